"""The HTTP backend against a real nginx: Range requests, a per-connection
rate limit, a JSON directory listing, and a server that goes away mid-read."""

from __future__ import annotations

import errno
import http.server
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import hdfs_fuse
from hdfs_fuse.copy import copy
from hdfs_fuse.reader import Client
from tests.harness.nginx import Nginx
from tests.harness.procs import wait_until
from tests.hdfs_fuse.conftest import STRIPE, Tree, small_config


def test_striped_reads_match_the_files(tree: Tree, nginx: Nginx) -> None:
    with Client(small_config()) as client:
        for name, data in tree.files.items():
            with client.open(f"{nginx.url}/{name}") as f:
                assert f.read() == data, name
        rng = random.Random(2)
        data = tree.files["big.bin"]
        with client.open(f"{nginx.url}/big.bin") as f:
            for _ in range(40):
                offset, size = rng.randrange(len(data)), rng.randrange(1, 3 * STRIPE)
                assert f.pread(size, offset) == data[offset : offset + size]


def _second_reads() -> float:
    """Stripe reads issued again so far: retries after a failure, and hedges
    of a stripe slower than the timeout (a loaded machine has those)."""
    return sum(
        REGISTRY.get_sample_value(name) or 0.0
        for name in ("bootseer_hdfs_fuse_retries_total", "bootseer_hdfs_fuse_hedged_reads_total")
    )


def test_stripes_are_range_requests_over_parallel_connections(tree: Tree, private_nginx: Callable[..., Nginx]) -> None:
    # A server of its own: a shared one may still log a request another
    # test's client left in flight (a read-ahead it closed on).
    nginx = private_nginx(tree.root, limit_rate="16m")
    again = _second_reads()
    with Client(small_config()) as client, client.open(f"{nginx.url}/big.bin") as f:
        assert f.read() == tree.files["big.bin"]
    gets = [line for line in nginx.access_log.read_text().splitlines() if '"GET /big.bin' in line]
    # One per stripe, each once but for the reads issued again.
    assert len(gets) == 25 + (_second_reads() - again)
    assert all(re.search(r'" 206 \d+', line) for line in gets)


def test_listing_and_copy_through_nginx_autoindex(tree: Tree, nginx: Nginx, tmp_path: Path) -> None:
    with Client(small_config()) as client:
        names = {e.name: e for e in client.list(nginx.url + "/")}
        assert names["sub"].is_dir and names["odd.bin"].size == len(tree.files["odd.bin"])
        assert client.stat(nginx.url + "/sub").is_dir
        report = copy(client, nginx.url + "/", tmp_path / "out")
    assert report.files == len(tree.files)
    for name, data in tree.files.items():
        assert (tmp_path / "out" / name).read_bytes() == data


@pytest.fixture
def redirector(nginx: Nginx) -> Iterator[str]:
    """A server on 127.0.0.1 answering every HEAD and GET with a 302 to the
    same path on `nginx` (as object stores and WebHDFS send readers on)."""

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(302)
            self.send_header("Location", nginx.url + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_redirected_range_reads_follow_the_redirect(tree: Tree, nginx: Nginx, redirector: str) -> None:
    data = tree.files["big.bin"]
    before = nginx.access_log.read_text().count("\n")
    with Client(small_config()) as client, client.open(f"{redirector}/big.bin") as f:
        assert f.read() == data
        assert f.pread(STRIPE + 10, 3 * STRIPE - 5) == data[3 * STRIPE - 5 : 4 * STRIPE + 5]
        assert f.stats.retries == 0
    lines = nginx.access_log.read_text().splitlines()[before:]
    assert sum('"GET /big.bin' in line and '" 206 ' in line for line in lines) >= 25


def test_missing_file_is_file_not_found(nginx: Nginx) -> None:
    with Client(small_config()) as client, pytest.raises(FileNotFoundError):
        client.open(nginx.url + "/nope.bin")


MiB = 1024 * 1024


def _slow_file(root: Path, size: int = 6 * MiB) -> bytes:
    data = random.Random(11).randbytes(size)
    (root / "slow.bin").write_bytes(data)
    return data


def _read_in_thread(f: hdfs_fuse.StripedFile) -> tuple[threading.Thread, dict[str, object]]:
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["data"] = f.read()
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_server_restarted_mid_read_is_retried(tmp_path: Path, private_nginx: Callable[..., Nginx]) -> None:
    data = _slow_file(tmp_path)
    # nginx lets each response start with one second's worth of its rate,
    # then paces it: 1 MiB stripes at 512 KiB/s take about a second each, so
    # the server goes away with stripe reads in flight.
    server = private_nginx(tmp_path, limit_rate="512k")
    config = small_config(
        stripe_size=MiB,
        streams=2,
        readahead=4 * MiB,
        memory=16 * MiB,
        retries=12,
        backoff=0.05,
        backoff_max=0.5,
    )
    with hdfs_fuse.open(f"{server.url}/slow.bin", config) as f:
        thread, result = _read_in_thread(f)
        wait_until(lambda: f.stats.fetched_bytes > 0, 30, "the first stripe")
        server.stop()
        time.sleep(0.3)
        server.start()
        thread.join(60)
        assert result.get("data") == data, result.get("error")
        assert f.stats.retries > 0


def test_server_gone_past_the_retry_budget_is_eio(tmp_path: Path, private_nginx: Callable[..., Nginx]) -> None:
    data = _slow_file(tmp_path)
    server = private_nginx(tmp_path)
    with hdfs_fuse.open(f"{server.url}/slow.bin", small_config(retries=2, readahead=0)) as f:
        assert f.read(STRIPE) == data[:STRIPE]
        server.stop()
        with pytest.raises(hdfs_fuse.RemoteReadError) as caught:
            f.read()
        assert caught.value.errno == errno.EIO
        assert "gave up after 3 attempts" in str(caught.value) and "slow.bin" in str(caught.value)
        assert f.stats.retries == 2 and f.stats.failures == 1


def test_file_replaced_mid_read_fails_instead_of_mixing_versions(
    tmp_path: Path, private_nginx: Callable[..., Nginx]
) -> None:
    data = _slow_file(tmp_path)
    server = private_nginx(tmp_path, limit_rate="2m")
    with hdfs_fuse.open(f"{server.url}/slow.bin", small_config(readahead=0)) as f:
        assert f.read(STRIPE) == data[:STRIPE]
        replacement = tmp_path / "slow.new"
        replacement.write_bytes(bytes(len(data)))
        os.utime(replacement, (time.time() + 100, time.time() + 100))
        os.replace(replacement, tmp_path / "slow.bin")
        with pytest.raises(hdfs_fuse.RemoteReadError, match="changed since it was opened"):
            f.read(STRIPE)


def test_server_without_range_support_is_refused(tmp_path: Path, private_nginx: Callable[..., Nginx]) -> None:
    _slow_file(tmp_path, size=4 * STRIPE)
    server = private_nginx(tmp_path, ranges=False)
    with (
        hdfs_fuse.open(f"{server.url}/slow.bin", small_config()) as f,
        pytest.raises(hdfs_fuse.RemoteReadError, match="ignores Range"),
    ):
        f.read(10)
