"""The remote (lazy) Prepare path: find a layer's index in the registry,
hand the layer to the FUSE layer server, and tell containerd the layer
already exists.

Trust: the index is used only if a key in `[trust] keys` signed it (over the
layer's digest and the index blob's), if it arrived through an artifact
manifest fetched by digest whose `subject` is the pulled image's manifest,
inside a blob whose digest that manifest lists, and if it describes exactly
the layer containerd asked for. Nothing else binds what the lazy path serves
to the layer's bytes (docs/layer-index.md, Signatures). Anything else leaves
the layer to the normal path; a stored copy of an index is used again only
while its recorded signature still verifies.

Binding: containerd commits a layer under the chainID the image's config
gives (its diff_ids), and any later image whose config gives the same chain
reuses that snapshot without asking again. So the layer is served lazily only
if the chainID containerd asked for (`containerd.io/snapshot.ref`) is the one
the index's own diff_id gives on top of the parent's chain; an image that
claims another layer's diff_id for its own takes the normal path, where
containerd checks the real diff_id (and fails the pull).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import io
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import structlog

from snapshotter import labels, parents
from snapshotter.fs import control
from snapshotter.fs.fusewire.connection import mounted_fstype
from snapshotter.fs.layers import LayerSource, LayerStore, layer_name
from snapshotter.labels import RemoteLayerLabels
from snapshotter.layer.artifact import index_blobs
from snapshotter.layer.index import (
    ARTIFACT_TYPE,
    IndexFormatError,
    IndexHeader,
    LayerIndex,
    ParsedIndex,
    chain_id,
    is_sha256_digest,
)
from snapshotter.layer.signature import Signature
from snapshotter.layer.tree import implicit_dirs, shows_xattrs
from snapshotter.model import Snapshot
from snapshotter.registry import artifact, media
from snapshotter.registry.auth import CredentialsError
from snapshotter.registry.errors import (
    DeadlineExceeded,
    NotFound,
    RegistryError,
    Unauthorized,
    Unreachable,
)
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.singleflight import SingleFlight
from snapshotter.trust import IndexTrust

if TYPE_CHECKING:
    from snapshotter.registry.client import RegistryClient

log = structlog.get_logger("bootseer.snapshotter")

# Fetching an index is registry round trips and a download, not CPU: enough
# threads that every layer of a large image is on its way at the first
# Prepare, instead of the bottom layers' indexes holding up the others.
INDEX_FETCHERS = 16
# How long a layer's index, stored and decoded by the lookahead of a Prepare
# below it, waits for the layer's own Prepare, which then takes it without
# reading and decoding it again: the Prepares of one pull come within
# seconds. One that was never asked for (an aborted pull) goes after this.
INDEX_REUSE_S = 60.0
# The longest a layer's load waits for the load of the layer below it.
PRELOAD_TURN_S = 10.0


class Reason(enum.StrEnum):
    """Why a Prepare that asked for a remote layer took the path it took: the
    `reason` label of bootseer_snapshotter_layers_total. Few on purpose, so
    each can be alerted on; the log line has the details."""

    # path="lazy"
    SERVED = "served"  # committed as a lazily served layer (or already was)
    # path="normal"
    LAZY_DISABLED = "lazy_disabled"  # [snapshotter] lazy = false (--no-lazy)
    LAYER_SERVER_DOWN = "layer_server_down"  # nothing mounted, or the mount does not answer
    NO_INDEX = "no_index"  # the image has no bootseer index: run `bootseer index`
    LAYER_NOT_INDEXED = "layer_not_indexed"  # the index skipped this layer (zstd, unsafe names)
    UNAUTHORIZED = "unauthorized"  # the registry wants credentials this node lacks (401/403)
    NOT_FOUND = "not_found"  # the image or its index blob is gone from the registry
    REGISTRY_UNREACHABLE = "registry_unreachable"  # no answer after the retries, or past the deadline
    REGISTRY_ERROR = "registry_error"  # 5xx/429 after the retries, or an answer that is wrong
    INDEX_REFUSED = "index_refused"  # the index does not decode, validate or match the layer (or is v1)
    INDEX_UNTRUSTED = "index_untrusted"  # no key in [trust] keys signed the layer's index
    # the chainID containerd asked for is not the one the index's diff_id gives
    # (the image's config claims another layer's diff_id), or the parent's chain is unknown
    DIFF_ID_MISMATCH = "diff_id_mismatch"
    LAYER_REFUSED = "layer_refused"  # the layer server answered EIO for the layer, or does not show it
    # the layer lacks an entry for a directory a lower layer has with other
    # attributes, which containerd copies and the lazy tree cannot (parents.py)
    IMPLICIT_DIRS = "implicit_dirs"
    ERROR = "error"  # anything else (a full disk, a bug): see the log line

    @property
    def path(self) -> str:
        return "lazy" if self is Reason.SERVED else "normal"


class NotLazy(Exception):
    """Why a layer takes the normal path; the message goes to the log, the
    reason to the layers metric."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def reason_of(exc: BaseException) -> Reason:
    """The metric's reason for an exception out of the remote Prepare path."""
    if isinstance(exc, NotLazy):
        return exc.reason
    if isinstance(exc, Unauthorized | CredentialsError):
        return Reason.UNAUTHORIZED
    if isinstance(exc, Unreachable | DeadlineExceeded):
        return Reason.REGISTRY_UNREACHABLE
    if isinstance(exc, NotFound):
        return Reason.NOT_FOUND
    if isinstance(exc, IndexFormatError):
        # A stored index that no longer decodes.
        return Reason.INDEX_REFUSED
    if isinstance(exc, RegistryError):
        # ServerError, DigestMismatch and whatever else the registry client raises.
        return Reason.REGISTRY_ERROR
    return Reason.ERROR


