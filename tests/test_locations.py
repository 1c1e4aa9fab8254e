"""A location is its identity, not its spelling; S3 settings reach every entry point; messages name locations
well; a typed error survives Spark's wrapping (``storage.location_identity``, ``store.sources``,
``datasources.s3_defaults``, ``errors.typed_error``)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

from datasources.options import log_source_id, offsets_from_json
from spark_state.errors import ConfigError, CorruptBlobError, typed_error
from spark_state.storage import location_identity
from spark_state.store.sources import canonical_source_id, canonical_sources

SAME_LOG = [
    "s3://events-bucket/logs/events?endpoint=http://127.0.0.1:8333&path_style=true",
    "s3://events-bucket/logs/events?path_style=true&endpoint=http://127.0.0.1:8333",
    "s3a://events-bucket/logs/events/",
    "s3://events-bucket/logs/events?pathStyle=true",
    "S3://events-bucket/logs/events",
]


def test_every_spelling_of_one_s3_location_has_one_identity():
    assert {location_identity(uri) for uri in SAME_LOG} == {"s3://events-bucket/logs/events"}
    assert len({log_source_id(uri) for uri in SAME_LOG}) == 1


def test_local_and_webhdfs_locations_have_one_identity_each(tmp_path):
    assert location_identity(str(tmp_path / "log")) == location_identity(f"file://{tmp_path}/log/")
    assert location_identity("hdfs://nn:9870/data/log/?user=alice") == location_identity("webhdfs://NN:9870/data/log")
    assert location_identity("memory://name") == "memory://name"
    assert location_identity("gs://not/a/backend/") == "gs://not/a/backend"  # never raises: it reads records


def test_a_checkpoint_recorded_under_another_spelling_reads_as_the_same_source():
    """Existing checkpoints (ids recorded as the URI was spelled) keep working: ids compare canonical."""
    old = "replayable:" + SAME_LOG[0]
    recorded = {old: {"source_id": old, "0": 40, "1": 12}}
    assert canonical_sources(recorded) == {
        log_source_id(SAME_LOG[2]): {"source_id": log_source_id(SAME_LOG[2]), "0": 40, "1": 12}
    }
    assert offsets_from_json(recorded[old], "offsets", source_id=log_source_id(SAME_LOG[3])) == {0: 40, 1: 12}
    with pytest.raises(ConfigError, match="another source"):
        offsets_from_json(recorded[old], "offsets", source_id=log_source_id("s3://events-bucket/logs/other"))
    assert canonical_source_id("spark-source-0") == "spark-source-0"


def test_an_s3_uri_in_a_message_names_the_path_before_the_endpoint():
    from spark_state.storage.s3 import S3Storage
    from spark_state.storage.s3_location import parse

    storage = S3Storage(parse("s3://events-bucket/state?endpoint=http://127.0.0.1:1&path_style=true"))
    assert storage.describe("blobs/c/1.arrow") == "s3://events-bucket/state/blobs/c/1.arrow at http://127.0.0.1:1"


def test_typed_error_finds_ours_in_spark_s_wrapping_text():
    class Wrapped(Exception):
        pass

    text = (
        "[STREAM_FAILED] Query terminated with exception: ... Traceback (most recent call last):\n"
        '  File "x.py", line 1\nspark_state.errors.CorruptBlobError: blob s3://b/state/blobs/c/1.arrow fails its '
        "checksum\n"
    )
    found = typed_error(Wrapped(text))
    assert isinstance(found, CorruptBlobError) and "fails its checksum" in str(found)
    assert isinstance(found.__cause__, Wrapped)
    assert typed_error(ValueError("no error of ours")) is None
    inner = ConfigError("typed")
    try:
        raise RuntimeError("wrapper") from inner
    except RuntimeError as outer:
        assert typed_error(outer) is inner


@pytest.mark.spark
def test_a_log_on_s3_is_the_same_source_however_its_uri_is_spelled_and_the_settings_reach_every_entry_point(
    spark, s3_server, s3_bucket, tmp_path
):
    """One query, restarted with the log's URI spelled another way each time (parameters reordered, ``s3a://``
    and a trailing '/', the endpoint moved into the session's settings): every restart continues exactly. Then
    the state reader and the CLI reach the store with the settings alone."""
    import datasources
    from spark_state import keyed
    from spark_state.ops.cli import cli

    prefix = f"{tmp_path.name}"
    endpoint = s3_server.endpoint
    spellings = [
        f"s3://{s3_bucket}/{prefix}/events?endpoint={endpoint}&path_style=true",
        f"s3://{s3_bucket}/{prefix}/events?path_style=true&endpoint={endpoint}",
        f"s3a://{s3_bucket}/{prefix}/events/?pathStyle=true&endpoint={endpoint}",
        f"s3://{s3_bucket}/{prefix}/events",  # the endpoint from spark.state.s3.* (datasources.register)
    ]
    store = f"s3://{s3_bucket}/{prefix}/state"
    totals: dict[str, int] = {}
    outputs: dict[int, dict[str, int]] = {}
    try:
        spark.conf.set("spark.state.s3.endpoint", endpoint)
        spark.conf.set("spark.state.s3.pathStyle", "true")
        spark.conf.set("spark.state.store", store)
        datasources.register(spark)  # the session's S3 settings for the sources' s3:// locations
        for run, log in enumerate(spellings):
            rows = [f"u{(i * 3 + run) % 11}" for i in range(60)]
            spark.createDataFrame([(u,) for u in rows], "user string").write.format("replayable").mode("append").option(
                "keyColumn", "user"
            ).save(spellings[0])
            for user in rows:
                totals[user] = totals.get(user, 0) + 1
            events = spark.readStream.format("replayable").option("path", log).load()
            query = (
                keyed(events, "user", name="counts")
                .count()
                .writeStream.foreachBatch(
                    lambda df, b: outputs.update({b: {r["user"]: r["count"] for r in df.collect()}})
                )
                .option("checkpointLocation", str(tmp_path / "chk"))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination()
            latest: dict[str, int] = {}
            for batch in sorted(outputs):
                latest.update(outputs[batch])
            assert latest == totals, run
        state = spark.read.format("spark-state").option("store", store).option("component", "counts").load()
        assert {r["user"]: r["count"] for r in state.collect()} == totals
    finally:
        for key in ("spark.state.s3.endpoint", "spark.state.s3.pathStyle", "spark.state.store"):
            spark.conf.unset(key)
        datasources.register(spark)
    listed = CliRunner().invoke(cli, ["--endpoint", endpoint, "--path-style", "checkpoints", store, "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["checkpoints"]


@pytest.mark.spark
def test_a_typed_error_raised_in_a_task_is_found_through_the_streaming_query_exception(spark, tmp_path):
    from pyspark.errors import StreamingQueryException

    from spark_state import keyed
    from tests.files import publish

    (tmp_path / "input").mkdir()
    publish(pa.table({"user": ["a", "b"]}), tmp_path / "input" / "part-0.parquet", 0)
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    try:
        events = spark.readStream.schema("user string").parquet(str(tmp_path / "input"))
        query = (
            keyed(events, "user", name="halves")
            .apply(
                lambda key, rows, state: [{"user": key[0], "half": 2.5}],
                state_schema="n long",
                output_schema="user string, half long",
            )
            .writeStream.foreachBatch(lambda df, b: df.collect())
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        with pytest.raises(StreamingQueryException) as raised:
            query.awaitTermination()
    finally:
        spark.conf.unset("spark.state.store")
    found = typed_error(raised.value)
    assert isinstance(found, ConfigError) and "'half' is int64, and 2.5" in str(found)
