"""`ensure` end to end with real pip and real uv, offline from the test wheelhouse."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.depsnap.conftest import Work
from tests.harness.procs import wait_until
from tests.harness.tree import diff, walk

REQUIREMENTS = "dsdemo==1.0\n-c constraints.txt\n"
CONSTRAINTS = "dsspeed==1.0\n"


def mtimes(root: Path) -> dict[str, int]:
    """Every non-directory's mtime: .pyc files are valid only while these hold."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, root)] = os.lstat(path).st_mtime_ns
    return found


def pycs(root: Path) -> dict[str, int]:
    return {p: m for p, m in mtimes(root).items() if p.endswith(".pyc")}


def use_environment(env: Path) -> None:
    """Imports, the .pth file, the console script and the compiled extension all work,
    and pip sees a consistent environment."""
    python = env / "bin" / "python"
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import dsdemo, dsspeed, dsdemo_plugin;print(dsspeed.add(2, 40), dsdemo_plugin.PLUGIN)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "42 loaded through the .pth file"
    hello = subprocess.run([str(env / "bin" / "dsdemo-hello")], capture_output=True, text=True, check=True)
    assert hello.stdout.strip() == "hello from dsdemo 1.0"
    check = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def status(result: subprocess.CompletedProcess[str]) -> str:
    line = [x for x in result.stdout.splitlines() if x.startswith("depsnap: ")][-1]
    return line.split()[1]


RESTORE_ARGS = {
    "mount": ("--restore", "mount", "--lazy-min-bytes", "-1"),
    "copy": ("--restore", "copy"),
    # Read from the store through depsnap's FUSE server, whatever the size.
    "lazy": ("--restore", "mount", "--lazy-min-bytes", "0"),
}


@pytest.mark.parametrize("installer,restore", [("uv", "mount"), ("pip", "mount"), ("uv", "copy"), ("uv", "lazy")])
def test_restored_environment_equals_installed(work: Work, installer: str, restore: str) -> None:
    req = work.requirements(REQUIREMENTS)
    work.requirements(CONSTRAINTS, "constraints.txt")
    target = work.root / "env"
    args = ("--installer", installer, *RESTORE_ARGS[restore])

    first = work.ensure(req, target, *args)
    assert status(first) == "miss", first.stdout
    installed, installed_mtimes = walk(target), mtimes(target)
    assert any(p.endswith(".pyc") for p in installed_mtimes)
    use_environment(target)

    # A fresh node: no environment, no node cache; the snapshot comes from the store.
    work.bootseer("depsnap", "release", "--target", str(target))
    shutil.rmtree(work.cache)
    second = work.ensure(req, target, *args)
    assert status(second) == "hit", second.stdout + second.stderr
    assert "from store" in second.stdout
    assert ("read lazily" in second.stdout) == (restore == "lazy")

    assert diff(installed, walk(target), "installed", "restored") == ""
    assert mtimes(target) == installed_mtimes
    before = pycs(target)
    use_environment(target)
    assert pycs(target) == before, "the first import compiled .pyc files"
    if restore in ("mount", "lazy"):
        upper = target.parent / f".{target.name}.depsnap" / "upper"
        assert list(upper.iterdir()) == [], "using the environment wrote into it"
    if restore == "lazy":
        # The server fills the node cache behind the reads.
        wait_until(lambda: any((work.cache / "images").iterdir()), 60, "the node cache to fill")

    # And once more from the node cache, on a target released in between.
    work.bootseer("depsnap", "release", "--target", str(target))
    third = work.ensure(req, target, *args)
    assert status(third) == "hit" and "from node cache" in third.stdout
    assert diff(installed, walk(target), "installed", "restored") == ""


def test_restored_environment_is_writable_and_ensure_again_is_a_no_op(work: Work) -> None:
    req = work.requirements("dsdemo==1.0\n")
    target = work.root / "env"
    work.ensure(req, target)
    work.bootseer("depsnap", "release", "--target", str(target))
    assert status(work.ensure(req, target)) == "hit"
    (target / "lib" / "scratch.txt").write_text("mine")
    again = work.ensure(req, target)
    assert status(again) == "present"
    assert (target / "lib" / "scratch.txt").read_text() == "mine"


