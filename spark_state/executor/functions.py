"""What a keyed query computes per key: built-in aggregates and user functions. No I/O, no pyspark.

Both kinds take an instance's rows of one micro-batch (an Arrow table with the
key-group column) and its resident ``KeyGroupTable``, update the ``value``
state variable and return the output rows.

**Built-in aggregates are data**: each is one ``AggregateDef`` in
``AGGREGATES`` (its state columns, the Arrow partial aggregates a batch
computes per key, how a partial merges into the state, and how the state
becomes the output value). Adding one is adding an entry. On a native state
(``KeyGroupTable.native``) a batch's partials merge into the state with Arrow
kernels, no Python object per key; elsewhere per key, in Python.

**User functions** (``PythonFunction``) are called once per key with that
key's new rows and a ``KeyState``, like Spark's ``applyInPandasWithState``;
with ``on_timer`` they register timers (``state.timers``) and are called back
for a key when its timer is due, even if the key has no new rows; with a time
to live a key's value is not served after it expires and is deleted from the
state (``timers``). A batch runs in this order: the rows, then the due
timers in time order, then the expiries.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import AggregateOverflowError, ConfigError
from spark_state.model.eventtime import END_OF_TIME
from spark_state.model.instance_items import InstanceItems
from spark_state.executor.table import KeyGroupTable
from spark_state.model.schema import Key
from spark_state.model.timers import (
    EVENT,
    EXPIRES,
    PROCESSING,
    KeyTimersHandle,
    Timer,
    TimerIndex,
    with_expiry,
    with_timer,
)

KEY_GROUP_COLUMN = "_spark_state_key_group"
PARTIAL_PREFIX = "_spark_state_partial_"
"""Column ``PARTIAL_PREFIX + str(i)`` holds a key's partial ``i`` of a built-in aggregate, computed in the JVM."""
ROWS_COLUMN = "_spark_state_rows"
"""With partials computed in the JVM, the number of input rows each partial row stands for."""

_MERGES: dict[str, Callable[[Any, Any], Any]] = {  # builtins: ``map`` runs them without Python frames
    "sum": operator.add,
    "min": min,
    "max": max,
}
_first = itemgetter(0)
"""``finish`` of the aggregates whose output is their one state column."""


def _merge(op: str, old: Any, new: Any) -> Any:
    """Merge a state field with a batch's partial; None (no value yet, or only nulls) is the identity."""
    if old is None:
        return new
    if new is None:
        return old
    return _MERGES[op](old, new)


def _numeric(name: str, column: str, kind: pa.DataType) -> None:
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)):
        raise ConfigError(f"{name}({column!r}) needs a numeric column, it is {kind}")


def _orderable(name: str, column: str, kind: pa.DataType) -> None:
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
            or pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_temporal(kind)):
        raise ConfigError(f"{name}({column!r}) needs a numeric, string, date or timestamp column, it is {kind}")


def _sum_type(kind: pa.DataType) -> pa.DataType:
    return pa.int64() if pa.types.is_integer(kind) else pa.float64()


def _always(_: pa.DataType | None) -> bool:
    return True


def _jvm_sums(kind: pa.DataType | None) -> bool:
    return kind is not None and (pa.types.is_integer(kind) or pa.types.is_floating(kind))


def _jvm_orders(kind: pa.DataType | None) -> bool:
    return kind is not None and (pa.types.is_integer(kind) or pa.types.is_string(kind)
                                 or pa.types.is_date(kind) or pa.types.is_timestamp(kind))


@dataclass(frozen=True)
class AggregateDef:
    """One built-in aggregate.

    ``check(name, column, input_type)`` validates the input column;
    ``state(input_type)`` gives the state columns' types; ``partials`` the
    Arrow ``group_by`` aggregations, one per state column, computed per key
    over a batch; ``merges`` how each partial merges into its state column
    (``"sum"``, ``"min"``, ``"max"``; None is the identity); ``output`` the
    output type and ``finish`` the output value from a state tuple.
    ``in_jvm(input_type)``: whether Spark's aggregate of each partial equals
    Arrow's for that input type, so Spark may compute the partials per key
    before rows cross into Python (not for floating-point min/max, where
    Spark orders NaN above every number and Arrow skips it, nor for decimals,
    whose sums Spark types differently). ``identity(input_type)``: for a
    one-column state, the state a new key merges a non-null partial into to
    get that partial exactly (0 for an integer sum or count, -0.0 for a
    floating-point sum: -0.0 + x is x, signed zeros included), or None when
    there is none (min, max): a batch's new keys then merge at C speed with
    the others.
    """

    name: str
    needs_column: bool
    check: Callable[[str, str, pa.DataType], None]
    state: Callable[[pa.DataType | None], tuple[pa.DataType, ...]]
    partials: tuple[str, ...]
    merges: tuple[str, ...]
    output: Callable[[pa.DataType | None], pa.DataType]
    finish: Callable[[tuple], Any]
    in_jvm: Callable[[pa.DataType | None], bool]
    identity: Callable[[pa.DataType | None], tuple | None] = lambda _: None


