"""`bootseer`: one entry point, a subcommand per part.

The commands live in `bootseer.commands`, one module per part, each with a
`register(subparsers)` function; the parts themselves are libraries and
daemons that never import this package.
"""

from __future__ import annotations

import argparse
import sys

from bootseer.commands import depsnap, hdfs_fuse, pull, record, report, snapshotter, trust
from bootseer.config import ConfigError
from bootseer.options import EXIT_USAGE, CommandError

# In --help order.
COMMANDS = (snapshotter, pull, record, depsnap, hdfs_fuse, trust, report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bootseer", description="Start large ML training jobs fast.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
