"""End-to-end: timers, idle event time and drains take effect on a source that stopped (``datasources.clock``).

Each query reads a directory of Parquet files that stops growing; every batch
that runs after the last file comes from the query's clock. Outputs are
written per batch id, so a replayed batch replaces its own output; the
oracle is what each order's rows say.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark import cloudpickle

from spark_state import keyed
from spark_state.spark.microbatch import MicroBatch
from spark_state.storage import open_storage
from spark_state.store.drain import request_drain
from spark_state.store.manifestlog import open_manifest_log
from tests.diagnostics import stalled
from tests.files import publish

pytestmark = pytest.mark.spark

# The functions below run in Python workers, which cannot import this test module by its name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

WAIT_MS = 1500
"""How long a placed order waits for its confirmation (processing time)."""
IDLE_SECONDS = 3.0
"""How long a query with nothing due is watched for batches it should not run."""


@pytest.fixture(autouse=True)
def _conf(spark):
    spark.conf.set("spark.state.clock", "true")  # the default, which the test session turns off
    spark.conf.set("spark.state.clockPollSeconds", "0.2")
    yield
    for key in ("spark.state.parallelism", "spark.state.store", "spark.state.clockPollSeconds"):
        spark.conf.unset(key)
    spark.conf.set("spark.state.clock", "false")  # the session's (an unset would leave the default, on)


def on_order(key, rows, state):
    """The README's alert, in processing time: an order not confirmed within ``WAIT_MS`` of arriving alerts."""
    if (rows["kind"] == "confirmed").any():
        state.remove()
    elif not state.exists:
        state.update((int(rows["amount"].sum()),))
        state.timers.register(state.processing_time + WAIT_MS, kind="processing")


def on_timer(key, timer, state):
    if state.exists:
        state.remove()
        return [{"order_id": key[0], "due": timer.time_ms}]


def _write_orders(tmp_path: Path, index: int, rows: list[tuple[str, str]]) -> None:
    (tmp_path / "in").mkdir(exist_ok=True)
    table = pa.table({"order_id": [o for o, _ in rows], "kind": [k for _, k in rows], "amount": [5] * len(rows)})
    publish(table, tmp_path / "in" / f"p{index}.parquet", index)


def _alerts_query(spark, tmp_path: Path):
    orders = spark.readStream.schema("order_id string, kind string, amount long").parquet(str(tmp_path / "in"))
    return (
        keyed(orders, "order_id", name="alerts")
        .apply(on_order, on_timer=on_timer, state_schema="amount long", output_schema="order_id string, due long")
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "chk"))
        .start()
    )


def _fails_with(query, message: str) -> None:
    with pytest.raises(Exception, match=message):
        query.awaitTermination(180)


def _wait_for(condition, spark, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}\n{stalled(spark)}"
        time.sleep(0.1)


def _rows_in(batch: dict) -> int:
    return sum(i["rows_in"] for i in batch["instances"])


def test_alerts_on_a_source_that_stopped_arrive_once_through_a_crash_a_restart_a_replay_and_a_live_rescale(
    spark, tmp_path, monkeypatch
):
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    _write_orders(tmp_path, 0, [("o1", "placed"), ("o1", "confirmed"), ("o2", "placed")])

    def crash_after_commit(self, at, batch_id):
        if (at, batch_id) == ("committed", 0):  # the state is committed, Spark's batch is not
            raise RuntimeError("injected driver failure after the commit")

    def crash_after_alert_output(self, at, batch_id):
        if (at, batch_id) == ("output_written", 1):  # the clock's batch wrote its alert, committed nothing
            raise RuntimeError("injected driver failure after the output")

    monkeypatch.setattr(MicroBatch, "_fault", crash_after_commit)
    spark.conf.set("spark.state.parallelism", "2")
    _fails_with(_alerts_query(spark, tmp_path), "after the commit")

    monkeypatch.setattr(MicroBatch, "_fault", crash_after_alert_output)
    spark.conf.set("spark.state.parallelism", "3")  # a restart at another parallelism
    second = _alerts_query(spark, tmp_path)
    _fails_with(second, "after the output")  # no file came: only the clock ran batch 1
    assert [b["replayed"] for b in second.batches] == [True]

    monkeypatch.setattr(MicroBatch, "_fault", lambda self, at, batch_id: None)
    third = _alerts_query(spark, tmp_path)
    try:
        assert third.await_batches(1, timeout=120), stalled(spark)  # Spark's replay of batch 1, the same offsets
        third.set_parallelism(4)  # live, from the next batch on
        _write_orders(tmp_path, 1, [("o3", "placed")])
        _wait_for(lambda: sum(b["timers_fired"] for b in third.batches) >= 2, spark, "o3's alert did not fire")
        settled = len(third.batches)
        time.sleep(IDLE_SECONDS)  # nothing is due: the clock runs no batch
        assert len(third.batches) == settled and third.batches[-1]["wake_ms"] is None
    finally:
        third.stop()
    batches = third.batches
    assert [b["batch_id"] for b in batches] == [1, 2, 3]
    assert [b["parallelism"] for b in batches] == [3, 4, 4]
    assert [_rows_in(b) for b in batches] == [0, 1, 0]  # batches 1 and 3 came from the clock
    out = pq.read_table(tmp_path / "out").to_pandas()
    assert sorted(zip(out["order_id"], out["batch_id"].astype(int))) == [("o2", 1), ("o3", 3)]
    for batch, order in ((batches[0], "o2"), (batches[2], "o3")):
        due = int(out.loc[out["order_id"] == order, "due"].iloc[0])
        assert batch["processing_ms"] >= due  # never early; how late is bench_time's idle section
    assert open_manifest_log(str(tmp_path / "state")).latest().components["alerts"].parallelism == 4


