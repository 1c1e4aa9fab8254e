"""Event time against Spark's own: session windows, state size under a time to live, and the cost of timers.

Run: ``./run bench bench_time [--full]``. Prints one JSON object, writes
``benchmarks/results/time.json`` (``time_full.json``) and a PNG beside it.

1. ``sessions``: the same Parquet files (keys Zipf-skewed, event times
   rising file by file with disorder below the watermark delay) through
   - ``ours``: ``keyed(df, "key").withWatermark("ts", delay).session_window(gap, "v")``;
   - ``spark_native``: ``df.withWatermark("ts", delay).groupBy("key", session_window("ts", gap))``
     with count, sum, min and max of ``v``, append mode;
   - ``spark_tws``: the same sessions in ``transformWithStateInPandas`` with a
     list state and event-time timers (RocksDB state store, as it requires).
   Rows/s = rows of batches 1..n / the sum of their ``triggerExecution``
   (batch 0 warms up). All three must emit the same sessions among those
   whose end is at most the last watermark our query ran with (Spark also
   runs batches without new data, which close later sessions).
2. ``ttl``: a keyed function remembering each key, over batches that each
   bring new keys one second of event time later, with an event-time time to
   live and without: stored state bytes (the blobs the latest checkpoint
   references) and batch time; with the time to live they must stay flat.
3. ``timers``: keys with one event-time timer each, spread over 100 seconds
   of event time; every steady batch updates 1% of the keys and advances the
   watermark one second, so 1% of the timers fire (each re-registers 100 s
   later). The same query without timers gets the same batches: the ratio of
   their steady batch times is the cost of timers.
4. ``timer_checkpoint``: what a checkpoint of a state with timers costs as
   the state grows, in-process (an instance's ``ResidentState`` over memory
   storage, ``DEFAULT_MAX_PARALLELISM`` key groups, so no Spark and no disk
   in the figure): each state size is filled with keys holding a value and
   an event-time timer, then ``timer_rounds`` checkpoints each follow the
   same number of changed keys (a new value and a new timer each); beside
   it, the same states without timers. A checkpoint must cost the keys
   changed, not the state (each entry records its key group's earliest
   timers, and the chain planner sizes each changed key group).

5. ``idle``: work without rows on a source that stopped (the query's clock,
   ``datasources.clock``). One key re-registers a processing-time timer every
   ``tick_ms``; after its one file the source stays idle for
   ``idle_seconds``, under Spark's default trigger and under a 1 s
   processing-time trigger. Per alert: its lateness (the time its batch's
   output was written minus the timer's time), the part of it before the
   batch began (the batch's processing time minus the timer's; the rest is
   the batch itself), and the batches that fired no timer. Beside them, a
   count per key (no timers) idle as long: every batch after its file is an
   extra one. Extrapolated to an hour: batches with nothing due, and batches
   per hour with one timer due per minute (60 x batches per timer fired).
   What the clock costs: the CPU the session's processes take per idle
   second with nothing due, clock on minus clock off (Spark asks an idle
   query's sources for offsets every 10 ms under its default trigger), and
   a busy query's median steady batch time with the clock and without
   (a keyed count, one file per batch, in turn twice).

Targets (issue): sessions at least 1.0x ``spark_tws`` and 0.5x
``spark_native``; with a time to live, bytes and batch time at the last batch
at most 1.2x those at batch 10 (medians of five batches around each, since
compaction makes single batches jump); timers at most 1.3x; a checkpoint
of a state with timers growing from the smallest state to the largest at
most 1.2x as much as the same checkpoint without timers (medians of the same
number of changed keys; the states without timers show what the machine's
caches and memory add as a state grows, which timers must not multiply);
idle: a timer's wait before its batch began at most one trigger interval
(median and p95; under the default trigger Spark polls every 10 ms, so the
bound used is 0.1 s), and its lateness at most that plus its batch; no batch
with nothing due; one batch per timer due (60 per hour at one per minute);
a busy query's batches with the clock at most 1.05x those without (ours).
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

WORK = common.WORK_DIR / "time"
BASE_MS = 1_700_000_000_000


@dataclass(frozen=True)
class Config:
    mode: str
    session_files: int
    session_rows: int
    session_keys: int
    ttl_batches: int
    ttl_keys: int
    timer_keys: int
    timer_batches: int
    timer_state_sizes: tuple[int, ...]  # timer_checkpoint: smallest first
    timer_changes: int  # keys changed before each measured checkpoint
    timer_rounds: int
    idle_seconds: float = 60.0
    tick_ms: int = 3_000
    parallelism: int = 2
    clock_files: int = 12  # the clock's cost to a busy query: files of ``clock_rows`` rows over ``clock_keys`` keys
    clock_rows: int = 50_000
    clock_keys: int = 20_000
    clock_turns: tuple[bool, ...] = (True, False, False, True)  # with the clock or without, in this order


QUICK = Config("quick", 8, 20_000, 2_000, 30, 2_000, 100_000, 6, (10_000, 1_000_000), 1_000, 12, 60.0)
FULL = Config("full", 12, 50_000, 5_000, 100, 5_000, 1_000_000, 8, (10_000, 1_000_000, 3_000_000), 1_000, 16, 300.0)
SMOKE = Config(
    "smoke",
    3,
    1_000,
    100,
    8,
    100,
    2_000,
    3,
    (1_000, 20_000),
    100,
    3,
    4.0,
    1_000,
    clock_files=4,
    clock_rows=1_000,
    clock_turns=(True, False),
)


# 1. Sessions ----------------------------------------------------------------------------------------

GAP_MS, DELAY_MS = 2_000, 5_000


def _session_tables(config: Config, rng) -> list[pa.Table]:
    """File i: rows with event times in [i * 10 s, (i + 1) * 10 s) plus disorder below the delay."""
    weights = 1.0 / np.arange(1, config.session_keys + 1)
    weights /= weights.sum()
    tables = []
    for i in range(config.session_files):
        n = config.session_rows
        keys = rng.choice(config.session_keys, size=n, p=weights)
        times = BASE_MS + i * 10_000 + np.sort(rng.integers(0, 10_000, size=n)) - rng.integers(0, DELAY_MS // 2, size=n)
        tables.append(
            pa.table(
                {
                    "key": pa.array([f"k{k:06d}" for k in keys]),
                    "ts": pa.array(times.astype("datetime64[ms]"), pa.timestamp("ms", tz="UTC")),
                    "v": pa.array(rng.integers(0, 1000, size=n), pa.int64()),
                }
            )
        )
    return tables


def _ours(spark, stream):
    from spark_state import keyed

    return (
        keyed(stream, "key", name="sessions").withWatermark("ts", f"{DELAY_MS} ms").session_window(f"{GAP_MS} ms", "v")
    )


def _native(spark, stream):
    from pyspark.sql import functions as F

    grouped = stream.withWatermark("ts", f"{DELAY_MS} milliseconds").groupBy(
        "key", F.session_window("ts", f"{GAP_MS} milliseconds")
    )
    return grouped.agg(
        F.count("*").alias("count"), F.sum("v").alias("sum_v"), F.min("v").alias("min_v"), F.max("v").alias("max_v")
    )


def _tws(spark, stream):
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Sessions(StatefulProcessor):
        def init(self, handle):
            self.handle = handle
            self.sessions = handle.getListState(
                "sessions", "start long, end long, count long, sum_v long, min_v long, max_v long"
            )

        def handleInputRows(self, key, rows, timerValues):
            sessions = [list(s) for s in self.sessions.get()]
            before = {s[1] for s in sessions}
            for frame in rows:
                times = frame["ts"].astype("int64") // 1_000_000 if frame["ts"].dtype.kind == "M" else frame["ts"]
                for t, v in sorted(zip(times.tolist(), frame["v"].tolist())):
                    merged = [t, t + GAP_MS, 1, v, v, v]
                    keep = []
                    for s in sessions:
                        if s[0] <= merged[1] and merged[0] <= s[1]:
                            merged = [
                                min(s[0], merged[0]),
                                max(s[1], merged[1]),
                                s[2] + merged[2],
                                s[3] + merged[3],
                                min(s[4], merged[4]),
                                max(s[5], merged[5]),
                            ]
                        else:
                            keep.append(s)
                    sessions = keep + [merged]
            after = {s[1] for s in sessions}
            for end in before - after:
                self.handle.deleteTimer(end)
            for end in after - before:
                self.handle.registerTimer(end)
            self.sessions.clear()
            if sessions:
                self.sessions.put([tuple(s) for s in sessions])
            return iter([])

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
            end = expiredTimerInfo.getExpiryTimeInMs()
            sessions = [list(s) for s in self.sessions.get()]
            closed = [s for s in sessions if s[1] == end]
            self.sessions.clear()
            rest = [tuple(s) for s in sessions if s[1] != end]
            if rest:
                self.sessions.put(rest)
            if closed:
                yield pd.DataFrame(
                    {
                        "key": [key[0]] * len(closed),
                        "start": [s[0] for s in closed],
                        "end": [s[1] for s in closed],
                        "count": [s[2] for s in closed],
                        "sum_v": [s[3] for s in closed],
                        "min_v": [s[4] for s in closed],
                        "max_v": [s[5] for s in closed],
                    }
                )

        def close(self):
            pass

    return (
        stream.withWatermark("ts", f"{DELAY_MS} milliseconds")
        .groupBy("key")
        .transformWithStateInPandas(
            Sessions(),
            "key string, start long, end long, count long, sum_v long, min_v long, max_v long",
            "Append",
            "EventTime",
        )
    )


def _session_rows(system: str, rows: list) -> set[tuple]:
    out = set()
    for r in rows:
        if system == "ours":
            start, end = r["session_start"], r["session_end"]
        elif system == "spark_native":
            start, end = r["session_window"]["start"], r["session_window"]["end"]
        else:
            start, end = r["start"], r["end"]
        as_ms = [int(t.timestamp() * 1000) if isinstance(t, dt.datetime) else int(t) for t in (start, end)]
        out.add((r["key"], *as_ms, r["count"], r["sum_v"], r["min_v"], r["max_v"]))
    return out


def sessions(spark, config: Config, rng) -> dict:
    files = common.write_input(WORK / "sessions", _session_tables(config, rng), "key string, ts timestamp, v long")
    builds = {"ours": _ours, "spark_native": _native, "spark_tws": _tws}
    results, emitted = {}, {}
    spark.conf.set("spark.state.parallelism", str(config.parallelism))
    for system, build in builds.items():
        work = common.fresh_dir(WORK / system)
        if system == "spark_tws":
            spark.conf.set(
                "spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
            )
        out: list = []
        stream = spark.readStream.schema(files.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(files.directory))
        query = build(spark, stream).writeStream.foreachBatch(
            lambda df, b: out.extend(r.asDict() for r in df.collect())
        )
        if system != "ours":
            query = query.outputMode("append")
        query = query.option("checkpointLocation", str(work / "chk")).trigger(availableNow=True).start()
        query.awaitTermination()
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
        progress = common.batch_progress(query)
        measured = [p for p in progress if p["batch_id"] >= 1 and p["rows"]]
        seconds = sum(p["seconds"] for p in measured)
        results[system] = {
            "rows": sum(p["rows"] for p in measured),
            "seconds": round(seconds, 3),
            "rows_per_s": round(sum(p["rows"] for p in measured) / seconds),
            "batches": len(progress),
            "sessions_emitted": len(out),
        }
        if system == "ours":
            results[system]["last_watermark_ms"] = query.batches[-1]["watermark_ms"]
            results[system]["late_rows"] = sum(b["late_rows"] for b in query.batches)
        emitted[system] = _session_rows(system, out)
    spark.conf.unset("spark.state.parallelism")
    horizon = results["ours"]["last_watermark_ms"]
    closed = {s: {row for row in rows if row[2] <= horizon} for s, rows in emitted.items()}
    return {
        "systems": results,
        "sessions_compared": len(closed["ours"]),
        "same_sessions": closed["ours"] == closed["spark_native"] == closed["spark_tws"],
        "ours_vs_spark_tws": round(results["ours"]["rows_per_s"] / results["spark_tws"]["rows_per_s"], 3),
        "ours_vs_spark_native": round(results["ours"]["rows_per_s"] / results["spark_native"]["rows_per_s"], 3),
    }


# 2. State size under a time to live ------------------------------------------------------------------


def _remember(key, rows, state):
    state.update((len(rows),))


def _stored_bytes(store: Path, component: str) -> int:
    from spark_state.store.manifestlog import open_manifest_log

    latest = open_manifest_log(str(store)).latest()
    return sum(b.size for b in latest.components[component].blobs.values())


def ttl(spark, config: Config, rng) -> dict:
    from spark_state import keyed

    tables = []
    for i in range(config.ttl_batches):
        n = config.ttl_keys
        keys = [f"b{i}-{j}" for j in range(n)]
        tables.append(pa.table({"key": pa.array(keys), "t": pa.array([BASE_MS + i * 1000] * n, pa.int64())}))
    files = common.write_input(WORK / "ttl-files", tables, "key string, t long")
    runs = {}
    for label, time_to_live in (("with_ttl", "3 seconds"), ("without_ttl", None)):
        work = common.fresh_dir(WORK / label)
        spark.conf.set("spark.state.parallelism", str(config.parallelism))
        spark.conf.set("spark.state.store", str(work / "state"))
        live = common.fresh_dir(work / "input")
        stream = spark.readStream.schema(files.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(live))
        query = (
            keyed(stream, "key", name=label)
            .withWatermark("t", "0 ms")
            .apply(
                _remember,
                state_schema="n long",
                output_schema="key string",
                ttl=time_to_live,
                ttl_kind="event",
            )
            .writeStream.foreachBatch(common.noop_sink)
            .option("checkpointLocation", str(work / "chk"))
            .start()
        )
        stored, keys_held = [], []
        try:
            for index in range(config.ttl_batches):
                common.release_file(files, index, live)
                common.await_batches(query, index + 1)
                stored.append(_stored_bytes(work / "state", label))
                keys_held.append(sum(i["keys"] for i in query.batches[-1]["instances"]))
        finally:
            query.stop()
            spark.conf.unset("spark.state.store")
            spark.conf.unset("spark.state.parallelism")
        progress = common.batch_progress(query)
        runs[label] = {
            "stored_bytes": stored,
            "keys": keys_held,
            "batch_seconds": [p["seconds"] for p in progress],
            "expired": sum(b["expired"] for b in query.batches),
        }

    def around(values, index):
        return statistics.median(values[max(0, index - 2) : index + 3])

    ttl_run, last = runs["with_ttl"], config.ttl_batches - 3
    early = min(10, config.ttl_batches // 2)
    return {
        "runs": runs,
        "bytes_last_vs_batch_10": round(
            around(ttl_run["stored_bytes"], last) / around(ttl_run["stored_bytes"], early), 3
        ),
        "seconds_last_vs_batch_10": round(
            around(ttl_run["batch_seconds"], last) / around(ttl_run["batch_seconds"], early), 3
        ),
        "without_ttl_bytes_last_vs_batch_10": round(
            around(runs["without_ttl"]["stored_bytes"], last) / around(runs["without_ttl"]["stored_bytes"], early), 3
        ),
        "compared_batches": [early, last],
    }


# 3. Timer cost --------------------------------------------------------------------------------------


def _with_timer(key, rows, state):
    if not state.exists:
        state.timers.register(int(rows["due"].iloc[0]))
    state.update((int(rows["t"].max()),))


def _refire(key, timer, state):
    state.timers.register(timer.time_ms + 100_000)


def _without_timer(key, rows, state):
    state.update((int(rows["t"].max()),))


def timers(spark, config: Config, rng) -> dict:
    from spark_state import keyed

    n = config.timer_keys
    keys = np.array([f"k{k:07d}" for k in range(n)])
    setup = pa.table(
        {
            "key": pa.array(keys),
            "t": pa.array([BASE_MS] * n, pa.int64()),
            "due": pa.array(BASE_MS + 1000 + (np.arange(n) % 100) * 1000, pa.int64()),
        }
    )
    tables = [setup]
    for step in range(1, config.timer_batches + 1):
        chosen = rng.choice(n, size=max(1, n // 100), replace=False)
        tables.append(
            pa.table(
                {
                    "key": pa.array(keys[chosen]),
                    "t": pa.array([BASE_MS + step * 1000] * len(chosen), pa.int64()),
                    "due": pa.array([0] * len(chosen), pa.int64()),
                }
            )
        )
    files = common.write_input(WORK / "timer-files", tables, "key string, t long, due long")
    runs = {}
    for label in ("timers", "no_timers"):
        work = common.fresh_dir(WORK / label)
        spark.conf.set("spark.state.parallelism", str(config.parallelism))
        spark.conf.set("spark.state.store", str(work / "state"))
        stream = spark.readStream.schema(files.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(files.directory))
        keyed_stream = keyed(stream, "key", name=label).withWatermark("t", "0 ms")
        if label == "timers":
            stateful = keyed_stream.apply(
                _with_timer, state_schema="t long", output_schema="key string", on_timer=_refire
            )
        else:
            stateful = keyed_stream.apply(_without_timer, state_schema="t long", output_schema="key string")
        query = (
            stateful.writeStream.foreachBatch(common.noop_sink)
            .option("checkpointLocation", str(work / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        spark.conf.unset("spark.state.store")
        spark.conf.unset("spark.state.parallelism")
        progress = common.batch_progress(query)
        steady = [p["seconds"] for p in progress if p["batch_id"] >= 2]  # 0: setup, 1: warm
        runs[label] = {
            "steady_batch_seconds": steady,
            "median_steady_seconds": round(statistics.median(steady), 3),
            "timers_fired": [b["timers_fired"] for b in query.batches],
        }
    return {
        "runs": runs,
        "timer_keys": n,
        "fired_per_batch_target": n // 100,
        "ratio": round(runs["timers"]["median_steady_seconds"] / runs["no_timers"]["median_steady_seconds"], 3),
    }


# 4. Checkpoint cost with timers against state size -------------------------------------------------


class _TimedState:
    """One state of ``timer_checkpoint``: ``size`` keys with a value (and an event-time timer), checkpointed."""

    def __init__(self, size: int, with_timers: bool):
        from spark_state.executor.resident import ResidentState
        from spark_state.keyspace import DEFAULT_MAX_PARALLELISM, key_group_for, key_group_range
        from spark_state.model.schema import KeyedSchema, StateVariable
        from spark_state.model.timers import TIMERS
        from spark_state.storage.memory import MemoryStorage
        from spark_state.store.blobstore import BlobStore

        value = StateVariable("value", (pa.field("t", pa.int64()),))
        schema = KeyedSchema((pa.field("key", pa.string()),), (value, TIMERS) if with_timers else (value,))
        self.size, self.with_timers = size, with_timers
        self.state = ResidentState(schema, key_group_range(0, 1, DEFAULT_MAX_PARALLELISM))
        self.blobs = BlobStore(MemoryStorage())
        self.keys = [(f"k{n:08d}",) for n in range(size)]
        self.groups = [key_group_for(key[0], DEFAULT_MAX_PARALLELISM) for key in self.keys]
        for index in range(size):
            self.write(index, 0)
        self.state.checkpoint(self.blobs, "c", 0, 0)

    def write(self, index: int, step: int) -> None:
        table, group, key = self.state.table, self.groups[index], self.keys[index]
        table.put(group, key, (BASE_MS + step,), 0)
        if self.with_timers:
            table.put(group, key, ([BASE_MS + 100_000 + step + index % 1000], [], None), 1)

    def checkpoint_after_changes(self, step: int, changes: int, rng) -> float:
        """Change ``changes`` keys, then checkpoint; the checkpoint's seconds."""
        import time

        for index in rng.choice(self.size, size=changes, replace=False):
            self.write(int(index), step)
        started = time.perf_counter()
        self.state.checkpoint(self.blobs, "c", step, 0)
        return round(time.perf_counter() - started, 4)


