"""The driver's part of every micro-batch of a keyed query: only the Spark calls around the ``Coordinator``.

A ``StatefulQuery`` is a Structured Streaming query whose ``foreachBatch``
runs ``MicroBatch.run`` for every micro-batch N:

1. read the settings (``spark.state.*``) from the session that started the
   query, so a changed parallelism applies from the next batch on;
2. ask Spark's checkpoint about batch N (query id, start and end offsets)
   and let ``Coordinator.begin`` decide: run on the latest committed
   checkpoint; or, when batch N was already committed (the driver died after
   our commit but before Spark's), recompute it on the one before without
   committing again; or refuse, when the store and Spark's checkpoint
   disagree (see ``coordinator``);
3. route rows: key group and instance are computed in the JVM from the same
   hash as ``keygroups.key_group_for``; ``repartitionById`` makes Spark task
   i instance i; each task runs ``operator.run_instance``;
4. write the output rows to the sink with batch id N (idempotently): the
   sink's job runs the tasks of step 3, whose reports come back through an
   accumulator, so a batch is one Spark job; when the sink ran no action on
   the output (the ``replayable`` sink skips a batch id it holds), the driver
   runs the tasks itself;
5. ``Coordinator.commit``: checkpoint N with this batch's source end offsets
   (Spark's ``offsets/N``, the record Spark replays from) and its binding to
   the query;
6. ``Coordinator.cleanup``: delete what no retained checkpoint needs.

A crash before step 5 leaves checkpoint N uncommitted: Spark replays batch N
with the same offsets, tasks restart from the same base, and the sink skips
or overwrites what step 4 had written. A crash after step 5 is step 2's case.
Each action on the output runs the tasks (a ``foreachBatch`` function that
uses its DataFrame twice should persist it, as for any Spark query): they
compute the same output from the same base, the last report of each instance
is committed, and an instance host whose state ran ahead of the base
reads back the key groups it changed (``ResidentState.catch_up``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pyarrow as pa
from pyspark.accumulators import AccumulatorParam

from spark_state.conf import StateConf, check_store_reachable, default_store
from spark_state.coordinator import Coordinator, InstanceReport, SparkBatch, check_reports
from spark_state.drain import finish_request, pending_requests
from spark_state.errors import CheckpointError
from spark_state.functions import EVENT_MS_COLUMN, KEY_GROUP_COLUMN, PARTIAL_PREFIX, ROWS_COLUMN, Aggregate
from spark_state.hosts import run_hosted
from spark_state.manifest import ComponentManifest, ComponentSpec, check_compatible
from spark_state.manifestlog import open_manifest_log
from spark_state.operator import INSTANCE_COLUMN, META_COLUMN, TaskSpec, report_from_meta, run_instance
from spark_state.sinks import BatchSink
from spark_state.spark_checkpoint import SparkCheckpoint, batch_start_offsets
from spark_state.stops import record_stop
from spark_state.stop_watch import unwatch as unwatch_stops
from spark_state.timers import TIMERS

_LOG = logging.getLogger(__name__)

QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""Local property Spark sets on the thread that runs a streaming query's micro-batches."""
RUN_ID_PROPERTY = "spark.jobGroup.id"
"""Spark runs each streaming query's jobs in a job group named by the run id."""


def location_name(uri: str) -> str:
    """How a checkpoint location is named in state checkpoints and sink ids: a local path as a path."""
    return uri[len("file:"):] if uri.startswith("file:/") and not uri.startswith("file://") else uri


def _requests_since(storage, before: dict | None) -> int | None:
    """Requests ``storage`` made since its ``counters()`` were ``before`` (None if it does not count them)."""
    after = storage.counters()
    return None if before is None or after is None else after["requests"] - before["requests"]


