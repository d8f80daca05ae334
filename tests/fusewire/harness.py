"""Processes for the failover tests and the benchmark: the descriptor
holder, toy servers and a hashing reader, each started and stopped by its
PID; the mount removed with umount2(2) (umount(8) stats the mountpoint
first, which waits for a server when none runs).

Bounds are subprocess timeouts. A reader waiting on a request a server
took can be killed by nothing but an answer or the end of the connection:
when a bound passes, `abort()` ends the connection through fusectl so the
test fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from snapshotter.fs.fusewire import handoff
from snapshotter.fs.fusewire.connection import mounted_fstype
from snapshotter.fs.fusewire.mount import unmount
from tests.fusewire.toyfs import OPTIONS

BIG_SIZE = 100 << 20
START_TIMEOUT = 30.0
FUSECTL = Path("/sys/fs/fuse/connections")


class Hang(AssertionError):
    """Something did not finish within its bound."""


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise Hang(f"{what}: not within {timeout} s")
        time.sleep(interval)


def make_big(path: Path, size: int = BIG_SIZE) -> str:
    """A file of `size` reproducible pseudo-random bytes; its sha256."""
    import hashlib

    data = random.Random(20240329).randbytes(size)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    out: Path
    stats_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        try:
            return self.out.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.pid} exited with {self.proc.returncode}:\n{self.text()}")
            return "READY" in self.text()

        wait_for(f"server {self.pid} ready", ready, timeout)

    @property
    def source(self) -> str:
        for line in self.text().splitlines():
            if line.startswith("CONNECTION "):
                return line.split()[1]
        return ""

    def stats(self) -> dict[str, object]:
        stats: dict[str, object] = json.loads(self.stats_path.read_text())
        return stats

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


@dataclass
class Reader:
    proc: subprocess.Popen[bytes]
    out: Path
    stop_file: Path

    def passes(self) -> list[dict[str, object]]:
        try:
            lines = self.out.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def wait_passes(self, n: int, after: float, timeout: float) -> None:
        def enough() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"reader exited with {self.proc.returncode}")
            return sum(1 for p in self.passes() if float(str(p["began"])) > after) >= n

        wait_for(f"{n} reader passes", enough, timeout, interval=0.1)

    def stop(self, timeout: float) -> None:
        self.stop_file.touch()
        self.proc.wait(timeout=timeout)


@dataclass
class Failover:
    """A mountpoint, its holder, its servers and readers, in `workdir`."""

    workdir: Path
    big: Path
    holder: subprocess.Popen[bytes] | None = None
    servers: list[Server] = field(default_factory=list)
    readers: list[Reader] = field(default_factory=list)

    @property
    def mountpoint(self) -> Path:
        return self.workdir / "mnt"

    @property
    def socket(self) -> Path:
        return self.workdir / "holder.sock"

    def start_holder(self) -> None:
        # Not Path.mkdir(exist_ok=True): it stats an existing directory,
        # which fails on a dead mount.
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.mountpoint)
        with (self.workdir / "holder.log").open("wb") as log:
            self.holder = subprocess.Popen(
                [sys.executable, "-m", "snapshotter.fs.fusewire.holder", str(self.socket)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for("holder answering", lambda: handoff.holder_alive(self.socket) == self.holder_pid, START_TIMEOUT)

    @property
    def holder_pid(self) -> int | None:
        return self.holder.pid if self.holder is not None else None

    def start_server(self, slow_offset: int | None = None, slow_s: float = 3600.0) -> Server:
        n = len(self.servers)
        out = self.workdir / f"server{n}.out"
        stats = self.workdir / f"server{n}.stats"
        argv = [
            sys.executable,
            "-m",
            "tests.fusewire.toyfs",
            "--mountpoint",
            str(self.mountpoint),
            "--holder",
            str(self.socket),
            "--big",
            str(self.big),
            "--stats",
            str(stats),
        ]
        if slow_offset is not None:
            argv += ["--slow-offset", str(slow_offset), "--slow-s", str(slow_s), "--slow-marker", str(self.marker)]
        with out.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = Server(proc, out, stats)
        self.servers.append(server)
        return server

    @property
    def marker(self) -> Path:
        return self.workdir / "slow.marker"

    def start_reader(self, sha: str) -> Reader:
        n = len(self.readers)
        out = self.workdir / f"reader{n}.jsonl"
        stop = self.workdir / f"reader{n}.stop"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fusewire.reader", str(self.mountpoint / "big.bin"), sha, str(out), str(stop)],
            start_new_session=True,
        )
        reader = Reader(proc, out, stop)
        self.readers.append(reader)
        return reader

    def mounted(self) -> bool:
        return mounted_fstype(self.mountpoint) == OPTIONS.fstype

    def abort(self) -> bool:
        """End the connection (fusectl's abort): every waiting request fails.
        Only on a failing test's way out; fusectl is mounted if it is not
        (and left mounted: something on the machine may use it by then)."""
        conn = _connection_id(self.mountpoint)
        if conn is None:
            return False
        if not (FUSECTL / str(conn)).exists():
            subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], check=False, capture_output=True)
        if not (FUSECTL / str(conn)).exists():
            return False
        (FUSECTL / str(conn) / "abort").write_text("1")
        return True

    def teardown(self) -> list[str]:
        """Stop everything by PID and remove the mount; what leaked."""
        leaks: list[str] = []
        for reader in self.readers:
            reader.stop_file.touch()
        for server in self.servers:
            if server.proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.terminate(timeout=20)
        if self.mounted():
            unmount(self.mountpoint, lazy=True)
        if self.holder is not None:
            # The holder leaves once the connection is gone (or when told).
            try:
                self.holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                leaks.append(f"holder {self.holder.pid} still running after the unmount")
                handoff.drop(self.socket)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.holder.wait(timeout=5)
                if self.holder.poll() is None:
                    self.holder.kill()
                    self.holder.wait()
        for reader in self.readers:
            try:
                reader.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                leaks.append(f"reader {reader.proc.pid} still running")
                reader.proc.kill()
        for server in self.servers:
            if server.proc.poll() is None:
                leaks.append(f"server {server.pid} still running")
                server.proc.kill()
                server.proc.wait()
        if self.mounted():
            leaks.append(f"{self.mountpoint} still mounted")
        return leaks


def _connection_id(mountpoint: Path) -> int | None:
    absolute = Path(os.path.abspath(mountpoint))
    target = os.path.join(os.path.realpath(absolute.parent), absolute.name)
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if len(fields) > 4 and fields[4] == target:
                return int(fields[2].split(":")[1])
    return None
