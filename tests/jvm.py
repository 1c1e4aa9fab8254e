"""The Java options of every JVM the tests start (the session's, the drivers', a cluster's daemons and executors).

The tests' JVMs live for seconds to minutes on small data, so starting them
dominates: C1 alone (no C2 compile threads) and the serial collector take
about half the CPU to start and leave it to the other test worker. Only the
tests use them: the benchmarks and ``./run main`` run Spark's defaults.

Drivers also map a class-data-sharing archive of the classes a Spark driver
loads (``driver_jvm_options``): a session's start and first query took 14.8 s
without it and 7.4-8.1 s with it, on a machine where the suite starts about
twenty drivers. ``ensure_class_archive`` makes it once per checkout, Java and
pyspark (in ``work-dirs/jvm``, under a lock, before the first Spark test of
the first test worker to get there; the other does not wait): a JVM run with
``-XX:ArchiveClassesAtExit`` writes it as it exits, under a temporary name
renamed only once that JVM has exited, since a truncated archive crashes the
JVM that maps it. A JVM whose class path no longer matches the archive
prints "Unable to use shared archive" and starts without it; making one
failed, the tests run without it. Executors of the cluster have another
class path and do without.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
ARCHIVE_DIR = Path(__file__).resolve().parent.parent / "work-dirs" / "jvm"

_DUMP = """
import sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.driver.extraJavaOptions", sys.argv[1]).getOrCreate())
df = spark.range(100).selectExpr("id % 7 AS k", "id AS v")
df.groupBy("k").count().collect()
df.mapInArrow(lambda batches: batches, df.schema).collect()
process = spark.sparkContext._gateway.proc
spark.stop()
process.stdin.close()  # the gateway JVM exits on end of input, writing the archive as it goes
process.wait(timeout=120)
"""


@functools.cache
def class_archive() -> Path:
    """Where the driver class archive of this checkout, Java and pyspark lives (it may not exist); asked before
    every Spark test, so found once per process."""
    import pyspark

    java = os.path.realpath(shutil.which("java") or "java")
    key = hashlib.sha256(f"{java}|{pyspark.__file__}|{pyspark.__version__}".encode()).hexdigest()[:16]
    return ARCHIVE_DIR / f"driver-{key}.jsa"


def ensure_class_archive() -> None:
    """Make the driver class archive unless it exists (25-40 s, once); on failure the tests do without.

    A process that finds another making it does not wait for it: its JVMs
    start without the archive until it exists (a fresh checkout's second
    test worker lost 40 s waiting for the first's).
    """
    archive = class_archive()
    if archive.exists():
        return
    ARCHIVE_DIR.mkdir(parents=True, exist_ok=True)
    with open(ARCHIVE_DIR / "archive.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        if archive.exists():
            return
        partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        try:
            done = subprocess.run(
                [sys.executable, "-c", _DUMP, f"{JVM_OPTIONS} -XX:ArchiveClassesAtExit={partial}"],
                env=env,
                capture_output=True,
                timeout=300,
            )
            if done.returncode == 0 and partial.exists() and partial.stat().st_size > 0:
                os.replace(partial, archive)
        except subprocess.TimeoutExpired:
            pass
        finally:
            partial.unlink(missing_ok=True)


def driver_jvm_options() -> str:
    """``JVM_OPTIONS`` for a driver: with the class archive when one has been made."""
    archive = class_archive()
    return f"{JVM_OPTIONS} -XX:SharedArchiveFile={archive}" if archive.exists() else JVM_OPTIONS
