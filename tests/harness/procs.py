"""Start, probe and stop daemon processes by PID.

Every daemon the tests start is tracked by the Popen object that started it,
so teardown signals exactly that PID (or the process group it leads), never a
name: the machine may run other containerd or registry instances.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Long enough for a loaded 2-core machine to start containerd, short enough
# that a daemon that will never come up fails the session quickly.
DEFAULT_START_TIMEOUT = 30.0
DEFAULT_STOP_GRACE = 10.0


class DaemonError(RuntimeError):
    """A daemon did not start, or died; the message carries its log tail."""


@dataclass
class Daemon:
    """A running background process whose output goes to `log_path`."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def describe_failure(self, what: str) -> str:
        status = "running" if self.alive() else f"exited with {self.proc.returncode}"
        return (
            f"{self.name} (pid {self.pid}, {status}): {what}\n"
            f"command: {' '.join(self.argv)}\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def stop(self, grace: float = DEFAULT_STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `grace` seconds."""
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill9()

    def kill9(self) -> None:
        """Simulate a crash: SIGKILL this PID only, then reap it.

        Children the daemon started (a separate FUSE server, say) are left
        alone on purpose; surviving such a crash is what the tests check.
        """
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def kill_group(self) -> None:
        """SIGKILL whatever is left in the process group this daemon leads.

        Used at session end only, after `stop`, so helpers the daemon forked
        (and that did not leave its group) do not outlive the tests.
        """
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.poll()


def start_daemon(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    ready: Callable[[], bool],
    timeout: float = DEFAULT_START_TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> Daemon:
    """Start `argv` in its own process group and wait until `ready()` is true.

    Its own group keeps a Ctrl-C on pytest from reaching the daemon before
    teardown has had a chance to stop it in order.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
        )
    daemon = Daemon(name=name, argv=list(argv), log_path=log_path, proc=proc)
    try:
        wait_until(ready, timeout, f"{name} to answer", daemon)
    except BaseException:
        daemon.stop(grace=2.0)
        raise
    return daemon


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    daemon: Daemon | None = None,
) -> None:
    """Poll `predicate` until true; fail early if `daemon` dies meanwhile."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if predicate():
            return
        if daemon is not None and not daemon.alive():
            raise DaemonError(daemon.describe_failure(f"died while waiting for {what}"))
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:.0f}s waiting for {what}"
            raise DaemonError(daemon.describe_failure(message) if daemon else message)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def unix_socket_answers(path: Path) -> bool:
    """True once something accepts connections on the unix socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def tcp_port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out, so very likely still free.

    The daemon binds it a moment later; the tiny race is acceptable in tests
    (a collision shows up as a start failure with the log tail).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_pid(pid: int, grace: float = DEFAULT_STOP_GRACE) -> None:
    """SIGTERM then SIGKILL a process we did not fork ourselves (a shim)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
