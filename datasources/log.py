"""The replayable log: an append-only, split, offset-addressable log on a ``Storage``.

No pyspark here; ``datasources.replayable`` is the Spark edge. The words
(split, offset, end, earliest, segment, commit), the index and the pure
planning are in ``datasources.logindex``; key routing is ``datasources.routing``.
This module does the I/O: segment files, commits, snapshots, reads and trims.

Layout under the log's root::

    _log.json                 name, num_splits, payload schema (written once)
    _commits/<20-digit id>.json
    _index/<20-digit id>.json  index snapshot after that commit (a cache)
    data/<writer dir>/<split>-<seq>.arrow

A writer directory belongs to one writer (one attempt of one task) and is
named ``<kind>-<unix millis>-...-<random hex>`` (``writer_directory``): the
time its writer started, which is how the garbage collector tells its age.
Logs written before may hold names without a time (``data/job-<hex>/<task>/``,
``data/stream-<hex>-<task>-<attempt>/``); they count as old.

``_log.json``, commits and snapshots are records framed with a CRC-32
(``spark_state.store.commitlog.encode_record``); commits and snapshots are written
and read through ``spark_state.store.commitlog.CommitLog``. Reading one that fails
its checksum, is truncated or does not parse raises ``CorruptLogError`` naming
the file. Files written before framing (plain JSON objects) are still read,
unchecked.

Append protocol (``ReplayableLog.append``), in this order:

1. Writers write segments to unique names under ``data/``. They are invisible:
   only a commit makes a segment part of the log.
2. Refresh the index: the latest snapshot, then every commit after it.
3. If the append carries a sink mark ``(sink_id, batch)`` and the index already
   holds a batch ``>= batch`` for that sink, stop: the batch is in the log.
4. Assign offsets: each split's new segments continue at that split's end, in
   the order the writer gave them.
5. Create commit ``last + 1`` (``CommitLog.create``: one atomic create of
   ``_commits/<last + 1>.json`` without overwrite). This single create is the
   commit point. If another writer created that id first, go back to step 2
   (the offsets are re-assigned; segments need no rewrite because they do not
   store offsets).
6. Every ``INDEX_SNAPSHOT_INTERVAL`` commits, write an index snapshot. A
   snapshot only caches what commits say; losing one loses nothing.

Trim protocol (``ReplayableLog.trim``): commit a trim record (same race as
step 5), then delete the segments it dropped. A crash between the two leaves
unreferenced files, never a reference to a missing one.

Garbage collection (``ReplayableLog.collect_garbage``): delete what under
``data/`` no commit references and whose writer started at least a grace
period ago. Failed, retried, speculative and killed write attempts leave such
files behind; a writer that is still running may be writing next to them, so
nothing deletes another writer's files at commit time. The collector runs
after each batch write's commit and after each trim, once they passed their
commit point, so its failure is logged and fails nothing.

Every commit records the size and CRC-32 of each segment it adds; a read
checks both, so a corrupt or truncated segment raises ``CorruptSegmentError``
naming the file instead of returning rows.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from datasources.errors import (
    CommitContentionError,
    CorruptLogError,
    CorruptSegmentError,
    IncompatibleLogError,
    LogNotFoundError,
    ReplayableOptionError,
    SegmentMissingError,
)
from datasources.logindex import (
    MAX_SEGMENT_ROWS,
    Commit,
    LogIndex,
    LogMeta,
    ReadTask,
    SegmentRef,
    SinkMark,
    StagedSegment,
    apply_commit,
    plan_append,
    plan_reads,
    plan_trim,
    position_schema,
)
from spark_state.driver.conf import COMPRESSIONS
from spark_state.errors import BlobExistsError, BlobNotFoundError, CorruptBlobError, StorageError
from spark_state.storage.base import Storage, join
from spark_state.store.commitlog import CommitLog, decode_record, encode_record

META_PATH = "_log.json"
COMMITS_DIR = "_commits"
INDEX_DIR = "_index"
DATA_DIR = "data"
INDEX_SNAPSHOT_INTERVAL = 32
MAX_COMMIT_ATTEMPTS = 1000
DEFAULT_ORPHAN_GRACE_SECONDS = 3600
"""Default age at which unreferenced files under ``data/`` are collected: longer than any write should take."""
SEGMENT_SUFFIX = ".arrow"
SEGMENT_MAX_BYTES = 64 << 20
IPC_CHUNK_ROWS = 65536
_LOG = logging.getLogger(__name__)
_TIMED_NAME = re.compile(r"[a-z]+-(\d{13})-")


def writer_directory(kind: str, tag: str = "", now_ms: int | None = None) -> str:
    """A fresh writer directory name: ``<kind>-<unix millis, 13 digits>-[<tag>-]<12 random hex digits>``.

    ``kind`` is lower-case letters (``task``, ``stream``, ``writer``); ``tag``
    (digits, letters and '-') says which task wrote it. ``now_ms`` defaults to
    the clock now: the time the writer starts, which the garbage collector
    reads back with ``directory_time_ms``.
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return "-".join([kind, f"{now_ms:013d}"] + ([tag] if tag else []) + [uuid.uuid4().hex[:12]])


