"""The directory tree a layer's table of contents describes, as containerd's
overlayfs applier would lay it down in a snapshot directory.

Tar semantics within one layer: a later entry replaces an earlier one of the
same path (a directory over a directory only updates its attributes);
missing parent directories appear with mode 0755 owned by root. Overlay
semantics for the layers below: `.wh.NAME` becomes a 0/0 character device
NAME, and `.wh..wh..opq` marks its directory opaque
(trusted.overlay.opaque=y).
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass, field

from snapshotter.layer.index import Entry, EntryType, IndexFormatError

ROOT = 1
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"

_FORMAT = {
    EntryType.REG: stat.S_IFREG,
    EntryType.DIR: stat.S_IFDIR,
    EntryType.SYMLINK: stat.S_IFLNK,
    EntryType.CHAR: stat.S_IFCHR,
    EntryType.BLOCK: stat.S_IFBLK,
    EntryType.FIFO: stat.S_IFIFO,
}


@dataclass
class Node:
    ino: int
    mode: int  # full st_mode: file type and permission bits
    uid: int
    gid: int
    mtime: float
    size: int = 0
    offset: int = 0  # of the data in the uncompressed stream
    target: bytes = b""  # symlink target
    rdev: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    nlink: int = 1
    children: dict[bytes, int] | None = None  # for directories

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass
class LayerTree:
    nodes: dict[int, Node]

    def lookup(self, parent: int, name: bytes) -> Node | None:
        children = self.nodes[parent].children
        ino = children.get(name) if children is not None else None
        return self.nodes[ino] if ino is not None else None


def _encode(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def build_tree(entries: list[Entry]) -> LayerTree:
    nodes: dict[int, Node] = {ROOT: Node(ROOT, stat.S_IFDIR | 0o755, 0, 0, 0.0, children={})}
    next_ino = ROOT + 1

    def new_ino() -> int:
        nonlocal next_ino
        next_ino += 1
        return next_ino - 1

    # Directories by path: tens of thousands of entries share a few parents.
    dirs: dict[str, Node] = {"": nodes[ROOT]}

    def resolve_dir(path: str) -> Node:
        """The directory at `path`, creating missing parents as containerd does."""
        node = dirs.get(path)
        if node is not None:
            return node
        parent_path, base = posixpath.split(path)
        parent = resolve_dir(parent_path)
        assert parent.children is not None
        name = _encode(base)
        child_ino = parent.children.get(name)
        if child_ino is None:
            node = Node(new_ino(), stat.S_IFDIR | 0o755, 0, 0, 0.0, children={})
            nodes[node.ino] = node
            parent.children[name] = node.ino
        else:
            node = nodes[child_ino]
            if not node.is_dir:
                raise IndexFormatError(f"{path!r} passes through a non-directory in the layer")
        dirs[path] = node
        return node

    def unlink(parent: Node, name: bytes) -> None:
        assert parent.children is not None
        ino = parent.children.pop(name, None)
        if ino is not None:
            nodes[ino].nlink -= 1
            if nodes[ino].is_dir:
                # Paths through the removed directory now lead elsewhere.
                dirs.clear()
                dirs[""] = nodes[ROOT]

    for entry in entries:
        if entry.name == "":
            root = nodes[ROOT]
            root.mode, root.uid, root.gid, root.mtime = stat.S_IFDIR | entry.mode, entry.uid, entry.gid, entry.mtime
            root.xattrs.update(entry.xattrs)
            continue
        dirname, basename = posixpath.split(entry.name)
        parent = resolve_dir(dirname)
        assert parent.children is not None
        if basename == OPAQUE_MARKER:
            parent.xattrs[OPAQUE_XATTR] = b"y"
            continue
        if basename.startswith(WHITEOUT_PREFIX):
            name = _encode(basename[len(WHITEOUT_PREFIX) :])
            unlink(parent, name)
            node = Node(new_ino(), stat.S_IFCHR, entry.uid, entry.gid, entry.mtime)
            nodes[node.ino] = node
            parent.children[name] = node.ino
            continue
        name = _encode(basename)
        existing = parent.children.get(name)
        if entry.type == EntryType.HARDLINK:
            target_dir, target_base = posixpath.split(entry.linkname)
            target_children = resolve_dir(target_dir).children or {}
            target_ino = target_children.get(_encode(target_base))
            if target_ino is None or nodes[target_ino].is_dir:
                raise IndexFormatError(f"hardlink {entry.name!r} -> {entry.linkname!r} has no file to link to")
            # containerd's applier chowns, chmods and stamps the link path,
            # which is the shared inode: the link entry's metadata wins.
            target = nodes[target_ino]
            target.mode = stat.S_IFMT(target.mode) | entry.mode
            target.uid, target.gid, target.mtime = entry.uid, entry.gid, entry.mtime
            if existing == target_ino:
                continue
            unlink(parent, name)
            parent.children[name] = target_ino
            target.nlink += 1
            continue
        if entry.type == EntryType.DIR and existing is not None and nodes[existing].is_dir:
            node = nodes[existing]
            node.mode, node.uid, node.gid, node.mtime = stat.S_IFDIR | entry.mode, entry.uid, entry.gid, entry.mtime
            node.xattrs = {**node.xattrs, **entry.xattrs}
            continue
        if existing is not None:
            unlink(parent, name)
        node = Node(
            ino=new_ino(),
            mode=_FORMAT[entry.type] | entry.mode,
            uid=entry.uid,
            gid=entry.gid,
            mtime=entry.mtime,
            size=entry.size,
            offset=entry.offset,
            target=_encode(entry.linkname) if entry.type == EntryType.SYMLINK else b"",
            rdev=(os.makedev(entry.devmajor, entry.devminor) if entry.type in (EntryType.CHAR, EntryType.BLOCK) else 0),
            xattrs=dict(entry.xattrs),
            children={} if entry.type == EntryType.DIR else None,
        )
        if entry.type == EntryType.SYMLINK:
            node.size = len(node.target)
        nodes[node.ino] = node
        parent.children[name] = node.ino
    for node in nodes.values():
        if node.is_dir and node.children is not None:
            node.nlink = 2 + sum(1 for c in node.children.values() if nodes[c].is_dir)
    return LayerTree(nodes)
