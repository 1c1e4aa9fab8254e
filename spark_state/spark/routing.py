"""The Spark edge of routing: key groups and instances as Column expressions.

These expressions compute, on the JVM and without a Python UDF, exactly what
``spark_state.keyspace.key_group_for`` and ``instance_for_key_group`` compute
in Python (``tests/test_routing_spark.py`` checks it row by row). Each key
column is encoded the way ``keygroups`` encodes a key component:

- byte, short, int, long, boolean: ``CAST(c AS BIGINT)``, hashed as 8 bytes;
- string: its UTF-8 bytes (``CAST(c AS BINARY)``), zero-padded to a multiple
  of 4 bytes; only the default ``UTF8_BINARY`` collation is accepted, because
  under another collation Spark treats keys with different bytes as equal
  while their hashes differ;
- binary: zero-padded to a multiple of 4 bytes;
- void (NullType): passed through; ``hash`` skips nulls like ``keygroups`` does.

Any other type raises ``UnsupportedKeyError`` when the expression is built:
cast it first, the same way on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark_state.errors import UnsupportedKeyError
from spark_state.keyspace import check_max_parallelism, check_parallelism

_INTEGRAL_TYPES = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)
_BINARY_COLLATION = "UTF8_BINARY"


def _pad_to_4_bytes(binary: Column) -> Column:
    """Append 0-3 zero bytes so the length is a multiple of 4; null stays null."""
    pad_length = F.pmod(-F.octet_length(binary), F.lit(4))
    return F.concat(binary, F.substring(F.unhex(F.lit("000000")), F.lit(1), pad_length))


def _pad_to_4_bytes_sql(binary: str) -> str:
    """``_pad_to_4_bytes`` as SQL text."""
    return f"concat({binary}, substring(unhex('000000'), 1, pmod(-octet_length({binary}), 4)))"


def _encode(column: Column, data_type: T.DataType, index: int) -> Column:
    """Return ``column`` encoded for ``hash`` as ``keygroups`` encodes a component."""
    kind = _encoding(data_type, index)
    if kind == "bigint":
        return column.cast("bigint")
    if kind == "string":
        return _pad_to_4_bytes(column.cast("binary"))
    return _pad_to_4_bytes(column) if kind == "binary" else column


def _encode_sql(column: str, data_type: T.DataType, index: int) -> str:
    """``_encode`` as SQL text, of ``column`` (SQL text)."""
    kind = _encoding(data_type, index)
    if kind == "bigint":
        return f"CAST({column} AS BIGINT)"
    if kind == "string":
        return _pad_to_4_bytes_sql(f"CAST({column} AS BINARY)")
    return _pad_to_4_bytes_sql(column) if kind == "binary" else column


def check_key_type(data_type: T.DataType, index: int, name: str | None = None) -> str:
    """How key column ``index`` (called ``name``) of ``data_type`` is encoded; ``UnsupportedKeyError`` naming it
    when it cannot be a key (``keyed()`` asks before a query starts)."""
    try:
        return _encoding(data_type, index)
    except UnsupportedKeyError as error:
        if name is None:
            raise
        raise UnsupportedKeyError(str(error).replace(f"key column {index} ", f"key column {name!r} ", 1)) from None


def _encoding(data_type: T.DataType, index: int) -> str:
    """How a key component of ``data_type`` is encoded (see the module docstring); raises if it cannot be."""
    if isinstance(data_type, _INTEGRAL_TYPES):
        return "bigint"
    if isinstance(data_type, T.StringType):
        collation = getattr(data_type, "collation", _BINARY_COLLATION)
        if collation != _BINARY_COLLATION:
            raise UnsupportedKeyError(
                f"key column {index} is a string with collation {collation}: keys that the collation "
                "treats as equal would get different key groups. Normalise the key (for example "
                f"lower()) and collate it as {_BINARY_COLLATION}"
            )
        return "string"
    if isinstance(data_type, T.BinaryType):
        return "binary"
    if isinstance(data_type, T.NullType):
        return "void"
    raise UnsupportedKeyError(
        f"key column {index} has Spark type {data_type.simpleString()}, which has no canonical "
        "encoding; supported: tinyint, smallint, int, bigint, boolean, string, binary, void. "
        "Cast it (for example a timestamp to bigint) the same way in Python"
    )


def key_group_column(df: DataFrame, key_cols: Sequence[str | Column], max_parallelism: int) -> Column:
    """Return an int Column with each row's key group: ``pmod(hash(enc(c1), ...), max_parallelism)``.

    Equals ``keygroups.key_group_for((c1, c2, ...), max_parallelism)`` on every
    row, nulls included. Resolving the key column types reads ``df``'s
    schema (no job runs; other than top-level column names, an analysis).

    Args:
        df: the DataFrame the key columns belong to; used only for their types.
        key_cols: one or more column names or Columns of ``df``, in key order.
        max_parallelism: ``1 <= max_parallelism <= 32768``.

    Returns:
        Column of int, ``0 <= key_group < max_parallelism``.

    Raises:
        InvalidParallelismError: bad ``max_parallelism``.
        UnsupportedKeyError: no key columns, or a column of an unsupported type.
    """
    return _key_group(df, key_cols, max_parallelism)[1]


def _key_group(df: DataFrame, key_cols: Sequence[str | Column], max_parallelism: int) -> tuple[str | None, Column]:
    """``key_group_column``'s checks and Column, with its SQL text when it has one (``_key_group_sql``)."""
    m = check_max_parallelism(max_parallelism)
    if isinstance(key_cols, (str, Column)) or not key_cols:
        raise UnsupportedKeyError("key_cols must be a non-empty list of column names or Columns, e.g. ['user_id']")
    sql = _key_group_sql(df, key_cols, m)
    if sql is not None:
        return sql, F.expr(sql)
    columns = [F.col(c) if isinstance(c, str) else c for c in key_cols]
    data_types = [field.dataType for field in df.select(*columns).schema.fields]  # as Spark resolves them
    encoded = [_encode(column, data_type, i) for i, (column, data_type) in enumerate(zip(columns, data_types))]
    return None, F.pmod(F.hash(*encoded), F.lit(m))


