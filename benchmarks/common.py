"""Helpers shared by the Spark benchmarks: one session, deterministic input files, streaming timing, reports.

Every benchmark compares systems side by side in one run on the same input,
because the machine is shared and noisy: report ratios, and the load average
next to them, never absolute times alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
WORK_DIR = RESULTS_DIR / "tmp"

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
BASE_MTIME = 1_700_000_000


def session(app: str, *, cores: int = 2, driver_memory: str = "4g"):
    """A ``local[cores]`` session with the UI and AQE off; the Python workers run this interpreter and talk
    to the JVM over Unix sockets (``spark.python.unix.domain.socket.enabled``, as the README's settings advise: every
    system with Python tasks, ours and Spark's Python APIs alike, gains; the JVM's own state stores have none).

    ``spark.sql.shuffle.partitions`` starts at 2; set it to the parallelism
    under test before starting each query (a stateful query with 200
    partitions is about 10x slower per batch on this machine).

    ``spark.state.clock`` is off: the harnesses release each batch's file
    after the query started and count batches as files, and a query with
    the clock runs a first batch at once, without rows (Spark runs one for
    any new Python source). ``bench_time``'s idle section measures the clock,
    and what it costs a busy query.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pyspark.sql import SparkSession

    from spark_state.spark.streaming import UNIX_SOCKETS

    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config(UNIX_SOCKETS, "true")  # Python tasks without TCP's delayed ACKs
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
        .config("spark.state.clock", "false")
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


def await_batches(query, count: int) -> None:
    """Wait until ``query`` (a ``StatefulQuery``) completed ``count`` micro-batches, the last one for the file
    just released (``processAllAvailable`` can return before a file released while the query polls is taken)."""
    if not query.await_batches(count):
        raise RuntimeError(f"the query stopped after {len(query.batches)} of {count} micro-batches")


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
        if rows is None:  # over Spark Connect: the sources' sum
            rows = sum(source["numInputRows"] for source in p["sources"])
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


def cpu_steal_seconds() -> float | None:
    """CPU seconds the hypervisor has run other machines on this one's CPUs since boot (``steal`` in
    ``/proc/stat``, summed over CPUs); None where there is no such file.

    The difference over a batch says how much of the machine was taken away
    while it ran: a batch slower than its peers with a large difference was
    slowed by the host, not by the code under test.
    """
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def jvm_gc_seconds(spark) -> float:
    """Seconds the driver JVM's garbage collectors have spent since it started (their MXBeans' collection
    time); in local mode the executors' tasks run in that JVM, so its pauses stall them too."""
    beans = spark._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    return sum(bean.getCollectionTime() for bean in beans) / 1000.0


def io_stall_seconds() -> float | None:
    """Seconds in which at least one task of this machine waited for I/O since boot (the kernel's pressure
    stall information, ``some`` in ``/proc/pressure/io``); None where the kernel does not count it."""
    try:
        some = Path("/proc/pressure/io").read_text().split("\n", 1)[0]
    except OSError:
        return None
    total = dict(field.split("=", 1) for field in some.split()[1:]).get("total")
    return int(total) / 1e6 if total is not None else None


INTERFERENCE = ("cpu_steal_seconds", "io_stall_seconds", "jvm_gc_seconds")
"""The counters ``interference`` reads, by name."""


def interference(spark) -> dict[str, float]:
    """What was taken from the code under test so far: ``jvm_gc_seconds``, and where the machine counts
    them ``cpu_steal_seconds`` and ``io_stall_seconds``. The difference over a batch, beside its time, says
    whether the machine or the JVM rather than the code under test made it slow."""
    taken = {
        "jvm_gc_seconds": jvm_gc_seconds(spark),
        "cpu_steal_seconds": cpu_steal_seconds(),
        "io_stall_seconds": io_stall_seconds(),
    }
    return {name: value for name, value in taken.items() if value is not None}


