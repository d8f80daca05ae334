"""Time to ready of a training container from a realistic image over a shaped
link, for every pull mode, against stargz-snapshotter and the limits. Run:
`make bench-startup` (`--quick` for a short run: small image, one link, one
run per mode; `--modes`, `--link`, `--runs` to pick).

- image: bench/image.py, `--image full` (Python, torch, numpy, weights, a
  long tail; `quick` is a small one) or `--image tabular` (Python, pandas,
  pyarrow, scikit-learn, scipy, parquet shards, a tail), pushed once to a
  docker-registry in a network namespace of the benchmark's own;
- link: bench/link.py (tc htb on the namespace's veth + a delay-line proxy);
- modes, interleaved round by round, caches dropped before each run:
  `overlayfs` (containerd's default: `ctr images pull`, then `ctr run`),
  `lazy` (`bootseer pull`, then `ctr run --snapshotter bootseer`), and
  `warm` (image already unpacked locally). Cold modes get a fresh node
  (layer server, snapshotter, containerd) every run, hot blocks off.
- `prefetch`: the same with hot blocks on; before the runs, one recording run
  on its own fresh node publishes the image's hot-block manifest.
- `stargz`, `stargz-optimized`: the peer (bench/stargz.py), the image
  converted by `ctr-remote` to eStargz and to optimised eStargz, pulled by
  `ctr-remote image rpull` on a fresh node running stargz's daemon with its
  defaults, then `ctr run --snapshotter stargz`.
- `lazy-warm`: every block of the image in the layer server's cache (one
  node, set up once over the unshaped veth with `[fs] background_fetch` on,
  primed by one start and then left until every layer is fetched whole and
  unpacked onto local disk, fs/unpack.py): a restart on a node that holds the
  image, whose mounts then take the local copies;
- `lazy-warm-fuse`: the blocks the start reads in the cache and nothing
  else (one node, primed by one start, unpacking off): the start run through
  the layer mount, the FUSE cost of a warm start, with the FUSE requests it
  made by opcode (`layer_server.fuse_requests.*`).
- time to ready: from the pull's start to the script's READY line.
- limits: the additive one, warm time + the compressed bytes of the blocks
  the start reads (the hot-block manifest) / link rate; the strict one,
  max(warm time, the compressed bytes the start truly reads / link rate),
  those bytes measured page by page (bench/hotbytes.py); next to them, the
  same count for one start through the layer mount (`layer_mount_read_bytes`:
  what the kernel reads from it, read-around included, which is what a
  hot-block recording sees).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import cpu, fusewait, hotbytes, image, link, report, stargz, timeline
from bench.node import Node, start_node
from bench.report import log
from bench.timeline import Run, ScriptOutput, Segment
from snapshotter.fs.layers import LayerStore, layer_name
from tests.harness.containerd import CTR_BIN, Containerd
from tests.harness.oci import ImageLayout, push
from tests.harness.procs import wait_until
from tests.harness.tree import drop_page_cache

NAME = "startup"
REPOSITORY = "bench/train"
TARGETS = {
    "lazy_vs_overlayfs": 0.40,
    "prefetch_vs_overlayfs": 0.15,
    "prefetch_vs_limit": 1.25,
    # issue 16
    "lazy_vs_stargz": 0.6,
    "prefetch_vs_strict_limit": 1.25,
    "bytes_vs_stargz_optimized": 1.0,
    "lazy_warm_vs_warm": 1.15,
}
# Targets that differ by link: the slower link leaves less to win.
LINK_TARGETS = {
    "1gbit-2ms": {"prefetch_vs_stargz_optimized": 0.5},
    "200mbit-20ms": {"prefetch_vs_stargz_optimized": 0.7},
}
# Bounds a hung pull or container, not a slow one: 1.2 GB at 200 Mbit/s is ~50 s.
STEP_TIMEOUT = 900.0
SAMPLE_EVERY_S = 0.02
LAYER_SERVER_METRICS = (
    "bootseer_fs_fetched_bytes_total",
    "bootseer_fs_fetched_blocks_total",
    "bootseer_fs_fetch_seconds_count",
    "bootseer_fs_fetch_seconds_sum",
    "bootseer_fs_read_bytes_total",
)
WORKDIR = Path("/var/tmp/bootseer-bench")


class RxSampler:
    """Samples the link's received-bytes counter, for the pull's fetch/unpack split
    and the throughput track of the plot."""

    def __init__(self, netns: link.Netns) -> None:
        self.netns = netns
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rx-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.netns.rx_bytes()))
            self._stop.wait(SAMPLE_EVERY_S)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time(), self.netns.rx_bytes()))

    @property
    def received(self) -> int:
        return self.samples[-1][1] - self.samples[0][1]


@dataclass
class Nodes:
    """The long-lived nodes and artefacts, shared by every link."""

    warm: Node
    direct_ref: str  # through the veth, unshaped by the proxy: what the warm node pulled
    registry_pid: int  # the image's registry, for CPU accounting
    lazy_warm: Node | None = None  # lazily pulled, every block cached, layers unpacked
    lazy_warm_fuse: Node | None = None  # lazily pulled, the blocks the start reads cached
    stargz_binary: Path | None = None


@dataclass
class Setup:
    """Everything a timed run needs for the current link."""

    netns: link.Netns
    proxy: link.DelayProxy
    nodes: Nodes
    # Whether the kernel's FUSE tracepoints time each run's requests (bench/fusewait.py).
    fuse_trace: bool = False

    @property
    def warm(self) -> Node:
        return self.nodes.warm

    @property
    def ref(self) -> str:
        return self.ref_for("v1")

    def ref_for(self, tag: str) -> str:
        return f"{self.proxy.host}/{REPOSITORY}:{tag}"


AnyNode = Node | stargz.StargzNode


@dataclass
class RunContext:
    setup: Setup
    node: AnyNode
    sampler: RxSampler
    t0: float
    ref: str
    notes: dict[str, object] = field(default_factory=dict)


def _pull_overlayfs(ctx: RunContext) -> list[Segment]:
    ctx.node.containerd.ctr(
        "images",
        "pull",
        "--plain-http",
        "--snapshotter",
        "overlayfs",
        ctx.ref,
        timeout=STEP_TIMEOUT,
    )
    end = time.time()
    quiet = timeline.fetch_end(ctx.sampler.samples, end)
    return [
        Segment("pull: fetch", 0.0, quiet - ctx.t0),
        Segment("pull: unpack", quiet - ctx.t0, end - ctx.t0),
    ]


def _pull_lazy(ctx: RunContext) -> list[Segment]:
    assert isinstance(ctx.node, Node)
    out = subprocess.run(
        ctx.node.pull_command(ctx.ref),
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
        check=False,
    )
    end = time.time()
    counts = re.search(r"\((\d+) remote, (\d+) fetched", out.stdout)
    if out.returncode != 0 or counts is None or int(counts.group(1)) == 0:
        raise RuntimeError(f"bootseer pull did not pull lazily ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    ctx.notes["remote_layers"] = int(counts.group(1))
    ctx.notes["fetched_layers"] = int(counts.group(2))
    return [Segment("pull: index + remote mounts", 0.0, end - ctx.t0)]


def _pull_stargz(ctx: RunContext) -> list[Segment]:
    """`ctr-remote image rpull`: manifest, config, each layer's TOC, FUSE mounts
    (and, with stargz's defaults, the prefetch of an optimised layer's
    landmarked region before its mount returns)."""
    assert isinstance(ctx.node, stargz.StargzNode)
    out = subprocess.run(
        ctx.node.rpull_command(ctx.ref),
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
        check=False,
    )
    end = time.time()
    if out.returncode != 0:
        raise RuntimeError(f"ctr-remote image rpull failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return [Segment("pull: rpull (TOCs + FUSE mounts)", 0.0, end - ctx.t0)]


def _pull_nothing(ctx: RunContext) -> list[Segment]:
    return []


FRESH, STARGZ, WARM, LAZY_WARM, LAZY_WARM_FUSE = "fresh", "stargz", "warm", "lazy-warm", "lazy-warm-fuse"


@dataclass(frozen=True)
class Mode:
    name: str
    # Which node runs it: FRESH and STARGZ are new every run and pull over the
    # link; WARM and the LAZY_WARM ones are long-lived, with nothing to pull.
    node: str
    snapshotter: str
    pull: Callable[[RunContext], list[Segment]]
    # Hot blocks on (the layer server prefetches the published manifest);
    # off for `lazy`, so it measures on-demand fetching alone.
    hot_blocks: bool = False
    tag: str = "v1"  # which image: the gzip original or a stargz conversion

    @property
    def cold(self) -> bool:
        return self.node in (FRESH, STARGZ)


MODES = {
    m.name: m
    for m in (
        Mode("overlayfs", FRESH, "overlayfs", _pull_overlayfs),
        Mode("lazy", FRESH, "bootseer", _pull_lazy),
        Mode("prefetch", FRESH, "bootseer", _pull_lazy, hot_blocks=True),
        Mode("stargz", STARGZ, stargz.SNAPSHOTTER, _pull_stargz, tag=stargz.ESTARGZ_TAG),
        Mode("stargz-optimized", STARGZ, stargz.SNAPSHOTTER, _pull_stargz, tag=stargz.OPTIMIZED_TAG),
        Mode("warm", WARM, "overlayfs", _pull_nothing),
        Mode("lazy-warm", LAZY_WARM, "bootseer", _pull_nothing),
        Mode("lazy-warm-fuse", LAZY_WARM_FUSE, "bootseer", _pull_nothing),
    )
}


def run_container(c: Containerd, snapshotter: str, ref: str, container_id: str) -> tuple[float, ScriptOutput]:
    """`ctr run` the image's entry point; when its READY line came, and what it printed."""
    argv = [
        CTR_BIN,
        "--address",
        str(c.address),
        "--namespace",
        c.namespace,
        "run",
        "--rm",
        "--snapshotter",
        snapshotter,
        ref,
        container_id,
    ]
    script = ScriptOutput()
    ready_at = 0.0
    lines: list[str] = []
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    timer = threading.Timer(STEP_TIMEOUT, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if script.feed(line):
                ready_at = time.time()
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode != 0 or not ready_at:
        raise RuntimeError(f"`{' '.join(argv)}` exited {proc.returncode} without READY:\n{''.join(lines[-30:])}")
    return ready_at, script


_FUSE_REQUESTS = re.compile(r'^bootseer_fs_fuse_requests_total\{opcode="(\w+)"\} (\S+)$', re.MULTILINE)
_FUSE_ANSWERED_NOW = re.compile(r'^bootseer_fs_fuse_requests_answered_now_total\{opcode="\w+"\} (\S+)$', re.MULTILINE)


def _layer_server_metrics(node: AnyNode) -> dict[str, float]:
    """LAYER_SERVER_METRICS, and the FUSE requests the kernel sent by opcode
    (`fuse_requests.<opcode>`, with their sum as `fuse_requests`, and as
    `fuse_answered_now` those answered in the session's read loop, without
    a task): what a warm start through the layer mount costs besides the
    reads' bytes."""
    if not isinstance(node, Node):
        return {}
    values = {name: node.layers.metric(name) for name in LAYER_SERVER_METRICS}
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{node.layers.config.metrics_port}/metrics", timeout=10)
    text = scrape.read().decode()
    requests = {f"fuse_requests.{op}": float(n) for op, n in _FUSE_REQUESTS.findall(text)}
    now = sum(float(n) for n in _FUSE_ANSWERED_NOW.findall(text))
    return {**values, **requests, "fuse_requests": sum(requests.values()), "fuse_answered_now": now}


def _node_for(setup: Setup, mode: Mode) -> AnyNode:
    if mode.node == FRESH:
        return start_node([setup.proxy.host], mode.hot_blocks)
    if mode.node == STARGZ:
        assert setup.nodes.stargz_binary is not None
        return stargz.start_node(setup.nodes.stargz_binary)
    if mode.node == LAZY_WARM:
        assert setup.nodes.lazy_warm is not None
        return setup.nodes.lazy_warm
    if mode.node == LAZY_WARM_FUSE:
        assert setup.nodes.lazy_warm_fuse is not None
        return setup.nodes.lazy_warm_fuse
    return setup.warm


def _cpu_roles(setup: Setup, node: AnyNode) -> dict[str, list[int]]:
    """The processes a start keeps busy, by role, besides its containers and
    the clients (`bootseer pull`, `ctr`, `ctr-remote`) this process runs."""
    daemons = (
        node.daemon_pids()
        if isinstance(node, Node)
        else {"containerd": node.containerd.daemon.pid, "stargz": node.daemon.pid}
    )
    return {
        **{role: [pid] for role, pid in daemons.items()},
        "registry": [setup.nodes.registry_pid],
        "link_proxy": [setup.proxy.daemon.pid],
    }


def timed_run(setup: Setup, mode: Mode, number: int) -> Run:
    node = _node_for(setup, mode)
    ref = setup.ref_for(mode.tag) if mode.cold else setup.nodes.direct_ref
    roles = _cpu_roles(setup, node)
    # Modes on overlayfs make no FUSE request.
    traced = setup.fuse_trace and mode.snapshotter != "overlayfs"
    trace = fusewait.FuseTrace(f"bootseer-bench-{os.getpid()}") if traced else None
    try:
        # Counter deltas: the long-lived lazy-warm node has counted earlier runs.
        before = _layer_server_metrics(node)
        drop_page_cache()
        cpu_before = cpu.snapshot(roles, node.containerd.namespace)
        with RxSampler(setup.netns) as sampler:
            ctx = RunContext(setup, node, sampler, time.time(), ref)
            pull = mode.pull(ctx)
            pull_end = time.time()
            # The container's requests: from the pull's end to its ready line.
            requests: list[str] = []
            if trace is not None:
                trace.start()
            try:
                ready_at, script = run_container(node.containerd, mode.snapshotter, ref, f"{mode.name}-{number}")
            finally:
                if trace is not None:
                    requests = trace.stop()
        cpu_s, busy, _ = cpu.delta(cpu_before, cpu.snapshot(roles, node.containerd.namespace))
        metrics = {k: v - before.get(k, 0.0) for k, v in _layer_server_metrics(node).items()}
        fuse_wait = None
        if trace is not None:
            if trace.lost:
                log("warning: the FUSE trace buffer overflowed; no FUSE wait figure for this run")
            else:
                fuse_wait = fusewait.summarise(fusewait.parse(requests))
    finally:
        if mode.cold:
            leftovers = node.teardown()
            if leftovers:
                log(f"warning: mounts left behind: {leftovers}")
    return Run(
        mode=mode.name,
        ready_s=ready_at - ctx.t0,
        bytes_fetched=sampler.received,
        segments=timeline.timeline(ctx.t0, pull, pull_end, ready_at, script),
        read_bytes=script.read_bytes,
        layer_server=metrics,
        cpu_s=cpu_s,
        busy_cores=busy,
        fuse_wait=fuse_wait,
    )


def _record_hot_blocks(setup: Setup) -> int:
    """The image's first run anywhere: a fresh node records the blocks the
    start reads and publishes the manifest the `prefetch` runs then use.
    Returns the manifest's bytes (compressed, as fetched)."""
    node = start_node([setup.proxy.host], hot_blocks=True)
    try:
        ctx = RunContext(setup, node, RxSampler(setup.netns), time.time(), setup.ref)
        _pull_lazy(ctx)
        run_container(node.containerd, "bootseer", setup.ref, "record")
        show = node.command("record", "show", setup.ref)
        deadline = time.monotonic() + STEP_TIMEOUT
        # `record show` fails until the recording settles and publishes the manifest.
        while (shown := subprocess.run(show, capture_output=True, text=True, check=False)).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the recording run published no hot-block manifest")
            time.sleep(0.5)
        log(f"hot-block manifest published: {shown.stdout.splitlines()[0]}")
        found = re.search(r"hot blocks, (\d+) bytes", shown.stdout)
        if found is None:
            raise RuntimeError(f"`bootseer record show` printed no manifest size:\n{shown.stdout}")
        return int(found.group(1))
    finally:
        node.teardown()


def _calibrate(
    netns: link.Netns, upstream: str, spec: link.LinkSpec, blob_path: str, shaper: str
) -> tuple[link.DelayProxy, dict[str, object]]:
    """Measure both shapers on this link; leave the chosen one in place."""
    results = {}
    for kind in ("proxy", "tc"):
        if kind == "tc":
            netns.shape(spec.rate_mbit)
        else:
            netns.unshape()
        proxy = link.start_proxy(
            upstream,
            spec.rtt_ms,
            spec.rate_mbit if kind == "proxy" else 0.0,
            WORKDIR / f"proxy-{kind}.log",
        )
        try:
            results[kind] = link.calibrate(kind, proxy.host, blob_path, spec)
        finally:
            proxy.stop()
    if shaper == "proxy":
        netns.unshape()
    chosen = link.start_proxy(
        upstream,
        spec.rtt_ms,
        spec.rate_mbit if shaper == "proxy" else 0.0,
        WORKDIR / "proxy.log",
    )
    return chosen, {k: c.describe(spec) for k, c in results.items()}


def run_link(
    netns: link.Netns,
    nodes: Nodes,
    spec: link.LinkSpec,
    built: image.BuiltImage,
    modes: list[Mode],
    runs: int,
    shaper: str,
    strict_hot: hotbytes.HotBytes | None,
) -> tuple[dict[str, object], dict[str, Run]]:
    upstream = f"{netns.ns_addr}:{link.REGISTRY_PORT}"
    biggest = max(zip(built.layout.layer_sizes, built.layout.layer_digests, strict=True))[1]
    proxy, calibration = _calibrate(netns, upstream, spec, f"/v2/{REPOSITORY}/blobs/{biggest}", shaper)
    traced = fusewait.FuseTrace.available()
    if not traced:
        log("this kernel has no FUSE request tracepoints: runs get no FUSE wait figure")
    setup = Setup(netns, proxy, nodes, fuse_trace=traced)
    by_mode: dict[str, list[Run]] = {m.name: [] for m in modes}
    manifest_bytes = None
    try:
        if any(m.hot_blocks for m in modes):
            manifest_bytes = _record_hot_blocks(setup)
        for i in range(runs):
            # Rotate the order each round, so drift in the machine's load hits every mode alike.
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                run = timed_run(setup, mode, i)
                by_mode[mode.name].append(run)
                wait = run.fuse_wait
                waited = "" if wait is None else f", FUSE wait {wait.outstanding_s:.2f} s ({wait.requests} requests)"
                log(
                    f"{spec.name} round {i + 1}/{runs} {mode.name:16} ready in {run.ready_s:6.2f} s, "
                    f"{run.bytes_fetched / 1e6:8.1f} MB over the link, {run.busy_cores:.2f} cores busy, "
                    f"CPU s {' '.join(f'{role} {s:.2f}' for role, s in run.cpu_s.items())}{waited}"
                )
    finally:
        proxy.stop()
        netns.unshape()
    summary = {name: timeline.summarise(rs) for name, rs in by_mode.items()}
    representative = {name: sorted(rs, key=lambda r: r.ready_s)[len(rs) // 2] for name, rs in by_mode.items()}
    results = _link_results(spec, shaper, calibration, summary, manifest_bytes, strict_hot)
    return results, representative


def _link_results(
    spec: link.LinkSpec,
    shaper: str,
    calibration: dict[str, object],
    summary: dict[str, dict],
    manifest_bytes: int | None = None,
    strict_hot: hotbytes.HotBytes | None = None,
) -> dict[str, object]:
    hot_bytes, hot_source = _hot_bytes(summary, manifest_bytes)
    limit = strict = None
    if "warm" in summary and hot_bytes:
        limit = round(
            timeline.limit_s(summary["warm"]["median_s"], hot_bytes, spec.bytes_per_s),
            3,
        )
    if "warm" in summary and strict_hot is not None:
        strict = round(
            timeline.strict_limit_s(summary["warm"]["median_s"], strict_hot.compressed_bytes, spec.bytes_per_s), 3
        )
    ratios = timeline.ratios(
        {name: s["median_s"] for name, s in summary.items()},
        {name: s["bytes_fetched"] for name, s in summary.items()},
        limit,
        strict,
    )
    targets = {**TARGETS, **LINK_TARGETS.get(spec.name, {})}
    modes: dict[str, object] = dict(summary)
    if "warm" in summary:
        warm = summary["warm"]["breakdown_s"]
        for name, mode_summary in summary.items():
            if name != "warm":
                mode_summary["excess_over_warm_s"] = timeline.waits_vs_warm(mode_summary["breakdown_s"], warm)
    cpus = os.cpu_count() or 1
    for mode_summary in summary.values():
        if "cpu_s" in mode_summary:
            mode_summary["cpu_floor_s"] = round(timeline.cpu_floor_s(mode_summary["cpu_s"], cpus), 2)
            mode_summary["node_cpu_floor_s"] = round(
                timeline.cpu_floor_s(mode_summary["cpu_s"], cpus, timeline.OFF_NODE_ROLES), 2
            )
    return {
        "link": {
            "name": spec.name,
            "rate_mbit": spec.rate_mbit,
            "rtt_ms": spec.rtt_ms,
            "shaper": shaper,
            "calibration": calibration,
        },
        "modes": modes,
        "limit_s": limit,
        "hot_bytes": hot_bytes,
        "limit_definition": f"warm median + hot_bytes ({hot_source}) / configured link rate",
        "strict_limit_s": strict,
        "strict_hot_bytes": None if strict_hot is None else strict_hot.compressed_bytes,
        "strict_hot_uncompressed_bytes": None if strict_hot is None else strict_hot.uncompressed_bytes,
        "strict_limit_definition": (
            "max(warm median, strict_hot_bytes / configured link rate); strict_hot_bytes: the compressed "
            "bytes encoding the pages the warm start read (page cache after one run from disk with the "
            "disk's read-ahead off, mapped through each layer's gzip stream; bench/hotbytes.py)"
        ),
        "ratios": ratios,
        "targets": {
            k: {"target": v, "measured": ratios[k], "met": None if ratios[k] is None else ratios[k] <= v}
            for k, v in targets.items()
        },
        "closing_note": _closing_note(ratios, summary, targets),
    }


def _hot_bytes(summary: dict[str, dict], manifest_bytes: int | None) -> tuple[int | None, str]:
    """What the start needs over the link: the compressed blocks its reads
    touch, which is what the recording run's hot-block manifest holds. Without
    one, the lazy run's fetched bytes (which include read-ahead and small
    layers fetched whole: an overstatement), else the warm start's disk reads
    (uncompressed: an upper bound)."""
    if manifest_bytes:
        return manifest_bytes, "compressed bytes of the blocks the recording run read (its hot-block manifest)"
    lazy = summary.get("lazy", {}).get("layer_server", {}).get("bootseer_fs_fetched_bytes_total")
    if lazy:
        return (
            int(lazy),
            "compressed bytes the lazy start fetched (read-ahead and whole small layers included)",
        )
    warm = summary.get("warm", {}).get("start_read_bytes")
    return (
        warm,
        "uncompressed bytes the warm start read from disk (/proc/self/io read_bytes)",
    )


def _closing_note(ratios: dict[str, float | None], summary: dict[str, dict], targets: dict[str, float]) -> list[str]:
    notes = []
    for key, target in targets.items():
        measured = ratios[key]
        mode = key.split("_vs_")[0].replace("_", "-")
        if mode == "bytes":
            mode = "prefetch"
        if measured is None or mode not in summary:
            notes.append(f"{key}: not measured ({mode} not run)")
            continue
        if measured <= target:
            notes.append(f"{key} = {measured} meets the target {target}")
            continue
        s = summary[mode]
        excess = s.get("excess_over_warm_s", {})
        pull = {k: v for k, v in s["breakdown_s"].items() if k.startswith("pull")}
        worst = max(excess.items(), key=lambda kv: kv[1], default=("?", 0.0))
        ls = s.get("layer_server", {})
        fetch = (
            f"; layer server: {ls.get('bootseer_fs_fetched_bytes_total', 0) / 1e6:.0f} MB fetched in "
            f"{ls.get('bootseer_fs_fetch_seconds_count', 0):.0f} range requests, "
            f"{ls.get('bootseer_fs_fetch_seconds_sum', 0):.1f} s of summed request time"
            if ls
            else ""
        )
        floor = (
            f"; its processes' CPU alone needs {s['cpu_floor_s']:.2f} s with every core busy throughout "
            f"({s['node_cpu_floor_s']:.2f} s without the registry's and the link proxy's)"
            if "cpu_floor_s" in s
            else ""
        )
        fw = s.get("fuse_wait")
        waited = (
            f"; the container had a FUSE request outstanding for {fw['outstanding_s']:.2f} s "
            f"({fw['requests']} requests, {fw['slow_requests']} of them over {fusewait.SLOW_S * 1e3:g} ms "
            f"for {fw['slow_sum_s']:.2f} s)"
            if fw
            else ""
        )
        notes.append(
            f"{key} = {measured} misses the target {target}: pull {sum(pull.values()):.2f} s {pull}; "
            f"the segment furthest above warm is '{worst[0]}' (+{worst[1]:.2f} s){fetch}{floor}{waited}"
        )
    return notes


COLORS = {
    "pull: fetch": "#1f77b4",
    "pull: unpack": "#aec7e8",
    "pull: index + remote mounts": "#17becf",
    "pull: rpull (TOCs + FUSE mounts)": "#bcbd22",
    "container start + interpreter": "#ff7f0e",
    "import torch": "#d62728",
    "build model": "#9467bd",
    "load config + shard": "#8c564b",
    timeline.READY_SEGMENT: "#2ca02c",
}


def plot(
    per_link: dict[str, dict[str, object]],
    representative: dict[str, dict[str, Run]],
    path: Path,
) -> None:
    rows = max(len(r) for r in representative.values())
    fig, axes = plt.subplots(len(per_link), 1, figsize=(11, 1.6 + (0.3 * rows + 0.8) * len(per_link)), squeeze=False)
    for ax, (name, results) in zip(axes[:, 0], per_link.items(), strict=True):
        runs = representative[name]
        order = [m for m in MODES if m in runs]
        for row, mode in enumerate(order):
            for seg in runs[mode].segments:
                ax.broken_barh(
                    [(seg.start, seg.seconds)],
                    (row - 0.35, 0.7),
                    color=COLORS.get(seg.label, "grey"),
                    label=seg.label,
                )
            ax.text(
                runs[mode].ready_s,
                row,
                f" {runs[mode].ready_s:.1f} s",
                va="center",
                fontsize=8,
            )
        for key, style, what in (("limit_s", "--", "additive limit"), ("strict_limit_s", ":", "strict limit")):
            value = results.get(key)
            if isinstance(value, float | int):
                ax.axvline(value, color="black", linestyle=style, linewidth=1, label=f"{what} {value:.1f} s")
        ax.set_yticks(range(len(order)), order)
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the pull began (median run)")
        ax.set_title(f"time to ready over {name} ({results['link']['shaper']} shaper)")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", choices=[*link.LINKS, "all"], default="all")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per mode and link")
    parser.add_argument("--image", choices=list(image.IMAGES), default="full")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)}",
    )
    parser.add_argument("--shaper", choices=["tc", "proxy"], default="tc", help="what limits bandwidth")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small image, 1gbit-2ms only, one run per mode",
    )
    args = parser.parse_args()
    if args.quick:
        args.image, args.runs, args.link = "quick", 1, "1gbit-2ms"
    modes = [MODES[m] for m in args.modes.split(",")]
    specs = list(link.LINKS.values()) if args.link == "all" else [link.LINKS[args.link]]
    WORKDIR.mkdir(parents=True, exist_ok=True)

    built = image.build(image.IMAGES[args.image], log)
    log(
        f"image {built.spec.name}: {built.uncompressed_bytes / 1e9:.2f} GB uncompressed, "
        f"{built.compressed_bytes / 1e9:.2f} GB compressed, {len(built.layer_names)} layers"
    )
    peer = any(m.node == STARGZ for m in modes)
    if peer:
        stargz.ensure_packages(log)
    stargz_binary = stargz.build_daemon(log) if peer else None
    link.remove_stale_namespaces()
    netns = link.Netns()
    netns.create()
    registry = warm = lazy_warm = lazy_warm_fuse = None
    stargz_images: dict[str, object] = {}
    try:
        registry = link.start_ns_registry(netns, Path(tempfile.mkdtemp(prefix="bs-bench-reg-", dir=WORKDIR)))
        direct_ref = f"{registry.host}/{REPOSITORY}:v1"
        log(f"pushing to {direct_ref} and indexing (unshaped)")
        push(built.layout, direct_ref)
        warm = start_node([registry.host])
        warm.index(direct_ref, STEP_TIMEOUT)
        warm.containerd.pull(direct_ref, snapshotter="overlayfs")
        if peer:
            layouts = stargz.convert(built, warm.containerd, direct_ref, registry.host, REPOSITORY, log)
            for tag, layout in layouts.items():
                push(layout, f"{registry.host}/{REPOSITORY}:{tag}")
                stargz_images[tag] = {"compressed_bytes": sum(layout.layer_sizes), "layers": len(layout.layer_sizes)}
        log("measuring the bytes the start truly reads (three warm starts, read-ahead off)")
        warm_containerd = warm.containerd
        strict_hot = hotbytes.measure(
            warm_containerd,
            direct_ref,
            built.layout,
            lambda: run_container(warm_containerd, "overlayfs", direct_ref, "hotbytes"),
            image.CACHE_DIR / "layermaps",
            log,
        )
        log(
            f"the start reads {strict_hot.uncompressed_bytes / 1e6:.1f} MB, "
            f"{strict_hot.compressed_bytes / 1e6:.1f} MB compressed"
        )
        mount_reads = None
        if any(m.node == FRESH and m.snapshotter == "bootseer" for m in modes):
            log("measuring what the kernel reads through the layer mount (one lazy start, unshaped)")
            mount_reads = _measure_layer_mount(registry.host, direct_ref, built.layout)
            log(
                f"through the layer mount (read-ahead {mount_reads.read_ahead_kb} KiB) the kernel reads "
                f"{mount_reads.uncompressed_bytes / 1e6:.1f} MB, {mount_reads.compressed_bytes / 1e6:.1f} MB "
                f"compressed; in whole 1 MiB blocks {mount_reads.block_bytes[1 << 20] / 1e6:.1f} MB"
            )
        if any(m.node == LAZY_WARM for m in modes):
            lazy_warm = _start_lazy_warm(registry.host, direct_ref, built.layout.layer_digests, whole=True)
        if any(m.node == LAZY_WARM_FUSE for m in modes):
            lazy_warm_fuse = _start_lazy_warm(registry.host, direct_ref, built.layout.layer_digests, whole=False)
        nodes = Nodes(warm, direct_ref, registry.daemon.pid, lazy_warm, lazy_warm_fuse, stargz_binary)
        per_link: dict[str, dict[str, object]] = {}
        representative: dict[str, dict[str, Run]] = {}
        for spec in specs:
            log(f"link {spec.name}: calibrating, then {args.runs} round(s) of {', '.join(m.name for m in modes)}")
            per_link[spec.name], representative[spec.name] = run_link(
                netns, nodes, spec, built, modes, args.runs, args.shaper, strict_hot
            )
    finally:
        for node in (lazy_warm_fuse, lazy_warm, warm):
            if node is not None:
                node.teardown()
        if registry is not None:
            registry.daemon.stop()
            # The image stays cached under WORKDIR; the registry's copy of it goes.
            shutil.rmtree(registry.workdir, ignore_errors=True)
        netns.destroy()

    first = per_link[specs[0].name]
    results = {
        "image": built.describe(),
        "stargz_images": stargz_images,
        "strict_hot_bytes": strict_hot.describe(),
        # The same count for a start through the layer mount: the kernel's reads, read-around included.
        "layer_mount_read_bytes": None if mount_reads is None else mount_reads.describe(),
        # The timed runs' disk read-ahead (the strict measurement turns it off).
        "disk_read_ahead_kb": hotbytes.device_read_ahead_kb(Path("/tmp")),
        "runs_per_mode": args.runs,
        "note": "2-core VM shared with other engineers' test runs: figures may be depressed by contention",
        "fuse_wait_definition": (
            "per mode, medians over its runs of the FUSE requests sent from the pull's end to the ready line "
            "(the container's, and its runtime's), timed by the kernel's fuse_request_send/end tracepoints: "
            f"outstanding_s, the wall time with one or more outstanding; slow: answered in over "
            f"{fusewait.SLOW_S * 1e3:g} ms (bench/fusewait.py)"
        ),
        # The first link's figures at the top level, every link under "links".
        "link": first["link"],
        "modes": first["modes"],
        "limit_s": first["limit_s"],
        "strict_limit_s": first["strict_limit_s"],
        "ratios": first["ratios"],
        "links": per_link,
    }
    out = report.write(NAME, results)
    plot(per_link, representative, report.RESULTS / f"{NAME}.png")
    _print_table(per_link)
    print(f"wrote {out} and {report.RESULTS / f'{NAME}.png'}")


