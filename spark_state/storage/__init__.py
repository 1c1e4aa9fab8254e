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

``WebHdfsStorage`` and ``S3Storage`` (with their clients, ``hdfs`` and
``boto3``) are imported only when such a store is opened.

Every call to a local storage is bounded in time (``timeouts.TimeoutStorage``,
``DEFAULT_TIMEOUT_SECONDS``); WebHDFS bounds each HTTP call itself. Test-only:
when the environment variable ``SPARK_STATE_FAULT_PLAN`` is set,
``open_storage`` wraps every storage in ``faults.FaultStorage`` (and a
``TimeoutStorage`` with the plan's timeout), see ``spark_state.storage.faults``.
"""

from __future__ import annotations

import re
import sys
from urllib.parse import parse_qs, unquote, urlsplit

from typing import TYPE_CHECKING

from spark_state.errors import ConfigError
from spark_state.storage.base import CountingStorage, ForwardingStorage, Storage
from spark_state.storage.local import LocalStorage
from spark_state.storage.memory import MemoryStorage
from spark_state.storage.timeouts import DEFAULT_TIMEOUT_SECONDS, TimeoutStorage

if TYPE_CHECKING:
    from spark_state.storage.hdfs import WebHdfsStorage
    from spark_state.storage.s3 import S3Storage

__all__ = [
    "CountingStorage",
    "ForwardingStorage",
    "LocalStorage",
    "MemoryStorage",
    "S3Storage",
    "Storage",
    "TimeoutStorage",
    "WebHdfsStorage",
    "open_storage",
]

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")

SUPPORTED_URIS = (
    "a plain path or file:///abs/path, memory://NAME, "
    "webhdfs://HOST:PORT/path or hdfs://HOST:PORT/path (PORT is the WebHDFS HTTP port; optional ?user=NAME), "
    "s3://BUCKET/PREFIX (optional ?endpoint=URL&region=R&path_style=true&profile=NAME&retry_seconds=N)"
)


def __getattr__(name: str):
    """``WebHdfsStorage`` and ``S3Storage`` are imported (with their clients) only when something asks for them."""
    if name == "WebHdfsStorage":
        from spark_state.storage.hdfs import WebHdfsStorage

        return WebHdfsStorage
    if name == "S3Storage":
        from spark_state.storage.s3 import S3Storage

        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def preload(uri: str) -> None:
    """Import and load what opening ``uri`` and making its first client need, sending nothing to the store.

    For S3 that includes resolving credentials, as the first client does. See ``hosts``.
    """
    storage = _open(uri)  # imports the backend's module: boto3 for S3, the WebHDFS client
    s3 = sys.modules.get("spark_state.storage.s3")
    if s3 is not None and isinstance(storage, s3.S3Storage):
        storage.client()  # its service models read and credentials resolved; the storage object is dropped


def open_storage(uri: str) -> Storage:
    """Return the storage that ``uri`` names; ``ConfigError`` (naming the URI) if it names none."""
    storage = _open(uri)
    if not isinstance(storage, MemoryStorage):
        from spark_state.storage.faults import FaultStorage, plan_from_environment

        plan = plan_from_environment()
        if plan is not None:
            return TimeoutStorage(FaultStorage(storage, plan), plan.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
    return TimeoutStorage(storage) if isinstance(storage, LocalStorage) else storage


def _open(uri: str) -> Storage:
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"storage URI must be a non-empty str, got {uri!r}; use {SUPPORTED_URIS}")
    if not _SCHEME.match(uri):
        return LocalStorage(uri)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return _open_file(uri, parts)
    if scheme == "memory":
        return _open_memory(uri, parts)
    if scheme in ("webhdfs", "hdfs"):
        return _open_webhdfs(uri, parts)
    if scheme in ("s3", "s3a"):
        from spark_state.storage import s3_location
        from spark_state.storage.s3 import S3Storage

        return S3Storage(s3_location.parse(uri))
    raise ConfigError(f"unsupported storage URI {uri!r}: scheme {scheme!r} is not one of {SUPPORTED_URIS}")


def _open_file(uri: str, parts) -> LocalStorage:
    if parts.netloc not in ("", "localhost") or not parts.path or parts.query or parts.fragment:
        raise ConfigError(f"invalid file URI {uri!r}: use file:///absolute/path (no host, query or fragment)")
    return LocalStorage(unquote(parts.path))


def _open_memory(uri: str, parts) -> MemoryStorage:
    if not parts.netloc or parts.path or parts.query or parts.fragment:
        raise ConfigError(f"invalid memory URI {uri!r}: use memory://NAME (letters, digits, '.', '_', '-')")
    try:
        return MemoryStorage.named(parts.netloc)
    except ConfigError as err:
        raise ConfigError(f"invalid memory URI {uri!r}: {err}") from err


def _open_webhdfs(uri: str, parts) -> "WebHdfsStorage":
    from spark_state.storage.hdfs import WebHdfsStorage

    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.username is not None or parts.fragment:
        raise ConfigError(
            f"invalid HDFS URI {uri!r}: use webhdfs://HOST:PORT/path[?user=NAME] with the NameNode's "
            "WebHDFS HTTP port (9870 on Hadoop 3, 50070 on Hadoop 2)"
        )
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        query = {"": []}
    if set(query) - {"user"} or any(len(values) != 1 or not values[0] for values in query.values()):
        raise ConfigError(f"invalid HDFS URI {uri!r}: the only query parameter is one non-empty user=NAME")
    user = query["user"][0] if "user" in query else None
    try:
        return WebHdfsStorage(f"http://{parts.netloc}", unquote(parts.path) or "/", user)
    except ConfigError as err:
        raise ConfigError(f"invalid HDFS URI {uri!r}: {err}") from err
