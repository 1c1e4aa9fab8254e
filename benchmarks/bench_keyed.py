"""The keyed count against Spark's own stateful operators, and its batch time as state grows.

Run: ``./run bench bench_keyed [--full] [--keys long]``. Prints one JSON object, writes it
to ``benchmarks/results/keyed.json`` and plots ``benchmarks/results/keyed.png``
(``keyed_full.*`` with ``--full``). Quick mode (default) takes a few
minutes on the shared 2-core machine; ``--full`` adds parallelism 4, five
rounds of the throughput runs (the order of the systems rotates each round,
so each runs once in every position: on this machine two rounds gave one
system ratios 40% apart), 100k and 10M keys of state and ten steady batches
(a round of compaction of every key group).

Input: Parquet files generated once from a seeded RNG, read by a file stream
with ``maxFilesPerTrigger=1`` (file i has mtime BASE + i), so batch i has the
same rows in every run and for every system. Keys are strings ``k0000000``...,
or with ``--keys long`` the longs 0, 1, ... (``keyed_long.json``): the key
type users most often group by, whose entries our store writes sorted by
value and searches after a restore.

1. ``throughput``: rows/s of a running count per key, every system over the
   same files at the same parallelism (``spark.state.parallelism`` for ours,
   ``spark.sql.shuffle.partitions`` for Spark's operators):

   - ``keyed_count``: ``keyed(df, "key", name=...).count()``, output to
     ``foreachBatch`` writing to the ``noop`` format;
   - ``groupby_count_rocksdb`` and ``groupby_count_hdfs``:
     ``df.groupBy("key").count()``, update mode, ``noop`` sink, on Spark's
     RocksDB state store and on its default HDFS-backed one;
   - ``apply_in_pandas_with_state``: the same count as a pandas function
     (``applyInPandasWithState``, update mode, RocksDB state store);
   - ``transform_with_state_in_pandas``: the same count in Spark's current
     Python state API, a ``StatefulProcessor`` with one ``ValueState``
     (``transformWithStateInPandas``, update mode, RocksDB, which it needs).

   Batch 0 is a small warm-up; rows/s = rows of batches 1..n / the sum of
   their ``triggerExecution`` times (Spark's per-batch wall time, which
   includes all of our driver work). The two pandas APIs call Python per key
   (applyInPandasWithState costs 1-2 ms per key), so they run only the first
   measured batch (a "probe" batch of 10k rows, 20k in full mode) and ratios
   use the batches both systems ran. Systems run in rotated order each round,
   after one unmeasured run of each over all the files at every parallelism
   (the JVM's JIT; the pandas APIs over the warm-up file only).
2. ``state_size``: one keyed count per state size (quick: 10k and 1M keys;
   full: 10k, 100k, 1M, 10M), run side by side, one batch each in turn: each
   is prefilled with its size (a first batch of distinct keys), then all get
   the same steady batches (100k rows over the same 10k keys). The ratio for
   a size is the median over steady batches of (its batch time / the twin
   batch of the smallest state); each instance's ``restore`` report
   (resident, bytes and key groups read) shows which batches read state from
   the store, and full entries show compaction. The same steady batches
   change the same keys; their checkpoint bytes are reported against the
   smallest state's, and include the share of compaction each batch carries
   (``chains``: compaction is spread over batches, so with much state every
   steady batch rewrites some key groups in full). Targets: the largest state's steady
   batch at most 1.2x the 10k one, no steady batch reloading state, and no
   steady batch above 1.5x the median at the largest state (compaction).
   Each batch records the CPU seconds the hypervisor took while it ran
   (``cpu_steal_seconds``), the seconds some task of the machine waited for
   I/O (``io_stall_seconds``) and the JVM's garbage-collection seconds
   (``jvm_gc_seconds``; in local mode they pause the tasks), and
   ``slowest_batch`` sets the slowest steady batch's beside their medians: a
   slow batch that wrote no key group in full, with a slowest task no slower
   than usual, was slowed by something other than its state.
3. ``memory``: resident bytes per key of state, the RSS growth of the
   processes that hold the instances (the instance hosts) over the smallest
   state's, per extra key, and the stored bytes per key; beside it
   (``rocksdb_memory``) Spark's RocksDB store holding the largest state: its
   ``memoryUsedBytes`` and SST bytes per key, from the query's progress.

Checkpoint bytes and time against keys changed, with and without
compaction, are ``bench_checkpoint``'s. Every ratio is measured side by side
in one run; the machine is shared and noisy, so the load average is recorded
and absolute numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

WORK = common.WORK_DIR / "keyed"
TARGETS = {
    "throughput_vs_groupby_hdfs": 1.0,  # ours / Spark groupBy().count() on its default HDFS-backed store, at least
    "throughput_vs_groupby_rocksdb": 1.5,  # ours / Spark groupBy().count() on RocksDB, at least
    "throughput_vs_apply_in_pandas_with_state": 10.0,  # ours / applyInPandasWithState, at least
    "public_path_vs_groupby_hdfs": 1.0,  # ours without the plan accelerator / Spark groupBy().count() HDFS, at least
    "connect_vs_groupby_hdfs": 1.0,  # over Connect: ours / Spark groupBy().count() HDFS-backed, at least
    "connect_vs_transform_with_state": 10.0,  # over Connect: ours / transformWithStateInPandas, at least
    "connect_rescaled_restart_vs_spark_restart": 1.2,  # over Connect, 1M keys: ours rescaled / Spark's, at most
    "state_size_batch_time_ratio": 1.2,  # steady batch time with the largest state / with 10k keys, at most
    "steady_batches_reloading_state": 0,  # steady batches that read state from the store, at most
    "steady_batch_max_over_median": 1.5,  # slowest steady batch / median steady batch, largest state, at most
}
THROUGHPUT_TARGETS = (
    ("throughput_vs_groupby_hdfs", "groupby_count_hdfs"),
    ("throughput_vs_groupby_rocksdb", "groupby_count_rocksdb"),
    ("throughput_vs_apply_in_pandas_with_state", "apply_in_pandas_with_state"),
)


@dataclass(frozen=True)
class Config:
    """Sizes of one mode; ``--full`` scales them up."""

    mode: str
    rows_per_batch: int
    warmup_rows: int  # batch 0 of the throughput input, not measured
    probe_rows: int  # batch 1 of the throughput input: the only one a system limited to 1 batch measures
    throughput_keys: int
    throughput_batches: int  # measured, after one warm-up batch
    rounds: int
    parallelisms: tuple[int, ...]
    systems: tuple[str, ...]
    batch_limits: dict  # system -> measured batches, when it is too slow to run them all
    state_sizes: tuple[int, ...]  # smallest first; the targets compare 1M with 10k
    steady_keys: int
    steady_batches: int
    key_type: str = "string"  # of common.KEY_TYPES
    distribution: str = "uniform"  # of the throughput batches' keys: uniform, or zipf (``--distribution zipf``)
    warm_up: bool = True  # every system over the files before the measured rounds (smoke: no rounds to protect)
    connect: bool = True  # the Connect section (``--no-connect``: without it)

    @property
    def schema_ddl(self) -> str:
        return f"key {self.key_type}"

    def key_space(self, n: int) -> pa.Array:
        """Key i at index i, ``n`` of them."""
        return common.keys_of(self.key_type, n)


BATCH_LIMITS = {  # measured batches of the systems too slow to run them all (per key ~1-2 ms: minutes per batch)
    "apply_in_pandas_with_state": 1,
    "transform_with_state_in_pandas": 1,
}
QUICK = Config(
    mode="quick",
    rows_per_batch=100_000,
    warmup_rows=5_000,
    probe_rows=10_000,
    throughput_keys=100_000,
    throughput_batches=4,
    rounds=1,
    parallelisms=(2,),
    systems=(
        "keyed_count",
        "keyed_count_public",
        "groupby_count_rocksdb",
        "groupby_count_hdfs",
        "apply_in_pandas_with_state",
        "transform_with_state_in_pandas",
    ),
    batch_limits=BATCH_LIMITS,
    state_sizes=(10_000, 1_000_000),
    steady_keys=10_000,
    steady_batches=5,
)
FULL = Config(
    mode="full",
    rows_per_batch=100_000,
    warmup_rows=10_000,
    probe_rows=20_000,
    throughput_keys=100_000,
    throughput_batches=8,
    rounds=5,  # one per position of the five systems in the rotated order
    parallelisms=(2, 4),
    systems=(
        "keyed_count",
        "keyed_count_public",
        "groupby_count_rocksdb",
        "groupby_count_hdfs",
        "apply_in_pandas_with_state",
        "transform_with_state_in_pandas",
    ),
    batch_limits=BATCH_LIMITS,
    state_sizes=(10_000, 100_000, 1_000_000, 10_000_000),
    steady_keys=10_000,
    steady_batches=10,  # covers one compaction of every key group (spark.state.maxChainLength = 8)
)
SMOKE = Config(  # tests/test_benchmarks.py: every code path, in seconds
    mode="smoke",
    rows_per_batch=2_000,
    warmup_rows=200,
    probe_rows=500,
    throughput_keys=1_000,
    throughput_batches=2,
    rounds=1,
    parallelisms=(2,),
    systems=(
        "keyed_count",
        "keyed_count_public",
        "groupby_count_rocksdb",
        "groupby_count_hdfs",
        "apply_in_pandas_with_state",
        "transform_with_state_in_pandas",
    ),
    batch_limits=BATCH_LIMITS,
    state_sizes=(1_000, 10_000),
    steady_keys=1_000,
    steady_batches=2,
    warm_up=False,
)


# Systems -------------------------------------------------------------------


def _count_rows(key, frames, state):
    """applyInPandasWithState: running count of one key; emits (key, count) like groupBy().count()."""
    import pandas as pd

    total = state.get[0] if state.exists else 0
    for frame in frames:
        total += len(frame)
    state.update((total,))
    yield pd.DataFrame({"key": [key[0]], "count": [total]})


def run_keyed(spark, files: common.InputFiles, parallelism: int, work: Path, *, accelerated: bool = True):
    """Our keyed count; the returned query's ``batches`` has each instance's report. Not ``accelerated``: each
    batch's plan is made by PySpark's public calls (``spark.state.planAccelerator=false``), as over Connect."""
    from spark_state import keyed

    spark.conf.set("spark.state.parallelism", str(parallelism))
    spark.conf.set("spark.state.store", str(common.fresh_dir(work / "state")))
    spark.conf.set("spark.state.planAccelerator", str(accelerated).lower())
    stream = keyed(files.stream(spark), "key", name=common.KEYED_COMPONENT).count()
    writer = stream.writeStream.foreachBatch(common.noop_sink)
    try:
        return common.run_available_now(writer, work / "chk")
    finally:
        spark.conf.unset("spark.state.parallelism")
        spark.conf.unset("spark.state.store")
        spark.conf.unset("spark.state.planAccelerator")


def run_keyed_public(spark, files: common.InputFiles, parallelism: int, work: Path):
    return run_keyed(spark, files, parallelism, work, accelerated=False)


def _spark_stateful(provider: str, build: Callable):
    def run(spark, files: common.InputFiles, parallelism: int, work: Path):
        spark.conf.set(common.PROVIDER_CONF, provider)
        spark.conf.set("spark.sql.shuffle.partitions", str(parallelism))
        try:
            writer = build(files.stream(spark)).writeStream.format("noop").outputMode("update")
            return common.run_available_now(writer, work / "chk")
        finally:
            spark.conf.unset(common.PROVIDER_CONF)
            spark.conf.set("spark.sql.shuffle.partitions", "2")

    return run


def _transform_with_state_in_pandas(df):
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Count(StatefulProcessor):
        """A running count of one key in a value state; emits (key, count) like groupBy().count()."""

        def init(self, handle):
            self.count = handle.getValueState("count", "count long")

        def handleInputRows(self, key, rows, timerValues):
            total = self.count.get()[0] if self.count.exists() else 0
            for frame in rows:
                total += len(frame)
            self.count.update((total,))
            yield pd.DataFrame({"key": [key[0]], "count": [total]})

        def close(self):
            pass

    return df.groupBy("key").transformWithStateInPandas(Count(), _output_ddl(df), "Update", "None")


def _output_ddl(df) -> str:
    """The pandas APIs' output: the key as the input has it, and its count."""
    return f"key {df.schema['key'].dataType.simpleString()}, count long"