def _bootseer_pull(node: Node, ref: str) -> None:
    pulled = subprocess.run(node.pull_command(ref), capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)
    if pulled.returncode != 0:
        raise RuntimeError(f"bootseer pull failed:\n{pulled.stdout}\n{pulled.stderr}")


def _measure_layer_mount(registry_host: str, direct_ref: str, layout: ImageLayout) -> hotbytes.HotBytes:
    """hotbytes.measure_layer_mount on a fresh node (hot blocks and
    unpacking off, so every layer is read through the mount), pulled over
    the unshaped veth."""
    node = start_node([registry_host], unpack_whole_layers=False)
    try:
        _bootseer_pull(node, direct_ref)
        return hotbytes.measure_layer_mount(
            node.containerd,
            layout,
            lambda: run_container(node.containerd, "bootseer", direct_ref, "mount-reads"),
            image.CACHE_DIR / "layermaps",
            log,
        )
    finally:
        node.teardown()


def _start_lazy_warm(registry_host: str, direct_ref: str, layers: Sequence[str], whole: bool) -> Node:
    """A lazy-warm node: `bootseer pull` over the unshaped veth, then one
    start, after which every block the start reads is in the layer cache.
    `whole`: with background fetch on, and back only once every layer is
    fetched whole and unpacked; else with unpacking off."""
    node = start_node([registry_host], background_fetch=whole, unpack_whole_layers=whole)
    try:
        _bootseer_pull(node, direct_ref)
        run_container(node.containerd, "bootseer", direct_ref, "lazy-warm-prime")
        if whole:
            store = LayerStore(node.layers.config.store)
            trees = [store.tree_path(layer_name(digest)) for digest in layers]
            wait_until(
                lambda: all(tree.is_dir() for tree in trees),
                STEP_TIMEOUT,
                "the lazy-warm node to fetch and unpack every layer",
                node.layers.daemon,
            )
            log(f"lazy-warm node: {len(trees)} layers fetched whole and unpacked")
    except BaseException:
        node.teardown()
        raise
    return node


def _print_table(per_link: dict[str, dict[str, object]]) -> None:
    for name, results in per_link.items():
        print(f"\n{name}: additive limit {results['limit_s']} s, strict limit {results['strict_limit_s']} s")
        print(f"{'mode':18}{'median s':>10}{'MB fetched':>12}")
        for mode, s in results["modes"].items():  # type: ignore[union-attr]
            if "median_s" in s:
                print(f"{mode:18}{s['median_s']:>10.2f}{s['bytes_fetched'] / 1e6:>12.1f}")
        for key, value in results["ratios"].items():  # type: ignore[union-attr]
            if value is not None:
                print(f"  {key} = {value}")
        for line in results["closing_note"]:  # type: ignore[union-attr]
            print("  " + line)


if __name__ == "__main__":
    sys.exit(main())
