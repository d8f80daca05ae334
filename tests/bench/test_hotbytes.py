"""The strict limit's input: pages read -> tar ranges -> compressed bytes."""

from __future__ import annotations

import gzip
import io
import os
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest

from bench import hotbytes
from bench.hotbytes import OffsetMap


def test_merge_joins_overlapping_and_touching_ranges_and_drops_empty_ones() -> None:
    assert hotbytes.merge([(10, 20), (0, 5), (5, 8), (15, 30), (40, 40), (50, 60)]) == [(0, 8), (10, 30), (50, 60)]
    assert hotbytes.merge([]) == []


def test_resident_ranges_follow_the_vector_and_stop_at_the_file_end() -> None:
    # Pages 0-1 and 3 resident, 2 not; only bit 0 counts; the last page is partial.
    assert hotbytes.resident_ranges(bytes([1, 3, 2, 1]), 3 * 4096 + 100, page=4096) == [
        (0, 8192),
        (12288, 12388),
    ]
    assert hotbytes.resident_ranges(bytes([0, 0]), 8192, page=4096) == []


def test_offset_map_interpolates_between_samples() -> None:
    m = OffsetMap(np.array([0, 100, 200]), np.array([0, 10, 60]))
    assert m.compressed_bytes([(0, 100)]) == 10
    assert m.compressed_bytes([(150, 200)]) == 25
    # Two ranges, one spanning a sample.
    assert m.compressed_bytes([(0, 50), (50, 150)]) == 35
    assert m.compressed_bytes([]) == 0


def test_block_bytes_price_every_block_a_range_touches_whole() -> None:
    # 1000 uncompressed bytes compress to 100, evenly.
    m = OffsetMap(np.array([0, 1000]), np.array([0, 100]))
    # One byte in block 0, and a range across blocks 2 and 3, of span 200.
    assert m.block_bytes([(10, 11), (450, 620)], 200) == 60
    # The same reads in blocks of 100: blocks 0, 4, 5 and 6.
    assert m.block_bytes([(10, 11), (450, 620)], 100) == 40
    # The last block stops at the end of the stream.
    assert m.block_bytes([(990, 1000)], 400) == 20
    assert m.block_bytes([], 100) == 0
    # Never less than the bytes read.
    assert m.block_bytes([(0, 1000)], 300) == m.compressed_bytes([(0, 1000)]) == 100


def test_prefix_bytes_price_each_touched_block_up_to_its_last_byte_read() -> None:
    m = OffsetMap(np.array([0, 1000]), np.array([0, 100]))
    # Of span 200: block 0 up to byte 11, block 2 to its end, block 3 up to 620.
    assert m.prefix_bytes([(10, 11), (450, 620)], 200) == round(1.1 + 20 + 2)
    # Between the bytes read and the whole blocks.
    assert m.compressed_bytes([(10, 11), (450, 620)]) <= 23 <= m.block_bytes([(10, 11), (450, 620)], 200)
    assert m.prefix_bytes([(990, 1000)], 400) == 20
    assert m.prefix_bytes([], 100) == 0


def _layer(path: Path, files: dict[str, bytes]) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("./hard")
        link.type, link.linkname = tarfile.LNKTYPE, "./noise"
        tar.addfile(link)
    path.write_bytes(gzip.compress(raw.getvalue(), compresslevel=6))


def test_layer_map_finds_each_file_and_prices_it_by_its_compressibility(tmp_path: Path) -> None:
    rng = random.Random(3)
    noise = rng.randbytes(600_000)  # incompressible
    zeros = bytes(600_000)  # compresses to almost nothing
    blob = tmp_path / "layer.tar.gz"
    _layer(blob, {"./noise": noise, "./usr/zeros": zeros})
    m = hotbytes.build_layer_map(blob)
    assert set(m.files) == {"noise", "usr/zeros"}  # the hardlink has no data of its own
    raw = gzip.decompress(blob.read_bytes())
    for name, data in (("noise", noise), ("usr/zeros", zeros)):
        offset, size = m.files[name]
        assert raw[offset : offset + size] == data
    # The whole stream costs the whole blob (give or take the header and trailer).
    total = m.offsets.compressed_bytes([(0, len(raw))])
    assert abs(total - blob.stat().st_size) < 64
    offset, size = m.files["noise"]
    assert m.offsets.compressed_bytes([(offset, offset + size)]) == pytest.approx(len(noise), rel=0.05)
    offset, size = m.files["usr/zeros"]
    assert m.offsets.compressed_bytes([(offset, offset + size)]) < len(zeros) / 50


def test_layer_map_is_cached_by_blob_name(tmp_path: Path) -> None:
    blob = tmp_path / "0123abcd"
    _layer(blob, {"./a": b"x" * 10_000})
    first = hotbytes.layer_map(blob, tmp_path / "cache")
    blob.write_bytes(b"not read again")
    again = hotbytes.layer_map(blob, tmp_path / "cache")
    assert again.files == first.files
    assert np.array_equal(again.offsets.compressed, first.offsets.compressed)


def test_multi_member_gzip_is_one_stream(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("f")
        info.size = 200_000
        tar.addfile(info, io.BytesIO(os.urandom(200_000)))
    data = raw.getvalue()
    blob = tmp_path / "multi"
    blob.write_bytes(gzip.compress(data[:100_000]) + gzip.compress(data[100_000:]))
    m = hotbytes.build_layer_map(blob)
    assert m.files["f"][1] == 200_000
    assert abs(m.offsets.compressed_bytes([(0, len(data))]) - blob.stat().st_size) < 128


def test_a_file_just_written_is_resident(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * 10_000)
    assert hotbytes.file_resident_ranges(path) == [(0, 10_000)]
    (tmp_path / "empty").write_bytes(b"")
    assert hotbytes.file_resident_ranges(tmp_path / "empty") == []


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_layer_costs_the_compressed_bytes_of_its_files_pages_in_the_page_cache(tmp_path: Path) -> None:
    rng = random.Random(5)
    read, unread = rng.randbytes(300_000), rng.randbytes(300_000)  # incompressible: 1 compressed byte each
    blob = tmp_path / "layer.tar.gz"
    _layer(blob, {"./lib/read.so": read, "./lib/unread.so": unread})
    lmap = hotbytes.build_layer_map(blob)
    root = tmp_path / "root"
    (root / "lib").mkdir(parents=True)
    for name, data in (("read.so", read), ("unread.so", unread)):
        (root / "lib" / name).write_bytes(data)
        _evict(root / "lib" / name)
    if hotbytes.file_resident_ranges(root / "lib" / "unread.so"):
        pytest.skip("this filesystem keeps a file's pages in memory (tmpfs)")
    assert (root / "lib" / "read.so").read_bytes() == read

    (layer,) = hotbytes.resident_layers([lmap], [root], ["sha256:layer"])

    assert (layer.digest, layer.files_read, layer.uncompressed_bytes) == ("sha256:layer", 1, len(read))
    assert layer.compressed_bytes == pytest.approx(len(read), rel=0.05)
    # The two files share one 1 MiB block: whole, it costs both; up to the last byte read, one.
    assert layer.block_bytes[1 << 20] == pytest.approx(len(read) + len(unread), rel=0.05)
    offset, _ = lmap.files["lib/read.so"]
    assert offset < lmap.files["lib/unread.so"][0]
    assert layer.prefix_bytes[1 << 20] == pytest.approx(len(read), rel=0.05)
