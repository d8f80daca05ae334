"""The mount daemon: one pyfuse3 mount per process, run in the foreground
(systemd, tests) or detached by `mount` itself, and `umount`; and whether a
FUSE mount answers (`MountProbe`), for readiness and health here and in the
layer server."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import structlog
import trio

from hdfs_fuse import mountinfo
from hdfs_fuse import uri as uri_mod
from hdfs_fuse.fuse_fs import RemoteFS
from hdfs_fuse.mountinfo import FSTYPE
from hdfs_fuse.reader import Client
from hdfs_fuse.settings import HdfsFuseConfig

log = structlog.get_logger("bootseer.hdfs_fuse.mount")

# Kernel requests in flight at once; each waits on a stripe in a thread.
MAX_FUSE_TASKS = 64
MOUNT_WAIT_S = 30.0
# How long a health check waits for the mount to answer.
PROBE_TIMEOUT_S = 2.0


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


class _Stat:
    """One probe of a mount, in a daemon thread: a stat that hangs (a wedged
    server) must neither hold up the caller nor keep the process from exiting."""

    def __init__(self, mountpoint: Path, fstype: str) -> None:
        self.mountpoint = mountpoint
        self.fstype = fstype
        self.done = threading.Event()
        self.reason: str | None = None
        threading.Thread(target=self._run, name="mount-probe", daemon=True).start()

    def _run(self) -> None:
        try:
            self.reason = self._check()
        finally:
            self.done.set()

    def _check(self) -> str | None:
        path = self.mountpoint
        # mountinfo first: it never touches the mount.
        mount = mountinfo.current(path)
        if mount is None:
            return f"nothing is mounted on {path}"
        if mount.fstype != self.fstype:
            return f"{path} is a {mount.fstype} mount, not the {self.fstype} one"
        try:
            # stat may be answered from the kernel's attribute cache; statfs
            # always goes to the server.
            os.stat(path)
            os.statvfs(path)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                return f"the mount on {path} is disconnected (ENOTCONN): its server is gone"
            if exc.errno != errno.ENOSYS:  # the server answered, without statfs
                return f"the mount on {path} fails: {exc.strerror}"
        return None


class MountProbe:
    """Whether the FUSE mount on `mountpoint` answers: mounted there (with
    `fstype`), and a stat and a statfs of it come back within `timeout`.

    While a probe hangs no second one is started: every check until it
    returns reports the hang, so a wedged mount costs one stuck thread."""

    def __init__(self, mountpoint: Path, fstype: str, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.mountpoint = mountpoint
        self.fstype = fstype
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pending: _Stat | None = None

    def check(self) -> str | None:
        """None when the mount answers, else why not (one line)."""
        with self._lock:
            probe = self._pending
            if probe is None or probe.done.is_set():
                probe = self._pending = _Stat(self.mountpoint, self.fstype)
        if not probe.done.wait(self.timeout):
            return f"the mount on {self.mountpoint} did not answer within {self.timeout:g} s"
        return probe.reason

    async def answering(self, poll: float = 0.05) -> None:
        """Return once the mount answers (from inside the server's trio loop,
        which must keep answering the kernel meanwhile)."""
        while (reason := await trio.to_thread.run_sync(self.check, abandon_on_cancel=True)) is not None:
            log.debug("mount not answering yet", reason=reason)
            await trio.sleep(poll)


async def _serve(
    fs: RemoteFS, mountpoint: Path, readahead: int, on_ready: Callable[[], None], on_stopping: Callable[[], None]
) -> None:
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
                    on_stopping()
                    # While reads are still answered: a push may be waiting for one.
                    await trio.to_thread.run_sync(fs.stop_pushing)
                    pyfuse3.terminate()
                    return

        async def announce_ready() -> None:
            # After the kernel's INIT, and once a stat of the mount shows it.
            await fs.initialized.wait()
            await MountProbe(mountpoint, FSTYPE).answering()
            on_ready()

        nursery.start_soon(stop_on_signal)
        nursery.start_soon(tune_readahead)
        nursery.start_soon(announce_ready)
        await pyfuse3.main(max_tasks=MAX_FUSE_TASKS)
        nursery.cancel_scope.cancel()


def run(
    uri: str,
    mountpoint: Path,
    config: HdfsFuseConfig,
    allow_other: bool = False,
    *,
    on_started: Callable[[Callable[[], str | None]], None] = lambda _health: None,
    on_ready: Callable[[], None] = lambda: None,
    on_stopping: Callable[[], None] = lambda: None,
) -> None:
    """Mount `uri` on `mountpoint` and serve until unmounted or signalled.

    `on_started(health)` once mounted (`health()`: None while the mount
    answers, else why not; the application serves it with the metrics on
    `metrics_address`); `on_ready()` once the mount answers; `on_stopping()`
    when a signal starts the shutdown."""
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
            on_started(MountProbe(mountpoint, FSTYPE).check)
            log.info(
                "mounted",
                uri=str(location),
                mountpoint=str(mountpoint),
                streams=config.streams,
                stripe_size=config.stripe_size,
            )
            trio.run(_serve, fs, mountpoint, config.kernel_readahead, on_ready, on_stopping)
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
    if mount.fstype != FSTYPE:
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
