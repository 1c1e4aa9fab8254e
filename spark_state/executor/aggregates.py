"""The built-in aggregates: each one ``AggregateDef``, from which everything else about it follows. No pyspark.

Each is data (``AGGREGATES``): its state columns, the Arrow partial
aggregates a batch computes per key (``PARTIAL_OPS``: also what Spark
computes for it in the JVM, ``spark.plan``), how a partial merges into the
state, and how the state becomes the output value. **Adding one is adding
an entry** (or calling ``register_aggregate``): ``KeyedStream`` gets its
method (``spark.streaming``). On a native state (``KeyGroupTable.native``) a
batch's partials merge into the state with Arrow kernels, no Python object
per key; elsewhere per key, in Python.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import AggregateOverflowError, ConfigError
from spark_state.executor.columns import KEY_GROUP_COLUMN
from spark_state.executor.table import KeyGroupTable

PARTIAL_PREFIX = "_spark_state_partial_"
"""Column ``PARTIAL_PREFIX + str(i)`` holds a key's partial ``i`` of a built-in aggregate, computed in the JVM."""
ROWS_COLUMN = "_spark_state_rows"
"""With partials computed in the JVM, the number of input rows each partial row stands for."""

PARTIAL_OPS: dict[str, tuple[str, str]] = {
    "count_all": ("count", "one"),
    "count": ("count", "column"),
    "sum": ("sum", "column"),
    "min": ("min", "column"),
    "max": ("max", "column"),
}
"""Each Arrow ``group_by`` aggregation a partial may be, and the Spark function that computes the same value
per key in the JVM, with its argument (``"column"``: the aggregate's column; ``"one"``: the literal 1)."""

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
    if not (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_decimal(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_temporal(kind)
    ):
        raise ConfigError(f"{name}({column!r}) needs a numeric, string, date or timestamp column, it is {kind}")


def _sum_type(kind: pa.DataType) -> pa.DataType:
    return pa.int64() if pa.types.is_integer(kind) else pa.float64()


def _always(_: pa.DataType | None) -> bool:
    return True


def _jvm_sums(kind: pa.DataType | None) -> bool:
    return kind is not None and (pa.types.is_integer(kind) or pa.types.is_floating(kind))


def _jvm_orders(kind: pa.DataType | None) -> bool:
    return kind is not None and (
        pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_date(kind) or pa.types.is_timestamp(kind)
    )


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
    the others. ``doc`` is the docstring of its ``KeyedStream`` method.
    ``finish_arrow`` is ``finish`` over the state's Arrow columns (None: the
    aggregate is merged per key in Python only), and ``in_arrow(input_type)``
    whether Arrow's kernels merge its state exactly as ``_merge`` does.

    **A new aggregate is one entry of ``AGGREGATES``** (or one
    ``register_aggregate`` call): ``KeyedStream`` gets a method of its name,
    Spark computes its partials per key when ``in_jvm`` allows (from
    ``PARTIAL_OPS``), and the merge, the output and the state schema follow
    from its fields. A partial not in ``PARTIAL_OPS`` is one more entry there.
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
    doc: str = ""
    finish_arrow: Callable[[list[pa.Array]], pa.Array] | None = None
    in_arrow: Callable[[pa.DataType | None], bool] = lambda _: True

    def __post_init__(self) -> None:
        unknown = [p for p in self.partials if p not in PARTIAL_OPS] + [m for m in self.merges if m not in _MERGES]
        if not self.needs_column and any(PARTIAL_OPS.get(p, ("", ""))[1] == "column" for p in self.partials):
            raise ConfigError(
                f"aggregate {self.name!r}: partials {self.partials} read a column, so it needs one (needs_column=True)"
            )
        if unknown or len(self.partials) != len(self.merges):
            raise ConfigError(
                f"aggregate {self.name!r}: partials {self.partials} and merges {self.merges} must pair up, each "
                f"partial one of {sorted(PARTIAL_OPS)}, each merge one of {sorted(_MERGES)}"
            )

    def __reduce__(self):
        """A built-in is pickled by name (each process has it); one ``register_aggregate`` added, by value."""
        if BUILT_IN.get(self.name) is self:
            return _built_in, (self.name,)
        return super().__reduce__()

    def output_name(self, column: str | None) -> str:
        """The output column a call names by default: ``<name>`` without a column, ``<name>_<column>`` with one."""
        return self.name if column is None else f"{self.name}_{column}"


