"""The read stall a running reader sees across a restart of the server of
its FUSE mount, for `kill -9` and for a graceful restart (SIGTERM, then a
new process), with failed reads counted: for the real layer server (`layer`)
and for the fusewire engine alone (`toy`).

`layer`: a node (layer server, snapshotter, containerd, registry) lazily
serves an image with a 100 MB file; a reader process hashes the file
through the layer mount in 1 MiB reads, in a loop, its page cache dropped
before each round, so its reads reach the server; the descriptor holder
keeps the connection. `toy`: tests/fusewire/toyfs.py serves a 100 MB
direct-I/O file through the same engine. Each round kills or stops the
server at a random moment of a pass and starts the next one at once, as
systemd's Restart= would. The stall of a round is the slowest single read
of the passes that overlap the restart.

Run: `.venv/bin/python -m bench.failover [--rounds 5] [--server layer|toy|both]` (root).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench import report
from bench.report import log
from tests.fusewire.harness import Failover, Reader, make_big

NAME = "failover"
TIMEOUT = 120.0


def _round(fo: Failover, reader_passes: int, mode: str, rng: random.Random) -> tuple[float, float]:
    """One restart; (event time, restart done time)."""
    server = fo.servers[-1]
    reader = fo.readers[-1]
    reader.wait_passes(1, after=time.monotonic(), timeout=TIMEOUT)
    time.sleep(rng.uniform(0.0, 0.1))
    event = time.monotonic()
    if mode == "kill9":
        server.kill9()
    else:
        assert server.terminate(timeout=TIMEOUT) == 0
    successor = fo.start_server()
    successor.wait_ready(timeout=TIMEOUT)
    done = time.monotonic()
    reader.wait_passes(reader_passes, after=done, timeout=TIMEOUT)
    return event, done


def run(rounds: int) -> dict[str, object]:
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="bs-failover-", dir="/var/tmp") as tmp:
        workdir = Path(tmp)
        big = workdir / "big.bin"
        sha = make_big(big)
        fo = Failover(workdir, big)
        results: dict[str, object] = {}
        try:
            fo.start_holder()
            fo.start_server().wait_ready(timeout=TIMEOUT)
            reader = fo.start_reader(sha)
            for mode in ("kill9", "graceful"):
                windows = []
                for i in range(rounds):
                    event, done = _round(fo, 1, mode, rng)
                    windows.append((event, done))
                    log(f"{mode} round {i + 1}: server back after {(done - event) * 1000:.0f} ms")
                results[mode] = _stalls(reader, windows)
            results.update(_stop_reader(reader))
            fo.servers[-1].terminate(timeout=TIMEOUT)
            # Only servers that stopped gracefully wrote their counts.
            results["resent_requests"] = sum(
                int(str(s.stats().get("resent", 0))) for s in fo.servers if s.stats_path.exists()
            )
        finally:
            leaks = fo.teardown()
            if leaks:
                log(f"leaked: {leaks}")
    return results


def _stalls(reader: Reader, windows: list[tuple[float, float]]) -> dict[str, object]:
    passes = reader.passes()
    stalls = []
    for event, done in windows:
        overlapping = [p for p in passes if float(str(p["began"])) <= done and float(str(p["ended"])) >= event]
        stalls.append(max(float(str(p["slowest_read_s"])) for p in overlapping))
    return {
        "stall_p50_ms": round(statistics.median(stalls) * 1000, 1),
        "stall_max_ms": round(max(stalls) * 1000, 1),
        "stalls_ms": [round(s * 1000, 1) for s in stalls],
        "restart_ms": [round((d - e) * 1000, 1) for e, d in windows],
    }


def _stop_reader(reader: Reader) -> dict[str, int]:
    """Stop the reader; how many passes it made, failed and read wrong bytes."""
    reader.stop(timeout=TIMEOUT)
    passes = reader.passes()
    return {
        "passes": len(passes),
        "failed_passes": sum(1 for p in passes if not p["ok"]),
        "wrong_bytes": sum(1 for p in passes if p["wrong_bytes"]),
    }


def run_layer_server(rounds: int) -> dict[str, object]:
    import hashlib
    import subprocess
    import sys

    from tests.harness.lazynode import start_lazy_node, stop_lazy_node
    from tests.harness.oci import File, ImageBuilder, busybox_layer
    from tests.harness.registry import start_registry
    from tests.harness.tree import drop_page_cache

    rng = random.Random(2)
    data = random.Random(3).randbytes(100 << 20)
    sha = hashlib.sha256(data).hexdigest()
    registry = start_registry()
    node = start_lazy_node(registry.host)
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bs-failover-", dir="/var/tmp") as tmp:
        workdir = Path(tmp)
        try:
            image = ImageBuilder(registry.host, workdir).push("failover/bench", [busybox_layer(), [File("/big", data)]])
            node.index(image.ref)
            node.pull(image.ref)
            big = node.layers.config.mountpoint / image.layout.layer_digests[-1].split(":")[1] / "big"
            out, stop = workdir / "reader.jsonl", workdir / "reader.stop"
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.fusewire.reader", str(big), sha, str(out), str(stop)],
                start_new_session=True,
            )
            reader = Reader(proc, out, stop)
            for mode in ("kill9", "graceful"):
                windows = []
                for i in range(rounds):
                    reader.wait_passes(1, after=time.monotonic(), timeout=TIMEOUT)
                    drop_page_cache()
                    time.sleep(rng.uniform(0.0, 0.2))
                    event = time.monotonic()
                    if mode == "kill9":
                        node.layers.kill9()
                    else:
                        node.layers.stop()
                    node.layers.start()
                    done = time.monotonic()
                    reader.wait_passes(1, after=done, timeout=TIMEOUT)
                    windows.append((event, done))
                    log(f"layer server {mode} round {i + 1}: back after {(done - event) * 1000:.0f} ms")
                results[mode] = _stalls(reader, windows)
            results.update(_stop_reader(reader))
        finally:
            stop_lazy_node(node)
            registry.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server", choices=("layer", "toy", "both"), default="both")
    args = parser.parse_args()
    results: dict[str, object] = {"rounds": args.rounds}
    if args.server in ("layer", "both"):
        results["layer_server"] = run_layer_server(args.rounds)
    if args.server in ("toy", "both"):
        results["toy"] = run(args.rounds)
    path = report.write(NAME, results)
    for server in ("layer_server", "toy"):
        found = results.get(server)
        if not isinstance(found, dict):
            continue
        for mode in ("kill9", "graceful"):
            r = found[mode]
            log(f"{server} {mode}: stall p50 {r['stall_p50_ms']} ms, max {r['stall_max_ms']} ms")
        log(f"{server}: failed passes {found['failed_passes']}, wrong bytes {found['wrong_bytes']}")
    log(f"results in {path}")


if __name__ == "__main__":
    main()
