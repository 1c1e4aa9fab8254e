"""End-to-end: event time, timers, time to live, deduplication, session windows and drain in Spark.

The oracles are computed independently of the operator (pandas, or plain
Python over the input files), from all the rows the sources hold.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_state import keyed
from spark_state.errors import ConfigError
from spark_state.spark.microbatch import MicroBatch
from spark_state.storage import open_storage
from spark_state.store.drain import request_drain
from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.stops import stopped_run
from tests.diagnostics import stalled
from tests.files import publish

pytestmark = pytest.mark.spark

BASE = 1_700_000_000_000


@pytest.fixture(autouse=True)
def _clean_conf(spark):
    yield
    for key in ("spark.state.parallelism", "spark.state.store"):
        spark.conf.unset(key)


def _sessions_oracle(events: pd.DataFrame, gap_ms: int) -> list[tuple]:
    """Sessions of rows at most ``gap_ms`` apart per key (touching sessions merge, as in Spark's
    ``session_window``): (key, start, end, count, sum, min, max)."""
    out = []
    for key, rows in events.sort_values("t").groupby("key"):
        current = None
        for t, v in zip(rows["t"], rows["value"]):
            if current is not None and t <= current[1]:
                current = [
                    current[0],
                    max(current[1], t + gap_ms),
                    current[2] + 1,
                    current[3] + v,
                    min(current[4], v),
                    max(current[5], v),
                ]
            else:
                if current is not None:
                    out.append((key, *current))
                current = [t, t + gap_ms, 1, v, v, v]
        out.append((key, *current))
    return sorted(out)


@pytest.fixture
def clock_on(spark):
    """The query's clock, on by default, which the test session turns off."""
    spark.conf.set("spark.state.clock", "true")
    yield
    # Back to the test session's: an unset drops the builder's setting too, which leaves the default (on) to the
    # worker's later tests (a drain test then raced the clock's batch against its next file).
    spark.conf.set("spark.state.clock", "false")


