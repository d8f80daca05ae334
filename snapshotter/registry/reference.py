"""Image references ("ubuntu", "127.0.0.1:5000/demo/train:v1",
"docker.io/library/ubuntu@sha256:...") parsed and normalised as docker and
containerd do. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from snapshotter.registry.media import check_digest

DOCKER_HUB = "docker.io"
# Where docker.io's API actually lives.
DOCKER_HUB_API = "registry-1.docker.io"
DEFAULT_TAG = "latest"

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DOMAIN = re.compile(r"(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?")


class InvalidReference(ValueError):
    """An image reference that cannot be parsed."""


@dataclass(frozen=True)
class Reference:
    domain: str  # "docker.io", "127.0.0.1:5000"
    repository: str  # "library/ubuntu", "demo/train"
    tag: str = ""
    digest: str = ""

    @property
    def name(self) -> str:
        """domain/repository, what content source labels and errors show."""
        return f"{self.domain}/{self.repository}"

    @property
    def object(self) -> str:
        """What goes after /manifests/: the digest if pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_digest(self, digest: str) -> Reference:
        return replace(self, digest=check_digest(digest))

    def with_tag(self, tag: str) -> Reference:
        return replace(self, tag=tag, digest="")

    def __str__(self) -> str:
        text = self.name
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse(text: str) -> Reference:
    """Parse and normalise: no domain means docker.io, a one-component docker.io
    name gets "library/", no tag and no digest means ":latest"."""
    original = text
    text = text.strip()
    if not text:
        raise InvalidReference("empty image reference")
    digest = ""
    if "@" in text:
        text, digest = text.rsplit("@", 1)
        try:
            check_digest(digest)
        except ValueError as exc:
            raise InvalidReference(f"{original!r}: {exc}") from None
    tag = ""
    last_slash = text.rfind("/")
    colon = text.rfind(":")
    if colon > last_slash:
        text, tag = text[:colon], text[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise InvalidReference(f"{original!r}: invalid tag {tag!r}")
    domain, _, path = text.partition("/")
    # The first component is a domain only if it looks like one; docker's rule.
    if not path or not ("." in domain or ":" in domain or domain == "localhost" or domain.startswith("[")):
        domain, path = DOCKER_HUB, text
    elif domain in ("index.docker.io", "registry-1.docker.io"):
        domain = DOCKER_HUB
    if not _DOMAIN.fullmatch(domain):
        raise InvalidReference(f"{original!r}: invalid registry host {domain!r}")
    if domain == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    for component in path.split("/"):
        if not _COMPONENT.fullmatch(component):
            raise InvalidReference(
                f"{original!r}: invalid repository path component {component!r} "
                "(lowercase letters, digits and . _ - separators only)"
            )
    if not tag and not digest:
        tag = DEFAULT_TAG
    return Reference(domain=domain, repository=path, tag=tag, digest=digest)
