"""The layer store shared by the snapshotter (which adds layers) and the FUSE
layer server (which serves them):

    STORE/<hex>/index        the verified layer index
    STORE/<hex>/source.json  where the blob lives, which copy this is and who
                             signed the index: {"ref": "host/repo", "digest":
                             "sha256:...", "generation": "<hex>", "signer":
                             "sha256:...", "signature": "<base64>"} (the last
                             two absent for an unsigned index)
    STORE/<hex>/cache        uncompressed layer bytes, filled block by block (sparse)
    STORE/<hex>/tree/        the layer unpacked, once every block is cached (fs.unpack)
    STORE/blocks.lmdb/       the block index: (layer copy, block) -> state and crc
    STORE/hot.lmdb/          hot-block manifests this node holds (recorder.localstore)
    STORE/images/<hex>.json  image requests to the layer server (fs.control)
    STORE/slots.json         each layer copy's slot in the mount (fs.slots)

A layer directory appears complete or not at all: it is written under a
temporary name and renamed, so the server never loads half a layer. Each
copy of a layer gets a new generation, and cached blocks are recorded per
generation: a layer removed and added again never inherits the old copy's
block records.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import structlog

from snapshotter.fs.blockindex import BlockIndex
from snapshotter.layer.index import IndexHeader, LayerIndex
from snapshotter.layer.signature import Signature

log = structlog.get_logger("bootseer.fs")

INDEX = "index"
# Prefix of a layer directory renamed away to be deleted.
_DOOMED = ".rm-"
SOURCE = "source.json"
CACHE = "cache"
TREE = "tree"
BLOCK_INDEX = "blocks.lmdb"
HOT_MANIFESTS = "hot.lmdb"
REQUESTS = "images"
SLOTS = "slots.json"


@dataclass(frozen=True)
class LayerSource:
    ref: str  # host/repository the blob can be fetched from
    digest: str
    generation: str = ""  # set by LayerStore.add
    # The index's signature as the registry carried it; the Prepare path
    # checks it against [trust] keys again before a stored copy is used.
    signature: Signature | None = None

    @property
    def cache_key(self) -> str:
        """The block index's name for this copy of the layer (hex)."""
        return copy_key(layer_name(self.digest), self.generation)


def copy_key(name: str, generation: str) -> str:
    """The block index's name for one copy of layer `name`."""
    return name + generation


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

    @property
    def block_index_path(self) -> Path:
        return self.root / BLOCK_INDEX

    @property
    def hot_manifests_path(self) -> Path:
        return self.root / HOT_MANIFESTS

    @property
    def slots_path(self) -> Path:
        return self.root / SLOTS

    def request_path(self, name: str) -> Path:
        return self.root / REQUESTS / f"{name}.json"

    def cache_path(self, name: str) -> Path:
        return self.path(name) / CACHE

    def tree_path(self, name: str) -> Path:
        return self.path(name) / TREE

    def has(self, digest: str) -> bool:
        return (self.path(layer_name(digest)) / INDEX).exists()

    def add(self, index: IndexHeader, source: LayerSource, encoded: bytes) -> Path:
        """Store a layer (its index's header checked: the layer server
        checks the whole index); idempotent."""
        final = self.path(layer_name(index.layer_digest))
        if (final / INDEX).exists():
            return final
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=self.root))
        try:
            (staging / INDEX).write_bytes(encoded)
            record = {"ref": source.ref, "digest": source.digest, "generation": uuid.uuid4().hex}
            if source.signature is not None:
                record |= {"signer": source.signature.signer, "signature": source.signature.encoded}
            (staging / SOURCE).write_text(json.dumps(record))
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

    def load(self, name: str, checkpoints: bool = True) -> tuple[LayerIndex, LayerSource]:
        """The stored index and where it came from; `checkpoints` as
        LayerIndex.decode takes it."""
        directory = self.path(name)
        index = LayerIndex.decode((directory / INDEX).read_bytes(), checkpoints)
        source = json.loads((directory / SOURCE).read_text())
        if layer_name(index.layer_digest) != name:
            raise ValueError(f"layer {name} holds the index of {index.layer_digest}")
        signature = Signature.parse(source.get("signer", ""), source.get("signature", ""))
        return index, LayerSource(
            ref=source["ref"], digest=source["digest"], generation=source["generation"], signature=signature
        )

    def index_digest(self, name: str) -> str:
        """The digest of the stored index blob, as a signature names it."""
        with open(self.path(name) / INDEX, "rb") as f:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()

    def generation(self, name: str) -> str | None:
        """The generation of the layer copy now in the store, None if absent."""
        try:
            return str(json.loads((self.path(name) / SOURCE).read_text())["generation"])
        except (OSError, ValueError, KeyError):
            return None

    def prune(self, keep: set[str], older_than_s: float) -> list[str]:
        """Remove layers whose digest is not in `keep` and that were added
        more than `older_than_s` ago (younger ones may belong to a Prepare in
        progress), with their block records. Returns the names removed. A
        layer that cannot be removed is logged and left for the next call;
        the others go on."""
        removed = []
        copies = []
        now = time.time()
        for name in self.names():
            directory = self.path(name)
            if f"sha256:{name}" in keep or now - directory.stat().st_mtime < older_than_s:
                continue
            doomed, copy = self._doom(name)
            if doomed:
                removed.append(name)
            if copy is not None:
                copies.append(copy)
        self._remove(copies)
        return removed

    def remove(self, name: str) -> None:
        """Remove layer `name` now, with its block records (the snapshotter
        stored its index, then found the index unusable)."""
        _, copy = self._doom(name)
        self._remove([] if copy is None else [copy])

    def _doom(self, name: str) -> tuple[bool, str | None]:
        """Rename layer `name` away for removal: whether it was, and its copy key."""
        directory = self.path(name)
        generation = self.generation(name)
        doomed = directory.with_name(f"{_DOOMED}{name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(directory, doomed)
        except OSError as exc:
            log.warning("could not remove a stored layer", layer=name, error=str(exc))
            return False, None
        return True, None if generation is None else copy_key(name, generation)

    def _remove(self, copies: list[str]) -> None:
        """Delete what was renamed away, and the block records of `copies`."""
        self._remove_doomed()
        if copies and self.block_index_path.exists():
            # The layer server may hold the index open too: LMDB serialises
            # writers across processes.
            block_index = BlockIndex(self.block_index_path)
            try:
                for copy in copies:
                    block_index.drop_layer(copy)
            finally:
                block_index.close()

    def _remove_doomed(self) -> None:
        """Delete layers renamed away for removal, this call's and any an
        earlier call or a crash left."""
        for doomed in self.root.glob(f"{_DOOMED}*"):
            try:
                shutil.rmtree(doomed)
            except OSError as exc:
                log.warning("could not delete a removed layer's files", path=str(doomed), error=str(exc))

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / INDEX).exists())
