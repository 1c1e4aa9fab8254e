"""On a real cluster: a Spark standalone master and two workers on loopback, rescaled 2 -> 3.

Each run is a new application (a new SparkSession in the driver process, so
new executors with no resident state) that appends events to a
``replayable`` log and then processes everything in it with
``keyed(events, "user", name="clicks").count()``. The log and the state
store live on S3 (SeaweedFS, ``tests/s3_server.py``); no local directory is
shared between the processes of the cluster (each has its own scratch
space, and Spark's checkpoint is read and written by the driver alone), and
a local state store is refused on this master. After every run the output
must be exact (every key's count grows by exactly the rows each batch
consumed, and ends at the model's), the instances must have run in both
executors (two JVMs, each with its own Python workers), and the first batch
after a restart must have read exactly the restore plan of each instance:
only its own key groups. (Scaling down, to one instance reading the whole
state, is ``test_remote_storage_spark``'s 2 -> 3 -> 1 on S3 in local mode: a
third application here cost the suite 35-40 s of its ten minutes.)
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spark_state.manifestlog import open_manifest_log
from spark_state.resident import CATCH_UP_MAX_GAP_BYTES
from spark_state.restore import plan_instance_restore
from tests.cluster import Driver, StandaloneCluster

pytestmark = pytest.mark.cluster

COMPONENT = "clicks"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server):
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
    """The log, state store and Spark checkpoint of one logical job, each run an application of ``driver``."""

    def __init__(self, driver: Driver, root: Path, s3_server, bucket: str):
        self.driver = driver
        self.root = root
        prefix = f"cluster-{root.name}"
        self.log = s3_server.uri(bucket, f"{prefix}/events")
        self.store = s3_server.uri(bucket, f"{prefix}/state")
        self.rows: list[str] = []
        self.outputs: dict[int, dict[str, int]] = {}

    def run(self, parallelism: int, n: int, keys: int, salt: int, **extra) -> dict:
        """One application: append ``n`` events over ``keys`` users, then count everything at ``parallelism``."""
        users = [f"u{(i * 7 + salt) % keys}" for i in range(n)]
        result = self.driver.run(
            {
                "parallelism": parallelism,
                "log": self.log,
                "append": users,
                "component": COMPONENT,
                "store": self.store,
                "checkpoint": str(self.root / "chk"),
                **extra,
            }
        )
        self.rows += users
        for batch_id, rows in result["outputs"].items():
            self.outputs[int(batch_id)] = rows
        return result

    def check_exact(self) -> None:
        """Every batch's output grows each key's count by the rows it consumed; the totals are the model's."""
        latest: dict[str, int] = {}
        consumed = 0
        for batch_id in sorted(self.outputs):
            for user, count in self.outputs[batch_id].items():
                assert count > latest.get(user, 0), f"batch {batch_id}: {user} from {latest.get(user)} to {count}"
                consumed += count - latest.get(user, 0)
                latest[user] = count
        assert consumed == len(self.rows)
        assert latest == dict(Counter(self.rows))

    def restore_bytes(self, parallelism: int) -> dict[int, int]:
        """Per instance at ``parallelism``: the bytes its restore plan reads from the latest checkpoint."""
        component = open_manifest_log(self.store).latest().components[COMPONENT]
        return {j: plan_instance_restore(component, j, parallelism, max_gap_bytes=CATCH_UP_MAX_GAP_BYTES).bytes_to_read
                for j in range(parallelism)}


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


def test_rescale_2_3_across_executors_on_s3_gives_exact_output(cluster, driver, tmp_path, s3_server, s3_bucket):
    job = ClusterJob(driver, tmp_path, s3_server, s3_bucket)

    first = job.run(2, 600, keys=90, salt=0, try_local_store=str(tmp_path / "local-state"))
    assert "on local disk, but the master" in first["local_store_refused"]
    assert [b["parallelism"] for b in first["batches"]] == [2, 2]
    job.check_exact()
    assert len(executors_of(cluster, first)) == 2
    assert first_batch_reads(first) == {0: 0, 1: 0}  # nothing to restore yet

    # Scale up to 3: every instance reads its own key groups, which are part of the state.
    planned = job.restore_bytes(3)
    whole = job.restore_bytes(1)[0]
    assert all(0 < planned[i] < whole for i in range(3)) and sum(planned.values()) == whole
    second = job.run(3, 600, keys=120, salt=2)
    assert [b["parallelism"] for b in second["batches"]] == [3, 3]
    assert [b["batch_id"] for b in second["batches"]] == [2, 3]
    assert first_batch_reads(second) == planned
    job.check_exact()
    assert len(executors_of(cluster, second)) == 2
    assert first["app_id"] != second["app_id"]
