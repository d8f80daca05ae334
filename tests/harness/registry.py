"""A throwaway local registry: Debian's `docker-registry` (distribution 2.8).

Plain HTTP on 127.0.0.1 with a free port; blobs in a temp dir so every
session starts empty. Deletes are enabled so tests may remove manifests.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

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

    def stop(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


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
    config = workdir / "config.yml"
    config.write_text(_config(workdir / "storage", port))
    try:
        daemon = start_daemon(
            "docker-registry",
            [REGISTRY_BIN, "serve", str(config)],
            workdir / "registry.log",
            ready=lambda: tcp_port_answers("127.0.0.1", port),
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Registry(daemon=daemon, workdir=workdir, port=port)
