"""`bootseer report`'s analysis on records as the daemons write them: the
segments partition the window, the JSON schema, the plot; and the layer
server's per-image summaries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import eventlog
from bootseer.commands import report
from eventlog import startreport
from snapshotter.fs.metrics import ImageStarts

CID = "job-1"
IMAGE = "127.0.0.1:5000/train/model:v1"
MANIFEST = "sha256:" + "m" * 64
T = 1_700_000_000.0


def rec(kind: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "daemon": "d", "pid": 1, "kind": kind, **fields}


def records() -> list[dict[str, Any]]:
    layer = {"layer": "sha256:" + "l" * 64, "target": "sha256:c", "how": "remote", "bytes": 0, "size": 10}
    return [
        rec(
            "pull",
            T + 2.0,
            image=IMAGE,
            manifest=MANIFEST,
            start=T,
            resolved=T + 0.5,
            end=T + 2.0,
            layers=[{**layer, "start": T + 0.5, "end": T + 1.5}],
        ),
        rec(
            "prepare",
            T + 1.5,
            image_ref=IMAGE,
            manifest=MANIFEST,
            layer=layer["layer"],
            target="sha256:c",
            path="lazy",
            reason="served",
            error="",
            start=T + 0.6,
            end=T + 1.4,
        ),
        rec(
            "fs.image",
            T - 5,
            image=MANIFEST,
            reads={"hit": 1, "prefetched": 0, "prefetch_wait": 0, "miss": 1},
            fetched_bytes=100,
            prefetched_bytes=0,
            prefetched_blocks=0,
            waits=1,
            wait_s=0.1,
            stalled_s=0.1,
            waiting=0,
            episodes=[[T - 6, T - 5.9]],
        ),
        rec(
            "depsnap.pod",
            T + 4.0,
            op="pod-attach",
            outcome="miss",
            key="k" * 64,
            target="/opt/env",
            start=T + 3.9,
            end=T + 4.0,
            cgroup=f"/default/{CID}",
        ),
        rec(
            "depsnap.pod",
            T + 7.0,
            op="pod-capture",
            outcome="captured",
            key="k" * 64,
            target="/opt/env",
            start=T + 6.5,
            end=T + 7.0,
            cgroup=f"/default/{CID}",
        ),
        rec(
            "hdfs_fuse.file",
            T + 9.0,
            uri="hdfs://x/ckpt",
            served_bytes=2_000_000,
            fetched_bytes=2_000_000,
            start=T + 7.5,
            end=T + 9.0,
            cgroup=f"/default/{CID}",
        ),
        rec(
            "fs.image",
            T + 5.0,
            image=MANIFEST,
            reads={"hit": 11, "prefetched": 5, "prefetch_wait": 1, "miss": 3},
            fetched_bytes=900,
            prefetched_bytes=500,
            prefetched_blocks=5,
            waits=4,
            wait_s=0.9,
            stalled_s=0.6,
            waiting=0,
            episodes=[[T + 3.0, T + 3.5], [T + 4.5, T + 4.6]],
        ),
        rec(
            "hdfs_fuse.prefetch",
            T + 8.0,
            uri="hdfs://x/ckpt",
            outcome="handed-over",
            pushed_bytes=1_500_000,
            size=2_000_000,
            start=T + 3.0,
            end=T + 8.0,
            cgroup=f"/default/{CID}",
        ),
        rec("hdfs_fuse.file", T + 9.5, uri="other", served_bytes=1, start=T + 8, end=T + 9.5, cgroup="/default/x"),
        rec("mark", T + 10.0, name="ready", cgroup=f"/default/{CID}", caller_pid=5),
        rec("mark", T + 11.0, name="ready", container=CID),
    ]


def build() -> startreport.StartReport:
    return startreport.build(startreport.Container(CID, IMAGE, T + 2.5), records(), "ready", 600.0, report.same_image)


def test_segments_partition_the_window_from_pull_to_ready() -> None:
    rep = build()
    assert rep.began_with == "pull" and rep.ready_mark
    assert rep.start == T and rep.end == T + 10.0
    assert sum(s.seconds for s in rep.segments) == pytest.approx(rep.wall_s, abs=startreport.TOLERANCE_S)
    # Back to back, in order.
    for a, b in zip(rep.segments, rep.segments[1:], strict=False):
        assert a.end == b.start
    totals = rep.totals()
    assert totals["pull: resolve"] == pytest.approx(0.5)
    assert totals["pull: layers"] == pytest.approx(1.0)
    assert totals["scheduling"] == pytest.approx(0.5)
    assert totals["deps: install"] == pytest.approx(3.1)  # the attach's miss to the capture's end
    assert totals["checkpoint"] == pytest.approx(1.5)  # only this container's file
    # The wait at 4.5 s falls in the install, which ranks first; the one at 3 s is its own.
    assert totals["image fetch wait"] == pytest.approx(0.5)
    assert rep.fetch["reads"] == {"hit": 10, "prefetched": 5, "prefetch_wait": 1, "miss": 2}
    assert rep.fetch["hit_ratio"] == pytest.approx(15 / 18, abs=1e-3)
    assert rep.fetch["fetched_bytes"] == 800
    assert rep.checkpoint["served_bytes"] == 2_000_000
    # The prefetch ran beside the start: counted, but no time of its own.
    assert rep.checkpoint["prefetches"] == 1 and rep.checkpoint["prefetched_bytes"] == 1_500_000
    assert [x["path"] for x in rep.layers] == ["lazy"]


def test_json_schema() -> None:
    doc = build().to_json()
    assert set(doc) >= {
        "container",
        "image",
        "manifests",
        "start",
        "created",
        "end",
        "began_with",
        "ready_mark",
        "wall_s",
        "segments",
        "totals",
        "consistency",
        "layers",
        "fetch",
        "deps",
        "checkpoint",
    }
    assert all(set(s) == {"name", "start", "end", "seconds"} for s in doc["segments"])
    assert doc["consistency"]["sum_s"] == pytest.approx(doc["wall_s"], abs=startreport.TOLERANCE_S)
    json.dumps(doc)
    node = startreport.node_summary([build(), build()])
    assert node["containers"] == 2 and node["wall_s"] == pytest.approx(20.0)


def test_without_pull_or_mark_the_window_is_creation_to_the_last_record() -> None:
    recs = [r for r in records() if r["kind"] not in ("pull", "prepare", "mark")]
    rep = startreport.build(startreport.Container(CID, IMAGE, T + 2.5), recs, "ready", 600.0, report.same_image)
    assert rep.began_with == "create" and not rep.ready_mark
    assert rep.start == T + 2.5 and rep.end == T + 9.0
    assert sum(s.seconds for s in rep.segments) == pytest.approx(rep.wall_s, abs=startreport.TOLERANCE_S)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "start.png"
    report.plot([build(), build()], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(report.CommandError, match=r"bootseer\[bench\]"):
        report.plot([build()], tmp_path / "x.png")


def test_image_summaries_carry_stalls_and_reads(tmp_path: Path) -> None:
    eventlog.configure(tmp_path, "layer-server")
    try:
        starts = ImageStarts()
        starts.announce(MANIFEST, ["sha256:a"])
        starts.read("sha256:a", "miss")
        starts.read("sha256:a", "hit")
        starts.read("sha256:unknown", "hit")  # no image: totals only
        starts.wait_began("sha256:a")
        starts.wait_began("sha256:a")
        starts.wait_ended("sha256:a", 0.2)
        starts.flush()  # one reader still waits: its stall is not closed yet
        starts.wait_ended("sha256:a", 0.3)
        starts.fetched(MANIFEST, 1000, prefetched=True)
        starts.flush()
        starts.flush()  # nothing changed: nothing written
    finally:
        eventlog.configure(None, "x")
    first, second = [r for r in eventlog.read(tmp_path) if r["kind"] == "fs.image"]
    assert first["waiting"] == 1 and first["episodes"] == []
    assert second["reads"] == {"hit": 1, "prefetched": 0, "prefetch_wait": 0, "miss": 1}
    assert second["waits"] == 2 and second["wait_s"] == pytest.approx(0.5)
    assert len(second["episodes"]) == 1 and second["prefetched_bytes"] == 1000
    a, b = second["episodes"][0]
    assert b - a == pytest.approx(second["stalled_s"], abs=1e-3)