def _apply_in_pandas(df):
    from pyspark.sql.streaming.state import GroupStateTimeout

    return df.groupBy("key").applyInPandasWithState(
        _count_rows, _output_ddl(df), "count long", "update", GroupStateTimeout.NoTimeout
    )


SYSTEMS: dict[str, tuple[Callable, str | None]] = {
    "keyed_count": (run_keyed, None),
    "keyed_count_public": (run_keyed_public, None),
    "groupby_count_rocksdb": (
        _spark_stateful(common.ROCKSDB_PROVIDER, lambda df: df.groupBy("key").count()),
        common.ROCKSDB_PROVIDER,
    ),
    "groupby_count_hdfs": (
        _spark_stateful(common.HDFS_PROVIDER, lambda df: df.groupBy("key").count()),
        common.HDFS_PROVIDER,
    ),
    "apply_in_pandas_with_state": (_spark_stateful(common.ROCKSDB_PROVIDER, _apply_in_pandas), common.ROCKSDB_PROVIDER),
    "transform_with_state_in_pandas": (
        _spark_stateful(common.ROCKSDB_PROVIDER, _transform_with_state_in_pandas),
        common.ROCKSDB_PROVIDER,
    ),
}


# 1. Throughput -------------------------------------------------------------


def _rate(batch_seconds: dict[int, float], batch_ids: list[int], rows: dict[int, int]) -> float:
    return sum(rows[b] for b in batch_ids) / sum(batch_seconds[b] for b in batch_ids)


