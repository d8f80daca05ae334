"""How the snapshotter and `bootseer record` tell the layer server about an
image: a small JSON file per image in the layer store, then a lookup of
`.image-<hex>` in the mount root, which makes the server (re)read it.

    STORE/images/<manifest hex>.json
        {"ref": "host/repo:tag", "image": "sha256:...", "layers": [digests, bottom first],
         "record": false, "stop": false}

`record` asks for a recording even if the image has a hot-block manifest
(it is merged into it); `stop` ends a recording now.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONTROL_PREFIX = ".image-"


@dataclass
class ImageRequest:
    ref: str
    image: str
    layers: list[str] = field(default_factory=list)
    record: bool = False
    stop: bool = False

    @property
    def name(self) -> str:
        return self.image.split(":", 1)[1]


def request_path(store: Path, name: str) -> Path:
    return store / "images" / f"{name}.json"


def read(store: Path, name: str) -> ImageRequest | None:
    try:
        doc = json.loads(request_path(store, name).read_text())
        return ImageRequest(**doc)
    except (OSError, ValueError, TypeError):
        return None


def write(store: Path, request: ImageRequest) -> None:
    """Atomically: the server never reads half a request."""
    path = request_path(store, request.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(request), f)
    os.rename(tmp, path)


def notify(mountpoint: Path, name: str) -> None:
    """Make the layer server read the image's request now."""
    try:
        os.stat(mountpoint / f"{CONTROL_PREFIX}{name}")
    except OSError as exc:
        # The server answers ENOENT once it has read the request.
        if exc.errno != errno.ENOENT:
            raise
