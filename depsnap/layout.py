"""Where an environment's bookkeeping lives beside its target: the side
directory `.NAME.depsnap/`, whose `key` file says which snapshot the target
holds. Standard library only: the pod client writes it too."""

from __future__ import annotations

import os
from pathlib import Path


def side_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.depsnap"


def present_key(target: Path) -> str | None:
    """The key of the snapshot restored or installed at `target`, if known."""
    try:
        return (side_dir(target) / "key").read_text().strip() or None
    except FileNotFoundError:
        return None


def write_key(target: Path, key: str) -> None:
    side = side_dir(target)
    side.mkdir(exist_ok=True)
    temp = side / "key.tmp"
    temp.write_text(key + "\n")
    os.rename(temp, side / "key")


def is_empty_or_missing(path: Path) -> bool:
    try:
        return not any(os.scandir(path))
    except FileNotFoundError:
        return True
