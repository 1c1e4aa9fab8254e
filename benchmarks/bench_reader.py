"""Reading state out: the ``spark-state`` data source against Parquet, and the CLI's verify and plan, at scale.

Run: ``./run bench bench_reader [--full]``. Prints one JSON object, writes
``benchmarks/results/reader[_full].json`` and plots ``reader[_full].png``.
Quick: 1M keys; full: 10M keys.

A store is written without Spark the way a keyed count at parallelism 8
writes it (max parallelism 4096, one blob per instance): checkpoint 0 holds
every key (string keys ``k0000000``... and an int64 count) in full entries,
checkpoint 1 changes 1% of the keys in 10% of the key groups (delta
entries), so a read folds chains of two entries there. The same final keys
and counts are written to Parquet (one file per instance, as 8 Spark tasks
would).

Measured, side by side, best of ``repeats``:

- ``spark_state_source`` and ``parquet``: ``spark.read.format(...).load()``
  written to Spark's ``noop`` sink (every row and column materialized in the
  JVM), rows/s, the two alternating. Target: the state reader at >= 0.5x
  Parquet. ``python_source_ceiling``: a Python data source that reads the
  same Parquet files with pyarrow and yields their batches: what any Python
  data source pays to hand rows to the JVM;
- ``read_state`` (``spark_state.ops.reader``, no Spark) and
  ``pyarrow.parquet.read_table``, rows/s;
- ``spark-state verify`` (every byte read and CRC-checked) and
  ``spark-state plan -p 7`` (the pure restore plan at 7 and at 8), wall
  seconds of the console script, Python start-up included. Target: seconds,
  not minutes.

The rows read are checked: count and the sum of the counts equal the model's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

WORK = common.WORK_DIR / "reader"
COMPONENT = "bench_counts"
MAX_PARALLELISM = 4096
PARALLELISM = 8


@dataclass(frozen=True)
class Config:
    mode: str
    keys: int
    repeats: int


QUICK = Config("quick", 1_000_000, 3)
FULL = Config("full", 10_000_000, 3)
SMOKE = Config("smoke", 20_000, 1)


def write_store(keys_n: int, store: Path, parquet: Path, seed: int = 7) -> dict:
    """Write the store (checkpoints 0 and 1) and the Parquet copy of its final state; the model's totals."""
    import pyarrow.parquet as pq

    from spark_state.keyspace import key_group_range, key_groups_for_columns
    from spark_state.model.schema import KeyedSchema
    from spark_state.storage.local import LocalStorage
    from spark_state.store.blobstore import BlobStore
    from spark_state.store.manifest import ComponentSpec, ComponentUpdate, next_manifest
    from spark_state.store.manifestlog import ManifestLog

    rng = np.random.default_rng(seed)
    keys = common.key_space(keys_n)
    counts = rng.integers(1, 1000, keys_n)
    groups = key_groups_for_columns([keys], MAX_PARALLELISM)
    order = np.argsort(groups, kind="stable")
    keys, counts, groups = keys.take(pa.array(order)), counts[order], groups[order]
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("count", pa.int64())])
    blob_schema = schema.blob_schema
    common.fresh_dir(store)
    storage = LocalStorage(store)
    blobs, log = BlobStore(storage), ManifestLog(storage, retained=3)
    spec = ComponentSpec(COMPONENT, MAX_PARALLELISM, PARALLELISM, schema)
    bounds = np.searchsorted(groups, np.arange(MAX_PARALLELISM + 1))

    def rows(lo: int, hi: int, values: np.ndarray, deleted: bool = False) -> pa.Table:
        value = pa.StructArray.from_arrays([pa.array(values, pa.int64())], fields=list(schema.value.fields))
        return pa.Table.from_arrays(
            [keys.slice(lo, hi - lo), value, pa.array(np.full(hi - lo, deleted))], schema=blob_schema
        )

    def commit(checkpoint_id: int, entries_of) -> None:
        refs = []
        for instance in range(PARALLELISM):
            owned = key_group_range(instance, PARALLELISM, MAX_PARALLELISM)
            entries = [e for g in range(owned.start, owned.end + 1) for e in entries_of(g)]
            if entries:
                refs.append(blobs.write_blob(COMPONENT, checkpoint_id, instance, owned, blob_schema, entries))
        manifest = next_manifest(
            log.latest(),
            checkpoint_id,
            {COMPONENT: ComponentUpdate(spec, refs)},
            {"bench": {"offset": checkpoint_id}},
            committed_at=time.time(),
        )
        log.cleanup(log.commit(manifest))

    commit(
        0,
        lambda g: (
            [(g, "full", rows(bounds[g], bounds[g + 1], counts[bounds[g] : bounds[g + 1]]))]
            if bounds[g + 1] > bounds[g]
            else []
        ),
    )
    changed_groups = set(range(0, MAX_PARALLELISM, 10))
    final = counts.copy()

    def delta(g: int):
        lo, hi = bounds[g], bounds[g + 1]
        if g not in changed_groups or hi - lo < 10:
            return []
        width = max(1, (hi - lo) // 10)  # 10% of the keys of 10% of the key groups: 1% of all keys
        final[lo : lo + width] += 1
        return [(g, "delta", rows(lo, lo + width, final[lo : lo + width]))]

    commit(1, delta)
    common.fresh_dir(parquet)
    table = pa.table({"key": keys, "count": pa.array(final, pa.int64())})
    for instance in range(PARALLELISM):
        owned = key_group_range(instance, PARALLELISM, MAX_PARALLELISM)
        lo, hi = bounds[owned.start], bounds[owned.end + 1]
        pq.write_table(table.slice(lo, hi - lo), parquet / f"part-{instance:05d}.parquet")
    store_bytes = sum(p.stat().st_size for p in store.rglob("*.arrow"))
    return {
        "keys": keys_n,
        "count_sum": int(final.sum()),
        "store_bytes": store_bytes,
        "parquet_bytes": sum(p.stat().st_size for p in parquet.rglob("*.parquet")),
    }


class ParquetThroughPython:
    """A Python data source yielding the batches of Parquet files read by pyarrow (the Python source ceiling)."""

    @staticmethod
    def source():
        from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

        class Reader(DataSourceReader):
            def __init__(self, path: str):
                self.path = path

            def partitions(self):
                return [InputPartition(str(p)) for p in sorted(Path(self.path).glob("*.parquet"))]

            def read(self, partition):
                import pyarrow.parquet as pq

                yield from pq.read_table(partition.value).to_batches(max_chunksize=1 << 17)

        class Source(DataSource):
            @classmethod
            def name(cls):
                return "bench_parquet_through_python"

            def schema(self):
                return "key string, count long"

            def reader(self, schema):
                return Reader(self.options["path"])

        return Source


def _best(action, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = action()
        best = min(best, time.perf_counter() - started)
    return best, result


def _cli_seconds(*args: str) -> tuple[float, dict]:
    script = Path(sys.executable).with_name("spark-state")
    started = time.perf_counter()
    done = subprocess.run([str(script), *args, "--json"], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"spark-state {' '.join(args)} failed: {done.stderr}")
    return seconds, json.loads(done.stdout)


def run(spark, config: Config) -> dict:
    import pyarrow.parquet as pq

    from spark_state.ops.reader import read_state

    store, parquet = WORK / "store", WORK / "parquet"
    model = write_store(config.keys, store, parquet)

    def spark_read(fmt: str) -> None:
        reader = spark.read.format(fmt)
        reader = (
            reader.option("store", str(store)).option("component", COMPONENT)
            if fmt == "spark-state"
            else reader.option("path", str(parquet))
        )
        reader.load().write.format("noop").mode("overwrite").save()

    state_df = spark.read.format("spark-state").option("store", str(store)).option("component", COMPONENT).load()
    checked = state_df.selectExpr("count(*) AS n", "sum(count) AS total").collect()[0]
    if (checked["n"], checked["total"]) != (model["keys"], model["count_sum"]):
        raise RuntimeError(f"the state reader read {checked}, the model has {model}")
    spark.dataSource.register(ParquetThroughPython.source())
    seconds = {"spark_state_source": float("inf"), "parquet": float("inf"), "python_source_ceiling": float("inf")}
    for _ in range(config.repeats):  # alternating, so a change of load hits all three alike
        for label, fmt in [
            ("spark_state_source", "spark-state"),
            ("parquet", "parquet"),
            ("python_source_ceiling", "bench_parquet_through_python"),
        ]:
            seconds[label] = min(seconds[label], _best(lambda: spark_read(fmt), 1)[0])
    seconds["read_state"], table = _best(lambda: read_state(str(store), COMPONENT), config.repeats)
    if table.num_rows != model["keys"] or pa.compute.sum(table.column("count")).as_py() != model["count_sum"]:
        raise RuntimeError("read_state returned other rows than the model's")
    seconds["pyarrow_parquet"], _ = _best(lambda: pq.read_table(parquet), config.repeats)
    rows_per_s = {label: int(config.keys / s) for label, s in seconds.items()}
    verify_s, verified = _cli_seconds("verify", str(store))
    plan_s, planned = _cli_seconds("plan", str(store), COMPONENT, "--parallelism", "7")
    if not verified["ok"] or planned["target"]["bytes"] != planned["state_bytes"]:
        raise RuntimeError(f"verify or plan disagree with the store: {verified['problems'][:3]}")
    ratio = rows_per_s["spark_state_source"] / rows_per_s["parquet"]
    result = {
        "config": config.__dict__,
        "store": model,
        "partitions": state_df.rdd.getNumPartitions(),
        "read_seconds": {k: round(v, 3) for k, v in seconds.items()},
        "rows_per_s": rows_per_s,
        "source_vs_parquet": round(ratio, 3),
        "ceiling_vs_parquet": round(rows_per_s["python_source_ceiling"] / rows_per_s["parquet"], 3),
        "source_vs_ceiling": round(rows_per_s["spark_state_source"] / rows_per_s["python_source_ceiling"], 3),
        "read_state_vs_pyarrow_parquet": round(rows_per_s["read_state"] / rows_per_s["pyarrow_parquet"], 3),
        "cli": {
            "verify_seconds": round(verify_s, 2),
            "verify_bytes": verified["checked"]["bytes"],
            "plan_seconds": round(plan_s, 2),
            "plan_requests": planned["target"]["requests"],
        },
        "targets": [
            {"target": "state reader rows/s >= 0.5x Parquet's", "value": round(ratio, 3), "met": ratio >= 0.5},
            {"target": "verify finishes in seconds", "value": round(verify_s, 2), "met": verify_s < 60},
            {"target": "plan finishes in seconds", "value": round(plan_s, 2), "met": plan_s < 60},
        ],
    }
    shutil.rmtree(WORK, ignore_errors=True)
    return result


def plot(result: dict, path: Path) -> None:
    rates = result["rows_per_s"]
    common.bar_plot(
        path,
        f"Reading {result['store']['keys']:,} keys of state",
        [
            (
                "Spark DataFrame (noop sink), rows/s",
                {
                    "spark-state": rates["spark_state_source"],
                    "parquet": rates["parquet"],
                    "parquet via Python source": rates["python_source_ceiling"],
                },
                "rows/s",
                False,
            ),
            (
                "Without Spark, rows/s",
                {"read_state": rates["read_state"], "pyarrow parquet": rates["pyarrow_parquet"]},
                "rows/s",
                False,
            ),
            (
                "CLI on the store, seconds",
                {"verify": result["cli"]["verify_seconds"], "plan -p 7": result["cli"]["plan_seconds"]},
                "seconds",
                False,
            ),
        ],
    )


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__, "10M keys instead of 1M", {"quick": QUICK, "full": FULL, "smoke": SMOKE}, argv
    )
    return common.run_and_save(
        "reader", config.mode, common.command_line("bench_reader", args), lambda spark: run(spark, config), plot
    )


if __name__ == "__main__":
    main()
