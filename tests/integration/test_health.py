"""Readiness (sd_notify) and /healthz of the real daemons.

Each daemon is started by the real CLI with NOTIFY_SOCKET pointing at a
datagram socket of the test, as systemd would start it for a Type=notify
unit; READY=1 must arrive only once the daemon can do its job. /healthz must
answer 200 while it can, and 503 with the reason once it cannot, caused for
real: the layer mount detached from outside (`umount -l`, the daemon lives
on), the snapshotter's socket file removed or its metadata store moved away,
the depsnap socket removed; and a hung mount (its server stopped) seen by the
probe the layer server and hdfs-fuse use.

The first tests need no daemon: the endpoint and the readiness states. No
test needs a running systemd, only its notify protocol.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bootseer.daemon import NOTIFY_SOCKET, Daemon, Notifier
from hdfs_fuse import mountinfo
from hdfs_fuse.mount import MountProbe
from tests.harness.layerserver import LayerServer, LazyConfig, start_layer_server
from tests.harness.procs import Daemon as Process
from tests.harness.procs import DaemonError, free_tcp_port, start_daemon, unix_socket_answers, wait_until
from tests.harness.snapshotter import BOOTSEER_BIN, start_snapshotter
from tests.harness.tree import unmount_under

integration = pytest.mark.integration


def healthz(port: int) -> tuple[int, str]:
    """The endpoint's status and body; (0, why) while nothing listens yet (a
    daemon answers its socket before its HTTP endpoint is up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0, str(exc.reason)
        raise


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


