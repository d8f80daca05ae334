"""`bootseer pull IMAGE`: a lazy pull through containerd's own services.

The counterpart of `ctr images pull --snapshotter bootseer` (and of
stargz's `ctr-remote image rpull`): the manifest and config go into
containerd's content store, then each layer is Prepared on the snapshotter
with the cri.* labels that let it serve the layer remotely. A snapshotter
that can answers ALREADY_EXISTS and no byte of the layer is fetched; for
any other layer the blob is fetched, applied with the diff service and
committed, exactly as containerd's own unpacker does.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

import grpc
import structlog

import eventlog
from snapshotter.containerd_client import Blob, ContainerdClient, code_of
from snapshotter.labels import (
    GC_REF_CONFIG,
    GC_REF_LAYER_PREFIX,
    GC_REF_SNAPSHOT_PREFIX,
    UNCOMPRESSED,
    distribution_source,
    remote_snapshot_labels,
)
from snapshotter.layer.index import chain_ids
from snapshotter.pullwire import DEFAULT_SNAPSHOTTER, PullRequest
from snapshotter.registry.client import RegistryClient, ResolvedImage
from snapshotter.registry.config import client_from_config
from snapshotter.registry.errors import RegistryError
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import InvalidReference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.settings import RegistryConfig

log = structlog.get_logger("bootseer.pull")


class PullError(Exception):
    """A pull that cannot finish; the message says what to do."""


# -- pure core ---------------------------------------------------------------


def manifest_labels(image: ResolvedImage) -> dict[str, str]:
    """GC references from the manifest to its config and layers."""
    labels = {GC_REF_CONFIG: image.manifest.config.digest}
    for i, layer in enumerate(image.manifest.layers):
        labels[f"{GC_REF_LAYER_PREFIX}{i}"] = layer.digest
    key, value = distribution_source(image.ref.domain, image.ref.repository)
    labels[key] = value
    return labels


def config_labels(image: ResolvedImage, snapshotter: str, top_chain_id: str) -> dict[str, str]:
    """The config keeps the unpacked snapshot chain alive (through its top)."""
    key, value = distribution_source(image.ref.domain, image.ref.repository)
    return {f"{GC_REF_SNAPSHOT_PREFIX}{snapshotter}": top_chain_id, key: value}


def diff_ids_of(config: bytes, layer_count: int) -> list[str]:
    try:
        doc = json.loads(config)
        diff_ids = doc["rootfs"]["diff_ids"]
    except (ValueError, KeyError, TypeError):
        raise PullError("the image config has no rootfs.diff_ids; it is not a runnable image") from None
    if not isinstance(diff_ids, list) or len(diff_ids) != layer_count or not all(isinstance(d, str) for d in diff_ids):
        raise PullError(
            f"the image config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
            f"diff_ids for {layer_count} layers; the image is broken"
        )
    return diff_ids


def failure_message(exc: BaseException, containerd_address: object) -> str | None:
    """What to tell the user of a pull that raised `exc`: the registry's,
    the image's or containerd's word; None for anything else (a bug)."""
    if isinstance(exc, grpc.RpcError):
        detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        return f"containerd at {containerd_address}: {detail}"
    if isinstance(exc, InvalidReference | RegistryError | PullError | ValueError):
        return str(exc)
    return None


def unpack_key(chain_id: str) -> str:
    """containerd's unpack key format, "extract-<unique> <chainID>"."""
    return f"extract-{time.time_ns()}-{secrets.token_hex(4)} {chain_id}"


# -- the pull ----------------------------------------------------------------


@dataclass
class LayerResult:
    digest: str
    chain_id: str
    how: str  # "remote", "fetched" or "present"
    fetched_bytes: int = 0


@dataclass
class PullResult:
    name: str
    manifest_digest: str
    layers: list[LayerResult] = field(default_factory=list)

    @property
    def fetched_bytes(self) -> int:
        return sum(layer.fetched_bytes for layer in self.layers)

    def as_event(self) -> dict[str, object]:
        """The result as the pull socket's `done` event carries it (snapshotter.pullwire)."""
        return {
            "name": self.name,
            "manifest": self.manifest_digest,
            "layers": [
                {"digest": x.digest, "chain_id": x.chain_id, "how": x.how, "fetched_bytes": x.fetched_bytes}
                for x in self.layers
            ],
        }