def _versus(ours: list[dict], theirs: list[dict], rows: dict[int, int]) -> dict:
    """Our runs' rate over theirs, round by round over the batch ids both measured; the median."""
    ratios = []
    common_ids: list[int] = []
    for mine, other in zip(ours, theirs):
        common_ids = sorted(set(mine["measured_batch_ids"]) & set(other["measured_batch_ids"]))
        ratios.append(_rate(mine["batch_seconds"], common_ids, rows) / _rate(other["batch_seconds"], common_ids, rows))
    return {
        "ratio": round(statistics.median(ratios), 3),
        "per_round": [round(r, 3) for r in ratios],
        "batch_ids": common_ids,
    }


def throughput(spark, config: Config, keys: pa.Array, rng: np.random.Generator) -> dict:
    """Rows/s of every system over the same files; ratios over the batches both systems ran."""
    batches = common.uniform_batches if config.distribution == "uniform" else common.zipf_batches
    warmup = batches(keys, config.throughput_keys, config.warmup_rows, 1, rng)
    probe = batches(keys, config.throughput_keys, config.probe_rows, 1, rng)
    rest = batches(keys, config.throughput_keys, config.rows_per_batch, config.throughput_batches - 1, rng)
    tables = warmup + probe + rest
    files = common.write_input(WORK / "throughput-input", tables, config.schema_ddl)
    rows = dict(enumerate(files.rows))
    # Warm the JVM (and its Python workers) with every system before measuring, so that the system that runs
    # first in round 0 (always the first of ``config.systems``) does not pay for the JIT alone: a run over all
    # the files at every parallelism (after three files at the first parallelism only, round 0 gave the first
    # system its lowest ratio at p=2 in three of four side-by-side runs), or over the warm-up file alone for the
    # systems that run only the probe batch (they cost a millisecond per key).
    for parallelism in config.parallelisms if config.warm_up else ():
        for system in config.systems:
            limit = config.batch_limits.get(system, config.throughput_batches)
            warm = files if limit == config.throughput_batches else common.first_files(files, 1)
            SYSTEMS[system][0](spark, warm, parallelism, WORK / f"warm-{system}-p{parallelism}")
    runs = []
    for round_index in range(config.rounds):
        shift = round_index % len(config.systems)
        order = config.systems[shift:] + config.systems[:shift]
        for parallelism in config.parallelisms:
            for system in order:
                run, _ = SYSTEMS[system]
                limit = config.batch_limits.get(system, config.throughput_batches)
                source = files if limit == config.throughput_batches else common.first_files(files, 1 + limit)
                # A fresh directory per run: Python workers cache manifests by store URI across queries.
                work = WORK / f"run-{system}-p{parallelism}-r{round_index}"
                query, wall = common.timed(lambda: run(spark, source, parallelism, work))
                batches = common.batch_progress(query)
                if [b["rows"] for b in batches] != list(source.rows):
                    raise RuntimeError(f"{system} ran batches {batches}, expected rows {source.rows}")
                seconds = {b["batch_id"]: b["seconds"] for b in batches}
                ids = sorted(seconds)[1:]
                runs.append(
                    {
                        "system": system,
                        "parallelism": parallelism,
                        "round": round_index,
                        "measured_batch_ids": ids,
                        "rows": sum(rows[b] for b in ids),
                        "seconds": round(sum(seconds[b] for b in ids), 3),
                        "rows_per_s": round(_rate(seconds, ids, rows)),
                        "warmup_seconds": seconds[0],
                        "batch_seconds": seconds,
                        "wall_seconds": round(wall, 2),
                        "load_average_1m": round(os.getloadavg()[0], 2),
                    }
                )
                print(f"throughput p={parallelism} {system}: {runs[-1]['rows_per_s']} rows/s", file=sys.stderr)
    by_parallelism = {}
    for parallelism in config.parallelisms:
        of = {s: [r for r in runs if r["system"] == s and r["parallelism"] == parallelism] for s in config.systems}
        numbers = {
            "rows_per_s": {s: round(statistics.median(r["rows_per_s"] for r in of[s])) for s in config.systems},
            "keyed_count_vs": {s: _versus(of["keyed_count"], of[s], rows) for s in config.systems[1:]},
        }
        if "keyed_count_public" in config.systems:  # the public path against Spark's systems
            numbers["keyed_count_public_vs"] = {
                s: _versus(of["keyed_count_public"], of[s], rows) for s in config.systems if not s.startswith("keyed")
            }
        by_parallelism[str(parallelism)] = numbers
    return {
        "rows_per_batch": config.rows_per_batch,
        "warmup_rows": config.warmup_rows,
        "probe_rows": config.probe_rows,
        "input_rows_by_batch": list(files.rows),
        "distinct_keys": config.throughput_keys,
        "measured_batches": config.throughput_batches,
        "measured_batches_by_system": {
            s: config.batch_limits.get(s, config.throughput_batches) for s in config.systems
        },
        "rounds": config.rounds,
        "ratio_rule": "ours / theirs, rows/s over the batch ids both measured (median over rounds)",
        "state_store_provider": {s: SYSTEMS[s][1] for s in config.systems},
        "by_parallelism": by_parallelism,
        "runs": runs,
    }


