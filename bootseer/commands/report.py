"""`bootseer report [CONTAINER|IMAGE]`: where a job's start went, from the
daemons' own event records (`eventlog`), joined to containerd's record of
the container; and `bootseer report --mark NAME`, a job's ready mark.

The window runs from the pull of the container's image (the latest
`bootseer pull` of it that ended at most `--pull-window` seconds before the
container was created; else the first remote Prepare of it in that window;
else the container's creation) to the container's `ready` mark. Every
instant of it goes to exactly one segment, the first of these that covers
it: the pull's phases (resolve, layers, finish), the Prepares of a pull
made by containerd itself, dependency restore or install (depsnap),
checkpoint reads (hdfs-fuse), waits of the image's readers on the
registry (the layer server), then `job` (anything else once the
container exists: runtime start, imports, the job's own work) or
`scheduling` (before it exists). So the segments add up to the window
exactly, and the window's ends come from records made by other processes
(the pull, containerd, the mark): the check the tests make.

How a record finds its container: by the container id in the cgroup of
the process that caused it (depsnap pod requests and marks through the
depsnap socket, hdfs-fuse opens), by the id it names (`--mark` on the
host), or by image (pulls and Prepares by image reference, layer-server
summaries by manifest digest). Two containers of one image running at the
same time share that image's layer-server summaries.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import eventlog
from bootseer.config import Config
from bootseer.options import CommandError, add_common_arguments, load_config

SCHEMA = 1
# The sum of the segments and the window agree to this (rounding only: the
# segments partition the window by construction).
TOLERANCE_S = 0.01
# A pull this long before the container's creation is not part of its start.
PULL_WINDOW_S = 600.0
# Layer-server summaries come every [events] summary_interval_s: one written
# this long after the ready mark still describes reads made before it.
SUMMARY_SLACK_S = 1.5
CTR_TIMEOUT_S = 30.0

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


def configure_events(cfg: Config, name: str) -> None:
    """The event log of this process, from the config's [events] section:
    what each composition root calls before it serves."""
    events = cfg.events
    eventlog.configure(events.dir, name, events.max_bytes, events.summary_interval_s)


# -- containerd ----------------------------------------------------------------


@dataclass(frozen=True)
class Container:
    id: str
    image: str
    created: float


class Ctr:
    """containerd's record of containers, through `ctr`."""

    def __init__(self, address: Path, namespace: str) -> None:
        self.base = ["ctr", "--address", str(address), "--namespace", namespace]

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [*self.base, *args], capture_output=True, text=True, timeout=CTR_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CommandError(f"cannot ask containerd through ctr: {exc}") from None

    def info(self, container_id: str) -> Container | None:
        result = self._run("containers", "info", container_id)
        if result.returncode != 0:
            return None
        doc = json.loads(result.stdout)
        return Container(doc["ID"], doc.get("Image", ""), parse_time(doc["CreatedAt"]))

    def ids(self) -> list[str]:
        result = self._run("containers", "list", "--quiet")
        if result.returncode != 0:
            raise CommandError(f"ctr containers list: {result.stderr.strip()}")
        return result.stdout.split()


def parse_time(text: str) -> float:
    """containerd's RFC 3339 times, nanoseconds and all."""
    main, _, rest = text.partition(".")
    if rest:
        digits = "".join(c for c in rest if c.isdigit())
        zone = rest[len(digits) :]
        text = f"{main}.{digits[:6]}{zone}"
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def same_image(a: str, b: str) -> bool:
    return bool(a) and bool(b) and _normal(a) == _normal(b)


def _normal(ref: str) -> str:
    from snapshotter.registry.reference import InvalidReference, parse

    try:
        return str(parse(ref))
    except InvalidReference:
        return ref


# -- the report ----------------------------------------------------------------


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


def _in_cgroup(record: dict[str, Any], container_id: str) -> bool:
    cgroup = record.get("cgroup")
    return isinstance(cgroup, str) and container_id in cgroup


def _interval(record: dict[str, Any]) -> tuple[float, float]:
    return float(record.get("start", record["ts"])), float(record.get("end", record["ts"]))


