"""The scale benchmark's arithmetic: /proc counters, a round's figures,
summaries per mode and N, the ratios and their targets, what bounded a round."""

from __future__ import annotations

import pytest

from bench import scalemath
from bench.scalemath import DIRECT, MIRROR, SLICE_CACHE, CpuTimes, NodeStart, Round

PROC_STAT = """cpu  100 5 50 800 40 3 2 0 7 0
cpu0 50 2 25 400 20 1 1 0 3 0
cpu1 50 3 25 400 20 2 1 0 4 0
intr 12345
"""


def a_round(ready: list[float | None], registry_bytes: int = 1000, busy: float = 1.0, **kw: object) -> Round:
    fields: dict[str, object] = {
        "mode": "lazy",
        "nodes": len(ready),
        "route": DIRECT,
        "run": 0,
        "starts": [NodeStart(ready_s=r) for r in ready],
        "registry_bytes": registry_bytes,
        "manifests_pushed": 0,
        "wall_s": 10.0,
        "machine_busy_cores": busy,
        **kw,
    }
    return Round(**fields)  # type: ignore[arg-type]


def test_proc_stat_counts_iowait_as_idle_and_leaves_guest_time_out() -> None:
    times = scalemath.parse_proc_stat(PROC_STAT)
    # user..steal only: guest (7) is already inside user.
    assert times == CpuTimes(total=100 + 5 + 50 + 800 + 40 + 3 + 2 + 0, idle=840, iowait=40)


def test_proc_stat_without_the_aggregate_line_is_an_error() -> None:
    with pytest.raises(ValueError, match="cpu line"):
        scalemath.parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n")


def test_pid_stat_sums_own_and_reaped_children_time_whatever_the_command_name() -> None:
    # A command name with spaces and a ')' must not shift the fields.
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "10", "0", "0", "0", "7", "3", "2", "1", "20", "0"]
    line = "4242 (odd) name) " + " ".join(fields) + " 1 0 100\n"
    assert scalemath.parse_pid_stat_ticks(line) == 7 + 3 + 2 + 1


def test_busy_cores_scale_the_busy_share_by_the_cpu_count() -> None:
    before = CpuTimes(total=1000, idle=800, iowait=10)
    after = CpuTimes(total=2000, idle=1300, iowait=110)
    busy, iowait = scalemath.busy_cores(before, after, cpus=2)
    assert busy == pytest.approx(1.0) and iowait == pytest.approx(0.2)
    assert scalemath.busy_cores(after, after, cpus=2) == (0.0, 0.0)


def test_a_round_reports_median_and_max_and_a_failed_node_voids_the_max() -> None:
    r = a_round([3.0, 1.0, 2.0, 10.0])
    assert r.median_ready_s == 2.5 and r.max_ready_s == 10.0 and r.failed == 0
    failed = a_round([3.0, None, 2.0])
    # The job never starts if one node never gets ready: no maximum to report.
    assert failed.failed == 1 and failed.max_ready_s is None and failed.median_ready_s == 2.5


def test_bound_by_prefers_the_link_then_the_cpu() -> None:
    assert scalemath.bound_by(0.9, 1.0) == "link"
    assert scalemath.bound_by(0.2, 0.95) == "cpu"
    assert scalemath.bound_by(0.2, 0.5) == "neither"
    assert scalemath.link_utilisation(500, 2.0, 500.0) == 0.5
    assert scalemath.link_utilisation(500, 0.0, 500.0) == 0.0


def test_summarise_takes_the_median_over_runs_of_each_runs_figures() -> None:
    rounds = [
        a_round([1.0, 4.0], registry_bytes=100, busy=1.0, cpu_s={"containers": 4.0}),
        a_round([2.0, 6.0], registry_bytes=300, busy=2.0, cpu_s={"containers": 6.0, "mirror": 1.0}),
        a_round([3.0, 5.0], registry_bytes=200, busy=1.5, cpu_s={"containers": 5.0}),
    ]
    s = scalemath.summarise(rounds, cpus=2, link_bytes_per_s=10.0)
    assert s["median_ready_s"] == 4.0  # the median of the runs' medians 2.5, 4.0 and 4.0
    assert s["max_ready_s"] == 5.0 and s["registry_bytes"] == 200 and s["runs"] == 3
    # A role a run lacks counts as 0 in that run.
    assert s["cpu_s"] == {"containers": 5.0, "mirror": 0.0}
    assert s["machine_busy_cores"] == 1.5
    assert s["link_utilisation"] == 4.0 and s["bound_by"] == "link"
    with pytest.raises(ValueError):
        scalemath.summarise([], cpus=2, link_bytes_per_s=1.0)


def table() -> dict[str, dict[str, dict[int, dict[str, object]]]]:
    return {
        "overlayfs": {
            DIRECT: {1: {"registry_bytes": 1000, "max_ready_s": 10.0}, 8: {"max_ready_s": 80.0}},
            MIRROR: {8: {"registry_bytes": 2000}},
        },
        "prefetch": {
            DIRECT: {1: {"registry_bytes": 400, "max_ready_s": 5.0}, 8: {"max_ready_s": 16.0}},
            MIRROR: {8: {"registry_bytes": 440}},
            SLICE_CACHE: {8: {"registry_bytes": 420}},
        },
        "lazy": {
            DIRECT: {1: {"registry_bytes": 0}},
            MIRROR: {8: {"registry_bytes": 50}},
            SLICE_CACHE: {8: {"registry_bytes": 60}},
        },
    }


def test_mirror_ratio_is_per_mode_against_one_node_without_the_mirror() -> None:
    ratios = scalemath.mirror_bytes_ratios(table(), largest=8)
    # lazy's one-node figure is 0 bytes: no ratio rather than a division by zero.
    assert ratios == {"overlayfs": 2.0, "prefetch": 1.1, "lazy": None}
    assert scalemath.mirror_bytes_ratios(table(), largest=4) == {"overlayfs": None, "prefetch": None, "lazy": None}
    # The same against another cache's route; modes that did not take it have none.
    assert scalemath.mirror_bytes_ratios(table(), 8, SLICE_CACHE) == {"overlayfs": None, "prefetch": 1.05, "lazy": None}


def test_prefetch_ratio_compares_maxima_at_the_largest_n() -> None:
    assert scalemath.prefetch_vs_overlayfs(table(), DIRECT, 8) == 0.2
    assert scalemath.prefetch_vs_overlayfs(table(), MIRROR, 8) is None


def test_headline_is_the_deployed_mode_first() -> None:
    assert scalemath.headline_mode(["overlayfs", "lazy", "prefetch"]) == "prefetch"
    assert scalemath.headline_mode(["overlayfs", "lazy"]) == "lazy"
    assert scalemath.headline_mode([]) is None


def test_targets_say_met_missed_or_not_measured() -> None:
    checked = scalemath.check_targets({"mirror_registry_bytes_vs_one_node": 1.1, "prefetch_max_vs_overlayfs_max": None})
    assert checked["mirror_registry_bytes_vs_one_node"] == {"target": 1.2, "measured": 1.1, "met": True}
    assert checked["prefetch_max_vs_overlayfs_max"]["met"] is None
    assert (
        scalemath.check_targets({"mirror_registry_bytes_vs_one_node": 1.3})["mirror_registry_bytes_vs_one_node"]["met"]
        is False
    )
