"""The `bootseer` entry point: a command line loads its own command's
module only, and the table that says which module holds which command
matches what the modules register."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from bootseer import cli


def test_the_command_table_names_what_each_module_registers() -> None:
    for module_name, commands in cli.COMMANDS.items():
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        importlib.import_module(f"bootseer.commands.{module_name}").register(sub)
        assert tuple(sub.choices) == commands, module_name


def test_help_lists_every_command() -> None:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == [c for commands in cli.COMMANDS.values() for c in commands]


def test_a_pull_loads_neither_the_other_commands_nor_its_progress_bars() -> None:
    """What a cold `bootseer pull` would read from disk before it starts."""
    probe = (
        "import sys; from bootseer import cli; cli.build_parser(['pull', 'x']);"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('bootseer.commands.') or m == 'tqdm')))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["bootseer.commands.pull"]
