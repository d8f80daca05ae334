"""The hot-block manifest format (version 1), JSON:

    {"version": 1, "image": "sha256:<image manifest>", "runs": 3,
     "blocks": [[layer digest, block number, block digest, first access ms, size], ...]}

Blocks are ordered by first access after the image's first mount. `block
digest` is the layer index's digest of that block, so a manifest that no
longer matches the image's indexes is detected and ignored; `size` is the
block's compressed size, the bytes a prefetch fetches. `runs` counts the
records merged into it: first-access times are their run-weighted mean.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from snapshotter.layer.index import LayerIndex

FORMAT_VERSION = 1
MEDIA_TYPE = "application/vnd.bootseer.hot-blocks.v1+json"
ARTIFACT_TYPE = "application/vnd.bootseer.hot-blocks.v1"
# The size bound: a start that reads more blocks than this is not a "start".
MAX_BLOCKS = 1 << 16


class ManifestError(ValueError):
    """A manifest that is malformed, or belongs to another image or index."""


@dataclass(frozen=True)
class HotBlock:
    layer: str
    block: int
    digest: str
    first_access_ms: int
    size: int


@dataclass
class HotManifest:
    image: str
    runs: int = 1
    blocks: list[HotBlock] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(b.size for b in self.blocks)

    def encode(self) -> bytes:
        doc = {
            "version": FORMAT_VERSION,
            "image": self.image,
            "runs": self.runs,
            "blocks": [[b.layer, b.block, b.digest, b.first_access_ms, b.size] for b in self.blocks],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> HotManifest:
        try:
            doc = json.loads(data)
            if doc.get("version") != FORMAT_VERSION:
                raise ManifestError(f"hot-block manifest version {doc.get('version')!r} is not supported")
            blocks = [
                HotBlock(str(layer), int(n), str(digest), int(ms), int(size))
                for layer, n, digest, ms, size in doc["blocks"]
            ]
            manifest = cls(image=str(doc["image"]), runs=int(doc["runs"]), blocks=blocks)
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"hot-block manifest is malformed: {exc!r}") from None
        if manifest.runs < 1 or len(blocks) > MAX_BLOCKS:
            raise ManifestError("hot-block manifest is out of bounds")
        return manifest


def from_record(
    image: str, accesses: Mapping[tuple[str, int], float], indexes: Mapping[str, LayerIndex]
) -> HotManifest:
    """A manifest from one run's first accesses: (layer, block) -> seconds after start."""
    blocks = []
    for (layer, n), seconds in accesses.items():
        block = indexes[layer].blocks[n]
        blocks.append(HotBlock(layer, n, block.digest, round(seconds * 1000), block.cend - block.cstart))
    blocks.sort(key=lambda b: (b.first_access_ms, b.layer, b.block))
    return HotManifest(image=image, runs=1, blocks=blocks[:MAX_BLOCKS])


def merge(a: HotManifest, b: HotManifest, max_blocks: int = MAX_BLOCKS) -> HotManifest:
    """The union of two records of one image, ordered by typical first access."""
    if a.image != b.image:
        raise ManifestError(f"cannot merge manifests of {a.image} and {b.image}")
    merged: dict[tuple[str, int], HotBlock] = {(x.layer, x.block): x for x in a.blocks}
    for y in b.blocks:
        x = merged.get((y.layer, y.block))
        if x is None:
            merged[(y.layer, y.block)] = y
            continue
        mean = (x.first_access_ms * a.runs + y.first_access_ms * b.runs) / (a.runs + b.runs)
        merged[(y.layer, y.block)] = HotBlock(y.layer, y.block, y.digest, round(mean), y.size)
    blocks = sorted(merged.values(), key=lambda x: (x.first_access_ms, x.layer, x.block))
    return HotManifest(image=a.image, runs=a.runs + b.runs, blocks=blocks[:max_blocks])


def check(manifest: HotManifest, image: str, indexes: Mapping[str, LayerIndex]) -> None:
    """Raise ManifestError unless every block belongs to this image's layers
    and matches their indexes."""
    if manifest.image != image:
        raise ManifestError(f"hot-block manifest is for {manifest.image}, not {image}")
    for b in manifest.blocks:
        index = indexes.get(b.layer)
        if index is None:
            raise ManifestError(f"hot-block manifest names layer {b.layer}, which {image} does not have")
        if not 0 <= b.block < len(index.blocks) or index.blocks[b.block].digest != b.digest:
            raise ManifestError(f"hot-block manifest is stale: block {b.block} of {b.layer} does not match its index")
