"""The node cache: one download per key under concurrency, LRU eviction by size."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

from depsnap.cache import Cache
from depsnap.format import Manifest, header, pack
from depsnap.store import Store, Stream


def publish(store: Store, key: str, data: bytes) -> None:
    manifest = Manifest(key=key, kind="env", image_size=0, chunk_size=1 << 16)
    body = io.BytesIO()
    pack(io.BytesIO(data), body, manifest)
    body.seek(0)
    store.publish(key, header(manifest), body)


class CountingStore(Store):
    """A real local store that counts how often a snapshot is read."""

    gets = 0

    def get(self, key: str) -> Stream | None:
        type(self).gets += 1
        time.sleep(0.05)  # widen the window in which a second download could start
        return super().get(key)


def test_concurrent_fetches_download_once(tmp_path: Path) -> None:
    base = Store.open(str(tmp_path / "store"))
    store = CountingStore(base.uri, base.fs, base.root)
    key = "0" * 64
    publish(store, key, os.urandom(200_000))
    results = []

    def fetch() -> None:
        results.append(Cache(tmp_path / "cache", 1 << 30).fetch(key, store))

    threads = [threading.Thread(target=fetch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert CountingStore.gets == 1
    assert sorted(r.source for r in results if r) == ["cache"] * 5 + ["store"]


def test_least_recently_used_goes_first(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=2500)
    keys = [str(n) * 64 for n in range(3)]
    for n, key in enumerate(keys):
        image = tmp_path / f"image{n}"
        image.write_bytes(b"x" * 1000)
        cache.put(key, image)
        os.utime(cache.image_path(key), (1000 + n, 1000 + n))
    assert cache.lookup(keys[0]) is not None  # a use makes keys[0] the newest
    evicted = cache.evict()
    assert [e.key for e in evicted] == [keys[1]]
    assert cache.lookup(keys[1]) is None and cache.lookup(keys[2]) is not None


def test_eviction_never_takes_the_image_just_asked_for(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=10)
    image = tmp_path / "big"
    image.write_bytes(b"x" * 1000)
    cache.put("a" * 64, image)
    assert cache.evict(keep="a" * 64) == []
    assert cache.lookup("a" * 64) is not None
