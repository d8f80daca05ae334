"""The node daemon: containers asking for one key at once cause one download."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from depsnap.client import DaemonNode
from tests.depsnap.conftest import BOOTSEER, PYTHON, Work
from tests.harness.procs import Daemon, start_daemon, unix_socket_answers

CONTAINERS = 4


@pytest.fixture
def daemon(work: Work) -> Iterator[Daemon]:
    socket = work.root / "depsnap.sock"
    proc = start_daemon(
        "depsnap-serve",
        [
            str(BOOTSEER),
            "depsnap",
            "serve",
            "--socket",
            str(socket),
            "--cache-dir",
            str(work.root / "node-cache"),
            "--cache-max-bytes",
            str(1 << 30),
            "--log-format",
            "json",
        ],
        work.root / "daemon.log",
        ready=lambda: unix_socket_answers(socket),
        env=work.env,
    )
    try:
        yield proc
    finally:
        proc.stop()
    assert not socket.exists(), "the daemon left its socket behind"


def in_container(work: Work, parent: Path, script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a private mount namespace with its own tmpfs on `parent`:
    what a container on this node sees (its own filesystem, the host's socket)."""
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-euc",
            f"mount -t tmpfs depsnap-test {parent}\n{script}",
        ],
        capture_output=True,
        text=True,
        env=work.env,
        cwd=work.root,
        check=False,
    )


def ensure_line(work: Work, req: Path, target: Path, *extra: str) -> str:
    return " ".join(
        [
            str(BOOTSEER),
            "depsnap",
            "ensure",
            "-r",
            str(req),
            "--target",
            str(target),
            "--python",
            str(PYTHON),
            "--store",
            str(work.store),
            *extra,
        ]
    )


def test_concurrent_ensures_through_the_daemon_download_once(work: Work, daemon: Daemon) -> None:
    req = work.requirements("dsdemo==1.0\n")
    parent = work.root / "container"
    parent.mkdir()
    target = parent / "env"
    socket = work.root / "depsnap.sock"
    # Another node installed and published it (standalone, its own cache).
    other = work.root / "other-node-cache"
    first = in_container(work, parent, ensure_line(work, req, target, "--no-daemon", "--cache-dir", str(other)))
    assert first.returncode == 0 and "depsnap: miss" in first.stdout, first.stderr

    script = ensure_line(work, req, target, "--socket", str(socket)) + f"\n{target}/bin/dsdemo-hello"
    with ThreadPoolExecutor(CONTAINERS) as pool:
        results = list(pool.map(lambda _: in_container(work, parent, script), range(CONTAINERS)))
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "depsnap: hit" in result.stdout and "via daemon" in result.stdout, result.stdout
        assert "hello from dsdemo 1.0" in result.stdout

    stats = DaemonNode(socket).stats()
    assert stats["downloads"] == 1, stats
    assert stats["hits"] == CONTAINERS - 1, stats
    assert stats["entries"] == 1


def test_a_miss_through_the_daemon_fills_the_node_cache(work: Work, daemon: Daemon) -> None:
    req = work.requirements("dsdemo==1.0\n")
    parent = work.root / "container"
    parent.mkdir()
    target = parent / "env"
    socket = work.root / "depsnap.sock"
    line = ensure_line(work, req, target, "--socket", str(socket))
    miss = in_container(work, parent, line)
    assert "depsnap: miss" in miss.stdout, miss.stderr
    hit = in_container(work, parent, line)
    assert "depsnap: hit" in hit.stdout and "from node cache via daemon" in hit.stdout, hit.stdout
    assert DaemonNode(socket).stats()["puts"] == 1