class NotifySocket:
    """What systemd listens on for a Type=notify unit: an abstract datagram socket."""

    def __init__(self) -> None:
        self.name = f"bs-test-notify-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.name.encode())
        self.sock.setblocking(False)
        self.messages: list[str] = []

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, NOTIFY_SOCKET: "@" + self.name}

    def poll(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return self.messages

    def got(self, assignment: str) -> bool:
        return any(assignment in message.split("\n") for message in self.poll())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    try:
        yield sock
    finally:
        sock.close()


def freeze(process: Process) -> Callable[[], None]:
    """SIGSTOP `process`; returns the SIGCONT."""
    os.kill(process.pid, signal.SIGSTOP)
    return lambda: os.kill(process.pid, signal.SIGCONT)


def start_notified(
    name: str, argv: list[str], log: Path, notify: NotifySocket, at_ready: Callable[[], None] = lambda: None
) -> Process:
    """Start `argv` under `notify` and return once READY=1 arrived, calling
    `at_ready()` with the daemon frozen (SIGSTOP) as soon as the message is
    in, so that what it checks held when the daemon said it was ready."""
    process = start_daemon(name, argv, log, ready=lambda: True, env=notify.env)
    try:
        deadline = time.monotonic() + 30
        while not notify.got("READY=1"):
            if not process.alive():
                raise DaemonError(process.describe_failure("died before READY=1"))
            if time.monotonic() > deadline:
                raise DaemonError(process.describe_failure("no READY=1 after 30 s"))
            select.select([notify.sock], [], [], 0.05)
        cont = freeze(process)
        try:
            at_ready()
        finally:
            cont()
    except BaseException:
        process.stop(grace=2.0)
        raise
    return process


# -- the endpoint and the readiness states, no daemon -------------------------


@pytest.fixture
def endpoint_daemon(notify: NotifySocket) -> Iterator[tuple[Daemon, list[str | None]]]:
    verdict: list[str | None] = [None]
    daemon = Daemon("the test daemon", "testing things", "127.0.0.1:0", notifier=Notifier("@" + notify.name))

    def health() -> str | None:
        if verdict[0] == "raise":
            raise RuntimeError("the check itself broke")
        return verdict[0]

    daemon.started(health)
    try:
        yield daemon, verdict
    finally:
        daemon.close()


def test_healthz_follows_readiness_and_the_check(
    endpoint_daemon: tuple[Daemon, list[str | None]], notify: NotifySocket
) -> None:
    daemon, verdict = endpoint_daemon
    assert daemon.endpoint is not None
    port = daemon.endpoint.port
    assert healthz(port) == (503, "the test daemon is starting\n")
    assert not notify.got("READY=1")
    daemon.ready()
    assert healthz(port) == (200, "ok\n")
    assert "READY=1\nSTATUS=testing things" in notify.poll()
    verdict[0] = "the widget\nis gone"
    assert healthz(port) == (503, "the widget is gone\n")  # one line
    verdict[0] = "raise"
    assert healthz(port) == (503, "health check failed: RuntimeError: the check itself broke\n")
    verdict[0] = None
    daemon.stopping()
    assert healthz(port) == (503, "the test daemon is stopping\n")
    assert "STOPPING=1\nSTATUS=stopping" in notify.poll()


def test_metrics_are_served_beside_healthz(endpoint_daemon: tuple[Daemon, list[str | None]]) -> None:
    daemon, _ = endpoint_daemon
    assert daemon.endpoint is not None
    assert "# TYPE python_info gauge" in metrics(daemon.endpoint.port)


# -- the snapshotter ------------------------------------------------------------


def _snapshotter_args(workdir: Path) -> list[str]:
    """`bootseer snapshotter` with everything under `workdir`, its socket
    `snapshotter.sock`; no layer server runs."""
    return [
        "snapshotter",
        "--root",
        str(workdir / "root"),
        "--address",
        str(workdir / "snapshotter.sock"),
        "--fs-store",
        str(workdir / "layers"),
        "--fs-mountpoint",
        str(workdir / "m"),
        "--pull-address",
        str(workdir / "pull.sock"),
    ]


@integration
def test_snapshotter_is_ready_once_its_socket_accepts(notify: NotifySocket) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bs-hz-", dir="/tmp"))
    address = workdir / "snapshotter.sock"
    argv = [str(BOOTSEER_BIN), *_snapshotter_args(workdir), "--log-format", "console"]
    accepted: list[bool] = []
    process = None
    try:
        process = start_notified(
            "bootseer snapshotter",
            argv,
            workdir / "snapshotter.log",
            notify,
            at_ready=lambda: accepted.append(unix_socket_answers(address)),
        )
        assert accepted == [True]
        before_ready = notify.messages[: next(i for i, m in enumerate(notify.messages) if "READY=1" in m)]
        assert [m for m in before_ready if m.startswith("STATUS=starting")], notify.messages
        assert any(f"STATUS=serving containerd snapshots on {address}" in m for m in notify.messages)
        process.stop()
        assert process.proc.returncode == 0, process.log_tail()
        wait_until(lambda: notify.got("STOPPING=1"), 5, "STOPPING=1")
    finally:
        if process is not None:
            process.stop()
        assert unmount_under(workdir) == []
        shutil.rmtree(workdir, ignore_errors=True)


@integration
def test_snapshotter_healthz() -> None:
    port = free_tcp_port()
    snap = start_snapshotter(extra_args=["--metrics-address", f"127.0.0.1:{port}"])
    try:
        wait_until(lambda: healthz(port)[0] == 200, 10, "the snapshotter's /healthz")
        assert healthz(port) == (200, "ok\n")
        assert "bootseer_snapshotter_rpc" in metrics(port)

        # Its metadata store moved away: the daemon still reads its open copy,
        # but whatever it records from now on would be lost at the next start.
        store = snap.root / "metadata.lmdb"
        store.rename(snap.root / "metadata.moved")
        status, reason = healthz(port)
        assert status == 503
        assert "metadata store" in reason and "removed or replaced" in reason, reason
        (snap.root / "metadata.moved").rename(store)
        assert healthz(port) == (200, "ok\n")

        # Its socket removed: containerd can no longer reach it.
        snap.address.unlink()
        status, reason = healthz(port)
        assert status == 503
        assert f"{snap.address} does not accept connections" in reason, reason
        assert snap.daemon.alive()
    finally:
        assert snap.teardown() == []


# -- the layer server -----------------------------------------------------------


@pytest.fixture
def layer_server() -> Iterator[LayerServer]:
    server = start_layer_server([])
    try:
        yield server
    finally:
        assert server.teardown() == []


@integration
def test_layer_server_is_ready_once_its_mount_answers(notify: NotifySocket) -> None:
    config = LazyConfig(Path(tempfile.mkdtemp(prefix="bs-hz-fs-", dir="/tmp")))
    config.write()
    at_ready: list[mountinfo.Mount | None] = []
    server = LayerServer(config)
    try:
        server.incarnations.append(
            start_notified(
                "bootseer layer-server",
                [str(BOOTSEER_BIN), "layer-server", "--config", str(config.path)],
                config.workdir / "layer-server.log",
                notify,
                # mountinfo only: a stat would wait for the frozen server.
                at_ready=lambda: at_ready.append(mountinfo.current(config.mountpoint)),
            )
        )
        (mount,) = at_ready
        assert mount is not None and mount.fstype == "fuse.bootseer"
        assert MountProbe(config.mountpoint, "fuse.bootseer").check() is None
        assert os.path.ismount(config.mountpoint)
    finally:
        assert server.teardown() == []


@integration
def test_layer_server_healthz_turns_503_when_its_mount_is_gone(layer_server: LayerServer) -> None:
    port = layer_server.config.metrics_port
    wait_until(lambda: healthz(port)[0] == 200, 10, "the layer server's /healthz")
    assert healthz(port) == (200, "ok\n")
    assert "python_info" in metrics(port)

    # Detached from outside: the daemon lives on, its mount is gone.
    subprocess.run(["umount", "-l", str(layer_server.config.mountpoint)], check=True)
    status, reason = healthz(port)
    assert status == 503
    assert reason == f"nothing is mounted on {layer_server.config.mountpoint}\n"
    assert layer_server.daemon.alive()


@integration
def test_a_stopped_layer_server_is_seen_hanging(layer_server: LayerServer) -> None:
    """A server that answers nothing (stopped here) fails the probe within
    its deadline, with one stuck stat however often it is asked; once the
    server answers again, so does the probe."""
    mountpoint = layer_server.config.mountpoint
    probe = MountProbe(mountpoint, "fuse.bootseer", timeout=0.5)
    assert probe.check() is None
    cont = freeze(layer_server.daemon)
    try:
        for _ in range(3):
            t0 = time.monotonic()
            assert probe.check() == f"the mount on {mountpoint} did not answer within 0.5 s"
            assert time.monotonic() - t0 < 2
        assert [t.name for t in threading.enumerate()].count("mount-probe") == 1
    finally:
        cont()
    wait_until(lambda: probe.check() is None, 10, "the probe to pass again")


# -- depsnap and hdfs-fuse --------------------------------------------------------


@pytest.fixture
def workdir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="bs-hz-", dir="/tmp"))
    try:
        yield directory
    finally:
        assert unmount_under(directory) == []
        shutil.rmtree(directory, ignore_errors=True)


