"""Session fixtures for the integration tests: one registry, one bootseer
snapshotter and one containerd wired to it, shared by every test.

Sharing keeps the suite to minutes on two cores; tests stay independent by
using unique image names and container ids (the `unique` fixture).
Everything started here is stopped by PID at session end and every mount
under the fixtures' temp dirs is removed; leftovers fail the session.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.containerd import Containerd, start_containerd
from tests.harness.oci import ImageBuilder
from tests.harness.registry import AuthRegistry, Registry, start_auth_registry, start_registry
from tests.harness.snapshotter import Snapshotter, start_snapshotter

# Fixtures that start a real part (a daemon, a registry, a web server, a FUSE
# or overlay mount). A test that uses one, directly or through another
# fixture, is an integration test; a test that starts such a part itself
# says so with `pytestmark = pytest.mark.integration`. `make test-unit` runs
# everything else: `-m "not integration"`.
REAL_PART_FIXTURES = frozenset(
    {
        "registry",
        "auth_registry",
        "snapshotter",
        "containerd",
        "images",
        "client",  # tests/contract: the snapshotter over gRPC
        "work",  # tests/depsnap: node daemons and stores
        "mount_layers",  # tests/fs
        "tree",  # tests/hdfs_fuse: served over nginx
        "nginx",
        "private_nginx",
        "mount",
        "lazy_node",  # tests/lazy
        "pushed",  # tests/registry
        "proxy",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    integration = pytest.mark.integration
    for item in items:
        if REAL_PART_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(integration)
    # Only lack of root is a reason to skip: containerd, runc and overlay
    # mounts cannot work without it. A missing binary is a broken set-up and
    # must fail loudly instead.
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="integration tests need root (containerd, runc, mounts)")
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(skip)


def _fail_on_leftover_mounts(what: str, leftovers: list[str]) -> None:
    if leftovers:
        raise RuntimeError(f"{what} left mounts behind:\n" + "\n".join(leftovers))


@pytest.fixture(scope="session")
def registry() -> Iterator[Registry]:
    """A running local registry; `.host` is "127.0.0.1:PORT"."""
    reg = start_registry()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[AuthRegistry]:
    """A second registry that wants a login; `.docker_config()` writes credentials."""
    reg = start_auth_registry()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="session")
def snapshotter() -> Iterator[Snapshotter]:
    """The bootseer snapshotter process (start/stop/kill9/restart)."""
    snap = start_snapshotter()
    try:
        yield snap
    finally:
        _fail_on_leftover_mounts("bootseer snapshotter", snap.teardown())


@pytest.fixture(scope="session")
def containerd(snapshotter: Snapshotter) -> Iterator[Containerd]:
    """containerd with `[proxy_plugins.bootseer]` pointing at `snapshotter`."""
    daemon = start_containerd(snapshotter.address)
    try:
        yield daemon
    finally:
        _fail_on_leftover_mounts("containerd", daemon.stop())


@pytest.fixture(scope="session")
def images(registry: Registry) -> Iterator[ImageBuilder]:
    """`images.push(name, layers, cmd=..., tag=...)` builds and pushes an image."""
    workdir = Path(tempfile.mkdtemp(prefix="bs-img-", dir="/tmp"))
    try:
        yield ImageBuilder(registry_host=registry.host, workdir=workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def unique() -> str:
    """A short random token for image names and container ids."""
    return uuid.uuid4().hex[:10]
