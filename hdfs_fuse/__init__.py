"""Striped, parallel, read-ahead reads of remote files (HDFS, S3, GCS, HTTP,
local), as a library and behind a read-only FUSE mount.

    import hdfs_fuse
    with hdfs_fuse.open("hdfs://namenode/ckpt/model.pt") as f:
        state = torch.load(f)

Imports no other part of bootseer; its commands are `bootseer.commands.hdfs_fuse`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hdfs_fuse.errors import RemoteReadError
    from hdfs_fuse.reader import Client, StripedFile, open
    from hdfs_fuse.settings import HdfsFuseConfig

__all__ = ["Client", "HdfsFuseConfig", "RemoteReadError", "StripedFile", "open"]

# Loaded on first use: every CLI start imports `hdfs_fuse.settings` (through
# bootseer.config), which runs this file, and should not pay for the reader,
# httpx and pyarrow.
_HOMES = {
    "Client": "hdfs_fuse.reader",
    "StripedFile": "hdfs_fuse.reader",
    "open": "hdfs_fuse.reader",
    "RemoteReadError": "hdfs_fuse.errors",
    "HdfsFuseConfig": "hdfs_fuse.settings",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hdfs_fuse' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
