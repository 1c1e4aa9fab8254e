"""User functions: what ``apply`` computes per key, and the state a function sees. No I/O, no pyspark.

A user function takes an instance's rows of one micro-batch (an Arrow table
with the key-group column) and its resident ``KeyGroupTable``, updates the
state variables and returns the output rows. The built-in aggregates, which
do the same with Arrow kernels, are in ``aggregates``.

**User functions** (``PythonFunction``) are called once per key with that
key's new rows and a ``KeyState``, like Spark's ``applyInPandasWithState``;
with ``on_timer`` they register timers (``state.timers``) and are called back
for a key when its timer is due, even if the key has no new rows; with a time
to live a key's value is not served after it expires and is deleted from the
state (``timers``). A batch runs in this order: the rows, then the due
timers in time order, then the expiries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import ConfigError
from spark_state.executor.columns import EVENT_MS_COLUMN, KEY_GROUP_COLUMN
from spark_state.model.eventtime import END_OF_TIME
from spark_state.model.exact import exact_column, exact_tuple
from spark_state.model.instance_items import InstanceItems
from spark_state.model.schema import Key, KeyedSchema
from spark_state.model.timers import (
    EVENT,
    EXPIRES,
    PROCESSING,
    KeyTimersHandle,
    Timer,
    with_expiry,
    with_timer,
)


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
        if self.duration_ms <= 0:
            raise ConfigError(f"ttl={self.duration_ms} ms: a time to live must be longer than zero (as Spark's)")

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

    __slots__ = (
        "_value",
        "_fields",
        "changed",
        "instance_items",
        "_timers",
        "_time",
        "expires",
        "_ttl",
        "_event_ms",
        "expired",
        "_convert",
    )

    def __init__(
        self,
        value: tuple | None,
        fields: tuple[str, ...],
        instance_items: InstanceItems | None = None,
        *,
        timers: KeyTimersHandle | None = None,
        time: BatchTime | None = None,
        ttl: TimeToLive | None = None,
        expires: int | None = None,
        event_time_ms: int | None = None,
        convert: Callable[[tuple], tuple] | None = None,
    ):
        self._convert = convert
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
        if self._convert is not None:
            value = self._convert(value)  # exactly, or a ConfigError now, not when the checkpoint writes it
        self._value = value
        self.changed = True
        if self._ttl is not None:
            start: int | None
            if self._ttl.kind == PROCESSING:
                assert self._time is not None, "a key's state under a time to live is given the batch's time"
                start = self._time.processing_ms
            else:
                start = self._event_ms
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

    def _key_state(
        self,
        state,
        key_group: int,
        key: Key,
        value_fields: tuple[str, ...],
        time: BatchTime,
        event_time_ms: int | None,
        event_time: bool,
    ) -> KeyState:
        stored = state.table.get(key_group, key, variable=state.timers_variable) if state.timers_variable else None
        convert = _value_converter(state.table.schema)
        handle = KeyTimersHandle(stored, event_time=event_time) if self.on_timer is not None else None
        expires = stored[2] if stored is not None and self.ttl is not None else None
        return KeyState(
            state.table.get(key_group, key),
            value_fields,
            state.items,
            timers=handle,
            time=time,
            ttl=self.ttl,
            expires=expires,
            event_time_ms=event_time_ms,
            convert=convert,
        )

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
        for kind, time_ms in handle.registered if handle is not None else ():
            state.timers.push(kind, time_ms, key_group, key)
        if new is not None and new[2] is not None and (stored is None or stored[2] != new[2]):
            state.timers.push(EXPIRES, new[2], key_group, key)

    def apply(
        self,
        state,
        rows: pa.Table,
        key_columns: tuple[str, ...],
        value_fields: tuple[str, ...],
        input_columns: Sequence[str],
        output_schema: pa.Schema,
        time: BatchTime,
        event_time: bool,
    ) -> pa.Table:
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
            part = (
                frame.iloc[start:end].reset_index(drop=True)
                if self.style == "pandas"
                else frame.slice(start, end - start)
            )
            result = self.fn(key, part, key_state)
            self._write_back(state, key_group, key, key_state)
            if result is not None:
                outputs.append(_to_output_table(result, output_schema))
        return pa.concat_tables(outputs) if outputs else output_schema.empty_table()

    def fire(
        self, state, value_fields: tuple[str, ...], output_schema: pa.Schema, time: BatchTime, event_time: bool
    ) -> tuple[pa.Table, int]:
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
            key_state = self._key_state(
                state, key_group, key, value_fields, time, time_ms if kind == EVENT else None, event_time
            )
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

    def next_due(self, state) -> dict[str, int]:
        """The earliest pending time of each kind of this instance's timers and expiries (``EVENT``,
        ``PROCESSING``, ``EXPIRES``; a kind without any is left out): what the driver wakes an idle query
        for (``model.wake``)."""
        if state.timers is None:
            return {}
        table, variable, index = state.table, state.timers_variable, state.timers
        found = {}
        for kind, position in ((EVENT, 0), (PROCESSING, 1), (EXPIRES, 2)):
            if kind == EXPIRES and self.ttl is None or kind != EXPIRES and self.on_timer is None:
                continue

            def fold(g, position=position):
                if position == 2:
                    return [(t[2], key) for key, t in table.values(g, variable).items() if t[2] is not None]
                return [(time_ms, key) for key, t in table.values(g, variable).items() for time_ms in t[position]]

            def live(time_ms, g, key, position=position):
                stored = table.get(g, key, variable=variable)
                if stored is None:
                    return False
                return stored[2] == time_ms if position == 2 else time_ms in stored[position]

            earliest = index.next_due(kind, fold, live)
            if earliest is not None:
                found[kind] = earliest
        return found


@functools.lru_cache(maxsize=64)
def _value_converter(schema: KeyedSchema) -> Callable[[tuple], tuple]:
    """``model.exact`` over the ``value`` variable of ``schema``: made once per schema, not per key."""
    return exact_tuple(schema.value.fields)


def _to_output_table(result: Any, schema: pa.Schema) -> pa.Table:
    """What a function returned as rows of ``schema``, every value converted exactly (``model.exact``): a column
    the schema does not have is refused, never dropped (a misspelled one would leave its column null)."""
    if isinstance(result, list):
        if not all(isinstance(row, dict) for row in result):
            raise ConfigError(
                "the keyed function returned a list whose items are not all dicts; return rows as "
                "dicts of column name to value"
            )
        _check_columns(set().union(*map(dict.keys, result)) if result else set(), schema)
        return pa.table(
            [exact_column(field, [row.get(field.name) for row in result]) for field in schema], schema=schema
        )
    import pandas as pd

    try:
        if isinstance(result, pa.Table):
            _check_columns(set(result.column_names), schema)
            return result.select(schema.names).cast(schema, safe=True)
        if isinstance(result, pd.DataFrame):
            _check_columns(set(map(str, result.columns)), schema)
            return pa.Table.from_pandas(result[list(schema.names)], schema=schema, preserve_index=False, safe=True)
    except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
        raise ConfigError(
            f"the keyed function returned rows that do not fit the output schema {schema}: {exc}"
        ) from exc
    raise ConfigError(
        f"the keyed function returned {type(result).__name__}; return a pandas DataFrame, a pyarrow Table, "
        "a list of dicts, or None"
    )


def _check_columns(names: set, schema: pa.Schema) -> None:
    unknown = sorted(map(str, names - set(schema.names)))
    if unknown:
        raise ConfigError(
            f"the keyed function returned column(s) {unknown} that the output schema does not have "
            f"({', '.join(schema.names)}); fix their names, or add them to output_schema"
        )
