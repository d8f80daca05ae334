"""`bootseer pull` run by the snapshotter daemon on its pull socket: the
same pull as in-process, the CLI's fallback when no daemon answers, and a
daemon that takes no harm from bad requests or clients that leave."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from snapshotter.pullwire import PullRequest, encode_event, request_pull
from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, busybox_layer
from tests.harness.procs import wait_until
from tests.harness.snapshotter import BOOTSEER_BIN

pytestmark = pytest.mark.integration


def _log(node: LazyNode) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", node.snapshotter.daemon.log_path.read_text(errors="replace"))


def _served(node: LazyNode, ref: str) -> int:
    """How many pulls of `ref` the snapshotter took on its pull socket."""
    return sum(1 for line in _log(node).splitlines() if "pull.request" in line and f"image={ref}" in line)


def _ask(address: Path, line: bytes) -> list[dict[str, object]]:
    """Send raw bytes as a request; the events the daemon answers with."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(address))
        sock.sendall(line)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return [json.loads(x) for x in data.splitlines()]


def test_the_snapshotter_runs_the_pull(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    image = images.push(f"socket/lazy-{unique}", [busybox_layer(), [File("/hello.txt", b"hello\n")]])
    lazy_node.index(image.ref)
    address = lazy_node.layers.config.pull_socket
    assert stat.S_IMODE(address.stat().st_mode) == 0o600
    out = lazy_node.pull(image.ref)
    assert "(2 remote, 0 fetched, 0 already present; 0 bytes fetched)" in out, out
    assert _served(lazy_node, image.ref) == 1
    c = lazy_node.containerd
    shown = c.ctr("run", "--rm", "--snapshotter", "bootseer", image.ref, f"sock-{unique}", "/bin/cat", "/hello.txt")
    assert shown.stdout == "hello\n"
    # Again: every layer is there now.
    assert "(0 remote, 0 fetched, 2 already present" in lazy_node.pull(image.ref)
    assert _served(lazy_node, image.ref) == 2


def test_errors_come_back_from_the_daemon(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    missing = f"{images.registry_host}/socket/missing-{unique}:v1"
    result = lazy_node.try_pull(missing)
    assert result.returncode == 1
    assert "bootseer pull:" in result.stderr and "not found" in result.stderr, result.stderr
    assert _served(lazy_node, missing) == 1
    bad = lazy_node.try_pull("UPPER/case")
    assert bad.returncode == 1 and "invalid repository" in bad.stderr
    assert lazy_node.snapshotter.daemon.alive()


def test_a_bad_request_gets_a_reason_and_harms_nothing(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    address = lazy_node.layers.config.pull_socket
    for line, why in [
        (b"GET / HTTP/1.1\r\n\r\n", "not a JSON request"),
        (b'{"image": "a"}\n', "must be a non-empty string"),
        (b'{"image": "a", "address": "/c", "namespace": "n", "snapshotter": "s", "x": 1}\n', "unknown request fields"),
        (b"{" + b" " * (1 << 17) + b"}\n", "longer than"),
    ]:
        events = _ask(address, line)
        assert len(events) == 1 and events[0]["event"] == "error", events
        assert why in str(events[0]["message"]), events
    # A bare connect (a health check) is no request at all.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(address))
    image = images.push(f"socket/after-{unique}", [[File("/marker", unique.encode())]])
    lazy_node.index(image.ref)
    assert "(1 remote" in lazy_node.pull(image.ref)


def test_a_daemon_that_refuses_the_request_leaves_the_pull_to_the_command(
    lazy_node: LazyNode, images: ImageBuilder, unique: str, tmp_path: Path
) -> None:
    """An older daemon than the command (a field it does not know), as it
    answers: the command says so and pulls itself."""
    image = images.push(f"socket/older-{unique}", [busybox_layer(), [File("/older.txt", b"older\n")]])
    older = tmp_path / "older.sock"
    refusal = encode_event("error", message="bad request: unknown request fields: started", refused=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(older))
        server.listen()

        def answer() -> None:
            peer, _ = server.accept()
            with peer:
                peer.recv(65536)
                peer.sendall(refusal)

        answering = threading.Thread(target=answer, daemon=True)
        answering.start()
        config = tmp_path / "config.toml"
        own = str(lazy_node.layers.config.pull_socket)
        config.write_text(lazy_node.layers.config.path.read_text().replace(own, str(older)))
        c = lazy_node.containerd
        argv = [str(BOOTSEER_BIN), "pull", "--config", str(config), "--address", str(c.address)]
        done = subprocess.run(
            [*argv, "--namespace", c.namespace, "--snapshotter", "overlayfs", image.ref],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        answering.join(10)
    assert done.returncode == 0, done.stderr
    assert "refused the pull: bad request: unknown request fields: started" in done.stderr
    assert "pulling in this process" in done.stderr and "(0 remote, " in done.stdout
    assert _served(lazy_node, image.ref) == 0


def test_only_root_may_ask(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    address = lazy_node.layers.config.pull_socket
    c = lazy_node.containerd
    request = PullRequest(f"{images.registry_host}/socket/nobody-{unique}:v1", str(c.address), c.namespace, "bootseer")
    # As if another user reached the socket before its chmod: a link to it
    # where that user can go (the node's work directory is root's).
    shared = Path(tempfile.mkdtemp(prefix="bs-pub-", dir="/tmp"))
    shared.chmod(0o755)
    os.link(address, shared / "pull.sock")
    address.chmod(0o666)
    try:
        asked = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", _ASK_AS_NOBODY],
            input=request.encode(),
            capture_output=True,
            timeout=60,
            check=False,
            env={"ADDRESS": str(shared / "pull.sock")},
        )
    finally:
        address.chmod(0o600)
        shutil.rmtree(shared)
    assert asked.returncode == 0, asked.stderr
    events = [json.loads(line) for line in asked.stdout.splitlines()]
    assert len(events) == 1 and events[0]["event"] == "error", events
    assert "uid 65534 may not pull" in str(events[0]["message"])
    assert _served(lazy_node, request.image) == 0


# Sends stdin's request line to $ADDRESS and prints the answer.
_ASK_AS_NOBODY = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["ADDRESS"])
s.sendall(sys.stdin.buffer.read())
s.shutdown(socket.SHUT_WR)
while chunk := s.recv(65536):
    sys.stdout.buffer.write(chunk)
"""


def test_a_client_that_leaves_mid_pull_leaves_nothing_behind(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    # Not indexed: the layer takes the normal path, a download in chunks.
    big = random.Random(unique).randbytes(24 << 20)
    image = images.push(f"socket/left-{unique}", [busybox_layer(), [File("/big.bin", big)]])
    c = lazy_node.containerd
    request = PullRequest(image.ref, str(c.address), c.namespace, "bootseer")
    events = request_pull(lazy_node.layers.config.pull_socket, request)
    for event in events:
        if event["event"] == "fetched":
            break
    events.close()  # the client goes: its socket closes
    wait_until(lambda: "pull.client_gone" in _log(lazy_node), 60, "the daemon to see its client go")
    wait_until(lambda: c.ctr("leases", "ls", "-q").stdout.split() == [], 30, "the pull's lease to go")
    assert not [k for k in c.snapshots("bootseer") if k.startswith("extract-")]
    # The image was never recorded, and a whole pull afterwards works.
    assert image.ref not in c.ctr("images", "ls", "-q").stdout.split()
    assert f"{image.layout.layer_sizes[1]} bytes fetched" in lazy_node.pull(image.ref)


def test_without_a_daemon_the_command_pulls_itself(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    image = images.push(f"socket/self-{unique}", [busybox_layer(), [File("/self.txt", b"self\n")]])
    c = lazy_node.containerd

    def pull(*flags: str) -> subprocess.CompletedProcess[str]:
        argv = [str(BOOTSEER_BIN), "pull", "--config", str(lazy_node.layers.config.path), *flags]
        argv += ["--address", str(c.address), "--namespace", c.namespace, "--snapshotter", "overlayfs", image.ref]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)

    asked = pull("--in-process")
    assert asked.returncode == 0 and "(0 remote, " in asked.stdout, asked.stderr
    assert _served(lazy_node, image.ref) == 0
    c.ctr("images", "rm", "--sync", image.ref)
    # A killed daemon leaves its socket file, which nothing answers on.
    lazy_node.snapshotter.kill9()
    try:
        assert lazy_node.layers.config.pull_socket.is_socket()
        done = pull()
        assert done.returncode == 0 and "(0 remote, " in done.stdout, done.stderr
    finally:
        lazy_node.snapshotter.start()
        c.wait_snapshotter()
    assert _served(lazy_node, image.ref) == 0
    shown = c.ctr("run", "--rm", "--snapshotter", "overlayfs", image.ref, f"self-{unique}", "/bin/cat", "/self.txt")
    assert shown.stdout == "self\n"
    # The restarted daemon serves pulls again.
    again = images.push(f"socket/again-{unique}", [[File("/marker", unique.encode())]])
    lazy_node.index(again.ref)
    assert "(1 remote" in lazy_node.pull(again.ref)
    assert _served(lazy_node, again.ref) == 1