def _mean(columns: list[pa.Array]) -> pa.Array:
    total, count = columns
    return pc.if_else(
        pc.fill_null(pc.equal(count, 0), True),
        pa.scalar(None, pa.float64()),
        pc.divide(total, pc.cast(count, pa.float64())),
    )


def _ordered_in_arrow(kind: pa.DataType | None) -> bool:
    """Python's and Arrow's orders of NaN differ, and Arrow has no element-wise min or max of dates and
    timestamps: a min or max merges in Arrow only over integers or strings."""
    return kind is not None and (
        pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
    )


AGGREGATES: dict[str, AggregateDef] = {
    d.name: d
    for d in (
        AggregateDef(
            "count",
            False,
            lambda *_: None,
            lambda _: (pa.int64(),),
            ("count_all",),
            ("sum",),
            lambda _: pa.int64(),
            _first,
            _always,
            lambda _: (0,),
            doc="Running count of rows per key; emits ``(keys..., output)`` for every key seen in a batch.",
            finish_arrow=_first,
        ),
        AggregateDef(
            "sum",
            True,
            _numeric,
            lambda t: (_sum_type(t),),
            ("sum",),
            ("sum",),
            _sum_type,
            _first,
            _jvm_sums,
            lambda t: (0,) if pa.types.is_integer(_sum_type(t)) else (-0.0,),
            doc="Running sum of ``column`` per key (int64 for integers, float64 otherwise); nulls are skipped.",
            finish_arrow=_first,
        ),
        AggregateDef(
            "min",
            True,
            _orderable,
            lambda t: (t,),
            ("min",),
            ("min",),
            lambda t: t,
            _first,
            _jvm_orders,
            doc="Running minimum of ``column`` per key (numbers, strings, dates, timestamps); nulls are skipped.",
            finish_arrow=_first,
            in_arrow=_ordered_in_arrow,
        ),
        AggregateDef(
            "max",
            True,
            _orderable,
            lambda t: (t,),
            ("max",),
            ("max",),
            lambda t: t,
            _first,
            _jvm_orders,
            doc="Running maximum of ``column`` per key; nulls are skipped.",
            finish_arrow=_first,
            in_arrow=_ordered_in_arrow,
        ),
        AggregateDef(
            "mean",
            True,
            _numeric,
            lambda _: (pa.float64(), pa.int64()),
            ("sum", "count"),
            ("sum", "sum"),
            lambda _: pa.float64(),
            lambda s: None if not s[1] else s[0] / s[1],
            _jvm_sums,
            doc="Running mean of ``column`` per key (float64; null until a non-null value arrives).",
            finish_arrow=_mean,
        ),
    )
}


BUILT_IN: dict[str, AggregateDef] = dict(AGGREGATES)
"""The aggregates this module defines (``AGGREGATES`` may hold registered ones beside them)."""


def _built_in(name: str) -> AggregateDef:
    return BUILT_IN[name]


def register_aggregate(definition: AggregateDef) -> AggregateDef:
    """Add a built-in aggregate (``AggregateDef``): ``KeyedStream`` gets a method named ``definition.name``
    (``spark.streaming``). ``ConfigError`` if that name is taken."""
    if definition.name in AGGREGATES:
        raise ConfigError(f"an aggregate named {definition.name!r} exists already: {sorted(AGGREGATES)}")
    AGGREGATES[definition.name] = definition
    for listener in _REGISTERED:
        listener(definition)
    return definition


_REGISTERED: list[Callable[[AggregateDef], None]] = []
"""Called with each aggregate ``register_aggregate`` adds (``KeyedStream`` makes its method)."""


def on_register(listener: Callable[[AggregateDef], None]) -> None:
    """Call ``listener`` with every aggregate there is, and with each one registered later."""
    _REGISTERED.append(listener)
    for definition in list(AGGREGATES.values()):
        listener(definition)


