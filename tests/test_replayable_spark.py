"""The ``replayable`` format inside Spark: auto-registration, streams, exactly-once, replay, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from datasources.log import ReplayableLog
from datasources.options import log_source_id
from datasources.routing import splits_of_keys
from spark_state.storage.local import LocalStorage

pytestmark = pytest.mark.spark


def write_source_log(spark, path: Path, rows: int, splits: int = 3, segment_rows: int = 400) -> None:
    df = spark.range(0, rows, numPartitions=2).selectExpr(
        "concat('user-', cast(id % 97 as string)) AS key", "id AS value"
    )
    (
        df.write.format("replayable")
        .mode("append")
        .option("path", str(path))
        .option("keyColumn", "key")
        .option("numSplits", str(splits))
        .option("maxRecordsPerSegment", str(segment_rows))
        .save()
    )


def batch_sizes(query) -> list[int]:
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


@pytest.fixture(scope="module")
def small_log(spark, tmp_path_factory):
    """A 3-split log of 900 rows, shared by the read-only tests."""
    path = tmp_path_factory.mktemp("replayable") / "log"
    write_source_log(spark, path, 900)
    return path


def test_stream_honours_max_records_per_batch_under_available_now_and_trims(spark, tmp_path):
    """Also proves auto-registration: the session never registers the format."""
    path = tmp_path / "log"
    write_source_log(spark, path, 900, segment_rows=50)
    query = (
        spark.readStream.format("replayable")
        .option("path", str(path))
        .option("maxRecordsPerBatch", 400)
        .option("maxRecordsPerPartition", 150)
        .option("retention", 0)
        .load()
        .writeStream.format("memory")
        .queryName("replayable_admission")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    query.awaitTermination()
    sizes = batch_sizes(query)
    assert sizes == [400, 400, 100]
    got = spark.sql("SELECT split, offset, value FROM replayable_admission").collect()
    assert len(got) == 900 and len({(r.split, r.offset) for r in got}) == 900
    assert sorted(r.value for r in got) == list(range(900))
    # same key, same split
    by_key = {}
    for row in spark.sql("SELECT key, split FROM replayable_admission").collect():
        by_key.setdefault(row.key, set()).add(row.split)
    assert all(len(s) == 1 for s in by_key.values()) and len(by_key) == 97
    routed = dict(zip(by_key, splits_of_keys(pa.array(list(by_key)), 3).tolist()))
    assert all(splits == {routed[key]} for key, splits in by_key.items())
    # retention 0: commit(end of batch 1) trimmed whole segments below that batch's end
    # (batch 2's commit only arrives when a batch 3 is planned, which availableNow never does)
    log = ReplayableLog.open(LocalStorage(path))
    end_offset = json.loads(query.recentProgress[1]["sources"][0]["endOffset"])
    assert end_offset.pop("source_id") == log_source_id(str(path))  # offsets name their log
    end_of_batch_1 = {int(k): v for k, v in end_offset.items()}
    earliest = log.index().earliest_offsets()
    assert all(end_of_batch_1[s] - 50 < earliest[s] <= end_of_batch_1[s] for s in range(3))
    on_disk = sorted(str(p.relative_to(path)) for p in (path / "data").rglob("*.arrow"))
    assert on_disk == sorted(seg.path for s in log.index().splits for seg in s.segments)


def test_register_gives_both_sources_the_environment_of_the_session_s_python_functions(spark, tmp_path):
    """Spark's own registration hands the sources' tasks another environment, so another pool of Python workers;
    ``datasources.register`` gives them the context's, as PySpark gives every Python function (a keyed query's
    instances among them). A new session: registrations are per session, and the others here keep Spark's."""
    import datasources

    session = spark.newSession()

    def environment_of(name: str) -> dict:
        source = session._jsparkSession.sessionState().dataSourceManager().lookupDataSource(name)
        return dict(source.dataSourceCls().envVars())

    context = dict(session.sparkContext.environment)
    assert environment_of("replayable") != context and environment_of("spark-state") != context
    datasources.register(session)
    datasources.register(session)  # again: harmless
    assert environment_of("replayable") == context and environment_of("spark-state") == context
    path = tmp_path / "log"
    write_source_log(session, path, 200)
    read = session.read.format("replayable").option("path", str(path)).load()
    assert sorted(r.value for r in read.select("value").collect()) == list(range(200))


