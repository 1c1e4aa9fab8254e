"""The Spark edge: the user API and the driver's part of every micro-batch.

Usage::

    from spark_state import keyed

    query = (
        keyed(events, "user", name="clicks")      # key column(s) and a component name
        .count()                                  # or .sum("amount") or .apply(fn, ...)
        .writeStream.format("replayable")         # any sink, written once per batch id
        .option("path", "/data/click-counts")
        .option("checkpointLocation", "/chk/clicks")
        .start()
    )

A ``StatefulQuery`` is a Structured Streaming query whose ``foreachBatch``
runs ``MicroBatch.run`` on the driver for every micro-batch N:

1. read the settings (``spark.state.*``) from the session that started the
   query, so a changed parallelism applies from the next batch on;
2. decide with ``coordinator.plan_batch`` how to run it, from the store's
   latest checkpoint and what Spark's checkpoint says about batch N (query
   id, start and end offsets): on the latest committed checkpoint; or, when
   batch N of this query was already committed (the driver died after our
   commit but before Spark's), on the one before it, so the batch is
   recomputed exactly; or not at all, when the store and Spark's checkpoint
   disagree (a lost state record, another query's state);
3. route rows: key group and instance are computed in the JVM from the same
   hash as ``key_group_for``; ``repartitionById`` makes Spark task i
   instance i; each task runs ``operator.run_instance``;
4. write the output rows to the sink with batch id N (idempotently);
5. commit checkpoint N with this batch's source end offsets, read from
   ``<checkpointLocation>/offsets/N`` (the record Spark replays from), and
   its binding to the query (``manifest.QueryBinding``);
6. clean up what no retained checkpoint needs.

A crash before step 5 leaves checkpoint N uncommitted: Spark replays batch N
with the same offsets, tasks restart from the same base, and the sink skips
or overwrites what step 4 had written. A crash after step 5 is step 2's case.

Before the query starts, ``start`` removes the leftovers of a first
``offsets/0`` write that a killed driver interrupted (Spark would refuse to
start otherwise) and refuses a store that is behind Spark's commits.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pyarrow as pa

from spark_state.checkpoint import CheckpointExistsError, CheckpointStore, open_checkpoint_store
from spark_state.conf import STORE, StateConf
from spark_state.coordinator import SparkBatch, check_query_start, plan_batch
from spark_state.errors import CheckpointError, ConfigError
from spark_state.keyed_state import StateLayout
from spark_state.sinks import BatchSink, open_sink
from spark_state.spark_checkpoint import SparkCheckpoint, batch_start_offsets
from spark_state.operator import (
    INSTANCE_COLUMN,
    KEY_GROUP_COLUMN,
    META_COLUMN,
    Aggregate,
    PythonFunction,
    TaskSpec,
    blob_ref_from_meta,
    run_instance,
)

QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""Local property Spark sets on the thread that runs a streaming query's micro-batches."""
RUN_ID_PROPERTY = "spark.jobGroup.id"
"""Spark runs each streaming query's jobs in a job group named by the run id."""


def keyed(df, *key_columns: str, name: str) -> "KeyedStream":
    """Key a streaming DataFrame by ``key_columns`` for rescalable state stored as component ``name``."""
    if not key_columns:
        raise ConfigError("keyed() needs at least one key column")
    missing = [c for c in key_columns if c not in df.columns]
    if missing:
        raise ConfigError(f"key column(s) {missing} are not in the DataFrame; it has {df.columns}")
    if not df.isStreaming:
        raise ConfigError("keyed() works on streaming DataFrames (spark.readStream...); use groupBy for batch data")
    return KeyedStream(df, tuple(key_columns), name)


def _to_arrow_schema(schema) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        schema = StructType.fromDDL(schema)
    if not isinstance(schema, StructType):
        raise ConfigError(f"a schema must be a DDL string, a StructType or a pyarrow.Schema, got {type(schema).__name__}")
    return to_arrow_schema(schema, timezone="UTC")


def _to_spark_schema(schema: pa.Schema):
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


