"""A throwaway local registry: Debian's `docker-registry` (distribution 2.8).

Plain HTTP on 127.0.0.1 with a free port; blobs in a temp dir so every
session starts empty. Deletes are enabled so tests may remove manifests.
`start_pull_through_cache` runs one in proxy mode (`proxy: remoteurl:`), the
rack-level mirror users put in front of a registry.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import bcrypt

from tests.harness.procs import Daemon, free_tcp_port, start_daemon, tcp_port_answers

REGISTRY_BIN = "docker-registry"


@dataclass
class Registry:
    daemon: Daemon
    workdir: Path
    port: int

    @property
    def host(self) -> str:
        """What goes in front of an image name: "127.0.0.1:PORT"."""
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        """Stop the registry process, keeping its storage: an outage."""
        self.daemon.stop()

    def resume(self) -> None:
        """Start it again on the same port with the same storage."""
        self.daemon = _serve(self.workdir, self.port)

    def stop(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _serve(workdir: Path, port: int) -> Daemon:
    return start_daemon(
        "docker-registry",
        [REGISTRY_BIN, "serve", str(workdir / "config.yml")],
        workdir / "registry.log",
        ready=lambda: tcp_port_answers("127.0.0.1", port),
    )


def _started(workdir: Path, port: int) -> Registry:
    """The registry configured in `workdir`, serving; its directory removed if it does not start."""
    try:
        daemon = _serve(workdir, port)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Registry(daemon=daemon, workdir=workdir, port=port)


def _config(storage: Path, port: int) -> str:
    # JSON is valid YAML, which saves depending on a YAML writer.
    return json.dumps(
        {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(storage)},
                "delete": {"enabled": True},
            },
            "http": {"addr": f"127.0.0.1:{port}"},
        },
        indent=2,
    )


def start_registry() -> Registry:
    workdir = Path(tempfile.mkdtemp(prefix="bs-reg-", dir="/tmp"))
    port = free_tcp_port()
    (workdir / "config.yml").write_text(_config(workdir / "storage", port))
    return _started(workdir, port)


USER, PASSWORD = "trainer", "s3cret-pass"


@dataclass
class AuthRegistry:
    """A docker-registry that wants a login (htpasswd: USER / PASSWORD)."""

    daemon: Daemon
    workdir: Path
    port: int

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def docker_config(self, user: str = USER, password: str = PASSWORD) -> Path:
        """A docker config.json holding `user`:`password` for this registry."""
        path = self.workdir / f"docker-{user}-{len(password)}" / "config.json"
        path.parent.mkdir(exist_ok=True)
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        path.write_text(json.dumps({"auths": {self.host: {"auth": token}}}))
        return path

    def stop(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_auth_registry() -> AuthRegistry:
    workdir = Path(tempfile.mkdtemp(prefix="bs-regauth-", dir="/tmp"))
    port = free_tcp_port()
    htpasswd = workdir / "htpasswd"
    # Cost 5 keeps each login check fast on a loaded 2-core machine.
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()
    htpasswd.write_text(f"{USER}:{hashed}\n")
    config = json.loads(_config(workdir / "storage", port))
    config["auth"] = {"htpasswd": {"realm": "bootseer-test", "path": str(htpasswd)}}
    (workdir / "config.yml").write_text(json.dumps(config))
    try:
        daemon = start_daemon(
            "docker-registry (htpasswd)",
            [REGISTRY_BIN, "serve", str(workdir / "config.yml")],
            workdir / "registry.log",
            ready=lambda: tcp_port_answers("127.0.0.1", port),
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return AuthRegistry(daemon, workdir, port)


def start_pull_through_cache(remote_url: str) -> Registry:
    """A docker-registry in proxy mode caching `remote_url` ("http://HOST:PORT"):
    it fetches what it lacks from there, stores it and serves it from then on.
    Distribution 2.8 answers a Range request for a blob it lacks with the whole
    blob (200), and cannot proxy OCI manifests (it answers 404 or 500: the
    client takes them from the next host)."""
    workdir = Path(tempfile.mkdtemp(prefix="bs-regcache-", dir="/tmp"))
    port = free_tcp_port()
    config = json.loads(_config(workdir / "storage", port))
    del config["storage"]["delete"]  # a proxy-mode registry refuses deletes
    config["proxy"] = {"remoteurl": remote_url}
    (workdir / "config.yml").write_text(json.dumps(config))
    return _started(workdir, port)


def cached_blob(cache: Registry, digest: str) -> bool:
    """Whether the pull-through cache `cache` has stored blob `digest`."""
    algorithm, _, hex_part = digest.partition(":")
    data = cache.workdir / "storage" / "docker" / "registry" / "v2" / "blobs" / algorithm / hex_part[:2] / hex_part
    return (data / "data").is_file()


class Storage(Protocol):
    """A registry whose filesystem storage lies under `workdir/storage`
    (this module's and the benchmarks' network-namespace one)."""

    @property
    def workdir(self) -> Path: ...


def _v2(registry: Storage) -> Path:
    return registry.workdir / "storage" / "docker" / "registry" / "v2"


def _blob(registry: Storage, hex_part: str) -> Path:
    return _v2(registry) / "blobs" / "sha256" / hex_part[:2] / hex_part / "data"


def stored_manifests(registry: Storage, repository: str) -> dict[str, bytes]:
    """The manifests `repository` holds now, by digest, read from the
    registry's storage (a deleted manifest loses its revision link)."""
    revisions = _v2(registry) / "repositories" / repository / "_manifests" / "revisions" / "sha256"
    if not revisions.is_dir():
        return {}
    return {
        f"sha256:{d.name}": _blob(registry, d.name).read_bytes()
        for d in sorted(revisions.iterdir())
        if (d / "link").is_file()
    }


def uploaded_hot_manifests(registry: Storage, image: str) -> int:
    """How many distinct hot-block manifests of `image` were ever uploaded:
    their blobs stay in storage after their artifacts are deleted (until a
    garbage collection), so this counts pushes whatever was pruned since."""
    prefix = json.dumps({"version": 1, "image": image}, separators=(",", ":"))[:-1].encode()
    blobs = _v2(registry) / "blobs" / "sha256"
    count = 0
    for data in blobs.glob("*/*/data") if blobs.is_dir() else ():
        with open(data, "rb") as f:
            count += f.read(len(prefix)) == prefix
    return count
