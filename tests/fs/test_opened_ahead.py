"""A layer's stored index decoded ahead of the layer's load (control.open_ahead,
which the snapshotter sends as soon as it has stored an index): the load, in
the layer's Prepare, then takes that reader over and only builds the tree."""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from snapshotter.fs import control
from snapshotter.fs.layers import LayerStore
from tests.fs.conftest import Blob, Mounted, add_layer, make_layer, metric
from tests.fs.test_layerfs import SPAN, _cache_removed, _hardlink_to_nothing, info
from tests.harness.procs import wait_until


def _layer(tmp_path: Path) -> tuple[LayerStore, str, bytes, dict[str, bytes]]:
    """A layer of four files, each a block of its own or more."""
    rng = random.Random(7)
    files = {f"f{i}": rng.randbytes(SPAN + 1000) for i in range(4)}
    blob = make_layer([(info(name, size=len(data)), data) for name, data in files.items()])
    store = LayerStore(tmp_path / "store")
    return store, add_layer(store, tmp_path, blob, SPAN), blob, files


def _count_decodes(m: Mounted) -> list[str]:
    """Every decoding of a stored index by the server, by layer name."""
    loads: list[str] = []
    load = m.ops.store.load

    def counted(name: str) -> tuple[object, object]:
        loads.append(name)
        return load(name)

    m.ops.store.load = counted  # type: ignore[method-assign,assignment]
    return loads


def _opened(m: Mounted, name: str) -> bool:
    return any(o.name == name for o in m.ops.opened.values())


def _mount_and_open_ahead(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> tuple[Mounted, LayerStore, str, dict[str, bytes], list[str]]:
    """The layer of _layer mounted and opened ahead (the lookup is answered
    at once, as a name that is not there; the decoding goes on): the mount,
    the store, the layer's name, its files, and every index decoding."""
    store, digest, blob, files = _layer(tmp_path)
    name = digest.split(":")[1]
    m = mount_layers({digest: Blob(blob)}, tmp_path / "store")
    decodes = _count_decodes(m)
    control.open_ahead(m.mountpoint, name)
    wait_until(lambda: _opened(m, name), 10, "the layer opened ahead")
    return m, store, name, files, decodes


def test_a_layer_opened_ahead_is_loaded_with_that_reader_and_its_index_decoded_once(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    m, _, name, files, decodes = _mount_and_open_ahead(mount_layers, tmp_path)
    # Opened, not loaded (no tree, no slot), and nothing fetched.
    assert name not in m.ops.layers_by_name
    (blob,) = m.blobs.values()
    assert blob.fetched == []
    (opened,) = m.ops.opened.values()

    assert {f: (m.mountpoint / name / f).read_bytes() for f in files} == files
    assert m.ops.layers_by_name[name].reader is opened.reader
    assert decodes == [name]
    assert not m.ops.opened


@pytest.mark.parametrize("bad", ["zz", "A" * 64, "0" * 63, "../" + "0" * 61])
def test_opening_ahead_a_name_that_is_no_layer_does_nothing(
    mount_layers: Callable[..., Mounted], tmp_path: Path, bad: str
) -> None:
    _, digest, blob, _ = _layer(tmp_path)
    m = mount_layers({digest: Blob(blob)}, tmp_path / "store")
    before = metric("bootseer_fs_layer_load_errors_total")
    with pytest.raises(OSError) as exc:
        os.stat(m.mountpoint / (control.OPEN_PREFIX + bad))
    assert exc.value.errno in (errno.ENOENT, errno.ENOTDIR)
    # A layer the store does not hold: nothing to open, nothing refused.
    control.open_ahead(m.mountpoint, "f" * 64)
    m.sweep()
    assert not m.ops.opened and not m.ops.layers_by_name
    assert metric("bootseer_fs_layer_load_errors_total") == before


def test_a_layer_opened_ahead_and_never_loaded_is_closed_once_pruned(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    m, store, name, _, _ = _mount_and_open_ahead(mount_layers, tmp_path)
    (opened,) = m.ops.opened.values()
    m.sweep()
    # Kept: the store holds the copy, and its Prepare may come yet.
    assert not opened.reader.closed

    # As the snapshotter's prune does (which opens the block index, as this
    # in-process server has it open already).
    shutil.rmtree(store.path(name))
    m.sweep()
    assert opened.reader.closed
    assert not m.ops.opened


@pytest.mark.parametrize("damage", [_hardlink_to_nothing, _cache_removed], ids=["hardlink-to-nothing", "cache-removed"])
def test_a_layer_that_cannot_be_served_is_refused_once_whether_opened_ahead_or_loaded(
    mount_layers: Callable[..., Mounted], tmp_path: Path, damage: Callable[[LayerStore, str], None]
) -> None:
    """An index that decodes but builds no tree is refused by the load,
    which closes the reader opened ahead; one whose copy cannot be opened is
    refused by the opening. Either way once, and never decoded again."""
    store, digest, blob, _ = _layer(tmp_path)
    bad_blob = make_layer([(info("target", size=1), b"t"), (info("link"), b"")])
    bad = add_layer(store, tmp_path, bad_blob, SPAN)
    bad_name = bad.split(":")[1]
    damage(store, bad_name)
    m = mount_layers({digest: Blob(blob), bad: Blob(bad_blob)}, tmp_path / "store")
    decodes = _count_decodes(m)
    before = metric("bootseer_fs_layer_load_errors_total")

    control.open_ahead(m.mountpoint, bad_name)
    wait_until(lambda: _opened(m, bad_name) or bad_name in m.ops.unloadable, 10, "the bad layer opened or refused")
    for _ in range(2):
        with pytest.raises(OSError) as exc:
            os.stat(m.layer(bad))
        assert exc.value.errno == errno.EIO
    control.open_ahead(m.mountpoint, bad_name)
    m.sweep()

    assert metric("bootseer_fs_layer_load_errors_total") == before + 1
    assert decodes.count(bad_name) == 1
    assert not m.ops.opened
    assert os.listdir(m.mountpoint) == [digest.split(":")[1]]
