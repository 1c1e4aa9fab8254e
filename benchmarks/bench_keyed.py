"""The keyed count against Spark's own stateful operators, on the same input in one run.

Run: ``./run bench bench_keyed [--full]`` (or ``PYTHONPATH=. .venv/bin/python
benchmarks/bench_keyed.py``). Prints one JSON object, writes it to
``benchmarks/results/keyed.json`` and plots ``benchmarks/results/keyed.png``
(``keyed_full.*`` with ``--full``). Quick mode (default) takes 1.5-3 minutes
on the shared 2-core machine; ``--full`` (about 20 minutes) adds parallelism
4, Spark's HDFS-backed provider, two rounds, ten steady batches (one
compaction of every key group) and measures applyInPandasWithState on
100k-row batches.

Input: Parquet files generated once from a seeded RNG, read by a file stream
with ``maxFilesPerTrigger=1`` (file i has mtime BASE + i), so batch i has the
same rows in every run and for every system. Keys are strings ``k0000000``...

1. ``throughput``: rows/s of a running count per key, every system over the
   same files at the same parallelism (``spark.state.parallelism`` for ours,
   ``spark.sql.shuffle.partitions`` for Spark's operators):

   - ``keyed_count``: ``keyed(df, "key", name=...).count()``, output to
     ``foreachBatch`` writing to the ``noop`` format;
   - ``groupby_count_rocksdb``: ``df.groupBy("key").count()``, update mode,
     RocksDB state store, ``noop`` sink (``groupby_count_hdfs`` in --full);
   - ``apply_in_pandas_with_state``: the same count as a pandas function
     (``applyInPandasWithState``, update mode, RocksDB state store).

   Batch 0 is a small warm-up; rows/s = rows of batches 1..n / the sum of
   their ``triggerExecution`` times (Spark's per-batch wall time, which
   includes all of our driver work). applyInPandasWithState costs 1-2 ms per
   key, so it runs only the first measured batch (quick mode: a 10k-row
   "probe" batch; full: 100k rows) and ratios use the batches both systems
   ran. Systems run in rotated order each round.
2. ``state_size``: two keyed counts run side by side, one batch each in
   turn: one prefilled with 10k keys, one with 1M keys (a first batch of
   distinct keys). Both then get the same steady batches (100k rows over the
   same 10k keys). The ratio is the median over steady batches of (batch
   time with 1M keys / the twin batch with 10k keys); each instance's
   ``restore`` report (resident, bytes and key groups read) shows which
   batches read state from the store, and full entries show compaction.
3. ``checkpoint_bytes``: on the 1M-key state, right after the prefill (no
   compaction yet), batches of 100k rows that change 1k, 10k and 100k
   distinct keys. Bytes of a checkpoint = sum of the sizes of the blobs
   committed for it (the blob refs the driver committed, cross-checked
   against the manifests still retained), and the same 10k-key change is
   compared over 10k and over 1M keys of state.

Every ratio is measured side by side in one run; the machine is shared and
noisy, so the load average is recorded and absolute numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from spark_state.blob import ENTRY_KINDS  # noqa: E402

WORK = common.WORK_DIR / "keyed"
SCHEMA_DDL = "key string"
COMPONENT = "bench_counts"
TARGETS = {
    "throughput_vs_groupby_rocksdb": 0.5,  # ours / Spark groupBy().count() on RocksDB, at least
    "throughput_vs_apply_in_pandas_with_state": 1.0,  # ours / applyInPandasWithState, at least
    "state_size_batch_time_ratio": 1.5,  # batch time with 1M keys / with 10k keys, at most
}
SAME_CHANGE_BYTES = 1.1  # bytes of the same change over 1M keys / over 10k keys of state, at most


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
    small_state: int
    large_state: int
    steady_keys: int
    steady_batches: int
    changed_keys: tuple[int, ...]


QUICK = Config(
    mode="quick",
    rows_per_batch=100_000,
    warmup_rows=5_000,
    probe_rows=10_000,
    throughput_keys=100_000,
    throughput_batches=4,
    rounds=1,
    parallelisms=(2,),
    systems=("keyed_count", "groupby_count_rocksdb", "apply_in_pandas_with_state"),
    batch_limits={"apply_in_pandas_with_state": 1},  # ~1-2 ms per key: a 100k-row batch takes 1-2 minutes
    small_state=10_000,
    large_state=1_000_000,
    steady_keys=10_000,
    steady_batches=5,
    changed_keys=(1_000, 10_000, 100_000),
)
FULL = Config(
    mode="full",
    rows_per_batch=100_000,
    warmup_rows=10_000,
    probe_rows=100_000,
    throughput_keys=100_000,
    throughput_batches=8,
    rounds=2,
    parallelisms=(2, 4),
    systems=("keyed_count", "groupby_count_rocksdb", "groupby_count_hdfs", "apply_in_pandas_with_state"),
    batch_limits={"apply_in_pandas_with_state": 2},
    small_state=10_000,
    large_state=1_000_000,
    steady_keys=10_000,
    steady_batches=10,  # covers one compaction of every key group (spark.state.maxChainLength = 8)
    changed_keys=(1_000, 10_000, 100_000),
)


# Input ---------------------------------------------------------------------


def key_space(n: int) -> pa.Array:
    """The strings ``k0000000``, ``k0000001``, ... (``n`` of them), key i at index i."""
    digits = pc.utf8_lpad(pa.array(np.arange(n, dtype=np.int64)).cast(pa.string()), 7, "0")
    return pc.binary_join_element_wise(pa.scalar("k"), digits, "")


def batch_over(keys: pa.Array, indices: np.ndarray) -> pa.Table:
    return pa.table({"key": keys.take(pa.array(indices))})


def uniform_batches(keys: pa.Array, n_keys: int, rows: int, batches: int, rng: np.random.Generator) -> list[pa.Table]:
    """``batches`` tables of ``rows`` keys drawn uniformly from the first ``n_keys``."""
    return [batch_over(keys, rng.integers(0, n_keys, rows)) for _ in range(batches)]


def changing_batch(keys: pa.Array, total_keys: int, changed: int, rows: int, rng: np.random.Generator) -> pa.Table:
    """``rows`` rows over exactly ``changed`` distinct keys (each at least once) of the first ``total_keys``."""
    chosen = rng.choice(total_keys, size=changed, replace=False)
    extra = chosen[rng.integers(0, changed, rows - changed)] if rows > changed else np.empty(0, dtype=np.int64)
    indices = np.concatenate([chosen, extra])
    rng.shuffle(indices)
    return batch_over(keys, indices)


# Systems -------------------------------------------------------------------


def _noop_sink(out, batch_id: int) -> None:
    out.write.format("noop").mode("overwrite").save()


def _count_rows(key, frames, state):
    """applyInPandasWithState: running count of one key; emits (key, count) like groupBy().count()."""
    import pandas as pd

    total = state.get[0] if state.exists else 0
    for frame in frames:
        total += len(frame)
    state.update((total,))
    yield pd.DataFrame({"key": [key[0]], "count": [total]})


def run_keyed(spark, files: common.InputFiles, parallelism: int, work: Path):
    """Our keyed count; the returned query's ``batches`` has each instance's report."""
    from spark_state import keyed

    spark.conf.set("spark.state.parallelism", str(parallelism))
    spark.conf.set("spark.state.store", str(common.fresh_dir(work / "state")))
    writer = keyed(files.stream(spark), "key", name=COMPONENT).count().writeStream.foreachBatch(_noop_sink)
    try:
        return common.run_available_now(writer, work / "chk")
    finally:
        spark.conf.unset("spark.state.parallelism")
        spark.conf.unset("spark.state.store")


def run_keyed_interleaved(
    spark, inputs: dict[str, common.InputFiles], schedules: dict[str, list[int | None]], parallelism: int, work: Path
) -> dict:
    """One keyed-count query per input, run side by side, one batch each in turn (order alternating per step).

    At step s, query ``label`` gets file ``schedules[label][s]`` of its
    input (None: it idles that step) and processes it before the next query
    gets its file. Each query reads its own directory, into which files are
    released only when their step starts, and keeps its state under its own
    ``<checkpointLocation>/state``. Returns the stopped queries by label.
    """
    from spark_state import keyed

    spark.conf.set("spark.state.parallelism", str(parallelism))
    spark.conf.unset("spark.state.store")
    queries, live = {}, {}
    try:
        for label, files in inputs.items():
            live[label] = common.fresh_dir(work / f"{label}-input")
            stream = spark.readStream.schema(files.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(live[label]))
            queries[label] = (
                keyed(stream, "key", name=COMPONENT).count().writeStream.foreachBatch(_noop_sink)
                .option("checkpointLocation", str(work / f"{label}-chk"))
                .trigger(processingTime="100 milliseconds")
                .start()
            )
        for step in range(max(len(schedule) for schedule in schedules.values())):
            labels = list(inputs) if step % 2 == 0 else list(reversed(inputs))
            for label in labels:
                index = schedules[label][step] if step < len(schedules[label]) else None
                if index is not None:
                    common.release_file(inputs[label], index, live[label])
                    queries[label].processAllAvailable()
    finally:
        for query in queries.values():
            query.stop()
        spark.conf.unset("spark.state.parallelism")
    return queries


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


def _apply_in_pandas(df):
    from pyspark.sql.streaming.state import GroupStateTimeout

    return df.groupBy("key").applyInPandasWithState(
        _count_rows, "key string, count long", "count long", "update", GroupStateTimeout.NoTimeout
    )


SYSTEMS: dict[str, tuple[Callable, str | None]] = {
    "keyed_count": (run_keyed, None),
    "groupby_count_rocksdb": (
        _spark_stateful(common.ROCKSDB_PROVIDER, lambda df: df.groupBy("key").count()),
        common.ROCKSDB_PROVIDER,
    ),
    "groupby_count_hdfs": (
        _spark_stateful(common.HDFS_PROVIDER, lambda df: df.groupBy("key").count()),
        common.HDFS_PROVIDER,
    ),
    "apply_in_pandas_with_state": (_spark_stateful(common.ROCKSDB_PROVIDER, _apply_in_pandas), common.ROCKSDB_PROVIDER),
}


# 1. Throughput -------------------------------------------------------------


def _rate(batch_seconds: dict[int, float], batch_ids: list[int], rows: dict[int, int]) -> float:
    return sum(rows[b] for b in batch_ids) / sum(batch_seconds[b] for b in batch_ids)


def throughput(spark, config: Config, keys: pa.Array, rng: np.random.Generator) -> dict:
    """Rows/s of every system over the same files; ratios over the batches both systems ran."""
    warmup = uniform_batches(keys, config.throughput_keys, config.warmup_rows, 1, rng)
    probe = uniform_batches(keys, config.throughput_keys, config.probe_rows, 1, rng)
    rest = uniform_batches(keys, config.throughput_keys, config.rows_per_batch, config.throughput_batches - 1, rng)
    tables = warmup + probe + rest
    files = common.write_input(WORK / "throughput-input", tables, SCHEMA_DDL)
    rows = dict(enumerate(files.rows))
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
        versus = {}
        for system in config.systems[1:]:
            ratios = []
            for ours, theirs in zip(of["keyed_count"], of[system]):
                common_ids = sorted(set(ours["measured_batch_ids"]) & set(theirs["measured_batch_ids"]))
                ratios.append(
                    _rate(ours["batch_seconds"], common_ids, rows) / _rate(theirs["batch_seconds"], common_ids, rows)
                )
            versus[system] = {"ratio": round(statistics.median(ratios), 3), "per_round": [round(r, 3) for r in ratios],
                              "batch_ids": common_ids}
        by_parallelism[str(parallelism)] = {
            "rows_per_s": {s: round(statistics.median(r["rows_per_s"] for r in of[s])) for s in config.systems},
            "keyed_count_vs": versus,
        }
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


# 2 and 3. State size and checkpoint bytes ----------------------------------


def _instance_report(meta: dict) -> dict:
    restore = meta["restore"]
    return {
        "instance": meta["instance"],
        "pid": meta["pid"],
        "task_seconds": meta["seconds"],
        "phase_seconds": meta.get("phase_seconds"),
        "rows_in": meta["rows_in"],
        "keys": meta["keys"],
        "resident": restore["resident"],
        "bytes_read": restore["bytes_read"],
        "key_groups_read": restore["key_groups_read"],
        "key_groups_appended": restore.get("key_groups_appended", 0),
        "restore_seconds": restore["seconds"],
        "blob_bytes": meta["blob"]["size"] if meta.get("blob") else 0,
    }


def _batch_reports(query, progress: list[dict]) -> list[dict]:
    seconds = {b["batch_id"]: b["seconds"] for b in progress}
    reports = []
    for batch in query.batches:
        instances = [_instance_report(m) for m in batch["instances"]]
        indexes = [m["blob"]["index"] for m in batch["instances"] if m.get("blob")]
        kinds = [ENTRY_KINDS[k] for index in indexes for k in index["kind"]]
        reports.append(
            {
                "batch_id": batch["batch_id"],
                "checkpoint_id": batch["checkpoint_id"],
                "seconds": seconds.get(batch["batch_id"]),
                "max_task_seconds": max(i["task_seconds"] for i in instances),
                "reloaded_state": any(i["key_groups_read"] > 0 for i in instances),
                "bytes_read": sum(i["bytes_read"] for i in instances),
                "checkpoint_bytes": sum(i["blob_bytes"] for i in instances),
                "full_entries": kinds.count("full"),
                "delta_entries": kinds.count("delta"),
                "rows_written": sum(sum(index["rows"]) for index in indexes),
                "instances": instances,
            }
        )
    return reports


def _check_against_manifests(store_path: Path, reports: list[dict]) -> dict:
    """Checkpoint bytes from the retained manifests, compared with those derived from the batch reports."""
    from spark_state.checkpoint import open_checkpoint_store

    store = open_checkpoint_store(str(store_path))
    checked = {}
    for checkpoint_id in store.committed_ids():
        component = store.load(checkpoint_id).components[COMPONENT]
        from_manifest = sum(b.size for b in component.blobs.values() if b.checkpoint_id == checkpoint_id)
        reported = next(r["checkpoint_bytes"] for r in reports if r["checkpoint_id"] == checkpoint_id)
        if from_manifest != reported:
            raise RuntimeError(
                f"checkpoint {checkpoint_id}: manifest blobs {from_manifest} B, batch reports {reported} B"
            )
        checked[str(checkpoint_id)] = from_manifest
    return checked


def _steady_summary(reports: list[dict]) -> dict:
    seconds = [r["seconds"] for r in reports]
    return {
        "batch_seconds": common.summary(seconds),
        "max_task_seconds": common.summary([r["max_task_seconds"] for r in reports]),
        "batches_that_reloaded_state": [r["batch_id"] for r in reports if r["reloaded_state"]],
        "batches_with_full_entries": [r["batch_id"] for r in reports if r["full_entries"]],
        "bytes_read": sum(r["bytes_read"] for r in reports),
    }


def state_size(
    spark, config: Config, keys: pa.Array, rng: np.random.Generator, parallelism: int = 2
) -> tuple[dict, dict]:
    """Sections 2 and 3 (see the module docstring): batch time vs state size, checkpoint bytes vs change."""
    steady = uniform_batches(keys, config.steady_keys, config.rows_per_batch, config.steady_batches, rng)
    changes = [changing_batch(keys, config.large_state, n, config.rows_per_batch, rng) for n in config.changed_keys]
    # Large: prefill, the change batches (checkpoint bytes), then the steady batches; small: prefill, idle while
    # the large query runs its change batches, then the same steady batches, each beside its large twin.
    inputs = {
        "small": common.write_input(
            WORK / "state-small-files", [batch_over(keys, rng.permutation(config.small_state)), *steady], SCHEMA_DDL
        ),
        "large": common.write_input(
            WORK / "state-large-files", [batch_over(keys, rng.permutation(config.large_state)), *changes, *steady],
            SCHEMA_DDL,
        ),
    }
    n_changes, n_steady = len(changes), len(steady)
    schedules = {
        "small": [0] + [None] * n_changes + list(range(1, 1 + n_steady)),
        "large": list(range(1 + n_changes + n_steady)),
    }
    steady_ids = {"small": list(range(1, 1 + n_steady)), "large": list(range(1 + n_changes, 1 + n_changes + n_steady))}
    work = WORK / "state"
    queries, wall = common.timed(lambda: run_keyed_interleaved(spark, inputs, schedules, parallelism, work))
    runs = {}
    for label, query in queries.items():
        reports = _batch_reports(query, common.batch_progress(query))
        if [r["batch_id"] for r in reports] != list(range(len(inputs[label].rows))):
            raise RuntimeError(f"state_size {label}: batches {[r['batch_id'] for r in reports]}")
        runs[label] = {
            "state_keys": config.small_state if label == "small" else config.large_state,
            "prefill": {k: v for k, v in reports[0].items() if k != "instances"},
            "steady_batch_ids": steady_ids[label],
            "steady": _steady_summary([reports[i] for i in steady_ids[label]]),
            "batches": reports,
            "manifest_checkpoint_bytes": _check_against_manifests(work / f"{label}-chk" / "state", reports),
        }
        print(f"state_size {label}: {runs[label]['steady']['batch_seconds']}", file=sys.stderr)
    small, large = runs["small"]["steady"], runs["large"]["steady"]
    paired = [
        runs["large"]["batches"][j]["seconds"] / runs["small"]["batches"][i]["seconds"]
        for i, j in zip(steady_ids["small"], steady_ids["large"])
    ]
    state = {
        "parallelism": parallelism,
        "rows_per_batch": config.rows_per_batch,
        "steady_batch_keys": config.steady_keys,
        "steady_batches": config.steady_batches,
        "method": "both queries run side by side, one batch each in turn; ratio = median over steady batches of "
                  "(batch seconds with the large state / with the small state)",
        "batch_time_ratio_large_vs_small": round(statistics.median(paired), 3),
        "mean_paired_ratio": round(statistics.fmean(paired), 3),
        "paired_ratios": [round(r, 3) for r in paired],
        "ratio_of_mean_batch_times": round(large["batch_seconds"]["mean"] / small["batch_seconds"]["mean"], 3),
        "ratio_of_median_batch_times": round(large["batch_seconds"]["median"] / small["batch_seconds"]["median"], 3),
        "task_time_ratio_large_vs_small": round(
            large["max_task_seconds"]["median"] / small["max_task_seconds"]["median"], 3
        ),
        "wall_seconds": round(wall, 2),
        "runs": runs,
    }
    large_reports = runs["large"]["batches"]
    full_bytes = large_reports[0]["checkpoint_bytes"]
    points = []
    for changed, report in zip(config.changed_keys, large_reports[1 : 1 + n_changes]):
        points.append(
            {
                "keys_changed": changed,
                "checkpoint_id": report["checkpoint_id"],
                "bytes": report["checkpoint_bytes"],
                "bytes_per_changed_key": round(report["checkpoint_bytes"] / changed, 1),
                "fraction_of_full_state_bytes": round(report["checkpoint_bytes"] / full_bytes, 5),
                "fraction_of_keys_changed": changed / config.large_state,
                "delta_entries": report["delta_entries"],
                "full_entries": report["full_entries"],
                "rows_written": report["rows_written"],
                "batch_seconds": report["seconds"],
            }
        )
    same_change = {
        label: statistics.median(runs[label]["batches"][i]["checkpoint_bytes"] for i in steady_ids[label])
        for label in ("small", "large")
    }
    checkpoint = {
        "state_keys": config.large_state,
        "full_state_bytes": full_bytes,
        "full_state_bytes_per_key": round(full_bytes / config.large_state, 1),
        "points": points,
        "steady_checkpoints": [
            {"checkpoint_id": r["checkpoint_id"], "keys_changed": config.steady_keys, "bytes": r["checkpoint_bytes"],
             "full_entries": r["full_entries"], "delta_entries": r["delta_entries"]}
            for r in (large_reports[i] for i in steady_ids["large"])
        ],
        "same_change_bytes": {
            "keys_changed": config.steady_keys,
            "median_bytes_with_small_state": same_change["small"],
            "median_bytes_with_large_state": same_change["large"],
            "ratio_large_vs_small_state": round(same_change["large"] / same_change["small"], 3),
        },
        "bytes_model": _bytes_model(large_reports),
        "max_parallelism": 4096,
        "bytes_source": "blob refs committed per batch (query.batches), equal to the retained manifests' blob sizes",
    }
    return state, checkpoint


def _bytes_model(reports: list[dict]) -> dict:
    """Least-squares fit of checkpoint bytes = per_entry * entries + per_row * rows written."""
    entries = np.array([r["full_entries"] + r["delta_entries"] for r in reports], dtype=float)
    rows = np.array([r["rows_written"] for r in reports], dtype=float)
    observed = np.array([r["checkpoint_bytes"] for r in reports], dtype=float)
    (per_entry, per_row), *_ = np.linalg.lstsq(np.column_stack([entries, rows]), observed, rcond=None)
    predicted = per_entry * entries + per_row * rows
    return {
        "bytes_per_entry": round(float(per_entry), 1),
        "bytes_per_row": round(float(per_row), 2),
        "max_relative_error": round(float(np.max(np.abs(predicted - observed) / observed)), 3),
        "note": "one entry per key group touched (at most max_parallelism): sparse changes pay the per-entry cost",
    }


# Report --------------------------------------------------------------------


def targets(result: dict) -> list[dict]:
    out = []
    versus = result["throughput"]["by_parallelism"]
    for parallelism, numbers in versus.items():
        for name, system in (
            ("throughput_vs_groupby_rocksdb", "groupby_count_rocksdb"),
            ("throughput_vs_apply_in_pandas_with_state", "apply_in_pandas_with_state"),
        ):
            measured = numbers["keyed_count_vs"][system]["ratio"]
            out.append({"target": name, "parallelism": int(parallelism), "at_least": TARGETS[name],
                        "measured": measured, "met": measured >= TARGETS[name]})
    ratio = result["state_size"]["batch_time_ratio_large_vs_small"]
    limit = TARGETS["state_size_batch_time_ratio"]
    out.append({"target": "state_size_batch_time_ratio", "at_most": limit, "measured": ratio, "met": ratio <= limit})
    checkpoint = result["checkpoint_bytes"]
    points = checkpoint["points"]
    same = checkpoint["same_change_bytes"]["ratio_large_vs_small_state"]
    out.append(
        {
            "target": "checkpoint_bytes_proportional_to_change",
            "rule": f"the same change writes at most {SAME_CHANGE_BYTES}x the bytes with 100x the state, bytes grow "
                    "with keys changed, and no checkpoint of a partial change writes the full state",
            "same_change_bytes_ratio_large_vs_small_state": same,
            "bytes_per_changed_key": [p["bytes_per_changed_key"] for p in points],
            "met": same <= SAME_CHANGE_BYTES
            and all(b["bytes"] > a["bytes"] for a, b in zip(points, points[1:]))
            and all(p["fraction_of_full_state_bytes"] < 1 for p in points),
        }
    )
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
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
        [s.replace("_", "\n", 2) + (f"\n(batch 1 to {limits[s]} only)" if limits[s] < result["throughput"]
                                     ["measured_batches"] else "") for s in systems],
        fontsize=7,
    )
    for i, (parallelism, numbers) in enumerate(by_p.items()):
        for j, system in enumerate(systems):
            versus = numbers["keyed_count_vs"].get(system)
            if versus:
                ax.annotate(f"ours {versus['ratio']}x", (j + i * width, numbers["rows_per_s"][system]),
                            ha="center", va="top", rotation=90, fontsize=7, xytext=(0, -4),
                            textcoords="offset points", color="white")
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(v for n in by_p.values() for v in n["rows_per_s"].values()) / 20)
    ax.set_ylabel("rows/s (measured batches, log scale)")
    ax.set_title("Running count per key: throughput")
    ax.legend(fontsize=8)

    ax = axes[1]
    for label, run in result["state_size"]["runs"].items():
        steady = [run["batches"][i] for i in run["steady_batch_ids"]]
        xs = list(range(1, len(steady) + 1))
        ax.plot(xs, [b["seconds"] for b in steady], marker="o", label=f"{run['state_keys']:,} keys of state")
        for x, b in zip(xs, steady):
            if b["reloaded_state"]:
                ax.scatter([x], [b["seconds"]], s=140, facecolors="none", edgecolors="red")
            if b["full_entries"] and b["delta_entries"]:
                ax.annotate("compaction", (x, b["seconds"]), fontsize=7, xytext=(3, 5), textcoords="offset points")
    ax.set_xticks(xs)
    ax.set_xlabel("steady batch (100k rows over 10k keys); red ring: state read from the store")
    ax.set_ylabel("batch seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Batch time vs state size (paired median ratio "
                 f"{result['state_size']['batch_time_ratio_large_vs_small']})", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[2]
    points = result["checkpoint_bytes"]["points"]
    xs = [p["keys_changed"] for p in points]
    ax.loglog(xs, [p["bytes"] for p in points], marker="o", label="checkpoint bytes")
    per_key = result["checkpoint_bytes"]["full_state_bytes_per_key"]
    ax.loglog(xs, [x * per_key for x in xs], linestyle="--", label="keys changed x full-state bytes/key")
    ax.axhline(result["checkpoint_bytes"]["full_state_bytes"], color="grey", linestyle=":", label="full state")
    ax.set_xlabel(f"keys changed (of {result['checkpoint_bytes']['state_keys']:,})")
    ax.set_ylabel("bytes written")
    ax.set_title("Bytes per checkpoint vs keys changed")
    ax.legend(fontsize=8)
    fig.suptitle(f"spark-state keyed count, {result['mode']} mode, local[2], load avg "
                 f"{result['environment']['load_average_1m']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="parallelism 2 and 4, HDFS provider, more batches")
    parser.add_argument("--parts", default="throughput,state", help="comma-separated: throughput, state")
    args = parser.parse_args()
    config = FULL if args.full else QUICK
    started = time.perf_counter()
    spark = common.session("bench-keyed")
    common.fresh_dir(WORK)
    rng = np.random.default_rng(20240601)
    keys = key_space(max(config.large_state, config.throughput_keys))
    result: dict = {
        "benchmark": "bench_keyed",
        "mode": config.mode,
        "command": "./run bench bench_keyed" + (" --full" if args.full else ""),
        "master": "local[2]",
        "environment": common.environment(spark),
        "spark_conf": {
            "spark.sql.adaptive.enabled": "false",
            "spark.sql.shuffle.partitions": "= parallelism under test",
            "spark.state.maxParallelism": "4096 (default)",
            "spark.state.maxChainLength": "8 (default)",
        },
    }
    parts = set(args.parts.split(","))
    if "throughput" in parts:
        result["throughput"] = throughput(spark, config, keys, rng)
    if "state" in parts:
        result["state_size"], result["checkpoint_bytes"] = state_size(spark, config, keys, rng)
    if parts >= {"throughput", "state"}:
        result["targets"] = targets(result)
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["seconds"] = round(time.perf_counter() - started, 1)
    spark.stop()
    shutil.rmtree(WORK, ignore_errors=True)
    name = "keyed" if config.mode == "quick" else "keyed_full"
    if "targets" in result:
        plot(result, common.RESULTS_DIR / f"{name}.png")
        common.save_report(name, result)
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
