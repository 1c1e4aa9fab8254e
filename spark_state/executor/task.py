"""What one instance does in one micro-batch (executor side; pyarrow and the store, no pyspark).

``run_instance(task, instance, batches)`` is the body of Spark task
``instance`` of micro-batch ``task.checkpoint_id``:

1. take this process's resident state of the instance (``resident.take``)
   and catch it up to the committed base checkpoint; under a memory bound,
   load the evicted key groups the rows touch;
2. check that every row's key group (computed by the JVM) equals the one
   ``key_groups_for_columns`` computes, and that this instance owns it; with
   event time, set aside the rows older than the batch's watermark (late:
   dropped and counted, or passed marked late);
3. apply the keyed function (``functions``) to the rows, then fire the due
   timers and expire values past their time to live: output rows and state
   changes; then find the earliest pending timer and expiry of each kind
   (``next_due``: the driver wakes an idle query for them);
4. write the changed key groups and instance items (step 1 of the commit
   protocol in ``manifestlog``), evict least recently used key groups down
   to the memory bound, keep the state for the next batch, and emit, after
   the output batches, one batch of a single column ``META_COLUMN`` and one
   row: the instance's ``InstanceReport`` for the driver (with the state's
   estimated bytes, their high-water mark, the process's RSS, and the CPU
   time and page faults the task cost its process: ``cpu``).

Executors get a ``BlobStore`` (write and fetch blobs and items) and a
read-only ``ManifestReader`` (to find the base checkpoint's component); only
the driver commits and cleans up.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute

from spark_state.errors import KeyGroupOwnershipError
from spark_state.executor.aggregates import ROWS_COLUMN, Aggregate
from spark_state.executor.columns import EVENT_MS_COLUMN, KEY_GROUP_COLUMN, LATE_COLUMN
from spark_state.executor.functions import BatchTime, PythonFunction
from spark_state.executor.report import InstanceReport
from spark_state.executor.resident import ResidentState, keep, memory_share, take
from spark_state.keyspace import KeyGroupRange, key_groups_for_columns
from spark_state.model.eventtime import EventTime, to_millis
from spark_state.model.schema import KeyedSchema
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifest import ComponentManifest
from spark_state.store.manifestlog import ManifestReader

INSTANCE_COLUMN = "_spark_state_instance"
META_COLUMN = "_spark_state_meta"


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped from the driver (small and picklable)."""

    store_uri: str
    component: str
    schema: KeyedSchema
    input_columns: tuple[str, ...]
    output_schema: pa.Schema
    function: Aggregate | PythonFunction
    checkpoint_id: int
    base_checkpoint_id: int | None
    base_committed_at: float | None  # identifies the base manifest (a store recreated at the same URI reuses ids)
    parallelism: int
    max_parallelism: int
    max_chain_length: int
    compression: str | None
    event_time: EventTime | None = None
    watermark_ms: int | None = None
    processing_ms: int = 0
    drain: bool = False
    resident_memory: int | None = None  # bytes per executor (``spark.state.residentMemory``)
    run_id: str | None = None  # Spark's run id of the query run the task belongs to (``stops``)

    @property
    def time(self) -> BatchTime:
        return BatchTime(self.watermark_ms, self.processing_ms, self.drain)


_LOCK = threading.Lock()
_STORES: dict[str, tuple[BlobStore, ManifestReader]] = {}


def _stores(uri: str) -> tuple[BlobStore, ManifestReader]:
    """This process's blob store and manifest reader for ``uri`` (manifests are cached across batches)."""
    with _LOCK:
        stores = _STORES.get(uri)
        if stores is None:
            from spark_state.storage import open_storage

            storage = open_storage(uri)
            stores = _STORES[uri] = (BlobStore(storage), ManifestReader(storage))
        return stores


def manifest_reader(uri: str) -> ManifestReader:
    """This process's manifest reader of the store at ``uri`` (the one its tasks use)."""
    return _stores(uri)[1]


def forget_stores() -> None:
    """Drop this process's blob stores and manifest readers (a forked process opens its own)."""
    with _LOCK:
        _STORES.clear()


def _base_component(task: TaskSpec, manifests: ManifestReader) -> ComponentManifest | None:
    if task.base_checkpoint_id is None:
        return None
    base = manifests.load(task.base_checkpoint_id)
    if base.committed_at != task.base_committed_at:
        manifests.forget_cached_manifests()
        base = manifests.load(task.base_checkpoint_id)
    return base.components.get(task.component)


