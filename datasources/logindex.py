"""The replayable log's index and its pure planning: no I/O, no pyspark.

Words (see ``datasources.log`` for the file layout and the commit protocol):

- ``split``: one of the log's fixed sub-logs, ``0 <= split < num_splits``.
- ``offset``: a record's position in its split, dense from 0. Ranges are
  half-open: ``[start, end)`` holds ``end - start`` records.
- ``end`` of a split: the offset the next appended record gets (records ever
  appended). ``earliest``: the first offset still stored (> 0 only after a
  trim). Readable offsets are ``earliest <= offset < end``.
- ``segment``: one file holding a contiguous offset range of one split.
- ``commit``: the unit that changes the index; commit ids are dense from 0.

The index after commit ``n`` is ``apply_commit`` folded over commits
``0..n``; everything here is a pure function of an index and its arguments.
"""

from __future__ import annotations

import base64
import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from datasources.errors import CorruptLogError, IncompatibleLogError, OffsetOutOfRangeError, ReplayableOptionError

FORMAT_VERSION = 1
RESERVED_COLUMNS = ("split", "offset")
MAX_SPLITS = 2**16
"""Largest split count (inclusive). A log keeps an index entry per split, so the bound also keeps a damaged or
hostile ``_log.json`` from making a reader allocate billions of them."""
MAX_SEGMENT_ROWS = 2**31 - 1
"""Most records one segment may claim; a commit claiming more is refused before anything is read or allocated."""

Offsets = dict[int, int]
"""Split -> next offset to read (exclusive end of what was read)."""


