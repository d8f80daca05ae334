"""The layer store shared by the snapshotter (which adds layers) and the FUSE
layer server (which serves them):

    STORE/<hex>/index        the verified layer index
    STORE/<hex>/source.json  where the blob lives: {"ref": "host/repo", "digest": "sha256:..."}
    STORE/<hex>/cache        uncompressed layer bytes, filled block by block (sparse)
    STORE/blocks.lmdb/       the block index: (layer, block) -> place and state

A layer directory appears complete or not at all: it is written under a
temporary name and renamed, so the server never loads half a layer.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from snapshotter.layer.index import LayerIndex

INDEX = "index"
SOURCE = "source.json"
CACHE = "cache"


@dataclass(frozen=True)
class LayerSource:
    ref: str  # host/repository the blob can be fetched from
    digest: str


def layer_name(digest: str) -> str:
    """The directory name of a layer: its digest's hex. Also its name in the mount."""
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64:
        raise ValueError(f"unsupported layer digest {digest!r}")
    return hexpart


class LayerStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        return self.root / name

    def has(self, digest: str) -> bool:
        return (self.path(layer_name(digest)) / INDEX).exists()

    def add(self, index: LayerIndex, source: LayerSource, encoded: bytes) -> Path:
        """Store a layer (index already verified); idempotent."""
        final = self.path(layer_name(index.layer_digest))
        if (final / INDEX).exists():
            return final
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=self.root))
        try:
            (staging / INDEX).write_bytes(encoded)
            (staging / SOURCE).write_text(json.dumps({"ref": source.ref, "digest": source.digest}))
            with open(staging / CACHE, "wb") as cache:
                cache.truncate(index.uncompressed_size)
                os.fsync(cache.fileno())
            os.chmod(staging, 0o700)
            os.rename(staging, final)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            # Another Prepare of the same layer won the race; its copy is as good.
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def load(self, name: str) -> tuple[LayerIndex, LayerSource]:
        directory = self.path(name)
        index = LayerIndex.decode((directory / INDEX).read_bytes())
        source = json.loads((directory / SOURCE).read_text())
        if layer_name(index.layer_digest) != name:
            raise ValueError(f"layer {name} holds the index of {index.layer_digest}")
        return index, LayerSource(ref=source["ref"], digest=source["digest"])

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / INDEX).exists()
        )
