"""`bootseer`: one entry point, a subcommand per part.

Each part keeps its subcommands in its own `cli.py` with a
`register(subparsers)` function; this module only strings them together and
owns what they share (the config file and logging flags).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from bootseer import config as config_mod
from bootseer import log

# Modules with a `register(subparsers)` function, in --help order.
PARTS = ("snapshotter.cli", "snapshotter.pull", "recorder.cli", "depsnap.cli", "hdfs_fuse.cli")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help=f"TOML configuration file (default {config_mod.DEFAULT_PATH}, if it exists)",
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        help="json for machines, console for people; auto picks console on a terminal",
    )


def load_config(args: argparse.Namespace) -> config_mod.Config:
    """The config file with the common flags applied, and logging set up from it."""
    cfg = config_mod.load(args.config)
    if args.log_level:
        cfg.log.level = args.log_level
    if args.log_format:
        cfg.log.format = args.log_format
    log.configure(cfg.log.level, cfg.log.format)
    return cfg


def override(section: object, args: argparse.Namespace, **fields: str) -> None:
    """Set `section.<field>` from `args.<flag>` where the flag was given:
    command-line flags win over the config file."""
    for field_name, flag in fields.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(section, field_name, value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bootseer", description="Start large ML training jobs fast.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in PARTS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except config_mod.ConfigError as exc:
        print(f"bootseer: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
