"""Fixtures for the registry client tests: an image in the shared registry,
a fault proxy in front of it, and a second docker-registry that wants a
login (htpasswd), with a docker config.json holding the credentials."""

from __future__ import annotations

import base64
import random
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest

from tests.harness.oci import ImageBuilder, PushedImage, busybox_layer, File, Dir
from tests.harness.procs import Daemon, free_tcp_port, start_daemon, tcp_port_answers
from tests.harness.registry import REGISTRY_BIN, Registry
from tests.registry import faultproxy

USER, PASSWORD = "trainer", "s3cret-pass"


@dataclass
class AuthRegistry:
    daemon: Daemon
    workdir: Path
    port: int

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def docker_config(self, user: str = USER, password: str = PASSWORD) -> Path:
        """A config.json holding `user`:`password` for this registry."""
        path = self.workdir / f"docker-{user}-{len(password)}" / "config.json"
        path.parent.mkdir(exist_ok=True)
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        path.write_text(json.dumps({"auths": {self.host: {"auth": token}}}))
        return path


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[AuthRegistry]:
    workdir = Path(tempfile.mkdtemp(prefix="bs-regauth-", dir="/tmp"))
    port = free_tcp_port()
    htpasswd = workdir / "htpasswd"
    # Cost 5 keeps each login check fast on a loaded 2-core machine.
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()
    htpasswd.write_text(f"{USER}:{hashed}\n")
    config = workdir / "config.yml"
    config.write_text(json.dumps({
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
        "auth": {"htpasswd": {"realm": "bootseer-test", "path": str(htpasswd)}},
    }))
    try:
        daemon = start_daemon("docker-registry (htpasswd)", [REGISTRY_BIN, "serve", str(config)],
                              workdir / "registry.log", ready=lambda: tcp_port_answers("127.0.0.1", port))
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        yield AuthRegistry(daemon, workdir, port)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def sample_layers() -> list[list]:
    big = random.Random(3).randbytes(1 << 20)  # 1 MiB that does not compress
    return [
        busybox_layer(),
        [Dir("/data"), File("/data/big.bin", big), File("/data/small.txt", b"hello\n")],
    ]


@pytest.fixture(scope="session")
def pushed(images: ImageBuilder) -> PushedImage:
    """A two-layer image in the shared registry."""
    return images.push("regtest/sample", sample_layers())


@pytest.fixture
def proxy(registry: Registry) -> Iterator[faultproxy.FaultProxy]:
    with faultproxy.running(registry.port) as p:
        yield p
