"""The store: local directories and pyarrow.fs URIs, atomic and race-safe publishing."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from depsnap.store import Store, StoreUnavailable
from tests.harness.procs import free_tcp_port

KEY = "ef" * 32


def read_snapshot(store: Store) -> bytes:
    stream = store.get(KEY)
    assert stream is not None, "the snapshot is missing"
    with stream:
        return stream.read()


@pytest.mark.parametrize("form", ["dir", "file-uri"])
def test_publish_then_get(tmp_path: Path, form: str) -> None:
    root = tmp_path / "store"
    store = Store.open(str(root) if form == "dir" else f"file://{root}")
    assert store.get(KEY) is None
    store.publish(KEY, b"head", io.BytesIO(b"body" * 1000))
    assert read_snapshot(store) == b"head" + b"body" * 1000
    assert [p.name for p in root.iterdir()] == [f"{KEY}.dsnap"]
    store.delete(KEY)
    assert store.get(KEY) is None


def test_concurrent_publishers_of_one_key_leave_one_whole_snapshot(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))
    bodies = [bytes([n]) * 300_000 for n in range(8)]
    barrier = threading.Barrier(len(bodies))

    def publish(body: bytes) -> None:
        barrier.wait()
        Store.open(store.uri).publish(KEY, b"h", io.BytesIO(body))

    threads = [threading.Thread(target=publish, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = read_snapshot(store)
    assert data[:1] == b"h" and data[1:] in bodies
    assert [p.name for p in (tmp_path / "store").iterdir()] == [f"{KEY}.dsnap"]


def test_failed_publish_leaves_nothing_visible(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))

    class Broken(io.BytesIO):
        def read(self, *args: object) -> bytes:
            raise OSError("disk on fire")

    with pytest.raises(StoreUnavailable, match="disk on fire"):
        store.publish(KEY, b"h", Broken())
    assert store.get(KEY) is None
    assert list((tmp_path / "store").iterdir()) == []


def test_unreachable_store_is_reported_as_such() -> None:
    port = free_tcp_port()
    store = Store.open(f"s3://bucket/snaps?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1")
    with pytest.raises(StoreUnavailable, match="cannot read"):
        store.get(KEY)
