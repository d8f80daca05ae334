"""The layer index core: format round trip and validation, block math,
decoding with verification, the tree and the builder's refusals."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import random
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zstandard

from snapshotter.layer.blockmath import InOrderReadAhead, RunArrival, fetch_runs, hot_runs
from snapshotter.layer.build import COARSE_SPANS, UnsupportedLayer, build_index, coarsen
from snapshotter.layer.decode import BlockDecoder, BlockVerificationError
from snapshotter.layer.index import (
    MAGIC,
    Block,
    Entry,
    EntryType,
    IndexFormatError,
    LayerIndex,
    chain_id,
    chain_ids,
    normalize_name,
)
from snapshotter.layer.tree import OPAQUE_XATTR, ROOT, build_tree, shows_xattrs
from snapshotter.remote import NotLazy, Reason, check_chain, parent_chain_of


def tar_of(members: list[tuple[str, bytes]], gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), 6) if gz else buf.getvalue()


def index_of(blob: bytes, tmp_path: Path, span: int = 64 << 10) -> LayerIndex:
    path = tmp_path / "blob"
    path.write_bytes(blob)
    return build_index(path, "sha256:" + hashlib.sha256(blob).hexdigest(), span=span)


@pytest.mark.parametrize("gz", [True, False])
def test_every_block_decodes_to_the_uncompressed_stream(tmp_path: Path, gz: bool) -> None:
    rng = random.Random(1)
    members = [(f"f{i}", rng.randbytes(rng.randint(0, 300_000)) + b"a" * 100_000) for i in range(12)]
    blob = tar_of(members, gz)
    index = LayerIndex.decode(index_of(blob, tmp_path).encode())
    raw = gzip.decompress(blob) if gz else blob
    assert index.uncompressed_size == len(raw)
    assert len(index.blocks) > 3
    decoder = BlockDecoder(index)
    order = list(range(len(index.blocks)))
    random.Random(2).shuffle(order)
    for n in order:
        b = index.blocks[n]
        assert decoder.decode(n, blob[b.cstart : b.cend]) == raw[b.ustart : b.uend]
    for entry, (name, data) in zip(index.entries, members, strict=False):
        assert entry.name == name
        assert raw[entry.offset : entry.offset + entry.size] == data


def test_tampered_block_is_refused(tmp_path: Path) -> None:
    blob = tar_of([("a", b"x" * 200_000)])
    index = index_of(blob, tmp_path)
    b = index.blocks[0]
    data = bytearray(blob[b.cstart : b.cend])
    data[len(data) // 2] ^= 1
    with pytest.raises(BlockVerificationError, match="does not match"):
        BlockDecoder(index).decode(0, bytes(data))
    with pytest.raises(BlockVerificationError, match="expected"):
        BlockDecoder(index).decode(0, bytes(data[:-1]))


def test_block_range_and_fetch_runs() -> None:
    blocks = [Block(i * 10, i * 10 + 11, i * 100, (i + 1) * 100, "0" * 64) for i in range(10)]
    index = LayerIndex("sha256:" + "0" * 64, "none", 101, 1000, 100, blocks, [])  # type: ignore[arg-type]
    assert index.block_range(0, 1) == range(1)
    assert index.block_range(99, 101) == range(2)
    assert index.block_range(100, 200) == range(1, 2)
    assert index.block_range(950, 5000) == range(9, 10)
    assert index.block_range(5, 5) == range(0)
    assert fetch_runs([1, 2, 3, 5, 7, 8], blocks) == [[1, 2, 3], [5], [7, 8]]
    # The caller's order stands: a manifest's first-access order is kept.
    assert fetch_runs([5, 1, 2, 3, 8, 7], blocks) == [[5], [1, 2, 3], [8], [7]]
    assert fetch_runs([1, 2, 3], blocks, max_bytes=25) == [[1, 2], [3]]
    # A manifest's blocks of a layer, read in the order 8, 2, 7, 1, 3 (their
    # places among the image's hot blocks): merged by number, each run taken
    # when its earliest-read block is due, never past max_bytes.
    positions = {8: 0, 2: 3, 7: 4, 1: 6, 3: 9}
    assert hot_runs(positions, blocks) == [(3, [1, 2, 3]), (0, [7, 8])]
    assert hot_runs(positions, blocks, max_bytes=25) == [(3, [1, 2]), (9, [3]), (0, [7, 8])]
    # A run's blocks are handed out as its response arrives, each once it
    # is whole: block 1 ends a byte into block 2 (they share it).
    data = bytes(range(41))
    arrival = RunArrival([1, 2, 3], blocks, memoryview(data[blocks[1].cstart : blocks[3].cend]))
    assert arrival.ends == [11, 21, 31]
    assert arrival.whole(10) == {}
    assert list(arrival.whole(20)) == [1]
    parts = arrival.whole(31)
    assert list(parts) == [2, 3] and parts[2] == data[20:31] and parts[3] == data[30:41]
    assert arrival.whole(31) == {}


def test_format_refuses_bad_input(tmp_path: Path) -> None:
    index = index_of(tar_of([("a", b"hello")]), tmp_path)
    good = index.encode()
    assert LayerIndex.decode(good).entries == index.entries
    with pytest.raises(IndexFormatError, match="magic"):
        LayerIndex.decode(b"garbage")
    with pytest.raises(IndexFormatError, match="corrupt"):
        LayerIndex.decode(MAGIC + b"not zstd")
    cases = {
        "does not continue": dataclasses.replace(index, blocks=[msgspec.structs.replace(index.blocks[0], ustart=1)]),
        "outside the compressed blob": dataclasses.replace(
            index, blocks=[msgspec.structs.replace(index.blocks[0], cend=index.compressed_size + 1)]
        ),
        "data outside the layer": dataclasses.replace(
            index, entries=[msgspec.structs.replace(index.entries[0], size=10**9)]
        ),
        "climbs out": dataclasses.replace(
            index, entries=[msgspec.structs.replace(index.entries[0], name="../etc/passwd")]
        ),
        "not normalised": dataclasses.replace(index, entries=[msgspec.structs.replace(index.entries[0], name="./a")]),
        "malformed digest": dataclasses.replace(index, blocks=[msgspec.structs.replace(index.blocks[0], digest="zz")]),
    }
    for message, bad in cases.items():
        with pytest.raises(IndexFormatError, match=message):
            LayerIndex.decode(bad.encode())


def test_the_snapshotter_decodes_an_index_without_its_checkpoints(tmp_path: Path) -> None:
    """It never inflates: the document is all it reads and checks, and the
    layer server, which serves the layer, checks the checkpoints too."""
    index = index_of(tar_of([("file", b"x" * 100_000)]), tmp_path)
    encoded = index.encode()
    light = LayerIndex.decode(encoded, checkpoints=False)
    assert light.checkpoints == b"" and index.checkpoints != b""
    assert (light.entries, light.blocks, light.diff_id) == (index.entries, index.blocks, index.diff_id)
    # Checkpoints cut short: only the whole decode sees it.
    damaged = _reencoded(encoded, lambda payload: payload[:-10])
    assert LayerIndex.decode(damaged, checkpoints=False).entries == index.entries
    with pytest.raises(IndexFormatError):
        LayerIndex.decode(damaged)
    # A document cut short is refused either way.
    short = _reencoded(encoded, lambda payload: payload[: len(payload) - len(index.checkpoints) - 1])
    for checkpoints in (True, False):
        with pytest.raises(IndexFormatError, match="corrupt"):
            LayerIndex.decode(short, checkpoints=checkpoints)


def _reencoded(encoded: bytes, change: Callable[[bytes], bytes]) -> bytes:
    payload = zstandard.ZstdDecompressor().decompress(encoded[len(MAGIC) :])
    return MAGIC + zstandard.ZstdCompressor().compress(change(payload))


def test_names_are_normalised_and_escapes_refused() -> None:
    assert normalize_name("./usr//bin/") == "usr/bin"
    assert normalize_name("/etc/passwd") == "etc/passwd"
    assert normalize_name("./") == ""
    with pytest.raises(IndexFormatError, match="climbs out"):
        normalize_name("a/../../etc/shadow")
    # tar stops a name at NUL, a PAX record need not: no name of two readings.
    with pytest.raises(IndexFormatError, match="NUL"):
        normalize_name("etc/passwd\x00.txt")


def test_builder_refuses_path_traversal_and_non_tar(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedLayer, match="climbs out"):
        index_of(tar_of([("../../evil", b"x")]), tmp_path)
    with pytest.raises(UnsupportedLayer, match="tar"):
        index_of(gzip.compress(b"this is not a tar archive" * 100), tmp_path)


def entry(name: str, etype: EntryType = EntryType.REG, mode: int = 0o644, **kw: object) -> Entry:
    fields: dict[str, object] = {"size": 0, "offset": 0, "linkname": "", "devmajor": 0, "devminor": 0, "xattrs": {}}
    return Entry(name=name, type=etype, mode=mode, uid=0, gid=0, mtime=0.0, **(fields | kw))  # type: ignore[arg-type]


def test_tree_follows_tar_and_overlay_rules() -> None:
    tree = build_tree(
        [
            entry("", EntryType.DIR, 0o700),
            entry("a/b/file", size=3, offset=512),
            entry("a/b/file", size=7, offset=2048),  # a later entry wins
            entry("a/link", EntryType.HARDLINK, mode=0o600, linkname="a/b/file"),
            entry("a", EntryType.DIR, 0o750),  # updates the implicit directory
            entry("a/.wh.gone"),
            entry("o/.wh..wh..opq"),
            entry("s", EntryType.SYMLINK, 0o777, linkname="a/b"),
        ]
    )
    root = tree.nodes[ROOT]
    assert stat.S_IMODE(root.mode) == 0o700
    a = tree.lookup(ROOT, b"a")
    assert a is not None and stat.S_IMODE(a.mode) == 0o750
    b = tree.lookup(a.ino, b"b")
    assert b is not None and stat.S_IMODE(b.mode) == 0o755  # implicit parent
    file = tree.lookup(b.ino, b"file")
    link = tree.lookup(a.ino, b"link")
    assert file is link and file is not None and (file.size, file.offset, file.nlink) == (7, 2048, 2)
    assert stat.S_IMODE(file.mode) == 0o600  # the link entry's metadata, as containerd applies it
    gone = tree.lookup(a.ino, b"gone")
    assert gone is not None and stat.S_ISCHR(gone.mode) and gone.rdev == 0
    opaque = tree.lookup(ROOT, b"o")
    assert opaque is not None and opaque.xattrs == {OPAQUE_XATTR: b"y"}
    symlink = tree.lookup(ROOT, b"s")
    assert symlink is not None and (symlink.target, symlink.size) == (b"a/b", 3)


def test_a_layer_shows_xattrs_through_its_entries_or_an_opaque_marker() -> None:
    assert not shows_xattrs([entry("", EntryType.DIR, 0o755), entry("a/f"), entry("a/.wh.gone")])
    assert shows_xattrs([entry("a/f"), entry("o/.wh..wh..opq")])
    assert shows_xattrs([entry("f", xattrs={"security.capability": b"\x01"})])
    assert shows_xattrs([entry("", EntryType.DIR, 0o755, xattrs={"user.a": b"1"})])


def test_tree_refuses_broken_hardlinks_and_file_parents() -> None:
    with pytest.raises(IndexFormatError, match="no file to link to"):
        build_tree([entry("l", EntryType.HARDLINK, linkname="missing")])
    with pytest.raises(IndexFormatError, match="non-directory"):
        build_tree([entry("f"), entry("f/child")])


def test_read_ahead_grows_on_sequential_reads_and_stops_on_random_ones() -> None:
    ra = InOrderReadAhead(max_blocks=8)
    assert ra.observe(0, 0) == range(1, 1)  # a first read fetches nothing extra
    assert ra.observe(0, 0) == range(1, 1)  # more reads in the same block
    assert ra.observe(1, 1) == range(2, 4)  # into the next block: 2 ahead
    assert ra.observe(2, 2) == range(3, 7)  # then 4
    assert ra.observe(3, 4) == range(5, 13)  # then 8
    assert ra.observe(5, 5) == range(6, 14)  # capped at 8
    assert ra.observe(40, 40) == range(41, 41)  # a jump closes the window
    assert ra.observe(41, 41) == range(42, 44)
    # Reads that straddle block boundaries (file data rarely starts at one).
    ra = InOrderReadAhead(max_blocks=8)
    assert ra.observe(0, 0) == range(1, 1)
    assert ra.observe(0, 1) == range(2, 4)
    assert ra.observe(1, 1) == range(2, 4)
    assert ra.observe(1, 2) == range(3, 7)


# -- block sizes: fine where data compresses, coarser where it does not -------


def _text(rng: random.Random, size: int) -> bytes:
    words = [rng.randbytes(4).hex() for _ in range(300)]
    return " ".join(rng.choice(words) for _ in range(size // 8)).encode()[:size]


def test_blocks_of_incompressible_data_are_merged_and_every_block_still_decodes(tmp_path: Path) -> None:
    rng = random.Random(8)
    span = 64 << 10
    members = [("text", _text(rng, 1 << 20)), ("noise", rng.randbytes(1 << 20)), ("more-text", _text(rng, 1 << 20))]
    blob = tar_of(members)
    raw = gzip.decompress(blob)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    index = LayerIndex.decode(build_index(path, digest, span=span, coarse=True).encode())
    fine = build_index(path, digest, span=span)
    noise = next(e for e in index.entries if e.name == "noise")

    def within_noise(blocks: list[Block]) -> list[Block]:
        return [b for b in blocks if noise.offset <= b.ustart and b.uend <= noise.offset + noise.size]

    # Noise: runs of COARSE_SPANS blocks become one; text keeps every block.
    assert 0 < len(within_noise(index.blocks)) <= len(within_noise(fine.blocks)) / (COARSE_SPANS - 1)
    assert max(b.uend - b.ustart for b in within_noise(index.blocks)) >= COARSE_SPANS * span
    text = {b.ustart for b in fine.blocks if b.uend <= noise.offset or b.ustart >= noise.offset + noise.size}
    assert text <= {b.ustart for b in index.blocks}
    # One checkpoint per block start: the merged-away ones and their windows are gone.
    assert {b.ustart for b in index.blocks} <= set(index.checkpoints_by_offset)
    assert len(index.checkpoints_by_offset) <= len(index.blocks) + 1
    assert len(index.encode()) < len(fine.encode())
    decoder = BlockDecoder(index)
    for n, b in enumerate(index.blocks):
        compressed = blob[b.cstart : b.cend]
        assert decoder.decode(n, compressed) == raw[b.ustart : b.uend]
        # indexed_gzip's reader (the fallback) takes the thinned checkpoints too.
        assert decoder._inflate_with_zran(n, compressed, b.uend - b.ustart) == raw[b.ustart : b.uend]
    decoder.close()


def test_coarsen_merges_runs_of_incompressible_blocks_only() -> None:
    def block(n: int, compressed: int) -> tuple[int, int, int, int]:
        return (n * 10, n * 10 + compressed, n * 100, n * 100 + 100)

    bounds = [block(0, 20), *(block(n, 90) for n in range(1, 7)), block(7, 20), block(8, 95), block(9, 95)]
    assert coarsen(bounds, windowless=set()) == [
        bounds[0],
        (10, 40 + 90, 100, 500),  # blocks 1-4: COARSE_SPANS of them
        (50, 60 + 90, 500, 700),  # blocks 5-6
        bounds[7],
        (80, 90 + 95, 800, 1000),
    ]
    # A gzip member starts at block 3: nothing is merged across it.
    assert coarsen(bounds[:5], windowless={300}) == [bounds[0], (10, 20 + 90, 100, 300), (30, 40 + 90, 300, 500)]
    # Nor past COARSE_MAX_BYTES: blocks of a 4 MiB span stay as they are.
    big = [(n << 22, (n + 1) << 22, n << 22, (n + 1) << 22) for n in range(4)]
    assert coarsen(big, windowless=set()) == big
    assert coarsen([*big[:2], (8 << 20, 9 << 20, 8 << 20, 9 << 20)], windowless=set())[1:] == [
        (4 << 20, 9 << 20, 4 << 20, 9 << 20)
    ]


# -- the diff_id and the chain it binds the index to --------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_the_index_records_the_diff_id_of_the_uncompressed_tar(tmp_path: Path, gz: bool) -> None:
    rng = random.Random(4)
    members = [(f"f{i}", rng.randbytes(rng.randint(0, 200_000))) for i in range(20)]
    blob = tar_of(members, gz)
    raw = gzip.decompress(blob) if gz else blob
    index = index_of(blob, tmp_path)
    assert index.diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert LayerIndex.decode(index.encode()).diff_id == index.diff_id


def test_the_diff_id_of_a_multi_member_gzip_layer_covers_every_member(tmp_path: Path) -> None:
    raw = tar_of([("a", b"x" * 300_000), ("b", random.Random(5).randbytes(100_000))], gz=False)
    # As pigz and concatenating writers make them: containerd reads on past each member.
    blob = gzip.compress(raw[:70_000], 6) + gzip.compress(raw[70_000:], 6)
    assert index_of(blob, tmp_path).diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()


def test_a_gzip_layer_cut_short_is_not_indexed(tmp_path: Path) -> None:
    blob = tar_of([("a", random.Random(6).randbytes(300_000))])
    with pytest.raises(UnsupportedLayer):
        index_of(blob[:-9], tmp_path)


A_DIFF = "sha256:" + "a" * 64
B_DIFF = "sha256:" + "b" * 64


def test_chain_ids_follow_the_oci_definition() -> None:
    ab = "sha256:" + hashlib.sha256(f"{A_DIFF} {B_DIFF}".encode()).hexdigest()
    assert chain_id("", A_DIFF) == A_DIFF
    assert chain_id(A_DIFF, B_DIFF) == ab
    assert chain_ids([A_DIFF, B_DIFF]) == [A_DIFF, ab]


def test_a_bottom_layer_binds_when_the_target_is_its_diff_id() -> None:
    check_chain("", A_DIFF, A_DIFF)
    with pytest.raises(NotLazy, match="claims another layer's diff_id") as refused:
        check_chain("", A_DIFF, B_DIFF)
    assert refused.value.reason is Reason.DIFF_ID_MISMATCH


def test_an_upper_layer_binds_to_its_parents_chain() -> None:
    check_chain(A_DIFF, B_DIFF, chain_id(A_DIFF, B_DIFF))
    # The diff_id another image's config gives for a layer, on the same parent.
    with pytest.raises(NotLazy) as refused:
        check_chain(A_DIFF, "sha256:" + "c" * 64, chain_id(A_DIFF, B_DIFF))
    assert refused.value.reason is Reason.DIFF_ID_MISMATCH
    # The right diff_id, on another parent.
    with pytest.raises(NotLazy):
        check_chain(B_DIFF, B_DIFF, chain_id(A_DIFF, B_DIFF))
    # A parent that is not an image layer's snapshot, and a version 1 index.
    with pytest.raises(NotLazy, match="ends in no chainID"):
        check_chain(None, B_DIFF, chain_id(A_DIFF, B_DIFF))
    with pytest.raises(NotLazy, match="version 1") as refused:
        check_chain(A_DIFF, "", chain_id(A_DIFF, B_DIFF))
    assert refused.value.reason is Reason.INDEX_REFUSED


@pytest.mark.parametrize(
    ("key", "chain"),
    [
        ("", ""),
        # What containerd's metadata store sends (observed in tests/lazy/test_diff_id_binding.py):
        (f"default/12/{A_DIFF}", A_DIFF),  # a layer containerd committed
        (f"bs-test/remote/{A_DIFF}", A_DIFF),  # a layer served lazily, under our name
        ("default/13/my-container-snapshot", None),
        (f"default/14/{A_DIFF[:-1]}", None),
    ],
)
def test_the_parents_chain_comes_from_its_key(key: str, chain: str | None) -> None:
    assert parent_chain_of(key) == chain
