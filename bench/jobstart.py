"""One training job's start, end to end: its image, its pip dependencies and
a multi-GB checkpoint, from "the container is scheduled" to its first step.
Run: `make bench-jobstart` (`--quick`: small image, small checkpoint, a few
packages, one round; `--runs`, `--checkpoint-mib`, `--modes` to pick).

Everything a node fetches crosses one link, a tc-shaped veth (1 Gbit/s) to a
network namespace holding the registry, an nginx with the job's wheels and
the dependency-snapshot store (PUT), and an nginx with the checkpoint that
limits each connection (`--per-stream`, 25 MB/s: one HDFS datanode stream,
or one S3 connection). The job (bench/jobscript.py) is the same in every
mode; what changes is how its node gets each part. Modes, interleaved
round by round, page cache dropped before each run:

- `baseline`: containerd alone, `ctr images pull` (overlayfs), the job's
  own `pip install -r` into a venv, the checkpoint read in one stream;
- `bootseer-first`: a fresh bootseer node (layer server, snapshotter,
  depsnap daemon, hdfs-fuse mount) on an image and requirements no node has
  started before: `bootseer pull`, on-demand blocks (the start is recorded
  and its hot-block manifest published), a depsnap miss (pip in the pod,
  the daemon captures and publishes), the checkpoint striped and
  prefetched from the pull's start, as the CRI proxy does for a pod
  annotated `bootseer.io/prefetch` (the job's first act also asks, by its
  `user.bootseer.prefetch` attribute, as a pod without the annotation
  would), so it arrives while the image, the dependencies and the imports
  do;
- `bootseer-fresh-node`: another fresh node after that: the hot blocks are
  prefetched, the dependencies restored from the store, the checkpoint
  striped and prefetched as in `bootseer-first`;
- `warm`: everything on the node already: the image unpacked, the
  environment installed, the checkpoint on local disk.

Each round pushes the image to a new repository and uses a new store
prefix, so `bootseer-first` finds nothing recorded or snapshotted. The
pods run with ctr's default capabilities (no CAP_SYS_ADMIN): the depsnap
socket's directory and the hdfs-fuse mount (HostToContainer propagation)
are their only host volumes. The limit: `warm` plus the bytes the fresh
node moved over the link at the link's rate. The bootseer modes' breakdown
comes from `bootseer report` (the daemons' event records) as well as from
the job's own marks.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import image, link, ocidir, report
from bench.jobtimeline import MODES, PHASES, Run, limit_s, parse_output, phases, ratios, round_order, summarise
from bench.node import Node, index_image, start_node
from bench.report import log
from depsnap.podclient import write_zipapp
from hdfs_fuse import mountinfo, prefetch_client
from snapshotter.fs.settings import FsConfig
from tests.harness.containerd import BindMount, Containerd, start_containerd
from tests.harness.layerserver import LazyConfig
from tests.harness.nginx import Nginx, remove, start_nginx
from tests.harness.oci import ImageLayout, push
from tests.harness.procs import Daemon, start_daemon, unix_socket_answers
from tests.harness.registry import uploaded_hot_manifests
from tests.harness.snapshotter import BOOTSEER_BIN
from tests.harness.tree import drop_page_cache

NAME = "jobstart"
WORKDIR = image.CACHE_DIR / "jobstart"
TARGETS = {"fresh_node_vs_baseline": 0.2, "fresh_node_vs_limit": 1.3}
LINK_MBIT = 1000.0
# Real packages a training job adds to its image's torch: data loading,
# config, tokenising, numerics; numpy comes again as pandas' dependency.
REQUIREMENTS = ("pandas", "pyarrow", "scipy", "pyyaml", "requests", "tqdm", "safetensors", "jinja2", "regex")
IMPORTS = ("numpy", "pandas", "pyarrow", "scipy.linalg", "yaml", "requests", "tqdm", "safetensors", "jinja2", "regex")
QUICK_REQUIREMENTS = ("pyyaml", "requests", "tqdm")
QUICK_IMPORTS = ("yaml", "requests", "tqdm")
FILES_PORT, CHECKPOINT_PORT = 8080, 8081
ENV_TARGET = "/opt/env"
SOCKET_DIR = "/run/bootseer"
CHECKPOINT_DIR = "/ckpt"
CHECKPOINT_NAME = "model.bin"
HEAD_BYTES = 64 << 20  # the job digests this much of the checkpoint's head
STEP_TIMEOUT = 1800.0
JOB_SCRIPT = Path(__file__).with_name("jobscript.py")
JOB_ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "OMP_NUM_THREADS=2")


# -- what the benchmark serves -------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    layout: ImageLayout
    manifest_digest: str
    image_bytes: int
    wheels: Path
    checkpoint: Path
    checkpoint_bytes: int
    head_sha256: str
    imports: tuple[str, ...]


def _job_layout(base: image.BuiltImage, requirements: tuple[str, ...], log_: Callable[[str], None]) -> ImageLayout:
    """The benchmark image plus two layers, as a job's Dockerfile would add
    them: pip's wheels for `venv` (Debian keeps them apart from the
    standard library), and the job (script, requirements, depsnap's pod client)."""
    key = hashlib.sha256(JOB_SCRIPT.read_bytes() + "\n".join(requirements).encode() + base.layout.diff_ids[-1].encode())
    home = WORKDIR / f"image-{base.spec.name}-{key.hexdigest()[:12]}"
    if (home / "layout" / "index.json").exists():
        return ocidir.read_layout(home / "layout")
    log_(f"building the job image in {home}")
    shutil.rmtree(home, ignore_errors=True)
    wheels_layer, job_layer = home / "stage" / "pip", home / "stage" / "job"
    shutil.copytree("/usr/share/python-wheels", wheels_layer / "usr/share/python-wheels")
    (job_layer / "app").mkdir(parents=True)
    shutil.copy(JOB_SCRIPT, job_layer / "app" / "job.py")
    (job_layer / "app" / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))
    write_zipapp(job_layer / "app" / "depsnap-client.pyz")
    layout = ocidir.write_layout(
        home / "layout",
        [wheels_layer, job_layer],
        ("/usr/bin/python3", "/app/job.py"),
        JOB_ENV,
        tag="v1",
        base=base.layout,
    )
    shutil.rmtree(home / "stage")
    return layout


