"""The startup benchmark's arithmetic: one run's timeline from its marks,
medians per mode, the limit and the ratios. Pure, so it has unit tests."""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from bench.fusewait import FuseWait

# The training-start script's marks, in order; each ends the segment named here.
SCRIPT_SEGMENTS = (
    ("interpreter", "container start + interpreter"),
    ("import_torch", "import torch"),
    ("build_model", "build model"),
    ("load_shard", "load config + shard"),
)
READY_SEGMENT = "first forward + ready"
PHASE_LINE = re.compile(r"^PHASE (\w+) ([0-9.]+)$")
READY_LINE = re.compile(r"^READY .*read_bytes=(\d+)")


@dataclass(frozen=True)
class Segment:
    label: str
    start: float  # seconds since the pull began
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class ScriptOutput:
    """What the training-start script printed: phase marks (epoch seconds) and READY."""

    marks: dict[str, float] = field(default_factory=dict)
    read_bytes: int | None = None

    def feed(self, line: str) -> bool:
        """Take one output line; True once it was the READY line."""
        line = line.strip()
        if m := PHASE_LINE.match(line):
            self.marks[m.group(1)] = float(m.group(2))
        elif m := READY_LINE.match(line):
            self.read_bytes = int(m.group(1))
            return True
        return False


@dataclass
class Run:
    mode: str
    ready_s: float
    bytes_fetched: int
    segments: list[Segment]
    read_bytes: int | None = None
    # Counter deltas from the layer server for this run (lazy modes).
    layer_server: dict[str, float] = field(default_factory=dict)
    # CPU seconds by role over the run (bench/cpu.py), and the cores the
    # whole machine kept busy on average.
    cpu_s: dict[str, float] = field(default_factory=dict)
    busy_cores: float | None = None
    # The container's FUSE requests and how long they kept it waiting
    # (bench/fusewait.py), where the kernel can tell.
    fuse_wait: FuseWait | None = None


def timeline(
    t0: float,
    pull: list[Segment],
    pull_end: float,
    ready_at: float,
    script: ScriptOutput,
) -> list[Segment]:
    """Pull segments, then the container's: each script mark closes one segment.

    `t0`, `pull_end` and `ready_at` are epoch seconds, as the marks are;
    `pull` segments are already relative to `t0`.
    """
    segments = list(pull)
    previous = pull_end
    for mark, label in SCRIPT_SEGMENTS:
        at = script.marks.get(mark)
        if at is None:
            raise ValueError(f"the script printed no {mark!r} mark: {sorted(script.marks)}")
        segments.append(Segment(label, previous - t0, at - t0))
        previous = at
    segments.append(Segment(READY_SEGMENT, previous - t0, ready_at - t0))
    return segments


def fetch_end(samples: list[tuple[float, int]], until: float) -> float:
    """When the link went quiet for good before `until`: the last time its
    byte counter grew. `samples` are (time, cumulative bytes), oldest first."""
    last_growth = samples[0][0] if samples else 0.0
    for (_, before), (at, after) in itertools.pairwise(samples):
        if at > until:
            break
        if after > before:
            last_growth = at
    return min(last_growth, until)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarise(runs: list[Run]) -> dict[str, object]:
    """Medians of one mode's runs, and its median breakdown by segment."""
    labels: list[str] = []
    for run in runs:
        labels += [s.label for s in run.segments if s.label not in labels]
    breakdown = {
        label: round(
            _median([sum(s.seconds for s in r.segments if s.label == label) for r in runs]),
            3,
        )
        for label in labels
    }
    out: dict[str, object] = {
        "median_s": round(_median([r.ready_s for r in runs]), 3),
        "runs_s": [round(r.ready_s, 3) for r in runs],
        "bytes_fetched": int(_median([r.bytes_fetched for r in runs])),
        "breakdown_s": breakdown,
    }
    read = [r.read_bytes for r in runs if r.read_bytes is not None]
    if read:
        out["start_read_bytes"] = int(_median([float(x) for x in read]))
    keys = sorted({k for r in runs for k in r.layer_server})
    if keys:
        out["layer_server"] = {k: round(_median([r.layer_server.get(k, 0.0) for r in runs]), 3) for k in keys}
    roles = sorted({k for r in runs for k in r.cpu_s})
    if roles:
        out["cpu_s"] = {k: round(_median([r.cpu_s.get(k, 0.0) for r in runs]), 2) for k in roles}
    busy = [r.busy_cores for r in runs if r.busy_cores is not None]
    if busy:
        out["busy_cores"] = round(_median(busy), 2)
    waits = [r.fuse_wait for r in runs if r.fuse_wait is not None]
    if waits:
        opcodes = sorted({op for w in waits for op in w.by_opcode_s})
        out["fuse_wait"] = {
            "requests": int(_median([w.requests for w in waits])),
            "outstanding_s": round(_median([w.outstanding_s for w in waits]), 3),
            "latency_sum_s": round(_median([w.latency_sum_s for w in waits]), 3),
            "slow_requests": int(_median([w.slow_requests for w in waits])),
            "slow_sum_s": round(_median([w.slow_sum_s for w in waits]), 3),
            "by_opcode_s": {op: round(_median([w.by_opcode_s.get(op, 0.0) for w in waits]), 3) for op in opcodes},
        }
    return out


