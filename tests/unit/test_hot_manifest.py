"""The hot-block manifest core: building, merging, checking, the format, and
when a recording settles."""

from __future__ import annotations

import dataclasses

import pytest

from recorder.manifest import HotBlock, HotManifest, ManifestError, check, from_record, merge
from recorder.session import RecordingSession
from snapshotter.layer.index import Block, Compression, LayerIndex
from snapshotter.layer.parts import Reach

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
    [
        b"not json",
        b'{"version": 2}',
        b'{"version": 3, "image": "x", "runs": 1, "blocks": []}',
        b'{"version": 1, "image": "x", "runs": 0, "blocks": []}',
        b'{"version": 1}',
        b'{"version": 2, "image": "x", "runs": 1, "blocks": [["l", 0, "d", 0, 10]]}',
        b'{"version": 2, "image": "x", "runs": 1, "blocks": [["l", 0, "d", 0, 10, "zz"]]}',
    ],
)
def test_malformed_manifests_are_refused(data: bytes) -> None:
    with pytest.raises(ManifestError):
        HotManifest.decode(data)


def test_session_settles_when_reads_stop_or_the_window_ends() -> None:
    s = RecordingSession(IMAGE, {LAYER}, started=100.0, idle_s=5.0, max_s=60.0)
    assert not s.settled(150.0)  # nothing read yet: keep waiting, up to max_s
    s.access(LAYER, 1, 110.0, 100)
    s.access(LAYER, 1, 112.0, 40)  # only the first access counts, and the read reaching furthest
    s.access("sha256:" + "9" * 64, 0, 111.0, 10)  # not this image's layer
    assert s.accesses == {(LAYER, 1): 10.0} and s.extents == {(LAYER, 1): 100}
    assert not s.settled(114.0)
    assert s.settled(115.0)
    assert RecordingSession(IMAGE, {LAYER}, started=0.0, idle_s=5.0, max_s=60.0).settled(60.0)


PART = 4096
LINKS = tuple(bytes([k]) * 32 for k in range(4))


def parted(blocks: int = 4) -> LayerIndex:
    """Blocks of 4 parts (16 KiB compressed), each inflating to 64 KiB."""
    size = 4 * PART
    return LayerIndex(
        layer_digest=LAYER,
        compression=Compression.GZIP,
        compressed_size=blocks * size,
        uncompressed_size=blocks * 4 * size,
        span=4 * size,
        blocks=[Block(i * size, (i + 1) * size, i * 4 * size, (i + 1) * 4 * size, f"{i:064x}") for i in range(blocks)],
        entries=[],
        part=PART,
    )


def test_a_block_the_run_read_only_the_start_of_is_fetched_only_up_to_the_parts_that_give_it() -> None:
    reach = Reach((10_000, 30_000, 50_000, 65_536), LINKS)
    accesses = {(LAYER, 0): 0.0, (LAYER, 1): 0.1, (LAYER, 2): 0.2, (LAYER, 3): 0.3}
    # Block 0: read up to byte 30,000, which its first 2 parts give; block 1
    # to its last byte; block 2 up to byte 1; block 3's reach is not known.
    extents = {(LAYER, 0): 30_000, (LAYER, 1): 65_536, (LAYER, 2): 1, (LAYER, 3): 5}
    reaches = {(LAYER, n): reach for n in range(3)}
    m = from_record(IMAGE, accesses, {LAYER: parted()}, extents, reaches)
    assert [(b.size, b.link) for b in m.blocks] == [
        (2 * PART, LINKS[2].hex()),
        (4 * PART, ""),
        (PART, LINKS[1].hex()),
        (4 * PART, ""),
    ]
    assert m.total_bytes == 11 * PART
    assert HotManifest.decode(m.encode()) == m
    check(m, IMAGE, {LAYER: parted()})
    # An index without parts (or another's) cannot check them: refused.
    with pytest.raises(ManifestError, match="not its first parts"):
        check(m, IMAGE, {LAYER: dataclasses.replace(parted(), part=0)})
    for size in (PART + 1, 4 * PART, 0):
        bad = HotManifest(IMAGE, 1, [dataclasses.replace(m.blocks[0], size=size)])
        with pytest.raises(ManifestError, match="not its first parts"):
            check(bad, IMAGE, {LAYER: parted()})


def test_merged_runs_keep_what_either_read_of_a_block() -> None:
    def one(size: int, link: bytes | None) -> HotManifest:
        return HotManifest(IMAGE, 1, [HotBlock(LAYER, 0, "d0", 0, size, link.hex() if link else "")])

    assert merge(one(PART, LINKS[1]), one(2 * PART, LINKS[2])).blocks[0].link == LINKS[2].hex()
    assert merge(one(2 * PART, LINKS[2]), one(PART, LINKS[1])).blocks[0].size == 2 * PART
    for a, b in ((one(PART, LINKS[1]), one(4 * PART, None)), (one(4 * PART, None), one(PART, LINKS[1]))):
        merged = merge(a, b).blocks[0]
        assert (merged.size, merged.link) == (4 * PART, "")


def test_a_version_1_manifest_still_decodes_every_block_whole() -> None:
    old = b'{"version": 1, "image": "x", "runs": 2, "blocks": [["l", 3, "d", 7, 10]]}'
    assert HotManifest.decode(old).blocks == [HotBlock("l", 3, "d", 7, 10, "")]
