"""The remote Prepare path over a whole image: the first layer's Prepare
sets every layer's index on its way at once, each index is listed, fetched
and decoded once for the pull, and a bad index or a lost copy costs only
its own layer."""

from __future__ import annotations

import errno
import io
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import msgspec
import pytest

from snapshotter import remote as remote_mod
from snapshotter.fs.control import CONTROL_PREFIX, ImageRequest, read_request
from snapshotter.fs.layers import LayerStore
from snapshotter.labels import LAYER_DIGEST, REMOTE
from snapshotter.layer.index import LAYER_ANNOTATION, MEDIA_TYPE, LayerIndex, ParsedIndex, chain_ids
from snapshotter.model import Kind, Snapshot
from snapshotter.registry import artifact as registry_artifact
from snapshotter.registry import media
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor, Manifest
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.remote import INDEX_FETCHERS, NotLazy, Reason, RemoteLayers, RemotePrepare
from tests.harness.procs import wait_until
from tests.harness.trust import index_trust, signed
from tests.unit.test_index_validation import digest_of, index_of, layer, member

REF = parse_reference("registry.example/team/train:v1")
# More layers than the snapshotter used to fetch indexes for at once (4).
LAYERS = 6
# Bounds a wait that fails the test; nothing is timed.
WAIT_S = 10.0


