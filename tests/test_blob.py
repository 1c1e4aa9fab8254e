"""Unit and property tests of spark_state.store.blob (no Spark, no storage)."""

from __future__ import annotations

import zlib

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import ConfigError, CorruptBlobError
from spark_state.keyspace import HASH_VERSION, KeyGroupRange
from spark_state.store.blob import (
    DELETED_COLUMN,
    FORMAT_VERSION,
    BlobEntry,
    BlobIndex,
    decode_entry,
    encode_blob,
    read_blob_file,
)

# --------------------------------------------------------------------------- fixtures
#
# The blob format takes any schema ending in ``_deleted``; these tests use flat ones (a component's real
# blob schema, with one struct column per state variable, is ``schema.KeyedSchema.blob_schema``).


def blob_schema(state_schema: pa.Schema) -> pa.Schema:
    return state_schema.append(pa.field(DELETED_COLUMN, pa.bool_(), nullable=False))


INT_KEY = pa.schema([("id", pa.int64()), ("count", pa.int64())])
STRING_KEY = pa.schema([("name", pa.string()), ("score", pa.float64())])
COMPOSITE_KEY = pa.schema(
    [
        ("tenant", pa.string()),
        ("user", pa.int32()),
        ("note", pa.string()),
        ("history", pa.list_(pa.int64())),
    ]
)


def _int_rows(key_group: int, n: int) -> dict:
    return {"id": [key_group * 1000 + i for i in range(n)], "count": [i * i - 7 for i in range(n)]}


def _string_rows(key_group: int, n: int) -> dict:
    return {
        "name": [f"k{key_group}-{i}-é" for i in range(n)],
        "score": [None if i % 3 == 0 else i / 4 for i in range(n)],
    }


def _composite_rows(key_group: int, n: int) -> dict:
    return {
        "tenant": [f"t{key_group % 3}" for i in range(n)],
        "user": [key_group * 100 + i for i in range(n)],
        "note": [None if i % 2 else f"note {i}" for i in range(n)],
        "history": [None if i == 1 else list(range(i)) for i in range(n)],
    }


SCHEMAS = {
    "int64 key": (INT_KEY, _int_rows),
    "string key, nullable value": (STRING_KEY, _string_rows),
    "composite key, nulls and a list column": (COMPOSITE_KEY, _composite_rows),
}


def _entry_rows(state_schema: pa.Schema, make, key_group: int, n: int, *, deleted_every: int = 0) -> pa.Table:
    columns = make(key_group, n)
    columns[DELETED_COLUMN] = [bool(deleted_every) and i % deleted_every == deleted_every - 1 for i in range(n)]
    return pa.table(columns, schema=blob_schema(state_schema))


def _sample_entries(state_schema: pa.Schema, make) -> list[tuple[int, str, pa.Table]]:
    """Entries for key groups 3, 4, 9, 10 and 15 of range [3, 15]: full, delta, empty full, several sizes."""
    return [
        (3, "full", _entry_rows(state_schema, make, 3, 5)),
        (4, "delta", _entry_rows(state_schema, make, 4, 4, deleted_every=2)),
        (9, "full", _entry_rows(state_schema, make, 9, 0)),
        (10, "full", _entry_rows(state_schema, make, 10, 1)),
        (15, "delta", _entry_rows(state_schema, make, 15, 12, deleted_every=3)),
    ]


RANGE = KeyGroupRange(3, 15)


def _encode(state_schema, entries, **kwargs):
    return encode_blob(
        blob_schema(state_schema),
        entries,
        key_group_range=kwargs.pop("key_group_range", RANGE),
        metadata=kwargs.pop("metadata", {"component": "counts", "checkpoint_id": "7", "instance": "2"}),
        **kwargs,
    )


@pytest.fixture(params=sorted(SCHEMAS), scope="module")
def encoded(request):
    state_schema, make = SCHEMAS[request.param]
    entries = _sample_entries(state_schema, make)
    data, index = _encode(state_schema, entries)
    return state_schema, entries, data, index


