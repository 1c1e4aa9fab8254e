"""Storage backends and ``open_storage``, which maps a URI to one.

Supported URIs (every backend's ``uri`` attribute is one of them, and
``open_storage(storage.uri)`` gives back an equal storage):

- a plain path (``/data/state``, ``state``) or ``file:///abs/path``:
  ``LocalStorage``. A relative path is made absolute against the current
  directory of the process that opens it; Spark executors run in other
  directories, so pass absolute paths to Spark.
- ``memory://NAME``: the process-wide ``MemoryStorage`` called NAME (same
  NAME, same object). Only for tests: Spark's Python workers are separate
  processes.
- ``webhdfs://HOST:PORT/path`` or ``hdfs://HOST:PORT/path``, optionally with
  ``?user=NAME``: ``WebHdfsStorage`` against ``http://HOST:PORT`` with root
  ``/path``. The port is the NameNode's *HTTP* (WebHDFS) port in both forms,
  never the RPC port that ``hdfs://`` URIs usually carry in Hadoop configs.
- ``s3://BUCKET[/PREFIX][?endpoint=...&region=...&path_style=...&profile=...&retry_seconds=...]``
  (``s3a://`` is the same): ``S3Storage`` through boto3; see ``s3_location`` for
  the parameters. Credentials come from the AWS environment and config files
  of the process, never from the URI.

Each backend registers itself (``base.Backend``: an entry point of group
``spark_state.storage`` per scheme, or ``register_backend``), and its module
(with its client, ``hdfs`` or ``boto3``) is imported only when a store of its
scheme is opened. Nothing here lists backends.

Every call to a local storage is bounded in time (``timeouts.TimeoutStorage``,
``DEFAULT_TIMEOUT_SECONDS``); WebHDFS bounds each HTTP call itself. Test-only:
when the environment variable ``SPARK_STATE_FAULT_PLAN`` is set,
``open_storage`` wraps every storage in ``faults.FaultStorage`` (and a
``TimeoutStorage`` with the plan's timeout), see ``spark_state.storage.faults``.

May import: ``spark_state.errors`` and ``spark_state.redaction`` only; every layer above may import it.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from spark_state.errors import ConfigError
from spark_state.storage.base import Backend, CountingStorage, ForwardingStorage, Storage
from spark_state.storage.local import LocalStorage
from spark_state.storage.memory import MemoryStorage
from spark_state.storage.timeouts import DEFAULT_TIMEOUT_SECONDS, TimeoutStorage

if TYPE_CHECKING:
    from spark_state.storage.hdfs import WebHdfsStorage
    from spark_state.storage.s3 import S3Storage

__all__ = [
    "Backend",
    "CountingStorage",
    "ForwardingStorage",
    "LocalStorage",
    "MemoryStorage",
    "S3Storage",
    "Storage",
    "TimeoutStorage",
    "WebHdfsStorage",
    "backends",
    "location_identity",
    "open_storage",
    "register_backend",
]

ENTRY_POINT_GROUP = "spark_state.storage"
"""The entry points naming each backend's ``BACKEND``, one per URI scheme (``file`` for plain paths)."""
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make ``open_storage`` open ``backend``'s schemes (those of an installed backend are found without this)."""
    for scheme in backend.schemes:
        _BACKENDS[scheme.lower()] = backend
    return backend


def _backend(scheme: str) -> Backend | None:
    """The backend of ``scheme``: registered, or the entry point of that name (loaded once), or None."""
    backend = _BACKENDS.get(scheme)
    if backend is None:
        for point in entry_points(group=ENTRY_POINT_GROUP, name=scheme):
            backend = register_backend(point.load())
            break
    return backend


def backends() -> list[Backend]:
    """Every backend there is (each installed one is loaded: its module imported)."""
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name not in _BACKENDS:
            try:
                register_backend(point.load())
            except ImportError:  # its client library is not installed: not offered
                continue
    return list(dict.fromkeys(_BACKENDS.values()))


def supported_uris() -> str:
    """How the URIs of every backend are written, for messages."""
    return ", ".join(backend.usage for backend in backends())


def __getattr__(name: str):
    """``WebHdfsStorage`` and ``S3Storage`` are imported (with their clients) only when something asks for them."""
    if name == "WebHdfsStorage":
        from spark_state.storage.hdfs import WebHdfsStorage

        return WebHdfsStorage
    if name == "S3Storage":
        from spark_state.storage.s3 import S3Storage

        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def location_identity(uri: str) -> str:
    """The location ``uri`` names, in one spelling and without client options (``Backend.identity``): the same
    for ``s3a://b/p/`` and ``s3://b/p?endpoint=...&path_style=true``, for ``/data/log`` and ``file:///data/log/``.
    A URI no backend takes is returned without trailing '/'; this never raises (it reads records)."""
    try:
        backend, _ = _resolve(uri)
    except ConfigError:
        return uri.rstrip("/") if isinstance(uri, str) else uri
    if backend.identity is None:
        return uri.rstrip("/")
    try:
        return backend.identity(uri)
    except ConfigError:
        return uri.rstrip("/")


def preload(uri: str) -> None:
    """Import and load what opening ``uri`` and making its first client need, sending nothing to the store
    (``Backend.preload``: for S3, boto3's models and the credentials). See ``hosts.process``."""
    backend, _ = _resolve(uri)
    (backend.preload or backend.open)(uri)


def open_storage(uri: str) -> Storage:
    """Return the storage that ``uri`` names; ``ConfigError`` (naming the URI) if it names none.

    A backend that does not bound its calls in time itself is wrapped in a
    ``TimeoutStorage``; with a test fault plan set, in a ``FaultStorage`` too.
    """
    backend, storage = _resolve(uri, opened=True)
    if backend.faults:
        from spark_state.storage.faults import FaultStorage, plan_from_environment

        plan = plan_from_environment()
        if plan is not None:
            return TimeoutStorage(FaultStorage(storage, plan), plan.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
    return storage if backend.bounded else TimeoutStorage(storage)


def _resolve(uri: str, *, opened: bool = False):
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"storage URI must be a non-empty str, got {uri!r}; use {supported_uris()}")
    scheme = uri.split(":", 1)[0].lower() if _SCHEME.match(uri) else "file"
    backend = _backend(scheme)
    if backend is None:
        raise ConfigError(f"unsupported storage URI {uri!r}: scheme {scheme!r} is not one of {supported_uris()}")
    return backend, (backend.open(uri) if opened else None)


def _open(uri: str) -> Storage:
    """The storage ``uri`` names, unwrapped (no time bound, no fault plan)."""
    return _resolve(uri, opened=True)[1]
