"""The benchmark's images, built from what this machine has.

Layers, bottom first, as a Dockerfile for a training job would make them:

1. base: busybox, /etc, and the shared libraries Python and the packages
   load (their `ldd` closure, from this Debian host);
2. python: Debian's python3.11 interpreter and standard library;
3. packages: `pip install` of the image's requirements, from a wheelhouse
   `pip download` filled once (torch's CPU wheel from /opt/wheels, the rest
   from the package index), so a rebuild installs the same wheels offline;
4. tail: files a start never reads (corpora shards, extra native
   libraries) - every real image carries such a tail;
5. data: what the start loads its first piece of - safetensors shards of
   float16 weights (`weights`) or parquet shards of a table (`dataset`);
6. app: the start script, as /app/train.py.

Two kinds of image: `train-*` (torch and numpy, weights, bench/trainstart.py)
and `tabular` (pandas, pyarrow, scikit-learn, scipy, a parquet dataset,
bench/tabularstart.py), whose start imports many small modules and
extensions across many packages where torch's reads a few large libraries.

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
from tests.harness.oci import BUSYBOX, BUSYBOX_APPLETS, MTIME, ImageLayout

CACHE_DIR = Path("/var/tmp/bootseer-bench")
HOST_PYTHON = Path("/usr/bin/python3.11")
HOST_STDLIB = Path("/usr/lib/python3.11")
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
WHEELS = "/opt/wheels"
CMD = ("/usr/bin/python3", "/app/train.py")
ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "OMP_NUM_THREADS=2")
# Bump when the recipe changes in a way the spec fields do not show.
RECIPE_VERSION = 2
MIB = 1 << 20
TORCH = ("torch==2.13.0", "numpy")
# Pinned to what the index served when the image was added; numpy and the
# rest come as their dependencies.
TABULAR_PACKAGES = ("pandas==3.1.1", "pyarrow==26.0.1", "scikit-learn==1.9.1", "scipy==1.17.1")


@dataclass(frozen=True)
class ImageSpec:
    name: str
    requirements: tuple[str, ...]  # what the packages layer pip-installs
    start: str  # the start script, a file next to this one
    data: str  # the data layer: a key of DATA_LAYERS
    shards: int  # data shards; the start loads the first
    shard_mib: int
    tail_text_files: int  # small text files, ~16 KiB each
    tail_libs: int  # large native-library-like blobs
    tail_lib_mib: int


FULL = ImageSpec(
    "train-full",
    requirements=TORCH,
    start="trainstart.py",
    data="weights",
    shards=4,
    shard_mib=96,
    tail_text_files=6000,
    tail_libs=4,
    tail_lib_mib=64,
)
QUICK = ImageSpec(
    "train-quick",
    requirements=TORCH,
    start="trainstart.py",
    data="weights",
    shards=2,
    shard_mib=24,
    tail_text_files=0,
    tail_libs=0,
    tail_lib_mib=0,
)
TABULAR = ImageSpec(
    "tabular",
    requirements=TABULAR_PACKAGES,
    start="tabularstart.py",
    data="dataset",
    shards=4,
    shard_mib=64,
    tail_text_files=6000,
    tail_libs=2,
    tail_lib_mib=32,
)
IMAGES = {"full": FULL, "quick": QUICK, "tabular": TABULAR}


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


def _start_script(spec: ImageSpec) -> Path:
    return Path(__file__).with_name(spec.start)


def _recipe_key(spec: ImageSpec, wheels: list[str]) -> str:
    # The wheels' names carry the versions pip resolved the requirements to.
    h = hashlib.sha256(json.dumps([asdict(spec), RECIPE_VERSION, wheels]).encode())
    h.update(_start_script(spec).read_bytes())
    return h.hexdigest()[:12]


def _wheelhouse(requirements: tuple[str, ...], log: Callable[[str], None]) -> Path:
    """The requirements' wheels, with their dependencies', downloaded once:
    every build of an image installs these and nothing else."""
    home = CACHE_DIR / f"wheels-{hashlib.sha256(json.dumps(requirements).encode()).hexdigest()[:12]}"
    done = home / "complete"
    if not done.exists():
        log(f"downloading wheels for {' '.join(requirements)} to {home}")
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        env = {**os.environ, "PIP_FIND_LINKS": WHEELS, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(home)]
        subprocess.run([*cmd, *requirements], check=True, env=env)
        done.touch()
    return home


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


def _compile_bytecode(root: Path) -> None:
    """(Re)write the .pyc of every module under `root` against the mtime its
    source has in the image. The layer tar stamps every file with MTIME, so
    bytecode compiled against the build's own mtimes (pip's, Debian's) would
    be stale in the container and Python would compile every module it
    imports at every start; a Docker-built image's bytecode is valid."""
    for source in root.rglob("*.py"):
        os.utime(source, (MTIME, MTIME), follow_symlinks=False)
    # Paths in the bytecode as the container sees them. Files that are not
    # Python 3.11 (templates, test data) stay without bytecode, as pip leaves
    # them: compile_dir's result is not checked, only that it ran.
    script = (
        "import compileall, py_compile, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0, "
        "stripdir=sys.argv[1], prependdir='/', invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)"
    )
    subprocess.run([str(HOST_PYTHON), "-c", script, str(root)], check=True)


