"""One driver process of the fault campaign: a keyed query of one shape, run until the supervisor says stop.

    python -m tests.campaign.driver SPEC_JSON

The spec (written by the supervisor) names the shape, the events log and
where its source starts (offsets, or ``checkpoint``: a query started from a
savepoint reads from its store's first checkpoint), the state store, Spark's
checkpoint location, the sink (a replayable log), the parallelism and an
optional live change, Spark's master and settings. The
query runs with the default trigger, or the spec's (a processing-time
interval: under dynamic allocation, gaps in which executors idle; the driver
then writes the executors it sees to ``control/executors.json``); the driver
watches the files the supervisor drops into ``control/``:

- ``finish``: process everything available, stop, exit 0;
- ``stop``: stop the query at once (a clean stop, mid-batch or not), exit 0;
- ``drain``: process everything available, ask for a drain, write
  ``control/drain-requested`` and wait for the drain batch (the supervisor
  appends its input), exit 0 once the query stopped drained.

``report.json`` records the query's batches (parallelism, replays, drains);
``error.json`` the type and message of what stopped the query (exit code 3).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from tests.campaign.model import DELAY_MS, GAP_MS, HORIZON_MS, TIMER_AFTER_MS, TTL_MS

EXIT_ERROR = 3


def count_fn(key, rows, state):
    n, total, top = state.get() if state.exists else (0, 0, -1)
    n, total, top = n + len(rows), total + int(rows["value"].sum()), max(top, int(rows["seq"].max()))
    state.update((n, total, top))
    return [{"key": key[0], "n": n, "total": total, "top": top}]


def timed_fn(key, rows, state):
    n = (state.get()[0] if state.exists else 0) + rows.num_rows
    state.update((n,))
    latest = pc.max(rows.column("event_time").cast(pa.timestamp("ms", tz="UTC")).cast(pa.int64())).as_py()
    state.timers.register(latest + TIMER_AFTER_MS, "event")
    return [{"key": key[0], "n": n, "t": -1}]


def on_timer(key, timer, state):
    return [{"key": key[0], "n": state.get()[0] if state.exists else -1, "t": timer.time_ms}]


def build(shape: str, events):
    from spark_state import keyed

    stream = keyed(events, "key", name=shape)
    delay = f"{DELAY_MS} ms"
    if shape == "count":
        return stream.count()
    if shape == "sum":
        return stream.sum("value")
    if shape == "apply":
        return stream.apply(
            count_fn,
            state_schema="n long, total long, top long",
            output_schema="key string, n long, total long, top long",
        )
    if shape == "sessions":
        return stream.withWatermark("event_time", delay).session_window(f"{GAP_MS} ms", "value")
    if shape == "dedup":
        return stream.withWatermark("event_time", delay).deduplicate(f"{HORIZON_MS} ms")
    if shape == "timers":
        return stream.withWatermark("event_time", delay).apply(
            timed_fn,
            state_schema="n long",
            output_schema="key string, n long, t long",
            style="arrow",
            on_timer=on_timer,
            ttl=f"{TTL_MS} ms",
        )
    raise ValueError(f"unknown shape {shape!r}")


class _Executors:
    """The executors Spark runs (its ids, over py4j: a test's view), written to ``control/executors.json`` when
    they change: those at the start, every one seen, and those removed since."""

    def __init__(self, spark, control: Path):
        self.context, self.path = spark.sparkContext._jsc.sc(), control / "executors.json"
        self.first = self.now()
        self.seen, self.removed = list(self.first), []
        self.write()

    def now(self) -> list[str]:
        ids = self.context.getExecutorIds().mkString(",")
        return [i for i in ids.split(",") if i]

    def poll(self) -> None:
        now = self.now()
        gone = [e for e in self.seen if e not in now and e not in self.removed]
        new = [e for e in now if e not in self.seen]
        if gone or new:
            self.removed += gone
            self.seen += new
            self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps({"first": self.first, "seen": self.seen, "removed": self.removed}))


def run(spec: dict) -> int:
    from pyspark.sql import SparkSession

    import datasources

    control = Path(spec["control"])
    builder = SparkSession.builder.appName(f"campaign-{spec['shape']}")
    for key, value in spec["conf"].items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    datasources.register(spark)  # the source's tasks in the instances' worker pool: one cold start, not two
    query = None
    try:
        reader = (
            spark.readStream.format("replayable")
            .option("path", spec["events"])
            .option("maxRecordsPerBatch", spec["max_records_per_batch"])
        )
        if spec["starting_offsets"] == "checkpoint":  # a fork: where its store's first checkpoint says
            reader = reader.option("startingOffsets", "checkpoint").option(
                "stateStore", spec["conf"]["spark.state.store"]
            )
        else:
            reader = reader.option("startingOffsets", json.dumps(spec["starting_offsets"]))
        events = reader.load().selectExpr(
            "key", "value", "event_time", "seq", "split AS src_split", "offset AS src_offset"
        )
        writer = (
            build(spec["shape"], events)
            .writeStream.format("replayable")
            .option("path", spec["out"])
            .option("keyColumn", "key")
            .option("checkpointLocation", spec["checkpoint"])
        )
        if spec.get("trigger"):
            writer = writer.trigger(processingTime=spec["trigger"])
        query = writer.start()
        executors = _Executors(spark, control) if spec["conf"].get("spark.dynamicAllocation.enabled") else None
        (control / "started").write_text(str(query.run_id))
        if spec.get("stop_at_start"):  # a stop before the first batch: every later start must still work
            query.stop()
            return 0
        changed = spec.get("live_change") is None
        while query.isActive:
            if executors is not None:
                executors.poll()
            if not changed and len(query.batches) >= spec["live_change"][1]:
                query.set_parallelism(spec["live_change"][0])
                changed = True
            if (control / "stop").exists():
                query.stop()
                break
            if (control / "finish").exists():
                query.processAllAvailable()
                query.stop()
                break
            if (control / "drain").exists():
                query.processAllAvailable()
                query.request_drain()
                (control / "drain-requested").write_text("")
                query.awaitTermination(600)
                break
            query.awaitTermination(0.2)
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the supervisor, which decides what it means
        text = "".join(traceback.format_exception(exc))
        (control / "error.json").write_text(json.dumps({"type": type(exc).__name__, "message": text}))
        sys.stderr.write(text)
        return EXIT_ERROR
    finally:
        if query is not None:
            batches = [
                {k: b[k] for k in ("batch_id", "checkpoint_id", "replayed", "parallelism", "drained")}
                | {
                    "repairs": sum(i.get("repairs", 0) for i in b["instances"]),
                    "evicted": sum(i.get("memory", {}).get("evicted_key_groups", 0) for i in b["instances"]),
                    "loaded": sum(i["restore"].get("loaded", {}).get("key_groups", 0) for i in b["instances"]),
                }
                for b in query.batches
            ]
            (control / "report.json").write_text(json.dumps({"batches": batches}))
        try:
            spark.stop()
        except Exception:  # noqa: BLE001 - the JVM may be gone
            pass


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    started = time.time()
    code = run(spec)
    sys.stderr.write(f"campaign driver: exit {code} after {time.time() - started:.1f} s\n")
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
