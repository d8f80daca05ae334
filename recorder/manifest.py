"""The hot-block manifest format (version 2), JSON:

    {"version": 2, "image": "sha256:<image manifest>", "runs": 3,
     "blocks": [[layer digest, block number, block digest, first access ms, size, link], ...]}

Blocks are ordered by first access after the image's first mount. `block
digest` is the layer index's digest of that block, so a manifest that no
longer matches the image's indexes is detected and ignored; `size` is the
compressed bytes a prefetch fetches of it. `link` is "" where that is the
whole block; else the runs read only the block's first `size` bytes' worth
(whole parts of its index's `part`, snapshotter/layer/parts.py), and `link`
is the hex of the link after them, which those bytes are checked against
the block's digest with. `runs` counts the records merged into it:
first-access times are their run-weighted mean. Version 1 had no links: it
still decodes, every block whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from snapshotter.layer.index import LayerIndex
from snapshotter.layer.parts import LINK_BYTES, Reach

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, FORMAT_VERSION)
MEDIA_TYPE = "application/vnd.bootseer.hot-blocks.v1+json"
ARTIFACT_TYPE = "application/vnd.bootseer.hot-blocks.v1"
# The size bound: a start that reads more blocks than this is not a "start".
MAX_BLOCKS = 1 << 16


_HEX = frozenset("0123456789abcdef")


class ManifestError(ValueError):
    """A manifest that is malformed, or belongs to another image or index."""


@dataclass(frozen=True)
class HotBlock:
    layer: str
    block: int
    digest: str
    first_access_ms: int
    size: int
    link: str = ""

    @property
    def partial(self) -> bool:
        return self.link != ""


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
            "blocks": [[b.layer, b.block, b.digest, b.first_access_ms, b.size, b.link] for b in self.blocks],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> HotManifest:
        try:
            doc = json.loads(data)
            version = doc.get("version")
            if type(version) is not int or version not in READABLE_VERSIONS:
                raise ManifestError(f"hot-block manifest version {version!r} is not supported")
            rows = doc["blocks"] if version > 1 else [[*row, ""] for row in doc["blocks"]]
            blocks = [
                HotBlock(str(layer), int(n), str(digest), int(ms), int(size), str(link))
                for layer, n, digest, ms, size, link in rows
            ]
            manifest = cls(image=str(doc["image"]), runs=int(doc["runs"]), blocks=blocks)
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"hot-block manifest is malformed: {exc!r}") from None
        if manifest.runs < 1 or len(blocks) > MAX_BLOCKS:
            raise ManifestError("hot-block manifest is out of bounds")
        if any(b.link and (len(b.link) != 2 * LINK_BYTES or not set(b.link) <= _HEX) for b in blocks):
            raise ManifestError("hot-block manifest has a malformed link")
        return manifest


def from_record(
    image: str,
    accesses: Mapping[tuple[str, int], float],
    indexes: Mapping[str, LayerIndex],
    extents: Mapping[tuple[str, int], int] | None = None,
    reaches: Mapping[tuple[str, int], Reach] | None = None,
) -> HotManifest:
    """A manifest from one run's first accesses: (layer, block) -> seconds
    after start. A block whose `extents` (the uncompressed bytes from its
    start the run read up to) its first parts give, by its `reaches` (how
    far its parts take it, known for the blocks the run fetched), is
    fetched only up to those parts."""
    blocks = []
    for (layer, n), seconds in accesses.items():
        index = indexes[layer]
        block = index.blocks[n]
        size, link = block.cend - block.cstart, ""
        reach = (reaches or {}).get((layer, n))
        extent = (extents or {}).get((layer, n))
        if reach is not None and extent is not None and index.part:
            prefix = reach.prefix(extent, index.part)
            if prefix is not None:
                size, link = prefix[0], prefix[1].hex()
        blocks.append(HotBlock(layer, n, block.digest, round(seconds * 1000), size, link))
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
        # What either run read of the block: the whole of it, or the more parts.
        wider = y if not y.partial or (x.partial and y.size >= x.size) else x
        merged[(y.layer, y.block)] = HotBlock(y.layer, y.block, y.digest, round(mean), wider.size, wider.link)
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
        block = index.blocks[b.block]
        if b.partial and not (index.part and 0 < b.size < block.cend - block.cstart and b.size % index.part == 0):
            raise ManifestError(
                f"hot-block manifest asks for {b.size} bytes of block {b.block} of {b.layer}, not its first parts"
            )
