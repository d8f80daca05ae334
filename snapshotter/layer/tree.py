"""The directory tree a layer's table of contents describes, as containerd's
applier lays it down in a snapshot directory.

containerd applies a layer onto the snapshot's own directory (overlayfs'
upperdir, or a bind mount for the bottom layer), never through the mounted
overlay, so one layer's tree is all it sees (core/diff/apply/apply_linux.go,
pkg/archive/tar.go), and all this builder needs:

- a later entry replaces an earlier one of the same path (a directory over a
  directory only updates its attributes);
- an entry's parent path is resolved as continuity's fs.RootPath does:
  symlinks in it are followed within the layer (an absolute target starts
  again at the layer root, `..` never climbs above it), so `esc -> /tmp/x`
  then `esc/pwned` puts `pwned` in `tmp/x`; missing directories appear with
  mode 0755 owned by root (mkparent; containerd copies a lower layer's
  directory attributes instead when it has one, which one layer cannot know:
  the tree lists them in `implicit_dirs`, for the Prepare path to compare
  with the lower layers, snapshotter/parents.py);
- a hardlink links to a path in this layer (hardlinkRootPath), never to a
  lower layer's file;
- `.wh.NAME` becomes a 0/0 character device NAME and `.wh..wh..opq` marks its
  directory opaque (trusted.overlay.opaque=y), as overlayfs expects.

Where containerd's applier fails, so that the layer would not unpack at all,
the builder refuses the layer with IndexFormatError: a hardlink to a path
this layer does not hold (a lower layer's file, or nothing), to a directory
or to itself; a parent path through a non-directory or through more than 255
symlinks; a whiteout naming no file. So it does for paths that resolve deeper
than MAX_DEPTH and layers costing more than the bounds below. `bootseer
index` then leaves the layer unindexed, and a layer server given such an
index anyway cannot load it: either way the layer takes the normal path,
where it fails as it always would. Nothing else escapes: no recursion, and
every value was range-checked by LayerIndex.validate, which the entries must
have passed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from snapshotter.layer.index import (
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_XATTR_LIST_BYTES,
    Entry,
    EntryType,
    IndexFormatError,
    encode_name,
)

ROOT = 1
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"

# continuity's RootPath gives up ("too many links") after 255 symlinks.
MAX_SYMLINKS = 255
# Live nodes of one layer: its entries plus the missing parents they imply.
MAX_NODES = 2 * MAX_ENTRIES
# Path components walked (and symlink target parts expanded) outside the
# cache of resolved parents. An honest layer walks each directory once or
# twice; a hostile one could make every entry walk MAX_DEPTH levels through
# MAX_SYMLINKS links, and the layer server loads one layer at a time.
MAX_STEPS = 8 * MAX_ENTRIES

_FORMAT = {
    EntryType.REG: stat.S_IFREG,
    EntryType.DIR: stat.S_IFDIR,
    EntryType.SYMLINK: stat.S_IFLNK,
    EntryType.CHAR: stat.S_IFCHR,
    EntryType.BLOCK: stat.S_IFBLK,
    EntryType.FIFO: stat.S_IFIFO,
}


# Not tracked by the garbage collector (a node holds no other node, so no
# cycle): a layer server holds a node for every file of every loaded layer,
# hundreds of thousands, which every full collection would otherwise walk.
class Node(msgspec.Struct, gc=False):
    ino: int
    mode: int  # full st_mode: file type and permission bits
    uid: int
    gid: int
    mtime: float
    size: int = 0
    offset: int = 0  # of the data in the uncompressed stream
    target: bytes = b""  # symlink target
    rdev: int = 0
    xattrs: dict[str, bytes] = msgspec.field(default_factory=dict)
    nlink: int = 1
    children: dict[bytes, int] | None = None  # for directories

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def mtime_ns(self) -> int:
        """The mtime the layer mount shows, and an unpacked copy gets."""
        return int(self.mtime * 1e9)


@dataclass
class LayerTree:
    nodes: dict[int, Node]
    # Directories made for an entry's parent path before (or without) an
    # entry of their own, as paths from the layer root; nearest the root first.
    implicit_dirs: tuple[str, ...] = ()

    def lookup(self, parent: int, name: bytes) -> Node | None:
        node = self.nodes.get(parent)
        children = node.children if node is not None else None
        ino = children.get(name) if children is not None else None
        return self.nodes[ino] if ino is not None else None


def build_tree(entries: list[Entry]) -> LayerTree:
    """The tree of a validated index's entries; IndexFormatError if
    containerd could not apply them (see the module's docstring)."""
    builder = _Builder()
    for entry in entries:
        builder.add(entry)
    return builder.finish()


def shows_xattrs(entries: Iterable[Entry]) -> bool:
    """Whether the layer's files may show an extended attribute: an entry
    has some, or an opaque marker gives its directory trusted.overlay.opaque.
    (An entry with xattrs that a later one replaces still counts: False is
    a promise, True only a maybe.)"""
    return any(e.xattrs or e.name.rpartition("/")[2] == OPAQUE_MARKER for e in entries)


def implicit_dirs(entries: list[Entry]) -> tuple[str, ...]:
    """LayerTree.implicit_dirs of the entries. Layers as docker, BuildKit and
    most tar writers make them name every directory before what is in it and
    have none: one pass over the names says so, without building the tree."""
    named = {""}
    for entry in entries:
        parent, _, base = entry.name.rpartition("/")
        if parent not in named:
            return build_tree(entries).implicit_dirs
        if entry.type == EntryType.DIR:
            named.add(entry.name)
            continue
        replaced = entry.name
        if base.startswith(WHITEOUT_PREFIX):
            hidden = base[len(WHITEOUT_PREFIX) :]
            replaced = f"{parent}/{hidden}" if parent else hidden
        if replaced in named:
            # A directory replaced by a file, symlink or whiteout: paths
            # through it may now lead elsewhere.
            return build_tree(entries).implicit_dirs
    return ()


class _Builder:
    def __init__(self) -> None:
        self.root = Node(ROOT, stat.S_IFDIR | 0o755, 0, 0, 0.0, children={})
        self.nodes: dict[int, Node] = {ROOT: self.root}
        self.next_ino = ROOT + 1
        self.steps = 0
        # Directories by parent path as entries write it: tens of thousands of
        # entries share a few parents. Emptied whenever a directory or symlink
        # goes, since paths through it then lead elsewhere.
        self.dirs: dict[str, Node] = {"": self.root}
        # Inodes of directories made for a parent path (mkparent's).
        self.implicit: set[int] = set()

    def add(self, entry: Entry) -> None:
        if entry.name == "":
            root = self.root
            root.mode, root.uid, root.gid, root.mtime = stat.S_IFDIR | entry.mode, entry.uid, entry.gid, entry.mtime
            _merge_xattrs(root, entry.xattrs, entry.name)
            return
        dirname, _, basename = entry.name.rpartition("/")
        parent = self.directory(dirname, create=True, what=entry.name)
        if basename == OPAQUE_MARKER:
            _merge_xattrs(parent, {OPAQUE_XATTR: b"y"}, entry.name)
            return
        if basename.startswith(WHITEOUT_PREFIX):
            hidden = basename[len(WHITEOUT_PREFIX) :]
            if hidden in ("", ".", ".."):
                raise IndexFormatError(f"whiteout {entry.name!r} names no file (containerd refuses it too)")
            # containerd's overlay applier fails on a whiteout of a path this
            # layer already holds (mknod: EEXIST), its bottom-layer applier
            # removes the path: what shows is the same, so it is replaced.
            self.place(parent, encode_name(hidden), self.new_node(stat.S_IFCHR, entry.uid, entry.gid, entry.mtime))
            return
        name = encode_name(basename)
        existing = _children(parent).get(name)
        if entry.type == EntryType.HARDLINK:
            self.link(parent, name, entry)
            return
        if entry.type == EntryType.DIR and existing is not None and self.nodes[existing].is_dir:
            node = self.nodes[existing]
            node.mode, node.uid, node.gid, node.mtime = stat.S_IFDIR | entry.mode, entry.uid, entry.gid, entry.mtime
            _merge_xattrs(node, entry.xattrs, entry.name)
            return
        # Linux gives symlinks no mode of their own: they show 0777, whatever
        # the tar header says (containerd's lchmod leaves them alone).
        mode = 0o777 if entry.type == EntryType.SYMLINK else entry.mode
        node = self.new_node(_FORMAT[entry.type] | mode, entry.uid, entry.gid, entry.mtime)
        node.xattrs = dict(entry.xattrs)
        if entry.type == EntryType.REG:
            node.size, node.offset = entry.size, entry.offset
        elif entry.type == EntryType.SYMLINK:
            node.target = encode_name(entry.linkname)
            node.size = len(node.target)
        elif entry.type in (EntryType.CHAR, EntryType.BLOCK):
            node.rdev = os.makedev(entry.devmajor, entry.devminor)
        elif entry.type == EntryType.DIR:
            node.children = {}
        self.place(parent, name, node)

    def link(self, parent: Node, name: bytes, entry: Entry) -> None:
        # As containerd: the link's path is removed first, then linked to
        # the target as the layer holds it then.
        self.unlink(parent, name)
        target_dir, _, target_base = entry.linkname.rpartition("/")
        what = f"hardlink {entry.name!r} -> {entry.linkname!r}"
        found = _children(self.directory(target_dir, create=False, what=what)).get(encode_name(target_base))
        if found is None:
            raise IndexFormatError(f"{what} has no file to link to in this layer, the only one containerd links within")
        target = self.nodes[found]
        if target.is_dir:
            raise IndexFormatError(f"{what}: a directory cannot be hardlinked")
        # containerd chowns, chmods, stamps and sets the xattrs of the link's
        # path, which is the shared inode: the link entry's metadata wins.
        if not stat.S_ISLNK(target.mode):
            target.mode = stat.S_IFMT(target.mode) | entry.mode
        target.uid, target.gid, target.mtime = entry.uid, entry.gid, entry.mtime
        _merge_xattrs(target, entry.xattrs, entry.name)
        _children(parent)[name] = target.ino
        target.nlink += 1

    def directory(self, path: str, create: bool, what: str) -> Node:
        """The directory `path` leads to, its symlinks followed within the
        layer; missing directories are made if `create` (an entry's parent),
        and otherwise refused (a hardlink's target)."""
        cached = self.dirs.get(path)
        if cached is not None:
            return cached
        chain = [self.root]  # the directories walked, for ".."
        pending = encode_name(path).split(b"/")[::-1] if path else []
        links = 0
        while pending:
            self.spend()
            part = pending.pop()
            here = chain[-1]
            ino = _children(here).get(part)
            if ino is None:
                if not create:
                    raise IndexFormatError(f"{what} has no file to link to: {path!r} is not a directory of this layer")
                child = self.new_node(stat.S_IFDIR | 0o755, 0, 0, 0.0)
                child.children = {}
                _children(here)[part] = child.ino
                self.implicit.add(child.ino)
            else:
                child = self.nodes[ino]
                if stat.S_ISLNK(child.mode):
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise IndexFormatError(f"{what}: {path!r} leads through more than {MAX_SYMLINKS} symlinks")
                    pending.extend(reversed(self.expand(child.target, chain)))
                    continue
                if not child.is_dir:
                    raise IndexFormatError(f"{what}: {path!r} passes through a non-directory")
            chain.append(child)
            if len(chain) > MAX_DEPTH:
                raise IndexFormatError(f"{what}: {path!r} leads deeper than {MAX_DEPTH} levels")
        self.dirs[path] = chain[-1]
        return chain[-1]

    def expand(self, target: bytes, chain: list[Node]) -> list[bytes]:
        """A symlink's target as the parts left to walk from `chain`, which
        it moves to where the target starts. Like filepath.Join in RootPath,
        `..` is taken lexically: in the target first, then against the
        directories walked, never above the root."""
        if target.startswith(b"/"):
            del chain[1:]
        parts: list[bytes] = []
        for part in target.split(b"/"):
            self.spend()
            if part in (b"", b"."):
                continue
            if part != b"..":
                parts.append(part)
            elif parts:
                parts.pop()
            elif len(chain) > 1:
                chain.pop()
        return parts

    def spend(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise IndexFormatError(f"the layer's paths take more than {MAX_STEPS} steps to resolve")

    def new_node(self, mode: int, uid: int, gid: int, mtime: float) -> Node:
        if len(self.nodes) >= MAX_NODES:
            raise IndexFormatError(f"the layer makes more than {MAX_NODES} files and directories")
        node = Node(self.next_ino, mode, uid, gid, mtime)
        self.next_ino += 1
        self.nodes[node.ino] = node
        return node

    def place(self, parent: Node, name: bytes, node: Node) -> None:
        self.unlink(parent, name)
        _children(parent)[name] = node.ino

    def unlink(self, parent: Node, name: bytes) -> None:
        """Remove `name` from `parent`: a node goes with its last name, a
        directory with everything under it that has no other name."""
        ino = _children(parent).pop(name, None)
        if ino is None:
            return
        gone = self.nodes[ino]
        if gone.is_dir or stat.S_ISLNK(gone.mode):
            self.dirs = {"": self.root}
        stack = [gone]
        while stack:
            node = stack.pop()
            node.nlink -= 1
            if node.nlink > 0:
                continue
            del self.nodes[node.ino]
            if node.children:
                stack.extend(self.nodes[c] for c in node.children.values())

    def finish(self) -> LayerTree:
        for node in self.nodes.values():
            if node.children is not None:
                node.nlink = 2 + sum(1 for c in node.children.values() if self.nodes[c].children is not None)
        return LayerTree(self.nodes, self.implicit_paths())

    def implicit_paths(self) -> tuple[str, ...]:
        """Where the directories made for parent paths ended up (a later entry
        of the same path keeps them listed: containerd copied the lower
        layer's xattrs onto them before that entry's own)."""
        if not self.implicit.intersection(self.nodes):
            return ()
        found = []
        stack = [(self.root, "")]
        while stack:
            node, path = stack.pop()
            for name, ino in sorted(_children(node).items(), reverse=True):
                child = self.nodes[ino]
                if child.children is None:
                    continue
                child_path = f"{path}/{os.fsdecode(name)}" if path else os.fsdecode(name)
                if ino in self.implicit:
                    found.append(child_path)
                stack.append((child, child_path))
        return tuple(sorted(found, key=lambda p: (p.count("/"), p)))


def _merge_xattrs(node: Node, xattrs: dict[str, bytes], what: str) -> None:
    """Entries of one path add up their xattrs; the sum is bounded as each
    entry's is (listxattr(2) answers at most XATTR_LIST_MAX bytes)."""
    if not xattrs:
        return
    node.xattrs.update(xattrs)
    if sum(len(encode_name(k)) + 1 for k in node.xattrs) > MAX_XATTR_LIST_BYTES:
        raise IndexFormatError(f"{what!r}: its xattr names add up to more than {MAX_XATTR_LIST_BYTES} bytes")


def _children(node: Node) -> dict[bytes, int]:
    """A directory's children; only directories are ever asked for theirs."""
    assert node.children is not None
    return node.children
