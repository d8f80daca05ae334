"""The index-signing key pair of a test run: one for every node and indexer
the run starts, as one CI key would sign for a whole cluster."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from snapshotter.layer.index import LAYER_ANNOTATION
from snapshotter.layer.signature import generate, load_private_key, sign
from snapshotter.registry.media import Descriptor
from snapshotter.trust import IndexTrust
from snapshotter.trust_settings import TrustConfig


@dataclass(frozen=True)
class SigningKeys:
    private: Path
    public: Path
    key_id: str

    def toml(self) -> str:
        """The `[trust]` section that trusts this key and signs with it."""
        return f'[trust]\nkeys = ["{self.public}"]\nsigning_key = "{self.private}"\n'


@functools.cache
def signing_keys() -> SigningKeys:
    directory = Path(tempfile.mkdtemp(prefix="bs-trust-", dir="/tmp"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    pair = generate()
    private, public = directory / "index-signing.key", directory / "index-signing.pub"
    private.write_bytes(pair.private_pem)
    private.chmod(0o600)
    public.write_bytes(pair.public_pem)
    return SigningKeys(private=private, public=public, key_id=pair.key_id)


def index_trust() -> IndexTrust:
    """What a node configured with signing_keys() believes."""
    keys = signing_keys()
    return IndexTrust.from_config(TrustConfig(keys=[str(keys.public)]))


def signed(blob: Descriptor) -> Descriptor:
    """An index blob's descriptor with the run key's signature added."""
    key = load_private_key(signing_keys().private.read_bytes(), "test key")
    signature = sign(key, blob.annotations[LAYER_ANNOTATION], blob.digest)
    return dataclasses.replace(blob, annotations={**blob.annotations, **signature.annotations()})
