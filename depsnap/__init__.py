"""depsnap: capture an installed dependency set once, restore it by key.

The first start with a given set of inputs installs as usual and captures the
result as a read-only filesystem image; every later start with the same
inputs mounts (or copies out) that image instead of installing again.

Imports `hdfs_fuse` (the striped reader, for stores and the lazy mount);
never `bootseer`, which holds its commands (`bootseer.commands.depsnap`).
"""
