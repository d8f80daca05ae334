"""/proc/self/mountinfo, parsed: is a path a mount point, and of which device.

Used to wait for a mount to appear or vanish without touching it (a stat of
a dead FUSE mount hangs or fails) and to find the FUSE connection's backing
device, whose read-ahead the daemon raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
# What an hdfs-fuse mount shows as its type (its FUSE subtype).
FSTYPE = "fuse.hdfs-fuse"


@dataclass(frozen=True)
class Mount:
    major: int
    minor: int
    mountpoint: str
    fstype: str
    source: str

    @property
    def bdi(self) -> str:
        """Name of the backing device info under /sys/class/bdi."""
        return f"{self.major}:{self.minor}"


def _unescape(field: str) -> str:
    # The kernel escapes space, tab, newline and backslash as octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        major, _, minor = fields[2].partition(":")
        mounts.append(Mount(int(major), int(minor), _unescape(fields[4]), tail[0], _unescape(tail[1])))
    return mounts


def find(text: str, mountpoint: str) -> Mount | None:
    """The mount on `mountpoint` (the topmost if several are stacked)."""
    found = None
    for mount in parse(text):
        if mount.mountpoint == mountpoint:
            found = mount
    return found


def current(mountpoint: Path) -> Mount | None:
    return find(MOUNTINFO.read_text(), str(mountpoint.absolute()))