def partition(t0: float, t1: float, created: float, intervals: Iterable[tuple[str, float, float]]) -> list[Segment]:
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


def build(container: Container, records: Sequence[dict[str, Any]], mark: str, pull_window: float) -> StartReport:
    cid, created = container.id, container.created
    marks = [
        r
        for r in records
        if r["kind"] == "mark"
        and r.get("name") == mark
        and r["ts"] >= created
        and (r.get("container") == cid or _in_cgroup(r, cid))
    ]
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
    start = min(start, created)
    if marks:
        end, ready = min(float(r["ts"]) for r in marks), True
    else:
        # No mark (yet): up to the last record about the container.
        tied = [r["ts"] for r in records if (_in_cgroup(r, cid) or r.get("container") == cid) and r["ts"] >= created]
        end, ready = max([created, *tied]), False

    intervals: list[tuple[str, float, float]] = []
    if pull is not None:
        layer_ends = [float(x["end"]) for x in pull.get("layers", [])]
        resolved = float(pull.get("resolved", pull["start"]))
        last_layer = max(layer_ends, default=resolved)
        intervals += [
            ("pull: resolve", float(pull["start"]), resolved),
            ("pull: layers", resolved, last_layer),
            ("pull: finish", last_layer, float(pull["end"])),
        ]
    targets = {r.get("target") for r in prepares}
    unpacks = [r for r in records if r["kind"] == "unpacked" and r.get("target") in targets]
    if prepares and pull is None:
        first = min(float(r["start"]) for r in prepares)
        last = max([float(r["end"]) for r in prepares] + [float(r["end"]) for r in unpacks])
        intervals.append(("prepare", first, last))

    deps: list[dict[str, Any]] = []
    attaches = sorted((r for r in records if r["kind"] == "depsnap.pod" and _in_cgroup(r, cid)), key=_interval)
    for r in attaches:
        a, b = _interval(r)
        deps.append({"op": r["op"], "outcome": r["outcome"], "key": r["key"], "start": a, "end": b, "seconds": b - a})
        if r["op"] == "pod-attach" and r["outcome"] == "hit":
            intervals.append(("deps: restore", a, b))
        elif r["op"] == "pod-attach":
            # The install runs in the pod from the miss to the capture that follows it.
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

    files = [r for r in records if r["kind"] == "hdfs_fuse.file" and _in_cgroup(r, cid)]
    checkpoint: dict[str, Any] = {}
    if files:
        for r in files:
            intervals.append(("checkpoint", *_interval(r)))
        spans = partition(start, end, start, [("checkpoint", *_interval(r)) for r in files])
        busy = sum(s.seconds for s in spans if s.name == "checkpoint")
        served = sum(int(r.get("served_bytes", 0)) for r in files)
        checkpoint = {
            "files": len(files),
            "served_bytes": served,
            "fetched_bytes": sum(int(r.get("fetched_bytes", 0)) for r in files),
            "seconds": round(busy, 6),
            "bytes_per_s": round(served / busy, 1) if busy > 0 else 0.0,
            "retries": sum(int(r.get("retries", 0)) for r in files),
        }

    fetch: dict[str, Any] = {}
    summaries = [r for r in records if r["kind"] == "fs.image" and r.get("image") in manifests]
    if summaries:
        before = [r for r in summaries if r["ts"] < start]
        upto = [r for r in summaries if r["ts"] <= end + SUMMARY_SLACK_S]
        base = max(before, key=lambda r: r["ts"]) if before else None
        final = max(upto, key=lambda r: r["ts"]) if upto else None
        if final is not None and final is not base:
            fetch = _summary_delta(final, base)
        for r in summaries:
            if start <= r["ts"] <= end + SUMMARY_SLACK_S:
                for a, b in r.get("episodes", []):
                    intervals.append(("image fetch wait", float(a), float(b)))

    layers = [
        {
            "layer": r["layer"],
            "path": r["path"],
            "reason": r["reason"],
            "seconds": round(float(r["end"]) - float(r["start"]), 6),
            **({"error": r["error"]} if r.get("error") else {}),
        }
        for r in sorted(prepares, key=lambda r: float(r["start"]))
    ]
    if pull is not None:
        by_layer = {x["layer"]: x for x in layers}
        for x in pull.get("layers", []):
            entry = by_layer.get(x["layer"])
            how = {"remote": "lazy", "fetched": "normal", "present": "present"}.get(x["how"], x["how"])
            if entry is None:
                entry = {"layer": x["layer"], "path": how, "reason": "already present" if how == "present" else ""}
                layers.append(entry)
            entry.update(pull_seconds=round(float(x["end"]) - float(x["start"]), 6), fetched_bytes=x["bytes"])
    return StartReport(
        container=cid,
        image=container.image,
        manifests=sorted(manifests),
        start=start,
        created=created,
        end=end,
        began_with=began_with,
        ready_mark=ready,
        segments=partition(start, end, created, intervals),
        layers=layers,
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


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def table(rep: StartReport) -> str:
    lines = [f"container {rep.container}  image {rep.image}"]
    if rep.manifests:
        lines.append(f"  manifest {', '.join(rep.manifests)}")
    ending = "ready mark" if rep.ready_mark else "last record (no ready mark)"
    lines.append(f"  from {rep.began_with} at {_clock(rep.start)} to {ending} at {_clock(rep.end)}: {rep.wall_s:.3f} s")
    lines.append(f"  {'segment':<22}{'seconds':>10}{'share':>9}")
    wall = rep.wall_s or 1.0
    for name, seconds in rep.totals().items():
        lines.append(f"  {name:<22}{seconds:>10.3f}{100 * seconds / wall:>8.1f}%")
    lines.append(f"  {'total':<22}{sum(rep.totals().values()):>10.3f}{100.0 if rep.wall_s else 0:>8.1f}%")
    if rep.layers:
        lazy = sum(1 for x in rep.layers if x["path"] == "lazy")
        lines.append(f"  layers: {len(rep.layers)} ({lazy} lazy, {len(rep.layers) - lazy} other)")
        for x in rep.layers:
            took = x.get("seconds", x.get("pull_seconds", 0.0))
            lines.append(f"    {x['layer'][:19]}  {x['path']:<8}{x['reason']:<20}{took:>8.3f} s")
    if rep.fetch:
        f = rep.fetch
        reads = ", ".join(f"{k} {v}" for k, v in f["reads"].items())
        ratio = "n/a" if f["hit_ratio"] is None else f"{f['hit_ratio']:.2f}"
        lines.append(
            f"  image reads: hit ratio {ratio} ({reads}); {f['waits']} waits, {f['stalled_s']:.3f} s stalled; "
            f"fetched {_bytes(f['fetched_bytes'])}, prefetched {_bytes(f['prefetched_bytes'])} "
            f"({f['prefetched_blocks']} blocks)"
        )
    for dep in rep.deps:
        lines.append(f"  dependencies: {dep['op']} {dep['outcome']} {dep['key'][:12]} in {dep['seconds']:.3f} s")
    if rep.checkpoint:
        c = rep.checkpoint
        lines.append(
            f"  checkpoint: {c['files']} files, {_bytes(c['served_bytes'])} in {c['seconds']:.3f} s "
            f"({_bytes(c['bytes_per_s'])}/s)"
        )
    return "\n".join(lines)


def node_table(summary: dict[str, Any]) -> str:
    lines = [
        f"node: {summary['containers']} starts ({summary['ready_marks']} with a ready mark), "
        f"{summary['wall_s']:.3f} s of startup in all"
    ]
    for name, seconds in summary["totals"].items():
        lines.append(f"  {name:<22}{seconds:>10.3f}")
    return "\n".join(lines)


def plot(reports: Sequence[StartReport], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError(
            "--plot needs matplotlib, which is the optional extra `bench`: pip install 'bootseer[bench]'"
        ) from None
    names = list(dict.fromkeys([*PRIORITY, "job", "scheduling", *(s.name for r in reports for s in r.segments)]))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(reports)))
    used: set[str] = set()
    for row, rep in enumerate(reports):
        for seg in rep.segments:
            label = seg.name if seg.name not in used else None
            used.add(seg.name)
            ax.barh(row, seg.seconds, left=seg.start - rep.start, color=colours[seg.name], label=label)
    ax.set_yticks(range(len(reports)), [r.container[:24] for r in reports])
    ax.set_xlabel("seconds from the start of each container's start")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the command -------------------------------------------------------------------


