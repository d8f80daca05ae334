"""Hot blocks inside the layer server: for each image it is told about,
prefetch the blocks of its hot-block manifest, or, if it has none, record
the blocks its first run reads and publish them as one.

Prefetching runs alongside the container's own reads: the blocks of every
layer prepared so far are fetched in manifest order (first access across the
whole image) by a few workers, adjacent blocks merged into one Range
request; a reader's miss does not queue behind them (separate fetch slots),
and a block already on its way is waited for, never fetched twice
(LayerReader.ensure).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
import trio

from recorder import manifest as hot
from recorder.localstore import LocalManifests
from recorder.manifest import HotManifest, ManifestError
from recorder.session import RecordingSession
from snapshotter.fs.control import ImageRequest, read_request
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import BlockUnavailable, Origin
from snapshotter.fs.served import ServedLayer
from snapshotter.layer.blockmath import fetch_runs
from snapshotter.layer.index import LayerIndex
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference

log = structlog.get_logger("bootseer.hotblocks")

# A published manifest may be large; bound what is read of one.
MAX_MANIFEST_BYTES = 32 << 20
TICK_S = 0.25


@dataclass
class _Prefetch:
    """One image's prefetch: the runs of every prepared layer in one queue,
    ordered by their first block's place in the manifest (first access)."""

    manifest: HotManifest
    expected: set[str]  # the layers the manifest has blocks in
    queued: set[str] = field(default_factory=set)  # layers checked (and queued, if good)
    queue: list[tuple[int, str, list[int]]] = field(default_factory=list)
    layers: dict[str, ServedLayer] = field(default_factory=dict)
    arrived: trio.Event = field(default_factory=trio.Event)
    began: float = field(default_factory=time.monotonic)
    workers: int = 0

    def wake(self) -> None:
        """Workers waiting for more runs look again."""
        self.arrived.set()
        self.arrived = trio.Event()


@dataclass
class _Image:
    request: ImageRequest
    manifest: HotManifest | None = None
    session: RecordingSession | None = None
    started_layers: set[str] = field(default_factory=set)
    decided: bool = False
    # The session records only in case the manifest turns out unusable: it
    # is dropped once every layer's blocks checked out.
    provisional: bool = False
    prefetch: _Prefetch | None = None


@dataclass
class HotBlockSettings:
    idle_s: float
    max_s: float
    prefetch_parallel: int


