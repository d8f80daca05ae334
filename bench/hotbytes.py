"""The compressed bytes a training start truly reads: the input of the strict limit.

Not blocks, not whole files: the pages the start reads, mapped back to the
stretch of each layer's gzip stream that encodes them.

1. The warm node runs the start from the image unpacked on local disk
   (containerd's overlayfs snapshotter), after the page cache is dropped and
   with the disk's read-ahead off for that run (it is 8 MiB on these VMs and
   would count whole windows the start never asked for); three times, the
   largest count kept, as another process's cache drop can only lower one.
   The pages of each
   layer's files that are then resident (mincore) are what the start read:
   read() and mmap faults, at page granularity. Overlayfs reads a lower file
   through the lower file's own page cache, so each page is attributed to the
   layer whose copy the container saw.
2. Each layer blob is inflated once (cached under the image's cache dir):
   every regular file's offset in the uncompressed tar stream, and a map from
   uncompressed to compressed offsets sampled every MAP_STEP compressed bytes.
3. Each merged range of read tar bytes costs the compressed bytes between the
   map's (interpolated) offsets of its ends.

Left out: tar headers and directory metadata (every lazy format carries its
table of contents separately) and the decompressor's restart cost (a
checkpoint's window, a chunk boundary): what remains is the bytes no format
can avoid moving.

The same count for one start through bootseer's layer mount
(`measure_layer_mount`) gives what the kernel reads from a lazy image, its
read-ahead and the read-around of page faults included: the reads a
hot-block recording sees, and so the least a manifest of blocks can hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import json
import mmap
import os
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tests.harness.containerd import Containerd, CtrError
from tests.harness.oci import ImageLayout
from tests.harness.tree import drop_page_cache

# Compressed bytes between two samples of the offset map: the worst error of
# one range's end, averaged out by the interpolation.
MAP_STEP = 16 * 1024
MAP_FORMAT = 1
PAGE = mmap.PAGESIZE
# Spans whose cost the measurement reports next to the bytes read: what
# fetching whole blocks between checkpoints that far apart moves for the same
# reads (the span is the fetch unit bootseer's index is built with).
SIMULATED_SPANS = (4 << 20, 2 << 20, 1 << 20, 512 << 10, 256 << 10, 128 << 10)


# -- pure arithmetic (unit-tested) ---------------------------------------------


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open ranges, sorted, with overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def resident_ranges(vector: bytes, size: int, page: int = PAGE) -> list[tuple[int, int]]:
    """mincore's vector (one byte per page, bit 0 = resident) as byte ranges of a file of `size` bytes."""
    out: list[tuple[int, int]] = []
    start = None
    for i, flag in enumerate(vector):
        if flag & 1:
            if start is None:
                start = i
        elif start is not None:
            out.append((start * page, min(i * page, size)))
            start = None
    if start is not None:
        out.append((start * page, min(len(vector) * page, size)))
    return out


