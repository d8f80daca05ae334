"""The snapshot key: a digest of every input that changes what gets installed.

Pure: the caller gathers the inputs (see `inputs.py`); this module decides
which environment variables count, how secrets are kept out, and how the
inputs fold into one key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

# Bumped whenever the snapshot layout changes, so old snapshots never match.
FORMAT_VERSION = "depsnap-1"

# Installer settings read from the environment. Everything with these
# prefixes counts unless listed below: an unknown variable costing a miss is
# cheap, one silently ignored could restore the wrong environment.
_ENV_PREFIXES = ("PIP_", "UV_", "CONDA_")
# Variables that steer a build from source.
_ENV_NAMES = frozenset(
    {
        "CC",
        "CXX",
        "CFLAGS",
        "CXXFLAGS",
        "CPPFLAGS",
        "LDFLAGS",
        "CUDA_HOME",
        "CUDA_PATH",
        "TORCH_CUDA_ARCH_LIST",
        "SETUPTOOLS_SCM_PRETEND_VERSION",
        "SOURCE_DATE_EPOCH",
    }
)
# Variables with those prefixes that change how an install runs (logging,
# caching, timeouts, where config lives) but never what it produces.
_ENV_IGNORED = frozenset(
    {
        "PIP_CACHE_DIR",
        "PIP_NO_CACHE_DIR",
        "PIP_DISABLE_PIP_VERSION_CHECK",
        "PIP_DEFAULT_TIMEOUT",
        "PIP_TIMEOUT",
        "PIP_RETRIES",
        "PIP_PROGRESS_BAR",
        "PIP_QUIET",
        "PIP_VERBOSE",
        "PIP_NO_COLOR",
        "PIP_NO_INPUT",
        "PIP_LOG",
        "PIP_CERT",
        "PIP_CLIENT_CERT",
        "PIP_ROOT_USER_ACTION",
        "PIP_CONFIG_FILE",
        "UV_CACHE_DIR",
        "UV_NO_CACHE",
        "UV_NO_PROGRESS",
        "UV_HTTP_TIMEOUT",
        "UV_CONCURRENT_DOWNLOADS",
        "UV_CONCURRENT_BUILDS",
        "UV_CONCURRENT_INSTALLS",
        "UV_NATIVE_TLS",
        "UV_CONFIG_FILE",
        "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV",
        "CONDA_SHLVL",
        "CONDA_PROMPT_MODIFIER",
    }
)

_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


@dataclass(frozen=True)
class Input:
    """One named input. `value` goes into the key; `note` is shown only."""

    name: str
    value: str
    note: str = ""


def redact(value: str) -> str:
    """`value` with credentials in URLs replaced, so no secret is printed or
    hashed (a token rotation must not cost a miss)."""
    return _URL_USERINFO.sub(r"\g<scheme>***@", value)


def environment_inputs(environ: Mapping[str, str]) -> list[Input]:
    """The variables of `environ` that change what gets installed."""
    names = sorted(
        name for name in environ if (name.startswith(_ENV_PREFIXES) and name not in _ENV_IGNORED) or name in _ENV_NAMES
    )
    return [Input(f"env:{name}", redact(environ[name])) for name in names]


def compute(inputs: list[Input]) -> str:
    """The key: sha256 over the names and values, order-independent.

    Names must be unique; a duplicate means the caller gathered an input
    twice, which would hide a difference.
    """
    table: dict[str, str] = {}
    for item in inputs:
        if item.name in table:
            raise ValueError(f"key input {item.name!r} given twice")
        table[item.name] = item.value
    table["format"] = FORMAT_VERSION
    canonical = json.dumps(table, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


def describe(key: str, inputs: list[Input]) -> str:
    """`bootseer depsnap key` output: the key, then every input, one a line."""
    lines = [f"key {key}", f"  format = {FORMAT_VERSION}"]
    for item in sorted(inputs, key=lambda i: i.name):
        note = f"  ({item.note})" if item.note else ""
        lines.append(f"  {item.name} = {item.value}{note}")
    return "\n".join(lines)
