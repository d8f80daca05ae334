"""Pull and run an image full of awkward filesystem features through bootseer.

The oracle is containerd's own overlayfs snapshotter: the same image run
from both must look identical from the host, down to modes, owners, xattrs,
device numbers and hardlinks. Spot checks against the image as built guard
against both being wrong the same way.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.harness import tree
from tests.harness.containerd import Containerd
from tests.harness.images import (
    DEEP_PATH,
    LARGE,
    LONG_NAME,
    LONG_UTF8_NAME,
    UNICODE_FILE,
    awkward_layers,
)
from tests.harness.oci import (
    ImageBuilder,
    PushedImage,
)

pytestmark = pytest.mark.integration


def _file(data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0, **xattrs: bytes) -> tree.Entry:
    return tree.Entry(
        kind="file",
        mode=mode,
        uid=uid,
        gid=gid,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        xattrs=tuple(sorted(xattrs.items())),
    )


def _dir(mode: int = 0o755, uid: int = 0, gid: int = 0, **xattrs: bytes) -> tree.Entry:
    return tree.Entry(kind="dir", mode=mode, uid=uid, gid=gid, xattrs=tuple(sorted(xattrs.items())))


def _symlink(target: str, uid: int = 0, gid: int = 0) -> tree.Entry:
    return tree.Entry(kind="symlink", mode=0o777, uid=uid, gid=gid, target=target)


# What the final image must show at these paths (None: must be absent).
EXPECTED: dict[str, tree.Entry | None] = {
    "/data/keep.txt": _file(b"keep\n"),
    "/data/gone.txt": None,
    "/data/gone-dir": None,
    "/data/gone-dir/inner.txt": None,
    "/data/reborn.txt": _file(b"second life\n", uid=1000, gid=1000),
    "/data/replaced": _dir(),
    "/data/replaced/new.txt": _file(b"new\n"),
    "/data/replaced/old1.txt": None,
    "/data/replaced/sub": None,
    "/data/overwritten.txt": _file(b"v2\n", uid=65534, gid=65534),
    "/data/file2dir": _dir(),
    "/data/file2dir/child": _file(b"now a dir\n"),
    "/data/dir2file": _file(b"now a file\n"),
    "/data/dir2file/child": None,
    "/data/hard/a": _file(b"one inode, three names\n", mode=0o640, uid=1000, gid=1000),
    "/data/hard/b": _file(b"one inode, three names\n", mode=0o640, uid=1000, gid=1000),
    "/data/hard/sub/c": _file(b"one inode, three names\n", mode=0o640, uid=1000, gid=1000),
    "/data/links/rel": _symlink("../keep.txt"),
    "/data/links/abs": _symlink("/data/keep.txt"),
    "/data/links/dangling": _symlink("/nonexistent/target"),
    "/data/links/dirlink": _symlink("../hard"),
    "/data/links/owned": _symlink("../keep.txt", uid=1000, gid=1000),
    "/data/xattr.txt": _file(b"xattrs\n", **{"user.foo": b"bar", "user.unicode": "wört".encode()}),
    "/data/xattr-dir": _dir(**{"user.dir": b"yes"}),
    "/data/modes/setuid": _file(b"#!/bin/sh\n", mode=0o4755),
    "/data/modes/setgid": _file(b"#!/bin/sh\n", mode=0o2755),
    "/data/modes/both": _file(b"#!/bin/sh\n", mode=0o6711),
    "/data/modes/none": _file(b"no access\n", mode=0o000),
    "/data/modes/readonly": _file(b"read only\n", mode=0o400),
    "/data/modes/sticky": _dir(mode=0o1777),
    "/data/modes/setgid-dir": _dir(mode=0o2775, uid=1000, gid=1000),
    "/data/modes/chmod-later": _dir(mode=0o750, uid=1000, gid=1000),
    "/data/owners/u1000": _file(b"1000\n", uid=1000, gid=1000),
    "/data/owners/nobody": _file(b"nobody\n", uid=65534, gid=65534),
    "/data/owners/mixed": _file(b"mixed\n", uid=1000, gid=65534),
    "/data/owners/dir": _dir(uid=1234, gid=5678),
    "/data/empty": _file(b""),
    "/data/empty-dir": _dir(),
    "/data/large.bin": _file(LARGE),
    f"/data/long/{LONG_NAME}": _file(b"long name\n"),
    f"/data/long/{LONG_UTF8_NAME}/{LONG_NAME}": _file(b"long utf-8 dir\n"),
    f"{DEEP_PATH}/leaf.txt": _file(b"deep leaf\n"),
    UNICODE_FILE: _file(b"unicode\n"),
    "/data/unicode/日本語/ファイル.txt": _file(b"nihongo\n"),
    "/data/unicode/emoji-🙂.txt": _file(b"smile\n"),
    "/data/dev/null-like": tree.Entry(kind="char", mode=0o666, uid=0, gid=0, rdev=(1, 3)),
}


@dataclass(frozen=True)
class RunningPair:
    """The same image running once per snapshotter, as a sleeping container."""

    image: PushedImage
    bootseer_id: str
    overlayfs_id: str


@pytest.fixture(scope="module")
def running_pair(containerd: Containerd, images: ImageBuilder) -> Iterator[RunningPair]:
    token = uuid.uuid4().hex[:10]
    image = images.push(f"pull-run/rich-{token}", awkward_layers(), cmd=["/bin/sleep", "600"])
    pair = RunningPair(image=image, bootseer_id=f"rich-bs-{token}", overlayfs_id=f"rich-ov-{token}")
    try:
        for snapshotter, container_id in (
            ("bootseer", pair.bootseer_id),
            ("overlayfs", pair.overlayfs_id),
        ):
            containerd.pull(image.ref, snapshotter)
            containerd.run(image.ref, container_id, "/bin/sleep", "600", detach=True, snapshotter=snapshotter)
        yield pair
    finally:
        containerd.remove_container(pair.bootseer_id)
        containerd.remove_container(pair.overlayfs_id)


def test_rootfs_matches_overlayfs(containerd: Containerd, running_pair: RunningPair) -> None:
    ours = tree.walk(containerd.task_rootfs(running_pair.bootseer_id))
    reference = tree.walk(containerd.task_rootfs(running_pair.overlayfs_id))
    differences = tree.diff(ours, reference, "bootseer", "overlayfs")
    assert not differences, differences
    # Guard against comparing two empty or half-mounted trees.
    assert "/data/large.bin" in ours.entries and "/bin/busybox" in ours.entries


def test_rootfs_has_image_content(containerd: Containerd, running_pair: RunningPair) -> None:
    ours = tree.walk(containerd.task_rootfs(running_pair.bootseer_id))
    wrong = [
        f"{path}:\n  expected {want.describe() if want else 'absent'}\n  got      {got.describe() if got else 'absent'}"
        for path, want in EXPECTED.items()
        if (got := ours.entries.get(path)) != want
    ]
    assert not wrong, "\n".join(wrong)
    replaced = sorted(p for p in ours.entries if p.startswith("/data/replaced/"))
    assert replaced == ["/data/replaced/new.txt"]
    assert frozenset({"/data/hard/a", "/data/hard/b", "/data/hard/sub/c"}) in ours.hardlinks


def test_container_reads_and_writes(containerd: Containerd, running_pair: RunningPair, unique: str) -> None:
    script = "\n".join(
        [
            "set -e",
            "cat /data/keep.txt",
            "test ! -e /data/gone.txt && echo gone-is-absent",
            "test ! -e /data/gone-dir && echo gone-dir-is-absent",
            "ls -A /data/replaced",
            "cat /data/hard/sub/c",
            "cat /data/links/rel",
            "readlink /data/links/abs",
            f"cat '{UNICODE_FILE}'",
            f"cat '{DEEP_PATH}/leaf.txt'",
            "stat -c '%a %u:%g' /data/modes/setuid /data/owners/nobody",
            "sha256sum /data/large.bin",
            "echo written-in-container > /data/new.txt && cat /data/new.txt",
            "echo appended >> /data/keep.txt && cat /data/keep.txt",
            "echo changed > /data/hard/a && cat /data/hard/a",
            "rm -r /data/replaced /data/large.bin && test ! -e /data/replaced && echo removed",
        ]
    )
    output = containerd.run(running_pair.image.ref, f"rw-{unique}", "/bin/sh", "-c", script)
    assert output.splitlines() == [
        "keep",
        "gone-is-absent",
        "gone-dir-is-absent",
        "new.txt",
        "one inode, three names",
        "keep",
        "/data/keep.txt",
        "unicode",
        "deep leaf",
        "4755 0:0",
        "644 65534:65534",
        f"{hashlib.sha256(LARGE).hexdigest()}  /data/large.bin",
        "written-in-container",
        "keep",
        "appended",
        "changed",
        "removed",
    ], output

    # The writes went to that container's own snapshot, not to the image.
    check = "cat /data/keep.txt /data/hard/b; test ! -e /data/new.txt && echo clean"
    output = containerd.exec(running_pair.bootseer_id, f"check-{unique}", "/bin/sh", "-c", check)
    assert output.splitlines() == ["keep", "one inode, three names", "clean"]
