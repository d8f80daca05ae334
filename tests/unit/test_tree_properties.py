"""Properties of the decoder and the tree builder over arbitrary input.

Whatever an index holds, decoding and building its tree either refuse it
(IndexFormatError) or give a tree whose every value fits what the layer
server hands the kernel, and whose every name resolves; never any other
exception. Whatever a tar layer holds, `bootseer index` either leaves it to
the normal path or builds an index that the decoder and the tree builder take.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import stat
import struct
import tarfile
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, cast
from unittest import mock

import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.fs.fusewire.session import _attr as encode_attr
from snapshotter.fs.layerfs import entry_attributes
from snapshotter.layer import index as index_module
from snapshotter.layer.build import UnsupportedLayer, build_index
from snapshotter.layer.index import (
    MAGIC,
    MAX_ID,
    MAX_LINK_BYTES,
    MAX_MTIME,
    MAX_NAME_BYTES,
    MAX_XATTR_LIST_BYTES,
    MAX_XATTR_VALUE_BYTES,
    EntryType,
    IndexFormatError,
    LayerIndex,
)
from snapshotter.layer.tree import ROOT, LayerTree, Node, build_tree, implicit_dirs, shows_xattrs

# Hypothesis keeps no example database in the repository, and examples that
# build deep trees may take a while: no deadlines.
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

LAYER_BYTES = 1 << 16
TYPES = {stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO}

# -- arbitrary index documents -------------------------------------------------

PARTS = st.sampled_from(["a", "b", "c", ".wh.a", ".wh..wh..opq"])
# Names of what is not a directory end mostly in parts no directory has, so
# that trees are not mostly a file in the way of another entry's parent.
LEAVES = st.sampled_from(["f", "g", "h", "a", ".wh.a", ".wh.f", ".wh..wh..opq"])
ODD_PARTS = st.sampled_from(
    ["", ".", "..", ".wh.", ".wh..", ".wh...", "é", "caf\udce9", "\ud800", "x\x00y", "n" * 255, "n" * 256, " ", "/"]
)
NAMES = st.lists(PARTS, min_size=1, max_size=4).map("/".join)
LEAF_NAMES = st.tuples(st.lists(PARTS, max_size=3), LEAVES).map(lambda t: "/".join([*t[0], t[1]]))
ODD_NAMES = st.one_of(
    st.lists(st.one_of(PARTS, ODD_PARTS), max_size=5).map("/".join),
    st.sampled_from([1000, 1024, 1025, 2047, 5000]).map(lambda n: "a/" * (n - 1) + "a"),
    NAMES.map(lambda n: "/" + n),
    NAMES.map(lambda n: n + "/"),
)
SYMLINK_TARGETS = st.sampled_from(
    ["a", "/a", "../a", "a/b", "/", "..", "../../c", "b/../a", "a/./b", "//a", "c/a", "f"]
)
ODD_LINKS = st.one_of(ODD_NAMES, st.sampled_from(["", "x" * 4096, "a\x00b", "\ud800"]))
HOSTILE_INTS = st.one_of(
    st.sampled_from([-1, 0o10000, MAX_ID + 1, 2**40, 2**63, 2**70, 4096, 2**20, LAYER_BYTES + 1, True]),
    st.floats(),
    st.text(max_size=2),
    st.none(),
)
HOSTILE_MTIMES = st.one_of(st.floats(), st.integers(-(2**70), 2**70), st.sampled_from([MAX_MTIME + 1, "0", True, None]))
GOOD_XATTRS = st.dictionaries(
    st.sampled_from(["user.a", "security.capability", "system.posix_acl_access"]), st.binary(max_size=8), max_size=2
)
ODD_XATTRS = st.dictionaries(
    st.sampled_from(["trusted.overlay.redirect", "", "user.\x00", "user." + "x" * 300, "plain", "user.\ud800"]),
    st.one_of(st.binary(max_size=8), st.just(b"x" * (MAX_XATTR_VALUE_BYTES + 1))),
    max_size=2,
)


def b64(xattrs: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in xattrs.items()}


# Files, directories and hardlinks more often than devices: the tree is made of them.
KINDS = ["reg", "reg", "reg", "dir", "dir", "symlink", "hardlink", "hardlink", "char", "block", "fifo"]
assert set(KINDS) == {t.value for t in EntryType}


@st.composite
def good_row(draw: st.DrawFn, earlier: list[str]) -> list[Any]:
    """A row the decoder takes; its tree may still be one containerd cannot lay down."""
    kind = draw(st.sampled_from(KINDS))
    if kind == "hardlink":
        link = draw(st.sampled_from(earlier)) if earlier and draw(st.integers(0, 3)) else draw(LEAF_NAMES)
    elif kind == "symlink":
        link = draw(SYMLINK_TARGETS)
    else:
        link = ""
    offset = draw(st.integers(0, LAYER_BYTES))
    return [
        "" if draw(st.integers(0, 9)) == 0 else draw(NAMES if kind == "dir" else LEAF_NAMES),
        kind,
        draw(st.integers(0, 0o7777)),
        draw(st.sampled_from([0, 1000, MAX_ID])),
        draw(st.sampled_from([0, 1000, MAX_ID])),
        draw(st.one_of(st.sampled_from([0, MAX_MTIME]), st.floats(0, MAX_MTIME))),
        draw(st.integers(0, LAYER_BYTES - offset)),
        offset,
        link,
        draw(st.integers(0, 4095)),
        draw(st.integers(0, 2**20 - 1)),
        b64(draw(GOOD_XATTRS)),
    ]


@st.composite
def hostile_row(draw: st.DrawFn, earlier: list[str]) -> list[Any]:
    """A good row with one or more values anything at all, and now and
    then a value short or one too many."""
    row = draw(good_row(earlier))
    for column in draw(st.sets(st.integers(0, 11), min_size=1, max_size=3)):
        if column == 0:
            row[0] = draw(ODD_NAMES)
        elif column == 1:
            row[1] = draw(st.sampled_from(["sock", "", "REG", 1]))
        elif column == 5:
            row[5] = draw(HOSTILE_MTIMES)
        elif column == 8:
            row[8] = draw(ODD_LINKS)
        elif column == 11:
            row[11] = draw(st.one_of(ODD_XATTRS.map(b64), st.just({"user.a": "!!"}), st.just([1])))
        else:
            row[column] = draw(HOSTILE_INTS)
    return draw(st.sampled_from([row, row, row, row[:-1], [*row, 0]]))


@st.composite
def index_rows(draw: st.DrawFn, hostile: bool) -> list[list[Any]]:
    """Good rows, so that trees get built, with hardlinks mostly to files
    that came before; if `hostile`, one row in ten hostile."""
    rows: list[list[Any]] = []
    for _ in range(draw(st.integers(0, 15))):
        files = [r[0] for r in rows if r[1] == "reg" and isinstance(r[0], str)]
        bad = hostile and draw(st.integers(0, 9)) == 0
        rows.append(draw(hostile_row(files) if bad else good_row(files)))
    return rows


def document(rows: list[list[Any]]) -> dict[str, Any]:
    """A plain (uncompressed) layer of LAYER_BYTES in one block."""
    return {
        "version": 1,
        "layer_digest": "sha256:" + "0" * 64,
        "compression": "none",
        "compressed_size": LAYER_BYTES,
        "uncompressed_size": LAYER_BYTES,
        "span": LAYER_BYTES,
        "blocks": [[0, LAYER_BYTES, 0, LAYER_BYTES, "0" * 64]],
        "entries": rows,
    }


def blob_of(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc).encode()
    return MAGIC + zstandard.ZstdCompressor().compress(struct.pack(">I", len(body)) + body)


# -- what the layer server hands the kernel ------------------------------------


def check_node(node: Node, layer_bytes: int) -> None:
    assert 0 < node.ino < 2**32
    assert stat.S_IFMT(node.mode) in TYPES and node.mode == stat.S_IFMT(node.mode) | stat.S_IMODE(node.mode)
    assert 0 <= node.uid <= MAX_ID and 0 <= node.gid <= MAX_ID
    assert type(node.mtime) in (int, float) and math.isfinite(node.mtime) and 0 <= node.mtime <= MAX_MTIME
    assert 0 <= int(node.mtime * 1e9) < 2**63
    assert node.nlink >= 1
    if stat.S_ISREG(node.mode):
        assert node.offset >= 0 and node.offset + node.size <= layer_bytes
    elif stat.S_ISLNK(node.mode):
        assert 0 < len(node.target) <= MAX_LINK_BYTES and b"\x00" not in node.target
        assert node.size == len(node.target) and stat.S_IMODE(node.mode) == 0o777
    else:
        assert node.size == 0
    if stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
        # What FUSE's 32-bit rdev carries, and what it decodes back to.
        assert 0 <= node.rdev < 2**32
        assert os.makedev(os.major(node.rdev), os.minor(node.rdev)) == node.rdev
    else:
        assert node.rdev == 0
    assert (node.children is not None) == stat.S_ISDIR(node.mode)
    listed = 0
    for key, value in node.xattrs.items():
        name = os.fsencode(key)
        assert 0 < len(name) <= 255 and b"\x00" not in name and type(value) is bytes
        assert len(value) <= MAX_XATTR_VALUE_BYTES
        listed += len(name) + 1
    assert listed <= MAX_XATTR_LIST_BYTES
    # What the kernel is sent: struct.error on any value its fields cannot hold.
    encode_attr(entry_attributes(1, node))


def check_tree(tree: LayerTree, layer_bytes: int) -> None:
    """Every node in range, every name found by lookup, every node reached
    from the root by names, and directories a tree."""
    assert tree.nodes[ROOT].is_dir
    reached = {ROOT}
    queue = deque([tree.nodes[ROOT]])
    while queue:
        node = queue.popleft()
        check_node(node, layer_bytes)
        children = node.children or {}
        if node.is_dir:
            assert node.nlink == 2 + sum(1 for c in children.values() if tree.nodes[c].is_dir)
        for name, ino in children.items():
            assert 0 < len(name) <= MAX_NAME_BYTES and b"/" not in name and b"\x00" not in name
            assert name not in (b".", b"..")
            child = tree.lookup(node.ino, name)
            assert child is tree.nodes[ino]
            if child.is_dir:
                assert ino not in reached, "a directory with two names"
            if ino not in reached:
                reached.add(ino)
                queue.append(child)
        for odd in (b"", b".", b"..", b"\x00", b"a/b", b"\xff" * 300):
            assert tree.lookup(node.ino, odd) in (None, *(tree.nodes[i] for i in children.values()))
    assert reached == set(tree.nodes)
    # The kernel may ask about any inode number; the tree answers or not.
    assert tree.lookup(max(tree.nodes) + 1, b"a") is None


@FAST
@given(index_rows(hostile=True))
def test_any_index_is_refused_or_served_within_bounds(rows: list[list[Any]]) -> None:
    try:
        index = LayerIndex.decode(blob_of(document(rows)))
        tree = build_tree(index.entries)
    except IndexFormatError:
        return
    check_tree(tree, index.uncompressed_size)


@FAST
@given(index_rows(hostile=False))
def test_values_in_range_are_never_refused_by_the_decoder(rows: list[list[Any]]) -> None:
    index = LayerIndex.decode(blob_of(document(rows)))
    try:
        tree = build_tree(index.entries)
    except IndexFormatError:
        return
    check_tree(tree, LAYER_BYTES)


def decoded(blob: bytes) -> LayerIndex | str:
    try:
        return LayerIndex.decode(blob)
    except IndexFormatError as exc:
        return str(exc)


@FAST
@given(index_rows(hostile=True), st.sampled_from([1, 4]))
def test_the_fast_decoder_takes_what_the_rows_path_takes_and_gives_the_same(
    rows: list[list[Any]], version: int
) -> None:
    """Documents go through msgspec first and through the json module only
    where it refuses them: with and without that first pass, every document
    gives the same index, or is refused with the same message."""
    doc = document(rows) | ({"version": 4, "diff_id": "sha256:" + "1" * 64, "part": 0} if version == 4 else {})
    blob = blob_of(doc)
    fast = decoded(blob)
    with mock.patch.object(index_module, "_fast_document", return_value=None):
        slow = decoded(blob)
    assert fast == slow
    if isinstance(fast, LayerIndex):
        assert [type(e.mtime) for e in fast.entries] == [type(e.mtime) for e in cast(LayerIndex, slow).entries]


# -- arbitrary tar layers through `bootseer index` -----------------------------

TAR_TYPES = [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE]


@st.composite
def tar_members(draw: st.DrawFn) -> list[tuple[tarfile.TarInfo, bytes]]:
    members = []
    names: list[str] = []
    for _ in range(draw(st.integers(0, 15))):
        name = draw(
            st.one_of(NAMES, st.sampled_from(["./a", "a//b/", "/abs/a", "a/../b", "caf\udce9", "d/" * 600 + "f"]))
        )
        kind = draw(st.sampled_from(TAR_TYPES))
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = draw(st.integers(0, 0o7777))
        info.uid = draw(st.sampled_from([0, 1000, MAX_ID, MAX_ID + 1, 2**40]))
        info.gid = draw(st.sampled_from([0, 1000]))
        info.mtime = draw(st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False)))
        if draw(st.integers(0, 9)) == 0:
            # What tarfile cannot write from a float, a PAX header can hold.
            info.pax_headers = {"mtime": draw(st.sampled_from(["nan", "inf", "-inf", "1e300"]))}
        if kind == tarfile.SYMTYPE:
            info.linkname = draw(st.one_of(SYMLINK_TARGETS, st.just("")))
        elif kind == tarfile.LNKTYPE:
            info.linkname = draw(st.sampled_from(names)) if names and draw(st.booleans()) else draw(NAMES)
        elif kind == tarfile.CHRTYPE:
            info.devmajor, info.devminor = draw(st.sampled_from([(1, 3), (4095, 2**20 - 1), (4096, 0), (0, 2**20)]))
        if kind == tarfile.REGTYPE and draw(st.booleans()):
            info.pax_headers["SCHILY.xattr." + draw(st.sampled_from(["user.a", "trusted.x", "odd"]))] = "v"
        data = draw(st.binary(max_size=64)) if kind == tarfile.REGTYPE else b""
        info.size = len(data)
        members.append((info, data))
        names.append(name)
    return members


@FAST
@given(tar_members())
def test_bootseer_index_builds_only_indexes_the_snapshotter_takes(members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blob"
        path.write_bytes(buf.getvalue())
        try:
            index = build_index(path, "sha256:" + "0" * 64, span=4096)
        except UnsupportedLayer:
            return
    # What `bootseer index` pushes, the snapshotter and the layer server take.
    decoded = LayerIndex.decode(index.encode())
    assert decoded.entries == index.entries
    check_tree(build_tree(decoded.entries), decoded.uncompressed_size)


def _resolve(tree: LayerTree, path: str) -> Node | None:
    node: Node | None = tree.nodes[ROOT]
    for part in path.split("/"):
        node = tree.lookup(node.ino, os.fsencode(part)) if node is not None else None
    return node


@FAST
@given(index_rows(hostile=False))
def test_the_implicit_directories_are_the_ones_the_tree_builder_made(rows: list[list[Any]]) -> None:
    """The one-pass check finds none exactly when the tree has none, and the
    tree's are directories it holds, none of them the root."""
    index = LayerIndex.decode(blob_of(document(rows)))
    try:
        tree = build_tree(index.entries)
    except IndexFormatError:
        return
    assert implicit_dirs(index.entries) == tree.implicit_dirs
    for path in tree.implicit_dirs:
        node = _resolve(tree, path)
        assert path and node is not None and node.is_dir, path


@FAST
@given(index_rows(hostile=False))
def test_a_layer_said_to_show_no_xattrs_has_none_in_its_tree(rows: list[list[Any]]) -> None:
    """shows_xattrs picks the layers the plain mount (no xattrs at all)
    serves: where it says none, no node of the tree has one."""
    index = LayerIndex.decode(blob_of(document(rows)))
    try:
        tree = build_tree(index.entries)
    except IndexFormatError:
        return
    if not shows_xattrs(index.entries):
        assert not any(node.xattrs for node in tree.nodes.values())
