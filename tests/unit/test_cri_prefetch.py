"""Which paths a pod's prefetch annotation names, and which may be asked for."""

from __future__ import annotations

from hdfs_fuse.mountinfo import FSTYPE, Mount
from snapshotter.cri.prefetch import ANNOTATION, MAX_PATHS, refusal, requested_paths

MOUNTS = [
    Mount(0, 20, "/", "ext4", "/dev/vda1"),
    Mount(0, 50, "/mnt/ckpts/run42", FSTYPE, "bootseer"),
    Mount(0, 51, "/mnt/ckpts/run42/inner", "tmpfs", "tmpfs"),
]


def test_paths_split_on_commas_and_spaces_absolute_only_once_each() -> None:
    text = " /mnt/a.bin,/mnt/b.bin\n/mnt/a.bin  relative/c.bin ,, /mnt/d "
    assert requested_paths({ANNOTATION: text}) == ["/mnt/a.bin", "/mnt/b.bin", "/mnt/d"]
    assert requested_paths({"other": "/mnt/a.bin"}) == []
    many = ",".join(f"/p/{i}" for i in range(3 * MAX_PATHS))
    assert len(requested_paths({ANNOTATION: many})) == MAX_PATHS


def test_only_files_of_hdfs_fuse_mounts_below_a_root_may_be_prefetched() -> None:
    roots = ["/mnt/ckpts"]
    assert refusal("/mnt/ckpts/run42/model.bin", roots, MOUNTS) is None
    assert refusal("/mnt/ckpts/run42", roots, MOUNTS) is None
    assert "not below" in (refusal("/etc/shadow", roots, MOUNTS) or "")
    # A prefix of a root's name is not below it.
    assert "not below" in (refusal("/mnt/ckpts-other/x", roots, MOUNTS) or "")
    assert "not on an hdfs-fuse mount" in (refusal("/mnt/ckpts/local.bin", roots, MOUNTS) or "")
    # The innermost mount decides.
    assert "not on an hdfs-fuse mount" in (refusal("/mnt/ckpts/run42/inner/x", roots, MOUNTS) or "")