@dataclass(frozen=True)
class KeyedStream:
    """A streaming DataFrame keyed for rescalable state; choose what to compute per key."""

    df: Any
    key_columns: tuple[str, ...]
    name: str

    def _key_fields(self) -> list[pa.Field]:
        schema = _to_arrow_schema(self.df.schema)
        return [schema.field(c) for c in self.key_columns]

    def count(self, output: str = "count") -> "StatefulStream":
        """Running count of rows per key; emits ``(keys..., output)`` for every key seen in a batch."""
        fields = self._key_fields() + [pa.field(output, pa.int64())]
        schema = pa.schema(fields)
        return StatefulStream(self, Aggregate("count", None, output), schema, schema, ())

    def sum(self, column: str, output: str | None = None) -> "StatefulStream":
        """Running sum of ``column`` per key (int64 for integers, float64 otherwise)."""
        if column not in self.df.columns:
            raise ConfigError(f"sum({column!r}): no such column; the DataFrame has {self.df.columns}")
        output = output or f"sum_{column}"
        function = Aggregate("sum", column, output)
        value_type = function.value_type(_to_arrow_schema(self.df.schema))
        schema = pa.schema(self._key_fields() + [pa.field(output, value_type)])
        return StatefulStream(self, function, schema, schema, (column,))

    def apply(
        self,
        fn: Callable,
        *,
        state_schema,
        output_schema,
        style: str = "pandas",
    ) -> "StatefulStream":
        """Call ``fn(key, rows, state)`` once per key and batch; see ``operator.PythonFunction``.

        ``state_schema`` holds the value columns of the per-key state (DDL
        string, StructType or pyarrow schema; key columns are added in
        front); ``output_schema`` the columns ``fn`` returns.
        """
        values = _to_arrow_schema(state_schema)
        clash = [f.name for f in values if f.name in self.key_columns]
        if clash:
            raise ConfigError(f"state_schema repeats key column(s) {clash}; list only the value columns")
        state = pa.schema(self._key_fields() + list(values))
        outputs = _to_arrow_schema(output_schema)
        return StatefulStream(self, PythonFunction(fn, style), state, outputs, tuple(self.df.columns))


@dataclass(frozen=True)
class StatefulStream:
    """A keyed computation ready to be written; ``writeStream`` starts it like any streaming DataFrame."""

    keyed: KeyedStream
    function: Any
    state_schema: pa.Schema
    output_schema: pa.Schema
    input_columns: tuple[str, ...]

    @property
    def writeStream(self) -> "StatefulStreamWriter":
        StateLayout(self.state_schema, self.keyed.key_columns)  # validate now, not at the first batch
        return StatefulStreamWriter(self)


class StatefulStreamWriter:
    """Mirrors ``DataStreamWriter``: ``format``, ``option(s)``, ``trigger``, ``queryName``, ``foreachBatch``, ``start``.

    The sink receives each batch's output once per batch id: ``replayable``
    skips a batch id it already holds; file formats (parquet, json, ...) are
    written with mode overwrite to ``<path>/batch_id=N``; ``foreachBatch(fn)``
    hands ``(output_df, batch_id)`` to ``fn``, which must be idempotent per
    batch id (Spark may call it again for the same id after a failure).
    """

    def __init__(self, stream: StatefulStream):
        self._stream = stream
        self._format: str | None = None
        self._options: dict[str, str] = {}
        self._trigger: dict[str, Any] | None = None
        self._query_name: str | None = None
        self._foreach_batch: Callable | None = None

    def format(self, source: str) -> "StatefulStreamWriter":
        self._format = source
        return self

    def option(self, key: str, value: Any) -> "StatefulStreamWriter":
        self._options[key] = str(value)
        return self

    def options(self, **options: Any) -> "StatefulStreamWriter":
        for key, value in options.items():
            self.option(key, value)
        return self

    def trigger(self, **trigger: Any) -> "StatefulStreamWriter":
        self._trigger = trigger
        return self

    def queryName(self, name: str) -> "StatefulStreamWriter":
        self._query_name = name
        return self

    def foreachBatch(self, fn: Callable) -> "StatefulStreamWriter":
        self._foreach_batch = fn
        return self

    def start(self, path: str | None = None) -> "StatefulQuery":
        if path is not None:
            self._options["path"] = path
        checkpoint_location = self._options.pop("checkpointLocation", None)
        if not checkpoint_location:
            raise ConfigError(
                "option('checkpointLocation', ...) is required: it holds Spark's offsets log, from which "
                "each state checkpoint records its source offsets"
            )
        session = self._stream.keyed.df.sparkSession
        spark_checkpoint = SparkCheckpoint(session, checkpoint_location)
        batch = MicroBatch(
            stream=self._stream,
            session=session,
            checkpoint_location=_location_name(spark_checkpoint.uri),
            spark_checkpoint=spark_checkpoint,
        )
        batch.sink = open_sink(
            self._format, self._options, self._foreach_batch,
            default_sink_id=f"spark-state:{batch.checkpoint_location}",
        )
        conf = batch.conf()  # fail now on bad settings, not at the first batch
        spark_checkpoint.clear_interrupted_first_batch()
        check_query_start(
            batch.store(conf).latest(),
            spark_checkpoint.query_id(),
            spark_checkpoint.last_committed_batch(),
            checkpoint_location=batch.checkpoint_location,
            store=conf.store,
        )
        writer = self._stream.keyed.df.writeStream.foreachBatch(batch.run).option(
            "checkpointLocation", checkpoint_location
        )
        if self._trigger:
            writer = writer.trigger(**self._trigger)
        if self._query_name:
            writer = writer.queryName(self._query_name)
        return StatefulQuery(writer.start(), batch)


