"""Reading Spark's checkpoint: offsets entries and the leftovers of an interrupted first write (no Spark), and the
reads through spark-state's storage and through Spark's Hadoop file system (the last tests, on both)."""

from __future__ import annotations

import uuid

import pytest

from spark_state.driver.conf import checkpoint_storage_uri
from spark_state.errors import CheckpointLocationError
from spark_state.spark.checkpoint import (
    HadoopFiles,
    SparkCheckpoint,
    StoredFiles,
    checkpoint_files,
    interrupted_first_batch,
    parse_offsets_entry,
    qualified_location,
)

WHERE = "file:/chk"


def temp(batch: int) -> tuple[str, str]:
    """The names Spark's ``createAtomic`` gives the temp file of ``offsets/<batch>`` and its checksum."""
    name = f".{batch}.{uuid.uuid4()}.tmp"
    return name, f".{name}.crc"


def test_offsets_entries_are_keyed_by_their_source_id_or_position():
    text = "\n".join(
        [
            "v1",
            '{"batchWatermarkMs":0,"batchTimestampMs":1,"conf":{}}',
            '{"source_id": "replayable:file:///e", "0": 4}',
            '{"logOffset":3}',
            "-",
        ]
    )
    assert parse_offsets_entry(text) == {
        "replayable:file:///e": {"source_id": "replayable:file:///e", "0": 4},
        "spark-source-1": {"logOffset": 3},
    }


def test_the_leftovers_of_an_interrupted_first_write_are_recognised():
    tmp, crc = temp(0)
    assert interrupted_first_batch([tmp, crc], [], WHERE) == sorted([tmp, crc])
    assert interrupted_first_batch([tmp], [], WHERE) == [tmp]
    assert interrupted_first_batch([crc], [], WHERE) == [crc]


def test_nothing_is_touched_once_an_entry_is_complete_or_when_offsets_is_empty():
    tmp, crc = temp(0)
    assert interrupted_first_batch(["0", ".0.crc", tmp, crc], [], WHERE) == []
    assert interrupted_first_batch(["0", ".0.crc"], [], WHERE) == []
    assert interrupted_first_batch([], [], WHERE) == []
    later, _ = temp(7)
    assert interrupted_first_batch(["6", later], ["5"], WHERE) == []


@pytest.mark.parametrize(
    "names",
    [
        [".0.crc"],  # the checksum of a complete entry whose entry is gone
        [temp(3)[0]],  # a temp file of another batch
        ["notes.txt"],
        [".0.not-a-uuid.tmp"],
        [temp(0)[0], ".DS_Store"],
    ],
)
def test_anything_else_is_refused_naming_the_file_and_the_fix(names):
    with pytest.raises(CheckpointLocationError, match="delete .* by hand"):
        interrupted_first_batch(names, [], WHERE)


def test_commits_without_offsets_is_refused():
    tmp, _ = temp(0)
    with pytest.raises(CheckpointLocationError, match="commits holds committed batches"):
        interrupted_first_batch([tmp], ["0"], WHERE)


def test_checkpoint_locations_map_to_the_storage_that_reads_them():
    assert checkpoint_storage_uri("file:/data/chk") == "/data/chk"
    assert checkpoint_storage_uri("file:///data/chk/") == "/data/chk"
    assert checkpoint_storage_uri("webhdfs://nn:9870/chk") == "webhdfs://nn:9870/chk"
    settings = {"spark.state.s3.endpoint": "http://127.0.0.1:9000"}
    assert checkpoint_storage_uri("s3a://bucket/chk", settings.get).startswith("s3://bucket/chk?")
    assert checkpoint_storage_uri("abfs://c@a.dfs.core.windows.net/chk") is None  # Hadoop's, on classic only
    assert checkpoint_storage_uri("dbfs:/chk") is None


class _Connect:
    """A session as Spark Connect's client sees it: settings, no JVM."""

    def __init__(self, **settings):
        self.conf = type("Conf", (), {"get": staticmethod(lambda key, default=None: settings.get(key, default))})


