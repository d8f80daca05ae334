"""The scale benchmark's arithmetic: one round's figures from its nodes'
times to ready, CPU accounting from /proc counters, rounds summarised per
mode and N, the ratios against their targets and what bounded a round.
Pure (no processes, no clock), so it has unit tests (tests/bench/test_scale_math.py)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TARGETS = {
    "mirror_registry_bytes_vs_one_node": 1.2,
    "prefetch_max_vs_overlayfs_max": 0.25,
}
# Routes: every node to the registry; through distribution's pull-through
# cache (the mirror the targets are about); through a range-aware slice cache
# (an experiment, bench/slicecache.py).
DIRECT, MIRROR, SLICE_CACHE = "direct", "mirror", "slice-cache"
# A round whose registry link carried at least this share of its rate, over
# the job's whole wait (the slowest node's time to ready), was link-bound...
LINK_BOUND_UTILISATION = 0.6
# ...else one whose machine was at least this busy (share of all cores) was CPU-bound.
CPU_BOUND_BUSY = 0.85


@dataclass(frozen=True)
class CpuTimes:
    """/proc/stat's first line, in clock ticks: all of them, and the idle ones."""

    total: int
    idle: int  # idle + iowait: a core waiting on the disk does no work either
    iowait: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            # user nice system idle iowait irq softirq steal [guest guest_nice]:
            # guest time is already counted in user, so it is left out.
            ticks = [int(f) for f in fields[1:9]]
            return CpuTimes(total=sum(ticks), idle=ticks[3] + ticks[4], iowait=ticks[4])
    raise ValueError("no aggregate cpu line in /proc/stat")


def parse_pid_stat_ticks(text: str) -> int:
    """utime + stime of a /proc/PID/stat line, plus its waited-for children's
    (cutime + cstime): a daemon's helpers that already exited count too."""
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); utime..cstime are fields 14..17.
    return sum(int(v) for v in rest[11:15])


def busy_cores(before: CpuTimes, after: CpuTimes, cpus: int) -> tuple[float, float]:
    """Average cores busy, and in iowait, between two /proc/stat readings."""
    total = after.total - before.total
    if total <= 0:
        return 0.0, 0.0
    busy = total - (after.idle - before.idle)
    return busy / total * cpus, (after.iowait - before.iowait) / total * cpus


@dataclass
class NodeStart:
    """One node's start: pull, then the container up to its READY line."""

    ready_s: float | None  # None: it failed
    pull_s: float | None = None
    error: str = ""


@dataclass
class Round:
    """N nodes starting the image at once, in one mode, direct or through the mirror."""

    mode: str
    nodes: int
    route: str  # DIRECT or MIRROR
    run: int
    starts: list[NodeStart]
    registry_bytes: int  # out of the registry, over the shaped link
    manifests_pushed: int  # hot-block manifests uploaded to the registry during the round
    wall_s: float  # barrier to the last node's end
    cpu_s: dict[str, float] = field(default_factory=dict)  # by role
    machine_busy_cores: float = 0.0
    machine_iowait_cores: float = 0.0
    layer_server: dict[str, float] = field(default_factory=dict)  # summed over the nodes

    @property
    def ready(self) -> list[float]:
        return [s.ready_s for s in self.starts if s.ready_s is not None]

    @property
    def failed(self) -> int:
        return sum(s.ready_s is None for s in self.starts)

    @property
    def median_ready_s(self) -> float | None:
        return statistics.median(self.ready) if self.ready else None

    @property
    def max_ready_s(self) -> float | None:
        # The job waits for its slowest node, and a node that never got ready
        # means the job never started: no maximum.
        return max(self.ready) if self.ready and not self.failed else None


def link_utilisation(registry_bytes: int, seconds: float, link_bytes_per_s: float) -> float:
    """The share of the link's rate the round's registry bytes used over `seconds`."""
    if seconds <= 0 or link_bytes_per_s <= 0:
        return 0.0
    return registry_bytes / (seconds * link_bytes_per_s)


def bound_by(utilisation: float, busy_share: float) -> str:
    """What limited a round: "link" if the registry link was mostly full, else
    "cpu" if the machine's cores were, else "neither" (latency, or waits
    such as one node's slow step)."""
    if utilisation >= LINK_BOUND_UTILISATION:
        return "link"
    if busy_share >= CPU_BOUND_BUSY:
        return "cpu"
    return "neither"


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summarise(rounds: Sequence[Round], cpus: int, link_bytes_per_s: float) -> dict[str, object]:
    """The repeated rounds of one (mode, N, route): medians over the runs of
    each run's figures."""
    if not rounds:
        raise ValueError("no rounds to summarise")
    roles = sorted({role for r in rounds for role in r.cpu_s})
    max_ready = _median([r.max_ready_s for r in rounds])
    registry_bytes = int(statistics.median(r.registry_bytes for r in rounds))
    busy = statistics.median(r.machine_busy_cores for r in rounds)
    utilisation = link_utilisation(registry_bytes, max_ready or 0.0, link_bytes_per_s)
    return {
        "median_ready_s": _rounded(_median([r.median_ready_s for r in rounds])),
        "max_ready_s": _rounded(max_ready),
        "registry_bytes": registry_bytes,
        "manifests_pushed": max(r.manifests_pushed for r in rounds),
        "failed_nodes": sum(r.failed for r in rounds),
        "runs": len(rounds),
        "cpu_s": {role: round(statistics.median(r.cpu_s.get(role, 0.0) for r in rounds), 2) for role in roles},
        "machine_busy_cores": round(busy, 2),
        "machine_iowait_cores": round(statistics.median(r.machine_iowait_cores for r in rounds), 2),
        "link_utilisation": round(utilisation, 3),
        "bound_by": bound_by(utilisation, busy / cpus if cpus else 0.0),
    }


Table = Mapping[str, Mapping[str, Mapping[int, Mapping[str, object]]]]  # mode -> route -> N -> summary


def _figure(table: Table, mode: str, route: str, n: int, key: str) -> float | None:
    value = table.get(mode, {}).get(route, {}).get(n, {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def mirror_bytes_ratios(table: Table, largest: int, route: str = MIRROR) -> dict[str, float | None]:
    """Per mode: registry bytes out through the cache on `route` at the
    largest N over one node's registry bytes without a cache (the same mode)."""
    return {
        mode: _ratio(
            _figure(table, mode, route, largest, "registry_bytes"),
            _figure(table, mode, DIRECT, 1, "registry_bytes"),
        )
        for mode in table
    }


def prefetch_vs_overlayfs(table: Table, route: str, largest: int) -> float | None:
    """The prefetch mode's slowest node over overlayfs's, both at the largest N."""
    return _ratio(
        _figure(table, "prefetch", route, largest, "max_ready_s"),
        _figure(table, "overlayfs", route, largest, "max_ready_s"),
    )


def headline_mode(available: Sequence[str]) -> str | None:
    """Which mode's mirror ratio is the headline: prefetch, the mode bootseer
    is deployed in (what a registry behind a mirror really serves a fleet of
    bootseer nodes); else lazy, else overlayfs."""
    for mode in ("prefetch", "lazy", "overlayfs"):
        if mode in available:
            return mode
    return None


def check_targets(ratios: Mapping[str, float | None]) -> dict[str, dict[str, object]]:
    """Each target with what was measured and whether it held (None: not measured)."""
    checked: dict[str, dict[str, object]] = {}
    for key, target in TARGETS.items():
        measured = ratios.get(key)
        checked[key] = {"target": target, "measured": measured, "met": None if measured is None else measured <= target}
    return checked
