"""The schema of a component's keyed state: key columns and named state variables. Pure, no I/O.

A key's state is a set of named **state variables** (Flink keeps a meta-info
record per registered state; Spark's transformWithState names its value, list
and map variables). Each variable has its own columns; today a component has
the ``value`` variable (what a user function reads and updates, or a built-in
aggregate's accumulator) and, with timers or a time to live, the ``timers``
variable beside it (``model.timers.TIMERS``). All variables of a key live in the key's key group and are written
in the same blob entry, so a rescale moves all of a key's state at once.

In a blob every variable is one nullable struct column, named after it with
the reserved prefix ``_spark_state_`` (key columns may not use it, so a key
column may be called ``value``)::

    <key columns...> | _spark_state_<variable 1>: struct<its columns> | ... | _deleted: bool

A null struct means the key has no value for that variable; a row with
``_deleted = true`` (all structs null) is a tombstone: the key has no state at
all. In memory a key group holds one dict per variable, ``key -> value`` with
``key`` a tuple of the key column values (or, *bare*, the value of the one
key column) and ``value`` a tuple of the variable's column values
(``KeyedSchema.rows_to_columns`` and ``columns_to_rows`` convert).

**A new state variable** (a list or map state, say), following ``timers``:

1. Define it as a ``StateVariable(name, fields)`` constant in the module of
   ``model`` that owns its meaning (as ``timers.TIMERS``), with a name that is
   not ``value`` and is fixed forever: stored blobs name their columns by it.
2. Add it to the ``KeyedSchema`` of the components that use it where the
   stream declares its schema (``spark.streaming.KeyedStream._schema``). The
   blob layout, the chains, restore, rescale and compaction carry it with
   no further step: they handle every variable of the schema alike.
3. Give user functions access through ``executor.functions.KeyState``, reading
   and writing it with ``KeyGroupTable.get``/``put``/``delete`` and its index in
   ``schema.variables`` (as ``KeyTimersHandle`` does for ``timers``).
4. Schema evolution (``model.evolution``) treats an added variable as added
   columns: a stored state without it reads as empty for every key.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, cast

import numpy as np
import pyarrow as pa

from spark_state.errors import ConfigError, CorruptBlobError

DELETED_COLUMN = "_deleted"
RESERVED_PREFIX = "_spark_state"
VARIABLE_PREFIX = RESERVED_PREFIX + "_"
VALUE = "value"
"""The name of the value state variable every component has."""

Key = tuple
Value = tuple


def _check_field(field: pa.Field, what: str) -> None:
    if field.name == DELETED_COLUMN or not field.name or field.name.startswith(RESERVED_PREFIX):
        raise ConfigError(f"{what} {field.name!r} uses a reserved name; rename it")
    if pa.types.is_dictionary(field.type):
        raise ConfigError(
            f"{what} {field.name!r} is dictionary-encoded; decode it first "
            "(dictionary batches would break ranged reads of key groups)"
        )


@dataclass(frozen=True)
class StateVariable:
    """A named piece of every key's state with its own columns (a struct column in blobs)."""

    name: str
    fields: tuple[pa.Field, ...]

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("_"):
            raise ConfigError(f"state variable name {self.name!r} is invalid: use a name not starting with '_'")
        for field in self.fields:
            _check_field(field, f"column of state variable {self.name!r}")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ConfigError(f"state variable {self.name!r} repeats a column name: {names}")

    @property
    def arrow_type(self) -> pa.StructType:
        return pa.struct(list(self.fields))

    @property
    def column_name(self) -> str:
        """The name of its struct column in blobs."""
        return VARIABLE_PREFIX + self.name

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


