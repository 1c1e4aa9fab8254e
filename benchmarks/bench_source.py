"""Throughput of the ``replayable`` source and writer against Spark's built-ins, at ``local[2]``.

Run: ``./run bench bench_source [--full]``. Prints one JSON object, writes it
to ``benchmarks/results/source.json`` and plots ``source.png``. The quick mode (default) takes well under
two minutes (3M rows, reads best of 2); ``--full`` uses 20M rows and keeps
the best of 3 runs of everything. Single runs at this size vary by +-30%
on a shared 2-core machine: compare ratios across several runs.

The same rows (generator events: ``key`` string, ``value`` long, ``event_time``
timestamp) are cached once, then written once as a replayable log and once
as Parquet (``write``: rows/s of each writer for that cached DataFrame).

``read`` (rows/s into a ``noop`` sink, one ``trigger(availableNow=True)`` run
of a streaming query): ``rows_per_s`` counts from ``start()`` to termination
(it includes starting the query: for a Python source that spawns its driver-side
Python process), ``processing_rows_per_s`` divides by the batches'
``triggerExecution`` time only. Every source is read once untimed first.

- ``log``: ``readStream.format("replayable")`` over the log just written.
- ``parquet``: ``readStream.parquet`` over the Parquet copy (same rows, the
  three payload columns).
- ``parquet_with_position``: Parquet holding exactly what a log read returns
  (payload plus ``split`` and ``offset``): the same five columns cross into
  the JVM.
- ``generator``: ``readStream.format("replayable").option("generator", ...)``,
  bounded to the same row count.
- ``rate``: Spark's ``rate`` source cannot run availableNow; it runs for a
  fixed time at a rate above what it can reach, and its figure is the rows it
  processed divided by the sum of its batches' ``triggerExecution`` time.

``batch_read`` is the same log and Parquet read with ``spark.read`` into
``noop``, plus ``python_ceiling``: a Python data source that yields one
prebuilt batch of the log's five columns over and over (no I/O, no work per
row), the fastest any Python source can feed Spark on this machine. The load
average is recorded: other processes skew the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "source.json"
WORK = ROOT / "benchmarks" / "results" / "tmp" / "source"
SPLITS = 4


def _ceiling_source(rows_per_split: int, schema):
    """A Python data source that repeats one prebuilt batch: the Python-to-JVM transfer and nothing else."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class CeilingReader(DataSourceReader):
        def partitions(self):
            return [InputPartition(split) for split in range(SPLITS)]

        def read(self, partition):
            from pyspark.sql.pandas.types import to_arrow_schema

            from datasources.generator import GeneratorSpec, generate

            chunk = 65536
            arrow_schema = to_arrow_schema(schema, timezone="UTC")
            one = next(generate(GeneratorSpec(keys=100_000, skew=1.0), partition.value, 0, chunk, arrow_schema))
            for start in range(0, rows_per_split, chunk):
                yield one.slice(0, min(chunk, rows_per_split - start))

    class CeilingSource(DataSource):
        @classmethod
        def name(cls):
            return "bench_python_ceiling"

        def schema(self):
            return schema

        def reader(self, schema):
            return CeilingReader()

    return CeilingSource


def _session():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(ROOT))
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-source")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _rate(rows: int, seconds: float) -> dict:
    return {"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds) if seconds else None}


def _best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r.get("processing_rows_per_s") or r["rows_per_s"] or 0)


def _timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _stream_to_noop(reader, checkpoint: Path) -> dict:
    shutil.rmtree(checkpoint, ignore_errors=True)
    start = time.perf_counter()
    query = (
        reader.load()
        .writeStream.format("noop")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - start
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    busy = sum(p["durationMs"].get("triggerExecution", 0) for p in query.recentProgress) / 1000
    return {**_rate(rows, seconds), "processing_rows_per_s": round(rows / busy) if busy else None}


def _rate_source(spark, rows_per_second: int, run_seconds: float, checkpoint: Path) -> dict:
    shutil.rmtree(checkpoint, ignore_errors=True)
    query = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rows_per_second)
        .option("numPartitions", 2)
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    time.sleep(run_seconds)  # the rate source only ends when stopped
    query.stop()
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in progress)
    busy = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    return {
        "rows": rows,
        "seconds": round(busy, 3),
        "rows_per_s": None,
        "processing_rows_per_s": round(rows / busy) if busy else None,
    }


def _measure_writes(data, rows: int, repeats: int) -> dict:
    """Write the cached DataFrame as a log and as Parquet, ``repeats`` times each (to fresh paths)."""
    warm = data.limit(1000)  # warm up: the first write of a kind starts its Python workers
    warm.write.format("replayable").mode("append").save(str(WORK / "warm-log"))
    warm.write.parquet(str(WORK / "warm-parquet"))
    write = {"log": [], "parquet": []}
    for attempt in range(repeats):
        log_path, parquet_path = WORK / f"log-{attempt}", WORK / f"parquet-{attempt}"
        write["log"].append(
            _rate(
                rows,
                _timed(
                    lambda: (
                        data.write.format("replayable")
                        .mode("append")
                        .option("numSplits", str(SPLITS))
                        .save(str(log_path))
                    )
                ),
            )
        )
        write["parquet"].append(_rate(rows, _timed(lambda: data.write.parquet(str(parquet_path)))))
    return write


