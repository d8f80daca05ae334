"""Striped, parallel, read-ahead reads of remote files (HDFS, S3, GCS, HTTP,
local), as a library and behind a read-only FUSE mount.

    import hdfs_fuse
    with hdfs_fuse.open("hdfs://namenode/ckpt/model.pt") as f:
        state = torch.load(f)
"""

from hdfs_fuse.errors import RemoteReadError
from hdfs_fuse.reader import Client, StripedFile, open
from hdfs_fuse.settings import HdfsFuseConfig

__all__ = ["Client", "HdfsFuseConfig", "RemoteReadError", "StripedFile", "open"]
