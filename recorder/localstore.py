"""Hot-block manifests kept on the node, in LMDB beside the block index, so a
node that recorded or fetched one has it without asking the registry.

Beside each manifest (key: the image digest) a small record (key
`meta:<image digest>`) says where the copy came from: `published`, the
registry artifact it is identical to ("" for a manifest only this node
has, one it recorded and did not push), and `includes`, the published
artifacts already merged into it, so that merging it with the registry's
again does not count their runs twice. A manifest stored before this
record existed reads as this node's own, which costs one registry lookup
on its next start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb

from recorder.manifest import HotManifest, ManifestError

META_PREFIX = b"meta:"


@dataclass(frozen=True)
class LocalManifest:
    manifest: HotManifest
    published: str = ""
    includes: tuple[str, ...] = ()


class LocalManifests:
    def __init__(self, path: Path, readonly: bool = False) -> None:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=1 << 30, readonly=readonly, lock=not readonly)

    def get(self, image: str) -> HotManifest | None:
        entry = self.entry(image)
        return entry.manifest if entry is not None else None

    def entry(self, image: str) -> LocalManifest | None:
        with self._env.begin() as txn:
            data = txn.get(image.encode())
            meta = txn.get(META_PREFIX + image.encode())
        if data is None:
            return None
        try:
            manifest = HotManifest.decode(bytes(data))
        except ManifestError:
            return None
        try:
            doc = json.loads(bytes(meta)) if meta is not None else {}
            return LocalManifest(manifest, str(doc.get("published", "")), tuple(map(str, doc.get("includes", ()))))
        except (ValueError, TypeError):
            return LocalManifest(manifest)

    def put(self, manifest: HotManifest, published: str = "", includes: Sequence[str] = ()) -> None:
        meta = json.dumps({"published": published, "includes": list(includes)}).encode()
        with self._env.begin(write=True) as txn:
            txn.put(manifest.image.encode(), manifest.encode())
            txn.put(META_PREFIX + manifest.image.encode(), meta)

    def close(self) -> None:
        self._env.close()
