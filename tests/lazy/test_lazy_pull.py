"""Lazy pulling end to end: `bootseer index`, `bootseer pull`, the remote
Prepare path, the FUSE layer server and containers run by containerd/runc
from a real registry."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
from pathlib import Path

import pytest

from snapshotter.fs.fusewire.connection import mounted_fstype
from tests.harness import faultproxy, tree
from tests.harness.containerd import CtrError
from tests.harness.images import awkward_layers
from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.oci import Dir, File, ImageBuilder, busybox_layer
from tests.harness.registry import PASSWORD, USER, AuthRegistry, Registry, start_registry
from tests.harness.tree import drop_page_cache

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"


def _lowers(rootfs: Path) -> list[Path]:
    """The lower directories of the overlay mounted at `rootfs`, top first,
    each with the snapshotter's links followed."""
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields, _, rest = line.partition(" - ")
            if fields.split()[4] != str(rootfs):
                continue
            options = rest.split()[2].split(",")
            lowers = [p for o in options if o.startswith("lowerdir=") for p in o.removeprefix("lowerdir=").split(":")]
            lowers += [o.removeprefix("lowerdir+=") for o in options if o.startswith("lowerdir+=")]
            return [Path(os.path.realpath(p)) for p in lowers]
    raise AssertionError(f"nothing is mounted at {rootfs}")


def pulled_counts(output: str) -> dict[str, int]:
    match = re.search(r"\((\d+) remote, (\d+) fetched, (\d+) already present", output)
    assert match, output
    remote, fetched, present = map(int, match.groups())
    return {"remote": remote, "fetched": fetched, "present": present}


