"""The replayable log, generator, offsets and options without Spark (milliseconds each)."""

from __future__ import annotations

import base64
import json
import re
import threading
import uuid
import zlib

import mmh3
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spark_state.driver.conf as spark_state_conf
from datasources.errors import (
    CorruptLogError,
    CorruptSegmentError,
    IncompatibleLogError,
    InvalidOffsetsError,
    LogNotFoundError,
    OffsetOutOfRangeError,
    ReplayableOptionError,
    SegmentMissingError,
    UnknownOptionError,
    UnsupportedKeyColumnError,
)
from datasources.generator import GeneratorSpec, generate, ranks
from datasources.log import INDEX_SNAPSHOT_INTERVAL, ReplayableLog, decode_segment, encode_segment
from datasources.logindex import (
    MAX_SPLITS,
    Commit,
    LogIndex,
    LogMeta,
    SegmentRef,
    SinkMark,
    SplitIndex,
    StagedSegment,
    apply_commit,
    plan_append,
    plan_reads,
    position_schema,
)
from datasources.options import (
    ANY_READ,
    READ,
    STREAM_READ,
    STREAM_WRITE,
    WRITE,
    admit,
    log_source_id,
    normalize_log_uri,
    parse_read_options,
    parse_write_options,
)
from datasources.routing import is_key_type, route_batch, splits_of_keys
from datasources.sources import LogSource, retention_floors
from spark_state.errors import ConfigError, CorruptBlobError, StorageError
from spark_state.storage.base import CountingStorage, Storage
from spark_state.storage.memory import MemoryStorage
from spark_state.store.commitlog import decode_record, encode_record

SCHEMA = pa.schema([pa.field("key", pa.string()), pa.field("value", pa.int64())])


