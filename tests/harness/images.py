"""Test images shared by the suites that compare bootseer against containerd's
own overlayfs snapshotter (normal and lazy paths alike)."""

from __future__ import annotations

import random

from tests.harness.oci import (
    CharDevice,
    Dir,
    File,
    Hardlink,
    Layer,
    Opaque,
    Symlink,
    Whiteout,
    busybox_layer,
)

# Random bytes do not compress, so the layer really carries 20 MB.
LARGE = random.Random(20240501).randbytes(20 << 20)
LONG_NAME = "n" * 255
LONG_UTF8_NAME = "é" * 127 + "x"  # 255 bytes in UTF-8
DEEP_DIRS = [f"deep-level-{i:02d}" for i in range(50)]
DEEP_PATH = "/data/deep/" + "/".join(DEEP_DIRS)
UNICODE_FILE = "/data/unicode/héllo wörld.txt"


def awkward_layers() -> list[Layer]:
    """Four layers with every filesystem feature a snapshotter can get wrong."""
    lower: Layer = [
        Dir("/data"),
        File("/data/keep.txt", b"keep\n"),
        File("/data/gone.txt", b"deleted by the next layer\n"),
        Dir("/data/gone-dir"),
        File("/data/gone-dir/inner.txt", b"inner\n"),
        File("/data/reborn.txt", b"first life\n"),
        Dir("/data/replaced"),
        File("/data/replaced/old1.txt", b"old1\n"),
        Dir("/data/replaced/sub"),
        File("/data/replaced/sub/old2.txt", b"old2\n"),
        File("/data/overwritten.txt", b"v1\n", mode=0o600),
        File("/data/file2dir", b"a file, then a dir\n"),
        Dir("/data/dir2file"),
        File("/data/dir2file/child", b"child\n"),
        Dir("/data/hard"),
        File("/data/hard/a", b"one inode, three names\n", mode=0o640, uid=1000, gid=1000),
        Hardlink("/data/hard/b", "/data/hard/a"),
        Dir("/data/hard/sub"),
        Hardlink("/data/hard/sub/c", "/data/hard/a"),
        Dir("/data/links"),
        Symlink("/data/links/rel", "../keep.txt"),
        Symlink("/data/links/abs", "/data/keep.txt"),
        Symlink("/data/links/dangling", "/nonexistent/target"),
        Symlink("/data/links/dirlink", "../hard"),
        Symlink("/data/links/owned", "../keep.txt", uid=1000, gid=1000),
        File("/data/xattr.txt", b"xattrs\n", xattrs={"user.foo": "bar", "user.unicode": "wört"}),
        Dir("/data/xattr-dir", xattrs={"user.dir": "yes"}),
        Dir("/data/modes"),
        File("/data/modes/setuid", b"#!/bin/sh\n", mode=0o4755),
        File("/data/modes/setgid", b"#!/bin/sh\n", mode=0o2755),
        File("/data/modes/both", b"#!/bin/sh\n", mode=0o6711),
        File("/data/modes/none", b"no access\n", mode=0o000),
        File("/data/modes/readonly", b"read only\n", mode=0o400),
        Dir("/data/modes/sticky", mode=0o1777),
        Dir("/data/modes/setgid-dir", mode=0o2775, uid=1000, gid=1000),
        Dir("/data/modes/chmod-later", mode=0o700),
        Dir("/data/owners"),
        File("/data/owners/u1000", b"1000\n", uid=1000, gid=1000),
        File("/data/owners/nobody", b"nobody\n", uid=65534, gid=65534),
        File("/data/owners/mixed", b"mixed\n", uid=1000, gid=65534),
        Dir("/data/owners/dir", uid=1234, gid=5678),
        File("/data/empty", b""),
        Dir("/data/empty-dir"),
        File("/data/large.bin", LARGE),
        Dir("/data/long"),
        File(f"/data/long/{LONG_NAME}", b"long name\n"),
        Dir(f"/data/long/{LONG_UTF8_NAME}"),
        File(f"/data/long/{LONG_UTF8_NAME}/{LONG_NAME}", b"long utf-8 dir\n"),
        Dir("/data/deep"),
        *[Dir("/data/deep/" + "/".join(DEEP_DIRS[: i + 1])) for i in range(len(DEEP_DIRS))],
        File(f"{DEEP_PATH}/leaf.txt", b"deep leaf\n"),
        Dir("/data/unicode"),
        File(UNICODE_FILE, b"unicode\n"),
        Dir("/data/unicode/日本語"),
        File("/data/unicode/日本語/ファイル.txt", b"nihongo\n"),
        File("/data/unicode/emoji-🙂.txt", b"smile\n"),
        Dir("/data/dev"),
        CharDevice("/data/dev/null-like", 1, 3),
    ]
    upper: Layer = [
        Dir("/data"),
        Whiteout("/data/gone.txt"),
        Whiteout("/data/gone-dir"),
        Whiteout("/data/reborn.txt"),
        Dir("/data/replaced"),
        Opaque("/data/replaced"),
        File("/data/replaced/new.txt", b"new\n"),
        File("/data/overwritten.txt", b"v2\n", mode=0o644, uid=65534, gid=65534),
        Dir("/data/file2dir"),
        File("/data/file2dir/child", b"now a dir\n"),
        File("/data/dir2file", b"now a file\n"),
        Dir("/data/modes"),
        Dir("/data/modes/chmod-later", mode=0o750, uid=1000, gid=1000),
    ]
    top: Layer = [
        Dir("/data"),
        File("/data/reborn.txt", b"second life\n", uid=1000, gid=1000),
    ]
    return [busybox_layer(), lower, upper, top]
