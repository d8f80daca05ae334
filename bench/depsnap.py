"""depsnap against pip and uv on a heavy, realistic environment.

Each run is a fresh node: empty pip/uv caches, an empty depsnap node cache
and an empty store. Measured side by side in one run:

- `pip install -r` into a new venv;
- `uv pip install -r` into a new venv (cold cache);
- `depsnap ensure`, miss: uv install + capture + publish;
- `depsnap ensure`, hit on a fresh node: the snapshot comes from the store,
  an nginx on 127.0.0.1 whose per-connection rate is the bandwidth measured
  to the package index. By default a large image is read lazily (mounted
  through depsnap's FUSE server); `hit_whole` is the same hit with the whole
  image fetched and unpacked before mounting (`--lazy-min-bytes -1`);
- `depsnap ensure`, hit on the same node again (a restart): node cache.

A lazy hit returns before the bytes are there, so every environment is also
timed to a working import (`IMPORTS` run in it right after): pip + import,
uv + import, hit + import. The limit for a mounted image is the mount
(measured: the node-cache hit, CLI and key included) plus the bytes the
first imports read, as they cross the link (compressed), over the bandwidth;
those bytes are measured with fincore on a cold mount of the cached image.

Run: `make bench-depsnap` (or `.venv/bin/python -m bench.depsnap --help`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench import report
from tests.harness.nginx import remove, start_nginx

VENV_BIN = Path(sys.executable).parent
BOOTSEER = VENV_BIN / "bootseer"
UV = VENV_BIN / "uv"
PYTHON = Path(os.path.realpath(sys.executable))
ROOT = Path("/tmp/depsnap-bench")

# torch's CPU wheel lies on local disk (/opt/wheels); the rest come from the index.
HEAVY = """\
--find-links /opt/wheels
torch==2.13.0
numpy
pandas
scipy
scikit-learn
matplotlib
pillow
sympy
requests
pyyaml
tqdm
jinja2
protobuf
psutil
regex
safetensors
# Built from its sdist, C extension and all, as real environments have some.
--no-binary simplejson
simplejson
"""
SMALL = """\
numpy
pandas
requests
pyyaml
--no-binary simplejson
simplejson
"""
# The first imports of a training job, timed in every environment.
IMPORTS = {"heavy": "import torch, numpy, pandas", "small": "import numpy, pandas"}
# A ~12 MB wheel from the index, to measure the bandwidth the installers get.
PROBE_PACKAGE = "pandas"


def index_bandwidth() -> float:
    """Bytes/s of a wheel download from the index (median of three)."""
    with httpx.Client(timeout=60.0, follow_redirects=True) as client:
        listing = f"https://pypi.org/pypi/{PROBE_PACKAGE}/json"
        files = client.get(listing).json()["urls"]
        wheel = next(f for f in files if "cp311-cp311-manylinux" in f["filename"] and "x86_64" in f["filename"])
        # The index may hand out relative links.
        url = httpx.URL(listing).join(wheel["url"])
        speeds = []
        for _ in range(3):
            started = time.perf_counter()
            size = len(client.get(url).content)
            speeds.append(size / (time.perf_counter() - started))
    return statistics.median(speeds)


@contextmanager
def shaped_store(store: Path, rate: int) -> Iterator[str]:
    """nginx serving `store` over HTTP on 127.0.0.1 at `rate` bytes/s per
    connection, taking PUT and DELETE (depsnap publishes there)."""
    server = start_nginx(store, limit_rate=rate, access_log=False, autoindex=False, writable=True, parent=ROOT)
    try:
        yield server.url
    finally:
        remove(server)


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    # Checked below, where the failure can carry the step's output.
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"`{' '.join(argv)}` failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return elapsed, result.stdout


def timed_steps(steps: list[list[str]], env: dict[str, str]) -> float:
    return sum(timed(argv, env)[0] for argv in steps)


def timed_import(env_dir: Path, imports: str, env: dict[str, str]) -> float:
    return timed([str(env_dir / "bin" / "python"), "-c", imports], env)[0]


def settle() -> None:
    """Flush what earlier steps wrote: a fresh node is not busy writing back
    another node's install (untimed)."""
    subprocess.run(["sync"], check=True)


def resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0])


