"""Fixtures: a tree of test files, nginx serving it, and hdfs-fuse mounts
run by the real CLI, each stopped by PID and unmounted at teardown."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hdfs_fuse import mountinfo
from hdfs_fuse.settings import HdfsFuseConfig
from tests.harness.nginx import Nginx, remove, start_nginx
from tests.harness.procs import Daemon, free_tcp_port, start_daemon

STRIPE = 256 * 1024
REPO = Path(__file__).resolve().parents[2]


def small_config(**overrides: Any) -> HdfsFuseConfig:
    """Small stripes so a few MB exercise many of them; a short retry budget."""
    small = HdfsFuseConfig(
        stripe_size=STRIPE,
        streams=4,
        readahead=8 * STRIPE,
        memory=32 * STRIPE,
        retries=3,
        backoff=0.02,
        backoff_max=0.2,
        stripe_timeout=5.0,
        io_timeout=5.0,
        attr_ttl=1.0,
    )
    return dataclasses.replace(small, **overrides)


@dataclass
class Tree:
    root: Path
    # name -> content of every file, relative to root
    files: dict[str, bytes]


@pytest.fixture(scope="session")
def tree() -> Iterator[Tree]:
    root = Path(tempfile.mkdtemp(prefix="bs-hf-tree-", dir="/tmp"))
    rng = random.Random(7)
    files = {
        "empty.bin": b"",
        "small.txt": b"hello, stripes\n",
        "one-stripe.bin": rng.randbytes(STRIPE),
        "odd.bin": rng.randbytes(3 * STRIPE + 12345),
        "big.bin": rng.randbytes(24 * STRIPE + 7),
        "sub/deeper/nested.bin": rng.randbytes(2 * STRIPE - 1),
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    try:
        yield Tree(root, files)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def nginx(tree: Tree) -> Iterator[Nginx]:
    """nginx over `tree` with a per-connection rate limit."""
    server = start_nginx(tree.root, limit_rate="16m")
    try:
        yield server
    finally:
        remove(server)


@pytest.fixture
def private_nginx(tmp_path: Path) -> Iterator[Callable[..., Nginx]]:
    """Start an nginx of the test's own (it may stop and restart it)."""
    started: list[Nginx] = []

    def start(root: Path, **kwargs: Any) -> Nginx:
        server = start_nginx(root, **kwargs)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            remove(server)


@dataclass
class Mount:
    path: Path
    daemon: Daemon
    metrics_port: int

    def log(self) -> str:
        return self.daemon.log_tail(200)


def _umount(path: Path) -> None:
    if mountinfo.current(path) is None:
        return
    result = subprocess.run(
        [sys.executable, "-m", "bootseer.cli", "hdfs-fuse", "umount", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if result.returncode != 0 and mountinfo.current(path) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(path)], check=False)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """`mount(uri, *flags, directory=None)`: a foreground hdfs-fuse daemon,
    ready once mounted at `directory` (the test's tmp_path)/mnt<n>."""
    mounts: list[Mount] = []

    def start(uri: str, *flags: str, directory: Path | None = None) -> Mount:
        path = (directory or tmp_path) / f"mnt{len(mounts)}"
        path.mkdir()
        port = free_tcp_port()
        argv = [
            sys.executable,
            "-m",
            "bootseer.cli",
            "hdfs-fuse",
            "mount",
            "--foreground",
            "--log-format",
            "json",
            "--log-level",
            "debug",
            "--stripe-size",
            str(STRIPE),
            "--streams",
            "4",
            "--readahead",
            str(8 * STRIPE),
            "--memory",
            str(32 * STRIPE),
            "--retries",
            "3",
            "--backoff",
            "0.02",
            "--backoff-max",
            "0.2",
            "--io-timeout",
            "5",
            "--attr-ttl",
            "1",
            "--metrics-address",
            f"127.0.0.1:{port}",
            *flags,
            uri,
            str(path),
        ]
        daemon = start_daemon(
            "hdfs-fuse",
            argv,
            tmp_path / f"mnt{len(mounts)}.log",
            ready=lambda: mountinfo.current(path) is not None,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        m = Mount(path, daemon, port)
        mounts.append(m)
        return m

    try:
        yield start
    finally:
        for m in mounts:
            _umount(m.path)
            m.daemon.stop()
        leftovers = [str(m.path) for m in mounts if mountinfo.current(m.path) is not None]
        assert not leftovers, f"mounts left behind: {leftovers}"