@dataclass(frozen=True)
class Aggregate:
    """A built-in aggregate of ``column`` per key (``AGGREGATES[kind]``), emitted as ``output_name``."""

    kind: str
    column: str | None
    output_name: str
    input_type: pa.DataType | None = None
    definition: AggregateDef = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        definition = self.definition or AGGREGATES.get(self.kind)
        if definition is None:
            raise ConfigError(f"unknown aggregate {self.kind!r}; built-ins: {sorted(AGGREGATES)}")
        object.__setattr__(self, "definition", definition)  # shipped with the task: executors need no registry
        if definition.needs_column:
            if self.column is None or self.input_type is None:
                raise ConfigError(f"{self.kind}() needs a column")
            definition.check(self.kind, self.column, self.input_type)

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
        """Whether Arrow kernels merge this aggregate exactly as ``_merge`` does (``_apply_arrow``): it has an
        Arrow ``finish`` and its ``in_arrow`` holds for the input type."""
        return self.definition.finish_arrow is not None and self.definition.in_arrow(self.input_type)

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
        return totals, totals.column_names[-len(definition.partials) :]

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
        parts = (
            [self._apply_arrow(table, totals.filter(pa.array(rows_native)), names, key_columns)] if native.any() else []
        )
        parts.append(self._apply_python(table, totals.filter(pa.array(~rows_native)), names, key_columns))
        return pa.concat_tables(parts)

    def _apply_arrow(
        self, table: KeyGroupTable, totals: pa.Table, names: list[str], key_columns: tuple[str, ...]
    ) -> pa.Table:
        """``apply`` with Arrow kernels: look the keys' states up, merge, put them back, without Python objects.

        A null state field (no value yet, or only nulls) is the identity, as
        in ``_merge``: a sum is the coalesce of the checked sum and the two
        sides, a min or max skips nulls. An integer sum that overflows raises
        ``AggregateOverflowError`` before the state changes, as in Python.
        """
        definition = self.definition
        finish_arrow = definition.finish_arrow
        assert finish_arrow is not None, "apply takes the Arrow path only when vectorized()"
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
        result = finish_arrow(columns)
        return pa.table(
            {**{c: totals.column(c) for c in key_columns}, self.output_name: result.cast(self.output_type())}
        )

    def _overflow(self) -> AggregateOverflowError:
        return AggregateOverflowError(
            f"{self.kind}({self.column!r}) overflows its 64-bit integer state for some key; the batch failed and "
            "the state is unchanged: cast the column to double before aggregating"
        )

    def _apply_python(
        self, table: KeyGroupTable, totals: pa.Table, names: list[str], key_columns: tuple[str, ...]
    ) -> pa.Table:
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
                merged = (
                    list(map(merge, firsts, part))
                    if None not in firsts
                    else [p if f is None else merge(f, p) for f, p in zip(firsts, part)]
                )
            else:  # the rule of ``_merge``, as one comprehension
                new = [
                    (p,) if o is None or o[0] is None else o if p is None else (merge(o[0], p),)
                    for o, p in zip(olds, part)
                ]
            if merged is not None:
                new = list(zip(merged))
        else:
            new = [
                tuple(
                    _merge(op, old[i] if old is not None else None, part[row])
                    for i, (op, part) in enumerate(zip(merges, partials))
                )
                for row, old in enumerate(olds)
            ]
        # No state is ever None here (a key with a batch has a value): the columns are the values as put.
        fields = [merged] if merged is not None else [[s[i] for s in new] for i in range(len(state_types))]
        try:
            columns = [pa.array(f, t) for f, t in zip(fields, state_types)]
        except (OverflowError, pa.ArrowInvalid) as exc:
            raise self._overflow() from exc
        table.put_many(
            key_groups,
            keys,
            new,
            key_columns=[totals.column(c).combine_chunks() for c in key_columns],
            value_columns=columns,
        )
        output = {c: totals.column(c) for c in key_columns}
        if definition.finish is _first and columns[0].type == self.output_type():
            output[self.output_name] = columns[0]  # the output is the state column, as stored
        else:
            output[self.output_name] = pa.array([definition.finish(s) for s in new], self.output_type())
        return pa.table(output)