@dataclass(frozen=True)
class RemotePrepare(RemoteLayerLabels):
    """A remote layer's Prepare with the chain it goes on: `parent_chain` is
    the parent snapshot's chainID ("" for a bottom layer), None if the
    parent is not a snapshot of an image layer; `lowers` the directories of
    the parent snapshot and its ancestors, nearest first."""

    parent_chain: str | None
    lowers: tuple[Path, ...] = ()

    @classmethod
    def of(cls, wanted: RemoteLayerLabels, parent_key: str, lowers: tuple[Path, ...] = ()) -> RemotePrepare:
        fields = {f.name: getattr(wanted, f.name) for f in dataclasses.fields(RemoteLayerLabels)}
        return cls(**fields, parent_chain=parent_chain_of(parent_key), lowers=lowers)


def parent_chain_of(parent_key: str) -> str | None:
    """The chainID of a parent snapshot from its key, as containerd (1.6 to
    2.x, through its metadata store) names the snapshots of image layers:
    "<namespace>/<n>/<chainID>" for a layer it committed itself, and our own
    "<namespace>/remote/<chainID>" for a lazily served one (containerd
    records our name for the chainID). "" for no parent; None for a key that
    ends in no chainID (not an image layer's snapshot)."""
    if not parent_key:
        return ""
    last = parent_key.rsplit("/", 1)[-1]
    return last if is_sha256_digest(last) else None


def check_chain(parent_chain: str | None, diff_id: str, target: str) -> None:
    """Refuse (NotLazy) a layer whose index does not give the chainID
    containerd asked to commit it under."""
    if parent_chain is None:
        raise NotLazy(
            Reason.DIFF_ID_MISMATCH,
            f"the parent snapshot is not an image layer's (its key ends in no chainID): cannot bind to {target}",
        )
    if not diff_id:
        raise NotLazy(Reason.INDEX_REFUSED, "the index records no diff_id (format version 1)")
    got = chain_id(parent_chain, diff_id)
    if got != target:
        raise NotLazy(
            Reason.DIFF_ID_MISMATCH,
            f"the layer's diff_id is {diff_id} (its index says), which gives chainID {got} on "
            f"{parent_chain or 'no parent'}, not {target}: the image's config claims another layer's diff_id",
        )


@dataclass(frozen=True)
class LazyLayer:
    path: Path  # the layer's directory in the FUSE mount
    index: LayerIndex