# --------------------------------------------------------------------------- encode/decode


def test_index_lists_entries_in_order_with_row_counts(encoded):
    _, entries, _, index = encoded
    assert [(e.key_group, e.kind, e.rows) for e in index.entries] == [(g, k, t.num_rows) for g, k, t in entries]


def test_entries_are_contiguous_byte_ranges_inside_the_blob(encoded):
    _, _, data, index = encoded
    first, last = index.entries[0], index.entries[-1]
    assert data[:6] == b"ARROW1"
    assert first.offset > 8  # after the magic and the schema message
    for before, after in zip(index.entries, index.entries[1:]):
        assert after.offset == before.offset + before.length
    assert last.offset + last.length < len(data) - 6  # the footer follows
    for entry in index.entries:
        assert entry.crc32 == zlib.crc32(data[entry.offset : entry.offset + entry.length])


def test_each_entry_decodes_from_its_own_byte_slice(encoded):
    state_schema, entries, data, index = encoded
    schema = blob_schema(state_schema)
    for (key_group, _, table), entry in zip(entries, index.entries):
        piece = bytes(data[entry.offset : entry.offset + entry.length])  # a copy: nothing else of the blob
        batch = decode_entry(piece, schema, entry)
        assert batch.schema.equals(schema)
        assert batch.to_pylist() == table.to_pylist(), key_group
        # memoryview slices decode the same way
        assert decode_entry(memoryview(data)[entry.offset : entry.offset + entry.length], schema, entry).equals(batch)


def test_record_batch_entries_and_multi_chunk_tables_encode_the_same():
    state_schema, make = SCHEMAS["composite key, nulls and a list column"]
    table = _entry_rows(state_schema, make, 5, 6, deleted_every=4)
    chunked = pa.concat_tables([table.slice(0, 2), table.slice(2, 3), table.slice(5)])
    assert chunked.column(0).num_chunks == 3
    as_batch = table.combine_chunks().to_batches()[0]
    results = [_encode(state_schema, [(5, "full", rows)]) for rows in (table, chunked, as_batch)]
    decoded = [
        decode_entry(data[e.offset : e.offset + e.length], blob_schema(state_schema), e).to_pylist()
        for data, index in results
        for e in index.entries
    ]
    assert decoded[0] == decoded[1] == decoded[2] == table.to_pylist()


def test_empty_blob_has_no_entries_and_still_opens():
    data, index = _encode(INT_KEY, [])
    assert index.entries == ()
    schema, batches = read_blob_file(data, index)
    assert batches == []
    assert schema.metadata[b"spark_state.key_group_start"] == b"3"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(-(2**63), 2**63 - 1),
            st.one_of(st.none(), st.text(max_size=20)),
            st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), max_size=5)),
            st.booleans(),
        ),
        max_size=30,
    ),
    st.integers(0, 4),
)
def test_roundtrip_property(rows, split):
    """Arbitrary rows split over two key groups decode back exactly."""
    state_schema = pa.schema([("k", pa.int64()), ("s", pa.string()), ("l", pa.list_(pa.int32()))])
    schema = blob_schema(state_schema)
    cut = min(split * 7, len(rows))
    parts = [rows[:cut], rows[cut:]]
    tables = [pa.table(list(zip(*part)) if part else [[], [], [], []], schema=schema) for part in parts]
    data, index = encode_blob(
        schema, [(0, "full", tables[0]), (1, "delta", tables[1])], key_group_range=KeyGroupRange(0, 1), metadata={}
    )
    for table, entry in zip(tables, index.entries):
        decoded = decode_entry(data[entry.offset : entry.offset + entry.length], schema, entry)
        assert decoded.to_pylist() == table.to_pylist()


# --------------------------------------------------------------------------- self-describing file


