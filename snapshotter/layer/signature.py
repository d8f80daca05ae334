"""Signatures on layer indexes: who vouches that an index describes its layer.

An index travels beside the image, not inside it: anyone who can push to the
repository can attach one, and nothing in the image's digest covers it. Its
table of contents, offsets, checkpoint windows and diff_id could only be
checked against the layer by reading the whole layer (the tar stream is
sequential, and deflate output depends on the window before it), which gives
up lazy pulling. So the node trusts an index only if a key it trusts signed
it: the signer (`bootseer index` in CI, or the image's publisher) read the
whole layer to build it.

The signature is Ed25519 over PAYLOAD_PREFIX + layer digest + index blob
digest, carried in two annotations on the index blob's descriptor in the
artifact (docs/layer-index.md, Signatures). The index blob names the layer
and its diff_id itself, so its digest covers everything the node serves.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_ANNOTATION = "dev.bootseer.layer-index.signature"
SIGNER_ANNOTATION = "dev.bootseer.layer-index.signer"
PAYLOAD_PREFIX = b"bootseer layer index signature v1\n"
_SIGNATURE_BYTES = 64


class KeyFormatError(ValueError):
    """A key file that is not an Ed25519 key in PEM."""


def payload(layer_digest: str, index_digest: str) -> bytes:
    """What a signature covers: the layer and the index blob, by digest."""
    return PAYLOAD_PREFIX + f"{layer_digest}\n{index_digest}\n".encode()


def key_id(public: Ed25519PublicKey) -> str:
    """The name a signature gives its key: the digest of the raw public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class Signature:
    signer: str  # key_id of the key that made it
    value: bytes

    @property
    def encoded(self) -> str:
        return base64.b64encode(self.value).decode()

    def annotations(self) -> dict[str, str]:
        return {SIGNER_ANNOTATION: self.signer, SIGNATURE_ANNOTATION: self.encoded}

    @classmethod
    def parse(cls, signer: str, encoded: str) -> Signature | None:
        """None for no signature, or a malformed one (which verifies as nothing either)."""
        if not signer or not encoded:
            return None
        try:
            value = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            return None
        if len(value) != _SIGNATURE_BYTES:
            return None
        return cls(signer=signer, value=value)

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> Signature | None:
        """The signature an index blob's annotations carry."""
        return cls.parse(annotations.get(SIGNER_ANNOTATION, ""), annotations.get(SIGNATURE_ANNOTATION, ""))


def sign(key: Ed25519PrivateKey, layer_digest: str, index_digest: str) -> Signature:
    return Signature(signer=key_id(key.public_key()), value=key.sign(payload(layer_digest, index_digest)))


class Verifier:
    """The public keys a node trusts, by key_id."""

    def __init__(self, keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys = {key_id(k): k for k in keys}

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, signature: Signature | None, layer_digest: str, index_digest: str) -> bool:
        """Whether a trusted key made this signature over this layer and index."""
        if signature is None:
            return False
        key = self._keys.get(signature.signer)
        if key is None:
            return False
        try:
            key.verify(signature.value, payload(layer_digest, index_digest))
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class KeyPair:
    private_pem: bytes
    public_pem: bytes
    key_id: str


def generate() -> KeyPair:
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return KeyPair(private_pem=private, public_pem=public, key_id=key_id(key.public_key()))


def load_public_key(data: bytes, source: str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyFormatError(f"{source}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFormatError(f"{source}: not an Ed25519 key (a {type(key).__name__})")
    return key


def load_private_key(data: bytes, source: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFormatError(f"{source}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFormatError(f"{source}: not an Ed25519 key (a {type(key).__name__})")
    return key
