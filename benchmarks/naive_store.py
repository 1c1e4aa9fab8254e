"""The baseline ``bench_rescale`` compares against: keyed state partitioned by hash(key) mod parallelism.

This is what a store without key groups does. Instance ``i`` of ``p`` owns
the keys with ``pmod(hash(key), p) == i`` and writes them as one blob per
checkpoint. Keys move between almost all instances when ``p`` changes, so on
the first batch after a rescale each new instance must read every old blob
whole and keep the rows that are now its own.

It runs a running count per key with the same driver protocol as
``spark_state.keyed(...).count()``: rows are routed in the JVM
(``repartitionById`` on ``pmod(hash(key), p)``), a ``mapInArrow`` task per
instance updates its state and writes its blob, the driver collects the
tasks' reports, writes the output to the user's ``foreachBatch`` and then
commits a manifest. Between batches of one query the state stays resident in
the Python worker, so only the first batch of a query (a restart) reads the
store. Reads go through ``CountingStorage``: each task reports the bytes and
requests it made.

Only as much as the benchmark needs: a ``key`` column of strings or longs
(``bench_rescale --keys``), full snapshots every checkpoint, no retention,
no replay detection beyond refusing to go backwards.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from spark_state.keyspace import key_groups_for_columns
from spark_state.storage import open_storage
from spark_state.storage.base import CountingStorage

PARALLELISM_CONF = "bench.naive.parallelism"
META = "_meta"


def state_schema(key_type: pa.DataType) -> pa.Schema:
    """The state's (and the output's) columns: the key, of the stream's key type, and its count."""
    return pa.schema([("key", key_type), ("count", pa.int64())])


_RESIDENT: dict[tuple[str, int, int], tuple[int, pa.Table]] = {}  # (root, parallelism, instance) -> (checkpoint, state)
_LOCK = threading.Lock()
_STORAGES: dict[str, object] = {}  # root -> Storage: one client per process, as the keyed operator keeps


def _storage(root: str):
    with _LOCK:
        if root not in _STORAGES:
            _STORAGES[root] = open_storage(root)
        return _STORAGES[root]


@dataclass(frozen=True)
class Manifest:
    checkpoint_id: int
    parallelism: int
    blobs: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        return cls(d["checkpoint_id"], d["parallelism"], tuple(d["blobs"]))


def latest_manifest(root: str) -> Manifest | None:
    storage = open_storage(root)
    if not storage.exists("manifests"):
        return None
    ids = sorted(int(name.split(".")[0]) for name in storage.list("manifests"))
    return Manifest.from_json(storage.read(f"manifests/{ids[-1]}.json").decode()) if ids else None


def _owned_rows(table: pa.Table, parallelism: int, instance: int) -> pa.Table:
    """Rows of ``table`` whose ``pmod(hash(key), parallelism)`` is ``instance``: the routing's hash, in Python."""
    return table.filter(pa.array(key_groups_for_columns([table.column("key")], parallelism) == instance))


def _read_state(
    storage: CountingStorage, base: Manifest | None, parallelism: int, instance: int, schema: pa.Schema
) -> pa.Table:
    if base is None:
        return schema.empty_table()
    if base.parallelism == parallelism:  # same partitioning: the instance's own blob is its whole state
        return pa.ipc.open_file(pa.py_buffer(storage.read(base.blobs[instance]))).read_all()
    parts = [
        _owned_rows(pa.ipc.open_file(pa.py_buffer(storage.read(path))).read_all(), parallelism, instance)
        for path in base.blobs  # hash mod p: this instance's keys may be in every old blob
    ]
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _update(state: pa.Table, rows: pa.Table, schema: pa.Schema) -> tuple[pa.Table, pa.Table]:
    """(new state, updated rows): counts of ``rows`` per key added to ``state``."""
    if rows.num_rows == 0:
        return state, schema.empty_table()
    added = rows.group_by("key").aggregate([("key", "count")]).rename_columns(["key", "added"])
    joined = added.join(state, "key", join_type="left outer")
    previous = joined.column("count").fill_null(0)
    updated = pa.table({"key": joined.column("key"), "count": pc.add(previous, joined.column("added"))}, schema=schema)
    untouched = state.join(added.select(["key"]), "key", join_type="left anti")
    return pa.concat_tables([untouched.select(schema.names).cast(schema), updated]), updated