def _key_group_sql(df: DataFrame, key_cols: Sequence[str | Column], m: int) -> str | None:
    """``key_group_column`` as SQL text when every key column is a top-level column named as in ``df``'s schema
    (None otherwise: expressions, nested or differently cased names).

    One parse in the JVM instead of a py4j round trip per function and
    literal (about 30 ms on the driver for a string key), in the first batch
    of a query and of every parallelism.
    """
    top_level = {field.name: field.dataType for field in df.schema.fields}  # kept by the DataFrame once read
    names = [c for c in key_cols if isinstance(c, str) and c in top_level]
    if len(names) != len(key_cols):  # not every one is a top-level column's name
        return None
    encoded = [_encode_sql(quoted_identifier(c), top_level[c], i) for i, c in enumerate(names)]
    return f"pmod(hash({', '.join(encoded)}), {m})"


def quoted_identifier(name: str) -> str:
    """A column name as a SQL identifier (a top-level column, whatever characters its name holds)."""
    return "`" + name.replace("`", "``") + "`"


def instance_column(
    key_group_col: str | Column, parallelism: int, max_parallelism: int, *, in_range: bool = False
) -> Column:
    """Return an int Column with the instance that owns each row's key group.

    Equals ``keygroups.instance_for_key_group(g, parallelism, max_parallelism)``.
    A null key group gives null; a key group outside ``[0, max_parallelism)``
    fails the query rather than routing the row to a nonexistent instance,
    unless ``in_range`` says it cannot be outside (a ``key_group_column``).
    The expression names the key group once when ``parallelism`` divides
    ``max_parallelism`` and twice otherwise (three more times with the
    range check): an expression given as ``key_group_col`` is repeated
    where it is named, and every copy costs Spark's analysis time.

    Args:
        key_group_col: name or Column of key groups, ``0 <= key_group < max_parallelism``.
        parallelism: ``1 <= parallelism <= max_parallelism``.
        max_parallelism: ``1 <= max_parallelism <= 32768``.
        in_range: the key groups are known to be in ``[0, max_parallelism)``: no check.

    Returns:
        Column of int, ``0 <= instance < parallelism``.

    Raises:
        InvalidParallelismError: bad ``parallelism`` or ``max_parallelism``.
    """
    p, m = check_parallelism(parallelism, max_parallelism)
    group = F.col(key_group_col) if isinstance(key_group_col, str) else key_group_col
    q, r = divmod(m, p)
    # The first r instances own q + 1 key groups each, the others q: key group g belongs to g // (q + 1)
    # below first_small = r * (q + 1), else to r + (g - first_small) // q = (g - r) // q. Below first_small
    # (g - r) // q <= g // (q + 1), from it on the other way round, so the instance is the greater of the two
    # (one quotient when r = 0). floor() of a double quotient is exact here: operands are at most 2**15, and
    # a true quotient below an integer is below it by at least 1/divisor >= 2**-15.
    by_small = F.floor((group - F.lit(r)) / F.lit(q)) if r else F.floor(group / F.lit(q))
    instance = F.greatest(F.floor(group / F.lit(q + 1)), by_small) if r else by_small
    if in_range:
        return instance.cast("int")
    out_of_range = (group < F.lit(0)) | (group >= F.lit(m))
    error = F.raise_error(F.concat(F.lit(f"key group out of range, need 0 <= key_group < {m}: "), group.cast("string")))
    return F.when(out_of_range, error).otherwise(instance).cast("int")


def instance_sql(key_group: str, parallelism: int, max_parallelism: int, *, in_range: bool = False) -> str:
    """``instance_column`` as SQL text, of ``key_group`` (SQL text: a quoted name, or ``_key_group_sql``'s text).

    One parse in the JVM instead of a py4j round trip per function and
    literal (see ``_key_group_sql``); the same expression, which
    ``tests/test_routing_spark.py`` checks against Python for every key group.
    """
    p, m = check_parallelism(parallelism, max_parallelism)
    q, r = divmod(m, p)  # see instance_column
    by_small = f"FLOOR(({key_group} - {r}) / {q})" if r else f"FLOOR({key_group} / {q})"
    instance = f"greatest(FLOOR({key_group} / {q + 1}), {by_small})" if r else by_small
    if in_range:
        return f"CAST({instance} AS INT)"
    error = f"raise_error(concat('key group out of range, need 0 <= key_group < {m}: ', CAST({key_group} AS STRING)))"
    return f"CAST(CASE WHEN ({key_group} < 0) OR ({key_group} >= {m}) THEN {error} ELSE {instance} END AS INT)"


def routing_columns(
    df: DataFrame, key_cols: Sequence[str], parallelism: int, max_parallelism: int
) -> tuple[Column, Column]:
    """The key group and instance Columns of ``df``'s rows keyed by ``key_cols`` (names of its columns).

    As ``key_group_column`` and ``instance_column(..., in_range=True)`` over
    it, each parsed from SQL text once when the key columns are top-level.
    """
    sql, key_group = _key_group(df, key_cols, max_parallelism)
    if sql is None:
        return key_group, instance_column(key_group, parallelism, max_parallelism, in_range=True)
    return key_group, F.expr(instance_sql(sql, parallelism, max_parallelism, in_range=True))
