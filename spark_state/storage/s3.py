"""``S3Storage``: blobs as objects of an S3 bucket (AWS or any S3-compatible store), through boto3.

Verified against SeaweedFS's S3 gateway (``tests/s3_server.py``), not against
AWS itself. Each blob is the object ``<prefix>/<path>``; directories are key
prefixes, so they exist exactly while they hold something.

Requests per call (each one HTTP request unless retried):

- ``create(path, data)`` publishes with ONE ``PutObject`` carrying
  ``If-None-Match: *``: S3 creates the object only if no object has that key,
  atomically, so of racing creators exactly one wins and the others get ``412
  PreconditionFailed`` -> ``BlobExistsError``. There is no check-then-put: the
  object is complete and visible from the instant the PUT succeeds, never
  partial. ``overwrite=True`` is a plain ``PutObject`` (S3 replaces objects
  atomically). Before the PUT, the "a path is a blob or a directory, never
  both" rule is checked: one ``ListObjectsV2`` (is ``path`` a directory?) and
  one ``HeadObject`` per ancestor not yet seen as a directory by this
  storage object (is an ancestor a blob?). Those checks guard against caller
  bugs and are not atomic with the PUT; the existence check is.
- ``read(path, offset, length)``: one ``GetObject`` with ``Range: bytes=a-b``
  (a whole-object GET for ``offset=0, length=None``); a zero-length read is one
  ``HeadObject``. Restore planning coalesces a blob's adjacent entries into
  one range, so an instance makes one request per coalesced range.
- ``size``: one ``HeadObject``. ``exists``: a ``HeadObject``, then (if no blob)
  one ``ListObjectsV2`` with ``MaxKeys=1``.
- ``list``: ``ListObjectsV2`` with ``Delimiter='/'`` (one request per 1000
  names). ``delete``: ``DeleteObject`` of the key, then a listing of the
  subtree and ``DeleteObjects`` per 1000 keys. Listing serves discovery and
  garbage collection only, never a commit decision.

Failures: throttling (429, ``SlowDown``), 5xx answers, refused, reset or timed
out connections and broken response bodies are retried with exponential
backoff and full jitter until ``retry_seconds`` have passed since the call
began (``S3Location.retry_seconds``, default 30), then ``StorageUnavailableError``
names the operation, the path, the attempts and the last cause. A create whose
earlier attempt failed without an answer may have been published by that
attempt: if a retry then meets ``412``, the object is read back, and the same
bytes mean that the blob holds what this create asked for, so it succeeds.
A missing bucket raises ``BucketNotFoundError``; refused or missing
credentials ``StorageAccessError`` naming where credentials were looked up
(the AWS chain's method and profile), never a key or a secret.

``counters()`` reports the requests this storage object made (every attempt,
by operation) and the response bytes it received, so callers can measure
what a restore really cost on the wire.
"""

from __future__ import annotations

import builtins
import functools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
import botocore.exceptions
import botocore.session
from botocore.config import Config

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    BucketNotFoundError,
    ConfigError,
    ShortReadError,
    StorageAccessError,
    StorageError,
    StorageUnavailableError,
)
from spark_state.storage.base import TEMP_PREFIX, Storage, check_path, check_range
from spark_state.storage.s3_location import DEFAULT_RETRY_SECONDS, S3Location

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
        "BandwidthLimitExceeded",
    }
)
_ACCESS_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "AuthorizationHeaderMalformed",
        "AllAccessDisabled",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DELETE_BATCH = 1000
_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 2.0


_LOADER_LOCK = threading.Lock()
_LOADER = None  # botocore's loader of service models, shared by this process's sessions (see ``_session``)


def _session(profile: str | None) -> boto3.session.Session:
    """A new boto3 session whose botocore loader is this process's shared one.

    The loader holds the service models read from botocore's JSON files,
    which each new session otherwise reads again (about 0.07 s for S3). It
    is plain data, so a process forked from this one (an instance host)
    inherits it loaded. Credentials stay per session. Raises botocore's
    ``ProfileNotFound`` for an unknown ``profile``.
    """
    global _LOADER
    core = botocore.session.Session(profile=profile)
    core.get_scoped_config()  # an unknown profile raises now, as boto3.Session(profile_name=...) would
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _LOADER)
        session = boto3.session.Session(botocore_session=core)
        _LOADER.search_paths[:] = list(dict.fromkeys(_LOADER.search_paths))  # boto3 appends its data directory
    return session


class _Transient(Exception):
    """Internal: one attempt failed in a way worth retrying; ``cause`` is what happened."""

    def __init__(self, cause: BaseException, description: str):
        super().__init__(description)
        self.cause = cause
        self.description = description