def run_instance(
    root: str,
    base: Manifest | None,
    checkpoint_id: int,
    parallelism: int,
    instance: int,
    batches,
    key_type: pa.DataType = pa.string(),
) -> Iterator[pa.RecordBatch]:
    schema = state_schema(key_type)
    started = time.perf_counter()
    storage = CountingStorage(_storage(root))
    wire_before = storage.counters()
    cache_key = (root, parallelism, instance)
    with _LOCK:
        resident = _RESIDENT.pop(cache_key, None)
    base_id = base.checkpoint_id if base is not None else None
    if resident is not None and resident[0] == base_id:
        state = resident[1]
    else:
        state = _read_state(storage, base, parallelism, instance, schema)
    restore_seconds = time.perf_counter() - started
    wire_after = storage.counters()
    rows = pa.Table.from_batches(list(batches))
    state, updated = _update(state, rows.select(["key"]) if rows.num_rows else schema.empty_table(), schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(state)
    path = f"blobs/{checkpoint_id}-{instance}.arrow"
    data = sink.getvalue().to_pybytes()
    storage.create(path, data)
    with _LOCK:
        _RESIDENT[cache_key] = (checkpoint_id, state)
    meta = {
        "instance": instance,
        "blob": path,
        "size": len(data),
        "keys": state.num_rows,
        "restore": {
            "resident": resident is not None and resident[0] == base_id,
            "bytes_read": storage.bytes_read,
            "requests": storage.requests,
            "seconds": round(restore_seconds, 4),
            **(
                {"storage": {k: wire_after[k] - wire_before.get(k, 0) for k in wire_after}}
                if wire_before is not None
                else {}
            ),
        },
        "pid": os.getpid(),
        "seconds": round(time.perf_counter() - started, 4),
    }
    out = schema.append(pa.field(META, pa.string()))
    for batch in updated.combine_chunks().to_batches():
        yield pa.RecordBatch.from_arrays(list(batch.columns) + [pa.nulls(batch.num_rows, pa.string())], schema=out)
    yield pa.RecordBatch.from_arrays(
        [pa.nulls(1, pa.string()), pa.nulls(1, pa.int64()), pa.array([json.dumps(meta)])], schema=out
    )


def _ship_to_workers(spark) -> None:
    """Make this module importable in the Python workers (its tasks keep state in its globals)."""
    if getattr(spark.sparkContext, "_naive_store_shipped", False):
        return
    spark.sparkContext.addPyFile(__file__)
    spark.sparkContext._naive_store_shipped = True


class NaiveCount:
    """``foreachBatch`` function: a running count of ``df.key`` kept under ``root``; see the module docstring."""

    def __init__(self, spark, root: str, sink: Callable):
        _ship_to_workers(spark)
        self.spark = spark
        self.root = root
        self.sink = sink
        self.history: list[dict] = []

    def __call__(self, batch_df, batch_id: int) -> None:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        parallelism = int(self.spark.conf.get(PARALLELISM_CONF))
        base = latest_manifest(self.root)
        checkpoint_id = 0 if base is None else base.checkpoint_id + 1
        root = self.root
        from pyspark.sql.pandas.types import to_arrow_type

        key_spark_type = batch_df.schema["key"].dataType
        key_ddl, key_type = key_spark_type.simpleString(), to_arrow_type(key_spark_type)

        def process(batches):
            from pyspark import TaskContext

            yield from run_instance(
                root, base, checkpoint_id, parallelism, TaskContext.get().partitionId(), batches, key_type
            )

        from spark_state.spark.routing import key_group_column

        # key groups with max parallelism = parallelism: exactly pmod(hash(key), parallelism)
        routed = batch_df.select("key").withColumn("_instance", key_group_column(batch_df, ["key"], parallelism))
        result = (
            routed.repartitionById(parallelism, F.col("_instance"))
            .drop("_instance")
            .mapInArrow(process, f"key {key_ddl}, count long, _meta string")
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        try:
            metas = [json.loads(r[0]) for r in result.where(F.col(META).isNotNull()).select(META).collect()]
            if sorted(m["instance"] for m in metas) != list(range(parallelism)):
                raise RuntimeError(f"expected reports from {parallelism} instances, got {metas}")
            self.sink(result.where(F.col(META).isNull()).drop(META), batch_id)
            metas.sort(key=lambda m: m["instance"])
            manifest = Manifest(checkpoint_id, parallelism, tuple(m["blob"] for m in metas))
            open_storage(root).create(f"manifests/{checkpoint_id}.json", manifest.to_json().encode())
        finally:
            result.unpersist()
        self.history.append(
            {"batch_id": batch_id, "checkpoint_id": checkpoint_id, "parallelism": parallelism, "instances": metas}
        )