def batch(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch(
        [pa.array([f"k{i}" for i in range(start, start + n)]), pa.array(range(start, start + n), pa.int64())],
        schema=SCHEMA,
    )


def new_log(num_splits: int = 2, storage: Storage | None = None) -> ReplayableLog:
    return ReplayableLog.create(storage or MemoryStorage(), LogMeta("t", num_splits, SCHEMA))


def append(log: ReplayableLog, split: int, start: int, n: int, max_records: int = 1_000_000, sink=None):
    writer = log.segment_writer(order=0, max_records=max_records)
    writer.add(split, batch(start, n))
    return log.append(writer.finish(), sink)


def rows(log: ReplayableLog, start=None, end=None) -> list[tuple]:
    index = log.index()
    got = log.read_range(start or index.earliest_offsets(), end or index.end_offsets())
    table = pa.Table.from_batches(list(got), schema=position_schema(log.meta.schema))
    return list(zip(*(table.column(c).to_pylist() for c in ("split", "offset", "value"))))


# --- log: roundtrip, index, commits -------------------------------------------


def test_roundtrip_assigns_dense_offsets_per_split_in_append_order():
    log = new_log()
    append(log, 0, 0, 5)
    append(log, 1, 100, 3)
    append(log, 0, 5, 2)
    assert log.index().end_offsets() == {0: 7, 1: 3}
    assert rows(log) == [(0, i, i) for i in range(7)] + [(1, i, 100 + i) for i in range(3)]


def test_reopened_log_sees_the_same_index_and_rows():
    storage = MemoryStorage()
    log = new_log(3, storage)
    for i in range(5):
        append(log, i % 3, 10 * i, 4)
    again = ReplayableLog.open(storage)
    assert again.meta == log.meta
    assert again.index() == log.index()
    assert rows(again) == rows(log)


def test_create_rejects_a_different_split_count_or_schema():
    storage = MemoryStorage()
    new_log(2, storage)
    with pytest.raises(IncompatibleLogError, match="2 splits"):
        ReplayableLog.create(storage, LogMeta("t", 3, SCHEMA))
    other = pa.schema([pa.field("key", pa.string()), pa.field("value", pa.int32())])
    with pytest.raises(IncompatibleLogError, match="schema"):
        ReplayableLog.create(storage, LogMeta("t", 2, other))


def test_reserved_columns_and_split_counts_outside_int32_are_rejected():
    with pytest.raises(IncompatibleLogError, match="reserved"):
        LogMeta("t", 1, SCHEMA.append(pa.field("offset", pa.int64())))
    assert LogMeta("t", MAX_SPLITS, SCHEMA).num_splits == 2**16
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(IncompatibleLogError, match="between 1 and 65536"):
            LogMeta("t", bad, SCHEMA)


def test_open_missing_log_names_the_location():
    storage = MemoryStorage()
    with pytest.raises(LogNotFoundError, match=storage.uri):
        ReplayableLog.open(storage)


def test_segment_writer_cuts_segments_at_max_records_and_keeps_order():
    log = new_log(1)
    writer = log.segment_writer(order=7, max_records=4)
    writer.add(0, batch(0, 6))
    writer.add(0, batch(6, 5))
    staged = writer.finish()
    assert [s.rows for s in staged] == [4, 4, 3]
    assert [s.order for s in staged] == [(7, 0), (7, 1), (7, 2)]
    log.append(staged)
    assert [r[2] for r in rows(log)] == list(range(11))


def test_plan_append_orders_segments_of_a_split_by_task_then_sequence():
    index = LogIndex.empty(1)
    staged = [
        StagedSegment(0, "b", 2, 1, 1, (1, 0)),
        StagedSegment(0, "a", 3, 1, 1, (0, 5)),
        StagedSegment(0, "c", 0, 1, 1, (0, 9)),
    ]
    commit = plan_append(index, staged)
    assert [(s.path, s.start, s.end) for s in commit.segments] == [("a", 0, 3), ("b", 3, 5)]


def test_concurrent_appends_race_for_commit_ids_and_never_overlap():
    storage = MemoryStorage()
    new_log(2, storage)
    errors = []

    def worker(w: int) -> None:
        try:
            log = ReplayableLog.open(storage)  # each thread its own (soon stale) index
            for j in range(10):
                append(log, (w + j) % 2, 1000 * w + j, 3)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    log = ReplayableLog.open(storage)
    index = log.index()
    assert index.commit_id == 39
    assert sum(index.end_offsets().values()) == 4 * 10 * 3
    values = [r[2] for r in rows(log)]
    assert sorted(values) == sorted(1000 * w + j + k for w in range(4) for j in range(10) for k in range(3))
    for split in index.splits:  # contiguous cover
        assert [s.start for s in split.segments] == [0] + [s.end for s in split.segments[:-1]]


def test_a_reader_that_finds_the_next_commit_missing_then_lists_commits_another_writer_just_made_reads_them():
    """The next commit is absent when a reader looks, then another writer commits it and one more before the
    reader lists the commits to see whether the first was lost: that is a race, not a missing commit."""
    storage = MemoryStorage()
    writer = new_log(1, storage)
    append(writer, 0, 0, 3)
    reader = ReplayableLog.open(storage)
    assert reader.index().commit_id == 0
    commits_dir = writer.commits.directory
    real_list = storage.list

    def list_after_two_more_commits(directory):
        if directory == commits_dir:
            storage.list = real_list
            append(writer, 0, 3, 3)
            append(writer, 0, 6, 3)
        return real_list(directory)

    storage.list = list_after_two_more_commits
    assert reader.index().commit_id == 2 and [r[2] for r in rows(reader)] == list(range(9))
    storage.delete(writer.commits.path(1))  # a commit that is really gone, with one after it: refused
    with pytest.raises(CorruptLogError, match=re.escape(writer.commits.where(1)) + " is missing"):
        ReplayableLog.open(storage).index()


def test_stale_writer_loses_the_race_and_retries_at_the_next_id():
    storage = MemoryStorage()
    a = new_log(1, storage)
    b = ReplayableLog.open(storage)
    b.index()
    append(a, 0, 0, 2)
    commit = append(b, 0, 10, 3)  # b's index says commit 0 is next; it is taken
    assert commit.commit_id == 1
    assert commit.segments[0].start == 2
    assert rows(ReplayableLog.open(storage)) == [(0, 0, 0), (0, 1, 1), (0, 2, 10), (0, 3, 11), (0, 4, 12)]


def test_sink_mark_makes_a_replayed_batch_a_no_op_and_deletes_its_segments():
    storage = MemoryStorage()
    log = new_log(1, storage)
    assert append(log, 0, 0, 3, sink=SinkMark("q", 0)) is not None
    writer = log.segment_writer(order=0)
    writer.add(0, batch(0, 3))
    staged = writer.finish()
    assert log.append(staged, SinkMark("q", 0)) is None
    assert not storage.exists(staged[0].path)
    assert append(log, 0, 3, 1, sink=SinkMark("other", 0)) is not None
    assert append(log, 0, 4, 1, sink=SinkMark("q", 1)) is not None
    assert log.index().sinks == {"q": 1, "other": 0}
    assert [r[2] for r in rows(log)] == [0, 1, 2, 3, 4]


def test_index_snapshots_bound_what_a_new_reader_reads():
    storage = MemoryStorage()
    log = new_log(1, storage)
    for i in range(INDEX_SNAPSHOT_INTERVAL + 3):
        append(log, 0, i, 1)
    counting = CountingStorage(storage)
    fresh = ReplayableLog.open(counting)
    assert fresh.index() == log.index()
    commits_read = [p for p in counting.reads if p.startswith("_commits/")]
    # snapshot after commit 31, then commits 32..34 and one probe for the missing 35
    assert commits_read == [fresh.commits.path(i) for i in range(INDEX_SNAPSHOT_INTERVAL, INDEX_SNAPSHOT_INTERVAL + 4)]


def test_ranged_read_touches_only_the_segments_holding_the_range():
    storage = MemoryStorage()
    log = new_log(1, storage)
    for i in range(10):
        append(log, 0, 10 * i, 10)  # segments [0,10) [10,20) ... [90,100)
    counting = CountingStorage(storage)
    reader = ReplayableLog.open(counting)
    reader.index()
    counting.reads.clear()
    got = rows(reader, {0: 25}, {0: 41})
    assert [r[1] for r in got] == list(range(25, 41))
    segment_reads = [p for p in counting.reads if p.startswith("data/")]
    expected = [s.path for s in reader.index().splits[0].segments[2:5]]
    assert segment_reads == expected


def test_corrupt_segment_raises_naming_the_file():
    storage = MemoryStorage()
    log = new_log(1, storage)
    append(log, 0, 0, 50)
    ref = log.index().splits[0].segments[0]
    data = bytearray(storage.read(ref.path))
    data[len(data) // 2] ^= 0xFF
    storage.create(ref.path, bytes(data), overwrite=True)
    with pytest.raises(CorruptSegmentError, match=ref.path) as info:
        rows(ReplayableLog.open(storage))
    assert "CRC-32" in str(info.value)
    assert isinstance(info.value, CorruptBlobError)


def test_truncated_segment_raises_naming_the_file():
    storage = MemoryStorage()
    log = new_log(1, storage)
    append(log, 0, 0, 50)
    ref = log.index().splits[0].segments[0]
    storage.create(ref.path, storage.read(ref.path)[:-7], overwrite=True)
    with pytest.raises(CorruptSegmentError, match=f"{ref.path} is truncated"):
        rows(ReplayableLog.open(storage))


def test_missing_segment_and_corrupt_commit_raise():
    storage = MemoryStorage()
    log = new_log(1, storage)
    append(log, 0, 0, 5)
    ref = log.index().splits[0].segments[0]
    storage.delete(ref.path)
    with pytest.raises(SegmentMissingError, match=ref.path):
        rows(ReplayableLog.open(storage))
    storage.create(log.commits.path(1), b"{not json")
    with pytest.raises(CorruptLogError, match=log.commits.path(1)):
        ReplayableLog.open(storage).index()


def test_log_files_are_checksummed_records():
    storage = MemoryStorage()
    log = new_log(1, storage)
    for i in range(INDEX_SNAPSHOT_INTERVAL):
        append(log, 0, i, 1)
    last = INDEX_SNAPSHOT_INTERVAL - 1
    for path in ("_log.json", log.commits.path(0), log.commits.path(last), log.snapshots.path(last)):
        decode_record(storage.read(path), path)  # accept_unframed=False: raises unless framed


def legacy_log(storage: Storage) -> list[int]:
    """A log as written before its files were framed: plain JSON ``_log.json``, commits 0 and 1, snapshot 0.

    Commit 0 appends values 0..2 to split 1, commit 1 values 3..4 to split 0;
    returns the values in read order (split 0 first).
    """
    meta = LogMeta("old", 2, SCHEMA)
    schema_b64 = base64.b64encode(SCHEMA.serialize().to_pybytes()).decode("ascii")
    storage.create(
        "_log.json",
        json.dumps(
            {"format": 1, "name": "old", "numSplits": 2, "schema": schema_b64, "schemaText": SCHEMA.to_string()},
            indent=1,
        ).encode(),
    )
    writer = ReplayableLog(storage, meta).segment_writer(order=0)
    writer.add(1, batch(0, 3))
    writer.add(0, batch(3, 2))
    first, second = sorted(writer.finish(), key=lambda seg: -seg.split)

    def ref(seg, split: int, n: int) -> str:
        return (
            f'{{"split": {split}, "start": 0, "end": {n}, "path": "{seg.path}", "size": {seg.size}, '
            f'"crc32": {seg.crc32}}}'
        )

    storage.create(
        "_commits/00000000000000000000.json",
        f'{{"format": 1, "commit": 0, "segments": [{ref(first, 1, 3)}], "trims": {{}}, "sink": null}}'.encode(),
    )
    storage.create(
        "_commits/00000000000000000001.json",
        f'{{"format": 1, "commit": 1, "segments": [{ref(second, 0, 2)}], "trims": {{}}, '
        f'"sink": {{"id": "q", "batch": 4}}}}'.encode(),
    )
    storage.create(
        "_index/00000000000000000000.json",
        f'{{"format": 1, "commit": 0, "earliest": [0, 0], "end": [0, 3], '
        f'"segments": [{ref(first, 1, 3)}], "sinks": {{}}}}'.encode(),
    )
    return [3, 4, 0, 1, 2]


def test_a_log_written_before_framing_opens_reads_and_takes_new_commits():
    storage = MemoryStorage()
    old_values = legacy_log(storage)
    log = ReplayableLog.open(storage)
    assert log.meta == LogMeta("old", 2, SCHEMA)
    assert [r[2] for r in rows(log)] == old_values
    assert log.index().sinks == {"q": 4}
    append(log, 1, 10, 2)
    counting = CountingStorage(storage)
    again = ReplayableLog.open(counting)
    assert [r[2] for r in rows(again)] == [3, 4, 0, 1, 2, 10, 11]
    assert again.index().end_offsets() == {0: 2, 1: 5}
    assert again.commits.path(0) not in counting.reads  # the legacy snapshot stood in for commit 0
    decode_record(storage.read(log.commits.path(2)), "commit 2")  # the new commit is framed
    storage.delete("_index")
    assert ReplayableLog.open(storage).index() == again.index()  # every legacy commit replayed


def damaged_copies(data: bytes):
    """Every single-byte flip of ``data``, then every strict prefix."""
    for i in range(len(data)):
        yield data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
    for n in range(len(data)):
        yield data[:n]


@pytest.mark.parametrize("target", ["_log.json", "commit", "snapshot"])
def test_every_flipped_byte_or_truncation_of_a_log_file_raises_naming_it(target):
    storage = MemoryStorage()
    log = new_log(2, storage)
    commits = INDEX_SNAPSHOT_INTERVAL if target == "snapshot" else 2
    for i in range(commits):
        append(log, i % 2, 10 * i, 3)
    path = {
        "_log.json": "_log.json",
        "commit": log.commits.path(1),
        "snapshot": log.snapshots.path(INDEX_SNAPSHOT_INTERVAL - 1),
    }[target]
    expected = rows(log)
    original = storage.read(path)
    for damaged in damaged_copies(original):
        storage.create(path, damaged, overwrite=True)
        with pytest.raises(CorruptLogError, match=re.escape(f"{storage.uri}/{path}")) as info:
            rows(ReplayableLog.open(storage))
        assert isinstance(info.value, CorruptBlobError)
    storage.create(path, original, overwrite=True)
    assert rows(ReplayableLog.open(storage)) == expected


def framed_log(num_splits: int = 2) -> tuple[MemoryStorage, ReplayableLog]:
    storage = MemoryStorage()
    log = new_log(num_splits, storage)
    append(log, 0, 0, 3)
    return storage, log


GOOD_SEGMENT = {"split": 1, "start": 0, "end": 2, "path": "data/x/1-000000.arrow", "size": 10, "crc32": 0}


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"commit": 1, "segments": [], "trims": {}, "sink": None},
        {"format": 1, "commit": 1, "trims": {}, "sink": None},
        {"format": 1, "commit": 1, "segments": ["data/x.arrow"], "trims": {}, "sink": None},
        {"format": 1, "commit": 1, "segments": [{**GOOD_SEGMENT, "size": "big"}], "trims": {}, "sink": None},
        {"format": 1, "commit": 1, "segments": [], "trims": {"7": 0}, "sink": None},
        {"format": 1, "commit": 1, "segments": [], "trims": {"-1": 0}, "sink": None},
        {"format": 1, "commit": 1, "segments": [], "trims": {"0": 99}, "sink": None},
        {"format": 1, "commit": 1, "segments": [], "trims": [], "sink": None},
        {"format": 1, "commit": 1, "segments": [], "trims": {}, "sink": ["q", 1]},
        {"format": 1, "commit": 1, "segments": [{**GOOD_SEGMENT, "split": -1}], "trims": {}, "sink": None},
    ],
)
def test_a_malformed_commit_raises_a_typed_error_naming_it(body):
    storage, log = framed_log()
    storage.create(log.commits.path(1), encode_record(body))
    with pytest.raises(CorruptLogError, match=re.escape(log.commits.where(1))):
        ReplayableLog.open(storage).index()