# The benchmark's stand-ins for the network (the registry, the link's delay
# proxy) run on the measured machine; on a node, their CPU is another's.
OFF_NODE_ROLES = ("registry", "link_proxy")


def cpu_floor_s(cpu_s: Mapping[str, float], cpus: int, exclude: Iterable[str] = ()) -> float:
    """The shortest a start could take on `cpus` cores, given the CPU
    seconds its processes (`cpu_s`, by role, less those in `exclude`)
    used: every core busy from its first moment to its last."""
    skip = set(exclude)
    return sum(seconds for role, seconds in cpu_s.items() if role not in skip) / cpus


def limit_s(warm_s: float, hot_bytes: int, bytes_per_s: float) -> float:
    """The additive limit: warm start plus moving what it reads (an upper
    bound of the best, as the two can overlap; see `strict_limit_s`)."""
    return warm_s + hot_bytes / bytes_per_s


def strict_limit_s(warm_s: float, hot_bytes: int, bytes_per_s: float) -> float:
    """The strict limit: no start beats a warm start, nor moving the bytes it
    truly reads over the link; the two can overlap, so the larger of them."""
    return max(warm_s, hot_bytes / bytes_per_s)


def ratios(
    medians: dict[str, float],
    bytes_fetched: dict[str, int],
    limit: float | None,
    strict_limit: float | None,
) -> dict[str, float | None]:
    """Every ratio the startup benchmark reports, from each mode's median
    time and bytes over the link; None where a mode was not run."""

    def t(mode: str) -> float | None:
        return medians.get(mode)

    def b(mode: str) -> float | None:
        value = bytes_fetched.get(mode)
        return None if value is None else float(value)

    return {
        "lazy_vs_overlayfs": ratio(t("lazy"), t("overlayfs")),
        "prefetch_vs_overlayfs": ratio(t("prefetch"), t("overlayfs")),
        "prefetch_vs_limit": ratio(t("prefetch"), limit),
        "lazy_vs_limit": ratio(t("lazy"), limit),
        "overlayfs_vs_limit": ratio(t("overlayfs"), limit),
        "warm_vs_overlayfs": ratio(t("warm"), t("overlayfs")),
        "prefetch_vs_strict_limit": ratio(t("prefetch"), strict_limit),
        "lazy_vs_strict_limit": ratio(t("lazy"), strict_limit),
        "stargz_optimized_vs_strict_limit": ratio(t("stargz-optimized"), strict_limit),
        "prefetch_vs_stargz_optimized": ratio(t("prefetch"), t("stargz-optimized")),
        "lazy_vs_stargz": ratio(t("lazy"), t("stargz")),
        "prefetch_vs_stargz": ratio(t("prefetch"), t("stargz")),
        # Bytes over the link: bootseer's best mode against stargz's.
        "bytes_vs_stargz_optimized": ratio(b("prefetch"), b("stargz-optimized")),
        "lazy_bytes_vs_stargz": ratio(b("lazy"), b("stargz")),
        "lazy_warm_vs_warm": ratio(t("lazy-warm"), t("warm")),
        "lazy_warm_fuse_vs_warm": ratio(t("lazy-warm-fuse"), t("warm")),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def waits_vs_warm(mode: dict[str, float], warm: dict[str, float]) -> dict[str, float]:
    """How much longer each container-side segment took than warm: the time
    spent waiting for bytes the warm start had on disk."""
    return {label: round(mode[label] - warm[label], 3) for label in mode if label in warm}
