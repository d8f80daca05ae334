"""Many nodes starting one image at the same moment, from one registry behind
one shaped link, with and without a pull-through cache in front of it.
Run: `make bench-scale` (`--quick`: N = 1 and 2 only, one run;
`--nodes`, `--modes`, `--runs`, `--image`, `--link`, `--routes`, `--output`
to pick).

- image and registry: bench/startup.py's training image (bench/image.py;
  the quick one by default, which keeps 8 nodes x 3 modes x 2 routes within
  about 40 minutes on a 2-core VM), pushed once to a docker-registry in a network namespace (bench/link.py),
  indexed once by `bootseer index`;
- link: bench/link.py's tc htb on the namespace's veth plus its delay-line
  proxy, the one link every node and the mirror share;
- a node: bench/node.py's `start_node` (its own containerd, bootseer
  snapshotter and layer server), fresh for every round, in a containerd
  namespace of this run's own so its containers' CPU can be read from their
  cgroup;
- a round: N fresh nodes released by one barrier; each pulls (`ctr images
  pull` for overlayfs, `bootseer pull` for lazy and prefetch) and runs the
  image's training start up to its READY line, with bench/startup.py's
  run-and-ready logic. Time to ready: from the barrier to READY. The job
  waits for the slowest node: the maximum is the figure that matters;
- routes: `direct` (every node to the registry over the link) and `mirror`
  (every node's hosts.toml names a fresh distribution 2.8 pull-through cache
  on this host, in front of the link, as a rack-level cache would be; the
  registry stays the last host and the only one with `push`); and, as an
  experiment (`--routes slice-cache`), a range-aware nginx slice cache in
  the same place (bench/slicecache.py), which tells distribution 2.8's
  whole-blob semantics apart from what bootseer asks;
- modes: `overlayfs` (containerd's default), `lazy` (hot blocks off),
  `prefetch` (hot blocks on; before its rounds, a recording wave: the largest
  N of nodes start the image at once with no manifest published, which
  measures how many manifests a new image's first start pushes);
- per round: registry bytes out (the registry side of the veth, which the
  mirror's upstream fetches cross too), hot-block manifests uploaded (the
  registry's storage, tests/harness/registry.py), CPU seconds by role
  (containers from their cgroup, daemons from /proc/PID/stat, clients from
  rusage) and the machine's busy cores (/proc/stat), so a reader can tell a
  link-bound round from a CPU-bound one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import cpu as cpu_accounting
from bench import image, link, ocidir, report, scalemath, slicecache, startup
from bench.node import Node, start_node
from bench.report import log
from bench.scalemath import DIRECT, MIRROR, SLICE_CACHE, NodeStart, Round
from tests.harness.oci import push
from tests.harness.registry import Registry, start_pull_through_cache, uploaded_hot_manifests
from tests.harness.tree import drop_page_cache

NAME = "scale"
REPOSITORY = startup.REPOSITORY
WORKDIR = startup.WORKDIR
STEP_TIMEOUT = startup.STEP_TIMEOUT
# What one node (three daemons and a container importing torch) may take, and
# what the machine keeps for everyone else: an N that does not fit is skipped.
NODE_MEMORY_BYTES = 1536 << 20
RESERVE_MEMORY_BYTES = 3 << 30
# Starting or stopping daemons is CPU-bound on 2 cores: a few at a time.
START_PARALLEL = 4
# A recording settles record_idle_s (10 s) after the start stops reading; its
# publish election and push take a few more.
SETTLE_TIMEOUT_S = 180.0
PUSHED = "bootseer_hot_manifests_pushed_total"
NOT_PUSHED = "bootseer_hot_manifests_not_pushed_total"
LAYER_SERVER_METRICS = (
    "bootseer_fs_fetched_bytes_total",
    "bootseer_fs_fetch_seconds_count",
    "bootseer_fs_prefetched_blocks_total",
    "bootseer_registry_range_ignored_total",
    "bootseer_registry_mirror_skipped_total",
    "bootseer_registry_mirror_down_total",
    PUSHED,
    NOT_PUSHED,
)

T = TypeVar("T")
# A results document, as it goes to JSON.
Doc = dict[str, Any]


@dataclass(frozen=True)
class Mode:
    name: str
    snapshotter: str
    lazy: bool  # `bootseer pull` (remote layers) rather than `ctr images pull`
    hot_blocks: bool


MODES = {
    m.name: m
    for m in (
        Mode("overlayfs", "overlayfs", lazy=False, hot_blocks=False),
        Mode("lazy", "bootseer", lazy=True, hot_blocks=False),
        Mode("prefetch", "bootseer", lazy=True, hot_blocks=True),
    )
}


@dataclass
class Env:
    """What every round shares: the link, the registry behind it, the image."""

    netns: link.Netns
    registry: link.NsRegistry
    proxy: link.DelayProxy
    spec: link.LinkSpec
    built: image.BuiltImage
    digest: str  # the image manifest's, which hot-block manifests name
    namespace: str  # containerd namespace of every node: its containers' cgroup parent

    @property
    def ref(self) -> str:
        """The image through the shaped link."""
        return f"{self.proxy.host}/{REPOSITORY}:v1"

    def uploaded_manifests(self) -> int:
        # The namespace registry keeps its storage where the harness's does.
        store = Registry(daemon=self.registry.daemon, workdir=self.registry.workdir, port=link.REGISTRY_PORT)
        return uploaded_hot_manifests(store, self.digest)


# --- nodes ------------------------------------------------------------------


def _parallel(items: Sequence[T], action: Callable[[T], object]) -> list[object]:
    with ThreadPoolExecutor(max_workers=START_PARALLEL) as pool:
        return list(pool.map(action, items))


def _start_nodes(env: Env, n: int, hot_blocks: bool) -> list[Node]:
    nodes: list[Node] = []
    lock = threading.Lock()

    def one(_: int) -> None:
        node = start_node([env.proxy.host], hot_blocks, namespace=env.namespace)
        with lock:
            nodes.append(node)

    try:
        _parallel(range(n), one)
    except BaseException:
        _stop_nodes(nodes)
        raise
    return nodes


def _stop_nodes(nodes: Sequence[Node]) -> None:
    for leftovers in _parallel(nodes, Node.teardown):
        if leftovers:
            log(f"warning: mounts left behind: {leftovers}")


def _memory_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _fits(n: int) -> bool:
    return _memory_available() >= n * NODE_MEMORY_BYTES + RESERVE_MEMORY_BYTES


def _start_one(env: Env, mode: Mode, node: Node, container_id: str, t0: float) -> NodeStart:
    """One node's start from the barrier: pull, then run up to READY."""
    if mode.lazy:
        out = subprocess.run(
            node.pull_command(env.ref), capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False
        )
        counts = re.search(r"\((\d+) remote, (\d+) fetched", out.stdout)
        if out.returncode != 0 or counts is None or int(counts.group(1)) == 0:
            raise RuntimeError(f"bootseer pull did not pull lazily ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    else:
        # --hosts-dir: containerd's resolver reads the same hosts.toml bootseer does.
        node.containerd.ctr(
            "images",
            "pull",
            "--plain-http",
            "--hosts-dir",
            str(node.hosts_dir),
            "--snapshotter",
            "overlayfs",
            env.ref,
            timeout=STEP_TIMEOUT,
        )
    pulled = time.time()
    ready_at, _ = startup.run_container(node.containerd, mode.snapshotter, env.ref, container_id)
    return NodeStart(ready_s=round(ready_at - t0, 3), pull_s=round(pulled - t0, 3))


def _at_once(nodes: Sequence[Node], action: Callable[[int, Node, float], NodeStart]) -> list[NodeStart]:
    """`action` on every node in its own thread, released by one barrier; a
    failing node is recorded, not raised, so the others' figures stay."""
    released: list[float] = []
    barrier = threading.Barrier(len(nodes), action=lambda: released.append(time.time()))
    starts: dict[int, NodeStart] = {}

    def one(i: int, node: Node) -> None:
        barrier.wait()
        try:
            starts[i] = action(i, node, released[0])
        except Exception as exc:  # the figures say which node failed and why
            starts[i] = NodeStart(ready_s=None, error=f"{type(exc).__name__}: {exc}"[-2000:])

    threads = [threading.Thread(target=one, args=(i, n), name=f"node-{i}") for i, n in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [starts[i] for i in range(len(nodes))]


def _metrics(nodes: Sequence[Node]) -> dict[str, float]:
    return {name: sum(node.layers.metric(name) for node in nodes) for name in LAYER_SERVER_METRICS}


def _settle(nodes: Sequence[Node], before: float) -> bool:
    """Wait until every node's recording has been pushed or kept."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        settled = sum(node.layers.metric(PUSHED) + node.layers.metric(NOT_PUSHED) for node in nodes)
        if settled - before >= len(nodes):
            return True
        time.sleep(1.0)
    return False


# --- rounds -----------------------------------------------------------------


def run_round(env: Env, mode: Mode, n: int, route: str, run: int, settle: bool = False) -> Round:
    cache: Registry | slicecache.SliceCache | None = None
    if route == MIRROR:
        cache = start_pull_through_cache(f"http://{env.proxy.host}")
    elif route == SLICE_CACHE:
        cache = slicecache.start_slice_cache(env.proxy.host)
    nodes: list[Node] = []
    try:
        nodes = _start_nodes(env, n, mode.hot_blocks)
        if cache is not None:
            for node in nodes:
                node.use_mirror(env.proxy.host, cache.host)
        pids: dict[str, list[int]] = {"containerd": [], "snapshotter": [], "layer_server": []}
        for node in nodes:
            for role, pid in node.daemon_pids().items():
                pids[role].append(pid)
        pids["registry"] = [env.registry.daemon.pid]
        pids["link_proxy"] = [env.proxy.daemon.pid]
        if cache is not None:
            pids["mirror"] = cache.pids() if isinstance(cache, slicecache.SliceCache) else [cache.daemon.pid]
        uploads = env.uploaded_manifests()
        before_metrics = _metrics(nodes)
        drop_page_cache()
        cpu_before = cpu_accounting.snapshot(pids, env.namespace)
        rx_before = env.netns.rx_bytes()
        began = time.time()

        def start(i: int, node: Node, t0: float) -> NodeStart:
            return _start_one(env, mode, node, f"{mode.name}-{route}-{n}-{i}-{run}", t0)

        starts = _at_once(nodes, start)
        wall = time.time() - began
        if settle:
            settled_before = before_metrics[PUSHED] + before_metrics[NOT_PUSHED]
            if not _settle(nodes, settled_before):
                log("warning: not every node's recording settled")
        rx_after = env.netns.rx_bytes()
        cpu, busy, iowait = cpu_accounting.delta(cpu_before, cpu_accounting.snapshot(pids, env.namespace))
        metrics = {k: v - before_metrics[k] for k, v in _metrics(nodes).items()}
    finally:
        _stop_nodes(nodes)
        if cache is not None:
            cache.stop()
    return Round(
        mode=mode.name,
        nodes=n,
        route=route,
        run=run,
        starts=starts,
        registry_bytes=rx_after - rx_before,
        manifests_pushed=env.uploaded_manifests() - uploads,
        wall_s=round(wall, 3),
        cpu_s=cpu,
        machine_busy_cores=round(busy, 3),
        machine_iowait_cores=round(iowait, 3),
        layer_server=metrics,
    )


def _describe_round(r: Round) -> str:
    errors = "; ".join(s.error.splitlines()[0] for s in r.starts if s.error)
    return (
        f"{r.mode:9} N={r.nodes} {r.route:6} run {r.run + 1}: median {r.median_ready_s or 0:6.2f} s, "
        f"max {r.max_ready_s or 0:6.2f} s, registry {r.registry_bytes / 1e6:8.1f} MB, "
        f"{r.manifests_pushed} manifest(s) pushed, busy {r.machine_busy_cores:.2f} cores"
        + (f", FAILED: {errors}" if errors else "")
    )


def _round_json(r: Round) -> dict[str, object]:
    return {
        **{k: v for k, v in asdict(r).items() if k != "starts"},
        "starts": [asdict(s) for s in r.starts],
        "median_ready_s": r.median_ready_s,
        "max_ready_s": r.max_ready_s,
    }


# --- setup ------------------------------------------------------------------


def _index(registry_host: str, direct_ref: str) -> None:
    """`bootseer index` once, over the unshaped veth, on a node of its own."""
    node = start_node([registry_host])
    try:
        node.index(direct_ref, STEP_TIMEOUT)
    finally:
        node.teardown()


DEFAULT_OUTPUT = report.RESULTS / f"{NAME}.json"


def _write(path: Path, doc: Doc) -> Path:
    if path == DEFAULT_OUTPUT:
        return report.write(NAME, doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": report.machine(), **doc}, indent=2) + "\n")
    return path


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


# --- results ----------------------------------------------------------------


def _table(
    rounds: Sequence[Round], cpus: int, link_bytes_per_s: float
) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    grouped: dict[tuple[str, str, int], list[Round]] = {}
    for r in rounds:
        grouped.setdefault((r.mode, r.route, r.nodes), []).append(r)
    table: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for (mode, route, n), rs in sorted(grouped.items(), key=lambda kv: (list(MODES).index(kv[0][0]), kv[0][1:])):
        table.setdefault(mode, {}).setdefault(route, {})[n] = scalemath.summarise(rs, cpus, link_bytes_per_s)
    return table


def _why(
    table: dict[str, dict[str, dict[int, dict[str, Any]]]],
    ratios: dict[str, object],
    largest: int,
    compressed: int,
    targets: dict[str, dict[str, object]],
) -> list[str]:
    """Figures behind each missed target."""
    notes = []
    mirror = targets["mirror_registry_bytes_vs_one_node"]
    if mirror["met"] is False:
        for mode, routes in table.items():
            m = routes.get(MIRROR, {})
            if largest not in m:
                continue
            row = m[largest]
            one = routes.get(DIRECT, {}).get(1, {}).get("registry_bytes")
            mirror_one = m.get(1, {}).get("registry_bytes")
            ls = row.get("layer_server", {})
            notes.append(
                f"{mode}: with the mirror at N={largest} the registry sent {row['registry_bytes'] / 1e6:.0f} MB = "
                f"{row['registry_bytes'] / compressed:.2f}x the image's compressed {compressed / 1e6:.0f} MB"
                + (f" and {row['registry_bytes'] / mirror_one:.2f}x the mirror's own N=1 figure" if mirror_one else "")
                + (f"; one node without the mirror takes {one / 1e6:.0f} MB" if one else "")
                + (
                    f"; layer servers saw {ls.get('bootseer_registry_range_ignored_total', 0):.0f} ranges answered "
                    f"with a whole 200 body and went past the mirror "
                    f"{ls.get('bootseer_registry_mirror_skipped_total', 0):.0f} times"
                    if ls
                    else ""
                )
            )
    prefetch = targets["prefetch_max_vs_overlayfs_max"]
    if prefetch["met"] is False:
        for mode in ("prefetch", "overlayfs"):
            direct = table.get(mode, {}).get(DIRECT, {}).get(largest)
            if direct:
                notes.append(
                    f"{mode} at N={largest}: max {direct['max_ready_s']} s (median {direct['median_ready_s']} s), "
                    f"registry {direct['registry_bytes'] / 1e6:.0f} MB, link utilisation {direct['link_utilisation']}, "
                    f"machine busy {direct['machine_busy_cores']} cores: {direct['bound_by']}-bound; "
                    f"cpu_s {direct['cpu_s']}"
                )
    return notes


def results(
    env_describe: dict[str, object],
    rounds: Sequence[Round],
    wave: Round | None,
    node_counts: Sequence[int],
    skipped: Sequence[int],
    cpus: int,
    spec: link.LinkSpec,
    compressed: int,
) -> Doc:
    table = _table(rounds, cpus, spec.bytes_per_s)
    # The layer servers' counters, summed over nodes, summarised like the rest.
    for r in rounds:
        row = table[r.mode][r.route][r.nodes]
        row.setdefault("layer_server", dict.fromkeys(r.layer_server, 0.0))
        for k, v in r.layer_server.items():
            row["layer_server"][k] = round(row["layer_server"].get(k, 0.0) + v / row["runs"], 1)
    ran = sorted({r.nodes for r in rounds})
    largest = max(ran) if ran else 0
    by_mode = scalemath.mirror_bytes_ratios(table, largest)
    headline = scalemath.headline_mode([m for m, v in by_mode.items() if v is not None])
    ratios: dict[str, object] = {
        "mirror_registry_bytes_vs_one_node": by_mode.get(headline) if headline else None,
        "mirror_registry_bytes_vs_one_node_by_mode": by_mode,
        "mirror_registry_bytes_vs_one_node_mode": headline,
        "slice_cache_registry_bytes_vs_one_node_by_mode": scalemath.mirror_bytes_ratios(table, largest, SLICE_CACHE),
        "prefetch_max_vs_overlayfs_max": scalemath.prefetch_vs_overlayfs(table, DIRECT, largest),
        "prefetch_max_vs_overlayfs_max_mirror": scalemath.prefetch_vs_overlayfs(table, MIRROR, largest),
        "largest_n": largest,
    }
    targets = scalemath.check_targets(
        {k: float(v) if isinstance(v, float | int) else None for k, v in ratios.items() if k in scalemath.TARGETS}
    )
    return {
        **env_describe,
        "nodes": list(node_counts),
        "nodes_skipped_for_memory": list(skipped),
        "modes": {
            mode: {route: {str(n): row for n, row in rs.items()} for route, rs in routes.items()}
            for mode, routes in table.items()
        },
        "recording_wave": None if wave is None else _round_json(wave),
        "ratios": ratios,
        "headline_why": (
            "prefetch is the mode bootseer runs in (hot blocks on), so its ratio is what a registry behind "
            "a mirror serves a fleet of bootseer nodes; overlayfs's ratio measures the mirror alone (one node "
            "takes the whole image), lazy's sits in between"
        ),
        "targets": targets,
        "why_not_met": _why(table, ratios, largest, compressed, targets),
        "rounds": [_round_json(r) for r in rounds],
    }


COLORS = {"overlayfs": "#1f77b4", "lazy": "#ff7f0e", "prefetch": "#2ca02c"}


def plot(out: Doc, path: Path) -> None:
    modes = out["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for mode, routes in modes.items():
        for route, rows in routes.items():
            ns = sorted(int(n) for n in rows)
            style = {DIRECT: "-", MIRROR: "--"}.get(route, ":")
            label = f"{mode} ({route})"
            maxima = [rows[str(n)]["max_ready_s"] for n in ns]
            left.plot(ns, maxima, style, marker="o", color=COLORS.get(mode, "grey"), label=label)
            registry_gb = [rows[str(n)]["registry_bytes"] / 1e9 for n in ns]
            right.plot(ns, registry_gb, style, marker="o", color=COLORS.get(mode, "grey"), label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(out["nodes"], [str(n) for n in out["nodes"]])
        ax.set_xlabel("nodes starting at once (N)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.set_ylabel("max time to ready (s): the job's wait")
    left.set_title("slowest node's time to ready")
    right.set_ylabel("registry bytes out (GB)")
    right.set_title("registry load (dashed: through distribution's pull-through cache)")
    left.legend(fontsize=8)
    fig.suptitle(f"bench-scale: {out['image']['name']} over {out['link']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _print_table(out: Doc) -> None:
    print(
        f"\n{'mode':10}{'route':12}{'N':>3}{'median s':>10}{'max s':>9}{'registry MB':>13}{'pushed':>8}"
        f"{'busy cores':>12}{'link use':>10}  bound"
    )
    for mode, routes in out["modes"].items():
        for route, rows in routes.items():
            for n, row in rows.items():
                print(
                    f"{mode:10}{route:12}{n:>3}{row['median_ready_s'] or 0:>10.2f}{row['max_ready_s'] or 0:>9.2f}"
                    f"{row['registry_bytes'] / 1e6:>13.1f}{row['manifests_pushed']:>8}"
                    f"{row['machine_busy_cores']:>12.2f}{row['link_utilisation']:>10.2f}  {row['bound_by']}"
                )
    for key, value in out["ratios"].items():
        print(f"  {key} = {value}")
    for line in out["why_not_met"]:
        print("  " + line)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,2,4,8", help="comma-separated N to run (skipped if memory is short)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument(
        "--routes",
        default=f"{DIRECT},{MIRROR}",
        help=f"comma-separated subset of {DIRECT},{MIRROR},{SLICE_CACHE} ({SLICE_CACHE}: a range-aware nginx "
        "slice cache instead of distribution's, an experiment)",
    )
    parser.add_argument("--runs", type=int, default=1, help="rounds per mode, N and route")
    # The quick image by default: 8 nodes x 3 modes x 2 routes of the full one
    # take over an hour on a 2-core VM; the startup figures come from the full one.
    parser.add_argument("--image", choices=["full", "quick"], default="quick")
    parser.add_argument("--link", choices=list(link.LINKS), default="1gbit-2ms")
    parser.add_argument("--quick", action="store_true", help="small image, N = 1 and 2, one run")
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="the JSON results (the plot goes beside it, .png); another path keeps an experiment's "
        "figures out of the published ones",
    )
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so every node, the mirror and the
    # namespace are stopped by the `finally` blocks rather than left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.quick:
        args.image, args.nodes, args.runs = "quick", "1,2", 1
    modes = [MODES[m] for m in args.modes.split(",")]
    routes = args.routes.split(",")
    if not set(routes) <= {DIRECT, MIRROR, SLICE_CACHE}:
        parser.error(f"--routes: a subset of {DIRECT},{MIRROR},{SLICE_CACHE}")
    node_counts = sorted({int(n) for n in args.nodes.split(",")})
    spec = link.LINKS[args.link]
    WORKDIR.mkdir(parents=True, exist_ok=True)
    load_before = _uptime()
    log(f"load: {load_before}")

    built = image.build(image.QUICK if args.image == "quick" else image.FULL, log)
    log(f"image {built.spec.name}: {built.compressed_bytes / 1e6:.0f} MB compressed, {len(built.layer_names)} layers")
    link.remove_stale_namespaces()
    netns = link.Netns()
    netns.create()
    namespace = f"bs-scale-{os.getpid()}"
    registry = proxy = None
    rounds: list[Round] = []
    wave: Round | None = None
    skipped: list[int] = []
    try:
        registry = link.start_ns_registry(netns, Path(tempfile.mkdtemp(prefix="bs-bench-reg-", dir=WORKDIR)))
        direct_ref = f"{registry.host}/{REPOSITORY}:v1"
        log(f"pushing to {direct_ref} and indexing (unshaped)")
        push(built.layout, direct_ref)
        _index(registry.host, direct_ref)
        netns.shape(spec.rate_mbit)
        proxy = link.start_proxy(registry.host, spec.rtt_ms, 0.0, WORKDIR / "scale-proxy.log")
        env = Env(netns, registry, proxy, spec, built, ocidir.manifest_digest(built.layout), namespace)
        runnable = [n for n in node_counts if _fits(n)]
        skipped = [n for n in node_counts if n not in runnable]
        if skipped:
            log(f"skipping N={skipped}: {_memory_available() / 2**30:.1f} GiB available")
        if any(m.hot_blocks for m in modes) and runnable:
            largest = max(runnable)
            log(f"recording wave: {largest} nodes start the image at once, no hot-block manifest published yet")
            wave = run_round(env, MODES["prefetch"], largest, DIRECT, 0, settle=True)
            log("recording wave: " + _describe_round(wave))
            if env.uploaded_manifests() == 0:
                log("warning: the recording wave published no hot-block manifest; prefetch rounds will record")
        for n in runnable:
            for run in range(args.runs):
                # Rotate the order each run, so drift in the machine's load hits every mode alike.
                for mode in modes[run % len(modes) :] + modes[: run % len(modes)]:
                    for route in routes:
                        r = run_round(env, mode, n, route, run)
                        rounds.append(r)
                        log(_describe_round(r))
                        # What is measured so far survives a run that dies later.
                        _write(args.output, {"partial": True, "rounds": [_round_json(x) for x in rounds]})
    finally:
        if proxy is not None:
            proxy.stop()
        netns.unshape()
        if registry is not None:
            registry.daemon.stop()
            shutil.rmtree(registry.workdir, ignore_errors=True)
        netns.destroy()
        # The containers' cgroup parent (empty once every node is gone).
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            for d in sorted((hierarchy / namespace).glob("**/"), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()

    env_describe: dict[str, object] = {
        "image": built.describe(),
        "link": {"name": spec.name, "rate_mbit": spec.rate_mbit, "rtt_ms": spec.rtt_ms, "shaper": "tc"},
        "runs_per_round": args.runs,
        "load": {"before": load_before, "after": _uptime(), "cpus": os.cpu_count()},
        "note": "2-core VM shared with other engineers' test runs: figures may be depressed by contention",
        "definitions": {
            "time_to_ready": "from the barrier releasing every node to its container's READY line",
            "registry_bytes": "bytes the host received from the registry's network namespace (veth rx counter)",
            "manifests_pushed": "hot-block manifest blobs uploaded to the registry during the round",
            "cpu_s": "CPU seconds by role: containers (cgroup cpuacct), daemons (/proc/PID/stat), "
            "clients (`ctr`, `bootseer pull`: rusage of reaped children)",
            "machine_busy_cores": "average busy cores of the whole machine over the round (/proc/stat)",
            "link_utilisation": "registry_bytes / (max time to ready x link rate)",
            "bound_by": f"link if link_utilisation >= {scalemath.LINK_BOUND_UTILISATION}, else cpu if busy "
            f"cores >= {scalemath.CPU_BOUND_BUSY} of all cores, else neither",
        },
    }
    out = results(env_describe, rounds, wave, node_counts, skipped, os.cpu_count() or 1, spec, built.compressed_bytes)
    path = _write(args.output, out)
    plot(out, path.with_suffix(".png"))
    _print_table(out)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
