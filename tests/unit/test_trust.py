"""Signed layer indexes: what a signature covers, which index the Prepare
path takes, when a stored copy may be used again, what `bootseer index`
signs and rebuilds, and the `[trust]` section and `bootseer trust keygen`."""

from __future__ import annotations

import io
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import structlog

from bootseer import cli
from bootseer.config import ConfigError
from bootseer.config import parse as parse_config
from snapshotter.fs.layers import LayerStore, layer_name
from snapshotter.indexer import index_image
from snapshotter.layer.artifact import index_blobs
from snapshotter.layer.index import FORMAT_VERSION, LAYER_ANNOTATION, MEDIA_TYPE, VERSION_ANNOTATION, LayerIndex
from snapshotter.layer.signature import (
    SIGNATURE_ANNOTATION,
    SIGNER_ANNOTATION,
    Signature,
    Verifier,
    generate,
    load_private_key,
    load_public_key,
    sign,
)
from snapshotter.registry import artifact as registry_artifact
from snapshotter.registry import media
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor, Manifest
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.remote import NotLazy, Reason, RemoteLayers
from snapshotter.trust import IndexTrust, TrustError
from snapshotter.trust_settings import TrustConfig
from tests.harness.trust import index_trust, signed, signing_keys
from tests.unit.test_index_validation import PARITY_GZIP, FakeRegistry, digest_of, index_of, layer, member

LAYER = "sha256:" + "5" * 64
INDEX = "sha256:" + "6" * 64
REF = parse_reference("registry.example/team/app:v1")


def test_a_signature_covers_the_layer_and_the_index_blob() -> None:
    pair = generate()
    key = load_private_key(pair.private_pem, "k")
    verifier = Verifier([load_public_key(pair.public_pem, "k")])
    signature = sign(key, LAYER, INDEX)
    assert signature.signer == pair.key_id and verifier.key_ids == [pair.key_id]
    assert verifier.verify(signature, LAYER, INDEX)
    assert not verifier.verify(signature, "sha256:" + "7" * 64, INDEX)  # relabelled for another layer
    assert not verifier.verify(signature, LAYER, "sha256:" + "7" * 64)  # another index blob
    assert not verifier.verify(None, LAYER, INDEX)
    stranger = sign(load_private_key(generate().private_pem, "s"), LAYER, INDEX)
    assert not verifier.verify(stranger, LAYER, INDEX)
    # A stranger's signature under the trusted key's name.
    assert not verifier.verify(Signature(pair.key_id, stranger.value), LAYER, INDEX)
    assert Signature.from_annotations(signature.annotations()) == signature


@pytest.mark.parametrize(
    "annotations",
    [
        {},
        {SIGNER_ANNOTATION: "sha256:x"},
        {SIGNER_ANNOTATION: "sha256:x", SIGNATURE_ANNOTATION: "not base64!"},
        {SIGNER_ANNOTATION: "sha256:x", SIGNATURE_ANNOTATION: "AAAA"},  # 3 bytes, not 64
        {SIGNER_ANNOTATION: "", SIGNATURE_ANNOTATION: "A" * 88},
    ],
)
def test_a_missing_or_malformed_signature_is_no_signature(annotations: dict[str, str]) -> None:
    assert Signature.from_annotations(annotations) is None


def test_key_files_that_are_not_ed25519_pem_are_refused_with_their_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pub"
    with pytest.raises(TrustError, match=f"cannot read \\[trust\\] key {missing}"):
        IndexTrust.from_config(TrustConfig(keys=[str(missing)]))
    garbage = tmp_path / "garbage.pub"
    garbage.write_text("not a key\n")
    with pytest.raises(TrustError, match=f"{garbage}: not a PEM public key"):
        IndexTrust.from_config(TrustConfig(keys=[str(garbage)]))
    private = tmp_path / "private.key"
    private.write_bytes(generate().private_pem)
    # The private key where the public one belongs.
    with pytest.raises(TrustError, match="not a PEM public key"):
        IndexTrust.from_config(TrustConfig(keys=[str(private)]))


def test_the_trust_section_takes_a_list_of_key_paths() -> None:
    config = parse_config('[trust]\nkeys = ["/etc/bootseer/a.pub", "/etc/bootseer/b.pub"]\n')
    assert config.trust.keys == ["/etc/bootseer/a.pub", "/etc/bootseer/b.pub"] and config.trust.require_signature
    for bad in ['keys = "/etc/bootseer/a.pub"', "keys = [1]", 'keys = [""]']:
        with pytest.raises(ConfigError, match=r"trust\.keys must be a list of non-empty strings"):
            parse_config(f"[trust]\n{bad}\n")


def _blob(layer_digest: str, digest: str) -> Descriptor:
    return Descriptor(MEDIA_TYPE, digest, 10, annotations={LAYER_ANNOTATION: layer_digest})


