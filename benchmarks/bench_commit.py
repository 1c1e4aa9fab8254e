"""What a checkpoint costs per micro-batch with the state on S3 vs on local disk, side by side in one run.

Run: ``./run bench bench_commit`` (about 3 minutes). Prints one JSON object,
writes ``benchmarks/results/commit.json`` and plots ``commit.png``.

Two keyed counts (``spark_state.keyed(df, "key").count()``, parallelism 2)
run side by side, one batch each in turn, over the same files: ``local``
keeps its state under ``<checkpointLocation>/state`` on local disk, ``s3``
in a bucket of a SeaweedFS server started for the run on loopback
(``tests/s3_server.py``). Each is prefilled with ``state_keys`` keys (batch
0, not measured), then runs ``batches`` batches of ``rows_per_batch`` rows
over those keys. Per batch:

- ``blob_write_seconds``: the slowest instance's checkpoint phase (encode its
  changed key groups and create its blob: one conditional PUT on S3);
- ``commit_seconds``: the driver's commit (derive the manifest and create
  the checkpoint record: the commit point);
- ``checkpoint_seconds``: the two added, what makes a batch's state durable
  and visible beyond the work of the batch;
- ``cleanup_seconds``: the driver deleting what no retained checkpoint needs;
- ``batch_seconds``: Spark's ``triggerExecution`` of the batch;
- on S3, the requests of an instance's blob write (max over instances), of
  the commit and of the cleanup, as the backend counted them.

Median and 95th percentile (nearest rank) of each over the measured
batches, and the S3 / local ratio of the medians. Loopback S3 has none of a
real region's network latency (single-digit milliseconds per request here,
tens of milliseconds on AWS): on AWS every request costs more, and the
requests per checkpoint are the number to carry over.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from bench_rescale import s3_store

WORK = common.WORK_DIR / "commit"
SCHEMA_DDL = "key string"
LABELS = ("local", "s3")
METRICS = ("blob_write_seconds", "commit_seconds", "checkpoint_seconds", "cleanup_seconds", "batch_seconds")


@dataclass(frozen=True)
class Config:
    mode: str
    state_keys: int
    batches: int
    rows_per_batch: int
    parallelism: int = 2
    store: str = "s3"  # s3_store() starts the server for this


QUICK = Config("quick", 100_000, 30, 10_000)
SMOKE = Config("smoke", 2_000, 2, 300)  # tests/test_benchmarks.py


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (``0 < q <= 100``) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _stats(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 4),
        "p95": round(percentile(values, 95), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def run(spark, config: Config, stores) -> dict:
    work = common.fresh_dir(WORK)
    rng = np.random.default_rng(20261121)
    keys = common.key_space(config.state_keys)
    tables = [common.batch_over(keys, rng.permutation(config.state_keys))]
    tables += common.uniform_batches(keys, config.state_keys, config.rows_per_batch, config.batches, rng)
    files = common.write_input(work / "files", tables, SCHEMA_DDL)
    s3_store_uri = stores.uri(work / "s3-chk")
    confs = {"s3": {"spark.state.store": s3_store_uri}}
    try:
        queries, wall = common.timed(
            lambda: common.run_keyed_interleaved(
                spark,
                {label: files for label in LABELS},
                {label: list(range(len(tables))) for label in LABELS},
                config.parallelism,
                work,
                confs,
            )
        )
        runs = {}
        for label, query in queries.items():
            reports = common.batch_reports(query, common.batch_progress(query))
            history = {b["batch_id"]: b for b in query.batches}
            if [r["batch_id"] for r in reports] != list(range(len(tables))):
                raise RuntimeError(f"{label}: batches {[r['batch_id'] for r in reports]}")
            batches = []
            for r in reports[1:]:  # batch 0 fills the state: not a steady batch
                h = history[r["batch_id"]]
                batches.append(
                    {
                        "batch_id": r["batch_id"],
                        "blob_write_seconds": r["checkpoint_seconds"],
                        "commit_seconds": h["commit_seconds"],
                        "checkpoint_seconds": round(r["checkpoint_seconds"] + h["commit_seconds"], 4),
                        "cleanup_seconds": h["cleanup_seconds"],
                        "batch_seconds": r["seconds"],
                        "checkpoint_bytes": r["checkpoint_bytes"],
                        "blob_write_requests": max(
                            (m.get("checkpoint_storage") or {}).get("requests", 0) for m in h["instances"]
                        ),
                        "commit_requests": h["commit_requests"],
                        "cleanup_requests": h["cleanup_requests"],
                    }
                )
            runs[label] = {
                "store": s3_store_uri if label == "s3" else "<checkpointLocation>/state (local disk)",
                "batches": batches,
                "stats": {m: _stats([b[m] for b in batches]) for m in METRICS},
                "median_checkpoint_bytes": statistics.median(b["checkpoint_bytes"] for b in batches),
                "median_requests": {
                    k: statistics.median(b[k] or 0 for b in batches)
                    for k in ("blob_write_requests", "commit_requests", "cleanup_requests")
                },
            }
    finally:
        stores.delete(work / "s3-chk")
        common.fresh_dir(WORK)
    local, s3 = runs["local"]["stats"], runs["s3"]["stats"]
    return {
        "state_keys": config.state_keys,
        "batches": config.batches,
        "rows_per_batch": config.rows_per_batch,
        "parallelism": config.parallelism,
        "wall_seconds": round(wall, 2),
        "runs": runs,
        "s3_vs_local_median": {
            m: round(s3[m]["median"] / local[m]["median"], 2) if local[m]["median"] else None for m in METRICS
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    colors = {"local": "tab:blue", "s3": "tab:orange"}
    ax = axes[0]
    for label in LABELS:
        batches = result["runs"][label]["batches"]
        ax.plot(
            [b["batch_id"] for b in batches],
            [b["checkpoint_seconds"] * 1000 for b in batches],
            marker="o",
            color=colors[label],
            label=f"{label}: blob write + commit",
        )
        ax.plot(
            [b["batch_id"] for b in batches],
            [b["commit_seconds"] * 1000 for b in batches],
            linestyle=":",
            color=colors[label],
            label=f"{label}: driver commit alone",
        )
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("milliseconds")
    ax.set_title("Checkpoint latency per batch")
    ax.legend(fontsize=7)
    ax = axes[1]
    width = 0.38
    metrics = [m for m in METRICS if m != "batch_seconds"]
    for i, label in enumerate(LABELS):
        stats = result["runs"][label]["stats"]
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, [stats[m]["median"] * 1000 for m in metrics], width, color=colors[label], label=f"{label} median")
        ax.scatter(
            xs,
            [stats[m]["p95"] * 1000 for m in metrics],
            color="black",
            marker="_",
            s=200,
            label="p95" if i == 0 else None,
            zorder=3,
        )
    ax.set_xticks([j + width / 2 for j in range(len(metrics))])
    ax.set_xticklabels([m.replace("_seconds", "").replace("_", "\n") for m in metrics], fontsize=8)
    ax.set_ylabel("milliseconds per batch")
    ax.set_title(f"{result['state_keys']:,} keys of state, {result['rows_per_batch']:,}-row batches")
    ax.legend(fontsize=7)
    common.save_figure(fig, path, "Checkpoint cost on S3 (SeaweedFS, loopback) vs local disk", result)


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__,
        "(no full mode: the quick run is the measurement)",
        {"quick": QUICK, "full": QUICK, "smoke": SMOKE},
        argv,
    )
    with s3_store(config, common.WORK_DIR / "commit-s3") as stores:
        return common.run_and_save(
            "commit",
            config.mode,
            common.command_line("bench_commit", args),
            lambda spark: run(spark, config, stores),
            plot,
        )


if __name__ == "__main__":
    main()