def _records(directory: Path) -> list[dict[str, Any]]:
    return sorted(eventlog.read(directory), key=lambda r: float(r["ts"]))


def _mark(args: argparse.Namespace, cfg: Config) -> int:
    configure_events(cfg, "mark")
    if not eventlog.enabled():
        raise CommandError("[events] max_bytes is 0: the event records are off")
    fields: dict[str, Any] = {"name": args.mark}
    if args.target:
        container = Ctr(args.address, args.namespace).info(args.target)
        fields["container" if container is not None else "image"] = args.target
    fields["cgroup"] = eventlog.cgroup_of(os.getppid())
    eventlog.emit("mark", **fields)
    return 0


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if args.mark:
        return _mark(args, cfg)
    directory = args.events_dir or cfg.events.dir
    ctr = Ctr(args.address, args.namespace)
    containers: list[Container] = []
    if args.target and not args.all:
        found = ctr.info(args.target)
        if found is not None:
            containers = [found]
        else:
            containers = [c for i in ctr.ids() if (c := ctr.info(i)) is not None and same_image(c.image, args.target)]
            if not containers:
                raise CommandError(f"no container {args.target!r}, and no container of an image {args.target!r}")
    else:
        containers = [c for i in ctr.ids() if (c := ctr.info(i)) is not None]
    records = _records(directory)
    reports = [build(c, records, args.ready, args.pull_window) for c in sorted(containers, key=lambda c: c.created)]
    if args.plot:
        plot(reports, args.plot)
    several = len(reports) != 1 or args.all or not args.target
    if args.json:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "events_dir": str(directory),
            "containers": [r.to_json() for r in reports],
        }
        if several:
            doc["node"] = node_summary(reports)
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        print("\n\n".join(table(r) for r in reports) or f"no containers in namespace {args.namespace}")
        if several and reports:
            print()
            print(node_table(node_summary(reports)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "report",
        help="where a container's start went, from the daemons' event records",
        description=(
            "Lay a container's start end to end, from the pull of its image to its ready mark: "
            "pull and prepare per layer (lazy or normal, and why), waits on the registry, prefetch and hit "
            "ratio, dependency restore or install, checkpoint reads. With no CONTAINER (or --all), every "
            "container of the namespace and their sum. With --mark NAME, write a mark instead (a job's "
            "'ready' before its first step; from inside a pod: the depsnap socket's 'mark' request, see "
            "docs/report.md)."
        ),
    )
    add_common_arguments(parser)
    parser.add_argument("target", nargs="?", metavar="CONTAINER|IMAGE", help="a container id, or an image reference")
    parser.add_argument("--all", action="store_true", help="every container of the namespace, and their sum")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (schema in docs/report.md)")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a timeline PNG (needs matplotlib)")
    parser.add_argument("--mark", metavar="NAME", help="record mark NAME (e.g. ready) for CONTAINER|IMAGE, now")
    parser.add_argument("--ready", default="ready", help="the mark that ends a start (default: ready)")
    parser.add_argument("--events-dir", type=Path, help="the event records' directory (default: [events] dir)")
    parser.add_argument(
        "--pull-window",
        type=float,
        default=PULL_WINDOW_S,
        help=f"a pull at most this many seconds before the container's creation is part of its start "
        f"(default {PULL_WINDOW_S:g})",
    )
    parser.add_argument(
        "--address",
        type=Path,
        default=Path(os.environ.get("CONTAINERD_ADDRESS", "/run/containerd/containerd.sock")),
        help="containerd's socket (default $CONTAINERD_ADDRESS or /run/containerd/containerd.sock)",
    )
    parser.add_argument(
        "--namespace", "-n", default=os.environ.get("CONTAINERD_NAMESPACE", "default"), help="containerd namespace"
    )
    parser.set_defaults(func=_run)
