"""Checkpoint read throughput behind a per-connection-limited server: one
plain stream, then the striped reader with 4, 8, 16 and 32 streams, through
the library and through the FUSE mount, side by side in one run.

The server is a real nginx on 127.0.0.1 with `limit_rate` per connection (the
analogue of one HDFS datanode stream or one S3 connection). The limit for N
streams is min(N x per-connection rate, link rate), the link rate being what
parallel range reads with no per-connection limit reach on this host (a
2-core VM's loopback: the machine's ceiling, measured in the same run, with
the same receive path as the library). Run: `make bench-checkpoint`
(`--size 512M` for a quicker run).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import report
from hdfs_fuse import mountinfo
from hdfs_fuse.reader import Client
from hdfs_fuse.settings import HdfsFuseConfig, parse_size
from tests.harness.nginx import Nginx, remove, start_nginx
from tests.harness.procs import start_daemon

NAME = "checkpoint"
STREAMS = (4, 8, 16, 32)
STRIPE = 8 * 1024 * 1024
# Both readers read the file front to back in 4 MiB reads into one buffer,
# as a checkpoint loader does (unbuffered read(2) on the mount).
CHUNK = 4 * 1024 * 1024
LINK_PROBE_STREAMS = 16
TARGET_LIBRARY = 0.9
TARGET_FUSE_VS_LIBRARY = 0.75
REPO = Path(__file__).resolve().parents[1]


def _make_checkpoint(path: Path, size: int) -> None:
    """Float32 weights: what a checkpoint shard holds, incompressible like one."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 * 1024 * 1024)
            f.write(rng.standard_normal(n // 4 + 1, dtype=np.float32).tobytes()[:n])
            left -= n


def _one_stream(url: str) -> int:
    got = 0
    with httpx.stream("GET", url, timeout=60) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            got += len(chunk)
    return got


def _parallel_ranges(url: str, size: int, streams: int) -> int:
    """Plain range reads from threads, one slice each: the link-rate probe.
    Received as the library receives stripes (`readinto`, no per-chunk
    Python work), so the probe measures the host rather than an HTTP
    client's CPU cost."""
    part = -(-size // streams)
    totals = [0] * streams
    target = httpx.URL(url)

    def run(i: int) -> None:
        start, end = i * part, min(size, (i + 1) * part) - 1
        conn = http.client.HTTPConnection(target.host, target.port, timeout=60)
        try:
            conn.request("GET", target.raw_path.decode(), headers={"Range": f"bytes={start}-{end}"})
            response = conn.getresponse()
            buffer = memoryview(bytearray(STRIPE))
            while n := response.readinto(buffer):
                totals[i] += n
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(totals)


def _config(streams: int) -> HdfsFuseConfig:
    return HdfsFuseConfig(
        stripe_size=STRIPE,
        streams=streams,
        readahead=2 * streams * STRIPE,
        memory=3 * streams * STRIPE,
        io_timeout=60.0,
        stripe_timeout=30.0,
    )


def _library(url: str, streams: int) -> int:
    buffer = memoryview(bytearray(CHUNK))
    got = 0
    with Client(_config(streams)) as client, client.open(url) as f:
        while n := f.readinto(buffer):
            got += n
    return got


def _fuse(base_url: str, name: str, streams: int, workdir: Path) -> tuple[int, float]:
    """Bytes read through a fresh mount, and the seconds the read took
    (mounting and unmounting are not part of a checkpoint read)."""
    mountpoint = workdir / f"mnt-{streams}"
    mountpoint.mkdir()
    cfg = _config(streams)
    argv = [
        sys.executable,
        "-m",
        "bootseer.cli",
        "hdfs-fuse",
        "mount",
        "--foreground",
        "--log-format",
        "json",
        "--stripe-size",
        str(cfg.stripe_size),
        "--streams",
        str(streams),
        "--readahead",
        str(cfg.readahead),
        "--memory",
        str(cfg.memory),
        "--io-timeout",
        "60",
        "--stripe-timeout",
        "30",
        base_url + "/",
        str(mountpoint),
    ]
    daemon = start_daemon(
        "hdfs-fuse",
        argv,
        workdir / f"mnt-{streams}.log",
        ready=lambda: mountinfo.current(mountpoint) is not None,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        buffer = bytearray(CHUNK)
        got = 0
        start = time.perf_counter()
        with open(mountpoint / name, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                got += n
        return got, time.perf_counter() - start
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False)
        daemon.stop()


def _timed(what: str, size: int, fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    got = fn(*args)
    seconds = time.perf_counter() - start
    if isinstance(got, tuple):
        got, seconds = got
    if got != size:
        raise RuntimeError(f"{what}: read {got} bytes, expected {size}")
    rate = size / seconds / 1e6
    print(f"  {what:<24} {seconds:7.2f} s  {rate:8.1f} MB/s", flush=True)
    return rate


def run(size: int, rate: str) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bs-bench-ckpt-", dir="/tmp"))
    servers: list[Nginx] = []
    try:
        data = workdir / "data"
        data.mkdir()
        print(f"writing a {size / 1e9:.2f} GB checkpoint-like file", flush=True)
        _make_checkpoint(data / "model.bin", size)
        limited = start_nginx(data, limit_rate=rate, workers=2, access_log=False)
        servers.append(limited)
        unlimited = start_nginx(data, limit_rate="0", workers=2, access_log=False)
        servers.append(unlimited)
        url = f"{limited.url}/model.bin"

        link = _timed(
            f"link ({LINK_PROBE_STREAMS} ranges, no limit)",
            size,
            _parallel_ranges,
            f"{unlimited.url}/model.bin",
            size,
            LINK_PROBE_STREAMS,
        )
        one = _timed("one stream", size, _one_stream, url)
        rows = []
        for streams in STREAMS:
            lib = _timed(f"library, {streams} streams", size, _library, url, streams)
            fuse = _timed(f"fuse, {streams} streams", size, _fuse, limited.url, "model.bin", streams, workdir)
            limit = min(streams * one, link)
            rows.append(
                {
                    "streams": streams,
                    "library_mb_s": round(lib, 1),
                    "fuse_mb_s": round(fuse, 1),
                    "limit_mb_s": round(limit, 1),
                    "library_vs_limit": round(lib / limit, 3),
                    "fuse_vs_limit": round(fuse / limit, 3),
                    "fuse_vs_library": round(fuse / lib, 3),
                    "library_vs_one_stream": round(lib / one, 2),
                }
            )
        return {
            "size_bytes": size,
            "limit_rate": rate,
            "stripe_size": STRIPE,
            "reader": (
                f"sequential {CHUNK >> 20} MiB reads into one buffer (read(2) on the mount, readinto on the library)"
            ),
            "one_stream_mb_s": round(one, 1),
            "link_mb_s": round(link, 1),
            "targets": {"library_vs_limit": TARGET_LIBRARY, "fuse_vs_library": TARGET_FUSE_VS_LIBRARY},
            "runs": rows,
        }
    finally:
        for server in servers:
            remove(server)
        shutil.rmtree(workdir, ignore_errors=True)


def _plot(results: dict[str, Any]) -> Path:
    rows = results["runs"]
    streams = [r["streams"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(streams, [r["limit_mb_s"] for r in rows], "k--", label="limit min(N x stream, link)")
    ax.plot(streams, [r["library_mb_s"] for r in rows], "o-", label="library")
    ax.plot(streams, [r["fuse_mb_s"] for r in rows], "s-", label="FUSE mount")
    ax.axhline(results["one_stream_mb_s"], color="grey", linewidth=1, label="one stream")
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(s) for s in streams])
    ax.set_xlabel("parallel streams")
    ax.set_ylabel("MB/s")
    ax.set_title(f"checkpoint read, nginx limit_rate {results['limit_rate']} per connection")
    ax.legend()
    fig.tight_layout()
    path = report.RESULTS / f"{NAME}.png"
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("2G"), help="file size (default 2G)")
    parser.add_argument("--rate", default="25m", help="nginx limit_rate per connection (default 25m)")
    args = parser.parse_args()
    results = run(args.size, args.rate)
    path = report.write(NAME, results)
    plot = _plot(results)
    print(f"\none stream {results['one_stream_mb_s']} MB/s, link {results['link_mb_s']} MB/s")
    print(f"{'streams':>7} {'library':>9} {'fuse':>9} {'limit':>9} {'lib/limit':>9} {'fuse/lib':>9}")
    for r in results["runs"]:
        print(
            f"{r['streams']:>7} {r['library_mb_s']:>9} {r['fuse_mb_s']:>9} {r['limit_mb_s']:>9} "
            f"{r['library_vs_limit']:>9} {r['fuse_vs_library']:>9}"
        )
    print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
