"""On a cluster: our keyed count against Spark's ``groupBy().count()`` on a standalone cluster of one-core executors.

Run: ``./run bench bench_cluster [--full]``. Prints one JSON object, writes
``benchmarks/results/cluster.json`` (``cluster_full.json``) and a PNG beside it.

The benchmark starts a Spark standalone master and ``executors`` one-core
workers on loopback from the pip package (``tests.cluster.StandaloneCluster``),
and one application on them (a driver process of its own: this one keeps
no Spark). Each system reads the same Parquet files, one per micro-batch
(``maxFilesPerTrigger=1``, ``Trigger.AvailableNow``): file 0 holds every
key of the state once (it builds the state), files 1..n ``rows`` rows drawn
over those keys, uniformly or Zipf-skewed (``zipf_s``; word frequencies of
real text follow Zipf's law). Systems, in turn, the order reversed for the
second distribution:

- ``keyed_count``: ``keyed(df, "key").count()`` at parallelism ``parallelism``,
  its store on local disk (one machine: ``spark.state.sharedLocalStore``),
  the settings' defaults otherwise (so the memory bound Spark's settings
  give, ``conf.default_resident_memory``);
- ``groupby_count_hdfs`` and ``groupby_count_rocksdb``: ``df.groupBy("key").count()``,
  update mode, ``spark.sql.shuffle.partitions`` = the parallelism, on
  Spark's default HDFS-backed state store and on RocksDB.

Throughput: rows of batches 2..n over the sum of their ``triggerExecution``
(batch 0 builds the state, batch 1 warms up). For ours, per steady
instance task: ``resident`` (its state was in the host on the executor
that ran it, nothing read), ``caught_up`` (resident, newer entries read),
``restored`` (nothing resident: every key group its task needed read from
the store; with a memory bound, only those its rows touched), and whether
it read from the store any key group its rows do not touch (the report's
``key_groups_read_untouched``); and memory:
the resident bytes of the latest copy of each instance (its last report),
and the proportional set size (PSS) of every instance host the query
used, right after its last batch and ``settle_seconds`` later, the query
idle (a copy left on an executor the instance moved away from is dropped
at the host's next idle check, ``hosts.policy.OBSOLETE_CHECK_SECONDS``; the
host stays, a spare holding nothing).

Rescale (uniform keys): each system's first run builds the state (file 0)
and takes one steady batch at parallelism ``parallelism``; then two
restarts of one steady batch each, ours at ``rescales`` (6 -> 9 -> 4: each
restore reads only the key-group ranges an instance now owns), Spark's
``groupBy().count()`` at the same parallelism (it cannot change it).
Measured: each restart's wall time from ``start()`` to its end and its
batch's ``triggerExecution``, ours over Spark's.

Targets (issue 63): steady throughput at least 1.0x ``groupby_count_hdfs`` and
1.5x ``groupby_count_rocksdb``, uniform and skewed; at least 95% of steady
instance tasks resident or reading only the key groups their batch touches
(``key_groups_read_untouched`` = 0: nothing, a catch-up of those, or a lazy
restore under a bound; ``resident`` + ``caught_up`` is reported beside it); settled, the
PSS of every host at most 1.25x that of the hosts holding the latest copies;
each rescaling restart's batch at most 1.2x Spark's restart without rescaling.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common

from spark_state.keyspace import default_max_parallelism

WORK = common.WORK_DIR / "cluster"
COMPONENT = "counts"


@dataclass(frozen=True)
class Config:
    mode: str
    keys: int
    rows: int
    batches: int
    parallelism: int = 6
    executors: int = 3
    executor_memory: str = "1g"
    zipf_s: float = 1.1
    settle_seconds: float = 8.0
    rescales: tuple[int, ...] = (6, 9, 4)


QUICK = Config("quick", 1_000_000, 100_000, 10)
FULL = Config("full", 1_000_000, 100_000, 24)
SMOKE = Config("smoke", 20_000, 2_000, 4, parallelism=3, executors=2, executor_memory="512m", rescales=(3, 4, 2))

SYSTEMS = ("keyed_count", "groupby_count_hdfs", "groupby_count_rocksdb")


def _inputs(config: Config, distribution: str, directory: Path) -> common.InputFiles:
    rng = np.random.default_rng(63)
    keys = np.array([f"k{k:07d}" for k in range(config.keys)], dtype=object)
    tables = [pa.table({"key": pa.array(keys[rng.permutation(config.keys)], pa.string())})]
    for _ in range(config.batches):
        if distribution == "uniform":
            drawn = rng.integers(0, config.keys, config.rows)
        else:
            drawn = np.minimum(rng.zipf(config.zipf_s, config.rows) - 1, config.keys - 1)
            drawn = rng.permutation(config.keys)[drawn]  # the frequent keys spread over the key space
        tables.append(pa.table({"key": pa.array(keys[drawn], pa.string())}))
    return common.write_input(directory, tables, "key string")


# The application, in a driver process of its own -----------------------------------------------------


def _executor_of(pid: int) -> str | None:
    """``<app id>/<executor id>`` of a process of an executor (Spark runs it in the executor's directory)."""
    from tests.cluster import _process_dir

    directory = _process_dir(pid)
    return None if directory is None else f"{Path(directory).parent.name}/{Path(directory).name}"


def _classify(instance: dict) -> str:
    restore = instance["restore"]
    read = restore["key_groups_read"] + restore.get("key_groups_appended", 0)
    if not restore["resident"]:
        return "restored"
    return "caught_up" if read else "resident"


def _within_touched(instance: dict) -> bool:
    """Whether the task read from the store no key group its rows do not touch (lazily, or none at all)."""
    return instance["restore"].get("key_groups_read_untouched", 1) == 0


def _ours(spark, files: dict, config: dict, work: Path) -> dict:
    from spark_state import keyed

    spark.conf.set("spark.state.parallelism", str(config["parallelism"]))
    spark.conf.set("spark.state.store", str(work / "state"))
    spark.conf.set("spark.state.sharedLocalStore", "true")  # every executor of this cluster is on this machine
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(files["directory"])
    query = (
        keyed(stream, "key", name=COMPONENT)
        .count()
        .writeStream.foreachBatch(common.noop_sink)
        .option("checkpointLocation", str(work / "chk"))
        .start()
    )
    try:  # running, idle after its last file, so its hosts stay until the store says their copy is stale
        common.await_batches(query, files["count"])
        pids = {i["pid"] for b in query.batches for i in b["instances"]}
        at_last_batch = _hosts(pids)
        time.sleep(config["settle_seconds"])
        settled = _hosts(pids)
    finally:
        query.stop()
    progress = {p["batch_id"]: p for p in common.batch_progress(query)}
    batches = []
    for batch in query.batches:
        kinds = [_classify(i) for i in batch["instances"]]
        batches.append(
            {
                "batch_id": batch["batch_id"],
                "seconds": progress.get(batch["batch_id"], {}).get("seconds"),
                "rows": progress.get(batch["batch_id"], {}).get("rows"),
                **{kind: kinds.count(kind) for kind in ("resident", "caught_up", "restored")},
                "within_touched": sum(map(_within_touched, batch["instances"])),
                "key_groups_touched": [i["restore"].get("key_groups_touched") for i in batch["instances"]],
                "task_seconds": {
                    kind: [i["seconds"] for i, k in zip(batch["instances"], kinds) if k == kind]
                    for kind in ("resident", "caught_up", "restored")
                },
                "executors": sorted({_executor_of(i["pid"]) or "gone" for i in batch["instances"]}),
                "memory_limit_bytes": batch["instances"][0].get("memory", {}).get("limit_bytes"),
            }
        )
    last = {i["instance"]: i for i in query.batches[-1]["instances"]}
    latest_copies = sum(i.get("memory", {}).get("resident_bytes", 0) for i in last.values())
    return {
        "batches": batches,
        "latest_copies_resident_bytes": latest_copies,
        "latest_copies_by_pid": {str(i["pid"]): i.get("memory", {}).get("resident_bytes", 0) for i in last.values()},
        "hosts_at_last_batch": at_last_batch,
        "hosts_settled": settled,
    }


def _pss(pid: int) -> int | None:
    """The proportional set size of ``pid`` (its private pages, and its share of those it shares with the
    processes it was forked from or forked): RSS counts every shared page in every process."""
    return common.proc_bytes(pid, "smaps_rollup", "Pss")


def _hosts(pids: set[int]) -> dict:
    """The instance hosts among ``pids`` still alive, per executor: each one's PSS."""
    found: dict[str, dict[str, int]] = {}
    for pid in sorted(pids):
        pss, executor = _pss(pid), _executor_of(pid)
        if pss is None or executor is None:
            continue
        found.setdefault(executor, {})[str(pid)] = pss
    return found


def _spark(provider: str):
    def run(spark, files: dict, config: dict, work: Path) -> dict:
        spark.conf.set(common.PROVIDER_CONF, provider)
        spark.conf.set("spark.sql.shuffle.partitions", str(config["parallelism"]))
        try:
            stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(files["directory"])
            writer = stream.groupBy("key").count().writeStream.format("noop").outputMode("update")
            query = common.run_available_now(writer, work / "chk")
        finally:
            spark.conf.unset(common.PROVIDER_CONF)
        return {"batches": common.batch_progress(query)}

    return run


def _rescales(spark, files: dict, config: dict, work: Path) -> dict:
    """The rescale section (module docstring): per system, its first run and its two restarts."""
    from spark_state import keyed

    source = Path(files["directory"])
    parallelisms = config["rescales"]
    runs = {}
    for system in ("keyed_count", "groupby_count_hdfs"):
        base = common.fresh_dir(work / system)
        directory = common.fresh_dir(base / "input")
        phases = []
        for phase, parallelism in enumerate(parallelisms if system == "keyed_count" else [parallelisms[0]] * 3):
            for index in (0, 1) if phase == 0 else (phase + 1,):
                name = f"part-{index:05d}.parquet"
                os.link(source / name, directory / name)
            stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(directory))
            if system == "keyed_count":
                spark.conf.set("spark.state.parallelism", str(parallelism))
                spark.conf.set("spark.state.store", str(base / "state"))
                spark.conf.set("spark.state.sharedLocalStore", "true")
                writer = keyed(stream, "key", name=COMPONENT).count().writeStream.foreachBatch(common.noop_sink)
            else:
                spark.conf.set(common.PROVIDER_CONF, common.HDFS_PROVIDER)
                spark.conf.set("spark.sql.shuffle.partitions", str(parallelism))
                writer = stream.groupBy("key").count().writeStream.format("noop").outputMode("update")
            began = time.perf_counter()
            query = writer.option("checkpointLocation", str(base / "chk")).trigger(availableNow=True).start()
            query.awaitTermination()
            wall = time.perf_counter() - began
            batches = common.batch_progress(query)
            if not batches or (phase and len(batches) != 1):
                raise RuntimeError(f"{system} at {parallelism} ran {batches}, expected one batch a restart")
            phases.append({"parallelism": parallelism, "wall_seconds": round(wall, 3), "batches": batches})
        spark.conf.unset(common.PROVIDER_CONF)
        runs[system] = phases
    return runs


