"""The mount daemon: one pyfuse3 mount per process, run in the foreground
(systemd, tests) or detached by `mount` itself, and `umount`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import prometheus_client
import pyfuse3
import structlog
import trio

from hdfs_fuse import mountinfo
from hdfs_fuse import uri as uri_mod
from hdfs_fuse.fuse_fs import RemoteFS
from hdfs_fuse.reader import Client
from hdfs_fuse.settings import HdfsFuseConfig

log = structlog.get_logger("bootseer.hdfs_fuse.mount")

# Kernel requests in flight at once; each waits on a stripe in a thread.
MAX_FUSE_TASKS = 64
MOUNT_WAIT_S = 30.0


class MountError(RuntimeError):
    pass


def set_kernel_readahead(mountpoint: Path, nbytes: int) -> None:
    """Raise the read-ahead of the mount's backing device.

    The kernel offers FUSE 128 KiB of read-ahead and libfuse accepts it; a
    larger window makes a sequential reader (cat, dd, numpy, torch) send many
    requests of up to 1 MiB at once, which the stripe window then serves.
    """
    mount = mountinfo.current(mountpoint)
    if mount is None or nbytes <= 0:
        return
    knob = Path("/sys/class/bdi") / mount.bdi / "read_ahead_kb"
    try:
        knob.write_text(str(nbytes // 1024))
    except OSError as exc:
        log.warning("cannot raise kernel read-ahead", path=str(knob), error=str(exc))
        return
    log.info("kernel read-ahead raised", path=str(knob), kib=nbytes // 1024)


async def _serve(fs: RemoteFS, mountpoint: Path, readahead: int) -> None:
    async with trio.open_nursery() as nursery:

        async def tune_readahead() -> None:
            # The kernel settles the read-ahead when it gets libfuse's answer
            # to INIT, inside pyfuse3.main; a value written earlier is lost.
            await fs.initialized.wait()
            await trio.sleep(0)
            await trio.to_thread.run_sync(set_kernel_readahead, mountpoint, readahead)

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("stopping", signal=signal.Signals(signum).name)
                    if fs.filler is not None:
                        # While reads are still answered: a push may be waiting for one.
                        await trio.to_thread.run_sync(fs.filler.close)
                    pyfuse3.terminate()
                    return

        nursery.start_soon(stop_on_signal)
        nursery.start_soon(tune_readahead)
        await pyfuse3.main(max_tasks=MAX_FUSE_TASKS)
        nursery.cancel_scope.cancel()


def _bind_metrics(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise MountError(f"metrics address {address!r} must be host:port")
    prometheus_client.start_http_server(int(port), addr=host or "127.0.0.1")


def run(uri: str, mountpoint: Path, config: HdfsFuseConfig, allow_other: bool = False) -> None:
    """Mount `uri` on `mountpoint` and serve until unmounted or signalled."""
    location = uri_mod.parse(uri)
    mountpoint = mountpoint.absolute()
    if not mountpoint.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if mountinfo.current(mountpoint) is not None:
        raise MountError(f"{mountpoint} is already a mount point")
    client = Client(config)
    try:
        fs = RemoteFS(client, location)
        options = set(pyfuse3.default_options) | {"ro", "fsname=bootseer", "subtype=hdfs-fuse"}
        if allow_other:
            options.add("allow_other")
        pyfuse3.init(fs, str(mountpoint), options)
        try:
            if config.metrics_address:
                _bind_metrics(config.metrics_address)
            log.info(
                "mounted",
                uri=str(location),
                mountpoint=str(mountpoint),
                streams=config.streams,
                stripe_size=config.stripe_size,
            )
            trio.run(_serve, fs, mountpoint, config.kernel_readahead)
        finally:
            fs.close_all()
            pyfuse3.close(unmount=True)
        log.info("unmounted", mountpoint=str(mountpoint))
    finally:
        client.close()


def spawn(argv: list[str], mountpoint: Path, log_path: Path) -> int:
    """Run `argv` (a foreground mount) detached; return its PID once mounted."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + MOUNT_WAIT_S
    while mountinfo.current(mountpoint) is None:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-10:])
            raise MountError(f"mount daemon exited with {proc.returncode}; log {log_path}:\n{tail}")
        if time.monotonic() > deadline:
            raise MountError(f"{mountpoint} not mounted after {MOUNT_WAIT_S:.0f}s; see {log_path}")
        time.sleep(0.05)
    return proc.pid


def unmount(mountpoint: Path, lazy: bool = False, timeout: float = 10.0) -> None:
    mountpoint = mountpoint.absolute()
    mount = mountinfo.current(mountpoint)
    if mount is None:
        raise MountError(f"{mountpoint} is not mounted")
    if mount.fstype != "fuse.hdfs-fuse":
        raise MountError(f"{mountpoint} is a {mount.fstype} mount, not an hdfs-fuse one")
    argv = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(mountpoint)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MountError(f"fusermount3 -u {mountpoint}: {result.stderr.strip()}")
    deadline = time.monotonic() + timeout
    while mountinfo.current(mountpoint) is not None:
        if time.monotonic() > deadline:
            raise MountError(f"{mountpoint} still mounted after {timeout:.0f}s")
        time.sleep(0.05)


def foreground_argv(args: list[str]) -> list[str]:
    """The command line that runs this same mount in the foreground."""
    return [sys.executable, "-m", "bootseer.cli", *args]


def default_log_path(mountpoint: Path) -> Path:
    escaped = str(mountpoint.absolute()).strip("/").replace("/", "-") or "root"
    base = Path("/var/log/bootseer") if os.geteuid() == 0 else Path.home() / ".cache" / "bootseer"
    return base / f"hdfs-fuse-{escaped}.log"