@dataclass(frozen=True)
class KeyedSchema:
    """Key columns and state variables of a component; ``variables[0]`` is always ``value``."""

    keys: tuple[pa.Field, ...]
    variables: tuple[StateVariable, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ConfigError("a keyed state needs at least one key column")
        for field in self.keys:
            _check_field(field, "key column")
        names = [v.name for v in self.variables]
        if not names or names[0] != VALUE or len(set(names)) != len(names):
            raise ConfigError(f"state variables must start with {VALUE!r} and be unique, got {names}")
        if len(set(self.key_columns)) != len(self.keys):
            raise ConfigError(f"key columns {list(self.key_columns)} must be distinct")

    @classmethod
    def of_values(cls, key_fields: Sequence[pa.Field], value_fields: Sequence[pa.Field]) -> KeyedSchema:
        """A schema with only the ``value`` variable holding ``value_fields``."""
        return cls(tuple(key_fields), (StateVariable(VALUE, tuple(value_fields)),))

    @functools.cached_property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.keys)

    @property
    def value(self) -> StateVariable:
        return self.variables[0]

    @functools.cached_property
    def sorted_key(self) -> str | None:
        """The key column each entry's rows are in ascending order of, if any: the one key column, when an integer
        (by value), a string or a binary (by bytes).

        A checkpoint writes the rows of every entry of such a component in
        that order (``executor.order.sort_rows``), so a lookup finds a key by
        binary search instead of hashing its key group
        (``executor.chain.FetchedChain.searchable``). Readers check the order,
        never assume it: a store written before it was kept reads as well.
        """
        kind = self.keys[0].type
        if len(self.keys) == 1 and (
            pa.types.is_integer(kind)
            or pa.types.is_string(kind)
            or pa.types.is_binary(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_large_binary(kind)
        ):
            return self.keys[0].name
        return None

    def has_variable(self, name: str) -> bool:
        return any(variable.name == name for variable in self.variables)

    def variable_index(self, name: str) -> int:
        for index, variable in enumerate(self.variables):
            if variable.name == name:
                return index
        raise ConfigError(f"no state variable {name!r}; this component has {[v.name for v in self.variables]}")

    @functools.cached_property
    def blob_schema(self) -> pa.Schema:
        """The schema of every blob entry: keys, one struct per variable, ``_deleted``."""
        fields = list(self.keys) + [pa.field(v.column_name, v.arrow_type, nullable=True) for v in self.variables]
        return pa.schema(fields + [pa.field(DELETED_COLUMN, pa.bool_(), nullable=False)])

    def serialize(self) -> str:
        """The form stored in manifests (base64 of the blob schema's IPC message; see ``deserialize``)."""
        return base64.b64encode(self.blob_schema.serialize().to_pybytes()).decode("ascii")

    @classmethod
    def deserialize(cls, text: str, key_columns: Sequence[str]) -> KeyedSchema:
        """Inverse of ``serialize``, given the key column names the manifest records beside it."""
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
        except (ValueError, pa.ArrowInvalid) as exc:
            raise CorruptBlobError(f"stored state schema does not decode: {exc}") from exc
        n = len(key_columns)
        if list(schema.names[:n]) != list(key_columns) or schema.names[-1] != DELETED_COLUMN:
            raise CorruptBlobError(
                f"stored state schema {schema.names} does not start with the key columns {list(key_columns)}"
            )
        stored = list(schema)[n:-1]
        if not all(f.name.startswith(VARIABLE_PREFIX) and pa.types.is_struct(f.type) for f in stored):
            raise CorruptBlobError(f"stored state schema {schema.names} has columns that are not state variables")
        variables = tuple(StateVariable(f.name[len(VARIABLE_PREFIX) :], tuple(f.type)) for f in stored)
        return cls(tuple(schema)[:n], variables)

    # -- conversions between Arrow and the in-memory form -------------------------------

    def columns_to_rows(
        self, batch: pa.RecordBatch | pa.Table, *, bare: bool = False
    ) -> tuple[list[Key], list[list[Value | None]], list[bool]]:
        """The keys, per variable the values (None where the struct is null) and the tombstone flags of a batch.

        ``bare`` (one key column): each key is its column's value, not a 1-tuple.
        """
        n_keys = len(self.keys)
        if bare:
            keys = batch.column(0).to_pylist()
        else:
            keys = list(zip(*[batch.column(i).to_pylist() for i in range(n_keys)]))
        values = [struct_values(batch.column(n_keys + i), len(v.fields)) for i, v in enumerate(self.variables)]
        deleted = batch.column(n_keys + len(self.variables)).to_pylist()
        return keys, values, deleted

    def rows_to_columns(
        self,
        keys: Sequence[Key],
        values: Sequence[Sequence[Value | None]],
        deleted: Sequence[bool] | np.ndarray,
        *,
        bare: bool = False,
    ) -> pa.Table:
        """Inverse of ``columns_to_rows``: ``values[i][r]`` is variable i's value of row r (or None)."""
        schema = self.blob_schema
        if bare:
            arrays = [pa.array(keys, type=self.keys[0].type)]
        else:
            arrays = [pa.array(list(map(itemgetter(i), keys)), type=field.type) for i, field in enumerate(self.keys)]
        for variable, column in zip(self.variables, values):
            arrays.append(_struct_array(variable, column))
        arrays.append(pa.array(deleted, pa.bool_()))  # a list, or a NumPy array when none is deleted
        return pa.Table.from_arrays(arrays, schema=schema)

    def fields_to_batch(self, keys: Sequence[pa.Array], fields: Sequence[pa.Array]) -> pa.RecordBatch:
        """A blob-schema batch of one variable given as Arrow columns, no row deleted."""
        schema = self.blob_schema
        (variable,) = self.variables
        arrays = [
            column if column.type == field.type else column.cast(field.type)
            for column, field in zip([*keys, *fields], [*self.keys, *variable.fields])
        ]
        value = pa.StructArray.from_arrays(arrays[len(keys) :], fields=list(variable.fields))
        deleted = pa.array(np.zeros(len(value), bool))
        return pa.RecordBatch.from_arrays([*arrays[: len(keys)], value, deleted], schema=schema)


def struct_values(column: Any, width: int) -> list[Value | None]:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    children = [column.field(i).to_pylist() for i in range(width)]
    rows: list[Value | None] = list(zip(*children)) if width else [()] * len(column)
    if column.null_count:
        for row, valid in enumerate(column.is_valid().to_pylist()):
            if not valid:
                rows[row] = None
    return rows


def _struct_array(variable: StateVariable, values: Sequence[Value | None]) -> pa.StructArray:
    absent = None in values
    present: Sequence[Value] = (
        [v if v is not None else (None,) * len(variable.fields) for v in values]
        if absent
        else cast(Sequence[Value], values)  # ``None in values`` is False: no value is None
    )
    children = [pa.array(list(map(itemgetter(i), present)), type=field.type) for i, field in enumerate(variable.fields)]
    mask = pa.array([v is None for v in values], pa.bool_()) if absent else None
    if not variable.fields:
        return (
            pa.StructArray.from_arrays([], fields=[], mask=mask)
            if mask is not None
            else pa.array([{}] * len(values), type=variable.arrow_type)
        )
    return pa.StructArray.from_arrays(children, fields=list(variable.fields), mask=mask)