def test_sessions_close_on_an_idle_source_the_same_way_on_replay_and_a_drain_completes_without_rows(
    spark, tmp_path, monkeypatch
):
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    spark.conf.set("spark.state.parallelism", "2")
    start = int(time.time() * 1000)

    def write(index: int, rows: list[tuple[str, int]]) -> None:
        (tmp_path / "in").mkdir(exist_ok=True)
        times = [dt.datetime.fromtimestamp((start + ms) / 1000, dt.timezone.utc) for _, ms in rows]
        table = pa.table({"key": [k for k, _ in rows], "t": pa.array(times, pa.timestamp("ms", tz="UTC"))})
        publish(table, tmp_path / "in" / f"p{index}.parquet", index)

    def query():
        inputs = spark.readStream.schema("key string, t timestamp").parquet(str(tmp_path / "in"))
        return (
            keyed(inputs, "key", name="sessions")
            .withWatermark("t", "500 ms", idle_after="1 second")
            .session_window("1 second")
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(tmp_path / "chk"))
            .start()
        )

    def crash_after_sessions_output(self, at, batch_id):
        if (at, batch_id) == ("output_written", 1):
            raise RuntimeError("injected driver failure after the sessions closed")

    write(0, [("a", 0), ("a", 200), ("b", 200)])  # both sessions end at 1200: one wake-up closes both
    monkeypatch.setattr(MicroBatch, "_fault", crash_after_sessions_output)
    _fails_with(query(), "after the sessions closed")  # the idle watermark closed both sessions in batch 1
    monkeypatch.setattr(MicroBatch, "_fault", lambda self, at, batch_id: None)
    restarted = query()
    try:
        assert restarted.await_batches(1, timeout=120), stalled(spark)
        replay = restarted.batches[0]
        assert replay["batch_id"] == 1 and _rows_in(replay) == 0 and replay["timers_fired"] == 2
        assert replay["watermark_ms"] >= start + 1200  # idle: past both sessions' ends, from the recorded times
        c_ms = int(time.time() * 1000) - start + 2000  # ahead of the idle watermark, which follows the clock
        write(1, [("c", c_ms)])
        _wait_for(lambda: any(_rows_in(b) for b in restarted.batches), spark, "c's file was not read")
        request_drain(open_storage(str(tmp_path / "state")), restarted.run_id)  # from outside, on an idle source
        restarted.awaitTermination(120)
        assert not restarted.isActive and restarted.exception() is None
    finally:
        restarted.stop()
    latest = open_manifest_log(str(tmp_path / "state")).latest()
    assert latest.drained
    out = pq.read_table(tmp_path / "out").to_pandas()
    sessions = sorted(
        (k, int(s.value // 1_000_000) - start, n) for k, s, n in zip(out["key"], out["session_start"], out["count"])
    )
    assert sessions == [("a", 0, 2), ("b", 200, 1), ("c", c_ms, 1)]  # each once: the replay rewrote batch 1


def test_a_query_with_nothing_due_runs_no_batch_and_one_begun_without_the_clock_keeps_running_without_it(
    spark, tmp_path, caplog
):
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    spark.conf.set("spark.state.clock", "false")  # as a checkpoint made before the clock
    _write_orders(tmp_path, 0, [("o1", "placed"), ("o2", "placed")])

    def counts():
        orders = spark.readStream.schema("order_id string, kind string, amount long").parquet(str(tmp_path / "in"))
        return (
            keyed(orders, "order_id", name="counts")
            .count()
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(tmp_path / "chk"))
            .start()
        )

    first = counts()
    try:
        assert first.await_batches(1, timeout=120), stalled(spark)
    finally:
        first.stop()
    spark.conf.set("spark.state.clock", "true")  # as by default: the checkpoint keeps the sources it began with
    with caplog.at_level(logging.WARNING, logger="spark_state"):
        second = counts()
    try:
        assert "began without spark-state's clock" in caplog.text
        _write_orders(tmp_path, 1, [("o1", "placed")])
        assert second.await_batches(1, timeout=120), stalled(spark)
        time.sleep(IDLE_SECONDS)
        assert len(second.batches) == 1
    finally:
        second.stop()
    out = pq.read_table(tmp_path / "out").to_pandas()
    assert sorted(zip(out["order_id"], out["count"], out["batch_id"].astype(int))) == [
        ("o1", 1, 0),
        ("o1", 2, 1),
        ("o2", 1, 0),
    ]
