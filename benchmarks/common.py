"""Helpers shared by the Spark benchmarks: one session, deterministic input files, streaming timing, reports.

Every benchmark compares systems side by side in one run on the same input,
because the machine is shared and noisy: report ratios, and the load average
next to them, never absolute times alone.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
WORK_DIR = RESULTS_DIR / "tmp"

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
BASE_MTIME = 1_700_000_000


def session(app: str, *, cores: int = 2, driver_memory: str = "4g"):
    """A ``local[cores]`` session with the UI and AQE off; the Python workers run this interpreter.

    ``spark.sql.shuffle.partitions`` starts at 2; set it to the parallelism
    under test before starting each query (a stateful query with 200
    partitions is about 10x slower per batch on this machine).
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def fresh_dir(path: Path) -> Path:
    """``path``, emptied (created if missing)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@dataclass(frozen=True)
class InputFiles:
    """A directory of Parquet files that a file stream reads one per micro-batch, in file order.

    The file source orders files by modification time, so file ``i`` gets
    mtime ``BASE_MTIME + i``: batch ``i`` (after ``maxFilesPerTrigger=1``)
    always reads file ``i``, in every run and for every system.
    """

    directory: Path
    schema_ddl: str
    rows: tuple[int, ...]  # rows of each file, in batch order

    def stream(self, spark):
        return spark.readStream.schema(self.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(self.directory))


def write_input(directory: Path, tables: Sequence[Any], schema_ddl: str) -> InputFiles:
    """Write each ``pyarrow.Table`` of ``tables`` as one Parquet file, in batch order."""
    import pyarrow.parquet as pq

    fresh_dir(directory)
    for index, table in enumerate(tables):
        path = directory / f"part-{index:05d}.parquet"
        pq.write_table(table, path)
        os.utime(path, (BASE_MTIME + index, BASE_MTIME + index))
    return InputFiles(directory, schema_ddl, tuple(t.num_rows for t in tables))


def release_file(files: InputFiles, index: int, directory: Path) -> None:
    """Make file ``index`` of ``files`` appear in ``directory`` (a hard link: same bytes, same mtime)."""
    name = f"part-{index:05d}.parquet"
    os.link(files.directory / name, directory / name)


def first_files(files: InputFiles, n: int) -> InputFiles:
    """The first ``n`` files of ``files`` in a sibling directory."""
    directory = fresh_dir(files.directory.with_name(f"{files.directory.name}-first-{n}"))
    for index in range(n):
        release_file(files, index, directory)
    return InputFiles(directory, files.schema_ddl, files.rows[:n])


def run_available_now(writer, checkpoint: Path):
    """Start ``writer`` with ``trigger(availableNow=True)`` on a fresh checkpoint; wait for it; return the query."""
    shutil.rmtree(checkpoint, ignore_errors=True)
    query = writer.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    try:
        query.awaitTermination()
    finally:
        query.stop()
    return query


def batch_progress(query) -> list[dict]:
    """Per completed micro-batch (by batch id): input rows and Spark's ``triggerExecution`` seconds."""
    seen: dict[int, dict] = {}
    for p in query.recentProgress:
        rows = p["numInputRows"]
        if rows == 0 and p["batchId"] in seen:
            continue
        seen[p["batchId"]] = {
            "batch_id": p["batchId"],
            "rows": rows,
            "seconds": p["durationMs"].get("triggerExecution", 0) / 1000.0,
        }
    return [seen[b] for b in sorted(seen) if seen[b]["rows"] > 0]


def summary(values: Sequence[float]) -> dict:
    """Median, mean, min and max of ``values`` (rounded), for a JSON report."""
    return {
        "median": round(statistics.median(values), 4),
        "mean": round(statistics.fmean(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def timed(action: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = action()
    return result, time.perf_counter() - started


def environment(spark=None) -> dict:
    """Machine and versions, with the load average: numbers from a loaded machine are noisier."""
    import numpy
    import pyarrow

    info = {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if spark is not None:
        info["spark"] = spark.version
    return info


def save_report(name: str, report: dict) -> Path:
    """Write ``results/<name>.json`` and print the report as one JSON object."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return path