@pytest.mark.parametrize(
    "change",
    [
        {"segments": [{**GOOD_SEGMENT, "split": -1}]},
        {"segments": [{**GOOD_SEGMENT, "split": 2}]},
        {"earliest": [0]},
        {"end": [3, "x"]},
        {"sinks": [["q", 1]]},
        {"segments": None},
    ],
)
def test_a_malformed_snapshot_raises_a_typed_error_naming_it(change):
    storage, log = framed_log()
    body = {**log.index().to_json(), **change}
    storage.create(log.snapshots.path(0), encode_record(body))
    with pytest.raises(CorruptLogError, match=re.escape(log.snapshots.where(0))):
        ReplayableLog.open(storage).index()


@pytest.mark.parametrize(
    "change",
    [
        {"schema": None},
        {"schema": "not base64!"},
        {"numSplits": "many"},
        {"numSplits": 0},
        {"name": None, "schema": "AAAA"},
    ],
)
def test_a_malformed_log_meta_raises_a_typed_error_naming_it(change):
    storage, log = framed_log()
    storage.create("_log.json", encode_record({**log.meta.to_json(), **change}), overwrite=True)
    with pytest.raises(CorruptLogError, match=re.escape(f"{storage.uri}/_log.json")):
        ReplayableLog.open(storage)


