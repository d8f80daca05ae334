"""`bootseer`: one entry point, a subcommand per part.

The commands live in `bootseer.commands`, one module per part, each with a
`register(subparsers)` function; the parts themselves are libraries and
daemons that never import this package.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from bootseer.config import ConfigError
from bootseer.options import EXIT_USAGE, CommandError

# The modules under bootseer.commands, in --help order, with the commands
# each registers. A command line that names a command imports that module
# only: `bootseer pull` sits on the path to a container's start and should
# not load depsnap, hdfs-fuse or the report as well (tens of milliseconds
# from a cold page cache).
COMMANDS = {
    "snapshotter": ("snapshotter", "layer-server", "index"),
    "pull": ("pull",),
    "record": ("record",),
    "depsnap": ("depsnap",),
    "hdfs_fuse": ("hdfs-fuse",),
    "trust": ("trust",),
    "report": ("report",),
}


def _modules(argv: list[str]) -> list[ModuleType]:
    """The command modules `argv` needs: the one its command is in, or all
    of them (for --help, or a command line argparse will refuse)."""
    wanted = [name for name, commands in COMMANDS.items() if argv and argv[0] in commands]
    return [importlib.import_module(f"bootseer.commands.{name}") for name in wanted or COMMANDS]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (None: for every command)."""
    parser = argparse.ArgumentParser(prog="bootseer", description="Start large ML training jobs fast.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _modules(argv or []):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"bootseer: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as exc:
        print(f"bootseer {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
