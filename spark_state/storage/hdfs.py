"""``WebHdfsStorage``: blobs as HDFS files, reached over WebHDFS with the ``hdfs`` package.

Verified against ``tests/webhdfs_server.py``, a stand-in that follows the
WebHDFS REST spec for the calls used here, not against a real NameNode.

``create`` follows Spark's ``CheckpointFileManager`` (write a temp file, then
rename it), because an HDFS file is visible while it is being written:

1. Without ``overwrite``, GETFILESTATUS the final path: if it exists, raise
   ``BlobExistsError`` before uploading anything.
2. CREATE ``<dir>/.tmp-<uuid>-<name>`` (two-step: the NameNode redirects to a
   DataNode, which receives the bytes). HDFS creates missing parent
   directories.
3. Publish with RENAME to the final path; this is the only step at which the
   blob becomes visible. WebHDFS RENAME answers ``{"boolean": false}``, not an
   error, when the destination exists, so exactly one racing creator wins;
   the losers get ``BlobExistsError``.
   With ``overwrite=True``: DELETE the final path (not recursively, so a
   directory is never removed), then RENAME. Between the two calls the path is
   absent: a reader sees ``BlobNotFoundError`` then, never a partial blob.
4. On any failure, DELETE the temp file (best effort: a leftover temp file is
   never listed and goes with its directory).

Traps of the protocol that this module works around or documents:

- A RENAME onto an existing *directory* moves the source into it and answers
  true. Step 1 catches a directory at the final path; one created between
  steps 1 and 3 would swallow the blob (a caller bug: a path is a blob or a
  directory, never both).
- OPEN of a non-empty file at ``offset >= length`` fails on the NameNode, and
  OPEN of an empty file at ``offset > 0`` on the DataNode, both with a plain
  ``IOException``; ``read`` then asks for the size to tell a short read from
  another failure. A range that runs past the end is served short, so the
  returned length is checked.
- The ``hdfs`` client's ``status(strict=False)`` returns None for *any*
  failing answer (a 500 looks like a missing file) and ``rename`` hides the
  difference between "refused" and "failed"; this module therefore calls the
  client's raw endpoints (``_get_file_status``, ``_list_status``, ``_rename``,
  ``_delete``) and maps errors itself.
- WebHDFS also has ``renameoptions=OVERWRITE`` (Hadoop's ``rename2``), which
  would make overwriting atomic; it is not in the published REST docs and the
  ``hdfs`` client does not expose it, so it is not used.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Iterator
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import hdfs
import requests

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    ConfigError,
    InvalidPathError,
    ShortReadError,
    StorageError,
)
from spark_state.storage.base import TEMP_PREFIX, Backend, Storage, check_path, check_range

_MISSING = frozenset({"FileNotFoundException", "ParentNotDirectoryException"})
"""RemoteExceptions meaning "no such path" when reading (a blob as a parent also means absent)."""

_CONFLICT = frozenset({"FileAlreadyExistsException", "ParentNotDirectoryException", "PathIsNotEmptyDirectoryException"})
"""RemoteExceptions meaning "a blob or directory is in the way" when writing."""

_OUT_OF_RANGE = frozenset({"IOException", "EOFException"})
"""RemoteExceptions with which OPEN refuses an offset past the end (among other failures)."""

_OVERWRITE_ATTEMPTS = 5
"""How often an overwriting ``create`` retries DELETE + RENAME when a concurrent writer re-creates the path."""

_READ_CHUNK = 1 << 20


class WebHdfsStorage(Storage):
    """Blobs below directory ``root`` of the HDFS whose WebHDFS endpoint is ``url``.

    ``url`` is ``http://host:port`` with the NameNode's HTTP port (9870 on
    Hadoop 3, 50070 on Hadoop 2), not its RPC port. ``root`` is an absolute
    HDFS path such as ``/spark-state/job1``. ``user`` is sent as
    ``user.name`` (simple authentication; the default is the OS user).
    ``timeout`` (seconds) bounds each HTTP call.
    """

    def __init__(self, url: str, root: str = "/", user: str | None = None, *, timeout: float = 60.0) -> None:
        self.url = _check_url(url)
        self.root = _check_root(root)
        if user is not None and (not isinstance(user, str) or not user):
            raise ConfigError(f"WebHDFS user must be a non-empty str or None, got {user!r}")
        self.user = user
        query = f"?{urlencode({'user': user})}" if user else ""
        self.uri = f"webhdfs://{urlsplit(self.url).netloc}{quote(self.root)}{query}"
        self._client = hdfs.InsecureClient(self.url, user=user, timeout=timeout)

    def __repr__(self) -> str:
        return f"WebHdfsStorage({self.url!r}, {self.root!r}, user={self.user!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WebHdfsStorage) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((WebHdfsStorage, self._key()))

    def _key(self) -> tuple[str, str, str | None]:
        return (self.url, self.root, self.user)

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        check_path(path)
        payload = data if isinstance(data, bytes) else memoryview(data).tobytes()
        final = self._hdfs_path(path)
        if not overwrite:
            status = self._status(path, final)
            if status is not None:
                raise self._exists_error(path, final, status)
        directory, name = posixpath.split(final)
        tmp = f"{directory}/{TEMP_PREFIX}{uuid.uuid4().hex}-{name}"
        try:
            with self._mapped("create", path, writing=True):
                self._client.write(tmp, data=payload, overwrite=False)
            self._publish(path, tmp, final, overwrite)
        except BaseException:
            self._discard(tmp)
            raise

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        check_path(path)
        check_range(offset, length)
        if length == 0:
            return self._read_nothing(path, offset, 0)
        try:
            with self._mapped("read", path):
                with self._client.read(
                    self._hdfs_path(path), offset=offset, length=length, chunk_size=_READ_CHUNK
                ) as chunks:
                    data = b"".join(chunks)
        except StorageError as err:
            if getattr(err.__cause__, "exception", None) in _OUT_OF_RANGE:
                return self._read_nothing(path, offset, length, cause=err)
            raise
        if length is not None and len(data) != length:
            raise ShortReadError(
                f"read at offset {offset}, length {length}, of {path!r} in {self.uri} returned "
                f"{len(data)} bytes: the range runs past the end of the blob"
            )
        return data

    def size(self, path: str) -> int:
        check_path(path)
        status = self._status(path, self._hdfs_path(path))
        if status is None:
            raise BlobNotFoundError(f"{path!r} does not exist in {self.uri}")
        if status["type"] != "FILE":
            raise BlobNotFoundError(f"{path!r} is a directory, not a blob, in {self.uri}")
        return int(status["length"])

    def exists(self, path: str) -> bool:
        check_path(path)
        return self._status(path, self._hdfs_path(path)) is not None

    def list(self, path: str = "") -> list[str]:
        check_path(path, allow_root=True)
        try:
            with self._mapped("list", path):
                response = self._client._list_status(self._hdfs_path(path))
        except BlobNotFoundError:
            return []
        statuses = response.json()["FileStatuses"]["FileStatus"]
        # A file lists as itself, with an empty pathSuffix: it has no children.
        return sorted(
            name for name in (status["pathSuffix"] for status in statuses) if name and not name.startswith(TEMP_PREFIX)
        )

    def delete(self, path: str) -> None:
        check_path(path)
        try:
            with self._mapped("delete", path):
                deleted = self._client._delete(self._hdfs_path(path), recursive=True).json()["boolean"]
        except BlobNotFoundError:
            return
        if deleted:
            self._prune_empty_parents(path)

    def _hdfs_path(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    def _status(self, path: str, hdfs_path: str) -> dict | None:
        """GETFILESTATUS of ``hdfs_path``, or None if it does not exist."""
        try:
            with self._mapped("status", path):
                return self._client._get_file_status(hdfs_path).json()["FileStatus"]
        except BlobNotFoundError:
            return None

    def _publish(self, path: str, tmp: str, final: str, overwrite: bool) -> None:
        """Step 3: RENAME the complete temp file to ``final``; the blob becomes visible here."""
        if not overwrite:
            if not self._rename(path, tmp, final):
                raise self._refused_rename_error(path, final)
            return
        for _ in range(_OVERWRITE_ATTEMPTS):
            with self._mapped("create", path, writing=True):
                self._client._delete(final, recursive=False)
            if self._rename(path, tmp, final):
                return
        raise StorageError(
            f"create of {path!r} in {self.uri} with overwrite=True failed: the path was re-created "
            f"by another writer {_OVERWRITE_ATTEMPTS} times between DELETE and RENAME; "
            "let one writer own each path"
        )

    def _rename(self, path: str, source: str, destination: str) -> bool:
        with self._mapped("create", path, writing=True):
            return bool(self._client._rename(source, destination=destination).json()["boolean"])

    def _refused_rename_error(self, path: str, final: str) -> StorageError:
        """Why RENAME answered false: the destination exists, or the temp file vanished."""
        status = self._status(path, final)
        if status is not None:
            return self._exists_error(path, final, status)
        return StorageError(
            f"create of {path!r} in {self.uri} failed: WebHDFS refused to rename the temp file "
            "although the destination does not exist; was its directory deleted concurrently?"
        )

    def _exists_error(self, path: str, final: str, status: dict) -> BlobExistsError:
        what = "is a directory" if status["type"] == "DIRECTORY" else "already exists"
        return BlobExistsError(
            f"blob {path!r} {what} in {self.uri} (HDFS path {final}); delete it or, for a blob, pass overwrite=True"
        )

    def _discard(self, tmp: str) -> None:
        """Step 4 on failure: remove the temp file, keeping the original error if this fails too."""
        with contextlib.suppress(hdfs.HdfsError, requests.RequestException):
            self._client._delete(tmp, recursive=False)

    def _read_nothing(self, path: str, offset: int, length: int | None, cause: StorageError | None = None) -> bytes:
        """Answer a read that returns no bytes (or whose OPEN was refused) from the blob's size."""
        size = self.size(path)
        end = size if length is None else offset + length
        if offset > size or end > size:
            raise ShortReadError(
                f"read at offset {offset}, length {length}, of {path!r} in {self.uri} is past its end ({size} bytes)"
            ) from cause
        if cause is not None and offset < size:
            raise cause  # the range fits: OPEN failed for another reason
        return b""

    def _prune_empty_parents(self, path: str) -> None:
        """Remove the directories above ``path`` that are now empty, deepest first, never the root."""
        parts = path.split("/")
        for depth in range(len(parts) - 1, 0, -1):
            parent = "/".join(parts[:depth])
            try:
                with self._mapped("delete", parent, writing=True):
                    removed = self._client._delete(self._hdfs_path(parent), recursive=False).json()["boolean"]
            except BlobExistsError:
                return  # not empty: neither are its ancestors
            if not removed:
                return  # already gone: the delete that removed it prunes above it

    @contextlib.contextmanager
    def _mapped(self, op: str, path: str, *, writing: bool = False) -> Iterator[None]:
        """Turn the client's and ``requests``' errors during ``op`` on ``path`` into typed errors."""
        try:
            yield
        except hdfs.HdfsError as err:
            exception = err.exception or "error"
            detail = f"{op} of {path!r} in {self.uri} failed: {exception}: {err.message}"
            if writing and exception in _CONFLICT:
                raise BlobExistsError(f"{detail}; a blob or a directory is in the way (a path is never both)") from err
            if not writing and exception in _MISSING:
                raise BlobNotFoundError(f"{path!r} does not exist in {self.uri} ({exception})") from err
            raise StorageError(detail) from err
        except requests.RequestException as err:
            raise StorageError(
                f"{op} of {path!r} in {self.uri} failed: {type(err).__name__}: {err}; check that the "
                f"NameNode's WebHDFS endpoint {self.url} is reachable"
            ) from err


