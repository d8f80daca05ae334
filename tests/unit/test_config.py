from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from bootseer import cli
from bootseer.config import Config, ConfigError, load, parse


def test_empty_file_gives_defaults() -> None:
    assert parse("") == Config()


def test_values_are_read_and_typed() -> None:
    cfg = parse(
        """
        [log]
        level = "debug"
        format = "json"
        [snapshotter]
        root = "/srv/bs"
        address = "/run/bs.sock"
        metrics_address = "127.0.0.1:9701"
        """
    )
    assert cfg.log.level == "debug"
    assert cfg.snapshotter.root == Path("/srv/bs")
    assert cfg.snapshotter.address == Path("/run/bs.sock")
    assert cfg.snapshotter.metrics_address == "127.0.0.1:9701"


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("[snapshotter]\nroots = '/x'", "unknown key snapshotter.'roots'"),
        ("[snapshoter]\nroot = '/x'", "unknown key 'snapshoter'"),
        ("[snapshotter]\nroot = 3", "snapshotter.root must be a non-empty path string"),
        ("[log]\nlevel = 'loud'", "log.level must be one of"),
        ("snapshotter = 3", "snapshotter must be a table"),
        ("[log\n", "not valid TOML"),
    ],
)
def test_bad_config_is_a_clear_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text, "cfg.toml")
    assert fragment in str(info.value)
    assert str(info.value).startswith("cfg.toml: ")


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path / "nope.toml")


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.toml"
    bad.write_text("[snapshotter]\nrooot = '/x'\n")
    assert cli.main(["snapshotter", "--config", str(bad)]) == 2
    assert "unknown key snapshotter.'rooot'" in capsys.readouterr().err


def test_the_documented_config_lists_every_key_with_the_code_default() -> None:
    example = Path(__file__).parents[2] / "docs" / "config.toml"
    documented = tomllib.loads(example.read_text())
    for section in dataclasses.fields(Config):
        keys = {f.name for f in dataclasses.fields(getattr(Config(), section.name))}
        assert set(documented[section.name]) == keys, section.name
    assert parse(example.read_text(), str(example)) == Config()