def test_arguments_out_of_range_raise_typed_errors_naming_the_option():
    log = new_log(2)
    with pytest.raises(ReplayableOptionError, match="compression='gzip'"):
        encode_segment([batch(0, 1)], SCHEMA, "gzip")
    with pytest.raises(ReplayableOptionError, match="maxRecordsPerSegment=0"):
        log.segment_writer(max_records=0)
    with pytest.raises(ReplayableOptionError, match="compression='snappy'"):
        log.segment_writer(compression="snappy")
    with pytest.raises(ReplayableOptionError, match="maxRecordsPerPartition=0"):
        plan_reads(log.index(), {0: 0, 1: 0}, {0: 0, 1: 0}, 0)
    with pytest.raises(ReplayableOptionError, match="maxRecordsPerBatch=0"):
        admit({0: 0}, {0: 5}, 0)
    checkpoint = parse_read_options({"path": "/x", "startingOffsets": "checkpoint", "stateStore": "/s"}, READ)
    with pytest.raises(ReplayableOptionError, match="startingOffsets=checkpoint"):
        checkpoint.starting.resolve({0: 0}, {0: 0})
    with pytest.raises(OffsetOutOfRangeError, match="cannot trim split 2"):
        log.trim({2: 0})
    assert all(isinstance(e, ConfigError) for e in (ReplayableOptionError("x"), OffsetOutOfRangeError("x")))
    for compression in spark_state_conf.COMPRESSIONS:  # one list of codecs for state blobs and log segments
        assert parse_write_options({"path": "/x", "compression": compression}, WRITE).compression == compression
        data = encode_segment([batch(0, 2)], SCHEMA, compression)
        ref = SegmentRef(0, 0, 2, "s", len(data), zlib.crc32(data))
        assert decode_segment(data, ref, SCHEMA).column("value").to_pylist() == [0, 1]