def process_stats() -> dict[int, list[str]]:
    """Every running process: pid -> the fields of ``/proc/<pid>/stat`` after ``pid (comm)`` (field 1 of these is
    the parent pid, 11 and 12 the user and system ticks, 7 and 9 the page faults)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                found[int(entry)] = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
    return found


def with_descendants(pid: int, stats: dict[int, list[str]]) -> set[int]:
    """``pid`` and its children, grandchildren, ... among ``stats`` (``process_stats``)."""
    children: dict[int, list[int]] = {}
    for child, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    found, queue = {pid}, [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.add(child)
            queue.append(child)
    return found


def proc_bytes(pid: int, file: str, key: str) -> int | None:
    """The ``key:`` line of ``/proc/<pid>/<file>`` (``status`` VmRSS, ``smaps_rollup`` Pss), in bytes; None if the
    process is gone."""
    try:
        with open(f"/proc/{pid}/{file}") as lines:
            for line in lines:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
        from spark_state.spark.streaming import python_on_unix_sockets

        info["python_workers_on_unix_sockets"] = python_on_unix_sockets(spark)
    return info


def save_report(name: str, report: dict) -> Path:
    """Write ``results/<name>.json`` and print the report as one JSON object."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return path


# Keyed-count runs (bench_keyed, bench_checkpoint, bench_rescale) -----------

KEYED_COMPONENT = "bench_counts"


KEY_TYPES = ("string", "long")
"""The key column types the keyed benchmarks run with (``--keys``): strings by default, or longs."""


def keys_of(key_type: str, n: int):
    """Key i at index i, ``n`` of them, of ``key_type`` (``KEY_TYPES``): ``key_space`` or ``0..n-1``."""
    import numpy as np
    import pyarrow as pa

    if key_type not in KEY_TYPES:
        raise ValueError(f"key type {key_type!r} is not one of {KEY_TYPES}")
    return key_space(n) if key_type == "string" else pa.array(np.arange(n, dtype=np.int64))


def key_indexes(keys):
    """The index ``i`` of each key of ``keys_of`` (an Arrow column of its strings or longs) as a NumPy array."""
    import numpy as np
    import pyarrow as pa

    if pa.types.is_integer(keys.type):
        return keys.to_numpy()
    return np.array([int(k[1:]) for k in keys.to_pylist()], dtype=np.int64)


def key_space(n: int):
    """The strings ``k0000000``, ``k0000001``, ... (``n`` of them, 8 bytes each up to 10M), key i at index i."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    digits = pc.utf8_lpad(pa.array(np.arange(n, dtype=np.int64)).cast(pa.string()), 7, "0")
    return pc.binary_join_element_wise(pa.scalar("k"), digits, "")


def batch_over(keys, indices):
    """A table with one ``key`` column: ``keys`` at ``indices``."""
    import pyarrow as pa

    return pa.table({"key": keys.take(pa.array(indices))})


def uniform_batches(keys, n_keys: int, rows: int, batches: int, rng) -> list:
    """``batches`` tables of ``rows`` keys drawn uniformly from the first ``n_keys``."""
    return [batch_over(keys, rng.integers(0, n_keys, rows)) for _ in range(batches)]


ZIPF_S = 1.1
"""The exponent of ``zipf_batches``: word frequencies of real text follow Zipf's law with s near 1."""


def zipf_batches(keys, n_keys: int, rows: int, batches: int, rng) -> list:
    """``batches`` tables of ``rows`` keys of the first ``n_keys``, Zipf-skewed (``ZIPF_S``), the frequent ones
    spread over the key space by a fixed permutation (as words' hashes spread them)."""
    import numpy as np

    spread = np.random.default_rng(1).permutation(n_keys)
    return [batch_over(keys, spread[np.minimum(rng.zipf(ZIPF_S, rows) - 1, n_keys - 1)]) for _ in range(batches)]


def changing_batch(keys, total_keys: int, changed: int, rows: int, rng):
    """``rows`` rows over exactly ``changed`` distinct keys (each at least once) of the first ``total_keys``."""
    import numpy as np

    chosen = rng.choice(total_keys, size=changed, replace=False)
    extra = chosen[rng.integers(0, changed, rows - changed)] if rows > changed else np.empty(0, dtype=np.int64)
    indices = np.concatenate([chosen, extra])
    rng.shuffle(indices)
    return batch_over(keys, indices)


def noop_sink(out, batch_id: int) -> None:
    out.write.format("noop").mode("overwrite").save()


