"""Where a job's start went, from the daemons' event records (`eventlog`):
the window of one container's start and its segments. Pure: records and
containerd's facts about the container in, a `StartReport` out, so that
`bootseer report` (which reads the records and asks containerd) and the
tests share one implementation.

The window runs from the pull of the container's image (the latest
`bootseer pull` of it that ended at most `pull_window` seconds before the
container was created; else the first remote Prepare of it in that window;
else the container's creation) to the container's `ready` mark. Every
instant of it goes to exactly one segment, the first of `PRIORITY` that
covers it, then `job` (anything else once the container exists: runtime
start, imports, the job's own work) or `scheduling` (before it exists). So
the segments add up to the window exactly, and the window's ends come from
records made by other processes (the pull, containerd, the mark).

How a record finds its container: by the container id in the cgroup of
the process that caused it (depsnap pod requests and marks through the
depsnap socket, hdfs-fuse opens), by the id it names (`--mark` on the
host), or by image (pulls and Prepares by image reference, layer-server
summaries by manifest digest). Two containers of one image running at the
same time share that image's layer-server summaries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA = 1
# The sum of the segments and the window agree to this (rounding only: the
# segments partition the window by construction).
TOLERANCE_S = 0.01
# A pull this long before the container's creation is not part of its start.
PULL_WINDOW_S = 600.0
# Layer-server summaries come every [events] summary_interval_s: one written
# this long after the ready mark still describes reads made before it.
SUMMARY_SLACK_S = 1.5

# Segment priority: the first that covers an instant gets it.
PRIORITY = (
    "pull: resolve",
    "pull: layers",
    "pull: finish",
    "prepare",
    "deps: restore",
    "deps: install",
    "checkpoint",
    "image fetch wait",
)

Record = dict[str, Any]
Interval = tuple[str, float, float]
# Whether two image references name one image (the CLI parses them).
SameImage = Callable[[str, str], bool]


@dataclass(frozen=True)
class Container:
    id: str
    image: str
    created: float


@dataclass
class Segment:
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class StartReport:
    container: str
    image: str
    manifests: list[str]
    start: float
    created: float
    end: float
    began_with: str  # "pull", "prepare" or "create"
    ready_mark: bool
    segments: list[Segment]
    layers: list[dict[str, Any]] = field(default_factory=list)
    fetch: dict[str, Any] = field(default_factory=dict)
    deps: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for seg in self.segments:
            out[seg.name] = out.get(seg.name, 0.0) + seg.seconds
        return out

    def to_json(self) -> dict[str, Any]:
        total = sum(s.seconds for s in self.segments)
        return {
            "container": self.container,
            "image": self.image,
            "manifests": self.manifests,
            "start": self.start,
            "created": self.created,
            "end": self.end,
            "began_with": self.began_with,
            "ready_mark": self.ready_mark,
            "wall_s": round(self.wall_s, 6),
            "segments": [
                {"name": s.name, "start": s.start, "end": s.end, "seconds": round(s.seconds, 6)} for s in self.segments
            ],
            "totals": {k: round(v, 6) for k, v in self.totals().items()},
            "consistency": {"sum_s": round(total, 6), "wall_s": round(self.wall_s, 6), "tolerance_s": TOLERANCE_S},
            "layers": self.layers,
            "fetch": self.fetch,
            "deps": self.deps,
            "checkpoint": self.checkpoint,
        }


def _in_cgroup(record: Record, container_id: str) -> bool:
    cgroup = record.get("cgroup")
    return isinstance(cgroup, str) and container_id in cgroup


def _interval(record: Record) -> tuple[float, float]:
    ts = float(record["ts"])
    return float(record.get("start", ts)), float(record.get("end", ts))


def partition(t0: float, t1: float, created: float, intervals: Iterable[Interval]) -> list[Segment]:
    """[t0, t1] cut into segments: each instant to the highest-priority
    interval covering it, else `job` (after `created`) or `scheduling`."""
    rank = {name: i for i, name in enumerate(PRIORITY)}
    clipped = [(n, max(a, t0), min(b, t1)) for n, a, b in intervals if min(b, t1) > max(a, t0)]
    points = sorted({t0, t1, *(p for _, a, b in clipped for p in (a, b)), *([created] if t0 < created < t1 else [])})
    segments: list[Segment] = []
    for a, b in itertools.pairwise(points):
        covering = [n for n, s, e in clipped if s <= a and e >= b]
        name = (
            min(covering, key=lambda n: rank.get(n, len(rank)))
            if covering
            else ("job" if a >= created else "scheduling")
        )
        if segments and segments[-1].name == name and segments[-1].end == a:
            segments[-1].end = b
        else:
            segments.append(Segment(name, a, b))
    return segments


def _tied(record: Record, container_id: str) -> bool:
    return record.get("container") == container_id or _in_cgroup(record, container_id)


@dataclass
class _Window:
    start: float
    end: float
    began_with: str
    ready: bool
    pull: Record | None
    prepares: list[Record]
    manifests: set[str]


def _window(
    container: Container, records: Sequence[Record], mark: str, pull_window: float, same_image: SameImage
) -> _Window:
    """Where the start begins (its pull, else its first Prepare, else the
    container's creation) and ends (its first `mark`, else its last record)."""
    cid, created = container.id, container.created
    pulls = [
        r
        for r in records
        if r["kind"] == "pull"
        and not r.get("error")
        and same_image(str(r.get("image", "")), container.image)
        and created - pull_window <= float(r["end"]) <= created + 1.0
    ]
    pull = max(pulls, key=lambda r: float(r["end"])) if pulls else None
    manifests = {str(pull["manifest"])} if pull else set()
    prepares = [
        r
        for r in records
        if r["kind"] == "prepare"
        and (same_image(str(r.get("image_ref", "")), container.image) or r.get("manifest") in manifests)
        and created - pull_window <= float(r["start"]) <= created + 1.0
        and (pull is None or float(r["start"]) >= float(pull["start"]) - 1.0)
    ]
    manifests |= {str(r["manifest"]) for r in prepares if r.get("manifest")}
    if pull is not None:
        start, began_with = float(pull["start"]), "pull"
    elif prepares:
        start, began_with = min(float(r["start"]) for r in prepares), "prepare"
    else:
        start, began_with = created, "create"
    marks = [
        r["ts"]
        for r in records
        if r["kind"] == "mark" and r.get("name") == mark and r["ts"] >= created and _tied(r, cid)
    ]
    if marks:
        end, ready = min(float(t) for t in marks), True
    else:
        # No mark (yet): up to the last record about the container.
        end, ready = max([created, *(r["ts"] for r in records if _tied(r, cid) and r["ts"] >= created)]), False
    return _Window(min(start, created), end, began_with, ready, pull, prepares, manifests)


def _pull_intervals(w: _Window, records: Sequence[Record]) -> list[Interval]:
    intervals: list[Interval] = []
    if w.pull is not None:
        pull = w.pull
        began = float(pull["start"])
        resolved = float(pull.get("resolved", began))
        last_layer = max((float(x["end"]) for x in pull.get("layers", [])), default=resolved)
        intervals += [
            ("pull: resolve", began, resolved),
            ("pull: layers", resolved, last_layer),
            ("pull: finish", last_layer, float(pull["end"])),
        ]
    elif w.prepares:
        targets = {r.get("target") for r in w.prepares}
        unpacks = [r for r in records if r["kind"] == "unpacked" and r.get("target") in targets]
        first = min(float(r["start"]) for r in w.prepares)
        last = max([float(r["end"]) for r in w.prepares] + [float(r["end"]) for r in unpacks])
        intervals.append(("prepare", first, last))
    return intervals


def _deps(records: Sequence[Record], cid: str) -> tuple[list[dict[str, Any]], list[Interval]]:
    """depsnap's part: a pod's attach (a hit restores; a miss installs in the
    pod until its capture) or a host `ensure`."""
    deps: list[dict[str, Any]] = []
    intervals: list[Interval] = []
    attaches = sorted((r for r in records if r["kind"] == "depsnap.pod" and _in_cgroup(r, cid)), key=_interval)
    for r in attaches:
        a, b = _interval(r)
        deps.append({"op": r["op"], "outcome": r["outcome"], "key": r["key"], "start": a, "end": b, "seconds": b - a})
        if r["op"] == "pod-attach" and r["outcome"] == "hit":
            intervals.append(("deps: restore", a, b))
        elif r["op"] == "pod-attach":
            capture = next(
                (c for c in attaches if c["op"] == "pod-capture" and c["key"] == r["key"] and _interval(c)[0] >= b),
                None,
            )
            intervals.append(("deps: install", a, _interval(capture)[1] if capture else b))
    for r in records:
        if r["kind"] == "depsnap.ensure" and _in_cgroup(r, cid):
            a, b = _interval(r)
            deps.append(
                {
                    "op": "ensure",
                    "outcome": r["status"],
                    "key": r["key"],
                    "start": a,
                    "end": b,
                    "seconds": b - a,
                    "detail": r.get("detail", ""),
                }
            )
            intervals.append(("deps: install" if r["status"] in ("miss", "failed") else "deps: restore", a, b))
    return deps, intervals


def _checkpoint(records: Sequence[Record], cid: str, w: _Window) -> tuple[dict[str, Any], list[Interval]]:
    """hdfs-fuse's part: the container's checkpoint files, first open to last
    close, and what it had prefetched. A prefetch runs beside the start, so it
    is no segment of its own: its worth shows as a shorter read."""
    files = [r for r in records if r["kind"] == "hdfs_fuse.file" and _in_cgroup(r, cid)]
    prefetches = [r for r in records if r["kind"] == "hdfs_fuse.prefetch" and _in_cgroup(r, cid)]
    if not files and not prefetches:
        return {}, []
    intervals: list[Interval] = [("checkpoint", *_interval(r)) for r in files]
    busy = sum(s.seconds for s in partition(w.start, w.end, w.start, intervals) if s.name == "checkpoint")
    served = sum(int(r.get("served_bytes", 0)) for r in files)
    return {
        "files": len(files),
        "served_bytes": served,
        "fetched_bytes": sum(int(r.get("fetched_bytes", 0)) for r in files),
        "seconds": round(busy, 6),
        "bytes_per_s": round(served / busy, 1) if busy > 0 else 0.0,
        "retries": sum(int(r.get("retries", 0)) for r in files),
        "prefetches": len(prefetches),
        "prefetched_bytes": sum(int(r.get("pushed_bytes", 0)) for r in prefetches),
    }, intervals


def _fetch(records: Sequence[Record], w: _Window) -> tuple[dict[str, Any], list[Interval]]:
    """The layer server's part: the image's reads over the window (deltas of
    its cumulative summaries) and the episodes its readers waited on the registry."""
    summaries = [r for r in records if r["kind"] == "fs.image" and r.get("image") in w.manifests]
    if not summaries:
        return {}, []
    before = [r for r in summaries if r["ts"] < w.start]
    upto = [r for r in summaries if r["ts"] <= w.end + SUMMARY_SLACK_S]
    base = max(before, key=lambda r: r["ts"]) if before else None
    final = max(upto, key=lambda r: r["ts"]) if upto else None
    fetch = _summary_delta(final, base) if final is not None and final is not base else {}
    waits: list[Interval] = [
        ("image fetch wait", float(a), float(b))
        for r in summaries
        if w.start <= r["ts"] <= w.end + SUMMARY_SLACK_S
        for a, b in r.get("episodes", [])
    ]
    return fetch, waits


def _layers(w: _Window) -> list[dict[str, Any]]:
    """Per layer: the path it took (lazy, normal, present) and why, from its
    Prepare and the pull's own account."""
    layers = [
        {
            "layer": r["layer"],
            "path": r["path"],
            "reason": r["reason"],
            "seconds": round(float(r["end"]) - float(r["start"]), 6),
            **({"error": r["error"]} if r.get("error") else {}),
        }
        for r in sorted(w.prepares, key=lambda r: float(r["start"]))
    ]
    if w.pull is not None:
        by_layer = {x["layer"]: x for x in layers}
        for x in w.pull.get("layers", []):
            entry = by_layer.get(x["layer"])
            how = {"remote": "lazy", "fetched": "normal", "present": "present"}.get(x["how"], x["how"])
            if entry is None:
                entry = {"layer": x["layer"], "path": how, "reason": "already present" if how == "present" else ""}
                layers.append(entry)
            entry.update(pull_seconds=round(float(x["end"]) - float(x["start"]), 6), fetched_bytes=x["bytes"])
    return layers


def build(
    container: Container, records: Sequence[Record], mark: str, pull_window: float, same_image: SameImage
) -> StartReport:
    """The start of `container`, from `records` (any order); `same_image`
    tells whether two image references name one image."""
    w = _window(container, records, mark, pull_window, same_image)
    deps, dep_intervals = _deps(records, container.id)
    checkpoint, checkpoint_intervals = _checkpoint(records, container.id, w)
    fetch, waits = _fetch(records, w)
    intervals = _pull_intervals(w, records) + dep_intervals + checkpoint_intervals + waits
    return StartReport(
        container=container.id,
        image=container.image,
        manifests=sorted(w.manifests),
        start=w.start,
        created=container.created,
        end=w.end,
        began_with=w.began_with,
        ready_mark=w.ready,
        segments=partition(w.start, w.end, container.created, intervals),
        layers=_layers(w),
        fetch=fetch,
        deps=deps,
        checkpoint=checkpoint,
    )


def _summary_delta(last: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """What the image's readers did between two cumulative summaries."""

    def d(key: str) -> float:
        return float(last.get(key, 0)) - float(base.get(key, 0) if base else 0)

    reads = {k: int(v) - int((base or {}).get("reads", {}).get(k, 0)) for k, v in last.get("reads", {}).items()}
    total = sum(reads.values())
    return {
        "reads": reads,
        "hit_ratio": round((reads.get("hit", 0) + reads.get("prefetched", 0)) / total, 4) if total else None,
        "waits": int(d("waits")),
        "wait_s": round(d("wait_s"), 6),
        "stalled_s": round(d("stalled_s"), 6),
        "fetched_bytes": int(d("fetched_bytes")),
        "prefetched_bytes": int(d("prefetched_bytes")),
        "prefetched_blocks": int(d("prefetched_blocks")),
    }


def node_summary(reports: Sequence[StartReport]) -> dict[str, Any]:
    """What the starts cost the node, summed."""
    totals: dict[str, float] = {}
    for rep in reports:
        for name, seconds in rep.totals().items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {
        "containers": len(reports),
        "ready_marks": sum(1 for r in reports if r.ready_mark),
        "wall_s": round(sum(r.wall_s for r in reports), 6),
        "totals": {k: round(v, 6) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "fetch_wait_s": round(sum(float(r.fetch.get("stalled_s", 0)) for r in reports), 6),
        "fetched_bytes": sum(int(r.fetch.get("fetched_bytes", 0)) for r in reports),
        "checkpoint_bytes": sum(int(r.checkpoint.get("served_bytes", 0)) for r in reports),
    }


# -- output ----------------------------------------------------------------------