def _stage_python(root: Path) -> None:
    _copy_into(root, HOST_PYTHON)
    (root / "usr/bin/python3").symlink_to("python3.11")
    shutil.copytree(HOST_STDLIB, root / HOST_STDLIB.relative_to("/"), symlinks=True)
    (root / HOST_STDLIB.relative_to("/") / "EXTERNALLY-MANAGED").unlink(missing_ok=True)
    shutil.copytree("/etc/python3.11", root / "etc/python3.11")
    _compile_bytecode(root)


def _stage_packages(root: Path, spec: ImageSpec, wheels: Path) -> None:
    # The wheelhouse alone: no index, and no find-links from this machine's pip configuration.
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    # --no-compile: _compile_bytecode writes the .pyc files `RUN pip install`
    # in a Dockerfile would, valid for the image's mtimes.
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target", str(root / SITE_PACKAGES)]
    subprocess.run([*cmd, *spec.requirements], check=True, env=env)
    _compile_bytecode(root)


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


def _stage_dataset(root: Path, spec: ImageSpec) -> None:
    """Parquet shards of a table (numeric features, low-cardinality string
    columns, a binary label that depends on both) and the config naming them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data_dir = root / "datasets/demo"
    data_dir.mkdir(parents=True)
    shards = [f"part-{i:05d}-of-{spec.shards:05d}.parquet" for i in range(spec.shards)]
    numeric = [f"f{i:02d}" for i in range(48)]
    categorical = {"region": 12, "device": 6, "plan": 4, "channel": 9}
    config = {"shards": shards, "numeric": numeric, "categorical": list(categorical), "label": "label"}
    (data_dir / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(9)
    weights = rng.standard_normal(len(numeric)).astype(np.float32)
    # float32 features plus ~1 byte of codes per categorical column, per row.
    rows = spec.shard_mib * MIB // (4 * len(numeric) + len(categorical))
    for name in shards:
        features = rng.standard_normal((rows, len(numeric)), dtype=np.float32)
        codes = {col: rng.integers(0, n, rows) for col, n in categorical.items()}
        score = features @ weights + codes["plan"] - 1.5
        columns: dict[str, object] = {col: features[:, i] for i, col in enumerate(numeric)}
        for col, n in categorical.items():
            labels = pa.array([f"{col}-{k}" for k in range(n)])
            columns[col] = pa.DictionaryArray.from_arrays(pa.array(codes[col], pa.int8()), labels)
        columns["label"] = (score + rng.standard_normal(rows) > 0).astype(np.int8)
        # Dictionary pages for the string columns only: tried on random floats
        # they overflow and fall back, leaving the shard half as large again.
        pq.write_table(pa.table(columns), data_dir / name, use_dictionary=list(categorical))


DATA_LAYERS: dict[str, Callable[[Path, ImageSpec], None]] = {"weights": _stage_weights, "dataset": _stage_dataset}


def _stage_app(root: Path, spec: ImageSpec) -> None:
    _copy_into(root, _start_script(spec), "/app/train.py")


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def build(spec: ImageSpec, log: Callable[[str], None] = print) -> BuiltImage:
    """The image's OCI layout, built now or taken from the cache."""
    wheels = _wheelhouse(spec.requirements, log)
    home = CACHE_DIR / f"{spec.name}-{_recipe_key(spec, sorted(p.name for p in wheels.glob('*.whl')))}"
    layout_dir, stage = home / "layout", home / "stage"
    meta_path = home / "image.json"
    names = ["base", "python", "packages", "tail", spec.data, "app"]
    if not (spec.tail_text_files or spec.tail_libs):
        names.remove("tail")
    if not meta_path.exists():
        shutil.rmtree(home, ignore_errors=True)
        dirs = {n: stage / f"{i}-{n}" for i, n in enumerate(names)}
        for d in dirs.values():
            d.mkdir(parents=True)
        log(f"building image {spec.name} in {home} (pip install, {spec.data}, gzip: a few minutes)")
        _stage_packages(dirs["packages"], spec, wheels)
        _stage_base(dirs["base"], dirs["packages"] / SITE_PACKAGES)
        _stage_python(dirs["python"])
        if "tail" in dirs:
            _stage_tail(dirs["tail"], spec)
        DATA_LAYERS[spec.data](dirs[spec.data], spec)
        _stage_app(dirs["app"], spec)
        size = sum(_tree_bytes(d) for d in dirs.values())
        ocidir.write_layout(layout_dir, list(dirs.values()), CMD, ENV, tag="v1")
        meta_path.write_text(json.dumps({"uncompressed_bytes": size, "layer_names": names}))
        shutil.rmtree(stage)
    meta = json.loads(meta_path.read_text())
    layout = ocidir.read_layout(layout_dir)
    return BuiltImage(spec, layout, tuple(meta["layer_names"]), meta["uncompressed_bytes"])