def _check_url(url: str) -> str:
    """Return ``http://host:port`` from ``url``, else raise ``ConfigError``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except (TypeError, ValueError, AttributeError):
        parts, port = None, None
    if (
        parts is None
        or parts.scheme != "http"
        or not parts.hostname
        or port is None
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ConfigError(
            f"invalid WebHDFS URL {url!r}: use http://HOST:PORT with the NameNode's HTTP port "
            "(9870 on Hadoop 3, 50070 on Hadoop 2)"
        )
    return f"http://{parts.netloc}"


def _check_root(root: str) -> str:
    """Return ``root`` without a trailing '/' if it is a clean absolute HDFS path, else raise ``ConfigError``."""
    if not isinstance(root, str) or not root.startswith("/"):
        raise ConfigError(f"invalid WebHDFS root {root!r}: use an absolute HDFS path like '/spark-state/job1'")
    stripped = root.rstrip("/")
    if stripped:
        try:
            check_path(stripped[1:])
        except InvalidPathError as err:
            raise ConfigError(f"invalid WebHDFS root {root!r}: {err}") from err
    return stripped or "/"


def open_webhdfs(uri: str) -> WebHdfsStorage:
    """``webhdfs://HOST:PORT/path`` or ``hdfs://HOST:PORT/path`` (PORT: the NameNode's WebHDFS HTTP port)."""
    parts = urlsplit(uri)
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


def webhdfs_identity(uri: str) -> str:
    """``webhdfs://HOST:PORT/path``: ``hdfs://`` is the same NameNode's, and ``?user=`` a client's option."""
    parts = urlsplit(uri)
    return f"webhdfs://{parts.netloc.lower()}{unquote(parts.path).rstrip('/') or '/'}"


BACKEND = Backend(
    ("webhdfs", "hdfs"),
    open_webhdfs,
    "webhdfs://HOST:PORT/path or hdfs://HOST:PORT/path (PORT is the WebHDFS HTTP port; optional ?user=NAME)",
    identity=webhdfs_identity,
)
