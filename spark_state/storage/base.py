"""The storage interface every backend implements, and its guarantees.

A ``Storage`` is a tree of immutable blobs addressed by clean relative paths
(``"a/b/c.arrow"``: '/'-separated, no leading '/', no empty, '.' or '..'
component, no NUL, no component starting with ``".tmp-"``, which is reserved
for in-flight writes), so no path, whether from an option or from a stored
record, can reach outside the storage's root. Directories exist implicitly: creating ``a/b/c`` makes
``a`` and ``a/b`` listable. A path is a blob or a directory, never both.

Guarantees (checked by ``tests/test_storage_contract.py`` for every backend):

- ``create(path, data)`` is atomic: no reader ever sees a partial blob; the
  blob becomes visible, complete, at one instant. Without ``overwrite=True``
  it raises ``BlobExistsError`` if the path exists, and exactly one of two
  racing creators succeeds. With ``overwrite=True`` the old content is
  replaced (atomically on local disk; on HDFS there is a short window in
  which the path is absent, never one in which it is partial). Creating a
  blob where a directory exists, or below a blob, raises ``BlobExistsError``
  even with ``overwrite=True``. If ``create`` fails with any other
  ``StorageError`` the blob may or may not have been published (the outcome
  of a remote call can be unknown), but it is never partial; retry with
  ``overwrite=False`` and treat ``BlobExistsError`` as "already there".
- ``read(path, offset, length)`` returns exactly ``length`` bytes starting at
  byte ``offset`` (0-based); ``length=None`` reads to the end. The range is
  valid when ``0 <= offset`` and ``offset + length <= size`` (``offset <=
  size`` when ``length`` is None), so ``read(p, size(p), 0)`` is ``b""``. A
  range past the end raises ``ShortReadError``; a negative offset or length
  raises ``ConfigError``; a missing path, or a directory, raises
  ``BlobNotFoundError``.
- ``size(path)`` is the blob's length in bytes (``BlobNotFoundError`` for a
  missing path or a directory).
- ``exists(path)`` is true for a blob or a non-empty directory.
- ``list(path)`` returns the sorted names (not paths) of the immediate
  children of directory ``path`` (``""`` is the root); a missing directory,
  or a blob, lists as ``[]``. Temporary files of in-flight or crashed
  creates are never listed. Listings are for discovery and garbage
  collection only: they never prove that a checkpoint was committed.
- ``delete(path)`` removes a blob or a whole directory tree and does not fail
  when the path is missing. It is not atomic against concurrent creates
  below the directory and never fails because of them: it removes every blob
  that existed when it started; a blob created meanwhile may stay (with its
  directories), and such a create either publishes its blob complete or
  fails with a ``StorageError``. Directories that it leaves empty are removed too,
  so a directory exists only while it holds something. The one exception: a
  create that is in progress, or that crashed before publishing, leaves a
  directory that holds only its hidden temporary file; such a directory can
  show in ``exists`` and ``list`` of its parent until it is deleted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from spark_state.errors import ConfigError, InvalidPathError

TEMP_PREFIX = ".tmp-"
"""Names starting with this are backends' in-flight writes: never listed, never valid in a path."""


def check_path(path: str, *, allow_root: bool = False) -> str:
    """Return ``path`` if it is a clean relative path, else raise ``InvalidPathError``."""
    if not isinstance(path, str):
        raise InvalidPathError(f"storage path must be a str, got {type(path).__name__}")
    if path == "" and allow_root:
        return path
    parts = path.split("/")
    if "\x00" in path:
        raise InvalidPathError(f"invalid storage path {path!r}: it holds a NUL character, which no file system stores")
    if path == "" or any(part in ("", ".", "..") for part in parts):
        raise InvalidPathError(
            f"invalid storage path {path!r}: use a relative path like 'dir/name' "
            "with no leading '/', no empty, '.' or '..' component"
        )
    if any(part.startswith(TEMP_PREFIX) for part in parts):
        raise InvalidPathError(
            f"invalid storage path {path!r}: names starting with {TEMP_PREFIX!r} are "
            "reserved for in-flight writes; rename the component"
        )
    return path


