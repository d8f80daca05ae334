"""The `[trust]` section of the config file (what it means: trust.py).
Apart from trust.py so that reading the config imports no cryptography:
`bootseer pull` starts cold on every node, and only the daemons verify."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrustConfig:
    # Public keys (Ed25519, PEM files, as `bootseer trust keygen` writes them)
    # whose signatures on layer indexes this node accepts.
    keys: list[str] = field(default_factory=list)
    # Serve a layer lazily only from an index one of `keys` signed; off, any
    # index attached to the image is believed.
    require_signature: bool = True
    # The private key `bootseer index` signs the indexes it pushes with; empty: unsigned.
    signing_key: str = ""