AGGREGATES: dict[str, AggregateDef] = {
    d.name: d
    for d in (
        AggregateDef("count", False, lambda *_: None, lambda _: (pa.int64(),), ("count_all",), ("sum",),
                     lambda _: pa.int64(), _first, _always, lambda _: (0,)),
        AggregateDef("sum", True, _numeric, lambda t: (_sum_type(t),), ("sum",), ("sum",), _sum_type,
                     _first, _jvm_sums, lambda t: (0,) if pa.types.is_integer(_sum_type(t)) else (-0.0,)),
        AggregateDef("min", True, _orderable, lambda t: (t,), ("min",), ("min",), lambda t: t, _first,
                     _jvm_orders),
        AggregateDef("max", True, _orderable, lambda t: (t,), ("max",), ("max",), lambda t: t, _first,
                     _jvm_orders),
        AggregateDef("mean", True, _numeric, lambda _: (pa.float64(), pa.int64()), ("sum", "count"),
                     ("sum", "sum"), lambda _: pa.float64(),
                     lambda s: None if not s[1] else s[0] / s[1], _jvm_sums),
    )
}


@dataclass(frozen=True)
class Aggregate:
    """A built-in aggregate of ``column`` per key (``AGGREGATES[kind]``), emitted as ``output_name``."""

    kind: str
    column: str | None
    output_name: str
    input_type: pa.DataType | None = None

    def __post_init__(self) -> None:
        definition = AGGREGATES.get(self.kind)
        if definition is None:
            raise ConfigError(f"unknown aggregate {self.kind!r}; built-ins: {sorted(AGGREGATES)}")
        if definition.needs_column:
            if self.column is None or self.input_type is None:
                raise ConfigError(f"{self.kind}() needs a column")
            definition.check(self.kind, self.column, self.input_type)

    @property
    def definition(self) -> AggregateDef:
        return AGGREGATES[self.kind]

    def state_fields(self) -> list[pa.Field]:
        """The columns of the ``value`` state variable."""
        types = self.definition.state(self.input_type)
        names = [self.output_name] if len(types) == 1 else [f"{self.output_name}_{p}" for p in self.definition.partials]
        return [pa.field(name, kind) for name, kind in zip(names, types)]

    def output_type(self) -> pa.DataType:
        return self.definition.output(self.input_type)

    def partials_in_jvm(self) -> bool:
        """Whether Spark may compute this aggregate's partials per key (``AggregateDef.in_jvm``)."""
        return self.definition.in_jvm(self.input_type)

    def vectorized(self) -> bool:
        """Whether Arrow kernels merge this aggregate exactly as ``_merge`` does (``_apply_arrow``): a min or max
        only of integers or strings (Python's and Arrow's orders of NaN differ; Arrow has no element-wise
        min or max of dates and timestamps)."""
        kind = self.input_type
        if self.definition.finish is not _first and self.kind != "mean":
            return False
        return self.kind not in ("min", "max") or kind is not None and (
            pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind))

    def partials(self, rows: pa.Table, key_columns: tuple[str, ...]) -> tuple[pa.Table, list[str]]:
        """The batch's partials per key: a table with the key group, the key columns and the partials' names.

        Rows that already carry partials (``PARTIAL_PREFIX`` columns, one row
        per key, computed by Spark) are used as they are.
        """
        definition = self.definition
        given = [f"{PARTIAL_PREFIX}{i}" for i in range(len(definition.partials))]
        if given[0] in rows.column_names:
            return rows, given
        groups = rows.group_by([KEY_GROUP_COLUMN, *key_columns], use_threads=False)
        column = [] if self.column is None else self.column
        totals = groups.aggregate([(column, op) for op in definition.partials])
        return totals, totals.column_names[-len(definition.partials):]

    def apply(self, table: KeyGroupTable, rows: pa.Table, key_columns: tuple[str, ...]) -> pa.Table:
        """Merge the batch's partial aggregates per key into the state; one output row per key seen.

        On a ``native`` table, the keys of the key groups it holds as Arrow
        are merged with Arrow kernels (``_apply_arrow``), the others per key
        in Python (``_apply_python``).
        """
        totals, names = self.partials(rows, key_columns)
        totals = totals.sort_by(KEY_GROUP_COLUMN)  # the table takes each key group's keys at once
        if not (table.native and self.vectorized()) or totals.column(key_columns[0]).null_count:
            return self._apply_python(table, totals, names, key_columns)
        key_groups = totals.column(KEY_GROUP_COLUMN).to_numpy()
        groups, starts = np.unique(key_groups, return_index=True)
        native = table.native_groups(groups)
        if native.all():
            return self._apply_arrow(table, totals, names, key_columns)
        rows_native = np.repeat(native, np.diff(np.append(starts, len(key_groups))))
        parts = [self._apply_arrow(table, totals.filter(pa.array(rows_native)), names, key_columns)
                 ] if native.any() else []
        parts.append(self._apply_python(table, totals.filter(pa.array(~rows_native)), names, key_columns))
        return pa.concat_tables(parts)

    def _apply_arrow(self, table: KeyGroupTable, totals: pa.Table, names: list[str],
                     key_columns: tuple[str, ...]) -> pa.Table:
        """``apply`` with Arrow kernels: look the keys' states up, merge, put them back, without Python objects.

        A null state field (no value yet, or only nulls) is the identity, as
        in ``_merge``: a sum is the coalesce of the checked sum and the two
        sides, a min or max skips nulls. An integer sum that overflows raises
        ``AggregateOverflowError`` before the state changes, as in Python.
        """
        definition = self.definition
        key_groups = totals.column(KEY_GROUP_COLUMN).to_numpy()
        keys = totals.column(key_columns[0]).combine_chunks()
        key_type = table.schema.keys[0].type
        keys = keys if keys.type == key_type else keys.cast(key_type)  # e.g. large strings from Spark
        olds = table.look_up(key_groups, keys)
        columns = []
        for i, (op, name, kind) in enumerate(zip(definition.merges, names, definition.state(self.input_type))):
            old, part = pc.struct_field(olds, [i]), totals.column(name).cast(kind).combine_chunks()
            if op == "sum":
                try:
                    merged = pc.coalesce(pc.add_checked(old, part), old, part)
                except pa.ArrowInvalid as exc:
                    raise self._overflow() from exc
            else:
                merged = (pc.min_element_wise if op == "min" else pc.max_element_wise)(old, part, skip_nulls=True)
            columns.append(merged)
        table.put_arrow(key_groups, keys, columns, olds.is_null().to_numpy(zero_copy_only=False))
        if definition.finish is _first:
            result = columns[0]
        else:  # mean: the sum over the count, null without a count
            total, count = columns
            result = pc.if_else(pc.fill_null(pc.equal(count, 0), True), pa.scalar(None, pa.float64()),
                                pc.divide(total, pc.cast(count, pa.float64())))
        return pa.table({**{c: totals.column(c) for c in key_columns}, self.output_name: result.cast(self.output_type())})

    def _overflow(self) -> AggregateOverflowError:
        return AggregateOverflowError(
            f"{self.kind}({self.column!r}) overflows its 64-bit integer state for some key; the batch failed and "
            "the state is unchanged: cast the column to double before aggregating")

    def _apply_python(self, table: KeyGroupTable, totals: pa.Table, names: list[str],
                      key_columns: tuple[str, ...]) -> pa.Table:
        """``apply`` through ``get_many``/``put_many``, one Python object per key."""
        definition = self.definition
        state_types = definition.state(self.input_type)
        partials = [totals.column(n).cast(t).to_pylist() for n, t in zip(names, state_types)]
        key_groups = totals.column(KEY_GROUP_COLUMN).to_numpy()
        if table.bare:  # the keys as the table holds them (``KeyGroupTable.held_key``)
            keys = totals.column(key_columns[0]).to_pylist()
        else:
            keys = list(zip(*[totals.column(c).to_pylist() for c in key_columns]))
        merges = definition.merges
        # A new key reads the identity when every partial has a value (a null partial must not merge into it).
        identity = definition.identity(self.input_type) if len(merges) == 1 and None not in partials[0] else None
        # Each key occurs once in ``totals``, so reading all old values first is the same as get-then-put per key.
        olds = table.get_many(key_groups, keys, identity)
        merged = None  # the one state column, when there is one and it could be merged at C speed
        if len(merges) == 1:
            merge, part = _MERGES[merges[0]], partials[0]
            if olds.count(None) == len(olds):
                merged = part
            elif None not in part:  # some keys may be new (old None) or hold None (only nulls so far)
                firsts = list(map(_first, olds)) if None not in olds else [o if o is None else o[0] for o in olds]
                merged = list(map(merge, firsts, part)) if None not in firsts else [
                    p if f is None else merge(f, p) for f, p in zip(firsts, part)]
            else:  # the rule of ``_merge``, as one comprehension
                new = [(p,) if o is None or o[0] is None else o if p is None else (merge(o[0], p),)
                       for o, p in zip(olds, part)]
            if merged is not None:
                new = list(zip(merged))
        else:
            new = [
                tuple(_merge(op, old[i] if old is not None else None, part[row])
                      for i, (op, part) in enumerate(zip(merges, partials)))
                for row, old in enumerate(olds)
            ]
        # No state is ever None here (a key with a batch has a value): the columns are the values as put.
        fields = [merged] if merged is not None else [[s[i] for s in new] for i in range(len(state_types))]
        try:
            columns = [pa.array(f, t) for f, t in zip(fields, state_types)]
        except (OverflowError, pa.ArrowInvalid) as exc:
            raise self._overflow() from exc
        table.put_many(key_groups, keys, new, key_columns=[totals.column(c).combine_chunks() for c in key_columns],
                       value_columns=columns)
        output = {c: totals.column(c) for c in key_columns}
        if definition.finish is _first and columns[0].type == self.output_type():
            output[self.output_name] = columns[0]  # the output is the state column, as stored
        else:
            output[self.output_name] = pa.array([definition.finish(s) for s in new], self.output_type())
        return pa.table(output)


