"""The configuration file (TOML, default /etc/bootseer/config.toml).

Every section and key is declared here as a dataclass field; anything else in
the file is an error naming the offending key, so a typo never silently
falls back to a default. Command-line flags override the file.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from depsnap.settings import DepsnapConfig
from eventlog.settings import EventsConfig
from hdfs_fuse.settings import HdfsFuseConfig
from snapshotter.cri.settings import CriConfig
from snapshotter.fs.settings import FsConfig
from snapshotter.registry.settings import RegistryConfig
from snapshotter.settings import SnapshotterConfig
from snapshotter.trust_settings import TrustConfig

DEFAULT_PATH = Path("/etc/bootseer/config.toml")


class ConfigError(Exception):
    pass


@dataclass
class LogConfig:
    # debug, info, warning, error
    level: str = "info"
    # "json" (production), "console" (readable), "auto" (console on a terminal)
    format: str = "auto"


@dataclass
class Config:
    log: LogConfig = field(default_factory=LogConfig)
    snapshotter: SnapshotterConfig = field(default_factory=SnapshotterConfig)
    fs: FsConfig = field(default_factory=FsConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    cri: CriConfig = field(default_factory=CriConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    hdfs_fuse: HdfsFuseConfig = field(default_factory=HdfsFuseConfig)
    depsnap: DepsnapConfig = field(default_factory=DepsnapConfig)
    events: EventsConfig = field(default_factory=EventsConfig)


_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "console")


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {where}{key!r} (known: {known})")
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            if not isinstance(raw, dict):
                raise ConfigError(f"{where}{key} must be a table")
            values[key] = _build(type(default), raw, f"{where}{key}.")
        elif isinstance(default, Path):
            if not isinstance(raw, str) or not raw:
                raise ConfigError(f"{where}{key} must be a non-empty path string")
            values[key] = Path(raw)
        elif isinstance(default, list):
            if not isinstance(raw, list) or not all(isinstance(item, str) and item for item in raw):
                raise ConfigError(f"{where}{key} must be a list of non-empty strings")
            values[key] = list(raw)
        elif isinstance(default, float) and isinstance(raw, int) and not isinstance(raw, bool):
            values[key] = float(raw)
        else:
            if not isinstance(raw, type(default)) or isinstance(raw, bool) != isinstance(default, bool):
                raise ConfigError(f"{where}{key} must be a {type(default).__name__}, not {type(raw).__name__}")
            values[key] = raw
    return cls(**values)


def parse(text: str, source: str = "<config>") -> Config:
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    try:
        config: Config = _build(Config, table, "")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if config.log.level not in _LOG_LEVELS:
        raise ConfigError(f"{source}: log.level must be one of {', '.join(_LOG_LEVELS)}")
    if config.log.format not in _LOG_FORMATS:
        raise ConfigError(f"{source}: log.format must be one of {', '.join(_LOG_FORMATS)}")
    return config


def load(path: Path | None) -> Config:
    """Load `path`; with no path, the default file if it exists, else defaults."""
    if path is None:
        if not DEFAULT_PATH.exists():
            return Config()
        path = DEFAULT_PATH
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    return parse(text, str(path))