def test_a_log_schema_spark_cannot_read_is_a_typed_error():
    from datasources.replayable import spark_schema

    with pytest.raises(IncompatibleLogError, match="uint64"):
        spark_schema(pa.schema([pa.field("n", pa.uint64())]))


def test_datasources_raises_only_its_own_typed_errors():
    """Every ``raise X(...)`` in the package names a class of ``datasources.errors`` (bare re-raises aside)."""
    import ast
    import importlib
    import inspect
    from pathlib import Path

    import datasources
    import datasources.errors as errors
    from spark_state.errors import SparkStateError

    typed = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, SparkStateError) and value.__module__ == errors.__name__
    }
    untyped = []
    for path in sorted(Path(datasources.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"datasources.{path.stem}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = target.id if isinstance(target, ast.Name) else ast.unparse(target)
                helper = getattr(module, name, None) if name.startswith("_") else None
                if helper is not None and inspect.isfunction(helper):  # a function that builds the error
                    name = inspect.signature(helper).return_annotation
                if name not in typed:
                    untyped.append(f"{path.name}:{node.lineno} raises {name}")
    assert untyped == []
    assert len(typed) >= 10


def test_trim_drops_whole_segments_and_later_reads_below_it_fail():
    storage = MemoryStorage()
    log = new_log(1, storage)
    for i in range(4):
        append(log, 0, 10 * i, 10)
    paths = [s.path for s in log.index().splits[0].segments]
    commit = log.trim({0: 25})  # [20, 30) still holds 25..29: keep it
    assert commit.trims == {0: 20}
    assert log.index().earliest_offsets() == {0: 20}
    assert [storage.exists(p) for p in paths] == [False, False, True, True]
    assert [r[1] for r in rows(log)] == list(range(20, 40))
    with pytest.raises(OffsetOutOfRangeError, match="trimmed"):
        rows(log, {0: 10}, {0: 40})
    assert log.trim({0: 25}) is None


# --- planning ------------------------------------------------------------------


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(1, 20), min_size=0, max_size=8))
    segments, start = [], 0
    for i, size in enumerate(sizes):
        segments.append(SegmentRef(0, start, start + size, f"s{i}", 1, 0))
        start += size
    a = draw(st.integers(0, start))
    b = draw(st.integers(a, start))
    return LogIndex(0, (SplitIndex(0, start, tuple(segments)),)), a, b, draw(st.integers(1, 30))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_plan_reads_covers_the_range_exactly_with_bounded_tasks(case):
    index, a, b, max_records = case
    tasks = plan_reads(index, {0: a}, {0: b}, max_records)
    assert [t.start for t in tasks] == ([a] + [t.end for t in tasks[:-1]] if tasks else [])
    assert (tasks[-1].end if tasks else a) == b
    for task in tasks:
        assert 0 < task.end - task.start <= max_records
        needed = [s for s in index.splits[0].segments if s.start < task.end and s.end > task.start]
        assert list(task.segments) == needed
    if a < b and max_records >= max(s.rows for s in index.splits[0].segments):
        # segments no larger than a task are never split between tasks
        assert len({s.path for t in tasks for s in t.segments}) == sum(len(t.segments) for t in tasks)


def test_plan_reads_rejects_offsets_past_the_end():
    index = LogIndex(0, (SplitIndex(0, 5, (SegmentRef(0, 0, 5, "s", 1, 0),)),))
    with pytest.raises(OffsetOutOfRangeError, match="past the split's end 5"):
        plan_reads(index, {0: 0}, {0: 6}, 10)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=6), st.integers(1, 200))
def test_admit_shares_the_budget_without_exceeding_pending(ranges, max_rows):
    start = {s: lo for s, (lo, _) in enumerate(ranges)}
    end = {s: lo + extra for s, (lo, extra) in enumerate(ranges)}
    got = admit(start, end, max_rows)
    granted = {s: got[s] - start[s] for s in start}
    pending = sum(end[s] - start[s] for s in start)
    assert all(0 <= granted[s] <= end[s] - start[s] for s in start)
    assert sum(granted.values()) == min(max_rows, pending)
    # even sharing: a split that got less than another was given all it had
    for s in start:
        for t in start:
            if granted[s] + 1 < granted[t]:
                assert granted[s] == end[s] - start[s]


# --- routing -------------------------------------------------------------------


def reference_split(key, num_splits: int) -> int:
    """The on-disk routing, spelled out with ``mmh3``: murmur3_32(seed 0, unsigned) of the key's bytes."""
    if key is None:
        return 0
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, bytes):
        data = key
    else:
        data = key.to_bytes(8, "little", signed=True)
    return mmh3.hash(data, 0, signed=False) % num_splits


TEXT_KEYS = st.one_of(st.text(max_size=100), st.text(alphabet="\x00aé日😀", max_size=100))
KEY_COLUMNS = st.one_of(
    st.tuples(st.sampled_from([pa.string(), pa.large_string()]), st.lists(st.none() | TEXT_KEYS, max_size=40)),
    st.tuples(
        st.sampled_from([pa.binary(), pa.large_binary()]), st.lists(st.none() | st.binary(max_size=100), max_size=40)
    ),
    st.tuples(st.just(pa.int64()), st.lists(st.none() | st.integers(-(2**63), 2**63 - 1), max_size=40)),
    st.tuples(st.just(pa.int32()), st.lists(st.none() | st.integers(-(2**31), 2**31 - 1), max_size=40)),
    st.tuples(st.just(pa.uint8()), st.lists(st.none() | st.integers(0, 255), max_size=40)),
)