def _location_name(uri: str) -> str:
    """How a checkpoint location is named in state checkpoints and sink ids: a local path as a path."""
    return uri[len("file:"):] if uri.startswith("file:/") and not uri.startswith("file://") else uri


def _default_store(checkpoint_location: str) -> str:
    """``<checkpointLocation>/state`` where the state store can live beside Spark's checkpoint."""
    if checkpoint_location.startswith("/") or checkpoint_location.startswith("webhdfs://"):
        return checkpoint_location.rstrip("/") + "/state"
    raise ConfigError(
        f"checkpointLocation {checkpoint_location!r} is not on a file system spark-state can also store state "
        f"on by default; set {STORE} to a state store URI (a local path for local[*], webhdfs://HOST:PORT/path)"
    )


@dataclass
class MicroBatch:
    """The driver's part of every micro-batch (see the module docstring); one per query."""

    stream: StatefulStream
    session: Any
    checkpoint_location: str
    spark_checkpoint: SparkCheckpoint | None = None
    sink: BatchSink | None = None
    parallelism_override: int | None = None
    fault_hook: Callable[[str, int], None] | None = None  # tests: called at "tasks_done", "output_written", "committed"
    history: list[dict] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stores: dict[tuple[str, int], CheckpointStore] = field(default_factory=dict)

    def store(self, conf: StateConf) -> CheckpointStore:
        """One store per setting, kept for the query's life, so parsed manifests are reused across batches."""
        key = (conf.store, conf.checkpoints_retained)
        if key not in self._stores:
            self._stores[key] = open_checkpoint_store(conf.store, retained=conf.checkpoints_retained)
        return self._stores[key]

    def conf(self) -> StateConf:
        """Settings for the next batch, from the session that started the query."""
        get = lambda key: self.session.conf.get(key, None)  # noqa: E731
        default_parallelism = int(self.session.conf.get("spark.sql.shuffle.partitions", "200"))
        conf = StateConf.parse(
            get,
            default_store=lambda: _default_store(self.checkpoint_location),
            default_parallelism=default_parallelism,
        )
        if self.parallelism_override is not None:
            conf = replace(conf, parallelism=self.parallelism_override)
        return conf

    def spark_batch(self, batch_df, batch_id: int) -> SparkBatch:
        """What Spark's checkpoint says about micro-batch ``batch_id`` (see ``coordinator.SparkBatch``)."""
        context = batch_df.sparkSession.sparkContext
        checkpoint = self.spark_checkpoint
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY) or checkpoint.query_id()
        end = checkpoint.offsets(batch_id)
        if end is None:
            raise CheckpointError(
                f"Spark's offsets log has no entry {checkpoint.uri}/offsets/{batch_id} for the micro-batch it "
                "runs; the checkpoint location was changed while the query ran"
            )
        return SparkBatch(
            query_id=query_id,
            run_id=context.getLocalProperty(RUN_ID_PROPERTY),
            batch_id=batch_id,
            checkpoint_location=self.checkpoint_location,
            end=end,
            start=batch_start_offsets(self.session, query_id, batch_id, checkpoint),
        )

    def run(self, batch_df, batch_id: int) -> None:
        with self._lock:
            self._run(batch_df, batch_id)

    def _run(self, batch_df, batch_id: int) -> None:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        from spark_state.routing import instance_column, key_group_column

        conf = self.conf()
        store = self.store(conf)
        spark_batch = self.spark_batch(batch_df, batch_id)
        plan = plan_batch(store.latest(), store.load, spark_batch, store=conf.store)
        checkpoint_id, base, replayed = plan.checkpoint_id, plan.base, plan.replayed
        stream = self.stream
        layout = StateLayout(stream.state_schema, stream.keyed.key_columns)
        spec = layout.spec(stream.keyed.name, conf.parallelism, conf.max_parallelism)
        if base is not None and stream.keyed.name in base.components:
            from spark_state.manifest import check_compatible

            check_compatible(base.components[stream.keyed.name], spec)
        task = TaskSpec(
            store_uri=store.storage.uri,
            component=stream.keyed.name,
            state_schema=stream.state_schema.serialize().to_pybytes(),
            key_columns=stream.keyed.key_columns,
            input_columns=stream.input_columns,
            output_schema=stream.output_schema.serialize().to_pybytes(),
            function=stream.function,
            checkpoint_id=checkpoint_id,
            base_checkpoint_id=base.checkpoint_id if base is not None else None,
            base_committed_at=base.committed_at if base is not None else None,
            parallelism=conf.parallelism,
            max_parallelism=conf.max_parallelism,
            max_chain_length=conf.max_chain_length,
            compression=conf.compression,
            retained=conf.checkpoints_retained,
        )
        key_group = key_group_column(batch_df, list(stream.keyed.key_columns), conf.max_parallelism)
        needed = list(dict.fromkeys(list(stream.keyed.key_columns) + list(stream.input_columns)))
        routed = batch_df.select(
            *needed,
            key_group.alias(KEY_GROUP_COLUMN),
        ).withColumn(
            INSTANCE_COLUMN, instance_column(F.col(KEY_GROUP_COLUMN), conf.parallelism, conf.max_parallelism)
        )

        def process(batches):
            from pyspark import TaskContext

            yield from run_instance(task, TaskContext.get().partitionId(), batches)

        out_schema = _to_spark_schema(stream.output_schema.append(pa.field(META_COLUMN, pa.string())))
        result = (
            routed.repartitionById(conf.parallelism, F.col(INSTANCE_COLUMN))
            .drop(INSTANCE_COLUMN)
            .mapInArrow(process, out_schema)
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        try:
            metas = [json.loads(r[0]) for r in result.where(F.col(META_COLUMN).isNotNull()).select(META_COLUMN).collect()]
            self._check_instances(metas, conf.parallelism)
            self._fault("tasks_done", batch_id)
            output = result.where(F.col(META_COLUMN).isNull()).drop(META_COLUMN)
            self.sink.write(output, batch_id)
            self._fault("output_written", batch_id)
            if not replayed:
                refs = [ref for ref in map(blob_ref_from_meta, metas) if ref is not None]
                items = {m["instance"]: m["items"] for m in metas if m.get("items")}
                try:
                    manifest = store.commit(
                        checkpoint_id,
                        {stream.keyed.name: (spec, refs)},
                        spark_batch.end,
                        instance_state={stream.keyed.name: items},
                        binding=spark_batch.binding(),
                    )
                except CheckpointExistsError as exc:
                    raise CheckpointError(
                        f"checkpoint {checkpoint_id} was committed by another query writing to the same "
                        f"state store {conf.store}; give each query its own spark.state.store"
                    ) from exc
                self._fault("committed", batch_id)
                store.cleanup(manifest)
        finally:
            result.unpersist()
        self.history.append(
            {
                "batch_id": batch_id,
                "checkpoint_id": checkpoint_id,
                "replayed": replayed,
                "parallelism": conf.parallelism,
                "instances": sorted(metas, key=lambda m: m["instance"]),
            }
        )

    def _fault(self, stage: str, batch_id: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, batch_id)

    @staticmethod
    def _check_instances(metas: list[dict], parallelism: int) -> None:
        seen = sorted(m["instance"] for m in metas)
        if seen != list(range(parallelism)):
            raise CheckpointError(
                f"expected one report from each of {parallelism} instances, got {seen}; not committing"
            )


class StatefulQuery:
    """A running stateful query: the ``StreamingQuery`` plus rescaling and restore reports."""

    def __init__(self, query, batch: MicroBatch):
        self.query = query
        self._batch = batch

    def set_parallelism(self, parallelism: int) -> None:
        """Use ``parallelism`` instances from the next micro-batch on (no restart needed)."""
        conf = self._batch.conf()
        StateConf(conf.store, parallelism, conf.max_parallelism, conf.checkpoints_retained)
        self._batch.parallelism_override = parallelism

    @property
    def batches(self) -> list[dict]:
        """Per completed micro-batch: ids, parallelism and each instance's report (restore cost, keys)."""
        return list(self._batch.history)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.query, name)