@dataclass(frozen=True)
class LogMeta:
    """What is fixed for the life of a log: its name, split count and payload schema.

    ``1 <= num_splits <= MAX_SPLITS``.
    """

    name: str
    num_splits: int
    schema: pa.Schema

    def __post_init__(self) -> None:
        if not isinstance(self.num_splits, int) or not 1 <= self.num_splits <= MAX_SPLITS:
            raise IncompatibleLogError(
                f"numSplits must be an integer between 1 and {MAX_SPLITS}, got {self.num_splits!r}"
            )
        clash = [name for name in self.schema.names if name in RESERVED_COLUMNS]
        if clash:
            raise IncompatibleLogError(
                f"columns {clash} are reserved: a replayable log adds 'split' and 'offset' "
                "itself when read; rename them before writing"
            )

    def to_json(self) -> dict:
        """The body of ``_log.json`` (``datasources.log`` frames it with a CRC-32)."""
        return {
            "format": FORMAT_VERSION,
            "name": self.name,
            "numSplits": self.num_splits,
            "schema": base64.b64encode(self.schema.serialize().to_pybytes()).decode("ascii"),
            "schemaText": self.schema.to_string(show_schema_metadata=False),
        }

    @classmethod
    def from_json(cls, raw, where: str) -> LogMeta:
        """Parse a ``to_json`` body; ``CorruptLogError`` naming ``where`` if it is not one."""
        _check_format(raw, where)
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(raw["schema"])))
            return cls(name=raw["name"], num_splits=int(raw["numSplits"]), schema=schema)
        except (ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            raise _unparsable("log metadata", where, exc) from exc


@dataclass(frozen=True, order=True)
class SegmentRef:
    """A committed segment: offsets ``[start, end)`` of ``split`` in file ``path``."""

    split: int
    start: int
    end: int
    path: str
    size: int
    crc32: int

    @property
    def rows(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {
            "split": self.split,
            "start": self.start,
            "end": self.end,
            "path": self.path,
            "size": self.size,
            "crc32": self.crc32,
        }

    @classmethod
    def from_dict(cls, raw: Mapping, where: str = "a log record") -> SegmentRef:
        """Parse; ``CorruptLogError`` for numbers no real segment has (negative, reversed, more rows than
        ``MAX_SEGMENT_ROWS``), so a hostile record cannot drive a reader's allocation."""
        ref = cls(
            int(raw["split"]), int(raw["start"]), int(raw["end"]), str(raw["path"]), int(raw["size"]), int(raw["crc32"])
        )
        if (
            ref.split < 0
            or ref.start < 0
            or not 0 <= ref.end - ref.start <= MAX_SEGMENT_ROWS
            or ref.size < 0
            or not 0 <= ref.crc32 < 2**32
        ):
            raise CorruptLogError(
                f"{where} claims segment {ref.path!r} of split {ref.split} at offsets "
                f"[{ref.start}, {ref.end}), {ref.size} bytes, CRC {ref.crc32}: no segment has these; "
                "restore the record from a copy, or rewrite the log"
            )
        return ref


@dataclass(frozen=True)
class StagedSegment:
    """A segment a writer task wrote but no commit references yet (so it has no offsets).

    ``order`` sorts the segments of one split inside a commit: writers use
    ``(task_partition_id, sequence_number)`` so a split's records keep the
    order of the input partitions.
    """

    split: int
    path: str
    rows: int
    size: int
    crc32: int
    order: tuple[int, int]


@dataclass(frozen=True)
class SinkMark:
    """Identifies a streaming sink's micro-batch: ``batch`` of the sink ``sink_id``."""

    sink_id: str
    batch: int


@dataclass(frozen=True)
class Commit:
    """One commit file: segments appended, or splits trimmed, or both empty for a no-op batch."""

    commit_id: int
    segments: tuple[SegmentRef, ...] = ()
    trims: Mapping[int, int] = field(default_factory=dict)
    sink: SinkMark | None = None

    def to_json(self) -> dict:
        """The body of a commit record (``datasources.log`` writes it through ``spark_state.store.commitlog``)."""
        return {
            "format": FORMAT_VERSION,
            "commit": self.commit_id,
            "segments": [segment.to_dict() for segment in self.segments],
            "trims": {str(split): floor for split, floor in sorted(self.trims.items())},
            "sink": None if self.sink is None else {"id": self.sink.sink_id, "batch": self.sink.batch},
        }

    @classmethod
    def from_json(cls, raw, where: str) -> Commit:
        """Parse a ``to_json`` body; ``CorruptLogError`` naming ``where`` if it is not one."""
        _check_format(raw, where)
        try:
            sink = raw.get("sink")
            return cls(
                commit_id=int(raw["commit"]),
                segments=tuple(SegmentRef.from_dict(s, where) for s in raw["segments"]),
                trims={int(k): int(v) for k, v in raw["trims"].items()},
                sink=None if sink is None else SinkMark(str(sink["id"]), int(sink["batch"])),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _unparsable("commit", where, exc) from exc


@dataclass(frozen=True)
class SplitIndex:
    """The segments of one split; they are contiguous and cover ``[earliest, end)`` exactly."""

    earliest: int = 0
    end: int = 0
    segments: tuple[SegmentRef, ...] = ()

    def segment_ends(self) -> list[int]:
        return [segment.end for segment in self.segments]

    def overlapping(self, start: int, end: int, ends: list[int] | None = None) -> tuple[SegmentRef, ...]:
        """The segments holding any offset of ``[start, end)``; ``earliest <= start <= end <= self.end``.

        ``ends`` may pass ``segment_ends()`` in, when the caller asks many times.
        """
        if start >= end:
            return ()
        first = bisect.bisect_right(self.segment_ends() if ends is None else ends, start)
        out = []
        for segment in self.segments[first:]:
            if segment.start >= end:
                break
            out.append(segment)
        return tuple(out)


@dataclass(frozen=True)
class LogIndex:
    """The state of the log after commit ``commit_id`` (-1: no commit yet)."""

    commit_id: int
    splits: tuple[SplitIndex, ...]
    sinks: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_splits: int) -> LogIndex:
        return cls(commit_id=-1, splits=tuple(SplitIndex() for _ in range(num_splits)))

    @property
    def num_splits(self) -> int:
        return len(self.splits)

    def end_offsets(self) -> Offsets:
        return {split: s.end for split, s in enumerate(self.splits)}

    def earliest_offsets(self) -> Offsets:
        return {split: s.earliest for split, s in enumerate(self.splits)}

    def to_json(self) -> dict:
        """The body of an index snapshot (``datasources.log`` writes it through ``spark_state.store.commitlog``)."""
        return {
            "format": FORMAT_VERSION,
            "commit": self.commit_id,
            "earliest": [s.earliest for s in self.splits],
            "end": [s.end for s in self.splits],
            "segments": [seg.to_dict() for s in self.splits for seg in s.segments],
            "sinks": dict(sorted(self.sinks.items())),
        }

    @classmethod
    def from_json(cls, raw, where: str) -> LogIndex:
        """Parse a ``to_json`` body; ``CorruptLogError`` naming ``where`` if it is not one."""
        _check_format(raw, where)
        try:
            earliest, end = [int(e) for e in raw["earliest"]], [int(e) for e in raw["end"]]
            if len(earliest) != len(end):
                raise CorruptLogError(
                    f"index snapshot {where} has {len(earliest)} earliest offsets for {len(end)} splits"
                )
            by_split: list[list[SegmentRef]] = [[] for _ in end]
            for seg in raw["segments"]:
                ref = SegmentRef.from_dict(seg, where)
                if not 0 <= ref.split < len(end):
                    raise CorruptLogError(
                        f"index snapshot {where} puts segment {ref.path} in split {ref.split}, "
                        f"it has splits 0..{len(end) - 1}"
                    )
                by_split[ref.split].append(ref)
            splits = tuple(SplitIndex(e, n, tuple(segs)) for e, n, segs in zip(earliest, end, by_split))
            return cls(int(raw["commit"]), splits, {str(k): int(v) for k, v in raw["sinks"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _unparsable("index snapshot", where, exc) from exc


@dataclass(frozen=True)
class ReadTask:
    """Offsets ``[start, end)`` of ``split`` and the segments that hold them (in offset order)."""

    split: int
    start: int
    end: int
    segments: tuple[SegmentRef, ...]


def position_schema(payload: pa.Schema) -> pa.Schema:
    """The schema of rows read from a log: the payload, then ``split`` (int32) and ``offset`` (int64)."""
    return payload.append(pa.field("split", pa.int32(), nullable=False)).append(
        pa.field("offset", pa.int64(), nullable=False)
    )


def _unparsable(what: str, where: str, exc: Exception) -> CorruptLogError:
    """The error for a ``what`` file at ``where`` whose JSON lacks a field or has one of the wrong type."""
    return CorruptLogError(
        f"cannot parse {what} {where} ({type(exc).__name__}: {exc}): it is damaged or was written by "
        "something else; restore it from a copy, or rewrite the log"
    )


def _check_format(raw, where: str) -> None:
    """Raise ``CorruptLogError`` naming ``where`` unless ``raw`` is a JSON object of ``FORMAT_VERSION``."""
    if not isinstance(raw, Mapping) or "format" not in raw:
        raise CorruptLogError(
            f"{where} is not a replayable log file (no format field): it was damaged or written by "
            "something else; restore it from a copy, or rewrite the log"
        )
    version = raw["format"]
    if version != FORMAT_VERSION:
        raise CorruptLogError(
            f"{where} has format {version!r}, this code reads format {FORMAT_VERSION}: "
            "upgrade spark-state or point at a log written by this version"
        )


# ---------------------------------------------------------------------------
# Pure planning
# ---------------------------------------------------------------------------


def plan_append(
    index: LogIndex, staged: Iterable[StagedSegment], commit_id: int | None = None, sink: SinkMark | None = None
) -> Commit:
    """Give staged segments offsets that continue each split's end; empty segments are dropped.

    Segments of one split are laid out in ``order``; the result is the commit
    that would follow ``index`` (``commit_id`` defaults to ``index.commit_id + 1``).
    """
    ends = [s.end for s in index.splits]
    refs = []
    for seg in sorted(staged, key=lambda s: (s.split, s.order)):
        if not 0 <= seg.split < index.num_splits:
            raise IncompatibleLogError(
                f"segment {seg.path} is for split {seg.split}, the log has splits 0..{index.num_splits - 1}"
            )
        if seg.rows == 0:
            continue
        start = ends[seg.split]
        ends[seg.split] = start + seg.rows
        refs.append(SegmentRef(seg.split, start, start + seg.rows, seg.path, seg.size, seg.crc32))
    return Commit(index.commit_id + 1 if commit_id is None else commit_id, tuple(refs), {}, sink)


def plan_trim(index: LogIndex, floors: Mapping[int, int]) -> tuple[dict[int, int], list[SegmentRef]]:
    """What trimming to ``floors`` (split -> first offset that must stay) removes.

    Only whole segments go: the new earliest of a split is the end of its last
    segment that lies entirely below the floor. Returns ``(trims, dropped)``;
    ``trims`` holds only the splits whose earliest advances.
    """
    trims: dict[int, int] = {}
    dropped: list[SegmentRef] = []
    for split, floor in sorted(floors.items()):
        if not 0 <= split < index.num_splits:
            raise OffsetOutOfRangeError(f"cannot trim split {split}: the log has splits 0..{index.num_splits - 1}")
        current = index.splits[split]
        gone = [seg for seg in current.segments if seg.end <= floor]
        if gone:
            trims[split] = gone[-1].end
            dropped.extend(gone)
    return trims, dropped


def apply_commit(index: LogIndex, commit: Commit, where: str = "commit") -> LogIndex:
    """The index after ``commit``; raises ``CorruptLogError`` if the commit does not follow ``index``."""
    if commit.commit_id != index.commit_id + 1:
        raise CorruptLogError(f"{where} has id {commit.commit_id}, expected {index.commit_id + 1}")
    splits = list(index.splits)
    added: dict[int, list[SegmentRef]] = {}
    ends = [s.end for s in splits]
    for seg in commit.segments:
        if not 0 <= seg.split < len(splits):
            raise CorruptLogError(f"{where} names split {seg.split}, the log has {len(splits)} splits")
        if seg.start != ends[seg.split] or seg.end <= seg.start:
            raise CorruptLogError(
                f"{where} puts {seg.path} at offsets [{seg.start}, {seg.end}) of split {seg.split}, "
                f"whose end is {ends[seg.split]}"
            )
        ends[seg.split] = seg.end
        added.setdefault(seg.split, []).append(seg)
    for split, segments in added.items():
        current = splits[split]
        splits[split] = SplitIndex(current.earliest, ends[split], current.segments + tuple(segments))
    for split, floor in commit.trims.items():
        if not 0 <= split < len(splits):
            raise CorruptLogError(f"{where} trims split {split}, the log has {len(splits)} splits")
        if not 0 <= floor <= splits[split].end:
            raise CorruptLogError(
                f"{where} trims split {split} to offset {floor}, outside [0, {splits[split].end}] (its end)"
            )
        current = splits[split]
        kept = tuple(seg for seg in current.segments if seg.end > floor)
        splits[split] = SplitIndex(max(current.earliest, floor), current.end, kept)
    sinks = index.sinks
    if commit.sink is not None:
        sinks = {**sinks, commit.sink.sink_id: commit.sink.batch}
    return LogIndex(commit.commit_id, tuple(splits), sinks)


def check_offsets(index: LogIndex, offsets: Mapping[int, int], what: str) -> None:
    """Raise ``OffsetOutOfRangeError`` unless every split has ``earliest <= offset <= end``.

    ``what`` names where the offsets came from (an option name, a batch) for the message.
    """
    if set(offsets) != set(range(index.num_splits)):
        raise OffsetOutOfRangeError(
            f"{what} names splits {sorted(offsets)}, the log has splits 0..{index.num_splits - 1}"
        )
    for split, offset in sorted(offsets.items()):
        current = index.splits[split]
        if offset > current.end:
            raise OffsetOutOfRangeError(
                f"{what}: offset {offset} of split {split} is past the split's end {current.end}; "
                "use offsets the log has reached (or 'latest')"
            )
        if offset < current.earliest:
            raise OffsetOutOfRangeError(
                f"{what}: offset {offset} of split {split} was trimmed (earliest retained is "
                f"{current.earliest}); start from 'earliest' or keep more with the retention option"
            )


def plan_reads(index: LogIndex, start: Mapping[int, int], end: Mapping[int, int], max_records: int) -> list[ReadTask]:
    """Cut ``[start[s], end[s])`` of every split into read tasks of at most ``max_records`` records.

    Cuts fall on segment boundaries when one lies inside the allowed span, so a
    segment is usually read by one task; a segment larger than ``max_records``
    is cut inside. Tasks come split by split, in offset order.
    """
    if max_records < 1:
        raise ReplayableOptionError(f"option maxRecordsPerPartition={max_records} must be >= 1")
    check_offsets(index, start, "start offsets")
    check_offsets(index, end, "end offsets")
    tasks = []
    for split in range(index.num_splits):
        a, b = start[split], end[split]
        if b < a:
            raise OffsetOutOfRangeError(f"end offset {b} of split {split} is before its start {a}")
        current = index.splits[split]
        ends = current.segment_ends()
        while a < b:
            limit = min(b, a + max_records)
            i = bisect.bisect_right(ends, limit) - 1
            cut = ends[i] if i >= 0 and ends[i] > a else limit
            tasks.append(ReadTask(split, a, cut, current.overlapping(a, cut, ends)))
            a = cut
    return tasks
