"""A running container never loses its files when the layer server goes: a
container hashes a 100 MB lazily served file in a loop while the server is
`kill -9`ed (as the OOM killer would) or stopped with SIGTERM (a restart),
and a new server is started on the same mount, as systemd would: the loop
goes on, every hash is right, and new containers start on both sides."""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, busybox_layer
from tests.harness.procs import wait_until
from tests.harness.tree import drop_page_cache

pytestmark = pytest.mark.integration

BIG = 100 << 20
# A pass of the loop that does not end this long after the server came back
# is a hang: far above what 100 MB from the layer server's cache takes.
PASS_BOUND_S = 120.0


@pytest.fixture
def out_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bs-failover-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _hashes(out: Path) -> list[str]:
    path = out / "hashes"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_a_container_reading_through_a_layer_server_restart_sees_every_byte(
    lazy_node: LazyNode, images: ImageBuilder, unique: str, out_dir: Path, how: str
) -> None:
    data = random.Random(how).randbytes(BIG)
    want = hashlib.sha256(data).hexdigest()
    image = images.push(f"failover/{how.replace(' ', '').lower()}-{unique}", [busybox_layer(), [File("/big", data)]])
    lazy_node.index(image.ref)
    lazy_node.pull(image.ref)
    c = lazy_node.containerd
    name = f"hasher-{unique}"
    script = (
        "while true; do "
        "if sha256sum /big > /out/one 2>>/out/errors; then cut -d' ' -f1 /out/one >> /out/hashes; "
        "else echo failed >> /out/failures; fi; done"
    )
    c.ctr(
        "run", "-d", "--snapshotter", "bootseer",
        "--mount", f"type=bind,src={out_dir},dst=/out,options=rbind:rw",
        image.ref, name, "/bin/sh", "-c", script,
    )  # fmt: skip
    try:
        wait_until(lambda: len(_hashes(out_dir)) >= 1, PASS_BOUND_S, "the first pass")
        before = len(_hashes(out_dir))
        drop_page_cache()
        # Mid-read: the loop reads /big through the layer server right now.
        wait_until(lambda: lazy_node.layers.metric("bootseer_fs_op_seconds_count") > 0, 10, "reads")
        stop: Callable[[], None] = lazy_node.layers.kill9 if how == "kill -9" else lazy_node.layers.stop
        stop()
        # Still mounted (mountinfo only: a stat would wait for a server).
        assert _mounted(lazy_node)
        lazy_node.layers.start()
        # The loop goes on: passes after the restart, each hash right.
        drop_page_cache()
        wait_until(lambda: len(_hashes(out_dir)) >= before + 2, PASS_BOUND_S, "passes after the restart")
        hashes = _hashes(out_dir)
        assert set(hashes) == {want}, hashes
        failures = (out_dir / "failures").read_text() if (out_dir / "failures").exists() else ""
        errors = (out_dir / "errors").read_text() if (out_dir / "errors").exists() else ""
        if how == "SIGTERM":
            # A graceful restart fails no read.
            assert failures == "" and errors == "", errors
        else:
            # kill -9: a read the dead server had taken is resent to the new
            # one, or at worst fails with EIO; never a hang, never wrong bytes.
            assert errors.count("\n") == failures.count("\n") <= 1, errors
            assert "Input/output error" in errors or errors == "", errors
        # New containers start after the restart, and the new server serves them.
        shown = c.run(image.ref, f"after-{unique}", "/bin/sh", "-c", "sha256sum /big | cut -d' ' -f1")
        assert shown.strip() == want
        assert lazy_node.layers.daemon.alive(), lazy_node.layers.logs()
        # Both connections: the layer mount's and its plain twin's.
        assert lazy_node.layers.daemon.log_path.read_text().count("took the FUSE connection over") == 2
    finally:
        c.remove_container(name, check=False)


def _mounted(node: LazyNode) -> bool:
    """Both mounts are there (a dead server's mount would make ismount stat it)."""
    found = [
        subprocess.run(["findmnt", "-n", str(m)], check=False, capture_output=True, text=True).stdout.strip()
        for m in node.layers.config.mountpoints
    ]
    return all(found)
