"""Hot blocks inside the layer server: for each image it is told about,
prefetch the blocks of its hot-block manifest, or, if it has none, record
the blocks its first run reads and publish them as one.

Prefetching runs alongside the container's own reads: the blocks of every
layer prepared so far are fetched in manifest order (first access across the
whole image) by a few workers, a layer's consecutive hot blocks merged into
one Range request and taken when the first of them is due (hot_runs); a
reader's miss does not queue behind them (separate fetch slots and decode
threads), and a block already on its way is waited for, never fetched twice
(LayerReader.ensure).

Publishing follows `[fs] hot_blocks_publish` (docs/hot-blocks.md): with
"elected" a recording reaches the registry only if the image has no
published manifest and this node wins the image's publish election
(recorder.election), so a thousand nodes starting a new image push one; with
"designated" every recording of this node is published; with "never" none
is. An explicit recording (`bootseer record start`) is published unless the
mode is "never". Whatever happens, the node keeps its merged manifest
locally and prefetches from it; a published manifest replaces it on a later
start.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
import trio

from recorder import election
from recorder import manifest as hot
from recorder import publish as registry_manifests
from recorder.localstore import LocalManifests
from recorder.manifest import HotManifest, ManifestError
from recorder.metrics import ELECTIONS, NOT_PUSHED, PUSHED
from recorder.publish import Published
from recorder.session import RecordingSession
from snapshotter.fs.control import ImageRequest, read_request
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import BlockUnavailable, Origin
from snapshotter.fs.served import ServedLayer
from snapshotter.layer.blockmath import HOT_BATCH_BYTES, HOT_BATCH_RUNS, hot_runs, run_span
from snapshotter.layer.index import LayerIndex
from snapshotter.layer.parts import Reach
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference

log = structlog.get_logger("bootseer.hotblocks")

TICK_S = 0.25
# How long a small layer's whole fetch waits for the images starting with it
# to find their manifests (a registry lookup or two): long enough for a
# manifest found in the registry, short enough that a layer no manifest
# covers is not held back much.
DECIDE_WAIT_S = 2.0
# `[fs] hot_blocks_publish`.
PUBLISH_MODES = ("elected", "designated", "never")


@dataclass
class _Prefetch:
    """One image's prefetch: the runs of every prepared layer in one queue,
    ordered by their first block's place in the manifest (first access)."""

    manifest: HotManifest
    expected: set[str]  # the layers the manifest has blocks in
    queued: set[str] = field(default_factory=set)  # layers checked (and queued, if good)
    # (place of the first-read block, layer, run, the run's last block's
    # first parts if that is all it asks, the run's compressed bytes)
    queue: list[tuple[int, str, list[int], dict[int, tuple[int, bytes]], int]] = field(default_factory=list)
    layers: dict[str, ServedLayer] = field(default_factory=dict)
    arrived: trio.Event = field(default_factory=trio.Event)
    began: float = field(default_factory=time.monotonic)
    workers: int = 0

    def wake(self) -> None:
        """Workers waiting for more runs look again."""
        self.arrived.set()
        self.arrived = trio.Event()


def _next_batch(
    queue: list[tuple[int, str, list[int], dict[int, tuple[int, bytes]], int]],
) -> tuple[str, list[int], dict[int, tuple[int, bytes]]]:
    """The runs due next, taken off `queue`: the first, and those after it
    of the same layer, up to HOT_BATCH_RUNS runs and HOT_BATCH_BYTES, which
    the reader asks for in one request. Returns (layer, their blocks, the
    first parts of those asked so)."""
    _, layer, blocks, prefixes, size = heapq.heappop(queue)
    blocks, prefixes, runs = list(blocks), dict(prefixes), 1
    while queue and queue[0][1] == layer and runs < HOT_BATCH_RUNS and size + queue[0][4] <= HOT_BATCH_BYTES:
        _, _, more, more_prefixes, more_size = heapq.heappop(queue)
        blocks += more
        prefixes.update(more_prefixes)
        size += more_size
        runs += 1
    return layer, blocks, prefixes


@dataclass
class _Image:
    request: ImageRequest
    manifest: HotManifest | None = None
    session: RecordingSession | None = None
    started_layers: set[str] = field(default_factory=set)
    decided: bool = False
    # Set with `decided`, for those waiting on the decision (covers).
    decision: trio.Event = field(default_factory=trio.Event)
    # The session records only in case the manifest turns out unusable: it
    # is dropped once every layer's blocks checked out.
    provisional: bool = False
    prefetch: _Prefetch | None = None


