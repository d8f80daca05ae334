"""The FUSE layer server: one mount showing every lazily served layer as a
directory, reading blocks from the registry on demand into a local cache."""
