"""Hot-block manifests kept on the node, in LMDB beside the block index, so a
node that recorded or fetched one has it without asking the registry."""

from __future__ import annotations

from pathlib import Path

import lmdb

from recorder.manifest import HotManifest, ManifestError


class LocalManifests:
    def __init__(self, path: Path, readonly: bool = False) -> None:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=1 << 30, readonly=readonly, lock=not readonly)

    def get(self, image: str) -> HotManifest | None:
        with self._env.begin() as txn:
            data = txn.get(image.encode())
        if data is None:
            return None
        try:
            return HotManifest.decode(bytes(data))
        except ManifestError:
            return None

    def put(self, manifest: HotManifest) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(manifest.image.encode(), manifest.encode())

    def close(self) -> None:
        self._env.close()
