"""Throughput of key group routing: vectorized columns vs the scalar loop.

Run: ``./run bench bench_keygroups``. Prints one JSON object, writes it to
``benchmarks/results/keygroups.json`` and plots ``keygroups.png``. Each
figure is the best of ``REPEATS`` runs, in keys per second; the load average
is recorded because other processes on the machine skew the numbers.

- ``vector_*``: ``key_groups_for_columns`` on 1M-row Arrow columns (random
  int64; strings like ``"user-123456"``; the (int64, string) pair).
- ``scalar_*``: ``key_group_for`` in a Python loop over Python values.
- ``raw_mmh3_short_string``: bare ``mmh3.hash(s.encode(), 42)`` in a Python
  loop over Python strs, no padding or validation: the floor of any per-row
  Python approach, for comparison.
- ``instances_for_key_groups``: 1M key groups to instances at parallelism 200.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import mmh3
import numpy as np
import pyarrow as pa

from spark_state.keyspace import (
    DEFAULT_MAX_PARALLELISM,
    instances_for_key_groups,
    key_group_for,
    key_groups_for_columns,
)

N_VECTOR = 1_000_000
N_SCALAR = 200_000
REPEATS = 5
PARALLELISM = 200
RESULTS = Path(__file__).resolve().parent / "results" / "keygroups.json"


def _best_keys_per_second(n_keys: int, run: Callable[[], object]) -> float:
    best = min(_timed(run) for _ in range(REPEATS))
    return round(n_keys / best)


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> dict:
    rng = np.random.default_rng(7)
    m = DEFAULT_MAX_PARALLELISM
    ints = pa.array(rng.integers(-(2**63), 2**63 - 1, size=N_VECTOR, dtype=np.int64))
    strings = pa.array([f"user-{n:06d}" for n in rng.integers(0, 1_000_000, size=N_VECTOR)])
    groups = key_groups_for_columns([ints], m)
    scalar_keys = [f"user-{n:06d}" for n in range(N_SCALAR)]
    scalar_ints = ints.slice(0, N_SCALAR).to_pylist()

    result = {
        "benchmark": "keygroups",
        "max_parallelism": m,
        "parallelism": PARALLELISM,
        "n_vector": N_VECTOR,
        "n_scalar": N_SCALAR,
        "keys_per_s": {
            "vector_int64": _best_keys_per_second(N_VECTOR, lambda: key_groups_for_columns([ints], m)),
            "vector_short_string": _best_keys_per_second(N_VECTOR, lambda: key_groups_for_columns([strings], m)),
            "vector_int64_string_pair": _best_keys_per_second(
                N_VECTOR, lambda: key_groups_for_columns([ints, strings], m)
            ),
            "scalar_int64": _best_keys_per_second(N_SCALAR, lambda: [key_group_for(k, m) for k in scalar_ints]),
            "scalar_short_string": _best_keys_per_second(N_SCALAR, lambda: [key_group_for(k, m) for k in scalar_keys]),
            "raw_mmh3_short_string": _best_keys_per_second(
                N_SCALAR, lambda: [mmh3.hash(k.encode(), 42) for k in scalar_keys]
            ),
            "instances_for_key_groups": _best_keys_per_second(
                N_VECTOR, lambda: instances_for_key_groups(groups, PARALLELISM, m)
            ),
        },
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    result["command"] = "./run bench bench_keygroups"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    import common

    common.bar_plot(
        RESULTS.with_suffix(".png"),
        f"Key-group mapping, best of {REPEATS} (load avg {result['load_average_1m']})",
        [("keys/s", result["keys_per_s"], "keys per second", True)],
    )
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