def _restore(
    task: TaskSpec, instance: int, blobs: BlobStore, manifests: ManifestReader
) -> tuple[ResidentState, dict, np.ndarray]:
    """Step 1: the instance's state at the base checkpoint, what that cost, and the key groups it read.

    ``bytes_read`` and ``requests`` are the restore plan's; on a backend that
    counts its traffic (S3), ``storage`` holds what the backend itself sent
    and received for the catch-up (``Storage.counters``), retries included.
    """
    native = isinstance(task.function, Aggregate) and task.function.vectorized()
    state = take(
        task.store_uri,
        task.component,
        instance,
        task.parallelism,
        task.max_parallelism,
        task.schema,
        bounded=task.resident_memory is not None,
        native=native,
    )
    info: dict[str, Any] = {
        "resident": state.has_keys(),
        "bytes_read": 0,
        "requests": 0,
        "key_groups_read": 0,
        "seconds": 0.0,
    }
    component = _base_component(task, manifests)
    if component is None:
        if state.has_keys() or state.chains.held():
            state = ResidentState(task.schema, state.key_group_range, bounded=state.bounded, native=native)
        return state, info, np.empty(0, np.int64)
    wire_before = blobs.storage.counters()
    caught = state.catch_up(blobs, component, instance, task.parallelism)
    wire_after = blobs.storage.counters()
    if wire_before is not None and wire_after is not None:
        info["storage"] = {name: wire_after[name] - wire_before.get(name, 0) for name in wire_after}
    info.update(
        bytes_read=caught.stats.bytes_read + caught.items_bytes,
        requests=caught.stats.requests,
        key_groups_read=len(caught.plan.chains),
        key_groups_appended=len(caught.plan.appends),
        seconds=round(caught.stats.seconds, 4),
    )
    return state, info, np.fromiter({*caught.plan.chains, *caught.plan.appends}, np.int64)


def _note_touched(restore_info: dict, caught_up: np.ndarray, touched: np.ndarray) -> None:
    """Record in ``restore_info`` how many key groups the batch's rows touch and how many of those its catch-up
    read (``caught_up``) lay outside them (``key_groups_touched``, ``key_groups_read_untouched``): a task that reads
    no more than its batch touches moved cheaply, wherever Spark placed it."""
    restore_info["key_groups_touched"] = int(touched.size)
    restore_info["key_groups_read_untouched"] = int(np.setdiff1d(caught_up, touched).size)


def _check_key_groups(
    table: pa.Table, key_columns: tuple[str, ...], max_parallelism: int, owned: KeyGroupRange
) -> None:
    """Step 2: the JVM's key groups equal ours, and this instance owns every one of them."""
    if table.num_rows == 0:
        return
    given = table.column(KEY_GROUP_COLUMN).to_numpy()
    expected = key_groups_for_columns([table.column(c) for c in key_columns], max_parallelism)
    wrong = np.flatnonzero(given != expected)
    if wrong.size:
        row = int(wrong[0])
        key = tuple(table.column(c)[row].as_py() for c in key_columns)
        raise KeyGroupOwnershipError(
            f"key {key!r} was routed to key group {int(given[row])} but the store computes "
            f"{int(expected[row])}; routing and store disagree, refusing to write state"
        )
    outside = (given < owned.start) | (given > owned.end)
    if outside.any():
        raise KeyGroupOwnershipError(
            f"instance owning {owned} received key group {int(given[np.argmax(outside)])}; "
            "rows were partitioned with a different parallelism than the state uses"
        )


def _event_times(task: TaskSpec, table: pa.Table) -> tuple[pa.Table, dict]:
    """Step 2 with event time: each row's event time, and the late rows dropped or marked; what that found."""
    event_time = task.event_time
    assert event_time is not None, "called for a task with event time"
    milliseconds = to_millis(table.column(event_time.column))
    arrived = len(milliseconds)
    late = milliseconds < task.watermark_ms if task.watermark_ms is not None else np.zeros(len(milliseconds), bool)
    on_time = milliseconds[~late]
    info = {
        "late_rows": int(late.sum()),
        "rows_arrived": arrived,  # late ones included: rows show the source is not idle (``model.wake``)
        "max_event_time_ms": int(on_time.max()) if on_time.size else None,
    }
    table = table.append_column(EVENT_MS_COLUMN, pa.array(milliseconds, pa.int64()))
    if event_time.late == "drop":
        return (table.filter(pa.array(~late)) if late.any() else table), info
    return table.append_column(LATE_COLUMN, pa.array(late)), info


