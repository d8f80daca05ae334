"""The bootseer snapshotter under test, as a process the tests can crash.

One root dir and one socket path survive every restart, as they would under
a service manager, so a restart test sees exactly what a crashed node would.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.procs import Daemon, start_daemon, unix_socket_answers
from tests.harness.tree import unmount_under

# The console script installed next to the interpreter running the tests,
# i.e. the repo's .venv, so the code under test is the working tree's.
BOOTSEER_BIN = Path(sys.executable).parent / "bootseer"


@dataclass
class Snapshotter:
    workdir: Path
    # More command-line flags (e.g. --metrics-address), kept across restarts.
    extra_args: tuple[str, ...] = ()
    # Every process started so far; the last one is the current one.
    incarnations: list[Daemon] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.workdir / "root"

    @property
    def address(self) -> Path:
        return self.workdir / "snapshotter.sock"

    @property
    def snapshots_dir(self) -> Path:
        """Per-snapshot directories: ROOT/snapshots/<id>/{fs,work}."""
        return self.root / "snapshots"

    @property
    def daemon(self) -> Daemon:
        return self.incarnations[-1]

    def start(self) -> None:
        """Start a new process on the same root and socket; wait for the socket.

        A stale socket file left by a killed process is not removed here:
        coping with it is the snapshotter's job after a crash.
        """
        if self.incarnations and self.daemon.alive():
            raise RuntimeError(f"snapshotter already running as pid {self.daemon.pid}")
        if not BOOTSEER_BIN.exists():
            raise FileNotFoundError(f"{BOOTSEER_BIN} is missing: run `make setup` first")
        argv = [
            str(BOOTSEER_BIN),
            "snapshotter",
            "--root",
            str(self.root),
            "--address",
            str(self.address),
            "--log-level",
            "debug",
            "--log-format",
            "console",
            # Without a config of its own, keep its layer store and pull
            # socket here too: the defaults are the host's /var/lib and /run paths.
            *(() if "--config" in self.extra_args else self._private_layer_paths()),
            *self.extra_args,
        ]
        number = len(self.incarnations) + 1
        self.incarnations.append(
            start_daemon(
                f"bootseer snapshotter #{number}",
                argv,
                self.workdir / f"snapshotter.{number}.log",
                ready=lambda: unix_socket_answers(self.address),
            )
        )

    def _private_layer_paths(self) -> tuple[str, ...]:
        return (
            "--fs-store",
            str(self.workdir / "layers"),
            "--fs-mountpoint",
            str(self.workdir / "m"),
            "--pull-address",
            str(self.workdir / "pull.sock"),
        )

    def stop(self) -> None:
        self.daemon.stop()

    def kill9(self) -> None:
        """Crash the snapshotter process (only it, not its helpers)."""
        self.daemon.kill9()

    def restart(self) -> None:
        if self.daemon.alive():
            self.stop()
        self.start()

    def snapshot_ids(self) -> set[str]:
        """The snapshot directories present on disk right now."""
        if not self.snapshots_dir.exists():
            return set()
        return {p.name for p in self.snapshots_dir.iterdir()}

    def teardown(self) -> list[str]:
        """Stop every incarnation and its process group, unmount, remove the dir.

        Returns mounts that could not be removed (the dir is kept then).
        """
        for daemon in self.incarnations:
            daemon.stop()
            daemon.kill_group()
        leftovers = unmount_under(self.workdir)
        if not leftovers:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return leftovers


def start_snapshotter(extra_args: Sequence[str] = ()) -> Snapshotter:
    workdir = Path(tempfile.mkdtemp(prefix="bs-sn-", dir="/tmp"))
    snapshotter = Snapshotter(workdir=workdir, extra_args=tuple(extra_args))
    try:
        snapshotter.start()
    except BaseException:
        snapshotter.teardown()
        raise
    return snapshotter
