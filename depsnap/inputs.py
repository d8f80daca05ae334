"""Gathering the key's inputs from the machine: the I/O shell around `key.py`."""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from depsnap import installer as installer_mod
from depsnap.key import Input, environment_inputs
from depsnap.requirements import InputFile, collect

BASE_IMAGE_ENV = "BOOTSEER_BASE_IMAGE"

_PROBE = """
import json, platform, sys, sysconfig
print(json.dumps({
    "executable": sys.executable,
    "version": sys.version,
    "abi": sysconfig.get_config_var("SOABI") or "",
    "abiflags": getattr(sys, "abiflags", ""),
    "cache_tag": sys.implementation.cache_tag or "",
    "platform": sysconfig.get_platform(),
    "machine": platform.machine(),
    "libc": " ".join(platform.libc_ver()),
}))
"""


class InputError(Exception):
    """An input could not be read (a missing file, a broken interpreter)."""


def interpreter(python: Path) -> list[Input]:
    """Path, version, ABI, platform tags and libc of the interpreter `python`."""
    try:
        result = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, check=False)
    except OSError as exc:
        raise InputError(f"cannot run interpreter {python}: {exc.strerror}") from None
    if result.returncode != 0:
        raise InputError(f"interpreter {python} failed: {result.stderr.strip()}")
    facts = json.loads(result.stdout)
    return [
        Input("python.path", str(python.absolute())),
        Input("python.executable", os.path.realpath(facts["executable"])),
        Input("python.version", facts["version"]),
        Input("python.abi", f"{facts['abi']} {facts['abiflags']} {facts['cache_tag']}".strip()),
        Input("platform", f"{facts['platform']} {facts['machine']}"),
        Input("libc", facts["libc"]),
    ]


def _file_input(name: str, item: InputFile) -> Input:
    return Input(name, item.sha256, str(item.path))


def _config_paths(installer: str, environ: Mapping[str, str], cwd: Path) -> list[Path]:
    home = Path(environ.get("HOME", "~")).expanduser()
    xdg_dirs = [Path(d) for d in environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") if d]
    xdg_home = Path(environ.get("XDG_CONFIG_HOME", home / ".config"))
    if installer == "pip":
        paths = [Path("/etc/pip.conf"), *(d / "pip" / "pip.conf" for d in xdg_dirs)]
        paths += [home / ".pip" / "pip.conf", xdg_home / "pip" / "pip.conf"]
        extra = environ.get("PIP_CONFIG_FILE")
    else:
        paths = [*(d / "uv" / "uv.toml" for d in xdg_dirs), xdg_home / "uv" / "uv.toml"]
        paths += [cwd / "uv.toml", cwd / "pyproject.toml"]
        extra = environ.get("UV_CONFIG_FILE")
    if extra and extra != os.devnull:
        paths.append(Path(extra))
    return [p for p in paths if p.is_file()]


def _pip_config_includes(config: Path) -> list[Path]:
    """Constraint and requirement files that a pip config file names."""
    parser = configparser.RawConfigParser()
    try:
        parser.read(config)
    except configparser.Error as exc:
        raise InputError(f"cannot parse pip config {config}: {exc}") from None
    found = []
    for section in parser.sections():
        for option in ("constraint", "constraints", "requirement", "requirements"):
            if parser.has_option(section, option):
                found += [Path(p) for p in parser.get(section, option).split()]
    return found


def installer_config(installer: str, environ: Mapping[str, str], cwd: Path) -> list[Input]:
    """The installer's config files and whatever requirement files they name."""
    inputs = []
    for index, path in enumerate(_config_paths(installer, environ, cwd)):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        inputs.append(Input(f"config[{index}]", digest, str(path)))
        if installer == "pip":
            try:
                included = collect(_pip_config_includes(path), role="constraint")
            except Exception as exc:
                raise InputError(str(exc)) from None
            inputs += [_file_input(f"config[{index}].{item.role}[{n}]", item) for n, item in enumerate(included)]
    return inputs


def base_image(flag: str | None, environ: Mapping[str, str]) -> Input:
    value = flag or environ.get(BASE_IMAGE_ENV, "")
    note = "" if value else f"set --base-image or {BASE_IMAGE_ENV}"
    return Input("base_image", value or "unknown", note)


@dataclass(frozen=True)
class EnvRequest:
    """What `ensure` is asked for."""

    requirements: list[Path]
    target: Path
    python: Path
    installer: str
    base_image: str | None = None


def for_env(request: EnvRequest, environ: Mapping[str, str], cwd: Path) -> list[Input]:
    """Every input of an environment snapshot.

    The target path is one: a virtual environment records its own absolute
    path (scripts' #! lines, pyvenv.cfg), so a snapshot is valid only there.
    """
    files = collect(request.requirements)
    return [
        Input("kind", "env"),
        Input("target", str(request.target.absolute())),
        Input("installer", installer_mod.version(request.installer, request.python)),
        *interpreter(request.python),
        base_image(request.base_image, environ),
        *(_file_input(f"{item.role}[{n}]", item) for n, item in enumerate(files)),
        *installer_config(request.installer, environ, cwd),
        *environment_inputs(environ),
    ]


@dataclass(frozen=True)
class RunRequest:
    """What `run` is asked to memoise."""

    command: list[str]
    inputs: list[Path]
    paths: list[Path]
    base_image: str | None = None


def for_run(request: RunRequest, environ: Mapping[str, str], cwd: Path) -> list[Input]:
    """Every input of a command snapshot: the command line, where it runs,
    its declared input files, the paths it writes and the platform."""
    inputs = [
        Input("kind", "run"),
        Input("command", json.dumps(request.command)),
        Input("cwd", str(cwd)),
        Input("platform", f"{platform.system()} {platform.machine()}"),
        Input("libc", " ".join(platform.libc_ver())),
        base_image(request.base_image, environ),
        *environment_inputs(environ),
    ]
    for n, path in enumerate(request.inputs):
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise InputError(f"cannot read input {path}: {exc.strerror}") from None
        inputs.append(Input(f"input[{n}]", digest, str(path)))
    inputs += [Input(f"path[{n}]", str(p.absolute())) for n, p in enumerate(request.paths)]
    return inputs
