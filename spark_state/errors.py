"""Typed errors of spark-state.

Every error says what happened and what the operator should do next, and
never repeats a secret the user typed (``SparkStateError``). Errors
that come from bad configuration or bad arguments also subclass ``ValueError``
so that generic callers can catch them as such.
"""

from __future__ import annotations

import re

from spark_state.redaction import redact


class SparkStateError(Exception):
    """Base class of every error raised by spark-state. Its message never holds what may be a secret: user
    information in a URI, a secret-looking parameter's value (``redaction``), however the message was made."""

    def __init__(self, *args):
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


class ConfigError(SparkStateError, ValueError):
    """A setting or argument is invalid; the message names it and the valid range."""


class NotAStoreError(ConfigError):
    """A command named a location that holds no spark-state store (a mistyped path, a file)."""


class InvalidParallelismError(ConfigError):
    """A parallelism, max parallelism, instance index or key group is out of range."""


class UnsupportedKeyError(ConfigError, TypeError):
    """A key has a type that has no canonical encoding for hashing."""


class UnsupportedOverConnectError(ConfigError):
    """What a query asks for cannot work over Spark Connect; the message says why and what to do instead."""


class StorageError(SparkStateError):
    """A storage backend failed; the message names the path and the backend."""


class StoreLinkError(StorageError):
    """A path in a local store leads through a symbolic link, which a store never follows; nothing was read or
    changed. The message names the link: remove it."""


class StorageTimeoutError(StorageError):
    """A storage call did not finish within its timeout; whether it took effect is unknown."""


class CommitFailedError(StorageError):
    """A commit record could not be written; nothing was committed, and retrying the batch is safe."""


class InvalidPathError(StorageError, ValueError):
    """A storage path is not a clean relative path ('a/b/c', no '..', no leading '/')."""


class BlobExistsError(StorageError, FileExistsError):
    """``create`` was asked not to overwrite, and the path already exists."""


class BlobNotFoundError(StorageError, FileNotFoundError):
    """The path does not exist in the storage backend."""


class StorageUnavailableError(StorageError):
    """A storage backend kept failing transiently (throttling, 5xx, connection refused or reset) for longer
    than its retry bound; the message names the path, how long it tried and the last cause."""


class StorageAccessError(StorageError):
    """The storage refused the credentials, or found none: the message says which, never the secret."""


class BucketNotFoundError(StorageError):
    """The bucket (or container) a store URI names does not exist; no object in it can be read or written.

    Not a ``BlobNotFoundError``: a missing bucket is a misconfiguration, never "no checkpoint yet".
    """


class ShortReadError(StorageError):
    """A ranged read asked for bytes past the end of the blob."""


class CorruptBlobError(StorageError):
    """Stored bytes fail their checksum or do not parse; never returned as state."""


class MissingFileError(CorruptBlobError):
    """A file that a committed record references is gone; the message names it and the way to recover."""


class CheckpointError(SparkStateError):
    """The checkpoint protocol was violated (for example committing an id twice)."""


class NoCheckpointError(CheckpointError):
    """No committed checkpoint exists where one was required."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint cannot be restored as asked (key space, hash or format changed)."""


class KeyGroupOwnershipError(SparkStateError):
    """A row reached an instance that does not own its key group (routing disagrees with the store)."""


class AggregateOverflowError(SparkStateError, ArithmeticError):
    """A built-in sum left its 64-bit integer state's range for some key; the batch fails, the state unchanged."""


class KeyGroupNotLoadedError(SparkStateError):
    """A task touched a key group whose state it evicted and did not load again (a defect of spark-state).

    Raised instead of reading an evicted key group as empty, which would
    lose its state; the task fails and nothing it wrote is committed.
    """


class StateQueryMismatchError(CheckpointError):
    """The state store and Spark's checkpoint disagree about where the query is; nothing was run or committed.

    Running the batch would count some input twice or lose some updates, so
    the query stops instead. The message says what differs and how to recover.
    """


class StateBehindQueryError(StateQueryMismatchError):
    """Spark committed micro-batches whose state checkpoints are not in the store (a lost record)."""


class StateMissingError(StateQueryMismatchError):
    """The query committed micro-batches, but the state store holds no checkpoint at all."""


class StateOfAnotherQueryError(StateQueryMismatchError):
    """The store holds another query's state, and this query's sources do not continue from its offsets."""


class StoreOwnedByAnotherQueryError(StateOfAnotherQueryError):
    """Another query committed to this state store while this one ran: it owns the store, this query stops.

    Nothing of this query's batch was committed; its written blobs are
    unreferenced and collected by the owner's cleanup.
    """


class CheckpointLocationError(CheckpointError):
    """Spark's checkpoint location holds files that neither Spark nor spark-state can start from."""


class IncompatibleSchemaError(IncompatibleCheckpointError):
    """A query's state schema cannot read the stored one (a key column changed, a type narrowed or changed).

    ``component``, ``column``, ``old_type`` and ``new_type`` name what differs
    (a type is None where the column does not exist on that side).
    """

    def __init__(self, message: str, *, component: str, column: str, old_type: str | None, new_type: str | None):
        super().__init__(message)
        self.component = component
        self.column = column
        self.old_type = old_type
        self.new_type = new_type


class SavepointError(CheckpointError):
    """A savepoint cannot be created, read, deleted or started from as asked."""


class SavepointNotFoundError(SavepointError):
    """No savepoint of that name exists in the store."""


class SavepointExistsError(SavepointError):
    """A savepoint of that name already exists; names are never reused."""


class SavepointMismatchError(SavepointError, IncompatibleCheckpointError):
    """A query cannot start from a savepoint: its plan (components, keys, schemas, key space) does not fit."""


def typed_error(error: BaseException) -> SparkStateError | None:
    """The typed error of ours that ``error`` carries, or None: ``error`` itself or one it was raised from, or the
    one Spark wrapped into it (a ``StreamingQueryException`` or a task's ``PythonException``, which hold only its
    text: the error is made again from its class and message, the Spark error its ``__cause__``).

    ``except StreamingQueryException as e: if isinstance(typed_error(e), CorruptBlobError): ...``
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, SparkStateError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    matches = _TYPED.findall(str(error))
    if not matches:
        return None
    module, name, message = matches[-1]  # a traceback prints the error raised last at its end
    import importlib

    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, SparkStateError)):
        return None
    made = cls.__new__(cls)
    Exception.__init__(made, message.strip())
    made.__cause__ = error
    return made


_TYPED = re.compile(r"\b(spark_state\.errors|datasources\.errors)\.([A-Z]\w*): ([^\n]*)")
