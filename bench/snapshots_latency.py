"""Snapshot API latency through containerd: Prepare+Commit and Mounts, bootseer
against containerd's built-in overlayfs snapshotter, interleaved in one run.

Both go through containerd's own snapshots service (the path every pull and
container start takes), so the difference is the proxy hop plus bootseer's
own work. Run: `make bench-snapshots`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import grpc
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import report
from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from tests.harness.containerd import start_containerd
from tests.harness.snapshotter import start_snapshotter

SNAPSHOTTERS = ("overlayfs", "bootseer")
# containerd garbage-collects unreferenced snapshots; a root label keeps ours.
ROOT_LABEL = {"containerd.io/gc.root": "bench"}
TARGET_P50_RATIO = 3.0


@dataclass
class Samples:
    prepare_commit: list[float] = field(default_factory=list)
    mounts: list[float] = field(default_factory=list)


def _one_round(
    stub: pb_grpc.SnapshotsStub, meta: list[tuple[str, str]], name: str, i: int, base: str
) -> tuple[float, float]:
    key, committed, active = f"bench-{name}-{i}", f"bench-{name}-{i}-c", f"bench-{name}-{i}-a"
    start = time.perf_counter()
    stub.Prepare(
        pb.PrepareSnapshotRequest(snapshotter=name, key=key, parent=base, labels=ROOT_LABEL),
        metadata=meta,
    )
    stub.Commit(
        pb.CommitSnapshotRequest(snapshotter=name, name=committed, key=key, labels=ROOT_LABEL),
        metadata=meta,
    )
    prepare_commit = time.perf_counter() - start
    stub.Prepare(
        pb.PrepareSnapshotRequest(snapshotter=name, key=active, parent=committed, labels=ROOT_LABEL),
        metadata=meta,
    )
    start = time.perf_counter()
    stub.Mounts(pb.MountsRequest(snapshotter=name, key=active), metadata=meta)
    mounts = time.perf_counter() - start
    return prepare_commit, mounts


def run(iterations: int, warmup: int) -> dict[str, object]:
    snapshotter = start_snapshotter()
    containerd = start_containerd(snapshotter.address)
    try:
        containerd.wait_snapshotter()
        channel = grpc.insecure_channel(f"unix://{containerd.address}")
        stub = pb_grpc.SnapshotsStub(channel)
        meta = [("containerd-namespace", containerd.namespace)]
        samples = {name: Samples() for name in SNAPSHOTTERS}
        bases = {}
        for name in SNAPSHOTTERS:
            base = f"bench-{name}-base"
            stub.Prepare(pb.PrepareSnapshotRequest(snapshotter=name, key=base + "-x", labels=ROOT_LABEL), metadata=meta)
            stub.Commit(
                pb.CommitSnapshotRequest(snapshotter=name, name=base, key=base + "-x", labels=ROOT_LABEL), metadata=meta
            )
            bases[name] = base
        # Interleaved, so drift in the machine's load hits both alike.
        for i in range(warmup + iterations):
            for name in SNAPSHOTTERS:
                pc, mo = _one_round(stub, meta, name, i, bases[name])
                if i >= warmup:
                    samples[name].prepare_commit.append(pc)
                    samples[name].mounts.append(mo)
        channel.close()
    finally:
        containerd.stop()
        snapshotter.teardown()

    results: dict[str, object] = {
        "iterations": iterations,
        "snapshotters": {
            name: {
                "prepare_commit": report.summary_ms(s.prepare_commit),
                "mounts": report.summary_ms(s.mounts),
            }
            for name, s in samples.items()
        },
    }
    ratio = {
        op: round(
            results["snapshotters"]["bootseer"][op]["p50_ms"]  # type: ignore[index]
            / results["snapshotters"]["overlayfs"][op]["p50_ms"],  # type: ignore[index]
            2,
        )
        for op in ("prepare_commit", "mounts")
    }
    results["ratios"] = {f"{op}_p50_bootseer_vs_overlayfs": r for op, r in ratio.items()}
    results["target"] = f"p50 ratio <= {TARGET_P50_RATIO}"
    _plot(samples)
    return results


def _plot(samples: dict[str, Samples]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, op in zip(axes, ("prepare_commit", "mounts"), strict=True):
        data = [[x * 1000 for x in getattr(samples[n], op)] for n in SNAPSHOTTERS]
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(SNAPSHOTTERS) + 1), SNAPSHOTTERS)
        ax.set_title(op.replace("_", "+").capitalize() + " via containerd")
        ax.set_ylabel("latency (ms)")
    fig.tight_layout()
    fig.savefig(report.RESULTS / "snapshots.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    results = run(args.iterations, args.warmup)
    path = report.write("snapshots", results)
    print(f"{'':16}{'overlayfs p50/p99':>22}{'bootseer p50/p99':>22}{'ratio p50':>11}")
    for op in ("prepare_commit", "mounts"):
        o = results["snapshotters"]["overlayfs"][op]  # type: ignore[index]
        b = results["snapshotters"]["bootseer"][op]  # type: ignore[index]
        r = results["ratios"][f"{op}_p50_bootseer_vs_overlayfs"]  # type: ignore[index]
        print(
            f"{op:16}{o['p50_ms']:>10.2f} /{o['p99_ms']:>7.2f} ms"
            f"{b['p50_ms']:>10.2f} /{b['p99_ms']:>7.2f} ms{r:>10.2f}x"
        )
    print(f"wrote {path} and {report.RESULTS / 'snapshots.png'}")


if __name__ == "__main__":
    main()