# 4. Over Spark Connect ------------------------------------------------------

CONNECT_SYSTEMS = ("keyed_count", "groupby_count_hdfs", "transform_with_state_in_pandas")
"""What runs over Connect: ours (its public path: Connect has no plan accelerator) and the two Spark systems the
targets name."""


def connect(config: Config) -> dict:
    """``throughput`` and ``restart`` over Spark Connect: a Connect server from the pip package on loopback
    (``tests/connect.py``, this benchmark's session settings) and a client process running this file with
    ``--connect-client`` (a Connect client turns its whole process to Connect mode)."""
    import subprocess

    from tests.connect import ConnectServer

    settings = {  # as ``common.session``'s
        "spark.driver.memory": "4g",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.numRecentProgressUpdates": "1000",
    }
    root = common.fresh_dir(WORK / "connect-server")
    server = ConnectServer(root, settings=settings, paths=(Path(__file__).resolve().parent,)).start()
    try:
        mode = {"smoke": ["--smoke"], "full": ["--full"]}.get(config.mode, [])
        command = [sys.executable, __file__, "--connect-client", server.url, "--keys", config.key_type, *mode]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=server.env(), check=False)
    finally:
        server.stop()
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the Connect client exited {done.returncode}:\n{done.stdout[-3000:]}\n{server.log_tail()}")
    return json.loads(lines[-1])


def connect_client(url: str, config: Config) -> dict:
    """The client process of ``connect``: the same files as the classic runs (the same seed), over Connect."""
    from pyspark.sql import SparkSession

    global WORK
    WORK = common.WORK_DIR / "keyed-connect"
    common.fresh_dir(WORK)
    spark = SparkSession.builder.remote(url).getOrCreate()
    spark.conf.set("spark.state.clock", "false")
    rng = np.random.default_rng(20240601)
    keys = config.key_space(max(max(config.state_sizes), config.throughput_keys))
    try:
        # At least three rounds in rotated order: one round's ratio moved 0.80-1.1 between runs here.
        rounds = config.rounds if config.mode == "smoke" else max(config.rounds, len(CONNECT_SYSTEMS))
        over = replace(config, systems=CONNECT_SYSTEMS, parallelisms=config.parallelisms[:1], rounds=rounds)
        return {"throughput": throughput(spark, over, keys, rng), "restart": restart(spark, config, keys, rng)}
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


RESTARTS = (  # system, the first run's parallelism, the restart's
    ("keyed_count_rescaled", 2, 4),
    ("keyed_count", 2, 2),
    ("groupby_count_hdfs", 2, 2),
)