def timer_checkpoint(config: Config, rng) -> dict:
    """Every state built first, then each round checkpoints each of them, in an order rotated every round.

    Garbage is handled as an instance host handles it (``hosts.collect_garbage``): what a round leaves is
    collected and frozen, so no checkpoint walks the states for cyclic garbage.
    """
    import gc

    from spark_state.hosts.policy import collect_garbage

    states = {
        (str(size), label): _TimedState(size, label == "timers")
        for size in config.timer_state_sizes
        for label in ("timers", "no_timers")
    }
    order, seconds = list(states), {name: [] for name in states}
    try:
        gc.collect()
        gc.freeze()
        for step in range(1, config.timer_rounds + 1):
            shift = step % len(order)
            for name in order[shift:] + order[:shift]:
                seconds[name].append(states[name].checkpoint_after_changes(step, config.timer_changes, rng))
                collect_garbage(0)
    finally:
        gc.unfreeze()  # this process is no host: its later objects are walked as usual
    states.clear()
    runs: dict = {}
    for (size, label), values in seconds.items():
        runs.setdefault(size, {})[label] = {"checkpoint_seconds": values, "median_seconds": statistics.median(values)}
    smallest, largest = str(config.timer_state_sizes[0]), str(config.timer_state_sizes[-1])

    def ratio(label: str) -> float:
        return round(runs[largest][label]["median_seconds"] / runs[smallest][label]["median_seconds"], 3)

    return {
        "runs": runs,
        "changed_keys": config.timer_changes,
        "largest_vs_smallest": ratio("timers"),
        "largest_vs_smallest_without_timers": ratio("no_timers"),
        "growth_vs_without_timers": round(ratio("timers") / ratio("no_timers"), 3),
        "timers_vs_none_at_largest": round(
            runs[largest]["timers"]["median_seconds"] / runs[largest]["no_timers"]["median_seconds"], 3
        ),
    }