def test_file_opens_with_plain_pyarrow_and_batches_name_key_group_and_kind(encoded):
    state_schema, entries, data, _ = encoded
    reader = pa.ipc.open_file(pa.py_buffer(data))
    assert reader.num_record_batches == len(entries)
    for i, (key_group, kind, table) in enumerate(entries):
        batch, meta = reader.get_batch_with_custom_metadata(i)
        assert meta[b"spark_state.key_group"] == str(key_group).encode()
        assert meta[b"spark_state.kind"] == kind.encode()
        assert batch.to_pylist() == table.to_pylist()


def test_schema_metadata_records_versions_range_and_caller_metadata(encoded):
    state_schema, _, data, _ = encoded
    schema = pa.ipc.open_file(pa.py_buffer(data)).schema
    assert schema.remove_metadata().equals(blob_schema(state_schema))
    assert schema.metadata == {
        b"spark_state.format_version": str(FORMAT_VERSION).encode(),
        b"spark_state.hash_version": str(HASH_VERSION).encode(),
        b"spark_state.key_group_start": b"3",
        b"spark_state.key_group_end": b"15",
        b"spark_state.component": b"counts",
        b"spark_state.checkpoint_id": b"7",
        b"spark_state.instance": b"2",
    }


@pytest.mark.parametrize("with_index", [False, True])
def test_read_blob_file(encoded, with_index):
    state_schema, entries, data, index = encoded
    schema, batches = read_blob_file(data, index if with_index else None)
    assert schema.metadata[b"spark_state.key_group_end"] == b"15"
    assert [(g, k) for g, k, _ in batches] == [(g, k) for g, k, _ in entries]
    assert [b.to_pylist() for _, _, b in batches] == [t.to_pylist() for _, _, t in entries]


def test_read_blob_file_rejects_an_index_of_other_entries(encoded):
    _, _, data, index = encoded
    fewer = BlobIndex(index.entries[1:])
    with pytest.raises(CorruptBlobError, match="do not match the manifest"):
        read_blob_file(data, fewer)


def test_read_blob_file_checks_every_entry_against_the_index(encoded):
    _, _, data, index = encoded
    entries = list(index.entries)
    entries[-1] = entries[-1]._replace(crc32=entries[-1].crc32 ^ 1)
    with pytest.raises(CorruptBlobError, match=f"key group {entries[-1].key_group} .*checksum"):
        read_blob_file(data, BlobIndex(tuple(entries)))


@pytest.mark.parametrize("data", [b"", b"ARROW1", b"not a blob at all, just bytes"])
def test_read_blob_file_rejects_non_blobs(data):
    with pytest.raises(CorruptBlobError, match="not a readable spark-state blob"):
        read_blob_file(data)


