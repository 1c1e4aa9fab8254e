"""What a ``replayable`` read does, without Spark: resolve offsets, plan tasks, read rows, trim.

``LogSource`` reads a log, ``GeneratorSource`` the generator; both offer the
same methods, which ``datasources.replayable`` wires to Spark's reader APIs.
Sources are pickled to Spark's Python workers: they hold only the URI, the log
metadata and the parsed options; storage handles are opened lazily per process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import pyarrow as pa

from datasources.errors import InvalidOffsetsError, OffsetOutOfRangeError, ReplayableOptionError
from datasources.generator import GeneratorSpec, generate
from datasources.log import DEFAULT_ORPHAN_GRACE_SECONDS, ReplayableLog, SegmentCache
from datasources.logindex import LogMeta, Offsets, ReadTask, check_offsets, plan_reads
from datasources.options import ReadOptions, log_source_id, offsets_from_json

_STORAGES: dict = {}
_SEGMENT_CACHE = SegmentCache()
"""Per-process: Spark reuses Python workers, so consecutive tasks share decoded segments."""


def open_log_storage(uri: str):
    """The ``Storage`` for ``uri``, one per URI per process."""
    storage = _STORAGES.get(uri)
    if storage is None:
        from spark_state.storage import open_storage

        storage = _STORAGES[uri] = open_storage(uri)
    return storage


def checkpoint_offsets(state_store: str, source_id: str, checkpoint_id: int | None = None) -> Offsets | None:
    """The offsets of ``source_id`` in the latest consistent checkpoint of ``state_store`` (or in retained
    checkpoint ``checkpoint_id``); None if it has none."""
    from spark_state.store.manifestlog import checkpoint_source_offsets, latest_source_offsets

    if checkpoint_id is None:
        raw, which = latest_source_offsets(state_store, source_id), "the latest checkpoint"
    else:
        raw, which = checkpoint_source_offsets(state_store, source_id, checkpoint_id), f"checkpoint {checkpoint_id}"
    if raw is None:
        return None
    return offsets_from_json(raw, f"the offsets of {source_id} in {which} of {state_store}", source_id=source_id)


def retained_checkpoint_offsets(state_store: str, source_id: str) -> list[Offsets]:
    """The offsets of ``source_id`` in every retained checkpoint of ``state_store``."""
    from spark_state.store.manifestlog import retained_source_offsets

    return [
        offsets_from_json(
            raw, f"the offsets of {source_id} in a retained checkpoint of {state_store}", source_id=source_id
        )
        for raw in retained_source_offsets(state_store, source_id)
    ]


def retention_floors(end: Mapping[int, int], retention: int, retained: list[Offsets] | None) -> Offsets | None:
    """Split -> first offset to keep after a batch ending at ``end`` committed.

    Keeps ``retention`` records below ``end``; when a state store is set
    (``retained`` not None) never goes below any retained checkpoint's offsets,
    and trims nothing while the store has no checkpoint (a restore would then
    start from the earliest offsets).
    """
    floors = {split: max(0, offset - retention) for split, offset in end.items()}
    if retained is None:
        return floors
    if not retained:
        return None
    for offsets in retained:
        for split in floors:
            floors[split] = min(floors[split], offsets.get(split, 0))
    return floors


def _log_uri(options: ReadOptions) -> str:
    """The log a read names: set by ``parse_read_options`` for every read that is not a generator's."""
    assert options.uri is not None, "a log read: parse_read_options set options.uri"
    return options.uri