@dataclass
class HotBlockSettings:
    idle_s: float
    max_s: float
    prefetch_parallel: int
    publish: str = "elected"
    # The length of one publish election round (recorder.election).
    election_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.publish not in PUBLISH_MODES:
            raise ValueError(f"[fs] hot_blocks_publish must be one of {', '.join(PUBLISH_MODES)}, not {self.publish!r}")
        if self.election_s <= 0:
            raise ValueError("[fs] hot_blocks_election_s must be positive")


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
        # Set, and replaced, on every image request: for covers().
        self._announced = trio.Event()

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

    def access(self, layer: str, block: int, extent: int) -> None:
        """A read reached `extent` bytes into `block` of `layer`."""
        now = time.monotonic()
        for image in self.images.values():
            if image.session is not None:
                image.session.access(layer, block, now, extent)

    def records(self, layer: str) -> bool:
        """Whether a recording under way reads `layer`: the layer's reader
        then keeps how far each block's parts take it (parts.Reach)."""
        return any(image.session is not None and layer in image.session.layers for image in self.images.values())

    async def covers(self, layer: str) -> bool:
        """Whether a hot-block manifest of an image starting with `layer`
        lists blocks of it: then the prefetch brings what a start reads, and
        nothing else is fetched ahead (a small layer is not fetched whole).
        The snapshotter has the layer loaded just before it announces the
        image: waits, at most DECIDE_WAIT_S, for an image with the layer to
        be announced and for those announced to find their manifests."""
        with trio.move_on_after(DECIDE_WAIT_S):
            while True:
                images = [image for image in self.images.values() if layer in image.request.layers]
                undecided = next((image for image in images if not image.decided), None)
                if undecided is not None:
                    await undecided.decision.wait()
                elif images:
                    break
                else:
                    await self._announced.wait()
        return any(
            image.manifest is not None and any(b.layer == layer for b in image.manifest.blocks)
            for image in self.images.values()
            if layer in image.request.layers
        )

    async def notify(self, name: str, request: ImageRequest | None = None) -> None:
        """The request file of image `name` was written: act on it (`request`,
        if the caller has read it already)."""
        # A small file the snapshotter has just written: reading it here is
        # quicker than a thread hop, and the snapshotter waits for this answer.
        if request is None:
            request = read_request(self.store, name)
        if request is None or self._nursery is None:
            return
        self._announced.set()
        self._announced = trio.Event()
        image = self.images.get(request.image)
        if image is None:
            image = self.images[request.image] = _Image(request)
            # Record from the first moment: the run's first reads arrive
            # while the manifest is still being looked for, and a recording
            # that turns out not to be wanted is simply dropped.
            self._start_recording(image, quiet=True, explicit=request.record)
            self._nursery.start_soon(self._decide, image)
            return
        image.request = request
        if image.session is not None:
            image.session.layers.update(request.layers)
            image.session.stop_requested = request.stop
            image.session.explicit = image.session.explicit or request.record
            image.provisional = image.provisional and not request.record
        elif request.record and not request.stop:
            self._start_recording(image, explicit=True)
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
        image.decision.set()
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
        """The manifest to prefetch: this node's copy of the published one;
        else the registry's newest, which replaces a manifest only this node
        has (it recorded and did not push) once one is published; else that
        one."""
        entry = self.local.entry(request.image)
        if entry is not None and entry.published:
            return entry.manifest
        try:
            newest = self._newest_published(request)
        except Exception as exc:
            log.warning("no usable hot-block manifest in the registry", image=request.image, error=str(exc))
            newest = None
        if newest is None or newest.manifest is None:
            if entry is not None:
                log.info("using this node's own hot-block manifest", image=request.image, runs=entry.manifest.runs)
                return entry.manifest
            return None
        if entry is not None and newest.digest in entry.includes:
            return entry.manifest
        self.local.put(newest.manifest, published=newest.digest, includes=(newest.digest,))
        if entry is not None:
            log.info("picked up the published hot-block manifest", image=request.image, artifact=newest.digest)
        return newest.manifest

    def _newest_published(self, request: ImageRequest) -> Published | None:
        found = registry_manifests.find(self.client, parse_reference(request.ref), request.image)
        if not found:
            return None
        if found[-1].manifest is None:
            log.warning("no usable hot-block manifest in the registry", image=request.image, artifact=found[-1].digest)
        return found[-1]

    def _start_recording(self, image: _Image, quiet: bool = False, explicit: bool = False) -> None:
        if image.session is None:
            image.session = RecordingSession(
                image=image.request.image,
                layers=set(image.request.layers),
                started=time.monotonic(),
                idle_s=self.settings.idle_s,
                max_s=self.settings.max_s,
                stop_requested=image.request.stop,
                explicit=explicit,
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
            layer.reader.follow_manifest({b.block for b in blocks})
            prefixes = {b.block: (b.size, bytes.fromhex(b.link)) for b in blocks if b.partial}
            for position, run in hot_runs(positions, index.blocks, {n: p[0] for n, p in prefixes.items()}):
                prefix = {run[-1]: prefixes[run[-1]]} if run[-1] in prefixes else {}
                start, end = run_span(run, index.blocks, prefix[run[-1]][0] if prefix else None)
                heapq.heappush(prefetch.queue, (position, layer_digest, run, prefix, end - start))
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
                    layer_digest, blocks, prefixes = _next_batch(prefetch.queue)
                    layer = prefetch.layers[layer_digest]
                    if not layer.current:
                        continue
                    try:
                        # What it fetches counts for this image (bootseer_fs_image_prefetched_bytes_total).
                        await layer.reader.ensure(blocks, Origin.HOT, image=image.request.image, prefixes=prefixes)
                    except BlockUnavailable as exc:
                        log.warning("prefetch failed", layer=layer_digest, blocks=blocks, error=str(exc))
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
        reaches: dict[tuple[str, int], Reach] = {}
        for layer_digest in {layer for layer, _ in session.accesses}:
            layer = await self.layer_for(layer_digest)
            if layer is not None:
                indexes[layer_digest] = layer.reader.index
                reaches.update(((layer_digest, n), r) for n, r in layer.reader.reaches.items())
                if not self.records(layer_digest):
                    layer.reader.reaches.clear()
        accesses = {k: v for k, v in session.accesses.items() if k[0] in indexes}
        recorded = hot.from_record(session.image, accesses, indexes, session.extents, reaches)
        try:
            merged, published = await trio.to_thread.run_sync(
                self._settle, image.request, recorded, indexes, session.explicit
            )
        except Exception as exc:
            log.warning("hot-block recording not kept", image=session.image, error=str(exc))
            return
        log.info(
            "hot-block manifest published" if published else "hot-block manifest kept on this node",
            image=session.image,
            blocks=len(merged.blocks),
            bytes=merged.total_bytes,
            runs=merged.runs,
            artifact=published or None,
        )

    def _settle(
        self, request: ImageRequest, recorded: HotManifest, indexes: dict[str, LayerIndex], explicit: bool
    ) -> tuple[HotManifest, str]:
        """This run merged into what the image already has (this node's
        manifest and the registry's, a stale one left out), published if the
        policy says so, and kept locally whatever the registry says: the
        manifest and the artifact it was published as ("" if it was not)."""
        ref = parse_reference(request.ref)

        def check(manifest: HotManifest) -> None:
            hot.check(manifest, request.image, indexes | self._indexes_of(manifest, indexes))

        own = recorded
        includes: tuple[str, ...] = ()
        entry = self.local.entry(request.image)
        if entry is not None:
            try:
                check(entry.manifest)
                own, includes = hot.merge(entry.manifest, recorded), entry.includes
            except ManifestError as exc:
                log.warning("hot-block manifest is stale; replacing it", image=request.image, reason=str(exc))
        found: list[Published] | None
        try:
            found = registry_manifests.find(self.client, ref, request.image)
        except Exception as exc:
            log.warning("published hot-block manifest unreadable", image=request.image, error=str(exc))
            found = None
        combined, includes = registry_manifests.combine(own, found or [], includes, check)
        merged = combined or recorded
        published = ""
        try:
            reason = self._why_not_publish(request, ref, explicit, found, includes)
            if reason is None:
                published = registry_manifests.publish(self.client, ref, request.image, merged, found or [])
                includes = (*includes, published)
                PUSHED.inc()
            elif reason == "failed":
                NOT_PUSHED.labels(reason).inc()
                log.warning(
                    "hot-block manifest kept locally; publishing failed",
                    image=request.image,
                    error="the registry's manifests for the image could not be read",
                )
            else:
                NOT_PUSHED.labels(reason).inc()
                log.info("hot-block manifest not pushed", image=request.image, reason=reason)
        except Exception as exc:
            NOT_PUSHED.labels("failed").inc()
            log.warning("hot-block manifest kept locally; publishing failed", image=request.image, error=str(exc))
        finally:
            # After the push, so that `bootseer record stop`, which waits for
            # the local copy to change, returns once the registry has it.
            self.local.put(merged, published=published, includes=includes)
        return merged, published

    def _why_not_publish(
        self,
        request: ImageRequest,
        ref: Reference,
        explicit: bool,
        found: list[Published] | None,
        includes: tuple[str, ...],
    ) -> str | None:
        """None if this node publishes its manifest now, else why not (the
        metric's reason). Holds the election when it is this node's turn."""
        mode = self.settings.publish
        if mode == "never":
            return "never"
        if mode == "designated" or explicit:
            return None
        if found is None:
            return "failed"
        if any(p.digest in includes for p in found):
            return "published"
        outcome, claim = election.run(self.client, ref, request.image, election.current_round(self.settings.election_s))
        ELECTIONS.labels(outcome.value).inc()
        log.info("hot-block publish election", image=request.image, outcome=outcome.value)
        if outcome is not election.Outcome.WON:
            return str(outcome.value)
        # Every later contender loses at Y already: X has served its purpose.
        election.release(self.client, ref, claim)
        return None

    def _indexes_of(self, manifest: HotManifest, known: dict[str, LayerIndex]) -> dict[str, LayerIndex]:
        """Indexes of layers a manifest names that this recording did not read."""
        out: dict[str, LayerIndex] = {}
        for layer in {b.layer for b in manifest.blocks} - set(known):
            loaded = trio.from_thread.run(self.layer_for, layer)
            if loaded is not None:
                out[layer] = loaded.reader.index
        return out
