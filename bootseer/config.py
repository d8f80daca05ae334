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
from hdfs_fuse.settings import HdfsFuseConfig

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
class SnapshotterConfig:
    root: Path = Path("/var/lib/bootseer/snapshotter")
    address: Path = Path("/run/bootseer/snapshotter.sock")
    # host:port for Prometheus metrics; empty turns them off.
    metrics_address: str = ""
    # Serve indexed layers lazily through the FUSE layer server.
    lazy: bool = True


@dataclass
class FsConfig:
    """The FUSE layer server, and where the snapshotter finds it."""

    # Layer indexes, block caches and the block index.
    store: Path = Path("/var/lib/bootseer/layers")
    # The single FUSE mount; short, because every lazy layer's path under it
    # goes into an overlay lowerdir option that must fit in one page.
    mountpoint: Path = Path("/var/lib/bootseer/m")
    max_parallel_fetches: int = 8
    metrics_address: str = ""
    # A stored layer no snapshot uses is removed by containerd's cleanup once
    # it is this old (younger ones may belong to a pull under way).
    layer_gc_grace_s: float = 600.0
    # Record first runs and prefetch hot-block manifests (off: neither).
    hot_blocks: bool = True
    # Hot blocks: a first run's recording ends once no new block was read
    # for record_idle_s, or after record_max_s.
    record_idle_s: float = 10.0
    record_max_s: float = 300.0
    # Parallel Range requests of the hot-block prefetcher (per image).
    prefetch_parallel: int = 4
    # Fetch every served layer whole in the background, at most
    # background_bandwidth bytes/s, pausing while readers wait on fetches.
    background_fetch: bool = False
    background_bandwidth: int = 50_000_000
    # Layers at most this big (compressed) are fetched whole as soon as they
    # are served, with the prefetch slots: a few Range requests instead of a
    # miss per file (0: off).
    whole_layer_bytes: int = 32 << 20


@dataclass
class RegistryConfig:
    # containerd's hosts directory: certs.d/<host>/hosts.toml (mirrors, plain HTTP, CAs).
    config_path: Path = Path("/etc/containerd/certs.d")
    # Docker credentials file; empty means $DOCKER_CONFIG/config.json or ~/.docker/config.json.
    docker_config: str = ""


@dataclass
class Config:
    log: LogConfig = field(default_factory=LogConfig)
    snapshotter: SnapshotterConfig = field(default_factory=SnapshotterConfig)
    fs: FsConfig = field(default_factory=FsConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    hdfs_fuse: HdfsFuseConfig = field(default_factory=HdfsFuseConfig)
    depsnap: DepsnapConfig = field(default_factory=DepsnapConfig)


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
        elif isinstance(default, float) and isinstance(raw, int) and not isinstance(raw, bool):
            values[key] = float(raw)
        else:
            if not isinstance(raw, type(default)) or isinstance(raw, bool) != isinstance(default, bool):
                raise ConfigError(
                    f"{where}{key} must be a {type(default).__name__}, not {type(raw).__name__}"
                )
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
