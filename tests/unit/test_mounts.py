from __future__ import annotations

from snapshotter.model import Kind
from snapshotter.mounts import Mount, snapshot_mounts


def test_active_without_parent_is_rw_bind() -> None:
    assert snapshot_mounts(Kind.ACTIVE, "/s/1/fs", "/s/1/work", []) == [Mount("bind", "/s/1/fs", ["rw", "rbind"])]


def test_view_without_parent_is_ro_bind() -> None:
    assert snapshot_mounts(Kind.VIEW, "/s/1/fs", "/s/1/work", []) == [Mount("bind", "/s/1/fs", ["ro", "rbind"])]


def test_active_with_parents_is_overlay_nearest_lower_first() -> None:
    mounts = snapshot_mounts(Kind.ACTIVE, "/s/3/fs", "/s/3/work", ["/s/2/fs", "/s/1/fs"], ["index=off"])
    assert mounts == [
        Mount(
            "overlay",
            "overlay",
            ["index=off", "workdir=/s/3/work", "upperdir=/s/3/fs", "lowerdir=/s/2/fs:/s/1/fs"],
        )
    ]


def test_view_of_single_layer_binds_the_parent_read_only() -> None:
    assert snapshot_mounts(Kind.VIEW, "/s/2/fs", "/s/2/work", ["/s/1/fs"]) == [
        Mount("bind", "/s/1/fs", ["ro", "rbind"])
    ]


def test_view_of_several_layers_is_lower_only_overlay() -> None:
    assert snapshot_mounts(Kind.VIEW, "/s/3/fs", "/s/3/work", ["/s/2/fs", "/s/1/fs"]) == [
        Mount("overlay", "overlay", ["lowerdir=/s/2/fs:/s/1/fs"])
    ]