def restart(spark, config: Config, keys: pa.Array, rng: np.random.Generator) -> dict:
    """A restart with the largest state of ``state_sizes``: each system's first run takes a batch of that many
    distinct keys at parallelism 2; its restart (ours at 4, and at 2; Spark's at 2: it cannot change it) one
    steady batch (``rows_per_batch`` rows over ``steady_keys`` keys), which first loads the state. Measured:
    the restart's wall time from ``start()`` to its end, and its batch's ``triggerExecution``."""
    from spark_state import keyed

    size = max(config.state_sizes)
    prefill = common.batch_over(keys, np.arange(size))
    steady = common.uniform_batches(keys, config.steady_keys, config.rows_per_batch, 1, rng)[0]
    files = common.write_input(WORK / "restart-input", [prefill, steady], config.schema_ddl)
    runs = {}
    for system, first, then in RESTARTS:
        work = common.fresh_dir(WORK / f"restart-{system}")
        directory = common.fresh_dir(work / "input")
        common.release_file(files, 0, directory)
        stream_files = common.InputFiles(directory, files.schema_ddl, files.rows)
        measured = {}
        for phase, parallelism in (("first", first), ("restart", then)):
            if phase == "restart":
                common.release_file(files, 1, directory)
            if system.startswith("keyed"):
                spark.conf.set("spark.state.parallelism", str(parallelism))
                spark.conf.set("spark.state.store", str(work / "state"))
                writer = keyed(stream_files.stream(spark), "key", name=common.KEYED_COMPONENT).count().writeStream
                writer = writer.foreachBatch(common.noop_sink)
            else:
                spark.conf.set(common.PROVIDER_CONF, common.HDFS_PROVIDER)
                spark.conf.set("spark.sql.shuffle.partitions", str(parallelism))
                grouped = stream_files.stream(spark).groupBy("key").count()
                writer = grouped.writeStream.format("noop").outputMode("update")
            began = time.perf_counter()
            query = writer.option("checkpointLocation", str(work / "chk")).trigger(availableNow=True).start()
            query.awaitTermination()
            wall = time.perf_counter() - began
            batches = common.batch_progress(query)
            measured[phase] = {"parallelism": parallelism, "wall_seconds": round(wall, 3), "batches": batches}
        for key in ("spark.state.parallelism", "spark.state.store", common.PROVIDER_CONF):
            spark.conf.unset(key)
        spark.conf.set("spark.sql.shuffle.partitions", "2")
        restarted = measured["restart"]["batches"]
        if [b["rows"] for b in measured["first"]["batches"] + restarted] != list(files.rows):
            raise RuntimeError(f"{system} ran {measured}, expected rows {files.rows}")
        runs[system] = {**measured, "restart_batch_seconds": restarted[-1]["seconds"]}
        print(f"restart {system}: {runs[system]['restart']['wall_seconds']} s", file=sys.stderr)
    spark_wall = runs["groupby_count_hdfs"]["restart"]["wall_seconds"]
    spark_batch = runs["groupby_count_hdfs"]["restart_batch_seconds"]
    return {
        "state_keys": size,
        "steady_rows": config.rows_per_batch,
        "runs": runs,
        "versus_spark_restart": {
            system: {
                "wall_ratio": round(runs[system]["restart"]["wall_seconds"] / spark_wall, 3),
                "batch_ratio": round(runs[system]["restart_batch_seconds"] / spark_batch, 3),
            }
            for system, _, _ in RESTARTS[:2]
        },
        "ratio_rule": "ours / Spark's groupBy().count() (HDFS-backed), the restart's wall time from start() to its "
        "end (batch_ratio: its batch's triggerExecution)",
    }


# 2. Batch time vs state size -----------------------------------------------


def _steady_summary(reports: list[dict]) -> dict:
    seconds = [r["seconds"] for r in reports]
    slowest = max(reports, key=lambda r: r["seconds"])
    taken = {}
    for counter in common.INTERFERENCE:
        values = [r[counter] for r in reports if r.get(counter) is not None]
        taken[counter] = slowest.get(counter)
        taken[f"median_{counter}"] = round(statistics.median(values), 3) if values else None
    return {
        "batch_seconds": common.summary(seconds),
        "max_over_median": round(max(seconds) / statistics.median(seconds), 3),
        "slowest_batch": {
            "batch_id": slowest["batch_id"],
            "seconds": slowest["seconds"],
            "max_task_seconds": slowest["max_task_seconds"],
            **taken,
        },
        "max_task_seconds": common.summary([r["max_task_seconds"] for r in reports]),
        "batches_that_reloaded_state": [r["batch_id"] for r in reports if r["reloaded_state"]],
        "batches_with_full_entries": [r["batch_id"] for r in reports if r["full_entries"]],
        "bytes_read": sum(r["bytes_read"] for r in reports),
        "median_checkpoint_bytes": statistics.median(r["checkpoint_bytes"] for r in reports),
    }


def _rss_bytes(pid: int) -> int | None:
    """Resident set size of process ``pid`` (None if it exited)."""
    return common.proc_bytes(pid, "status", "VmRSS")


def _resident_bytes(report: dict) -> dict:
    """RSS of the processes holding the instances' state after a batch (the instance hosts, which outlive it)."""
    by_pid = {i["pid"]: _rss_bytes(i["pid"]) for i in report["instances"]}
    return {
        "pids": sorted(by_pid),
        "rss_bytes": sum(v for v in by_pid.values() if v is not None),
        "processes_gone": sum(v is None for v in by_pid.values()),
    }


def _memory_per_key(runs: dict) -> dict:
    """Resident bytes per key of state: RSS growth of the instance hosts over the smallest state's, per extra key.

    The same processes' start-up and libraries are in both, so the
    difference is the state; the stored bytes per key (prefill checkpoint)
    are beside it.
    """
    smallest = runs[min(runs, key=int)]
    out = {}
    for label, run in runs.items():
        extra_keys = run["state_keys"] - smallest["state_keys"]
        growth = run["resident_bytes"]["rss_bytes"] - smallest["resident_bytes"]["rss_bytes"]
        out[label] = {
            "rss_bytes": run["resident_bytes"]["rss_bytes"],
            "resident_bytes_per_key": round(growth / extra_keys, 1) if extra_keys > 0 else None,
            "stored_bytes_per_key": round(run["prefill"]["checkpoint_bytes"] / run["state_keys"], 1),
        }
    return out


