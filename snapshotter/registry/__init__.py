"""The registry client every bootseer part shares: references, hosts.toml,
docker credentials, manifests, blobs, ranges and OCI referrers."""

from snapshotter.registry.client import RegistryClient, ResolvedImage, referrers_tag
from snapshotter.registry.errors import (
    DigestMismatch,
    NotFound,
    RegistryError,
    ServerError,
    Unauthorized,
    Unreachable,
)
from snapshotter.registry.media import Descriptor, Index, Manifest, Platform
from snapshotter.registry.reference import InvalidReference, Reference
from snapshotter.registry.reference import parse as parse_reference

__all__ = [
    "Descriptor",
    "DigestMismatch",
    "Index",
    "InvalidReference",
    "Manifest",
    "NotFound",
    "Platform",
    "Reference",
    "RegistryClient",
    "RegistryError",
    "ResolvedImage",
    "ServerError",
    "Unauthorized",
    "Unreachable",
    "parse_reference",
    "referrers_tag",
]
