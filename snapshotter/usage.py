"""Walking a snapshot directory of any depth: its disk usage, counted as
containerd counts it (allocated blocks, st_blocks * 512, and distinct inodes,
hardlinks once), and its removal.

A container can build a tree far deeper than Python's recursion limit or
PATH_MAX, so the walk is an explicit stack of directories and every call is
relative to a directory descriptor (no absolute paths below the root).
Symlinks are never followed: directories are opened with O_NOFOLLOW.

Descriptors are bounded: only the deepest `FD_WINDOW` directories of the
current path stay open. Climbing into an ancestor whose descriptor was closed
opens `..` of the directory being left and checks that it is the inode
recorded on the way down (as GNU fts does); if a concurrent rename moved the
subtree to another parent, the walk stops with `TreeChanged` rather than
carry on in a directory it did not come from. Reopening an ancestor by name
from the root instead would cost time quadratic in the depth and is no safer:
a rename can break that path just as well. Trees no deeper than the window,
nearly every real one, never use `..`, so renames inside them cannot disturb
a walk at all.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

# Open directories per walk. Small, because a depth that costs a descriptor
# per level is a denial of service on any limit (16 calls are served at once),
# and because deeper than this real trees rarely go.
FD_WINDOW = 16

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# What opening a directory listed a moment ago answers once it is gone, or
# has been replaced by a file or a symlink.
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)

# Failures a removal reports by example; the rest it only counts.
_EXAMPLES = 3


@dataclass(frozen=True)
class Usage:
    size: int
    inodes: int


class TreeError(Exception):
    """A walk could not do all it was asked to; the message says why."""


class TreeChanged(TreeError):
    """A directory the walk had to climb back into was moved away meanwhile."""


class TreeNotRemoved(TreeError):
    """Some entries of a tree could not be removed; the rest were."""


@dataclass
class _Dir:
    name: str  # in its parent; "" for the walk's root
    ident: tuple[int, int]  # st_dev, st_ino
    fd: int | None  # None once it has left the window
    # Entries not visited yet, split by the type the directory listing gave.
    files: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    # Removal only: something below it stays, so it cannot be removed.
    incomplete: bool = False


def _open(name: str | Path, dir_fd: int | None) -> tuple[int, os.stat_result]:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _Walk:
    """A depth-first walk below `root`: the caller takes entries off `here`,
    descends into directories and ascends when `here` has none left."""

    def __init__(self, root: Path) -> None:
        self.root = root
        fd, self.root_stat = _open(root, None)
        self._stack = [_Dir("", _ident(self.root_stat), fd)]
        try:
            self._list(self._stack[0], fd)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> _Walk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for level in self._stack:
            if level.fd is not None:
                os.close(level.fd)
                level.fd = None

    @property
    def here(self) -> _Dir:
        return self._stack[-1]

    @property
    def fd(self) -> int:
        fd = self.here.fd
        assert fd is not None, "the current directory is always open"
        return fd

    @property
    def depth(self) -> int:
        return len(self._stack) - 1

    @staticmethod
    def _list(level: _Dir, fd: int) -> None:
        with os.scandir(fd) as entries:
            for entry in entries:
                # d_type, or an fstatat while fd is still this directory's.
                (level.dirs if entry.is_dir(follow_symlinks=False) else level.files).append(entry.name)

    def descend(self, name: str) -> None:
        """Make `name`, a directory in `here`, the current directory."""
        try:
            fd, st = _open(name, self.fd)
        except OSError as exc:
            raise self.located(exc, name) from None
        level = _Dir(name, _ident(st), fd)
        try:
            self._list(level, fd)
        except OSError as exc:
            os.close(fd)
            raise self.located(exc, name) from None
        self._stack.append(level)
        if len(self._stack) > FD_WINDOW:
            leaving = self._stack[-FD_WINDOW - 1]
            if leaving.fd is not None:
                os.close(leaving.fd)
                leaving.fd = None

    def ascend(self) -> _Dir:
        """Leave `here` (all its entries taken) for its parent; returns it."""
        assert self.depth > 0, "the root has no parent in this walk"
        done = self._stack[-1]
        parent = self._stack[-2]
        assert done.fd is not None
        try:
            if parent.fd is None:
                try:
                    fd, st = _open("..", done.fd)
                except FileNotFoundError:
                    # `here` itself was removed: it has no parent any more.
                    raise TreeChanged(f"{self.display(done.name)} was removed while being walked") from None
                if _ident(st) != parent.ident:
                    os.close(fd)
                    raise TreeChanged(f"{self.display(done.name)} was moved to another directory while being walked")
                parent.fd = fd
        finally:
            # On TreeChanged too: `close` must not see it twice.
            os.close(done.fd)
            done.fd = None
        self._stack.pop()
        return done

    def located(self, exc: OSError, name: str) -> OSError:
        """`exc` with the entry's place under the root as its file name."""
        return OSError(exc.errno, exc.strerror, self.display(name))

    def display(self, name: str = "") -> str:
        """Where `name` in `here` is, for messages, without a path that could
        run to megabytes in a deep tree."""
        parts = [level.name for level in self._stack[1:]] + ([name] if name else [])
        if len(parts) > 6:
            parts = [*parts[:2], f"...({len(parts) - 4} levels)...", *parts[-2:]]
        return os.path.join(self.root, *parts)


