"""The FUSE layer server process (`bootseer layer-server`).

It runs apart from the snapshotter so that restarting the snapshotter leaves
the mount, and every running container's lower layers, in place. And the
mount outlives the layer server itself: it speaks the FUSE protocol on the
connection's descriptor (fs/fusewire), which systemd's descriptor store or a
holder process keeps, so a crash, an OOM kill or a restart hands the same
connection to the next server, which takes over without a new INIT and asks
the kernel to resend what the dead one left unanswered
(docs/fuse-failover.md). It serves the same layers on a second
connection too, the plain mount, which answers no getxattr: layers without
xattrs are served from there, and overlayfs's per-file xattr probes never
reach the server (`layer_mounts`). SIGTERM is a restart: the server stops
reading, answers what it read and exits, leaving the mounts; `release` is
the final stop. The application serves its metrics and health endpoint (`[fs]
metrics_address`) and tells the service manager about readiness, through
the callbacks `serve` takes.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio

from hdfs_fuse.mount import MountProbe, set_kernel_readahead
from recorder.localstore import LocalManifests
from recorder.tracker import HotBlocks, HotBlockSettings
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.fusewire import connection, handoff
from snapshotter.fs.fusewire.connection import Connection, MountpointBusy
from snapshotter.fs.fusewire.handoff import Notify
from snapshotter.fs.fusewire.mount import MountOptions, unmount
from snapshotter.fs.fusewire.session import Session, SessionConfig
from snapshotter.fs.layerfs import LayerFS, mounted_layers
from snapshotter.fs.layers import LayerSource, LayerStore
from snapshotter.fs.reader import BoundedFetcher, RangeFetcher
from snapshotter.fs.settings import FsConfig, cache_cap
from snapshotter.registry.config import client_from_config
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.settings import RegistryConfig

log = structlog.get_logger("bootseer.fs")

# The kernel's read-ahead on the layer mount, which is also how far it reads
# around each page fault of a mapped file: a start maps large libraries and
# touches them sparsely, and what the read-around reads is fetched, and
# recorded as read, up to its last byte (hot blocks are fetched only as far
# as a start read them); a start with every block cached gains from a larger
# window (its requests overlap). Against 4 MiB, on the training image
# (bench-startup, 2 runs each, minutes apart, 2026-12-07): the manifest 181
# MB against 201 MB, a prefetched start 185 MB over the link against 205,
# 9.00 / 9.04 s against 9.80 / 9.85 s at 200 Mbit/s and 4.49 / 4.62 s against
# 4.51 / 4.61 s at 1 Gbit/s; a lazy start 272 MB against 293 MB, as fast
# next to stargz (0.58 against 0.59); a start through the mount with every
# block it reads cached 2.41 / 2.70 s against 2.31 / 2.40 s (1 Gbit/s).
KERNEL_READAHEAD = 1 << 20
MOUNT = MountOptions(fsname="bootseer", subtype="bootseer")
PLAIN_MOUNT = MountOptions(fsname="bootseer-plain", subtype="bootseer")
FSTYPE = MOUNT.fstype
PLAIN_FDNAME = "fuse-plain"
# How often the server checks that the holder still keeps the connection.
KEEPER_CHECK_S = 5.0
# A graceful stop answers the requests already read for at most this long.
DRAIN_S = 10.0

__all__ = ["LayerMount", "MountpointBusy", "layer_mounts", "release", "serve"]


# The event loop answers the kernel while worker threads load layer indexes
# (pure Python, tens of milliseconds for a big layer): hand the GIL over more
# often than the default 5 ms, or every FUSE request waits out a loader.
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class LayerMount:
    """One of the server's FUSE connections: where it is mounted, how its
    session answers, and where it is kept across restarts."""

    mountpoint: Path
    options: MountOptions
    session: SessionConfig
    holder_socket: Path
    fdname: str


def layer_mounts(fs: FsConfig) -> tuple[LayerMount, LayerMount]:
    """The layer mount, and its plain twin that answers no getxattr
    (FsConfig.plain_mountpoint): the same layers on both."""
    plain = SessionConfig(getxattr=False)
    return (
        LayerMount(fs.mountpoint, MOUNT, SessionConfig(), fs.holder_socket, handoff.FDNAME),
        LayerMount(fs.plain_mountpoint, PLAIN_MOUNT, plain, fs.plain_holder_socket, PLAIN_FDNAME),
    )


def _served_mounts(fs: FsConfig, notify: Notify | None) -> tuple[LayerMount, ...]:
    """The mounts to serve. With `[fs] plain_mount` off (the snapshotter
    then hands out the layer mount only), a plain mount an earlier server
    left is released, unless running containers still read from it: it is
    served until a start finds it unused, or their reads would fail."""
    main, plain = layer_mounts(fs)
    if fs.plain_mount:
        return main, plain
    if mounted_layers([plain.mountpoint]):
        log.warning(
            "[fs] plain_mount is off, but running containers read from the plain mount: "
            "serving it until a start finds it unused",
            mountpoint=str(plain.mountpoint),
        )
        return main, plain
    _release(plain, notify)
    return (main,)


@dataclass
class _Served:
    mount: LayerMount
    conn: Connection
    # Who keeps a copy of the connection: "systemd", "holder" or None.
    keeper: str | None
    session: Session


def serve(
    fs: FsConfig,
    registry: RegistryConfig,
    *,
    on_started: Callable[[Callable[[], str | None]], None] = lambda _health: None,
    on_ready: Callable[[], None] = lambda: None,
    on_stopping: Callable[[], None] = lambda: None,
    notify: Notify | None = None,
) -> None:
    """Take the layer mounts over (or mount them) and serve until SIGTERM
    or SIGINT, which leave them for the next server.

    `on_started(health)` once mounted (`health()`: None while both mounts
    answer a stat and a statfs within 2 s, else why not); `on_ready()` once
    the kernel's INIT is answered (or the connection taken over) on both
    and they answer; `on_stopping()` when a signal starts the shutdown.
    `notify` reaches the service manager (sd_notify with descriptors), whose
    descriptor store then keeps the connections; without one, the holders
    at `[fs] holder_socket` (and its plain twin) do."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    store = LayerStore(fs.store)
    block_index = BlockIndex(store.block_index_path)
    client = client_from_config(registry)

    def fetcher_for(source: LayerSource) -> RangeFetcher:
        ref = parse_reference(source.ref)
        # The reader's deadline goes down to the registry client, so a fetch
        # the reader gave up on stops retrying there too.
        return BoundedFetcher(
            lambda start, end, deadline, sink: client.stream_range(
                ref, source.digest, start, end, sink, deadline=deadline
            ),
            fs.fetch_deadline_s,
            lambda ranges, deadline, sinks: client.stream_ranges(ref, source.digest, ranges, sinks, deadline=deadline),
        )

    cap = cache_cap(fs, store.root)
    log.info("block cache cap", max_bytes=cap, store=str(fs.store))
    mounts = _served_mounts(fs, notify)
    ops = LayerFS(
        store,
        block_index,
        fetcher_for,
        fs.max_parallel_fetches,
        fs.prefetch_parallel,
        fs.background_bandwidth if fs.background_fetch else 0,
        fs.whole_layer_bytes,
        cache_max_bytes=cap,
        unload_idle_s=fs.unload_idle_s,
        mountpoints=[m.mountpoint for m in mounts],
        unpack_whole_layers=fs.unpack_whole_layers,
        blocks_after_miss=fs.blocks_after_miss,
    )
    local = LocalManifests(store.hot_manifests_path)
    hot = (
        HotBlocks(
            store,
            ops.layer_for_digest,
            client,
            local,
            HotBlockSettings(
                fs.record_idle_s,
                fs.record_max_s,
                fs.prefetch_parallel,
                fs.hot_blocks_publish,
                fs.hot_blocks_election_s,
            ),
        )
        if fs.hot_blocks
        else None
    )
    ops.events = hot
    served: list[_Served] = []
    try:
        for m in mounts:
            conn = connection.acquire(m.mountpoint, m.options, holder_socket=m.holder_socket, name=m.fdname)
            keeper = connection.keep(conn, notify=notify, holder_socket=m.holder_socket)
            served.append(_Served(m, conn, keeper, Session(ops, conn.fd, m.session)))
        probes = [MountProbe(m.mountpoint, FSTYPE) for m in mounts]
        on_started(lambda: next((why for probe in probes if (why := probe.check()) is not None), None))
        for s in served:
            log.info(
                "serving layers",
                mountpoint=str(s.conn.mountpoint),
                getxattr=s.mount.session.getxattr,
                store=str(fs.store),
                connection=s.conn.source,
                kept_by=s.keeper,
            )
        trio.run(_main, ops, served, hot, on_ready, on_stopping)
    finally:
        # Our copies only: the keepers' stay, and with them the mounts.
        for s in served:
            os.close(s.conn.fd)
        ops.close()
        block_index.close()
        local.close()
        log.info("stopped; the mounts stay for the next layer server", mountpoint=str(fs.mountpoint))


