"""The benchmark's FUSE wait (bench/fusewait.py) over a real layer mount: the
kernel's request tracepoints, read from a trace instance of its own, give
every request a reader sends, paired with its answer and timed on the clock
the benchmark keeps; the instance is gone afterwards."""

from __future__ import annotations

import os
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.fusewait import FuseTrace, parse, summarise
from snapshotter.fs.layers import LayerStore
from tests.fs.conftest import Blob, Mounted, add_layer, make_layer


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
    return info, data


def test_every_request_of_a_reader_is_in_the_trace_timed_on_the_monotonic_clock(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    if not FuseTrace.available():
        pytest.skip("this kernel has no FUSE request tracepoints")
    store = LayerStore(tmp_path / "store")
    blob = make_layer([_file("app/hello.txt", b"hello\n" * 1000)])
    digest = add_layer(store, tmp_path, blob, 64 << 10)
    m = mount_layers({digest: Blob(blob)}, store_dir=tmp_path / "store")
    layer = m.layer(digest)
    # The requests come from this thread, and only its are counted: the
    # trace sees every FUSE mount on the machine.
    me = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    trace = FuseTrace(f"bootseer-test-{os.getpid()}")
    began = time.monotonic()
    trace.start()
    try:
        assert (layer / "app/hello.txt").read_bytes() == b"hello\n" * 1000
        for i in range(3):
            assert not (layer / "app" / f"missing-{i}").exists()
    finally:
        lines = trace.stop()
    ended = time.monotonic()

    assert not trace.dir.exists() and not trace.lost
    mine = [r for r in parse(lines) if r.task == me]
    opcodes = [r.opcode for r in mine]
    # The layer at the root, app, hello.txt and the three missing names.
    assert opcodes.count("LOOKUP") >= 6
    assert "READ" in opcodes
    assert all(began <= r.sent <= r.ended <= ended for r in mine)
    wait = summarise(mine)
    assert wait.requests == len(mine)
    assert 0 < wait.outstanding_s <= wait.latency_sum_s <= ended - began
