"""What every command shares: the common flags, loading the config file with
flags applied on top, the process's event log, and the one error a command
raises to fail.

Exit codes, for every command: 0 done, 1 the work failed (`CommandError`),
2 the command line or the config file is wrong (argparse, `ConfigError`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bootseer import config as config_mod

EXIT_FAILED = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A command that cannot do its work; `main` prints the message, prefixed
    with the command's name, and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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


def read_config(args: argparse.Namespace) -> config_mod.Config:
    """The config file with the common flags applied. Standard library only:
    `bootseer pull` reads it on its way to the snapshotter daemon."""
    cfg = config_mod.load(args.config)
    if args.log_level:
        cfg.log.level = args.log_level
    if args.log_format:
        cfg.log.format = args.log_format
    return cfg


def configure_logging(cfg: config_mod.Config) -> None:
    from bootseer import log

    log.configure(cfg.log.level, cfg.log.format)


def load_config(args: argparse.Namespace) -> config_mod.Config:
    """The config file with the common flags applied, and logging set up from it."""
    cfg = read_config(args)
    configure_logging(cfg)
    return cfg


def override(section: object, args: argparse.Namespace, **fields: str) -> None:
    """Set `section.<field>` from `args.<flag>` where the flag was given:
    command-line flags win over the config file."""
    for field_name, flag in fields.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(section, field_name, value)


def configure_events(cfg: config_mod.Config, name: str) -> None:
    """The event log of this process, from the config's [events] section:
    what each composition root calls before it serves."""
    import eventlog

    events = cfg.events
    eventlog.configure(events.dir, name, events.max_bytes, events.summary_interval_s)
