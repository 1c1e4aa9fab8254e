"""End-to-end on remote storage: state and the ``replayable`` log on S3 (SeaweedFS), Spark's checkpoint on WebHDFS.

The S3 jobs read a ``replayable`` log that lives on S3 too, at most 200
records per micro-batch, and count per key. Their output is checked exactly
by accounting: in every batch, each key's count grows by the rows of that key
the batch consumed, so over all batches the increments must add up to the
rows appended (nothing counted twice, nothing lost) and the last count of
every key must equal the model's.
"""

from __future__ import annotations

from collections import Counter

import pytest

from spark_state import keyed
from spark_state.driver.conf import S3_KEYS
from spark_state.errors import BucketNotFoundError, StorageAccessError
from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.restore import plan_instance_restore
from tests.s3_server import WRONG_SECRET_PROFILE

pytestmark = pytest.mark.spark

COMPONENT = "clicks"


@pytest.fixture(autouse=True)
def _clean_conf(spark):
    yield
    for key in ("spark.state.parallelism", "spark.state.store", "spark.state.maxParallelism", *S3_KEYS):
        spark.conf.unset(key)


class LogJob:
    """A keyed count over a ``replayable`` log on S3 with its state on S3; Spark's checkpoint on local disk."""

    def __init__(self, spark, s3_server, s3_bucket, root, tmp_path):
        self.spark = spark
        self.log = s3_server.uri(s3_bucket, f"{root}/events")
        self.store = f"s3://{s3_bucket}/{root}/state"  # the endpoint comes from spark.state.s3.* settings
        self.settings = {"spark.state.s3.endpoint": s3_server.endpoint, "spark.state.s3.pathStyle": "true"}
        self.checkpoint = str(tmp_path / "chk")
        self.rows: list[str] = []
        self.outputs: dict[int, dict[str, int]] = {}
        self.on_batch = None
        self.max_records_per_batch = 200

    def store_uri(self) -> str:
        return f"{self.store}?endpoint={self.settings['spark.state.s3.endpoint']}&path_style=true"

    def append(self, n: int, keys: int, salt: int) -> None:
        """``n`` rows over the users ``u0`` .. ``u<keys - 1>``."""
        users = [f"u{(i * 7 + salt) % keys}" for i in range(n)]
        (
            self.spark.createDataFrame([(u,) for u in users], "user string")
            .write.format("replayable")
            .mode("append")
            .option("numSplits", 2)
            .option("keyColumn", "user")
            .save(self.log)
        )
        self.rows += users

    def sink(self, out, batch_id: int) -> None:
        self.outputs[batch_id] = {r["user"]: r["count"] for r in out.collect()}  # runs the batch's tasks
        if self.on_batch is not None:
            self.on_batch(batch_id)

    def start(self, parallelism: int, **settings: str):
        self.spark.conf.set("spark.state.parallelism", str(parallelism))
        self.spark.conf.set("spark.state.store", self.store)
        for key, value in {**self.settings, **settings}.items():
            self.spark.conf.set(key, value)
        events = (
            self.spark.readStream.format("replayable")
            .option("maxRecordsPerBatch", self.max_records_per_batch)
            .load(self.log)
        )
        return (
            keyed(events, "user", name=COMPONENT)
            .count()
            .writeStream.foreachBatch(self.sink)
            .option("checkpointLocation", self.checkpoint)
            .trigger(availableNow=True)
            .start()
        )

    def run(self, parallelism: int, **settings: str):
        query = self.start(parallelism, **settings)
        try:
            query.awaitTermination()
        finally:
            query.stop()
        return query

    def check_exact(self) -> None:
        latest: dict[str, int] = {}
        consumed = 0
        for batch_id in sorted(self.outputs):
            for user, count in self.outputs[batch_id].items():
                assert count > latest.get(user, 0), f"batch {batch_id}: {user} went from {latest.get(user)} to {count}"
                consumed += count - latest.get(user, 0)
                latest[user] = count
        assert consumed == len(self.rows)
        assert latest == dict(Counter(self.rows))

    def restore_plans(self, parallelism: int) -> tuple[dict, list[int]]:
        """Each new instance's restore plan, and the sizes of the instance items every one of them reads."""
        component = open_manifest_log(self.store_uri()).latest().components[COMPONENT]
        items = [ref.size for ref in component.instance_items.values()]
        return {j: plan_instance_restore(component, j, parallelism) for j in range(parallelism)}, items


@pytest.fixture
def job(spark, s3_server, s3_bucket, tmp_path, request):
    return LogJob(spark, s3_server, s3_bucket, f"{request.node.name[:40]}-{id(tmp_path) % 10**6}", tmp_path)


def _first_batch_wire(query) -> dict[int, dict]:
    return {m["instance"]: m["restore"] for m in query.batches[0]["instances"]}


def _check_restore_reads(query, plans: dict, items: list[int]) -> None:
    """The first batch's instances read exactly their restore plans (counted by the S3 backend), amplification <= 1.05.

    An instance whose state its host still holds reads only what differs.
    """
    for instance, restore in _first_batch_wire(query).items():
        plan, wire = plans[instance], restore["storage"]
        if restore["resident"]:
            # A failed attempt's instance host kept the state: the catch-up reads again only the key groups that
            # attempt changed without committing, never more than a cold restore.
            assert 0 < wire["bytes_read"] <= plan.bytes_to_read + sum(items), (instance, wire, plan.bytes_to_read)
            continue
        assert plan.bytes_owned > 0
        assert wire["bytes_read"] == plan.bytes_to_read + sum(items), (instance, wire, plan.bytes_to_read)
        assert plan.bytes_owned <= plan.bytes_to_read <= 1.05 * plan.bytes_owned, (instance, plan)
        assert wire["requests.GetObject"] == len(plan.reads) + len(items), (instance, wire)
        assert wire["requests"] == wire["requests.GetObject"]  # a restore only reads ranges


