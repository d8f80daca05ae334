"""The lazy-pulling node the tests in this directory share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.registry import Registry


@pytest.fixture(scope="module")
def lazy_node(registry: Registry) -> Iterator[LazyNode]:
    node = start_lazy_node(registry.host)
    try:
        yield node
    finally:
        stop_lazy_node(node)