def run_keyed_interleaved(
    spark,
    inputs: dict[str, InputFiles],
    schedules: dict[str, list[int | None]],
    parallelism: int,
    work: Path,
    confs: dict[str, dict[str, str]] | None = None,
    taken: dict[str, dict[int, dict[str, float]]] | None = None,
) -> dict:
    """One keyed-count query per input, run side by side, one batch each in turn (order alternating per step).

    At step s, query ``label`` gets file ``schedules[label][s]`` of its
    input (None: it idles that step) and processes it before the next query
    gets its file. Each query reads its own directory, into which files are
    released only when their step starts, and keeps its state under its own
    ``<checkpointLocation>/state`` unless ``confs`` say otherwise: ``confs[label]``
    is set in ``spark.conf`` while that query starts and while it runs its
    batch (the driver reads ``spark.state.*`` at every batch, the store at
    the start). Returns the
    stopped queries by label. ``taken``, when given, is filled with what the
    machine and the JVM took while each batch ran (``interference``'s
    differences), by label and file index.
    """
    from spark_state import keyed

    confs = confs or {}
    spark.conf.set("spark.state.parallelism", str(parallelism))
    spark.conf.unset("spark.state.store")
    queries, live, released = {}, {}, dict.fromkeys(inputs, 0)
    try:
        for label, files in inputs.items():
            live[label] = fresh_dir(work / f"{label}-input")
            stream = spark.readStream.schema(files.schema_ddl).option("maxFilesPerTrigger", 1).parquet(str(live[label]))
            for key, value in confs.get(label, {}).items():
                spark.conf.set(key, value)
            queries[label] = (
                keyed(stream, "key", name=KEYED_COMPONENT)
                .count()
                .writeStream.foreachBatch(noop_sink)
                .option("checkpointLocation", str(work / f"{label}-chk"))
                .trigger(processingTime="100 milliseconds")
                .start()
            )
            for key in confs.get(label, {}):
                spark.conf.unset(key)
        for step in range(max(len(schedule) for schedule in schedules.values())):
            labels = list(inputs) if step % 2 == 0 else list(reversed(inputs))
            for label in labels:
                index = schedules[label][step] if step < len(schedules[label]) else None
                if index is not None:
                    for key, value in confs.get(label, {}).items():
                        spark.conf.set(key, value)
                    before = interference(spark) if taken is not None else {}
                    release_file(inputs[label], index, live[label])
                    released[label] += 1
                    await_batches(queries[label], released[label])
                    if taken is not None:
                        after = interference(spark)
                        taken.setdefault(label, {})[index] = {k: round(after[k] - v, 3) for k, v in before.items()}
                    for key in confs.get(label, {}):
                        spark.conf.unset(key)
    finally:
        for query in queries.values():
            query.stop()
        spark.conf.unset("spark.state.parallelism")
    return queries


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
        "blob_bytes": _blob(meta).size if meta.get("blob") else 0,
    }


def _blob(meta: dict):
    """The ``BlobRef`` an instance report names (reports carry it in its compact JSON form)."""
    from spark_state.store.manifest import BlobRef

    return BlobRef.from_json(meta["blob"])


def batch_reports(query, progress: list[dict]) -> list[dict]:
    """Per batch of a keyed query: Spark's batch seconds and what its instances read and wrote.

    ``checkpoint_seconds`` is the slowest instance's checkpoint phase (serialize
    and write its blob); ``checkpoint_bytes`` the sum of the blobs committed.
    """
    seconds = {b["batch_id"]: b["seconds"] for b in progress}
    reports = []
    for batch in query.batches:
        instances = [_instance_report(m) for m in batch["instances"]]
        entries = [e for m in batch["instances"] if m.get("blob") for e in _blob(m).index.entries]
        kinds = [e.kind for e in entries]
        reports.append(
            {
                "batch_id": batch["batch_id"],
                "checkpoint_id": batch["checkpoint_id"],
                "seconds": seconds.get(batch["batch_id"]),
                "max_task_seconds": max(i["task_seconds"] for i in instances),
                "checkpoint_seconds": max((i["phase_seconds"] or {}).get("checkpoint", 0.0) for i in instances),
                "reloaded_state": any(i["key_groups_read"] > 0 for i in instances),
                "bytes_read": sum(i["bytes_read"] for i in instances),
                "checkpoint_bytes": sum(i["blob_bytes"] for i in instances),
                "full_entries": kinds.count("full"),
                "delta_entries": kinds.count("delta"),
                "merge_entries": kinds.count("merge"),
                "rows_written": sum(e.rows for e in entries),
                "instances": instances,
            }
        )
    return reports


