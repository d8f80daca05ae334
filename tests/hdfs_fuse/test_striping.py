"""The pure core: stripe geometry, read-ahead policy, backoff, sizes, URIs, mountinfo."""

from __future__ import annotations

import pytest

from hdfs_fuse import mountinfo
from hdfs_fuse.settings import HdfsFuseConfig, parse_size
from hdfs_fuse.striping import Geometry, ReorderTolerantReadAhead, backoff_delay, window_limit


def test_geometry_extents_cover_the_file_exactly() -> None:
    g = Geometry(file_size=10, stripe_size=4)
    assert g.count == 3
    assert [g.extent(i) for i in range(g.count)] == [(0, 4), (4, 4), (8, 2)]
    with pytest.raises(IndexError):
        g.extent(3)


def test_geometry_span_clips_to_eof_and_handles_empty_reads() -> None:
    g = Geometry(file_size=10, stripe_size=4)
    assert g.span(0, 4) == range(1)
    assert g.span(3, 2) == range(2)  # crosses a boundary
    assert g.span(8, 100) == range(2, 3)
    assert g.span(10, 5) == range(0)  # at EOF
    assert g.span(4, 0) == range(0)
    assert Geometry(0, 4).count == 0 and Geometry(0, 4).span(0, 10) == range(0)


def test_window_limit_keeps_a_stripe_of_memory_free() -> None:
    assert window_limit(readahead=64, memory=1000, stripe_size=8) == 8
    assert window_limit(readahead=64, memory=32, stripe_size=8) == 3
    assert window_limit(readahead=64, memory=8, stripe_size=8) == 0


def test_readahead_grows_while_sequential() -> None:
    ra = ReorderTolerantReadAhead(max_window=16)
    sequential, ahead = ra.on_access(0, 0)
    assert sequential and ahead == range(1, 3)
    windows = []
    for stripe in range(1, 6):
        _, ahead = ra.on_access(stripe, stripe)
        windows.append(len(ahead))
    assert windows == [4, 8, 16, 16, 16]
    assert ahead == range(6, 22)


def test_readahead_stays_put_within_a_stripe() -> None:
    ra = ReorderTolerantReadAhead(max_window=16)
    ra.on_access(0, 0)
    for _ in range(5):
        _, ahead = ra.on_access(0, 0)
    assert ahead == range(1, 3)


def test_readahead_collapses_on_random_access() -> None:
    ra = ReorderTolerantReadAhead(max_window=16)
    for stripe in range(4):
        ra.on_access(stripe, stripe)
    sequential, ahead = ra.on_access(100, 100)
    assert not sequential and ahead == range(0) and ra.window == 0
    sequential, ahead = ra.on_access(40, 41)
    assert not sequential and ahead == range(0)


def test_readahead_tolerates_slightly_reordered_requests() -> None:
    ra = ReorderTolerantReadAhead(max_window=16)
    for stripe in range(4):
        ra.on_access(stripe, stripe)
    # The kernel's parallel read-ahead requests overtake one another.
    assert ra.on_access(6, 6)[0]
    assert ra.on_access(5, 5)[0]
    assert ra.last == 6


def test_random_first_access_fetches_nothing_extra() -> None:
    ra = ReorderTolerantReadAhead(max_window=16)
    assert ra.on_access(7, 7) == (False, range(0))


def test_readahead_off_when_no_window() -> None:
    ra = ReorderTolerantReadAhead(max_window=0)
    assert ra.on_access(0, 0)[1] == range(0)
    assert ra.on_access(1, 1)[1] == range(0)


def test_backoff_doubles_up_to_the_cap_with_jitter_range() -> None:
    assert [backoff_delay(a, 0.1, 1.0, jitter=0.999999) for a in range(6)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0], rel=1e-5
    )
    assert backoff_delay(2, 0.1, 1.0, jitter=0.0) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("8M", 8 << 20), ("8MiB", 8 << 20), ("512k", 512 << 10), ("1.5G", 3 << 29)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "8X", "-1", "eight"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="streams"):
        HdfsFuseConfig(streams=0).validate()
    with pytest.raises(ValueError, match="memory"):
        HdfsFuseConfig(stripe_size=1 << 20, memory=1000).validate()


MOUNTINFO = (
    "22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "42 27 0:39 / /tmp/mnt\\040a ro,nosuid,nodev,relatime - fuse.hdfs-fuse bootseer ro,user_id=0\n"
    "43 42 0:40 / /tmp/mnt\\040a rw - tmpfs tmpfs rw\n"
)


def test_mountinfo_parses_escapes_and_prefers_the_top_mount() -> None:
    mounts = mountinfo.parse(MOUNTINFO)
    assert [m.mountpoint for m in mounts] == ["/", "/tmp/mnt a", "/tmp/mnt a"]
    top = mountinfo.find(MOUNTINFO, "/tmp/mnt a")
    assert top is not None and top.fstype == "tmpfs" and top.bdi == "0:40"
    assert mountinfo.find(MOUNTINFO, "/nowhere") is None
