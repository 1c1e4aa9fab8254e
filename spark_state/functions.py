"""What a keyed query computes per key: built-in aggregates and user functions. No I/O, no pyspark.

Both kinds take an instance's rows of one micro-batch (an Arrow table with the
key-group column) and its resident ``KeyGroupTable``, update the ``value``
state variable and return the output rows.

**Built-in aggregates are data**: each is one ``AggregateDef`` in
``AGGREGATES`` (its state columns, the Arrow partial aggregates a batch
computes per key, how a partial merges into the state, and how the state
becomes the output value). Adding one is adding an entry.

**User functions** (``PythonFunction``) are called once per key with that
key's new rows and a ``KeyState``, like Spark's ``applyInPandasWithState``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import ConfigError
from spark_state.instance_items import InstanceItems
from spark_state.keyed_table import KeyGroupTable

KEY_GROUP_COLUMN = "_spark_state_key_group"

_MERGES: dict[str, Callable[[Any, Any], Any]] = {
    "sum": lambda a, b: a + b,
    "min": min,
    "max": max,
}


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


@dataclass(frozen=True)
class AggregateDef:
    """One built-in aggregate.

    ``check(name, column, input_type)`` validates the input column;
    ``state(input_type)`` gives the state columns' types; ``partials`` the
    Arrow ``group_by`` aggregations, one per state column, computed per key
    over a batch; ``merges`` how each partial merges into its state column
    (``"sum"``, ``"min"``, ``"max"``; None is the identity); ``output`` the
    output type and ``finish`` the output value from a state tuple.
    """

    name: str
    needs_column: bool
    check: Callable[[str, str, pa.DataType], None]
    state: Callable[[pa.DataType | None], tuple[pa.DataType, ...]]
    partials: tuple[str, ...]
    merges: tuple[str, ...]
    output: Callable[[pa.DataType | None], pa.DataType]
    finish: Callable[[tuple], Any]


AGGREGATES: dict[str, AggregateDef] = {
    d.name: d
    for d in (
        AggregateDef("count", False, lambda *_: None, lambda _: (pa.int64(),), ("count_all",), ("sum",),
                     lambda _: pa.int64(), lambda s: s[0]),
        AggregateDef("sum", True, _numeric, lambda t: (_sum_type(t),), ("sum",), ("sum",), _sum_type,
                     lambda s: s[0]),
        AggregateDef("min", True, _orderable, lambda t: (t,), ("min",), ("min",), lambda t: t, lambda s: s[0]),
        AggregateDef("max", True, _orderable, lambda t: (t,), ("max",), ("max",), lambda t: t, lambda s: s[0]),
        AggregateDef("mean", True, _numeric, lambda _: (pa.float64(), pa.int64()), ("sum", "count"),
                     ("sum", "sum"), lambda _: pa.float64(),
                     lambda s: None if not s[1] else s[0] / s[1]),
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

    def apply(self, table: KeyGroupTable, rows: pa.Table, key_columns: tuple[str, ...]) -> pa.Table:
        """Merge the batch's partial aggregates per key into the state; one output row per key seen."""
        definition = self.definition
        groups = rows.group_by([KEY_GROUP_COLUMN, *key_columns], use_threads=False)
        column = [] if self.column is None else self.column
        totals = groups.aggregate([(column, op) for op in definition.partials])
        names = totals.column_names[-len(definition.partials):]
        state_types = definition.state(self.input_type)
        partials = [totals.column(n).cast(t).to_pylist() for n, t in zip(names, state_types)]
        key_groups = totals.column(KEY_GROUP_COLUMN).to_pylist()
        keys = list(zip(*[totals.column(c).to_pylist() for c in key_columns]))
        # Each key occurs once in ``totals``, so reading all old values first is the same as get-then-put per key.
        olds = table.get_many(key_groups, keys)
        merges = definition.merges
        if olds.count(None) == len(olds) and len(merges) == 1:
            new = [(p,) for p in partials[0]]
        else:
            new = [
                tuple(_merge(op, old[i] if old is not None else None, part[row])
                      for i, (op, part) in enumerate(zip(merges, partials)))
                for row, old in enumerate(olds)
            ]
        table.put_many(key_groups, keys, new)
        output = {c: totals.column(c) for c in key_columns}
        output[self.output_name] = pa.array([definition.finish(s) for s in new], self.output_type())
        return pa.table(output)


class KeyState:
    """The state of one key inside a ``PythonFunction`` call (like Spark's ``GroupState``).

    ``get`` returns the value as a tuple of the state schema's value columns
    (None if the key has no state); ``update`` takes such a tuple (or a dict
    by column name); ``remove`` deletes it. ``instance_items`` are the
    non-keyed state of the instance processing this key (``InstanceItems``:
    a list of JSON values shared by all its keys, split or merged on rescale).
    """

    __slots__ = ("_value", "_fields", "changed", "instance_items")

    def __init__(self, value: tuple | None, fields: tuple[str, ...], instance_items: InstanceItems | None = None):
        self._value = value
        self._fields = fields
        self.changed = False
        self.instance_items = instance_items

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
        table: KeyGroupTable,
        items: InstanceItems,
        rows: pa.Table,
        key_columns: tuple[str, ...],
        value_fields: tuple[str, ...],
        input_columns: Sequence[str],
        output_schema: pa.Schema,
    ) -> pa.Table:
        ordered, bounds = _group_rows(rows, key_columns)
        payload = ordered.select(list(input_columns))
        key_group_values = ordered.column(KEY_GROUP_COLUMN).to_numpy()
        key_lists = [ordered.column(c).to_pylist() for c in key_columns]
        frame = payload.to_pandas() if self.style == "pandas" else payload
        outputs: list[pa.Table] = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            key_group = int(key_group_values[start])
            key = tuple(values[start] for values in key_lists)
            key_state = KeyState(table.get(key_group, key), value_fields, items)
            part = frame.iloc[start:end].reset_index(drop=True) if self.style == "pandas" else frame.slice(start, end - start)
            result = self.fn(key, part, key_state)
            if key_state.changed:
                if key_state.exists:
                    table.put(key_group, key, key_state.get())
                else:
                    table.delete(key_group, key, 0)
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