class LayerProgress(Protocol):
    """What a pull reports of one layer as it goes: bytes fetched, then how
    the layer was satisfied ("remote", "fetched" or "present")."""

    def advance(self, n: int) -> None: ...

    def done(self, how: str) -> None: ...


# (index, layer count, layer) -> that layer's progress.
ProgressFactory = Callable[[int, int, Descriptor], LayerProgress]


class _Silent:
    def advance(self, n: int) -> None:
        pass

    def done(self, how: str) -> None:
        pass


def silent(_index: int, _count: int, _layer: Descriptor) -> LayerProgress:
    return _Silent()


def registry_client(
    cfg: RegistryConfig, plain_http: bool, hosts_dir: str | None, docker_config: str | None
) -> RegistryClient:
    """The registry client for a pull request's flags (PullRequest's
    plain_http, hosts_dir and docker_config) over the `[registry]` section."""
    return client_from_config(
        cfg, plain_http, Path(hosts_dir) if hosts_dir else None, Path(docker_config) if docker_config else None
    )


def pull_request(
    request: PullRequest,
    registry: RegistryClient,
    containerd: ContainerdClient,
    progress: ProgressFactory = silent,
    resolved: Callable[[ResolvedImage], None] | None = None,
) -> PullResult:
    """The pull `request` asks for (the pull socket's, or the command's own);
    `resolved` as Puller's."""
    puller = Puller(registry, containerd, request.snapshotter, progress, resolved)
    return puller.pull(request.image, request.platform, started=request.started)