def _measure_reads(spark, generator: dict, rows: int, repeats: int) -> tuple[dict, dict]:
    """Stream and batch reads into ``noop`` of the log, its Parquet copies and the generator."""
    log_path, parquet_path = WORK / "log-0", WORK / "parquet-0"
    positioned_path = WORK / "parquet-with-position"
    spark.read.format("replayable").load(str(log_path)).write.parquet(str(positioned_path))
    schema = spark.read.parquet(str(parquet_path)).schema
    positioned_schema = spark.read.parquet(str(positioned_path)).schema
    streams = {
        "log": lambda: spark.readStream.format("replayable").option("path", str(log_path)),
        "parquet": lambda: spark.readStream.schema(schema).format("parquet").option("path", str(parquet_path)),
        "parquet_with_position": lambda: (
            spark.readStream.schema(positioned_schema).format("parquet").option("path", str(positioned_path))
        ),
        "generator": lambda: spark.readStream.format("replayable").options(**generator),
    }
    log_schema = spark.read.format("replayable").load(str(log_path)).schema
    spark.dataSource.register(_ceiling_source(rows // SPLITS, log_schema))
    batches = {
        "log": lambda: spark.read.format("replayable").load(str(log_path)),
        "parquet": lambda: spark.read.parquet(str(parquet_path)),
        "parquet_with_position": lambda: spark.read.parquet(str(positioned_path)),
        "python_ceiling": lambda: spark.read.format("bench_python_ceiling").load(),
    }
    for name, reader in streams.items():  # warm up: the first query of a kind pays one-off start costs
        _stream_to_noop(reader(), WORK / f"ck-{name}")
    batches["python_ceiling"]().write.format("noop").mode("overwrite").save()
    read = {name: [] for name in streams}
    batch_read = {name: [] for name in batches}
    for _ in range(repeats):
        for name, reader in streams.items():
            read[name].append(_stream_to_noop(reader(), WORK / f"ck-{name}"))
        for name, frame in batches.items():
            batch_read[name].append(_rate(rows, _timed(lambda: frame().write.format("noop").mode("overwrite").save())))
    for name, runs in read.items():
        assert all(r["rows"] == rows for r in runs), (name, runs)
    return read, batch_read


def _ratio(a: dict, b: dict, key: str) -> float:
    return round(a[key] / b[key], 2)


def main(full: bool) -> dict:
    rows_per_split = 5_000_000 if full else 750_000
    rows = rows_per_split * SPLITS
    write_repeats, read_repeats = (3, 3) if full else (1, 2)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    spark = _session()
    load_at_start = os.getloadavg()[0]

    generator = {
        "generator": "keyed",
        "numSplits": str(SPLITS),
        "rowsPerSplit": str(rows_per_split),
        "keys": "100000",
        "skew": "1.0",
        "seed": "1",
    }
    data = spark.read.format("replayable").options(**generator).load().drop("split", "offset").repartition(2).cache()
    assert data.count() == rows
    write = _measure_writes(data, rows, write_repeats)
    data.unpersist()
    read, batch_read = _measure_reads(spark, generator, rows, read_repeats)

    read = {name: _best(runs) for name, runs in read.items()}
    read["rate"] = _rate_source(spark, 5_000_000, 20 if full else 6, WORK / "ck-rate")
    batch_read = {name: _best(runs) for name, runs in batch_read.items()}
    write = {name: _best(runs) for name, runs in write.items()}
    result = {
        "benchmark": "bench_source",
        "mode": "full" if full else "quick",
        "rows": rows,
        "splits": SPLITS,
        "master": "local[2]",
        "repeats": {"write": write_repeats, "read": read_repeats},
        "load_average_at_start": load_at_start,
        "read_rows_per_s": read,
        "batch_read_rows_per_s": batch_read,
        "write_rows_per_s": write,
        "log_vs_parquet_read": _ratio(read["log"], read["parquet"], "rows_per_s"),
        "log_vs_parquet_read_processing": _ratio(read["log"], read["parquet"], "processing_rows_per_s"),
        "log_vs_parquet_with_position_read_processing": _ratio(
            read["log"], read["parquet_with_position"], "processing_rows_per_s"
        ),
        "log_vs_parquet_batch_read": _ratio(batch_read["log"], batch_read["parquet"], "rows_per_s"),
        "log_vs_parquet_with_position_batch_read": _ratio(
            batch_read["log"], batch_read["parquet_with_position"], "rows_per_s"
        ),
        "log_vs_python_ceiling_batch_read": _ratio(batch_read["log"], batch_read["python_ceiling"], "rows_per_s"),
        "log_vs_parquet_write": _ratio(write["log"], write["parquet"], "rows_per_s"),
        "load_average_at_end": os.getloadavg()[0],
    }
    spark.stop()
    shutil.rmtree(WORK, ignore_errors=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="20M rows, best of 3 runs")
    args = parser.parse_args()
    out = main(args.full)
    out["command"] = "./run bench bench_source" + (" --full" if args.full else "")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    common.bar_plot(
        RESULTS.with_suffix(".png"),
        f"Sources and writers, {out['rows']:,} rows, local[2]",
        [
            (
                "streaming read (batches' processing time)",
                {k: v["processing_rows_per_s"] for k, v in out["read_rows_per_s"].items()},
                "rows/s",
                False,
            ),
            ("batch read", {k: v["rows_per_s"] for k, v in out["batch_read_rows_per_s"].items()}, "rows/s", False),
            ("batch write", {k: v["rows_per_s"] for k, v in out["write_rows_per_s"].items()}, "rows/s", False),
        ],
    )
    print(json.dumps(out, indent=2))
