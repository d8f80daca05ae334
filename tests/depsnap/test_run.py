"""`run`: a command's effects captured once and replayed, with every kind of file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.depsnap.conftest import Work
from tests.harness.tree import diff, walk

# Writes what real installers write: modes (setuid included), a symlink, a
# hardlink, an xattr and a fixed mtime; and edits and deletes in an existing tree.
SCRIPT = """
import os, sys
out, existing = sys.argv[1], sys.argv[2]
os.makedirs(f"{out}/bin/sub")
with open(f"{out}/bin/tool", "w") as f:
    f.write("#!/bin/sh\\necho tool\\n")
os.chmod(f"{out}/bin/tool", 0o4755)
os.symlink("tool", f"{out}/bin/tool-link")
os.link(f"{out}/bin/tool", f"{out}/bin/sub/tool-hard")
with open(f"{out}/data", "wb") as f:
    f.write(os.urandom(100_000))
os.setxattr(f"{out}/data", "user.origin", b"depsnap-test")
os.utime(f"{out}/data", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
with open(f"{existing}/changed", "a") as f:
    f.write("more\\n")
os.unlink(f"{existing}/removed")
open(f"{existing}/added", "w").write("new\\n")
"""


def setup_existing(root: Path) -> Path:
    existing = root / "existing"
    shutil.rmtree(existing, ignore_errors=True)
    existing.mkdir()
    (existing / "changed").write_text("start\n")
    (existing / "removed").write_text("bye\n")
    (existing / "untouched").write_text("same\n")
    return existing


def test_run_replays_the_commands_effects(work: Work) -> None:
    script = work.root / "install.py"
    script.write_text(SCRIPT)
    out = work.root / "opt" / "thing"
    existing = setup_existing(work.root)
    argv = [
        "depsnap",
        "run",
        "--input",
        str(script),
        "--path",
        str(out),
        "--path",
        str(existing),
        "--store",
        str(work.store),
        "--cache-dir",
        str(work.cache),
        "--socket",
        str(work.root / "none.sock"),
        "--",
        "python3",
        str(script),
        str(out),
        str(existing),
    ]
    first = work.bootseer(*argv)
    assert "depsnap: miss" in first.stderr
    after_out, after_existing = walk(out), walk(existing)
    data_mtime = os.stat(out / "data").st_mtime_ns

    shutil.rmtree(out)
    setup_existing(work.root)
    shutil.rmtree(work.cache)
    second = work.bootseer(*argv)
    assert "depsnap: hit" in second.stderr, second.stderr
    assert diff(after_out, walk(out), "ran", "restored") == ""
    assert diff(after_existing, walk(existing), "ran", "restored") == ""
    assert os.getxattr(out / "data", "user.origin") == b"depsnap-test"
    assert os.stat(out / "data").st_mtime_ns == data_mtime
    assert os.stat(out / "bin" / "tool").st_ino == os.stat(out / "bin" / "sub" / "tool-hard").st_ino
    assert not (existing / "removed").exists()
    assert (existing / "changed").read_text() == "start\nmore\n"


def test_failed_command_publishes_nothing(work: Work) -> None:
    out = work.root / "out"
    result = work.bootseer(
        "depsnap",
        "run",
        "--path",
        str(out),
        "--store",
        str(work.store),
        "--cache-dir",
        str(work.cache),
        "--socket",
        str(work.root / "none.sock"),
        "--",
        "sh",
        "-c",
        f"mkdir {out} && touch {out}/half && exit 7",
        check=False,
    )
    assert result.returncode == 7
    assert not work.store.exists() or list(work.store.iterdir()) == []
    assert list((work.cache / "images").iterdir()) == []