@settings(max_examples=400, deadline=None)
@given(KEY_COLUMNS, st.one_of(st.integers(1, 64), st.integers(1, MAX_SPLITS)), st.integers(0, 3), st.data())
def test_split_routing_is_murmur3_seed_0_of_the_key_bytes(column, num_splits, cut, data):
    arrow_type, keys = column
    array = pa.array(keys, type=arrow_type)
    assert splits_of_keys(array, num_splits).tolist() == [reference_split(k, num_splits) for k in keys]
    start = data.draw(st.integers(0, len(keys)))
    sliced = array.slice(start, len(keys) - start - min(cut, len(keys) - start))
    assert splits_of_keys(sliced, num_splits).tolist() == [reference_split(k, num_splits) for k in sliced.to_pylist()]


def test_split_routing_known_answers_and_refusals():
    # murmur3_32(seed 0) of UTF-8 / 8-byte little-endian bytes, mod n: pinned so the routing never drifts
    assert splits_of_keys(pa.array(["user-000001", "a", None]), 1024).tolist() == [180, 434, 0]
    assert splits_of_keys(pa.array([7, -1, None], pa.int64()), 1024).tolist() == [67, 232, 0]
    # a large split count and the largest, and a tail that Spark's padded variant would hash like "ab"
    assert splits_of_keys(pa.array(["ab\x00", "ab"]), 2**31 - 1).tolist() == [940022599, 465557344]
    assert splits_of_keys(pa.array(["ab\x00", "ab"]), MAX_SPLITS).tolist() == [39750, 55135]
    for refused in (pa.array([1], pa.uint64()), pa.array([1.5]), pa.array([True])):
        assert not is_key_type(refused.type)
        with pytest.raises(UnsupportedKeyColumnError, match=str(refused.type)):
            splits_of_keys(refused, 4)


def test_route_batch_groups_rows_by_split_preserving_order():
    b = batch(0, 8)
    splits = pa.array([1, 0, 1, 2, 0, 1, 2, 0]).to_numpy().astype("int32")
    got = {s: part.column("value").to_pylist() for s, part in route_batch(b, splits, 3)}
    assert got == {0: [1, 4, 7], 1: [0, 2, 5], 2: [3, 6]}


# --- generator -----------------------------------------------------------------


def generated(spec, split, start, end, batch_rows=131072):
    return pa.Table.from_batches(list(generate(spec, split, start, end, batch_rows=batch_rows)))


def test_generator_rows_are_a_pure_function_of_seed_split_offset():
    spec = GeneratorSpec(keys=50, skew=1.1, seed=7)
    whole = generated(spec, 2, 0, 1000)
    assert generated(spec, 2, 400, 700, batch_rows=33).equals(whole.slice(400, 300))
    assert generated(GeneratorSpec(keys=50, skew=1.1, seed=7), 2, 0, 1000).equals(whole)
    assert not generated(GeneratorSpec(keys=50, skew=1.1, seed=8), 2, 0, 1000).column("key").equals(whole.column("key"))
    assert not generated(spec, 3, 0, 1000).column("key").equals(whole.column("key"))
    assert whole.column("offset").to_pylist() == list(range(1000))
    assert set(whole.column("split").to_pylist()) == {2}


def test_generator_keys_values_and_skew():
    uniform = generated(GeneratorSpec(keys=10), 0, 0, 20000)
    keys = uniform.column("key").to_pylist()
    assert set(keys) == {f"user-{i:06d}" for i in range(10)}
    assert min(keys.count(k) for k in set(keys)) > 1500  # uniform: ~2000 each
    values = uniform.column("value").to_pylist()
    assert 0 <= min(values) and max(values) < 1000
    skewed = generated(GeneratorSpec(keys=1000, skew=1.2, key_type="long"), 0, 0, 20000).column("key").to_pylist()
    assert skewed.count(0) > 20 * skewed.count(500) and 0 <= min(skewed) and max(skewed) < 1000
    assert uniform.column("event_time")[1].value - uniform.column("event_time")[0].value == 1000
    assert ranks(GeneratorSpec(keys=3, skew=0.5), pa.array([0.0, 0.999999]).to_numpy()).tolist() == [0, 2]


def test_generator_availability_bounded_and_rated():
    assert GeneratorSpec(rows_per_split=10, num_splits=2).available({0: 0, 1: 0}, 0) == {0: 10, 1: 10}
    rated = GeneratorSpec(rows_per_second=100, num_splits=1)
    assert rated.available({0: 50}, 2.5) == {0: 300}
    assert GeneratorSpec(rows_per_second=100, rows_per_split=120, num_splits=1).available({0: 0}, 5) == {0: 120}


# --- options and offsets -------------------------------------------------------


def test_unknown_option_is_named_and_spark_options_are_accepted():
    with pytest.raises(UnknownOptionError, match="maxrecordperbatch"):
        parse_read_options({"path": "/x", "maxRecordPerBatch": "5"}, STREAM_READ)
    with pytest.raises(UnknownOptionError, match=r"endingoffsets.*other modes"):
        parse_read_options({"path": "/x", "endingOffsets": "latest"}, STREAM_READ)
    with pytest.raises(UnknownOptionError, match="path"):
        parse_read_options({"generator": "keyed", "path": "/x"}, READ)
    opts = parse_write_options({"path": "/x", "checkpointlocation": "/ck", "queryname": "q"}, STREAM_WRITE)
    assert opts.sink_id == "checkpoint:file:///ck"
    assert parse_read_options({"PATH": "/x", "MAXRECORDSPERBATCH": "5"}, ANY_READ).max_records_per_batch == 5