def to_spark_schema(schema: pa.Schema):
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def task_output_schema(output_schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of what a task emits: the output columns, every one nullable.

    The output's schema as it always was: an earlier protocol sent each
    task's report as a last row with the output columns null, so a column
    the input declares not null (a source's ``split``, say, passed on by
    ``deduplicate``) became nullable, and sinks saw it so.
    """
    return pa.schema([f.with_nullable(True) for f in output_schema])


class _Reports(AccumulatorParam):
    """Accumulates ``(attempt, report JSON)`` pairs: each task adds its instance's report."""

    def zero(self, value: list) -> list:
        return []

    def addInPlace(self, value1: list, value2: list) -> list:
        value1.extend(value2)
        return value1


def reports_of(received: list[tuple[str, str]], attempt: str) -> dict[int, InstanceReport]:
    """Per instance, the last report that tasks of ``attempt`` sent (each action on the output runs them)."""
    reports = {}
    for sent_by, meta in received:
        if sent_by == attempt:
            report = report_from_meta(meta)
            reports[report.instance] = report
    return reports


def _strip_reports(batches, reports, attempt: str, schema: pa.Schema):
    """A task's output batches in the declared (nullable) ``schema``; its report batch goes to ``reports``."""
    for batch in batches:
        if batch.schema.names == [META_COLUMN]:
            reports.add([(attempt, batch.column(0)[0].as_py())])
        else:
            yield batch if batch.schema == schema else pa.RecordBatch.from_arrays(batch.columns, schema=schema)


@dataclass
class MicroBatch:
    """The driver's part of every micro-batch (see the module docstring); one per query.

    ``stream`` is the ``streaming.StatefulStream`` being run.
    """

    stream: Any
    session: Any
    checkpoint_location: str
    spark_checkpoint: SparkCheckpoint
    sink: BatchSink
    parallelism_override: int | None = None
    fault_hook: Callable[[str, int], None] | None = None  # tests: called at "output_written", "committed"
    history: list[dict] = field(default_factory=list)
    drain_requested: bool = False
    drained_batch: int | None = None
    query: Any = None  # the StreamingQuery, once started (to stop it after a drain)
    key_space: int | None = None  # the store's key space, once known (``StateConf.key_space``)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _coordinators: dict[tuple[str, int], Coordinator] = field(default_factory=dict)
    _task_plans: dict[tuple[int, int], "_TaskPlan"] = field(default_factory=dict)
    _preparing: dict[tuple[int, int], tuple[threading.Thread, list]] = field(default_factory=dict)
    _reports: Any = None  # the accumulator the tasks send their reports through (``_Reports``)
    _stopper: threading.Thread | None = None
    _stops_recorded: set[str] = field(default_factory=set)
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    _warned_unbounded: bool = False

    def coordinator(self, conf: StateConf) -> Coordinator:
        """One per setting, kept for the query's life, so parsed manifests are reused across batches."""
        key = (conf.store, conf.checkpoints_retained)
        if key not in self._coordinators:
            manifests = open_manifest_log(conf.store, retained=conf.checkpoints_retained)
            self._coordinators[key] = Coordinator(manifests, store=conf.store)
        return self._coordinators[key]

    def conf(self) -> StateConf:
        """Settings for the next batch, from the session that started the query."""
        conf = StateConf.from_session(self.session, default_store=lambda: default_store(self.checkpoint_location))
        check_store_reachable(conf.store, self.session.sparkContext.master, shared=conf.shared_local_store)
        if self.parallelism_override is not None:
            conf = replace(conf, parallelism=self.parallelism_override)
        return conf

    def component_spec(self, conf: StateConf, stored: ComponentManifest | None = None) -> ComponentSpec:
        """The component the query declares under ``conf``, continuing ``stored`` (whose key space it keeps
        when ``spark.state.maxParallelism`` is unset: ``StateConf.key_space``)."""
        stream = self.stream
        event_time = stream.keyed.event_time
        key_space = conf.key_space(stored.max_parallelism if stored is not None else None)
        return ComponentSpec(stream.keyed.name, key_space, conf.parallelism, stream.schema,
                             event_time.delay_ms if event_time is not None else None)

    def continuing(self, conf: StateConf, stored: ComponentManifest | None) -> ComponentSpec:
        """``component_spec``, refused unless it can continue ``stored`` (``check_compatible``); remembers the
        store's key space (``set_parallelism`` checks against it)."""
        spec = self.component_spec(conf, stored)
        if stored is not None:
            check_compatible(stored, spec)
            self.key_space = stored.max_parallelism
        return spec

    def spark_batch(self, batch_df, batch_id: int) -> SparkBatch:
        """What Spark's checkpoint says about micro-batch ``batch_id`` (see ``coordinator.SparkBatch``)."""
        context = batch_df.sparkSession.sparkContext
        checkpoint = self.spark_checkpoint
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY) or checkpoint.query_id()
        entry = checkpoint.offsets_entry(batch_id)
        if entry is None:
            raise CheckpointError(
                f"Spark's offsets log has no entry {checkpoint.uri}/offsets/{batch_id} for the micro-batch it "
                "runs; the checkpoint location was changed while the query ran"
            )
        end, timestamp_ms = entry
        return SparkBatch(
            query_id=query_id,
            run_id=context.getLocalProperty(RUN_ID_PROPERTY),
            batch_id=batch_id,
            checkpoint_location=self.checkpoint_location,
            end=end,
            start=batch_start_offsets(self.session, query_id, batch_id, checkpoint),
            timestamp_ms=timestamp_ms,
        )

    def run(self, batch_df, batch_id: int) -> None:
        with self._lock:
            self._run(batch_df, batch_id)

    def _run(self, batch_df, batch_id: int) -> None:
        conf = self.conf()
        coordinator = self.coordinator(conf)
        spark_batch = self.spark_batch(batch_df, batch_id)
        stream = self.stream
        event_time = stream.keyed.event_time
        plan = coordinator.plan(spark_batch, restore_from=conf.restore_from)
        base = plan.base.components.get(stream.keyed.name) if plan.base is not None else None
        spec = self.continuing(conf, base)
        drain, ignored = self._drain_wanted(coordinator, spark_batch, plan)
        task = TaskSpec(
            store_uri=coordinator.manifests.storage.uri,
            component=stream.keyed.name,
            schema=stream.schema,
            input_columns=stream.input_columns,
            output_schema=stream.output_schema,
            function=stream.function,
            checkpoint_id=plan.checkpoint_id,
            base_checkpoint_id=plan.base.checkpoint_id if plan.base is not None else None,
            base_committed_at=plan.base.committed_at if plan.base is not None else None,
            parallelism=conf.parallelism,
            max_parallelism=spec.max_parallelism,
            max_chain_length=conf.max_chain_length,
            compression=conf.compression,
            event_time=event_time,
            watermark_ms=base.watermark_ms if base is not None else None,
            processing_ms=spark_batch.timestamp_ms,
            drain=drain,
            resident_memory=conf.resident_memory,
            run_id=spark_batch.run_id,
        )
        self._warn_if_unbounded(conf)
        attempt = uuid.uuid4().hex  # names this attempt's reports among any late ones of an earlier attempt
        output = self._run_tasks(batch_df, task, conf.instance_hosts, attempt)
        self.sink.write(output, batch_id)
        reports = reports_of(self._reports.value, attempt)
        if sorted(reports) != list(range(conf.parallelism)):  # the sink ran no action on (all of) the output
            output.write.format("noop").mode("overwrite").save()
            reports = reports_of(self._reports.value, attempt)
        reports = [reports[i] for i in sorted(reports)]
        check_reports(reports, conf.parallelism)
        self._fault("output_written", batch_id)
        storage = coordinator.manifests.storage
        committing, wire = time.perf_counter(), storage.counters()
        manifest = coordinator.commit(plan, spark_batch, spec, reports, drained=drain)
        commit_seconds, commit_requests = time.perf_counter() - committing, _requests_since(storage, wire)
        cleanup_seconds, cleanup_requests = 0.0, _requests_since(storage, storage.counters())
        if manifest is not None:
            self._fault("committed", batch_id)
            cleaning, wire = time.perf_counter(), storage.counters()
            coordinator.cleanup(manifest, grace_seconds=conf.orphan_grace_seconds)
            cleanup_seconds, cleanup_requests = time.perf_counter() - cleaning, _requests_since(storage, wire)
        if drain:
            self._drained(coordinator, spark_batch)
        self._task_plan(task).java(batch_df.sparkSession.sparkContext).prepare()  # the next batch's plan, meanwhile
        self.history.append(
            {
                "batch_id": batch_id,
                "checkpoint_id": plan.checkpoint_id,
                "replayed": plan.replayed,
                "parallelism": conf.parallelism,
                "watermark_ms": task.watermark_ms,
                "processing_ms": task.processing_ms,
                "late_rows": sum(r.info.get("late_rows", 0) for r in reports),
                "timers_fired": sum(r.info.get("timers_fired", 0) for r in reports),
                "expired": sum(r.info.get("expired", 0) for r in reports),
                "drained": drain,
                "drain_requests_ignored": ignored,
                "commit_seconds": round(commit_seconds, 4),  # the driver's step 5: the manifest record, created
                "cleanup_seconds": round(cleanup_seconds, 4),  # step 6: what no retained checkpoint needs, deleted
                "commit_requests": commit_requests,  # storage requests of step 5 (None: the backend does not count)
                "cleanup_requests": cleanup_requests,
                "instances": sorted((r.to_json() for r in reports), key=lambda m: m["instance"]),
            }
        )

    def _drain_wanted(self, coordinator: Coordinator, batch: SparkBatch, plan) -> tuple[bool, list[str]]:
        """Whether this batch drains, and the drain requests that name another run (ignored)."""
        requests = pending_requests(coordinator.manifests.storage)
        ignored = [run for run in requests if run != batch.run_id]
        if plan.replayed:  # a replay does what its committed attempt did
            return coordinator.manifests.load(plan.checkpoint_id).drained, ignored
        wanted = self.drain_requested or self.drained_batch is not None or batch.run_id in requests
        return wanted, ignored

    def _drained(self, coordinator: Coordinator, batch: SparkBatch) -> None:
        """The drained checkpoint is committed: stop the query once Spark has committed the batch too."""
        self.drained_batch = batch.batch_id
        if batch.run_id in pending_requests(coordinator.manifests.storage):
            finish_request(coordinator.manifests.storage, batch.run_id)
        if self._stopper is None and self.query is not None:
            self._stopper = threading.Thread(target=self._stop_after, args=(batch.batch_id,), daemon=True)
            self._stopper.start()

    def _stop_after(self, batch_id: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.query.isActive:
            committed = self.spark_checkpoint.last_committed_batch()
            if committed is not None and committed >= batch_id:
                break
            time.sleep(0.05)
        if self.query.isActive:
            self.query.stop()
        self.record_stop(str(self.query.runId))

    def record_stop(self, run_id: str) -> None:
        """Record in the query's store that run ``run_id`` stopped, so that the instance hosts holding its state
        leave (``stops``), once per run; a store that cannot be written now only leaves them to their idle limit.
        The driver's watch (``stop_watch``) no longer looks for the run's end."""
        unwatch_stops(run_id)
        with self._stop_lock:  # a second caller (the drain's stopper, awaitTermination) returns once it is written
            if run_id in self._stops_recorded:
                return
            self._stops_recorded.add(run_id)
            for coordinator in list(self._coordinators.values()):
                storage = coordinator.manifests.storage
                try:
                    record_stop(storage, run_id)
                except Exception as error:  # noqa: BLE001  (the query is stopped either way)
                    _LOG.warning("spark-state: could not record in %s that run %s stopped (%s); its instance "
                                 "hosts keep its state until they idle out", storage.uri, run_id, error)

    def _run_tasks(self, batch_df, task: TaskSpec, hosted: bool, attempt: str):
        """Step 3: the output DataFrame, whose every action routes the rows to the instances and runs their tasks.

        Each task sends its report through the ``_Reports`` accumulator,
        tagged with ``attempt``.
        """
        plan = self._task_plan(task)
        run = run_hosted if hosted else run_instance
        if self._reports is None:
            self._reports = batch_df.sparkSession.sparkContext.accumulator([], _Reports())
        self._reports.value = []  # reports of earlier batches (a late one of a failed attempt is not this attempt's)
        reports, schema = self._reports, task_output_schema(task.output_schema)

        def process(batches):
            from pyspark import TaskContext

            yield from _strip_reports(run(task, TaskContext.get().partitionId(), batches), reports, attempt, schema)

        return plan.java(batch_df.sparkSession.sparkContext).tasks(batch_df, task.parallelism, process)

    def _warn_if_unbounded(self, conf: StateConf) -> None:
        """Say once per query that ``spark.state.residentMemory`` does not bound a component with timers."""
        has_timers = self.stream.schema.has_variable(TIMERS.name)
        if conf.resident_memory is not None and has_timers and not self._warned_unbounded:
            self._warned_unbounded = True
            _LOG.warning("spark.state.residentMemory does not bound component %r: it has timers or a time to live, "
                         "and its state stays in memory whole; its batch reports say bounded=false",
                         self.stream.keyed.name)

    def _task_plan(self, task: TaskSpec) -> "_TaskPlan":
        """The Spark expressions of step 3 for ``task``'s parallelism, built once (each costs JVM round trips):
        by ``prepare_plan``'s thread when it was asked for, else now."""
        key = (task.parallelism, task.max_parallelism)
        plan = self._task_plans.get(key)
        if plan is None:
            plan = self._prepared(key) or _TaskPlan.build(self.stream, task.parallelism, task.max_parallelism)
            self._task_plans[key] = plan
        return plan

    def prepare_plan(self, parallelism: int, max_parallelism: int) -> None:
        """Build step 3's plan for a parallelism the next batch will likely run at, in a thread of its own.

        The query's start asks for its first batch's, and ``set_parallelism``
        for the new one: their 40-120 ms of py4j calls (the expressions, their
        Java sequences, the names of the routed columns, from the stream's
        own plan) then run while Spark starts the query or finishes a batch,
        when the driver's Python waits, instead of on the first batch's
        critical path. A batch at another parallelism builds its own; one
        that fails leaves the batch to build it (``_prepared``).
        """
        key = (parallelism, max_parallelism)
        if key in self._task_plans or key in self._preparing:
            return
        stream, context = self.stream, self.session.sparkContext

        def build() -> "_TaskPlan":
            plan = _TaskPlan.build(stream, parallelism, max_parallelism)
            plan.java(context).prepare_first(stream.keyed.df, parallelism)
            return plan

        self._preparing[key] = _in_thread("spark-state plan", build)

    def _prepared(self, key: tuple[int, int]) -> "_TaskPlan | None":
        """The plan ``prepare_plan`` built for ``key`` (waiting for its thread), or None."""
        preparing = self._preparing.pop(key, None)
        if preparing is None:
            return None
        return _joined(preparing, f"prepare the plan of parallelism {key[0]}", "the batch builds it")

    def _fault(self, stage: str, batch_id: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, batch_id)


@dataclass(frozen=True)
class _TaskPlan:
    """Step 3's Spark expressions for one parallelism: the routed columns, the instance, the JVM partials.

    With ``partials`` (built-in aggregates whose partials Spark computes,
    ``functions.AggregateDef.in_jvm``, without event time), Spark groups the
    routed rows by ``partials_keys`` right after the shuffle to the
    instances: the instance column is among them, so Spark's aggregate keeps
    the instance partitioning (no second shuffle), and a task receives one
    row per key (``functions.PARTIAL_PREFIX`` columns and ``ROWS_COLUMN``)
    instead of every row, which ``Aggregate.apply`` merges as they are.
    The tasks' input keeps the instance column (they ignore it): dropping it
    would cost one more plan analysis per batch.
    """

    routed: tuple
    by: Any
    output_schema: Any
    partials_keys: tuple | None
    partials: tuple | None
    _java: list = field(default_factory=list, compare=False)  # its ``_JavaPlan``, built at first use

    def java(self, context) -> "_JavaPlan":
        """This plan's JVM objects (see ``_JavaPlan``), built once in ``context`` (the ``SparkContext``)."""
        if not self._java:
            self._java.append(_JavaPlan.build(self, context))
        return self._java[0]

    @classmethod
    def build(cls, stream, parallelism: int, max_parallelism: int) -> "_TaskPlan":
        """The plan of ``stream`` (a ``streaming.StatefulStream``, whose schema, function and event time every
        ``TaskSpec`` of the query repeats) at ``parallelism`` instances of ``max_parallelism`` key groups."""
        from spark_state.routing import routing_columns

        jf = _JvmColumns(stream.keyed.df.sparkSession.sparkContext)
        key_columns = list(stream.schema.key_columns)
        event_time = stream.keyed.event_time
        # The key types from the stream (its schema is resolved once), not from analysing every batch.
        key_group, instance = routing_columns(stream.keyed.df, key_columns, parallelism, max_parallelism)
        event_column = [event_time.column] if event_time is not None else []
        inputs = [c for c in stream.input_columns if c != EVENT_MS_COLUMN]  # added by the task
        needed = list(dict.fromkeys(key_columns + inputs + event_column))
        partials = None
        function = stream.function
        if isinstance(function, Aggregate) and event_time is None and function.partials_in_jvm():
            partials = _spark_partials(function, jf)
        # Columns, not names: a name becomes a Column (a JVM round trip) every time a batch's plan names it.
        return cls(
            routed=(*map(jf.col, needed), jf.alias(key_group, KEY_GROUP_COLUMN), jf.alias(instance, INSTANCE_COLUMN)),
            by=jf.col(INSTANCE_COLUMN),
            output_schema=to_spark_schema(task_output_schema(stream.output_schema)),
            partials_keys=tuple(map(jf.col, (INSTANCE_COLUMN, KEY_GROUP_COLUMN, *key_columns)))
            if partials is not None else None,
            partials=partials,
        )


class _JvmColumns:
    """Columns made by single calls to the JVM's ``org.apache.spark.sql.functions`` and ``Column``.

    PySpark's own ``functions.col``, ``count``, ``lit`` and ``Column.alias``
    first record the caller's stack for error messages (a stack walk, an
    import attempt and four more JVM round trips: 3-5 ms a call, against
    0.5-1 ms here). The plan of a parallelism makes about twenty of them on
    the critical path of its first batch: the first batch of every restart
    and of every live rescale.
    """

    def __init__(self, context):
        self.functions = context._jvm.org.apache.spark.sql.functions

    def col(self, name: str):
        from pyspark.sql.classic.column import Column

        return Column(self.functions.col(name))

    def call(self, name: str, *columns):
        """``functions.<name>(*columns)`` of Spark's aggregates and the like, on Columns."""
        from pyspark.sql.classic.column import Column

        return Column(getattr(self.functions, name)(*(c._jc for c in columns)))

    def lit(self, value):
        from pyspark.sql.classic.column import Column

        return Column(self.functions.lit(value))

    @staticmethod
    def alias(column, name: str):
        from pyspark.sql.classic.column import Column

        return Column(column._jc.alias(name))


class _JavaPlan:
    """A ``_TaskPlan`` as JVM objects, so that a batch's Spark calls cost a few py4j round trips, not dozens.

    PySpark's ``select``, ``groupBy``, ``agg`` and ``mapInArrow`` convert
    their Python lists of columns into Java sequences one element per round
    trip, and ``mapInArrow`` reads the frame's columns back from the JVM
    first: about 90 round trips in every batch before its job starts, on the
    driver's critical path. The sequences are the same in every batch of a
    parallelism, so they are built here once and the plan is made with one
    call per step on the batch's Java ``Dataset``. Spark analyses each step
    again (17-45 ms a batch), so later batches take that plan from the last
    one built this way (``_PlanTemplate``), and the first batch of a query
    run (or of a parallelism set with ``set_parallelism``) from the stream's
    own plan, made before it (``prepare_first``, ``MicroBatch.prepare_plan``). The template of a batch's plan is
    made by a thread of its own once the batch is committed (``prepare``;
    ``pending`` until then, ``building`` while it runs), while Spark commits
    the batch and plans the next, and the next batch waits for it: its
    10-60 ms of py4j calls, one per element of each node, are on no batch's
    critical path, and not in a job's either. One that fails (the session
    stopped under it, say) leaves the next batch to PySpark's calls.
    ``mapInArrow``'s input is every column of the frame it maps (as PySpark's
    own ``mapInArrow`` passes them), named once from the first batch's
    schema, which a stream keeps.
    """

    def __init__(self, plan: "_TaskPlan", context, routed, by, keys, first, rest):
        self.plan, self.context = plan, context
        self.routed, self.by, self.keys, self.first, self.rest = routed, by, keys, first, rest
        self.inputs = None  # mapInArrow's input columns, as a Java sequence (``tasks``)
        self.template: _PlanTemplate | None = None  # the plan PySpark's calls built last, for the next batches
        self.pending: tuple | None = None  # (session, rows, Java Dataset, return type, settings): not templated yet
        self.building: tuple[threading.Thread, list] | None = None  # the thread making the next template, its result
        self.declined = False  # whether the template declined a batch's function (``_PlanTemplate.rebase``)

    @classmethod
    def build(cls, plan: "_TaskPlan", context) -> "_JavaPlan":
        from pyspark.sql.classic.column import _to_java_column, _to_seq

        keys = first = rest = None
        if plan.partials is not None:
            keys = _to_seq(context, plan.partials_keys, _to_java_column)
            first, rest = plan.partials[0]._jc, _to_seq(context, plan.partials[1:], _to_java_column)
        return cls(plan, context, _to_seq(context, plan.routed, _to_java_column), plan.by._jc, keys, first, rest)

    def tasks(self, batch_df, parallelism: int, process: Callable):
        """``batch_df`` routed to ``parallelism`` instances, each running ``process`` (``MicroBatch._run_tasks``)."""
        from pyspark.sql.classic.dataframe import DataFrame
        from pyspark.sql.pandas.functions import pandas_udf
        from pyspark.util import PythonEvalType

        session = batch_df.sparkSession
        rows = batch_df._jdf.queryExecution().analyzed()
        if self.building is not None:
            self.template = self._built()
        if self.template is not None:
            if self.template.fits(rows):
                mapped = self.template.rebase(rows, process)
                if mapped is not None:
                    return DataFrame(mapped, session)
                self.declined = True  # so will every batch's function: no more templates to build and drop
            self.template = None  # the plan built next takes its place (and holds this batch's rows, not older ones)
        # The first batch, one whose rows or context changed, or a function the template declines: PySpark's calls.
        mapped, return_type = self._mapped(self._routed(batch_df._jdf, parallelism), session, process)
        if not self.declined:
            self.pending = (session, rows, mapped, return_type, _PlanTemplate.settings_of(self.context))
        return DataFrame(mapped, session)

    def _mapped(self, routed, session, process: Callable):
        """``routed`` (a Java ``Dataset``) mapped by ``process`` in ``mapInArrow``, and the UDF's return type."""
        from pyspark.sql.classic.dataframe import DataFrame
        from pyspark.sql.pandas.functions import pandas_udf
        from pyspark.util import PythonEvalType

        if self.inputs is None:
            self._name_inputs(DataFrame(routed, session).columns)
        udf = pandas_udf(process, returnType=self.plan.output_schema,
                         functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF)._unwrapped
        return routed.mapInArrow(udf._judf.apply(self.inputs), False, None), udf.returnType

    def _routed(self, frame, parallelism: int):
        """The Java ``Dataset`` of ``frame``'s rows routed to ``parallelism`` instances (and their JVM partials)."""
        routed = frame.select(self.routed).repartitionById(parallelism, self.by)
        return routed.groupBy(self.keys).agg(self.first, self.rest) if self.keys is not None else routed

    def _name_inputs(self, names: list[str]) -> None:
        """``mapInArrow``'s input columns: every column of the routed rows, by name."""
        from pyspark.sql.classic.column import _to_java_column, _to_seq

        from spark_state.routing import quoted_identifier

        jf = _JvmColumns(self.context)
        self.inputs = _to_seq(self.context, [jf.col(quoted_identifier(name)) for name in names], _to_java_column)

    def prepare_first(self, stream_df, parallelism: int) -> None:
        """Before the first batch, make the template its plan takes (``_PlanTemplate``) from ``stream_df``, the
        stream itself, routed and mapped as a batch's rows are.

        Spark gives each batch's rows the attributes of the stream's own
        (its ``foreachBatch`` frame is the query's plan over the batch's
        data), so the plan of the stream holds over them as the plan of an
        earlier batch does (``_PlanTemplate.fits`` checks it), with the
        batch's function in place of a placeholder. The first batch then
        costs a dozen py4j calls instead of Spark's analysis of each step.
        """
        def process(batches):  # named as the batches' own function (``MicroBatch._run_tasks``): the plan names it
            raise AssertionError("a plan made for no batch ran (a defect of spark-state, please report it)")

        session = stream_df.sparkSession
        mapped, return_type = self._mapped(self._routed(stream_df._jdf, parallelism), session, process)
        rows = stream_df._jdf.queryExecution().analyzed()
        self.template = _PlanTemplate.build(self.context, session, rows, mapped, return_type,
                                            _PlanTemplate.settings_of(self.context))

    def prepare(self) -> None:
        """Start making the template of the plan ``tasks`` made last, if any, in a thread (``_built`` waits)."""
        if self.pending is None:
            return
        arguments, self.pending = (self.context, *self.pending), None
        self.building = _in_thread("spark-state plan template", lambda: _PlanTemplate.build(*arguments))

    def _built(self) -> "_PlanTemplate | None":
        """The template the thread ``prepare`` started made (waiting for it), or None."""
        building, self.building = self.building, None
        return _joined(building, "make the plan template of the last batch",
                       "this batch's plan is made by PySpark's calls")


def _in_thread(name: str, make: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """Start ``make`` in a daemon thread named ``name``; the list receives what it returns or the exception it
    raised (``_joined``)."""
    result: list = []

    def run() -> None:
        try:
            result.append(make())
        except Exception as error:  # noqa: BLE001  (handed to ``_joined``)
            result.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def _joined(started: tuple[threading.Thread, list], failed: str, instead: str) -> Any:
    """What ``_in_thread``'s thread made (waiting for it); None when it raised, with a warning that it could not
    ``failed`` and what happens ``instead``."""
    thread, result = started
    thread.join()
    made = result[0] if result else None
    if isinstance(made, Exception):
        _LOG.warning("spark-state: could not %s (%s: %s); %s", failed, type(made).__name__, made, instead)
        return None
    return made


class _PlanTemplate:
    """A batch's analysed plan in about a dozen py4j calls: the plan of an earlier batch, on this batch's rows.

    Spark analyses a plan again at every ``Dataset`` step (the ``select``
    with the key-group expression, ``repartitionById``, the partial
    aggregate, ``mapInArrow``): 17-45 ms in every batch, on the driver's
    critical path. Two parts of the plan differ between the batches of a
    parallelism: the batch's rows (a leaf whose output, the same attributes
    with the same ids, a stream keeps) and the pickled function. So this
    keeps the analysed plan that PySpark's calls built for one batch and
    makes each next batch's as Spark would: a copy of each node of the chain
    above the rows with its child replaced (case-class copies, from the
    node's elements: that holds across Spark versions, whatever their
    constructors take), the top one around a copy of its ``PythonUDF`` with
    a new ``SimplePythonFunction`` made as PySpark makes it, from the new
    pickled ``(function, return type)`` and the first one's other parts.
    The result is marked analysed, as Spark marks what it has analysed, so
    the ``Dataset`` over it is not analysed again: it is the plan Spark's
    analysis gives, as ``tests/test_keyed_spark.py`` checks against it.

    It does not fit (``fits``) a batch whose rows have other attributes, or
    a context whose environment or includes changed since (PySpark puts both
    into the function), and ``rebase`` declines (returns None) what PySpark
    would ship differently: a pickled function past Spark's broadcast
    threshold, or one that pickles broadcast variables. That batch's plan
    is built the usual way, and becomes the template of the next batches
    (made once that batch is committed); except after a declined function:
    a function of the same query reads the same broadcasts in every batch,
    so ``_JavaPlan`` builds no more templates for it (each would cost about
    15 py4j calls, to be declined again). A template holds the nodes of the latest batch it
    made (``rebase`` keeps them), so no older batch's rows stay referenced:
    their RDD, and the shuffle files of a stream that shuffles before
    ``keyed``, are released as Spark releases them.
    """

    def __init__(self, context, session, rows, chain, udf, udf_parts, function_index, function_parts, return_type,
                 settings):
        self.context, self.session, self.return_type = context, session._jsparkSession, return_type
        self.rows_output = rows.output()
        self.chain = chain  # (node, its elements, the index of its child), from the top down to the rows
        self.udf, self.udf_parts, self.function_index = udf, udf_parts, function_index
        self.function_parts = function_parts  # all but the first, the pickled function (kilobytes to copy)
        self.threshold = context._jvm.PythonUtils.getBroadcastThreshold(context._jsc)
        self.new_function = context._jvm.SimplePythonFunction
        self.datasets = context._jvm.org.apache.spark.sql.classic.Dataset
        self.settings = settings

    @classmethod
    def build(cls, context, session, rows, mapped, return_type, settings) -> "_PlanTemplate | None":
        """The template of ``mapped`` (a Java ``Dataset``) over ``rows`` (the batch's analysed plan), built in
        the context's ``settings`` (``settings_of``), if its plan is a chain of one-child nodes down to ``rows``
        whose top node's first element is the Python UDF."""
        node, chain = mapped.queryExecution().analyzed(), []
        while not node.fastEquals(rows):
            if node.children().size() != 1:
                return None
            child = node.children().head()
            parts = _elements(node)
            index = _index_of(parts, child)
            if index is None:
                return None
            chain.append((node, parts, index))
            node = child
        if not chain or chain[0][0].nodeName() != "MapInArrow":
            return None
        udf = chain[0][1][0]
        if udf.getClass().getSimpleName() != "PythonUDF":
            return None
        udf_parts, function = _elements(udf), udf.func()
        function_index = _index_of(udf_parts, function)
        if function_index is None:
            return None
        function_parts = _elements(function, first=1)
        return cls(context, session, rows, chain, udf, udf_parts, function_index, function_parts, return_type,
                   settings)

    @staticmethod
    def settings_of(context) -> tuple:
        """What of ``context`` PySpark puts into a Python function: its environment and includes."""
        return dict(context.environment), list(context._python_includes)

    def fits(self, rows) -> bool:
        """Whether the template's plan holds over ``rows`` (a batch's analysed plan) in the context as it is."""
        return self.settings_of(self.context) == self.settings and rows.output().equals(self.rows_output)

    def rebase(self, rows, process: Callable):
        """The template's plan over ``rows`` mapped by ``process``, as a Java ``Dataset``; None where PySpark
        would ship the function differently."""
        from pyspark.serializers import CloudPickleSerializer

        pickled = CloudPickleSerializer().dumps((process, self.return_type))
        broadcasts = self.context._pickled_broadcast_vars  # (a registry, always true: it has no len)
        if next(iter(broadcasts), None) is not None or len(pickled) > self.threshold:
            broadcasts.clear()  # PySpark pickles the function again, and collects them again
            return None
        function = self.new_function(bytearray(pickled), *self.function_parts)
        udf = self.udf.copy(*_replaced(self.udf_parts, self.function_index, function))
        plan, chain = rows, []
        for depth in range(len(self.chain) - 1, -1, -1):
            node, parts, child = self.chain[depth]
            parts = _replaced(parts, child, plan)
            if depth == 0:
                parts = _replaced(parts, 0, udf)
            plan = node.copy(*parts)
            chain.append((plan, parts, child))
        self.chain = chain[::-1]  # the next batch copies these: the template holds no older batch's rows
        plan.setAnalyzed()
        return self.datasets.ofRows(self.session, plan)


def _elements(node, first: int = 0) -> list:
    """The elements of a JVM case class (its first parameter list), in order, from the ``first``."""
    return [node.productElement(i) for i in range(first, node.productArity())]


def _index_of(parts: list, element) -> int | None:
    """The index of the JVM object ``element`` among ``parts`` (None if it is not one of them)."""
    return next((i for i, part in enumerate(parts) if hasattr(part, "equals") and part.equals(element)), None)


def _replaced(parts: list, index: int, value) -> list:
    return [value if i == index else part for i, part in enumerate(parts)]


def _spark_partials(function: Aggregate, jf: _JvmColumns) -> tuple:
    """Spark's aggregates of ``function``'s partials (see ``_TaskPlan``), and the row count."""
    column = jf.col(function.column) if function.column is not None else None
    spark_partials = {  # the values Arrow's group_by computes for the same names
        "count_all": lambda: jf.call("count", jf.lit(1)),
        "count": lambda: jf.call("count", column),
        "sum": lambda: jf.call("sum", column),
        "min": lambda: jf.call("min", column),
        "max": lambda: jf.call("max", column),
    }
    partials = [jf.alias(spark_partials[op](), f"{PARTIAL_PREFIX}{i}")
                for i, op in enumerate(function.definition.partials)]
    return (*partials, jf.alias(jf.call("count", jf.lit(1)), ROWS_COLUMN))