# 5. Idle --------------------------------------------------------------------------------------------

DEFAULT_TRIGGER_BOUND_S = 0.1
"""The wait bound under Spark's default trigger, which asks the sources for offsets every 10 ms."""


def _tick(period_ms: int):
    def on_rows(key, rows, state):
        if not state.exists:
            state.update((0,))
            state.timers.register(state.processing_time + period_ms, kind="processing")

    def on_timer(key, timer, state):
        state.timers.register(timer.time_ms + period_ms, kind="processing")
        return [{"key": key[0], "due": timer.time_ms}]

    return on_rows, on_timer


def _idle_query(spark, work: Path, label: str, build, trigger: dict | None):
    """Start ``build(stream)`` on a one-file source, record when each batch's output was written, wait for the
    first batch; the query and the records ``(batch id, written at, rows)``."""
    work = common.fresh_dir(work / label)
    spark.conf.set("spark.state.parallelism", str(1))
    spark.conf.set("spark.state.store", str(work / "state"))
    spark.conf.set("spark.state.clock", "true")
    spark.conf.set("spark.state.clockPollSeconds", "1")
    common.write_input(work / "in", [pa.table({"key": ["tick"]})], "key string")
    written: list[tuple[int, float, list]] = []

    def sink(df, batch_id):
        rows = [tuple(r) for r in df.collect()]
        written.append((batch_id, time.time(), rows))

    stream = spark.readStream.schema("key string").parquet(str(work / "in"))
    writer = build(stream).writeStream.foreachBatch(sink).option("checkpointLocation", str(work / "chk"))
    query = (writer.trigger(**trigger) if trigger else writer).start()
    common.await_batches(query, 1)
    return query, written