class HotBlocks:
    def __init__(
        self,
        store: LayerStore,
        layer_for: Callable[[str], Awaitable[ServedLayer | None]],
        client: RegistryClient,
        local: LocalManifests,
        settings: HotBlockSettings,
    ) -> None:
        self.store = store
        self.layer_for = layer_for
        self.client = client
        self.local = local
        self.settings = settings
        self.images: dict[str, _Image] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        """Own every prefetch and recording task; settle recordings."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                await trio.sleep(TICK_S)
                now = time.monotonic()
                for image in list(self.images.values()):
                    # Until the manifest is decided on and checked, the
                    # session may yet be dropped for it.
                    if not image.decided or image.session is None or not image.session.settled(now):
                        continue
                    session, image.session = image.session, None
                    if not image.provisional:
                        nursery.start_soon(self._finish, image, session)

    # -- events from the file system ---------------------------------------

    def access(self, layer: str, block: int) -> None:
        """A reader touched `block` of `layer`."""
        now = time.monotonic()
        for image in self.images.values():
            if image.session is not None:
                image.session.access(layer, block, now)

    async def notify(self, name: str, request: ImageRequest | None = None) -> None:
        """The request file of image `name` was written: act on it (`request`,
        if the caller has read it already)."""
        # A small file the snapshotter has just written: reading it here is
        # quicker than a thread hop, and the snapshotter waits for this answer.
        if request is None:
            request = read_request(self.store, name)
        if request is None or self._nursery is None:
            return
        image = self.images.get(request.image)
        if image is None:
            image = self.images[request.image] = _Image(request)
            # Record from the first moment: the run's first reads arrive
            # while the manifest is still being looked for, and a recording
            # that turns out not to be wanted is simply dropped.
            self._start_recording(image, quiet=True)
            self._nursery.start_soon(self._decide, image)
            return
        image.request = request
        if image.session is not None:
            image.session.layers.update(request.layers)
            image.session.stop_requested = request.stop
            image.provisional = image.provisional and not request.record
        elif request.record and not request.stop:
            self._start_recording(image)
        self._start_prefetches(image)

    # -- deciding: prefetch or record ----------------------------------------

    async def _decide(self, image: _Image) -> None:
        request = image.request
        manifest = await trio.to_thread.run_sync(self._find_manifest, request)
        if manifest is not None and manifest.image != request.image:
            log.warning(
                "hot-block manifest ignored: it belongs to another image",
                image=request.image,
                manifest_for=manifest.image,
            )
            manifest = None
        image.decided = True
        if manifest is not None and not image.request.record:
            image.provisional = True
        elif image.session is not None:
            log.info("recording first-run block reads", image=request.image)
        if manifest is not None:
            image.manifest = manifest
            log.info(
                "prefetching hot blocks",
                image=request.image,
                blocks=len(manifest.blocks),
                bytes=manifest.total_bytes,
                runs=manifest.runs,
            )
        self._start_prefetches(image)

    def _find_manifest(self, request: ImageRequest) -> HotManifest | None:
        local = self.local.get(request.image)
        if local is not None:
            return local
        try:
            return self._fetch_published(request)
        except Exception as exc:
            log.warning("no usable hot-block manifest in the registry", image=request.image, error=str(exc))
            return None

    def _fetch_published(self, request: ImageRequest) -> HotManifest | None:
        ref = parse_reference(request.ref)
        found = artifact.referrers(self.client, ref, request.image, hot.ARTIFACT_TYPE)
        if not found or not found[-1].layers:
            return None
        blob = found[-1].layers[0]
        manifest = HotManifest.decode(self.client.fetch_blob_bytes(ref, blob.digest, limit=MAX_MANIFEST_BYTES))
        self.local.put(manifest)
        return manifest

    def _start_recording(self, image: _Image, quiet: bool = False) -> None:
        if image.session is None:
            image.session = RecordingSession(
                image=image.request.image,
                layers=set(image.request.layers),
                started=time.monotonic(),
                idle_s=self.settings.idle_s,
                max_s=self.settings.max_s,
                stop_requested=image.request.stop,
            )
            if not quiet:
                log.info("recording first-run block reads", image=image.request.image)

    # -- prefetching ------------------------------------------------------------

    def _start_prefetches(self, image: _Image) -> None:
        if not image.decided or image.manifest is None or self._nursery is None:
            return
        if image.prefetch is None or image.prefetch.manifest is not image.manifest:
            image.prefetch = _Prefetch(image.manifest, {b.layer for b in image.manifest.blocks})
            for _ in range(self.settings.prefetch_parallel):
                self._nursery.start_soon(self._prefetch_worker, image, image.prefetch)
        for layer in image.request.layers:
            if layer not in image.started_layers:
                image.started_layers.add(layer)
                self._nursery.start_soon(self._queue_layer, image, image.prefetch, layer)

    async def _queue_layer(self, image: _Image, prefetch: _Prefetch, layer_digest: str) -> None:
        """Check the manifest's blocks of a layer just prepared against its
        index, then queue them, in manifest order among every layer's."""
        try:
            layer = await self.layer_for(layer_digest)
            positions = {b.block: i for i, b in enumerate(prefetch.manifest.blocks) if b.layer == layer_digest}
            if layer is None or not positions:
                return
            index = layer.reader.index
            blocks = [b for b in prefetch.manifest.blocks if b.layer == layer_digest]
            try:
                hot.check(
                    HotManifest(prefetch.manifest.image, prefetch.manifest.runs, blocks),
                    image.request.image,
                    {layer_digest: index},
                )
            except ManifestError as exc:
                log.warning("hot-block manifest ignored", image=image.request.image, reason=str(exc))
                if image.manifest is prefetch.manifest:
                    # Record this run instead: its manifest replaces the stale one.
                    image.manifest = None
                    image.provisional = False
                    self._start_recording(image)
                return
            prefetch.layers[layer_digest] = layer
            for run in fetch_runs([b.block for b in blocks], index.blocks):
                heapq.heappush(prefetch.queue, (positions[run[0]], layer_digest, run))
        finally:
            prefetch.queued.add(layer_digest)
            prefetch.wake()
            if image.provisional and image.manifest is prefetch.manifest and prefetch.expected <= prefetch.queued:
                image.session = None
                image.provisional = False

    async def _prefetch_worker(self, image: _Image, prefetch: _Prefetch) -> None:
        prefetch.workers += 1
        try:
            while image.manifest is prefetch.manifest:
                if prefetch.queue:
                    _, layer_digest, run = heapq.heappop(prefetch.queue)
                    layer = prefetch.layers[layer_digest]
                    if not layer.current:
                        continue
                    try:
                        # What it fetches counts for this image (bootseer_fs_image_prefetched_bytes_total).
                        await layer.reader.ensure(run, Origin.HOT, image=image.request.image)
                    except BlockUnavailable as exc:
                        log.warning("prefetch failed", layer=layer_digest, blocks=run, error=str(exc))
                    continue
                if prefetch.expected <= prefetch.queued:
                    break
                await prefetch.arrived.wait()
        finally:
            prefetch.workers -= 1
        if prefetch.workers == 0 and image.manifest is prefetch.manifest:
            log.info(
                "hot blocks prefetched",
                image=image.request.image,
                blocks=len(prefetch.manifest.blocks),
                seconds=round(time.monotonic() - prefetch.began, 3),
            )

    # -- publishing ---------------------------------------------------------

    async def _finish(self, image: _Image, session: RecordingSession) -> None:
        if not session.accesses:
            log.info("recording ended with no reads; nothing to publish", image=session.image)
            return
        indexes: dict[str, LayerIndex] = {}
        for layer_digest in {layer for layer, _ in session.accesses}:
            layer = await self.layer_for(layer_digest)
            if layer is not None:
                indexes[layer_digest] = layer.reader.index
        accesses = {k: v for k, v in session.accesses.items() if k[0] in indexes}
        recorded = hot.from_record(session.image, accesses, indexes)
        merged = await trio.to_thread.run_sync(self._merged, image.request, recorded, indexes)
        # The node keeps what it learnt whatever the registry says.
        self.local.put(merged)
        try:
            await trio.to_thread.run_sync(self._push, image.request, merged)
        except Exception as exc:
            log.warning("hot-block manifest kept locally; publishing failed", image=session.image, error=str(exc))
            return
        log.info(
            "hot-block manifest published",
            image=session.image,
            blocks=len(merged.blocks),
            bytes=merged.total_bytes,
            runs=merged.runs,
        )

    def _merged(self, request: ImageRequest, recorded: HotManifest, indexes: dict[str, LayerIndex]) -> HotManifest:
        """This run merged into what the image already has: its published
        manifest or, if there is none or the registry cannot be asked, this
        node's. A stale one is replaced."""
        try:
            existing = self._fetch_published(request)
        except Exception as exc:
            log.warning("published hot-block manifest unreadable", image=request.image, error=str(exc))
            existing = None
        if existing is None:
            existing = self.local.get(request.image)
        if existing is None:
            return recorded
        try:
            hot.check(existing, request.image, indexes | self._indexes_of(existing, indexes))
            return hot.merge(existing, recorded)
        except ManifestError as exc:
            log.warning("hot-block manifest is stale; replacing it", image=request.image, reason=str(exc))
            return recorded

    def _push(self, request: ImageRequest, manifest: HotManifest) -> None:
        ref = parse_reference(request.ref)
        data, media_type, digest = self.client.fetch_manifest(ref.with_digest(request.image))
        blob = self.client.push_blob(ref, manifest.encode(), media_type=hot.MEDIA_TYPE)
        subject = Descriptor(media_type, digest, len(data))
        artifact.push(
            self.client, ref, subject, hot.ARTIFACT_TYPE, [Descriptor(hot.MEDIA_TYPE, blob.digest, blob.size)]
        )

    def _indexes_of(self, manifest: HotManifest, known: dict[str, LayerIndex]) -> dict[str, LayerIndex]:
        """Indexes of layers a manifest names that this recording did not read."""
        out: dict[str, LayerIndex] = {}
        for layer in {b.layer for b in manifest.blocks} - set(known):
            loaded = trio.from_thread.run(self.layer_for, layer)
            if loaded is not None:
                out[layer] = loaded.reader.index
        return out