def test_sessions_through_a_failed_driver_a_restart_a_live_rescale_and_a_drain_equal_a_batch_computation(
    spark, tmp_path, monkeypatch, clock_on
):
    events = (
        spark.read.format("replayable")
        .option("generator", "keyed")
        .option("numSplits", 3)
        .option("keys", 60)
        .option("skew", 1.0)
        .option("seed", 5)
        .option("rowsPerSplit", 1000)
        .load()
        .selectExpr("key", "value", "event_time + make_interval(0, 0, 0, 0, 0, 0, (offset % 7) * 0.05) AS event_time")
    )
    events.write.format("replayable").mode("append").option("numSplits", 3).save(str(tmp_path / "events"))
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    holder: dict = {}

    def start(parallelism: int, **trigger):
        """Session windows over the log, 800 rows per batch, written per batch id as Parquet."""
        spark.conf.set("spark.state.parallelism", str(parallelism))
        stream = (
            spark.readStream.format("replayable")
            .option("path", str(tmp_path / "events"))
            .option("maxRecordsPerBatch", 800)
            .load()
        )
        writer = (
            keyed(stream, "key", name="sessions")
            .withWatermark("event_time", "2 seconds")
            .session_window("300 ms", "value")
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(tmp_path / "chk"))
        )
        return writer.trigger(**trigger).start() if trigger else writer.start()

    def fail_after_commit(self, at, batch_id):
        if at == "committed" and batch_id == 1:  # the state is committed, Spark's batch is not
            raise RuntimeError("injected driver failure after the commit")

    def rescale_live(self, at, batch_id):
        if at == "committed" and batch_id == 2:
            holder["query"].set_parallelism(2)  # from batch 3 on, without a restart

    monkeypatch.setattr(MicroBatch, "_fault", fail_after_commit)
    failed = start(3, availableNow=True)
    with pytest.raises(Exception, match="injected driver failure"):
        failed.awaitTermination()
    monkeypatch.setattr(MicroBatch, "_fault", rescale_live)
    query = holder["query"] = start(5)
    query.processAllAvailable()
    query.request_drain()  # on the idle source: the query's clock runs the drain's batch
    query.awaitTermination(300)
    assert not query.isActive and query.exception() is None
    assert query.batches[0]["replayed"]  # batch 1, committed in the store before the failure
    log = spark.read.format("replayable").load(str(tmp_path / "events")).toPandas()
    log["t"] = (log["event_time"].astype("int64") // 1_000_000).astype("int64")
    expected = _sessions_oracle(log, 300)
    out = pq.read_table(tmp_path / "out").to_pandas()
    got = sorted(
        (
            r.key,
            int(r.session_start.value // 1_000_000),
            int(r.session_end.value // 1_000_000),
            r.count,
            r.sum_value,
            r.min_value,
            r.max_value,
        )
        for r in out.itertuples()
    )
    assert len(got) == len(expected) > 30 and got == expected
    manifests = open_manifest_log(str(tmp_path / "state"))
    latest = manifests.latest()
    assert latest.drained and latest.components["sessions"].parallelism == 2
    history = [manifests.load(i) for i in latest.consistent_checkpoints]
    assert {m.components["sessions"].parallelism for m in history} >= {2}


def _timer_job(spark, tmp_path: Path, name: str = "alarms"):
    """Per key: register an event-time timer 1 s after its first event; the timer emits (key, time, instance)."""
    from pyspark import TaskContext

    def on_rows(key, rows, state):
        if not state.exists:
            first = int(rows["t"].min())
            state.update((first,))
            state.timers.register(first + 1000)
        return None

    def on_timer(key, timer, state):
        return [
            {
                "key": key[0],
                "fired_at": timer.time_ms,
                "watermark": state.watermark,
                "instance": TaskContext.get().partitionId(),
            }
        ]

    inputs = spark.readStream.schema("key string, t long").option("maxFilesPerTrigger", 1).parquet(str(tmp_path / "in"))
    return (
        keyed(inputs, "key", name=name)
        .withWatermark("t", "500 ms")
        .apply(
            on_rows,
            state_schema="first long",
            output_schema="key string, fired_at long, watermark long, instance int",
            on_timer=on_timer,
        )
    )


def _write_times(tmp_path: Path, index: int, rows: list[tuple[str, int]]) -> None:
    (tmp_path / "in").mkdir(exist_ok=True)
    path = tmp_path / "in" / f"part-{index:04d}.parquet"
    publish(pa.table({"key": [k for k, _ in rows], "t": pa.array([t for _, t in rows], pa.int64())}), path, index)


def test_a_timer_fires_once_on_the_new_owner_after_a_rescale_and_not_twice_after_a_failed_attempt(
    spark, tmp_path, monkeypatch
):
    from spark_state.keyspace import instance_for_key_group, key_group_for

    fired: list = []
    keys = [f"k{i}" for i in range(40)]
    _write_times(tmp_path, 0, [(k, BASE + i) for i, k in enumerate(keys)])  # registers the timers at ~BASE + 1000
    _write_times(tmp_path, 1, [("tick", BASE + 900)])  # watermark BASE + 400: nothing due

    def run(parallelism):
        spark.conf.set("spark.state.parallelism", str(parallelism))
        spark.conf.set("spark.state.store", str(tmp_path / "state"))
        query = (
            _timer_job(spark, tmp_path)
            .writeStream.foreachBatch(lambda df, b: fired.extend((b, r) for r in df.collect()))
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        return query

    def crash(self, at, batch_id):
        if at == "output_written" and batch_id == 0:
            raise RuntimeError("injected driver failure in the batch that registers the timers")

    monkeypatch.setattr(MicroBatch, "_fault", crash)
    with pytest.raises(Exception, match="injected driver failure"):
        run(2)
    monkeypatch.undo()
    run(2)
    assert fired == []
    _write_times(tmp_path, 2, [("tick", BASE + 3000)])  # watermark after it: BASE + 2500
    _write_times(tmp_path, 3, [("tick", BASE + 3001)])  # runs with it: every timer is due
    run(3)
    first = {k: BASE + i for i, k in enumerate(keys)} | {"tick": BASE + 900}
    assert sorted(r["key"] for _, r in fired) == sorted(first)  # each exactly once, on the rescaled query
    for _, row in fired:
        assert row["fired_at"] == first[row["key"]] + 1000 <= row["watermark"]
        assert row["instance"] == instance_for_key_group(key_group_for(row["key"], 1024), 3, 1024)


def test_time_to_live_bounds_state_under_churning_keys(spark, tmp_path):
    def remember(key, rows, state):
        state.update((len(rows),))

    def keys_held(ttl):
        name = "ttl" if ttl else "forever"
        spark.conf.set("spark.state.parallelism", "2")
        spark.conf.set("spark.state.store", str(tmp_path / f"state-{name}"))
        inputs = (
            spark.readStream.schema("key string, t long").option("maxFilesPerTrigger", 1).parquet(str(tmp_path / "in"))
        )
        stream = keyed(inputs, "key", name=name).withWatermark("t", "0 ms")
        query = (
            stream.apply(remember, state_schema="n long", output_schema="key string", ttl=ttl, ttl_kind="event")
            .writeStream.foreachBatch(lambda df, b: None)
            .option("checkpointLocation", str(tmp_path / f"chk-{name}"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        return [sum(i["keys"] for i in b["instances"]) for b in query.batches], query.batches

    for batch in range(8):  # 50 new keys per batch, one event time unit per batch
        _write_times(tmp_path, batch, [(f"b{batch}-{i}", BASE + batch * 1000) for i in range(50)])
    with_ttl, batches = keys_held("1500 ms")
    without, _ = keys_held(None)
    assert without == [50 * (b + 1) for b in range(8)]  # grows with the stream
    assert max(with_ttl[2:]) <= 150 and with_ttl[-1] < without[-1] / 2  # bounded: the keys of the last batches
    assert sum(b["expired"] for b in batches) >= 200


def test_a_drain_emits_open_sessions_once_and_a_stale_request_does_nothing(spark, tmp_path):
    (tmp_path / "in").mkdir()
    spark.conf.set("spark.state.parallelism", "2")
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    out: list = []

    def start():
        inputs = spark.readStream.schema("key string, t timestamp, v long").parquet(str(tmp_path / "in"))
        return (
            keyed(inputs, "key", name="s")
            .withWatermark("t", "1 second")
            .session_window("10 seconds", "v")
            .writeStream.foreachBatch(lambda df, b: out.extend(r.asDict() for r in df.collect()))
            .option("checkpointLocation", str(tmp_path / "chk"))
            .start()
        )

    def write(index, rows):
        path = tmp_path / "in" / f"p{index}.parquet"
        times = [dt.datetime.fromtimestamp((BASE + ms) / 1000, dt.timezone.utc) for _, ms in rows]
        publish(
            pa.table(
                {"key": [k for k, _ in rows], "t": pa.array(times, pa.timestamp("ms", tz="UTC")), "v": [1] * len(rows)}
            ),
            path,
            index,
        )

    query = start()
    write(0, [("a", 0), ("b", 100), ("a", 2000)])
    assert query.await_batches(1, timeout=120), stalled(spark)
    request_drain(open_storage(str(tmp_path / "state")), "0f0f0f0f-0000-0000-0000-000000000000")  # another run
    write(1, [("c", 3000)])
    assert query.await_batches(2, timeout=120), stalled(spark)
    assert query.isActive and out == [] and not query.batches[-1]["drained"]
    assert query.batches[-1]["drain_requests_ignored"] == ["0f0f0f0f-0000-0000-0000-000000000000"]
    request_drain(open_storage(str(tmp_path / "state")), query.run_id)
    write(2, [("d", 3500)])
    query.awaitTermination(120)
    assert not query.isActive and query.exception() is None
    assert stopped_run(open_storage(str(tmp_path / "state"))) == query.run_id  # its instance hosts leave
    assert sorted((r["key"], r["count"]) for r in out) == [("a", 2), ("b", 1), ("c", 1), ("d", 1)]
    latest = open_manifest_log(str(tmp_path / "state")).latest()
    assert latest.drained and latest.components["s"].watermark_ms == BASE + 3500 - 1000
    restarted = start()  # from the drained checkpoint: nothing pending, the next rows are on time
    write(3, [("a", 4000)])
    assert restarted.await_batches(1, timeout=120), stalled(spark)
    assert stopped_run(open_storage(str(tmp_path / "state"))) == query.run_id  # the new run's hosts stay
    restarted.stop()
    assert stopped_run(open_storage(str(tmp_path / "state"))) == restarted.run_id != query.run_id
    assert restarted.batches[-1]["late_rows"] == 0 and restarted.batches[-1]["timers_fired"] == 0
    assert sum(len(i.get("items") or ()) for i in restarted.batches[-1]["instances"]) == 0


def test_deduplicate_keeps_the_first_row_per_key_within_the_horizon_across_a_crash_and_a_rescale(
    spark, tmp_path, monkeypatch
):
    rows = [("a", BASE), ("b", BASE + 10), ("a", BASE + 500)]  # a repeats within the horizon
    rows2 = [("a", BASE + 1200), ("c", BASE + 1300), ("b", BASE + 3000)]  # a again: still within; b after it
    rows3 = [("z", BASE + 9000)]
    for index, part in enumerate((rows, rows2, rows3)):
        _write_times(tmp_path, index, part)
    emitted: dict = {}

    def run(parallelism):
        spark.conf.set("spark.state.parallelism", str(parallelism))
        spark.conf.set("spark.state.store", str(tmp_path / "state"))
        inputs = (
            spark.readStream.schema("key string, t long").option("maxFilesPerTrigger", 1).parquet(str(tmp_path / "in"))
        )
        query = (
            keyed(inputs, "key", name="dedup")
            .withWatermark("t", "100 ms")
            .deduplicate("2 seconds")
            .writeStream.foreachBatch(lambda df, b: emitted.__setitem__(b, sorted(map(tuple, df.collect()))))
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    def crash(self, at, batch_id):
        if at == "committed" and batch_id == 1:
            raise RuntimeError("injected driver failure after the commit")

    monkeypatch.setattr(MicroBatch, "_fault", crash)
    with pytest.raises(Exception, match="injected driver failure"):
        run(2)
    monkeypatch.undo()
    run(3)
    assert emitted == {0: [("a", BASE), ("b", BASE + 10)], 1: [("c", BASE + 1300)], 2: [("z", BASE + 9000)]}


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda k: k.withWatermark("missing", "1 second"), "no such column"),
        (lambda k: k.withWatermark("key", "1 second"), "must be a timestamp, or a long"),
        (lambda k: k.withWatermark("t", "ten seconds"), "not a duration"),
        (lambda k: k.withWatermark("t", "-1 second"), "negative"),
        (
            lambda k: k.apply(
                lambda *a: None, state_schema="n long", output_schema="key string", ttl="1 hour", ttl_kind="event"
            ),
            "needs event time",
        ),
        (lambda k: k.session_window("5 minutes"), "needs event time"),
        (lambda k: k.withWatermark("t", "1 second").session_window("0 seconds"), "longer than zero"),
    ],
)
def test_bad_time_settings_are_refused_when_the_query_is_defined(spark, tmp_path, build, match):
    (tmp_path / "in").mkdir()
    inputs = spark.readStream.schema("key string, t long").parquet(str(tmp_path / "in"))
    with pytest.raises(ConfigError, match=match):
        build(keyed(inputs, "key", name="bad"))


def test_a_timer_with_a_value_that_is_not_a_time_is_refused_naming_it():
    from spark_state.model.timers import KeyTimersHandle

    handle = KeyTimersHandle(None, event_time=True)
    with pytest.raises(ConfigError, match="'soon' is not a time"):
        handle.register("soon")
    with pytest.raises(ConfigError, match="needs event time"):
        KeyTimersHandle(None, event_time=False).register(5)


def test_the_readme_alert_example_alerts_only_for_the_unconfirmed_order(spark, tmp_path):
    def on_order(key, rows, state):  # as in docs/time.md
        if (rows["kind"] == "confirmed").any():
            state.remove()
        elif not state.exists:
            state.update((int(rows["amount"].sum()),))
            state.timers.register(rows["event_time"].min() + pd.Timedelta(minutes=15))

    def on_timer(key, timer, state):
        if state.exists:
            return [{"order_id": key[0], "alert": "no confirmation within 15 minutes"}]

    (tmp_path / "in").mkdir()
    minute = 60_000

    def write(index, rows):
        path = tmp_path / "in" / f"p{index}.parquet"
        times = [dt.datetime.fromtimestamp((BASE + t) / 1000, dt.timezone.utc) for _, _, t in rows]
        publish(
            pa.table(
                {
                    "order_id": [o for o, _, _ in rows],
                    "kind": [k for _, k, _ in rows],
                    "amount": [5] * len(rows),
                    "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
                }
            ),
            path,
            index,
        )

    write(0, [("o1", "placed", 0), ("o2", "placed", minute)])
    write(1, [("o1", "confirmed", 10 * minute), ("x", "placed", 20 * minute)])
    write(2, [("y", "placed", 40 * minute)])  # the watermark passes o2's deadline (16 min) with batch 2
    write(3, [("z", "placed", 41 * minute)])
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    alerts: list = []
    events = (
        spark.readStream.schema("order_id string, kind string, amount long, event_time timestamp")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(tmp_path / "in"))
    )
    query = (
        keyed(events, "order_id", name="alerts")
        .withWatermark("event_time", "5 minutes")
        .apply(
            on_order,
            on_timer=on_timer,
            ttl="1 day",
            ttl_kind="event",
            state_schema="amount long",
            output_schema="order_id string, alert string",
        )
        .writeStream.foreachBatch(lambda df, b: alerts.extend((b, tuple(r)) for r in df.collect()))
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    # batch 3 runs with watermark 40 - 5 = 35 minutes: o2's deadline (16) and x's (35) have passed; o1 was confirmed
    assert sorted(alerts) == [
        (3, ("o2", "no confirmation within 15 minutes")),
        (3, ("x", "no confirmation within 15 minutes")),
    ]