def check_range(offset: int, length: int | None) -> None:
    """Raise ``ConfigError`` unless ``offset >= 0`` and ``length`` is None or ``>= 0``.

    Whether the range fits the blob is the backend's check (``ShortReadError``).
    """
    if not isinstance(offset, int) or offset < 0:
        raise ConfigError(f"read offset must be an int >= 0, got {offset!r}")
    if length is not None and (not isinstance(length, int) or length < 0):
        raise ConfigError(f"read length must be None or an int >= 0, got {length!r}")


def join(*parts: str) -> str:
    """Join path components with '/', skipping empty ones."""
    return "/".join(part for part in parts if part)


class Storage(ABC):
    """A tree of immutable blobs; see the module docstring for the guarantees."""

    uri: str

    @abstractmethod
    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        """Atomically make ``path`` hold ``data``; ``BlobExistsError`` if it exists and not ``overwrite``."""

    @abstractmethod
    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Return bytes ``[offset, offset + length)`` of the blob (to the end if ``length`` is None)."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Return the blob's length in bytes; ``BlobNotFoundError`` if missing."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Return whether ``path`` is a blob or a non-empty directory."""

    @abstractmethod
    def list(self, path: str = "") -> list[str]:
        """Return the sorted child names of directory ``path``; ``[]`` if it does not exist."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove the blob or directory tree at ``path``; a missing path is not an error."""

    def describe(self, path: str = "") -> str:
        """The storage, or ``path`` in it, for messages: a well-formed location (a URI's parameters, which say how
        to reach it, come after the path, or are left out)."""
        return f"{self.uri.rstrip('/')}/{path}" if path else self.uri

    def counters(self) -> dict[str, int] | None:
        """What this storage object sent and received on the wire so far, if the backend counts it.

        A remote backend returns at least ``requests`` (every request made,
        retries included) and ``bytes_read`` (response bytes received);
        local ones return None. The difference of two calls is the cost of
        what ran between them in this process.
        """
        return None


class ForwardingStorage(Storage):
    """Forwards every call to ``inner``; subclass it to observe or change one operation.

    It keeps every guarantee of ``inner`` as long as overrides only observe
    (metrics, tests) or fail.
    """

    def __init__(self, inner: Storage):
        self.inner = inner
        self.uri = inner.uri

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        self.inner.create(path, data, overwrite=overwrite)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read(path, offset, length)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, path: str = "") -> list[str]:
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def counters(self) -> dict[str, int] | None:
        return self.inner.counters()

    def describe(self, path: str = "") -> str:
        return self.inner.describe(path)


class CountingStorage(ForwardingStorage):
    """Counts reads through it: ``reads`` (every path asked for, in order, failed ones too), ``requests``, ``bytes_read``."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self.reads: list[str] = []
        self.bytes_read = 0

    @property
    def requests(self) -> int:
        return len(self.reads)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        self.reads.append(path)
        data = self.inner.read(path, offset, length)
        self.bytes_read += len(data)
        return data


@dataclass(frozen=True)
class Backend:
    """A storage backend as ``open_storage`` finds it: the URI schemes it opens and how.

    **A new backend is one module**: a ``Storage`` subclass that passes
    ``tests/test_storage_contract.py``, and a ``BACKEND = Backend(...)`` in
    that module, named by an entry point of group ``spark_state.storage``
    for each of its schemes (``pyproject.toml``), or registered at run time
    with ``storage.register_backend``. Nothing else lists backends.

    ``open(uri)`` returns the storage (``ConfigError`` naming the URI when it
    is malformed); ``usage`` says how its URIs are written, for messages;
    ``preload(uri)`` loads what its first client needs without sending
    anything (a new instance host calls it before it forks, ``hosts.process``);
    ``bounded``: every call is bounded in time by the backend itself (else
    ``TimeoutStorage`` bounds it); ``faults``: test fault plans may wrap it.
    ``identity(uri)`` is the location alone, in one spelling, without the
    options of a client (endpoints, users, retries): what names a log or a
    store in records that outlive a client's settings (``location_identity``).
    """

    schemes: tuple[str, ...]
    open: Callable[[str], Storage]
    usage: str
    preload: Callable[[str], None] | None = None
    bounded: bool = True
    faults: bool = True
    identity: Callable[[str], str] | None = None
