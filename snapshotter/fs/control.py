"""The layer server's control channel: how the snapshotter's Prepare path
and `bootseer record` reach the running layer server.

Both go through the mount itself, so they need no socket of their own and
work with whichever layer server holds the mount:

- a lookup of a layer's name in the mount root makes the server load that
  layer (decode its index, build its tree), and its answer proves the server
  serves it;
- a lookup of `.open-<layer name>` makes the server decode the layer's stored
  index and build its tree in the background (answered at once), so that
  the layer's load, when its Prepare comes, only gives it a slot;
- a lookup of `.image-<manifest hex>` makes the server (re)read the image's
  request file, written first into the layer store:

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
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from snapshotter.fs.layers import LayerStore

CONTROL_PREFIX = ".image-"
OPEN_PREFIX = ".open-"


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


def read_request(store: LayerStore, name: str) -> ImageRequest | None:
    try:
        doc = json.loads(store.request_path(name).read_text())
        return ImageRequest(**doc)
    except (OSError, ValueError, TypeError):
        return None


def write_request(store: LayerStore, request: ImageRequest) -> None:
    """Atomically: the server never reads half a request."""
    path = store.request_path(request.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(request), f)
    os.rename(tmp, path)


def lookup(mountpoint: Path, name: str) -> bool:
    """Look `name` up in the mount root: the one way to poke the layer server.
    True if the server shows a directory of that name (a layer it serves),
    False if it answers that there is none (always, for a control name, once
    it has read the request); any other failure (no server on the mount:
    ENOTCONN) raises OSError."""
    try:
        st = os.stat(mountpoint / name)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return stat.S_ISDIR(st.st_mode)


def notify(mountpoint: Path, name: str) -> None:
    """Make the layer server read image `name`'s request now."""
    lookup(mountpoint, CONTROL_PREFIX + name)


def open_ahead(mountpoint: Path, name: str) -> None:
    """Have the layer server decode layer `name`'s stored index now, ahead
    of its load."""
    lookup(mountpoint, OPEN_PREFIX + name)
