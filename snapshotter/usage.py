"""Disk usage of a snapshot directory, counted as containerd counts it:
allocated blocks (st_blocks * 512) and distinct inodes, hardlinks once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Usage:
    size: int
    inodes: int


def disk_usage(root: Path) -> Usage:
    seen: set[tuple[int, int]] = set()
    size = 0

    def account(st: os.stat_result) -> None:
        nonlocal size
        ident = (st.st_dev, st.st_ino)
        if ident not in seen:
            seen.add(ident)
            size += st.st_blocks * 512

    account(os.lstat(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            try:
                account(os.lstat(os.path.join(dirpath, name)))
            except FileNotFoundError:
                # An active snapshot may change under us; count what is there.
                continue
    return Usage(size=size, inodes=len(seen))