@dataclass(frozen=True)
class BatchTime:
    """The times a micro-batch runs with: its watermark (None: none yet), its processing time, whether it drains.

    A drain fires every timer (``timer_watermark`` and the processing time for
    timers are the end of time); late rows and expiries use the real times.
    """

    watermark_ms: int | None
    processing_ms: int
    drain: bool = False

    @property
    def timer_watermark(self) -> int | None:
        return END_OF_TIME if self.drain else self.watermark_ms


@dataclass(frozen=True)
class TimeToLive:
    """A value expires ``duration_ms`` after its last update, in processing time or in event time (watermark)."""

    duration_ms: int
    kind: str = PROCESSING

    def __post_init__(self) -> None:
        if self.kind not in (PROCESSING, EVENT):
            raise ConfigError(f"ttl_kind={self.kind!r} is not one of {PROCESSING!r}, {EVENT!r}")

    def now(self, time: BatchTime) -> int | None:
        return time.processing_ms if self.kind == PROCESSING else time.watermark_ms


class KeyState:
    """The state of one key inside a ``PythonFunction`` call (like Spark's ``GroupState``).

    ``get`` returns the value as a tuple of the state schema's value columns
    (None if the key has no state, or if it expired under a time to live);
    ``update`` takes such a tuple (or a dict by column name); ``remove``
    deletes it. ``timers`` registers, deletes and lists the key's timers
    (with ``on_timer``). ``watermark`` and ``processing_time`` are the batch's
    (milliseconds). ``instance_items`` are the non-keyed state of the instance
    processing this key (a list of JSON values shared by its keys, split or
    merged on rescale).
    """

    __slots__ = ("_value", "_fields", "changed", "instance_items", "_timers", "_time", "expires", "_ttl", "_event_ms",
                 "expired")

    def __init__(self, value: tuple | None, fields: tuple[str, ...], instance_items: InstanceItems | None = None, *,
                 timers: KeyTimersHandle | None = None, time: BatchTime | None = None,
                 ttl: TimeToLive | None = None, expires: int | None = None, event_time_ms: int | None = None):
        self._time = time
        self._ttl = ttl
        self.expires = expires
        self.expired = False
        if ttl is not None and expires is not None and time is not None:
            now = ttl.now(time)
            if now is not None and expires <= now and value is not None:
                value = None  # expired: never served again
                self.expired = True
        self._value = value
        self._fields = fields
        self.changed = False
        self.instance_items = instance_items
        self._timers = timers
        self._event_ms = event_time_ms

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
        if self._ttl is not None:
            start = self._time.processing_ms if self._ttl.kind == PROCESSING else self._event_ms
            self.expires = None if start is None else start + self._ttl.duration_ms

    def remove(self) -> None:
        self._value = None
        self.changed = True
        self.expires = None

    @property
    def timers(self) -> KeyTimersHandle:
        if self._timers is None:
            raise ConfigError("this keyed function has no timers: pass on_timer=... to apply() to use state.timers")
        return self._timers

    @property
    def watermark(self) -> int | None:
        return None if self._time is None else self._time.watermark_ms

    @property
    def processing_time(self) -> int | None:
        return None if self._time is None else self._time.processing_ms


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