def _ticks(spark, config: Config, trigger: dict | None) -> dict:
    from spark_state import keyed

    on_rows, on_timer = _tick(config.tick_ms)
    label = "ticks-" + ("default" if trigger is None else "1s")
    query, written = _idle_query(
        spark,
        WORK,
        label,
        lambda s: keyed(s, "key", name="ticks").apply(
            on_rows, on_timer=on_timer, state_schema="n long", output_schema="key string, due long"
        ),
        trigger,
    )
    try:
        time.sleep(config.idle_seconds)
    finally:
        query.stop()
    seconds = {p["batch_id"]: p["seconds"] for p in _all_progress(query)}
    history = {b["batch_id"]: b for b in query.batches}
    alerts = []
    for batch_id, at, rows in written:
        for _, due in rows:
            batch = history[batch_id]
            alerts.append(
                {
                    "batch_id": batch_id,
                    "lateness_s": round(at - due / 1000, 4),
                    "wait_s": round((batch["processing_ms"] - due) / 1000, 4),
                    "batch_s": seconds.get(batch_id),
                }
            )
    idle_batches = [b for b in query.batches if b["batch_id"] > 0]
    fired = sum(b["timers_fired"] for b in idle_batches)
    without_timer = sum(1 for b in idle_batches if b["timers_fired"] == 0)
    bound = DEFAULT_TRIGGER_BOUND_S if trigger is None else 1.0
    waits = [a["wait_s"] for a in alerts]
    excess = [a["lateness_s"] - (a["batch_s"] or 0) for a in alerts]
    return {
        "trigger": "default" if trigger is None else trigger,
        "idle_seconds": config.idle_seconds,
        "tick_ms": config.tick_ms,
        "alerts": len(alerts),
        "timers_fired": fired,
        "idle_batches": len(idle_batches),
        "batches_without_a_timer": without_timer,
        "batches_per_timer": round(len(idle_batches) / fired, 4) if fired else None,
        "wait_bound_s": bound,
        "wait_s": _quantiles(waits),
        "lateness_s": _quantiles([a["lateness_s"] for a in alerts]),
        "lateness_minus_batch_s": _quantiles(excess),
        "per_alert": alerts,
    }