def test_without_a_jvm_paths_are_local_unless_the_default_file_system_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert qualified_location(_Connect(), "chk") == f"file:{tmp_path}/chk"
    assert qualified_location(_Connect(), "file:///data/chk") == "file:/data/chk"
    assert qualified_location(_Connect(), "s3a://b/chk") == "s3a://b/chk"
    hdfs = _Connect(**{"spark.hadoop.fs.defaultFS": "webhdfs://nn:9870"})
    assert qualified_location(hdfs, "/chk") == "webhdfs://nn:9870/chk"
    files = checkpoint_files(_Connect(), str(tmp_path), checkpoint_storage_uri)
    assert isinstance(files, StoredFiles) and files.uri == f"file:{tmp_path}"
    with pytest.raises(CheckpointLocationError, match="over Spark Connect .* no backend for that scheme"):
        checkpoint_files(_Connect(), "abfs://c@a.dfs.core.windows.net/chk", checkpoint_storage_uri)


def _files(kind: str, spark, path) -> HadoopFiles | StoredFiles:
    return HadoopFiles(spark, str(path)) if kind == "hadoop" else StoredFiles(str(path), f"file:{path}")


@pytest.mark.spark
@pytest.mark.parametrize("kind", ["stored", "hadoop"])
def test_a_checkpoint_reads_its_metadata_offsets_and_commits_and_hands_out_copies(spark, tmp_path, kind):
    for directory in ("offsets", "commits"):
        (tmp_path / directory).mkdir()
    (tmp_path / "metadata").write_text('{"id":"q-1"}\n')
    for batch in (0, 1):
        (tmp_path / "offsets" / str(batch)).write_text(
            f'v1\n{{"batchTimestampMs":{5 + batch}}}\n{{"source_id":"log","splits":{{"0":{batch}}}}}\n'
        )
    (tmp_path / "commits" / "0").write_text("v1\n{}\n")
    checkpoint = SparkCheckpoint(_files(kind, spark, tmp_path))
    assert checkpoint.uri == f"file:{tmp_path}"
    assert checkpoint.query_id() == "q-1" and checkpoint.last_committed_batch() == 0
    assert checkpoint.offsets_entry(1) == ({"log": {"source_id": "log", "splits": {"0": 1}}}, 6)
    assert checkpoint.offsets_entry(2) is None  # no entry yet: None, not an error
    (tmp_path / "offsets" / "2").write_text('v1\n{"batchTimestampMs":7}\n-\n')
    assert checkpoint.offsets_entry(2) == ({}, 7)  # written since: read now
    entry = checkpoint.offsets(0)
    entry["log"]["splits"]["0"] = 99  # a caller's change
    assert checkpoint.offsets(0) == {"log": {"source_id": "log", "splits": {"0": 0}}}
    assert SparkCheckpoint(_files(kind, spark, tmp_path / "elsewhere")).query_id() is None


@pytest.mark.spark
@pytest.mark.parametrize("kind", ["stored", "hadoop"])
def test_listings_name_every_file_whatever_its_name_and_however_many(spark, tmp_path, kind):
    """A listing is a few JVM calls however many files there are; names with spaces, commas, escapes or a line
    break come back whole."""
    for directory in ("offsets", "commits"):
        (tmp_path / directory).mkdir()
    odd = ["a, b", "x y", "p%20q", "line\nbreak", "120"]
    for name in [str(batch) for batch in range(100)] + odd:
        (tmp_path / "commits" / name).write_text("v1\n{}\n")
    tmp, crc = temp(0)
    for name in (tmp, crc):
        (tmp_path / "offsets" / name).write_text("x")
    checkpoint = SparkCheckpoint(_files(kind, spark, tmp_path))
    assert sorted(checkpoint._names("commits")) == sorted([str(batch) for batch in range(100)] + odd)
    assert checkpoint.last_committed_batch() == 120
    (tmp_path / "commits" / "line\nbreak").unlink()
    assert sorted(checkpoint._names("commits")) == sorted([str(batch) for batch in range(100)] + odd[:3] + ["120"])
    assert checkpoint._names("nowhere") == []
    (tmp_path / "empty").mkdir()
    assert checkpoint._names("empty") == []
    for name in list((tmp_path / "commits").iterdir()):
        name.unlink()
    assert checkpoint.clear_interrupted_first_batch() == sorted([tmp, crc])  # the listing found both
    assert checkpoint._names("offsets") == []
