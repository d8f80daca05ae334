"""The jobstart benchmark's arithmetic: one run's phases from the job's
marks, medians per mode, the limit and the ratios. Pure, so it has unit tests."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

PHASE_LINE = re.compile(r"^PHASE (\w+) ([0-9.]+)$")
STEP_LINE = re.compile(r"^STEP .*head_sha256=([0-9a-f]+)")
# The job's marks, in order; each ends the phase named beside it.
MARKS = (
    ("container", "container start"),
    ("deps", "dependencies"),
    ("imports", "imports"),
    ("torch", "import torch"),
    ("model", "build model"),
    ("checkpoint", "checkpoint"),
    ("step", "first step"),
)
MODES = ("baseline", "bootseer-first", "bootseer-fresh-node", "warm")
PULL = "pull"
PHASES = (PULL, *(label for _, label in MARKS))


@dataclass(frozen=True)
class JobOutput:
    marks: dict[str, float]
    head_sha256: str


def parse_output(text: str) -> JobOutput:
    """The job's PHASE marks and the STEP line's digest; raises ValueError
    when a mark or the STEP line is missing (the job did not get there)."""
    marks: dict[str, float] = {}
    digest = ""
    for raw in text.splitlines():
        line = raw.strip()
        if found := PHASE_LINE.match(line):
            marks[found.group(1)] = float(found.group(2))
        elif found := STEP_LINE.match(line):
            digest = found.group(1)
    missing = [name for name, _ in MARKS if name not in marks]
    if missing or not digest:
        raise ValueError(f"the job's output lacks {', '.join(missing) or 'its STEP line'}")
    return JobOutput(marks, digest)


def phases(t0: float, pull_end: float, output: JobOutput) -> dict[str, float]:
    """Seconds per phase, from the pull's start (`t0`) to the first step;
    they add up to the time to first step."""
    out = {PULL: pull_end - t0}
    previous = pull_end
    for name, label in MARKS:
        at = output.marks[name]
        out[label] = at - previous
        previous = at
    return out


@dataclass
class Run:
    mode: str
    first_step_s: float
    bytes_over_link: int
    phases: dict[str, float]
    report: dict[str, Any] = field(default_factory=dict)  # `bootseer report --json`, bootseer modes

    def to_json(self) -> dict[str, Any]:
        return {
            "first_step_s": round(self.first_step_s, 3),
            "bytes_over_link": self.bytes_over_link,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            **({"report": self.report} if self.report else {}),
        }


def summarise(runs: list[Run]) -> dict[str, Any]:
    """Medians of a mode's runs (the phases' medians each, so they need not
    add up to the median time exactly)."""
    return {
        "runs": len(runs),
        "median_s": round(statistics.median(r.first_step_s for r in runs), 3),
        "min_s": round(min(r.first_step_s for r in runs), 3),
        "max_s": round(max(r.first_step_s for r in runs), 3),
        "bytes_over_link": int(statistics.median(r.bytes_over_link for r in runs)),
        "phases": {p: round(statistics.median(r.phases[p] for r in runs), 3) for p in PHASES},
        "samples_s": [round(r.first_step_s, 3) for r in runs],
    }


def limit_s(warm_s: float, bytes_moved: float, bytes_per_s: float) -> float:
    """What a fresh node cannot beat: the start with everything local, plus
    the bytes it must move over the link at the link's rate."""
    return warm_s + bytes_moved / bytes_per_s


def ratios(medians: dict[str, float], limit: float | None) -> dict[str, float | None]:
    def ratio(a: str, b: str) -> float | None:
        return round(medians[a] / medians[b], 3) if a in medians and b in medians and medians[b] else None

    fresh = medians.get("bootseer-fresh-node")
    return {
        "fresh_node_vs_baseline": ratio("bootseer-fresh-node", "baseline"),
        "fresh_node_vs_limit": round(fresh / limit, 3) if fresh and limit else None,
        "first_vs_baseline": ratio("bootseer-first", "baseline"),
        "fresh_node_vs_warm": ratio("bootseer-fresh-node", "warm"),
        "warm_vs_baseline": ratio("warm", "baseline"),
    }


def round_order(modes: list[str], number: int) -> list[str]:
    """Round `number`'s modes: the independent ones rotated round by round,
    so drift in the machine's load hits every mode alike, and the first
    start right before the fresh node's, which starts where it left off."""
    independent: list[str] = [m for m in ("baseline", "warm") if m in modes]
    shift = number % max(1, len(independent))
    order = independent[shift:] + independent[:shift]
    at = number % (len(order) + 1)
    pair: list[str] = [m for m in ("bootseer-first", "bootseer-fresh-node") if m in modes]
    return order[:at] + pair + order[at:]
