"""fusewire: the FUSE protocol spoken on /dev/fuse directly, so the layer
mount's connection can outlive the process serving it (docs/fuse-failover.md).

This package's top level is the pyfuse3-compatible facade: a filesystem
written against pyfuse3 (Operations, FUSEError, EntryAttributes, FileInfo,
StatvfsData, readdir_reply, ROOT_INODE, RequestContext, ReaddirToken)
switches by importing these names from here; NotNow and the `*_now`
methods of Operations are fusewire's own. The engine is
`fusewire.session.Session`; mounting is `fusewire.mount`; where the
descriptor comes from and goes to is `fusewire.connection` (with
`fusewire.handoff` and the `fusewire.holder` process).
"""

from snapshotter.fs.fusewire.api import (
    ROOT_INODE,
    EntryAttributes,
    FileBytes,
    FileInfo,
    FUSEError,
    NotNow,
    Operations,
    ReaddirToken,
    RequestContext,
    StatvfsData,
    readdir_reply,
)

__all__ = [
    "ROOT_INODE",
    "EntryAttributes",
    "FUSEError",
    "FileBytes",
    "FileInfo",
    "NotNow",
    "Operations",
    "ReaddirToken",
    "RequestContext",
    "StatvfsData",
    "readdir_reply",
]