@integration
def test_depsnap_daemon_ready_and_healthz(notify: NotifySocket, workdir: Path) -> None:
    address = workdir / "depsnap.sock"
    port = free_tcp_port()
    argv = [
        str(BOOTSEER_BIN),
        "depsnap",
        "serve",
        "--socket",
        str(address),
        "--cache-dir",
        str(workdir / "cache"),
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--log-format",
        "console",
    ]
    accepted: list[bool] = []
    process = start_notified(
        "bootseer depsnap serve",
        argv,
        workdir / "depsnap.log",
        notify,
        at_ready=lambda: accepted.append(unix_socket_answers(address)),
    )
    try:
        assert accepted == [True]
        # A bare connect, like the one above, leaves a warning in the log; the
        # health probe sends a real request and leaves none.
        wait_until(lambda: "bad client message" in process.log_tail(200), 5, "the bare connect's warning")
        for _ in range(3):
            assert healthz(port) == (200, "ok\n")
        assert process.log_tail(200).count("bad client message") == 1
        address.unlink()
        status, reason = healthz(port)
        assert status == 503 and f"{address} does not answer" in reason, reason
    finally:
        process.stop()


@integration
def test_hdfs_fuse_mount_ready_and_healthz(notify: NotifySocket, workdir: Path) -> None:
    remote = workdir / "remote"
    remote.mkdir()
    (remote / "ckpt.bin").write_bytes(b"weights")
    mountpoint = workdir / "mnt"
    mountpoint.mkdir()
    port = free_tcp_port()
    argv = [
        str(BOOTSEER_BIN),
        "hdfs-fuse",
        "mount",
        "--foreground",
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--log-format",
        "console",
        f"file://{remote}",
        str(mountpoint),
    ]
    at_ready: list[mountinfo.Mount | None] = []
    process = start_notified(
        "bootseer hdfs-fuse mount",
        argv,
        workdir / "hdfs-fuse.log",
        notify,
        at_ready=lambda: at_ready.append(mountinfo.current(mountpoint)),
    )
    try:
        (mount,) = at_ready
        assert mount is not None and mount.fstype == "fuse.hdfs-fuse"
        assert (mountpoint / "ckpt.bin").read_bytes() == b"weights"
        assert healthz(port) == (200, "ok\n")
        process.stop()
        assert process.proc.returncode == 0, process.log_tail()
        assert notify.got("STOPPING=1")
    finally:
        process.stop()
        if mountinfo.current(mountpoint) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


# -- a stop signal while a log line is being written ------------------------------

# The daemon's CLI in-process, its stderr sending it SIGTERM while it writes
# the line that says it is ready: the signal handler then runs inside the
# log call, which holds the log's lock (a handler that logged waited on it
# for good, and the daemon had to be killed).
_SIGNAL_MID_LOG = """
import os, signal, sys

class Stderr:
    def __init__(self, inner):
        self.inner, self.sent = inner, False

    def write(self, text):
        written = self.inner.write(text)
        if not self.sent and '"ready"' in text:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        self.inner.flush()
        return written

    def __getattr__(self, name):
        return getattr(self.inner, name)

sys.stderr = Stderr(sys.stderr)
from bootseer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@integration
@pytest.mark.parametrize("daemon", ["snapshotter", "depsnap"])
def test_a_stop_signal_during_a_log_line_stops_the_daemon(workdir: Path, daemon: str) -> None:
    depsnap = ["depsnap", "serve", "--socket", str(workdir / "depsnap.sock"), "--cache-dir", str(workdir / "cache")]
    args = _snapshotter_args(workdir) if daemon == "snapshotter" else depsnap
    python = BOOTSEER_BIN.parent / "python"
    proc = subprocess.Popen(
        [str(python), "-c", _SIGNAL_MID_LOG, *args, "--log-format", "json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"{daemon} did not stop on a SIGTERM that came while it logged:\n{err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    assert '"stopping"' in err and '"SIGTERM"' in err, err[-2000:]
