"""Inode numbers keep their meaning across layer-server processes: a new
server over the same store answers an inode number an earlier one gave out
(as the kernel may ask after a takeover of a live mount), never reuses a
slot, and finds nothing for a pruned layer's inode numbers."""

from __future__ import annotations

import errno
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from snapshotter.fs import fusewire
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.layerfs import SLOT_SHIFT, LayerFS
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.slots import SlotTable
from tests.fs.conftest import Blob, Mounted, add_layer, make_layer, unmount

pytestmark = pytest.mark.integration


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _server(store: LayerStore, blobs: dict[str, Blob]) -> LayerFS:
    """A second layer server over the store, as a new process would start
    (it answers requests directly here: no second mount)."""
    return LayerFS(store, BlockIndex(store.block_index_path), lambda source: blobs[source.digest].fetch)


def test_a_new_server_answers_the_inode_numbers_an_earlier_one_gave(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    first, second = (make_layer([_file("data.bin", bytes([n]) * 300_000)]) for n in (1, 2))
    digests = [add_layer(store, tmp_path, blob, 64 << 10) for blob in (first, second)]
    blobs = {d: Blob(b) for d, b in zip(digests, (first, second), strict=True)}
    m = mount_layers(blobs, store.root)
    # Looked up in the order second, first: slots follow load order.
    inodes = {d: os.stat(m.layer(d) / "data.bin").st_ino for d in reversed(digests)}
    unmount(m)

    server = _server(store, blobs)

    async def ask() -> None:
        for digest, ino in inodes.items():
            attr = await server.getattr(ino, None)
            assert attr.st_ino == ino and attr.st_size == 300_000
            # Files are opened without OPEN (it answers ENOSYS): reads name the inode.
            assert await server.read(ino, 0, 4) == bytes([1 if digest == digests[0] else 2]) * 4
        # A slot no process gave out finds nothing.
        with pytest.raises(fusewire.FUSEError) as nothing:
            await server.getattr((max(i >> SLOT_SHIFT for i in inodes.values()) + 1) << SLOT_SHIFT | 2, None)
        assert nothing.value.errno == errno.ENOENT

    trio.run(ask)
    server.close()
    table = SlotTable.load(store.slots_path)
    assert sorted(s for _, _, s in table.copies()) == sorted(i >> SLOT_SHIFT for i in inodes.values())


def test_a_pruned_layers_inode_numbers_find_nothing_and_its_slot_is_never_reused(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    old = make_layer([_file("old.bin", b"o" * 1000)])
    digest = add_layer(store, tmp_path, old, 64 << 10)
    m = mount_layers({digest: Blob(old)}, store.root)
    ino = os.stat(m.layer(digest) / "old.bin").st_ino
    unmount(m)
    store.prune(set(), older_than_s=0)
    new = make_layer([_file("new.bin", b"n" * 1000)])
    new_digest = add_layer(store, tmp_path, new, 64 << 10)
    server = _server(store, {new_digest: Blob(new)})

    async def ask() -> None:
        with pytest.raises(fusewire.FUSEError) as gone:
            await server.getattr(ino, None)
        assert gone.value.errno == errno.ENOENT
        attr = await server.lookup(fusewire.ROOT_INODE, new_digest.split(":")[1].encode(), None)
        assert attr.st_ino >> SLOT_SHIFT > ino >> SLOT_SHIFT

    trio.run(ask)
    server.close()


def test_an_unreadable_slot_table_is_set_aside_and_slots_start_far_above(tmp_path: Path) -> None:
    path = tmp_path / "slots.json"
    path.write_text("{not json")
    table = SlotTable.load(path)
    assert (tmp_path / "slots.json.bad").exists() and not path.exists()
    assert table.assign("a" * 64, "g") >= 1 << 30
    assert SlotTable.load(path).get("a" * 64, "g") == table.get("a" * 64, "g")
