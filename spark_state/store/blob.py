"""The state blob: one Arrow IPC file per (checkpoint, component, instance, key-group range).

Layout (a plain Arrow IPC *file*; ``pyarrow.ipc.open_file`` reads it without
this module)::

    "ARROW1\\0\\0" | schema message | batch(g1) | batch(g2) | ... | footer | "ARROW1"

- One record batch per *entry*: the state of one key group, either ``full``
  (every live key of the key group), ``delta`` (only keys changed since the
  previous checkpoint, deletions as rows with ``_deleted = true``) or
  ``merge`` (every key changed since the key group's full entry, deletions
  as tombstones: it replaces the chain's deltas, see ``chains``). Entries are
  sorted by key group, so the entries of any contiguous key-group range are
  one contiguous byte range of the blob.
- The schema is the component's blob schema (``schema.KeyedSchema``: the
  key columns, one struct column per state variable, and the bool column
  ``_deleted``). Its metadata records the format and hash versions, the
  component, checkpoint id, instance and the key-group range the blob was
  written for.
- Each batch's custom metadata names its key group and kind, so the blob is
  self-describing; the byte-offset index (``BlobIndex``) lives in the
  manifest, so a reader fetches exactly the entries it needs and never the
  footer.

Offsets in the index are absolute byte offsets into the blob; ``length``
covers the whole encapsulated IPC message (header, body and padding), so
bytes ``[offset, offset + length)`` decode on their own given the schema.
Each entry carries a CRC-32 of exactly those bytes, checked on every read:
corrupted state raises ``CorruptBlobError``, it is never returned.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import pyarrow as pa

from spark_state.errors import ConfigError, CorruptBlobError
from spark_state.keyspace import HASH_VERSION, KeyGroupRange
from spark_state.model.schema import DELETED_COLUMN  # noqa: F401 - the blob's tombstone column, re-exported

FORMAT_VERSION = 2
"""2: one struct column per state variable (``schema.KeyedSchema``); 1: flat value columns (not readable)."""
MAX_ENTRY_ROWS = 2**31 - 1
"""Most rows one entry may claim (a key group's keys); more is refused before anything is decoded."""
EntryKind = Literal["full", "delta", "merge"]
ENTRY_KINDS: tuple[str, ...] = ("full", "delta", "merge")
"""In this order: a blob index stores a kind as its position (``merge`` came last; older indexes read as before)."""
_MAGIC_PREFIX = 8  # b"ARROW1" plus two bytes of padding before the schema message


class BlobEntry(NamedTuple):
    """One key group's batch inside a blob: bytes ``[offset, offset + length)``.

    A named tuple, not a dataclass: every task parses the indexes of the
    blobs a checkpoint wrote (thousands of entries), and a tuple is built
    several times faster.
    """

    key_group: int
    kind: EntryKind
    offset: int
    length: int
    rows: int
    crc32: int
    earliest: tuple[int | None, int | None, int | None] | None = None
    """Earliest event, processing and expiry timer over the key group's keys when written (``timers``)."""
    live: int | None = None
    """Keys the key group's chain held up to and with this entry, when its writer knew (a state of one variable
    under one key column): a reader counts a restored chain without folding it. For reports only: what a chain
    holds is always what its entries fold to."""


@dataclass(frozen=True)
class BlobIndex:
    """The entries of one blob, sorted by key group, at most one per key group."""

    entries: tuple[BlobEntry, ...]

    def entry_for(self, key_group: int) -> BlobEntry | None:
        """Return the entry of ``key_group`` or None if the blob holds none for it."""
        return self._by_key_group.get(key_group)

    @functools.cached_property
    def _by_key_group(self) -> dict[int, BlobEntry]:
        """The entries by key group, made at the first lookup: a restore looks up an entry per key group it
        reads, several times (a binary search in Python cost more than the rest of finding the entry)."""
        return {entry.key_group: entry for entry in self.entries}

    def to_json(self) -> dict:
        """Columnar JSON form. Entries are contiguous in a blob as ``encode_blob`` writes it, so the
        offsets are stored as the first one (``start``) and follow from the lengths; an index whose
        entries are not contiguous keeps its ``offset`` column instead."""
        entries = self.entries
        obj: dict[str, Any] = {
            "key_group": [e.key_group for e in entries],
            "kind": [ENTRY_KINDS.index(e.kind) for e in entries],
            "length": [e.length for e in entries],
            "rows": [e.rows for e in entries],
            "crc32": [e.crc32 for e in entries],
        }
        if all(b.offset == a.offset + a.length for a, b in zip(entries, entries[1:])):
            obj["start"] = entries[0].offset if entries else 0
        else:
            obj["offset"] = [e.offset for e in entries]
        if any(e.earliest is not None for e in entries):
            obj["earliest"] = [list(e.earliest) if e.earliest is not None else None for e in entries]
        if any(e.live is not None for e in entries):
            obj["live"] = [e.live for e in entries]
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> BlobIndex:
        lengths = obj["length"]
        if "offset" in obj:
            offsets = obj["offset"]
        else:
            offsets, position = [], obj["start"]
            for length in lengths:
                offsets.append(position)
                position += length
        earliest = (
            [tuple(e) if e is not None else None for e in obj["earliest"]]
            if "earliest" in obj
            else [None] * len(lengths)
        )
        kinds = [ENTRY_KINDS[k] for k in obj["kind"]]
        live = obj["live"] if "live" in obj else [None] * len(lengths)
        columns = [obj["key_group"], kinds, offsets, lengths, obj["rows"], obj["crc32"], earliest, live]
        if len({len(column) for column in columns}) > 1:
            raise ValueError(f"index columns of different lengths: {[len(column) for column in columns]}")
        return cls(tuple(map(BlobEntry, *columns)))


def encode_blob(
    schema: pa.Schema,
    entries: Iterable[tuple[int, EntryKind, pa.Table | pa.RecordBatch]],
    *,
    key_group_range: KeyGroupRange,
    metadata: dict[str, str],
    compression: str | None = None,
    earliest: Mapping[int, tuple[int | None, int | None, int | None]] | None = None,
    live: Mapping[int, int] | None = None,
) -> tuple[bytes, BlobIndex]:
    """Serialize ``(key_group, kind, rows)`` entries into one blob.

    ``schema`` is the blob schema (``KeyedSchema.blob_schema``); every
    ``rows`` must have exactly its column names and types, including
    ``_deleted``. Key groups must be strictly increasing and inside
    ``key_group_range`` (inclusive bounds). Returns the blob bytes and their
    index; ``compression`` is an Arrow IPC codec ("lz4", "zstd") or None;
    ``earliest`` gives, per key group, the earliest timers its entry records
    (no later than the key group's earliest; see ``timers``); ``live``, per
    key group, the keys its chain holds with the entry (``BlobEntry.live``).
    """
    file_metadata = {
        "spark_state.format_version": str(FORMAT_VERSION),
        "spark_state.hash_version": str(HASH_VERSION),
        "spark_state.key_group_start": str(key_group_range.start),
        "spark_state.key_group_end": str(key_group_range.end),
        **{f"spark_state.{k}": v for k, v in metadata.items()},
    }
    schema = schema.with_metadata(file_metadata)
    options = pa.ipc.IpcWriteOptions(compression=compression)
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_file(sink, schema, options=options)
    index: list[tuple[int, EntryKind, int]] = []  # key group, kind, rows
    starts: list[int] = []
    previous, last = key_group_range.start - 1, key_group_range.end
    for key_group, kind, rows in entries:
        if kind not in ENTRY_KINDS:
            raise ConfigError(f"entry kind must be one of {ENTRY_KINDS}, got {kind!r}")
        if not previous < key_group <= last:
            raise ConfigError(
                f"blob entries must have strictly increasing key groups inside {key_group_range}; "
                f"got {key_group} after {previous}"
            )
        previous = key_group
        batch = rows if isinstance(rows, pa.RecordBatch) else _as_single_batch(rows, schema)
        starts.append(sink.tell())
        batch_metadata = {"spark_state.key_group": str(key_group), "spark_state.kind": kind}
        try:  # the writer refuses a batch of another schema before it writes anything
            writer.write_batch(batch, custom_metadata=batch_metadata)
        except pa.ArrowInvalid:  # names and types must match; field nullability and metadata may differ
            writer.write_batch(_as_single_batch(batch, schema), custom_metadata=batch_metadata)
        index.append((key_group, kind, batch.num_rows))
    ends = starts[1:] + [sink.tell()]
    writer.close()
    data = sink.getvalue().to_pybytes()
    if starts:
        # The writer emits magic and schema lazily with the first batch.
        starts[0] = _MAGIC_PREFIX + len(schema.serialize())
    earliest, live = earliest or {}, live or {}
    view = memoryview(data)
    entries_out = tuple(
        BlobEntry(
            key_group, kind, s, end - s, rows, zlib.crc32(view[s:end]), earliest.get(key_group), live.get(key_group)
        )
        for (key_group, kind, rows), s, end in zip(index, starts, ends)
    )
    if entries_out:
        first = entries_out[0]
        if decode_entry(data[first.offset : first.offset + first.length], schema, first).num_rows != first.rows:
            raise CorruptBlobError("blob self-check failed: the first entry does not decode at its offset")
    return data, BlobIndex(entries_out)


def _as_single_batch(rows: pa.Table | pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    if isinstance(rows, pa.Table):
        rows = rows.combine_chunks()
        batches = rows.to_batches()
        batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=schema)
    else:
        batch = rows
    if batch.schema.names != schema.names or batch.schema.types != schema.types:
        raise ConfigError(
            f"entry rows have schema {batch.schema.remove_metadata()} but the blob needs {schema.remove_metadata()}"
        )
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def decode_entry(
    data: bytes | memoryview, schema: pa.Schema, entry: BlobEntry, *, where: str = "blob"
) -> pa.RecordBatch:
    """Decode one entry's bytes (exactly ``entry.length`` of them) after checking its CRC-32."""
    if len(data) != entry.length or zlib.crc32(data) != entry.crc32:
        raise CorruptBlobError(
            f"key group {entry.key_group} in {where} fails its checksum (corrupt or truncated); restore the file "
            "from a replica, or start a new checkpointLocation from an older retained checkpoint "
            "(spark.state.restoreFrom=<id>)"
        )
    if not 0 <= entry.rows <= MAX_ENTRY_ROWS:
        raise CorruptBlobError(
            f"key group {entry.key_group} in {where} claims {entry.rows} rows; no entry has that many"
        )
    try:
        message = pa.ipc.read_message(pa.py_buffer(data))
        batch = pa.ipc.read_record_batch(message, schema)
        batch.validate()  # lengths against buffer sizes: a header claiming rows its buffers lack is refused here
    except (pa.ArrowException, EOFError, OSError) as exc:
        raise CorruptBlobError(f"key group {entry.key_group} in {where} does not decode: {exc}") from exc
    if batch.num_rows != entry.rows:
        raise CorruptBlobError(
            f"key group {entry.key_group} in {where} has {batch.num_rows} rows, index says {entry.rows}"
        )
    return batch


def read_blob_file(
    data: bytes, index: BlobIndex | None = None
) -> tuple[pa.Schema, list[tuple[int, str, pa.RecordBatch]]]:
    """Read a whole blob without a manifest (offline inspection).

    Returns the schema (with the blob's metadata) and ``(key_group, kind,
    batch)`` per entry. When ``index`` (from the manifest) is given, every
    entry's checksum and offset are verified too.
    """
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        batches = []
        for i in range(reader.num_record_batches):
            batch, meta = reader.get_batch_with_custom_metadata(i)
            batches.append((int(meta[b"spark_state.key_group"]), meta[b"spark_state.kind"].decode(), batch))
    except (pa.ArrowException, OSError, KeyError, TypeError, ValueError) as exc:
        raise CorruptBlobError(f"not a readable spark-state blob: {exc}") from exc
    if index is not None:
        if [e.key_group for e in index.entries] != [g for g, _, _ in batches]:
            raise CorruptBlobError("blob entries do not match the manifest's index")
        view = memoryview(data)
        for entry in index.entries:
            decode_entry(view[entry.offset : entry.offset + entry.length], reader.schema, entry)
    return reader.schema, batches
