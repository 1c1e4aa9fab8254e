"""The driver process is killed at each step of the micro-batch protocol, then restarted.

Each run is a separate driver process (``tests/driver_job.py``) that dies
with ``os._exit`` (no cleanup, no finally blocks) at the chosen step, or is
SIGKILLed with its whole process tree while Spark writes its first offsets
entry; the restart, possibly at another parallelism, must produce exactly the
output of a run without the crash.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_state.storage.local import LocalStorage
from spark_state.store.stops import stopped_run
from tests.files import publish
from tests.kills import kill_when_created

pytestmark = pytest.mark.spark

JOB = Path(__file__).with_name("driver_job.py")
FIRST_OFFSETS_TEMP = r"\.0\.[0-9a-f-]{36}\.tmp"


def _write_inputs(work: Path, batches: int) -> list[list[str]]:
    (work / "input").mkdir(parents=True)
    files = []
    for index in range(batches):
        users = [f"u{(i * 11 + index) % 37}" for i in range(200)]
        path = work / "input" / f"part-{index:05d}.parquet"
        publish(pa.table({"user": users, "amount": [1] * len(users)}), path, index)
        files.append(users)
    return files


def _command(work: Path, parallelism: int, die_at: str | None = None, function: str = "count") -> list[str]:
    command = [sys.executable, str(JOB), str(work), str(parallelism), "--function", function]
    return command + (["--die-at", die_at] if die_at else [])


def _env() -> dict:
    return dict(os.environ, PYSPARK_PYTHON=sys.executable)


def _run(work: Path, parallelism: int, die_at: str | None = None, function: str = "count") -> int:
    return _run_logged(work, parallelism, die_at, function).returncode


def _run_logged(work: Path, parallelism: int, die_at: str | None = None, function: str = "count"):
    return subprocess.run(
        _command(work, parallelism, die_at, function), env=_env(), capture_output=True, text=True, timeout=300
    )


def _kill_during_first_offsets_write(work: Path, function: str) -> list[str]:
    """Start the job and SIGKILL its process tree while Spark writes ``offsets/0``; return what is left there."""
    offsets = work / "chk" / "offsets"
    offsets.mkdir(parents=True)  # an empty offsets/ is a valid start; it lets inotify watch it from the start
    process = subprocess.Popen(
        _command(work, 2, function=function),
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert kill_when_created(process, str(offsets), FIRST_OFFSETS_TEMP, timeout=240) is not None
    return sorted(os.listdir(offsets))


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


def _matches_some_batching(outputs: dict[int, dict[str, int]], files: list[list[str]]) -> bool:
    """Whether each batch's output is the running count after a growing prefix of files, ending with all.

    A file source logs the files of a batch before Spark writes the batch's
    offsets, so a driver killed in between restarts with batch boundaries of
    its own choosing; the counts must still be exact at every boundary.
    """
    totals: Counter = Counter()
    consumed = 0
    for batch_id in sorted(outputs):
        seen: set[str] = set()
        while consumed < len(files):
            totals.update(files[consumed])
            seen.update(files[consumed])
            consumed += 1
            if outputs[batch_id] == {user: totals[user] for user in seen}:
                break
        else:
            return False
    return consumed == len(files)


def test_killed_driver_restarts_to_exact_output_and_a_script_that_exits_at_once_records_its_stop(tmp_path):
    files = _write_inputs(tmp_path, 4)
    # Dies after batch 0's tasks wrote their blobs and its output, before the commit: offsets/0 is complete.
    assert _run(tmp_path, 2, die_at="output_written:0") == 41
    first = (tmp_path / "chk" / "offsets" / "0").read_bytes()
    # Restarted at 3: replays batch 0 from its complete offsets entry (never repaired: only a first write's
    # leftovers are), then dies after committing batch 2, before Spark records it as done.
    restarted = _run_logged(tmp_path, 3, die_at="committed:2")
    assert restarted.returncode == 41, restarted.stderr[-3000:]
    assert "removed" not in restarted.stderr
    assert (tmp_path / "chk" / "offsets" / "0").read_bytes() == first
    # Restarted at 1: replays batch 2 from the checkpoint before it, then finishes. This driver awaits the raw
    # ``StreamingQuery`` and exits at once, as many scripts do (no ``StatefulQuery`` call records the stop, and
    # the session is not stopped): the run is recorded as stopped before the driver exits, and Spark logs no
    # error about a listener whose driver went away.
    finished = subprocess.run(
        _command(tmp_path, 1) + ["--raw-exit"], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    (run_id,) = re.findall(r"^run (\S+)$", finished.stdout, re.MULTILINE)
    assert stopped_run(LocalStorage(str(tmp_path / "state"))) == run_id
    assert "Listener" not in finished.stderr and "ERROR" not in finished.stderr, finished.stderr[-3000:]
    assert _outputs(tmp_path) == _expected(files)


@pytest.mark.parametrize("function", ["count"])  # the repair happens at start(), before any function runs
def test_a_driver_killed_while_writing_its_first_offsets_restarts_by_itself(tmp_path, function):
    files = _write_inputs(tmp_path, 3)
    left = _kill_during_first_offsets_write(tmp_path, function)
    if "0" in left:  # the kill landed after Spark's rename: one more try on a fresh directory
        work = tmp_path / "again"
        files = _write_inputs(work, 3)
        left = _kill_during_first_offsets_write(work, function)
    else:
        work = tmp_path
    assert left and all(re.fullmatch(r"\.?" + FIRST_OFFSETS_TEMP + r"(\.crc)?", name) for name in left), left
    restarted = _run_logged(work, 3, function=function)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    removed = next((line for line in restarted.stderr.splitlines() if "first micro-batch's offsets" in line), "")
    assert "removed " in removed and all(name in removed for name in left), restarted.stderr[-3000:]
    assert _matches_some_batching(_outputs(work), files)
    assert not _matches_some_batching({**_outputs(work), 99: {"u0": 1}}, files)  # the check can fail