def summarize_rescales(runs: dict) -> dict:
    """Each restart of ours against Spark's restart at the same place: wall time and its batch's."""
    restarts = []
    for ours, spark in zip(runs["keyed_count"][1:], runs["groupby_count_hdfs"][1:], strict=True):
        restarts.append(
            {
                "parallelism": ours["parallelism"],
                "wall_seconds": {"keyed_count": ours["wall_seconds"], "groupby_count_hdfs": spark["wall_seconds"]},
                "batch_seconds": {
                    "keyed_count": ours["batches"][-1]["seconds"],
                    "groupby_count_hdfs": spark["batches"][-1]["seconds"],
                },
                "wall_ratio": round(ours["wall_seconds"] / spark["wall_seconds"], 3),
                "batch_ratio": round(ours["batches"][-1]["seconds"] / spark["batches"][-1]["seconds"], 3),
            }
        )
    return {
        "parallelisms": [phase["parallelism"] for phase in runs["keyed_count"]],
        "restarts": restarts,
        "ratio_rule": "ours / Spark's groupBy().count() (HDFS-backed) restarted at its first parallelism: the "
        "restart's batch triggerExecution (wall_ratio: from start() to its end)",
    }


RUNNERS = {
    "rescale": _rescales,
    "keyed_count": _ours,
    "groupby_count_hdfs": _spark(common.HDFS_PROVIDER),
    "groupby_count_rocksdb": _spark(common.ROCKSDB_PROVIDER),
}