def rocksdb_memory(spark, config: Config, keys: pa.Array, rng: np.random.Generator, parallelism: int = 2) -> dict:
    """Spark's RocksDB state store holding the largest state size: its memory and SST bytes per key."""
    n = max(config.state_sizes)
    files = common.write_input(
        WORK / "rocksdb-memory-input", [common.batch_over(keys, rng.permutation(n))], config.schema_ddl
    )
    run, _ = SYSTEMS["groupby_count_rocksdb"]
    query = run(spark, files, parallelism, WORK / "rocksdb-memory")
    operator = [p for p in query.recentProgress if p["numInputRows"] > 0][-1]["stateOperators"][0]
    rows = operator["numRowsTotal"]
    metrics = operator.get("customMetrics", {})
    sst = metrics.get("rocksdbSstFileSize")
    return {
        "state_keys": n,
        "num_rows_total": rows,
        "memory_used_bytes": operator["memoryUsedBytes"],
        "memory_bytes_per_key": round(operator["memoryUsedBytes"] / rows, 1) if rows else None,
        "sst_file_bytes": sst,
        "sst_bytes_per_key": round(sst / rows, 1) if rows and sst is not None else None,
        "custom_metrics": metrics,
        "note": "memoryUsedBytes is RocksDB's own estimate (memtables, block cache and pinned blocks) of the "
        "executor's state store instances; ours is the measured RSS growth of the instance hosts",
    }


def state_size(spark, config: Config, keys: pa.Array, rng: np.random.Generator, parallelism: int = 2) -> dict:
    """Section 2 of the module docstring: batch time of the same steady batches over growing state."""
    steady = common.uniform_batches(keys, config.steady_keys, config.rows_per_batch, config.steady_batches, rng)
    inputs = {
        str(n): common.write_input(
            WORK / f"state-{n}-files", [common.batch_over(keys, rng.permutation(n)), *steady], config.schema_ddl
        )
        for n in config.state_sizes
    }
    schedules = {label: list(range(1 + len(steady))) for label in inputs}
    steady_ids = list(range(1, 1 + len(steady)))
    work = WORK / "state"
    taken: dict[str, dict[int, dict[str, float]]] = {}
    queries, wall = common.timed(
        lambda: common.run_keyed_interleaved(spark, inputs, schedules, parallelism, work, taken=taken)
    )
    runs = {}
    for label, query in queries.items():
        reports = common.batch_reports(query, common.batch_progress(query))
        if [r["batch_id"] for r in reports] != list(range(len(inputs[label].rows))):
            raise RuntimeError(f"state_size {label}: batches {[r['batch_id'] for r in reports]}")
        for report in reports:  # file i is batch i
            report.update({**dict.fromkeys(common.INTERFERENCE), **taken.get(label, {}).get(report["batch_id"], {})})
        runs[label] = {
            "state_keys": int(label),
            "resident_bytes": _resident_bytes(reports[-1]),
            "prefill": {k: v for k, v in reports[0].items() if k != "instances"},
            "steady": _steady_summary([reports[i] for i in steady_ids]),
            "batches": reports,
            "manifest_checkpoint_bytes": common.check_against_manifests(work / f"{label}-chk" / "state", reports),
        }
        print(f"state_size {label}: {runs[label]['steady']['batch_seconds']}", file=sys.stderr)
    smallest = runs[str(config.state_sizes[0])]
    versus_smallest = {}
    for label, run in runs.items():
        paired = [run["batches"][i]["seconds"] / smallest["batches"][i]["seconds"] for i in steady_ids]
        versus_smallest[label] = {
            "batch_time_ratio": round(statistics.median(paired), 3),
            "paired_ratios": [round(r, 3) for r in paired],
            "task_time_ratio": round(
                run["steady"]["max_task_seconds"]["median"] / smallest["steady"]["max_task_seconds"]["median"], 3
            ),
            "checkpoint_bytes_ratio": round(
                run["steady"]["median_checkpoint_bytes"] / smallest["steady"]["median_checkpoint_bytes"], 3
            ),
        }
    return {
        "parallelism": parallelism,
        "memory": _memory_per_key(runs),
        "rows_per_batch": config.rows_per_batch,
        "steady_batch_keys": config.steady_keys,
        "steady_batches": config.steady_batches,
        "steady_batch_ids": steady_ids,
        "method": "one query per state size, run side by side, one batch each in turn; ratio = median over steady "
        "batches of (batch seconds with this state / with the smallest state)",
        "versus_smallest": versus_smallest,
        "wall_seconds": round(wall, 2),
        "runs": runs,
    }


# Report --------------------------------------------------------------------


def _at_least(name: str, measured: float, **where) -> dict:
    return {"target": name, **where, "at_least": TARGETS[name], "measured": measured, "met": measured >= TARGETS[name]}


