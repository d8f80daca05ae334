"""The `[cri]` section, and the credentials path's one default."""

from __future__ import annotations

from pathlib import Path

from bootseer.config import parse
from snapshotter.cri.credentials import DEFAULT_PATH
from snapshotter.registry.settings import RegistryConfig

EXAMPLE = Path(__file__).parents[2] / "docs" / "config.toml"


def test_the_credentials_default_is_the_store_default() -> None:
    assert Path(RegistryConfig().cri_credentials) == DEFAULT_PATH


def test_cri_section_is_read() -> None:
    cfg = parse('[cri]\naddress = "/run/bootseer/cri.sock"\ncontainerd_address = "/x.sock"\n')
    assert cfg.cri.address == "/run/bootseer/cri.sock" and cfg.cri.containerd_address == Path("/x.sock")