def _all_progress(query) -> list[dict]:
    return [
        {"batch_id": p["batchId"], "seconds": p["durationMs"].get("triggerExecution", 0) / 1000.0}
        for p in query.recentProgress
        if p["numInputRows"] >= 0
    ]


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p95": None, "n": 0}
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered), 4),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
        "n": len(ordered),
    }


def _tree_cpu_seconds() -> float:
    """CPU seconds (user + system) taken so far by this process and all its descendants alive now (the JVM,
    Python workers, the sources' runners), from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = common.process_stats()
    mine = common.with_descendants(os.getpid(), stats)
    return sum((int(stats[pid][11]) + int(stats[pid][12])) / tick for pid in mine if pid in stats)


def _nothing_due(spark, config: Config, clock: bool) -> dict:
    """A keyed count idle ``idle_seconds`` after its one file: the batches it ran after it, and the CPU the
    session's processes took meanwhile (per idle second)."""
    from spark_state import keyed

    spark.conf.set("spark.state.clock", str(clock).lower())
    query, _ = _idle_query(
        spark, WORK, f"nothing-due-clock-{str(clock).lower()}", lambda s: keyed(s, "key", name="counts").count(), None
    )
    try:
        time.sleep(2)  # the first batch's aftermath (plan preparation, cleanup) out of the figure
        started, cpu = time.monotonic(), _tree_cpu_seconds()
        time.sleep(config.idle_seconds)
        cpu, seconds = _tree_cpu_seconds() - cpu, time.monotonic() - started
    finally:
        query.stop()
    return {
        "clock": clock,
        "idle_seconds": config.idle_seconds,
        "extra_batches": len(query.batches) - 1,
        "cpu_seconds_per_idle_second": round(cpu / seconds, 4),
    }