def test_read_blob_file_rejects_arrow_files_without_key_group_metadata():
    table = pa.table({"k": [1]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(CorruptBlobError):
        read_blob_file(sink.getvalue().to_pybytes())


# --------------------------------------------------------------------------- corruption


@pytest.fixture(scope="module")
def small_blob():
    state_schema, make = SCHEMAS["composite key, nulls and a list column"]
    entries = _sample_entries(state_schema, make)
    data, index = _encode(state_schema, entries)
    return blob_schema(state_schema), entries, data, index


@settings(max_examples=300, deadline=None)
@given(position=st.integers(min_value=0), flip=st.integers(1, 255))
def test_any_flipped_byte_inside_an_entry_is_detected(small_blob, position, flip):
    schema, entries, data, index = small_blob
    start = index.entries[0].offset
    end = index.entries[-1].offset + index.entries[-1].length
    position = start + position % (end - start)
    corrupted = bytearray(data)
    corrupted[position] ^= flip
    hit = next(e for e in index.entries if e.offset <= position < e.offset + e.length)
    for entry, (_, _, table) in zip(index.entries, entries):
        piece = bytes(corrupted[entry.offset : entry.offset + entry.length])
        if entry is hit:
            with pytest.raises(CorruptBlobError, match=f"key group {entry.key_group} in blobs/x fails its checksum"):
                decode_entry(piece, schema, entry, where="blobs/x")
        else:  # corruption stays local to the entry it hits
            assert decode_entry(piece, schema, entry).to_pylist() == table.to_pylist()


def test_truncated_or_extended_slices_are_corrupt(small_blob):
    schema, _, data, index = small_blob
    for entry in index.entries:
        whole = data[entry.offset : entry.offset + entry.length]
        for cut in range(entry.length):
            with pytest.raises(CorruptBlobError, match="corrupt or truncated"):
                decode_entry(whole[:cut], schema, entry)
        with pytest.raises(CorruptBlobError):
            decode_entry(data[entry.offset : entry.offset + entry.length + 1], schema, entry)


def test_slice_of_another_entry_is_rejected(small_blob):
    schema, _, data, index = small_blob
    a, b = index.entries[0], index.entries[1]
    with pytest.raises(CorruptBlobError):
        decode_entry(data[b.offset : b.offset + a.length], schema, a)


def test_row_count_mismatch_with_the_index_is_corrupt(small_blob):
    schema, _, data, index = small_blob
    entry = index.entries[0]
    wrong = entry._replace(rows=entry.rows + 1)
    with pytest.raises(CorruptBlobError, match=f"has {entry.rows} rows, index says {entry.rows + 1}"):
        decode_entry(data[entry.offset : entry.offset + entry.length], schema, wrong)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 16,  # reads as end of stream
        b"\xff\xff\xff\xff" + b"\x00" * 12,  # continuation marker, then end of stream
        b"\x01" * 16,  # absurd metadata length
        b"\xff\xff\xff\xff\x08\x00\x00\x00" + b"\x00" * 8,  # not a flatbuffer
    ],
)
def test_bytes_with_a_matching_checksum_that_do_not_decode_are_corrupt(garbage):
    """An index pointing at the wrong bytes (but with their CRC) must not escape as a non-spark-state error."""
    entry = BlobEntry(0, "full", 0, len(garbage), 0, zlib.crc32(garbage))
    with pytest.raises(CorruptBlobError, match="does not decode"):
        decode_entry(garbage, blob_schema(INT_KEY), entry)


def test_schema_message_is_not_an_entry():
    schema = blob_schema(INT_KEY)
    message = schema.serialize().to_pybytes()
    entry = BlobEntry(0, "full", 0, len(message), 0, zlib.crc32(message))
    with pytest.raises(CorruptBlobError, match="does not decode"):
        decode_entry(message, schema, entry)


# --------------------------------------------------------------------------- invalid input


def _one(g: int, kind: str = "full") -> tuple[int, str, pa.Table]:
    return (g, kind, _entry_rows(INT_KEY, _int_rows, g, 2))


@pytest.mark.parametrize(
    "groups",
    [[4, 3], [3, 3], [5, 9, 7]],
    ids=["decreasing", "duplicate", "out of order later"],
)
def test_entries_out_of_order_are_rejected(groups):
    with pytest.raises(ConfigError, match="strictly increasing"):
        _encode(INT_KEY, [_one(g) for g in groups])


@pytest.mark.parametrize("group", [2, 16, 100])
def test_entries_outside_the_range_are_rejected(group):
    with pytest.raises(ConfigError, match=r"inside \[3, 15\]"):
        _encode(INT_KEY, [_one(3), _one(group)] if group > 3 else [_one(group)])


def test_range_bounds_are_inclusive():
    _, index = _encode(INT_KEY, [_one(3), _one(15)])
    assert [e.key_group for e in index.entries] == [3, 15]


def test_unknown_entry_kind_is_rejected():
    with pytest.raises(ConfigError, match="entry kind"):
        _encode(INT_KEY, [_one(3, "partial")])


