"""The driver's part of every micro-batch of a keyed query: only the Spark calls around the ``Coordinator``.

A ``StatefulQuery`` is a Structured Streaming query whose ``foreachBatch``
runs ``MicroBatch.run`` for every micro-batch N:

1. read the settings (``spark.state.*``) from the session that started the
   query, so a changed parallelism applies from the next batch on;
2. ask Spark's checkpoint about batch N (query id, start and end offsets,
   processing time; with ``idle_after`` the watermark follows the clock when
   the source has been idle: ``eventtime.idle_watermark``)
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
   (Spark's ``offsets/N``, the record Spark replays from), its binding to
   the query, and when the component next has work without rows
   (``model.wake``, from the instances' earliest timers: the query's clock
   source runs a batch then);
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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
from pyspark.accumulators import AccumulatorParam

from spark_state.driver.conf import StateConf, check_store_reachable, default_store, session_master
from spark_state.driver.coordinator import BatchClock, Coordinator, SparkBatch, check_reports
from spark_state.errors import CheckpointError
from spark_state.executor.report import InstanceReport
from spark_state.executor.task import META_COLUMN, TaskSpec, report_from_meta, run_instance
from spark_state.hosts.worker import run_hosted
from spark_state.model.eventtime import idle_watermark
from spark_state.model.timers import TIMERS
from spark_state.redaction import redact
from spark_state.spark.checkpoint import SparkCheckpoint, batch_start_offsets
from spark_state.spark.plan import TaskPlan, in_thread, joined, task_output_schema
from spark_state.spark.sinks import BatchSink
from spark_state.spark.stop_watch import unwatch as unwatch_stops
from spark_state.store.drain import finish_request, pending_requests
from spark_state.store.manifest import ComponentManifest, ComponentSpec, check_compatible
from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.reports import (
    clear_task_reports,
    task_reports,
    write_batch_report,
    write_task_report,
)
from spark_state.store.sources import is_clock_source
from spark_state.store.stops import record_stop

_LOG = logging.getLogger(__name__)

QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""Local property Spark sets on the thread that runs a streaming query's micro-batches."""
RUN_ID_PROPERTY = "spark.jobGroup.id"
"""Spark runs each streaming query's jobs in a job group named by the run id."""


def location_name(uri: str) -> str:
    """How a checkpoint location is named in state checkpoints and sink ids: a local path as a path."""
    return uri[len("file:") :] if uri.startswith("file:/") and not uri.startswith("file://") else uri


def _requests_since(storage, before: dict | None) -> int | None:
    """Requests ``storage`` made since its ``counters()`` were ``before`` (None if it does not count them)."""
    after = storage.counters()
    return None if before is None or after is None else after["requests"] - before["requests"]


def _wake_of(manifest, component: str) -> int | None:
    """The wake-up the checkpoint of a batch records (``model.wake``; None for a replayed batch)."""
    return manifest.components[component].wake_ms if manifest is not None else None


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


@dataclass(frozen=True)
class _StoredReports:
    """Where tasks send their reports over Spark Connect, which has no accumulators: the store
    (``store.reports``); ``add`` takes what an accumulator's would."""

    store_uri: str
    instance: int

    def add(self, received: list[tuple[str, str]]) -> None:
        from spark_state.storage import open_storage

        storage = open_storage(self.store_uri)
        for attempt, meta in received:
            write_task_report(storage, attempt, self.instance, meta)


def _strip_reports(batches, reports, attempt: str, schema: pa.Schema):
    """A task's output batches in the declared (nullable) ``schema``; its report batch goes to ``reports``."""
    for batch in batches:
        if batch.schema.names == [META_COLUMN]:
            reports.add([(attempt, batch.column(0)[0].as_py())])
        else:
            yield batch if batch.schema == schema else pa.RecordBatch.from_arrays(batch.columns, schema=schema)


