"""`bootseer report` on a container that ran on a real lazy node (layer
server, snapshotter, containerd, registry): its segments are there and add
up to the wall time the test measured from outside. A consistency check,
not a timing one: nothing here says how fast anything must be."""

from __future__ import annotations

import itertools
import json
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventlog.startreport import TOLERANCE_S
from tests.harness.containerd import Containerd, start_containerd
from tests.harness.layerserver import LayerServer, LazyConfig
from tests.harness.lazynode import LazyNode, _stop
from tests.harness.oci import Dir, File, ImageBuilder, busybox_layer
from tests.harness.registry import Registry
from tests.harness.snapshotter import Snapshotter, start_snapshotter

pytestmark = pytest.mark.integration

# The window's ends are the pull's start (recorded inside `bootseer pull`,
# after its interpreter started) and the mark's time (recorded before the
# `bootseer report --mark` process exits): both lie within what the test
# measures around them, short of each command's start-up and exit.
COMMAND_OVERHEAD_S = 5.0


@pytest.fixture(scope="module")
def node(registry: Registry) -> Iterator[LazyNode]:
    config = LazyConfig(
        Path(tempfile.mkdtemp(prefix="bs-rep-", dir="/tmp")),
        [registry.host],
        events_max_bytes=1048576,
        events_summary_interval_s=0.2,
    )
    config.write()
    started: list[LayerServer | Snapshotter | Containerd] = []
    try:
        layers = LayerServer(config)
        started.append(layers)
        layers.start()
        snapshotter = start_snapshotter(["--config", str(config.path)])
        started.append(snapshotter)
        containerd = start_containerd(snapshotter.address)
        started.append(containerd)
        yield LazyNode(layers, snapshotter, containerd)
    finally:
        leftovers = _stop(started)
        assert not leftovers, f"mounts left behind: {leftovers}"


def test_report_of_a_container_that_ran(node: LazyNode, images: ImageBuilder, unique: str, tmp_path: Path) -> None:
    rng = random.Random(unique)
    parts = [File(f"/model/part-{i}.bin", rng.randbytes(1 << 20)) for i in range(8)]
    image = images.push(
        f"report/model-{unique}",
        [busybox_layer(), [Dir("/model"), *parts]],
        cmd=["/bin/sh", "-c", "cat /model/part-*.bin > /dev/null; echo READY"],
    )
    node.index(image.ref)
    cid = f"rep-{unique}"
    c = node.containerd

    before = time.time()
    node.pull(image.ref)
    # Not --rm: the report asks containerd for the container afterwards.
    assert "READY" in c.ctr("run", "--snapshotter", "bootseer", image.ref, cid).stdout
    node.bootseer("report", "--mark", "ready", "--address", str(c.address), "--namespace", c.namespace, cid)
    after = time.time()
    try:
        time.sleep(0.5)  # the layer server's last summary (every 0.2 s here)
        args = ("report", "--address", str(c.address), "--namespace", c.namespace, cid)
        doc = json.loads(node.bootseer(*args, "--json").stdout)
        (rep,) = doc["containers"]
        assert doc["schema"] == 1 and rep["container"] == cid
        assert rep["began_with"] == "pull" and rep["ready_mark"]

        # The segments cover the window back to back and add up to it...
        segments = rep["segments"]
        for a, b in itertools.pairwise(segments):
            assert a["end"] == pytest.approx(b["start"], abs=1e-6)
        total = sum(s["seconds"] for s in segments)
        assert total == pytest.approx(rep["wall_s"], abs=TOLERANCE_S)
        # ...and the window is the wall time measured out here, less command start-up.
        measured = after - before
        assert before <= rep["start"] <= rep["created"] <= rep["end"] <= after
        assert measured - COMMAND_OVERHEAD_S <= rep["wall_s"] <= measured, (measured, rep)

        names = {s["name"] for s in segments}
        assert {"pull: resolve", "pull: layers", "job"} <= names
        assert [x["path"] for x in rep["layers"]] == ["lazy", "lazy"]
        # The container read every block of the model: all of them counted for its image.
        assert sum(rep["fetch"]["reads"].values()) > 0 and rep["fetch"]["fetched_bytes"] > 0

        table = node.bootseer(*args).stdout
        assert cid in table and "pull: layers" in table and "total" in table
        png = tmp_path / "start.png"
        node.bootseer(*args, "--plot", str(png))
        assert png.read_bytes()[:4] == b"\x89PNG"

        # Across the node: the sum of every container's start.
        node_doc = json.loads(
            node.bootseer("report", "--address", str(c.address), "--namespace", c.namespace, "--all", "--json").stdout
        )
        assert node_doc["node"]["containers"] >= 1
        assert node_doc["node"]["wall_s"] >= rep["wall_s"] - TOLERANCE_S

        # Bounded: every daemon's records stay under [events] max_bytes.
        events = node.layers.config.events_dir
        assert {p.name for p in events.iterdir()} >= {"snapshotter.jsonl", "layer-server.jsonl"}
        # The snapshotter ran the pull (its pull socket): the record is in its file.
        records = [json.loads(line) for line in (events / "snapshotter.jsonl").read_text().splitlines()]
        assert [r["image"] for r in records if r["kind"] == "pull"] == [image.ref]
        assert all(p.stat().st_size <= 1048576 for p in events.iterdir())
    finally:
        c.ctr("containers", "rm", cid, check=False)