def directory_time_ms(name: str) -> int | None:
    """The unix millis a ``writer_directory`` name carries; None for a name without one."""
    match = _TIMED_NAME.match(name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------
# Segment files
# ---------------------------------------------------------------------------


def encode_segment(batches: Sequence[pa.RecordBatch], schema: pa.Schema, compression: str = "none") -> bytes:
    """Serialize batches as one Arrow IPC file, re-chunked to at most ``IPC_CHUNK_ROWS`` rows per batch.

    ``compression`` is one of ``spark_state.driver.conf.COMPRESSIONS``, else ``ReplayableOptionError``.
    """
    if compression not in COMPRESSIONS:
        raise ReplayableOptionError(
            f"option compression={compression!r} is not one of {', '.join(COMPRESSIONS)}; pick one of those"
        )
    options = pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)
    sink = pa.BufferOutputStream()
    table = pa.Table.from_batches(batches, schema=schema)
    if len(batches) > 1:
        table = table.combine_chunks()
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        writer.write_table(table, max_chunksize=IPC_CHUNK_ROWS)
    return sink.getvalue().to_pybytes()


def decode_segment(data: bytes, ref: SegmentRef, schema: pa.Schema, where: str = "") -> pa.Table:
    """Check ``data`` against ``ref``'s size and CRC-32 and parse it; ``CorruptSegmentError`` otherwise.

    ``where`` (the log's URI) prefixes the segment path in messages.
    """
    name = f"{where}/{ref.path}" if where else ref.path
    if len(data) != ref.size:
        raise CorruptSegmentError(
            f"segment {name} is truncated or overwritten: its commit recorded {ref.size} bytes, "
            f"found {len(data)}; restore the file or rewrite the log"
        )
    crc = zlib.crc32(data)
    if crc != ref.crc32:
        raise CorruptSegmentError(
            f"segment {name} is corrupt: CRC-32 {crc:#010x}, its commit recorded {ref.crc32:#010x}; "
            "restore the file or rewrite the log"
        )
    if ref.rows > MAX_SEGMENT_ROWS:
        raise CorruptSegmentError(f"segment {name} claims {ref.rows} records; no segment has that many")
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        table.validate()
    except (pa.ArrowException, OSError) as exc:
        raise CorruptSegmentError(f"segment {name} does not parse as Arrow IPC: {exc}") from exc
    if table.num_rows != ref.rows or not table.schema.equals(schema):
        raise CorruptSegmentError(
            f"segment {name} holds {table.num_rows} rows of schema {table.schema.names}, its commit "
            f"recorded {ref.rows} rows of the log schema {schema.names}"
        )
    return table


