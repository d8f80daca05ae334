"""The snapshotter proper: containerd's snapshot semantics over the metadata
store and one directory per snapshot.

Layout under the root (paths stay short because containerd passes every
lower directory in one `lowerdir=` option that must fit in a page):

    metadata.lmdb/          the metadata store
    snapshots/<id>/fs       the snapshot's filesystem (overlay upper dir)
    snapshots/<id>/work     overlay work dir

Crash safety: a directory is created under a temporary name and renamed to
its id inside the metadata transaction that records it; removal deletes the
record first and the directory after. Whatever a kill -9 interrupts, the
store is consistent and at worst a directory no snapshot owns is left, which
`cleanup` removes.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import structlog

import eventlog
from snapshotter import filters, metrics
from snapshotter import labels as label_keys
from snapshotter.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SnapshotError,
    Unavailable,
)
from snapshotter.labels import RemoteLayerLabels
from snapshotter.model import Kind, Snapshot, validate_key, validate_labels
from snapshotter.mounts import Mount, snapshot_mounts
from snapshotter.remote import LazyLayer, Reason, RemoteLayers, RemotePrepare, reason_of
from snapshotter.store import MetadataStore, Txn
from snapshotter.usage import TreeChanged, TreeError, Usage, disk_usage, remove_tree

log = structlog.get_logger("bootseer.snapshotter")

_INDEX_PARAM = Path("/sys/module/overlay/parameters/index")
# Beside a lazily served snapshot's "fs": where its Prepare found the layer
# (the layer mount or its plain twin), for when "fs" points at a local copy.
SERVED_LINK = "served"

# Every series exists from the start, at zero: an alert on a rate of
# `path="normal"` sees its first fallback.
_LAYERS = {reason: metrics.LAYERS.labels(reason.path, reason.value) for reason in Reason}


class Snapshotter:
    def __init__(self, root: Path, remote: RemoteLayers | None = None) -> None:
        self.root = root
        self.snapshots_dir = root / "snapshots"
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.store = MetadataStore(root / "metadata.lmdb")
        # As containerd does: with the overlay index feature available, turn it
        # off so that the same lower dirs can back many mounts.
        self.overlay_options = ["index=off"] if _INDEX_PARAM.exists() else []
        # One writer at a time; filesystem work happens under it too, so a
        # directory never exists for a transaction that is still open elsewhere.
        self._write_lock = threading.Lock()
        self.remote = remote

    def close(self) -> None:
        self.store.close()

    def _dir(self, snap_id: int | str) -> Path:
        return self.snapshots_dir / str(snap_id)

    def fs_path(self, snap: Snapshot) -> Path:
        return self._dir(snap.id) / "fs"

    # -- creating ---------------------------------------------------------

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        remote = RemoteLayerLabels.parse(labels)
        if remote is not None:
            if self.remote is None:
                # Chosen by the admin: counted, not warned about.
                _LAYERS[Reason.LAZY_DISABLED].inc()
            else:
                self._try_remote(key, parent, labels, remote)
        return self._create(Kind.ACTIVE, key, parent, labels)

    def _try_remote(self, key: str, parent: str, labels: dict[str, str], remote: RemoteLayerLabels) -> None:
        """Serve the layer lazily if its index is found: commit it under a
        name of our own with the target label and raise AlreadyExists, which
        tells containerd to skip the download. Returns only to fall back."""
        assert self.remote is not None
        target = remote.target
        started = eventlog.now()

        def record(path: str, reason: Reason, error: str = "") -> None:
            # What `bootseer report` shows for the layer: which path and why.
            eventlog.emit(
                "prepare",
                image_ref=remote.image_ref,
                manifest=remote.manifest_digest,
                layer=remote.layer_digest,
                target=target,
                path=path,
                reason=reason.value,
                error=error,
                start=started,
                end=eventlog.now(),
            )

        # containerd finds the snapshot by label and parent; the name only has
        # to be unique, per namespace like the keys containerd sends.
        namespace = key.split("/", 1)[0] if "/" in key else ""
        name = f"{namespace}/remote/{target}" if namespace else f"remote/{target}"
        with self.store.read() as txn:
            existing = txn.get(name)
            parent_snap = txn.get(parent) if parent else None
            chain = [parent_snap, *txn.ancestors(parent_snap)] if parent_snap is not None else []
        if existing is not None and existing.parent == parent:
            _LAYERS[Reason.SERVED].inc()
            record("lazy", Reason.SERVED)
            raise AlreadyExists(f"target snapshot {target!r} is already served lazily as {name!r}")
        lowers = tuple(self.fs_path(s) for s in chain)
        try:
            # The parent's chainID binds the layer's index to the target. A
            # cleanup meanwhile leaves the layer until the snapshot using it is recorded.
            with self.remote.claim(remote.layer_digest):
                lazy = self.remote.prepare(RemotePrepare.of(remote, parent, lowers))
                self._commit_remote(name, parent, {**labels, label_keys.REMOTE: "true"}, lazy)
        except AlreadyExists:
            # Committed meanwhile by a Prepare of the same layer: served lazily all the same.
            _LAYERS[Reason.SERVED].inc()
            record("lazy", Reason.SERVED)
            raise
        except Exception as exc:
            # The pull goes on (containerd downloads the layer), but a node
            # that was meant to pull lazily should say that it does not.
            reason = reason_of(exc)
            _LAYERS[reason].inc()
            record("normal", reason, str(exc))
            log.warning(
                "layer takes the normal path",
                target=target,
                parent=parent,
                image=remote.image_ref,
                layer=remote.layer_digest,
                reason=reason.value,
                error=str(exc),
                **({"exc_info": exc} if reason is Reason.ERROR else {}),
            )
            return
        _LAYERS[Reason.SERVED].inc()
        record("lazy", Reason.SERVED)
        log.info("layer served lazily", target=target, parent=parent, snapshot=name, layer=str(lazy.path))
        raise AlreadyExists(f"target snapshot {target!r} is served lazily as {name!r}")

    def _commit_remote(self, name: str, parent: str, labels: dict[str, str], lazy: LazyLayer) -> None:
        def populate(staging: Path, _parent: Snapshot | None) -> None:
            staging.mkdir(mode=0o700)
            # The layer's files are the FUSE server's directory; a symlink
            # keeps the overlay lowerdir path short. A second one remembers
            # which layer mount served it, for when "fs" points elsewhere.
            os.symlink(lazy.path, staging / "fs")
            os.symlink(lazy.path, staging / SERVED_LINK)

        validate_labels(labels)
        self._insert(
            Kind.COMMITTED,
            name,
            parent,
            labels,
            populate,
            size=lazy.index.uncompressed_size,
            inodes=len(lazy.index.entries),
        )

    def view(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        return self._create(Kind.VIEW, key, parent, labels)

    def _create(self, kind: Kind, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        validate_key("snapshot key", key)
        validate_labels(labels)
        return self._insert(kind, key, parent, labels, self._make_dirs)

    def _insert(
        self,
        kind: Kind,
        key: str,
        parent: str,
        labels: dict[str, str],
        populate: Callable[[Path, Snapshot | None], None],
        size: int = 0,
        inodes: int = 0,
    ) -> list[Mount]:
        """Record a new snapshot and its directory, made by `populate` under a
        staging name and renamed into place, in one transaction."""
        with self._write_lock:
            staging = self.snapshots_dir / f"new-{uuid.uuid4().hex[:12]}"
            try:
                with self.store.write() as txn:
                    if txn.get(key) is not None:
                        raise AlreadyExists(f"snapshot {key!r} already exists")
                    parent_snap = self._committed_parent(txn, parent) if parent else None
                    now = time.time_ns()
                    snap = Snapshot(
                        key=key,
                        id=txn.allocate_id(),
                        kind=kind,
                        parent=parent,
                        labels=dict(labels),
                        created_ns=now,
                        updated_ns=now,
                        size=size,
                        inodes=inodes,
                    )
                    populate(staging, parent_snap)
                    final = self._dir(snap.id)
                    # Left by a crash before its transaction committed.
                    remove_tree(final)
                    os.rename(staging, final)
                    txn.put(snap)
                    return [] if kind == Kind.COMMITTED else self._mounts(txn, snap)
            finally:
                # What stays is nobody's, and cleanup removes it.
                with contextlib.suppress(OSError, TreeError):
                    remove_tree(staging)

    def _committed_parent(self, txn: Txn, parent: str) -> Snapshot:
        parent_snap = txn.get(parent)
        if parent_snap is None:
            raise NotFound(f"parent snapshot {parent!r} does not exist")
        if parent_snap.kind != Kind.COMMITTED:
            raise InvalidArgument(
                f"parent {parent!r} is a {parent_snap.kind.filter_name} snapshot; "
                "only committed snapshots can be parents"
            )
        return parent_snap

    def _make_dirs(self, staging: Path, parent: Snapshot | None) -> None:
        staging.mkdir(mode=0o700)
        (staging / "fs").mkdir(mode=0o755)
        (staging / "work").mkdir(mode=0o711)
        os.chmod(staging / "fs", 0o755)
        if parent is not None:
            # The container's root directory takes its owner from the upper dir.
            st = self._stat_fs(parent)
            os.lchown(staging / "fs", st.st_uid, st.st_gid)

    # -- reading ----------------------------------------------------------

    def mounts(self, key: str) -> list[Mount]:
        with self.store.read() as txn:
            snap = self._get(txn, key)
            if snap.kind == Kind.COMMITTED:
                raise FailedPrecondition(
                    f"snapshot {key!r} is committed; only active snapshots and views have "
                    "mounts (prepare or view a child of it instead)"
                )
            return self._mounts(txn, snap)

    def _mounts(self, txn: Txn, snap: Snapshot) -> list[Mount]:
        ancestors = txn.ancestors(snap)
        for lower in ancestors:
            if label_keys.REMOTE in lower.labels:
                # Or containerd's mount fails with the layer server's bare errno.
                self._stat_fs(lower)
        lowers = [str(self.fs_path(p)) for p in ancestors]
        own = self._dir(snap.id)
        return snapshot_mounts(snap.kind, str(own / "fs"), str(own / "work"), lowers, self.overlay_options)

    def _follow_layer(self, snap: Snapshot) -> None:
        """Point a lazily served snapshot's files at where its layer is now
        (RemoteLayers.files_of): its local copy once the layer server has
        unpacked it, the layer mount again if that copy went. Mounts made
        before keep what they resolved; the link is replaced by rename."""
        digest = snap.labels.get(label_keys.LAYER_DIGEST)
        if self.remote is None or digest is None:
            return
        fs = self.fs_path(snap)
        try:
            served: Path | None = Path(os.readlink(fs.with_name(SERVED_LINK)))
        except OSError:
            # Committed before the link was kept: the layer mount served it.
            served = None
        wanted = self.remote.files_of(digest, served)
        try:
            if Path(os.readlink(fs)) == wanted:
                return
        except OSError:
            return
        fresh = fs.with_name(f"fs.{uuid.uuid4().hex[:8]}")
        try:
            os.symlink(wanted, fresh)
            os.rename(fresh, fs)
        except OSError as exc:
            # The old link still leads to the layer's files (through the mount).
            with contextlib.suppress(OSError):
                os.unlink(fresh)
            log.warning("could not point a lazily served layer at its new place", snapshot=snap.key, error=str(exc))
            return
        log.info("lazily served layer now read from", snapshot=snap.key, layer=digest, files=str(wanted))

    def _stat_fs(self, snap: Snapshot) -> os.stat_result:
        """stat a snapshot's files, following the symlink of a layer served
        lazily into the FUSE layer server's mount (or to its local copy);
        that server being down is said in words, not with the errno its
        mount gives."""
        if label_keys.REMOTE in snap.labels:
            self._follow_layer(snap)
        fs = self.fs_path(snap)
        try:
            return os.stat(fs)
        except OSError as exc:
            if exc.errno not in (errno.ENOTCONN, errno.ENOENT) or not fs.is_symlink():
                raise
            raise _layer_server_error(snap.key, Path(os.readlink(fs)), exc) from None

    def _measure(self, snap: Snapshot) -> Usage:
        try:
            return disk_usage(self.fs_path(snap))
        except TreeChanged as exc:
            raise Unavailable(f"snapshot {snap.key!r} changed while it was being measured ({exc}); try again") from None

    def stat(self, key: str) -> Snapshot:
        with self.store.read() as txn:
            return self._get(txn, key)

    def list(self, filter_texts: Sequence[str]) -> Iterator[Snapshot]:
        parsed = filters.parse_all(filter_texts)
        with self.store.read() as txn:
            snaps = list(txn.all())
        for snap in snaps:
            if filters.matches_any(parsed, functools.partial(_field, snap)):
                yield snap

    def usage(self, key: str) -> Usage:
        snap = self.stat(key)
        if snap.kind == Kind.COMMITTED:
            return Usage(size=snap.size, inodes=snap.inodes)
        if snap.kind == Kind.VIEW:
            return Usage(size=0, inodes=0)
        return self._measure(snap)

    @staticmethod
    def _get(txn: Txn, key: str) -> Snapshot:
        validate_key("snapshot key", key)
        snap = txn.get(key)
        if snap is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        return snap

    # -- changing ---------------------------------------------------------

    def commit(self, name: str, key: str, labels: dict[str, str]) -> Snapshot:
        validate_key("commit name", name)
        validate_labels(labels)
        with self._write_lock:
            active = self.stat(key)
            if active.kind != Kind.ACTIVE:
                raise FailedPrecondition(
                    f"snapshot {key!r} is a {active.kind.filter_name} snapshot; only active snapshots can be committed"
                )
            # Measured outside the transaction: nothing writes to it any more.
            used = self._measure(active)
            with self.store.write() as txn:
                if txn.get(name) is not None:
                    raise AlreadyExists(f"snapshot {name!r} already exists")
                txn.delete(active)
                now = time.time_ns()
                committed = Snapshot(
                    key=name,
                    id=active.id,
                    kind=Kind.COMMITTED,
                    parent=active.parent,
                    labels=dict(labels),
                    created_ns=now,
                    updated_ns=now,
                    size=used.size,
                    inodes=used.inodes,
                )
                txn.put(committed)
        if key.rsplit("/", 1)[-1].startswith("extract-"):
            # An unpack containerd did (the normal path): from its Prepare to now.
            target = name.rsplit("/", 1)[-1]
            eventlog.emit("unpacked", target=target, start=active.created_ns / 1e9, end=now / 1e9, bytes=used.size)
        return committed

    def remove(self, key: str) -> None:
        with self._write_lock:
            with self.store.write() as txn:
                snap = self._get(txn, key)
                children = txn.children(key)
                if children:
                    raise FailedPrecondition(
                        f"snapshot {key!r} has {len(children)} child snapshot(s) "
                        f"(e.g. {children[0]!r}); remove them first"
                    )
                txn.delete(snap)
            self._remove_dir(self._dir(snap.id))

    def update(self, key: str, labels: dict[str, str], paths: Sequence[str]) -> Snapshot:
        """Update labels. `paths` is the field mask: `labels` replaces them all,
        `labels.<k>` sets (or, with no or an empty value, deletes) one; an empty
        mask replaces all mutable fields, which are only the labels."""
        validate_labels({k: v for k, v in labels.items() if v})
        with self._write_lock, self.store.write() as txn:
            snap = self._get(txn, key)
            new_labels = dict(snap.labels)
            for path in paths or ["labels"]:
                if path == "labels":
                    new_labels = {k: v for k, v in labels.items() if v}
                elif path.startswith("labels.") and len(path) > len("labels."):
                    label = path[len("labels.") :]
                    if labels.get(label):
                        new_labels[label] = labels[label]
                    else:
                        new_labels.pop(label, None)
                else:
                    raise InvalidArgument(
                        f"cannot update field {path!r} of snapshot {key!r}: only "
                        "'labels' and 'labels.<key>' are mutable"
                    )
            snap.labels = new_labels
            snap.updated_ns = time.time_ns()
            txn.put(snap)
            return snap

    def cleanup(self) -> builtins.list[str]:
        """Remove directories under snapshots/ that no snapshot owns (left by
        crashes or interrupted removals), and lazily served layers no snapshot
        uses any more. Returns what was removed."""
        with self._write_lock:
            with self.store.read() as txn:
                snaps = list(txn.all())
            owned = {str(s.id) for s in snaps}
            removed = []
            for entry in sorted(os.listdir(self.snapshots_dir)):
                if entry in owned:
                    continue
                # One directory that will not go must not keep the others, or
                # the layer store below, from being cleaned up.
                try:
                    remove_tree(self.snapshots_dir / entry)
                except (OSError, TreeError) as exc:
                    log.warning(
                        "cleanup could not remove a directory no snapshot owns; the next cleanup tries again",
                        directory=str(self.snapshots_dir / entry),
                        reason=str(exc),
                    )
                    continue
                removed.append(entry)
            if self.remote is not None:
                removed += [f"layer {name}" for name in self.remote.prune(snaps)]
            return removed

    def _remove_dir(self, path: Path) -> None:
        """Remove the directory of a snapshot whose record is gone. It is
        renamed first so that a removal cut short leaves a directory that is
        plainly nobody's; what cannot be removed now is logged and left for
        cleanup, and the caller's removal stands: the snapshot is gone."""
        doomed = path.with_name(f"rm-{path.name}")
        left = path
        try:
            os.rename(path, doomed)
            left = doomed
            remove_tree(doomed)
        except FileNotFoundError:
            return
        except (OSError, TreeError) as exc:
            log.warning(
                "snapshot removed, but not all of its directory; cleanup tries again",
                directory=str(left),
                reason=str(exc),
            )