def test_generator_stream_is_bounded_and_admission_controlled(spark, tmp_path):
    query = (
        spark.readStream.format("replayable")
        .option("generator", "keyed")
        .option("numSplits", 2)
        .option("rowsPerSplit", 1500)
        .option("maxRecordsPerBatch", 2000)
        .load()
        .writeStream.format("memory")
        .queryName("replayable_generated")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    query.awaitTermination()
    assert batch_sizes(query) == [2000, 1000]
    got = spark.sql(
        "SELECT split, count(*) AS n, max(offset) AS top FROM replayable_generated GROUP BY split ORDER BY split"
    )
    assert [tuple(r) for r in got.collect()] == [(0, 1500, 1499), (1, 1500, 1499)]


def crash_once_in_batch(marker: str):
    """A mapInArrow function that raises once (then leaves ``marker``), in the task holding offset 300 of split 0."""

    def crash(batches):
        for b in batches:
            at = zip(b.column("src_split").to_pylist(), b.column("src_offset").to_pylist())
            if (0, 300) in at and not os.path.exists(marker):
                Path(marker).touch()
                raise RuntimeError("injected crash in the middle of a batch")
            yield b

    return crash


def start_pipeline(spark, source: Path, sink: Path, checkpoint: Path, marker: Path):
    stream = (
        spark.readStream.format("replayable")
        .option("path", str(source))
        .option("maxRecordsPerBatch", 600)
        .option("maxRecordsPerPartition", 300)
        .load()
        .selectExpr("key", "value", "split AS src_split", "offset AS src_offset")
    )
    stream = stream.mapInArrow(crash_once_in_batch(str(marker)), stream.schema)
    return (
        stream.writeStream.format("replayable")
        .option("path", str(sink))
        .option("keyColumn", "src_split")
        .option("numSplits", 2)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def test_end_to_end_exactly_once_after_a_crash_and_a_replayed_batch(spark, tmp_path):
    source, sink, checkpoint = tmp_path / "source", tmp_path / "sink", tmp_path / "ck"
    marker = tmp_path / "crashed"
    write_source_log(spark, source, 1500)
    ends = ReplayableLog.open(LocalStorage(source)).index().end_offsets()
    expected = [(split, offset) for split, end in sorted(ends.items()) for offset in range(end)]
    assert len(expected) == 1500

    query = start_pipeline(spark, source, sink, checkpoint, marker)
    with pytest.raises(Exception, match="injected crash"):
        query.awaitTermination()
    assert marker.exists()
    sink_log = ReplayableLog.open(LocalStorage(sink))
    committed_before_crash = sum(sink_log.index().end_offsets().values())
    assert 0 < committed_before_crash < 1500  # it died part-way

    start_pipeline(spark, source, sink, checkpoint, marker).awaitTermination()
    # make Spark replay its last batch: forget that the batch committed (as if the driver died
    # after the sink's commit and before Spark's)
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    before_replay = ReplayableLog.open(LocalStorage(sink)).index()
    assert list(before_replay.sinks.values()) == [last]
    replay = start_pipeline(spark, source, sink, checkpoint, marker)
    replay.awaitTermination()
    assert batch_sizes(replay) != []  # Spark did run batch `last` again ...
    assert ReplayableLog.open(LocalStorage(sink)).index() == before_replay  # ... and the sink skipped it

    sink_log = ReplayableLog.open(LocalStorage(sink))
    table = pa.Table.from_batches(list(sink_log.read_range({0: 0, 1: 0}, sink_log.index().end_offsets())))
    got = list(zip(table.column("src_split").to_pylist(), table.column("src_offset").to_pylist()))
    assert sorted(got) == expected  # every record exactly once
    for split in range(3):  # per source split, in offset order
        offsets = [o for s, o in got if s == split]
        assert offsets == sorted(offsets)


def test_two_reads_of_the_same_offsets_are_identical(spark, small_log):
    options = {
        "startingOffsets": '{"0": 5, "1": 0, "2": -2}',
        "endingOffsets": '{"0": 200, "1": -1, "2": 150}',
        "maxRecordsPerPartition": "70",
    }
    first = spark.read.format("replayable").options(**options).load(str(small_log)).collect()
    second = spark.read.format("replayable").options(**options).load(str(small_log)).collect()
    assert first == second
    assert [(r.split, r.offset) for r in first if r.split == 0] == [(0, o) for o in range(5, 200)]
    log = ReplayableLog.open(LocalStorage(small_log))
    direct = pa.Table.from_batches(
        list(log.read_range({0: 5, 1: 0, 2: 0}, {0: 200, 1: log.index().end_offsets()[1], 2: 150}))
    )
    assert [tuple(r) for r in first] == [tuple(r.values()) for r in direct.to_pylist()]

    gen = {
        "generator": "keyed",
        "numSplits": "2",
        "skew": "1.0",
        "seed": "11",
        "startingOffsets": '{"0": 100, "1": 0}',
        "endingOffsets": '{"0": 900, "1": 50}',
    }
    g1 = spark.read.format("replayable").options(**gen).load().collect()
    g2 = spark.read.format("replayable").options(**gen).load().collect()
    assert g1 == g2 and len(g1) == 850


def test_batch_write_with_sink_id_appends_each_batch_id_once(spark, tmp_path):
    df = spark.range(0, 50, numPartitions=2).selectExpr("concat('user-', cast(id as string)) AS key", "id AS value")
    for batch_id in (0, 0, 1):  # batch 0 re-run, as a foreachBatch retry would
        (
            df.write.format("replayable")
            .mode("append")
            .option("sinkId", "job-a")
            .option("batchId", batch_id)
            .save(str(tmp_path / "log"))
        )
    index = ReplayableLog.open(LocalStorage(tmp_path / "log")).index()
    assert sum(index.end_offsets().values()) == 100
    assert index.sinks == {"sink:job-a": 1}


def test_failed_batch_write_leaves_nothing_behind(spark, tmp_path):
    """A job whose only task dies after its writer got rows: nothing is committed, and the collector removes its files.

    One task, so no other attempt of the failed job can still be writing when
    ``save()`` raises (files of such attempts are the collector's, once they
    are older than ``orphanGraceSeconds``).
    """
    path = tmp_path / "log"
    write_source_log(spark, path, 100)
    log = ReplayableLog.open(LocalStorage(path))
    before = log.index()
    committed = sorted(seg.path for split in before.splits for seg in split.segments)

    def fail_after_30000_rows(batches):
        seen = 0
        for b in batches:
            yield b
            seen += b.num_rows
            if seen >= 30_000:  # three Arrow batches reached the writer: it has written segments
                raise RuntimeError("task failure")

    df = spark.range(0, 50_000, numPartitions=1).selectExpr("concat('user-', cast(id as string)) AS key", "id AS value")
    with pytest.raises(Exception, match="task failure"):
        (
            df.mapInArrow(fail_after_30000_rows, df.schema)
            .write.format("replayable")
            .mode("append")
            .option("maxRecordsPerSegment", 4000)
            .save(str(path))
        )
    assert ReplayableLog.open(LocalStorage(path)).index() == before  # nothing of the failed job is referenced

    log.collect_garbage(0)
    on_disk = sorted(str(p.relative_to(path)) for p in (path / "data").rglob("*") if p.is_file())
    assert on_disk == committed
    assert sorted(os.listdir(path / "data")) == sorted({p.split("/")[1] for p in committed})


@pytest.mark.parametrize(
    "options, match",
    [
        ({"path": "{log}", "maxRecordPerBatch": "5"}, "UnknownOptionError.*maxrecordperbatch"),
        ({"path": "{log}", "startingOffsets": "{{bad"}, "InvalidOffsetsError.*startingOffsets"),
        ({}, "option path is missing"),
        ({"path": "{missing}"}, "LogNotFoundError.*no replayable log"),
        (
            {"path": "{log}", "endingOffsets": '{{"0": 99999, "1": -1, "2": -1}}'},
            "OffsetOutOfRangeError.*endingOffsets",
        ),
    ],
)
def test_bad_input_raises_a_named_error(spark, small_log, tmp_path, options, match):
    options = {k: v.format(log=small_log, missing=tmp_path / "nothing") for k, v in options.items()}
    with pytest.raises(Exception, match=f"(?s){match}"):
        spark.read.format("replayable").options(**options).load().collect()


def test_corrupt_segment_fails_the_read_naming_the_file(spark, tmp_path):
    write_source_log(spark, tmp_path / "log", 300)
    log = ReplayableLog.open(LocalStorage(tmp_path / "log"))
    segment = log.index().splits[1].segments[0]
    data = bytearray((tmp_path / "log" / segment.path).read_bytes())
    data[len(data) // 2] ^= 0x55
    (tmp_path / "log" / segment.path).write_bytes(bytes(data))
    with pytest.raises(Exception, match=f"(?s)CorruptSegmentError.*{segment.path}"):
        spark.read.format("replayable").load(str(tmp_path / "log")).collect()
