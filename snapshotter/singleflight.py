"""Calls for the same key made while one is under way wait for it and share
its answer or its error, as Go's singleflight: the Prepares of one pull
start together, and each would otherwise ask the registry the same thing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class SingleFlight(Generic[_K, _V]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[_K, Future[_V]] = {}

    def do(self, key: _K, fn: Callable[[], _V]) -> _V:
        """fn(), or the answer of the call for `key` under way. Only calls
        overlapping share: the next one after it ends calls fn again, so an
        answer to keep is kept, and looked for, by fn."""
        with self._lock:
            call = self._calls.get(key)
            mine = call is None
            if call is None:
                call = self._calls[key] = Future()
        if not mine:
            return call.result()
        try:
            value = fn()
        except BaseException as exc:
            call.set_exception(exc)
            raise
        else:
            call.set_result(value)
            return value
        finally:
            with self._lock:
                del self._calls[key]
