"""A log of numbered commit records: ``<directory>/<N:020d>.json``, each created once, atomically, checksummed.

The one implementation behind every log of commits in the project: the state
store's checkpoint manifests (``checkpoints/``) and the ``replayable`` log's
commits (``_commits/``), as Spark's ``HDFSMetadataLog`` serves its offsets,
commits and sink logs alike.

- ``create(n, body)`` is the commit point of record ``n``: one atomic
  ``Storage.create`` without overwrite, so of two racing writers of the same
  ``n`` exactly one succeeds and the other gets ``BlobExistsError``. A record
  is never rewritten. When the create fails otherwise, its outcome may be
  unknown; ``create`` reads the path back to settle it: its own complete
  record there means committed (it returns); nothing there means not
  committed; a strict prefix of its own record (a truncated upload on a store
  that broke atomicity) is deleted, then not committed
  (``CommitFailedError``); another record there is another writer's
  (``BlobExistsError``).
- Every record is framed as ``{"crc32": C, "body": "<JSON text>"}`` with
  ``C`` the CRC-32 of the UTF-8 body text; ``load`` verifies it and raises
  ``CorruptBlobError`` naming the file on any mismatch, truncation or
  malformed JSON, so a damaged record is never read as a commit. Logs
  written before framing existed (``accept_unframed=True``) may hold plain
  JSON objects; those are read unchecked.
- ``ids()`` and ``latest_id()`` list the directory: discovery only. Which
  records exist is what the list says; what a record holds is only what
  ``load`` verified.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from spark_state.errors import BlobExistsError, BlobNotFoundError, CommitFailedError, CorruptBlobError, StorageError
from spark_state.storage.base import Storage, join

ID_DIGITS = 20
SUFFIX = ".json"


def encode_record(body: Any) -> bytes:
    """The framed bytes of ``body`` (canonical JSON, keys sorted) with its CRC-32."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"crc32": zlib.crc32(text.encode()), "body": text}).encode()


def decode_record(data: bytes, where: str, *, accept_unframed: bool = False) -> Any:
    """The body of framed record bytes; ``CorruptBlobError`` naming ``where`` unless they verify."""
    try:
        outer = json.loads(data)
    except RecursionError as exc:
        raise CorruptBlobError(f"{where} nests JSON too deeply to be a record") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptBlobError(f"{where} is not a readable record (truncated or overwritten?): {exc}") from exc
    if isinstance(outer, dict) and ("crc32" in outer or "body" in outer):
        if set(outer) != {"crc32", "body"}:
            raise CorruptBlobError(
                f"{where} has a damaged frame (keys {sorted(outer)}); it was changed after it was written"
            )
        text = outer["body"]
        if not isinstance(text, str) or zlib.crc32(text.encode()) != outer["crc32"]:
            raise CorruptBlobError(f"{where} fails its checksum: it was changed or damaged after it was written")
        try:
            return json.loads(text)
        except RecursionError as exc:
            raise CorruptBlobError(f"{where} nests JSON too deeply to be a record") from exc
        except ValueError as exc:
            raise CorruptBlobError(f"{where} has a valid checksum over malformed JSON: {exc}") from exc
    if accept_unframed and isinstance(outer, dict):
        return outer
    raise CorruptBlobError(f"{where} is not a checksummed record; it was not written by spark-state")


class CommitLog:
    """Numbered records under ``directory`` of ``storage``; see the module docstring.

    ``what`` names a record in messages ("checkpoint", "log commit").
    """

    def __init__(self, storage: Storage, directory: str, *, what: str = "record", accept_unframed: bool = False):
        self.storage = storage
        self.directory = directory
        self.what = what
        self.accept_unframed = accept_unframed

    def path(self, n: int) -> str:
        """The storage path of record ``n`` (``0 <= n``)."""
        return join(self.directory, f"{n:0{ID_DIGITS}d}{SUFFIX}")

    def where(self, n: int) -> str:
        """Record ``n``'s full URI, for messages."""
        return f"{self.storage.describe(self.path(n))}"

    def create(self, n: int, body: Any) -> int:
        """Commit record ``n``; return its size in bytes. ``BlobExistsError`` if it exists (another writer won ``n``)."""
        data = encode_record(body)
        try:
            self.storage.create(self.path(n), data)
        except BlobExistsError:
            raise BlobExistsError(f"{self.what} {n} already exists at {self.where(n)}") from None
        except StorageError as exc:
            self._settle(n, data, exc)
        return len(data)

    def _settle(self, n: int, data: bytes, failure: StorageError) -> None:
        """After a failed create of record ``n``: return if ``data`` is committed, else raise (module docstring)."""
        try:
            found = self.storage.read(self.path(n))
        except BlobNotFoundError:
            raise CommitFailedError(
                f"{self.what} {n} was not committed ({failure}); nothing was written at {self.where(n)}, so "
                "retrying is safe"
            ) from failure
        except StorageError as exc:
            raise CommitFailedError(
                f"{self.what} {n} at {self.where(n)} may or may not be committed: the create failed ({failure}) and "
                f"reading it back failed too ({exc}). Restart once the storage answers: if the record is there "
                "but fails its checksum, it is a partial upload of a commit that never happened; delete it"
            ) from failure
        if found == data:
            return
        if len(found) < len(data) and data.startswith(found):
            self.storage.delete(self.path(n))
            raise CommitFailedError(
                f"{self.what} {n} was not committed ({failure}); the storage left {len(found)} of its {len(data)} "
                f"bytes at {self.where(n)}, which were deleted, so retrying is safe"
            ) from failure
        raise BlobExistsError(f"{self.what} {n} already exists at {self.where(n)} (written by another writer)")

    def load(self, n: int) -> Any:
        """The verified body of record ``n``; ``BlobNotFoundError`` if there is none."""
        return self.load_sized(n)[0]

    def load_sized(self, n: int) -> tuple[Any, int]:
        """``load(n)`` and the record's size in bytes."""
        data = self.storage.read(self.path(n))
        return decode_record(data, self.where(n), accept_unframed=self.accept_unframed), len(data)

    def load_if_exists(self, n: int) -> Any | None:
        """``load(n)``, or None when record ``n`` does not exist."""
        try:
            return self.load(n)
        except BlobNotFoundError:
            return None

    def ids(self) -> list[int]:
        """Ids of the records present, ascending (a listing: discovery only)."""
        ids = []
        for name in self.storage.list(self.directory):
            stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
            if len(stem) == ID_DIGITS and stem.isdigit():
                ids.append(int(stem))
        return sorted(ids)

    def latest_id(self) -> int | None:
        """The highest id present, or None."""
        ids = self.ids()
        return ids[-1] if ids else None

    def delete(self, n: int) -> None:
        """Remove record ``n`` (retention and cleanup only); a missing record is not an error."""
        self.storage.delete(self.path(n))
