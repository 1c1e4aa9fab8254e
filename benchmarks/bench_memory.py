"""Resident memory under ``spark.state.residentMemory``: what the bound holds, the RSS it buys, what batches cost.

Run: ``./run bench bench_memory [--full]``. Prints one JSON object, writes
``benchmarks/results/memory[_full].json`` and plots ``memory[_full].png``.
Quick: 1M keys of state (about 3 minutes); full: 5M keys.

Keyed counts (``keyed(df, "key").count()``, parallelism 2, ``local[2]``: one
executor) run side by side, one batch each in turn:

- ``unbounded``: no bound, the default;
- ``bound_<size>``: ``spark.state.residentMemory=<size>`` for each size of
  the mode, chosen below the state (the smallest below even its Arrow form);
- ``baseline``: the same query over one file of 1,000 rows: its instance
  hosts' RSS is what a host costs without state (interpreter, pyarrow).

Each but ``baseline`` is prefilled with S distinct keys, ``prefill_rows`` new
keys a batch (a first batch of all S would hold them all as its own changes,
and that peak would hide every later one), then gets the same steady batches of ``rows_per_batch`` rows: ``uniform`` ones drawn
over all S keys (every key group touched, the worst case for a bound), then
``hot`` ones over the same 10k keys.

Per run: each batch's instance reports (``memory``: the estimate of the
state's bytes at its peak during the task, after the checkpoint and after
eviction, with the share of the bound; ``restore.loaded``: what evicted key
groups cost to read back), the steady batches' seconds against the
unbounded run's twins (paired ratios, median), the instance hosts' RSS
high-water mark (``VmHWM``) over the baseline hosts', and whether the final
state equals the unbounded run's (``read_state`` of both, compared row for
row). Targets: every batch leaves each instance's state within its share of
the bound, and the final state is exact. The RSS is reported beside the
bound, not held to it: a batch also holds its own changed keys (as Python
objects, until its checkpoint) and the chains of one chunk of key groups.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

WORK = common.WORK_DIR / "memory"
SCHEMA_DDL = "key string"
BOUND = "spark.state.residentMemory"
MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    mode: str
    state_keys: int
    bounds: tuple[str, ...]  # spark.state.residentMemory values, largest first
    rows_per_batch: int
    prefill_rows: int
    uniform_batches: int
    hot_batches: int
    hot_keys: int = 10_000
    parallelism: int = 2


QUICK = Config("quick", 1_000_000, ("64m", "8m"), 100_000, 200_000, 4, 4)
FULL = Config("full", 5_000_000, ("256m", "32m"), 100_000, 250_000, 5, 5)
SMOKE = Config("smoke", 20_000, ("1m", "512k"), 2_000, 10_000, 2, 2, hot_keys=500)


def _bytes(size: str) -> int:
    from spark_state.driver.conf import parse_bytes

    return parse_bytes(BOUND, size)


def _rss_high_water(reports: list[dict]) -> dict:
    """Per instance host (pid): the largest RSS high-water mark its reports gave, in bytes."""
    by_pid: dict[int, int] = {}
    for batch in reports:
        for meta in batch["instances"]:
            rss = meta.get("memory", {}).get("rss_high_water_bytes")
            if rss is not None:
                by_pid[meta["pid"]] = max(by_pid.get(meta["pid"], 0), rss)
    return by_pid


def _memory_rows(query) -> list[dict]:
    """Per batch: each instance's memory report and what it read back, from the query's batch records."""
    rows = []
    for batch in query.batches:
        rows.append(
            {
                "batch_id": batch["batch_id"],
                "instances": [
                    {
                        "pid": m["pid"],
                        "keys_in_memory": m["keys"],
                        **m["memory"],
                        "loaded": m["restore"].get("loaded", {}),
                    }
                    for m in batch["instances"]
                ],
            }
        )
    return rows


def _final_state(store: Path):
    from spark_state.ops.reader import read_state

    table = read_state(str(store), common.KEYED_COMPONENT)
    return table.sort_by([(name, "ascending") for name in table.column_names])


def run(spark, config: Config) -> dict:
    common.fresh_dir(WORK)
    rng = np.random.default_rng(20261125)
    keys = common.key_space(config.state_keys)
    steady = common.uniform_batches(
        keys, config.state_keys, config.rows_per_batch, config.uniform_batches, rng
    ) + common.uniform_batches(keys, config.hot_keys, config.rows_per_batch, config.hot_batches, rng)
    order = rng.permutation(config.state_keys)
    prefill = [
        common.batch_over(keys, order[i : i + config.prefill_rows])
        for i in range(0, config.state_keys, config.prefill_rows)
    ]
    files = [*prefill, *steady]
    labels = ["unbounded", *(f"bound_{b}" for b in config.bounds)]
    inputs = {label: common.write_input(WORK / f"{label}-files", files, SCHEMA_DDL) for label in labels}
    inputs["baseline"] = common.write_input(
        WORK / "baseline-files", [common.batch_over(keys, np.arange(1000))], SCHEMA_DDL
    )
    schedules = {label: list(range(len(files))) for label in labels}
    schedules["baseline"] = [0]
    confs = {f"bound_{b}": {BOUND: b} for b in config.bounds}
    try:
        queries, wall = common.timed(
            lambda: common.run_keyed_interleaved(spark, inputs, schedules, config.parallelism, WORK, confs)
        )
        runs = {label: _measure(queries[label], WORK / f"{label}-chk" / "state") for label in [*labels, "baseline"]}
        expected = _final_state(WORK / "unbounded-chk" / "state")
        for label in labels[1:]:
            runs[label]["final_state_equals_unbounded"] = _final_state(WORK / f"{label}-chk" / "state").equals(expected)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    baseline_rss = statistics.median(runs["baseline"]["rss_high_water_by_host"].values())
    steady_ids = list(range(len(prefill), len(files)))
    uniform_ids = steady_ids[: config.uniform_batches]
    hot_ids = steady_ids[config.uniform_batches :]
    for label in labels:
        run_ = runs[label]
        hosts = run_["rss_high_water_by_host"]
        run_["rss_growth_over_baseline_bytes"] = sum(max(0, v - baseline_rss) for v in hosts.values())
        run_["state_kept_between_batches_bytes"] = {
            "max": max(sum(i["resident_bytes"] for i in b["instances"]) for b in run_["batches"]),
        }
        run_["peak_estimate_bytes"] = max(sum(i["peak_bytes"] for i in b["instances"]) for b in run_["batches"])
        if label != "unbounded":
            limit = _bytes(label.removeprefix("bound_"))
            run_["limit_bytes"] = limit
            run_["batches_over_share"] = [
                b["batch_id"]
                for b in run_["batches"]
                if any(i["resident_bytes"] > i["limit_bytes"] for i in b["instances"])
            ]
            for name, ids in (("uniform", uniform_ids), ("hot", hot_ids)):
                paired = [run_["seconds"][i] / runs["unbounded"]["seconds"][i] for i in ids]
                run_[f"{name}_batch_time_vs_unbounded"] = {
                    "median": round(statistics.median(paired), 3),
                    "paired": [round(p, 3) for p in paired],
                }
            run_["bytes_read_back_per_steady_batch"] = statistics.median(
                sum(i["loaded"].get("bytes_read", 0) for i in run_["batches"][b]["instances"]) for b in steady_ids
            )
    result = {
        "parallelism": config.parallelism,
        "state_keys": config.state_keys,
        "rows_per_batch": config.rows_per_batch,
        "bounds": list(config.bounds),
        "prefill_batches": len(prefill),
        "uniform_batch_ids": uniform_ids,
        "hot_batch_ids": hot_ids,
        "hot_keys": config.hot_keys,
        "baseline_host_rss_bytes": baseline_rss,
        "wall_seconds": round(wall, 2),
        "runs": runs,
    }
    result["targets"] = targets(result)
    return result


def _measure(query, store: Path) -> dict:
    progress = {b["batch_id"]: b["seconds"] for b in common.batch_progress(query)}
    batches = _memory_rows(query)
    return {
        "seconds": [progress.get(b["batch_id"]) for b in batches],
        "rss_high_water_by_host": _rss_high_water(query.batches),
        "batches": batches,
    }


def targets(result: dict) -> list[dict]:
    out = []
    for label, run_ in result["runs"].items():
        if not label.startswith("bound_"):
            continue
        out.append(
            {
                "target": f"{label}, batches leaving an instance above its share of the bound (at most 0)",
                "value": len(run_["batches_over_share"]),
                "met": not run_["batches_over_share"],
            }
        )
        out.append(
            {
                "target": f"{label}, final state equal to the unbounded run's",
                "value": "yes" if run_["final_state_equals_unbounded"] else "no",
                "met": bool(run_["final_state_equals_unbounded"]),
            }
        )
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label in result["runs"] if label != "baseline"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    ax = axes[0]
    kinds = [
        ("state_kept_between_batches_bytes", "state kept between batches (estimate, max)"),
        ("peak_estimate_bytes", "peak during a batch (estimate, max)"),
        ("rss_growth_over_baseline_bytes", "hosts' RSS high-water over baseline hosts"),
    ]
    width = 0.8 / len(kinds)
    for k, (field, name) in enumerate(kinds):
        values = [
            result["runs"][label][field]
            if not isinstance(result["runs"][label][field], dict)
            else result["runs"][label][field]["max"]
            for label in labels
        ]
        ax.bar([j + k * width for j in range(len(labels))], [v / MiB for v in values], width, label=name)
    for j, label in enumerate(labels):
        limit = result["runs"][label].get("limit_bytes")
        if limit:
            ax.hlines(limit / MiB, j - width / 2, j + width * (len(kinds) - 0.5), colors="black", linestyles="--")
    ax.set_xticks([j + width for j in range(len(labels))])
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("MiB (log scale); dashed: the bound")
    ax.set_title(f"{result['state_keys']:,} keys of state, parallelism {result['parallelism']}")
    ax.legend(fontsize=7)
    ax = axes[1]
    ids = result["uniform_batch_ids"] + result["hot_batch_ids"]
    for label in labels:
        ax.plot(ids, [result["runs"][label]["seconds"][i] for i in ids], marker="o", label=label)
    ax.axvline(result["hot_batch_ids"][0] - 0.5, color="gray", linestyle=":")
    ax.set_xlabel(f"steady batch (uniform over all keys, then over {result['hot_keys']:,} hot keys)")
    ax.set_ylabel("batch seconds")
    ax.set_title("Steady batches side by side")
    ax.legend(fontsize=8)
    common.save_figure(fig, path, "bench_memory", result)


def main(argv=None) -> dict:
    args, config = common.parse_mode(
        __doc__, "5M keys of state, bounds 256m and 32m", {"quick": QUICK, "full": FULL, "smoke": SMOKE}, argv
    )
    return common.run_and_save(
        "memory", config.mode, common.command_line("bench_memory", args), lambda spark: run(spark, config), plot
    )


if __name__ == "__main__":
    main()
