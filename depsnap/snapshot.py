"""Capturing a tree as a snapshot, and restoring one at its target.

Restoring by mount: the image is mounted read-only and an overlay on top makes
the target writable; both live in a hidden directory beside the target
(`.NAME.depsnap/`), which also records the key. Mounts appear whole or not at
all, so nothing is ever half restored.

Restoring by copy (for hosts that cannot mount, and for `run`): the image's
files are copied beside the target and renamed into place at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from depsnap import image as image_mod
from depsnap import lazy
from depsnap.cache import Cache
from depsnap.format import DEFAULT_CHUNK_SIZE, Manifest, header, pack
from depsnap.layout import is_empty_or_missing, side_dir
from depsnap.layout import write_key as _write_key
from depsnap.store import SnapshotStore

_SERVER_EXIT_S = 10.0


class RestoreError(Exception):
    """The target is in a state that a restore must not overwrite."""


def mark_installed(target: Path, key: str) -> None:
    """Record that `target` holds what `key` describes (after a miss installed it)."""
    _write_key(target, key)


def release(target: Path) -> None:
    """Remove an environment restored or installed at `target`: unmount what
    depsnap mounted there, then delete the target and its side directory."""
    _unmount_all(target)
    if target.exists():
        shutil.rmtree(target)


def _unmount_all(target: Path) -> None:
    """Unmount, top down, the overlay, the image and the lazy server the
    image reads from; then remove the side directory."""
    side = side_dir(target)
    for point in (target, side / "lower", side / "remote"):
        if point.exists() and image_mod.is_mount_point(point):
            image_mod.unmount(point)
    _wait_for_server(side)
    shutil.rmtree(side, ignore_errors=True)


def _wait_for_server(side: Path) -> None:
    """Wait for the lazy server to exit after its unmount, so a released
    environment leaves no process behind; one still there after the grace
    period (a read stuck on a store that went away) is killed: with its
    mount gone it serves nobody."""
    try:
        pid = int((side / "server.pid").read_text())
    except (FileNotFoundError, ValueError):
        return
    if _exited(pid, _SERVER_EXIT_S):
        return
    try:
        # The server leads a session of its own (it calls setsid): a PID that
        # does not is not ours any more.
        if os.getsid(pid) == pid:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _exited(pid, _SERVER_EXIT_S)


def _exited(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            # This process started it (a restore that failed half-way): reap it.
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.02)
    return False


def restore_lazily(store_uri: str, cache: Cache, target: Path, key: str) -> None:
    """Mount the snapshot of `key` in the store at `target`, read lazily through a FUSE
    server that fills the node cache behind the reads (`depsnap.lazy`)."""

    def open_image(side: Path) -> Path:
        remote = side / "remote"
        remote.mkdir()
        server = lazy.start(store_uri, key, cache, remote, side / "server.log")
        (side / "server.pid").write_text(str(server.pid))
        return remote / lazy.IMAGE_NAME

    _restore_mounted(open_image, target, key)


def restore_mounted(image: Path, target: Path, key: str) -> None:
    """Mount `image` at `target` with a writable overlay."""
    _restore_mounted(lambda side: image, target, key)


def _restore_mounted(open_image: Callable[[Path], Path], target: Path, key: str) -> None:
    if not is_empty_or_missing(target):
        raise RestoreError(f"{target} exists and is not empty")
    side = side_dir(target)
    # A side directory with no mount on the target is a leftover of a crash.
    release_side = side.exists()
    if release_side:
        release(target)
    lower, upper, work = side / "lower", side / "upper", side / "work"
    created_target = not target.exists()
    for directory in (lower, upper, work):
        directory.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    try:
        image_mod.mount_image(open_image(side), lower)
        # The overlay's root takes the upper dir's metadata: give it the image root's.
        _copy_dir_metadata(lower, upper)
        image_mod.mount_overlay(lower, upper, work, target)
        _write_key(target, key)
    except BaseException:
        _unmount_all(target)
        if created_target:
            target.rmdir()
        raise


def _copy_dir_metadata(source: Path, dest: Path) -> None:
    st = os.lstat(source)
    os.chown(dest, st.st_uid, st.st_gid)
    os.chmod(dest, st.st_mode & 0o7777)
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextmanager
def mounted_image(image: Path, near: Path) -> Iterator[Path]:
    """`image` mounted read-only on a private directory next to `near`."""
    point = Path(tempfile.mkdtemp(prefix=f".{near.name}.depsnap-ro-", dir=near.parent))
    try:
        image_mod.mount_image(image, point)
        try:
            yield point
        finally:
            image_mod.unmount(point)
    finally:
        point.rmdir()


def copy_tree(source: Path, dest: Path) -> None:
    """Copy `source`'s contents into `dest` keeping modes, owners, mtimes,
    links and xattrs (GNU cp is far quicker here than any Python loop)."""
    result = subprocess.run(
        ["cp", "-a", "--preserve=all", f"{source}/.", str(dest)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RestoreError(f"copying {source} to {dest} failed: {result.stderr.strip()}")


def restore_copied(image: Path, target: Path, key: str) -> None:
    """Copy the image's tree beside `target`, then rename it into place."""
    if not is_empty_or_missing(target):
        raise RestoreError(f"{target} exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    beside = Path(tempfile.mkdtemp(prefix=f".{target.name}.depsnap-new-", dir=target.parent))
    try:
        with mounted_image(image, target) as tree:
            copy_tree(tree, beside)
        if target.exists():
            target.rmdir()
        os.rename(beside, target)
    except BaseException:
        shutil.rmtree(beside, ignore_errors=True)
        raise
    _write_key(target, key)


@dataclass
class Captured:
    image: Path
    manifest: Manifest
    body: Path | None  # the compressed image, only when there is a store to publish to


def capture(source: Path, work: Path, manifest: Manifest, compress: bool) -> Captured:
    """Build the image of `source` in `work`, and compress it if asked."""
    image = work / "image.erofs"
    image_mod.build(source, image)
    body = None
    manifest.image_size = image.stat().st_size
    if compress:
        body = work / "body.zst"
        with open(image, "rb") as src, open(body, "wb") as out:
            pack(src, out, manifest)
    return Captured(image, manifest, body)


def publish(store: SnapshotStore, captured: Captured) -> None:
    assert captured.body is not None, "capture(compress=True) before publishing"
    with open(captured.body, "rb") as body:
        store.publish(captured.manifest.key, header(captured.manifest), body)


def new_manifest(key: str, kind: str, inputs: dict[str, str]) -> Manifest:
    return Manifest(key=key, kind=kind, image_size=0, chunk_size=DEFAULT_CHUNK_SIZE, inputs=inputs)