def test_another_target_path_does_not_reuse_the_snapshot(work: Work) -> None:
    req = work.requirements("dsdemo==1.0\n")
    a = work.ensure(req, work.root / "a")
    b = work.ensure(req, work.root / "b")
    assert status(a) == status(b) == "miss"
    assert a.stdout.split()[2] != b.stdout.split()[2]
    # Same inputs, same target: the same key, so a hit.
    work.bootseer("depsnap", "release", "--target", str(work.root / "a"))
    again = work.ensure(req, work.root / "a")
    assert status(again) == "hit" and again.stdout.split()[2] == a.stdout.split()[2]
    # The scripts really are tied to their path: the snapshot would not be valid elsewhere.
    assert str(work.root / "b") in (work.root / "b" / "bin" / "dsdemo-hello").read_text()


def test_key_command_prints_the_same_key_ensure_uses(work: Work) -> None:
    req = work.requirements("dsdemo==1.0\n")
    target = work.root / "env"
    from tests.depsnap.conftest import PYTHON

    key = work.bootseer("depsnap", "key", "-r", str(req), "--target", str(target), "--python", str(PYTHON))
    ensured = work.ensure(req, target)
    assert key.stdout.split()[1] == ensured.stdout.split()[2]
    assert "base_image = sha256:abab" in key.stdout


def test_unreachable_store_installs_with_a_warning(work: Work) -> None:
    from tests.harness.procs import free_tcp_port

    req = work.requirements("dsdemo==1.0\n")
    endpoint = f"127.0.0.1:{free_tcp_port()}"
    store = f"s3://bucket/snaps?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    target = work.root / "env"
    result = work.bootseer(
        "depsnap",
        "ensure",
        "-r",
        str(req),
        "--target",
        str(target),
        "--store",
        store,
        "--cache-dir",
        str(work.cache),
        "--socket",
        str(work.root / "none.sock"),
        "--log-format",
        "json",
    )
    assert status(result) == "miss"
    assert "store unreachable, installing instead" in result.stderr
    use_environment(target)


def test_corrupt_snapshot_is_discarded_and_the_install_runs(work: Work) -> None:
    req = work.requirements("dsdemo==1.0\n")
    target = work.root / "env"
    key = work.ensure(req, target).stdout.split()[2]
    snapshot = work.store / f"{key}.dsnap"
    data = bytearray(snapshot.read_bytes())
    data[-100] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    work.bootseer("depsnap", "release", "--target", str(target))
    shutil.rmtree(work.cache)

    result = work.ensure(req, target)
    assert status(result) == "miss"
    assert "snapshot corrupt, discarding it and installing" in result.stderr
    use_environment(target)
    # What the install captured replaced the damaged snapshot.
    work.bootseer("depsnap", "release", "--target", str(target))
    shutil.rmtree(work.cache)
    assert status(work.ensure(req, target)) == "hit"


def test_failed_install_publishes_nothing(work: Work) -> None:
    req = work.requirements("dsdemo==1.0\nno-such-package==9.9\n")
    target = work.root / "env"
    result = work.ensure(req, target, check=False)
    assert result.returncode != 0
    assert status(result) == "failed"
    assert not target.exists()
    assert not work.store.exists() or list(work.store.iterdir()) == []
    assert list((work.cache / "images").iterdir()) == []


def test_target_holding_something_else_is_refused(work: Work) -> None:
    req = work.requirements("dsdemo==1.0\n")
    target = work.root / "env"
    target.mkdir()
    (target / "precious").write_text("keep me")
    result = work.ensure(req, target, check=False)
    assert result.returncode == 2 and "holds something else" in result.stderr
    assert (target / "precious").read_text() == "keep me"
