"""The FUSE layer server process (`bootseer layer-server`).

It runs apart from the snapshotter so that restarting the snapshotter leaves
the mount, and every running container's lower layers, in place. And the
mount outlives the layer server itself: it speaks the FUSE protocol on the
connection's descriptor (fs/fusewire), which systemd's descriptor store or a
holder process keeps, so a crash, an OOM kill or a restart hands the same
connection to the next server, which takes over without a new INIT and asks
the kernel to resend what the dead one left unanswered
(docs/fuse-failover.md). SIGTERM is a restart: the server stops reading,
answers what it read and exits, leaving the mount; `release` is the final
stop. The application serves its metrics and health endpoint (`[fs]
metrics_address`) and tells the service manager about readiness, through
the callbacks `serve` takes.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
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
from snapshotter.fs.fusewire.session import Session
from snapshotter.fs.layerfs import LayerFS
from snapshotter.fs.layers import LayerSource, LayerStore
from snapshotter.fs.reader import BoundedFetcher, RangeFetcher
from snapshotter.fs.settings import FsConfig, cache_cap
from snapshotter.registry.config import client_from_config
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.settings import RegistryConfig

log = structlog.get_logger("bootseer.fs")

# The kernel's read-ahead on the layer mount, which is also how far it reads
# around each page fault of a mapped file: a start maps large libraries and
# touches them sparsely, and every block the read-around touches is fetched
# and recorded as hot; a fully cached start gains from the larger window
# (its requests overlap). Side by side on the training image (1 Gbit/s,
# bench-startup): 512 KiB moved 214 MB for a prefetched start and made a
# cached one 1.59x overlayfs's; 8 MiB 252 MB and 1.14x; 4 MiB 235 MB and 1.17x.
KERNEL_READAHEAD = 4 << 20
MOUNT = MountOptions(fsname="bootseer", subtype="bootseer")
FSTYPE = MOUNT.fstype
# How often the server checks that the holder still keeps the connection.
KEEPER_CHECK_S = 5.0
# A graceful stop answers the requests already read for at most this long.
DRAIN_S = 10.0

__all__ = ["MountpointBusy", "release", "serve"]


# The event loop answers the kernel while worker threads load layer indexes
# (pure Python, tens of milliseconds for a big layer): hand the GIL over more
# often than the default 5 ms, or every FUSE request waits out a loader.
GIL_SWITCH_INTERVAL_S = 0.0005


def serve(
    fs: FsConfig,
    registry: RegistryConfig,
    *,
    on_started: Callable[[Callable[[], str | None]], None] = lambda _health: None,
    on_ready: Callable[[], None] = lambda: None,
    on_stopping: Callable[[], None] = lambda: None,
    notify: Notify | None = None,
) -> None:
    """Take the layer mount over (or mount it) and serve until SIGTERM or
    SIGINT, which leave it for the next server.

    `on_started(health)` once mounted (`health()`: None while the mount
    answers a stat and a statfs within 2 s, else why not); `on_ready()` once
    the kernel's INIT is answered (or the connection taken over) and the
    mount answers; `on_stopping()` when a signal starts the shutdown.
    `notify` reaches the service manager (sd_notify with descriptors), whose
    descriptor store then keeps the connection; without one, the holder at
    `[fs] holder_socket` does."""
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
        )

    cap = cache_cap(fs, store.root)
    log.info("block cache cap", max_bytes=cap, store=str(fs.store))
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
        mountpoint=fs.mountpoint,
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
    conn = connection.acquire(fs.mountpoint, MOUNT, holder_socket=fs.holder_socket)
    keeper = connection.keep(conn, notify=notify, holder_socket=fs.holder_socket)
    session = Session(ops, conn.fd)
    try:
        on_started(MountProbe(fs.mountpoint, FSTYPE).check)
        log.info(
            "serving layers",
            mountpoint=str(fs.mountpoint),
            store=str(fs.store),
            connection=conn.source,
            kept_by=keeper,
        )
        trio.run(_main, ops, session, conn, keeper, fs.holder_socket, hot, on_ready, on_stopping)
    finally:
        # Our copy only: the keeper's stays, and with it the mount.
        os.close(conn.fd)
        ops.close()
        block_index.close()
        local.close()
        log.info("stopped; the mount stays for the next layer server", mountpoint=str(fs.mountpoint))


def release(fs: FsConfig, notify: Notify | None = None) -> None:
    """The final stop of the layer mount: unmount it and let the holder go
    (running containers' reads then fail). Under systemd, stopping the unit
    does this: the descriptor store is emptied when the unit stops."""
    held = handoff.get(fs.holder_socket)
    if held is not None:
        connection.release(Connection(held.fd, fs.mountpoint, "holder"), notify=notify, holder_socket=fs.holder_socket)
    elif connection.mounted_fstype(fs.mountpoint) == FSTYPE:
        unmount(fs.mountpoint, lazy=True)


async def _tune_readahead(ops: LayerFS, mountpoint: Path) -> None:
    # The kernel settles the connection's read-ahead when INIT is answered;
    # set it after that, and after a takeover too: the knob belongs to the
    # mount, which keeps what an earlier server set (older ones: 8 MiB).
    await ops.initialized.wait()
    await trio.sleep(0)
    await trio.to_thread.run_sync(set_kernel_readahead, mountpoint, KERNEL_READAHEAD)


async def _announce_ready(ops: LayerFS, mountpoint: Path, on_ready: Callable[[], None]) -> None:
    # After the kernel's INIT (or the takeover), and once a stat of the
    # mountpoint shows the mount.
    await ops.initialized.wait()
    await MountProbe(mountpoint, FSTYPE).answering()
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
    session: Session,
    conn: Connection,
    keeper: str | None,
    holder_socket: Path,
    hot: HotBlocks | None,
    on_ready: Callable[[], None],
    on_stopping: Callable[[], None],
) -> None:
    async with trio.open_nursery() as nursery:
        stopped = trio.Event()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("stopping; handing the mount over", signal=signal.Signals(signum).name)
                    on_stopping()
                    session.stop(DRAIN_S)
                    stopped.set()
                    return

        async def run_session() -> None:
            outcome = await session.serve(conn.takeover)
            if not stopped.is_set():
                # Unmounted or aborted from outside: the daemon stays, unhealthy
                # (its probe says why), until it is told to stop.
                log.error("the FUSE connection ended", outcome=outcome.value, mountpoint=str(conn.mountpoint))
                await stopped.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        nursery.start_soon(run_session)
        nursery.start_soon(_announce_ready, ops, conn.mountpoint, on_ready)
        if hot is not None:
            nursery.start_soon(hot.run)
        nursery.start_soon(_tune_readahead, ops, conn.mountpoint)
        nursery.start_soon(ops.maintain)
        if keeper == "holder":
            nursery.start_soon(_watch_keeper, conn, holder_socket)
        if ops.background is not None:
            nursery.start_soon(ops.background.run)
        if ops.unpacker is not None:
            nursery.start_soon(ops.unpacker.run)
