"""A keyed-count job run as its own driver process, for tests that kill the driver.

    python tests/driver_job.py WORK PARALLELISM [--die-at STAGE:BATCH] [--function count|apply] [--raw-exit]

Reads Parquet files from WORK/input one per micro-batch, counts per user
(the built-in ``count``, or the same count as a user function with
``apply``), writes each batch's output to WORK/out/batch_id=N (Parquet,
overwrite) and exits. With ``--die-at``, the driver process dies (``os._exit``, no cleanup)
when the micro-batch protocol reaches STAGE of batch BATCH. With ``--raw-exit`` it prints the run id,
awaits the raw ``StreamingQuery`` (not ``StatefulQuery``, which records the run's stop itself) and exits
without stopping the session, as many scripts do.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def driver_session(work: Path, parallelism: int):
    """The test drivers' Spark session: ``local[2]``, UI and AQE off, state in WORK/state at ``parallelism``."""
    from pyspark.sql import SparkSession

    from tests.jvm import driver_jvm_options

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.extraJavaOptions", driver_jvm_options())
        .config("spark.state.parallelism", str(parallelism))
        .config("spark.state.store", str(work / "state"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("parallelism", type=int)
    parser.add_argument("--die-at")
    parser.add_argument("--function", choices=("count", "apply"), default="count")
    parser.add_argument("--raw-exit", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from spark_state import keyed
    from spark_state.spark.microbatch import MicroBatch

    if args.die_at:
        stage, batch = args.die_at.split(":")

        def die(self, at, batch_id):
            if at == stage and batch_id == int(batch):
                os._exit(41)

        MicroBatch._fault = die
    work = Path(args.work)
    spark = driver_session(work, args.parallelism)
    events = (
        spark.readStream.schema("user string, amount long").option("maxFilesPerTrigger", 1).parquet(str(work / "input"))
    )
    stream = keyed(events, "user", name="clicks")
    if args.function == "count":
        counted = stream.count()
    else:

        def count(key, rows, state):
            total = (state.get()[0] if state.exists else 0) + len(rows)
            state.update((total,))
            return [{"user": key[0], "count": total}]

        counted = stream.apply(count, state_schema="count long", output_schema="user string, count long")
    query = (
        counted.writeStream.format("parquet")
        .option("path", str(work / "out"))
        .option("checkpointLocation", str(work / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    if args.raw_exit:
        print("run", query.run_id, flush=True)
        query.query.awaitTermination()
        return
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
