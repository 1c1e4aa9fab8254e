"""State schema evolution: which changes of a component's state schema a restart may make, and the cast. Pure.

A query restarted with another state schema reads the stored state if every
change is one of these (``plan_evolution`` decides, ``SchemaEvolution.conform``
casts one blob entry):

=========================================  ====================================================================
change                                     what old state reads as
=========================================  ====================================================================
a value column added, nullable             null for every stored key
a value column added with a default        the default for every key that has a value (``DEFAULT_METADATA``)
a value column removed                     dropped
a widened type (``WIDENINGS``)             cast: int8 -> int16 -> int32 -> int64, uint to wider (u)int,
                                           float16 -> float32 -> float64, decimal to more precision at the
                                           same scale, string -> large_string, binary -> large_binary,
                                           list<T> -> list/large_list<wider T>
a state variable added (``timers`` when    null: no key has a value for it yet
the query gains ``on_timer`` or a TTL)
a state variable removed                   dropped
a non-nullable column made nullable        unchanged
=========================================  ====================================================================

Anything else is refused with ``IncompatibleSchemaError`` naming the column,
its old and new type and what to do: a key column changed (added, removed,
renamed, retyped: a key's hash and key group depend on its bytes), a type
narrowed or changed to another kind, a nullable column made non-nullable, or
a non-nullable column added without a default.

Nothing is rewritten when a query restarts: the blobs keep the schema they
were written in (the manifest records it per blob), each entry is cast when a
task reads it, and a key group is written in the new schema the next time it
is checkpointed or compacted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pyarrow as pa

from spark_state.errors import ConfigError, IncompatibleSchemaError
from spark_state.model.schema import KeyedSchema, StateVariable

DEFAULT_METADATA = b"spark_state.default"
"""Field metadata key of a value column's declared default: the JSON text of the value."""

_INTS = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]
_UINTS = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
_FLOATS = [pa.float16(), pa.float32(), pa.float64()]


def _ladder(types: list[pa.DataType]) -> set[tuple[pa.DataType, pa.DataType]]:
    return {(a, b) for i, a in enumerate(types) for b in types[i + 1 :]}


WIDENINGS: frozenset[tuple[pa.DataType, pa.DataType]] = frozenset(
    _ladder(_INTS)
    | _ladder(_UINTS)
    | _ladder(_FLOATS)
    | {(u, s) for i, u in enumerate(_UINTS) for s in _INTS[i + 1 :]}
    | {(pa.string(), pa.large_string()), (pa.binary(), pa.large_binary())}
)
"""Scalar ``(old, new)`` type pairs whose every old value is exactly representable in the new type."""


def widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether every value of ``old`` casts to ``new`` exactly (equal types included)."""
    if old.equals(new):
        return True
    if (old, new) in WIDENINGS:
        return True
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        return new.scale == old.scale and new.precision - new.scale >= old.precision - old.scale
    if (pa.types.is_list(old) or pa.types.is_large_list(old)) and (
        pa.types.is_list(new) or pa.types.is_large_list(new)
    ):
        return not (pa.types.is_large_list(old) and pa.types.is_list(new)) and widens(old.value_type, new.value_type)
    return False


def with_default(field: pa.Field, value: Any) -> pa.Field:
    """``field`` with a declared default (recorded in its metadata); ``ConfigError`` if the value does not fit."""
    try:
        pa.array([value], field.type)
        text = json.dumps(value)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(
            f"default {value!r} of state column {field.name!r} does not fit its type {field.type}: {exc}"
        ) from exc
    return field.with_metadata({**(field.metadata or {}), DEFAULT_METADATA: text.encode()})


def default_of(field: pa.Field) -> tuple[bool, Any]:
    """``(True, value)`` when ``field`` declares a default, else ``(False, None)``."""
    metadata = field.metadata or {}
    if DEFAULT_METADATA not in metadata:
        return False, None
    return True, json.loads(metadata[DEFAULT_METADATA])


def _type(t: pa.DataType | None) -> str | None:
    return None if t is None else str(t)


@dataclass(frozen=True)
class SchemaEvolution:
    """How entries written in ``old`` read in ``new``; ``changes`` describes each change for logs and the CLI."""

    old: KeyedSchema
    new: KeyedSchema
    changes: tuple[str, ...]

    @property
    def identity(self) -> bool:
        return self.old.blob_schema.equals(self.new.blob_schema)

    def conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` (an entry in the old blob schema) in the new blob schema: keys and ``_deleted`` as they are."""
        if self.identity:
            return batch
        n_keys = len(self.old.keys)
        columns = [batch.column(i) for i in range(n_keys)]
        old_index = {v.name: n_keys + i for i, v in enumerate(self.old.variables)}
        for variable in self.new.variables:
            position = old_index.get(variable.name)
            if position is None:
                columns.append(pa.nulls(batch.num_rows, variable.arrow_type))
            else:
                old_variable = self.old.variables[position - n_keys]
                columns.append(_conform_struct(batch.column(position), old_variable, variable))
        columns.append(batch.column(batch.num_columns - 1))
        return pa.RecordBatch.from_arrays(columns, schema=self.new.blob_schema)