@pytest.mark.parametrize(
    "text, match",
    [
        ("earliets", "neither one of"),
        ('{"0": "a"}', "offset 'a' of split 0"),
        ('{"x": 1}', "split 'x'"),
        ('{"0": -3}', ">= -2"),
        ("[1, 2]", "neither one of"),
    ],
)
def test_malformed_starting_offsets_are_rejected(text, match):
    with pytest.raises(InvalidOffsetsError, match=match) as info:
        parse_read_options({"path": "/x", "startingOffsets": text}, STREAM_READ)
    assert "startingOffsets" in str(info.value)


def test_bad_values_and_missing_path():
    with pytest.raises(ReplayableOptionError, match="option path is missing"):
        parse_read_options({}, READ)
    with pytest.raises(ReplayableOptionError, match="maxRecordsPerBatch=0 must be >= 1"):
        parse_read_options({"path": "/x", "maxRecordsPerBatch": "0"}, STREAM_READ)
    with pytest.raises(ReplayableOptionError, match="needs option stateStore"):
        parse_read_options({"path": "/x", "startingOffsets": "checkpoint"}, STREAM_READ)
    with pytest.raises(ConfigError, match="compression"):
        parse_write_options({"path": "/x", "compression": "gzip"}, WRITE)
    with pytest.raises(ReplayableOptionError, match="checkpointLocation"):
        parse_write_options({"path": "/x"}, STREAM_WRITE)


def test_explicit_offsets_resolve_markers_and_must_name_every_split():
    spec = parse_read_options({"path": "/x", "startingOffsets": '{"0": 3, "1": -2, "2": -1}'}, READ).starting
    assert spec.resolve({0: 1, 1: 1, 2: 1}, {0: 9, 1: 9, 2: 9}) == {0: 3, 1: 1, 2: 9}
    with pytest.raises(InvalidOffsetsError, match=r"missing \[3\]"):
        spec.resolve({s: 0 for s in range(4)}, {s: 9 for s in range(4)})


def test_log_source_id_normalizes_the_location(tmp_path):
    assert log_source_id(str(tmp_path)) == log_source_id(tmp_path.as_uri() + "/")
    assert log_source_id(str(tmp_path)) == "replayable:" + tmp_path.as_uri()
    assert normalize_log_uri("memory://abc/") == "memory://abc"
    assert normalize_log_uri("hdfs://nn:9870/logs/a") == "hdfs://nn:9870/logs/a"


# --- sources: checkpoint starts and retention ------------------------------------


@pytest.fixture
def memory_log():
    name = "replayable-" + uuid.uuid4().hex
    storage = MemoryStorage.named(name)
    log = new_log(2, storage)
    for i in range(4):
        append(log, i % 2, 10 * i, 10)  # each split: [0, 10) [10, 20)
    return storage, log


@pytest.fixture
def fake_checkpoints(monkeypatch):
    calls = {"latest": None, "retained": []}
    monkeypatch.setattr("spark_state.store.manifestlog.latest_source_offsets", lambda uri, source_id: calls["latest"])
    monkeypatch.setattr(
        "spark_state.store.manifestlog.retained_source_offsets", lambda uri, source_id: calls["retained"]
    )
    return calls


def test_starting_offsets_from_the_latest_state_checkpoint(memory_log, fake_checkpoints):
    storage, _ = memory_log
    options = {"path": storage.uri, "startingOffsets": "checkpoint", "stateStore": "memory://state"}
    fake_checkpoints["latest"] = {"source_id": log_source_id(storage.uri), "0": 12, "1": 20}
    assert LogSource.open(parse_read_options(options, STREAM_READ)).starting_offsets() == {0: 12, 1: 20}
    fake_checkpoints["latest"] = {"source_id": "replayable:file:///elsewhere", "0": 12, "1": 20}
    with pytest.raises(InvalidOffsetsError, match="another source"):
        LogSource.open(parse_read_options(options, STREAM_READ)).starting_offsets()
    fake_checkpoints["latest"] = None
    assert LogSource.open(parse_read_options(options, STREAM_READ)).starting_offsets() == {0: 0, 1: 0}
    fake_checkpoints["latest"] = {"0": 12, "1": 21}
    with pytest.raises(OffsetOutOfRangeError, match="state store memory://state"):
        LogSource.open(parse_read_options(options, STREAM_READ)).starting_offsets()


def test_commit_trims_only_what_retention_and_retained_checkpoints_allow(memory_log, fake_checkpoints):
    storage, log = memory_log
    options = {"path": storage.uri, "retention": "0", "stateStore": "memory://state"}
    source = LogSource.open(parse_read_options(options, STREAM_READ))
    source.commit({0: 20, 1: 20})  # no retained checkpoint yet: keep everything
    assert log.index().earliest_offsets() == {0: 0, 1: 0}
    fake_checkpoints["retained"] = [{"0": 15, "1": 20}, {"0": 12, "1": 10}]
    source.commit({0: 20, 1: 20})
    assert log.index().earliest_offsets() == {0: 10, 1: 10}
    keep_all = LogSource.open(parse_read_options({"path": storage.uri}, STREAM_READ))
    keep_all.commit({0: 20, 1: 20})
    assert log.index().earliest_offsets() == {0: 10, 1: 10}