def test_state_and_log_on_s3_rescale_2_3_1_through_a_store_outage_with_exact_output(job, spark, s3_server):
    """400 keys in 16 key groups, then batches over 60 of them; the store stops in the middle of the last batch.

    With 16 key groups and batches that change few keys of each, restores
    read whole entries: tiny entries, or batches that rewrite most keys of a
    key group, would make the few KB a restore reads between two owned
    entries (to save a request) weigh more than the entries themselves.
    """
    spark.conf.set("spark.state.maxParallelism", "16")
    job.max_records_per_batch = 10_000
    job.append(400, keys=400, salt=0)
    first = job.run(2)
    assert [b["parallelism"] for b in first.batches] == [2]
    job.check_exact()
    assert spark.read.format("replayable").load(job.log).count() == 400  # the log reads back on s3:// too

    job.append(200, keys=60, salt=1)
    plans, items = job.restore_plans(3)
    rescaled = job.run(3)
    assert [b["parallelism"] for b in rescaled.batches] == [3]
    job.check_exact()
    _check_restore_reads(rescaled, plans, items)

    # The store stops after the tasks wrote their blobs, before the driver commits: the batch fails, typed.
    job.append(200, keys=60, salt=2)
    committed = open_manifest_log(job.store_uri()).ids()
    job.on_batch = lambda batch_id: s3_server.stop()
    query = job.start(1, **{"spark.state.s3.retrySeconds": "1"})
    try:
        with pytest.raises(Exception, match="StorageUnavailableError") as error:
            query.awaitTermination()
        assert "'checkpoints" in str(error.value) and "retried for at most 1 s" in str(error.value)
    finally:
        query.stop()
        s3_server.start()
    job.on_batch = None
    assert open_manifest_log(job.store_uri()).ids() == committed  # nothing was committed

    # Started again, the query replays the batch at parallelism 1, from the last committed checkpoint.
    plans, items = job.restore_plans(1)
    resumed = job.run(1, **{"spark.state.s3.retrySeconds": "1"})
    assert [b["parallelism"] for b in resumed.batches] == [1]
    job.check_exact()
    _check_restore_reads(resumed, plans, items)
    assert open_manifest_log(job.store_uri()).latest().checkpoint_id > committed[-1]


def _generated(spark):
    return spark.readStream.format("replayable").option("generator", "keyed").option("rowsPerSplit", 10).load()


def test_a_missing_bucket_fails_at_query_start_naming_it(spark, s3_server, tmp_path):
    spark.conf.set("spark.state.store", "s3://no-such-bucket/state")
    spark.conf.set("spark.state.s3.endpoint", s3_server.endpoint)
    spark.conf.set("spark.state.s3.pathStyle", "true")
    writer = keyed(_generated(spark), "key", name=COMPONENT).count().writeStream.foreachBatch(lambda df, i: None)
    with pytest.raises(BucketNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        writer.option("checkpointLocation", str(tmp_path / "chk")).start()
    assert not spark.streams.active


def test_wrong_credentials_fail_at_query_start_saying_so(spark, s3_server, s3_bucket, tmp_path):
    spark.conf.set("spark.state.store", f"s3://{s3_bucket}/wrong-credentials")
    spark.conf.set("spark.state.s3.endpoint", s3_server.endpoint)
    spark.conf.set("spark.state.s3.pathStyle", "true")
    spark.conf.set("spark.state.s3.profile", WRONG_SECRET_PROFILE)
    writer = keyed(_generated(spark), "key", name=COMPONENT).count().writeStream.foreachBatch(lambda df, i: None)
    with pytest.raises(StorageAccessError, match="refused the credentials") as error:
        writer.option("checkpointLocation", str(tmp_path / "chk")).start()
    assert "SignatureDoesNotMatch" in str(error.value) and s3_server.secret not in str(error.value)
    assert not spark.streams.active


def test_checkpoint_location_on_webhdfs_with_the_default_store_beside_it(spark, tmp_path):
    """Spark writes its own checkpoint through Hadoop's WebHdfsFileSystem; the state goes to <location>/state."""
    from tests.test_keyed_spark import Job
    from tests.webhdfs_server import WebHdfsServer

    job = Job(spark, tmp_path)
    with WebHdfsServer(str(tmp_path / "namenode"), label_json=False) as server:
        location = server.url.replace("http://", "webhdfs://") + "/chk/clicks"

        def run(parallelism):
            spark.conf.set("spark.state.parallelism", str(parallelism))
            query = (
                keyed(job.stream(), "user", name="clicks")
                .count()
                .writeStream.foreachBatch(job.sink)
                .option("checkpointLocation", location)
                .trigger(availableNow=True)
                .start()
            )
            try:
                query.awaitTermination()
            finally:
                query.stop()
            return query

        job.add_batch(200, keys=40, salt=0)
        job.add_batch(200, keys=40, salt=1)
        run(2)
        job.add_batch(200, keys=50, salt=2)
        rescaled = run(3)
        assert job.outputs == job.expected()
        assert sum(i["restore"]["bytes_read"] for i in rescaled.batches[0]["instances"]) > 0
        written = {
            (r.op, r.path.split("/chk/clicks/")[-1].split("/")[0])
            for r in server.requests
            if r.op in ("CREATE", "RENAME") and "/chk/clicks/" in r.path
        }
        assert {("RENAME", "offsets"), ("RENAME", "commits"), ("CREATE", "state")} <= written
        assert open_manifest_log(f"{location}/state").latest().components["clicks"].parallelism == 3
