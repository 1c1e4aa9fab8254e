"""A Spark Connect client process for the Connect tests (``tests/connect.py``): ``python -m tests.connect_client
URL SCENARIO JSON-ARGUMENTS``; prints one JSON line with what the scenario saw.

Scenarios (each starts the query of ``connect_queries.build(kind)`` over the
Parquet files of ``input``, its output in ``out``, Spark's checkpoint in
``checkpoint``, the store where ``spark.state.store`` is given, else the
default ``<checkpoint>/state``):

- ``run``: at ``parallelism``, ``availableNow``; the batches' reports;
- ``live``: a processing-time trigger; after ``rescale_after`` batches
  ``set_parallelism(rescaled)``; stops once ``batches`` batches completed;
- ``start``: a processing-time trigger, then waits (the test kills the server);
- ``drain``: with the clock; once every file is taken, ``drain()`` on the idle source;
- ``replayable``: a count from a ``replayable`` log into a ``replayable`` sink
  (with ``savepoint``, a new query started from it), then the store read back
  with ``format("spark-state")``.
"""

from __future__ import annotations

import json
import sys
import time

from pyspark.sql import SparkSession

from spark_state import keyed
from tests import connect_queries as queries


def session(url: str, settings: dict) -> SparkSession:
    spark = SparkSession.builder.remote(url).getOrCreate()
    spark.conf.set("spark.state.clock", "false")
    for key, value in settings.items():
        spark.conf.set(key, str(value))
    return spark


def _report(query) -> dict:
    import pyspark

    error = query.exception()
    return {
        "batches": query.batches,
        "error": None if error is None else f"{type(error).__name__}: {error}"[:3000],
        "run_id": query.run_id,
        "pyspark": pyspark.__version__,
        "py4j": _has_py4j(),
    }


def _has_py4j() -> bool:
    import importlib.util

    return importlib.util.find_spec("py4j") is not None


def run(spark, a: dict) -> dict:
    """One query per kind of ``kinds`` (``<out>/<kind>``, ``<checkpoint>/<kind>``), or of ``kind``."""
    spark.conf.set("spark.state.parallelism", str(a["parallelism"]))
    kinds = a.get("kinds") or [a["kind"]]
    reports = {}
    for kind in kinds:
        out, checkpoint = (
            (f"{a['out']}/{kind}", f"{a['checkpoint']}/{kind}") if "kinds" in a else (a["out"], a["checkpoint"])
        )
        query = queries.write(queries.build(kind, queries.stream(spark, a["input"])), out, checkpoint)
        query.awaitTermination(a.get("timeout", 180))
        reports[kind] = _report(query)
    return reports if "kinds" in a else reports[kinds[0]]


def live(spark, a: dict) -> dict:
    spark.conf.set("spark.state.parallelism", str(a["parallelism"]))
    stateful = queries.build(a["kind"], queries.stream(spark, a["input"]))
    query = queries.write(stateful, a["out"], a["checkpoint"], trigger={"processingTime": "200 milliseconds"})
    try:
        assert query.await_batches(a["rescale_after"], timeout=120), "the first batches did not complete"
        query.set_parallelism(a["rescaled"])
        assert query.await_batches(a["batches"], timeout=120), "the rescaled batches did not complete"
    finally:
        query.stop()
    return _report(query)


def start(spark, a: dict) -> dict:
    spark.conf.set("spark.state.parallelism", str(a["parallelism"]))
    stateful = queries.build(a["kind"], queries.stream(spark, a["input"]))
    query = queries.write(stateful, a["out"], a["checkpoint"], trigger={"processingTime": "500 milliseconds"})
    query.await_batches(a["batches"], timeout=120)
    print(json.dumps({"started": True, **_report(query)}), flush=True)
    time.sleep(600)  # until the test kills the server, and this process
    return {}


def drain(spark, a: dict) -> dict:
    spark.conf.set("spark.state.parallelism", str(a["parallelism"]))
    spark.conf.set("spark.state.clock", "true")
    stateful = queries.build(a["kind"], queries.stream(spark, a["input"]))
    query = queries.write(stateful, a["out"], a["checkpoint"], trigger={"processingTime": "1 second"})
    assert query.await_batches(a["batches"], timeout=120), "the batches did not complete"
    time.sleep(2)  # the source is idle: no batch runs without the clock
    idle = len(query.batches)
    began = time.monotonic()
    drained = query.drain(timeout=90)
    return {**_report(query), "drained": drained, "idle_batches": idle, "drain_seconds": time.monotonic() - began}


def replayable(spark, a: dict) -> dict:
    spark.conf.set("spark.state.parallelism", str(a["parallelism"]))
    spark.conf.set("spark.state.store", a["store"])
    events = (
        spark.readStream.format("replayable")
        .option("path", a["log"])
        .option("startingOffsets", "checkpoint")
        .option("stateStore", a["store"])
        .option("maxRecordsPerBatch", 150)
        .load()
    )
    writer = (
        keyed(events, "user", name="clicks")
        .count()
        .writeStream.format("replayable")
        .option("path", a["out"])
        .option("keyColumn", "user")
        .option("checkpointLocation", a["checkpoint"])
        .trigger(availableNow=True)
    )
    if a.get("savepoint"):
        writer = writer.fromSavepoint(a["savepoint"])
    try:
        query = writer.start()
    except Exception as error:  # noqa: BLE001  (what the test looks for)
        return {"refused": f"{type(error).__name__}: {error}"}
    query.awaitTermination(180)
    state = spark.read.format("spark-state").option("store", a["store"]).option("component", "clicks").load()
    output = spark.read.format("replayable").option("path", a["out"]).load()
    return {
        **_report(query),
        "state": {row["user"]: row["count"] for row in state.collect()},
        "output_rows": output.count(),
    }


SCENARIOS = {f.__name__: f for f in (run, live, start, drain, replayable)}


def main() -> None:
    url, scenario, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spark = session(url, arguments.pop("settings", {}))
    result = SCENARIOS[scenario](spark, arguments)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
