"""The daemon's side of environments for unprivileged pods.

A pod has the daemon's socket and nothing else: no CAP_SYS_ADMIN, no host
path. The daemon (root on the host) identifies the caller from the socket
itself (`linux.peer`: a pidfd, so a reused pid is never mistaken for it)
and then works in the caller's filesystem only through descriptors:

- `pod-attach`: on a hit, the image and an overlay on it are assembled as
  one detached mount (`image.detached_environment`) and attached on the
  pod's target from a thread that has entered the pod's mount namespace
  (`linux.in_mount_namespace`): moving a mount into another namespace from
  outside it fails (EINVAL, measured on 6.18). No host path is involved, no
  mount propagation is needed, and nothing shows in the host's mount table.
- `pod-capture`: after the pod installed on a miss, the daemon copies the
  target out of the pod's root with `podfs.copy_tree` (descriptor-relative,
  never following a link) into a directory of its own, builds the image
  from that copy and publishes it.

Only targets in `[depsnap] pod_targets` are served. Snapshots captured from
pods live under their own keys (`pod_key`), so nothing a pod publishes is
ever restored by the privileged CLI on a host.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from depsnap import image as image_mod
from depsnap import linux, podfs, snapshot
from depsnap.cache import Cache, Fetched
from depsnap.format import CorruptSnapshot
from depsnap.store import SnapshotStore, StoreUnavailable

log = structlog.get_logger("depsnap.pods")

_POD_KEY_DOMAIN = b"depsnap pod capture\0"
_CAP_SYS_ADMIN = 21


class PodConfigError(ValueError):
    """`pod_targets` holds an entry no pod can safely be given."""


class PodRefused(Exception):
    """A pod's request that the daemon will not carry out; says why."""


def pod_key(key: str) -> str:
    """Where a pod's snapshot of `key` is kept: apart from the keys the
    privileged CLI uses, so a pod can never plant an environment that a
    host-side `ensure` (root, outside any container) would run."""
    return hashlib.sha256(_POD_KEY_DOMAIN + key.encode()).hexdigest()


def validate_targets(targets: list[str]) -> list[str]:
    """The configured `pod_targets`, normalised; PodConfigError for an
    entry no pod could safely be given (relative, the root, with `..`)."""
    clean = []
    for raw in targets:
        if not raw.startswith("/") or any(part in (".", "..") for part in raw.split("/")):
            raise PodConfigError(f"[depsnap] pod_targets: {raw!r} must be an absolute path without '.' or '..'")
        target = os.path.normpath(raw)
        if target == "/":
            raise PodConfigError("[depsnap] pod_targets: '/' cannot be a pod target")
        clean.append(target)
    return clean


def _same_namespace(peer: linux.Peer, kind: str) -> bool:
    theirs = os.stat(f"ns/{kind}", dir_fd=peer.proc_fd).st_ino
    return theirs == os.stat(f"/proc/self/ns/{kind}").st_ino


