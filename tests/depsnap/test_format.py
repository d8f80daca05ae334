"""The snapshot container: round trip, and every kind of damage detected."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from depsnap.format import CorruptSnapshot, Manifest, header, pack, unpack

KEY = "ab" * 32


def packed(data: bytes, chunk_size: int = 1000) -> bytes:
    manifest = Manifest(key=KEY, kind="env", image_size=0, chunk_size=chunk_size)
    body = io.BytesIO()
    pack(io.BytesIO(data), body, manifest, workers=2)
    return header(manifest) + body.getvalue()


def restore(blob: bytes, tmp_path: Path, key: str = KEY) -> bytes:
    out = tmp_path / "image"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        unpack(io.BytesIO(blob), fd, key, workers=2)
    finally:
        os.close(fd)
    return out.read_bytes()


def test_round_trip_over_many_chunks(tmp_path: Path) -> None:
    data = os.urandom(5000) + b"\0" * 7000 + b"tail"
    assert restore(packed(data), tmp_path) == data


def test_empty_image_round_trips(tmp_path: Path) -> None:
    assert restore(packed(b""), tmp_path) == b""


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda b: b[:-10], "ends early"),
        (lambda b: b + b"x", "bytes after its last chunk"),
        (lambda b: b"X" + b[1:], "bad magic"),
        (lambda b: b[:20] + b"{" + b[21:], "manifest"),
    ],
)
def test_damage_is_detected(tmp_path: Path, damage: Callable[[bytes], bytes], message: str) -> None:
    with pytest.raises(CorruptSnapshot, match=message):
        restore(damage(packed(os.urandom(3000))), tmp_path)


def test_flipped_bit_in_the_data_is_detected(tmp_path: Path) -> None:
    blob = bytearray(packed(bytes(range(256)) * 40))
    blob[-50] ^= 0x01
    with pytest.raises(CorruptSnapshot, match="chunk"):
        restore(bytes(blob), tmp_path)


def test_a_snapshot_of_another_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorruptSnapshot, match="not " + "cd" * 32):
        restore(packed(b"data"), tmp_path, key="cd" * 32)
