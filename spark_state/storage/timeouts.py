"""``TimeoutStorage``: every call of a storage bounded in time, so no storage fault can hang a query.

``open_storage`` wraps every local and remote backend in one. A call runs in
a daemon thread of its own; when it does not return within ``timeout_seconds``
the caller gets ``StorageTimeoutError`` naming the operation and the path,
and the thread is left to finish (or hang) on its own, never joined.

What a timed-out call did is unknown, as the ``Storage`` contract allows for
any failed call: a ``create`` may still publish its blob later (complete,
never partial), a ``delete`` may still delete. The commit protocols are built
for that: a blob written late is an unreferenced attempt that the garbage
collector removes, and a commit record written late is found by the next
batch's exactly-once decision (``coordinator.plan_batch``).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from spark_state.errors import StorageTimeoutError
from spark_state.storage.base import ForwardingStorage, Storage

DEFAULT_TIMEOUT_SECONDS = 300.0
"""Longest a single storage call may take (a 64 MiB segment over a slow link included)."""

T = TypeVar("T")


class _Pool:
    """Daemon threads that run storage calls; a new one starts whenever none is idle (a stalled call keeps its own).

    Daemon threads never hold up the exit of the process, stalled or not.
    """

    MAX_THREADS = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._threads = 0
        self._pid = os.getpid()

    def submit(self, call: Callable, outcome: list, done: threading.Event) -> None:
        with self._lock:
            if self._pid != os.getpid():  # forked (a Python worker): the parent's threads are not here
                _Pool.__init__(self)
            if self._idle == 0 and self._threads < self.MAX_THREADS:
                self._threads += 1
                threading.Thread(target=self._work, name="storage-call", daemon=True).start()
            else:
                self._idle -= 1
        self._calls.put((call, outcome, done))

    def _work(self) -> None:
        while True:
            call, outcome, done = self._calls.get()
            try:
                outcome[0] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                outcome[1] = exc
            finally:
                done.set()
            with self._lock:
                self._idle += 1


_POOL = _Pool()


def unwrapped(storage):
    """The backend below any layers that only bound or fail calls (``transparent``: timeouts, injected faults)."""
    while getattr(type(storage), "transparent", False):
        storage = storage.inner
    return storage


class TimeoutStorage(ForwardingStorage):
    """Forwards to ``inner``; a call that takes longer than ``timeout_seconds`` raises ``StorageTimeoutError``."""

    transparent = True

    def __init__(self, inner: Storage, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS):
        super().__init__(inner)
        if not timeout_seconds > 0:
            raise ValueError(f"a storage timeout must be > 0 seconds, got {timeout_seconds!r}")
        self.timeout_seconds = float(timeout_seconds)

    def __repr__(self) -> str:
        return f"TimeoutStorage({self.inner!r}, {self.timeout_seconds})"

    def __eq__(self, other: object) -> bool:
        """Equal to another view of the same storage: the bound is not part of what it stores."""
        return unwrapped(other) == unwrapped(self)

    def __hash__(self) -> int:
        return hash(unwrapped(self))

    def __getattr__(self, name: str):
        """The backend's own attributes (``root``, ``url``, ...)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _bounded(self, op: str, path: str, call: Callable[[], T]) -> T:
        call_done = threading.Event()
        outcome: list = [None, None]
        _POOL.submit(call, outcome, call_done)
        if not call_done.wait(self.timeout_seconds):
            raise StorageTimeoutError(
                f"{op} of {path!r} in {self.uri} did not finish within {self.timeout_seconds:g} s; the storage "
                "is unreachable or stalled. Whether it took effect is unknown; the query can be restarted once "
                "the storage answers again"
            )
        if outcome[1] is not None:
            raise outcome[1]
        return outcome[0]

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        self._bounded("create", path, lambda: self.inner.create(path, data, overwrite=overwrite))

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._bounded("read", path, lambda: self.inner.read(path, offset, length))

    def size(self, path: str) -> int:
        return self._bounded("size", path, lambda: self.inner.size(path))

    def exists(self, path: str) -> bool:
        return self._bounded("exists", path, lambda: self.inner.exists(path))

    def list(self, path: str = "") -> list[str]:
        return self._bounded("list", path, lambda: self.inner.list(path))

    def delete(self, path: str) -> None:
        self._bounded("delete", path, lambda: self.inner.delete(path))