def release(fs: FsConfig, notify: Notify | None = None) -> None:
    """The final stop of the layer mounts: unmount them and let the holders
    go (running containers' reads then fail). Under systemd, stopping the
    unit does this: the descriptor store is emptied when the unit stops."""
    for m in layer_mounts(fs):
        _release(m, notify)


def _release(m: LayerMount, notify: Notify | None) -> None:
    """Unmount `m` and have its keepers let go: systemd's copy (when passed
    to this process) and the holder's; kept by neither, just unmount."""
    kept = handoff.from_systemd(name=m.fdname)
    if kept is not None:
        connection.release(Connection(kept, m.mountpoint, "systemd", m.fdname), notify=notify)
    held = handoff.get(m.holder_socket)
    if held is not None:
        connection.release(
            Connection(held.fd, m.mountpoint, "holder", m.fdname), notify=notify, holder_socket=m.holder_socket
        )
    elif connection.mounted_fstype(m.mountpoint) == FSTYPE:
        unmount(m.mountpoint, lazy=True)


async def _tune_readahead(session: Session, mountpoint: Path) -> None:
    # The kernel settles the connection's read-ahead when INIT is answered;
    # set it after that, and after a takeover too: the knob belongs to the
    # mount, which keeps what an earlier server set (older ones: 8 MiB).
    await session.initialized.wait()
    await trio.sleep(0)
    await trio.to_thread.run_sync(set_kernel_readahead, mountpoint, KERNEL_READAHEAD)