def check_against_manifests(store_path: Path, reports: list[dict], component: str = KEYED_COMPONENT) -> dict:
    """Checkpoint bytes from the retained manifests, compared with those derived from the batch reports."""
    from spark_state.store.manifestlog import open_manifest_log

    store = open_manifest_log(str(store_path))
    checked = {}
    for checkpoint_id in store.ids():
        manifest_component = store.load(checkpoint_id).components[component]
        from_manifest = sum(b.size for b in manifest_component.blobs.values() if b.checkpoint_id == checkpoint_id)
        reported = next(r["checkpoint_bytes"] for r in reports if r["checkpoint_id"] == checkpoint_id)
        if from_manifest != reported:
            raise RuntimeError(
                f"checkpoint {checkpoint_id}: manifest blobs {from_manifest} B, batch reports {reported} B"
            )
        checked[str(checkpoint_id)] = from_manifest
    return checked


def bar_plot(path: Path, title: str, panels: list[tuple[str, dict[str, float], str, bool]]) -> None:
    """Save one row of bar charts: each panel is (title, {bar label: value}, y label, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for ax, (panel_title, values, ylabel, log) in zip(axes[0], panels):
        labels = list(values)
        bars = ax.bar(range(len(labels)), [values[k] for k in labels], color="tab:blue")
        for bar, label in zip(bars, labels):
            ax.annotate(
                f"{values[label]:.3g}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([label.replace("_", "\n") for label in labels], fontsize=7)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title, fontsize=10)
    save_figure(fig, path, title)


def save_figure(fig, path: Path, title: str, result: dict | None = None, dpi: int = 100) -> None:
    """Title ``fig`` (with the mode, master and load average of ``result``, if given), save it and close it."""
    import matplotlib.pyplot as plt

    if result is not None:
        title = (
            f"{title}, {result['mode']} mode, {result['master']}, load avg {result['environment']['load_average_1m']}"
        )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def parse_mode(doc: str, full_help: str, modes: dict, argv=None, add_arguments: Callable | None = None):
    """Parse ``--full`` / ``--smoke`` (plus what ``add_arguments(parser)`` adds): (args, the mode's config).

    ``modes`` maps "quick", "full" and "smoke" to the benchmark's configs.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help=full_help)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the wiring in seconds (*_smoke.json)")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    return args, modes["smoke" if args.smoke else "full" if args.full else "quick"]


def command_line(script: str, args) -> str:
    """The command that reran this benchmark in this mode (for its report)."""
    return f"./run bench {script}" + (" --full" if args.full else " --smoke" if args.smoke else "")


def result_header(spark, name: str, mode: str, command: str) -> dict:
    """The fields every Spark benchmark's report starts with: what ran, how, and on what."""
    return {
        "benchmark": f"bench_{name}",
        "mode": mode,
        "command": command,
        "master": spark.sparkContext.master,
        "environment": environment(spark),
    }


def run_and_save(
    name: str, mode: str, command: str, measure: Callable[[Any], dict], plot: Callable, variant: str = ""
) -> dict:
    """Run one Spark benchmark in a fresh session; save ``results/<name><variant>[_<mode>].json`` and its plot.

    ``measure(spark)`` returns the benchmark's own fields; the machine,
    versions, load average and wall time are added around them.
    """
    started = time.perf_counter()
    spark = session(f"bench-{name}")
    try:
        result = {**result_header(spark, name, mode, command), **measure(spark)}
    finally:
        spark.stop()
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["seconds"] = round(time.perf_counter() - started, 1)
    file = f"{name}{variant}" if mode == "quick" else f"{name}{variant}_{mode}"
    plot(result, RESULTS_DIR / f"{file}.png")
    save_report(file, result)
    return result