def _apply(task: TaskSpec, state: ResidentState, table: pa.Table | None) -> tuple[list[pa.Table], dict]:
    """Step 3: the function on the rows, then the due timers, then the expiries; the outputs and counts."""
    function, schema, time = task.function, task.schema, task.time
    key_columns, outputs = schema.key_columns, []
    info: dict = {}
    event_time = task.event_time is not None
    if isinstance(function, Aggregate):
        if table is not None and table.num_rows:
            outputs.append(function.apply(state.table, table, key_columns))
        return outputs, info
    if table is not None and table.num_rows:
        columns = list(task.input_columns) + ([LATE_COLUMN] if LATE_COLUMN in table.column_names else [])
        outputs.append(
            function.apply(
                state, table, key_columns, schema.value.columns, columns, task.output_schema, time, event_time
            )
        )
    fired, info["timers_fired"] = function.fire(state, schema.value.columns, task.output_schema, time, event_time)
    outputs.append(fired)
    info["expired"] = function.expire(state, time)
    if state.timers is not None:
        info["next_due"] = function.next_due(state)
        info["timers_indexed"] = state.timers.pending()
    return outputs, info


MIN_CHUNK_BYTES = 1 << 20
"""Under a memory bound, a batch loads evicted key groups in chunks of at least this many stored bytes."""


def _in_chunks(task: TaskSpec, state: ResidentState) -> bool:
    """Whether step 3 runs in chunks of key groups: a built-in aggregate on a bounded state."""
    return state.bounded and isinstance(task.function, Aggregate)


def _aggregate_in_chunks(
    task: TaskSpec, state: ResidentState, table: pa.Table, blobs: BlobStore
) -> tuple[list[pa.Table], dict]:
    """Step 1b and 3 under a memory bound: the rows by key group, in chunks whose evicted chains fit.

    Each chunk loads the evicted key groups its rows touch (at most a
    quarter of the state's share of the bound in stored bytes, or one key
    group), merges its rows, and, while the state's estimate is above its
    share, releases the chains it loaded (``KeyGroupTable.release``): the
    batch then holds the chains of one chunk at a time and its own changed
    keys. Returns the outputs and what the loads read.
    """
    function = task.function
    assert isinstance(function, Aggregate), "a built-in aggregate runs in chunks (_in_chunks)"
    assert task.resident_memory is not None, "a bounded state runs in chunks: the task has a memory bound"
    limit = memory_share(task.resident_memory)
    budget = max(limit // 4, MIN_CHUNK_BYTES)
    table = table.take(pa.compute.sort_indices(table.column(KEY_GROUP_COLUMN)))
    groups, starts = np.unique(table.column(KEY_GROUP_COLUMN).to_numpy(), return_index=True)
    sizes = state.bytes_to_load(groups)
    chunk = np.cumsum([sizes[int(g)] for g in groups]) // budget
    cuts = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(groups)]
    outputs, loaded = [], {"key_groups": 0, "bytes_read": 0, "requests": 0, "seconds": 0.0, "chunks": 0}
    for low, high in zip(cuts, cuts[1:]):
        chunk_groups = groups[low:high]
        first, end = int(starts[low]), (int(starts[high]) if high < len(groups) else table.num_rows)
        info = state.load(blobs, chunk_groups)
        for name in ("key_groups", "bytes_read", "requests", "seconds"):
            loaded[name] += info.get(name, 0)
        loaded["chunks"] += 1
        outputs.append(function.apply(state.table, table.slice(first, end - first), task.schema.key_columns))
        if state.note_peak() > limit:
            state.table.release(g for g in chunk_groups.tolist() if sizes[g] > 0)
    loaded["seconds"] = round(loaded["seconds"], 4)
    return outputs, loaded


class _Phases:
    """Seconds spent in each consecutive phase of a task, for its report."""

    def __init__(self, started: float):
        self._last = started
        self.seconds: dict[str, float] = {}

    def end(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 4)
        self._last = now


