"""An idle query's wake-ups, without Spark: when the next work without rows is due (``model.wake``), the idle
watermark (``eventtime.idle_watermark``), the earliest live timer (``TimerIndex.next_due``), what a checkpoint
records, and the clock source's offsets (``datasources.clock``) over a store in memory."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest

from datasources.clock import ClockReader
from spark_state.driver.conf import StateConf
from spark_state.driver.coordinator import BatchClock, Coordinator, SparkBatch
from spark_state.errors import ConfigError
from spark_state.executor.report import InstanceReport
from spark_state.model.eventtime import EventTime, idle_due_at, idle_watermark
from spark_state.model.schema import KeyedSchema
from spark_state.model.timers import EVENT, EXPIRES, PROCESSING, TimerIndex
from spark_state.model.wake import Due, next_wake
from spark_state.storage import open_storage
from spark_state.store.drain import request_drain
from spark_state.store.manifest import ComponentManifest, ComponentSpec
from spark_state.store.manifestlog import ManifestLog
from spark_state.store.sources import clock_source_id, is_clock_source

IDLE = EventTime("t", delay_ms=1_000, idle_ms=5_000)
SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])


def wake(due: Due, *, now=10_000, watermark=None, max_event=None, rows_at=None, event_time=None, ttl=None):
    return next_wake(
        due,
        processing_ms=now,
        watermark_ms=watermark,
        max_event_time_ms=max_event,
        rows_at_ms=rows_at,
        event_time=event_time,
        ttl_kind=ttl,
    )


def test_nothing_due_wakes_nothing():
    assert wake(Due()) is None
    assert wake(Due(event=50_000), watermark=1_000) is None  # an event-time timer waits for rows without idle_after
    assert wake(Due(expires=20_000)) is None  # an expiry without a time to live: not a kind the query has


def test_a_processing_timer_wakes_at_its_time_and_never_before_the_next_millisecond():
    assert wake(Due(processing=25_000)) == 25_000
    assert wake(Due(processing=3_000)) == 10_001  # overdue: the next batch
    assert wake(Due(processing=25_000, expires=12_000), ttl=PROCESSING) == 12_000
    assert wake(Due(processing=25_000, expires=12_000), ttl=EVENT) == 25_000


def test_an_event_timer_the_next_watermark_passed_wakes_at_once_and_an_idle_one_when_the_clock_reaches_it():
    assert wake(Due(event=900), watermark=1_000) == 10_001
    # idle: W(P) = E + (P - R) - delay reaches 20_000 at P = 20_000 - 8_000 + 9_000 + 1_000
    assert wake(Due(event=20_000), watermark=7_000, max_event=8_000, rows_at=9_000, event_time=IDLE) == 22_000
    # but never before the source has been idle for idle_after
    assert wake(Due(event=8_500), watermark=7_000, max_event=8_000, rows_at=9_000, event_time=IDLE) == 14_000
    assert wake(Due(expires=20_000), watermark=7_000, max_event=8_000, rows_at=9_000, event_time=IDLE, ttl=EVENT) == (
        22_000
    )


def test_the_idle_watermark_follows_the_clock_only_after_idle_after_and_never_goes_back():
    assert idle_watermark(7_000, 8_000, 9_000, 13_999, IDLE) == 7_000  # idle for less than 5 s
    assert idle_watermark(7_000, 8_000, 9_000, 14_000, IDLE) == 12_000  # 8 s + 5 s idle - 1 s delay
    assert idle_watermark(30_000, 8_000, 9_000, 14_000, IDLE) == 30_000
    assert idle_watermark(7_000, 8_000, 9_000, 60_000, EventTime("t", 1_000)) == 7_000  # no idle_after
    assert idle_watermark(None, None, None, 60_000, IDLE) is None  # no rows yet: nothing to advance from
    # the wake-up is exactly when the idle watermark reaches the time
    at = idle_due_at(20_000, 8_000, 9_000, IDLE)
    assert idle_watermark(7_000, 8_000, 9_000, at, IDLE) == 20_000
    assert idle_watermark(7_000, 8_000, 9_000, at - 1, IDLE) < 20_000


def test_idle_after_must_be_a_positive_duration():
    with pytest.raises(ConfigError, match="idle time must be longer than zero"):
        EventTime("t", 1_000, idle_ms=0)


def test_due_is_the_earliest_of_each_kind_over_the_instances():
    assert Due.over([{EVENT: 5, PROCESSING: 9}, {}, {PROCESSING: 7, EXPIRES: 3}]) == Due(5, 7, 3)


def _index(timers: dict[tuple[int, str], list[int]]) -> tuple[TimerIndex, dict]:
    """An index over processing timers ``{(key group, key): times}``, every key group unfolded (exact bounds)."""
    index = TimerIndex()
    for group in {g for g, _ in timers}:
        index.set_earliest(group, (None, min(t for (g, _), ts in timers.items() if g == group for t in ts), None))
    return index, timers


def _fold(timers):
    return lambda g: [(t, key) for (group, key), times in timers.items() if group == g for t in times]


def _live(timers):
    return lambda t, g, key: t in timers.get((g, key), ())


def test_next_due_folds_the_earliest_key_group_and_skips_deleted_timers():
    index, timers = _index({(1, "a"): [500, 900], (2, "b"): [700]})
    assert index.next_due(PROCESSING, _fold(timers), _live(timers)) == 500
    timers[(1, "a")] = [900]  # 500 deleted (or fired): its heap entry is stale
    assert index.next_due(PROCESSING, _fold(timers), _live(timers)) == 700
    timers.pop((2, "b"))
    assert index.next_due(PROCESSING, _fold(timers), _live(timers)) == 900
    timers.clear()
    assert index.next_due(PROCESSING, _fold(timers), _live(timers)) is None
    assert index.next_due(EVENT, _fold(timers), _live(timers)) is None


def test_next_due_under_a_bound_below_the_key_groups_timers_folds_it_and_finds_the_real_one():
    index = TimerIndex()
    index.set_earliest(3, (None, 100, None))  # a lower bound: the timer at 100 was deleted since
    timers = {(3, "c"): [4_000]}
    index.push(PROCESSING, 2_000, 5, "d")  # folded key group 5: its timer at 2000 exists
    timers[(5, "d")] = [2_000]
    assert index.next_due(PROCESSING, _fold(timers), _live(timers)) == 2_000
    assert [t for t, _, _ in index.due(PROCESSING, 10_000, _fold(timers))] == [2_000, 4_000]  # each once


def _committed(reports_due, *, clock, timestamp=10_000, drained=False, storage=None):
    storage = storage or open_storage(f"memory://wake-{uuid.uuid4().hex}")
    coordinator = Coordinator(ManifestLog(storage), store=storage.uri)
    spec = ComponentSpec("c", 8, 2, SCHEMA, delay_ms=clock.event_time.delay_ms if clock.event_time else None)
    batch = SparkBatch("q", "r", 0, "/chk", {"s": 1}, {"s": 0}, timestamp_ms=timestamp)
    plan = coordinator.begin(batch, spec)
    reports = [
        InstanceReport(i, None, None, {"next_due": due, "rows_received": 0}) for i, due in enumerate(reports_due)
    ]
    return coordinator.commit(plan, batch, spec, reports, drained=drained, clock=clock), storage


def test_a_checkpoint_records_the_wake_up_and_it_reads_back_from_full_and_delta_records():
    clock = BatchClock(None, None, None)
    manifest, storage = _committed([{PROCESSING: 25_000}, {PROCESSING: 40_000}], clock=clock)
    assert manifest.components["c"].wake_ms == 25_000
    log = ManifestLog(storage)
    assert log.latest().components["c"].wake_ms == 25_000
    coordinator = Coordinator(log, store=storage.uri)
    spec = ComponentSpec("c", 8, 2, SCHEMA)
    batch = SparkBatch("q", "r", 1, "/chk", {"s": 2}, {"s": 1}, timestamp_ms=30_000)
    reports = [InstanceReport(i, None, None, {"next_due": {}, "rows_received": 1}) for i in range(2)]
    second = coordinator.commit(coordinator.begin(batch, spec), batch, spec, reports, clock=clock)
    assert second.components["c"].wake_ms is None and second.components["c"].rows_at_ms == 30_000
    fresh = ManifestLog(storage).latest().components["c"]  # read from the delta record on the full one
    assert (fresh.wake_ms, fresh.rows_at_ms) == (None, 30_000)


def test_a_drained_checkpoint_wakes_nothing():
    manifest, _ = _committed([{PROCESSING: 25_000}, {}], clock=BatchClock(None, None, None), drained=True)
    assert manifest.components["c"].wake_ms is None


def test_a_record_written_before_the_clock_reads_as_never_waking():
    component = ComponentManifest("c", 8, 2, ("key",), SCHEMA.serialize(), {}, {}, wake_ms=5, rows_at_ms=6)
    old = component.to_json()
    del old["wake_ms"], old["rows_at_ms"]
    read = ComponentManifest.from_json("c", json.loads(json.dumps(old)))
    assert (read.wake_ms, read.rows_at_ms) == (None, None)


def test_the_clock_is_no_source_of_the_state(monkeypatch):
    from types import SimpleNamespace

    from spark_state.spark import microbatch

    clock_id = clock_source_id("c")
    checkpoint = SimpleNamespace(
        uri="/chk", query_id=lambda: "q", offsets_entry=lambda b: ({"log": {"n": 12}, clock_id: {"wake": 5}}, 1)
    )
    context = SimpleNamespace(getLocalProperty=lambda key: None)
    batch = microbatch.MicroBatch(None, None, "/chk", checkpoint, None)
    starts = {"log": {"n": 10}, clock_id: {"wake": 0}}
    monkeypatch.setattr(microbatch, "batch_start_offsets", lambda *args: starts)
    spark_batch = batch.spark_batch(SimpleNamespace(sparkSession=SimpleNamespace(sparkContext=context)), 3)
    assert (spark_batch.end, spark_batch.start) == ({"log": {"n": 12}}, {"log": {"n": 10}})
    assert is_clock_source(clock_id) and not is_clock_source("replayable:/data")


class _Time:
    def __init__(self):
        self.now, self.mono = 100.0, 0.0


def _reader(storage, poll=1.0) -> tuple[ClockReader, _Time]:
    clock = _Time()
    reader = ClockReader(storage.uri, "c", poll, now=lambda: clock.now, monotonic=lambda: clock.mono)
    return reader, clock


def _wake_at(storage, wake_ms: int | None) -> None:
    _committed([{PROCESSING: wake_ms} if wake_ms else {}, {}], clock=BatchClock(None, None, None), storage=storage)


def test_the_clock_moves_once_per_wake_up_at_its_time():
    storage = open_storage(f"memory://clock-{uuid.uuid4().hex}")
    reader, clock = _reader(storage)
    start = reader.initialOffset()
    assert start == {"source_id": "spark-state-clock:c", "wake": 0}
    assert reader.latestOffset(start, None) == start  # no checkpoint yet
    _wake_at(storage, 105_000)
    clock.mono += 1
    assert reader.latestOffset(start, None) == start  # not due yet
    clock.now = 105.0
    moved = reader.latestOffset(start, None)
    assert moved["wake"] == 105_000
    assert reader.latestOffset(moved, None) == moved  # the batch of that wake-up ran: nothing more
    assert reader.partitions(start, moved) == []


def test_the_clock_reads_the_store_at_most_once_per_poll():
    storage = open_storage(f"memory://clock-{uuid.uuid4().hex}")
    reader, clock = _reader(storage, poll=5.0)
    start = reader.initialOffset()
    reader.latestOffset(start, None)
    _wake_at(storage, 101_000)
    clock.now, clock.mono = 102.0, 4.0
    assert reader.latestOffset(start, None) == start  # read 4 s ago: the new checkpoint is not seen yet
    clock.mono = 5.0
    assert reader.latestOffset(start, None)["wake"] == 101_000


def test_the_clock_moves_once_for_each_new_drain_request():
    storage = open_storage(f"memory://clock-{uuid.uuid4().hex}")
    reader, clock = _reader(storage)
    start = reader.initialOffset()
    reader.latestOffset(start, None)
    request_drain(storage, "0" * 8 + "-1111-2222-3333-" + "4" * 12)
    clock.mono += 1
    moved = reader.latestOffset(start, None)
    assert moved["wake"] == 100_000
    clock.mono += 1
    assert reader.latestOffset(moved, None) == moved  # the same request: once


def test_clock_settings_are_checked():
    conf = StateConf.from_mapping({"spark.state.store": "/s"}, default_store="/s", default_parallelism=2)
    assert (conf.clock, conf.clock_poll_seconds) == (True, 1.0)
    conf = StateConf.from_mapping(
        {"spark.state.clock": "false", "spark.state.clockPollSeconds": "0.25"},
        default_store="/s",
        default_parallelism=2,
    )
    assert (conf.clock, conf.clock_poll_seconds) == (False, 0.25)
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ConfigError, match="spark.state.clockPollSeconds"):
            StateConf.from_mapping({"spark.state.clockPollSeconds": bad}, default_store="/s", default_parallelism=2)
    with pytest.raises(ConfigError, match="spark.state.clock='maybe' is not true or false"):
        StateConf.from_mapping({"spark.state.clock": "maybe"}, default_store="/s", default_parallelism=2)