@dataclass
class _IndexFetch:
    """A layer's index on its way into the layer store, or settled: when
    (monotonic), and either the store's `generation` of the copy it stored
    or, None, that it failed."""

    future: Future[LayerIndex]
    # Set once the layer server was asked to load the layer (or the fetch
    # ended without it): the fetch of the layer above waits for it.
    preloaded: threading.Event
    # Set if the layer server then showed the layer (it loaded it) and the
    # image was told of it: the Prepare need not ask either again.
    shown: threading.Event
    settled_at: float | None = None
    generation: str | None = None

    def reusable(self, now: float, store: LayerStore, layer_digest: str, own: bool) -> bool:
        """Whether a Prepare takes this fetch rather than starting another:
        one in flight always; a failed one only for the lookahead (the
        layer's `own` Prepare asks again, a registry may have recovered);
        a stored one while the store still holds that very copy (not
        pruned, not replaced)."""
        if self.settled_at is None:
            # In flight, or just ended: it is settled right after, in the
            # fetch's thread, and its Prepare may come in between.
            return not (own and self.future.done() and self.future.exception() is not None)
        if now - self.settled_at >= INDEX_REUSE_S:
            return False
        if self.generation is None:
            return not own
        return store.generation(layer_name(layer_digest)) == self.generation


@dataclass(frozen=True)
class ImageIndexes:
    """The index blobs attached to one image manifest, per layer digest: the
    newest of each layer's (`any`), and the newest a trusted key signed."""

    any: dict[str, Descriptor]
    trusted: dict[str, Descriptor]


