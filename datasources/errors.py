"""Typed errors of the ``replayable`` log, source and sink.

Each subclasses the matching spark-state error, so callers that catch
``ConfigError`` or ``StorageError`` catch these too. Messages name the option,
split or file involved and say what to do next.
"""

from __future__ import annotations

from spark_state.errors import (
    CheckpointError,
    ConfigError,
    CorruptBlobError,
    NoCheckpointError,
    StorageError,
    UnsupportedKeyError,
)


class ReplayableOptionError(ConfigError):
    """An option of the ``replayable`` format is unknown, missing or has an invalid value."""


class UnknownOptionError(ReplayableOptionError):
    """An option name is not one the ``replayable`` format knows in this mode."""


class InvalidOffsetsError(ReplayableOptionError):
    """``startingOffsets`` / ``endingOffsets`` (or stored offsets) are not valid offsets JSON."""


class UnsupportedKeyColumnError(ReplayableOptionError, UnsupportedKeyError):
    """The ``keyColumn`` is missing from the data or has a type with no canonical key bytes."""


class LogNotFoundError(ReplayableOptionError, FileNotFoundError):
    """No log exists at the given path (its ``_log.json`` is missing)."""


class IncompatibleLogError(ReplayableOptionError):
    """The data or options disagree with the log's fixed schema or split count."""


class OffsetOutOfRangeError(ReplayableOptionError):
    """Offsets lie past a split's end, or before its earliest retained offset."""


class CorruptLogError(CorruptBlobError):
    """A log file (meta, commit, index snapshot or segment) fails its checksum or does not parse."""


class CorruptSegmentError(CorruptLogError):
    """A segment's bytes do not match the size or CRC-32 its commit recorded (corrupt or truncated)."""


class SegmentMissingError(StorageError):
    """A committed segment is gone: it was trimmed by retention or deleted by hand."""


class CommitContentionError(CheckpointError):
    """An append lost the race for a commit number too many times in a row."""


class StateReaderOptionError(ConfigError):
    """An option of the ``spark-state`` (state reader) format is unknown, missing or has an invalid value."""


class StateCheckpointGoneError(NoCheckpointError):
    """The checkpoint a ``spark-state`` read resolved was cleaned up by its running query while it was read."""


class ClockReadError(ConfigError):
    """``format("spark-state-clock")`` was read on its own: keyed queries join it with their schema."""
