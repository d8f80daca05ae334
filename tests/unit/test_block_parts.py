"""Layer index version 4's block digests: a hash chain over parts, which a
block's first parts check against given the link after them; and version 3
indexes, whose blocks are digested whole, still verified as they were."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import struct
import tarfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.layer import parts
from snapshotter.layer.blockmath import MIN_LEFT_OUT, RunArrival, hot_runs
from snapshotter.layer.build import build_index
from snapshotter.layer.decode import BlockDecoder, BlockVerificationError
from snapshotter.layer.index import MAGIC, Block, LayerIndex

PART = parts.MIN_PART_BYTES


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 9 * PART + 17), cut=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_a_blocks_first_parts_check_against_its_digest_with_the_link_after_them(size: int, cut: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    digest = parts.chain_digest(data, PART)
    if size <= PART:
        # One part: the sha256 of the block, as before version 4.
        assert digest == hashlib.sha256(data).hexdigest()
    k = min(cut, parts.count(size, PART) - 1)
    if k < 1:
        return
    prefix, suffix = data[: k * PART], data[k * PART :]
    # The link after the first k parts is the digest of the rest as a block of its own.
    link = bytes.fromhex(parts.chain_digest(suffix, PART))
    assert parts.chain_digest(prefix, PART, link) == digest
    # Any other byte in the prefix, or any other link, checks out wrong.
    bad = bytearray(prefix)
    bad[random.Random(seed).randrange(len(bad))] ^= 0x40
    assert parts.chain_digest(bytes(bad), PART, link) != digest
    assert parts.chain_digest(prefix, PART, bytes(31) + b"\x01") != digest
    # The prefix alone, as if it were the whole block, is another block.
    assert parts.chain_digest(prefix, PART) != digest


def test_a_prefix_that_is_not_whole_parts_or_a_short_link_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        parts.chain_digest(b"x" * (PART + 1), PART, bytes(32))
    with pytest.raises(ValueError, match="multiple of"):
        parts.chain_digest(b"", PART, bytes(32))
    with pytest.raises(ValueError, match="a link is 32 bytes"):
        parts.chain_digest(b"x" * PART, PART, bytes(31))


def _layer(tmp_path: Path) -> tuple[bytes, Path]:
    rng = random.Random(7)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(6):
            data = rng.randbytes(150_000) + bytes(rng.randrange(200_000))
            info = tarfile.TarInfo(f"f{i}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = gzip.compress(buf.getvalue(), 6)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    return blob, path


def test_bootseer_index_chains_each_blocks_digest_over_parts(tmp_path: Path) -> None:
    blob, path = _layer(tmp_path)
    index = LayerIndex.decode(build_index(path, "sha256:" + hashlib.sha256(blob).hexdigest(), span=64 << 10).encode())
    assert index.part == parts.PART_BYTES
    many = [b for b in index.blocks if b.cend - b.cstart > index.part]
    assert many, "the layer has blocks of several parts"
    raw = gzip.decompress(blob)
    decoder = BlockDecoder(index)
    for n, b in enumerate(index.blocks):
        data = blob[b.cstart : b.cend]
        assert b.digest == parts.chain_digest(data, index.part)
        assert decoder.decode(n, data) == raw[b.ustart : b.uend]
    n = index.blocks.index(many[0])
    bad = bytearray(blob[many[0].cstart : many[0].cend])
    bad[-1] ^= 1
    with pytest.raises(BlockVerificationError, match="does not match"):
        decoder.decode(n, bytes(bad))


def test_a_version_3_index_is_still_verified_block_by_whole_block(tmp_path: Path) -> None:
    blob, path = _layer(tmp_path)
    built = build_index(path, "sha256:" + hashlib.sha256(blob).hexdigest(), span=64 << 10, part=0)
    payload = zstandard.ZstdDecompressor().decompress(built.encode()[len(MAGIC) :])
    (length,) = struct.unpack(">I", payload[:4])
    doc = json.loads(payload[4 : 4 + length])
    doc["version"] = 3
    del doc["part"]
    body = json.dumps(doc).encode()
    old = LayerIndex.decode(
        MAGIC + zstandard.ZstdCompressor().compress(struct.pack(">I", len(body)) + body + payload[4 + length :])
    )
    assert old.part == 0
    b = max(old.blocks, key=lambda b: b.cend - b.cstart)
    assert b.cend - b.cstart > parts.PART_BYTES and b.digest == hashlib.sha256(blob[b.cstart : b.cend]).hexdigest()
    n = old.blocks.index(b)
    assert BlockDecoder(old).decode(n, blob[b.cstart : b.cend]) == gzip.decompress(blob)[b.ustart : b.uend]


@pytest.mark.parametrize("gz", [True, False])
def test_a_blocks_first_parts_decode_to_its_first_bytes_as_far_as_its_reach_says(tmp_path: Path, gz: bool) -> None:
    blob, path = _layer(tmp_path)
    raw = gzip.decompress(blob)
    if not gz:
        blob = raw
        path.write_bytes(blob)
    index = LayerIndex.decode(build_index(path, "sha256:" + hashlib.sha256(blob).hexdigest(), span=64 << 10).encode())
    decoder = BlockDecoder(index)
    tried = 0
    for n, b in enumerate(index.blocks):
        data = blob[b.cstart : b.cend]
        out, found = decoder.decode_reach(n, data)
        assert out == raw[b.ustart : b.uend] and found is not None
        reach = found.outputs
        count = parts.count(len(data), index.part)
        assert list(reach) == sorted(reach) and reach[-1] == b.uend - b.ustart and len(reach) <= count
        links = found.links
        assert list(links) == parts.links(data, index.part) and links[0].hex() == b.digest
        bad = bytearray(data)
        bad[-1] ^= 1
        with pytest.raises(BlockVerificationError, match="does not match"):
            decoder.decode_reach(n, bytes(bad))
        for k in range(1, min(len(reach), count)):
            prefix = data[: k * index.part]
            out = decoder.decode_prefix(n, prefix, links[k])
            # Exactly the block's first bytes: at least what the reach promised.
            assert len(out) >= reach[k - 1] and out == raw[b.ustart : b.ustart + len(out)]
            with pytest.raises(BlockVerificationError, match="do not match"):
                decoder.decode_prefix(n, prefix, links[k - 1] if k > 1 else bytes(32))
            tried += 1
        with pytest.raises(BlockVerificationError, match="not its first parts"):
            decoder.decode_prefix(n, data, b"")
    assert tried > 10


def test_a_block_asked_only_for_its_first_parts_ends_its_run() -> None:
    size = 100_000
    blocks = [Block(i * size, (i + 1) * size, i * size, (i + 1) * size, "0" * 64) for i in range(6)]
    positions = {n: n for n in range(6)}
    # Block 1 leaves out 80 KB: its run ends there. Block 3 leaves out under
    # MIN_LEFT_OUT: fetched whole, with block 4.
    prefixes = {1: 20_000, 3: size - MIN_LEFT_OUT + 1}
    assert [run for _, run in hot_runs(positions, blocks, prefixes)] == [[0, 1], [2, 3, 4, 5]]
    # The response of a run ending in block 1's first parts: block 1 is
    # handed out once those are in.
    data = memoryview(bytes(range(256)) * 1000)[: size + 20_000]
    arrival = RunArrival([0, 1], blocks, data, size + 20_000)
    assert arrival.ends == [size, size + 20_000]
    assert list(arrival.whole(size + 19_999)) == [0]
    assert arrival.whole(size + 20_000)[1] == data[size:]