_NOT_PICKLED = ("session", "query", "_lock", "_stop_lock", "_coordinators", "_task_plans", "_preparing", "_reports")
"""What of a ``MicroBatch`` stays in the process that made it (``MicroBatch.__getstate__``)."""


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
    _task_plans: dict[tuple[int, int], TaskPlan] = field(default_factory=dict)
    _preparing: dict[tuple[int, int], tuple[threading.Thread, list]] = field(default_factory=dict)
    _reports: Any = None  # the accumulator the tasks send their reports through (``_Reports``)
    _stopper: threading.Thread | None = None
    _stops_recorded: set[str] = field(default_factory=set)
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    _warned_unbounded: bool = False
    started_store: str | None = None  # the store the query started with (``conf``), once started
    accelerated: bool = True  # whether step 3's plans take ``plan.TaskPlan.java`` (``plan.accelerated``)
    _warned_store: bool = False
    remote: bool = False  # whether it runs in a Spark Connect server's Python process (``__setstate__``)
    run_id: str | None = None  # the run it serves over Spark Connect, once its first batch found it

    def __getstate__(self) -> dict:
        """What Spark Connect ships to the server's Python process that runs the query's ``foreachBatch``.

        Over Connect the driver's part of each batch runs there, not in the
        client that started the query: the client's session, query, threads
        and caches stay behind, and so does the stream's DataFrame (each
        batch's own has its schema). The client then reads the batches'
        reports from the store (``store.reports``), and ``set_parallelism``
        reaches the server through the client's session conf, which the
        server reads at every batch (``conf.run_parallelism_key``).
        """
        state = {name: value for name, value in self.__dict__.items() if name not in _NOT_PICKLED}
        state["stream"] = replace(self.stream, keyed=replace(self.stream.keyed, df=None))
        state["history"], state["_stopper"], state["fault_hook"] = [], None, None
        return state

    def __setstate__(self, state: dict) -> None:
        from pyspark.sql import SparkSession

        self.__dict__.update(state)
        # Spark Connect's foreachBatch worker unpickles the function while the client's own session is active:
        # its conf is the client's, live, and its streams list the query (``spark_batch``).
        self.session = SparkSession.getActiveSession()
        self.query, self._reports, self.remote = None, None, True
        self._lock, self._stop_lock = threading.Lock(), threading.Lock()
        self._coordinators, self._task_plans, self._preparing = {}, {}, {}

    def coordinator(self, conf: StateConf) -> Coordinator:
        """One per setting, kept for the query's life, so parsed manifests are reused across batches."""
        key = (conf.store, conf.checkpoints_retained)
        if key not in self._coordinators:
            manifests = open_manifest_log(conf.store, retained=conf.checkpoints_retained)
            self._coordinators[key] = Coordinator(manifests, store=conf.store)
        return self._coordinators[key]

    def conf(self) -> StateConf:
        """Settings for the next batch, from the session that started the query.

        The store (``spark.state.store`` and ``spark.state.s3.*``) is the one
        the query started with, as Spark's checkpoint location is: a change
        of those settings while it runs is for the next query to start, and
        is logged once.
        """
        conf = StateConf.from_session(
            self.session, default_store=lambda: default_store(self.checkpoint_location), run_id=self.run_id
        )
        if self.started_store is not None and conf.store != self.started_store:
            if not self._warned_store:
                self._warned_store = True
                _LOG.warning(
                    "component %r: spark.state.store (or spark.state.s3.*) changed while the query runs; it keeps "
                    "the store it started with, %s (the setting applies to queries started from now on)",
                    self.stream.keyed.name,
                    redact(self.started_store),
                )
            conf = replace(conf, store=self.started_store)
        check_store_reachable(conf.store, session_master(self.session), shared=conf.shared_local_store)
        if self.parallelism_override is not None:
            conf = replace(conf, parallelism=self.parallelism_override)
        return conf

    def component_spec(self, conf: StateConf, stored: ComponentManifest | None = None) -> ComponentSpec:
        """The component the query declares under ``conf``, continuing ``stored`` (whose key space it keeps
        when ``spark.state.maxParallelism`` is unset: ``StateConf.key_space``)."""
        stream = self.stream
        event_time = stream.keyed.event_time
        key_space = conf.key_space(stored.max_parallelism if stored is not None else None)
        return ComponentSpec(
            stream.keyed.name,
            key_space,
            conf.parallelism,
            stream.schema,
            event_time.delay_ms if event_time is not None else None,
        )

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
        checkpoint = self.spark_checkpoint
        query_id, run_id = self._identity(batch_df)
        if query_id is None:  # a binding without a query id would pass for any query's
            raise CheckpointError(
                f"Spark's checkpoint {checkpoint.uri} has no metadata file naming the query's id, and Spark did not "
                "name it to the batch: the checkpoint location was changed while the query ran; restart the query"
            )
        entry = checkpoint.offsets_entry(batch_id)
        if entry is None:
            raise CheckpointError(
                f"Spark's offsets log has no entry {checkpoint.uri}/offsets/{batch_id} for the micro-batch it "
                "runs; the checkpoint location was changed while the query ran"
            )
        end, timestamp_ms = entry
        start = batch_start_offsets(self.session, query_id, batch_id, checkpoint)
        return SparkBatch(  # the clock holds no rows: the state records the query's own sources only
            query_id=query_id,
            run_id=run_id,
            batch_id=batch_id,
            checkpoint_location=self.checkpoint_location,
            end={source: offsets for source, offsets in end.items() if not is_clock_source(source)},
            start={source: offsets for source, offsets in start.items() if not is_clock_source(source)},
            timestamp_ms=timestamp_ms,
        )

    def _identity(self, batch_df) -> tuple[str | None, str | None]:
        """The ids of the query and of its run. A classic session names both to the batch's thread (local
        properties); over Spark Connect the query's id is in its checkpoint and the client's session lists the
        query, with its run id (found at the first batch, kept for the run: each start ships a new copy)."""
        if not self.remote:
            context = batch_df.sparkSession.sparkContext
            query_id = context.getLocalProperty(QUERY_ID_PROPERTY) or self.spark_checkpoint.query_id()
            return query_id, context.getLocalProperty(RUN_ID_PROPERTY)
        query_id = self.spark_checkpoint.query_id()
        if self.run_id is None and query_id is not None:
            query = self.session.streams.get(query_id)
            if query is not None:
                self.query, self.run_id = query, str(query.runId)
        return query_id, self.run_id

    def run(self, batch_df, batch_id: int) -> None:
        with self._lock:
            self._run(batch_df, batch_id)

    def _run(self, batch_df, batch_id: int) -> None:
        spark_batch = self.spark_batch(batch_df, batch_id)
        conf = self.conf()
        coordinator = self.coordinator(conf)
        stream = self.stream
        event_time = stream.keyed.event_time
        plan = coordinator.plan(spark_batch, restore_from=conf.restore_from)
        base = plan.base.components.get(stream.keyed.name) if plan.base is not None else None
        spec = self.continuing(conf, base)
        drain, ignored = self._drain_wanted(coordinator, spark_batch, plan)
        watermark = base.watermark_ms if base is not None else None
        if event_time is not None and base is not None:  # an idle source's watermark follows the clock
            watermark = idle_watermark(
                watermark, base.max_event_time_ms, base.rows_at_ms, spark_batch.timestamp_ms, event_time
            )
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
            watermark_ms=watermark,
            processing_ms=spark_batch.timestamp_ms,
            drain=drain,
            resident_memory=conf.resident_memory,
            run_id=spark_batch.run_id,
        )
        self._warn_if_unbounded(conf)
        attempt = uuid.uuid4().hex  # names this attempt's reports among any late ones of an earlier attempt
        output = self._run_tasks(batch_df, task, conf.instance_hosts, attempt)
        self.sink.write(output, batch_id)
        by_instance = self._received(coordinator, attempt)
        if sorted(by_instance) != list(range(conf.parallelism)):  # the sink ran no action on (all of) the output
            output.write.format("noop").mode("overwrite").save()
            by_instance = self._received(coordinator, attempt)
        reports = [by_instance[i] for i in sorted(by_instance)]
        check_reports(reports, conf.parallelism)
        self._fault("output_written", batch_id)
        storage = coordinator.manifests.storage
        committing, wire = time.perf_counter(), storage.counters()
        ttl = getattr(stream.function, "ttl", None)
        clock = BatchClock(watermark, event_time, ttl.kind if ttl is not None else None)
        manifest = coordinator.commit(plan, spark_batch, spec, reports, drained=drain, clock=clock)
        self.key_space = spec.max_parallelism  # the store's from now on: set_parallelism checks against it
        commit_seconds, commit_requests = time.perf_counter() - committing, _requests_since(storage, wire)
        cleanup_seconds, cleanup_requests = 0.0, _requests_since(storage, storage.counters())
        if manifest is not None:
            self._fault("committed", batch_id)
            cleaning, wire = time.perf_counter(), storage.counters()
            coordinator.cleanup(manifest, grace_seconds=conf.orphan_grace_seconds)
            cleanup_seconds, cleanup_requests = time.perf_counter() - cleaning, _requests_since(storage, wire)
        if self.remote:
            clear_task_reports(storage)
        if drain:
            self._drained(coordinator, spark_batch)
        if self.accelerated:
            self._task_plan(task, batch_df).java(
                batch_df.sparkSession.sparkContext
            ).prepare()  # the next batch's, meanwhile
        entry = {
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
            "wake_ms": _wake_of(manifest, stream.keyed.name),  # when the clock next runs a batch (None: never)
            "commit_seconds": round(commit_seconds, 4),  # the driver's step 5: the manifest record, created
            "cleanup_seconds": round(cleanup_seconds, 4),  # step 6: what no retained checkpoint needs, deleted
            "commit_requests": commit_requests,  # storage requests of step 5 (None: the backend does not count)
            "cleanup_requests": cleanup_requests,
            "instances": sorted((r.to_json() for r in reports), key=lambda m: m["instance"]),
        }
        self.history.append(entry)
        if self.remote and spark_batch.run_id is not None:  # the client reads it from the store
            write_batch_report(storage, spark_batch.run_id, entry)

    def _received(self, coordinator: Coordinator, attempt: str) -> dict[int, InstanceReport]:
        """The reports the tasks of ``attempt`` sent: through the accumulator, or the store over Connect."""
        if self.remote:
            texts = task_reports(coordinator.manifests.storage, attempt)
            return reports_of([(attempt, text) for text in texts], attempt)
        return reports_of(self._reports.value, attempt)

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
                    _LOG.warning(
                        "spark-state: could not record in %s that run %s stopped (%s); its instance "
                        "hosts keep its state until they idle out",
                        storage.uri,
                        run_id,
                        error,
                    )

    def _run_tasks(self, batch_df, task: TaskSpec, hosted: bool, attempt: str):
        """Step 3: the output DataFrame, whose every action routes the rows to the instances and runs their tasks.

        Each task sends its report through the ``_Reports`` accumulator,
        tagged with ``attempt``.
        """
        plan = self._task_plan(task, batch_df)
        run = run_hosted if hosted else run_instance
        remote, schema = self.remote, task_output_schema(task.output_schema)
        if not remote:
            if self._reports is None:
                self._reports = batch_df.sparkSession.sparkContext.accumulator([], _Reports())
            self._reports.value = []  # earlier batches' (a late one of a failed attempt is not this attempt's)
        accumulated = self._reports

        def process(batches):
            from pyspark import TaskContext

            instance = TaskContext.get().partitionId()
            reports = _StoredReports(task.store_uri, instance) if remote else accumulated
            yield from _strip_reports(run(task, instance, batches), reports, attempt, schema)

        if not self.accelerated:
            return plan.tasks(batch_df, task.parallelism, process)
        return plan.java(batch_df.sparkSession.sparkContext).tasks(batch_df, task.parallelism, process)

    def _warn_if_unbounded(self, conf: StateConf) -> None:
        """Say once per query that ``spark.state.residentMemory`` does not bound a component with timers."""
        has_timers = self.stream.schema.has_variable(TIMERS.name)
        if conf.resident_memory is not None and has_timers and not self._warned_unbounded:
            self._warned_unbounded = True
            _LOG.warning(
                "spark.state.residentMemory does not bound component %r: it has timers or a time to live, "
                "and its state stays in memory whole; its batch reports say bounded=false",
                self.stream.keyed.name,
            )

    def _task_plan(self, task: TaskSpec, batch_df=None) -> TaskPlan:
        """The Spark expressions of step 3 for ``task``'s parallelism, built once (each costs JVM round trips):
        by ``prepare_plan``'s thread when it was asked for, else now (from ``batch_df``'s columns over Spark
        Connect, where the stream's own DataFrame stayed with the client)."""
        key = (task.parallelism, task.max_parallelism)
        plan = self._task_plans.get(key)
        if plan is None:
            plan = self._prepared(key) or TaskPlan.build(
                self.stream,
                task.parallelism,
                task.max_parallelism,
                accelerated=self.accelerated,
                frame=batch_df if self.stream.keyed.df is None else None,
            )
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
        if key in self._task_plans or key in self._preparing or not self.accelerated:
            return  # the public path's plan costs no JVM round trips to prepare
        stream, context = self.stream, self.session.sparkContext

        def build() -> TaskPlan:
            plan = TaskPlan.build(stream, parallelism, max_parallelism)
            plan.java(context).prepare_first(stream.keyed.df, parallelism)
            return plan

        self._preparing[key] = in_thread("spark-state plan", build)

    def _prepared(self, key: tuple[int, int]) -> TaskPlan | None:
        """The plan ``prepare_plan`` built for ``key`` (waiting for its thread), or None."""
        preparing = self._preparing.pop(key, None)
        if preparing is None:
            return None
        return joined(preparing, f"prepare the plan of parallelism {key[0]}", "the batch builds it")

    def _fault(self, stage: str, batch_id: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, batch_id)
