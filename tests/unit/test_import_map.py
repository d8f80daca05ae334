"""Dependencies run one way (README, Development): the parts are libraries
and daemons under the `bootseer` application, the pure layer-index core
imports nothing else, and the hot-block recorder is wired into the layer
server in one place only."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("bootseer", "snapshotter", "recorder", "depsnap", "hdfs_fuse", "eventlog")
# Which parts each part may import (itself always). `eventlog`, the daemons'
# event records for `bootseer report`, is the bottom: everyone may use it,
# it uses no part.
ALLOWED = {
    "bootseer": {"snapshotter", "recorder", "depsnap", "hdfs_fuse", "proto", "eventlog"},
    "snapshotter": {"recorder", "hdfs_fuse", "proto", "eventlog"},
    "recorder": {"snapshotter", "eventlog"},
    "depsnap": {"hdfs_fuse", "eventlog"},
    "hdfs_fuse": {"eventlog"},
    "eventlog": set(),
}
# The layer server's composition root: the only module of the snapshotter
# that sees the recorder.
RECORDER_WIRING = "snapshotter/fs/server.py"


def _imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _modules(part: str) -> list[Path]:
    return sorted((ROOT / part).rglob("*.py"))


@pytest.mark.parametrize("part", PARTS)
def test_parts_import_only_what_they_may(part: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(part)
        for name in _imports(path)
        if (top := name.split(".")[0]) in {*PARTS, "proto"} and top != part and top not in ALLOWED[part]
    ]
    assert wrong == []


def test_only_the_layer_server_root_wires_in_the_recorder() -> None:
    wiring = [
        str(path.relative_to(ROOT))
        for path in _modules("snapshotter")
        if any(name.split(".")[0] == "recorder" for name in _imports(path))
    ]
    assert wiring == [RECORDER_WIRING]


# The pure core below the layer index: OCI descriptors are records too.
LAYER_CORE_MAY_IMPORT = ("snapshotter.layer", "snapshotter.registry.media")


def test_the_layer_index_core_imports_nothing_but_pure_records() -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules("snapshotter/layer")
        for name in _imports(path)
        if name.split(".")[0] in {*PARTS, "proto"} and not name.startswith(LAYER_CORE_MAY_IMPORT)
    ]
    assert wrong == []
