"""The driver process is killed at each step of the micro-batch protocol, then restarted.

Each run is a separate driver process (``tests/driver_job.py``) that dies
with ``os._exit`` (no cleanup, no finally blocks) at the chosen step; the
restart, possibly at another parallelism, must produce exactly the output of
a run without the crash.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.spark

JOB = Path(__file__).with_name("driver_job.py")


def _write_inputs(work: Path, batches: int) -> list[list[str]]:
    (work / "input").mkdir(parents=True)
    files = []
    for index in range(batches):
        users = [f"u{(i * 11 + index) % 37}" for i in range(200)]
        path = work / "input" / f"part-{index:05d}.parquet"
        pq.write_table(pa.table({"user": users, "amount": [1] * len(users)}), path)
        os.utime(path, (1_700_000_000 + index, 1_700_000_000 + index))
        files.append(users)
    return files


def _run(work: Path, parallelism: int, die_at: str | None = None) -> int:
    command = [sys.executable, str(JOB), str(work), str(parallelism)]
    if die_at:
        command += ["--die-at", die_at]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    return subprocess.run(command, env=env, capture_output=True, timeout=300).returncode


def _outputs(work: Path) -> dict[int, dict[str, int]]:
    table = pq.read_table(work / "out")
    result: dict[int, dict[str, int]] = {}
    for batch_id, user, count in zip(
        table.column("batch_id").to_pylist(), table.column("user").to_pylist(), table.column("count").to_pylist()
    ):
        result.setdefault(int(batch_id), {})[user] = count
    return result


def _expected(files: list[list[str]]) -> dict[int, dict[str, int]]:
    totals: Counter = Counter()
    result = {}
    for batch_id, users in enumerate(files):
        totals.update(users)
        result[batch_id] = {user: totals[user] for user in users}
    return result


def test_killed_driver_restarts_to_exact_output(tmp_path):
    files = _write_inputs(tmp_path, 4)
    # Dies after the tasks wrote their blobs, before output and commit.
    assert _run(tmp_path, 2, die_at="tasks_done:1") == 41
    # Restarted at 3: dies after committing batch 2, before Spark records it as done.
    assert _run(tmp_path, 3, die_at="committed:2") == 41
    # Restarted at 1: replays batch 2 from the checkpoint before it, then finishes.
    assert _run(tmp_path, 1) == 0
    assert _outputs(tmp_path) == _expected(files)
