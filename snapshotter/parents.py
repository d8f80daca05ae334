"""Implicit parent directories of a lazily served layer.

A layer with an entry `tmp/x` and none for `tmp` still gets a `tmp`:
containerd's applier makes it, and on overlayfs copies the mode, owner, times
and xattrs of the nearest lower layer's `tmp` onto it (pkg/archive/tar.go
mkparent, given the overlay mount's lower directories as parents; a lower
layer holding something other than a directory there stops the search). So a
layer adding `tmp/x` over a base whose `/tmp` is 1777 shows `/tmp` as 1777.

The lazy tree cannot do that: one directory of the FUSE mount serves a layer
in every chain it is part of, and it shows such a directory as 0755 owned by
root without xattrs. So a layer whose implicit directories would come out
otherwise on the normal path takes the normal path; on the images docker and
BuildKit build, every directory has an entry and nothing is looked up.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

# What the lazy tree shows for a directory no entry gave.
LAZY_MODE = 0o755
# continuity's RootPath gives up after this many symlinks.
_MAX_SYMLINKS = 255
# containerd does not copy these up (overlayfs' own, meaningless elsewhere).
_NOT_COPIED = "trusted.overlay."


def root_path(root: Path, rel: str) -> Path:
    """`rel` under `root` with its symlinks followed inside `root`, as
    continuity's fs.RootPath does: an absolute target starts again at `root`,
    `..` never climbs above it, and a missing component ends the resolution."""
    pending = rel.split("/")[::-1]
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            return root.joinpath(*resolved, part, *reversed(pending))
        if not stat.S_ISLNK(st.st_mode):
            resolved.append(part)
            continue
        links += 1
        if links > _MAX_SYMLINKS:
            raise OSError(errno.ELOOP, f"more than {_MAX_SYMLINKS} symlinks", str(root.joinpath(rel)))
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        pending.extend(reversed(target.split("/")))
    return root.joinpath(*resolved)


def differing(implicit: Sequence[str], lowers: Sequence[Path]) -> str | None:
    """Why the normal path would show one of the layer's `implicit`
    directories otherwise than the lazy tree does, given the lower layers'
    directories nearest first; None if it would not."""
    for rel in implicit:
        for lower in lowers:
            try:
                path = root_path(lower, rel)
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                return f"cannot look up /{rel} in the lower layer {lower}: {exc.strerror}"
            if not stat.S_ISDIR(st.st_mode):
                # Replaced in that layer: containerd copies nothing.
                break
            try:
                copied = [x for x in os.listxattr(path, follow_symlinks=False) if not x.startswith(_NOT_COPIED)]
            except OSError as exc:
                return f"cannot list the xattrs of /{rel} in the lower layer {lower}: {exc.strerror}"
            mode = stat.S_IMODE(st.st_mode)
            if mode != LAZY_MODE or st.st_uid or st.st_gid or copied:
                return (
                    f"the layer has no entry for directory /{rel}, which containerd makes like the lower "
                    f"layer's (mode {mode:o}, owner {st.st_uid}:{st.st_gid}, xattrs {copied or 'none'}) "
                    f"and the lazy tree cannot (mode {LAZY_MODE:o}, owner 0:0)"
                )
            break
    return None
