"""On a real cluster: a Spark standalone master and two workers on loopback, rescaled 2 -> 3 -> 1.

Each run is a new application (a new SparkSession in the driver process, so
new executors with no resident state) that processes every available input
file with ``keyed(df, "user", name="clicks").count()``. The state store is a
local directory that the driver and both executors share (one machine).
After every run the output of every batch must equal the Python model, the
instances must have run in both executors (two JVMs, each with its own
Python workers), and the first batch after a restart must have read exactly
the restore plan of each instance: only its own key groups.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_state.manifestlog import open_manifest_log
from spark_state.restore import plan_restore
from tests.cluster import Driver, StandaloneCluster

pytestmark = pytest.mark.cluster

SCHEMA = "user string, amount long"
COMPONENT = "clicks"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = StandaloneCluster(tmp_path_factory.mktemp("cluster"), workers=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def driver(cluster, tmp_path):
    driver = Driver(cluster, tmp_path / "driver")
    try:
        yield driver
    finally:
        driver.close()


class ClusterJob:
    """Input files, state store and Spark checkpoint of one logical job, each run an application of ``driver``."""

    def __init__(self, driver: Driver, root: Path):
        self.driver = driver
        self.root = root
        self.input = root / "input"
        self.input.mkdir(parents=True)
        self.store = root / "state"
        self.files: list[list[str]] = []
        self.outputs: dict[int, dict[str, int]] = {}

    def add_batch(self, n: int, keys: int, salt: int) -> None:
        users = [f"u{(i * 7 + salt) % keys}" for i in range(n)]
        index = len(self.files)
        path = self.input / f"part-{index:05d}.parquet"
        pq.write_table(pa.table({"user": users, "amount": [i % 5 + 1 for i in range(n)]}), path)
        # The file source takes files in modification-time order: make it the batch order.
        os.utime(path, (1_700_000_000 + index, 1_700_000_000 + index))
        self.files.append(users)

    def expected(self) -> dict[int, dict[str, int]]:
        """Per batch id: the running count of every user seen in that batch."""
        totals: Counter = Counter()
        result = {}
        for batch_id, users in enumerate(self.files):
            totals.update(users)
            result[batch_id] = {user: totals[user] for user in users}
        return result

    def run(self, parallelism: int) -> dict:
        """One application: everything available at ``parallelism``; returns the driver's result."""
        result = self.driver.run(
            {
                "parallelism": parallelism,
                "input": str(self.input),
                "schema": SCHEMA,
                "component": COMPONENT,
                "store": str(self.store),
                "checkpoint": str(self.root / "chk"),
            }
        )
        for batch_id, rows in result["outputs"].items():
            self.outputs[int(batch_id)] = rows
        return result

    def restore_bytes(self, parallelism: int) -> dict[int, int]:
        """Per instance at ``parallelism``: the bytes its restore plan reads from the latest checkpoint."""
        component = open_manifest_log(str(self.store)).latest().components[COMPONENT]
        return {plan.instance: plan.bytes_to_read for plan in plan_restore(component, parallelism)}


def executors_of(cluster: StandaloneCluster, result: dict) -> set[str]:
    """The executors (``worker-k/<app id>/<executor id>``) whose processes reported instances in ``result``."""
    found = set()
    for pid, directory in result["process_dirs"].items():
        assert directory is not None, f"instance process {pid} exited before the driver looked it up"
        path = Path(directory)
        assert path.parent.name == result["app_id"], f"pid {pid} ran in {path}, not in an executor of this app"
        assert path.parent.parent in cluster.work_dirs, f"pid {pid} ran in {path}, outside every worker"
        found.add(str(path.relative_to(path.parent.parent.parent)))
    return found


def first_batch_reads(result: dict) -> dict[int, int]:
    return {m["instance"]: m["restore"]["bytes_read"] for m in result["batches"][0]["instances"]}


def test_rescale_2_3_1_across_executors_gives_exact_output(cluster, driver, tmp_path):
    job = ClusterJob(driver, tmp_path)

    job.add_batch(400, keys=90, salt=0)
    job.add_batch(400, keys=90, salt=1)
    first = job.run(2)
    assert [b["parallelism"] for b in first["batches"]] == [2, 2]
    assert job.outputs == job.expected()
    assert len(executors_of(cluster, first)) == 2
    assert first_batch_reads(first) == {0: 0, 1: 0}  # nothing to restore yet

    # Scale up to 3: every instance reads its own key groups, which are part of the state.
    job.add_batch(300, keys=120, salt=2)
    job.add_batch(300, keys=120, salt=3)
    planned = job.restore_bytes(3)
    whole = job.restore_bytes(1)[0]
    assert all(0 < planned[i] < whole for i in range(3)) and sum(planned.values()) == whole
    second = job.run(3)
    assert [b["parallelism"] for b in second["batches"]] == [3, 3]
    assert [b["batch_id"] for b in second["batches"]] == [2, 3]
    assert first_batch_reads(second) == planned
    assert job.outputs == job.expected()
    assert len(executors_of(cluster, second)) == 2

    # Scale down to 1: the only instance reads the whole state.
    job.add_batch(200, keys=150, salt=4)
    whole = job.restore_bytes(1)[0]
    third = job.run(1)
    assert [b["parallelism"] for b in third["batches"]] == [1]
    assert first_batch_reads(third) == {0: whole} and whole > 0
    assert job.outputs == job.expected()
    assert len(executors_of(cluster, third)) == 1
    assert len({first["app_id"], second["app_id"], third["app_id"]}) == 3
