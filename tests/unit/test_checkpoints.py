"""Gzip checkpoints and the ISA-L block path (snapshotter/layer/checkpoints.py, decode.py)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import random
import tarfile
import zlib
from pathlib import Path

import pytest
from isal import isal_zlib

from snapshotter.layer import build, checkpoints, windows
from snapshotter.layer.build import build_index
from snapshotter.layer.decode import BlockDecoder, BlockVerificationError
from snapshotter.layer.index import IndexFormatError, LayerIndex

# A final, empty fixed-Huffman block: header 1,01 and end-of-block 0000000.
_FINAL_EMPTY = (0b011, 10)


@pytest.mark.parametrize("residue", range(8))
def test_empty_block_has_the_asked_length_and_inflates_to_nothing(residue: int) -> None:
    block = checkpoints._empty_block(residue)
    assert block.nbits % 8 == residue
    block.field(*_FINAL_EMPTY)
    stream = block.value.to_bytes((block.nbits + 7) // 8, "little")
    for inflater in (zlib.decompressobj(-15), isal_zlib.decompressobj(-15)):
        assert inflater.decompress(stream) == b""
        assert inflater.eof


def _mixed_tar(seed: int) -> bytes:
    """Text, incompressible bytes (stored deflate blocks) and runs, so that
    checkpoints land at every bit offset and before every kind of block."""
    rng = random.Random(seed)
    words = [bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz_", k=rng.randint(2, 9))) for _ in range(400)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(40):
            kind = i % 3
            if kind == 0:
                data = b" ".join(rng.choices(words, k=rng.randint(1000, 40_000)))
            elif kind == 1:
                data = rng.randbytes(rng.randint(1000, 200_000))
            else:
                data = bytes([rng.randrange(256)]) * rng.randint(1000, 100_000)
            info = tarfile.TarInfo(f"f{i}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _index(blob: bytes, tmp_path: Path, span: int) -> LayerIndex:
    path = tmp_path / "blob"
    path.write_bytes(blob)
    return build_index(path, "sha256:" + hashlib.sha256(blob).hexdigest(), span=span)


def test_isal_path_decodes_every_block_at_every_bit_offset(tmp_path: Path) -> None:
    raw = _mixed_tar(1)
    blob = gzip.compress(raw, 6)
    index = _index(blob, tmp_path, span=64 << 10)
    points = checkpoints.parse(index.checkpoints)
    assert {p.bits for p in points if p.window is not None} == set(range(8))
    decoder = BlockDecoder(index)
    for n, b in enumerate(index.blocks):
        data = blob[b.cstart : b.cend]
        # The ISA-L path itself, not the indexed_gzip fallback, gets it right.
        assert decoder._inflate(n, data, b.uend - b.ustart) == raw[b.ustart : b.uend], n
        assert decoder.decode(n, data) == raw[b.ustart : b.uend]


def test_later_gzip_members_decode(tmp_path: Path) -> None:
    raw = _mixed_tar(2)
    cut = len(raw) // 3
    blob = gzip.compress(raw[:cut], 6) + gzip.compress(raw[cut:], 1)
    index = _index(blob, tmp_path, span=64 << 10)
    decoder = BlockDecoder(index)
    assert any(b.ustart == cut for b in index.blocks)
    for n, b in enumerate(index.blocks):
        data = blob[b.cstart : b.cend]
        assert decoder._inflate(n, data, b.uend - b.ustart) == raw[b.ustart : b.uend], n


def test_indexed_gzip_takes_over_what_isal_cannot_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _mixed_tar(5)
    blob = gzip.compress(raw, 6)
    index = _index(blob, tmp_path, span=64 << 10)
    monkeypatch.setattr(checkpoints, "raw_stream", lambda point, data: b"\xff" * len(data))
    decoder = BlockDecoder(index)
    for n, b in enumerate(index.blocks):
        data = blob[b.cstart : b.cend]
        if n:
            assert decoder._inflate(n, data, b.uend - b.ustart) in (None, b"")
        assert decoder.decode(n, data) == raw[b.ustart : b.uend], n


def test_a_wrong_window_is_caught(tmp_path: Path) -> None:
    raw = _mixed_tar(3)
    blob = gzip.compress(raw, 6)
    index = _index(blob, tmp_path, span=64 << 10)
    points = checkpoints.parse(index.checkpoints)
    victim = next(i for i, p in enumerate(points) if p.window is not None and i > 1)
    # Flip one byte of that checkpoint's window inside the exported data.
    windows_start = len(index.checkpoints) - sum(len(p.window or b"") for p in points)
    offset = windows_start + sum(len(p.window or b"") for p in points[:victim]) + 100
    tampered = bytearray(index.checkpoints)
    tampered[offset] ^= 0xFF
    bad = dataclasses.replace(index, checkpoints=bytes(tampered))
    decoder = BlockDecoder(bad)
    before = next(n for n, b in enumerate(index.blocks) if b.uend == points[victim].uncompressed)
    b = index.blocks[before]
    with pytest.raises(BlockVerificationError):
        decoder.decode(before, blob[b.cstart : b.cend])


def test_malformed_checkpoints_are_refused(tmp_path: Path) -> None:
    blob = gzip.compress(_mixed_tar(4), 6)
    index = _index(blob, tmp_path, span=64 << 10)
    with pytest.raises(checkpoints.CheckpointFormatError):
        checkpoints.parse(index.checkpoints[:-1])
    with pytest.raises(checkpoints.CheckpointFormatError):
        checkpoints.parse(b"NOTGZ" + index.checkpoints[5:])
    with pytest.raises(IndexFormatError, match="gzip layer index"):
        dataclasses.replace(index, checkpoints=index.checkpoints[:40]).validate()


def _windows(index: LayerIndex) -> dict[int, bytes]:
    return {p.uncompressed: p.window for p in checkpoints.parse(index.checkpoints) if p.window is not None}


def test_pruned_windows_keep_only_what_blocks_refer_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _mixed_tar(6)
    blob = gzip.compress(raw, 6)
    pruned = _index(blob, tmp_path, span=64 << 10)
    monkeypatch.setattr(build, "_prune_windows", lambda _blob, exported, _bounds: exported)
    whole = _index(blob, tmp_path, span=64 << 10)
    pruned_windows, whole_windows = _windows(pruned), _windows(whole)
    assert pruned_windows.keys() == whole_windows.keys() and len(whole_windows) > 10
    for offset, window in pruned_windows.items():
        # Each byte is the window's own or a zero.
        assert all(p in (0, w) for p, w in zip(window, whole_windows[offset], strict=True))
    kept = sum(len(w) - w.count(0) for w in pruned_windows.values())
    assert kept < sum(len(w) - w.count(0) for w in whole_windows.values()) // 2
    assert len(pruned.encode()) < len(whole.encode())
    # And every block still decodes to its bytes (the ISA-L path, with the pruned window).
    decoder = BlockDecoder(pruned)
    for n, b in enumerate(pruned.blocks):
        assert decoder._inflate(n, blob[b.cstart : b.cend], b.uend - b.ustart) == raw[b.ustart : b.uend], n


def test_a_window_pruning_cannot_vouch_for_stays_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    text = b" ".join(bytes(rng.choices(b"abcdefgh", k=rng.randint(3, 8))) for _ in range(40_000))
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15, zdict=text[:32768])
    stream = compressor.compress(text[32768:]) + compressor.flush()
    window = text[:32768]
    assert windows.prune(window, stream).count(0) > 16_000
    # Not raw deflate at all: nothing to go by.
    assert windows.prune(window, b"\xff" * 1000) == window
    # Markers that name the wrong window bytes (every source below 256) give
    # a pruned window whose output differs: the check catches it and the
    # whole window stays.
    monkeypatch.setattr(windows, "_HIGH", bytes(len(window)))
    assert windows.prune(window, stream) == window


def test_a_block_tail_is_checked_where_the_window_keeps_bytes() -> None:
    tail = bytes(range(256)) * 128
    pruned = bytearray(len(tail))
    pruned[5], pruned[4000] = tail[5], tail[4000]
    assert windows.tail_matches(bytes(pruned), tail)
    assert windows.tail_matches(tail, tail)
    wrong = bytearray(pruned)
    wrong[4000] ^= 0x01
    assert not windows.tail_matches(bytes(wrong), tail)
