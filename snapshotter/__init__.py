"""The containerd proxy-plugin snapshotter: snapshot metadata, mounts and the gRPC service."""