def _artifact(*blobs: Descriptor) -> Manifest:
    return Manifest(media.OCI_MANIFEST, Descriptor(media.OCI_CONFIG, digest_of(b"{}"), 2), blobs)


def test_a_newer_unsigned_artifact_cannot_hide_a_signed_index() -> None:
    trust = index_trust()
    genuine = signed(_blob(LAYER, INDEX))
    forged = _blob(LAYER, "sha256:" + "f" * 64)
    copied = Descriptor(MEDIA_TYPE, forged.digest, 10, annotations=genuine.annotations)
    artifacts = [_artifact(genuine), _artifact(forged), _artifact(copied)]
    assert index_blobs(artifacts)[LAYER] == copied
    assert index_blobs(artifacts, trust.accepts_blob)[LAYER] == genuine
    assert "carries no signature" in trust.refusal(forged)
    assert "does not verify" in trust.refusal(copied)
    # Off, any index is believed, the newest first.
    believing = IndexTrust(Verifier([]), required=False)
    assert index_blobs(artifacts, believing.accepts_blob)[LAYER] == copied


class _Registry:
    """The registry calls the Prepare path makes, over one image in memory."""

    def __init__(self, index: LayerIndex, layer_size: int) -> None:
        self.blobs: dict[str, bytes] = {}
        self.image = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": media.OCI_MANIFEST,
                "config": {"mediaType": media.OCI_CONFIG, "digest": digest_of(b"{}"), "size": 2},
                "layers": [{"mediaType": media.OCI_LAYER_GZIP, "digest": index.layer_digest, "size": layer_size}],
            }
        ).encode()
        self.fetched: list[str] = []

    def add(self, encoded: bytes) -> str:
        self.blobs[digest_of(encoded)] = encoded
        return digest_of(encoded)

    def fetch_blob(self, ref: Reference, digest: str, dest: io.BytesIO) -> None:
        self.fetched.append(digest)
        dest.write(self.blobs[digest])

    def fetch_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
        return self.image, media.OCI_MANIFEST, digest_of(self.image)


def _remote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blobs: list[Descriptor], registry: _Registry, trust: IndexTrust
) -> RemoteLayers:
    monkeypatch.setattr(registry_artifact, "referrers", lambda *_: [_artifact(*blobs)])
    return RemoteLayers(
        LayerStore(tmp_path / "layers"), tmp_path / "m", lambda: cast(RegistryClient, registry), 0, trust
    )


def _index(tmp_path: Path) -> tuple[LayerIndex, bytes]:
    index = index_of(PARITY_GZIP, tmp_path)
    return index, index.encode()


def test_the_prepare_path_refuses_an_index_no_trusted_key_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, encoded = _index(tmp_path)
    registry = _Registry(index, len(PARITY_GZIP))
    blob = _blob(index.layer_digest, registry.add(encoded))
    stranger = load_private_key(generate().private_pem, "stranger")
    for offered in (
        blob,
        Descriptor(
            MEDIA_TYPE,
            blob.digest,
            10,
            annotations={**blob.annotations, **sign(stranger, index.layer_digest, blob.digest).annotations()},
        ),
    ):
        remote = _remote(tmp_path, monkeypatch, [offered], registry, index_trust())
        with pytest.raises(NotLazy) as refused:
            remote._store_index(REF, digest_of(registry.image), index.layer_digest)
        assert refused.value.reason is Reason.INDEX_UNTRUSTED
        assert not remote.store.has(index.layer_digest)
    # Nothing was fetched for an index that is not trusted.
    assert registry.fetched == []


def test_a_signed_index_is_stored_with_its_signature_and_used_again_without_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, encoded = _index(tmp_path)
    registry = _Registry(index, len(PARITY_GZIP))
    blob = signed(_blob(index.layer_digest, registry.add(encoded)))
    remote = _remote(tmp_path, monkeypatch, [blob], registry, index_trust())
    remote._store_index(REF, digest_of(registry.image), index.layer_digest)
    name = layer_name(index.layer_digest)
    _, source = remote.store.load(name)
    assert source.signature == Signature.from_annotations(blob.annotations)
    assert source.signature is not None and source.signature.signer == signing_keys().key_id
    # A second Prepare of the stored layer asks the registry for nothing.
    registry.fetched.clear()
    monkeypatch.setattr(registry_artifact, "referrers", lambda *_: pytest.fail("asked the registry"))
    assert remote._store_index(REF, digest_of(registry.image), index.layer_digest).diff_id == index.diff_id
    assert registry.fetched == []


