"""Hostile input: the readers of manifests, blobs, items and the log, fed random bytes and mutated real files.

Only typed errors come out (``SparkStateError`` subclasses), nothing hangs,
and no length field drives an allocation: a header claiming 2**40 rows (or
key groups, or splits) is refused before anything is read or allocated.
Names and paths from options or data cannot leave their storage's root.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datasources.errors import CorruptLogError
from datasources.log import ReplayableLog, decode_segment, encode_segment
from datasources.logindex import Commit, LogIndex, LogMeta, SegmentRef, SinkMark
from spark_state.errors import ConfigError, CorruptBlobError, InvalidPathError, SparkStateError
from spark_state.keyspace import KeyGroupRange
from spark_state.storage import LocalStorage, MemoryStorage
from spark_state.storage.base import check_path
from spark_state.store.blob import BlobEntry, decode_entry, encode_blob, read_blob_file
from spark_state.store.commitlog import decode_record, encode_record
from spark_state.store.manifest import ItemsRef, Manifest, check_component_name
from spark_state.store.manifestlog import ManifestReader, manifest_path
from tests.stores import Store
from tests.test_manifestlog import COMPONENT, KEYS, SCHEMA, Job, M, restore_all

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HOSTILE_NUMBERS = st.sampled_from([-1, 0, 1, 2**31, 2**40, 2**63, -(2**63), 10**30])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | HOSTILE_NUMBERS | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def mutate(body, data: st.DataObject):
    """``body`` (parsed JSON) with one value somewhere replaced by a hostile one."""
    if isinstance(body, dict) and body and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(body)))
        return {**body, key: mutate(body[key], data)}
    if isinstance(body, list) and body and data.draw(st.booleans()):
        index = data.draw(st.integers(0, len(body) - 1))
        return body[:index] + [mutate(body[index], data)] + body[index + 1 :]
    return data.draw(JSON_VALUES)


@pytest.fixture(scope="module")
def history():
    store = Store(MemoryStorage(), retained=3)
    job = Job(store, 2)
    for checkpoint_id in range(1, 4):
        for g in range(M):
            job.put(KEYS[g][checkpoint_id], checkpoint_id)
        job.checkpoint(checkpoint_id)
    return store, job


def copy_of(storage: MemoryStorage) -> MemoryStorage:
    copy = MemoryStorage()
    for path, data in storage._blobs.items():
        copy.create(path, data)
    return copy


@FUZZ
@given(st.binary(max_size=300) | st.builds(lambda n: b"[" * n, st.integers(1000, 100_000)))
def test_records_of_random_bytes_are_refused_typed(data):
    with pytest.raises(CorruptBlobError):
        decode_record(data, "record")


@FUZZ
@given(data=st.data())
def test_mutated_manifest_records_give_typed_errors_or_a_state_never_served_wrong(history, data):
    store, job = history
    storage = copy_of(store.storage)
    checkpoint_id = data.draw(st.sampled_from(ManifestReader(storage).ids()))
    path = manifest_path(checkpoint_id)
    body = decode_record(storage.read(path), path)
    storage.delete(path)
    storage.create(path, encode_record(mutate(body, data)))  # a valid checksum over hostile content
    try:
        if COMPONENT not in Store(storage).load(3).components:
            return  # a checkpoint without the component: a query starts it empty, as it does a new component
        restore_all(Store(storage), 3, 2)
    except SparkStateError:
        pass
    except AssertionError:
        pass  # restore_all's own checks of what it got (a forged manifest may point at other entries)


@pytest.mark.parametrize(
    "field, value",
    [
        ("schema", []),
        ("schema", None),
        ("schema", 7),
        ("key_columns", []),
        ("key_columns", [1]),
        ("key_columns", "key"),
    ],
)
def test_a_record_whose_schema_or_key_columns_are_not_text_is_refused_typed(history, field, value):
    """Found by the fuzz test above: a schema that was a list or null reached the decoder as a TypeError."""
    store, _ = history
    storage = copy_of(store.storage)
    path = manifest_path(3)
    body = decode_record(storage.read(path), path)
    component = body["components"][COMPONENT]
    assert field in component  # the newest record: a delta repeats its header only when it changed
    storage.delete(path)
    storage.create(path, encode_record({**body, "components": {COMPONENT: {**component, field: value}}}))
    with pytest.raises(CorruptBlobError, match=f"component {COMPONENT!r} claims the state schema"):
        restore_all(Store(storage), 3, 2)


@FUZZ
@given(data=st.data())
def test_mutated_blob_bytes_give_typed_errors_or_the_exact_state(history, data):
    store, job = history
    storage = copy_of(store.storage)
    blobs = sorted(p for p in storage._blobs if p.startswith("blobs/"))
    path = data.draw(st.sampled_from(blobs))
    blob = bytearray(storage.read(path))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    storage.delete(path)
    storage.create(path, bytes(blob))
    try:
        assert restore_all(Store(storage), 3, 2) == job.committed[3]
    except SparkStateError:
        pass
    with pytest.raises(CorruptBlobError) if bytes(blob) == b"" else _maybe_corrupt():
        read_blob_file(bytes(blob))


class _maybe_corrupt:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, CorruptBlobError)


def _entry_bytes(rows: int) -> tuple[bytes, pa.Schema]:
    schema = SCHEMA.blob_schema
    batch = pa.RecordBatch.from_pylist(
        [{"key": f"k{i}", **{c: None for c in schema.names[1:]}, "_deleted": False} for i in range(rows)], schema=schema
    )
    data, index = encode_blob(schema, [(0, "full", batch)], key_group_range=KeyGroupRange(0, 0), metadata={})
    entry = index.entries[0]
    return data[entry.offset : entry.offset + entry.length], schema


def test_an_entry_claiming_2_40_rows_is_refused_before_it_is_decoded():
    data, schema = _entry_bytes(777)
    with pytest.raises(CorruptBlobError, match="claims 1099511627776 rows"):
        decode_entry(data, schema, BlobEntry(0, "full", 0, len(data), 2**40, zlib.crc32(data)))
    # the Arrow header itself claiming 2**40 rows (its buffers hold 777), with a checksum that matches
    position = data.find(struct.pack("<q", 777))
    assert position > 0
    forged = data[:position] + struct.pack("<q", 2**40) + data[position + 8 :]
    with pytest.raises(CorruptBlobError, match="does not decode|rows"):
        decode_entry(forged, schema, BlobEntry(0, "full", 0, len(forged), 777, zlib.crc32(forged)))


def test_a_manifest_claiming_a_huge_key_space_or_entry_is_refused_before_any_restore(history):
    store, _ = history
    path = manifest_path(1)
    body = decode_record(store.storage.read(path), path)
    for field, value in (("max_parallelism", 2**40), ("parallelism", 2**40)):
        hostile = json.loads(json.dumps(body))
        hostile["components"][COMPONENT][field] = value
        with pytest.raises(CorruptBlobError, match=str(value)):
            Manifest.from_json(hostile, where=path)
    hostile = json.loads(json.dumps(body))
    hostile["components"][COMPONENT]["blobs"][0][7]["rows"][0] = 2**40
    with pytest.raises(CorruptBlobError, match="impossible entry"):
        Manifest.from_json(hostile, where=path)


@FUZZ
@given(
    st.recursive(st.integers() | st.text(max_size=4), lambda s: st.lists(s, max_size=3), max_leaves=10)
    | st.builds(lambda n: "[" * n + "]" * n, st.integers(1000, 50_000))
)
def test_instance_items_of_hostile_content_are_typed_errors_or_a_list(value):
    storage = MemoryStorage()
    data = value.encode() if isinstance(value, str) else json.dumps(value).encode()
    storage.create("items", data)
    from spark_state.store.blobstore import BlobStore

    try:
        assert isinstance(BlobStore(storage).read_items(ItemsRef("items", len(data), zlib.crc32(data))), list)
    except CorruptBlobError:
        pass


LOG_SCHEMA = pa.schema([pa.field("k", pa.string())])


@pytest.fixture(scope="module")
def log_files():
    storage = MemoryStorage()
    log = ReplayableLog.create(storage, LogMeta("log", 2, LOG_SCHEMA))
    for n in range(3):
        writer = log.segment_writer()
        writer.add(n % 2, pa.record_batch([pa.array([f"r{n}-{i}" for i in range(5)])], schema=LOG_SCHEMA))
        log.append(writer.finish(), SinkMark("s", n))
    return storage


@FUZZ
@given(data=st.data())
def test_mutated_log_records_give_typed_errors(log_files, data):
    storage = copy_of(log_files)
    path = data.draw(st.sampled_from(sorted(p for p in storage._blobs if not p.startswith("data/"))))
    body = decode_record(storage.read(path), path)
    storage.delete(path)
    storage.create(path, encode_record(mutate(body, data)))
    try:
        log = ReplayableLog.open(storage)
        list(log.read_range(log.index().earliest_offsets(), log.index().end_offsets()))
    except SparkStateError:
        pass


@FUZZ
@given(st.binary(max_size=400))
def test_segments_of_random_bytes_with_a_matching_checksum_are_typed_errors(data):
    ref = SegmentRef(0, 0, 5, "data/x", len(data), zlib.crc32(data))
    with pytest.raises(CorruptLogError):
        decode_segment(data, ref, LOG_SCHEMA)


def test_log_records_claiming_huge_numbers_are_refused_before_anything_is_allocated():
    with pytest.raises(CorruptLogError):
        LogMeta.from_json({**LogMeta("l", 2, LOG_SCHEMA).to_json(), "numSplits": 2**31 - 1}, "_log.json")
    segment = {"split": 0, "start": 0, "end": 2**40, "path": "data/x", "size": 10, "crc32": 0}
    with pytest.raises(CorruptLogError):
        Commit.from_json({"format": 1, "commit": 0, "segments": [segment], "trims": {}, "sink": None}, "c")
    with pytest.raises(CorruptLogError):
        LogIndex.from_json(
            {"format": 1, "commit": 0, "earliest": [0], "end": [2**40], "segments": [segment], "sinks": {}}, "s"
        )
    data = encode_segment([pa.record_batch([pa.array(["a"])], schema=LOG_SCHEMA)], LOG_SCHEMA)
    with pytest.raises(CorruptLogError, match="claims"):
        decode_segment(data, SegmentRef(0, 0, 2**40, "data/x", len(data), zlib.crc32(data)), LOG_SCHEMA)


# --- names and paths cannot escape their root -------------------------------------------------


@FUZZ
@given(st.lists(st.sampled_from(["a", "/", ".", "..", "\x00", "\\", "~", " ", "é", ".tmp-"]), max_size=8).map("".join))
def test_a_storage_path_is_refused_or_stays_inside_the_root(tmp_path, path):
    import tempfile

    root = os.path.realpath(tempfile.mkdtemp(dir=tmp_path))
    try:
        check_path(path)
    except InvalidPathError:
        return
    resolved = os.path.realpath(os.path.join(root, *path.split("/")))
    assert resolved.startswith(root + os.sep)
    LocalStorage(root).create(path, b"x")  # and it can be written there
    assert LocalStorage(root).read(path) == b"x"


@pytest.mark.parametrize("name", ["..", "../x", "a/b", "/abs", ".hidden", "a\x00b", "tab\tname", " padded", ""])
def test_component_names_that_could_leave_the_store_are_refused(name):
    with pytest.raises(ConfigError):
        check_component_name(name)


def test_paths_in_records_cannot_leave_the_root(history):
    store, _ = history
    storage = copy_of(store.storage)
    path = manifest_path(1)
    body = decode_record(storage.read(path), path)
    body["components"][COMPONENT]["blobs"][0][0] = "../../etc/passwd"
    storage.delete(path)
    storage.create(path, encode_record(body))
    with pytest.raises(SparkStateError):
        restore_all(Store(storage), 1, 2)
