"""Directory trees deeper than PATH_MAX and Python's recursion limit, as a
hostile image or container makes them: built one level at a time relative
to the directory above, since no absolute path can reach the bottom."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Past the recursion limit (1000) and, with two-byte steps, PATH_MAX (4096).
DEPTH = 5000

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


@dataclass(frozen=True)
class Counted:
    """What containerd's usage of the tree is: allocated bytes, distinct inodes."""

    size: int
    inodes: int


def build_deep_tree(root: Path, depth: int = DEPTH, every: int = 500) -> Counted:
    """`root/d/d/.../d`, `depth` levels below the existing directory `root`;
    every `every` levels a file, a second hardlink to it and a symlink out
    of the tree. Returns the usage of `root` and everything below it."""
    fd = os.open(root, _DIR)
    seen: dict[tuple[int, int], int] = {}

    def count(st: os.stat_result) -> None:
        seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512

    try:
        count(os.fstat(fd))
        for level in range(1, depth + 1):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", _DIR, dir_fd=fd)
            os.close(fd)
            fd = below
            count(os.fstat(fd))
            if level % every == 0:
                data = os.open("data", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
                try:
                    os.write(data, b"x" * 10_000)
                finally:
                    os.close(data)
                os.link("data", "hardlink", src_dir_fd=fd, dst_dir_fd=fd)
                os.symlink("/etc/passwd", "symlink", dir_fd=fd)
                for name in ("data", "hardlink", "symlink"):
                    count(os.stat(name, dir_fd=fd, follow_symlinks=False))
    finally:
        os.close(fd)
    return Counted(size=sum(seen.values()), inodes=len(seen))


def remove_deep_tree(path: Path) -> None:
    """Teardown that does not depend on the code under test (which may have
    failed to remove a tree, or left pytest a tree its own cleanup cannot
    remove): GNU rm walks any depth."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False)