def _busy_with_clock(spark, config: Config) -> dict:
    """What the clock costs a query with rows: a keyed count over ``clock_files`` files (one per batch, all
    there at its start, under Spark's default trigger), with the clock and without, in ``clock_turns``; the median
    steady batch time of each (batches 2 on) and their ratio."""
    from spark_state import keyed

    rng = np.random.default_rng(60)
    tables = [
        pa.table({"key": pa.array([f"k{k:06d}" for k in rng.integers(0, config.clock_keys, config.clock_rows)])})
        for _ in range(config.clock_files)
    ]
    steady: dict[bool, list[float]] = {True: [], False: []}
    for turn, clock in enumerate(config.clock_turns):
        work = common.fresh_dir(WORK / f"busy-{turn}")
        common.write_input(work / "in", tables, "key string")
        spark.conf.set("spark.state.clock", str(clock).lower())
        spark.conf.set("spark.state.parallelism", str(config.parallelism))
        spark.conf.set("spark.state.store", str(work / "state"))
        stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(work / "in"))
        query = (
            keyed(stream, "key", name="counts")
            .count()
            .writeStream.foreachBatch(common.noop_sink)
            .option("checkpointLocation", str(work / "chk"))
            .start()
        )
        try:
            common.await_batches(query, config.clock_files)
        finally:
            query.stop()
        steady[clock] += [p["seconds"] for p in common.batch_progress(query) if p["batch_id"] >= 2 and p["rows"]]
    with_clock, without = statistics.median(steady[True]), statistics.median(steady[False])
    return {
        "files": config.clock_files,
        "rows_per_file": config.clock_rows,
        "steady_batch_s_with_clock": round(with_clock, 4),
        "steady_batch_s_without_clock": round(without, 4),
        "with_vs_without": round(with_clock / without, 4),
        "batches_measured": {"with": len(steady[True]), "without": len(steady[False])},
    }


