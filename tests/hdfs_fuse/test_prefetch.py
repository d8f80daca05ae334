"""Prefetch through the mount: a file fetched into the page cache ahead of
its reader, asked for by reading an extended attribute, as a pod does, or
by `bootseer hdfs-fuse prefetch`."""

from __future__ import annotations

import errno
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hdfs_fuse import prefetch_client
from tests.harness.nginx import Nginx
from tests.harness.procs import wait_until
from tests.hdfs_fuse.conftest import REPO, STRIPE, Mount


def metric(m: Mount, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{m.metrics_port}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))


def _second_reads(m: Mount) -> float:
    return metric(m, "bootseer_hdfs_fuse_retries_total") + metric(m, "bootseer_hdfs_fuse_hedged_reads_total")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bootseer.cli", "hdfs-fuse", "prefetch", "--quiet", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=120,
    )


def _read(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        got = bytearray()
        while chunk := f.read(1 << 20):
            got += chunk
    return bytes(got)


def _source(tmp_path: Path, **files: bytes) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    return src


def test_a_prefetched_file_is_read_from_the_page_cache(tmp_path: Path, mount: Callable[..., Mount]) -> None:
    data = random.Random(21).randbytes(40 * STRIPE + 99)
    m = mount(f"file://{_source(tmp_path, **{'ckpt.bin': data})}")
    done = _cli("--wait", str(m.path / "ckpt.bin"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"done {len(data)}/{len(data)} bytes" in done.stdout
    assert prefetch_client.status(m.path / "ckpt.bin").state == "done"
    assert metric(m, "bootseer_hdfs_fuse_fetched_bytes_total") == len(data)
    assert metric(m, "bootseer_hdfs_fuse_prefetched_bytes_total") == len(data)
    assert _read(m.path / "ckpt.bin") == data
    # The reader asked the mount for next to nothing: every page was in the
    # cache, but for the few the kernel may have taken back meanwhile (these
    # VMs run DAMON's proactive reclaim, which pages out page-cache pages
    # nobody touched for a second or so: about one in a thousand here).
    assert metric(m, "bootseer_hdfs_fuse_fuse_read_request_bytes_sum") <= len(data) // 100


def test_a_reader_during_a_prefetch_shares_its_stripes(
    tmp_path: Path, private_nginx: Callable[..., Nginx], mount: Callable[..., Mount]
) -> None:
    data = random.Random(22).randbytes(48 * STRIPE + 5)
    server = private_nginx(_source(tmp_path, **{"ckpt.bin": data}), limit_rate="1m")
    m = mount(server.url + "/")
    started = prefetch_client.request(m.path / "ckpt.bin")
    assert started.state == "running" and started.size == len(data)
    # Asking again while it runs starts nothing new.
    assert prefetch_client.request(m.path / "ckpt.bin").state == "running"
    assert _read(m.path / "ckpt.bin") == data
    wait_until(lambda: prefetch_client.status(m.path / "ckpt.bin").ended, 30, "the prefetch to end")
    ended = prefetch_client.status(m.path / "ckpt.bin")
    assert ended.state in ("done", "handed-over"), ended
    # Every stripe came over the network once, however the two split the work.
    gets = [line for line in server.access_log.read_text().splitlines() if '"GET /ckpt.bin' in line]
    assert len(gets) == 49 + _second_reads(m), m.log()


def test_bad_requests_get_clear_errors_and_the_mount_goes_on(
    tmp_path: Path, private_nginx: Callable[..., Nginx], mount: Callable[..., Mount]
) -> None:
    data = random.Random(23).randbytes(64 * STRIPE)
    src = _source(tmp_path, **{"ckpt.bin": data, "other.bin": data[:STRIPE]})
    server = private_nginx(src, limit_rate="1m")
    m = mount(server.url + "/", "--retries", "1")
    assert prefetch_client.status(m.path / "ckpt.bin").state == "none"
    with pytest.raises(OSError) as caught:
        os.getxattr(m.path, prefetch_client.XATTR)
    assert caught.value.errno == errno.EISDIR
    with pytest.raises(OSError) as caught:
        os.getxattr(m.path / "ckpt.bin", "user.something.else")
    assert caught.value.errno == errno.ENODATA
    outside = _cli(str(tmp_path))
    assert outside.returncode == 1 and "not on an hdfs-fuse mount" in outside.stderr, outside.stderr
    # The store goes away mid-prefetch: the prefetch fails, with the reason,
    # and the mount still serves what it can.
    assert (m.path / "other.bin").stat().st_size == STRIPE
    assert prefetch_client.request(m.path / "ckpt.bin").state == "running"
    server.stop()
    wait_until(lambda: prefetch_client.status(m.path / "ckpt.bin").ended, 30, "the prefetch to end")
    failed = prefetch_client.status(m.path / "ckpt.bin")
    assert failed.state == "failed" and "gave up after 2 attempts" in failed.detail, failed
    # Asked again with the store still gone: it fails at once, saying why.
    again = _cli("--wait", str(m.path / "ckpt.bin"))
    assert again.returncode == 1, again.stdout + again.stderr
    assert re.search(r"ckpt.bin: failed 0/\d+ bytes: cannot open", again.stdout), again.stdout
    server.start()
    assert _read(m.path / "other.bin") == data[:STRIPE]