def targets(result: dict) -> list[dict]:
    out = []
    versus = result["throughput"]["by_parallelism"]
    for parallelism, numbers in versus.items():
        for name, system in THROUGHPUT_TARGETS:
            if system not in numbers["keyed_count_vs"]:
                continue
            measured = numbers["keyed_count_vs"][system]["ratio"]
            out.append(
                {
                    "target": name,
                    "parallelism": int(parallelism),
                    "at_least": TARGETS[name],
                    "measured": measured,
                    "met": measured >= TARGETS[name],
                }
            )
    for parallelism, numbers in versus.items():
        public = numbers.get("keyed_count_public_vs", {}).get("groupby_count_hdfs")
        if public is not None:
            out.append(_at_least("public_path_vs_groupby_hdfs", public["ratio"], parallelism=int(parallelism)))
    over = result.get("connect")
    if over is not None:
        for parallelism, numbers in over["throughput"]["by_parallelism"].items():
            for name, system in (
                ("connect_vs_groupby_hdfs", "groupby_count_hdfs"),
                ("connect_vs_transform_with_state", "transform_with_state_in_pandas"),
            ):
                out.append(_at_least(name, numbers["keyed_count_vs"][system]["ratio"], parallelism=int(parallelism)))
        measured = over["restart"]["versus_spark_restart"]["keyed_count_rescaled"]["wall_ratio"]
        limit = TARGETS["connect_rescaled_restart_vs_spark_restart"]
        out.append(
            {
                "target": "connect_rescaled_restart_vs_spark_restart",
                "compares": f"{over['restart']['state_keys']:,} keys, parallelism 2 -> 4 vs Spark's 2 -> 2",
                "at_most": limit,
                "measured": measured,
                "met": measured <= limit,
            }
        )
    state = result.get("state_size")
    sizes = state["versus_smallest"] if state is not None else {}
    if state is not None and "10000" in state["runs"]:
        largest = max(sizes, key=int)
        compares = f"{int(largest):,} vs {int(min(state['runs'], key=int)):,} keys"
        ratio = sizes[largest]["batch_time_ratio"]
        limit = TARGETS["state_size_batch_time_ratio"]
        out.append(
            {
                "target": "state_size_batch_time_ratio",
                "compares": compares,
                "at_most": limit,
                "measured": ratio,
                "met": ratio <= limit,
            }
        )
        reloads = sum(len(run["steady"]["batches_that_reloaded_state"]) for run in state["runs"].values())
        limit = TARGETS["steady_batches_reloading_state"]
        out.append(
            {
                "target": "steady_batches_reloading_state",
                "compares": "every state size",
                "at_most": limit,
                "measured": reloads,
                "met": reloads <= limit,
            }
        )
        spread = state["runs"][largest]["steady"]["max_over_median"]
        limit = TARGETS["steady_batch_max_over_median"]
        out.append(
            {
                "target": "steady_batch_max_over_median",
                "compares": f"{int(largest):,} keys",
                "at_most": limit,
                "measured": spread,
                "met": spread <= limit,
            }
        )
    return out


