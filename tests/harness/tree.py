"""Snapshot a directory tree into comparable records, and clean up mounts.

Two snapshotters are "the same" to a container when every path has the same
type, mode, owner, content, link target, device number and xattrs, and the
same paths share inodes. mtimes and inode numbers are left out: they
legitimately differ between two unpacks of the same image.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# security.* is set by the host's LSM and trusted.overlay.* is overlayfs'
# own bookkeeping; neither is image content.
_IGNORED_XATTR_PREFIXES = ("security.", "trusted.overlay.")


@dataclass(frozen=True)
class Entry:
    """What a container can observe about one path."""

    kind: str  # "file", "dir", "symlink", "char", "block", "fifo", "socket"
    mode: int  # permission bits including setuid/setgid/sticky
    uid: int
    gid: int
    size: int | None = None  # regular files only: a dir's size is fs-specific
    sha256: str | None = None
    target: str | None = None
    rdev: tuple[int, int] | None = None
    xattrs: tuple[tuple[str, bytes], ...] = ()

    def describe(self) -> str:
        parts = [self.kind, f"mode={self.mode:04o}", f"owner={self.uid}:{self.gid}"]
        if self.size is not None:
            parts.append(f"size={self.size} sha256={self.sha256}")
        if self.target is not None:
            parts.append(f"-> {self.target!r}")
        if self.rdev is not None:
            parts.append(f"rdev={self.rdev[0]},{self.rdev[1]}")
        if self.xattrs:
            parts.append(f"xattrs={dict(self.xattrs)!r}")
        return " ".join(parts)


@dataclass
class Tree:
    """All entries below a root, keyed by absolute in-container path ("/a/b")."""

    entries: dict[str, Entry] = field(default_factory=dict)
    # Sets of paths that are one inode, only for inodes seen more than once.
    hardlinks: set[frozenset[str]] = field(default_factory=set)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "dir"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISCHR, "char"),
        (stat.S_ISBLK, "block"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    raise ValueError(f"unknown file type in mode {mode:o}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _xattrs(path: str) -> tuple[tuple[str, bytes], ...]:
    names = os.listxattr(path, follow_symlinks=False)
    return tuple(
        (name, os.getxattr(path, name, follow_symlinks=False))
        for name in sorted(names)
        if not name.startswith(_IGNORED_XATTR_PREFIXES)
    )


def _entry(path: str, st: os.stat_result) -> Entry:
    kind = _kind(st.st_mode)
    return Entry(
        kind=kind,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        size=st.st_size if kind == "file" else None,
        sha256=_sha256(path) if kind == "file" else None,
        target=os.readlink(path) if kind == "symlink" else None,
        rdev=(os.major(st.st_rdev), os.minor(st.st_rdev)) if kind in ("char", "block") else None,
        xattrs=_xattrs(path),
    )


def walk(root: Path) -> Tree:
    """Record every path under `root`, without following symlinks and without
    descending into anything mounted below it.

    Mount points are found from mountinfo rather than by comparing st_dev:
    overlayfs reports the lower filesystem's st_dev for non-directories when
    its layers live on different filesystems (a FUSE lower, say).
    """
    root_str = os.fspath(root)
    nested = {m for m in mount_points() if m.startswith(root_str + "/")}
    tree = Tree()
    inodes: dict[tuple[int, int], list[str]] = {}

    def visit(host_path: str, rel: str) -> None:
        st = os.lstat(host_path)
        tree.entries[rel] = _entry(host_path, st)
        if stat.S_ISDIR(st.st_mode):
            if host_path in nested:
                return
            for name in os.listdir(host_path):
                visit(os.path.join(host_path, name), (rel.rstrip("/") + "/" + name))
        else:
            inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)

    visit(root_str, "/")
    tree.hardlinks = {frozenset(paths) for paths in inodes.values() if len(paths) > 1}
    return tree


def diff(left: Tree, right: Tree, left_name: str = "left", right_name: str = "right") -> str:
    """Human-readable differences, empty when the trees are the same."""
    lines: list[str] = []
    for path in sorted(left.entries.keys() | right.entries.keys()):
        a, b = left.entries.get(path), right.entries.get(path)
        if a == b:
            continue
        if b is None:
            lines.append(f"only in {left_name}: {path}: {a.describe()}")  # type: ignore[union-attr]
        elif a is None:
            lines.append(f"only in {right_name}: {path}: {b.describe()}")
        else:
            lines.append(f"differs {path}:\n  {left_name}: {a.describe()}\n  {right_name}: {b.describe()}")
    for group in sorted(left.hardlinks - right.hardlinks, key=sorted):
        lines.append(f"hardlink group only in {left_name}: {sorted(group)}")
    for group in sorted(right.hardlinks - left.hardlinks, key=sorted):
        lines.append(f"hardlink group only in {right_name}: {sorted(group)}")
    return "\n".join(lines)


def _unescape_mountinfo(text: str) -> str:
    # The kernel escapes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def mount_points() -> list[str]:
    """Mount points in this mount namespace, in mount order."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return [_unescape_mountinfo(line.split(" ")[4]) for line in f]


def unmount_under(directory: Path) -> list[str]:
    """Unmount everything mounted at or below `directory`, deepest first.

    Returns what could not be unmounted even lazily (for the caller to
    report). A lazy unmount is the fallback for busy mounts and for FUSE
    mounts whose server is already gone.
    """
    prefix = os.fspath(directory)
    leftovers: list[str] = []
    for point in reversed(mount_points()):
        if point != prefix and not point.startswith(prefix + "/"):
            continue
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode == 0:
            continue
        lazy = subprocess.run(["umount", "--lazy", point], capture_output=True, text=True, check=False)
        if lazy.returncode != 0:
            leftovers.append(f"{point}: {lazy.stderr.strip()}")
    return leftovers


@dataclass(frozen=True)
class Mount:
    """One entry of a snapshotter's mount list (containerd.types.Mount)."""

    type: str
    source: str
    options: tuple[str, ...]

    @classmethod
    def from_ctr_json(cls, obj: dict[str, object]) -> Mount:
        """From `ctr snapshots prepare/view --mounts` output items."""
        options = obj.get("Options") or []
        assert isinstance(options, list)
        return cls(str(obj["Type"]), str(obj["Source"]), tuple(map(str, options)))


def mount(m: Mount, target: Path) -> None:
    """Mount as containerd would; raises with mount(8)'s message on failure."""
    options = ",".join(m.options)
    # "bind" is not a filesystem type: mount(8) takes bind/rbind as options.
    type_args = [] if m.type == "bind" else ["-t", m.type]
    argv = ["mount", *type_args, *(["-o", options] if options else []), m.source, os.fspath(target)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


@contextmanager
def mounted(mounts: Sequence[Mount], target: Path) -> Iterator[Path]:
    """Mount a snapshot's mount list on `target` (created if missing) for a `with` block."""
    target.mkdir(parents=True, exist_ok=True)
    try:
        for m in mounts:
            mount(m, target)
        yield target
    finally:
        leftovers = unmount_under(target)
        if leftovers:
            raise RuntimeError("could not unmount:\n" + "\n".join(leftovers))


def drop_page_cache() -> None:
    """Empty the machine's page cache: reads after this reach the filesystem
    that serves them (a FUSE server, the disk), not memory."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
