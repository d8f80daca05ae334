"""The startup benchmark's arithmetic: marks to segments, medians, limit, ratios."""

from __future__ import annotations

import itertools

import pytest

from bench import timeline
from bench.fusewait import FuseWait
from bench.timeline import Run, ScriptOutput, Segment


def script(t0: float) -> ScriptOutput:
    out = ScriptOutput()
    for i, mark in enumerate(("interpreter", "import_torch", "build_model", "load_shard")):
        assert not out.feed(f"PHASE {mark} {t0 + 2 + i:.6f}\n")
    assert out.feed("READY params=1 shard_elements=2 read_bytes=4096\n")
    return out


def test_timeline_closes_one_segment_per_mark_after_the_pull() -> None:
    t0 = 1000.0
    segments = timeline.timeline(t0, [Segment("pull: fetch", 0, 1.5)], t0 + 1.5, t0 + 6.5, script(t0))
    assert [s.label for s in segments] == [
        "pull: fetch",
        "container start + interpreter",
        "import torch",
        "build model",
        "load config + shard",
        timeline.READY_SEGMENT,
    ]
    assert [round(s.seconds, 3) for s in segments] == [1.5, 0.5, 1.0, 1.0, 1.0, 1.5]
    # Contiguous: each segment starts where the previous ended.
    assert all(a.end == b.start for a, b in itertools.pairwise(segments))


def test_a_missing_mark_is_an_error_not_a_zero() -> None:
    out = ScriptOutput()
    out.feed("PHASE interpreter 1.0")
    with pytest.raises(ValueError, match="import_torch"):
        timeline.timeline(0.0, [], 0.5, 3.0, out)


def test_ready_line_carries_read_bytes() -> None:
    assert script(0.0).read_bytes == 4096


def test_fetch_end_is_the_last_growth_of_the_counter() -> None:
    samples = [(0.0, 0), (1.0, 100), (2.0, 250), (3.0, 250), (4.0, 250)]
    assert timeline.fetch_end(samples, until=4.0) == 2.0
    # Growth after `until` belongs to the next step.
    assert timeline.fetch_end([*samples, (5.0, 900)], until=4.5) == 2.0


def test_summarise_takes_medians_and_sums_repeated_labels() -> None:
    runs = [
        Run("lazy", r, 10 * r, [Segment("a", 0, r), Segment("b", r, 2 * r)], read_bytes=int(r), layer_server={"x": r})
        for r in (1.0, 3.0, 2.0)
    ]
    s = timeline.summarise(runs)
    assert s["median_s"] == 2.0
    assert s["bytes_fetched"] == 20
    assert s["breakdown_s"] == {"a": 2.0, "b": 2.0}
    assert s["layer_server"] == {"x": 2.0}
    assert s["start_read_bytes"] == 2
    # Runs measured without CPU accounting add nothing about it.
    assert "cpu_s" not in s and "busy_cores" not in s


def test_summarise_takes_the_median_cpu_of_each_role_and_of_the_busy_cores() -> None:
    runs = [
        Run("prefetch", r, 0, [], cpu_s={"layer_server": r, "registry": 2 * r}, busy_cores=r / 2)
        for r in (4.0, 3.0, 5.0)
    ]
    # A role one run lacks (a daemon that exited before its count) counts as 0 there.
    runs.append(Run("prefetch", 6.0, 0, [], cpu_s={"layer_server": 6.0}, busy_cores=1.9))
    s = timeline.summarise(runs)
    assert s["cpu_s"] == {"layer_server": 4.5, "registry": 7.0}
    assert s["busy_cores"] == 1.95


def test_summarise_takes_the_median_fuse_wait_of_the_runs_that_have_one() -> None:
    runs = [
        Run("prefetch", r, 0, [], fuse_wait=FuseWait(int(1000 * r), r / 4, r / 2, int(r), r / 8, {"READ": r / 3}))
        for r in (4.0, 2.0, 3.0)
    ]
    # A run the kernel could not trace (or whose trace overflowed) has none.
    runs.append(Run("prefetch", 9.0, 0, []))
    s = timeline.summarise(runs)
    assert s["fuse_wait"] == {
        "requests": 3000,
        "outstanding_s": 0.75,
        "latency_sum_s": 1.5,
        "slow_requests": 3,
        "slow_sum_s": 0.375,
        "by_opcode_s": {"READ": 1.0},
    }
    assert "fuse_wait" not in timeline.summarise([Run("warm", 1.0, 0, [])])


def test_limit_and_ratios() -> None:
    assert timeline.limit_s(4.0, 250_000_000, 125_000_000) == 6.0
    assert timeline.ratio(3.0, 12.0) == 0.25
    assert timeline.ratio(None, 12.0) is None
    assert timeline.ratio(3.0, None) is None


def test_waits_vs_warm_only_compares_shared_segments() -> None:
    lazy = {"pull: index + remote mounts": 1.0, "import torch": 9.0}
    warm = {"import torch": 3.5}
    assert timeline.waits_vs_warm(lazy, warm) == {"import torch": 5.5}


def test_strict_limit_is_the_larger_of_warm_and_moving_the_hot_bytes() -> None:
    # 250 MB over 1 Gbit/s takes 2 s: longer than a 1.5 s warm start...
    assert timeline.strict_limit_s(1.5, 250_000_000, 125_000_000) == 2.0
    # ...and shorter than a 3 s one: the two overlap, so the warm start bounds it.
    assert timeline.strict_limit_s(3.0, 250_000_000, 125_000_000) == 3.0


def test_ratios_against_the_peer_and_the_limits() -> None:
    medians = {"prefetch": 3.0, "lazy": 4.0, "stargz": 8.0, "stargz-optimized": 6.0, "warm": 2.0, "lazy-warm": 2.2}
    fetched = {"prefetch": 150, "stargz-optimized": 300, "lazy": 200, "stargz": 400}
    r = timeline.ratios(medians, fetched, limit=4.0, strict_limit=2.5)
    assert r["prefetch_vs_stargz_optimized"] == 0.5
    assert r["lazy_vs_stargz"] == 0.5
    assert r["prefetch_vs_strict_limit"] == 1.2
    assert r["prefetch_vs_limit"] == 0.75
    assert r["bytes_vs_stargz_optimized"] == 0.5
    assert r["lazy_warm_vs_warm"] == 1.1
    # A mode not run leaves its ratios empty, not zero.
    assert r["lazy_vs_overlayfs"] is None
    assert timeline.ratios({}, {}, None, None)["prefetch_vs_strict_limit"] is None


def test_the_cpu_floor_spreads_every_process_cpu_over_the_cores() -> None:
    cpu_s = {"layer_server": 3.5, "containers": 2.3, "registry": 0.8, "link_proxy": 0.5, "snapshotter": 0.5}
    assert timeline.cpu_floor_s(cpu_s, 2) == 3.8
    # The registry and the delay proxy stand in for the network: on a node their CPU is not the node's.
    assert timeline.cpu_floor_s(cpu_s, 2, timeline.OFF_NODE_ROLES) == 3.15
