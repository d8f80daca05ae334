"""Checkpoint prefetch a pod asks for, started when kubelet pulls its image.

A pod annotated `bootseer.io/prefetch: /mnt/ckpts/run42/model.bin` (host
paths, comma or space separated: what its hostPath volumes show it) has
those files of the node's hdfs-fuse mounts fetched into the page cache
from the moment kubelet asks for its image (PullImage carries the pod's
sandbox config). The checkpoint's transfer then overlaps the image pull,
the container's start and everything the job does before it reads; the
mount's own prefetch does the work (`hdfs_fuse.prefetch`). The pull never
waits for any of it.

Annotations come from whoever may create pods, so a path is asked for only
if it resolves (symlinks followed) below one of `[cri] prefetch_roots` and
onto an hdfs-fuse mount; nothing but a stat, a listing and the prefetch
attribute is ever read. A mount that hangs holds one of two worker
threads; requests beyond a short queue are dropped, never the pull.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from hdfs_fuse import mountinfo, prefetch_client
from proto.k8s.cri.runtime.v1 import api_pb2 as cri

log = structlog.get_logger("bootseer.cri")

ANNOTATION = "bootseer.io/prefetch"
# Per pod: paths named, and files they expand to.
MAX_PATHS = 32
MAX_FILES = 1024
WORKERS = 2
# Pods waiting for a worker; more are dropped (and counted).
MAX_PENDING = 16

PREFETCHES = Counter(
    "bootseer_cri_prefetch_files",
    "Files pods asked to have prefetched at PullImage: started, refused (outside the allowed "
    "roots or not on an hdfs-fuse mount), failed, dropped (too many pending).",
    ["result"],
)


def requested_paths(annotations: Mapping[str, str]) -> list[str]:
    """The absolute paths the pod's annotation names, in order, once each."""
    named = re.split(r"[,\s]+", annotations.get(ANNOTATION, "").strip())
    paths: list[str] = []
    for path in named:
        if path.startswith("/") and path not in paths:
            paths.append(path)
    return paths[:MAX_PATHS]


def refusal(resolved: str, roots: Sequence[str], mounts: Sequence[mountinfo.Mount]) -> str | None:
    """Why the resolved path may not be prefetched, None if it may: below a
    root, and the mount holding it an hdfs-fuse one."""
    path = Path(resolved)
    if not any(path.is_relative_to(root) for root in roots):
        return f"{resolved} is not below [cri] prefetch_roots"
    holding = max(
        (m for m in mounts if path.is_relative_to(m.mountpoint)), key=lambda m: len(m.mountpoint), default=None
    )
    if holding is None or holding.fstype != mountinfo.FSTYPE:
        return f"{resolved} is not on an hdfs-fuse mount"
    return None


class PodPrefetch:
    """What the proxy does with a PullImage's sandbox config: start the
    prefetches its annotation asks for, in the background."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = [os.path.realpath(root) for root in roots]
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="cri-prefetch")
        self._pending = threading.BoundedSemaphore(MAX_PENDING)

    def pull_image(self, request_bytes: bytes) -> None:
        """Never raises and never waits: the pull goes ahead whatever happens here."""
        try:
            request = cri.PullImageRequest.FromString(request_bytes)
        except DecodeError:
            return
        paths = requested_paths(request.sandbox_config.annotations)
        if not paths:
            return
        pod = request.sandbox_config.metadata
        where = {"pod": f"{pod.namespace}/{pod.name}", "image": request.image.image}
        if not self._pending.acquire(blocking=False):
            PREFETCHES.labels("dropped").inc(len(paths))
            log.warning("cri.prefetch_dropped", reason="too many pods waiting", paths=paths, **where)
            return
        self._pool.submit(self._run, paths, where)

    def _run(self, paths: list[str], where: dict[str, str]) -> None:
        try:
            for file in self._files(paths, where):
                try:
                    status = prefetch_client.request(file)
                except OSError as exc:
                    PREFETCHES.labels("failed").inc()
                    log.warning("cri.prefetch_failed", path=str(file), error=str(exc), **where)
                    continue
                PREFETCHES.labels("started").inc()
                log.info("cri.prefetch", path=str(file), status=status.line(), **where)
        except Exception:  # a bug must cost the prefetch, never the proxy's worker
            log.exception("cri.prefetch_crashed", **where)
        finally:
            self._pending.release()

    def _files(self, paths: list[str], where: dict[str, str]) -> Iterator[Path]:
        mounts = mountinfo.parse(mountinfo.MOUNTINFO.read_text())
        allowed: list[Path] = []
        for path in paths:
            resolved = os.path.realpath(path)
            why = refusal(resolved, self.roots, mounts)
            if why is not None:
                PREFETCHES.labels("refused").inc()
                log.warning("cri.prefetch_refused", path=path, reason=why, **where)
                continue
            allowed.append(Path(resolved))
        for count, file in enumerate(prefetch_client.files_under(allowed)):
            if count == MAX_FILES:
                log.warning("cri.prefetch_truncated", files=MAX_FILES, **where)
                return
            yield file

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
