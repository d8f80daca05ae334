"""`run`: memoise any install step by its effects on the paths it writes.

On a miss the command runs; what it created, changed or deleted under each
path is found by comparing the trees before and after, and captured as an
image whose top-level directories 0, 1, ... hold the new and changed entries
of each path, beside `deleted.json`. On a hit those are copied into place and
the deletions replayed. A path that did not exist before is restored beside
and renamed into place; an existing one (/usr/local, say) is merged into.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from depsnap.client import Node
from depsnap.ensure import capture_tree, fetch
from depsnap.inputs import RunRequest, for_run
from depsnap.key import compute
from depsnap.outcome import Outcome
from depsnap.snapshot import copy_tree, mounted_image

log = structlog.get_logger("depsnap")

_DELETED = "deleted.json"


@dataclass(frozen=True)
class State:
    """What identifies a version of an inode: any change moves ctime."""

    mode: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def scan(root: Path) -> dict[str, State]:
    """Every entry under `root` (relative paths, "" for root itself), not following links."""
    found: dict[str, State] = {}
    if not root.exists():
        return found

    def record(path: str, rel: str) -> os.stat_result:
        st = os.lstat(path)
        found[rel] = State(st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        return st

    record(str(root), "")
    for dirpath, dirnames, filenames in os.walk(root):
        base = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            rel = name if base == "." else f"{base}/{name}"
            record(os.path.join(dirpath, name), rel)
    return found


def changes(before: dict[str, State], after: dict[str, State]) -> tuple[list[str], list[str]]:
    """(new or changed entries, deleted entries): pure, on two scans.

    Deleted entries under a deleted directory are left out: removing the
    directory removes them.
    """
    changed = sorted(rel for rel, st in after.items() if before.get(rel) != st)
    gone = sorted(set(before) - set(after))
    gone_set = set(gone)
    return changed, [rel for rel in gone if rel == "" or os.path.dirname(rel) not in gone_set]


def _copy_meta(source: str, dest: str) -> None:
    st = os.lstat(source)
    os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest, stat.S_IMODE(st.st_mode))
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def stage(root: Path, changed: list[str], into: Path) -> None:
    """Recreate `changed` entries of `root` under `into` (hardlinked when the
    filesystem allows, so staging costs no copy and hardlinks stay hardlinks)."""
    into.mkdir()
    directories = [""]
    for rel in changed:
        if rel == "":
            continue
        source, dest = root / rel, into / rel
        parent = os.path.dirname(rel)
        while parent and not (into / parent).exists():
            directories.append(parent)
            parent = os.path.dirname(parent)
        dest.parent.mkdir(parents=True, exist_ok=True)
        st = os.lstat(source)
        if stat.S_ISDIR(st.st_mode):
            dest.mkdir(exist_ok=True)
            directories.append(rel)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(source), dest)
            _copy_meta(str(source), str(dest))
        elif stat.S_ISREG(st.st_mode):
            try:
                os.link(source, dest)
            except OSError:
                shutil.copy2(source, dest, follow_symlinks=False)
                _copy_meta(str(source), str(dest))
        else:
            log.warning("not capturing a special file", path=str(source))
    # Deepest first: creating children would move a parent's mtime again.
    for rel in sorted(set(directories), key=lambda r: r.count("/") + bool(r), reverse=True):
        _copy_meta(str(root / rel) if rel else str(root), str(into / rel) if rel else str(into))


def apply(source: Path, dest: Path, deleted: list[str]) -> None:
    """Put one captured path in place."""
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        beside = Path(tempfile.mkdtemp(prefix=f".{dest.name}.depsnap-new-", dir=dest.parent))
        try:
            copy_tree(source, beside)
            os.rename(beside, dest)
        except BaseException:
            shutil.rmtree(beside, ignore_errors=True)
            raise
        return
    copy_tree(source, dest)
    for rel in deleted:
        victim = dest / rel
        if victim.is_dir() and not victim.is_symlink():
            shutil.rmtree(victim)
        elif victim.exists() or victim.is_symlink():
            victim.unlink()


def memoise(request: RunRequest, node: Node, store_uri: str | None) -> Outcome:
    started = time.monotonic()
    inputs = for_run(request, os.environ, Path.cwd())
    key = compute(inputs)
    paths = [p.absolute() for p in request.paths]

    def done(status: str, detail: str, rc: int = 0) -> Outcome:
        return Outcome(status, key, time.monotonic() - started, detail, rc)

    found = fetch(node, key, store_uri)
    if found is not None:
        try:
            with mounted_image(found.path, paths[0]) as tree:
                deleted = json.loads((tree / _DELETED).read_text())
                for index, path in enumerate(paths):
                    apply(tree / str(index), path, deleted[index])
        finally:
            found.close()
        return done("hit", f"restored {len(paths)} path(s) from {found.source} via {node.where}")

    before = [scan(p) for p in paths]
    rc = subprocess.run(request.command, check=False).returncode
    if rc != 0:
        return done("failed", f"command exited with status {rc}; nothing published", rc)
    staging = Path(tempfile.mkdtemp(prefix=f".{paths[0].name}.depsnap-run-", dir=paths[0].parent))
    try:
        all_deleted = []
        for index, (path, old) in enumerate(zip(paths, before, strict=True)):
            changed, deleted = changes(old, scan(path))
            if path.exists():
                stage(path, changed, staging / str(index))
            else:
                (staging / str(index)).mkdir()
            all_deleted.append(deleted)
        (staging / _DELETED).write_text(json.dumps(all_deleted))
        detail = capture_tree(node, staging, key, "run", inputs, store_uri, [str(p) for p in paths])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return done("miss", f"ran the command, {detail}")
