"""The containerd proxy-plugin snapshotter: snapshot metadata, mounts, the
gRPC service, the lazy Prepare path and `bootseer pull`.

Imports: `layer/` (pure core) <- `registry/` <- `fs/` (the layer server; its
composition root `fs/server.py` is the one module that wires in `recorder`)
<- this package's top level (`server.py` is the snapshotter daemon's
composition root). Never imports `bootseer`.
"""
