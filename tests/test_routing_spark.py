"""Spark's key group and instance expressions agree with the Python definitions on every row."""

from __future__ import annotations

import random

import pytest

from spark_state.errors import InvalidParallelismError, UnsupportedKeyError
from spark_state.keyspace import instance_for_key_group, key_group_for, key_groups_for_columns

pytestmark = pytest.mark.spark

N_ROWS = 3000
INT32_EXTREMES = [-(2**31), 2**31 - 1, 0, -1, 1]
INT64_EXTREMES = [-(2**63), 2**63 - 1, 0, -1, 1, 2**32, -(2**32) - 1]
ALPHABET = "az09-_ éüß日本語😀\u0000\u07ff\uffff"

KEY_SPECS = {
    "i": ["i"],
    "l": ["l"],
    "s": ["s"],
    "bin": ["bin"],
    "tiny": ["tiny"],
    "small": ["small"],
    "flag": ["flag"],
    "void": ["void"],
    "i_s": ["i", "s"],
    "l_bin_s": ["l", "bin", "s"],
    "s_void_flag_tiny": ["s", "void", "flag", "tiny"],
}
MAX_PARALLELISMS = [4096, 7, 32768]
INSTANCE_CASES = {4096: [1, 3, 200, 1000, 4095, 4096], 7: [1, 2, 3, 4, 5, 6, 7], 32768: [1000, 32767]}


def _maybe_null(rng: random.Random, value: object) -> object:
    return None if rng.random() < 0.1 else value


def _rows(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    rows = []
    for _ in range(N_ROWS):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.choice([0, 1, 2, 3, 4, 5, 11, 40, 70])))
        rows.append(
            (
                _maybe_null(
                    rng, rng.choice(INT32_EXTREMES) if rng.random() < 0.1 else rng.randint(-(2**31), 2**31 - 1)
                ),
                _maybe_null(
                    rng, rng.choice(INT64_EXTREMES) if rng.random() < 0.1 else rng.randint(-(2**63), 2**63 - 1)
                ),
                _maybe_null(rng, text),
                _maybe_null(rng, rng.randbytes(rng.choice([0, 1, 3, 4, 7, 66]))),
                _maybe_null(rng, rng.randint(-128, 127)),
                _maybe_null(rng, rng.randint(-(2**15), 2**15 - 1)),
                _maybe_null(rng, rng.random() < 0.5),
            )
        )
    return rows


@pytest.fixture(scope="module")
def keyed(spark):
    """(DataFrame, rows as dicts) with every key column type and about 10% nulls per column."""
    from pyspark.sql import functions as F

    schema = "id int, i int, l bigint, s string, bin binary, tiny tinyint, small smallint, flag boolean"
    rows = _rows(seed=20240611)
    df = spark.createDataFrame([(n, *row) for n, row in enumerate(rows)], schema).withColumn("void", F.lit(None))
    names = ["i", "l", "s", "bin", "tiny", "small", "flag"]
    return df, [dict(zip(names, row), void=None) for row in rows]


def test_key_groups_match_python(keyed):
    from spark_state.spark.routing import key_group_column

    df, rows = keyed
    groups = df.select(
        "id",
        *(
            key_group_column(df, cols, m).alias(f"{spec_name}_{m}")
            for m in MAX_PARALLELISMS
            for spec_name, cols in KEY_SPECS.items()
        ),
    ).toArrow()
    assert groups["id"].to_pylist() == list(range(len(rows)))
    for m in MAX_PARALLELISMS:
        for spec_name, cols in KEY_SPECS.items():
            expected = [key_group_for(tuple(row[c] for c in cols), m) for row in rows]
            assert groups[f"{spec_name}_{m}"].to_pylist() == expected, (spec_name, m)