def _layer_server_error(key: str, target: Path, exc: OSError) -> SnapshotError:
    """What to answer when the files of `key`, a layer served lazily from
    `target` in the layer server's mount, cannot be reached."""
    mount = target.parent
    start = "start bootseer-layer-server (systemctl start bootseer-layer-server) and try again"
    if exc.errno == errno.ENOTCONN:
        return Unavailable(
            f"layer {key!r} is served lazily by the bootseer layer server, which is not running: "
            f"its mount at {mount} answers ENOTCONN (transport endpoint is not connected); {start}"
        )
    if not os.path.ismount(mount):
        return Unavailable(
            f"layer {key!r} is served lazily by the bootseer layer server, which is not running: "
            f"nothing is mounted at {mount}; {start}"
        )
    return FailedPrecondition(
        f"layer {key!r} is served lazily from {target}, but the bootseer layer server mounted at {mount} "
        "does not show it (does it use the layer store this snapshotter writes to?); "
        "remove the image and pull it again"
    )


def _field(snap: Snapshot, path: Sequence[str]) -> tuple[str, bool]:
    """Field lookup for filters, with containerd's field names and presence
    rules: name, parent and kind are always present, so `parent==""` finds
    snapshots without a parent (containerd asks exactly that after a remote
    Prepare of a base layer)."""
    head = path[0]
    if head == "labels":
        if len(path) == 1:
            return "", bool(snap.labels)
        label = ".".join(path[1:])
        return snap.labels.get(label, ""), label in snap.labels
    if len(path) > 1:
        return "", False
    if head == "name":
        return snap.key, True
    if head == "parent":
        return snap.parent, True
    if head == "kind":
        return snap.kind.filter_name, True
    return "", False
