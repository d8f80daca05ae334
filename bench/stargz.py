"""The peer in the startup benchmark: stargz-snapshotter, with its defaults.

- Packages: Debian's `stargz-snapshotter` (ctr-remote: convert, optimize,
  rpull), the library sources (`golang-github-containerd-stargz-snapshotter-dev`,
  under /usr/share/gocode) and Go (`golang-go`), installed here if missing.
- The daemon: Debian does not ship `containerd-stargz-grpc`, so the benchmark
  builds its own from bench/stargz/main.go (a small main over the library's
  public `service` package) in GOPATH mode, offline; the one package Debian
  lacks, the CRI API's `AuthConfig`, comes from bench/stargz/cri-api-stub.
  The binary is cached under the benchmark's cache dir, keyed by its sources
  and the Go and library versions.
- The images: the benchmark image converted by `ctr-remote image convert
  --estargz --oci` and by `ctr-remote image optimize --oci` (which runs the
  image's own entry point, the training start, and puts what it reads first),
  cached as OCI layouts next to the benchmark image.
- A node: the daemon and a containerd with it as the `stargz` proxy plugin;
  `ctr-remote image rpull` pulls, `ctr run --snapshotter stargz` runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import image, ocidir
from tests.harness.containerd import CONTAINERD_BIN, CTR_BIN, PROXY_NAME, Containerd, config_toml, new_workdir
from tests.harness.oci import ImageLayout
from tests.harness.procs import Daemon, start_daemon, unix_socket_answers
from tests.harness.tree import unmount_under

APT_PACKAGES = ("stargz-snapshotter", "golang-github-containerd-stargz-snapshotter-dev", "golang-go")
CTR_REMOTE = "ctr-remote"
GOCODE = Path("/usr/share/gocode")
SOURCES = Path(__file__).with_name("stargz")
MAIN_IMPORT_PATH = "bootseer.bench/containerd-stargz-grpc"
STUB_IMPORT_PATH = "k8s.io/cri-api/pkg/apis/runtime/v1alpha2"
BUILD_DIR = image.CACHE_DIR / "stargz"
SNAPSHOTTER = "stargz"
ESTARGZ_TAG = "esgz"
OPTIMIZED_TAG = "esgz-opt"
# optimize watches the sample container for this long at most; the training
# start exits once ready (seconds on a warm disk), which ends the watch sooner.
OPTIMIZE_PERIOD_S = 120
# Bump when the conversion changes in a way the key does not show.
CONVERT_VERSION = 1


def ensure_packages(log: Callable[[str], None]) -> None:
    """apt-get the peer's packages unless installed (as scripts/setup.sh does)."""
    missing = [
        p
        for p in APT_PACKAGES
        if "install ok installed"
        not in subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True, check=False
        ).stdout
    ]
    if not missing:
        return
    log(f"installing {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], check=True, env=env)


def _package_version(name: str) -> str:
    return subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, check=True
    ).stdout.strip()


def build_daemon(log: Callable[[str], None]) -> Path:
    """The daemon binary, built now or taken from the cache."""
    sources = sorted(SOURCES.rglob("*.go"))
    h = hashlib.sha256()
    for path in sources:
        h.update(path.relative_to(SOURCES).as_posix().encode() + b"\0" + path.read_bytes())
    for package in ("golang-go", "golang-github-containerd-stargz-snapshotter-dev"):
        h.update(_package_version(package).encode())
    binary = BUILD_DIR / f"containerd-stargz-grpc-{h.hexdigest()[:12]}"
    if binary.exists():
        return binary
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    log(f"building {binary.name} from bench/stargz (go build, GOPATH mode over {GOCODE})")
    gopath = Path(tempfile.mkdtemp(prefix="gopath-", dir=BUILD_DIR))
    try:
        main_dir = gopath / "src" / MAIN_IMPORT_PATH
        stub_dir = gopath / "src" / STUB_IMPORT_PATH
        main_dir.mkdir(parents=True)
        stub_dir.mkdir(parents=True)
        shutil.copy2(SOURCES / "main.go", main_dir)
        shutil.copy2(SOURCES / "cri-api-stub" / "auth.go", stub_dir)
        env = {
            **os.environ,
            "GO111MODULE": "off",
            "GOPATH": f"{gopath}:{GOCODE}",
            "GOCACHE": str(BUILD_DIR / "gocache"),
            "GOFLAGS": "",
            "GOPROXY": "off",  # offline: everything comes from Debian's packages
            "CGO_ENABLED": "0",
        }
        tmp = binary.with_suffix(".tmp")
        result = subprocess.run(
            ["go", "build", "-o", str(tmp), "."], cwd=main_dir, env=env, capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"building the stargz daemon failed:\n{result.stdout}\n{result.stderr}")
        tmp.rename(binary)
    finally:
        shutil.rmtree(gopath, ignore_errors=True)
    return binary