class LogSource:
    """Reads a replayable log; ``options.uri`` is set."""

    kind = "log"

    def __init__(self, options: ReadOptions, meta: LogMeta) -> None:
        self.options = options
        self.meta = meta
        self._log: ReplayableLog | None = None

    @classmethod
    def open(cls, options: ReadOptions) -> LogSource:
        """Open the log named by the options (``LogNotFoundError`` if there is none)."""
        log = ReplayableLog.open(open_log_storage(_log_uri(options)))
        source = cls(options, log.meta)
        source._log = log
        return source

    def __getstate__(self) -> dict:
        return {"options": self.options, "meta": self.meta, "_log": None}

    @property
    def log(self) -> ReplayableLog:
        if self._log is None:
            self._log = ReplayableLog(open_log_storage(_log_uri(self.options)), self.meta, _SEGMENT_CACHE)
        return self._log

    @property
    def source_id(self) -> str:
        return log_source_id(_log_uri(self.options))

    @property
    def num_splits(self) -> int:
        return self.meta.num_splits

    @property
    def payload_schema(self) -> pa.Schema:
        return self.meta.schema

    def earliest(self) -> Offsets:
        return self.log.index().earliest_offsets()

    def latest(self, start: Mapping[int, int] | None = None) -> Offsets:
        """The log's end offsets now (``start`` is ignored; the generator uses it)."""
        return self.log.index().end_offsets()

    def available_now_target(self) -> Offsets:
        """Where a ``trigger(availableNow=True)`` run stops: the log's end now."""
        return self.latest()

    def starting_offsets(self) -> Offsets:
        """Resolve ``startingOffsets`` against the log now; ``OffsetOutOfRangeError`` if outside it."""
        spec = self.options.starting
        index = self.log.index()
        if spec.kind == "checkpoint":
            state_store = self.options.state_store
            assert state_store, "parse_read_options requires stateStore with startingOffsets=checkpoint"
            offsets = checkpoint_offsets(state_store, self.source_id, spec.checkpoint_id)
            if offsets is None:
                return index.earliest_offsets()
            check_offsets(index, offsets, f"the latest checkpoint of state store {self.options.state_store}")
            return offsets
        offsets = spec.resolve(index.earliest_offsets(), index.end_offsets())
        check_offsets(index, offsets, f"option {spec.option}")
        return offsets

    def ending_offsets(self) -> Offsets:
        """Resolve ``endingOffsets`` (batch reads) against the log now."""
        index = self.log.index()
        offsets = self.options.ending.resolve(index.earliest_offsets(), index.end_offsets())
        check_offsets(index, offsets, "option endingOffsets")
        return offsets

    def plan(self, start: Mapping[int, int], end: Mapping[int, int]) -> list[ReadTask]:
        """Read tasks for ``[start, end)``; refreshes the index only if ``end`` is past what it knows."""
        index = self.log.index(refresh=False)
        if any(end[s] > index.splits[s].end for s in end if s < index.num_splits):
            index = self.log.index()
        return plan_reads(index, start, end, self.options.max_records_per_partition)

    def read(self, task: ReadTask, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
        return self.log.read(task, schema)

    def commit(self, end: Mapping[int, int]) -> None:
        """Trim what the retention option allows once a batch ending at ``end`` is committed.

        After a trim, collect garbage under ``data/`` with the default grace period.
        """
        if self.options.retention is None:
            return
        retained = None
        if self.options.state_store:
            retained = retained_checkpoint_offsets(self.options.state_store, self.source_id)
        floors = retention_floors(end, self.options.retention, retained)
        if floors and self.log.trim(floors) is not None:
            self.log.collect_garbage_after_commit(DEFAULT_ORPHAN_GRACE_SECONDS)


class GeneratorSource:
    """Reads the generator; ``options.generator`` is set."""

    kind = "generator"
    source_id = None
    """Generator offsets carry no source id: state checkpoints cannot resume a generator by id."""

    def __init__(self, options: ReadOptions) -> None:
        assert options.generator is not None, "a generator read: parse_read_options set options.generator"
        self.options = options
        self.spec: GeneratorSpec = options.generator
        self._clock: tuple[float, Offsets] | None = None

    def __getstate__(self) -> dict:
        return {"options": self.options, "spec": self.spec, "_clock": None}

    @property
    def num_splits(self) -> int:
        return self.spec.num_splits

    @property
    def payload_schema(self) -> pa.Schema:
        return self.spec.schema()

    def earliest(self) -> Offsets:
        return {split: 0 for split in range(self.num_splits)}

    def latest(self, start: Mapping[int, int] | None = None) -> Offsets:
        """What the generator has produced so far; the clock starts at the first call (at ``start``)."""
        if self._clock is None:
            self._clock = (time.monotonic(), dict(start) if start is not None else self.earliest())
        started, base = self._clock
        return self.spec.available(base, time.monotonic() - started)

    def available_now_target(self) -> Offsets:
        """Where a ``trigger(availableNow=True)`` run stops: every row of a bounded generator."""
        limit = self.spec.rows_per_split
        if limit is None:  # not ``spec.bounded``
            raise ReplayableOptionError("trigger(availableNow=True) needs a bounded generator: set option rowsPerSplit")
        return {split: limit for split in range(self.num_splits)}

    def starting_offsets(self) -> Offsets:
        offsets = self.options.starting.resolve(self.earliest(), self.latest())
        self._check(offsets, "option startingOffsets")
        return offsets

    def ending_offsets(self) -> Offsets:
        if not self.spec.bounded and self.options.ending.kind != "explicit":
            raise InvalidOffsetsError(
                "an unbounded generator has no 'latest' end for a batch read: set option rowsPerSplit, "
                "or give option endingOffsets as JSON"
            )
        offsets = self.options.ending.resolve(self.earliest(), self.latest())
        self._check(offsets, "option endingOffsets")
        return offsets

    def _check(self, offsets: Mapping[int, int], what: str) -> None:
        if set(offsets) != set(range(self.num_splits)):
            raise OffsetOutOfRangeError(
                f"{what} names splits {sorted(offsets)}, the generator has 0..{self.num_splits - 1}"
            )
        limit = self.spec.rows_per_split  # None: unbounded
        for split, offset in offsets.items():
            if limit is not None and offset > limit:
                raise OffsetOutOfRangeError(
                    f"{what}: offset {offset} of split {split} is past the generator's end {self.spec.rows_per_split} "
                    "(option rowsPerSplit)"
                )

    def plan(self, start: Mapping[int, int], end: Mapping[int, int]) -> list[ReadTask]:
        self._check(start, "start offsets")
        self._check(end, "end offsets")
        step = self.options.max_records_per_partition
        tasks = []
        for split in range(self.num_splits):
            if end[split] < start[split]:
                raise OffsetOutOfRangeError(
                    f"end offset {end[split]} of split {split} is before its start {start[split]}"
                )
            for lo in range(start[split], end[split], step):
                tasks.append(ReadTask(split, lo, min(end[split], lo + step), ()))
        return tasks

    def read(self, task: ReadTask, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
        return generate(self.spec, task.split, task.start, task.end, schema)

    def commit(self, end: Mapping[int, int]) -> None:
        """Nothing to trim: generated rows are never stored."""


def open_source(options: ReadOptions) -> LogSource | GeneratorSource:
    return GeneratorSource(options) if options.generator is not None else LogSource.open(options)


def parse_spark_offsets(raw, source, what: str) -> Offsets:
    """Offsets Spark hands back (from its offset log): this source's, naming exactly its splits."""
    offsets = offsets_from_json(raw, what, source_id=source.source_id)
    if set(offsets) != set(range(source.num_splits)):
        raise InvalidOffsetsError(
            f"{what} names splits {sorted(offsets)}, the source has 0..{source.num_splits - 1}: the query's "
            "checkpoint belongs to a different log or generator configuration; use a new checkpointLocation"
        )
    return offsets
