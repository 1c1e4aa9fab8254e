"""On a real cluster: a Spark standalone master and two workers on loopback, rescaled 2 -> 3.

One application (a SparkSession in a driver process of its own, with an
executor on each worker) runs the query twice, at parallelism 2 and then,
restarted, at 3: each run appends events to a ``replayable`` log and then
processes everything in it with ``keyed(events, "user", name="clicks").count()``.
The instances at 3 are new (no resident state: an instance's state is that
of its key-group range) and are restored from the store. The log and the state
store live on S3 (SeaweedFS, ``tests/s3_server.py``); no local directory is
shared between the processes of the cluster (each has its own scratch
space, and Spark's checkpoint is read and written by the driver alone), and
a local state store is refused on this master. After every run the output
must be exact (every key's count grows by exactly the rows each batch
consumed, and ends at the model's), the instances must have run in both
executors (two JVMs, each with its own Python workers), and the first batch
after the restart must have read exactly the restore plan of each instance:
only its own key groups. (Scaling down, to one instance reading the whole
state, is ``test_remote_storage_spark``'s 2 -> 3 -> 1 on S3 in local mode;
a restart in a new driver process, ``test_driver_kill`` and the campaign's.
A third run here, or a second application, cost the suite 25-40 s of its ten
minutes each.)
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.restore import plan_instance_restore
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
    """The log, state store and Spark checkpoint of one logical job, run by one application of ``driver``."""

    def __init__(self, driver: Driver, root: Path, s3_server, bucket: str):
        self.driver = driver
        self.root = root
        prefix = f"cluster-{root.name}"
        self.log = s3_server.uri(bucket, f"{prefix}/events")
        self.store = s3_server.uri(bucket, f"{prefix}/state")
        self.rows: list[str] = []
        self.outputs: dict[int, dict[str, int]] = {}

    @staticmethod
    def events(n: int, keys: int, salt: int) -> list[str]:
        """``n`` events over ``keys`` users."""
        return [f"u{(i * 7 + salt) % keys}" for i in range(n)]

    def run(self, *runs: dict) -> dict:
        """One application that runs the query once per ``runs`` entry (``parallelism``, ``append``: users to
        append first, optionally ``try_local_store``); its result, with every run's output recorded."""
        result = self.driver.run(
            {
                "log": self.log,
                "component": COMPONENT,
                "store": self.store,
                "checkpoint": str(self.root / "chk"),
                "runs": list(runs),
                # Unbounded, so a restore reads its plan at once (bounded, the default on a cluster, it reads each
                # key group as rows touch it).
                "conf": {"spark.state.residentMemory": "none"},
            },
            timeout=120.0 * len(runs),
        )
        for run, outcome in zip(runs, result["runs"], strict=True):
            self.rows += run["append"]
            for batch_id, rows in outcome["outputs"].items():
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

    def restore_bytes(self, checkpoint_id: int, parallelism: int) -> dict[int, int]:
        """Per instance at ``parallelism``: the bytes its restore plan reads from checkpoint ``checkpoint_id``."""
        component = open_manifest_log(self.store).load(checkpoint_id).components[COMPONENT]
        return {j: plan_instance_restore(component, j, parallelism).bytes_to_read for j in range(parallelism)}


def executors_of(cluster: StandaloneCluster, app_id: str, run: dict) -> set[str]:
    """The executors (``worker-k/<app id>/<executor id>``) whose processes reported instances in ``run``."""
    found = set()
    for pid, directory in run["process_dirs"].items():
        assert directory is not None, f"instance process {pid} exited before the driver looked it up"
        path = Path(directory)
        assert path.parent.name == app_id, f"pid {pid} ran in {path}, not in an executor of this app"
        assert path.parent.parent in cluster.work_dirs, f"pid {pid} ran in {path}, outside every worker"
        found.add(str(path.relative_to(path.parent.parent.parent)))
    return found


def first_batch_reads(result: dict) -> dict[int, int]:
    return {m["instance"]: m["restore"]["bytes_read"] for m in result["batches"][0]["instances"]}


def test_rescale_2_3_across_executors_on_s3_gives_exact_output(cluster, driver, tmp_path, s3_server, s3_bucket):
    job = ClusterJob(driver, tmp_path, s3_server, s3_bucket)
    result = job.run(
        {
            "parallelism": 2,
            "append": job.events(600, keys=90, salt=0),
            "try_local_store": str(tmp_path / "local-state"),
        },
        {"parallelism": 3, "append": job.events(600, keys=120, salt=2)},
    )
    job.check_exact()
    first, second = result["runs"]
    assert "on local disk, but the master" in first["local_store_refused"]
    assert [b["parallelism"] for b in first["batches"]] == [2, 2]
    assert len(executors_of(cluster, result["app_id"], first)) == 2
    assert first_batch_reads(first) == {0: 0, 1: 0}  # nothing to restore yet

    # Restarted at 3: every instance read its own key groups of the first run's last checkpoint, a part of it.
    assert [b["parallelism"] for b in second["batches"]] == [3, 3]
    assert [b["batch_id"] for b in second["batches"]] == [2, 3]
    planned = job.restore_bytes(first["batches"][-1]["checkpoint_id"], 3)
    whole = job.restore_bytes(first["batches"][-1]["checkpoint_id"], 1)[0]
    assert all(0 < planned[i] < whole for i in range(3)) and sum(planned.values()) == whole
    assert first_batch_reads(second) == planned
    assert len(executors_of(cluster, result["app_id"], second)) == 2