def privileged(peer: linux.Peer) -> bool:
    """Whether the caller could mount by itself: CAP_SYS_ADMIN in the
    daemon's own user namespace (a pod's root inside a user namespace has
    the capability only there, which counts for nothing here)."""
    if not _same_namespace(peer, "user"):
        return False
    with open(os.open("status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=peer.proc_fd)) as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    return False


def _propagates(peer: linux.Peer, mount: int) -> bool:
    """Whether the pod's mount `mount` is shared with other namespaces, so
    that a mount made on it would show up outside the pod (mountinfo is the
    kernel's, not the pod's; the pod names nothing here)."""
    with open(os.open("mountinfo", os.O_RDONLY | os.O_CLOEXEC, dir_fd=peer.proc_fd)) as mountinfo:
        for line in mountinfo:
            fields = line.split(" - ", 1)[0].split()
            if int(fields[0]) == mount:
                return any(tag.startswith("shared:") for tag in fields[6:])
    return False


class Pods:
    """pod-attach and pod-capture for the node cache `cache`."""

    def __init__(
        self,
        cache: Cache,
        targets: list[str],
        capture_max_bytes: int,
        store: Callable[[], SnapshotStore | None],
        evict: Callable[[str], None],
    ) -> None:
        self.cache = cache
        self.targets = validate_targets(targets)
        self.capture_max_bytes = capture_max_bytes
        self._store = store
        self._evict = evict

    def _open_target(self, peer: linux.Peer, raw: object) -> tuple[str, int]:
        """The allowed target and a descriptor of it in the pod, or PodRefused."""
        try:
            target = podfs.allowed_target(raw, self.targets)
        except podfs.PodPathError as exc:
            raise PodRefused(str(exc)) from None
        if _same_namespace(peer, "mnt"):
            raise PodRefused(
                "the caller shares the daemon's mount namespace: pod requests come from containers "
                "(on the host, `bootseer depsnap ensure` mounts by itself)"
            )
        root_fd = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=peer.proc_fd)
        try:
            return target, podfs.open_in_root(root_fd, target)
        except podfs.PodPathError as exc:
            raise PodRefused(str(exc)) from None
        finally:
            os.close(root_fd)

    def attach(self, peer: linux.Peer, key: str, raw_target: object) -> dict[str, Any]:
        """Mount the environment of `key` on the pod's target, if the node
        cache or the store has one."""
        target, target_fd = self._open_target(peer, raw_target)
        try:
            if os.listdir(target_fd):
                raise PodRefused(f"{target} in the pod is not empty; nothing is mounted over a pod's files")
            if _propagates(peer, linux.mount_id(target_fd)):
                raise PodRefused(
                    f"{target} in the pod is on a shared mount (it propagates to other namespaces); "
                    "depsnap mounts only into the pod's own"
                )
            stored = pod_key(key)
            fetched = self._fetch(stored)
            if fetched is None:
                log.info("pod miss", pid=peer.pid, uid=peer.uid, target=target, key=key)
                return {"ok": True, "found": False}
            env_fd = image_mod.detached_environment(fetched.path)
            try:
                linux.in_mount_namespace(peer.pidfd, lambda: linux.move_mount_fd(env_fd, target_fd))
            finally:
                os.close(env_fd)
        finally:
            os.close(target_fd)
        log.info("pod attach", pid=peer.pid, uid=peer.uid, target=target, key=key, source=fetched.source)
        return {"ok": True, "found": True, "source": fetched.source, "size": fetched.size}

    def _fetch(self, stored: str) -> Fetched | None:
        store = self._store()
        try:
            fetched = self.cache.fetch(stored, store)
        except CorruptSnapshot as exc:
            log.warning("corrupt pod snapshot, discarding it", key=stored, reason=str(exc))
            self.cache.discard(stored)
            if store is not None:
                try:
                    store.delete(stored)
                except StoreUnavailable as delete_exc:
                    log.warning("could not delete the corrupt snapshot", reason=str(delete_exc))
            return None
        except StoreUnavailable as exc:
            log.warning("store unreachable, the pod installs instead", reason=str(exc))
            return None
        if fetched is not None and fetched.source == "store":
            self._evict(stored)
        return fetched

    def capture(self, peer: linux.Peer, key: str, raw_target: object) -> dict[str, Any]:
        """Snapshot what the pod installed at its target and publish it."""
        target, target_fd = self._open_target(peer, raw_target)
        stored = pod_key(key)
        try:
            if self.cache.lookup(stored) is not None:
                return {"ok": True, "captured": False, "detail": "the node cache already has it"}
            work = Path(tempfile.mkdtemp(prefix="pod-capture-", dir=self.cache.tmp))
            try:
                tree = work / "tree"
                tree.mkdir(mode=0o700)
                tree_fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    copied = podfs.copy_tree(target_fd, tree_fd, podfs.Limits(self.capture_max_bytes))
                except podfs.PodPathError as exc:
                    raise PodRefused(str(exc)) from None
                finally:
                    os.close(tree_fd)
                store = self._store()
                inputs = {"target": target, "pod_key_of": key, "captured_from_uid": str(peer.uid)}
                manifest = snapshot.new_manifest(stored, "pod-env", inputs)
                captured = snapshot.capture(tree, work, manifest, compress=store is not None)
                self.cache.put(stored, captured.image)
                self._evict(stored)
                places = ["node cache"]
                if store is not None:
                    try:
                        snapshot.publish(store, captured)
                        places.append("store")
                    except StoreUnavailable as exc:
                        log.warning("could not publish the pod's snapshot", reason=str(exc))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        finally:
            os.close(target_fd)
        log.info(
            "pod capture",
            pid=peer.pid,
            uid=peer.uid,
            target=target,
            key=key,
            files=copied.files,
            bytes=copied.bytes,
            image_bytes=manifest.image_size,
        )
        detail = f"{copied.entries} entries, {copied.bytes} bytes captured to {', '.join(places)}"
        return {"ok": True, "captured": True, "detail": detail}
