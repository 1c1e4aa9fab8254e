"""An in-process ``Storage``: a dict of path -> bytes behind one lock, for unit tests.

It keeps every guarantee of ``spark_state.storage.base`` (the contract suite runs
against it), but only within one Python process: Spark's Python workers are
separate processes and do not share it.

Instances are registered by name so that ``open_storage("memory://NAME")``
returns the same object for the same NAME. A storage opened that way lives
until the process exits; one constructed directly lives while it is referenced,
and ``open_storage(storage.uri)`` finds it during that time.
"""

from __future__ import annotations

import re
import threading
import uuid
import weakref
from urllib.parse import urlsplit

from spark_state.errors import BlobExistsError, BlobNotFoundError, ConfigError, ShortReadError
from spark_state.storage.base import Backend, Storage, check_path, check_range

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_REGISTRY_LOCK = threading.RLock()
_LIVE: weakref.WeakValueDictionary[str, MemoryStorage] = weakref.WeakValueDictionary()
_OPENED: dict[str, MemoryStorage] = {}


class MemoryStorage(Storage):
    """A process-local tree of blobs; ``name`` (letters, digits, '.', '_', '-') identifies it.

    Without a name, a unique one is generated. Constructing a second storage
    under a live name raises ``ConfigError``: share it with ``named`` instead.
    """

    def __init__(self, name: str | None = None) -> None:
        name = f"anonymous-{uuid.uuid4().hex}" if name is None else name
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"invalid memory storage name {name!r}: use letters, digits, '.', '_' or '-'")
        self.name = name
        self.uri = f"memory://{name}"
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}
        with _REGISTRY_LOCK:
            if name in _LIVE:
                raise ConfigError(
                    f"a memory storage named {name!r} already exists in this process; "
                    f"use MemoryStorage.named({name!r}) or open_storage({self.uri!r}) to share it"
                )
            _LIVE[name] = self

    @classmethod
    def named(cls, name: str) -> MemoryStorage:
        """Return the live storage called ``name``, creating it (for the life of the process) if needed."""
        with _REGISTRY_LOCK:
            storage = _LIVE.get(name)
            if storage is None:
                storage = cls(name)
                _OPENED[name] = storage
            return storage

    def __repr__(self) -> str:
        return f"MemoryStorage({self.name!r})"

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        check_path(path)
        blob = memoryview(data).tobytes()
        with self._lock:
            self._check_no_conflict(path)
            if path in self._blobs and not overwrite:
                raise BlobExistsError(f"blob {path!r} already exists in {self.uri}; pass overwrite=True to replace it")
            self._blobs[path] = blob

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        check_path(path)
        check_range(offset, length)
        blob = self._blob(path)
        end = len(blob) if length is None else offset + length
        if offset > len(blob) or end > len(blob):
            raise ShortReadError(
                f"read at offset {offset}, length {length}, of {path!r} in {self.uri} is past its end "
                f"({len(blob)} bytes)"
            )
        return blob[offset:end]

    def size(self, path: str) -> int:
        check_path(path)
        return len(self._blob(path))

    def exists(self, path: str) -> bool:
        check_path(path)
        with self._lock:
            return path in self._blobs or self._is_directory(path)

    def list(self, path: str = "") -> list[str]:
        check_path(path, allow_root=True)
        prefix = f"{path}/" if path else ""
        with self._lock:
            return sorted({key[len(prefix) :].split("/", 1)[0] for key in self._blobs if key.startswith(prefix)})

    def delete(self, path: str) -> None:
        check_path(path)
        prefix = f"{path}/"
        with self._lock:
            for key in [key for key in self._blobs if key == path or key.startswith(prefix)]:
                del self._blobs[key]

    def _blob(self, path: str) -> bytes:
        with self._lock:
            blob = self._blobs.get(path)
            if blob is None:
                what = "is a directory, not a blob" if self._is_directory(path) else "does not exist"
                raise BlobNotFoundError(f"{path!r} {what} in {self.uri}")
            return blob

    def _is_directory(self, path: str) -> bool:
        prefix = f"{path}/"
        return any(key.startswith(prefix) for key in self._blobs)

    def _check_no_conflict(self, path: str) -> None:
        """Raise ``BlobExistsError`` if ``path`` is a directory or lies below a blob (caller holds the lock)."""
        if self._is_directory(path):
            raise BlobExistsError(f"cannot create blob {path!r} in {self.uri}: it is a directory")
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in self._blobs:
                raise BlobExistsError(f"cannot create blob {path!r} in {self.uri}: its parent {parent!r} is a blob")


def open_memory(uri: str) -> MemoryStorage:
    """``memory://NAME``: the process-wide ``MemoryStorage`` called NAME."""
    parts = urlsplit(uri)
    if not parts.netloc or parts.path or parts.query or parts.fragment:
        raise ConfigError(f"invalid memory URI {uri!r}: use memory://NAME (letters, digits, '.', '_', '-')")
    try:
        return MemoryStorage.named(parts.netloc)
    except ConfigError as err:
        raise ConfigError(f"invalid memory URI {uri!r}: {err}") from err


BACKEND = Backend(("memory",), open_memory, "memory://NAME", faults=False)
