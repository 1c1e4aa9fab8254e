"""Bytes and time of a checkpoint against keys changed, with and without compaction, and what restoring then costs.

Run: ``./run bench bench_checkpoint [--full]``. Prints one JSON object, writes
``benchmarks/results/checkpoint[_full].json`` and plots
``checkpoint[_full].png``. Quick: 1M keys of state, 4 rounds (about 1.5
minutes); full: 8 rounds.

Two keyed counts (``spark_state.keyed(df, "key").count()``, parallelism 2)
run side by side, one batch each in turn, over the same files:

- ``compaction``: ``spark.state.maxChainLength=8`` (the default): once a key
  group's chain of delta entries would pass 8 (from 4 on, spread over
  batches), it is compacted: a ``merge`` entry of the keys changed since its
  full entry replaces its deltas, or, once those are half of its keys, a
  full entry restarts it;
- ``no_compaction``: ``spark.state.maxChainLength=1000000``: deltas only.

Each is prefilled with S distinct keys (batch 0, one full entry per key
group), then gets ``rounds`` rounds of batches of ``rows_per_batch`` rows
over exactly 1k, 10k and 100k distinct keys of the S.

Per checkpoint: ``bytes`` (sum of the blobs committed for it, cross-checked
against the manifests), ``checkpoint_seconds`` (the slowest instance's time
to serialize and write its blob), Spark's batch seconds, and the full,
delta and merge entries written. After the last batch, the final checkpoint
of each is restored cold in the driver the way a task restores it (``restore_instance``
over a counting storage wrapper, then every key group folded): bytes read,
requests, seconds, and the longest chain. That is the price of skipping
compaction.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

WORK = common.WORK_DIR / "checkpoint"
SCHEMA_DDL = "key string"
MAX_CHAIN = "spark.state.maxChainLength"
NO_COMPACTION = 1_000_000


@dataclass(frozen=True)
class Config:
    mode: str
    state_keys: int
    changed_keys: tuple[int, ...]
    rounds: int
    rows_per_batch: int
    max_chain_length: int
    parallelism: int = 2


QUICK = Config("quick", 1_000_000, (1_000, 10_000, 100_000), 4, 100_000, 8)
FULL = Config("full", 1_000_000, (1_000, 10_000, 100_000), 8, 100_000, 8)
SMOKE = Config("smoke", 20_000, (100, 1_000), 2, 2_000, 2)  # tests/test_benchmarks.py


def restore_cost(store_path: Path, parallelism: int) -> dict:
    """Restore every instance of the latest checkpoint under ``store_path`` cold, as a task does; cost and size."""
    from spark_state.executor.resident import restore_instance
    from spark_state.storage.base import CountingStorage
    from spark_state.storage.local import LocalStorage
    from spark_state.store.blobstore import BlobStore
    from spark_state.store.manifestlog import ManifestReader

    counting = CountingStorage(LocalStorage(str(store_path)))
    component = ManifestReader(counting).latest().components[common.KEYED_COMPONENT]
    blobs = BlobStore(counting)
    started = time.perf_counter()
    keys = 0
    for instance in range(parallelism):
        state, _ = restore_instance(
            blobs, component, component.keyed_schema, instance, parallelism, component.max_parallelism
        )
        keys += sum(1 for _ in state.table.items())  # fold every key group: the whole restore, not just the fetch
    chains = [len(chain) for chain in component.chains.values()]
    return {
        "bytes_read": counting.bytes_read,
        "requests": counting.requests,
        "seconds": round(time.perf_counter() - started, 3),
        "keys_restored": keys,
        "longest_chain": max(chains),
        "mean_chain": round(statistics.fmean(chains), 2),
        "state_bytes_retained": sum(b.size for b in component.blobs.values()),
    }


def _checked_restore(store: Path, config: Config) -> dict:
    cost = restore_cost(store, config.parallelism)
    if cost["keys_restored"] != config.state_keys:
        raise RuntimeError(f"restored {cost['keys_restored']} keys from {store}, expected {config.state_keys}")
    return cost


def bytes_model(reports: list[dict]) -> dict:
    """Least-squares fit of checkpoint bytes = per_entry * entries + per_row * rows written."""
    entries = np.array([r["full_entries"] + r["delta_entries"] + r["merge_entries"] for r in reports], dtype=float)
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


def run(spark, config: Config) -> dict:
    work = common.fresh_dir(WORK)
    rng = np.random.default_rng(20261121)
    keys = common.key_space(config.state_keys)
    changes = [n for _ in range(config.rounds) for n in config.changed_keys]
    tables = [common.batch_over(keys, rng.permutation(config.state_keys))]
    tables += [common.changing_batch(keys, config.state_keys, n, config.rows_per_batch, rng) for n in changes]
    files = common.write_input(work / "files", tables, SCHEMA_DDL)
    configs = {"compaction": config.max_chain_length, "no_compaction": NO_COMPACTION}
    inputs = {label: files for label in configs}
    schedules = {label: list(range(len(tables))) for label in configs}
    confs = {label: {MAX_CHAIN: str(length)} for label, length in configs.items()}
    try:
        queries, wall = common.timed(
            lambda: common.run_keyed_interleaved(spark, inputs, schedules, config.parallelism, work, confs)
        )
        runs = {}
        for label, query in queries.items():
            reports = common.batch_reports(query, common.batch_progress(query))
            if [r["batch_id"] for r in reports] != list(range(len(tables))):
                raise RuntimeError(f"{label}: batches {[r['batch_id'] for r in reports]}")
            store = work / f"{label}-chk" / "state"
            common.check_against_manifests(store, reports)
            checkpoints = [
                {
                    "checkpoint_id": r["checkpoint_id"],
                    "keys_changed": n,
                    "bytes": r["checkpoint_bytes"],
                    "checkpoint_seconds": r["checkpoint_seconds"],
                    "batch_seconds": r["seconds"],
                    "full_entries": r["full_entries"],
                    "delta_entries": r["delta_entries"],
                    "merge_entries": r["merge_entries"],
                    "rows_written": r["rows_written"],
                }
                for n, r in zip(changes, reports[1:])
            ]
            runs[label] = {
                "max_chain_length": configs[label],
                "full_state_bytes": reports[0]["checkpoint_bytes"],
                "checkpoints": checkpoints,
                "by_keys_changed": {
                    str(n): {
                        "median_bytes": statistics.median(c["bytes"] for c in checkpoints if c["keys_changed"] == n),
                        "max_bytes": max(c["bytes"] for c in checkpoints if c["keys_changed"] == n),
                        "median_checkpoint_seconds": statistics.median(
                            c["checkpoint_seconds"] for c in checkpoints if c["keys_changed"] == n
                        ),
                        "max_checkpoint_seconds": max(
                            c["checkpoint_seconds"] for c in checkpoints if c["keys_changed"] == n
                        ),
                    }
                    for n in config.changed_keys
                },
                "total_bytes_written": sum(c["bytes"] for c in checkpoints),
                "total_checkpoint_seconds": round(sum(c["checkpoint_seconds"] for c in checkpoints), 3),
                "restore": _checked_restore(store, config),
                "bytes_model": bytes_model(reports),
            }
            print(f"{label}: restore {runs[label]['restore']}", file=sys.stderr)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    with_c, without = runs["compaction"], runs["no_compaction"]
    full_bytes = with_c["full_state_bytes"]
    return {
        "state_keys": config.state_keys,
        "parallelism": config.parallelism,
        "rows_per_batch": config.rows_per_batch,
        "rounds": config.rounds,
        "changed_keys": list(config.changed_keys),
        "wall_seconds": round(wall, 2),
        "runs": runs,
        "comparison": {
            "bytes_written_no_compaction_vs_compaction": round(
                without["total_bytes_written"] / with_c["total_bytes_written"], 3
            ),
            "restore_bytes_no_compaction_vs_compaction": round(
                without["restore"]["bytes_read"] / with_c["restore"]["bytes_read"], 3
            ),
            "restore_seconds_no_compaction_vs_compaction": round(
                without["restore"]["seconds"] / with_c["restore"]["seconds"], 3
            ),
            "fraction_of_full_state_by_keys_changed": {
                n: round(v["median_bytes"] / full_bytes, 5) for n, v in without["by_keys_changed"].items()
            },
        },
        "targets": [
            {
                "target": "checkpoint_bytes_proportional_to_change",
                "rule": "without compaction, bytes grow with keys changed and no checkpoint of a partial change writes "
                "the full state",
                "met": all(
                    without["by_keys_changed"][str(b)]["median_bytes"]
                    > without["by_keys_changed"][str(a)]["median_bytes"]
                    for a, b in zip(config.changed_keys, config.changed_keys[1:])
                )
                and all(c["bytes"] < full_bytes for c in without["checkpoints"]),
            }
        ],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = {"compaction": "tab:blue", "no_compaction": "tab:orange"}
    markers = {n: m for n, m in zip(result["changed_keys"], "o^s")}
    for label, run in result["runs"].items():
        points = run["checkpoints"]
        xs = [p["checkpoint_id"] for p in points]
        for ax, key in ((axes[0], "bytes"), (axes[1], "checkpoint_seconds")):
            ax.plot(xs, [p[key] for p in points], color=colors[label], alpha=0.4)
            for n in result["changed_keys"]:
                sel = [p for p in points if p["keys_changed"] == n]
                ax.scatter(
                    [p["checkpoint_id"] for p in sel],
                    [p[key] for p in sel],
                    color=colors[label],
                    marker=markers[n],
                    label=f"{label}, {n:,} keys changed",
                )
    full = result["runs"]["compaction"]["full_state_bytes"]
    axes[0].axhline(full, color="grey", linestyle=":", label="full state")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("bytes written per checkpoint")
    axes[0].set_title(f"Checkpoint bytes ({result['state_keys']:,} keys of state)")
    axes[1].set_ylabel("seconds (slowest instance: serialize + write)")
    axes[1].set_title("Checkpoint time")
    for ax in axes[:2]:
        ax.set_xlabel("checkpoint")
        ax.legend(fontsize=6)
    ax = axes[2]
    labels = list(result["runs"])
    restore = [result["runs"][label]["restore"] for label in labels]
    ax.bar(labels, [r["bytes_read"] / 1e6 for r in restore], color=[colors[label] for label in labels])
    for i, r in enumerate(restore):
        ax.annotate(
            f"{r['seconds']} s, longest chain {r['longest_chain']}",
            (i, r["bytes_read"] / 1e6),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("MB read to restore the last checkpoint")
    ax.set_title("Restore cost after the same batches")
    common.save_figure(fig, path, "Checkpoint cost", result)


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__, "8 rounds of changes instead of 4", {"quick": QUICK, "full": FULL, "smoke": SMOKE}, argv
    )
    return common.run_and_save(
        "checkpoint", config.mode, common.command_line("bench_checkpoint", args), lambda spark: run(spark, config), plot
    )


if __name__ == "__main__":
    main()
