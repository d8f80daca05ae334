"""The layer mount's filesystem: the mount's root lists every layer in the layer
store by name; each layer directory is that layer's tree, read-only.

Inode numbers: the mount root is 1; a layer copy given slot S owns inodes
S << 32 | n for its tree's inode n, so hardlinks within a layer share an
inode and layers never collide. A copy keeps its slot for as long as the
store holds it, across unloads and across layer-server processes
(fs/slots.py), so every inode number the kernel holds keeps its meaning.

Bounded memory: a layer no mount uses (no overlay lowerdir or bind mount in
the server's mount namespace names it) and no request touched for
`[fs] unload_idle_s` is unloaded: tree, index, reader and cache file
descriptor. The kernel may still hold its inode numbers (cached dentries,
open files, an overlay in another mount namespace): a request on one loads
the copy again into the same slot, and since the tree of an index is always
built the same, every inode number means what it meant. So unloading is
always correct; the signal only decides how often a reload is paid.

A layer's index may be decoded before its load (a lookup of `.open-<layer>`,
fs/control.py, which the snapshotter sends as soon as it has stored the
index) and its tree built: the load, in the layer's Prepare, then only
gives them a slot. A reader so opened whose layer is not loaded within
OPENED_ALONE_S, or that the store no longer holds, is closed at a sweep.

Pruned layers (removed from the store by the snapshotter's cleanup) are
closed at the next sweep, every SWEEP_S: their cache files' space goes back
to the filesystem, which `df` and statfs show.

Layers are untrusted input. Any request that fails other than with a
FUSEError answers EIO and leaves its layer broken: every later request on
that layer answers EIO at once, while the mount and the other layers carry on.

What the kernel keeps, since a layer copy never changes: names, attributes
and negative lookups inside layers (an hour), listings (directories are
opened without OPENDIR), file pages across opens (files are opened without
OPEN); each entry of a listing comes with its attributes (READDIRPLUS). The
mount root is asked every time (layers come and go there, and its control
names are messages), its listing kept only while the store's mtime stays.
The kernel does not keep xattrs: overlayfs's probes (trusted.overlay.*,
one per lower file and directory it finds) reach us, answered from the tree.

A request on a loaded layer that needs no waiting (lookup, getattr,
readlink, getxattr, listxattr, and a read of cached blocks whose bytes are
in the page cache) is answered in the session's read loop by the op's
`*_now` method; the root, an unloaded layer, a read that must fetch or
touch the disk and every other op go to the async methods as tasks.

Every request is timed (bootseer_fs_op_seconds{op}) in the same wrapper,
and counted by opcode in the engine (bootseer_fs_fuse_requests_total).
statfs answers the layer store's filesystem: what kubelet sees of the image
filesystem, and what its image garbage collection goes by.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gc
import os
import re
import stat
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import structlog
import trio

from snapshotter.fs import fusewire as fuse
from snapshotter.fs import metrics
from snapshotter.fs.background import BackgroundFetch
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.control import CONTROL_PREFIX, OPEN_PREFIX, ImageRequest, read_request
from snapshotter.fs.eviction import BlockCache
from snapshotter.fs.layers import LayerSource, LayerStore, copy_key, layer_name
from snapshotter.fs.reader import BlockUnavailable, LayerReader, Origin, RangeFetcher
from snapshotter.fs.slots import SlotTable
from snapshotter.fs.unpacker import Unpacker
from snapshotter.layer.tree import ROOT, LayerTree, Node, build_tree

log = structlog.get_logger("bootseer.fs")

SLOT_SHIFT = 32
# Layers never change, so the kernel may cache names and attributes for long.
TIMEOUT = 3600.0
BLOCK_SIZE = 4096
# Every listing starts with "." and "..", at offsets 1 and 2.
DOTS = 2

_P = ParamSpec("_P")
_R = TypeVar("_R")

_clock_ns = time.perf_counter_ns

# How often loaded layers are checked against the store (pruned ones
# closed), for idleness, and the cache against its cap.
SWEEP_S = 2.0
# Without unloading (unload_idle_s = 0) a layer counts as used by a
# container, for eviction's order, this long after its last request.
IN_USE_S = 300.0
# A statfs answer is given again, in the read loop, for this long: kubelet
# polls the image filesystem every 10 s, a container start asks a dozen
# times within a second.
STATFS_FRESH_S = 1.0
# How often the block index learns when blocks were last read.
LAST_READS_S = 60.0
# A reader opened ahead of its layer's load (fs/control.py, OPEN_PREFIX) is
# closed once idle this long with the layer still not loaded: the Prepares
# of one pull come within seconds, so its layer was not served after all.
OPENED_ALONE_S = 120.0

# A lookup's "no such name", cached by the kernel for TIMEOUT (inode 0).
# Made once: every field of an answer is checked as it is set, and most of
# a start's lookups are these (overlayfs probes each layer for each name).
_NEGATIVE_ENTRY = fuse.EntryAttributes(entry_timeout=TIMEOUT, attr_timeout=0)

_LAYER_ROOT = re.compile(r"/([0-9a-f]{64})(?:/|$)")
_LAYER_NAME = re.compile(r"[0-9a-f]{64}")


def mounted_layers(mountpoints: Sequence[Path]) -> set[str]:
    """Layers some mount in this mount namespace uses: an overlay's lower
    directory in one of `mountpoints` (lowerdir=MOUNTPOINT/<layer>:..., or
    the snapshotter's link to it, which is what its overlays name) or a
    bind mount from a layer mount (a view of one layer: a FUSE mount whose
    root is /<layer>). Links are read, never followed: a stat through a
    layer mount could wait for this very server."""
    prefixes = "|".join(re.escape(str(m).rstrip("/") + "/") for m in mountpoints)
    named = re.compile(f"(?:{prefixes})" + r"([0-9a-f]{64})")
    layers: set[str] = set()
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            layers.update(named.findall(line))
            fields = line.split(" - ", 1)
            if len(fields) != 2:
                continue
            if fields[1].startswith("overlay "):
                for lower in _lowerdirs(fields[1]):
                    with contextlib.suppress(OSError):
                        layers.update(named.findall(os.readlink(lower)))
            elif fields[1].startswith("fuse"):
                root = _LAYER_ROOT.match(fields[0].split()[3])
                if root is not None:
                    layers.add(root.group(1))
    return layers


def _lowerdirs(fs_fields: str) -> list[str]:
    """The lower directories an overlay's mountinfo options name."""
    parts = fs_fields.split()
    options = parts[2].split(",") if len(parts) > 2 else []
    lowers = [d for o in options if o.startswith("lowerdir=") for d in o.removeprefix("lowerdir=").split(":")]
    return lowers + [o.removeprefix("lowerdir+=") for o in options if o.startswith("lowerdir+=")]


def _release_memory() -> None:
    """Hand what unloaded layers held back to the system: Python frees
    their objects, glibc keeps the pages unless asked."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class BlockEvents(Protocol):
    """Who hears about reads and image requests (the hot-block tracker)."""

    def access(self, layer: str, block: int, extent: int) -> None:
        """A read reached `extent` bytes into `block` of `layer`."""

    def records(self, layer: str) -> bool:
        """Whether a recording under way reads `layer`."""

    async def notify(self, name: str, request: ImageRequest | None = None) -> None:
        """Image `name`'s request file was written; `request`: as read just now."""

    async def covers(self, layer: str) -> bool:
        """Whether a hot-block manifest says what a start reads of `layer`."""


@dataclass
class _Layer:
    slot: int
    name: str
    generation: str
    tree: LayerTree
    reader: LayerReader
    store: LayerStore
    root_attr: fuse.EntryAttributes
    # The parent of every directory but the layer's root, for "..".
    parents: dict[int, int]
    broken: bool = False
    # Cleared when unloaded: work for it is dropped (a reload is another _Layer).
    loaded: bool = True
    # time.monotonic() of the last request seen by a sweep, and whether one
    # came since.
    last_used: float = field(default_factory=time.monotonic)
    touched: bool = False
    loaded_at: float = field(default_factory=time.monotonic)
    # A container uses it (a mount names it, or a request came lately):
    # its blocks are evicted after those of layers nobody uses.
    in_use: bool = True

    @property
    def current(self) -> bool:
        """Still loaded and the copy the store holds (not removed or
        replaced), and not broken: nothing more is fetched for a copy no
        reader can use."""
        return self.loaded and not self.broken and self.store.generation(self.name) == self.generation


@dataclass
class _Opened:
    """A layer copy's reader and tree, made from the stored index ahead of
    the layer's load (which then only gives them a slot)."""

    name: str
    generation: str
    reader: LayerReader
    tree: LayerTree
    parents: dict[int, int]
    opened_at: float = field(default_factory=time.monotonic)


def _parents(tree: LayerTree) -> dict[int, int]:
    """The parent of every directory but the root, for ".."."""
    return {
        child: ino
        for ino, node in tree.nodes.items()
        if node.children
        for child in node.children.values()
        if tree.nodes[child].is_dir
    }


def _guarded(
    op: Callable[Concatenate[LayerFS, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[LayerFS, _P], Coroutine[Any, Any, _R]]:
    """A FUSE handler whose unexpected errors answer EIO and mark the
    request's layer broken, with a log line and a metric (the engine would
    answer EIO too, but knows nothing of layers). Only Exception is caught: cancellation (trio.Cancelled, alone or in a
    BaseExceptionGroup) and KeyboardInterrupt must reach trio. Timed,
    errors and all, into the op's histogram, resolved here once: the clock
    and the count cost about 0.25 us a request (a prometheus_client
    Histogram would cost about 0.75 us)."""
    times = metrics.OP_SECONDS.labels(op.__name__)

    async def handler(self: LayerFS, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        began = self.last_request_ns = _clock_ns()
        try:
            return await op(self, *args, **kwargs)
        except fuse.FUSEError:
            raise
        except Exception as exc:
            self._request_failed(op.__name__, args, exc)
            raise fuse.FUSEError(errno.EIO) from None
        finally:
            times.observe_ns(_clock_ns() - began)

    functools.update_wrapper(handler, op)
    return handler


def _guarded_now(
    op: Callable[Concatenate[LayerFS, _P], _R],
) -> Callable[Concatenate[LayerFS, _P], _R]:
    """_guarded for a `*_now` method, counted and timed as its async op
    (`lookup_now` as `lookup`). NotNow passes untimed: the async op that
    answers the request times it."""
    name = op.__name__.removesuffix("_now")
    times = metrics.OP_SECONDS.labels(name)

    def handler(self: LayerFS, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        began = self.last_request_ns = _clock_ns()
        try:
            result = op(self, *args, **kwargs)
        except (fuse.FUSEError, fuse.NotNow):
            raise
        except Exception as exc:
            self._request_failed(name, args, exc)
            raise fuse.FUSEError(errno.EIO) from None
        times.observe_ns(_clock_ns() - began)
        return result

    functools.update_wrapper(handler, op)
    return handler


def _guarded_forget(
    op: Callable[[LayerFS, Sequence[tuple[int, int]]], Coroutine[Any, Any, None]],
) -> Callable[[LayerFS, Sequence[tuple[int, int]]], Coroutine[Any, Any, None]]:
    """forget has no reply: any error there, even a FUSEError, is only
    logged and counted."""
    times = metrics.OP_SECONDS.labels(op.__name__)

    async def handler(self: LayerFS, inode_list: Sequence[tuple[int, int]]) -> None:
        began = _clock_ns()
        try:
            await op(self, inode_list)
        except Exception as exc:
            self._request_failed(op.__name__, (inode_list,), exc)
        finally:
            times.observe_ns(_clock_ns() - began)

    functools.update_wrapper(handler, op)
    return handler


def _target(node: Node) -> bytes:
    if not stat.S_ISLNK(node.mode):
        raise fuse.FUSEError(errno.EINVAL)
    return node.target


def _xattr(node: Node, name: bytes) -> bytes:
    value = node.xattrs.get(os.fsdecode(name))
    if value is None:
        raise fuse.FUSEError(errno.ENODATA)
    return value


def _xattr_names(node: Node) -> list[bytes]:
    return [os.fsencode(k) for k in node.xattrs]


def _reply_dots(
    token: fuse.ReaddirToken, start_id: int, this: fuse.EntryAttributes, parent: fuse.EntryAttributes
) -> bool:
    for n, (name, attr) in enumerate(((b".", this), (b"..", parent))[start_id:], start_id + 1):
        if not fuse.readdir_reply(token, name, attr, n):
            return False
    return True


def entry_attributes(slot: int, node: Node) -> fuse.EntryAttributes:
    """The stat the kernel gets for `node` of the layer in `slot`."""
    # Every field at once: each assignment is checked (a lookup makes one of these).
    mtime_ns = node.mtime_ns
    return fuse.EntryAttributes(
        st_ino=(slot << SLOT_SHIFT) | node.ino,
        entry_timeout=TIMEOUT,
        attr_timeout=TIMEOUT,
        st_mode=node.mode,
        st_nlink=node.nlink,
        st_uid=node.uid,
        st_gid=node.gid,
        st_rdev=node.rdev,
        st_size=node.size,
        st_blksize=BLOCK_SIZE,
        st_blocks=(node.size + 511) // 512,
        st_atime_ns=mtime_ns,
        st_mtime_ns=mtime_ns,
        st_ctime_ns=mtime_ns,
    )


class LayerFS(fuse.Operations):
    def __init__(
        self,
        store: LayerStore,
        block_index: BlockIndex,
        fetcher_for: Callable[[LayerSource], RangeFetcher],
        max_parallel_fetches: int = 8,
        prefetch_parallel: int = 4,
        background_bandwidth: int = 0,
        whole_layer_bytes: int = 0,
        cache_max_bytes: int = 0,
        unload_idle_s: float = 0.0,
        mountpoints: Sequence[Path] = (),
        unpack_whole_layers: bool = False,
        blocks_after_miss: int = 0,
    ) -> None:
        """`cache_max_bytes`: the block cache's cap (0: none). `unload_idle_s`:
        unload layers no mount uses after this long without a request (0:
        never). `mountpoints`: where the layer mount and its plain twin
        are, to tell which layers mounts use. `unpack_whole_layers`: write a layer out as a
        local directory once every block of it is cached (fs/unpack.py).
        `blocks_after_miss`: blocks fetched after a miss (`[fs]`'s)."""
        super().__init__()
        self.store = store
        self.block_index = block_index
        self.fetcher_for = fetcher_for
        self.layers_by_name: dict[str, _Layer] = {}
        self.layers_by_slot: dict[int, _Layer] = {}
        self.layers_by_copy: dict[str, _Layer] = {}
        # Every copy's slot, loaded or not, kept in the store across restarts.
        self.slots = SlotTable.load(store.slots_path)
        # Slots of copies unloaded while the store still holds them: slot ->
        # (name, generation). A request on one of their inodes reloads them.
        # At start that is every copy an earlier process gave a slot: the
        # kernel may hold their inode numbers still.
        self.unloaded: dict[int, tuple[str, str]] = {}
        for name, generation, slot in self.slots.copies():
            if store.generation(name) == generation:
                self.unloaded[slot] = (name, generation)
            else:
                self.slots.drop(name, generation)
        self.unload_idle_s = unload_idle_s
        self.mountpoints = tuple(mountpoints)
        # The store's entries as the last sweep saw them: name -> ((inode,
        # ctime), generation), so unchanged layers' source files are not read.
        self._identities: dict[str, tuple[tuple[int, int], str | None]] = {}
        self._last_reads_at = time.monotonic()
        # Copies (name -> generation) that failed to load: not tried again
        # until the store holds another copy.
        self.unloadable: dict[str, str] = {}
        self.limiter = trio.CapacityLimiter(max_parallel_fetches)
        self.prefetch_limiter = trio.CapacityLimiter(prefetch_parallel)
        self.background_limiter = trio.CapacityLimiter(1)
        # As many threads decode prefetched blocks as fetch them: fewer let a
        # start overtake its prefetch on two cores, more take the CPU the
        # container's own start needs (LayerReader.prefetch_decode_limiter).
        self.prefetch_decode_limiter = trio.CapacityLimiter(prefetch_parallel)
        # Whole layers fetched in the background when a bandwidth is given.
        self.background = BackgroundFetch(background_bandwidth, self.limiter) if background_bandwidth > 0 else None
        # When the last FUSE request came (_clock_ns): unpacking waits for a quiet mount.
        self.last_request_ns = _clock_ns()
        self.unpacker = Unpacker(store, lambda: self.last_request_ns) if unpack_whole_layers else None
        # Layers this small (compressed) are fetched whole once loaded.
        self.whole_layer_bytes = whole_layer_bytes
        self.blocks_after_miss = blocks_after_miss
        self.load_lock = trio.Lock()
        # Readers opened ahead of their layer's load, by copy (_Opened), and
        # the copies whose reader is being opened: a load waits for one under
        # way, so an index is decoded once, and a big layer's decoding holds
        # up no other layer's load.
        self.opened: dict[str, _Opened] = {}
        self._opening: dict[str, trio.Event] = {}
        self.cache = BlockCache(store, block_index, cache_max_bytes, self.load_lock, self._copy_in_use)
        self.cache.load()
        if self.background is not None:
            self.background.cache = self.cache
        self.events: BlockEvents | None = None
        # Which image each layer's fetched bytes count for, from the image requests.
        self.image_bytes = metrics.ImageBytes()
        # Set while the layer store's filesystem cannot answer statfs (logged once).
        self.statfs_error: str | None = None
        # The last statfs answer and when it was made (time.monotonic()).
        self._statfs: tuple[float, fuse.StatvfsData] | None = None

    def _access(self, layer: str, block: int, extent: int) -> None:
        if self.events is not None:
            self.events.access(layer, block, extent)

    def _records(self, layer: str) -> bool:
        return self.events is not None and self.events.records(layer)

    async def layer_for_digest(self, digest: str) -> _Layer | None:
        try:
            return await self._layer(layer_name(digest))
        except fuse.FUSEError:
            # A broken copy: nothing to prefetch into or record from.
            return None

    def _request_failed(self, op: str, args: tuple[object, ...], exc: Exception) -> None:
        # Requests on the mount root (slot 0), statfs and forget concern no
        # single layer.
        inode = args[0] if args else None
        layer = self.layers_by_slot.get(inode >> SLOT_SHIFT) if isinstance(inode, int) else None
        if layer is not None:
            layer.broken = True
        metrics.HANDLER_ERRORS.labels(op).inc()
        log.error(
            "FUSE request failed; answering EIO, and EIO for its layer from now on",
            op=op,
            layer=layer.name if layer is not None else None,
            error=repr(exc),
            exc_info=exc,
        )

    # -- layers -------------------------------------------------------------

    async def _layer(self, name: str) -> _Layer | None:
        """The layer `name` as the store holds it now: loaded on first use,
        loaded again if it was removed and added back (a new generation).
        None if the store does not hold it; EIO if this copy is broken."""
        generation = await trio.to_thread.run_sync(self.store.generation, name)
        if generation is None:
            return None
        layer = self.layers_by_name.get(name)
        if layer is None or layer.generation != generation:
            async with self.load_lock:
                layer = self.layers_by_name.get(name)
                if layer is None or layer.generation != generation:
                    layer = await self._load_copy(name, generation)
        if layer.broken:
            raise fuse.FUSEError(errno.EIO)
        return layer

    async def _load_copy(self, name: str, generation: str) -> _Layer:
        # Loading is reached from outside FUSE requests too (the hot-block
        # tracker), and a hostile index may be costly to decode: a copy that
        # cannot be loaded is remembered, not tried on every lookup.
        if self.unloadable.get(name) == generation:
            raise fuse.FUSEError(errno.EIO)
        opened = None
        try:
            opened = await self._open(name, generation)
            layer = await trio.to_thread.run_sync(self._load, opened)
            self._register(layer)
        except Exception as exc:
            if opened is not None:
                self._close_opened(opened)
            self._refuse(name, generation, exc)
            raise fuse.FUSEError(errno.EIO) from None
        layer.reader.on_whole = functools.partial(self._whole, layer)
        if layer.reader.all_cached:
            self._whole(layer)
        elif layer.reader.index.compressed_size <= self.whole_layer_bytes:
            trio.lowlevel.spawn_system_task(self._fetch_whole, layer)
        elif self.background is not None:
            self.background.add(layer)
        return layer

    def _refuse(self, name: str, generation: str, exc: Exception) -> None:
        """Copy `generation` of `name` cannot be loaded: remembered, so that
        a hostile index is not decoded again on every lookup or open ahead."""
        if self.unloadable.get(name) == generation:
            return
        self.unloadable[name] = generation
        metrics.LAYER_LOAD_ERRORS.inc()
        log.error(
            "layer cannot be loaded; it answers EIO until the store holds another copy",
            layer=name,
            error=repr(exc),
            exc_info=exc,
        )

    def _whole(self, layer: _Layer) -> None:
        """Every block of `layer` is cached (at load, or as its last block lands)."""
        if self.unpacker is not None:
            self.unpacker.add(layer)

    async def _fetch_whole(self, layer: _Layer) -> None:
        """A small layer costs a few Range requests whole, against a miss per
        file read (base images, interpreters, the app itself). Not a layer a
        hot-block manifest covers: its prefetch brings what a start reads,
        and the rest of the layer would be bytes no start was seen to need."""
        if self.events is not None and await self.events.covers(layer.reader.index.layer_digest):
            log.info("small layer left to its hot-block manifest, not fetched whole", layer=layer.name)
            return
        try:
            await layer.reader.ensure(range(len(layer.reader.index.blocks)), Origin.READAHEAD)
        except BlockUnavailable as exc:
            log.warning(
                "could not fetch a small layer whole; its reads fetch what they need", layer=layer.name, error=str(exc)
            )

    def _slot(self, name: str, generation: str) -> int:
        """The slot of a copy: the one it had if it was loaded before, by
        this process or an earlier one. Only under the load lock."""
        return self.slots.assign(name, generation)

    async def _open(self, name: str, generation: str) -> _Opened:
        """The reader of copy `generation` of layer `name`: the one opened
        already, else opened now from the stored index (decoded in a
        thread). Raises if the index cannot be read or the store holds
        another copy by now."""
        key = copy_key(name, generation)
        while True:
            opened = self.opened.get(key)
            if opened is not None and not opened.reader.closed:
                return opened
            loaded = self.layers_by_copy.get(key)
            if loaded is not None and loaded.loaded:
                # Loaded while this waited: its reader and tree it is.
                return _Opened(name, generation, loaded.reader, loaded.tree, loaded.parents)
            if self.unloadable.get(name) == generation:
                raise ValueError(f"layer {name} cannot be loaded (see the first error logged for it)")
            pending = self._opening.get(key)
            if pending is None:
                break
            await pending.wait()
        self._opening[key] = done = trio.Event()
        try:
            opened = self.opened[key] = await trio.to_thread.run_sync(self._opened_copy, name, generation)
            self.cache.attach(key, opened.reader)
            return opened
        finally:
            del self._opening[key]
            done.set()

    def _opened_copy(self, name: str, generation: str) -> _Opened:
        """In a thread: the store's copy of `name`, which must be copy
        `generation`, decoded, with its reader (which opens the cache file
        and reads the block index) and its tree. Ahead of the layer's load,
        which waits its turn behind the layers below: the tree of a big
        layer takes a tenth of a second, more while a prefetch runs."""
        reader = self._reader(name, generation)
        try:
            tree = build_tree(reader.index.entries)
            return _Opened(name, generation, reader, tree, _parents(tree))
        except BaseException:
            reader.close()
            raise

    def _reader(self, name: str, generation: str) -> LayerReader:
        index, source = self.store.load(name)
        if source.generation != generation:
            raise ValueError(f"the store holds another copy of layer {name} now")
        return LayerReader(
            name,
            source.cache_key,
            index,
            self.store.cache_path(name),
            self.block_index,
            self.fetcher_for(source),
            self.limiter,
            self.prefetch_limiter,
            self.background_limiter,
            self.prefetch_decode_limiter,
            self._access,
            self.image_bytes.fetched,
            self.cache,
            self.blocks_after_miss,
            self._records,
        )

    async def _open_ahead(self, name: str) -> None:
        """Open the store's copy of `name` ahead of its load (OPEN_PREFIX):
        its load, when its Prepare's turn comes, then only gives it a slot.
        A copy that cannot be opened is refused here as its load would (one
        already refused, or already loaded, _open leaves alone)."""
        generation = await trio.to_thread.run_sync(self.store.generation, name)
        if generation is None:
            return
        try:
            await self._open(name, generation)
        except Exception as exc:
            self._refuse(name, generation, exc)

    def _close_opened(self, opened: _Opened) -> None:
        key = copy_key(opened.name, opened.generation)
        if self.opened.get(key) is opened:
            del self.opened[key]
        if self.layers_by_copy.get(key) is None:
            self.cache.detach(key)
            opened.reader.close()

    def _register(self, layer: _Layer) -> None:
        self.opened.pop(layer.reader.cache_key, None)
        self.layers_by_name[layer.name] = layer
        self.layers_by_slot[layer.slot] = layer
        self.layers_by_copy[layer.reader.cache_key] = layer
        self.unloaded.pop(layer.slot, None)
        self.cache.attach(layer.reader.cache_key, layer.reader)
        metrics.LOADED_LAYERS.set(len(self.layers_by_slot))

    def _copy_in_use(self, copy: str) -> bool:
        layer = self.layers_by_copy.get(copy)
        return layer is not None and layer.in_use

    def _load(self, opened: _Opened) -> _Layer:
        """In a thread, under the load lock: the opened copy as a _Layer,
        not registered yet."""
        name, index, reader = opened.name, opened.reader.index, opened.reader
        slot = self._slot(name, opened.generation)
        root_attr = entry_attributes(slot, opened.tree.nodes[ROOT])
        # Layers come and go from the store: the kernel looks them up afresh each time.
        root_attr.entry_timeout = 0
        layer = _Layer(slot, name, opened.generation, opened.tree, reader, self.store, root_attr, opened.parents)
        log.info("layer loaded", layer=name, slot=slot, blocks=len(index.blocks), cached=len(reader.cached))
        return layer

    async def _resolve(self, inode: int) -> tuple[_Layer, Node]:
        if inode >> SLOT_SHIFT not in self.layers_by_slot:
            await self._reload(inode >> SLOT_SHIFT)
        return self._resolve_now(inode)

    def _resolve_now(self, inode: int) -> tuple[_Layer, Node]:
        """_resolve of a loaded layer's inode; NotNow if its layer must be loaded first."""
        layer = self.layers_by_slot.get(inode >> SLOT_SHIFT)
        if layer is None:
            raise fuse.NotNow
        node = layer.tree.nodes.get(inode & ((1 << SLOT_SHIFT) - 1))
        if node is None:
            raise fuse.FUSEError(errno.ENOENT)
        if layer.broken:
            raise fuse.FUSEError(errno.EIO)
        layer.touched = True
        return layer, node

    async def _reload(self, slot: int) -> None:
        """The copy in `slot`, unloaded while the kernel kept its inode
        numbers: loaded again into the same slot. ENOENT if the store no
        longer holds that copy (pruned, or replaced by another)."""
        copy = self.unloaded.get(slot)
        if copy is None:
            raise fuse.FUSEError(errno.ENOENT)
        layer = await self._layer(copy[0])
        if layer is None or layer.slot != slot:
            raise fuse.FUSEError(errno.ENOENT)
        log.debug("layer reloaded for a request on its inodes", layer=layer.name, slot=slot)

    # -- sweeps: pruned layers, idle layers, the cache cap -------------------

    async def maintain(self) -> None:
        """Sweep every SWEEP_S, for the server's life."""
        while True:
            await trio.sleep(SWEEP_S)
            try:
                await self.sweep()
            except Exception as exc:
                log.error("layer sweep failed; trying again at the next", error=repr(exc), exc_info=exc)

    async def sweep(self, unload_idle_s: float | None = None) -> None:
        """Close layers the store no longer holds; unload those no mount
        uses and no request touched for `unload_idle_s` (the configured
        one by default); evict down to the cache cap; tell the block index
        when blocks were read."""
        idle_s = self.unload_idle_s if unload_idle_s is None else unload_idle_s
        began = time.monotonic()
        generations = await trio.to_thread.run_sync(self._generations)
        now = time.monotonic()
        unloads = 0
        for layer in list(self.layers_by_slot.values()):
            if layer.loaded_at >= began:
                continue
            if generations.get(layer.name) != layer.generation:
                unloads += self._unload(layer, pruned=True)
                continue
            if layer.touched or layer.reader.touched:
                layer.last_used = now
                layer.touched = layer.reader.touched = False
        for slot, (name, generation) in list(self.unloaded.items()):
            if generations.get(name) != generation:
                del self.unloaded[slot]
                self.slots.drop(name, generation)
        for opened in list(self.opened.values()):
            if opened.opened_at >= began:
                continue
            pruned = generations.get(opened.name) != opened.generation
            if opened.reader.idle and (pruned or now - opened.opened_at >= OPENED_ALONE_S):
                self._close_opened(opened)
                unloads += 1
        for copy in list(self.cache.copies):
            if copy not in self.cache.readers and generations.get(copy[:64]) != copy[64:]:
                self.cache.forget_copy(copy)

        window = idle_s if idle_s > 0 else IN_USE_S
        stale = [layer for layer in self.layers_by_slot.values() if now - layer.last_used >= window]
        mounted: set[str] = set()
        if stale and self.mountpoints:
            mounted = await trio.to_thread.run_sync(mounted_layers, self.mountpoints)
        for layer in stale:
            if layer.name in mounted:
                # Looked at again a window from now, not every sweep.
                layer.last_used, layer.in_use = now, True
            elif idle_s > 0 and not layer.broken:
                unloads += self._unload(layer, pruned=False)
            else:
                layer.in_use = False
        for layer in self.layers_by_slot.values():
            if now - layer.last_used < window:
                layer.in_use = True
        if unloads:
            _release_memory()
        metrics.LOADED_LAYERS.set(len(self.layers_by_slot))

        await self.cache.trim()
        if now - self._last_reads_at >= LAST_READS_S:
            self._last_reads_at = now
            await trio.to_thread.run_sync(self.cache.write_last_reads, self.cache.touched(), int(time.time()))

    def _generations(self) -> dict[str, str]:
        """In a thread: the generation of every layer copy the store holds,
        reading a layer's source file only when its directory changed. The
        remembered entries are kept, not rebuilt, for unchanged layers:
        small objects made anew each sweep and kept until the next would
        pin the allocator's arenas that unloaded layers' trees leave empty."""
        try:
            entries = list(os.scandir(self.store.root))
        except FileNotFoundError:
            entries = []
        present = set()
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            present.add(entry.name)
            known = self._identities.get(entry.name)
            if known is None or known[0] != (st.st_ino, st.st_ctime_ns):
                self._identities[entry.name] = ((st.st_ino, st.st_ctime_ns), self.store.generation(entry.name))
        for name in [name for name in self._identities if name not in present]:
            del self._identities[name]
        return {name: generation for name, (_, generation) in self._identities.items() if generation is not None}

    def _unload(self, layer: _Layer, pruned: bool) -> bool:
        """Drop a loaded copy: tree, index, reader, cache file descriptor.
        An unloaded copy comes back on its next request; a pruned one is
        gone. Not while a read, fetch or eviction is under way on it (the
        next sweep tries again)."""
        if not layer.reader.idle:
            return False
        copy = layer.reader.cache_key
        layer.loaded = False
        del self.layers_by_slot[layer.slot]
        if self.layers_by_name.get(layer.name) is layer:
            del self.layers_by_name[layer.name]
        if self.layers_by_copy.get(copy) is layer:
            del self.layers_by_copy[copy]
        self.cache.detach(copy)
        layer.reader.close()
        if pruned:
            self.cache.forget_copy(copy)
            self.slots.drop(layer.name, layer.generation)
        else:
            self.unloaded[layer.slot] = (layer.name, layer.generation)
        metrics.LAYER_UNLOADS.labels("pruned" if pruned else "idle").inc()
        log.info("layer closed" if pruned else "layer unloaded", layer=layer.name, slot=layer.slot, pruned=pruned)
        return True

    # -- attributes ---------------------------------------------------------

    def _store_mtime_ns(self) -> int:
        try:
            return os.stat(self.store.root).st_mtime_ns
        except OSError:
            # No store yet (or gone): no layers to list.
            return 0

    def _root_attr(self) -> fuse.EntryAttributes:
        # The root's listing changes as layers arrive: do not let it be cached.
        return fuse.EntryAttributes(
            st_ino=fuse.ROOT_INODE,
            st_mode=stat.S_IFDIR | 0o755,
            st_nlink=2,
            st_blksize=BLOCK_SIZE,
            entry_timeout=0,
            attr_timeout=0,
        )

    def _root_getattr(self) -> fuse.EntryAttributes:
        attr = self._root_attr()
        # The store directory's mtime, which every layer added or removed
        # moves: the kernel keeps the root's listing (directories are opened
        # without OPENDIR, so every listing may be cached) only while this
        # stays, and asks it before each listing. A stat of a local
        # directory, in the loop: every path through the mount root asks it
        # first, and a thread hop queued behind a prefetch's decodes cost
        # the snapshotter's Prepares 5-60 ms each.
        attr.st_mtime_ns = self._store_mtime_ns()
        return attr

    @_guarded
    async def getattr(self, inode: int, ctx: fuse.RequestContext | None = None) -> fuse.EntryAttributes:
        if inode == fuse.ROOT_INODE:
            return self._root_getattr()
        layer, node = await self._resolve(inode)
        return entry_attributes(layer.slot, node)

    @_guarded_now
    def getattr_now(self, inode: int, ctx: fuse.RequestContext | None = None) -> fuse.EntryAttributes:
        if inode == fuse.ROOT_INODE:
            return self._root_getattr()
        layer, node = self._resolve_now(inode)
        return entry_attributes(layer.slot, node)

    @_guarded
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: fuse.RequestContext | None = None
    ) -> fuse.EntryAttributes:
        if parent_inode == fuse.ROOT_INODE:
            text = os.fsdecode(name)
            if text.startswith(CONTROL_PREFIX):
                # A control lookup: the snapshotter or `bootseer record` wrote
                # an image request; ENOENT tells them it has been read. A
                # small file the snapshotter has just written: quicker read
                # here than with a thread hop, and the snapshotter waits.
                image = text[len(CONTROL_PREFIX) :]
                request = read_request(self.store, image)
                if request is not None:
                    self.image_bytes.announce(request.image, request.layers)
                if self.events is not None:
                    await self.events.notify(image, request)
                raise fuse.FUSEError(errno.ENOENT)
            if text.startswith(OPEN_PREFIX):
                # The snapshotter stored a layer's index: decode it now, while
                # containerd prepares the layers below; answered at once.
                target = text[len(OPEN_PREFIX) :]
                if _LAYER_NAME.fullmatch(target):
                    trio.lowlevel.spawn_system_task(self._open_ahead, target)
                raise fuse.FUSEError(errno.ENOENT)
            layer = await self._layer(text)
            if layer is None:
                raise fuse.FUSEError(errno.ENOENT)
            return layer.root_attr
        return self._lookup_in(*await self._resolve(parent_inode), name)

    @_guarded_now
    def lookup_now(
        self, parent_inode: int, name: bytes, ctx: fuse.RequestContext | None = None
    ) -> fuse.EntryAttributes:
        if parent_inode == fuse.ROOT_INODE:
            raise fuse.NotNow
        return self._lookup_in(*self._resolve_now(parent_inode), name)

    @staticmethod
    def _lookup_in(layer: _Layer, node: Node, name: bytes) -> fuse.EntryAttributes:
        if name == b".":
            return entry_attributes(layer.slot, node)
        child = layer.tree.lookup(node.ino, name)
        if child is None:
            # A negative entry the kernel keeps (ENOENT it would ask again
            # for): overlayfs probes every layer above the one holding a
            # name. A layer copy's tree never changes and its slot is never
            # another copy's (fs/slots.py), so no unload, reload or prune
            # can make this answer wrong under this directory's inode.
            return _NEGATIVE_ENTRY
        return entry_attributes(layer.slot, child)

    @_guarded_forget
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        # Trees stay in memory for the mount's life; nothing to release.
        return None

    # -- directories --------------------------------------------------------

    @_guarded
    async def opendir(self, inode: int, ctx: fuse.RequestContext) -> int:
        """ENOSYS: the kernel opens directories itself from now on (no
        OPENDIR, RELEASEDIR) and keeps their listings, which a layer's
        never change; readdir names the inode. The root's listing, which
        follows the store, is kept only while the root's mtime stays (the
        kernel asks it before each listing: AUTO_INVAL_DATA, zero attribute
        timeout)."""
        raise fuse.FUSEError(errno.ENOSYS)

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: fuse.ReaddirToken) -> None:
        if fh == fuse.ROOT_INODE:
            root = self._root_attr()
            if start_id < DOTS and not _reply_dots(token, start_id, root, root):
                return
            names = await trio.to_thread.run_sync(self.store.names)
            for n, name in enumerate(names[max(start_id - DOTS, 0) :], max(start_id, DOTS) + 1):
                try:
                    layer = await self._layer(name)
                except fuse.FUSEError:
                    # A broken copy is left out; looking it up answers EIO.
                    continue
                if layer is None:
                    continue
                if not fuse.readdir_reply(token, name.encode(), layer.root_attr, n):
                    return
            return
        layer, node = await self._resolve(fh)
        if start_id < DOTS:
            parent = layer.parents.get(node.ino)
            up = self._root_attr() if parent is None else entry_attributes(layer.slot, layer.tree.nodes[parent])
            if not _reply_dots(token, start_id, entry_attributes(layer.slot, node), up):
                return
        entries = sorted((node.children or {}).items())
        for n, (child, ino) in enumerate(entries[max(start_id - DOTS, 0) :], max(start_id, DOTS) + 1):
            if not fuse.readdir_reply(token, child, entry_attributes(layer.slot, layer.tree.nodes[ino]), n):
                return

    # -- files --------------------------------------------------------------

    @_guarded
    async def readlink(self, inode: int, ctx: fuse.RequestContext) -> bytes:
        return _target((await self._resolve(inode))[1])

    @_guarded_now
    def readlink_now(self, inode: int, ctx: fuse.RequestContext) -> bytes:
        return _target(self._resolve_now(inode)[1])

    @_guarded
    async def open(self, inode: int, flags: int, ctx: fuse.RequestContext) -> fuse.FileInfo:
        """ENOSYS: the kernel opens files on this connection itself from now
        on (no OPEN, RELEASE) and keeps their pages across opens, as
        FOPEN_KEEP_CACHE would; reads name the inode. Nothing is lost: the
        mount is read-only (the kernel refuses writes itself) and only
        regular files reach open (nodev; fifos, sockets are the kernel's)."""
        raise fuse.FUSEError(errno.ENOSYS)

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> fuse.FileBytes:
        layer, node = await self._resolve(fh)
        if off >= node.size:
            return b""
        length = min(size, node.size - off)
        try:
            return await layer.reader.read(node.offset + off, node.offset + off + length, node.offset + node.size)
        except BlockUnavailable:
            raise fuse.FUSEError(errno.EIO) from None

    @_guarded_now
    def read_now(self, fh: int, off: int, size: int) -> fuse.FileBytes:
        layer, node = self._resolve_now(fh)
        if off >= node.size:
            return b""
        length = min(size, node.size - off)
        data = layer.reader.read_now(node.offset + off, node.offset + off + length)
        if data is None:
            raise fuse.NotNow
        return data

    # -- xattrs and statfs --------------------------------------------------

    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> bytes:
        if inode == fuse.ROOT_INODE:
            raise fuse.FUSEError(errno.ENODATA)
        return _xattr((await self._resolve(inode))[1], name)

    @_guarded_now
    def getxattr_now(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> bytes:
        if inode == fuse.ROOT_INODE:
            raise fuse.FUSEError(errno.ENODATA)
        return _xattr(self._resolve_now(inode)[1], name)

    @_guarded
    async def listxattr(self, inode: int, ctx: fuse.RequestContext) -> list[bytes]:
        if inode == fuse.ROOT_INODE:
            return []
        return _xattr_names((await self._resolve(inode))[1])

    @_guarded_now
    def listxattr_now(self, inode: int, ctx: fuse.RequestContext) -> list[bytes]:
        if inode == fuse.ROOT_INODE:
            return []
        return _xattr_names(self._resolve_now(inode)[1])

    @_guarded
    async def statfs(self, ctx: fuse.RequestContext) -> fuse.StatvfsData:
        """The layer store's filesystem, where every lazily served byte is
        cached: kubelet's view of the image filesystem (capacity, free
        space, inodes) and its image garbage collection go by it. In a
        thread: a store on a hung disk must not stall the mount."""
        try:
            st = await trio.to_thread.run_sync(os.statvfs, self.store.root)
        except OSError as exc:
            # overlayfs refuses a lower layer whose filesystem cannot answer
            # statfs: answer what the served layers hold, with no room left.
            if self.statfs_error is None:
                log.warning(
                    "the layer store's filesystem cannot answer statfs; the mount reports its layers' size",
                    store=str(self.store.root),
                    error=str(exc),
                )
            self.statfs_error = str(exc)
            self._statfs = None
            return self._layers_statfs()
        if self.statfs_error is not None:
            log.info("the layer store's filesystem answers statfs again", store=str(self.store.root))
            self.statfs_error = None
        data = fuse.StatvfsData()
        data.f_bsize, data.f_frsize = st.f_bsize, st.f_frsize
        data.f_blocks, data.f_bfree, data.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
        data.f_files, data.f_ffree, data.f_favail = st.f_files, st.f_ffree, st.f_favail
        data.f_namemax = st.f_namemax
        self._statfs = (time.monotonic(), data)
        return data

    @_guarded_now
    def statfs_now(self, ctx: fuse.RequestContext) -> fuse.StatvfsData:
        """The answer of a statfs at most STATFS_FRESH_S old. Overlayfs asks
        every lower layer's at each mount (a container start: two mounts of
        each of its layers, one after another), each a thread hop queued
        behind whatever the worker threads do."""
        if self._statfs is not None and time.monotonic() - self._statfs[0] < STATFS_FRESH_S:
            return self._statfs[1]
        raise fuse.NotNow

    def _layers_statfs(self) -> fuse.StatvfsData:
        data = fuse.StatvfsData()
        total = sum(layer.reader.index.uncompressed_size for layer in self.layers_by_slot.values())
        data.f_bsize = data.f_frsize = BLOCK_SIZE
        data.f_blocks = total // BLOCK_SIZE
        data.f_bfree = data.f_bavail = 0
        data.f_files = sum(len(layer.tree.nodes) for layer in self.layers_by_slot.values()) + 1
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    def close(self) -> None:
        for layer in self.layers_by_slot.values():
            layer.reader.close()
        for opened in self.opened.values():
            opened.reader.close()
        self.cache.write_last_reads(self.cache.touched(), int(time.time()))