@dataclass
class Image:
    """An indexed image in memory: its layers' indexes, their signed blobs,
    and the registry calls the Prepare path makes, counted."""

    indexes: list[LayerIndex]
    encoded: dict[str, bytes]  # index blob digest -> bytes
    blobs: list[Descriptor]  # index blob of each layer, bottom first
    manifest: bytes
    fetched: list[str] = field(default_factory=list)
    listings: int = 0
    manifests: int = 0
    # Called before each manifest fetch answers.
    before_manifest: list[Callable[[], object]] = field(default_factory=list)
    # Called with the index blob digest before each fetch answers.
    before_fetch: list[Callable[[str], object]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def manifest_digest(self) -> str:
        return digest_of(self.manifest)

    @property
    def layer_digests(self) -> list[str]:
        return [index.layer_digest for index in self.indexes]

    def fetch_blob(self, ref: Reference, digest: str, dest: io.BytesIO) -> None:
        with self.lock:
            self.fetched.append(digest)
        for hook in self.before_fetch:
            hook(digest)
        dest.write(self.encoded[digest])

    def fetch_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
        assert ref.object == self.manifest_digest
        with self.lock:
            self.manifests += 1
        for hook in self.before_manifest:
            hook()
        return self.manifest, media.OCI_MANIFEST, self.manifest_digest

    def referrers(self, *_: object) -> list[Manifest]:
        with self.lock:
            self.listings += 1
        config = Descriptor(media.OCI_CONFIG, digest_of(b"{}"), 2)
        return [Manifest(media.OCI_MANIFEST, config, tuple(self.blobs))]

    def fetches_of(self, i: int) -> int:
        return self.fetched.count(self.blobs[i].digest)

    def prepare(self, i: int) -> RemotePrepare:
        """Layer i's Prepare as containerd sends it: its chainID, and the
        layers above it in cri.image-layers."""
        chains = chain_ids([index.diff_id for index in self.indexes])
        return RemotePrepare(
            target=chains[i],
            image_ref=str(REF),
            layer_digest=self.layer_digests[i],
            manifest_digest=self.manifest_digest,
            upcoming=tuple(self.layer_digests[i + 1 :]),
            parent_chain=chains[i - 1] if i else "",
        )


def _image(tmp_path: Path, corrupt: int | None = None, bad_entry: int | None = None) -> Image:
    """`corrupt`: that layer's index is not one at all; `bad_entry`: that
    layer's index has a sound header, and an entry whose data lies past the
    layer's end."""
    indexes, encoded, blobs, descriptors = [], {}, [], []
    for i in range(LAYERS):
        blob = layer([member(f"file{i}", data=bytes([i]) * (1000 + i))])
        index = index_of(blob, tmp_path)
        if i == bad_entry:
            index = replace(
                index, entries=[msgspec.structs.replace(e, size=index.uncompressed_size + 1) for e in index.entries]
            )
        # A corrupt index is still the blob a trusted key signed: what a
        # broken indexer or a bad disk at the registry would publish.
        data = b"not an index" if i == corrupt else index.encode()
        encoded[digest_of(data)] = data
        indexes.append(index)
        blobs.append(
            signed(
                Descriptor(MEDIA_TYPE, digest_of(data), len(data), annotations={LAYER_ANNOTATION: index.layer_digest})
            )
        )
        descriptors.append({"mediaType": media.OCI_LAYER_GZIP, "digest": index.layer_digest, "size": len(blob)})
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media.OCI_MANIFEST,
            "config": {"mediaType": media.OCI_CONFIG, "digest": digest_of(b"{}"), "size": 2},
            "layers": descriptors,
        }
    ).encode()
    return Image(indexes, encoded, blobs, manifest)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A node whose layer server answers for every layer (no FUSE here)."""
    mountpoint = tmp_path / "m"
    mountpoint.mkdir()
    monkeypatch.setattr(remote_mod.os.path, "ismount", lambda path: Path(path) == mountpoint)
    monkeypatch.setattr(remote_mod.control, "lookup", lambda mount, name: True)
    yield mountpoint


def _remote(tmp_path: Path, mountpoint: Path, image: Image, monkeypatch: pytest.MonkeyPatch) -> RemoteLayers:
    monkeypatch.setattr(registry_artifact, "referrers", image.referrers)
    return RemoteLayers(
        LayerStore(tmp_path / "layers"), mountpoint, lambda: cast(RegistryClient, image), 0, index_trust()
    )


def _count_decodes(monkeypatch: pytest.MonkeyPatch, then: Callable[[int], object] = lambda count: None) -> list[int]:
    """Indexes parsed (LayerIndex.parse, which decode() goes through too);
    `then` is told the count after each parse, failed or not."""
    decodes = [0]
    parse = LayerIndex.__dict__["parse"].__func__
    lock = threading.Lock()

    def counted(cls: type[LayerIndex], data: bytes, checkpoints: bool = True) -> ParsedIndex:
        try:
            return cast(ParsedIndex, parse(cls, data, checkpoints))
        finally:
            with lock:
                decodes[0] += 1
                then(decodes[0])

    monkeypatch.setattr(LayerIndex, "parse", classmethod(counted))
    return decodes


def test_the_first_prepare_sets_every_layers_index_on_its_way_at_once(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert INDEX_FETCHERS >= LAYERS
    image = _image(tmp_path)
    # No index fetch answers until every layer's has been asked for: one
    # Prepare at a time, a few layers at a time, would never get there.
    everyone = threading.Barrier(LAYERS, timeout=WAIT_S)
    image.before_fetch.append(lambda digest: everyone.wait())
    remote = _remote(tmp_path, node, image, monkeypatch)
    served = remote.prepare(image.prepare(0))
    assert served.index.layer_digest == image.layer_digests[0]
    assert sorted(image.fetched) == sorted(blob.digest for blob in image.blobs)
    # The rest of the pull takes what the first Prepare set going.
    for i in range(1, LAYERS):
        assert remote.prepare(image.prepare(i)).path == node / image.layer_digests[i].split(":")[1]
    assert len(image.fetched) == LAYERS


def test_the_image_is_announced_before_its_first_index_is_fetched(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As soon as the listing finds signed indexes: the layer server then
    looks for the image's hot-block manifest while the indexes are fetched
    and the layers loaded, and each layer is added as it is stored."""
    image = _image(tmp_path)
    remote = _remote(tmp_path, node, image, monkeypatch)
    name = image.manifest_digest.split(":", 1)[1]
    poked: list[str] = []

    def lookup(mount: Path, what: str) -> bool:
        poked.append(what)
        return True

    monkeypatch.setattr(remote_mod.control, "lookup", lookup)
    at_first_fetch: list[tuple[ImageRequest | None, list[str]]] = []
    first = threading.Lock()

    def look(digest: str) -> None:
        # Every fetch answers after its own look: the first look comes
        # before any index is stored.
        with first:
            if not at_first_fetch:
                at_first_fetch.append((read_request(remote.store, name), list(poked)))

    image.before_fetch.append(look)
    for i in range(LAYERS):
        remote.prepare(image.prepare(i))
    request, poked_by_then = at_first_fetch[0]
    assert request == ImageRequest(ref=str(REF), image=image.manifest_digest, layers=[])
    assert poked_by_then == [CONTROL_PREFIX + name]
    final = read_request(remote.store, name)
    assert final is not None and sorted(final.layers) == sorted(image.layer_digests)


