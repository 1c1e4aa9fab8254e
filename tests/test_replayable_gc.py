"""Garbage collection under a replayable log's ``data/``, and the batch writer that relies on it (no Spark)."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from datasources.errors import ReplayableOptionError, UnknownOptionError
from datasources.log import (
    DEFAULT_ORPHAN_GRACE_SECONDS,
    ReplayableLog,
    directory_time_ms,
    writer_directory,
)
from datasources.logindex import LogMeta
from datasources.options import STREAM_READ, STREAM_WRITE, WRITE, parse_read_options, parse_write_options
from datasources.sources import LogSource
from spark_state.storage.local import LocalStorage
from spark_state.storage.memory import MemoryStorage

SCHEMA = pa.schema([pa.field("key", pa.string()), pa.field("value", pa.int64())])
NOW_MS = 1_750_000_000_000
HOUR_MS = 3_600_000


def rows(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch(
        [pa.array([f"k{i}" for i in range(start, start + n)]), pa.array(range(start, start + n), pa.int64())],
        schema=SCHEMA,
    )


def new_log(storage=None) -> ReplayableLog:
    return ReplayableLog.create(storage or MemoryStorage(), LogMeta("t", 2, SCHEMA))


def write(log: ReplayableLog, directory: str, start: int = 0, n: int = 3, commit: bool = True) -> list[str]:
    """Segments of ``n`` rows in each split under ``data/<directory>/``, committed or not; their paths."""
    writer = log.segment_writer(directory)
    writer.add(0, rows(start, n))
    writer.add(1, rows(start + n, n))
    staged = writer.finish()
    if commit:
        log.append(staged)
    return [seg.path for seg in staged]


def files(storage) -> list[str]:
    """Every blob under ``data/``, by walking listings."""
    out, pending = [], ["data"]
    while pending:
        directory = pending.pop()
        for name in storage.list(directory):
            path = f"{directory}/{name}"
            (out.append(path) if name.endswith(".arrow") else pending.append(path))
    return sorted(out)


def aged(kind: str, age_ms: int, tag: str = "") -> str:
    return writer_directory(kind, tag, now_ms=NOW_MS - age_ms)


def test_writer_directory_names_carry_their_time_and_old_names_none():
    name = writer_directory("task", "3f2a-7-0", now_ms=NOW_MS)
    assert name.startswith(f"task-{NOW_MS}-3f2a-7-0-") and directory_time_ms(name) == NOW_MS
    assert directory_time_ms(writer_directory("writer")) is not None
    assert writer_directory("writer", now_ms=NOW_MS) != writer_directory("writer", now_ms=NOW_MS)
    for legacy in (
        "job-" + uuid.uuid4().hex,
        "0-1-9a8b7c6d",
        uuid.uuid4().hex,
        f"stream-{'1' * 32}-0-0",
        "stream-0123456789abcdef-0-0",
    ):
        assert directory_time_ms(legacy) is None, legacy


def test_a_referenced_segment_is_never_deleted_whatever_its_age():
    log = new_log()
    committed = write(log, aged("task", 1000 * HOUR_MS)) + write(log, "job-" + uuid.uuid4().hex + "/0-0-12345678")
    assert log.collect_garbage(0, now_ms=NOW_MS + 1000 * HOUR_MS) == []
    assert files(log.storage) == sorted(committed)
    assert len(list(log.read_range({0: 0, 1: 0}, log.index().end_offsets()))) == 4


def test_an_unreferenced_writer_directory_goes_once_it_is_as_old_as_the_grace_period():
    log = new_log()
    committed = write(log, aged("task", 10 * HOUR_MS))
    at_grace = aged("task", HOUR_MS)
    just_younger = aged("task", HOUR_MS - 1)
    write(log, at_grace, commit=False)
    kept = write(log, just_younger, commit=False)
    assert log.collect_garbage(3600, now_ms=NOW_MS) == [f"data/{at_grace}"]
    assert files(log.storage) == sorted(committed + kept)
    assert log.collect_garbage(0, now_ms=NOW_MS) == [f"data/{just_younger}"]
    assert files(log.storage) == sorted(committed)


def test_a_directory_an_attempt_is_still_writing_is_kept():
    log = new_log()
    live = log.segment_writer(max_records=2)  # a fresh name: its writer started now
    live.add(0, rows(0, 3))  # one segment written, one row buffered: still writing
    (written,) = [path for path in files(log.storage)]
    assert log.collect_garbage(DEFAULT_ORPHAN_GRACE_SECONDS) == []
    assert files(log.storage) == [written]
    log.append(live.finish())
    assert log.collect_garbage(0) == [] and len(files(log.storage)) == 2


def test_names_without_a_time_count_as_old_and_old_job_directories_are_searched():
    """Logs written before writer directories carried a time: data/job-<hex>/<task>/ and flat ones."""
    log = new_log()
    job = "job-" + uuid.uuid4().hex
    committed = write(log, f"{job}/0-0-aaaaaaaa") + write(log, f"stream-{uuid.uuid4().hex}-1-0")
    failed_attempt = f"{job}/0-1-bbbbbbbb"
    write(log, failed_attempt, commit=False)
    orphan = uuid.uuid4().hex
    write(log, orphan, commit=False)
    young_in_old_job = write(log, f"{job}/" + aged("task", 0), commit=False)
    deleted = log.collect_garbage(3600, now_ms=NOW_MS)
    assert sorted(deleted) == sorted([f"data/{failed_attempt}", f"data/{orphan}"])
    assert files(log.storage) == sorted(committed + young_in_old_job)


def test_a_directory_left_with_only_an_interrupted_create_is_collected(tmp_path):
    log = new_log(LocalStorage(tmp_path / "log"))
    committed = write(log, aged("task", 2 * HOUR_MS))
    crashed = tmp_path / "log" / "data" / aged("task", 2 * HOUR_MS)
    crashed.mkdir()
    (crashed / ".tmp-0-000000.arrow-1234").write_bytes(b"half a segm")  # a create killed before it published
    assert log.storage.list("data") == sorted([committed[0].split("/")[1], crashed.name])
    assert log.collect_garbage(3600, now_ms=NOW_MS) == [f"data/{crashed.name}"]
    assert not crashed.exists() and files(log.storage) == sorted(committed)


def test_grace_must_not_be_negative():
    with pytest.raises(ReplayableOptionError, match="orphanGraceSeconds=-1 must be >= 0"):
        new_log().collect_garbage(-1)


def test_orphan_grace_option_is_parsed_and_validated_for_batch_writes():
    assert parse_write_options({"path": "/x"}, WRITE).orphan_grace_seconds == 3600 == DEFAULT_ORPHAN_GRACE_SECONDS
    assert parse_write_options({"path": "/x", "orphanGraceSeconds": " 0 "}, WRITE).orphan_grace_seconds == 0
    for bad, match in (
        ("-5", "orphanGraceSeconds=-5 must be >= 0"),
        ("1h", "orphanGraceSeconds='1h' is not an integer"),
    ):
        with pytest.raises(ReplayableOptionError, match=match):
            parse_write_options({"path": "/x", "orphanGraceSeconds": bad}, WRITE)
    with pytest.raises(UnknownOptionError, match="orphangraceseconds"):
        parse_write_options({"path": "/x", "checkpointLocation": "/c", "orphanGraceSeconds": "5"}, STREAM_WRITE)


def test_a_trim_collects_old_garbage_and_keeps_young():
    storage = MemoryStorage.named("replayable-gc-" + uuid.uuid4().hex)
    log = new_log(storage)
    write(log, aged("task", 0), 0)
    kept = write(log, aged("task", 0), 100)
    old_orphan = writer_directory("task", now_ms=NOW_MS - 1000 * HOUR_MS)  # long before the clock now
    young_orphan = writer_directory("task")
    write(log, old_orphan, commit=False)
    young = write(log, young_orphan, commit=False)
    source = LogSource.open(parse_read_options({"path": storage.uri, "retention": "0"}, STREAM_READ))
    source.commit({0: 3, 1: 3})  # drops the first directory's segments
    assert log.index().earliest_offsets() == {0: 3, 1: 3}
    assert files(storage) == sorted(kept + young)


def test_a_batch_commit_never_deletes_another_attempts_files():
    """A retried or speculative attempt may still be writing when the job commits: its files stay for the collector."""
    from datasources.replayable import _BatchWriter

    storage = MemoryStorage.named("replayable-gc-" + uuid.uuid4().hex)
    log = new_log(storage)
    options = parse_write_options({"path": storage.uri, "keyColumn": "key"}, WRITE)
    job = _BatchWriter(options, log.meta)
    reported = job.write(iter([rows(0, 10)]))
    still_writing = log.segment_writer(writer_directory("task", f"{job.job}-0-1"), max_records=2)
    still_writing.add(0, rows(50, 3))
    in_flight = [path for path in files(storage) if path not in {s.path for s in reported.segments}]
    assert len(in_flight) == 1

    job.commit([reported, None])
    assert sum(log.index().end_offsets().values()) == 10
    assert files(storage) == sorted([s.path for s in reported.segments] + in_flight)
    still_writing.add(0, rows(53, 2))  # the attempt goes on writing into its directory
    assert len(files(storage)) == len(reported.segments) + 2

    aborted = _BatchWriter(options, log.meta)
    finished = aborted.write(iter([rows(100, 4)]))
    aborted.abort([finished, None])  # deletes what the tasks that reported back wrote, nothing else
    assert not any(storage.exists(s.path) for s in finished.segments)
    assert len(files(storage)) == len(reported.segments) + 2
    assert sorted(log.collect_garbage(0)) == sorted({"data/" + p.split("/")[1] for p in in_flight})
    assert files(storage) == sorted(s.path for s in reported.segments)
