"""The mounts that make up a snapshot's filesystem, as containerd's overlayfs
snapshotter would return them.

containerd mounts these itself (for unpacking, and for a container's rootfs),
so they must be exactly what its mount code understands: a bind mount when
there is a single directory to show, overlay otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from snapshotter.model import Kind


@dataclass(frozen=True)
class Mount:
    type: str
    source: str
    options: list[str] = field(default_factory=list)
    target: str = ""


def snapshot_mounts(
    kind: Kind,
    upper: str,
    work: str,
    lowers: Sequence[str],
    overlay_options: Sequence[str] = (),
) -> list[Mount]:
    """Mounts for an active or view snapshot.

    `upper`/`work` are the snapshot's own directories, `lowers` its ancestors'
    filesystem directories, nearest parent first. `overlay_options` are extra
    options the host's overlayfs wants (such as index=off).
    """
    if not lowers:
        # No parents: the snapshot's own directory is the whole filesystem.
        mode = "ro" if kind == Kind.VIEW else "rw"
        return [Mount("bind", upper, [mode, "rbind"])]
    if kind == Kind.ACTIVE:
        options = [
            *overlay_options,
            f"workdir={work}",
            f"upperdir={upper}",
            f"lowerdir={':'.join(lowers)}",
        ]
        return [Mount("overlay", "overlay", options)]
    if len(lowers) == 1:
        # overlayfs refuses a single lowerdir without an upper; bind it read-only.
        return [Mount("bind", lowers[0], ["ro", "rbind"])]
    return [Mount("overlay", "overlay", [*overlay_options, f"lowerdir={':'.join(lowers)}"])]