async def _announce_ready(served: Sequence[_Served], on_ready: Callable[[], None]) -> None:
    # After the kernel's INIT (or the takeover), and once a stat of each
    # mountpoint shows its mount.
    for s in served:
        await s.session.initialized.wait()
        await MountProbe(s.conn.mountpoint, FSTYPE).answering()
    on_ready()


async def _watch_keeper(conn: Connection, holder_socket: Path) -> None:
    """A killed holder is replaced and given a copy again, so the next crash
    still finds the connection."""
    while True:
        await trio.sleep(KEEPER_CHECK_S)
        try:
            await trio.to_thread.run_sync(connection.ensure_kept, conn, holder_socket)
        except OSError as exc:
            log.warning("could not have the FUSE connection kept", error=str(exc))


async def _main(
    ops: LayerFS,
    served: Sequence[_Served],
    hot: HotBlocks | None,
    on_ready: Callable[[], None],
    on_stopping: Callable[[], None],
) -> None:
    async with trio.open_nursery() as nursery:
        stopped = trio.Event()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("stopping; handing the mounts over", signal=signal.Signals(signum).name)
                    on_stopping()
                    for s in served:
                        s.session.stop(DRAIN_S)
                    stopped.set()
                    return

        async def run_session(s: _Served) -> None:
            outcome = await s.session.serve(s.conn.takeover)
            if not stopped.is_set():
                # Unmounted or aborted from outside: the daemon stays, unhealthy
                # (its probe says why), until it is told to stop.
                log.error("the FUSE connection ended", outcome=outcome.value, mountpoint=str(s.conn.mountpoint))
                await stopped.wait()

        async def run_sessions() -> None:
            async with trio.open_nursery() as sessions:
                for s in served:
                    sessions.start_soon(run_session, s)
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        nursery.start_soon(run_sessions)
        nursery.start_soon(_announce_ready, served, on_ready)
        if hot is not None:
            nursery.start_soon(hot.run)
        for s in served:
            nursery.start_soon(_tune_readahead, s.session, s.conn.mountpoint)
            if s.keeper == "holder":
                nursery.start_soon(_watch_keeper, s.conn, s.mount.holder_socket)
        nursery.start_soon(ops.maintain)
        if ops.background is not None:
            nursery.start_soon(ops.background.run)
        if ops.unpacker is not None:
            nursery.start_soon(ops.unpacker.run)
