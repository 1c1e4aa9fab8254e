"""A session-window job run as its own driver process, for tests that kill it, rescale it and drain it.

    python tests/session_job.py WORK PARALLELISM [--die-at STAGE:BATCH] [--live-change P:BATCH] [--drain]

Reads the replayable log WORK/events (``maxRecordsPerBatch`` 800), keys it
by ``key`` with event time ``event_time`` (delay 2 seconds) and writes
``session_window("300 ms", "value")`` per batch id to WORK/out/batch_id=N
(Parquet, overwrite). Without ``--drain`` it processes what is available and
exits; with it, it then asks for a drain, appends one more event to trigger
the drain batch, and waits until the query stopped. ``--die-at`` kills the
driver (``os._exit``) at a step of the micro-batch protocol; ``--live-change``
sets the parallelism to P from batch BATCH on, without a restart.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GAP, DELAY = "300 ms", "2 seconds"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("parallelism", type=int)
    parser.add_argument("--die-at")
    parser.add_argument("--live-change")
    parser.add_argument("--drain", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from spark_state import keyed
    from spark_state.microbatch import MicroBatch
    from tests.driver_job import driver_session

    work = Path(args.work)
    stage = batch = change = None
    if args.die_at:
        stage, batch = args.die_at.split(":")
    if args.live_change:
        change = tuple(map(int, args.live_change.split(":")))
    holder: dict = {}

    def fault(self, at, batch_id):
        if at == stage and batch_id == int(batch):
            os._exit(41)
        if change and at == "committed" and batch_id + 1 == change[1]:
            holder["query"].set_parallelism(change[0])

    MicroBatch._fault = fault
    spark = driver_session(work, args.parallelism)
    events = (
        spark.readStream.format("replayable").option("path", str(work / "events"))
        .option("maxRecordsPerBatch", 800).load()
    )
    writer = (
        keyed(events, "key", name="sessions").withWatermark("event_time", DELAY).session_window(GAP, "value")
        .writeStream.format("parquet").option("path", str(work / "out"))
        .option("checkpointLocation", str(work / "chk"))
    )
    if not args.drain:
        query = writer.trigger(availableNow=True).start()
        holder["query"] = query
        query.awaitTermination()
    else:
        query = writer.start()
        holder["query"] = query
        query.processAllAvailable()
        query.request_drain()
        last = spark.read.format("replayable").load(str(work / "events")).selectExpr("max(event_time) AS t").first()["t"]
        (
            spark.createDataFrame([("drain-trigger", 0, last)], "key string, value long, event_time timestamp")
            .write.format("replayable").mode("append").save(str(work / "events"))
        )
        query.awaitTermination(300)
        if query.isActive or query.exception() is not None:
            sys.exit(3)
    spark.stop()


if __name__ == "__main__":
    main()
