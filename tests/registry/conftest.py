"""Fixtures for the registry client tests: an image in the shared registry,
a fault proxy in front of it, and a second docker-registry that wants a
login (htpasswd), with a docker config.json holding the credentials."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.harness import faultproxy
from tests.harness.oci import Dir, File, ImageBuilder, Layer, PushedImage, busybox_layer
from tests.harness.registry import Registry


def sample_layers() -> list[Layer]:
    big = random.Random(3).randbytes(1 << 20)  # 1 MiB that does not compress
    return [
        busybox_layer(),
        [Dir("/data"), File("/data/big.bin", big), File("/data/small.txt", b"hello\n")],
    ]


@pytest.fixture(scope="session")
def pushed(images: ImageBuilder) -> PushedImage:
    """A two-layer image in the shared registry."""
    return images.push("regtest/sample", sample_layers())


@pytest.fixture
def proxy(registry: Registry) -> Iterator[faultproxy.FaultProxy]:
    with faultproxy.running(registry.port) as p:
        yield p