def run_instance(task: TaskSpec, instance: int, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Process instance ``instance``'s rows of micro-batch ``task.checkpoint_id``; see the module docstring."""
    started, usage = time.perf_counter(), _usage()
    phases = _Phases(started)
    blobs, manifests = _stores(task.store_uri)
    state, restore_info, caught_up = _restore(task, instance, blobs, manifests)
    phases.end("restore")
    input_batches = list(batches)
    table = pa.Table.from_batches(input_batches) if input_batches else None
    phases.end("input")
    time_info: dict = {}
    chunked = _in_chunks(task, state) and table is not None and table.num_rows > 0
    touched = np.empty(0, np.int64)
    if table is not None and table.num_rows:
        _check_key_groups(table, task.schema.key_columns, task.max_parallelism, state.key_group_range)
        touched = np.unique(table.column(KEY_GROUP_COLUMN).to_numpy())
        if not chunked:
            loaded = state.load(blobs, touched)
            if loaded:
                restore_info["loaded"] = loaded
        if task.event_time is not None:
            table, time_info = _event_times(task, table)
    _note_touched(restore_info, caught_up, touched)
    if chunked:
        outputs, restore_info["loaded"] = _aggregate_in_chunks(task, state, table, blobs)
        apply_info: dict = {}
    else:
        outputs, apply_info = _apply(task, state, table)
    time_info.update(apply_info)
    phases.end("apply")
    for output in outputs:
        output = output.select(task.output_schema.names).cast(task.output_schema)
        yield from output.combine_chunks().to_batches()
    phases.end("output")
    wire_before = blobs.storage.counters()
    blob, items = state.checkpoint(
        blobs,
        task.component,
        task.checkpoint_id,
        instance,
        max_chain_length=task.max_chain_length,
        compression=task.compression,
    )
    phases.end("checkpoint")
    if state.compaction:
        time_info["compaction"] = state.compaction  # the stored chains read to compact key groups
    time_info["memory"] = {**state.bound_memory(memory_share(task.resident_memory)), **_rss()}
    wire_after = blobs.storage.counters()
    if wire_before is not None and wire_after is not None:
        time_info["checkpoint_storage"] = {k: wire_after[k] - wire_before.get(k, 0) for k in wire_after}
    keep(task.store_uri, task.component, instance, state)
    report = InstanceReport(
        instance,
        blob,
        items,
        {
            **time_info,
            "rows_in": _rows_in(table),
            "rows_received": 0 if table is None else table.num_rows,  # fewer than rows_in: partials from the JVM
            "keys": len(state),
            "restore": restore_info,
            "pid": os.getpid(),
            "seconds": round(time.perf_counter() - started, 4),
            "phase_seconds": phases.seconds,
            "cpu": _usage_since(usage),
        },
    )
    yield pa.RecordBatch.from_arrays([pa.array([json.dumps(report.to_json())], pa.string())], names=[META_COLUMN])


def _usage() -> tuple[float, float, int] | None:
    """This process's user and system CPU seconds and page faults so far (None where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # not Unix
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, usage.ru_minflt + usage.ru_majflt


def _usage_since(before: tuple[float, float, int] | None) -> dict:
    """What this process spent since ``before`` (``_usage``), all of its threads: CPU seconds in user code and
    in the kernel (page faults, system calls), and page faults (a new host's first task takes one per page
    of memory it touches first: what it shares with its worker, and every page it allocates)."""
    after = _usage()
    if before is None or after is None:
        return {}
    return {
        "user_seconds": round(after[0] - before[0], 4),
        "system_seconds": round(after[1] - before[1], 4),
        "page_faults": after[2] - before[2],
    }


def _rss() -> dict:
    """This process's resident set size and its high-water mark, in bytes (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return {}
    return {
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
        "rss_high_water_bytes": int(fields["VmHWM"].split()[0]) * 1024,
    }


def _rows_in(table: pa.Table | None) -> int:
    """Input rows of the task: rows of ``table``, or the rows its per-key partials (from the JVM) stand for."""
    if table is None:
        return 0
    if ROWS_COLUMN in table.column_names:
        return int(pa.compute.sum(table.column(ROWS_COLUMN)).as_py() or 0)
    return table.num_rows


def report_from_meta(meta: str | dict[str, Any]) -> InstanceReport:
    """The ``InstanceReport`` a task emitted (driver side)."""
    return InstanceReport.from_json(json.loads(meta) if isinstance(meta, str) else meta)