def _store_unsigned(tmp_path: Path, index: LayerIndex, encoded: bytes) -> LayerStore:
    """A copy stored by an older bootseer, or from an index trusted then."""
    from snapshotter.fs.layers import LayerSource

    store = LayerStore(tmp_path / "layers")
    store.add(index.header, LayerSource(ref="registry.example/team/app", digest=index.layer_digest), encoded)
    return store


def test_a_stored_copy_nobody_trusted_signed_is_used_only_if_it_is_the_signed_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, encoded = _index(tmp_path)
    _store_unsigned(tmp_path, index, encoded)
    registry = _Registry(index, len(PARITY_GZIP))
    same = signed(_blob(index.layer_digest, registry.add(encoded)))
    remote = _remote(tmp_path, monkeypatch, [same], registry, index_trust())
    assert remote._store_index(REF, digest_of(registry.image), index.layer_digest).diff_id == index.diff_id


def test_a_stored_copy_unlike_the_signed_index_leaves_the_layer_to_the_normal_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, encoded = _index(tmp_path)
    # What a forger got stored while the node believed any index: a setuid bit.
    forged = LayerIndex.decode(encoded)
    forged.entries[-1].mode |= 0o4000
    _store_unsigned(tmp_path, forged, forged.encode())
    registry = _Registry(index, len(PARITY_GZIP))
    genuine = signed(_blob(index.layer_digest, registry.add(encoded)))
    remote = _remote(tmp_path, monkeypatch, [genuine], registry, index_trust())
    with pytest.raises(NotLazy, match="holds another copy of the index") as refused:
        remote._store_index(REF, digest_of(registry.image), index.layer_digest)
    assert refused.value.reason is Reason.INDEX_REFUSED
    # The stored copy stays for the containers that use it, until pruned.
    assert remote.store.load(layer_name(index.layer_digest))[0].entries[-1].mode & 0o4000


def test_bootseer_index_signs_what_it_builds_and_rebuilds_what_it_did_not_sign(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old, current = layer([member("old", data=b"1")]), layer([member("new", data=b"2")])
    registry = FakeRegistry([(media.OCI_LAYER_GZIP, old), (media.OCI_LAYER_GZIP, current)])
    plain = {VERSION_ANNOTATION: str(FORMAT_VERSION)}
    existing = (
        # Current format, but unsigned: built again and signed.
        Descriptor(MEDIA_TYPE, "sha256:" + "e" * 64, 10, annotations={LAYER_ANNOTATION: digest_of(old), **plain}),
        # Signed by this run's key: kept.
        signed(
            Descriptor(
                MEDIA_TYPE, "sha256:" + "f" * 64, 10, annotations={LAYER_ANNOTATION: digest_of(current), **plain}
            )
        ),
    )
    monkeypatch.setattr(registry_artifact, "referrers", lambda *_: [_artifact(*existing)])
    key = load_private_key(signing_keys().private.read_bytes(), "test key")
    report = index_image(cast(RegistryClient, registry), REF, show_progress=False, signing_key=key)
    assert report.signer == signing_keys().key_id
    assert report.indexed == [digest_of(old)] and report.reused == [digest_of(current)]
    rebuilt, kept = registry.artifacts[-1].layers
    assert kept == existing[1]
    assert index_trust().accepts_blob(digest_of(old), rebuilt)
    # Without a key the unsigned one stands, and nothing new is pushed.
    before = len(registry.artifacts)
    report = index_image(cast(RegistryClient, registry), REF, show_progress=False)
    assert report.indexed == [] and report.signer == "" and len(registry.artifacts) == before


def test_keygen_writes_a_private_key_only_root_reads_and_never_replaces_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "keys"
    assert cli.main(["trust", "keygen", str(directory)]) == 0
    out = capsys.readouterr().out
    private, public = directory / "index-signing.key", directory / "index-signing.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    key_id = IndexTrust.from_config(TrustConfig(keys=[str(public)])).verifier.key_ids[0]
    assert f"key {key_id}" in out
    assert sign(load_private_key(private.read_bytes(), "k"), LAYER, INDEX).signer == key_id
    before = private.read_bytes()
    assert cli.main(["trust", "keygen", str(directory)]) == 1
    assert "refusing to replace a key" in capsys.readouterr().err and private.read_bytes() == before


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """The command configures structlog to print to the stderr it sees,
    here capsys's, which closes after the test: later tests' loggers get
    the unconfigured defaults back."""
    yield
    structlog.reset_defaults()


@pytest.mark.usefixtures("cli_logging")
def test_bootseer_index_refuses_a_signing_key_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    public = tmp_path / "key.pub"
    public.write_bytes(generate().public_pem)
    assert cli.main(["index", "--signing-key", str(public), "registry.example/team/app:v1"]) == 2
    assert f"[trust] signing_key: {public}: not an unencrypted PEM private key" in capsys.readouterr().err
