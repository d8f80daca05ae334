"""OCI and Docker media types, descriptors, manifests and image indexes.

Pure: parsing and platform matching only, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import platform as host_platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"

IMAGE_MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEXES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
# What a resolve accepts, best first; schema 1 is refused with a clear error.
MANIFEST_ACCEPT = (OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST)

DIGEST_ALGORITHMS = {"sha256": 64, "sha512": 128}


class InvalidManifest(ValueError):
    """A manifest or index that cannot be understood."""


def digest_of(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def check_digest(digest: str) -> str:
    """`digest` if well formed ("sha256:<64 hex>"); ValueError otherwise."""
    algorithm, _, hex_part = digest.partition(":")
    length = DIGEST_ALGORITHMS.get(algorithm)
    if length is None or len(hex_part) != length or not _is_lower_hex(hex_part):
        raise ValueError(f"not a valid digest: {digest!r} (want sha256:<64 lowercase hex>)")
    return digest


def _is_lower_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    @classmethod
    def parse(cls, text: str) -> Platform:
        """ "linux/amd64", "linux/arm64/v8"; ValueError on anything else."""
        parts = text.strip().split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"not a platform: {text!r} (want OS/ARCH[/VARIANT], e.g. linux/amd64)")
        return cls(*parts).normalized()

    @classmethod
    def host(cls) -> Platform:
        machine = host_platform.machine().lower()
        arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)
        return cls("linux", arch).normalized()

    def normalized(self) -> Platform:
        # containerd treats arm64 without a variant as arm64/v8.
        if self.architecture == "arm64" and self.variant in ("", "8"):
            return Platform(self.os, "arm64", "v8")
        return self

    def matches(self, other: Platform) -> bool:
        a, b = self.normalized(), other.normalized()
        if (a.os, a.architecture) != (b.os, b.architecture):
            return False
        return not a.variant or not b.variant or a.variant == b.variant

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    artifact_type: str = ""
    platform: Platform | None = None
    urls: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Any) -> Descriptor:
        if not isinstance(obj, dict):
            raise InvalidManifest(f"a descriptor must be an object, got {obj!r}")
        try:
            media_type, digest, size = obj["mediaType"], obj["digest"], obj["size"]
        except KeyError as exc:
            raise InvalidManifest(f"descriptor lacks {exc.args[0]!r}: {obj!r}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidManifest(f"descriptor size must be a non-negative integer: {obj!r}")
        try:
            check_digest(digest)
        except ValueError as exc:
            raise InvalidManifest(str(exc)) from None
        plat = obj.get("platform")
        return cls(
            media_type=str(media_type),
            digest=digest,
            size=size,
            annotations=dict(obj.get("annotations") or {}),
            artifact_type=str(obj.get("artifactType") or ""),
            platform=(
                Platform(
                    str(plat.get("os", "")),
                    str(plat.get("architecture", "")),
                    str(plat.get("variant", "")),
                )
                if isinstance(plat, dict)
                else None
            ),
            urls=tuple(obj.get("urls") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            out["artifactType"] = self.artifact_type
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.urls:
            out["urls"] = list(self.urls)
        if self.platform is not None:
            plat = {"architecture": self.platform.architecture, "os": self.platform.os}
            if self.platform.variant:
                plat["variant"] = self.platform.variant
            out["platform"] = plat
        return out


@dataclass(frozen=True)
class Manifest:
    """An image (or artifact) manifest: config plus layers, maybe a subject."""

    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]
    subject: Descriptor | None = None
    artifact_type: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Index:
    """An OCI image index or Docker manifest list."""

    media_type: str
    manifests: tuple[Descriptor, ...]
    annotations: Mapping[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": self.media_type,
            "manifests": [d.to_json() for d in self.manifests],
        }
        if self.annotations:
            obj["annotations"] = dict(self.annotations)
        return json.dumps(obj, separators=(",", ":")).encode()


def _load(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidManifest("a manifest must be a JSON object")
    return obj


def detect_media_type(data: bytes, header_media_type: str = "") -> str:
    """The media type of a manifest: the document's own field, else the
    Content-Type the registry sent, else guessed from its shape."""
    obj = _load(data)
    declared = obj.get("mediaType")
    if isinstance(declared, str) and declared:
        return declared
    header = header_media_type.split(";", maxsplit=1)[0].strip()
    if header and header not in ("application/json", "text/plain", "application/octet-stream"):
        return header
    if obj.get("schemaVersion") == 1:
        return DOCKER_SCHEMA1
    return OCI_INDEX if "manifests" in obj else OCI_MANIFEST


def parse(data: bytes, media_type: str) -> Manifest | Index:
    """Parse a manifest or an index of `media_type`."""
    obj = _load(data)
    if media_type in (DOCKER_SCHEMA1, DOCKER_SCHEMA1_SIGNED) or obj.get("schemaVersion") == 1:
        raise InvalidManifest("Docker schema 1 manifests are not supported; re-push the image with a current client")
    if media_type in INDEXES:
        manifests = obj.get("manifests")
        if not isinstance(manifests, list):
            raise InvalidManifest("an image index needs a 'manifests' list")
        return Index(
            media_type=media_type,
            manifests=tuple(Descriptor.from_json(m) for m in manifests),
            annotations=dict(obj.get("annotations") or {}),
        )
    if "config" not in obj:
        raise InvalidManifest(f"a manifest of type {media_type} needs a 'config' descriptor")
    layers = obj.get("layers") or []
    if not isinstance(layers, list):
        raise InvalidManifest("'layers' must be a list")
    subject = obj.get("subject")
    return Manifest(
        media_type=media_type,
        config=Descriptor.from_json(obj["config"]),
        layers=tuple(Descriptor.from_json(layer) for layer in layers),
        subject=Descriptor.from_json(subject) if subject is not None else None,
        artifact_type=str(obj.get("artifactType") or ""),
        annotations=dict(obj.get("annotations") or {}),
    )


def artifact_type_of(manifest: Manifest) -> str:
    """The artifact type a referrers listing shows: the manifest's own
    `artifactType`, else its config's media type (OCI distribution spec)."""
    return manifest.artifact_type or manifest.config.media_type


def select_platform(index: Index, wanted: Platform) -> Descriptor:
    """The first image manifest of `index` that runs on `wanted`.

    Entries without a platform are skipped (attestations, artifacts); so are
    nested indexes, which no mainstream registry serves for images.
    """
    for desc in index.manifests:
        if desc.media_type not in IMAGE_MANIFESTS or desc.platform is None:
            continue
        if desc.platform.matches(wanted):
            return desc
    available = ", ".join(str(d.platform) for d in index.manifests if d.platform) or "none"
    raise LookupError(f"no manifest for platform {wanted} (available: {available})")
