"""Python values into Arrow types exactly, or refused: what a user function stores or returns. Pure, no I/O.

Arrow's own conversion truncates a float into an integer column (``pa.array([2.5], pa.int64())`` is ``[2]``),
and it refuses other mismatches only when a batch is written, far from the call that made them. ``exact(field)``
is the rule of one column, applied where a value is handed over (``KeyState.update``, a function's output rows):

- an integer column takes ints (not bools) within its type's range, and floats that are whole numbers (as ints);
- a floating-point column takes ints and floats (not bools);
- a string column takes ``str``; a binary column ``bytes``, ``bytearray`` or ``memoryview``; a boolean column
  ``bool``;
- any other type takes what Arrow converts without complaint (dates, timestamps, decimals, nested values);
- ``None`` (and pandas' ``NA`` and ``NaT``) is a null, in every column.

Anything else is a ``ConfigError`` naming the column, the value, its Python type and the column's type.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from spark_state.errors import ConfigError

Convert = Callable[[Any], Any]


def _refuse(field: pa.Field, value: Any, why: str = "") -> ConfigError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigError(
        f"column {field.name!r} is {field.type}, and {shown} ({type(value).__name__}) {why or 'is not of that type'}: "
        f"convert it yourself before handing it over (nothing is truncated or guessed)"
    )


def _null(value: Any) -> bool:
    """``None``, or pandas' missing value (``pd.NA``, ``pd.NaT``), which a pandas function may hand over."""
    return value is None or type(value).__name__ in ("NAType", "NaTType")


def _integer(field: pa.Field) -> Convert:
    kind = field.type
    bits = kind.bit_width
    low, high = (0, 2**bits - 1) if pa.types.is_unsigned_integer(kind) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)

    def convert(value: Any) -> Any:
        if _null(value):
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _refuse(field, value)
        if isinstance(value, numbers.Integral):
            whole = int(value)
        else:
            number = float(value)
            if not (math.isfinite(number) and number.is_integer()):
                raise _refuse(field, value, "is not a whole number")
            whole = int(number)
        value = whole
        if not low <= value <= high:
            raise _refuse(field, value, f"is outside its range [{low}, {high}]")
        return value

    return convert


def _floating(field: pa.Field) -> Convert:
    def convert(value: Any) -> Any:
        if _null(value):
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _refuse(field, value)
        return value

    return convert


def _of(types: tuple[type, ...]) -> Callable[[pa.Field], Convert]:
    def make(field: pa.Field) -> Convert:
        def convert(value: Any) -> Any:
            if _null(value):
                return None
            if isinstance(value, types):
                return value
            raise _refuse(field, value)

        return convert

    return make


def _by_arrow(field: pa.Field) -> Convert:
    def convert(value: Any) -> Any:
        if _null(value):
            return None
        try:
            pa.array([value], field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as error:
            raise _refuse(field, value, f"does not convert ({error})") from None
        return value

    return convert


def exact(field: pa.Field) -> Convert:
    """The conversion of one value into ``field`` (see the module docstring); ``ConfigError`` when it is not exact."""
    kind = field.type
    if pa.types.is_integer(kind):
        return _integer(field)
    if pa.types.is_floating(kind):
        return _floating(field)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return _of((str,))(field)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return _of((bytes, bytearray, memoryview))(field)
    if pa.types.is_boolean(kind):
        import numpy as np

        return _of((bool, np.bool_))(field)
    return _by_arrow(field)


def exact_tuple(fields: Sequence[pa.Field]) -> Callable[[tuple], tuple]:
    """The conversion of a value tuple (one value per field, in order)."""
    converts = [exact(field) for field in fields]

    def convert(values: tuple) -> tuple:
        return tuple(c(v) for c, v in zip(converts, values))

    return convert


def exact_column(field: pa.Field, values: Sequence[Any]) -> pa.Array:
    """``values`` as an Arrow array of ``field``'s type, each converted exactly (``exact``).

    Only integer columns need a look at each value (Arrow truncates floats into them); a value Arrow refuses in
    any other column is found again by ``exact``, for a message that names it.
    """
    kind = field.type
    if pa.types.is_integer(kind):
        convert = exact(field)
        values = [v if type(v) is int else convert(v) for v in values]
    try:
        return pa.array(values, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as error:
        convert = exact(field)
        for value in values:
            convert(value)
        raise ConfigError(f"column {field.name!r} ({kind}) does not take these values: {error}") from None
