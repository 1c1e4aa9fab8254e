"""Read amplification of restoring keyed state at a new parallelism, on the local backend.

For each old parallelism, a checkpoint of N keys (int64 key, int64 count) is
written the way a job writes it: one blob per instance with one entry per key
group. Then every new instance of each (old -> new) pair restores its key
groups through ``plan_instance_restore`` + ``BlobStore.fetch``, over a
storage wrapper that counts every byte and request actually made.

Per pair it reports:
- ``read_amplification``: max over new instances of bytes fetched from storage
  / bytes of the entries of the key groups that instance owns (target <= 1.05);
- ``whole_blob_amplification``: the same ratio when each new instance reads
  every old blob that overlaps its range, whole;
- requests, restore seconds (max over instances) and whether the restored
  state equals the written one.

    ./run bench bench_restore              # 1M keys, all pairs
    ./run bench bench_restore --keys 100000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spark_state.keyspace import (
    DEFAULT_MAX_PARALLELISM,
    instances_for_key_groups,
    key_group_range,
    key_groups_for_columns,
)
from spark_state.model.schema import KeyedSchema
from spark_state.storage.base import CountingStorage
from spark_state.storage.local import LocalStorage
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifest import ComponentSpec, ComponentUpdate, next_manifest
from spark_state.store.manifestlog import ManifestLog
from spark_state.store.restore import fold_chain, plan_instance_restore

PAIRS = [(2, 3), (3, 2), (7, 4), (1, 16), (16, 1), (4, 8), (8, 4), (4, 7), (7, 2)]
COMPONENT = "counts"
SCHEMA = KeyedSchema.of_values([pa.field("key", pa.int64())], [pa.field("count", pa.int64())])


def write_checkpoint(storage, keys: np.ndarray, counts: np.ndarray, parallelism: int, max_parallelism: int):
    """Write one full snapshot of (keys, counts) at ``parallelism`` and commit it; return the component manifest."""
    groups = key_groups_for_columns([keys], max_parallelism)
    order = np.argsort(groups, kind="stable")
    keys, counts, groups = keys[order], counts[order], groups[order]
    bounds = np.searchsorted(groups, np.arange(max_parallelism + 1))
    owners = instances_for_key_groups(np.arange(max_parallelism), parallelism, max_parallelism)
    refs = []
    for instance in range(parallelism):
        owned = key_group_range(instance, parallelism, max_parallelism)
        entries = []
        for g in owned:
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                assert owners[g] == instance
                values = pa.StructArray.from_arrays([pa.array(counts[lo:hi])], fields=list(SCHEMA.value.fields))
                table = pa.table(
                    [pa.array(keys[lo:hi]), values, pa.array(np.zeros(hi - lo, dtype=bool))],
                    schema=SCHEMA.blob_schema,
                )
                entries.append((g, "full", table))
        refs.append(BlobStore(storage).write_blob(COMPONENT, 1, instance, owned, SCHEMA.blob_schema, entries))
    spec = ComponentSpec(COMPONENT, max_parallelism, parallelism, SCHEMA)
    manifest = ManifestLog(storage).commit(next_manifest(None, 1, {COMPONENT: ComponentUpdate(spec, refs)}, {}))
    return manifest.components[COMPONENT]


def restore_pair(root: Path, old: int, new: int, expected: dict[int, int] | None) -> dict:
    counting = CountingStorage(LocalStorage(str(root)))
    blobs = BlobStore(counting)
    component = ManifestLog(counting).latest().components[COMPONENT]
    instances = []
    restored_keys = 0
    correct = True
    for j in range(new):
        before_bytes, before_requests = counting.bytes_read, counting.requests
        started = time.perf_counter()
        plan = plan_instance_restore(component, j, new)
        entries, _ = blobs.fetch(component, plan)
        rows = {g: fold_chain(batches, SCHEMA.key_columns) for g, batches in entries.items()}
        seconds = time.perf_counter() - started
        fetched = counting.bytes_read - before_bytes
        owned_range = plan.key_group_range
        whole = sum(b.size for b in component.blobs.values() if b.key_group_range.intersection(owned_range) is not None)
        n = sum(t.num_rows for t in rows.values())
        restored_keys += n
        if expected is not None:
            for table in rows.values():
                counts = table.column("_spark_state_value").combine_chunks().field("count").to_pylist()
                for key, count in zip(table.column("key").to_pylist(), counts):
                    correct &= expected.get(key) == count
        instances.append(
            {
                "instance": j,
                "key_groups": len(owned_range),
                "keys": n,
                "bytes_owned": plan.bytes_owned,
                "bytes_fetched": fetched,
                "whole_blob_bytes": whole,
                "requests": counting.requests - before_requests,
                "seconds": round(seconds, 4),
            }
        )
    return {
        "old_parallelism": old,
        "new_parallelism": new,
        "read_amplification": round(
            max(i["bytes_fetched"] / i["bytes_owned"] for i in instances if i["bytes_owned"]), 4
        ),
        "whole_blob_amplification": round(
            max(i["whole_blob_bytes"] / i["bytes_owned"] for i in instances if i["bytes_owned"]), 4
        ),
        "max_requests_per_instance": max(i["requests"] for i in instances),
        "max_restore_seconds": max(i["seconds"] for i in instances),
        "restored_keys": restored_keys,
        "state_equal": correct and (expected is None or restored_keys == len(expected)),
        "instances": instances,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--max-parallelism", type=int, default=DEFAULT_MAX_PARALLELISM)
    parser.add_argument("--verify", action="store_true", help="compare every restored key with the written state")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "restore.json"))
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    keys = rng.choice(np.iinfo(np.int64).max, size=args.keys, replace=False).astype(np.int64)
    counts = rng.integers(1, 1000, size=args.keys, dtype=np.int64)
    expected = dict(zip(keys.tolist(), counts.tolist())) if args.verify else None
    work = Path(tempfile.mkdtemp(prefix="bench-restore-"))
    results = []
    try:
        for old in sorted({old for old, _ in PAIRS}):
            root = work / f"p{old}"
            started = time.perf_counter()
            component = write_checkpoint(LocalStorage(str(root)), keys, counts, old, args.max_parallelism)
            written = time.perf_counter() - started
            state_bytes = sum(b.size for b in component.blobs.values())
            for pair_old, new in PAIRS:
                if pair_old == old:
                    result = restore_pair(root, old, new, expected)
                    result["checkpoint_bytes"] = state_bytes
                    result["checkpoint_write_seconds"] = round(written, 3)
                    results.append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "restore_read_amplification",
        "backend": "local",
        "keys": args.keys,
        "max_parallelism": args.max_parallelism,
        "target_read_amplification": 1.05,
        "all_within_target": all(r["read_amplification"] <= 1.05 for r in results),
        "pairs": [{k: v for k, v in r.items() if k != "instances"} for r in results],
        "instances": {f"{r['old_parallelism']}->{r['new_parallelism']}": r["instances"] for r in results},
    }
    report["command"] = (
        "./run bench bench_restore"
        + (" --verify" if args.verify else "")
        + (f" --keys {args.keys}" if args.keys != 1_000_000 else "")
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    pairs = {f"{r['old_parallelism']}->{r['new_parallelism']}": r for r in report["pairs"]}
    common.bar_plot(
        Path(args.out).with_suffix(".png"),
        f"Restore at a new parallelism, {args.keys:,} keys, local disk",
        [
            (
                "key groups: ranged reads of owned entries",
                {k: r["read_amplification"] for k, r in pairs.items()},
                "read amplification (max over new instances)",
                False,
            ),
            (
                "whole overlapping blobs",
                {k: r["whole_blob_amplification"] for k, r in pairs.items()},
                "read amplification (max over new instances)",
                False,
            ),
        ],
    )
    print(json.dumps({k: v for k, v in report.items() if k != "instances"}, indent=2))


if __name__ == "__main__":
    main()