def idle(spark, config: Config) -> dict:
    clock = spark.conf.get("spark.state.clock", None)
    try:
        runs = {"default": _ticks(spark, config, None), "1s": _ticks(spark, config, {"processingTime": "1 second"})}
        nothing_due = _nothing_due(spark, config, clock=True)
        without_clock = _nothing_due(spark, config, clock=False)
        busy = _busy_with_clock(spark, config)
    finally:
        for key in ("spark.state.store", "spark.state.parallelism"):
            spark.conf.unset(key)
        if clock is None:
            spark.conf.unset("spark.state.clock")
        else:
            spark.conf.set("spark.state.clock", clock)
    extra = nothing_due["extra_batches"]
    per_timer = [r["batches_per_timer"] for r in runs.values() if r["batches_per_timer"] is not None]
    return {
        "ticks": runs,
        "nothing_due": nothing_due,
        "nothing_due_without_clock": without_clock,
        "clock_idle_cpu_seconds_per_second": round(
            nothing_due["cpu_seconds_per_idle_second"] - without_clock["cpu_seconds_per_idle_second"], 4
        ),
        "busy_query": busy,
        "extra_batches_per_idle_hour_nothing_due": round(extra * 3600 / config.idle_seconds, 2),
        "batches_per_hour_one_timer_per_minute": round(60 * max(per_timer), 2) if per_timer else None,
    }


# Report ---------------------------------------------------------------------------------------------


def targets(result: dict) -> list[dict]:
    s, t, m, k = result["sessions"], result["ttl"], result["timers"], result["timer_checkpoint"]
    return _idle_targets(result["idle"]) + [
        {
            "target": "sessions rows/s >= 1.0x transformWithStateInPandas",
            "value": s["ours_vs_spark_tws"],
            "met": s["ours_vs_spark_tws"] >= 1.0,
        },
        {
            "target": "sessions rows/s >= 0.5x Spark's native session_window",
            "value": s["ours_vs_spark_native"],
            "met": s["ours_vs_spark_native"] >= 0.5,
        },
        {
            "target": "the three systems emit the same sessions",
            "value": s["sessions_compared"],
            "met": s["same_sessions"],
        },
        {
            "target": "with TTL: stored bytes at the last batch <= 1.2x batch 10",
            "value": t["bytes_last_vs_batch_10"],
            "met": t["bytes_last_vs_batch_10"] <= 1.2,
        },
        {
            "target": "with TTL: batch time at the last batch <= 1.2x batch 10",
            "value": t["seconds_last_vs_batch_10"],
            "met": t["seconds_last_vs_batch_10"] <= 1.2,
        },
        {
            "target": "1% of the timers firing per batch: <= 1.3x the batch without timers",
            "value": m["ratio"],
            "met": m["ratio"] <= 1.3,
        },
        {
            "target": "checkpoint with timers, smallest to largest state: growth <= 1.2x the growth without timers",
            "value": k["growth_vs_without_timers"],
            "met": k["growth_vs_without_timers"] <= 1.2,
        },
    ]