EVENT_MS_COLUMN = "_spark_state_event_ms"
"""Each row's event time in milliseconds, added by the operator when the query has event time."""
LATE_COLUMN = "_late"
"""With ``late="pass"``, the boolean column that marks a function's late rows."""


@dataclass(frozen=True)
class PythonFunction:
    """A user function ``fn(key, rows, state) -> output`` called once per key with rows in the batch.

    ``key`` is a tuple of the key column values; ``rows`` a pandas DataFrame
    (``style="pandas"``) or a ``pyarrow.Table`` (``style="arrow"``) of that
    key's new rows, in the order Spark's shuffle delivered them, which a
    replayed batch may not repeat (on a cluster, the order blocks are
    fetched in): for exactly-once output, ``fn`` must not depend on it;
    ``state`` a ``KeyState``. It returns the output rows for that key: a
    pandas DataFrame, a pyarrow Table, a list of dicts, or None.
    ``on_timer(key, timer, state) -> output`` is called for each due timer of
    a key (``timers.Timer``), in time order; ``ttl`` expires values.
    """

    fn: Callable[[tuple, Any, KeyState], Any]
    style: str = "pandas"
    on_timer: Callable[[tuple, Timer, KeyState], Any] | None = None
    ttl: TimeToLive | None = None

    def __post_init__(self) -> None:
        if self.style not in ("pandas", "arrow"):
            raise ConfigError(f"style must be 'pandas' or 'arrow', got {self.style!r}")
        if not callable(self.fn):
            raise ConfigError("the keyed function must be callable as fn(key, rows, state)")
        if self.on_timer is not None and not callable(self.on_timer):
            raise ConfigError("on_timer must be callable as on_timer(key, timer, state)")

    @property
    def uses_timers(self) -> bool:
        """Whether its component needs the ``timers`` state variable."""
        return self.on_timer is not None or self.ttl is not None

    def _key_state(self, state, key_group: int, key: Key, value_fields: tuple[str, ...], time: BatchTime,
                   event_time_ms: int | None, event_time: bool) -> KeyState:
        stored = state.table.get(key_group, key, variable=state.timers_variable) if state.timers_variable else None
        handle = KeyTimersHandle(stored, event_time=event_time) if self.on_timer is not None else None
        expires = stored[2] if stored is not None and self.ttl is not None else None
        return KeyState(state.table.get(key_group, key), value_fields, state.items, timers=handle, time=time,
                        ttl=self.ttl, expires=expires, event_time_ms=event_time_ms)

    def _write_back(self, state, key_group: int, key: Key, key_state: KeyState) -> None:
        """Store what the call changed: the value, and the key's timers and expiry (indexing new ones)."""
        table = state.table
        if key_state.changed:
            if key_state.exists:
                table.put(key_group, key, key_state.get())
            else:
                table.delete(key_group, key, 0)
        elif key_state.expired:
            table.delete(key_group, key, 0)  # it expired before this call: gone now, not only at the batch's end
        variable = state.timers_variable
        if variable is None:
            return
        stored = table.get(key_group, key, variable=variable)
        handle = key_state._timers
        new = handle.value if handle is not None else stored
        if self.ttl is not None:
            new = with_expiry(new, key_state.expires if key_state.exists else None)
        if new == stored:
            return
        if new is None:
            table.delete(key_group, key, variable)
        else:
            table.put(key_group, key, new, variable)
        for kind, time_ms in (handle.registered if handle is not None else ()):
            state.timers.push(kind, time_ms, key_group, key)
        if new is not None and new[2] is not None and (stored is None or stored[2] != new[2]):
            state.timers.push(EXPIRES, new[2], key_group, key)

    def apply(self, state, rows: pa.Table, key_columns: tuple[str, ...], value_fields: tuple[str, ...],
              input_columns: Sequence[str], output_schema: pa.Schema, time: BatchTime, event_time: bool) -> pa.Table:
        """Call ``fn`` once per key of ``rows`` (the instance's rows of the batch) on ``state`` (a ``ResidentState``)."""
        ordered, bounds = _group_rows(rows, key_columns)
        payload = ordered.select(list(input_columns))
        key_group_values = ordered.column(KEY_GROUP_COLUMN).to_numpy()
        event_ms = ordered.column(EVENT_MS_COLUMN).to_numpy() if EVENT_MS_COLUMN in ordered.column_names else None
        key_lists = [ordered.column(c).to_pylist() for c in key_columns]
        frame = payload.to_pandas() if self.style == "pandas" else payload
        outputs: list[pa.Table] = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            key_group = int(key_group_values[start])
            key = tuple(values[start] for values in key_lists)
            latest = int(event_ms[start:end].max()) if event_ms is not None else None
            key_state = self._key_state(state, key_group, key, value_fields, time, latest, event_time)
            part = frame.iloc[start:end].reset_index(drop=True) if self.style == "pandas" else frame.slice(start, end - start)
            result = self.fn(key, part, key_state)
            self._write_back(state, key_group, key, key_state)
            if result is not None:
                outputs.append(_to_output_table(result, output_schema))
        return pa.concat_tables(outputs) if outputs else output_schema.empty_table()

    def fire(self, state, value_fields: tuple[str, ...], output_schema: pa.Schema, time: BatchTime,
             event_time: bool) -> tuple[pa.Table, int]:
        """Call ``on_timer`` for every due timer, in time order; the output and the number of timers fired.

        Event-time timers are due at or before the batch's watermark (every
        one when it drains), processing-time timers at or before its
        processing time. A timer registered while timers fire is due at the
        earliest in the next batch.
        """
        if self.on_timer is None or state.timers is None:
            return output_schema.empty_table(), 0
        table, index, variable = state.table, state.timers, state.timers_variable

        def fold(position: int):
            return lambda g: [(t, key) for key, timers in table.values(g, variable).items() for t in timers[position]]

        due = []
        if event_time and time.timer_watermark is not None:
            due += [(t, 0, g, key) for t, g, key in index.due(EVENT, time.timer_watermark, fold(0))]
        processing_now = END_OF_TIME if time.drain else time.processing_ms
        due += [(t, 1, g, key) for t, g, key in index.due(PROCESSING, processing_now, fold(1))]
        due.sort(key=lambda d: (d[0], d[1], d[2]))
        outputs, fired = [], 0
        for time_ms, position, key_group, key in due:
            kind = (EVENT, PROCESSING)[position]
            stored = table.get(key_group, key, variable=variable)
            if stored is None or time_ms not in stored[position]:
                continue  # deleted, or fired already (a duplicate index entry)
            remaining = with_timer(stored, kind, time_ms, remove=True)
            if remaining is None:
                table.delete(key_group, key, variable)
            else:
                table.put(key_group, key, remaining, variable)
            key_state = self._key_state(state, key_group, key, value_fields, time,
                                        time_ms if kind == EVENT else None, event_time)
            result = self.on_timer(key, Timer(time_ms, kind), key_state)
            self._write_back(state, key_group, key, key_state)
            fired += 1
            if result is not None:
                outputs.append(_to_output_table(result, output_schema))
        return (pa.concat_tables(outputs) if outputs else output_schema.empty_table()), fired

    def expire(self, state, time: BatchTime) -> int:
        """Delete the values whose time to live ran out (never served since); the number deleted."""
        if self.ttl is None or state.timers is None:
            return 0
        now = self.ttl.now(time)
        if now is None:
            return 0
        table, variable = state.table, state.timers_variable

        def fold(g):
            return [(timers[2], key) for key, timers in table.values(g, variable).items() if timers[2] is not None]

        expired = 0
        for time_ms, key_group, key in state.timers.due(EXPIRES, now, fold):
            stored = table.get(key_group, key, variable=variable)
            if stored is None or stored[2] != time_ms:
                continue
            table.delete(key_group, key, 0)
            rest = with_expiry(stored, None)
            if rest is None:
                table.delete(key_group, key, variable)
            else:
                table.put(key_group, key, rest, variable)
            expired += 1
        return expired


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