def drop_file_cache(path: Path) -> None:
    """Evict one file's pages (this file only: others' caches stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_for_file(directory: Path, timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(directory.glob("*.erofs")) if directory.exists() else []
        if found:
            return found[0]
        time.sleep(0.1)
    raise SystemExit(f"nothing appeared in {directory} within {timeout} s")


def one_run(req: Path, imports: str, store_url: str, store_dir: Path, with_pip: bool) -> dict[str, float]:
    run = Path(tempfile.mkdtemp(prefix="run-", dir=ROOT))
    env = dict(os.environ)
    env["PIP_CACHE_DIR"] = str(run / "pip-cache")
    env["UV_CACHE_DIR"] = str(run / "uv-cache")
    env["UV_PYTHON_DOWNLOADS"] = "never"
    times: dict[str, float] = {}
    if with_pip:
        pip_env = run / "pip-env"
        times["pip"] = timed_steps(
            [
                [str(PYTHON), "-m", "venv", str(pip_env)],
                [str(pip_env / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(req)],
            ],
            env,
        )
        times["pip_import"] = timed_import(pip_env, imports, env)
        shutil.rmtree(pip_env)
    uv_env = run / "uv-env"
    times["uv"] = timed_steps(
        [
            [str(UV), "venv", "-q", "--python", str(PYTHON), str(uv_env)],
            [
                str(UV),
                "pip",
                "install",
                "-q",
                "--python",
                str(uv_env / "bin" / "python"),
                "-r",
                str(req),
            ],
        ],
        env,
    )
    times["uv_import"] = timed_import(uv_env, imports, env)
    shutil.rmtree(uv_env)
    shutil.rmtree(run / "uv-cache")
    env["UV_CACHE_DIR"] = str(run / "uv-cache-2")

    # The same target path every time: a venv's snapshot is valid only there.
    target = ROOT / "env"
    for leftover in store_dir.iterdir():
        leftover.unlink()

    def ensure(cache: Path, *extra: str) -> tuple[float, str]:
        return timed(
            [
                str(BOOTSEER),
                "depsnap",
                "ensure",
                "-r",
                str(req),
                "--target",
                str(target),
                "--python",
                str(PYTHON),
                "--installer",
                "uv",
                "--store",
                store_url,
                "--cache-dir",
                str(cache),
                "--no-daemon",
                "--log-level",
                "warning",
                *extra,
            ],
            env,
        )

    def release() -> None:
        timed([str(BOOTSEER), "depsnap", "release", "--target", str(target)], env)

    times["depsnap_miss"], out = ensure(run / "node-a")
    assert " miss " in out and store_url in out, out
    release()
    shutil.rmtree(run / "node-a")

    settle()
    times["depsnap_hit"], out = ensure(run / "node-b")
    assert " hit " in out and "from store" in out, out
    times["lazy"] = float("read lazily" in out)
    times["depsnap_hit_import"] = timed_import(target, imports, env)
    # A lazy restore fills the node cache behind the reads; the restart needs it.
    image = wait_for_file(run / "node-b" / "images", 300)
    release()

    times["depsnap_hit_node_cache"], out = ensure(run / "node-b")
    assert "from node cache" in out, out
    times["depsnap_hit_node_cache_import"] = timed_import(target, imports, env)
    release()

    # What the first imports read of the image: a cold mount, then fincore.
    drop_file_cache(image)
    ensure(run / "node-b")
    timed_import(target, imports, env)
    times["import_image_bytes"] = resident_bytes(image)
    release()

    settle()
    times["depsnap_hit_whole"], out = ensure(run / "node-c", "--lazy-min-bytes", "-1")
    assert " hit " in out and "from store" in out and "read lazily" not in out, out
    times["depsnap_hit_whole_import"] = timed_import(target, imports, env)
    release()

    snapshots = list(store_dir.glob("*.dsnap"))
    times["snapshot_bytes"] = snapshots[0].stat().st_size
    times["image_bytes"] = image.stat().st_size
    shutil.rmtree(run)
    return times


ENSURE_KEYS = (
    "pip",
    "uv",
    "depsnap_miss",
    "depsnap_hit",
    "depsnap_hit_whole",
    "depsnap_hit_node_cache",
)


def plot(medians: dict[str, float], limits: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k in ENSURE_KEYS if k in medians]
    ready = [medians[k] for k in labels]
    first_import = [medians.get(f"{k}_import", 0.0) for k in labels]
    names = [label.replace("depsnap_", "depsnap\n").replace("_", " ") for label in labels]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(names, ready, color="#4878a8", label="install / restore")
    bars = ax.bar(names, first_import, bottom=ready, color="#a8c4e0", label="+ first imports")
    ax.bar_label(
        bars,
        labels=[f"{r:.2f} s\n+{i:.2f} s" if i else f"{r:.2f} s" for r, i in zip(ready, first_import, strict=True)],
    )
    ax.axhline(
        limits["hit"],
        color="#c44",
        linestyle="--",
        label=f"limit: mount + import bytes / bandwidth {limits['hit']:.2f} s",
    )
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.1)
    ax.set_ylabel("seconds (median, log scale)")
    ax.set_title("depsnap: heavy ML environment, fresh node per run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="fresh-node runs (default 3)")
    parser.add_argument("--small", action="store_true", help="no torch: a quick smoke run")
    parser.add_argument("--skip-pip", action="store_true", help="leave out pip (its ~50 s per run)")
    parser.add_argument("--bandwidth", type=float, help="store link in MB/s (default: measured to the index)")
    args = parser.parse_args(argv)

    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    req = ROOT / "requirements.txt"
    req.write_text(SMALL if args.small else HEAVY)
    imports = IMPORTS["small" if args.small else "heavy"]
    bandwidth = args.bandwidth * 1e6 if args.bandwidth else index_bandwidth()
    print(f"store link shaped to {bandwidth / 1e6:.1f} MB/s (the index's bandwidth)", flush=True)
    store_dir = ROOT / "store"
    store_dir.mkdir()
    runs = []
    try:
        with shaped_store(store_dir, int(bandwidth)) as store_url:
            for n in range(args.runs):
                runs.append(one_run(req, imports, store_url, store_dir, not args.skip_pip))
                print(
                    f"run {n + 1}/{args.runs}: "
                    + ", ".join(
                        f"{k} {v:.2f} s" for k, v in runs[-1].items() if not k.endswith("bytes") and k != "lazy"
                    ),
                    flush=True,
                )
    finally:
        # Best effort: nothing may be held if the run failed early.
        subprocess.run(
            [str(BOOTSEER), "depsnap", "release", "--target", str(ROOT / "env")],
            capture_output=True,
            check=False,
        )
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    # Bytes on the link per image byte: the first imports' reads, as fetched.
    link_import_bytes = medians["import_image_bytes"] * medians["snapshot_bytes"] / medians["image_bytes"]
    limit_s = medians["depsnap_hit_node_cache"] + link_import_bytes / bandwidth
    limits = {
        "hit": limit_s,
        "ready": limit_s + medians["depsnap_hit_node_cache_import"],
        "whole_snapshot_over_link": medians["snapshot_bytes"] / bandwidth,
    }

    def ready(key: str) -> float:
        return medians[key] + medians[f"{key}_import"]

    ratios = {}
    for name in ("depsnap_hit", "depsnap_hit_whole"):
        short = name.removeprefix("depsnap_")
        ratios[f"{short}_vs_uv"] = medians[name] / medians["uv"]
        ratios[f"{short}_vs_limit"] = medians[name] / limit_s
        ratios[f"ready_{short}_vs_uv"] = ready(name) / ready("uv")
        ratios[f"ready_{short}_vs_limit"] = ready(name) / limits["ready"]
        if "pip" in medians:
            ratios[f"{short}_vs_pip"] = medians[name] / medians["pip"]
            ratios[f"ready_{short}_vs_pip"] = ready(name) / ready("pip")
    ratios["node_cache_hit_vs_uv"] = medians["depsnap_hit_node_cache"] / medians["uv"]
    ratios["miss_vs_uv"] = medians["depsnap_miss"] / medians["uv"]
    if "pip" in medians:
        ratios["node_cache_hit_vs_pip"] = medians["depsnap_hit_node_cache"] / medians["pip"]
    byte_keys = ("snapshot_bytes", "image_bytes", "import_image_bytes")
    results: dict[str, Any] = {
        "set": "small" if args.small else "heavy",
        "requirements": req.read_text(),
        "imports": imports,
        "bandwidth_bytes_per_s": bandwidth,
        "limit_s": limit_s,
        "limits_s": limits,
        "medians_s": {k: v for k, v in medians.items() if k not in byte_keys and k != "lazy"},
        "lazy": medians["lazy"] == 1.0,
        **{k: medians[k] for k in byte_keys},
        "ratios": ratios,
        "targets": {"hit_vs_pip": 0.05, "hit_vs_uv": 0.25, "hit_vs_limit": 1.25},
        "runs": runs,
    }
    path = report.write("depsnap", results)
    plot(results["medians_s"], limits, report.RESULTS / "depsnap.png")
    print(f"wrote {path} and {report.RESULTS / 'depsnap.png'}")
    for name, value in ratios.items():
        print(f"  {name}: {value:.3f}")
    shutil.rmtree(ROOT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
