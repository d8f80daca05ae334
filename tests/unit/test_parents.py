"""Implicit parent directories: which a layer has, and when the normal path
would show them otherwise than the lazy tree (containerd's mkparent copies
the nearest lower layer's directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapshotter.layer.index import Entry, EntryType
from snapshotter.layer.tree import implicit_dirs
from snapshotter.parents import differing, root_path


def _entry(name: str, kind: EntryType = EntryType.REG, linkname: str = "") -> Entry:
    return Entry(name, kind, 0o755 if kind == EntryType.DIR else 0o644, 0, 0, 0.0, 0, 0, linkname, 0, 0, {})


def test_a_layer_naming_its_directories_first_has_none() -> None:
    entries = [_entry("usr", EntryType.DIR), _entry("usr/bin", EntryType.DIR), _entry("usr/bin/x")]
    assert implicit_dirs(entries) == ()


def test_directories_no_entry_gives_are_implicit_nearest_the_root_first() -> None:
    assert implicit_dirs([_entry("tmp/a/x"), _entry("tmp/b", EntryType.DIR)]) == ("tmp", "tmp/a")


def test_a_directory_given_after_its_contents_stays_implicit() -> None:
    """containerd made it like the lower layer's (xattrs included) before the entry came."""
    assert implicit_dirs([_entry("opt/x"), _entry("opt", EntryType.DIR)]) == ("opt",)


def test_a_parent_through_a_symlink_of_the_layer_is_where_the_link_leads() -> None:
    entries = [_entry("l", EntryType.SYMLINK, linkname="var/lib"), _entry("l/x")]
    assert implicit_dirs(entries) == ("var", "var/lib")


def test_a_directory_replaced_and_given_again_is_not_implicit() -> None:
    # The one-pass check cannot tell; the tree builder can.
    entries = [_entry("d", EntryType.DIR), _entry(".wh.d"), _entry("d", EntryType.DIR), _entry("d/x")]
    assert implicit_dirs(entries) == ()
    replaced = [_entry("d", EntryType.DIR), _entry("d", EntryType.SYMLINK, linkname="e"), _entry("d/x")]
    assert implicit_dirs(replaced) == ("e",)


@pytest.fixture
def lowers(tmp_path: Path) -> list[Path]:
    """Two lower layers, nearest first: the upper one has a symlinked /run
    and /srv replaced by a file; the base has /tmp 1777 and plain /var."""
    upper, base = tmp_path / "upper", tmp_path / "base"
    for d in ("var/run", "var/cache", "srv", "tmp", "plain"):
        (base / d).mkdir(parents=True)
    (base / "tmp").chmod(0o1777)
    (base / "var/cache").chmod(0o700)
    (base / "plain").chmod(0o755)
    os.symlink("/var/cache", base / "cached")
    upper.mkdir()
    os.symlink("/var/run", upper / "run")
    (upper / "srv").write_text("not a directory")
    return [upper, base]


def test_root_path_follows_symlinks_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "real/dir").mkdir(parents=True)
    os.symlink("/real", root / "abs")
    os.symlink("../../real", root / "climb")
    assert root_path(root, "abs/dir") == root / "real/dir"
    # `..` never climbs above the root.
    assert root_path(root, "climb/dir") == root / "real/dir"
    assert root_path(root, "missing/a/b") == root / "missing/a/b"
    os.symlink("loop", root / "loop")
    with pytest.raises(OSError, match="symlinks"):
        root_path(root, "loop/x")


def test_a_lower_directory_like_the_lazy_trees_or_none_at_all_is_no_difference(lowers: list[Path]) -> None:
    assert differing(["plain", "nowhere", "nowhere/deeper"], lowers) is None
    # Replaced by a file in the nearer layer: containerd copies nothing.
    assert differing(["srv"], lowers) is None


def test_a_lower_directory_with_other_attributes_is_a_difference(lowers: list[Path]) -> None:
    why = differing(["tmp"], lowers)
    assert why is not None and "/tmp" in why and "mode 1777" in why
    # The nearer layer's symlink leads nowhere in it, and the base has no /run.
    assert differing(["run"], lowers) is None
    # A symlink in the base is followed inside the base.
    linked = differing(["cached"], lowers)
    assert linked is not None and "mode 700" in linked
    cache = differing(["var", "var/cache"], lowers)
    assert cache is not None and "/var/cache" in cache and "mode 700" in cache


def test_lower_xattrs_are_a_difference_but_overlayfs_own_are_not(lowers: list[Path]) -> None:
    os.setxattr(lowers[1] / "plain", "user.origin", b"base")
    why = differing(["plain"], lowers)
    assert why is not None and "user.origin" in why
    os.setxattr(lowers[1] / "var", "trusted.overlay.opaque", b"y")
    assert differing(["var"], lowers) is None