def _plot_connect(ax, over: dict) -> None:
    """The Connect column: each system's rows/s over Connect, ours' ratio on theirs, and the restart ratios."""
    numbers = next(iter(over["throughput"]["by_parallelism"].values()))
    systems = list(numbers["rows_per_s"])
    ax.bar(range(len(systems)), [numbers["rows_per_s"][s] for s in systems], color="tab:purple")
    for j, system in enumerate(systems):
        versus = numbers["keyed_count_vs"].get(system)
        label = f"ours {versus['ratio']}x" if versus else f"{numbers['rows_per_s'][system]:,}"
        ax.annotate(
            label,
            (j, numbers["rows_per_s"][system]),
            ha="center",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels([s.replace("_", "\n", 2) for s in systems], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("rows/s over Spark Connect (log scale)")
    restart = over["restart"]
    ratios = "\n".join(f"{s}: {v['wall_ratio']}x" for s, v in restart["versus_spark_restart"].items())
    ax.set_ylim(bottom=min(numbers["rows_per_s"].values()) / 20)
    ax.set_xlabel(f"restart at {restart['state_keys']:,} keys, ours / Spark's:\n{ratios}", fontsize=8)
    ax.set_title("Over Spark Connect: throughput and a restart")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    over = result.get("connect")
    fig, axes = plt.subplots(1, 5 if over else 4, figsize=(26 if over else 21, 4.8))
    if over:
        _plot_connect(axes[4], over)
    ax = axes[0]
    by_p = result["throughput"]["by_parallelism"]
    systems = list(next(iter(by_p.values()))["rows_per_s"])
    width = 0.8 / len(by_p)
    for i, (parallelism, numbers) in enumerate(by_p.items()):
        xs = [j + i * width for j in range(len(systems))]
        ax.bar(xs, [numbers["rows_per_s"][s] for s in systems], width, label=f"parallelism {parallelism}")
    ax.set_xticks([j + width * (len(by_p) - 1) / 2 for j in range(len(systems))])
    limits = result["throughput"]["measured_batches_by_system"]
    ax.set_xticklabels(
        [
            s.replace("_", "\n", 2)
            + (f"\n(batch 1 to {limits[s]} only)" if limits[s] < result["throughput"]["measured_batches"] else "")
            for s in systems
        ],
        fontsize=7,
    )
    for i, numbers in enumerate(by_p.values()):
        for j, system in enumerate(systems):
            versus = numbers["keyed_count_vs"].get(system)
            if versus:
                ax.annotate(
                    f"ours {versus['ratio']}x",
                    (j + i * width, numbers["rows_per_s"][system]),
                    ha="center",
                    va="top",
                    rotation=90,
                    fontsize=7,
                    xytext=(0, -4),
                    textcoords="offset points",
                    color="white",
                )
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(v for n in by_p.values() for v in n["rows_per_s"].values()) / 20)
    ax.set_ylabel("rows/s (measured batches, log scale)")
    ax.set_title("Running count per key: throughput")
    ax.legend(fontsize=8)

    if "state_size" not in result:  # skewed keys: the throughput alone
        for unused in axes[1:4]:
            unused.set_visible(False)
        common.save_figure(fig, path, f"Keyed count, {result['distribution']} keys", result)
        return
    state = result["state_size"]
    ax = axes[1]
    xs = list(range(1, len(state["steady_batch_ids"]) + 1))
    for run in state["runs"].values():
        steady = [run["batches"][i] for i in state["steady_batch_ids"]]
        ax.plot(xs, [b["seconds"] for b in steady], marker="o", label=f"{run['state_keys']:,} keys of state")
        for x, b in zip(xs, steady):
            if b["reloaded_state"]:
                ax.scatter([x], [b["seconds"]], s=140, facecolors="none", edgecolors="red")
            if b["full_entries"] and b["delta_entries"]:
                ax.annotate("compaction", (x, b["seconds"]), fontsize=7, xytext=(3, 5), textcoords="offset points")
    ax.set_xticks(xs)
    ax.set_xlabel(
        f"steady batch ({state['rows_per_batch']:,} rows over {state['steady_batch_keys']:,} keys); "
        "red ring: state read from the store",
        fontsize=8,
    )
    ax.set_ylabel("batch seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("Batch time of the same batches vs state size")
    ax.legend(fontsize=8)

    ax = axes[2]
    sizes = [int(label) for label in state["versus_smallest"]]
    ratios = [state["versus_smallest"][str(n)]["batch_time_ratio"] for n in sizes]
    ax.semilogx(sizes, ratios, marker="o", label="batch time (paired median)")
    ax.semilogx(
        sizes,
        [state["versus_smallest"][str(n)]["checkpoint_bytes_ratio"] for n in sizes],
        marker="s",
        label="checkpoint bytes of the same change",
    )
    for n, r in zip(sizes, ratios):
        ax.annotate(f"{r}x", (n, r), fontsize=8, xytext=(3, 5), textcoords="offset points")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_xlabel("keys of state")
    ax.set_ylabel(f"ratio to {sizes[0]:,} keys of state")
    ax.set_ylim(bottom=0)
    ax.set_title("Cost of the same batch as state grows")
    ax.legend(fontsize=8)

    ax = axes[3]
    memory, rocks = state.get("memory", {}), result.get("rocksdb_memory")
    labels, values = [], []
    for label, numbers in memory.items():
        if numbers["resident_bytes_per_key"] is not None:
            labels.append(f"ours, resident\n{int(label):,} keys")
            values.append(numbers["resident_bytes_per_key"])
    largest = max(memory, key=int) if memory else None
    if largest:
        labels.append(f"ours, stored\n{int(largest):,} keys")
        values.append(memory[largest]["stored_bytes_per_key"])
    if rocks:
        for name, key in (("RocksDB memory", "memory_bytes_per_key"), ("RocksDB SST", "sst_bytes_per_key")):
            if rocks.get(key) is not None:
                labels.append(f"{name}\n{rocks['state_keys']:,} keys")
                values.append(rocks[key])
    ax.bar(range(len(values)), values)
    for x, v in enumerate(values):
        ax.annotate(f"{v:,.0f}", (x, v), ha="center", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("bytes per key of state")
    ax.set_title("Memory and storage per key")
    common.save_figure(fig, path, "spark-state keyed count", result, dpi=110)


def run(spark, config: Config) -> dict:
    """Both sections on ``spark``; the inputs and state live under ``WORK`` and are removed afterwards."""
    common.fresh_dir(WORK)
    rng = np.random.default_rng(20240601)
    keys = config.key_space(max(max(config.state_sizes), config.throughput_keys))
    try:
        result = {"distribution": config.distribution, "throughput": throughput(spark, config, keys, rng)}
        if config.distribution == "uniform":  # skewed keys: the throughput alone
            result["state_size"] = state_size(spark, config, keys, rng)
            result["rocksdb_memory"] = rocksdb_memory(spark, config, keys, rng)
            if config.connect:
                result["connect"] = connect(config)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    result["targets"] = targets(result)
    return result


def _arguments(parser) -> None:
    parser.add_argument(
        "--keys",
        choices=common.KEY_TYPES,
        default=common.KEY_TYPES[0],
        help="the key column's type (long: results in keyed_long*.json)",
    )
    parser.add_argument(
        "--distribution",
        choices=("uniform", "zipf"),
        default="uniform",
        help="the throughput batches' keys: Zipf-skewed as words in text (results in keyed_zipf*.json, "
        "throughput only)",
    )
    parser.add_argument("--no-connect", action="store_true", help="without the section over Spark Connect")
    parser.add_argument("--connect-client", metavar="URL", help=argparse.SUPPRESS)  # ``connect``'s client process


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__,
        "parallelism 2 and 4, HDFS provider, 10M keys, more batches",
        {"quick": QUICK, "full": FULL, "smoke": SMOKE},
        argv,
        _arguments,
    )
    config = replace(config, key_type=args.keys, distribution=args.distribution, connect=not args.no_connect)
    if args.connect_client:
        print(json.dumps(connect_client(args.connect_client, config)), flush=True)
        return {}
    variant = ("" if args.keys == common.KEY_TYPES[0] else f"_{args.keys}") + (
        "" if args.distribution == "uniform" else f"_{args.distribution}"
    )
    conf = {
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.shuffle.partitions": "= parallelism under test",
        "spark.state.maxParallelism": "unset (a new store: 1024 at parallelism 2 and 4)",
        "spark.state.maxChainLength": "8 (default)",
    }
    command = (
        common.command_line("bench_keyed", args)
        + (f" --keys {args.keys}" if args.keys != common.KEY_TYPES[0] else "")
        + (f" --distribution {args.distribution}" if args.distribution != "uniform" else "")
    )
    return common.run_and_save(
        "keyed",
        config.mode,
        command,
        lambda spark: {"spark_conf": conf, "key_type": config.key_type, **run(spark, config)},
        plot,
        variant=variant,
    )


if __name__ == "__main__":
    main()