@pytest.mark.parametrize("max_parallelism", list(INSTANCE_CASES))
def test_instances_match_python_for_every_key_group(spark, max_parallelism):
    from pyspark.sql import functions as F

    from spark_state.spark.routing import instance_column, instance_sql

    parallelisms = INSTANCE_CASES[max_parallelism]
    table = (
        spark.range(max_parallelism)
        .select(
            "id",
            *(instance_column("id", p, max_parallelism).alias(f"p{p}") for p in parallelisms),
            *(instance_column("id", p, max_parallelism, in_range=True).alias(f"unchecked{p}") for p in parallelisms),
            *(F.expr(instance_sql("id", p, max_parallelism)).alias(f"sql{p}") for p in parallelisms),
            *(
                F.expr(instance_sql("id", p, max_parallelism, in_range=True)).alias(f"sql_unchecked{p}")
                for p in parallelisms
            ),
        )
        .toArrow()
    )
    key_groups = table["id"].to_pylist()
    assert sorted(key_groups) == list(range(max_parallelism))
    for p in parallelisms:
        expected = [instance_for_key_group(g, p, max_parallelism) for g in key_groups]
        for name in (f"p{p}", f"unchecked{p}", f"sql{p}", f"sql_unchecked{p}"):
            assert table[name].to_pylist() == expected, name


def test_routing_columns_match_python(keyed):
    """``routing_columns`` (the keyed operator's routing, parsed from SQL text) gives every row the key group
    and the instance Python gives its key, for one key column and for several, a name needing quotes among them;
    a name cased otherwise than in the schema takes the Column path, as Spark resolves it."""
    from spark_state.spark.routing import routing_columns

    df, rows = keyed
    df = df.withColumnRenamed("s", "the `s`.col")
    in_rows = {"the `s`.col": "s", "L": "l"}
    for cols, m, p in (
        (["the `s`.col"], 1024, 3),
        (["l", "the `s`.col", "bin", "flag"], 4096, 7),
        (["L", "flag"], 1024, 5),
    ):
        key_group, instance = routing_columns(df, cols, p, m)
        table = df.select(key_group.alias("g"), instance.alias("i")).toArrow()
        python = [tuple(row[in_rows.get(c, c)] for c in cols) for row in rows]
        expected = [key_group_for(key, m) for key in python]
        assert table["g"].to_pylist() == expected, cols
        assert table["i"].to_pylist() == [instance_for_key_group(g, p, m) for g in expected], cols


def test_key_groups_match_vectorized_on_spark_arrow(keyed):
    from pyspark.sql import functions as F

    from spark_state.spark.routing import key_group_column

    df, _ = keyed
    cols = ["l", "s", "bin", "flag", "i"]
    table = df.select(*cols, key_group_column(df, [F.col(c) for c in cols], 4096).alias("g")).toArrow()
    vectorized = key_groups_for_columns([table[c] for c in cols], 4096)
    assert vectorized.tolist() == table["g"].to_pylist()


def test_unsupported_key_types_rejected(spark):
    from pyspark.sql import functions as F

    from spark_state.spark.routing import key_group_column

    df = spark.range(1).select(F.lit(1.5).alias("x"), F.lit("a").alias("s"), F.current_timestamp().alias("t"))
    with pytest.raises(UnsupportedKeyError, match="key column 1 has Spark type double"):
        key_group_column(df, ["s", "x"], 4096)
    with pytest.raises(UnsupportedKeyError, match="key column 0 has Spark type timestamp"):
        key_group_column(df, ["t"], 4096)
    with pytest.raises(UnsupportedKeyError, match="collation UTF8_LCASE"):
        key_group_column(df, [F.col("s").astype("string collate UTF8_LCASE")], 4096)
    with pytest.raises(UnsupportedKeyError, match="non-empty list"):
        key_group_column(df, "s", 4096)
    with pytest.raises(InvalidParallelismError, match="max_parallelism=0"):
        key_group_column(df, ["s"], 0)


def test_instance_column_validates(spark):
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    from spark_state.spark.routing import instance_column

    with pytest.raises(InvalidParallelismError, match="parallelism=11 is out of range"):
        instance_column("g", 11, 10)
    df = spark.createDataFrame([(3,), (None,)], "g int")
    assert [r[0] for r in df.select(instance_column("g", 3, 10)).collect()] == [0, None]
    with pytest.raises(PySparkException, match="key group out of range, need 0 <= key_group < 10: 10"):
        spark.range(1).select(instance_column(F.lit(10), 3, 10)).collect()