class S3Storage(Storage):
    """Blobs below ``location.prefix`` of ``location.bucket``; see the module docstring for the guarantees."""

    def __init__(self, location: S3Location):
        self.location = location
        self.uri = location.uri
        self.retry_seconds = DEFAULT_RETRY_SECONDS if location.retry_seconds is None else location.retry_seconds
        self._client_lock = threading.Lock()
        self._client: Any = None  # boto3's S3 client (no types)
        self._session = None
        self._known_directories: set[str] = set()
        self._counter_lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._bytes_received = 0

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r})"

    def describe(self, path: str = "") -> str:
        """``s3://bucket/prefix/path``, and the endpoint after it when one is set."""
        where = f"s3://{self.location.bucket}/" + "/".join(p for p in (self.location.prefix, path) if p)
        return where.rstrip("/") + (f" at {self.location.endpoint}" if self.location.endpoint else "")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, S3Storage) and other.location == self.location

    def __hash__(self) -> int:
        return hash((S3Storage, self.location))

    # --- the Storage interface ---------------------------------------------------------

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        check_path(path)
        body = memoryview(data).tobytes()
        self._check_structure(path)
        key = self._key(path)
        unanswered = []  # attempts whose outcome is unknown (no answer): they may have published

        def put() -> None:
            extra = {} if overwrite else {"IfNoneMatch": "*"}
            try:
                self._request(
                    "PutObject", lambda c: c.put_object(Bucket=self.location.bucket, Key=key, Body=body, **extra)
                )
            except _Transient as transient:
                unanswered.append(transient)
                raise

        try:
            self._retrying("create", path, put)
        except BlobExistsError:
            if unanswered and self._holds(path, body):
                return  # an earlier attempt of this very create published it
            raise
        self._remember_directories(path)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        check_path(path)
        check_range(offset, length)
        if length == 0 or (length is None and offset > 0):
            size = self.size(path)
            end = size if length is None else offset + length
            if offset > size or end > size:
                raise self._short(path, offset, length, size)
            if end == offset:
                return b""
            length = end - offset
        # ``length`` is None here only at offset 0: a read of the whole object
        ranged = {} if length is None else {"Range": f"bytes={offset}-{offset + length - 1}"}

        def get() -> bytes:
            def call(client):
                answer = client.get_object(Bucket=self.location.bucket, Key=self._key(path), **ranged)
                return answer["Body"].read()

            data = self._request("GetObject", call)
            self._received(len(data))
            return data

        try:
            data = self._retrying("read", path, get)
        except ShortReadError:
            raise self._short(path, offset, length, self.size(path)) from None
        if length is not None and len(data) != length:
            raise self._short(path, offset, length, offset + len(data))
        return data

    def size(self, path: str) -> int:
        check_path(path)
        answer = self._retrying("size", path, lambda: self._head(path))
        if answer is None:
            raise BlobNotFoundError(
                f"{path!r} does not exist (or is a directory, not a blob) in {self.location.describe()}"
            )
        return int(answer["ContentLength"])

    def exists(self, path: str) -> bool:
        check_path(path)
        if self._retrying("exists", path, lambda: self._head(path)) is not None:
            return True
        return bool(self._retrying("exists", path, lambda: self._list_page(f"{self._key(path)}/", None, None, 1)[0]))

    def list(self, path: str = "") -> list[str]:
        check_path(path, allow_root=True)
        prefix = self._directory_key(path)
        names: set[str] = set()
        token = None
        while True:
            keys, directories, token = self._retrying(
                "list", path or "<root>", functools.partial(self._list_page, prefix, "/", token, 1000)
            )
            names.update(key[len(prefix) :] for key in keys)
            names.update(directory[len(prefix) :].rstrip("/") for directory in directories)
            if token is None:
                break
        return sorted(name for name in names if name and not name.startswith(TEMP_PREFIX))

    def delete(self, path: str) -> None:
        check_path(path)
        subtree = f"{self._key(path)}/"
        first, token = True, None
        while True:  # the subtree's objects; the first batch also holds the key itself and its folder marker
            keys, _, token = self._retrying(
                "delete", path, functools.partial(self._list_page, subtree, None, token, _DELETE_BATCH - 2)
            )
            if first:
                keys += [self._key(path), subtree]
            if keys:
                self._retrying("delete", path, functools.partial(self._delete_batch, path, keys))
            first = False
            if token is None:
                break
        with self._counter_lock:
            self._known_directories = {d for d in self._known_directories if d != path and not d.startswith(f"{path}/")}
        self._prune_empty_parents(path)

    def _prune_empty_parents(self, path: str) -> None:
        """Remove the folder markers of the directories above ``path`` that are now empty, deepest first.

        S3 has no directories, but some S3-compatible stores (SeaweedFS) keep
        a folder entry for a key prefix and list it after its last object is
        gone. One listing per level tells whether the directory still holds
        an object; deleting an absent marker is harmless, and a store deletes
        a marker only of an empty folder.
        """

        def delete_marker(key: str) -> Any:
            return self._request("DeleteObject", lambda c: c.delete_object(Bucket=self.location.bucket, Key=key))

        parts = path.split("/")
        for depth in range(len(parts) - 1, 0, -1):
            directory = f"{self._key('/'.join(parts[:depth]))}/"
            if self._retrying("delete", path, functools.partial(self._list_page, directory, None, None, 1))[0]:
                return
            self._retrying("delete", path, functools.partial(delete_marker, directory))

    # --- measurement -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Requests made so far (every attempt, ``requests`` in total and per operation) and bytes received."""
        with self._counter_lock:
            return {
                "requests": sum(self._requests.values()),
                "bytes_read": self._bytes_received,
                **{f"requests.{op}": n for op, n in sorted(self._requests.items())},
            }

    def check_access(self) -> None:
        """Make one listing request, so that a missing bucket or refused credentials fail now, with their error."""
        self._retrying("check access to", "<root>", lambda: self._list_page(self._directory_key(""), "/", None, 1))

    # --- helpers -----------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return f"{self.location.prefix}/{path}" if self.location.prefix else path

    def _directory_key(self, path: str) -> str:
        """The key prefix of directory ``path`` ('' is the root), with its trailing '/' ('' for a bucket's root)."""
        key = self._key(path) if path else self.location.prefix
        return f"{key}/" if key else ""

    def _check_structure(self, path: str) -> None:
        """Refuse to create ``path`` if it is a directory or lies below a blob (not atomic with the PUT)."""
        if self._retrying("create", path, lambda: self._list_page(f"{self._key(path)}/", None, None, 1)[0]):
            raise BlobExistsError(f"cannot create blob {path!r} in {self.location.describe()}: it is a directory")
        parts = path.split("/")
        for depth in range(1, len(parts)):
            ancestor = "/".join(parts[:depth])
            with self._counter_lock:
                known = ancestor in self._known_directories
            if not known and self._retrying("create", path, functools.partial(self._head, ancestor)) is not None:
                raise BlobExistsError(
                    f"cannot create blob {path!r} in {self.location.describe()}: its parent {ancestor!r} is a blob"
                )

    def _remember_directories(self, path: str) -> None:
        parts = path.split("/")
        with self._counter_lock:
            self._known_directories.update("/".join(parts[:depth]) for depth in range(1, len(parts)))

    def _holds(self, path: str, body: bytes) -> bool:
        try:
            return self.read(path) == body
        except BlobNotFoundError:
            return False

    def _head(self, path: str) -> dict | None:
        """HeadObject of ``path``; None if no object has that key."""
        try:
            return self._request(
                "HeadObject", lambda c: c.head_object(Bucket=self.location.bucket, Key=self._key(path))
            )
        except BlobNotFoundError:
            return None

    def _list_page(self, prefix: str, delimiter: str | None, token: str | None, limit: int):
        """One ListObjectsV2 page: (keys, common prefixes, next continuation token or None)."""
        arguments = {"Bucket": self.location.bucket, "Prefix": prefix, "MaxKeys": limit}
        if delimiter:
            arguments["Delimiter"] = delimiter
        if token:
            arguments["ContinuationToken"] = token
        answer = self._request("ListObjectsV2", lambda c: c.list_objects_v2(**arguments))
        keys = [item["Key"] for item in answer.get("Contents", [])]
        directories = [item["Prefix"] for item in answer.get("CommonPrefixes", [])]
        more = answer.get("IsTruncated") and limit > 1
        return keys, directories, answer.get("NextContinuationToken") if more else None

    def _delete_batch(self, path: str, keys: builtins.list[str]) -> None:
        answer = self._request(
            "DeleteObjects",
            lambda c: c.delete_objects(
                Bucket=self.location.bucket, Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True}
            ),
        )
        errors = [e for e in answer.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise StorageError(
                f"delete of {path!r} in {self.location.describe()} failed for {len(errors)} object(s), first "
                f"{first.get('Key')!r}: {first.get('Code')}: {first.get('Message')}"
            )

    def _short(self, path: str, offset: int, length: int | None, size: int) -> ShortReadError:
        return ShortReadError(
            f"read at offset {offset}, length {length}, of {path!r} in {self.location.describe()} is past its end ({size} bytes)"
        )

    def _received(self, n: int) -> None:
        with self._counter_lock:
            self._bytes_received += n

    def client(self) -> Any:
        """The boto3 S3 client (created on first use; thread-safe, shared by every call of this storage)."""
        with self._client_lock:
            if self._client is None:
                self._client = self._new_client()
            return self._client

    def _new_client(self):
        location = self.location
        try:
            session = _session(location.profile)
        except botocore.exceptions.ProfileNotFound:
            raise ConfigError(
                f"AWS profile {location.profile!r} (store {location.describe()}) is not in the AWS config or "
                "credentials files of this process; add it there on the driver and every executor, or drop profile="
            ) from None
        self._session = session
        s3_options = (
            {} if location.path_style is None else {"addressing_style": "path" if location.path_style else "virtual"}
        )
        config = Config(
            s3=s3_options or None,
            retries={"total_max_attempts": 1},  # retried here, with a time bound and typed errors
            connect_timeout=5,
            read_timeout=30,
            max_pool_connections=32,
        )
        return session.client(
            "s3",
            endpoint_url=location.endpoint,
            region_name=location.region or session.region_name or "us-east-1",
            config=config,
        )

    def _request(self, operation: str, call: Callable[[Any], T]) -> T:
        """One attempt of one request; typed errors, or ``_Transient`` for what is worth retrying."""
        client = self.client()
        with self._counter_lock:
            self._requests[operation] += 1
        try:
            return call(client)
        except botocore.exceptions.ClientError as err:
            raise self._client_error(operation, err) from err
        except botocore.exceptions.NoCredentialsError as err:
            raise StorageAccessError(
                f"no AWS credentials found for {self.location.describe()} (looked in {self._credential_source()}): "
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile in the AWS credentials file "
                "(spark.state.s3.profile or ?profile=), or an instance or container role, for the driver and "
                "every executor"
            ) from err
        except (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
            botocore.exceptions.IncompleteReadError,
        ) as err:
            raise _Transient(err, f"{type(err).__name__}: {err}") from err

    def _client_error(self, operation: str, err: botocore.exceptions.ClientError) -> Exception:
        error = err.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        message = error.get("Message") or ""
        detail = f"{operation} answered {status} {code}" + (f": {message}" if message else "")
        if code in _TRANSIENT_CODES or status == 429 or status >= 500:
            return _Transient(err, detail)
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"bucket {self.location.bucket!r} does not exist at {self._endpoint()} (store {self.location.describe()}); "
                "create it, or correct the bucket name or endpoint of the store URI"
            )
        if code in _ACCESS_CODES or status == 403:
            return StorageAccessError(
                f"{self._endpoint()} refused the credentials for {self.location.describe()} ({detail}); they came "
                f"from {self._credential_source()}: check the access key and secret there (on the driver and every "
                "executor), or that they may use this bucket"
            )
        if code in _MISSING_CODES or status == 404:
            return BlobNotFoundError(f"{detail} in {self.location.describe()}")
        if code == "PreconditionFailed" or status == 412:
            return BlobExistsError(f"{detail} in {self.location.describe()}")
        if code == "InvalidRange" or status == 416:
            return ShortReadError(f"{detail} in {self.location.describe()}")
        return StorageError(f"{detail} in {self.location.describe()}")

    def _credential_source(self) -> str:
        return _credential_source(self._session, self.location.profile) if self._session else "the AWS chain"

    def _endpoint(self) -> str:
        return self.location.endpoint or str(self.client().meta.endpoint_url)

    def _retrying(self, op: str, path: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` until it answers, retrying ``_Transient`` failures for ``retry_seconds``; type the rest."""
        started = time.monotonic()
        deadline = started + self.retry_seconds
        attempts = 0
        while True:
            attempts += 1
            try:
                return attempt()
            except _Transient as transient:
                delay = random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_FIRST * 2 ** (attempts - 1)))
                if time.monotonic() + delay >= deadline:
                    raise StorageUnavailableError(
                        f"{op} of {path!r} in {self.location.describe()} failed {attempts} time(s) over "
                        f"{time.monotonic() - started:.1f} s (retried for at most {self.retry_seconds:g} s); last "
                        f"cause: {transient.description}. Check that {self._endpoint()} is up and reachable"
                    ) from transient.cause
                time.sleep(delay)
            except BlobExistsError as err:
                if op == "create":
                    raise BlobExistsError(
                        f"blob {path!r} already exists in {self.location.describe()}; delete it or, for a blob, pass overwrite=True"
                    ) from err
                raise
            except BlobNotFoundError as err:
                if op in ("read", "size"):
                    raise BlobNotFoundError(
                        f"{path!r} does not exist (or is a directory, not a blob) in {self.location.describe()}"
                    ) from err
                raise


def _credential_source(session, profile: str | None) -> str:
    """Where the AWS chain found credentials (its method, the profile), for messages; never the credentials."""
    try:
        credentials = session.get_credentials()
    except botocore.exceptions.BotoCoreError as err:
        return f"the AWS credential chain, which failed: {type(err).__name__}"
    where = f"profile {profile!r}" if profile else "the default AWS credential chain"
    if credentials is None:
        return f"{where} (which found none)"
    return f"{where} (method {getattr(credentials, 'method', 'unknown')!r})"