class SegmentCache:
    """A per-process LRU of decoded segments, bounded in bytes. Segments never change, so it never goes stale."""

    def __init__(self, max_bytes: int = 128 << 20) -> None:
        self.max_bytes = max_bytes
        self._tables: OrderedDict[tuple, tuple[pa.Table, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple) -> pa.Table | None:
        hit = self._tables.get(key)
        if hit is None:
            return None
        self._tables.move_to_end(key)
        return hit[0]

    def put(self, key: tuple, table: pa.Table, size: int) -> None:
        if size > self.max_bytes or key in self._tables:
            return
        self._tables[key] = (table, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, old) = self._tables.popitem(last=False)
            self._bytes -= old


# ---------------------------------------------------------------------------
# The log (I/O)
# ---------------------------------------------------------------------------


@contextmanager
def _as_corrupt_log():
    """Re-raise a record's ``CorruptBlobError`` (bad checksum, truncated, not JSON) as ``CorruptLogError``."""
    try:
        yield
    except CorruptLogError:
        raise
    except CorruptBlobError as exc:
        raise CorruptLogError(f"{exc}; restore the file from a copy, or rewrite the log") from exc


class ReplayableLog:
    """A log at the root of ``storage``; see the module docstring for the protocols.

    ``commits`` and ``snapshots`` are the numbered records under ``_commits/``
    and ``_index/``.
    """

    def __init__(self, storage: Storage, meta: LogMeta, cache: SegmentCache | None = None) -> None:
        self.storage = storage
        self.meta = meta
        self.cache = cache
        self.commits = CommitLog(storage, COMMITS_DIR, what="log commit", accept_unframed=True)
        self.snapshots = CommitLog(storage, INDEX_DIR, what="index snapshot", accept_unframed=True)
        self._index = LogIndex.empty(meta.num_splits)
        self._index_loaded = False

    @classmethod
    def open(cls, storage: Storage, cache: SegmentCache | None = None) -> ReplayableLog:
        """Open an existing log; ``LogNotFoundError`` if there is none at the storage root.

        ``CorruptLogError`` if its ``_log.json`` is damaged.
        """
        try:
            data = storage.read(META_PATH)
        except BlobNotFoundError as exc:
            raise LogNotFoundError(
                f"no replayable log at {storage.uri} ({META_PATH} is missing): check the path option, "
                "or create the log by writing to it first"
            ) from exc
        where = f"{storage.describe(META_PATH)}"
        with _as_corrupt_log():
            body = decode_record(data, where, accept_unframed=True)
        return cls(storage, LogMeta.from_json(body, where), cache)

    @classmethod
    def create(
        cls, storage: Storage, meta: LogMeta, cache: SegmentCache | None = None, exact_splits: bool = True
    ) -> ReplayableLog:
        """Create the log, or open it if it exists with the same schema.

        An existing log must also have ``meta.num_splits`` splits unless
        ``exact_splits`` is False (the caller did not ask for a count).
        """
        try:
            storage.create(META_PATH, encode_record(meta.to_json()))
        except BlobExistsError:
            log = cls.open(storage, cache)
            log.check_compatible(meta.schema, meta.num_splits if exact_splits else None)
            return log
        return cls(storage, meta, cache)

    def check_compatible(self, schema: pa.Schema, num_splits: int | None) -> None:
        """Raise ``IncompatibleLogError`` unless ``schema`` (and ``num_splits`` if given) match the log."""
        if num_splits is not None and num_splits != self.meta.num_splits:
            raise IncompatibleLogError(
                f"the log at {self.storage.uri} has {self.meta.num_splits} splits, numSplits asks for "
                f"{num_splits}; the split count is fixed at creation: drop numSplits or use a new path"
            )
        if not schema.equals(self.meta.schema):
            raise IncompatibleLogError(
                f"the log at {self.storage.uri} has schema\n{self.meta.schema}\nthe data has\n{schema}\n"
                "select and cast the columns to the log's schema, or write to a new path"
            )

    # -- index ---------------------------------------------------------------

    def index(self, refresh: bool = True) -> LogIndex:
        """The index after the latest commit (``refresh=False``: the one this object last saw)."""
        if not self._index_loaded:
            self._index = self._load_snapshot()
            self._index_loaded = True
            refresh = True
        if refresh:
            self._index = self._read_commits_after(self._index)
        return self._index

    def _load_snapshot(self) -> LogIndex:
        """The index of the latest snapshot (the empty index if there is none)."""
        latest = self.snapshots.latest_id()
        if latest is None:
            return LogIndex.empty(self.meta.num_splits)
        where = self.snapshots.where(latest)
        with _as_corrupt_log():
            body = self.snapshots.load(latest)
        index = LogIndex.from_json(body, where)
        if index.num_splits != self.meta.num_splits:
            raise CorruptLogError(
                f"index snapshot {where} has {index.num_splits} splits, the log {self.meta.num_splits}; "
                "delete the snapshot (commits hold the same information) or restore it from a copy"
            )
        return index

    def _read_commits_after(self, index: LogIndex) -> LogIndex:
        """Fold every commit after ``index.commit_id`` into ``index``, up to the first id that does not exist."""
        while True:
            n = index.commit_id + 1
            with _as_corrupt_log():
                body = self.commits.load_if_exists(n)
            if body is None:
                later = [i for i in self.commits.ids() if i > n]
                if not later:
                    return index
                # A writer commits n + 1 only once it has read commit n, so n existed before the later ones: unless
                # another writer created it between the read above and the listing, it is gone.
                with _as_corrupt_log():
                    body = self.commits.load_if_exists(n)
                if body is None:
                    raise CorruptLogError(
                        f"log commit {self.commits.where(n)} is missing, but commits up to {later[-1]} exist: reading "
                        "on would drop every record after it. Restore the file from a copy, or rewrite the log"
                    )
            where = self.commits.where(n)
            index = apply_commit(index, Commit.from_json(body, where), where)

    def _commit(self, build) -> tuple[Commit | None, LogIndex]:
        """Steps 2-6 of the append protocol; ``build(index)`` returns the commit to try, or None to stop."""
        for _ in range(MAX_COMMIT_ATTEMPTS):
            index = self.index()
            commit = build(index)
            if commit is None:
                return None, index
            try:
                self.commits.create(commit.commit_id, commit.to_json())
            except BlobExistsError:
                continue
            self._index = apply_commit(index, commit)
            if (commit.commit_id + 1) % INDEX_SNAPSHOT_INTERVAL == 0:
                self._write_snapshot(self._index)
            return commit, self._index
        raise CommitContentionError(
            f"gave up on committing to {self.storage.uri} after {MAX_COMMIT_ATTEMPTS} lost races; "
            "too many concurrent writers: retry later"
        )

    def _write_snapshot(self, index: LogIndex) -> None:
        """Step 6. Runs after the commit point, so it must not fail the append: a failure is logged."""
        try:
            self.snapshots.create(index.commit_id, index.to_json())
        except BlobExistsError:
            pass  # another process wrote the snapshot of the same commit: same content.
        except StorageError as exc:
            _LOG.warning(
                "index snapshot of commit %d in %s not written (readers replay more commits): %s",
                index.commit_id,
                self.storage.uri,
                exc,
            )

    # -- writes --------------------------------------------------------------

    def append(self, staged: Iterable[StagedSegment], sink: SinkMark | None = None) -> Commit | None:
        """Commit staged segments (protocol steps 2-6); None if ``sink`` says the batch is already in.

        A skipped batch's staged segments are deleted, since no commit will ever reference them.
        """
        staged = list(staged)

        def build(index: LogIndex) -> Commit | None:
            if sink is not None and index.sinks.get(sink.sink_id, -1) >= sink.batch:
                return None
            return plan_append(index, staged, sink=sink)

        commit, _ = self._commit(build)
        if commit is None:
            self.discard(seg.path for seg in staged)
        return commit

    def discard(self, paths: Iterable[str]) -> list[str]:
        """Delete written segments that no commit references; returns the paths deleted.

        Paths a commit does reference are kept: an abort that follows a commit
        which raised after its commit point must not delete committed data.
        """
        referenced = self.referenced_paths()
        doomed = [path for path in paths if path not in referenced]
        for path in doomed:
            self.storage.delete(path)
        return doomed

    def referenced_paths(self) -> set[str]:
        """The paths of every segment the latest index references."""
        return {seg.path for split in self.index().splits for seg in split.segments}

    def trim(self, floors: Mapping[int, int]) -> Commit | None:
        """Drop whole segments below ``floors`` (split -> first offset to keep); None if nothing goes."""
        dropped: list[SegmentRef] = []

        def build(index: LogIndex) -> Commit | None:
            trims, gone = plan_trim(index, floors)
            dropped[:] = gone
            return Commit(index.commit_id + 1, (), trims) if trims else None

        commit, _ = self._commit(build)
        if commit is not None:
            for seg in dropped:
                self.storage.delete(seg.path)
        return commit

    def collect_garbage(self, grace_seconds: float, now_ms: int | None = None) -> list[str]:
        """Delete what under ``data/`` no commit references and is at least ``grace_seconds`` old; the paths deleted.

        Ages come from names, never from the storage (object stores give no
        reliable modification time): an entry is as old as the time in its own
        ``writer_directory`` name, else in its parent's; a name without a time
        (written before names carried one) is old. ``now_ms`` (unix millis)
        defaults to the clock now.

        An entry of ``data/`` that holds no referenced segment and is old is
        deleted whole: a failed, retried, speculative or killed attempt's
        directory, temporary files of interrupted creates included. A
        referenced segment is never deleted, whatever its age, and a young
        entry is never touched. A directory that holds referenced segments is
        kept and not listed: one writer's segments are committed together, so
        it holds no garbage, except segments a crashed trim dropped without
        deleting, which go with the directory once the rest of it is trimmed.
        Only directories whose referenced segments lie in subdirectories (the
        ``data/job-<hex>/`` of older logs) are descended into.

        Safe only if every write attempt commits within ``grace_seconds`` of
        starting (clock skew between hosts included): an older unreferenced
        directory is presumed abandoned.
        """
        if not grace_seconds >= 0:
            raise ReplayableOptionError(f"option orphanGraceSeconds={grace_seconds} must be >= 0")
        cutoff = (int(time.time() * 1000) if now_ms is None else now_ms) - int(grace_seconds * 1000)
        names = self.storage.list(DATA_DIR)
        referenced = self.referenced_paths()  # after the listing: a directory listed is seen committed if it is
        holders: set[str] = set()  # directories holding a referenced segment, at any depth
        containers: set[str] = set()  # directories holding one in a subdirectory
        for path in referenced:
            parts = path.split("/")
            holders.update("/".join(parts[:depth]) for depth in range(2, len(parts)))
            containers.update("/".join(parts[:depth]) for depth in range(2, len(parts) - 1))
        deleted: list[str] = []

        def sweep(directory: str, names: list[str], inherited_ms: int | None) -> None:
            for name in names:
                path = join(directory, name)
                own_ms = directory_time_ms(name)
                time_ms = inherited_ms if own_ms is None else own_ms
                if path in referenced:
                    continue
                if path in holders:
                    if path in containers:
                        sweep(path, self.storage.list(path), time_ms)
                    continue
                if time_ms is None or time_ms <= cutoff:
                    self.storage.delete(path)
                    deleted.append(path)

        sweep(DATA_DIR, names, None)
        return deleted

    def collect_garbage_after_commit(self, grace_seconds: float) -> list[str]:
        """``collect_garbage`` after a commit point: a ``StorageError`` is logged, not raised; the next run retries.

        Returns the paths deleted (none when it failed).
        """
        try:
            return self.collect_garbage(grace_seconds)
        except StorageError as exc:
            _LOG.warning(
                "garbage collection of %s/%s failed; unreferenced files stay until the next run: %s",
                self.storage.uri,
                DATA_DIR,
                exc,
            )
            return []

    def segment_writer(
        self, directory: str | None = None, order: int = 0, max_records: int = 1_000_000, compression: str = "none"
    ) -> SegmentWriter:
        """A writer for one task's segments under ``data/<directory>/``.

        ``directory`` defaults to a fresh ``writer_directory("writer")``; give
        another only as a fresh ``writer_directory`` name, or the garbage
        collector takes the writer's files for old ones.
        """
        directory = join(DATA_DIR, directory or writer_directory("writer"))
        return SegmentWriter(self.storage, self.meta.schema, directory, order, max_records, compression)

    # -- reads ---------------------------------------------------------------

    def load_segment(self, ref: SegmentRef) -> pa.Table:
        """The verified contents of one segment (from the cache if it holds it)."""
        key = (self.storage.uri, ref.path, ref.crc32, ref.size)
        if self.cache is not None:
            table = self.cache.get(key)
            if table is not None:
                return table
        try:
            data = self.storage.read(ref.path)
        except BlobNotFoundError as exc:
            raise SegmentMissingError(
                f"segment {self.storage.describe(ref.path)} (offsets [{ref.start}, {ref.end}) of split {ref.split}) "
                "is missing: it was trimmed by a reader's retention or deleted; start from offsets the log "
                "still holds"
            ) from exc
        table = decode_segment(data, ref, self.meta.schema, self.storage.uri)
        if self.cache is not None:
            self.cache.put(key, table, ref.size)
        return table

    def read(self, task: ReadTask, schema: pa.Schema | None = None) -> Iterator[pa.RecordBatch]:
        """Yield the records ``[task.start, task.end)`` of ``task.split`` with ``split`` and ``offset`` columns.

        ``schema`` (default ``position_schema(meta.schema)``) is attached to every
        batch; it must have the same types. Same task, same rows, same order.
        """
        schema = schema or position_schema(self.meta.schema)
        for ref in task.segments:
            table = self.load_segment(ref)
            lo = max(task.start, ref.start)
            hi = min(task.end, ref.end)
            position = lo
            for batch in table.slice(lo - ref.start, hi - lo).to_batches():
                n = batch.num_rows
                if n == 0:
                    continue
                split = pa.array(np.full(n, task.split, dtype=np.int32))
                offset = pa.array(np.arange(position, position + n, dtype=np.int64))
                yield pa.RecordBatch.from_arrays(batch.columns + [split, offset], schema=schema)
                position += n

    def read_range(
        self, start: Mapping[int, int], end: Mapping[int, int], max_records: int = 1 << 62
    ) -> Iterator[pa.RecordBatch]:
        """Every record between two offset dicts, split by split, in offset order."""
        for task in plan_reads(self.index(), start, end, max_records):
            yield from self.read(task)


class SegmentWriter:
    """Buffers one task's rows per split and writes segments of at most ``max_records`` rows.

    Segment paths are ``<directory>/<split>-<seq>.arrow``; ``finish()`` returns
    what to put in a commit, ``discard()`` deletes what was written.
    """

    def __init__(
        self, storage: Storage, schema: pa.Schema, directory: str, order: int, max_records: int, compression: str
    ) -> None:
        if max_records < 1:
            raise ReplayableOptionError(f"option maxRecordsPerSegment={max_records} must be >= 1")
        if compression not in COMPRESSIONS:
            raise ReplayableOptionError(
                f"option compression={compression!r} is not one of {', '.join(COMPRESSIONS)}; pick one of those"
            )
        self.storage = storage
        self.schema = schema
        self.directory = directory
        self.order = order
        self.max_records = max_records
        self.compression = compression
        self._buffers: dict[int, list[pa.RecordBatch]] = {}
        self._rows: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._written: list[StagedSegment] = []
        self._seq = 0

    def add(self, split: int, batch: pa.RecordBatch) -> None:
        """Buffer ``batch`` (already of the log schema) for ``split``; flushes full segments."""
        while batch.num_rows:
            room = self.max_records - self._rows.get(split, 0)
            head, batch = batch.slice(0, room), batch.slice(room)
            self._buffers.setdefault(split, []).append(head)
            self._rows[split] = self._rows.get(split, 0) + head.num_rows
            self._bytes[split] = self._bytes.get(split, 0) + head.nbytes
            if self._rows[split] >= self.max_records or self._bytes[split] >= SEGMENT_MAX_BYTES:
                self._flush(split)

    def _flush(self, split: int) -> None:
        batches = self._buffers.pop(split, [])
        rows = self._rows.pop(split, 0)
        self._bytes.pop(split, None)
        if not rows:
            return
        data = encode_segment(batches, self.schema, self.compression)
        path = join(self.directory, f"{split}-{self._seq:06d}.arrow")
        self.storage.create(path, data)
        self._written.append(StagedSegment(split, path, rows, len(data), zlib.crc32(data), (self.order, self._seq)))
        self._seq += 1

    def finish(self) -> list[StagedSegment]:
        """Flush every buffer; the segments written, in write order."""
        for split in sorted(self._buffers):
            self._flush(split)
        return list(self._written)

    def discard(self) -> None:
        """Delete every segment this writer wrote (best effort after a failed task)."""
        self._buffers.clear()
        self._rows.clear()
        for seg in self._written:
            self.storage.delete(seg.path)
        self._written.clear()
