"""The ``replayable`` Spark data source: the Spark edge of ``datasources.log`` and friends.

Use it by name in any session once spark-state is installed (``pyspark_replayable``
registers it)::

    df.write.format("replayable").mode("append").option("path", p).option("keyColumn", "user").save()
    spark.readStream.format("replayable").option("path", p).option("maxRecordsPerBatch", 100_000).load()

Rows read carry the payload columns plus ``split`` (int) and ``offset`` (long).
Offsets are ``{"<split>": <next offset>}``. See ``datasources.options`` for the
options and ``datasources.log`` for the format and commit protocol.

When each method runs (Spark 4.x):

- ``schema()`` / ``reader()`` / ``streamReader()`` / ``writer()``: on the driver
  when the query is analysed or started; option and path errors surface here.
- ``DataSourceStreamReader.latestOffset``/``partitions``/``commit``: in one
  long-lived driver-side Python process per query. ``commit(end)`` for batch N
  arrives when batch N+1 is planned; ``stop()`` may never be called.
- ``read()`` / ``write()``: in executor Python workers; the reader or writer
  object is pickled there, so it carries only URIs, metadata and options.
- ``DataSourceStreamWriter.commit``: on the driver, with a fresh writer each batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import IntegerType, LongType, StructField, StructType

from datasources.errors import IncompatibleLogError, ReplayableOptionError, UnsupportedKeyColumnError
from datasources.log import ReplayableLog, writer_directory
from datasources.logindex import LogMeta, SinkMark, StagedSegment
from datasources.options import (
    ANY_READ,
    DEFAULT_NUM_SPLITS,
    READ,
    STREAM_READ,
    STREAM_WRITE,
    WRITE,
    WriteOptions,
    admit,
    log_source_id,
    normalize_log_uri,
    offsets_to_json,
    parse_read_options,
    parse_write_options,
)
from datasources.routing import is_key_type, route_batch, splits_of_keys
from datasources.sources import open_log_storage, open_source, parse_spark_offsets

__all__ = ["ReplayableDataSource", "log_source_id", "normalize_log_uri"]

ARROW_TIMEZONE = "UTC"
"""Spark checks Python-source batches against ``to_arrow_schema(schema, timezone="UTC")``."""


def spark_schema(payload: pa.Schema) -> StructType:
    """The Spark schema of rows read: payload columns, then ``split`` int and ``offset`` long (not null).

    ``IncompatibleLogError`` if a payload column has an Arrow type Spark cannot read.
    """
    try:
        fields = list(from_arrow_schema(payload).fields)
    except (TypeError, ValueError) as exc:
        raise IncompatibleLogError(
            f"the log's schema\n{payload}\nhas a column Spark cannot read ({exc}); the log was not written "
            "through Spark: rewrite it with Spark-compatible types"
        ) from exc
    return StructType(fields + [StructField("split", IntegerType(), False), StructField("offset", LongType(), False)])


def payload_arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema a log stores for a DataFrame schema: top-level columns nullable, timestamps UTC."""
    relaxed = StructType([StructField(f.name, f.dataType, True, f.metadata) for f in schema.fields])
    return to_arrow_schema(relaxed, timezone=ARROW_TIMEZONE)