class RemoteLayers:
    def __init__(
        self,
        store: LayerStore,
        mountpoint: Path,
        client_factory: Callable[[], RegistryClient],
        gc_grace_s: float,
        trust: IndexTrust,
        plain_mountpoint: Path | None = None,
    ) -> None:
        """`plain_mountpoint`: the layer mount's twin without xattrs
        (FsConfig.plain_mountpoint), where layers that have none are served
        while the layer server mounts it."""
        self.store = store
        self.trust = trust
        self.gc_grace_s = gc_grace_s
        self.mountpoint = mountpoint
        self.plain_mountpoint = plain_mountpoint
        self._client_factory = client_factory
        self._client: RegistryClient | None = None
        # Index blobs per image manifest, and the listings under way: one
        # referrers round trip per image, however many layers ask at once.
        self._artifacts: dict[str, ImageIndexes] = {}
        self._listing: SingleFlight[str, ImageIndexes] = SingleFlight()
        self._resolved: dict[str, str] = {}
        # Layer blob sizes per image manifest, as its descriptors give them,
        # and the manifest fetches under way: one GET of the manifest per
        # pull, however many layers' index checks need it at once (a
        # registry such as Docker Hub counts each GET of a manifest as a pull).
        self._sizes: dict[str, dict[str, int]] = {}
        self._sizing: SingleFlight[str, dict[str, int]] = SingleFlight()
        self._indexes: dict[str, _IndexFetch] = {}
        # Layers whose Prepare runs (claim), by how many.
        self._claims: Counter[str] = Counter()
        self._fetchers = ThreadPoolExecutor(max_workers=INDEX_FETCHERS, thread_name_prefix="index-fetch")
        # Reentrant: a future that is already done runs its callback at once.
        self._lock = threading.RLock()
        # The registry client's transport is imported on its first request
        # (httpx's httpcore, and trio through it: ~0.1 s, more from a cold
        # page cache); pay that now rather than in the first lazy Prepare.
        # Nothing is read: no credentials, no hosts files.
        self._fetchers.submit(_import_transport)

    @property
    def client(self) -> RegistryClient:
        """Made on first use: most nodes never pull a lazy image, and then no
        credentials or hosts files are read."""
        with self._lock:
            if self._client is None:
                self._client = self._client_factory()
            return self._client

    def prune(self, snapshots: Iterable[Snapshot]) -> list[str]:
        """Drop stored layers (index and cache) no remote snapshot uses any more."""
        keep = {
            s.labels[labels.LAYER_DIGEST]
            for s in snapshots
            if labels.REMOTE in s.labels and labels.LAYER_DIGEST in s.labels
        }
        # Nor the layers a pull has on its way: stored ahead of their Prepare
        # (however old the stored copy, one kept from an earlier pull), or
        # Prepared and their snapshot not recorded yet (claimed). Their
        # Prepare would otherwise hand containerd a layer the store no
        # longer holds. Under the lock: no fetch starts meanwhile on a copy
        # about to go.
        with self._lock:
            now = time.monotonic()
            keep |= {digest for digest, count in self._claims.items() if count}
            keep |= {
                digest
                for digest, fetch in self._indexes.items()
                if fetch.settled_at is None or now - fetch.settled_at < INDEX_REUSE_S
            }
            return self.store.prune(keep, older_than_s=self.gc_grace_s)

    @contextlib.contextmanager
    def claim(self, layer_digest: str) -> Iterator[None]:
        """The layer stays in the store (prune) while the block runs: around
        its Prepare and the recording of the snapshot that then uses it."""
        with self._lock:
            self._claims[layer_digest] += 1
        try:
            yield
        finally:
            with self._lock:
                self._claims[layer_digest] -= 1
                if not self._claims[layer_digest]:
                    del self._claims[layer_digest]

    def prepare(self, wanted: RemotePrepare) -> LazyLayer:
        if not os.path.ismount(self.mountpoint):
            raise NotLazy(Reason.LAYER_SERVER_DOWN, f"the FUSE layer server is not mounted at {self.mountpoint}")
        layer_digest = wanted.layer_digest
        ref = parse_reference(wanted.image_ref)
        manifest_digest = wanted.manifest_digest or self._resolve(ref)
        name = layer_name(layer_digest)
        mine = self._stored(ref, manifest_digest, layer_digest, own=True)
        stored = mine.future
        # The layers above this one come next: fetch their indexes meanwhile.
        below = mine
        for digest in wanted.upcoming:
            below = self._stored(ref, manifest_digest, digest, own=False, below=below)
        index = stored.result()
        # Used: a later Prepare of this layer (another image, a pull after a
        # removal) reads the stored copy again, checking its signature.
        self._consumed(layer_digest, stored)
        check_chain(wanted.parent_chain, index.diff_id, wanted.target)
        implicit = implicit_dirs(index.entries)
        if implicit and (why := parents.differing(implicit, wanted.lowers)):
            raise NotLazy(Reason.IMPLICIT_DIRS, why)
        path = self._mount_for(index) / name
        # Each is a round trip to a layer server busy loading the layers
        # above: asked again only if the fetch did not get both answers.
        if not mine.shown.is_set():
            self._show(name, path)
            self._announce(ref, manifest_digest, layer_digest)
        return LazyLayer(path=path, index=index)

    def expect(self, ref: Reference, manifest_digest: str, layers: Sequence[Descriptor]) -> None:
        """A pull into this snapshotter has just resolved the image: set the
        index fetch of every layer this node does not hold going now, bottom
        layer first, before containerd prepares any (its Prepares then take
        what these fetched), and the layer server looking for the image's
        hot-block manifest with the first of them. Returns at once."""
        if not os.path.ismount(self.mountpoint):
            return
        self._keep_sizes(manifest_digest, layers)
        below = None
        for layer in layers:
            # A stored layer is this node's already: its Prepare, if one
            # comes, reads the stored copy; a re-pull of an image the node
            # holds makes no Prepare at all. Indexes cover sha256 layers only.
            if is_sha256_digest(layer.digest) and not self.store.has(layer.digest):
                below = self._stored(ref, manifest_digest, layer.digest, own=False, below=below)

    def _show(self, name: str, path: Path) -> None:
        """Have the layer server load the layer; NotLazy if it does not show it."""
        try:
            shown = control.lookup(self.mountpoint, name)
        except OSError as exc:
            if exc.errno == errno.EIO:
                raise NotLazy(Reason.LAYER_REFUSED, f"the layer server refused layer {name} (see its log)") from None
            raise NotLazy(
                Reason.LAYER_SERVER_DOWN, f"the layer server at {self.mountpoint} does not answer: {exc.strerror}"
            ) from None
        if not shown:
            raise NotLazy(Reason.LAYER_REFUSED, f"the layer server does not show layer {name} at {path}")

    def _mount_for(self, index: LayerIndex) -> Path:
        """The plain mount for a layer whose files show no xattr (overlayfs
        then never asks), else the layer mount. A layer server from before
        the plain mount has none: the layer mount then."""
        plain = self._plain_up()
        return plain if plain is not None and not shows_xattrs(index.entries) else self.mountpoint

    def _plain_up(self) -> Path | None:
        """The plain mount if it is in use and mounted. From the mount
        table, not a stat: that would be a round trip to a layer server
        busy loading the layers above this one."""
        plain = self.plain_mountpoint
        return plain if plain is not None and mounted_fstype(plain) is not None else None

    def files_of(self, layer_digest: str, served: Path | None) -> Path:
        """Where a layer's files are for a mount made now: the local copy
        the layer server wrote once the layer was whole (fs/unpack.py), or
        the plain mount if its Prepare found it there (`served`) and the
        plain mount is still up, else the layer mount, which shows every
        layer as it is."""
        name = layer_name(layer_digest)
        tree = self.store.tree_path(name)
        if tree.is_dir():
            return tree
        # The mount table only for a lower the plain mount served.
        if served is not None and served.parent == self.plain_mountpoint and self._plain_up() is not None:
            return served
        return self.mountpoint / name

    def _stored(
        self, ref: Reference, manifest_digest: str, layer_digest: str, own: bool, below: _IndexFetch | None = None
    ) -> _IndexFetch:
        """The layer's index, put in the layer store by a background thread.
        A layer already on its way, or stored and decoded moments ago by the
        lookahead of a Prepare below it, is not fetched or decoded twice;
        nor is one that failed fetched again by the lookahead (`own`: the
        layer's own Prepare, which does try again). The layer server is
        asked to load it only after the layer `below` (the layer server
        loads one at a time, and containerd prepares from the bottom up)."""
        now = time.monotonic()
        with self._lock:
            fetch = self._indexes.get(layer_digest)
            # Bounded by what the last INDEX_REUSE_S prepared.
            for digest, other in list(self._indexes.items()):
                if other.settled_at is not None and now - other.settled_at >= INDEX_REUSE_S:
                    del self._indexes[digest]
        if fetch is not None and fetch.reusable(now, self.store, layer_digest, own):
            return fetch
        with self._lock:
            current = self._indexes.get(layer_digest)
            if current is not None and current is not fetch:
                # Another Prepare started one meanwhile.
                return current
            preloaded, shown = threading.Event(), threading.Event()
            turn = below.preloaded if below is not None else None
            future = self._fetchers.submit(
                self._store_and_announce, ref, manifest_digest, layer_digest, turn, preloaded, shown
            )
            fetch = _IndexFetch(future, preloaded, shown)
            self._indexes[layer_digest] = fetch
        fetch.future.add_done_callback(lambda future: self._settle(layer_digest, fetch, future))
        return fetch

    def _settle(self, layer_digest: str, fetch: _IndexFetch, future: Future[LayerIndex]) -> None:
        generation = None if future.exception() is not None else self.store.generation(layer_name(layer_digest))
        with self._lock:
            fetch.generation, fetch.settled_at = generation, time.monotonic()

    def _consumed(self, layer_digest: str, future: Future[LayerIndex]) -> None:
        with self._lock:
            fetch = self._indexes.get(layer_digest)
            if fetch is not None and fetch.future is future:
                del self._indexes[layer_digest]

    def _store_and_announce(
        self,
        ref: Reference,
        manifest_digest: str,
        layer_digest: str,
        turn: threading.Event | None,
        preloaded: threading.Event,
        shown: threading.Event,
    ) -> LayerIndex:
        """The layer's index, stored; the layer server asked to load the
        layer in its turn (after the layer below); and the layer announced,
        so that the layer server prefetches its hot blocks from now on: for
        the layers above the one being prepared (fetched ahead from
        cri.image-layers), while containerd is still preparing the layers
        below. A prefetch only fills the cache with blocks checked against
        this trusted index; whether a container is ever served the layer is
        still the Prepare's decision (chain binding, implicit directories)."""
        try:
            index = self._store_index(ref, manifest_digest, layer_digest)
            if turn is not None:
                # Bounded: the layer below's fetch always sets it, this is only
                # a guard against waiting on a registry that hangs there.
                turn.wait(PRELOAD_TURN_S)
            loaded = self._preload(layer_digest)
        finally:
            preloaded.set()
        if self._announce(ref, manifest_digest, layer_digest) and loaded:
            shown.set()
        return index

    def _store_index(self, ref: Reference, manifest_digest: str, layer_digest: str) -> LayerIndex:
        name = layer_name(layer_digest)
        if self.store.has(layer_digest):
            # The checkpoints are the layer server's to check, at its load.
            stored, source = self.store.load(name, checkpoints=False)
            stored_digest = self.store.index_digest(name)
            if stored.diff_id and self.trust.accepts(layer_digest, stored_digest, source.signature):
                return stored
            # Stored by an older bootseer (format 1, or unsigned) or signed by
            # a key no longer trusted. The layer server goes on serving it to
            # the containers that use it; a new snapshot may use it only if it
            # is the very blob a trusted key signed (no need to fetch it then).
            blob = self._trusted_blob(ref, manifest_digest, layer_digest)
            if blob.digest != stored_digest:
                raise NotLazy(
                    Reason.INDEX_REFUSED,
                    f"this node holds another copy of the index of {layer_digest} ({stored_digest}, stored "
                    f"by an older bootseer or from an index no trusted key signed) than the trusted {blob.digest}; "
                    "the layer unpacks the normal way until no snapshot uses that copy and it is pruned",
                )
            self._check_index(ref, manifest_digest, layer_digest, stored.header, blob.digest)
            return stored
        parsed, encoded, blob = self._fetch_index(ref, manifest_digest, layer_digest)
        source = LayerSource(ref=ref.name, digest=layer_digest, signature=Signature.from_annotations(blob.annotations))
        self.store.add(parsed.header, source, encoded)
        try:
            # The layer server decodes the index and builds its tree while
            # the layers below are prepared, and while this makes the
            # entries: its load, in this layer's turn, is quick.
            control.open_ahead(self.mountpoint, name)
        except OSError as exc:
            log.debug("layer server could not open a layer ahead", layer=layer_digest, error=str(exc))
        try:
            return parsed.index()
        except IndexFormatError as exc:
            # The layer server refuses it too. Not kept: a later Prepare
            # fetches the index again (the registry's may be mended by then).
            self.store.remove(name)
            raise NotLazy(Reason.INDEX_REFUSED, f"the index of {layer_digest} is unusable: {exc}") from None

    def _preload(self, layer_digest: str) -> bool:
        """Have the layer server load the layer now (decode its index, build
        its tree), while containerd is still preparing the layers below, so
        its own Prepare finds it ready. True if the server shows it."""
        try:
            return control.lookup(self.mountpoint, layer_name(layer_digest))
        except OSError as exc:
            log.debug("layer server could not preload a layer", layer=layer_digest, error=str(exc))
            return False

    def _resolve(self, ref: Reference) -> str:
        """The manifest digest of a reference, when containerd did not label it
        (its CRI adds cri.manifest-digest only in newer versions)."""
        with self._lock:
            known = self._resolved.get(str(ref))
        if known is None:
            resolved = self.client.resolve(ref)
            known = resolved.manifest_digest
            with self._lock:
                self._resolved[str(ref)] = known
            self._keep_sizes(known, resolved.manifest.layers)
        return known

    def _layer_size(self, ref: Reference, manifest_digest: str, layer_digest: str) -> int:
        """The size of the layer blob as the image manifest's descriptor gives
        it (containerd's normal path fetches exactly that many bytes)."""
        sizes = self._sizing.do(manifest_digest, lambda: self._sizes_of(ref, manifest_digest))
        size = sizes.get(layer_digest)
        if size is None:
            raise NotLazy(Reason.INDEX_REFUSED, f"image manifest {manifest_digest} lists no layer {layer_digest}")
        return size

    def _sizes_of(self, ref: Reference, manifest_digest: str) -> dict[str, int]:
        with self._lock:
            known = self._sizes.get(manifest_digest)
        if known is not None:
            return known
        # By digest: the registry client checks the bytes against it.
        data, media_type, _ = self.client.fetch_manifest(ref.with_digest(manifest_digest))
        try:
            parsed = media.parse(data, media_type)
        except media.InvalidManifest as exc:
            raise NotLazy(Reason.REGISTRY_ERROR, f"image manifest {manifest_digest}: {exc}") from None
        if not isinstance(parsed, media.Manifest):
            raise NotLazy(Reason.REGISTRY_ERROR, f"{manifest_digest} is a {media_type}, not an image manifest")
        return self._keep_sizes(manifest_digest, parsed.layers)

    def _keep_sizes(self, manifest_digest: str, layers: Sequence[Descriptor]) -> dict[str, int]:
        """The layer blob sizes of an image manifest the registry client
        checked against `manifest_digest`, kept for `_layer_size`."""
        with self._lock:
            return self._sizes.setdefault(manifest_digest, {d.digest: d.size for d in layers})

    def _announce(self, ref: Reference, manifest_digest: str, layer_digest: str | None = None) -> bool:
        """Tell the layer server this image now has this layer, so it can
        prefetch the image's hot blocks or record them; without a layer,
        that the image is coming (said once: nothing new to read after).
        False if it could not be told."""
        name = manifest_digest.split(":", 1)[1]
        try:
            with self._lock:
                request = control.read_request(self.store, name)
                changed = request is None
                if request is None:
                    request = control.ImageRequest(ref=str(ref), image=manifest_digest)
                if layer_digest is not None and layer_digest not in request.layers:
                    request.layers.append(layer_digest)
                    changed = True
                if changed:
                    control.write_request(self.store, request)
            if changed or layer_digest is not None:
                control.notify(self.mountpoint, name)
        except OSError as exc:
            log.warning("could not announce the image to the layer server", image=manifest_digest, error=str(exc))
            return False
        return True

    def _fetch_index(
        self, ref: Reference, manifest_digest: str, layer_digest: str
    ) -> tuple[ParsedIndex, bytes, Descriptor]:
        """The trusted index of a layer, parsed and its header checked
        against the image, its encoding and its blob's descriptor."""
        blob = self._trusted_blob(ref, manifest_digest, layer_digest)
        buffer = io.BytesIO()
        self.client.fetch_blob(ref, blob.digest, buffer)
        encoded = buffer.getvalue()
        try:
            parsed = LayerIndex.parse(encoded, checkpoints=False)
        except IndexFormatError as exc:
            raise NotLazy(Reason.INDEX_REFUSED, f"the index of {layer_digest} is unusable: {exc}") from None
        self._check_index(ref, manifest_digest, layer_digest, parsed.header, blob.digest)
        return parsed, encoded, blob

    def _trusted_blob(self, ref: Reference, manifest_digest: str, layer_digest: str) -> Descriptor:
        """The descriptor of the newest index blob of the layer a trusted key signed."""
        indexes = self._index_blobs(ref, manifest_digest)
        blob = indexes.trusted.get(layer_digest)
        if blob is None:
            newest = indexes.any.get(layer_digest)
            if newest is None:
                raise NotLazy(
                    Reason.LAYER_NOT_INDEXED, f"the index artifact of {manifest_digest} has no entry for {layer_digest}"
                )
            raise NotLazy(Reason.INDEX_UNTRUSTED, f"layer {layer_digest}: {self.trust.refusal(newest)}")
        return blob

    def _check_index(
        self, ref: Reference, manifest_digest: str, layer_digest: str, header: IndexHeader, blob_digest: str
    ) -> None:
        """Refuse (NotLazy) an index that does not describe exactly this layer."""
        if header.layer_digest != layer_digest:
            raise NotLazy(
                Reason.INDEX_REFUSED, f"the index {blob_digest} describes {header.layer_digest}, not {layer_digest}"
            )
        if not header.diff_id:
            raise NotLazy(
                Reason.INDEX_REFUSED,
                f"the index of {layer_digest} was built by an older bootseer (format version 1, no diff_id); "
                f"re-run `bootseer index {ref}` to rebuild it",
            )
        # The index's blocks end at compressed_size (decoding checks it);
        # the blob the normal path would read ends at the descriptor's size.
        # An index of a blob's readable part (a truncated one, or one with
        # trailing bytes that are not gzip) would serve what containerd refuses.
        size = self._layer_size(ref, manifest_digest, layer_digest)
        if header.compressed_size != size:
            raise NotLazy(
                Reason.INDEX_REFUSED,
                f"the index of {layer_digest} describes a blob of {header.compressed_size} bytes, "
                f"the image manifest's layer has {size}: the index does not cover the whole layer",
            )

    def _index_blobs(self, ref: Reference, manifest_digest: str) -> ImageIndexes:
        return self._listing.do(manifest_digest, lambda: self._list_index_blobs(ref, manifest_digest))

    def _list_index_blobs(self, ref: Reference, manifest_digest: str) -> ImageIndexes:
        with self._lock:
            cached = self._artifacts.get(manifest_digest)
        if cached is not None:
            return cached
        artifacts = artifact.referrers(self.client, ref, manifest_digest, ARTIFACT_TYPE)
        indexes = ImageIndexes(any=index_blobs(artifacts), trusted=index_blobs(artifacts, self.trust.accepts_blob))
        if not indexes.any:
            raise NotLazy(
                Reason.NO_INDEX, f"image {ref} ({manifest_digest}) has no bootseer index; run `bootseer index {ref}`"
            )
        if indexes.trusted:
            # Before any index is fetched (the Prepares that find the
            # listing kept fetch theirs at once): the layer server looks for
            # the image's hot-block manifest meanwhile, not once a layer is in.
            self._announce(ref, manifest_digest)
            # Not before: a signed index attached later is found at the next Prepare.
            with self._lock:
                self._artifacts[manifest_digest] = indexes
        return indexes


def _import_transport() -> None:
    httpx.HTTPTransport(verify=False).close()