@dataclass(frozen=True)
class OffsetMap:
    """Uncompressed -> compressed offsets of one gzip stream, as sampled
    points (both columns non-decreasing), interpolated in between."""

    uncompressed: np.ndarray
    compressed: np.ndarray

    def compressed_at(self, offsets: np.ndarray) -> np.ndarray:
        result: np.ndarray = np.interp(offsets, self.uncompressed, self.compressed)
        return result

    def compressed_bytes(self, ranges: list[tuple[int, int]]) -> int:
        """The compressed bytes that encode the merged uncompressed `ranges`."""
        if not ranges:
            return 0
        ends = np.array(ranges, dtype=np.float64)
        return round(float(np.sum(self.compressed_at(ends[:, 1]) - self.compressed_at(ends[:, 0]))))

    def block_bytes(self, ranges: list[tuple[int, int]], span: int) -> int:
        """The compressed bytes of the `span`-sized blocks of the uncompressed
        stream that the merged `ranges` touch, each block whole. Checkpoints
        are taken as exactly `span` apart (zran takes each at the first
        deflate block boundary past that): the cost of fetching in blocks,
        before any read-ahead."""
        touched = sorted({k for start, end in ranges for k in range(start // span, (end - 1) // span + 1)})
        if not touched:
            return 0
        starts = np.array(touched, dtype=np.float64) * span
        ends = np.minimum(starts + span, float(self.uncompressed[-1]))
        return round(float(np.sum(self.compressed_at(ends) - self.compressed_at(starts))))

    def prefix_bytes(self, ranges: list[tuple[int, int]], span: int) -> int:
        """Like block_bytes, but each touched block costs only the compressed
        bytes from its checkpoint to the last byte read in it: what fetching
        a block no further than a read needs would move (inflating starts at
        the checkpoint, so the bytes before a read in the block stay)."""
        last: dict[int, int] = {}
        for start, end in ranges:
            for k in range(start // span, (end - 1) // span + 1):
                last[k] = max(last.get(k, 0), min(end, (k + 1) * span))
        if not last:
            return 0
        starts = np.array(sorted(last), dtype=np.float64) * span
        ends = np.array([last[k] for k in sorted(last)], dtype=np.float64)
        return round(float(np.sum(self.compressed_at(ends) - self.compressed_at(starts))))


# -- one layer's map, cached ---------------------------------------------------


@dataclass(frozen=True)
class LayerMap:
    offsets: OffsetMap
    # path inside the layer -> (offset of the file's data in the tar stream, size)
    files: dict[str, tuple[int, int]]


class _Inflating(io.RawIOBase):
    """A gzip blob read as its uncompressed stream, sampling the offset map as it goes."""

    def __init__(self, raw: io.BufferedReader) -> None:
        self.raw = raw
        self.inflater = zlib.decompressobj(wbits=31)
        self.pending = b""
        self.total_in = 0
        self.total_out = 0
        self.points: list[tuple[int, int]] = [(0, 0)]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self.pending:
            chunk = self.raw.read(MAP_STEP)
            if not chunk:
                return 0
            data = []
            while chunk:
                out = self.inflater.decompress(chunk)
                data.append(out)
                self.total_out += len(out)
                if not self.inflater.eof:
                    self.total_in += len(chunk)
                    break
                rest = self.inflater.unused_data
                self.total_in += len(chunk) - len(rest)
                if not rest.strip(b"\0"):
                    break  # padding after the last member
                # A multi-member gzip: the next member starts where this one ended.
                self.inflater = zlib.decompressobj(wbits=31)
                chunk = rest
            self.points.append((self.total_out, self.total_in))
            self.pending = b"".join(data)
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n


def _normalise(name: str) -> str:
    return os.path.normpath("/" + name).lstrip("/")


def build_layer_map(blob: Path) -> LayerMap:
    files: dict[str, tuple[int, int]] = {}
    with open(blob, "rb") as raw:
        stream = _Inflating(raw)
        with tarfile.open(fileobj=io.BufferedReader(stream, 1 << 20), mode="r|") as tar:
            for member in tar:
                if member.isreg():
                    files[_normalise(member.name)] = (member.offset_data, member.size)
        points = np.array(stream.points, dtype=np.int64)
    return LayerMap(OffsetMap(points[:, 0], points[:, 1]), files)


def layer_map(blob: Path, cache: Path) -> LayerMap:
    """`build_layer_map`, cached by the blob's name (its digest) under `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    arrays, names = cache / f"{blob.name}.v{MAP_FORMAT}.npz", cache / f"{blob.name}.v{MAP_FORMAT}.json"
    if arrays.exists() and names.exists():
        with np.load(arrays) as data:
            offsets = OffsetMap(data["uncompressed"], data["compressed"])
        files = {k: (v[0], v[1]) for k, v in json.loads(names.read_text()).items()}
        return LayerMap(offsets, files)
    built = build_layer_map(blob)
    tmp = arrays.with_suffix(".tmp.npz")
    np.savez(tmp, uncompressed=built.offsets.uncompressed, compressed=built.offsets.compressed)
    names.write_text(json.dumps(built.files))
    tmp.rename(arrays)
    return built


# -- page-cache residency ------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
MAP_FAILED = ctypes.c_void_p(-1).value


def file_resident_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of `path` in the page cache. Mapping a file does not read
    it, and mincore reports the file's pages whoever read them."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return []
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vector = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if _libc.mincore(addr, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return resident_ranges(vector.raw, size)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _read_ahead_knob(path: Path) -> Path | None:
    """The read_ahead_kb of the filesystem holding `path`: its block
    device's queue, or, where it has none (FUSE), its backing device info."""
    st_dev = os.stat(path).st_dev
    dev = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    node = Path(f"/sys/dev/block/{dev}")
    if node.exists():
        # A partition's queue settings are its disk's.
        knob = (node / "queue" if (node / "queue").exists() else node.resolve().parent / "queue") / "read_ahead_kb"
    else:
        knob = Path(f"/sys/class/bdi/{dev}/read_ahead_kb")
    return knob if knob.exists() else None


class _ReadAheadOff:
    """The block device under `path` with read-ahead 0 for the duration;
    restored after (a device setting, so as short as possible)."""

    def __init__(self, path: Path) -> None:
        self.knob = _read_ahead_knob(path)
        self.saved = ""

    def __enter__(self) -> _ReadAheadOff:
        if self.knob is not None:
            self.saved = self.knob.read_text().strip()
            self.knob.write_text("0\n")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.knob is not None:
            self.knob.write_text(self.saved + "\n")


# -- the measurement -----------------------------------------------------------


@dataclass(frozen=True)
class LayerHot:
    digest: str
    files_read: int
    uncompressed_bytes: int
    compressed_bytes: int
    # span -> compressed bytes of the blocks of that span the reads touch (OffsetMap.block_bytes)
    block_bytes: dict[int, int]
    # span -> the same blocks each fetched only up to its last byte read (OffsetMap.prefix_bytes)
    prefix_bytes: dict[int, int]


@dataclass(frozen=True)
class HotBytes:
    compressed_bytes: int
    uncompressed_bytes: int
    layers: tuple[LayerHot, ...]
    # span -> the layers' block_bytes summed: what block-granular fetching at that span moves
    block_bytes: dict[int, int]
    # span -> the layers' prefix_bytes summed: what fetching blocks only as far as reads need moves
    prefix_bytes: dict[int, int]
    samples_compressed_bytes: tuple[int, ...]  # one per measured start; the largest is reported
    read_ahead_kb: str  # the read-ahead the start ran with ("n/a": not known)
    seconds: float

    def describe(self) -> dict[str, object]:
        return asdict(self)


def _lower_dirs(c: Containerd, layout: ImageLayout, snapshotter: str = "overlayfs") -> list[Path]:
    """Each layer's directory in `snapshotter`'s mounts of the image, bottom
    first: unpacked on disk for overlayfs, in the layer mount for bootseer."""
    key = f"hotbytes-view-{os.getpid()}"
    out = c.ctr("snapshots", "--snapshotter", snapshotter, "view", "--mounts", key, layout.chain_ids[-1]).stdout
    try:
        mounts = json.loads(out)
    finally:
        try:
            c.ctr("snapshots", "--snapshotter", snapshotter, "rm", key)
        except CtrError as exc:
            # containerd's garbage collector may have taken the unleased view already.
            if "not found" not in exc.result.stderr:
                raise
    mount = {k.lower(): v for k, v in mounts[0].items()}
    lower = [o.removeprefix("lowerdir=") for o in mount.get("options") or [] if o.startswith("lowerdir=")]
    dirs = [Path(d) for d in lower[0].split(":")][::-1] if lower else [Path(mount["source"])]
    if len(dirs) != len(layout.layer_digests):
        raise RuntimeError(f"expected {len(layout.layer_digests)} layer directories, got {dirs}")
    return dirs


def _maps(layout: ImageLayout, cache: Path, log: Callable[[str], None]) -> list[LayerMap]:
    blobs = layout.directory / "blobs" / "sha256"
    maps = []
    for digest in layout.layer_digests:
        started = time.monotonic()
        maps.append(layer_map(blobs / digest.removeprefix("sha256:"), cache))
        if time.monotonic() - started > 1:
            log(f"mapped layer {digest[:19]} in {time.monotonic() - started:.1f} s")
    return maps


def _summed(samples: list[list[LayerHot]], read_ahead_kb: str, started: float) -> HotBytes:
    # Page-cache drops by other work on the machine (tests, other benchmarks)
    # can only lower a sample, and nothing else reads these files: the largest is the truest.
    layers = max(samples, key=lambda ls: sum(layer.compressed_bytes for layer in ls))
    return HotBytes(
        compressed_bytes=sum(layer.compressed_bytes for layer in layers),
        uncompressed_bytes=sum(layer.uncompressed_bytes for layer in layers),
        layers=tuple(layers),
        block_bytes={span: sum(layer.block_bytes[span] for layer in layers) for span in SIMULATED_SPANS},
        prefix_bytes={span: sum(layer.prefix_bytes[span] for layer in layers) for span in SIMULATED_SPANS},
        samples_compressed_bytes=tuple(sum(layer.compressed_bytes for layer in ls) for ls in samples),
        read_ahead_kb=read_ahead_kb,
        seconds=round(time.monotonic() - started, 2),
    )


def measure(
    c: Containerd,
    ref: str,
    layout: ImageLayout,
    run: Callable[[], object],
    cache: Path,
    log: Callable[[str], None],
    repeats: int = 3,
) -> HotBytes:
    """Run the start `repeats` times (`run`, against `c`, which holds `ref`
    unpacked into overlayfs) and count what it read, per layer, in compressed bytes."""
    maps = _maps(layout, cache, log)
    dirs = _lower_dirs(c, layout)
    started = time.monotonic()
    samples = []
    for _ in range(repeats):
        drop_page_cache()
        with _ReadAheadOff(dirs[0]):
            run()
        samples.append(resident_layers(maps, dirs, layout.layer_digests))
    return _summed(samples, "0" if _read_ahead_knob(dirs[0]) is not None else "n/a", started)


def measure_layer_mount(
    c: Containerd, layout: ImageLayout, run: Callable[[], object], cache: Path, log: Callable[[str], None]
) -> HotBytes:
    """The same count for one start through bootseer's layer mount (`run`,
    against `c`, which holds the image pulled by `bootseer pull` with
    unpacking off): what the kernel asks the layer server for, its
    read-ahead and its read-around of each page fault included. The hot-block
    recording sees these reads, so they, not the pages the start uses, are
    what a manifest of blocks can be no smaller than. The layer mount keeps
    what it served in the page cache (FOPEN_KEEP_CACHE), which the mapping
    of each file then finds."""
    maps = _maps(layout, cache, log)
    dirs = _lower_dirs(c, layout, "bootseer")
    started = time.monotonic()
    drop_page_cache()
    run()
    return _summed([resident_layers(maps, dirs, layout.layer_digests)], device_read_ahead_kb(dirs[-1]), started)


def resident_layers(maps: list[LayerMap], dirs: list[Path], digests: Sequence[str]) -> list[LayerHot]:
    """Each layer's files (`maps`) under its directory (`dirs`) as what of
    them is in the page cache: tar ranges, priced in compressed bytes."""
    layers = []
    for digest, lmap, root in zip(digests, maps, dirs, strict=True):
        ranges: list[tuple[int, int]] = []
        files = 0
        for name, (offset, size) in lmap.files.items():
            try:
                read = file_resident_ranges(root / name)
            except OSError:
                continue  # a symlinked parent or a vanished file: nothing the start could read here
            if read:
                files += 1
                ranges += [(offset + a, offset + min(b, size)) for a, b in read]
        merged = merge(ranges)
        blocks = {span: lmap.offsets.block_bytes(merged, span) for span in SIMULATED_SPANS}
        prefixes = {span: lmap.offsets.prefix_bytes(merged, span) for span in SIMULATED_SPANS}
        layers.append(
            LayerHot(
                digest, files, sum(b - a for a, b in merged), lmap.offsets.compressed_bytes(merged), blocks, prefixes
            )
        )
    return layers


def device_read_ahead_kb(path: Path) -> str:
    """For the record: the read-ahead of the filesystem holding `path`."""
    knob = _read_ahead_knob(path)
    return knob.read_text().strip() if knob is not None else "n/a"
