"""Helpers that run the real daemons (registry, containerd, the bootseer
snapshotter) for the integration tests, build OCI images, and compare
filesystem trees. Plain functions and classes, no pytest dependency, so they
can also be driven from a REPL when a test fails."""
