"""Fixtures for depsnap's tests: a wheelhouse built on the spot, installer
settings that keep pip and uv off the network, and a work directory whose
mounts are all removed at the end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.depsnap import wheelhouse as wheelhouse_mod
from tests.harness.tree import unmount_under

BOOTSEER = Path(sys.executable).parent / "bootseer"
PYTHON = Path(os.path.realpath(sys.executable))


@pytest.fixture(scope="session")
def wheelhouse() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="ds-wh-", dir="/tmp"))
    try:
        yield wheelhouse_mod.build(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Work:
    """One test's directory: store, node cache, targets; and how to run the CLI there."""

    root: Path
    env: dict[str, str]

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def requirements(self, text: str, name: str = "requirements.txt") -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    def bootseer(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(BOOTSEER), *args], capture_output=True, text=True, env=self.env, cwd=self.root, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"bootseer {' '.join(args)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def ensure(self, req: Path, target: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.bootseer(
            "depsnap",
            "ensure",
            "-r",
            str(req),
            "--target",
            str(target),
            "--python",
            str(PYTHON),
            "--store",
            str(self.store),
            "--cache-dir",
            str(self.cache),
            "--socket",
            str(self.root / "no-daemon.sock"),
            *extra,
            check=check,
        )


@pytest.fixture
def work(wheelhouse: Path) -> Iterator[Work]:
    root = Path(tempfile.mkdtemp(prefix="ds-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "BOOTSEER_"))}
    env.update(
        {
            # Offline, from the wheelhouse only, with no machine config in the way.
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(wheelhouse),
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_CACHE_DIR": str(root / "pip-cache"),
            "UV_NO_INDEX": "1",
            "UV_FIND_LINKS": str(wheelhouse),
            "UV_NO_CONFIG": "1",
            "UV_CACHE_DIR": str(root / "uv-cache"),
            "BOOTSEER_BASE_IMAGE": "sha256:" + "ab" * 32,
        }
    )
    try:
        yield Work(root, env)
    finally:
        leftovers = unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)
        if leftovers:
            raise RuntimeError("depsnap test left mounts behind:\n" + "\n".join(leftovers))
