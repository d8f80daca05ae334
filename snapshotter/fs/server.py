"""The FUSE layer server process (`bootseer layer-server`).

It runs apart from the snapshotter so that restarting the snapshotter leaves
the mount, and every running container's lower layers, in place. The
application serves its metrics and health endpoint (`[fs] metrics_address`)
and tells the service manager about readiness, through the callbacks `serve`
takes.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import structlog
import trio

from hdfs_fuse.mount import MountProbe, set_kernel_readahead
from recorder.localstore import LocalManifests
from recorder.tracker import HotBlocks, HotBlockSettings
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.layerfs import LayerFS
from snapshotter.fs.layers import LayerSource, LayerStore
from snapshotter.fs.reader import BoundedFetcher, RangeFetcher
from snapshotter.fs.settings import FsConfig, cache_cap
from snapshotter.registry.config import client_from_config
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.settings import RegistryConfig

log = structlog.get_logger("bootseer.fs")

KERNEL_READAHEAD = 8 << 20
MOUNT_OPTIONS = ("fsname=bootseer", "subtype=bootseer", "ro", "allow_other", "default_permissions")
FSTYPE = "fuse.bootseer"


class MountpointBusy(Exception):
    """Another filesystem (most likely another layer server) holds the mountpoint."""


def _clear_stale_mount(mountpoint: Path) -> None:
    """A killed server leaves its mount behind, answering ENOTCONN; detach it."""
    try:
        os.stat(mountpoint)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True)
        log.warning("detached a stale mount", mountpoint=str(mountpoint))
        return
    if os.path.ismount(mountpoint):
        raise MountpointBusy(f"{mountpoint} is already mounted: is another layer server running?")


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
) -> None:
    """Mount and serve until SIGTERM or SIGINT.

    `on_started(health)` once mounted (`health()`: None while the mount
    answers a stat and a statfs within 2 s, else why not); `on_ready()` once
    the kernel's INIT is answered and the mount answers; `on_stopping()` when
    a signal starts the shutdown."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    store = LayerStore(fs.store)
    block_index = BlockIndex(store.block_index_path)
    client = client_from_config(registry)

    def fetcher_for(source: LayerSource) -> RangeFetcher:
        ref = parse_reference(source.ref)
        # The reader's deadline goes down to the registry client, so a fetch
        # the reader gave up on stops retrying there too.
        return BoundedFetcher(
            lambda start, end, deadline: client.fetch_range(ref, source.digest, start, end, deadline=deadline),
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
    _clear_stale_mount(fs.mountpoint)
    fs.mountpoint.mkdir(parents=True, exist_ok=True)
    options = set(pyfuse3.default_options) | set(MOUNT_OPTIONS)
    pyfuse3.init(ops, str(fs.mountpoint), options)
    try:
        on_started(MountProbe(fs.mountpoint, FSTYPE).check)
        log.info("serving layers", mountpoint=str(fs.mountpoint), store=str(fs.store))
        trio.run(_main, ops, fs.mountpoint, hot, on_ready, on_stopping)
    finally:
        pyfuse3.close(unmount=True)
        ops.close()
        block_index.close()
        local.close()
        log.info("stopped")


async def _tune_readahead(ops: LayerFS, mountpoint: Path) -> None:
    # The kernel settles the connection's read-ahead when libfuse answers INIT
    # (inside pyfuse3.main); raise it after that, so sequential readers send
    # large requests.
    await ops.initialized.wait()
    await trio.sleep(0)
    await trio.to_thread.run_sync(set_kernel_readahead, mountpoint, KERNEL_READAHEAD)


async def _announce_ready(ops: LayerFS, mountpoint: Path, on_ready: Callable[[], None]) -> None:
    # After the kernel's INIT, and once a stat of the mountpoint shows the mount.
    await ops.initialized.wait()
    await MountProbe(mountpoint, FSTYPE).answering()
    on_ready()


async def _main(
    ops: LayerFS,
    mountpoint: Path,
    hot: HotBlocks | None,
    on_ready: Callable[[], None],
    on_stopping: Callable[[], None],
) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        nursery.start_soon(_announce_ready, ops, mountpoint, on_ready)
        if hot is not None:
            nursery.start_soon(hot.run)
        nursery.start_soon(_tune_readahead, ops, mountpoint)
        nursery.start_soon(ops.maintain)
        if ops.background is not None:
            nursery.start_soon(ops.background.run)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("stopping", signal=signal.Signals(signum).name)
                on_stopping()
                nursery.cancel_scope.cancel()
                return