def application(spec: dict) -> dict:
    """Every (distribution, system) of ``spec`` in turn, in one SparkSession on the cluster."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("spark-state-bench-cluster")
    for key, value in spec["conf"].items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    results: dict = {}
    try:
        for distribution, systems in spec["order"]:
            for system in systems:
                work = common.fresh_dir(Path(spec["work"]) / f"{distribution}-{system}")
                started = time.perf_counter()
                run = RUNNERS[system](spark, spec["inputs"][distribution], spec["config"], work)
                run["wall_seconds"] = round(time.perf_counter() - started, 2)
                results.setdefault(distribution, {})[system] = run
                print(f"bench_cluster: {distribution} {system} done in {run['wall_seconds']} s", file=sys.stderr)
    finally:
        spark.stop()
    return results


# The benchmark ---------------------------------------------------------------------------------------


def _steady(batches: list[dict]) -> list[dict]:
    return [b for b in batches if b["batch_id"] >= 2 and b.get("seconds")]


def _rate(batches: list[dict]) -> float:
    steady = _steady(batches)
    return sum(b["rows"] for b in steady) / sum(b["seconds"] for b in steady)


def summarize(raw: dict, config: Config) -> dict:
    summary = {}
    for distribution, systems in raw.items():
        rates = {system: round(_rate(run["batches"]), 1) for system, run in systems.items()}
        ours = systems["keyed_count"]
        steady = _steady(ours["batches"])
        tasks = {kind: sum(b[kind] for b in steady) for kind in ("resident", "caught_up", "restored")}
        total = sum(tasks.values())
        bounded = any(b["memory_limit_bytes"] for b in steady)
        before = [pss for e in ours["hosts_at_last_batch"].values() for pss in e.values()]
        settled = [pss for e in ours["hosts_settled"].values() for pss in e.values()]
        latest = set(ours["latest_copies_by_pid"])
        stale = [
            pss for e in ours["hosts_settled"].values() for pid, pss in e.items() if pid not in latest
        ]  # hosts whose instance ran last elsewhere (or spares): what one copy per instance leaves on top
        summary[distribution] = {
            "rows_per_second": rates,
            "ours_vs_hdfs": round(rates["keyed_count"] / rates["groupby_count_hdfs"], 3),
            "ours_vs_rocksdb": round(rates["keyed_count"] / rates["groupby_count_rocksdb"], 3),
            "steady_tasks": tasks,
            "steady_tasks_resident_or_caught_up": round((tasks["resident"] + tasks["caught_up"]) / total, 3),
            # resident, or reading from the store only key groups its rows touch (a lazy restore under the bound)
            "steady_tasks_resident_or_reading_only_touched": round(sum(b["within_touched"] for b in steady) / total, 3),
            "median_key_groups_touched_per_task": statistics.median(
                n for b in steady for n in b["key_groups_touched"] if n is not None
            ),
            "key_groups_per_instance": round(default_max_parallelism(config.parallelism) / config.parallelism, 1),
            "median_task_seconds": {
                kind: round(statistics.median(times), 3) if times else None
                for kind in ("resident", "caught_up", "restored")
                for times in [[t for b in steady for t in b["task_seconds"][kind]]]
            },
            "memory_bound_bytes_per_host": steady[0]["memory_limit_bytes"] if steady else None,
            "bounded": bounded,
            "latest_copies_resident_bytes": ours["latest_copies_resident_bytes"],
            "hosts": len(before),
            "hosts_pss_bytes_at_last_batch": sum(before),
            "hosts_pss_bytes_settled": sum(settled),
            "stale_hosts": len(stale),
            "stale_hosts_pss_bytes_at_last_batch": sum(
                pss for e in ours["hosts_at_last_batch"].values() for pid, pss in e.items() if pid not in latest
            ),
            "stale_hosts_pss_bytes_settled": sum(stale),
            "hosts_vs_latest_copies_hosts": round(sum(settled) / max(1, sum(settled) - sum(stale)), 3),
            "median_steady_batch_seconds": {
                system: round(statistics.median(b["seconds"] for b in _steady(run["batches"])), 3)
                for system, run in systems.items()
            },
        }
    return summary


def targets(summary: dict) -> list[dict]:
    found = []
    for distribution, s in summary.items():
        found += [
            {
                "target": f"{distribution}: steady throughput >= 1.0x groupBy().count() on HDFS-backed state",
                "value": s["ours_vs_hdfs"],
                "met": s["ours_vs_hdfs"] >= 1.0,
            },
            {
                "target": f"{distribution}: steady throughput >= 1.5x groupBy().count() on RocksDB",
                "value": s["ours_vs_rocksdb"],
                "met": s["ours_vs_rocksdb"] >= 1.5,
            },
            {
                "target": f"{distribution}: >= 95% of steady instance tasks find their state resident, or read at "
                "most the key groups their batch touches",
                "value": s["steady_tasks_resident_or_reading_only_touched"],
                "met": s["steady_tasks_resident_or_reading_only_touched"] >= 0.95,
            },
            {
                "target": f"{distribution}: settled, every host's memory <= 1.25x that of the hosts of the latest "
                "copies (one copy of each instance)",
                "value": s["hosts_vs_latest_copies_hosts"],
                "met": s["hosts_vs_latest_copies_hosts"] <= 1.25,
            },
        ]
    return found


def rescale_targets(rescale: dict) -> list[dict]:
    worst = max(r["batch_ratio"] for r in rescale["restarts"])
    path = " -> ".join(str(p) for p in rescale["parallelisms"])
    return [
        {
            "target": f"a rescale {path}: each restart's batch <= 1.2x Spark's restart without rescaling",
            "value": worst,
            "met": worst <= 1.2,
        }
    ]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    rescale = result.get("rescale")
    fig, axes = plt.subplots(1, 3 if rescale else 2, figsize=(17 if rescale else 12, 4.2))
    distributions = list(summary)
    width = 0.26
    for offset, system in enumerate(SYSTEMS):
        xs = [i + offset * width for i in range(len(distributions))]
        axes[0].bar(xs, [summary[d]["rows_per_second"][system] for d in distributions], width, label=system)
    axes[0].set_xticks([i + width for i in range(len(distributions))])
    axes[0].set_xticklabels(distributions)
    axes[0].set_title("steady rows/s on the cluster", fontsize=10)
    axes[0].legend(fontsize=8)
    kinds = ("resident", "caught_up", "restored")
    bottoms = [0] * len(distributions)
    for kind in kinds:
        values = [summary[d]["steady_tasks"][kind] for d in distributions]
        axes[1].bar(distributions, values, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    axes[1].set_title("our steady instance tasks", fontsize=10)
    axes[1].legend(fontsize=8)
    if rescale:
        labels = [f"at {r['parallelism']}" for r in rescale["restarts"]]
        xs = range(len(labels))
        axes[2].bar([x - 0.2 for x in xs], [r["batch_ratio"] for r in rescale["restarts"]], 0.4, label="batch")
        axes[2].bar([x + 0.2 for x in xs], [r["wall_ratio"] for r in rescale["restarts"]], 0.4, label="wall")
        axes[2].axhline(1.2, color="grey", linestyle="--", linewidth=1, label="target 1.2x")
        axes[2].set_xticks(list(xs))
        axes[2].set_xticklabels(labels)
        steps = " -> ".join(str(p) for p in rescale["parallelisms"])
        axes[2].set_title(f"restarts {steps}: ours / Spark's restart", fontsize=10)
        axes[2].legend(fontsize=8)
    common.save_figure(fig, path, "Cluster", result)


def run(config: Config) -> dict:
    from tests.cluster import StandaloneCluster

    work = common.fresh_dir(WORK)
    inputs = {}
    for distribution in ("uniform", "zipf"):
        files = _inputs(config, distribution, work / f"in-{distribution}")
        inputs[distribution] = {"directory": str(files.directory), "count": len(files.rows)}
    inputs["rescale"] = inputs["uniform"]
    order = [("uniform", list(SYSTEMS)), ("zipf", list(reversed(SYSTEMS))), ("rescale", ["rescale"])]
    cluster = StandaloneCluster(work / "cluster", workers=config.executors, worker_memory="3g")
    cluster.start()
    try:
        conf = {
            **cluster.driver_conf(),
            "spark.executor.memory": config.executor_memory,
            "spark.driver.memory": "2g",
            "spark.sql.streaming.numRecentProgressUpdates": "1000",
            "spark.python.unix.domain.socket.enabled": "true",
            "spark.state.clock": "false",  # as the other benchmarks (common.session)
        }
        spec = {
            "conf": conf,
            "order": order,
            "inputs": inputs,
            "work": str(work / "runs"),
            "config": {
                "parallelism": config.parallelism,
                "settle_seconds": config.settle_seconds,
                "rescales": list(config.rescales),
            },
        }
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        out = work / "raw.json"
        env = cluster.process_env("local-driver")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), os.environ.get("PYTHONPATH")]))
        env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        env.pop("PYSPARK_SUBMIT_ARGS", None)
        subprocess.run(
            [sys.executable, __file__, "--application", str(spec_path), str(out)],
            env=env,
            cwd=work,
            check=True,
            timeout=3600,
        )
        raw = json.loads(out.read_text())
    finally:
        cluster.stop()
    rescales = raw.pop("rescale")["rescale"]
    summary = summarize(raw, config)
    for s in summary.values():
        s["parallelism"] = config.parallelism
    rescale = {**summarize_rescales(rescales), "runs": rescales}
    result = {"config": config.__dict__, "summary": summary, "runs": raw, "rescale": rescale}
    result["targets"] = targets(summary) + rescale_targets(rescale)
    return result


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--application"]:  # the driver process of ``run``
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(application(spec)))
        return {}
    args, config = common.parse_mode(
        __doc__, "24 steady batches instead of 10", {"quick": QUICK, "full": FULL, "smoke": SMOKE}, argv
    )
    started = time.perf_counter()
    result = {
        "benchmark": "bench_cluster",
        "mode": config.mode,
        "command": common.command_line("bench_cluster", args),
        "master": f"standalone, {config.executors} executors of 1 core",
        "environment": common.environment(),
        **run(config),
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    file = "cluster" if config.mode == "quick" else f"cluster_{config.mode}"
    plot(result, common.RESULTS_DIR / f"{file}.png")
    common.save_report(file, result)
    return result


if __name__ == "__main__":
    main()