@pytest.mark.parametrize(
    "rows",
    [
        pa.table({"id": [1], "count": [2]}),  # no _deleted
        pa.table({"id": [1], "count": [2.0], DELETED_COLUMN: [False]}),  # wrong type
        pa.table({"count": [2], "id": [1], DELETED_COLUMN: [False]}),  # wrong order
        pa.table({"id": pa.array([1], pa.int32()), "count": [2], DELETED_COLUMN: [False]}),  # narrower key
    ],
    ids=["missing _deleted", "wrong value type", "wrong column order", "narrower key"],
)
@pytest.mark.parametrize("as_batch", [False, True], ids=["table", "record batch"])
def test_rows_with_the_wrong_schema_are_rejected(rows, as_batch):
    if as_batch:  # record batches go to the IPC writer directly; its refusal must become the same error
        rows = rows.to_batches()[0]
    with pytest.raises(ConfigError, match="entry rows have schema"):
        _encode(INT_KEY, [(3, "full", rows)])


def test_a_record_batch_differing_only_in_nullability_and_metadata_is_written_in_the_blob_schema():
    schema = blob_schema(INT_KEY)
    loose = pa.schema([f.with_nullable(not f.nullable) for f in schema]).with_metadata({"from": "elsewhere"})
    batch = pa.RecordBatch.from_pylist([{"id": 1, "count": 2, DELETED_COLUMN: False}], schema=loose)
    data, index = _encode(INT_KEY, [(3, "full", batch)])
    (entry,) = index.entries
    decoded = decode_entry(data[entry.offset : entry.offset + entry.length], schema, entry)
    assert decoded.schema.equals(schema) and decoded.to_pylist() == batch.to_pylist()


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_compressed_blobs_roundtrip_and_are_smaller(codec):
    state_schema = pa.schema([("k", pa.int64()), ("v", pa.string())])
    schema = blob_schema(state_schema)
    tables = [
        pa.table(
            {"k": list(range(g, g + 2000)), "v": ["the same long value " * 4] * 2000, DELETED_COLUMN: [False] * 2000},
            schema=schema,
        )
        for g in (0, 1)
    ]
    entries = [(0, "full", tables[0]), (1, "delta", tables[1])]
    plain, _ = encode_blob(schema, entries, key_group_range=KeyGroupRange(0, 1), metadata={})
    data, index = encode_blob(schema, entries, key_group_range=KeyGroupRange(0, 1), metadata={}, compression=codec)
    assert len(data) < len(plain) / 4
    for table, entry in zip(tables, index.entries):
        assert decode_entry(data[entry.offset : entry.offset + entry.length], schema, entry).equals(
            pa.RecordBatch.from_pylist(table.to_pylist(), schema=schema)
        )
    _, batches = read_blob_file(data, index)
    assert [b.num_rows for _, _, b in batches] == [2000, 2000]


# --------------------------------------------------------------------------- index


def test_index_json_roundtrip_and_lookup(encoded):
    _, _, _, index = encoded
    again = BlobIndex.from_json(index.to_json())
    assert again == index
    present = {e.key_group: e for e in index.entries}
    for key_group in range(0, 20):
        assert again.entry_for(key_group) == present.get(key_group)


def test_recorded_key_counts_travel_in_the_index_and_only_when_given(encoded):
    """``live`` per key group: in the index's JSON when any entry has one (null for the others), absent
    otherwise, so an index written without counts reads as before."""
    state_schema, entries, _, index = encoded
    _, counted = _encode(state_schema, entries, live={4: 7, 10: 0})
    assert [e.live for e in counted.entries] == [
        7 if e.key_group == 4 else 0 if e.key_group == 10 else None for e in counted.entries
    ]
    assert BlobIndex.from_json(counted.to_json()) == counted
    assert "live" not in index.to_json() and all(e.live is None for e in BlobIndex.from_json(index.to_json()).entries)


def test_index_from_json_rejects_columns_of_different_lengths(encoded):
    _, _, _, index = encoded
    obj = index.to_json()
    obj["crc32"] = obj["crc32"][:-1]
    with pytest.raises(ValueError):
        BlobIndex.from_json(obj)