def test_index_is_idempotent(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    image = images.push(f"lazy/idem-{unique}", [busybox_layer(), [File("/a", b"a")]])
    first = lazy_node.index(image.ref)
    assert first.count("indexed ") == 2 and "pushed index artifact" in first
    again = lazy_node.index(image.ref)
    assert again.count("already ") == 2 and "nothing new to index" in again


def test_lazy_tree_equals_overlayfs(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    layers = awkward_layers()
    image = images.push(f"lazy/rich-{unique}", layers, cmd=["/bin/sleep", "600"])
    lazy_node.index(image.ref)
    assert pulled_counts(lazy_node.pull(image.ref))["remote"] == len(layers)
    c = lazy_node.containerd
    for chain_id in image.layout.chain_ids:
        info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", chain_id).stdout
        assert f'"{REMOTE_LABEL}": "true"' in info, info
    c.ctr("images", "pull", "--plain-http", "--snapshotter", "overlayfs", image.ref)
    c.ctr("run", "-d", "--snapshotter", "bootseer", image.ref, f"lazy-{unique}", "/bin/sleep", "600")
    c.ctr("run", "-d", "--snapshotter", "overlayfs", image.ref, f"ovl-{unique}", "/bin/sleep", "600")
    try:
        lazy_tree = tree.walk(c.task_rootfs(f"lazy-{unique}"))
        reference = tree.walk(c.task_rootfs(f"ovl-{unique}"))
        assert lazy_tree == reference, tree.diff(lazy_tree, reference, "lazy", "overlayfs")
        # Layers without xattrs come from the plain mount, whose kernel side
        # asks none; the one with xattrs and the one with an opaque
        # directory from the layer mount (the tree above shows both).
        config = lazy_node.layers.config
        served = [lower.parent for lower in _lowers(c.task_rootfs(f"lazy-{unique}"))]
        plain, full = config.fs.plain_mountpoint, config.mountpoint
        assert served == [plain, full, full, plain], served
    finally:
        c.remove_container(f"lazy-{unique}")
        c.remove_container(f"ovl-{unique}")


def test_the_plain_mount_turned_off_serves_its_containers_until_none_is_left(
    registry: Registry, images: ImageBuilder, unique: str
) -> None:
    """`[fs] plain_mount = false` and a restart of both daemons: a container
    that reads from the plain mount keeps reading, new ones get every layer
    from the layer mount (getxattr answers ENODATA there), the layers they
    share with it included, and the first start that finds the plain mount
    unused releases it."""
    node = start_lazy_node(registry.host)
    try:
        config, c = node.layers.config, node.containerd
        plain = config.fs.plain_mountpoint
        before = images.push(f"lazy/plain-{unique}", [busybox_layer(), [File("/a", b"a\n")]])
        node.index(before.ref)
        node.pull(before.ref)
        old = f"plain-{unique}"
        c.ctr("run", "-d", "--snapshotter", "bootseer", before.ref, old, "/bin/sleep", "600")
        assert [lower.parent for lower in _lowers(c.task_rootfs(old))] == [plain, plain]

        node.layers.stop()
        config.plain_mount = False
        config.write()
        node.layers.start()
        node.snapshotter.restart()
        c.wait_snapshotter()
        drop_page_cache()
        assert c.exec(old, "cat-a", "/bin/cat", "/a") == "a\n"

        after = images.push(f"lazy/noplain-{unique}", [busybox_layer(), [File("/b", b"b\n")]])
        node.index(after.ref)
        node.pull(after.ref)
        new = f"noplain-{unique}"
        c.ctr("run", "-d", "--snapshotter", "bootseer", after.ref, new, "/bin/sleep", "600")
        try:
            rootfs = c.task_rootfs(new)
            assert [lower.parent for lower in _lowers(rootfs)] == [config.mountpoint, config.mountpoint]
            assert (rootfs / "b").read_bytes() == b"b\n"
            with pytest.raises(OSError) as exc:
                os.getxattr(rootfs / "b", "user.x")
            assert exc.value.errno == errno.ENODATA
        finally:
            c.remove_container(new)

        c.remove_container(old)
        node.layers.stop()
        node.layers.start()
        assert mounted_fstype(plain) is None
    finally:
        stop_lazy_node(node)


def test_only_what_is_read_is_fetched(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    big = random.Random(7).randbytes(160 << 20)
    image = images.push(
        f"lazy/big-{unique}",
        [
            busybox_layer(),
            [Dir("/weights"), File("/weights/shard-0.bin", big), File("/weights/config.json", b'{"n": 1}\n')],
        ],
        cmd=["/bin/cat", "/weights/config.json"],
    )
    lazy_node.index(image.ref)
    before = lazy_node.layers.metric("bootseer_fs_fetched_bytes_total")
    lazy_node.pull(image.ref)
    c = lazy_node.containerd
    assert c.run(image.ref, f"big-{unique}") == '{"n": 1}\n'
    fetched = lazy_node.layers.metric("bootseer_fs_fetched_bytes_total") - before
    image_bytes = sum(image.layout.layer_sizes)
    assert 0 < fetched < image_bytes * 0.05, (fetched, image_bytes)
    big_layer = image.layout.layer_digests[-1]
    assert big_layer not in c.ctr("content", "ls", "-q").stdout
    # Reading the whole shard later fetches it, and every byte is right.
    out = c.run(image.ref, f"big2-{unique}", "/bin/sha256sum", "/weights/shard-0.bin")
    assert out.split()[0] == hashlib.sha256(big).hexdigest()


def test_unindexed_image_takes_the_normal_path(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    image = images.push(
        f"lazy/plain-{unique}", [busybox_layer(), [File("/hello", b"plain\n")]], cmd=["/bin/cat", "/hello"]
    )
    counts = pulled_counts(lazy_node.pull(image.ref))
    # The busybox base may already be present from another test's normal pull.
    assert counts["remote"] == 0 and counts["fetched"] >= 1
    assert lazy_node.containerd.run(image.ref, f"plain-{unique}") == "plain\n"
    info = lazy_node.containerd.ctr("snapshots", "--snapshotter", "bootseer", "info", image.layout.chain_ids[-1]).stdout
    assert REMOTE_LABEL not in info


def test_registry_faults_never_serve_wrong_bytes(
    lazy_node: LazyNode, images: ImageBuilder, registry: Registry, unique: str
) -> None:
    rng = random.Random(3)
    first, second = rng.randbytes(6 << 20), rng.randbytes(6 << 20)
    with faultproxy.running(registry.port) as proxy:
        lazy_node.layers.config.allow_plain_http(proxy.host)
        pushed = images.push(
            f"lazy/faults-{unique}",
            [busybox_layer(), [File("/first.bin", first), File("/second.bin", second)]],
            cmd=["/bin/sleep", "600"],
        )
        ref = pushed.ref.replace(registry.host, proxy.host)
        lazy_node.index(ref)
        lazy_node.pull(ref)
        c = lazy_node.containerd
        name = f"faults-{unique}"
        c.ctr("run", "-d", "--snapshotter", "bootseer", ref, name, "/bin/sleep", "600")
        try:
            digest = hashlib.sha256(first).hexdigest()
            assert c.exec(name, "e1", "/bin/sha256sum", "/first.bin").split()[0] == digest

            layer = pushed.layout.layer_digests[-1]
            proxy.plan("flip", layer, times=1000)
            with pytest.raises(CtrError, match="Input/output error"):
                c.exec(name, "e2", "/bin/sha256sum", "/second.bin")
            assert lazy_node.layers.metric("bootseer_fs_verify_failures_total") > 0
            proxy.reset()

            proxy.plan("status", layer, times=1000, status=503)
            with pytest.raises(CtrError, match="Input/output error"):
                c.exec(name, "e3", "/bin/sha256sum", "/second.bin")
            # What is cached is still served while the registry is down.
            assert c.exec(name, "e4", "/bin/sha256sum", "/first.bin").split()[0] == digest
            proxy.reset()

            out = c.exec(name, "e5", "/bin/sha256sum", "/second.bin")
            assert out.split()[0] == hashlib.sha256(second).hexdigest()
        finally:
            c.remove_container(name)


def test_authenticated_registry_through_docker_config(
    lazy_node: LazyNode, auth_registry: AuthRegistry, unique: str, tmp_path: Path
) -> None:
    builder = ImageBuilder(auth_registry.host, tmp_path, creds=f"{USER}:{PASSWORD}")
    image = builder.push(
        f"private/lazy-{unique}",
        [busybox_layer(), [File("/secret.txt", b"authorised\n")]],
        cmd=["/bin/cat", "/secret.txt"],
    )
    config = lazy_node.layers.config
    config.allow_plain_http(auth_registry.host)
    config.docker_config.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(auth_registry.docker_config(), config.docker_config)
    lazy_node.index(image.ref)
    # The busybox base may already be present from an earlier pull.
    assert pulled_counts(lazy_node.pull(image.ref))["remote"] >= 1
    assert lazy_node.containerd.run(image.ref, f"auth-{unique}") == "authorised\n"
    top = image.layout.chain_ids[-1]
    info = lazy_node.containerd.ctr("snapshots", "--snapshotter", "bootseer", "info", top).stdout
    assert f'"{REMOTE_LABEL}": "true"' in info


def test_snapshotter_crash_leaves_lazy_containers_running(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    data = random.Random(13).randbytes(3 << 20)
    image = images.push(
        f"lazy/crash-{unique}", [busybox_layer(), [File("/model.bin", data)]], cmd=["/bin/sleep", "600"]
    )
    lazy_node.index(image.ref)
    lazy_node.pull(image.ref)
    c = lazy_node.containerd
    name = f"crash-{unique}"
    c.ctr("run", "-d", "--snapshotter", "bootseer", image.ref, name, "/bin/sleep", "600")
    try:
        lazy_node.snapshotter.kill9()
        # Nothing the container reads goes through the snapshotter process.
        assert c.exec(name, "e1", "/bin/sha256sum", "/model.bin").split()[0] == hashlib.sha256(data).hexdigest()
        lazy_node.snapshotter.start()
        c.wait_snapshotter()
        again = images.push(
            f"lazy/after-crash-{unique}", [busybox_layer(), [File("/ok", b"ok\n")]], cmd=["/bin/cat", "/ok"]
        )
        lazy_node.index(again.ref)
        assert pulled_counts(lazy_node.pull(again.ref))["remote"] >= 1
        assert c.run(again.ref, f"after-{unique}") == "ok\n"
    finally:
        c.remove_container(name)


def test_image_removal_cleans_up_lazy_layers(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    marker = f"/gc-{unique}"
    image = images.push(f"lazy/gc-{unique}", [busybox_layer(), [File(marker, b"gc\n")]], cmd=["/bin/cat", marker])
    lazy_node.index(image.ref)
    lazy_node.pull(image.ref)
    c = lazy_node.containerd
    assert c.run(image.ref, f"gc-{unique}") == "gc\n"
    top_layer = image.layout.layer_digests[-1].split(":")[1]
    store = lazy_node.layers.config.store
    assert (store / top_layer).is_dir()
    dirs_before = lazy_node.snapshotter.snapshot_ids()
    c.ctr("images", "rm", "--sync", image.ref)
    # The top layer is this image's alone: its snapshot directory and its
    # stored index and cache are gone; a re-pull serves it again.
    assert not (store / top_layer).exists()
    assert len(lazy_node.snapshotter.snapshot_ids()) < len(dirs_before)
    assert top_layer not in "".join(str(p) for p in lazy_node.layers.config.mountpoint.iterdir())
    lazy_node.pull(image.ref)
    assert c.run(image.ref, f"gc2-{unique}") == "gc\n"


def test_registry_outage_after_the_pull(lazy_node: LazyNode, unique: str, tmp_path: Path) -> None:
    own = start_registry()
    try:
        lazy_node.layers.config.allow_plain_http(own.host)
        rng = random.Random(21)
        cached, later = rng.randbytes(6 << 20), rng.randbytes(6 << 20)
        image = ImageBuilder(own.host, tmp_path).push(
            f"lazy/outage-{unique}",
            [busybox_layer(), [File("/cached.bin", cached), File("/later.bin", later)]],
            cmd=["/bin/sleep", "600"],
        )
        lazy_node.index(image.ref)
        lazy_node.pull(image.ref)
        c, name = lazy_node.containerd, f"outage-{unique}"
        c.ctr("run", "-d", "--snapshotter", "bootseer", image.ref, name, "/bin/sleep", "600")
        try:
            digest = hashlib.sha256(cached).hexdigest()
            assert c.exec(name, "e1", "/bin/sha256sum", "/cached.bin").split()[0] == digest
            own.pause()
            assert c.exec(name, "e2", "/bin/sha256sum", "/cached.bin").split()[0] == digest
            with pytest.raises(CtrError, match="Input/output error"):
                c.exec(name, "e3", "/bin/sha256sum", "/later.bin")
            own.resume()
            out = c.exec(name, "e4", "/bin/sha256sum", "/later.bin")
            assert out.split()[0] == hashlib.sha256(later).hexdigest()
        finally:
            c.remove_container(name)
    finally:
        own.stop()
