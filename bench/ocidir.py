"""An OCI image layout written from directory trees on disk, streamed.

tests/harness/oci.py builds layers from in-memory entries, which is right for
the tests' small, hand-made images; a realistic training image is gigabytes,
so here each layer is a staged directory tarred and gzipped straight to its
blob file, hashing both streams on the way (diff_id and blob digest).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from tests.harness.oci import (
    MEDIA_CONFIG,
    MEDIA_LAYER_GZIP,
    MEDIA_MANIFEST,
    MTIME,
    ImageLayout,
)

# Go's compress/gzip default, which is what docker/buildkit push.
GZIP_LEVEL = 6


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, sink: BinaryIO | None) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.sink is not None:
            self.sink.write(data)
        return len(data)

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _walk(root: Path) -> list[Path]:
    """Every path under `root`, parents before children, in a stable order."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        out += [base / d for d in dirnames]
        out += [base / f for f in sorted(filenames)]
    # os.walk lists a directory's children when it visits it, so a child dir
    # would come before its siblings' files: sort by path parts instead.
    return sorted(out, key=lambda p: p.relative_to(root).parts)


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Root-owned, fixed mtime: layer digests do not depend on who built them when.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = MTIME
    return info


def write_layer(source: Path, blob_dir: Path) -> tuple[str, str, int]:
    """Tar+gzip the tree under `source` into `blob_dir`; (diff_id, digest, size)."""
    partial = blob_dir / f".partial-{os.getpid()}"
    with open(partial, "wb") as out:
        compressed = _HashingWriter(out)
        # mtime=0 and no name keep the blob digest reproducible.
        with gzip.GzipFile(
            filename="",
            mode="wb",
            fileobj=compressed,
            mtime=0,
            compresslevel=GZIP_LEVEL,
        ) as gz:  # type: ignore[arg-type]
            plain = _HashingWriter(gz)  # type: ignore[arg-type]
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[arg-type]
                for path in _walk(source):
                    info = _normalised(tar.gettarinfo(str(path), str(path.relative_to(source))))
                    if info.isreg():
                        with open(path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
    partial.rename(blob_dir / compressed.digest.removeprefix("sha256:"))
    return plain.digest, compressed.digest, compressed.size


def _json_blob(blob_dir: Path, obj: object) -> dict[str, object]:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (blob_dir / digest.removeprefix("sha256:")).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def write_layout(
    directory: Path,
    layer_dirs: Sequence[Path],
    cmd: Sequence[str],
    env: Sequence[str],
    tag: str = "latest",
    base: ImageLayout | None = None,
) -> ImageLayout:
    """An amd64/linux OCI layout of `layer_dirs` (bottom first), one tag;
    on top of `base`'s layers (hard-linked, not copied), as a Dockerfile's
    FROM would have them."""
    blob_dir = directory / "blobs" / "sha256"
    blob_dir.mkdir(parents=True, exist_ok=True)
    layers: list[tuple[str, str, int]] = []
    if base is not None:
        for diff_id, digest, size in zip(base.diff_ids, base.layer_digests, base.layer_sizes, strict=True):
            name = digest.removeprefix("sha256:")
            if not (blob_dir / name).exists():
                os.link(base.directory / "blobs" / "sha256" / name, blob_dir / name)
            layers.append((diff_id, digest, size))
    layers += [write_layer(d, blob_dir) for d in layer_dirs]
    config = _json_blob(
        blob_dir,
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": list(cmd), "Env": list(env)},
            "rootfs": {
                "type": "layers",
                "diff_ids": [diff_id for diff_id, _, _ in layers],
            },
        },
    )
    manifest = _json_blob(
        blob_dir,
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, **config},
            "layers": [{"mediaType": MEDIA_LAYER_GZIP, "digest": d, "size": s} for _, d, s in layers],
        },
    )
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                **manifest,
                "annotations": {"org.opencontainers.image.ref.name": tag},
                "platform": {"architecture": "amd64", "os": "linux"},
            }
        ],
    }
    (directory / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (directory / "index.json").write_text(json.dumps(index))
    return ImageLayout(
        directory=directory,
        tag=tag,
        diff_ids=tuple(diff_id for diff_id, _, _ in layers),
        layer_digests=tuple(d for _, d, _ in layers),
        layer_sizes=tuple(s for _, _, s in layers),
    )


def read_layout(directory: Path) -> ImageLayout:
    """The ImageLayout of a layout written by `write_layout` (one tagged image)."""
    blobs = directory / "blobs" / "sha256"
    index = json.loads((directory / "index.json").read_text())
    entry = index["manifests"][0]
    manifest = json.loads((blobs / entry["digest"].removeprefix("sha256:")).read_text())
    config = json.loads((blobs / manifest["config"]["digest"].removeprefix("sha256:")).read_text())
    return ImageLayout(
        directory=directory,
        tag=entry["annotations"]["org.opencontainers.image.ref.name"],
        diff_ids=tuple(config["rootfs"]["diff_ids"]),
        layer_digests=tuple(layer["digest"] for layer in manifest["layers"]),
        layer_sizes=tuple(layer["size"] for layer in manifest["layers"]),
    )


def manifest_digest(layout: ImageLayout) -> str:
    """The digest of the layout's image manifest: what a registry it is
    copied to unchanged names it by."""
    index = json.loads((layout.directory / "index.json").read_text())
    return str(index["manifests"][0]["digest"])
