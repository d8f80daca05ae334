"""Creating an environment and installing into it with pip or uv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSTALLERS = ("uv", "pip")


class InstallerError(Exception):
    """The installer is missing or its environment could not be created."""


def find_uv() -> str:
    """uv next to this interpreter (the project's venv) first, then on PATH."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file():
        return str(beside)
    found = shutil.which("uv")
    if found is None:
        raise InstallerError("uv not found (next to the bootseer interpreter or on PATH)")
    return found


def version(installer: str, python: Path) -> str:
    """The installer's version as it reports it: part of the key."""
    if installer == "uv":
        argv = [find_uv(), "--version"]
    else:
        # A fresh venv gets the pip bundled with the interpreter's ensurepip.
        argv = [str(python), "-c", "import ensurepip; print('pip', ensurepip.version())"]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise InstallerError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout.strip()


@dataclass(frozen=True)
class Plan:
    """The commands that build the environment, in order."""

    commands: list[list[str]]
    env: dict[str, str]


def plan(installer: str, python: Path, target: Path, requirements: list[Path]) -> Plan:
    env = dict(os.environ)
    req_args = [arg for req in requirements for arg in ("-r", str(req))]
    if installer == "uv":
        uv = find_uv()
        # Never fetch a managed interpreter: the key names this one.
        env["UV_PYTHON_DOWNLOADS"] = "never"
        return Plan(
            [
                [uv, "venv", "--quiet", "--python", str(python), str(target)],
                # Byte-compile now, so the snapshot carries the .pyc files
                # and no later start compiles anything.
                [
                    uv,
                    "pip",
                    "install",
                    "--python",
                    str(target / "bin" / "python"),
                    "--compile-bytecode",
                    *req_args,
                ],
            ],
            env,
        )
    if installer == "pip":
        return Plan(
            [
                [str(python), "-m", "venv", str(target)],
                [str(target / "bin" / "python"), "-m", "pip", "install", *req_args],
            ],
            env,
        )
    raise InstallerError(f"unknown installer {installer!r} (known: {', '.join(INSTALLERS)})")


def run(steps: Plan) -> int:
    """Run the plan's commands, stopping at the first failure; its status is returned."""
    for argv in steps.commands:
        rc = subprocess.run(argv, env=steps.env, check=False).returncode
        if rc != 0:
            return rc
    return 0
