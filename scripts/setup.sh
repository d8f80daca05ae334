#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine, run as root: the system
# packages the tests and the demo drive for real, a virtualenv at .venv with
# bootseer installed in it, and the generated gRPC stubs.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  containerd runc        # the container runtime bootseer plugs into
  docker-registry        # a local OCI registry (distribution 2.8)
  skopeo umoci           # push test images built as OCI layouts
  busybox-static         # a static shell and coreutils for test images
  fuse3 libfuse3-dev pkg-config
  nginx                  # a range-serving HTTP server with per-connection rate limits
  erofs-utils squashfs-tools  # read-only filesystem images for dependency snapshots
  iproute2               # tc, to shape links in benchmarks
  python3 python3-venv python3-dev
  make gcc
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.bootseer-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev,bench]'
  touch "$stamp"
fi
make -s proto