def _lstat(walk: _Walk, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
    except FileNotFoundError:
        # An active snapshot may change under us; count what is there.
        return None
    except OSError as exc:
        raise walk.located(exc, name) from None


def disk_usage(root: Path) -> Usage:
    """Raises TreeChanged if a directory more than FD_WINDOW levels deep is
    moved to another parent while it is measured."""
    seen: set[tuple[int, int]] = set()
    size = 0

    def account(st: os.stat_result) -> None:
        nonlocal size
        ident = _ident(st)
        if ident not in seen:
            seen.add(ident)
            size += st.st_blocks * 512

    with _Walk(root) as walk:
        account(walk.root_stat)
        while True:
            here = walk.here
            if here.files:
                st = _lstat(walk, here.files.pop())
                if st is not None:
                    account(st)
            elif here.dirs:
                name = here.dirs.pop()
                st = _lstat(walk, name)
                if st is None:
                    continue
                account(st)
                if stat.S_ISDIR(st.st_mode):
                    try:
                        walk.descend(name)
                    except OSError as exc:
                        if exc.errno not in _GONE:
                            raise
            elif walk.depth:
                walk.ascend()
            else:
                break
    return Usage(size=size, inodes=len(seen))


def remove_tree(path: Path) -> None:
    """Remove `path` and everything below it; a symlink or file at `path` is
    unlinked. Entries that will not go (a mount point, an immutable file) are
    skipped with their ancestors and the rest is removed all the same;
    TreeNotRemoved then says what stayed and why, and TreeChanged that the
    tree changed under the walk. Either way a later call can finish."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    examples: list[str] = []
    count = 0

    def failed(walk: _Walk, exc: OSError) -> None:
        nonlocal count
        walk.here.incomplete = True
        count += 1
        if len(examples) < _EXAMPLES:
            examples.append(f"{exc.filename}: {exc.strerror}")

    with _Walk(path) as walk:
        while True:
            here = walk.here
            if here.files:
                name = here.files.pop()
                try:
                    os.unlink(name, dir_fd=walk.fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    failed(walk, walk.located(exc, name))
            elif here.dirs:
                name = here.dirs.pop()
                try:
                    walk.descend(name)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    failed(walk, exc)
            elif walk.depth:
                done = walk.ascend()
                if done.incomplete:
                    # Its rmdir would only fail with ENOTEMPTY: say nothing more.
                    walk.here.incomplete = True
                    continue
                try:
                    os.rmdir(done.name, dir_fd=walk.fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    failed(walk, walk.located(exc, done.name))
            else:
                break
        if not walk.here.incomplete:
            try:
                os.rmdir(path)
            except OSError as exc:
                failed(walk, walk.located(exc, ""))
    if count:
        more = f" and {count - len(examples)} more" if count > len(examples) else ""
        raise TreeNotRemoved(f"could not remove everything under {path}: {'; '.join(examples)}{more}")
