"""The main job: a streaming keyed count that is stopped and restarted at another parallelism.

    ./run main [--work DIR] [--events-per-split N] [--keys K] [--batch-rows N]

1. Writes a ``replayable`` log of keyed events (4 splits) from the generator.
2. Streams it through ``keyed(events, "key", name="counts").count()`` at
   parallelism 4, with ``maxRecordsPerBatch``, until it is drained.
3. Appends more events, restarts the same query (same checkpointLocation)
   at parallelism 7, then again at 2.
4. After every run, checks the latest count of every key against a batch
   ``groupBy("key").count()`` over the same log, and prints what each
   instance read when it restored its key groups after the restart.

Exits non-zero if any count differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

STAGES = (4, 7, 2)


def _session():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from spark_state.spark.streaming import UNIX_SOCKETS

    spark = (
        SparkSession.builder.master("local[*]")
        .appName("spark-state main job")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config(UNIX_SOCKETS, "true")  # Python tasks without TCP's delayed ACKs
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def append_events(spark, log: Path, stage: int, events_per_split: int, keys: int) -> None:
    """Append one stage of generated events (a different seed per stage) to the log."""
    events = (
        spark.read.format("replayable")
        .option("generator", "keyed")
        .option("numSplits", 4)
        .option("keys", keys)
        .option("skew", 0.8)
        .option("seed", stage)
        .option("rowsPerSplit", events_per_split)
        .load()
        .select("key", "value", "event_time")
    )
    events.write.format("replayable").mode("append").option("path", str(log)).option("numSplits", 4).option(
        "keyColumn", "key"
    ).save()


def run_stage(spark, work: Path, parallelism: int, batch_rows: int):
    from spark_state.spark.streaming import keyed

    spark.conf.set("spark.state.parallelism", str(parallelism))
    spark.conf.set("spark.state.store", str(work / "state"))
    events = (
        spark.readStream.format("replayable")
        .option("path", str(work / "events"))
        .option("maxRecordsPerBatch", batch_rows)
        .load()
    )
    query = (
        keyed(events, "key", name="counts")
        .count()
        .writeStream.format("parquet")
        .option("path", str(work / "counts"))
        .option("checkpointLocation", str(work / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query


def check_counts(spark, work: Path) -> tuple[int, int]:
    """(keys checked, keys whose latest streamed count differs from the batch count)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    expected = spark.read.format("replayable").option("path", str(work / "events")).load().groupBy("key").count()
    outputs = spark.read.parquet(str(work / "counts"))
    latest = (
        outputs.withColumn("rank", F.row_number().over(Window.partitionBy("key").orderBy(F.desc("batch_id"))))
        .where("rank = 1")
        .select("key", F.col("count").alias("streamed"))
    )
    joined = expected.join(latest, "key", "full_outer")
    wrong = joined.where(~F.col("count").eqNullSafe(F.col("streamed"))).count()
    return joined.count(), wrong


def describe_restore(query, parallelism: int) -> list[dict]:
    """Per instance: what the first batch of this run read from the store."""
    first = query.batches[0]
    return [
        {
            "instance": i["instance"],
            "key_groups_read": i["restore"]["key_groups_read"],
            "bytes_read": i["restore"]["bytes_read"],
            "requests": i["restore"]["requests"],
            "seconds": i["restore"]["seconds"],
            "keys": i["keys"],
        }
        for i in first["instances"]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="work-dirs/main", help="directory for the log, state and outputs (wiped)")
    parser.add_argument("--events-per-split", type=int, default=50_000, help="events per split and stage")
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batch-rows", type=int, default=60_000, help="maxRecordsPerBatch of the stream")
    args = parser.parse_args(argv)

    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spark = _session()
    failures = 0
    report = []
    for stage, parallelism in enumerate(STAGES):
        append_events(spark, work / "events", stage, args.events_per_split, args.keys)
        started = time.perf_counter()
        query = run_stage(spark, work, parallelism, args.batch_rows)
        seconds = time.perf_counter() - started
        checked, wrong = check_counts(spark, work)
        failures += wrong
        batches = query.batches
        summary = {
            "stage": stage,
            "parallelism": parallelism,
            "batches": [b["batch_id"] for b in batches],
            "rows": sum(i["rows_in"] for b in batches for i in b["instances"]),
            "seconds": round(seconds, 2),
            "keys_checked": checked,
            "keys_wrong": wrong,
            "restore": describe_restore(query, parallelism) if batches else [],
        }
        report.append(summary)
        status = "OK" if wrong == 0 else f"{wrong} WRONG"
        print(
            f"stage {stage}: parallelism {parallelism}, batches {summary['batches']}, {summary['rows']} rows "
            f"in {summary['seconds']} s; {checked} keys checked against a batch count: {status}"
        )
        for item in summary["restore"]:
            print(
                f"  instance {item['instance']}: read {item['key_groups_read']} key groups, "
                f"{item['bytes_read']} bytes in {item['requests']} requests, {item['seconds']} s; "
                f"{item['keys']} keys after its first batch"
            )
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report: {work / 'report.json'}")
    spark.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
