"""What committing a checkpoint costs the driver as the key space grows: delta records against full ones.

A component with state in every key group (``--keys-per-group`` keys each,
parallelism 8) is checkpointed once in full, then for ``--checkpoints``
checkpoints 1% of the key groups change (2 keys each: delta entries). The
same blobs are committed to two manifest logs side by side, checkpoint by
checkpoint: one with the default policy (a delta record on the previous
checkpoint, a full record at least every ``MAX_DELTAS``), one writing every
record in full (what every checkpoint wrote before delta records).

Per checkpoint and policy it reports the record's bytes, the state delta
bytes (the blobs written for the checkpoint), the driver's commit seconds
(deriving the manifest and creating the record, fsync included, local disk)
and the seconds an executor spends reading the manifest warm (it holds the
previous one) and cold (a fresh reader). Targets at 1% of key groups
changed: record bytes at most 10% of the state delta bytes, and a commit of
at most 100 ms at 32768 key groups (medians).

    ./run bench bench_manifest            # 4096 and 32768 key groups, 20 checkpoints
    ./run bench bench_manifest --smoke    # 256 key groups, 4 checkpoints (tests)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from spark_state.executor.resident import ResidentState
from spark_state.keyspace import instance_for_key_group, key_group_range
from spark_state.model.schema import KeyedSchema
from spark_state.storage.local import LocalStorage
from spark_state.store import manifestlog
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifest import ComponentSpec, ComponentUpdate, next_manifest
from spark_state.store.manifestlog import ManifestLog, ManifestReader

COMPONENT = "counts"
PARALLELISM = 8
SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("count", pa.int64())])
POLICIES = ("delta_records", "full_records")


class _Policy(ManifestLog):
    """A manifest log that writes every record in full (``deltas=0``) or by the default policy."""

    def __init__(self, storage, full: bool):
        super().__init__(storage, retained=3)
        self.full = full

    def commit(self, manifest):
        saved = manifestlog.MAX_DELTAS
        manifestlog.MAX_DELTAS = 0 if self.full else saved
        try:
            return super().commit(manifest)
        finally:
            manifestlog.MAX_DELTAS = saved


def run(max_parallelism: int, checkpoints: int, keys_per_group: int, work: Path) -> dict:
    blobs = BlobStore(LocalStorage(str(work / "blobs")))
    logs = {name: _Policy(LocalStorage(str(work / name)), name == "full_records") for name in POLICIES}
    states = [ResidentState(SCHEMA, key_group_range(i, PARALLELISM, max_parallelism)) for i in range(PARALLELISM)]
    spec = ComponentSpec(COMPONENT, max_parallelism, PARALLELISM, SCHEMA)
    owner = [instance_for_key_group(g, PARALLELISM, max_parallelism) for g in range(max_parallelism)]
    for g in range(max_parallelism):
        for n in range(keys_per_group):
            states[owner[g]].table.put(g, (f"{g}-{n}",), (n,))
    changed = max(1, max_parallelism // 100)
    rows: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for checkpoint_id in range(checkpoints + 1):
        if checkpoint_id:
            for g in range(checkpoint_id % (max_parallelism // changed), max_parallelism, max_parallelism // changed):
                for n in range(2):
                    states[owner[g]].table.put(g, (f"{g}-{n}",), (-checkpoint_id,))
        refs = [r for r in (s.checkpoint(blobs, COMPONENT, checkpoint_id, i)[0] for i, s in enumerate(states)) if r]
        delta_bytes = sum(ref.size for ref in refs)
        for name in POLICIES if checkpoint_id % 2 else POLICIES[::-1]:  # alternate who goes first
            log = logs[name]
            started = time.perf_counter()
            manifest = log.commit(
                next_manifest(log.latest(), checkpoint_id, {COMPONENT: ComponentUpdate(spec, refs)}, {})
            )
            commit = time.perf_counter() - started
            record = log.storage.size(manifestlog.manifest_path(checkpoint_id))
            if checkpoint_id:
                warm = ManifestReader(log.storage)
                warm.load(checkpoint_id - 1)
                _, warm_seconds = common.timed(lambda: warm.load(checkpoint_id))
                _, cold_seconds = common.timed(lambda: ManifestReader(log.storage).load(checkpoint_id))
                assert warm.load(checkpoint_id) == manifest
                rows[name].append(
                    {
                        "checkpoint_id": checkpoint_id,
                        "record_bytes": record,
                        "state_delta_bytes": delta_bytes,
                        "record_to_delta": round(record / delta_bytes, 4),
                        "commit_seconds": round(commit, 4),
                        "warm_load_seconds": round(warm_seconds, 4),
                        "cold_load_seconds": round(cold_seconds, 4),
                    }
                )
            log.cleanup(manifest)
    result = {"max_parallelism": max_parallelism, "key_groups_changed": changed, "keys_per_group": keys_per_group}
    for name in POLICIES:
        result[name] = {
            "record_bytes": common.summary([r["record_bytes"] for r in rows[name]]),
            "record_to_state_delta": common.summary([r["record_to_delta"] for r in rows[name]]),
            "commit_seconds": common.summary([r["commit_seconds"] for r in rows[name]]),
            "warm_load_seconds": common.summary([r["warm_load_seconds"] for r in rows[name]]),
            "cold_load_seconds": common.summary([r["cold_load_seconds"] for r in rows[name]]),
            "checkpoints": rows[name],
        }
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["sizes"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, (metric, label) in zip(
        axes,
        [
            ("record_bytes", "bytes per checkpoint record (median)"),
            ("commit_seconds", "driver commit seconds (median)"),
            ("cold_load_seconds", "executor cold read seconds (median)"),
        ],
    ):
        for offset, name in enumerate(POLICIES):
            xs = [i + offset * 0.4 for i in range(len(sizes))]
            ax.bar(xs, [s[name][metric]["median"] for s in sizes], 0.4, label=name.replace("_", " "))
        if metric == "record_bytes":
            xs = [i + 0.2 for i in range(len(sizes))]
            ax.plot(
                xs,
                [s["delta_records"]["checkpoints"][0]["state_delta_bytes"] for s in sizes],
                "k_",
                markersize=30,
                label="state delta bytes",
            )
        ax.set_xticks([i + 0.2 for i in range(len(sizes))])
        ax.set_xticklabels([f"{s['max_parallelism']} key groups" for s in sizes])
        ax.set_yscale("log")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    common.save_figure(fig, path, "Checkpoint records, 1% of key groups changed per checkpoint, local disk")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--checkpoints", type=int)
    parser.add_argument("--keys-per-group", type=int, default=4)
    parser.add_argument("--out", help="the JSON file to write (default benchmarks/results/manifest[_smoke].json)")
    args = parser.parse_args(argv)
    key_spaces = (256,) if args.smoke else (4096, 32768)
    checkpoints = args.checkpoints or (4 if args.smoke else 20)
    work = Path(tempfile.mkdtemp(prefix="bench-manifest-"))
    try:
        sizes = [run(m, checkpoints, args.keys_per_group, work / str(m)) for m in key_spaces]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    largest = sizes[-1]["delta_records"]
    report = {
        "benchmark": "bench_manifest",
        "command": "./run bench bench_manifest" + (" --smoke" if args.smoke else ""),
        "environment": common.environment(),
        "sizes": sizes,
        "targets": [
            {
                "target": "record bytes <= 10% of the state delta bytes (median, every size)",
                "value": max(s["delta_records"]["record_to_state_delta"]["median"] for s in sizes),
                "met": all(s["delta_records"]["record_to_state_delta"]["median"] <= 0.10 for s in sizes),
            },
            {
                "target": f"commit <= 100 ms at {sizes[-1]['max_parallelism']} key groups (median)",
                "value": largest["commit_seconds"]["median"],
                "met": largest["commit_seconds"]["median"] <= 0.1,
            },
        ],
    }
    out = (
        Path(args.out) if args.out else common.RESULTS_DIR / ("manifest_smoke.json" if args.smoke else "manifest.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, out.with_suffix(".png"))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in report.items() if k != "sizes"}
            | {
                "medians": [
                    {
                        "max_parallelism": s["max_parallelism"],
                        **{
                            name: {
                                m: s[name][m]["median"]
                                for m in (
                                    "record_bytes",
                                    "record_to_state_delta",
                                    "commit_seconds",
                                    "warm_load_seconds",
                                    "cold_load_seconds",
                                )
                            }
                            for name in POLICIES
                        },
                    }
                    for s in sizes
                ]
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
