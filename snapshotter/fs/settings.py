"""The `[fs]` section of the config file: the FUSE layer server, and where
the snapshotter finds it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# A reader's miss gets EIO this long after it began if the registry has not
# delivered by then. Above what a healthy registry needs for the blocks one
# read touches (a few MiB), below the registry client's 30 s per-try
# timeout, so a registry that accepts and never answers costs one try, and
# well under a minute, so a stalled registry shows up as an error instead
# of a hung process.
FETCH_DEADLINE_S = 20.0
PLAIN_SUFFIX = "-plain"


@dataclass
class FsConfig:
    # Layer indexes, block caches and the block index.
    store: Path = Path("/var/lib/bootseer/layers")
    # The layer mount; short, because every lazy layer's path under it goes
    # into an overlay lowerdir option that must fit in one page. Its twin
    # without xattrs is beside it (plain_mountpoint).
    mountpoint: Path = Path("/var/lib/bootseer/m")
    max_parallel_fetches: int = 8
    # The longest a read waits on the registry before EIO, whatever the
    # retries under it; a prefetch's Range request gets as long once it has
    # its fetch slot.
    fetch_deadline_s: float = FETCH_DEADLINE_S
    metrics_address: str = ""
    # A stored layer no snapshot uses is removed by containerd's cleanup once
    # it is this old (younger ones may belong to a pull under way).
    layer_gc_grace_s: float = 600.0
    # Record first runs and prefetch hot-block manifests (off: neither).
    hot_blocks: bool = True
    # Hot blocks: a first run's recording ends once no new block was read
    # for record_idle_s, or after record_max_s.
    record_idle_s: float = 10.0
    record_max_s: float = 300.0
    # Parallel Range requests of the hot-block prefetcher, and threads
    # decoding the blocks it fetched.
    prefetch_parallel: int = 4
    # Who pushes a recording to the registry (docs/hot-blocks.md): "elected"
    # (the one node that wins the image's publish election, and only while
    # the image has no manifest), "designated" (this node, every recording)
    # or "never" (kept on this node). An election round lasts
    # hot_blocks_election_s: an image whose winner never published gets
    # another election in the next round.
    hot_blocks_publish: str = "elected"
    hot_blocks_election_s: float = 3600.0
    # Fetch every served layer whole in the background, at most
    # background_bandwidth bytes/s, pausing while readers wait on fetches.
    background_fetch: bool = False
    background_bandwidth: int = 50_000_000
    # A layer whose every block is cached (fetched whole, in the background
    # or because it is small) is written out as a local directory, and
    # containers started from then on get it as a plain overlayfs lower:
    # no FUSE request per lookup, xattr or read (fs/unpack.py). Costs the
    # layer's uncompressed size on disk, as a normal pull would.
    unpack_whole_layers: bool = True
    # Where the descriptor holder listens when no service manager keeps the
    # FUSE connection (docs/fuse-failover.md): a holder process keeps the
    # mount's connection, so a new layer server takes the mount over after a
    # crash or a restart and running containers keep their files.
    holder_socket: Path = Path("/run/bootseer/layer-server.fuse")
    # A miss in a layer no hot-block manifest covers also fetches this many
    # blocks after it, whatever files they hold, in the miss's own Range
    # request (its block first, landing first): a tar keeps a package's
    # files together, and of the blocks after each miss of the benchmark
    # image's first start 78% were read by it later. 4, not 2 or 6: side
    # by side, the lazy start was fastest with 4 on both benchmark links
    # (docs/benchmarks.md). 0: only what is read.
    blocks_after_miss: int = 4
    # Layers at most this big (compressed) are fetched whole as soon as they
    # are served, with the prefetch slots: a few Range requests instead of a
    # miss per file (0: off).
    whole_layer_bytes: int = 32 << 20
    # The block cache's cap in bytes; 0: cache_max_percent of the size of
    # the layer store's filesystem, measured at start. Above it the least
    # recently read blocks are evicted, those of layers no container uses
    # first.
    cache_max_bytes: int = 0
    # 20%: a node's image filesystem also holds normally pulled images and
    # containers' writable layers, and kubelet's image garbage collection
    # starts at 85% full; a fifth of a 2 TB disk still caches dozens of
    # large training images (a start reads a few GB of each).
    cache_max_percent: float = 20.0
    # A layer no mount uses and no request touched for this long is
    # unloaded (tree, index, cache file descriptor; loaded again on its
    # next use); 0: never.
    unload_idle_s: float = 300.0
    # Serve layers without xattrs from the plain mount (plain_mountpoint).
    # Its files answer getxattr(2) EOPNOTSUPP rather than ENODATA (a
    # listing still shows none): set false where something asks container
    # files for xattrs and fails on that, such as SELinux labelling a
    # container's files from xattrs instead of a context= mount option.
    plain_mount: bool = True

    @property
    def plain_mountpoint(self) -> Path:
        """The layer mount's twin: the same layers on a FUSE connection of
        its own that answers xattr requests ENOSYS, which the kernel then
        stops sending. Overlayfs asks every lower file it looks up for its
        trusted.overlay.* xattrs, a round trip to the layer server each
        (3,228 in the benchmark image's start); a layer that has no xattrs
        and no opaque directory is served from here without them. Beside
        the layer mount: `<mountpoint>-plain`."""
        return self.mountpoint.with_name(self.mountpoint.name + PLAIN_SUFFIX)

    @property
    def plain_holder_socket(self) -> Path:
        """Where the descriptor holder of the plain mount's connection listens."""
        return self.holder_socket.with_name(self.holder_socket.name + PLAIN_SUFFIX)


def cache_cap(config: FsConfig, store: Path) -> int:
    """The block cache's cap in bytes, as `config` asks for it on `store`."""
    if config.cache_max_bytes > 0:
        return config.cache_max_bytes
    st = os.statvfs(store)
    return int(st.f_blocks * st.f_frsize * config.cache_max_percent / 100)
