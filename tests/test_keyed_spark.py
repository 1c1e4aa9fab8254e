"""End-to-end: the keyed operator in Spark, through rescales, faults and live parallelism changes.

Input is a directory of Parquet files read one file per micro-batch, so the
input of every batch is fixed and replayable. The sink keeps each batch's
output by batch id (overwriting on replay, as an idempotent sink must), and
the expected output is computed from the same files by a plain Python model.
"""

from __future__ import annotations

import logging
import os
import time
import zipfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from spark_state import keyed
from spark_state.errors import ConfigError, StateBehindQueryError
from spark_state.spark.microbatch import MicroBatch
from spark_state.spark.stop_watch import watched_runs
from spark_state.storage.local import LocalStorage
from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.stops import stopped_run
from tests.diagnostics import stalled
from tests.files import publish

pytestmark = pytest.mark.spark

SCHEMA = "user string, amount long"


class Job:
    """One logical job: input files, state store, Spark checkpoint and the exact expected outputs."""

    def __init__(self, spark, root: Path, name: str = "clicks"):
        self.spark = spark
        self.root = root
        self.name = name
        self.input = root / "input"
        self.input.mkdir(parents=True)
        self.files: list[list[tuple[str, int]]] = []
        self.outputs: dict[int, dict[str, int]] = {}

    def add_batch(self, n: int, keys: int, salt: int) -> None:
        rows = [(f"u{(i * 7 + salt) % keys}", i % 5 + 1) for i in range(n)]
        index = len(self.files)
        path = self.input / f"part-{index:05d}.parquet"
        # The file source takes files in modification-time order: ``publish`` makes it the batch order.
        publish(pa.table({"user": [r[0] for r in rows], "amount": [r[1] for r in rows]}), path, index)
        self.files.append(rows)

    def expected(self) -> dict[int, dict[str, int]]:
        """Per batch id: the running count of every user seen in that batch."""
        totals: Counter = Counter()
        result = {}
        for batch_id, rows in enumerate(self.files):
            totals.update(user for user, _ in rows)
            result[batch_id] = {user: totals[user] for user, _ in rows}
        return result

    def stream(self):
        return self.spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(self.input))

    def sink(self, out, batch_id: int) -> None:
        self.outputs[batch_id] = {r["user"]: r["count"] for r in out.collect()}

    def run(self, parallelism: int, stream_fn=None, checkpoint: Path | None = None):
        """Process everything available at ``parallelism``; returns the StatefulQuery (stopped)."""
        self.spark.conf.set("spark.state.parallelism", str(parallelism))
        self.spark.conf.set("spark.state.store", str(self.root / "state"))
        stream = (
            stream_fn(keyed(self.stream(), "user", name=self.name))
            if stream_fn
            else keyed(self.stream(), "user", name=self.name).count()
        )
        query = (
            stream.writeStream.foreachBatch(self.sink)
            .option("checkpointLocation", str(checkpoint or self.root / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination()
        finally:
            query.stop()
        return query


@pytest.fixture(autouse=True)
def _clean_conf(spark):
    yield
    for key in ("spark.state.parallelism", "spark.state.store", "spark.state.maxParallelism", "spark.state.paralelism"):
        spark.conf.unset(key)


def _counting_fn(marker: Path, action: str):
    """A count written as a user function that fails once (raise or kill its worker) while ``marker`` exists."""

    def count(key, rows, state):
        try:
            marker.unlink()  # atomic: of two tasks seeing the marker, exactly one fails
        except FileNotFoundError:
            pass
        else:
            if action == "exit":
                os._exit(17)
            raise RuntimeError("injected task failure")
        total = (state.get()[0] if state.exists else 0) + len(rows)
        state.update((total,))
        return [{"user": key[0], "count": total}]

    return lambda k: k.apply(count, state_schema="count long", output_schema="user string, count long")


def test_rescale_3_5_1_8_with_faults_gives_exact_output(spark, tmp_path, monkeypatch):
    job = Job(spark, tmp_path)
    for salt in range(2):
        job.add_batch(400, keys=90, salt=salt)
    first = job.run(3)
    assert [b["parallelism"] for b in first.batches] == [3, 3]
    assert job.outputs == job.expected()

    # Resume at 5; the task of the first new batch raises once (the query fails and is restarted).
    job.add_batch(300, keys=120, salt=2)
    job.add_batch(300, keys=120, salt=3)
    marker = tmp_path / "fail-task"
    marker.touch()
    with pytest.raises(Exception, match="injected task failure"):
        job.run(5, _counting_fn(marker, "raise"))
    second = job.run(5, _counting_fn(marker, "raise"))
    assert {b["parallelism"] for b in second.batches} == {5}
    assert job.outputs == job.expected()

    # Resume at 1; the Python worker dies once.
    job.add_batch(200, keys=150, salt=4)
    marker.touch()
    with pytest.raises(Exception):  # noqa: B017 - Spark reports the worker that exited in several ways
        job.run(1, _counting_fn(marker, "exit"))
    job.run(1, _counting_fn(marker, "exit"))
    assert job.outputs == job.expected()

    # Resume at 8; the driver fails after our commit, before Spark's commit of the batch.
    job.add_batch(300, keys=200, salt=5)
    job.add_batch(300, keys=200, salt=6)
    crashed = []

    def crash_once(self, stage, batch_id):
        if stage == "committed" and not crashed:
            crashed.append(batch_id)
            raise RuntimeError("injected driver failure after commit")

    monkeypatch.setattr(MicroBatch, "_fault", crash_once)
    with pytest.raises(Exception, match="injected driver failure"):
        job.run(8)
    monkeypatch.undo()
    last = job.run(8)
    assert last.batches[0]["batch_id"] == crashed[0] and last.batches[0]["replayed"]
    assert job.outputs == job.expected()

    # The final state equals the model, read back from the store at yet another parallelism.
    manifest = open_manifest_log(str(tmp_path / "state")).latest()
    assert manifest.components["clicks"].parallelism == 8
    totals = Counter(user for rows in job.files for user, _ in rows)
    assert _state_counts(tmp_path / "state", "clicks", parallelism=3) == dict(totals)


@pytest.mark.parametrize("stage", ["sink", "output_written"])
def test_driver_failure_before_commit_replays_batch_exactly(spark, tmp_path, monkeypatch, stage):
    job = Job(spark, tmp_path)
    job.add_batch(300, keys=40, salt=0)
    job.add_batch(300, keys=40, salt=1)
    job.add_batch(300, keys=40, salt=2)

    def crash(self, at, batch_id):
        if at == stage and batch_id == 1:
            raise RuntimeError(f"injected driver failure at {at}")

    sink = job.sink

    def failing_sink(out, batch_id):  # batch 1: the tasks ran and wrote their blobs, the output is not delivered
        out.collect()
        crash(None, "sink", batch_id)
        sink(out, batch_id)

    if stage == "sink":
        monkeypatch.setattr(job, "sink", failing_sink)
    else:
        monkeypatch.setattr(MicroBatch, "_fault", crash)
    with pytest.raises(Exception, match="injected driver failure"):
        job.run(2)
    store = open_manifest_log(str(tmp_path / "state"))
    assert [store.load(i).binding.batch_id for i in store.ids()] == [0]
    monkeypatch.undo()
    job.run(3)
    assert job.outputs == job.expected()


@pytest.mark.parametrize("actions", [0, 2])
def test_a_foreach_batch_function_may_run_the_output_any_number_of_times(spark, tmp_path, monkeypatch, actions):
    """No action: the driver runs the tasks itself; two actions: the tasks run twice, from the same base."""
    job = Job(spark, tmp_path)
    for salt in range(4):
        job.add_batch(300, keys=40, salt=salt)
    sink = job.sink

    def odd_sink(out, batch_id):
        if batch_id % 2:
            for _ in range(actions):
                out.collect()
        else:
            sink(out, batch_id)

    monkeypatch.setattr(job, "sink", odd_sink)
    query = job.run(2)
    assert [b["batch_id"] for b in query.batches] == [0, 1, 2, 3]
    assert {b: job.outputs[b] for b in (0, 2)} == {b: job.expected()[b] for b in (0, 2)}
    totals = Counter(user for rows in job.files for user, _ in rows)
    assert _state_counts(tmp_path / "state", "clicks", parallelism=2) == dict(totals)


def test_parallelism_change_applies_at_next_batch_without_restart(spark, tmp_path, monkeypatch):
    """A parallelism set in the session applies at the next batch; one set with ``set_parallelism`` also has
    its plan made meanwhile (``MicroBatch.prepare_plan``), as the query's start makes the first batch's: those
    batches take a template (``_PlanTemplate.rebase``), the other one's plan is PySpark's."""
    from spark_state.spark import microbatch, plan

    prepared: list[int] = []  # the parallelisms whose plan a batch found made
    templated: list[bool] = []  # whether each batch given a template took it
    found, rebase = microbatch.MicroBatch._prepared, plan._PlanTemplate.rebase

    def recorded_prepared(self, key):
        plan = found(self, key)
        if plan is not None:
            prepared.append(key[0])
        return plan

    def recorded_rebase(self, rows, process):
        mapped = rebase(self, rows, process)
        templated.append(mapped is not None)
        return mapped

    monkeypatch.setattr(microbatch.MicroBatch, "_prepared", recorded_prepared)
    monkeypatch.setattr(plan._PlanTemplate, "rebase", recorded_rebase)
    job = Job(spark, tmp_path)
    spark.conf.set("spark.state.parallelism", "2")
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    query = (
        keyed(job.stream(), "user", name="clicks")
        .count()
        .writeStream.foreachBatch(job.sink)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .start()
    )
    try:
        job.add_batch(200, keys=30, salt=0)
        assert query.await_batches(1, timeout=120), stalled(spark)
        spark.conf.set("spark.state.parallelism", "5")
        job.add_batch(200, keys=30, salt=1)
        assert query.await_batches(2, timeout=120), stalled(spark)
        query.set_parallelism(3)
        job.add_batch(200, keys=30, salt=2)
        assert query.await_batches(3, timeout=120), stalled(spark)
    finally:
        query.stop()
    assert [b["parallelism"] for b in query.batches] == [2, 5, 3]
    assert job.outputs == job.expected()
    assert prepared == [2, 3] and templated == [True, True]  # the batch at 5 had PySpark build its plan


def test_the_key_space_is_the_store_s_unless_set_and_another_is_refused(spark, tmp_path):
    def key_space() -> int:
        return open_manifest_log(str(tmp_path / "state")).latest().components["clicks"].max_parallelism

    job = Job(spark, tmp_path)
    job.add_batch(100, keys=10, salt=0)
    job.run(2)
    assert key_space() == 1024  # a new store's default at parallelism 2
    spark.conf.set("spark.state.maxParallelism", "4096")
    job.add_batch(100, keys=10, salt=1)
    with pytest.raises(Exception, match="max parallelism is 4096 but the checkpoints were written with 1024"):
        job.run(2)
    spark.conf.unset("spark.state.maxParallelism")
    job.run(3)  # unset: the store's key space, whatever the parallelism
    assert key_space() == 1024
    assert job.outputs == job.expected()


def test_a_store_keeps_the_key_space_it_was_created_with_when_the_setting_is_unset(spark, tmp_path):
    job = Job(spark, tmp_path)
    job.add_batch(100, keys=10, salt=0)
    spark.conf.set("spark.state.maxParallelism", "4096")  # as every store created before the default changed
    job.run(2)
    spark.conf.unset("spark.state.maxParallelism")
    job.add_batch(100, keys=10, salt=1)
    job.run(3)
    assert open_manifest_log(str(tmp_path / "state")).latest().components["clicks"].max_parallelism == 4096
    assert job.outputs == job.expected()


def test_sum_and_arrow_apply(spark, tmp_path):
    job = Job(spark, tmp_path)
    job.add_batch(500, keys=25, salt=0)
    sums: dict[int, dict] = {}

    def sink(out, batch_id):
        sums[batch_id] = {r["user"]: r["sum_amount"] for r in out.collect()}

    spark.conf.set("spark.state.parallelism", "2")
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    query = (
        keyed(job.stream(), "user", name="amounts")
        .sum("amount")
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    expected = Counter()
    for user, amount in job.files[0]:
        expected[user] += amount
    assert sums == {0: dict(expected)}


def test_a_built_in_shuffles_each_batch_once_and_only_the_columns_it_needs(spark, tmp_path):
    """With its partials computed in the JVM, a batch of a built-in is one shuffle to the instances, then
    Spark's aggregate per key in the same stage; the shuffle carries only the columns the aggregate reads."""
    job = Job(spark, tmp_path)
    job.add_batch(200, keys=20, salt=0)
    plans: list[str] = []
    record = job.sink

    def sink(out, batch_id):
        plans.append(out._jdf.queryExecution().executedPlan().toString())
        record(out, batch_id)

    job.sink = sink
    job.run(2)
    assert job.outputs == job.expected()
    (plan,) = plans
    assert plan.count("Exchange") == 1, plan
    shuffled = plan.split("Exchange")[1].splitlines()[1]  # what the shuffle writes: ``amount`` is pruned
    assert shuffled.strip().startswith("+- *(1) Project [user#") and "amount" not in shuffled, plan
    assert "HashAggregate" in plan.split("Exchange")[0], plan


def test_later_batches_take_the_plan_of_the_first_with_their_own_rows_and_a_function_may_read_a_broadcast(
    spark, tmp_path, monkeypatch, caplog
):
    """The first batch takes the analysed plan of the stream itself, made while the query started, and each
    later batch the plan of the one before (``_PlanTemplate``), over its own rows and function: the plan Spark's
    analysis gives, node for node. A context whose includes changed makes the next plan PySpark's (and that one
    the template); a function that reads a broadcast variable has every plan built by PySpark, which ships the
    broadcast, and the instance hosts get its value. A template is built by a thread of its own, while the
    query starts or once the batch whose plan it copies is committed, so on no batch's critical path."""
    import re
    import threading

    from spark_state.spark import microbatch, plan

    templated: list[bool] = []
    built: list[bool] = []  # each template built (from the plan of a batch PySpark's calls made): whether it could be
    build_threads: set[str] = set()  # the names of the threads that ran ``_PlanTemplate.build``
    plans: list[str] = []
    java_plans, rows = [], []  # each batch's ``_JavaPlan`` and analysed rows
    rebase, tasks, build = plan._PlanTemplate.rebase, plan._JavaPlan.tasks, plan._PlanTemplate.build

    def recorded_rebase(self, rows, process):
        mapped = rebase(self, rows, process)
        templated.append(mapped is not None)
        return mapped

    def recorded_tasks(self, batch_df, parallelism, process):
        mapped = tasks(self, batch_df, parallelism, process)
        java_plans.append(self)
        rows.append(batch_df._jdf.queryExecution().analyzed())
        for step in ("analyzed", "optimizedPlan", "executedPlan"):  # ids differ between batches, nothing else
            plans.append(re.sub(r"(#|plan_id=)\d+", "", getattr(mapped._jdf.queryExecution(), step)().toString()))
        return mapped

    def recorded_build(*args):
        build_threads.add(threading.current_thread().name)
        template = build(*args)
        built.append(template is not None)
        return template

    monkeypatch.setattr(plan._PlanTemplate, "rebase", recorded_rebase)
    monkeypatch.setattr(plan._PlanTemplate, "build", recorded_build)
    monkeypatch.setattr(plan._JavaPlan, "tasks", recorded_tasks)
    job = Job(spark, tmp_path / "plain")
    for salt in range(4):
        job.add_batch(100, keys=10, salt=salt)
    module = tmp_path / "spark_state_test_include.zip"  # a zip (not a .py file) joins the includes
    with zipfile.ZipFile(module, "w") as archive:
        archive.writestr("spark_state_test_include.py", "")
    record = job.sink

    def sink(out, batch_id):
        record(out, batch_id)
        if batch_id == 0:  # new includes: the next UDF is PySpark's, and the template after it
            spark.sparkContext.addPyFile(str(module))

    job.sink = sink
    job.run(2)
    # Batch 0 takes the stream's plan, batch 1 is PySpark's (new includes), batches 2 and 3 take batch 1's.
    assert job.outputs == job.expected() and templated == [True, True, True]
    assert built == [True, True]  # from the stream's plan and from batch 1's
    assert build_threads == {"spark-state plan", "spark-state plan template"}  # never the thread running a batch
    assert java_plans[-1].pending is None and java_plans[-1].building is None
    assert len(plans) == 12 and plans[:3] * 4 == plans, plans
    # The template holds the last batch's rows (its nodes copy next), no older batch's (their RDDs are released).
    bottom = java_plans[-1].template.chain[-1][0].children().head()
    assert bottom.fastEquals(rows[-1]) and not any(bottom.fastEquals(old) for old in rows[:-1])

    # A function that reads a broadcast variable: PySpark builds every batch's UDF, to ship the broadcast.
    weights = spark.sparkContext.broadcast({"u1": 10})

    def weighted(key, rows, state):
        total = (state.get()[0] if state.exists else 0) + len(rows) * weights.value.get(key[0], 1)
        state.update((total,))
        return [{"user": key[0], "count": total}]

    templated.clear()
    built.clear()
    job = Job(spark, tmp_path / "broadcast")
    for salt in range(3):
        job.add_batch(100, keys=10, salt=salt)
    job.run(2, lambda k: k.apply(weighted, state_schema="count long", output_schema="user string, count long"))
    expected = {b: {u: c * (10 if u == "u1" else 1) for u, c in out.items()} for b, out in job.expected().items()}
    # Batch 1's function declined the template built from batch 0's plan; batch 2 has none to decline.
    assert job.outputs == expected and templated == [False] and java_plans[-1].template is None
    assert built == [True] and java_plans[-1].building is None

    # A build that fails (the session stopped under it, say) leaves the next batch to PySpark's calls.
    def failed_build(*args):
        raise RuntimeError("no template")

    monkeypatch.setattr(plan._PlanTemplate, "build", failed_build)
    templated.clear()
    job = Job(spark, tmp_path / "failed")
    for salt in range(3):
        job.add_batch(100, keys=10, salt=salt)
    with caplog.at_level(logging.WARNING, logger=microbatch.__name__):
        job.run(2)
    assert job.outputs == job.expected() and templated == [] and java_plans[-1].template is None
    warned = [r for r in caplog.records if "could not make the plan template" in r.getMessage()]
    assert len(warned) == 2  # at batches 1 and 2 (batch 2's own failed build has no next batch to wait for it)


def _state_counts(store_path: Path, component: str, parallelism: int) -> dict[str, int]:
    from spark_state.executor.resident import restore_instance
    from spark_state.store.blobstore import BlobStore

    manifests = open_manifest_log(str(store_path))
    comp = manifests.latest().components[component]
    result = {}
    for i in range(parallelism):
        state, _ = restore_instance(
            BlobStore(manifests.storage), comp, comp.keyed_schema, i, parallelism, comp.max_parallelism
        )
        result.update({key[0]: value[0] for _, key, value in state.table.items()})
    return result


def test_unsupported_settings_fail_before_the_first_batch(spark, tmp_path):
    job = Job(spark, tmp_path)
    spark.conf.set("spark.state.parallelism", "0")
    with pytest.raises(ConfigError, match="spark.state.parallelism=0"):
        keyed(job.stream(), "user", name="clicks").count().writeStream.foreachBatch(job.sink).option(
            "checkpointLocation", str(tmp_path / "chk")
        ).start()


def _first_seen_fn(k):
    """Count per key, and remember every new key in the instance's non-keyed items."""

    def count(key, rows, state):
        if not state.exists:
            state.instance_items.append(key[0])
        total = (state.get()[0] if state.exists else 0) + len(rows)
        state.update((total,))
        return [{"user": key[0], "count": total}]

    return k.apply(count, state_schema="count long", output_schema="user string, count long")


def test_instance_items_survive_rescales_without_loss_or_duplication(spark, tmp_path):
    import json

    job = Job(spark, tmp_path)
    for parallelism, salt in ((3, 0), (2, 1), (4, 2)):
        job.add_batch(300, keys=60 + 30 * salt, salt=salt)
        job.run(parallelism, _first_seen_fn)
        assert job.outputs == job.expected()
        store = open_manifest_log(str(tmp_path / "state"))
        component = store.latest().components["clicks"]
        assert component.parallelism == parallelism
        items = [
            item
            for i in sorted(component.instance_items)
            for item in json.loads(store.storage.read(component.instance_items[i].path))
        ]
        seen = {user for rows in job.files for user, _ in rows}
        assert sorted(items) == sorted(seen)


def test_new_query_resumes_from_state_checkpoint_and_its_source_offsets(spark, tmp_path):
    """A new checkpointLocation (e.g. after changing the query) starts where the state checkpoint stands."""
    from datasources.options import log_source_id

    log, store = str(tmp_path / "events"), str(tmp_path / "state")

    def append(users):
        spark.createDataFrame([(u,) for u in users], "user string").write.format("replayable").mode("append").option(
            "numSplits", 2
        ).option("keyColumn", "user").save(log)

    latest: dict[str, int] = {}

    def sink(out, batch_id):
        latest.update({r["user"]: r["count"] for r in out.collect()})

    def run(checkpoint, parallelism):
        spark.conf.set("spark.state.parallelism", str(parallelism))
        spark.conf.set("spark.state.store", store)
        events = (
            spark.readStream.format("replayable")
            .option("path", log)
            .option("startingOffsets", "checkpoint")
            .option("stateStore", store)
            .load()
        )
        query = (
            keyed(events, "user", name="clicks")
            .count()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    first = [f"u{i % 13}" for i in range(300)]
    append(first)
    run(str(tmp_path / "chk-a"), 2)
    recorded = open_manifest_log(store).latest().sources[log_source_id(log)]
    assert sum(v for k, v in recorded.items() if k != "source_id") == 300

    second = [f"u{i % 17}" for i in range(200)]
    append(second)
    run(str(tmp_path / "chk-b"), 3)  # a new query: Spark knows nothing, the state checkpoint knows all
    assert latest == dict(Counter(first + second))


def test_state_store_on_hdfs_rescales_with_exact_output(spark, tmp_path):
    """The same job with ``spark.state.store=hdfs://...`` (the loopback WebHDFS server of the tests)."""
    from tests.webhdfs_server import WebHdfsServer

    job = Job(spark, tmp_path)
    with WebHdfsServer(str(tmp_path / "namenode")) as server:
        store = server.url.replace("http://", "hdfs://") + "/jobs/clicks-state"

        def run(parallelism):
            spark.conf.set("spark.state.parallelism", str(parallelism))
            spark.conf.set("spark.state.store", store)
            query = (
                keyed(job.stream(), "user", name="clicks")
                .count()
                .writeStream.foreachBatch(job.sink)
                .option("checkpointLocation", str(tmp_path / "chk"))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination()
            return query

        job.add_batch(300, keys=50, salt=0)
        run(2)
        job.add_batch(300, keys=50, salt=1)
        rescaled = run(3)
        assert job.outputs == job.expected()
        assert sum(i["restore"]["bytes_read"] for i in rescaled.batches[0]["instances"]) > 0
        ranged_blob_reads = [
            r for r in server.requests if r.op == "OPEN" and "/blobs/" in r.path and "offset" in r.params
        ]
        assert ranged_blob_reads, "the restore at parallelism 3 must read blob ranges over WebHDFS"
        manifest = open_manifest_log(store).latest()
        assert manifest.components["clicks"].parallelism == 3
        assert os.path.isdir(server.local_path("/jobs/clicks-state/checkpoints"))


def test_store_recreated_at_the_same_path_is_not_served_from_stale_caches(spark, tmp_path):
    """Python workers cache manifests and state per store URI; a new store at the same path must not hit them."""
    import shutil

    first = Job(spark, tmp_path / "job")
    first.add_batch(300, keys=40, salt=0)
    first.add_batch(300, keys=40, salt=1)
    first.run(2)
    shutil.rmtree(tmp_path / "job")

    second = Job(spark, tmp_path / "job")
    second.add_batch(200, keys=25, salt=3)
    second.add_batch(200, keys=25, salt=4)  # its base, checkpoint 0, shares an id with the first job's
    second.run(2)
    assert second.outputs == second.expected()


def test_a_lost_state_record_stops_the_query_and_restoring_it_recovers(spark, tmp_path):
    job = Job(spark, tmp_path)
    for salt in range(3):
        job.add_batch(200, keys=30, salt=salt)
    job.run(2)
    store = open_manifest_log(str(tmp_path / "state"))
    committed = store.ids()
    record = tmp_path / "state" / "checkpoints" / f"{committed[-1]:020d}.json"
    kept = record.read_bytes()
    record.unlink()  # the newest record is lost; older ones remain
    job.add_batch(200, keys=30, salt=3)
    with pytest.raises(StateBehindQueryError, match="micro-batches 2..2 are missing"):
        job.run(2)
    assert sorted(job.outputs) == [0, 1, 2]
    assert open_manifest_log(str(tmp_path / "state")).ids() == committed[:-1]
    record.write_bytes(kept)  # the documented recovery: restore the record
    job.run(3)
    assert job.outputs == job.expected()


def test_a_new_checkpoint_location_on_a_store_with_state_is_refused(spark, tmp_path):
    job = Job(spark, tmp_path)
    job.add_batch(200, keys=30, salt=0)
    job.add_batch(200, keys=30, salt=1)
    job.run(2)
    before = dict(job.outputs)
    committed = open_manifest_log(str(tmp_path / "state")).ids()
    # A new checkpointLocation makes Spark read the files from the start: the state would count them twice.
    with pytest.raises(Exception, match="StateOfAnotherQueryError") as error:
        job.run(2, checkpoint=tmp_path / "chk-new")
    assert "the source's beginning" in str(error.value) and "does not continue it" in str(error.value)
    assert job.outputs == before
    assert open_manifest_log(str(tmp_path / "state")).ids() == committed


def test_replayable_sink_appends_each_batch_once_across_a_replay(spark, tmp_path, monkeypatch):
    job = Job(spark, tmp_path)
    for salt in range(3):
        job.add_batch(150, keys=20, salt=salt)
    sink_log = str(tmp_path / "counts-log")

    def run(parallelism):
        spark.conf.set("spark.state.parallelism", str(parallelism))
        spark.conf.set("spark.state.store", str(tmp_path / "state"))
        query = (
            keyed(job.stream(), "user", name="clicks")
            .count()
            .writeStream.format("replayable")
            .option("path", sink_log)
            .option("keyColumn", "user")
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    def crash(self, at, batch_id):
        if at == "output_written" and batch_id == 1:
            raise RuntimeError("injected driver failure after the sink write")

    monkeypatch.setattr(MicroBatch, "_fault", crash)
    with pytest.raises(Exception, match="injected driver failure"):
        run(2)
    monkeypatch.undo()
    run(3)
    rows = spark.read.format("replayable").load(sink_log).select("user", "count").collect()
    expected = job.expected()
    assert sorted((r["user"], r["count"]) for r in rows) == sorted(
        (user, count) for batch in expected.values() for user, count in batch.items()
    )


def test_a_misspelled_setting_or_a_non_integer_parallelism_is_refused_by_name(spark, tmp_path):
    job = Job(spark, tmp_path)
    spark.conf.set("spark.state.paralelism", "3")
    with pytest.raises(ConfigError, match=r"spark.state.paralelism \(did you mean spark.state.parallelism\?\)"):
        keyed(job.stream(), "user", name="clicks").count().writeStream.foreachBatch(job.sink).option(
            "checkpointLocation", str(tmp_path / "chk")
        ).start()
    spark.conf.unset("spark.state.paralelism")
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    query = (
        keyed(job.stream(), "user", name="clicks")
        .count()
        .writeStream.foreachBatch(job.sink)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .start()
    )
    try:
        for bad in (2.5, "abc", True, 0):
            with pytest.raises(ConfigError, match="parallelism"):
                query.set_parallelism(bad)
        query.set_parallelism(3)
    finally:
        query.stop()


def test_mean_min_and_max_per_key(spark, tmp_path):
    job = Job(spark, tmp_path)
    job.add_batch(300, keys=20, salt=0)
    job.add_batch(300, keys=25, salt=1)
    seen: dict[str, list[int]] = {}
    for rows in job.files:
        for user, amount in rows:
            seen.setdefault(user, []).append(amount)
    for method, expected in (("mean", lambda v: sum(v) / len(v)), ("min", min), ("max", max)):
        outputs: dict[str, float] = {}
        column = f"{method}_amount"

        def sink(out, batch_id):
            outputs.update({r["user"]: r[column] for r in out.collect()})

        spark.conf.set("spark.state.parallelism", "3")
        spark.conf.set("spark.state.store", str(tmp_path / f"state-{method}"))
        query = (
            getattr(keyed(job.stream(), "user", name=method), method)("amount")
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / f"chk-{method}"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        assert outputs == {user: expected(values) for user, values in seen.items()}, method


def test_built_in_aggregates_give_the_same_answers_with_partials_in_the_jvm_or_in_python(spark, tmp_path):
    """Spark computes the partials per key where its aggregate equals Arrow's (``AggregateDef.in_jvm``).

    Over ints, doubles with NaN, strings and timestamps with nulls, every
    built-in emits what a plain Python model of its running value gives;
    ``rows_received`` says where the partials were computed: one row per key
    (the JVM) or every row (Python: floating min/max, where Spark orders NaN
    above every number and Arrow skips it). Every other case makes its plans
    by PySpark's public calls (``spark.state.planAccelerator=false``, the path
    a session without the internals takes, Spark Connect's), the others with
    the accelerator (``spark.plan``).
    """
    import datetime as dt
    import math

    spark.conf.set("spark.sql.session.timeZone", "UTC")
    directory = tmp_path / "typed"
    directory.mkdir()
    utc = dt.timezone.utc
    batches = []
    for index in range(2):
        rows = [
            (
                f"k{i % 4}",
                None if i % 5 == 0 else i * (index + 1),
                math.nan if i % 7 == 3 else None if i % 6 == 0 else i / 4 - index,
                None if i % 3 == 0 else f"s{(i * 13 + index) % 9}",
                None if i % 4 == 1 else dt.datetime(2026, 1, 1 + i % 20, tzinfo=utc),
            )
            for i in range(40)
        ]
        batches.append(rows)
        path = directory / f"part-{index:05d}.parquet"
        publish(
            pa.table(
                {
                    "k": [r[0] for r in rows],
                    "n": pa.array([r[1] for r in rows], pa.int64()),
                    "x": pa.array([r[2] for r in rows], pa.float64()),
                    "s": [r[3] for r in rows],
                    "t": pa.array([r[4] for r in rows], pa.timestamp("us", tz="UTC")),
                }
            ),
            path,
            index,
        )

    def model(method, column):
        position = {"n": 1, "x": 2, "s": 3, "t": 4}[column]
        seen: dict[str, list] = {}
        for rows in batches:
            for row in rows:
                values = seen.setdefault(row[0], [])
                if row[position] is not None:
                    values.append(row[position])
        if column == "x" and method in ("min", "max"):  # Arrow's min/max skip NaN unless a key has only NaN
            seen = {k: [x for x in v if not math.isnan(x)] or v for k, v in seen.items()}
        finish = {"sum": sum, "mean": lambda v: sum(v) / len(v), "min": min, "max": max}[method]
        return {k: finish(v) if v else None for k, v in seen.items()}

    def same(a, b):
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)
        return a == b

    cases = [
        ("count", None, True),
        ("sum", "n", True),
        ("sum", "x", True),
        ("mean", "n", True),
        ("min", "s", True),
        ("max", "t", True),
        ("min", "n", True),
        ("max", "x", False),
        ("min", "x", False),
    ]
    for case, (method, column, in_jvm) in enumerate(cases):
        output = f"{method}_{column}" if column else "count"
        outputs: dict = {}
        public = case % 2 == 1
        spark.conf.set("spark.state.planAccelerator", str(not public).lower())

        def sink(out, batch_id):
            outputs.update({r["k"]: r[output] for r in out.collect()})

        spark.conf.set("spark.state.parallelism", "2")
        spark.conf.set("spark.state.store", str(tmp_path / f"state-{output}"))
        stream = keyed(
            spark.readStream.schema("k string, n long, x double, s string, t timestamp")
            .option("maxFilesPerTrigger", 1)
            .parquet(str(directory)),
            "k",
            name="typed",
        )
        stream = stream.count() if column is None else getattr(stream, method)(column)
        query = (
            stream.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / f"chk-{output}"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        expected = {k: 40 * 2 // 4 for k in ("k0", "k1", "k2", "k3")} if column is None else model(method, column)
        if column == "t":
            outputs = {
                k: v.replace(tzinfo=utc) if v is not None and v.tzinfo is None else v for k, v in outputs.items()
            }
        assert set(outputs) == set(expected), output
        assert all(same(outputs[k], expected[k]) for k in expected), (output, outputs, expected)
        instances = [i for b in query.batches for i in b["instances"]]
        assert sum(i["rows_in"] for i in instances) == 80, output
        assert sum(i["rows_received"] for i in instances) == (8 if in_jvm else 80), output
        assert query._batch.accelerated is not public, output
    spark.conf.unset("spark.state.planAccelerator")


def test_steady_batches_never_reload_state_whichever_worker_spark_picks(spark, tmp_path):
    """With instance hosts, every task after the first finds its instance's state resident: nothing is read.

    Four instances on two task slots: Spark hands each task to whichever
    Python worker is idle, so without hosts (``spark.state.instanceHosts``
    false) some tasks land on a worker that holds another instance and
    reload theirs from the store.
    """
    job = Job(spark, tmp_path)
    for salt in range(6):
        job.add_batch(300, keys=60, salt=salt)
    query = job.run(4)
    assert job.outputs == job.expected()
    later = [i for b in query.batches[1:] for i in b["instances"]]
    assert len(later) == 5 * 4
    assert [(i["restore"]["resident"], i["restore"]["bytes_read"]) for i in later] == [(True, 0)] * 20
    assert all(i["restore"]["key_groups_read_untouched"] == 0 < i["restore"]["key_groups_touched"] for i in later)
    assert len({i["pid"] for i in later}) == 4  # one host per instance
    first = query.batches[0]["instances"]  # new hosts: their first task touches memory, faulting it in
    assert all(
        i["cpu"]["user_seconds"] + i["cpu"]["system_seconds"] > 0 and i["cpu"]["page_faults"] > 0 for i in first
    ), first
    assert stopped_run(LocalStorage(str(job.root / "state"))) == query.run_id  # stopped: its hosts leave when idle


def test_a_run_that_ends_outside_stateful_query_is_recorded_as_stopped_by_the_driver_s_watch(spark, tmp_path):
    """A run awaited, or stopped, through the raw ``StreamingQuery`` (``StatefulQuery`` records neither) is
    recorded as stopped in its store all the same: a driver thread finds it no longer active."""
    job = Job(spark, tmp_path)
    job.add_batch(100, keys=10, salt=0)
    store = LocalStorage(str(tmp_path / "state"))
    spark.conf.set("spark.state.parallelism", "2")
    spark.conf.set("spark.state.store", str(tmp_path / "state"))

    def start(**trigger):
        return (
            keyed(job.stream(), "user", name=job.name)
            .count()
            .writeStream.foreachBatch(job.sink)
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(**trigger)
            .start()
        )

    def recorded(run_id: str) -> bool:
        deadline = time.monotonic() + 30  # the watch looks every second
        while stopped_run(store) != run_id and time.monotonic() < deadline:
            time.sleep(0.1)
        return stopped_run(store) == run_id

    ended = start(availableNow=True)
    ended.query.awaitTermination()  # not StatefulQuery.awaitTermination, which would record the stop itself
    assert recorded(ended.run_id)
    job.add_batch(100, keys=10, salt=1)
    running = start(processingTime="100 milliseconds")
    deadline = time.monotonic() + 60
    while len(running.batches) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running.batches, "the restarted run processed no batch"
    spark.streams.get(running.id).stop()  # the raw query, as ``spark.streams.active`` hands it out
    assert recorded(running.run_id) and running.run_id != ended.run_id
    assert running.run_id not in watched_runs() and ended.run_id not in watched_runs()
    assert job.outputs == job.expected()


def test_a_memory_bound_below_the_state_holds_and_output_stays_exact_through_a_rescale(spark, tmp_path):
    """``spark.state.residentMemory`` far below the state: key groups are evicted and read back when touched.

    Every batch's estimate of resident state ends within its share of the
    bound, evicted key groups are loaded again (from the store) by later
    batches, in chunks, and the output equals the model's, before and after
    2 -> 3. (User functions under a bound: the store state machine.)
    """
    job = Job(spark, tmp_path)
    for salt in range(6):
        job.add_batch(20000, keys=100000, salt=salt * 17000)
    spark.conf.set("spark.state.residentMemory", "1m")
    try:
        first = job.run(2)
        job.add_batch(20000, keys=100000, salt=1)
        job.add_batch(20000, keys=100000, salt=7)
        second = job.run(3)
    finally:
        spark.conf.unset("spark.state.residentMemory")
    assert job.outputs == job.expected()
    instances = [i for b in first.batches + second.batches for i in b["instances"]]
    assert [b["parallelism"] for b in first.batches + second.batches] == [2] * 6 + [3] * 2
    memory = [i["memory"] for i in instances]
    assert all(m["limit_bytes"] <= 1 << 20 and m["resident_bytes"] <= m["limit_bytes"] for m in memory), memory
    assert sum(m["evicted_key_groups"] for m in memory) > 0
    assert max(m["high_water_bytes"] for m in memory) > max(m["limit_bytes"] for m in memory)
    reloaded = [
        i["restore"]["loaded"]["bytes_read"]
        for b in first.batches[1:]
        for i in b["instances"]
        if "loaded" in i["restore"]
    ]
    assert sum(r > 0 for r in reloaded) >= 4  # evicted key groups came back from the store
    assert all(i["restore"]["bytes_read"] == 0 for i in second.batches[0]["instances"])  # a lazy rescale
    assert all(
        i["restore"]["key_groups_read_untouched"] == 0 < i["restore"]["key_groups_touched"]
        for i in second.batches[0]["instances"]
    )  # it read only what its rows touch
    # built-ins load evicted key groups chunk by chunk, releasing chains over the bound
    assert max(i["restore"].get("loaded", {}).get("chunks", 0) for i in instances) > 1