def _idle_targets(idle: dict) -> list[dict]:
    found = []
    for label, run in idle["ticks"].items():
        bound = run["wait_bound_s"]
        for which in ("median", "p95"):
            wait, excess = run["wait_s"][which], run["lateness_minus_batch_s"][which]
            found.append(
                {
                    "target": f"idle, {label} trigger: a timer's wait before its batch <= {bound} s ({which})",
                    "value": wait,
                    "met": wait is not None and wait <= bound,
                }
            )
            found.append(
                {
                    "target": f"idle, {label} trigger: lateness <= {bound} s + its batch ({which})",
                    "value": excess,
                    "met": excess is not None and excess <= bound,
                }
            )
    per_hour = idle["batches_per_hour_one_timer_per_minute"]
    return found + [
        {
            "target": "idle: extra batches per idle hour with nothing due == 0",
            "value": idle["extra_batches_per_idle_hour_nothing_due"],
            "met": idle["extra_batches_per_idle_hour_nothing_due"] == 0,
        },
        {
            "target": "idle: batches per hour with one timer due per minute <= 60",
            "value": per_hour,
            "met": per_hour is not None and per_hour <= 60,
        },
        {
            "target": "the clock: a busy query's steady batch time <= 1.05x without it",
            "value": idle["busy_query"]["with_vs_without"],
            "met": idle["busy_query"]["with_vs_without"] <= 1.05,
        },
    ]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(26, 4.4))
    systems = result["sessions"]["systems"]
    axes[0].bar(list(systems), [v["rows_per_s"] for v in systems.values()], color="tab:blue")
    axes[0].set_title("session windows: rows/s", fontsize=10)
    for label, run in result["ttl"]["runs"].items():
        axes[1].plot([b / 1e6 for b in run["stored_bytes"]], label=label.replace("_", " "))
    axes[1].set_title("stored state, MB, per batch (new keys every batch)", fontsize=10)
    axes[1].legend(fontsize=8)
    runs = result["timers"]["runs"]
    axes[2].bar(list(runs), [r["median_steady_seconds"] for r in runs.values()], color="tab:orange")
    axes[2].set_title(f"steady batch s, {result['timers']['timer_keys']:,} keys (1% of timers fire)", fontsize=10)
    checkpoint = result["timer_checkpoint"]
    sizes = list(checkpoint["runs"])
    for label, color in (("timers", "tab:orange"), ("no_timers", "tab:gray")):
        axes[3].plot(
            [int(s) for s in sizes],
            [checkpoint["runs"][s][label]["median_seconds"] * 1000 for s in sizes],
            marker="o",
            color=color,
            label=label.replace("_", " "),
        )
    axes[3].set_xscale("log")
    axes[3].set_ylim(bottom=0)
    axes[3].set_xlabel("keys of state")
    axes[3].set_title(f"checkpoint ms after {checkpoint['changed_keys']:,} changed keys (in-process)", fontsize=10)
    axes[3].legend(fontsize=8)
    ticks = result["idle"]["ticks"]
    labels = list(ticks)
    for offset, (which, color) in enumerate((("median", "tab:blue"), ("p95", "tab:red"))):
        xs = [i + offset * 0.38 for i in range(len(labels))]
        axes[4].bar(xs, [ticks[t]["lateness_s"][which] or 0 for t in labels], 0.36, color=color, label=f"{which}")
    axes[4].set_xticks([i + 0.19 for i in range(len(labels))])
    axes[4].set_xticklabels([f"{t} trigger" for t in labels])
    axes[4].set_title("idle source: processing-time timer lateness, s", fontsize=10)
    axes[4].legend(fontsize=8)
    common.save_figure(fig, path, "Event time", result)


def run(spark, config: Config) -> dict:
    rng = np.random.default_rng(20261123)
    result = {
        "config": config.__dict__,
        "sessions": sessions(spark, config, rng),
        "ttl": ttl(spark, config, rng),
        "timers": timers(spark, config, rng),
        "timer_checkpoint": timer_checkpoint(config, rng),
        "idle": idle(spark, config),
    }
    result["targets"] = targets(result)
    return result


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__,
        "12 session files of 50k rows, 100 TTL batches, 1M timers",
        {"quick": QUICK, "full": FULL, "smoke": SMOKE},
        argv,
    )
    return common.run_and_save(
        "time", config.mode, common.command_line("bench_time", args), lambda spark: run(spark, config), plot
    )


if __name__ == "__main__":
    main()