def _expected_arrow_schema(source, schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects from ``read()``; raises if ``schema`` is not the source's."""
    expected = to_arrow_schema(schema, timezone=ARROW_TIMEZONE)
    own = to_arrow_schema(spark_schema(source.payload_schema), timezone=ARROW_TIMEZONE)
    if expected.names != own.names or [f.type for f in expected] != [f.type for f in own]:
        raise IncompatibleLogError(
            f"the schema given to the reader\n{expected}\ndoes not match the source's\n{own}\n"
            "drop .schema(...) and let the source supply it"
        )
    return expected


class ReplayableDataSource(DataSource):
    """``format("replayable")``: a durable, offset-addressable log (or a generator) for Spark."""

    @classmethod
    def name(cls) -> str:
        return "replayable"

    def schema(self) -> StructType:
        options = parse_read_options(self.options, ANY_READ)
        return spark_schema(open_source(options).payload_schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        return _BatchReader(open_source(parse_read_options(self.options, READ)), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _StreamReader(open_source(parse_read_options(self.options, STREAM_READ)), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        options = parse_write_options(self.options, WRITE)
        return _BatchWriter(options, _open_for_write(options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        options = parse_write_options(self.options, STREAM_WRITE)
        return _StreamWriter(options, _open_for_write(options, schema, overwrite))


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


class _BatchReader(DataSourceReader):
    """``spark.read``: one DataFrame of ``[startingOffsets, endingOffsets)``, resolved when the read is planned."""

    def __init__(self, source, schema: StructType) -> None:
        self.source = source
        self.arrow_schema = _expected_arrow_schema(source, schema)
        self.start = source.starting_offsets()
        self.end = source.ending_offsets()
        for split in self.start:
            if self.end[split] < self.start[split]:
                raise ReplayableOptionError(
                    f"endingOffsets {self.end[split]} of split {split} is before startingOffsets {self.start[split]}"
                )

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(task) for task in self.source.plan(self.start, self.end)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if partition.value is None:
            return iter(())
        return self.source.read(partition.value, self.arrow_schema)


class _StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream``: offsets, admission control, partition planning and trimming."""

    def __init__(self, source, schema: StructType) -> None:
        self.source = source
        self.arrow_schema = _expected_arrow_schema(source, schema)
        self._target = None
        self._initial: dict | None = None

    def __getstate__(self) -> dict:
        return {"source": self.source, "arrow_schema": self.arrow_schema, "_target": None, "_initial": None}

    def _offsets(self, raw, what: str):
        return parse_spark_offsets(raw, self.source, what)

    def initialOffset(self) -> dict:
        """Resolved once per run: Spark asks again for batch 0, and ``latest`` must not move in between."""
        if self._initial is None:
            self._initial = offsets_to_json(self.source.starting_offsets(), self.source.source_id)
        return self._initial

    def getDefaultReadLimit(self):
        limit = self.source.options.max_records_per_batch
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def _available(self, start):
        """The end offsets available now: under availableNow, never past the target it fixed."""
        if self._target is not None and self.source.kind == "generator":
            latest = self._target  # a bounded generator has all its rows at once: ignore its clock
        else:
            latest = self.source.latest(start)
            if self._target is not None:
                latest = {s: min(latest[s], self._target[s]) for s in latest}
        return {s: max(latest[s], start[s]) for s in start}

    def latestOffset(self, start: dict, limit) -> dict:
        start = self._offsets(start, "the start offsets Spark gave latestOffset")
        available = self._available(start)
        if isinstance(limit, ReadMaxRows):
            return offsets_to_json(admit(start, available, limit.max_rows), self.source.source_id)
        if isinstance(limit, ReadAllAvailable):
            return offsets_to_json(available, self.source.source_id)
        raise ReplayableOptionError(f"read limit {limit!r} is not supported; use option maxRecordsPerBatch")

    def reportLatestOffset(self) -> dict | None:
        return (
            None
            if self.source.kind == "generator"
            else offsets_to_json(self.source.latest(None), self.source.source_id)
        )

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.source.available_now_target()

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        start = self._offsets(start, "the batch's start offsets")
        end = self._offsets(end, "the batch's end offsets")
        return [InputPartition(task) for task in self.source.plan(start, end)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self.source.read(partition.value, self.arrow_schema)

    def commit(self, end: dict) -> None:
        self.source.commit(self._offsets(end, "the committed offsets"))


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _open_for_write(options: WriteOptions, schema: StructType, overwrite: bool) -> LogMeta:
    """Create or open the log for a write and check the data fits it; returns the log's metadata."""
    if overwrite:
        raise ReplayableOptionError(
            "a replayable log is append-only: use mode('append') (or outputMode('append') for streams)"
        )
    payload = payload_arrow_schema(schema)
    if options.key_column is not None:
        field = payload.field(options.key_column) if options.key_column in payload.names else None
        if field is None or not is_key_type(field.type):
            raise UnsupportedKeyColumnError(
                f"option keyColumn={options.key_column!r}: "
                + ("no such column" if field is None else f"type {field.type} has no canonical key bytes")
                + f"; the data has columns {payload.names}, keys must be string, binary or integer"
            )
    storage = open_log_storage(options.uri)
    name = options.uri.rstrip("/").rsplit("/", 1)[-1] or "log"
    meta = LogMeta(name, options.num_splits or DEFAULT_NUM_SPLITS, payload)
    return ReplayableLog.create(storage, meta, exact_splits=options.num_splits is not None).meta


@dataclass
class _Staged(WriterCommitMessage):
    """What one write task produced: the segments it wrote, all in its own writer directory."""

    segments: list[StagedSegment]


def _task_order() -> tuple[int, int]:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return 0, 0
    return context.partitionId(), context.attemptNumber()


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with exactly the log schema (Spark may hand timestamps in the session time zone)."""
    if batch.schema.names != schema.names:
        batch = pa.RecordBatch.from_arrays([batch.column(name) for name in schema.names], names=schema.names)
    if not batch.schema.equals(schema):
        batch = batch.cast(schema)
    return batch


def _write_task(options: WriteOptions, meta: LogMeta, directory: str, batches: Iterator[pa.RecordBatch]) -> _Staged:
    """One write task: route rows to splits, write segments under ``data/<directory>/``.

    Deletes its files if it fails; if it is killed, they stay for the garbage collector.
    """
    partition, _ = _task_order()
    log = ReplayableLog(open_log_storage(options.uri), meta)
    writer = log.segment_writer(
        directory, order=partition, max_records=options.max_records_per_segment, compression=options.compression
    )
    n = meta.num_splits
    try:
        for i, batch in enumerate(batches):
            if batch.num_rows == 0:
                continue
            batch = _conform(batch, meta.schema)
            if options.key_column is None:
                writer.add((partition + i) % n, batch)
            else:
                splits = splits_of_keys(batch.column(options.key_column), n)
                for split, rows in route_batch(batch, splits, n):
                    writer.add(split, rows)
        return _Staged(writer.finish())
    except BaseException:
        writer.discard()
        raise


def _staged(messages) -> list[StagedSegment]:
    """The segments of the tasks that reported back (Spark passes None for the others)."""
    return [seg for message in messages if isinstance(message, _Staged) for seg in message.segments]


class _BatchWriter(DataSourceArrowWriter):
    """``df.write``: each task attempt writes to its own writer directory; ``commit`` publishes them in one log commit.

    Neither ``commit`` nor ``abort`` touches the files of attempts that did not
    report back: a retried, speculative or killed attempt may still be writing
    them. They are garbage once no commit references them, and the collector
    run after each commit deletes them when older than ``orphanGraceSeconds``.

    With options ``sinkId`` and ``batchId`` the commit carries that sink mark,
    so a job that writes each of its batches this way (a ``foreachBatch``)
    appends every batch id once even when it re-runs a batch.
    """

    def __init__(self, options: WriteOptions, meta: LogMeta) -> None:
        self.options = options
        self.meta = meta
        self.job = uuid.uuid4().hex[:12]

    def write(self, iterator: Iterator[pa.RecordBatch]) -> _Staged:
        partition, attempt = _task_order()
        directory = writer_directory("task", f"{self.job}-{partition}-{attempt}")
        return _write_task(self.options, self.meta, directory, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        segments = _staged(messages)
        log = ReplayableLog(open_log_storage(self.options.uri), self.meta)
        if any(seg.rows for seg in segments):
            mark = None
            if self.options.batch_id is not None:
                assert self.options.sink_id is not None, "parse_write_options: batchId comes with sinkId"
                mark = SinkMark(self.options.sink_id, self.options.batch_id)
            log.append(segments, mark)
        log.collect_garbage_after_commit(self.options.orphan_grace_seconds)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Delete the segments of the attempts that reported back, unless ``commit`` got past its commit point."""
        log = ReplayableLog(open_log_storage(self.options.uri), self.meta)
        log.discard(seg.path for seg in _staged(messages))


class _StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream``: each micro-batch becomes one log commit carrying ``(sink id, batch id)``.

    A batch id the log already holds for this sink (Spark replaying a batch
    after a failure) is skipped and its new segments deleted. Batch ids only
    grow within one checkpoint, so a batch id <= the last committed one is
    treated as committed: reusing a sink id with a fresh checkpoint skips
    batches; give a new checkpointLocation or sinkId instead.
    """

    def __init__(self, options: WriteOptions, meta: LogMeta) -> None:
        self.options = options
        self.meta = meta

    def write(self, iterator: Iterator[pa.RecordBatch]) -> _Staged:
        partition, attempt = _task_order()
        return _write_task(self.options, self.meta, writer_directory("stream", f"{partition}-{attempt}"), iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log = ReplayableLog(open_log_storage(self.options.uri), self.meta)
        assert self.options.sink_id is not None, "parse_write_options gives a stream write a sink id"
        log.append(_staged(messages), SinkMark(self.options.sink_id, batchId))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        ReplayableLog(open_log_storage(self.options.uri), self.meta).discard(seg.path for seg in _staged(messages))
