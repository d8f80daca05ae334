"""Which layer indexes a node serves from, and the key `bootseer index`
signs with, as the `[trust]` section (trust_settings.py) says
(docs/layer-index.md, Signatures).

A layer is served lazily only from an index a trusted key signed, unless
`require_signature` is turned off: then any index attached to the image is
believed, which is only safe where nobody who can push to the repository is
a stranger.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from snapshotter.layer.signature import KeyFormatError, Signature, Verifier, load_private_key, load_public_key
from snapshotter.registry.media import Descriptor
from snapshotter.trust_settings import TrustConfig


class TrustError(Exception):
    """A key file that cannot be read or is not an Ed25519 key."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TrustError(f"cannot read {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class IndexTrust:
    """What a node believes of the indexes it finds."""

    verifier: Verifier
    required: bool

    @classmethod
    def from_config(cls, config: TrustConfig) -> IndexTrust:
        keys = []
        for name in config.keys:
            path = Path(name)
            try:
                keys.append(load_public_key(_read(path, "[trust] key"), str(path)))
            except KeyFormatError as exc:
                raise TrustError(f"[trust] keys: {exc}") from None
        return cls(verifier=Verifier(keys), required=config.require_signature)

    def accepts(self, layer_digest: str, index_digest: str, signature: Signature | None) -> bool:
        """Whether the node may serve `layer_digest` from this index."""
        return not self.required or self.verifier.verify(signature, layer_digest, index_digest)

    def accepts_blob(self, layer_digest: str, blob: Descriptor) -> bool:
        return self.accepts(layer_digest, blob.digest, Signature.from_annotations(blob.annotations))

    def refusal(self, blob: Descriptor) -> str:
        """Why accepts_blob said no, for the log."""
        signature = Signature.from_annotations(blob.annotations)
        if signature is None:
            said = f"index {blob.digest} carries no signature"
        elif signature.signer not in self.verifier.key_ids:
            said = f"index {blob.digest} is signed by {signature.signer}, which is not in [trust] keys"
        else:
            said = f"the signature on index {blob.digest} does not verify"
        if not self.verifier.key_ids:
            return f"{said}, and [trust] keys is empty: this node serves no index lazily (docs/layer-index.md)"
        return f"{said}; re-run `bootseer index` with a [trust] signing_key this node trusts"


def signing_key(config: TrustConfig) -> Ed25519PrivateKey | None:
    if not config.signing_key:
        return None
    path = Path(config.signing_key)
    try:
        return load_private_key(_read(path, "[trust] signing_key"), str(path))
    except KeyFormatError as exc:
        raise TrustError(f"[trust] signing_key: {exc}") from None