def test_each_index_is_listed_fetched_and_decoded_once_for_a_pull(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image(tmp_path)
    remote = _remote(tmp_path, node, image, monkeypatch)
    decodes = _count_decodes(monkeypatch)
    for i in range(LAYERS):
        remote.prepare(image.prepare(i))
    assert image.listings == 1
    assert [image.fetches_of(i) for i in range(LAYERS)] == [1] * LAYERS
    assert decodes[0] == LAYERS
    # A later pull of a layer (another image, after a removal) reads the
    # stored copy again, and checks its signature again, without the registry.
    remote.prepare(image.prepare(LAYERS - 1))
    assert decodes[0] == LAYERS + 1 and len(image.fetched) == LAYERS


def test_the_image_manifest_is_fetched_once_while_every_layers_check_needs_it(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each index is checked against the layer sizes of the image manifest,
    which containerd fetched but does not pass on: the first check's GET
    answers only once every layer's index has been fetched, so every other
    check needs the sizes while it is under way, and waits for it."""
    image = _image(tmp_path)
    everyone = threading.Barrier(LAYERS, timeout=WAIT_S)
    image.before_fetch.append(lambda digest: everyone.wait())
    checking = threading.Event()
    # The other layers' checks start once their index is in; the first GET
    # is held until then (the bound only ends a wait for checks that never come).
    image.before_manifest.append(lambda: checking.wait(1.0))
    remote = _remote(tmp_path, node, image, monkeypatch)
    _count_decodes(monkeypatch, lambda count: count == LAYERS and checking.set())
    for i in range(LAYERS):
        remote.prepare(image.prepare(i))
    assert checking.is_set()
    assert image.manifests == 1


def test_a_corrupt_index_costs_its_own_layer_and_is_asked_for_again(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = 2
    image = _image(tmp_path, corrupt=bad)
    remote = _remote(tmp_path, node, image, monkeypatch)
    for i in range(bad):
        remote.prepare(image.prepare(i))
    with pytest.raises(NotLazy, match=f"the index of {image.layer_digests[bad]} is unusable") as refused:
        remote.prepare(image.prepare(bad))
    assert refused.value.reason is Reason.INDEX_REFUSED
    assert not remote.store.has(image.layer_digests[bad])
    # A failed lookahead is not kept: the layer's own Prepare asked again.
    assert image.fetches_of(bad) == 2
    # The layers above it are served from their lookahead as usual.
    for i in range(bad + 1, LAYERS):
        remote.prepare(image.prepare(i))
    assert [image.fetches_of(i) for i in range(LAYERS) if i != bad] == [1] * (LAYERS - 1)


def test_an_index_with_a_bad_entry_is_stored_for_the_layer_server_first_then_refused_and_removed(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer server is told of a layer's index once its header is
    checked, before the snapshotter makes its entries (the slow part); an
    entry that is then refused takes the layer to the normal path, and the
    stored copy is removed, so the next Prepare fetches the index again."""
    bad = 2
    image = _image(tmp_path, bad_entry=bad)
    remote = _remote(tmp_path, node, image, monkeypatch)
    told: list[str] = []
    monkeypatch.setattr(remote_mod.control, "open_ahead", lambda mount, name: told.append(name))
    for i in range(bad):
        remote.prepare(image.prepare(i))
    with pytest.raises(NotLazy, match="has data outside the layer") as refused:
        remote.prepare(image.prepare(bad))
    assert refused.value.reason is Reason.INDEX_REFUSED
    assert image.layer_digests[bad].removeprefix("sha256:") in told
    assert not remote.store.has(image.layer_digests[bad])
    fetches = image.fetches_of(bad)
    with pytest.raises(NotLazy, match="has data outside the layer"):
        remote.prepare(image.prepare(bad))
    assert image.fetches_of(bad) == fetches + 1
    for i in range(bad + 1, LAYERS):
        remote.prepare(image.prepare(i))


def test_a_lookahead_copy_pruned_before_its_prepare_is_fetched_again(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image(tmp_path)
    remote = _remote(tmp_path, node, image, monkeypatch)
    remote.prepare(image.prepare(0))
    for i in range(1, LAYERS):
        remote._stored(REF, image.manifest_digest, image.layer_digests[i], own=False).future.result(WAIT_S)
    # Cleanup ran between the lookahead and the Prepare (no snapshot used the layers yet).
    pruned = remote.store.prune({image.layer_digests[0]}, older_than_s=0)
    assert len(pruned) == LAYERS - 1
    served = remote.prepare(image.prepare(1))
    assert served.index.layer_digest == image.layer_digests[1]
    assert remote.store.has(image.layer_digests[1]) and image.fetches_of(1) == 2


def test_a_cleanup_during_a_pull_leaves_the_layers_it_has_on_their_way(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """containerd's Cleanup may come at any moment of a pull (its garbage
    collection runs on its own), before the layers above the one being
    prepared have a snapshot, and even with no grace for young copies: what
    the pull stored ahead, fetched or still on its way, stays, and so does a
    layer whose Prepare is done and its snapshot not recorded yet. Every
    Prepare serves a layer the store holds, fetched once."""
    image = _image(tmp_path)
    remote = _remote(tmp_path, node, image, monkeypatch)
    assert remote.gc_grace_s == 0
    held = image.blobs[LAYERS - 1].digest
    release = threading.Event()
    image.before_fetch.append(lambda digest: digest != held or release.wait(WAIT_S))
    recorded: list[Snapshot] = []
    for i in range(LAYERS):
        with remote.claim(image.layer_digests[i]):
            served = remote.prepare(image.prepare(i))
            if i == 0:
                wait_until(lambda: all(remote.store.has(d) for d in image.layer_digests[:-1]), WAIT_S, "the lookahead")
                # The top layer's index is still on its way.
                assert remote.prune(recorded) == []
                release.set()
            # Its snapshot is not recorded yet.
            assert remote.prune(recorded) == []
            assert remote.store.has(served.index.layer_digest)
        labels = {REMOTE: "true", LAYER_DIGEST: image.layer_digests[i]}
        recorded.append(Snapshot(key=f"remote/{i}", id=i, kind=Kind.COMMITTED, labels=labels))
    assert [image.fetches_of(i) for i in range(LAYERS)] == [1] * LAYERS
    # The image removed: its layers are garbage.
    assert sorted(remote.prune([])) == sorted(d.split(":")[1] for d in image.layer_digests)


def test_the_layer_server_is_asked_to_load_layers_bottom_up(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It loads one layer at a time and containerd prepares from the bottom
    up: a layer whose index came first must not hold up the layers below."""
    image = _image(tmp_path)
    remote = _remote(tmp_path, node, image, monkeypatch)
    bottom = image.blobs[0].digest

    def bottom_last(digest: str) -> None:
        # The bottom layer's index answers once every other one is stored.
        if digest == bottom:
            wait_until(lambda: all(remote.store.has(d) for d in image.layer_digests[1:]), WAIT_S, "the upper indexes")

    image.before_fetch.append(bottom_last)
    loaded: list[str] = []
    lock = threading.Lock()

    def lookup(mount: Path, name: str) -> bool:
        # Control names (an image announced) are no loads.
        with lock:
            if name not in loaded and not name.startswith("."):
                loaded.append(name)
        return True

    monkeypatch.setattr(remote_mod.control, "lookup", lookup)
    for i in range(LAYERS):
        remote.prepare(image.prepare(i))
    assert loaded == [digest.split(":")[1] for digest in image.layer_digests]


def test_a_prepare_asks_the_layer_server_again_only_if_its_preload_did_not_show_the_layer(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load the fetch asked for answers for the Prepare: each of its
    lookups is a round trip to a layer server busy loading the layers above.
    A layer the server refused at the preload is refused by its Prepare."""
    image = _image(tmp_path)
    remote = _remote(tmp_path, node, image, monkeypatch)
    refused = image.layer_digests[3].split(":")[1]
    looked: list[str] = []
    lock = threading.Lock()

    def lookup(mount: Path, name: str) -> bool:
        with lock:
            looked.append(name)
        if name == refused:
            raise OSError(errno.EIO, "refused")
        return True

    monkeypatch.setattr(remote_mod.control, "lookup", lookup)
    for i in range(LAYERS):
        if i == 3:
            with pytest.raises(NotLazy) as no:
                remote.prepare(image.prepare(i))
            assert no.value.reason is Reason.LAYER_REFUSED
        else:
            assert remote.prepare(image.prepare(i)).index.layer_digest == image.layer_digests[i]
    layers = [name for name in looked if not name.startswith(".")]
    assert sorted(layers) == sorted([d.split(":")[1] for d in image.layer_digests] + [refused])
    assert layers.count(refused) == 2


def test_a_fetch_that_failed_and_is_not_settled_yet_is_not_taken_by_its_own_prepare(tmp_path: Path) -> None:
    """A fetch is settled by a callback in its thread right after it ends;
    the layer's own Prepare may look in between, and must ask again, not
    take the failure for a fetch still on its way."""
    store = LayerStore(tmp_path / "layers")
    digest = "sha256:" + "ab" * 32
    running: Future[LayerIndex] = Future()
    failed: Future[LayerIndex] = Future()
    failed.set_exception(NotLazy(Reason.INDEX_REFUSED, "bad index"))
    on_its_way = remote_mod._IndexFetch(running, threading.Event(), threading.Event())
    ended = remote_mod._IndexFetch(failed, threading.Event(), threading.Event())
    assert on_its_way.reusable(0.0, store, digest, own=True)
    assert not ended.reusable(0.0, store, digest, own=True)
    assert ended.reusable(0.0, store, digest, own=False)
