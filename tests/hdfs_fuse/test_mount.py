"""The FUSE mount, run by `bootseer hdfs-fuse mount`: what ordinary tools see."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hdfs_fuse import mountinfo
from tests.harness.nginx import Nginx
from tests.hdfs_fuse.conftest import REPO, STRIPE, Mount, Tree


def test_listing_attributes_and_cat(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}")
    assert sorted(os.listdir(m.path)) == ["big.bin", "empty.bin", "odd.bin", "one-stripe.bin", "small.txt", "sub"]
    assert os.listdir(m.path / "sub" / "deeper") == ["nested.bin"]
    for name, data in tree.files.items():
        st = os.stat(m.path / name)
        assert st.st_size == len(data) and st.st_mode & 0o777 == 0o444
        out = subprocess.run(["cat", str(m.path / name)], capture_output=True, check=True).stdout
        assert out == data, name
    assert not (m.path / "missing").exists()
    assert os.statvfs(m.path).f_namemax == 255


def test_dd_with_large_blocks_and_offsets(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}")
    data = tree.files["big.bin"]
    out = subprocess.run(
        ["dd", f"if={m.path / 'big.bin'}", "bs=4M", "status=none"], capture_output=True, check=True
    ).stdout
    assert out == data
    out = subprocess.run(
        ["dd", f"if={m.path / 'big.bin'}", "bs=1000", "skip=777", "count=3000", "iflag=direct", "status=none"],
        capture_output=True,
        check=True,
    ).stdout
    assert out == data[777_000 : 777_000 + 3_000_000]


def test_kernel_sends_large_reads(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}")
    with open(m.path / "big.bin", "rb") as f:
        assert f.read() == tree.files["big.bin"]
    metrics = httpx.get(f"http://127.0.0.1:{m.metrics_port}/metrics").text
    bucket = r'bootseer_hdfs_fuse_fuse_read_request_bytes_bucket\{le="([0-9.e+]+)"\} ([0-9.e+]+)'
    counts = {float(le): float(v) for le, v in re.findall(bucket, metrics)}
    total_match = re.search(r"bootseer_hdfs_fuse_fuse_read_request_bytes_count ([0-9.e+]+)", metrics)
    assert total_match is not None, metrics
    total = float(total_match[1])
    # Default FUSE mounts get 128 KiB requests; this one gets more.
    assert total > counts[131072.0], metrics
    assert "bootseer_hdfs_fuse_readahead_hit_bytes_total" in metrics


def test_numpy_fromfile_and_random_preads(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}")
    data = tree.files["odd.bin"]
    array = np.fromfile(m.path / "odd.bin", dtype=np.uint8)
    assert array.tobytes() == data
    rng = random.Random(4)
    fd = os.open(m.path / "odd.bin", os.O_RDONLY)
    try:
        for _ in range(100):
            offset, size = rng.randrange(len(data) + 5), rng.randrange(1, 2 * STRIPE)
            assert os.pread(fd, size, offset) == data[offset : offset + size]
    finally:
        os.close(fd)


def test_torch_load_of_a_checkpoint(tmp_path: Path, mount: Callable[..., Mount]) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(256, 257) for i in range(6)}
    momentum = torch.randn(1000)
    torch.save({"model": model, "optimizer": {"step": 1234, "lr": 3e-4, "momentum": momentum}}, src / "model.pt")
    m = mount(f"file://{src}")
    loaded = torch.load(m.path / "model.pt", weights_only=True)
    assert loaded["optimizer"]["step"] == 1234
    for key, tensor in model.items():
        assert torch.equal(loaded["model"][key], tensor)
    assert torch.equal(loaded["optimizer"]["momentum"], momentum)


def test_concurrent_readers_through_the_mount(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}")
    names = list(tree.files) * 4

    def digest(name: str) -> bool:
        with open(m.path / name, "rb", buffering=0) as f:
            h = hashlib.sha256()
            while chunk := f.read(100_003):
                h.update(chunk)
        return h.digest() == hashlib.sha256(tree.files[name]).digest()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(digest, names))


def _open_and_close(path: Path, mode: str) -> None:
    with open(path, mode):
        pass


def test_writes_are_refused_with_erofs(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}")
    attempts: list[Callable[[], object]] = [
        lambda: _open_and_close(m.path / "new.txt", "wb"),
        lambda: _open_and_close(m.path / "small.txt", "r+b"),
        lambda: os.mkdir(m.path / "dir"),
        lambda: os.unlink(m.path / "small.txt"),
        lambda: os.rename(m.path / "small.txt", m.path / "x"),
        lambda: os.chmod(m.path / "small.txt", 0o777),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS
    assert (tree.root / "small.txt").read_bytes() == tree.files["small.txt"]


def test_single_file_uri_mounts_as_a_directory_of_one(tree: Tree, mount: Callable[..., Mount]) -> None:
    m = mount(f"file://{tree.root}/odd.bin")
    assert os.listdir(m.path) == ["odd.bin"]
    assert (m.path / "odd.bin").read_bytes() == tree.files["odd.bin"]


def test_http_mount_and_server_loss_gives_eio(
    tmp_path: Path, private_nginx: Callable[..., Nginx], mount: Callable[..., Mount]
) -> None:
    data = random.Random(9).randbytes(32 * STRIPE)
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "ckpt.bin").write_bytes(data)
    server = private_nginx(tmp_path / "srv", limit_rate="2m")
    m = mount(server.url + "/", "--retries", "2", "--kernel-readahead", "0")
    with open(m.path / "ckpt.bin", "rb", buffering=0) as f:
        got = f.read(STRIPE)
        assert got == data[:STRIPE]
        server.stop()
        with pytest.raises(OSError) as caught:
            while chunk := f.read(STRIPE):
                assert chunk == data[len(got) : len(got) + len(chunk)]  # never wrong bytes
                got += chunk
        assert caught.value.errno == errno.EIO
    assert "gave up after 3 attempts" in m.log()


def test_cli_mount_in_background_and_umount(tree: Tree, tmp_path: Path) -> None:
    mountpoint = tmp_path / "bg"
    mountpoint.mkdir()
    cli = [sys.executable, "-m", "bootseer.cli", "hdfs-fuse"]
    started = subprocess.run(
        [
            *cli,
            "mount",
            f"file://{tree.root}",
            str(mountpoint),
            "--log-file",
            str(tmp_path / "bg.log"),
            "--stripe-size",
            "256K",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    try:
        assert started.returncode == 0, started.stderr
        pid = int(started.stdout.split("(pid ")[1].split(",")[0])
        assert (mountpoint / "small.txt").read_bytes() == tree.files["small.txt"]
    finally:
        stopped = subprocess.run(
            [*cli, "umount", str(mountpoint)], capture_output=True, text=True, cwd=REPO, check=False
        )
    assert stopped.returncode == 0, stopped.stderr
    assert mountinfo.current(mountpoint) is None
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the daemon outlived its mount"


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "bootseer.cli", "hdfs-fuse"]
    bad = subprocess.run(
        [*cli, "mount", "ftp://x/y", str(tmp_path)], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert bad.returncode == 1 and "scheme must be one of" in bad.stderr
    missing = subprocess.run([*cli, "umount", str(tmp_path)], capture_output=True, text=True, cwd=REPO, check=False)
    assert missing.returncode == 1 and "is not mounted" in missing.stderr


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found is not None, text
    return float(found[1])


@pytest.mark.parametrize("push", ["on", "off"])
def test_arriving_stripes_are_pushed_into_the_page_cache(
    tmp_path: Path, mount: Callable[..., Mount], push: str
) -> None:
    data = random.Random(11).randbytes(64 * STRIPE + 5)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "ckpt.bin").write_bytes(data)
    m = mount(f"file://{tmp_path / 'src'}", "--kernel-readahead", "256K", "--page-cache-push", push)
    with open(m.path / "ckpt.bin", "rb", buffering=0) as f:
        got = bytearray()
        while chunk := f.read(1 << 20):
            got += chunk
    assert got == data
    metrics = httpx.get(f"http://127.0.0.1:{m.metrics_port}/metrics").text
    pushed = _metric(metrics, "bootseer_hdfs_fuse_page_cache_pushed_bytes_total")
    asked = _metric(metrics, "bootseer_hdfs_fuse_fuse_read_request_bytes_sum")
    if push == "on":
        # The reader found pushed pages without asking the mount for them.
        assert pushed > 0 and asked < len(data), metrics
    else:
        assert pushed == 0 and asked >= len(data), metrics
