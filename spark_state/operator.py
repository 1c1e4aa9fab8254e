"""What one instance does in one micro-batch (executor side; pyarrow and the store, no pyspark).

``run_instance(task, instance, batches)`` is the body of Spark task
``instance`` of micro-batch ``task.checkpoint_id``:

1. take this process's resident state of the instance, or a new empty one,
   and ``catch_up`` it to the committed base checkpoint (reads only what
   differs: nothing when this process ran the instance last batch);
2. check that every row's key group (computed by the JVM) equals the one
   ``key_groups_for_columns`` computes, and that this instance owns it;
3. apply the keyed function to the rows of each key, producing output rows
   and state changes;
4. write the changed key groups as this instance's blob for the checkpoint
   (step 1 of the commit protocol) and emit a last row carrying its
   ``BlobRef`` for the driver, which commits (steps 2-4).

Keyed functions are small picklable objects: ``Count``, ``Sum`` and
``PythonFunction`` (a user function called once per key with that key's rows
and its ``KeyState``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.checkpoint import CheckpointStore
from spark_state.errors import ConfigError, KeyGroupOwnershipError
from spark_state.keygroups import key_group_range, key_groups_for_columns
from spark_state.keyed_state import (
    InstanceItems,
    InstanceState,
    StateLayout,
    checkpoint_instance,
    checkpoint_instance_items,
)
from spark_state.manifest import BlobRef

KEY_GROUP_COLUMN = "_spark_state_key_group"
INSTANCE_COLUMN = "_spark_state_instance"
META_COLUMN = "_spark_state_meta"


class KeyState:
    """The state of one key inside a ``PythonFunction`` call (like Spark's ``GroupState``).

    ``get`` returns the value as a tuple of the state schema's value columns
    (None if the key has no state); ``update`` takes such a tuple (or a dict
    by column name); ``remove`` deletes it. ``instance`` is the non-keyed
    state of the instance processing this key (``InstanceItems``: a list of
    JSON values shared by all its keys, split or merged on rescale).
    """

    __slots__ = ("_value", "_fields", "changed", "instance")

    def __init__(self, value: tuple | None, fields: tuple[str, ...], instance: InstanceItems | None = None):
        self._value = value
        self._fields = fields
        self.changed = False
        self.instance = instance

    @property
    def exists(self) -> bool:
        return self._value is not None

    def get(self) -> tuple | None:
        return self._value

    def update(self, value: tuple | dict) -> None:
        if isinstance(value, dict):
            missing = [f for f in self._fields if f not in value]
            if missing:
                raise ConfigError(f"state update is missing value column(s) {missing}")
            value = tuple(value[f] for f in self._fields)
        value = tuple(value)
        if len(value) != len(self._fields):
            raise ConfigError(f"state update has {len(value)} values, the state schema has {list(self._fields)}")
        self._value = value
        self.changed = True

    def remove(self) -> None:
        self._value = None
        self.changed = True


def _group_rows(table: pa.Table, key_columns: tuple[str, ...]) -> tuple[pa.Table, np.ndarray]:
    """Sort ``table`` by key group and key; return it and the start offset of each key's run (plus the end)."""
    ordered = table.sort_by([(KEY_GROUP_COLUMN, "ascending")] + [(c, "ascending") for c in key_columns])
    if ordered.num_rows == 0:
        return ordered, np.zeros(1, dtype=np.int64)
    change = np.zeros(ordered.num_rows, dtype=bool)
    change[0] = True
    for name in (KEY_GROUP_COLUMN,) + key_columns:
        column = ordered.column(name).combine_chunks()
        different = pc.not_equal(column[1:], column[:-1])
        nulls = pc.xor(column[1:].is_null(), column[:-1].is_null())
        different = pc.or_(pc.fill_null(different, False), nulls)
        change[1:] |= different.to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(change)
    return ordered, np.append(starts, ordered.num_rows)


@dataclass(frozen=True)
class Aggregate:
    """A built-in per-key aggregation whose state is one int64/float64 column (``Count``/``Sum``)."""

    kind: str  # "count" or "sum"
    column: str | None
    output_name: str

    def value_type(self, input_schema: pa.Schema) -> pa.DataType:
        if self.kind == "count":
            return pa.int64()
        field_type = input_schema.field(self.column).type
        if pa.types.is_integer(field_type):
            return pa.int64()
        if pa.types.is_floating(field_type) or pa.types.is_decimal(field_type):
            return pa.float64()
        raise ConfigError(f"sum({self.column!r}) needs a numeric column, it is {field_type}")

    def apply(self, state: InstanceState, table: pa.Table, key_columns: tuple[str, ...], value_type: pa.DataType) -> pa.Table:
        groups = table.group_by([KEY_GROUP_COLUMN, *key_columns], use_threads=False)
        if self.kind == "count":
            totals = groups.aggregate([([], "count_all")])
            delta_name = "count_all"
        else:
            totals = groups.aggregate([(self.column, "sum")])
            delta_name = f"{self.column}_sum"
        key_group_list = totals.column(KEY_GROUP_COLUMN).to_pylist()
        keys = list(zip(*[totals.column(c).to_pylist() for c in key_columns]))
        deltas = totals.column(delta_name).to_pylist()
        zero = 0 if pa.types.is_integer(value_type) else 0.0
        # Each key occurs once in ``totals``, so reading all old values first is the same as get-then-put per key.
        olds = state.get_many(key_group_list, keys)
        new_values = [
            (old[0] if old is not None else zero) + (delta if delta is not None else zero)
            for old, delta in zip(olds, deltas)
        ]
        state.put_many(key_group_list, keys, [(value,) for value in new_values])
        columns = {c: totals.column(c) for c in key_columns}
        columns[self.output_name] = pa.array(new_values, value_type)
        return pa.table(columns)


@dataclass(frozen=True)
class PythonFunction:
    """A user function ``fn(key, rows, state) -> output`` called once per key with rows in the batch.

    ``key`` is a tuple of the key column values; ``rows`` a pandas DataFrame
    (``style="pandas"``) or a ``pyarrow.Table`` (``style="arrow"``) of that
    key's new rows, in arrival order within their input partition;
    ``state`` a ``KeyState``. It returns the output rows for that key: a
    pandas DataFrame, a pyarrow Table, a list of dicts, or None.
    """

    fn: Callable[[tuple, Any, KeyState], Any]
    style: str = "pandas"

    def __post_init__(self) -> None:
        if self.style not in ("pandas", "arrow"):
            raise ConfigError(f"style must be 'pandas' or 'arrow', got {self.style!r}")
        if not callable(self.fn):
            raise ConfigError("the keyed function must be callable as fn(key, rows, state)")

    def apply(
        self,
        state: InstanceState,
        table: pa.Table,
        key_columns: tuple[str, ...],
        value_fields: tuple[str, ...],
        input_columns: list[str],
        output_schema: pa.Schema,
    ) -> pa.Table:
        ordered, bounds = _group_rows(table, key_columns)
        payload = ordered.select(input_columns)
        key_group_values = ordered.column(KEY_GROUP_COLUMN).to_numpy()
        key_lists = [ordered.column(c).to_pylist() for c in key_columns]
        frame = payload.to_pandas() if self.style == "pandas" else payload
        outputs: list[pa.Table] = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            key_group = int(key_group_values[start])
            key = tuple(values[start] for values in key_lists)
            key_state = KeyState(state.get(key_group, key), value_fields, state.instance_items)
            rows = frame.iloc[start:end].reset_index(drop=True) if self.style == "pandas" else frame.slice(start, end - start)
            result = self.fn(key, rows, key_state)
            if key_state.changed:
                if key_state.exists:
                    state.put(key_group, key, key_state.get())
                else:
                    state.delete(key_group, key)
            if result is not None:
                outputs.append(_to_output_table(result, output_schema))
        if not outputs:
            return output_schema.empty_table()
        return pa.concat_tables(outputs)


def _to_output_table(result: Any, schema: pa.Schema) -> pa.Table:
    try:
        if isinstance(result, pa.Table):
            return result.select(schema.names).cast(schema)
        if isinstance(result, list):
            return pa.Table.from_pylist(result, schema=schema)
        import pandas as pd

        if isinstance(result, pd.DataFrame):
            return pa.Table.from_pandas(result[list(schema.names)], schema=schema, preserve_index=False)
    except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
        raise ConfigError(f"the keyed function returned rows that do not fit the output schema {schema}: {exc}") from exc
    raise ConfigError(
        f"the keyed function returned {type(result).__name__}; return a pandas DataFrame, a pyarrow Table, "
        "a list of dicts, or None"
    )


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped from the driver (small and picklable)."""

    store_uri: str
    component: str
    state_schema: bytes  # IPC-serialized state schema (keys, then values)
    key_columns: tuple[str, ...]
    input_columns: tuple[str, ...]
    output_schema: bytes  # IPC-serialized output schema (without the meta column)
    function: Any  # Aggregate or PythonFunction
    checkpoint_id: int
    base_checkpoint_id: int | None
    base_committed_at: float | None  # identifies the base manifest (a store recreated at the same URI reuses ids)
    parallelism: int
    max_parallelism: int
    max_chain_length: int
    compression: str | None
    retained: int

    @property
    def layout(self) -> StateLayout:
        schema = pa.ipc.read_schema(pa.py_buffer(self.state_schema))
        return StateLayout(schema, self.key_columns)

    @property
    def outputs(self) -> pa.Schema:
        return pa.ipc.read_schema(pa.py_buffer(self.output_schema))


_LOCK = threading.Lock()
_STORES: dict[str, CheckpointStore] = {}
_RESIDENT: dict[tuple[str, str, int], InstanceState] = {}


def _store(uri: str, retained: int) -> CheckpointStore:
    with _LOCK:
        store = _STORES.get(uri)
        if store is None:
            from spark_state.storage import open_storage

            store = _STORES[uri] = CheckpointStore(open_storage(uri), retained=retained)
        return store


def _resident_state(task: TaskSpec, instance: int, store: CheckpointStore) -> tuple[InstanceState, dict]:
    """This process's state of ``instance`` caught up to the task's base checkpoint, and what that cost."""
    layout = task.layout
    owned = key_group_range(instance, task.parallelism, task.max_parallelism)
    cache_key = (task.store_uri, task.component, instance)
    with _LOCK:
        state = _RESIDENT.pop(cache_key, None)
    if state is None or state.key_group_range != owned or state.layout != layout:
        state = InstanceState(layout, owned)
    info = {"resident": len(state) > 0, "bytes_read": 0, "requests": 0, "key_groups_read": 0, "seconds": 0.0}
    base = None
    if task.base_checkpoint_id is not None:
        base = store.load(task.base_checkpoint_id)
        if base.committed_at != task.base_committed_at:
            store.forget_cached_manifests()
            base = store.load(task.base_checkpoint_id)
    component = base.components.get(task.component) if base is not None else None
    if component is None:
        if len(state) or state.chains():
            state = InstanceState(layout, owned)
        return state, info
    plan, stats = state.catch_up(store, component, instance, task.parallelism)
    items_read = state.catch_up_items(store, component, instance, task.parallelism)
    info.update(
        bytes_read=stats.bytes_read + items_read,
        requests=stats.requests,
        key_groups_read=len(plan.chains),
        key_groups_appended=len(plan.appends),
        seconds=round(stats.seconds, 4),
    )
    return state, info


def _check_key_groups(table: pa.Table, key_columns: tuple[str, ...], task: TaskSpec, owned) -> None:
    if table.num_rows == 0:
        return
    given = table.column(KEY_GROUP_COLUMN).to_numpy()
    expected = key_groups_for_columns([table.column(c) for c in key_columns], task.max_parallelism)
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
    started = time.perf_counter()
    phases = _Phases(started)
    store = _store(task.store_uri, task.retained)
    state, restore_info = _resident_state(task, instance, store)
    phases.end("restore")
    input_batches = list(batches)
    table = pa.Table.from_batches(input_batches) if input_batches else None
    phases.end("input")
    outputs = task.outputs
    out_with_meta = outputs.append(pa.field(META_COLUMN, pa.string()))
    if table is not None and table.num_rows:
        _check_key_groups(table, task.key_columns, task, state.key_group_range)
        result = _apply(task, state, table)
        phases.end("apply")
        for batch in result.combine_chunks().to_batches():
            yield pa.RecordBatch.from_arrays(
                list(batch.columns) + [pa.nulls(batch.num_rows, pa.string())], schema=out_with_meta
            )
        phases.end("output")
    ref = checkpoint_instance(
        store,
        task.component,
        task.checkpoint_id,
        instance,
        state,
        max_chain_length=task.max_chain_length,
        compression=task.compression,
    )
    items_path = checkpoint_instance_items(store, task.component, task.checkpoint_id, instance, state)
    phases.end("checkpoint")
    with _LOCK:
        _RESIDENT[(task.store_uri, task.component, instance)] = state
    meta = {
        "instance": instance,
        "blob": ref.to_json() if ref is not None else None,
        "items": items_path,
        "rows_in": 0 if table is None else table.num_rows,
        "keys": len(state),
        "restore": restore_info,
        "pid": os.getpid(),
        "seconds": round(time.perf_counter() - started, 4),
        "phase_seconds": phases.seconds,
    }
    arrays = [pa.nulls(1, f.type) for f in outputs] + [pa.array([json.dumps(meta)], pa.string())]
    yield pa.RecordBatch.from_arrays(arrays, schema=out_with_meta)


def _apply(task: TaskSpec, state: InstanceState, table: pa.Table) -> pa.Table:
    function = task.function
    if isinstance(function, Aggregate):
        value_type = task.layout.schema.field(function.output_name).type
        result = function.apply(state, table, task.key_columns, value_type)
    else:
        result = function.apply(
            state, table, task.key_columns, task.layout.value_columns, list(task.input_columns), task.outputs
        )
    return result.select(task.outputs.names).cast(task.outputs)


def blob_ref_from_meta(meta: dict) -> BlobRef | None:
    """The ``BlobRef`` a task reported (driver side), or None if the instance changed nothing."""
    return BlobRef.from_json(meta["blob"]) if meta.get("blob") else None