def _ctr_remote(c: Containerd, *args: str, timeout: float = 1800) -> str:
    argv = [CTR_REMOTE, "--address", str(c.address), "--namespace", c.namespace, *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def convert(
    built: image.BuiltImage,
    c: Containerd,
    source_ref: str,
    registry_host: str,
    repository: str,
    log: Callable[[str], None],
) -> dict[str, ImageLayout]:
    """The eStargz and optimised eStargz images, by tag: converted now, from
    `source_ref` (unpacked into overlayfs in `c`, pushed to `registry_host`
    and copied into the cache), or taken from the cache."""
    key = hashlib.sha256(
        f"{built.layout.layer_digests}{_package_version('stargz-snapshotter')}{OPTIMIZE_PERIOD_S}{CONVERT_VERSION}".encode()
    ).hexdigest()[:12]
    home = built.layout.directory.parent / f"estargz-{key}"
    layouts = {tag: home / tag for tag in (ESTARGZ_TAG, OPTIMIZED_TAG)}
    if not all((d / "index.json").exists() for d in layouts.values()):
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        for tag, d in layouts.items():
            target = f"{registry_host}/{repository}:{tag}"
            if tag == ESTARGZ_TAG:
                log(f"ctr-remote image convert --estargz --oci -> {target}")
                _ctr_remote(c, "image", "convert", "--estargz", "--oci", source_ref, target)
            else:
                log(f"ctr-remote image optimize --oci (runs the training start) -> {target}")
                _ctr_remote(c, "image", "optimize", "--oci", "--period", str(OPTIMIZE_PERIOD_S), source_ref, target)
            _ctr_remote(c, "image", "push", "--plain-http", target)
            tmp = d.with_suffix(".tmp")
            subprocess.run(
                [
                    "skopeo",
                    "copy",
                    "--quiet",
                    "--preserve-digests",
                    "--src-tls-verify=false",
                    f"docker://{target}",
                    f"oci:{tmp}:{tag}",
                ],
                check=True,
                capture_output=True,
            )
            tmp.rename(d)
    return {tag: ocidir.read_layout(d) for tag, d in layouts.items()}


@dataclass
class StargzNode:
    """stargz's daemon and a containerd using it as the `stargz` proxy snapshotter."""

    daemon: Daemon
    root: Path
    containerd: Containerd

    def rpull_command(self, ref: str) -> list[str]:
        c = self.containerd
        return [
            CTR_REMOTE,
            "--address",
            str(c.address),
            "--namespace",
            c.namespace,
            "image",
            "rpull",
            "--plain-http",
            "--snapshotter",
            SNAPSHOTTER,
            ref,
        ]

    def teardown(self) -> list[str]:
        """containerd first (its containers use the daemon's mounts), then the
        daemon, by PID, then whatever FUSE mounts it left."""
        leftovers = self.containerd.stop()
        self.daemon.stop()
        self.daemon.kill_group()
        leftovers += unmount_under(self.root)
        if not leftovers:
            shutil.rmtree(self.root, ignore_errors=True)
        return leftovers


def _start_containerd(snapshotter_address: Path) -> Containerd:
    """The harness's containerd, with the proxy plugin named `stargz`
    (rpull and ctr name the snapshotter; stargz's metadata does not care)."""
    workdir = new_workdir()
    root, state, address = workdir / "root", workdir / "state", workdir / "containerd.sock"
    text = config_toml(root, state, address, snapshotter_address)
    text = text.replace(f"[proxy_plugins.{PROXY_NAME}]", f"[proxy_plugins.{SNAPSHOTTER}]")
    (workdir / "config.toml").write_text(text)

    def ready() -> bool:
        if not unix_socket_answers(address):
            return False
        version = subprocess.run([CTR_BIN, "--address", str(address), "version"], capture_output=True, check=False)
        return version.returncode == 0

    try:
        daemon = start_daemon(
            "containerd (stargz)", [CONTAINERD_BIN, "--config", str(workdir / "config.toml")], workdir / "log", ready
        )
    except BaseException:
        if not unmount_under(workdir):
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Containerd(daemon=daemon, workdir=workdir)


def start_node(binary: Path) -> StargzNode:
    # Short paths: the socket must fit a sockaddr_un, the overlay options a page.
    root = Path(tempfile.mkdtemp(prefix="bs-sgz-", dir="/tmp"))
    socket = root / "grpc.sock"
    daemon = start_daemon(
        "containerd-stargz-grpc",
        [str(binary), "--root", str(root / "state"), "--address", str(socket), "--log-level", "info"],
        root / "stargz.log",
        ready=lambda: unix_socket_answers(socket),
    )
    try:
        containerd = _start_containerd(socket)
    except BaseException:
        daemon.stop()
        unmount_under(root)
        raise
    node = StargzNode(daemon, root, containerd)
    try:
        containerd.wait_snapshotter(SNAPSHOTTER)
    except BaseException:
        node.teardown()
        raise
    return node
