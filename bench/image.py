"""The benchmark's training image, built from what this machine has.

Layers, bottom first, as a Dockerfile for a training job would make them:

1. base: busybox, /etc, and the shared libraries Python, torch and numpy
   load (their `ldd` closure, from this Debian host);
2. python: Debian's python3.11 interpreter and standard library;
3. packages: `pip install torch==2.13.0 numpy` (the CPU wheel from
   /opt/wheels, numpy and torch's dependencies from the package index);
4. tail: files a training start never reads (corpora shards, extra native
   libraries) - every real image carries such a tail;
5. weights: a model config and safetensors shards of float16 weights;
6. app: the training-start script (bench/trainstart.py).

Building takes a few minutes (pip, gzip); the layout is cached under
CACHE_DIR keyed by the recipe, so later runs reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import ocidir
from tests.harness.oci import BUSYBOX, BUSYBOX_APPLETS, ImageLayout

CACHE_DIR = Path("/var/tmp/bootseer-bench")
TRAINSTART = Path(__file__).with_name("trainstart.py")
HOST_PYTHON = Path("/usr/bin/python3.11")
HOST_STDLIB = Path("/usr/lib/python3.11")
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
PACKAGES = ("torch==2.13.0", "numpy")
WHEELS = "/opt/wheels"
CMD = ("/usr/bin/python3", "/app/train.py")
ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "OMP_NUM_THREADS=2")
# Bump when the recipe changes in a way the spec fields do not show.
RECIPE_VERSION = 1
MIB = 1 << 20


@dataclass(frozen=True)
class ImageSpec:
    name: str
    shards: int  # weight shards; the start loads the first
    shard_mib: int
    tail_text_files: int  # small text files, ~16 KiB each
    tail_libs: int  # large native-library-like blobs
    tail_lib_mib: int


FULL = ImageSpec(
    "train-full",
    shards=4,
    shard_mib=96,
    tail_text_files=6000,
    tail_libs=4,
    tail_lib_mib=64,
)
QUICK = ImageSpec(
    "train-quick",
    shards=2,
    shard_mib=24,
    tail_text_files=0,
    tail_libs=0,
    tail_lib_mib=0,
)


@dataclass(frozen=True)
class BuiltImage:
    spec: ImageSpec
    layout: ImageLayout
    layer_names: tuple[str, ...]
    uncompressed_bytes: int

    @property
    def compressed_bytes(self) -> int:
        return sum(self.layout.layer_sizes)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.spec.name,
            "uncompressed_bytes": self.uncompressed_bytes,
            "compressed_bytes": self.compressed_bytes,
            "layers": [
                {"name": n, "digest": d, "compressed_bytes": s}
                for n, d, s in zip(self.layer_names, self.layout.layer_digests, self.layout.layer_sizes, strict=True)
            ],
            "spec": asdict(self.spec),
        }


def _recipe_key(spec: ImageSpec) -> str:
    h = hashlib.sha256(json.dumps([asdict(spec), RECIPE_VERSION, PACKAGES]).encode())
    h.update(TRAINSTART.read_bytes())
    return h.hexdigest()[:12]


def _copy_into(root: Path, src: Path, dest: str | None = None) -> None:
    """Copy host file `src` to `root`/`dest` (default: its own path), following symlinks."""
    target = root / (dest or str(src)).lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src.resolve(), target)


def _merged_usr(path: str) -> str:
    # Debian 12 has /lib -> usr/lib; the image does too, so files live under usr/.
    for prefix in ("/lib/", "/lib64/"):
        if path.startswith(prefix):
            return "/usr" + path
    return path


def _shared_libraries(binaries: list[Path]) -> set[str]:
    libs: set[str] = set()
    for chunk in range(0, len(binaries), 64):
        out = subprocess.run(
            ["ldd", *map(str, binaries[chunk : chunk + 64])],
            capture_output=True,
            text=True,
            check=False,  # ldd fails on files that are not dynamic objects; their lines are skipped
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts else ""
            # ldd heads each file's list with "FILE:"; libraries are absolute paths.
            if path.startswith("/") and not path.endswith(":") and not path.startswith(str(CACHE_DIR)):
                libs.add(path)
    return libs


def _stage_base(root: Path, packages: Path) -> None:
    for d in (
        "usr/bin",
        "usr/lib",
        "usr/lib64",
        "usr/sbin",
        "tmp",
        "proc",
        "sys",
        "dev",
        "etc",
        "root",
        "app",
    ):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    for link in ("bin", "lib", "lib64", "sbin"):
        (root / link).symlink_to(f"usr/{link}")
    _copy_into(root, BUSYBOX, "/usr/bin/busybox")
    for applet in BUSYBOX_APPLETS:
        (root / "usr/bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    binaries = [
        HOST_PYTHON,
        *sorted((HOST_STDLIB / "lib-dynload").glob("*.so")),
        *sorted(packages.rglob("*.so*")),
    ]
    for lib in sorted(_shared_libraries(binaries)):
        _copy_into(root, Path(lib), _merged_usr(lib))
    shutil.copytree("/usr/share/zoneinfo", root / "usr/share/zoneinfo", symlinks=True)


def _stage_python(root: Path) -> None:
    _copy_into(root, HOST_PYTHON)
    (root / "usr/bin/python3").symlink_to("python3.11")
    shutil.copytree(HOST_STDLIB, root / HOST_STDLIB.relative_to("/"), symlinks=True)
    (root / HOST_STDLIB.relative_to("/") / "EXTERNALLY-MANAGED").unlink(missing_ok=True)
    shutil.copytree("/etc/python3.11", root / "etc/python3.11")


def _stage_packages(root: Path) -> None:
    target = root / SITE_PACKAGES
    env = {**os.environ, "PIP_FIND_LINKS": WHEELS, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # pip compiles .pyc files, as `RUN pip install` in a Dockerfile does.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--target",
        str(target),
        *PACKAGES,
    ]
    subprocess.run(cmd, check=True, env=env)


def _stage_tail(root: Path, spec: ImageSpec) -> None:
    rng = random.Random(11)
    words = [f"{rng.getrandbits(40):x}" for _ in range(4096)]
    text_dir = root / "opt/corpus"
    for i in range(spec.tail_text_files):
        path = text_dir / f"{i // 500:03d}" / f"doc-{i:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(rng.choices(words, k=1800)))
    lib_dir = root / "opt/vendor/lib"
    lib_dir.mkdir(parents=True, exist_ok=True)
    for i in range(spec.tail_libs):
        # Half noise, half runs of repeated pages: compresses like machine code.
        with open(lib_dir / f"libvendor{i}.so", "wb") as f:
            for _ in range(spec.tail_lib_mib * 16):
                page = rng.randbytes(4096)
                f.write(rng.randbytes(32 * 1024) + page * 8)


def _stage_weights(root: Path, spec: ImageSpec) -> None:
    model_dir = root / "models/demo"
    model_dir.mkdir(parents=True)
    shards = [f"model-{i + 1:05d}-of-{spec.shards:05d}.safetensors" for i in range(spec.shards)]
    hidden = 1024
    config = {
        "hidden_size": hidden,
        "num_heads": 16,
        "intermediate_size": 4 * hidden,
        "num_layers": 4,
        "shards": shards,
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(5)
    rows = spec.shard_mib * MIB // (hidden * 2)
    per_tensor = 256
    for name in shards:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        chunks, offset = [], 0
        for t in range(0, rows, per_tensor):
            n = min(per_tensor, rows - t)
            data = (rng.standard_normal((n, hidden), dtype=np.float32) * 0.02).astype(np.float16).tobytes()
            header[f"layers.{t // per_tensor}.weight"] = {
                "dtype": "F16",
                "shape": [n, hidden],
                "data_offsets": [offset, offset + len(data)],
            }
            chunks.append(data)
            offset += len(data)
        blob = json.dumps(header).encode()
        with open(model_dir / name, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for data in chunks:
                f.write(data)


def _stage_app(root: Path) -> None:
    _copy_into(root, TRAINSTART, "/app/train.py")


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def build(spec: ImageSpec, log: Callable[[str], None] = print) -> BuiltImage:
    """The image's OCI layout, built now or taken from the cache."""
    home = CACHE_DIR / f"{spec.name}-{_recipe_key(spec)}"
    layout_dir, stage = home / "layout", home / "stage"
    meta_path = home / "image.json"
    names = ["base", "python", "packages", "tail", "weights", "app"]
    if not (spec.tail_text_files or spec.tail_libs):
        names.remove("tail")
    if not meta_path.exists():
        shutil.rmtree(home, ignore_errors=True)
        dirs = {n: stage / f"{i}-{n}" for i, n in enumerate(names)}
        for d in dirs.values():
            d.mkdir(parents=True)
        log(f"building image {spec.name} in {home} (pip install, weights, gzip: a few minutes)")
        _stage_packages(dirs["packages"])
        _stage_base(dirs["base"], dirs["packages"] / SITE_PACKAGES)
        _stage_python(dirs["python"])
        if "tail" in dirs:
            _stage_tail(dirs["tail"], spec)
        _stage_weights(dirs["weights"], spec)
        _stage_app(dirs["app"])
        size = sum(_tree_bytes(d) for d in dirs.values())
        ocidir.write_layout(layout_dir, list(dirs.values()), CMD, ENV, tag="v1")
        meta_path.write_text(json.dumps({"uncompressed_bytes": size, "layer_names": names}))
        shutil.rmtree(stage)
    meta = json.loads(meta_path.read_text())
    layout = ocidir.read_layout(layout_dir)
    return BuiltImage(spec, layout, tuple(meta["layer_names"]), meta["uncompressed_bytes"])