class Puller:
    def __init__(
        self,
        registry: RegistryClient,
        containerd: ContainerdClient,
        snapshotter: str = DEFAULT_SNAPSHOTTER,
        progress: ProgressFactory = silent,
        resolved: Callable[[ResolvedImage], None] | None = None,
    ) -> None:
        """`resolved(image)`, if given, is told the image's manifest as soon
        as it is known, before anything goes to containerd: the snapshotter
        that will be asked to prepare its layers can set their work going."""
        self.registry = registry
        self.containerd = containerd
        self.snapshotter = snapshotter
        self.progress = progress
        self.resolved = resolved

    def pull(self, reference: str, platform: str | None = None, started: float | None = None) -> PullResult:
        """`started`: when the user's command began (the records' clock), if
        not now: the pull's record starts there."""
        started = eventlog.now() if started is None else started
        try:
            result = self._pull(reference, platform, started)
        except Exception as exc:
            eventlog.emit("pull", image=reference, start=started, end=eventlog.now(), error=str(exc))
            raise
        return result

    def _pull(self, reference: str, platform: str | None, started: float) -> PullResult:
        ref = parse_reference(reference)
        image = self.registry.resolve(ref, platform)
        if self.resolved is not None:
            try:
                self.resolved(image)
            except Exception as exc:
                # Only a head start: the Prepares do the work all the same.
                log.warning("pull.resolved_hook_failed", image=str(ref), error=str(exc))
        name = str(ref)
        log.info("pull.resolved", image=name, manifest=image.manifest_digest, layers=len(image.manifest.layers))
        config = self.registry.fetch_blob_bytes(ref, image.manifest.config.digest)
        layers = image.manifest.layers
        diff_ids = diff_ids_of(config, len(layers))
        chains = chain_ids(diff_ids)
        result = PullResult(name=name, manifest_digest=image.manifest_digest)
        with self.containerd.lease() as lease:
            cfg = image.manifest.config
            self.containerd.write_content(
                f"config-{cfg.digest}",
                Blob(cfg.media_type, cfg.digest, cfg.size),
                lambda: [config],
                config_labels(image, self.snapshotter, chains[-1] if chains else ""),
                lease,
            )
            self.containerd.write_content(
                f"manifest-{image.manifest_digest}",
                Blob(image.media_type, image.manifest_digest, len(image.manifest_bytes)),
                lambda: [image.manifest_bytes],
                manifest_labels(image),
                lease,
            )
            resolved = eventlog.now()
            layer_times: list[dict[str, object]] = []
            for i, layer in enumerate(layers):
                bar = self.progress(i, len(layers), layer)
                layer_started = eventlog.now()
                outcome = self._layer(image, i, chains, diff_ids[i], lease, bar)
                bar.done(outcome.how)
                log.info("pull.layer", image=name, layer=layer.digest, how=outcome.how, bytes=outcome.fetched_bytes)
                result.layers.append(outcome)
                layer_times.append(
                    {
                        "layer": layer.digest,
                        "target": outcome.chain_id,
                        "how": outcome.how,
                        "bytes": outcome.fetched_bytes,
                        "size": layer.size,
                        "start": layer_started,
                        "end": eventlog.now(),
                    }
                )
            self.containerd.put_image(name, Blob(image.media_type, image.manifest_digest, len(image.manifest_bytes)))
        # One record for the whole pull: its phases are what `bootseer report` lays end to end.
        eventlog.emit(
            "pull",
            image=name,
            manifest=image.manifest_digest,
            start=started,
            resolved=resolved,
            end=eventlog.now(),
            layers=layer_times,
        )
        return result

    def _layer(
        self, image: ResolvedImage, i: int, chains: list[str], diff_id: str, lease: str, bar: LayerProgress
    ) -> LayerResult:
        layer = image.manifest.layers[i]
        chain_id, parent = chains[i], chains[i - 1] if i else ""
        # Held before it is looked at: a snapshot nothing refers to (left by
        # a failed pull) may otherwise be collected between this Stat and the
        # Prepare of the layer above it.
        self.containerd.hold_snapshot(lease, self.snapshotter, chain_id)
        if self.containerd.stat_snapshot(self.snapshotter, chain_id) is not None:
            return LayerResult(layer.digest, chain_id, "present")
        labels = remote_snapshot_labels(str(image.ref), image.manifest_digest, image.manifest.layers, i, chain_id)
        key = unpack_key(chain_id)
        try:
            mounts = self.containerd.prepare_snapshot(self.snapshotter, key, parent, labels, lease)
        except grpc.RpcError as exc:
            if code_of(exc) != grpc.StatusCode.ALREADY_EXISTS:
                raise
            # The snapshotter made the layer available remotely (or another
            # pull committed it meanwhile); either way containerd must now know it.
            if self.containerd.stat_snapshot(self.snapshotter, chain_id) is None:
                raise PullError(
                    f"snapshotter {self.snapshotter!r} answered ALREADY_EXISTS for layer {layer.digest} "
                    f"but snapshot {chain_id} does not exist; check the snapshotter's log"
                ) from None
            return LayerResult(layer.digest, chain_id, "remote")
        try:
            fetched = self._ensure_blob(image, layer, diff_id, lease, bar)
            applied = self.containerd.apply(Blob(layer.media_type, layer.digest, layer.size), mounts, lease)
            if applied.digest != diff_id:
                raise PullError(
                    f"layer {layer.digest} unpacked to {applied.digest}, but the config says {diff_id}; "
                    "the image is corrupt"
                )
            try:
                self.containerd.commit_snapshot(self.snapshotter, chain_id, key, labels, lease)
            except grpc.RpcError as exc:
                # Another pull of the same image committed it first: fine.
                if code_of(exc) != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                self._remove_quietly(key)
        except BaseException:
            self._remove_quietly(key)
            raise
        return LayerResult(layer.digest, chain_id, "fetched", fetched)

    def _ensure_blob(
        self, image: ResolvedImage, layer: Descriptor, diff_id: str, lease: str, bar: LayerProgress
    ) -> int:
        """Put the layer blob in the content store unless it is there; returns bytes fetched."""
        key, value = distribution_source(image.ref.domain, image.ref.repository)
        labels = {UNCOMPRESSED: diff_id, key: value}
        blob = Blob(layer.media_type, layer.digest, layer.size)
        if self.containerd.content_info(layer.digest) is not None:
            self.containerd.label_content(layer.digest, labels, lease)
            return 0
        with tempfile.TemporaryFile(prefix="bootseer-layer-") as spool:
            self.registry.fetch_blob(image.ref, layer.digest, spool, progress=bar.advance)  # verified
            if spool.tell() != layer.size:
                raise PullError(f"layer {layer.digest}: registry sent {spool.tell()} bytes, manifest says {layer.size}")
            self.containerd.write_content(f"layer-{layer.digest}", blob, lambda: _chunks(spool), labels, lease)
        return layer.size

    def _remove_quietly(self, key: str) -> None:
        try:
            self.containerd.remove_snapshot(self.snapshotter, key)
        except grpc.RpcError as exc:
            if code_of(exc) != grpc.StatusCode.NOT_FOUND:
                log.warning(
                    "pull.cleanup_failed", key=key, error=exc.details() if isinstance(exc, grpc.Call) else str(exc)
                )


def _chunks(spool: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    spool.seek(0)
    while chunk := spool.read(size):
        yield chunk
