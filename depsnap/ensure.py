"""`ensure`: the environment for a set of requirements, restored on a hit,
installed and captured on a miss."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import structlog

import eventlog
from depsnap import installer, layout, snapshot
from depsnap.client import Image, LocalNode, Node
from depsnap.format import CorruptSnapshot, read_manifest
from depsnap.image import ImageError
from depsnap.inputs import EnvRequest, for_env
from depsnap.key import Input, compute
from depsnap.outcome import Outcome
from depsnap.store import StoreUnavailable, open_store

log = structlog.get_logger("depsnap")


def fetch(node: Node, key: str, store_uri: str | None) -> Image | None:
    """The image for `key` from the node cache or the store; None means install.

    Every reason to fall back to installing is logged as a warning: the job
    still starts, and the log says why it was slow.
    """
    try:
        return node.fetch(key, store_uri)
    except StoreUnavailable as exc:
        log.warning("store unreachable, installing instead", key=key, reason=str(exc))
    except CorruptSnapshot as exc:
        log.warning("snapshot corrupt, discarding it and installing", key=key, reason=str(exc))
        node.discard(key)
        if store_uri:
            try:
                open_store(store_uri).delete(key)
            except StoreUnavailable as delete_exc:
                log.warning("could not delete the corrupt snapshot", reason=str(delete_exc))
    return None


def lazy_restore(node: LocalNode, key: str, store_uri: str | None, target: Path, min_bytes: int) -> int | None:
    """Mount the store's snapshot at `target`, read lazily, when the node
    lacks it and it is large enough to be worth a FUSE server; its image size
    if so. Anything else (or any failure) leaves the whole-image fetch to run."""
    if not store_uri or node.cache.lookup(key) is not None:
        return None
    try:
        store = open_store(store_uri)
        stream = store.get(key)
        if stream is None:
            return None
        with stream:
            manifest = read_manifest(stream, key)
        if manifest.image_size < min_bytes:
            return None
        snapshot.restore_lazily(store_uri, node.cache, target, key)
    except (StoreUnavailable, CorruptSnapshot, ImageError, snapshot.RestoreError, OSError) as exc:
        log.warning("lazy restore failed, fetching the whole image", key=key, reason=str(exc))
        return None
    return manifest.image_size


def publish(node: Node, captured: snapshot.Captured, store_uri: str | None) -> str:
    """Hand the capture to the node cache and the store; what went where."""
    places = []
    try:
        node.put(captured.manifest.key, captured.image)
        places.append("node cache")
    except OSError as exc:
        log.warning("could not add the snapshot to the node cache", reason=str(exc))
    if store_uri and captured.body is not None:
        try:
            snapshot.publish(open_store(store_uri), captured)
            places.append(store_uri)
        except StoreUnavailable as exc:
            log.warning("could not publish the snapshot", reason=str(exc))
    return "captured to " + (", ".join(places) if places else "nowhere")


def capture_tree(
    node: Node,
    tree: Path,
    key: str,
    kind: str,
    inputs: list[Input],
    store_uri: str | None,
    paths: list[str] | None = None,
) -> str:
    manifest = snapshot.new_manifest(key, kind, {i.name: i.value for i in inputs})
    manifest.paths = paths or []
    work = Path(tempfile.mkdtemp(prefix=f".{tree.name}.depsnap-capture-", dir=tree.parent))
    try:
        captured = snapshot.capture(tree, work, manifest, compress=bool(store_uri))
        return publish(node, captured, store_uri)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure(
    request: EnvRequest,
    node: Node,
    store_uri: str | None,
    restore_mode: str = "mount",
    lazy_min_bytes: int | None = None,
) -> Outcome:
    started = time.monotonic()
    started_at = eventlog.now()
    inputs = for_env(request, os.environ, Path.cwd())
    key = compute(inputs)
    target = request.target.absolute()

    def done(status: str, detail: str, rc: int = 0) -> Outcome:
        # A restore on a hit, an install on a miss: `bootseer report` tells them apart by status.
        eventlog.emit(
            "depsnap.ensure",
            status=status,
            key=key,
            target=str(target),
            detail=detail,
            start=started_at,
            end=eventlog.now(),
            cgroup=eventlog.cgroup_of(os.getpid()),
        )
        return Outcome(status, key, time.monotonic() - started, detail, rc)

    if layout.present_key(target) == key and target.exists():
        return done("present", f"already at {target}")
    if not layout.is_empty_or_missing(target):
        raise snapshot.RestoreError(
            f"{target} exists and holds something else; remove it (bootseer depsnap release) first"
        )
    if restore_mode == "mount" and lazy_min_bytes is not None and isinstance(node, LocalNode):
        size = lazy_restore(node, key, store_uri, target, lazy_min_bytes)
        if size is not None:
            return done("hit", f"{size} image bytes from store, read lazily via {node.where}, mounted")
    found = fetch(node, key, store_uri)
    if found is not None:
        try:
            restore = snapshot.restore_mounted if restore_mode == "mount" else snapshot.restore_copied
            restore(found.path, target, key)
        except (ImageError, snapshot.RestoreError, OSError) as exc:
            log.warning("restore failed, installing instead", key=key, reason=str(exc))
        else:
            where = "node cache" if found.source == "cache" else "store"
            return done("hit", f"{found.size} image bytes from {where} via {node.where}, {restore_mode}ed")
        finally:
            found.close()

    steps = installer.plan(request.installer, request.python, target, request.requirements)
    rc = installer.run(steps)
    if rc != 0:
        # A failed install is neither published nor left half-built at the target.
        shutil.rmtree(target, ignore_errors=True)
        return done("failed", f"{request.installer} exited with status {rc}; nothing published", rc)
    snapshot.mark_installed(target, key)
    detail = capture_tree(node, target, key, "env", inputs, store_uri)
    return done("miss", f"installed with {request.installer}, {detail}")