def _wheelhouse(requirements: tuple[str, ...], log_: Callable[[str], None]) -> Path:
    """The requirements' wheels, downloaded once, with the HTML page pip's
    --find-links reads."""
    home = WORKDIR / f"wheels-{hashlib.sha256(' '.join(requirements).encode()).hexdigest()[:12]}"
    page = home / "index.html"
    if not page.exists():
        log_(f"downloading wheels for {' '.join(requirements)} to {home}")
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(home), *requirements],
            check=True,
        )
        links = "".join(
            f'<a href="{html.escape(p.name)}">{html.escape(p.name)}</a>\n' for p in sorted(home.glob("*.whl"))
        )
        page.write_text(f"<html><body>\n{links}</body></html>\n")
    return home


def _checkpoint(mib: int, log_: Callable[[str], None]) -> tuple[Path, str]:
    """A checkpoint of float32 weights (incompressible, like a real one) and
    the sha256 of its head."""
    path = WORKDIR / f"checkpoint-{mib}m" / CHECKPOINT_NAME
    if not path.exists():
        log_(f"writing a {mib} MiB checkpoint to {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(7)
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as f:
            for _ in range(0, mib, 64):
                f.write((rng.standard_normal(16 << 20, dtype=np.float32) * 0.02).tobytes()[: 64 << 20])
            f.truncate(mib << 20)
        partial.rename(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()[:16]
    return path, head


# -- the link and its servers --------------------------------------------------------


@dataclass
class Servers:
    netns: link.Netns
    registry: link.NsRegistry
    files: Nginx  # wheels/ and store/ (PUT)
    checkpoints: Nginx  # the checkpoint, rate-limited per connection

    @property
    def wheels_url(self) -> str:
        return f"{self.files.url}/wheels/index.html"

    def store_url(self, prefix: str) -> str:
        return f"{self.files.url}/store/{prefix}"

    @property
    def checkpoint_url(self) -> str:
        return f"{self.checkpoints.url}/{CHECKPOINT_NAME}"


@contextmanager
def servers(work: Workload, per_stream: str, scratch: Path) -> Iterator[Servers]:
    link.remove_stale_namespaces()
    netns = link.Netns()
    netns.create()
    with ExitStack() as stack:
        stack.callback(netns.destroy)
        registry = link.start_ns_registry(netns, scratch / "registry")
        stack.callback(registry.daemon.stop)
        served = scratch / "files"
        (served / "store").mkdir(parents=True)
        (served / "wheels").symlink_to(work.wheels)
        ns = netns.ns_addr, netns.name
        files = start_nginx(served, writable=True, autoindex=False, parent=scratch, host=ns[0], netns=ns[1])
        stack.callback(remove, files)
        checkpoints = start_nginx(
            work.checkpoint.parent,
            limit_rate=per_stream,
            workers=2,
            access_log=False,
            parent=scratch,
            host=ns[0],
            netns=ns[1],
        )
        stack.callback(remove, checkpoints)
        netns.shape(LINK_MBIT)
        stack.callback(netns.unshape)
        yield Servers(netns, registry, files, checkpoints)


# -- nodes ---------------------------------------------------------------------------


@dataclass
class JobNode:
    """One fresh bootseer node: layer server, snapshotter, containerd,
    depsnap daemon and an hdfs-fuse mount of the checkpoint server."""

    node: Node
    config: Path
    socket_dir: Path
    checkpoint_mount: Path
    daemons: list[Daemon] = field(default_factory=list)

    def argv(self, command: str, *args: str) -> list[str]:
        """`bootseer COMMAND --config <this node's> ARGS`; COMMAND may be two
        words (`hdfs-fuse mount`): the config flag belongs to the last."""
        return [str(BOOTSEER_BIN), *command.split(), "--config", str(self.config), *args]

    def bootseer(self, command: str, *args: str, timeout: float = STEP_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command, *args), capture_output=True, text=True, timeout=timeout, check=False)

    def teardown(self) -> list[str]:
        if mountinfo.current(self.checkpoint_mount) is not None:
            self.bootseer("hdfs-fuse umount", str(self.checkpoint_mount), timeout=60)
        for daemon in reversed(self.daemons):
            daemon.stop()
        left = self.node.teardown()
        if mountinfo.current(self.checkpoint_mount) is not None:
            subprocess.run(["umount", "-l", str(self.checkpoint_mount)], check=False)
            left.append(str(self.checkpoint_mount))
        return left


def start_job_node(s: Servers, store_prefix: str) -> JobNode:
    def sections(workdir: Path) -> str:
        return (
            f'\n[depsnap]\nsocket = "{workdir / "depsnap" / "depsnap.sock"}"\n'
            f'cache_dir = "{workdir / "depsnap-cache"}"\n'
            f'store = "{s.store_url(store_prefix)}"\npod_targets = ["{ENV_TARGET}"]\n'
        )

    # The recording ends at the first step (`Bench._publish`), not by idling.
    node = start_node(
        [s.registry.host],
        hot_blocks=True,
        extra_config=sections,
        record_idle_s=FsConfig().record_max_s,
        events_summary_interval_s=0.5,
    )
    workdir = node.layers.config.workdir
    job = JobNode(node, node.layers.config.path, workdir / "depsnap", workdir / "ckpt")
    socket = job.socket_dir / "depsnap.sock"
    try:
        job.daemons.append(
            start_daemon(
                "depsnap serve",
                job.argv("depsnap serve", "--log-format", "json"),
                workdir / "depsnap.log",
                ready=lambda: unix_socket_answers(socket),
            )
        )
        job.checkpoint_mount.mkdir()
        job.daemons.append(
            start_daemon(
                "hdfs-fuse",
                job.argv(
                    "hdfs-fuse mount",
                    "--foreground",
                    "--log-format",
                    "json",
                    "--allow-other",
                    f"{s.checkpoints.url}/",
                    str(job.checkpoint_mount),
                ),
                workdir / "hdfs-fuse.log",
                ready=lambda: mountinfo.current(job.checkpoint_mount) is not None,
            )
        )
    except BaseException:
        job.teardown()
        raise
    return job


def _plain_containerd() -> Containerd:
    """containerd with no proxy snapshotter behind it: the baseline node."""
    scratch = Path(tempfile.mkdtemp(prefix="bs-job-base-", dir="/tmp"))
    return start_containerd(scratch / "no-proxy-snapshotter.sock")


# -- one run -------------------------------------------------------------------------


def _pip_env(s: Servers) -> dict[str, str]:
    return {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": s.wheels_url,
        "PIP_TRUSTED_HOST": s.netns.ns_addr,
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
    }


def _run_job(
    c: Containerd,
    snapshotter: str,
    ref: str,
    cid: str,
    env: dict[str, str],
    mounts: tuple[BindMount, ...],
    keep: bool = False,
) -> str:
    """The job's container, on the host network (the servers are across the
    link); its output. `keep`: left for `bootseer report` to look up."""
    args = ["run", "--net-host", "--snapshotter", snapshotter, *([] if keep else ["--rm"])]
    for mount in mounts:
        args += ["--mount", mount.ctr_arg()]
    for name, value in env.items():
        args += ["--env", f"{name}={value}"]
    done = c.ctr(*args, ref, cid, check=False, timeout=STEP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"job {cid} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def _job_env(work: Workload, deps: str, checkpoint: str) -> dict[str, str]:
    return {
        "JOB_DEPS": deps,
        "JOB_CHECKPOINT": checkpoint,
        "JOB_CHECKPOINT_BYTES": str(work.checkpoint_bytes),
        "JOB_IMPORTS": ",".join(work.imports),
        "BOOTSEER_BASE_IMAGE": work.manifest_digest,
    }


@dataclass
class Round:
    """What one round's modes share: the image's repository, the store prefix."""

    number: int
    ref: str
    store_prefix: str


@dataclass
class Bench:
    work: Workload
    servers: Servers
    warm: Containerd | None
    warm_ref: str
    warm_env: Path
    indexer: Path  # a node config `bootseer index` signs with

    def new_round(self, number: int) -> Round:
        nonce = uuid.uuid4().hex[:8]
        ref = f"{self.servers.registry.host}/bench/job-{nonce}:v1"
        push(self.work.layout, ref)
        index_image(self.indexer, ref, STEP_TIMEOUT)
        return Round(number, ref, f"round-{nonce}")

    def run(self, mode: str, rnd: Round) -> Run:
        """One timed start. A node's daemons are up before the clock starts,
        as on a node that has run them for days: the start is the pull, the
        container and the job."""
        if mode == "warm":
            return self._timed(mode, lambda: self._warm(rnd))
        if mode == "baseline":
            c = _plain_containerd()
            try:
                return self._timed(mode, lambda: self._baseline(c, rnd))
            finally:
                left = c.stop()
                if left:
                    log(f"warning: mounts left behind: {left}")
        published = uploaded_hot_manifests(self.servers.registry, self.work.manifest_digest)
        node = start_job_node(self.servers, rnd.store_prefix)
        cid = f"job-{mode}-{rnd.number}"
        try:
            run = self._timed(mode, lambda: self._bootseer(node, mode, rnd, cid))
            time.sleep(1.0)  # the layer server's last summary of the image's reads
            run.report = self._report(node, cid)
            if mode == "bootseer-first":
                self._publish(node, rnd.ref, published)
            node.node.containerd.ctr("containers", "rm", cid, check=False)
            return run
        finally:
            left = node.teardown()
            if left:
                log(f"warning: mounts left behind: {left}")

    def _timed(self, mode: str, start: Callable[[], tuple[str, float]]) -> Run:
        """`start`'s job output and the end of its pull, timed from here."""
        drop_page_cache()
        rx = self.servers.netns.rx_bytes()
        t0 = time.time()
        output, pull_end = start()
        moved = self.servers.netns.rx_bytes() - rx
        job = parse_output(output)
        if job.head_sha256 != self.work.head_sha256:
            raise RuntimeError(f"{mode}: the job read a checkpoint whose head is {job.head_sha256}")
        return Run(mode, job.marks["step"] - t0, moved, phases(t0, pull_end, job))

    def _baseline(self, c: Containerd, rnd: Round) -> tuple[str, float]:
        c.ctr("images", "pull", "--plain-http", "--snapshotter", "overlayfs", rnd.ref, timeout=STEP_TIMEOUT)
        pull_end = time.time()
        env = {**_job_env(self.work, "pip", self.servers.checkpoint_url), **_pip_env(self.servers)}
        return _run_job(c, "overlayfs", rnd.ref, f"job-baseline-{rnd.number}", env, ()), pull_end

    def _warm(self, rnd: Round) -> tuple[str, float]:
        assert self.warm is not None
        env = _job_env(self.work, "present", f"{CHECKPOINT_DIR}/{CHECKPOINT_NAME}")
        mounts = (
            BindMount(self.warm_env, ENV_TARGET, read_only=True),
            BindMount(self.work.checkpoint.parent, CHECKPOINT_DIR, read_only=True),
        )
        # Nothing to pull: the phases start with the container.
        started = time.time()
        return _run_job(self.warm, "overlayfs", self.warm_ref, f"job-warm-{rnd.number}", env, mounts), started

    def _bootseer(self, node: JobNode, mode: str, rnd: Round, cid: str) -> tuple[str, float]:
        # What the CRI proxy does for a pod annotated bootseer.io/prefetch
        # when kubelet pulls its image (tests/cri/test_prefetch_annotation.py):
        # the checkpoint's prefetch starts with the pull.
        asked = subprocess.Popen(
            node.argv("hdfs-fuse prefetch", "--quiet", str(node.checkpoint_mount / CHECKPOINT_NAME)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        pulled = subprocess.run(
            node.node.pull_command(rnd.ref), capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False
        )
        pull_end = time.time()
        answer, _ = asked.communicate(timeout=STEP_TIMEOUT)
        if asked.returncode != 0:
            raise RuntimeError(f"bootseer hdfs-fuse prefetch failed:\n{answer}")
        if pulled.returncode != 0:
            raise RuntimeError(f"bootseer pull failed:\n{pulled.stdout}\n{pulled.stderr}")
        env = {
            **_job_env(self.work, "depsnap", f"{CHECKPOINT_DIR}/{CHECKPOINT_NAME}"),
            **_pip_env(self.servers),
            "JOB_PREFETCH_XATTR": prefetch_client.XATTR,
        }
        mounts = (
            BindMount(node.socket_dir, SOCKET_DIR, read_only=True),
            BindMount(node.checkpoint_mount, CHECKPOINT_DIR, read_only=True, propagation="rslave"),
        )
        output = _run_job(node.node.containerd, "bootseer", rnd.ref, cid, env, mounts, keep=True)
        expected = "depsnap: miss" if mode == "bootseer-first" else "depsnap: hit"
        if expected not in output:
            raise RuntimeError(f"{mode}: expected `{expected}` from the pod client:\n{output[-3000:]}")
        return output, pull_end

    def _report(self, node: JobNode, cid: str) -> dict[str, Any]:
        c = node.node.containerd
        done = node.bootseer("report", "--json", "--address", str(c.address), "--namespace", c.namespace, cid)
        if done.returncode != 0:
            raise RuntimeError(f"bootseer report failed:\n{done.stdout}\n{done.stderr}")
        (rep,) = json.loads(done.stdout)["containers"]
        return {
            k: rep[k] for k in ("wall_s", "totals", "segments", "start", "consistency", "fetch", "deps", "checkpoint")
        }

    def _publish(self, node: JobNode, ref: str, before: int) -> None:
        """End the first start's recording at its first step, as a job's
        wrapper does at its ready point, and wait for the manifest to reach
        the registry (after the timed part): the idle window that ends a
        recording by itself ([fs] record_idle_s) can close during a long pip
        install in the pod, before the job imports torch."""
        done = node.bootseer("record stop", ref, "--plain-http")
        if done.returncode != 0:
            raise RuntimeError(f"bootseer record stop saved no hot-block manifest:\n{done.stdout}\n{done.stderr}")
        deadline = time.monotonic() + STEP_TIMEOUT
        while uploaded_hot_manifests(self.servers.registry, self.work.manifest_digest) == before:
            if time.monotonic() > deadline:
                raise RuntimeError("the first start's hot-block manifest never reached the registry")
            time.sleep(0.5)


def _prepare_warm(bench_servers: Servers, work: Workload, scratch: Path) -> tuple[Containerd, str, Path]:
    """The warm node: the image pulled and unpacked, the environment
    installed by the same pip run the job makes, outside the timed runs."""
    warm = _plain_containerd()
    ref = f"{bench_servers.registry.host}/bench/job-warm:v1"
    push(work.layout, ref)
    warm.ctr("images", "pull", "--plain-http", "--snapshotter", "overlayfs", ref, timeout=STEP_TIMEOUT)
    env_dir = scratch / "warm-env"
    env_dir.mkdir()
    install = (
        f"/usr/bin/python3 -m venv {ENV_TARGET} && "
        f"{ENV_TARGET}/bin/python -m pip install --quiet -r /app/requirements.txt"
    )
    args = ["run", "--rm", "--net-host", "--snapshotter", "overlayfs", "--mount"]
    args.append(BindMount(env_dir, ENV_TARGET).ctr_arg())
    for name, value in _pip_env(bench_servers).items():
        args += ["--env", f"{name}={value}"]
    warm.ctr(*args, ref, "job-warm-install", "/bin/sh", "-c", install, timeout=STEP_TIMEOUT)
    return warm, ref, env_dir


# -- results -------------------------------------------------------------------------


def plot(summary: dict[str, dict[str, Any]], fresh: Run | None, limit: float | None, path: Path) -> None:
    fig, (bars, timeline) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]})
    modes = [m for m in MODES if m in summary]
    colours = {p: plt.get_cmap("tab10")(i) for i, p in enumerate(PHASES)}
    for row, mode in enumerate(modes):
        left = 0.0
        for p in PHASES:
            seconds = float(summary[mode]["phases"][p])
            bars.barh(row, seconds, left=left, color=colours[p], label=p if row == 0 else None)
            left += seconds
        bars.text(left + 1, row, f"{summary[mode]['median_s']:.1f} s", va="center", fontsize="small")
    if limit:
        bars.axvline(limit, color="black", linestyle="--", linewidth=1, label=f"limit {limit:.1f} s")
    bars.set_yticks(range(len(modes)), modes)
    bars.invert_yaxis()
    bars.set_xlabel("seconds from 'pull begins' to the first training step (medians)")
    bars.legend(loc="lower right", fontsize="small", ncol=2)
    bars.set_title("One training job's start: image + pip dependencies + checkpoint, 1 Gbit/s link")
    if fresh is not None and fresh.report:
        segments = fresh.report["segments"]
        start = float(fresh.report["start"])
        names = list(dict.fromkeys(s["name"] for s in segments))
        tab = plt.get_cmap("tab20")
        for s in segments:
            row = names.index(s["name"])
            timeline.barh(row, s["seconds"], left=float(s["start"]) - start, color=tab(row % 20))
        timeline.set_yticks(range(len(names)), names)
        timeline.invert_yaxis()
        timeline.set_xlabel("seconds from the pull (bootseer-fresh-node, `bootseer report` segments)")
    else:
        timeline.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="rounds; each runs every mode once")
    parser.add_argument("--checkpoint-mib", type=int, default=2048, help="checkpoint size (MiB)")
    parser.add_argument("--per-stream", default="25m", help="the checkpoint server's limit per connection")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--quick", action="store_true", help="small image, 256 MiB checkpoint, 3 packages, 1 round")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {', '.join(sorted(unknown))}")
    if "bootseer-fresh-node" in modes and "bootseer-first" not in modes:
        parser.error("bootseer-fresh-node needs bootseer-first (it starts where the first left off)")
    requirements, imports = (QUICK_REQUIREMENTS, QUICK_IMPORTS) if args.quick else (REQUIREMENTS, IMPORTS)
    if args.quick:
        args.runs, args.checkpoint_mib = 1, 256
    WORKDIR.mkdir(parents=True, exist_ok=True)

    built = image.build(image.QUICK if args.quick else image.FULL, log)
    layout = _job_layout(built, requirements, log)
    checkpoint, head = _checkpoint(args.checkpoint_mib, log)
    work = Workload(
        layout=layout,
        manifest_digest=ocidir.manifest_digest(layout),
        image_bytes=sum(layout.layer_sizes),
        wheels=_wheelhouse(requirements, log),
        checkpoint=checkpoint,
        checkpoint_bytes=checkpoint.stat().st_size,
        head_sha256=head,
        imports=imports,
    )
    log(
        f"image {work.image_bytes / 1e9:.2f} GB compressed, {len(layout.layer_sizes)} layers; "
        f"{len(requirements)} requirements; checkpoint {work.checkpoint_bytes / 1e9:.2f} GB at {args.per_stream}B/s "
        "per stream"
    )
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=WORKDIR))
    by_mode: dict[str, list[Run]] = {m: [] for m in modes}
    try:
        with servers(work, args.per_stream, scratch) as s:
            indexer = LazyConfig(scratch / "indexer", [s.registry.host])
            indexer.workdir.mkdir()
            indexer.write()
            warm = None
            try:
                warm_ref, warm_env = "", scratch
                if "warm" in modes:
                    log("preparing the warm node (image unpacked, environment installed)")
                    warm, warm_ref, warm_env = _prepare_warm(s, work, scratch)
                bench = Bench(work, s, warm, warm_ref, warm_env, indexer.path)
                for i in range(args.runs):
                    rnd = bench.new_round(i)
                    for mode in round_order(modes, i):
                        run = bench.run(mode, rnd)
                        by_mode[mode].append(run)
                        log(
                            f"round {i + 1}/{args.runs} {mode:20} first step at {run.first_step_s:7.2f} s, "
                            f"{run.bytes_over_link / 1e6:8.1f} MB over the link"
                        )
            finally:
                if warm is not None:
                    left = warm.stop()
                    if left:
                        log(f"warning: mounts left behind: {left}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary = {m: summarise(rs) for m, rs in by_mode.items() if rs}
    medians = {m: float(s["median_s"]) for m, s in summary.items()}
    bytes_per_s = LINK_MBIT * 1e6 / 8
    limit = None
    if "warm" in summary and "bootseer-fresh-node" in summary:
        moved = float(summary["bootseer-fresh-node"]["bytes_over_link"])
        limit = round(limit_s(medians["warm"], moved, bytes_per_s), 3)
    ratio = ratios(medians, limit)
    representative = {m: sorted(rs, key=lambda r: r.first_step_s)[len(rs) // 2] for m, rs in by_mode.items() if rs}
    fresh = representative.get("bootseer-fresh-node")
    results = {
        "link": {"rate_mbit": LINK_MBIT, "shaper": "tc htb on the veth to the servers' namespace"},
        "checkpoint": {"bytes": work.checkpoint_bytes, "per_stream_limit": args.per_stream},
        "image": {"compressed_bytes": work.image_bytes, "layers": len(layout.layer_sizes), "name": built.spec.name},
        "requirements": list(requirements),
        "runs_per_mode": args.runs,
        "modes": summary,
        "runs": {m: [r.to_json() for r in rs] for m, rs in by_mode.items()},
        "limit_s": limit,
        "ratios": ratio,
        "targets": TARGETS,
        "note": "2-core VM; figures depend on what else shares it (load average in `machine`)",
    }
    out = report.write(NAME, results)
    png = report.RESULTS / f"{NAME}.png"
    plot(summary, fresh, limit, png)
    print(f"\n{'mode':22}{'first step s':>14}{'MB over link':>14}")
    for m, s_ in summary.items():
        print(f"{m:22}{s_['median_s']:>14.2f}{float(s_['bytes_over_link']) / 1e6:>14.1f}")
    print(f"limit (warm + fresh node's bytes / link): {limit} s")
    for key, value in ratio.items():
        target = TARGETS.get(key)
        print(f"  {key} = {value}" + (f" (target <= {target})" if target else ""))
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
