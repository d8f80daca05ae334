"""The event log itself: bounded by rotation, whole records under
concurrent writers, and a full disk that drops records without raising."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import eventlog
from snapshotter.snapshots import Snapshotter


@pytest.fixture(autouse=True)
def _off_after() -> Iterator[None]:
    yield
    eventlog.configure(None, "test")


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("bootseer_events_dropped_total", {"reason": reason}) or 0.0


def test_records_are_json_lines_with_the_common_fields(tmp_path: Path) -> None:
    eventlog.configure(tmp_path, "daemon")
    eventlog.emit("thing", start=1.0, end=2.0, name="x")
    (record,) = list(eventlog.read(tmp_path))
    assert record["kind"] == "thing" and record["daemon"] == "daemon" and record["pid"] == os.getpid()
    assert record["start"] == 1.0 and record["end"] == 2.0 and isinstance(record["ts"], float)


def test_unconfigured_emit_does_nothing(tmp_path: Path) -> None:
    eventlog.emit("thing")
    assert not eventlog.enabled()
    assert eventlog.files(tmp_path) == []


def test_the_log_stays_bounded_by_rotation(tmp_path: Path) -> None:
    max_bytes = 20_000
    eventlog.configure(tmp_path, "busy", max_bytes=max_bytes)
    for i in range(5_000):
        eventlog.emit("tick", n=i, pad="x" * 40)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["busy.jsonl", "busy.jsonl.1"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= max_bytes
    # The newest records are kept, in order, none broken.
    numbers = [r["n"] for r in eventlog.read(tmp_path)]
    assert numbers == sorted(numbers) and numbers[-1] == 4_999
    assert len(numbers) > 100


def _writer(directory: str, worker: int, count: int) -> None:
    eventlog.configure(Path(directory), "shared", max_bytes=200_000)
    for i in range(count):
        eventlog.emit("w", worker=worker, n=i, pad="y" * (50 + worker * 30))


def test_concurrent_writers_never_interleave_and_rotate_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 1500)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for path in eventlog.files(tmp_path):
        for line in path.read_bytes().splitlines():
            json.loads(line)  # every line whole
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 200_000 + 4 * 1024
    assert {p.name for p in tmp_path.iterdir()} == {"shared.jsonl", "shared.jsonl.1"}


def test_a_full_disk_drops_records_and_counts_them(tmp_path: Path) -> None:
    # /dev/full answers every write with ENOSPC, as a full filesystem does.
    (tmp_path / "full.jsonl").symlink_to("/dev/full")
    eventlog.configure(tmp_path, "full")
    before = dropped("nospace")
    for _ in range(3):
        eventlog.emit("lost", n=1)
    assert dropped("nospace") == before + 3


def test_an_unwritable_directory_drops_records(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    eventlog.configure(tmp_path / "file" / "events", "nowhere")
    before = dropped("error")
    eventlog.emit("lost")
    assert dropped("error") == before + 1


def test_the_snapshotter_works_on_with_a_full_event_disk(tmp_path: Path) -> None:
    """The snapshotter core, with its records going to a full disk: its
    Prepare and Commit of an unpack (which write a record) succeed."""
    events = tmp_path / "events"
    events.mkdir()
    (events / "snapshotter.jsonl").symlink_to("/dev/full")
    eventlog.configure(events, "snapshotter")
    before = dropped("nospace")
    snap = Snapshotter(tmp_path / "root")
    try:
        snap.prepare("default/1/extract-1 sha256:abc", "", {})
        committed = snap.commit("default/2/sha256:abc", "default/1/extract-1 sha256:abc", {})
    finally:
        snap.close()
    assert committed.key == "default/2/sha256:abc"
    assert dropped("nospace") == before + 1


def test_a_commit_of_an_unpack_is_recorded(tmp_path: Path) -> None:
    eventlog.configure(tmp_path / "events", "snapshotter")
    snap = Snapshotter(tmp_path / "root")
    try:
        snap.prepare("default/1/extract-1 sha256:abc", "", {})
        snap.commit("default/2/sha256:abc", "default/1/extract-1 sha256:abc", {})
    finally:
        snap.close()
    (record,) = [r for r in eventlog.read(tmp_path / "events") if r["kind"] == "unpacked"]
    assert record["target"] == "sha256:abc" and record["start"] <= record["end"]