def _conform_struct(column: pa.StructArray, old: StateVariable, new: StateVariable) -> pa.Array:
    n = len(column)
    mask = column.is_null() if column.null_count else None
    children = dict(zip(old.columns, column.flatten())) if old.fields else {}
    arrays = []
    for field in new.fields:
        if field.name in children:
            child = children[field.name]
            arrays.append(child if child.type.equals(field.type) else child.cast(field.type))
            continue
        has_default, value = default_of(field)
        arrays.append(pa.array([value] * n, field.type) if has_default else pa.nulls(n, field.type))
    if not new.fields:
        valid = [True] * n if mask is None else [not m for m in mask.to_pylist()]
        return pa.array([{} if v else None for v in valid], new.arrow_type)
    return pa.StructArray.from_arrays(arrays, fields=list(new.fields), mask=mask)


def plan_evolution(component: str, old: KeyedSchema, new: KeyedSchema) -> SchemaEvolution:
    """How state stored in ``old`` reads in ``new``; ``IncompatibleSchemaError`` if it cannot (module docstring)."""
    _check_keys(component, old, new)
    changes: list[str] = []
    old_variables = {v.name: v for v in old.variables}
    new_names = {v.name for v in new.variables}
    for variable in new.variables:
        before = old_variables.get(variable.name)
        if before is None:
            changes.append(f"state variable {variable.name!r} added (null for stored keys)")
            continue
        changes.extend(_variable_changes(component, before, variable))
    changes.extend(f"state variable {name!r} removed" for name in old_variables if name not in new_names)
    return SchemaEvolution(old, new, tuple(changes))


def _refuse(component: str, column: str, old: pa.DataType | None, new: pa.DataType | None, why: str) -> None:
    raise IncompatibleSchemaError(
        f"component {component!r}: state column {column!r} cannot change from {_type(old) or '(absent)'} to "
        f"{_type(new) or '(absent)'}: {why}. Keep the stored schema for {column!r}, or start from a savepoint "
        "(`spark-state savepoint create`) under a new component name, which starts its state empty",
        component=component,
        column=column,
        old_type=_type(old),
        new_type=_type(new),
    )


def _check_keys(component: str, old: KeyedSchema, new: KeyedSchema) -> None:
    old_keys = {f.name: f for f in old.keys}
    new_keys = {f.name: f for f in new.keys}
    why = "key columns never change (a key's hash, and so its key group, depends on its bytes)"
    for name in [f.name for f in old.keys] + [f.name for f in new.keys if f.name not in old_keys]:
        before, after = old_keys.get(name), new_keys.get(name)
        if before is None or after is None or not before.type.equals(after.type):
            _refuse(component, name, before.type if before else None, after.type if after else None, why)
    if old.key_columns != new.key_columns:
        _refuse(
            component,
            ",".join(new.key_columns),
            None,
            None,
            f"key columns are {list(new.key_columns)}, the state is keyed by {list(old.key_columns)} (order "
            "matters); " + why,
        )


def _variable_changes(component: str, old: StateVariable, new: StateVariable) -> list[str]:
    changes = []
    before = {f.name: f for f in old.fields}
    for field in new.fields:
        column = f"{new.name}.{field.name}"
        previous = before.get(field.name)
        if previous is None:
            has_default, value = default_of(field)
            if not field.nullable and not has_default:
                _refuse(
                    component,
                    column,
                    None,
                    field.type,
                    "a column added as non-nullable needs a declared default (apply(..., state_defaults="
                    "{...})) or must be nullable",
                )
            changes.append(
                f"{column} added ({'default ' + json.dumps(value) if has_default else 'null'} for stored keys)"
            )
            continue
        if not widens(previous.type, field.type):
            _refuse(
                component,
                column,
                previous.type,
                field.type,
                "only widening casts are allowed (int8->int16->int32->int64, float32->float64, "
                "string->large_string, ...); this one narrows or changes the kind of the type",
            )
        if previous.nullable and not field.nullable:
            _refuse(
                component,
                column,
                previous.type,
                field.type,
                "it was nullable and is now non-nullable, but stored values may be null",
            )
        if not previous.type.equals(field.type):
            changes.append(f"{column} widened from {previous.type} to {field.type}")
    names = {f.name for f in new.fields}
    changes.extend(f"{old.name}.{f.name} removed" for f in old.fields if f.name not in names)
    return changes


@lru_cache(maxsize=256)
def cached_evolution(component: str, old_text: str, new_text: str, key_columns: tuple[str, ...]) -> SchemaEvolution:
    """``plan_evolution`` of two serialized schemas (``KeyedSchema.serialize``), cached: readers call it per entry."""
    return plan_evolution(
        component, KeyedSchema.deserialize(old_text, key_columns), KeyedSchema.deserialize(new_text, key_columns)
    )
