"""`bootseer report [CONTAINER|IMAGE]`: where a job's start went, and
`bootseer report --mark NAME`, a job's ready mark.

The command reads the daemons' event records (`eventlog`), asks containerd
about the containers, and lays each start out with `eventlog.startreport`
(the window, its segments and what they mean are described there); this
module holds only that I/O and the table, JSON and plot it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import eventlog
from bootseer.config import Config
from bootseer.options import CommandError, add_common_arguments, configure_events, load_config
from eventlog.startreport import PRIORITY, PULL_WINDOW_S, SCHEMA, Container, StartReport, build, node_summary
from snapshotter.registry.reference import InvalidReference, parse

CTR_TIMEOUT_S = 30.0


# -- containerd ----------------------------------------------------------------


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
    try:
        return str(parse(ref))
    except InvalidReference:
        return ref


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
        prefetched = (
            f"; {_bytes(c['prefetched_bytes'])} prefetched by {c['prefetches']} prefetches" if c["prefetches"] else ""
        )
        lines.append(
            f"  checkpoint: {c['files']} files, {_bytes(c['served_bytes'])} in {c['seconds']:.3f} s "
            f"({_bytes(c['bytes_per_s'])}/s){prefetched}"
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
    reports = [
        build(c, records, args.ready, args.pull_window, same_image) for c in sorted(containers, key=lambda c: c.created)
    ]
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