def test_retention_floors():
    assert retention_floors({0: 100, 1: 5}, 10, None) == {0: 90, 1: 0}
    assert retention_floors({0: 100}, 0, []) is None
    assert retention_floors({0: 100, 1: 50}, 0, [{0: 70, 1: 60}, {0: 80}]) == {0: 70, 1: 0}


def test_discard_never_deletes_a_committed_segment():
    storage = MemoryStorage()
    log = new_log(1, storage)
    append(log, 0, 0, 3)
    committed = log.index().splits[0].segments[0].path
    writer = log.segment_writer(order=0)
    writer.add(0, batch(3, 2))
    (orphan,) = writer.finish()
    assert log.discard([committed, orphan.path]) == [orphan.path]
    assert storage.exists(committed) and not storage.exists(orphan.path)


class SnapshotFailingStorage(CountingStorage):
    def create(self, path, data, *, overwrite=False):
        if path.startswith("_index/"):
            raise StorageError(f"disk full writing {path}")
        super().create(path, data, overwrite=overwrite)


def test_a_failed_index_snapshot_does_not_fail_the_committed_append():
    storage = SnapshotFailingStorage(MemoryStorage())
    log = new_log(1, storage)
    for i in range(INDEX_SNAPSHOT_INTERVAL + 1):
        assert append(log, 0, i, 1) is not None
    assert storage.list("_index") == []
    assert ReplayableLog.open(storage).index().end_offsets() == {0: INDEX_SNAPSHOT_INTERVAL + 1}


def test_a_commit_that_does_not_continue_its_split_is_rejected():
    index = LogIndex(0, (SplitIndex(0, 5, (SegmentRef(0, 0, 5, "a", 1, 0),)),))
    gap = Commit(1, (SegmentRef(0, 6, 8, "b", 1, 0),))
    with pytest.raises(CorruptLogError, match=r"\[6, 8\) of split 0, whose end is 5"):
        apply_commit(index, gap, "commit 1")
    with pytest.raises(CorruptLogError, match="expected 1"):
        apply_commit(index, Commit(2, ()), "commit 2")


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 2), st.integers(1, 9)),
        st.tuples(st.just("trim"), st.integers(0, 2), st.integers(0, 40)),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_log_matches_a_list_model_through_appends_trims_and_reopens(ops):
    storage = MemoryStorage()
    log = new_log(3, storage)
    model = {s: [] for s in range(3)}  # split -> [(offset, value)], the records still stored
    ends = {s: 0 for s in range(3)}
    next_value = 0
    for op, split, n in ops:
        if op == "append":
            append(log, split, next_value, n, max_records=4)
            model[split].extend((ends[split] + i, next_value + i) for i in range(n))
            ends[split] += n
            next_value += n
        else:
            before = log.index().earliest_offsets()[split]
            log.trim({split: n})
            earliest = log.index().earliest_offsets()[split]
            assert before <= earliest <= max(before, min(n, ends[split]))  # never past the floor
            model[split] = [(o, v) for o, v in model[split] if o >= earliest]
        log = ReplayableLog.open(storage)  # every step through a fresh reader
    assert rows(log) == [(s, o, v) for s in range(3) for o, v in model[s]]
    assert log.index().end_offsets() == ends


def test_offsets_carry_and_check_their_source_id():
    from datasources.options import offsets_from_json, offsets_to_json

    raw = offsets_to_json({1: 5, 0: 3}, "replayable:file:///a")
    assert list(raw) == ["source_id", "0", "1"]
    assert offsets_from_json(raw, "x", source_id="replayable:file:///a") == {0: 3, 1: 5}
    with pytest.raises(InvalidOffsetsError, match="belong to 'replayable:file:///a'"):
        offsets_from_json(raw, "x", source_id="replayable:file:///b")


def test_batch_write_sink_options_go_together():
    opts = parse_write_options({"path": "/x", "sinkId": "job", "batchId": "7"}, WRITE)
    assert (opts.sink_id, opts.batch_id) == ("sink:job", 7)
    with pytest.raises(ReplayableOptionError, match="go together"):
        parse_write_options({"path": "/x", "batchId": "7"}, WRITE)
    with pytest.raises(UnknownOptionError, match="batchid"):
        parse_write_options({"path": "/x", "sinkId": "s", "batchId": "1"}, STREAM_WRITE)


def test_a_stream_resolves_its_initial_offsets_once_per_run(tmp_path):
    """Spark asks for the initial offsets more than once in batch 0; appends in between must not move them."""
    from datasources.replayable import ReplayableDataSource
    from spark_state.storage.local import LocalStorage

    log = ReplayableLog.create(LocalStorage(str(tmp_path / "log")), LogMeta("log", 2, SCHEMA))
    append(log, 0, 0, 10)
    source = ReplayableDataSource({"path": str(tmp_path / "log"), "startingOffsets": "latest"})
    reader = source.streamReader(source.schema())
    first = reader.initialOffset()
    assert (first["0"], first["1"]) == (10, 0)
    append(log, 0, 10, 5)
    assert reader.initialOffset() == first
    rerun = ReplayableDataSource({"path": str(tmp_path / "log"), "startingOffsets": "latest"})
    assert rerun.streamReader(rerun.schema()).initialOffset()["0"] == 15
