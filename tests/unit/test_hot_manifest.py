"""The hot-block manifest core: building, merging, checking, the format, and
when a recording settles."""

from __future__ import annotations

import pytest

from recorder.manifest import HotBlock, HotManifest, ManifestError, check, from_record, merge
from recorder.session import RecordingSession
from snapshotter.layer.index import Block, Compression, LayerIndex

IMAGE = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64
LAYER = "sha256:" + "1" * 64


def index(layer: str = LAYER, blocks: int = 4) -> LayerIndex:
    return LayerIndex(
        layer_digest=layer,
        compression=Compression.NONE,
        compressed_size=blocks * 10,
        uncompressed_size=blocks * 10,
        span=10,
        blocks=[Block(i * 10, i * 10 + 10, i * 10, i * 10 + 10, f"{i:064x}") for i in range(blocks)],
        entries=[],
    )


def test_record_is_ordered_by_first_access_with_sizes_and_digests() -> None:
    m = from_record(IMAGE, {(LAYER, 3): 0.5, (LAYER, 1): 0.1}, {LAYER: index()})
    assert [(b.block, b.first_access_ms, b.size) for b in m.blocks] == [(1, 100, 10), (3, 500, 10)]
    assert m.blocks[0].digest == f"{1:064x}" and m.total_bytes == 20
    assert HotManifest.decode(m.encode()) == m


def test_merge_is_a_run_weighted_union() -> None:
    a = HotManifest(IMAGE, 1, [HotBlock(LAYER, 0, "d0", 100, 10), HotBlock(LAYER, 1, "d1", 300, 10)])
    b = HotManifest(IMAGE, 2, [HotBlock(LAYER, 1, "d1", 0, 10), HotBlock(LAYER, 2, "d2", 50, 10)])
    merged = merge(a, b)
    assert merged.runs == 3
    assert [(x.block, x.first_access_ms) for x in merged.blocks] == [(2, 50), (0, 100), (1, 100)]
    assert len(merge(a, b, max_blocks=2).blocks) == 2
    with pytest.raises(ManifestError, match="cannot merge"):
        merge(a, HotManifest(OTHER, 1, []))


def test_check_refuses_other_images_and_stale_blocks() -> None:
    good = from_record(IMAGE, {(LAYER, 2): 0.0}, {LAYER: index()})
    check(good, IMAGE, {LAYER: index()})
    with pytest.raises(ManifestError, match="not " + OTHER):
        check(good, OTHER, {LAYER: index()})
    with pytest.raises(ManifestError, match="does not have"):
        check(good, IMAGE, {"sha256:" + "2" * 64: index("sha256:" + "2" * 64)})
    stale = HotManifest(IMAGE, 1, [HotBlock(LAYER, 2, "0" * 64, 0, 10)])
    with pytest.raises(ManifestError, match="stale"):
        check(stale, IMAGE, {LAYER: index()})
    beyond = HotManifest(IMAGE, 1, [HotBlock(LAYER, 9, "0" * 64, 0, 10)])
    with pytest.raises(ManifestError, match="stale"):
        check(beyond, IMAGE, {LAYER: index()})


@pytest.mark.parametrize(
    "data",
    [b"not json", b'{"version": 2}', b'{"version": 1, "image": "x", "runs": 0, "blocks": []}', b'{"version": 1}'],
)
def test_malformed_manifests_are_refused(data: bytes) -> None:
    with pytest.raises(ManifestError):
        HotManifest.decode(data)


def test_session_settles_when_reads_stop_or_the_window_ends() -> None:
    s = RecordingSession(IMAGE, {LAYER}, started=100.0, idle_s=5.0, max_s=60.0)
    assert not s.settled(150.0)  # nothing read yet: keep waiting, up to max_s
    s.access(LAYER, 1, 110.0)
    s.access(LAYER, 1, 112.0)  # only the first access counts
    s.access("sha256:" + "9" * 64, 0, 111.0)  # not this image's layer
    assert s.accesses == {(LAYER, 1): 10.0}
    assert not s.settled(114.0)
    assert s.settled(115.0)
    assert RecordingSession(IMAGE, {LAYER}, started=0.0, idle_s=5.0, max_s=60.0).settled(60.0)
