"""Bad input, refused where it is made with our typed error, or handled exactly: one table, one verdict per case.

Each case is what a careless user might pass (an argument, a setting, a value a function stores or returns, a CLI
argument) and the verdict: the typed error of ours it must raise (class and a phrase of its message, which says
what to do), or the exact result. **A case a user reports is one more row of the table that fits it.**
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from click.testing import CliRunner

from spark_state.driver.conf import StateConf
from spark_state.errors import (
    ConfigError,
    SparkStateError,
    UnsupportedKeyError,
)
from spark_state.executor.functions import KeyState, TimeToLive, _to_output_table, _value_converter
from spark_state.model.eventtime import timestamp_millis
from spark_state.model.schema import KeyedSchema
from spark_state.model.timers import KeyTimersHandle
from spark_state.store.manifest import check_component_name


@dataclass(frozen=True)
class Refused:
    """The verdict: our typed ``error`` whose message holds ``says``."""

    error: type[SparkStateError]
    says: str


def _verdict(call: Callable[[], Any], expected: Refused | Any) -> None:
    if isinstance(expected, Refused):
        with pytest.raises(expected.error, match=expected.says):
            call()
    else:
        assert call() == expected


LONG_STATE = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("total", pa.int64())])
OUTPUT = pa.schema([("key", pa.string()), ("total", pa.int64())])


def _update(value: Any) -> tuple | None:
    state = KeyState(None, ("total",), convert=_value_converter(LONG_STATE))
    state.update(value)
    return state.get()


def _register(time: Any) -> list:
    timers = KeyTimersHandle(None, event_time=True)
    timers.register(time)
    return [t.time_ms for t in timers.list()]


def _conf(**settings: str) -> StateConf:
    return StateConf.from_mapping(
        {f"spark.state.{k}": v for k, v in settings.items()}, default_store="/unused", default_parallelism=2
    )


PURE = {
    # values a function stores: exactly, or refused at update (not at the checkpoint)
    "state float into long": (lambda: _update((2.5,)), Refused(ConfigError, "'total' is int64, and 2.5")),
    "state whole float into long": (lambda: _update((3.0,)), (3,)),
    "state string into long": (lambda: _update(("abc",)), Refused(ConfigError, "'abc' \\(str\\)")),
    "state bool into long": (lambda: _update((True,)), Refused(ConfigError, "True \\(bool\\)")),
    "state beyond int64": (lambda: _update((2**70,)), Refused(ConfigError, "outside its range")),
    "state too few values": (lambda: _update(()), Refused(ConfigError, "has 0 values")),
    "state missing dict column": (lambda: _update({"totl": 1}), Refused(ConfigError, "missing value column")),
    "state pandas NA": (lambda: _update((pd.NA,)), (None,)),
    # rows a function returns
    "output float into long": (
        lambda: _to_output_table([{"key": "a", "total": 2.5}], OUTPUT),
        Refused(ConfigError, "not a whole number"),
    ),
    "output misspelled column": (
        lambda: _to_output_table([{"key": "a", "totl": 2}], OUTPUT),
        Refused(ConfigError, "\\['totl'\\] that the output schema does not have"),
    ),
    "output frame with an extra column": (
        lambda: _to_output_table(pd.DataFrame({"key": ["a"], "total": [1], "x": [0]}), OUTPUT),
        Refused(ConfigError, "\\['x'\\]"),
    ),
    "output frame float into long": (
        lambda: _to_output_table(pd.DataFrame({"key": ["a"], "total": [1.5]}), OUTPUT),
        Refused(ConfigError, "do not fit the output schema"),
    ),
    "output int key into string": (
        lambda: _to_output_table([{"key": 1, "total": 2}], OUTPUT),
        Refused(ConfigError, "'key' is string, and 1"),
    ),
    "output not rows": (lambda: _to_output_table(42, OUTPUT), Refused(ConfigError, "returned int")),
    "output a missing value is null": (
        lambda: _to_output_table([{"key": "a"}], OUTPUT).to_pylist(),
        [{"key": "a", "total": None}],
    ),
    # timers
    "timer NaT": (lambda: _register(pd.NaT), Refused(ConfigError, "NaT is not a time")),
    "timer beyond int64": (lambda: _register(2**70), Refused(ConfigError, "outside the times a timer can hold")),
    "timer a string": (lambda: _register("soon"), Refused(ConfigError, "'soon' is not a time")),
    "timer bool": (lambda: timestamp_millis(True, "t"), Refused(ConfigError, "True is not a time")),
    "timer a timestamp": (lambda: _register(pd.Timestamp("2024-01-01")), [1704067200000]),
    # time to live and names
    "ttl zero": (lambda: TimeToLive(0), Refused(ConfigError, "longer than zero")),
    "ttl of an unknown kind": (lambda: TimeToLive(1000, "wall"), Refused(ConfigError, "ttl_kind='wall'")),
    "component name too long": (lambda: check_component_name("c" * 10_000), Refused(ConfigError, "at most 200")),
    "component name with a slash": (lambda: check_component_name("a/b"), Refused(ConfigError, "without '/'")),
    # settings
    "parallelism zero": (lambda: _conf(parallelism="0"), Refused(ConfigError, "out of range")),
    "parallelism a word": (lambda: _conf(parallelism="four"), Refused(ConfigError, "is not an integer")),
    "parallelism above the key space": (
        lambda: _conf(parallelism="2000", maxParallelism="1024").key_space(None),
        Refused(ConfigError, "between 1 and spark.state.maxParallelism=1024"),
    ),
    "parallelism above the store's key space": (
        lambda: _conf(parallelism="2000").key_space(1024),
        Refused(ConfigError, "the key space of the store, 1024"),
    ),
    "a setting misspelled": (
        lambda: StateConf.from_mapping({"spark.state.paralelism": "2"}, default_store="/x", default_parallelism=2),
        Refused(ConfigError, "did you mean spark.state.parallelism"),
    ),
    "a retention of one": (lambda: _conf(checkpointsRetained="1"), Refused(ConfigError, "out of range")),
    "a compression codec unknown": (lambda: _conf(compression="gzip"), Refused(ConfigError, "gzip")),
    "a resident memory in words": (lambda: _conf(residentMemory="lots"), Refused(ConfigError, "residentMemory")),
    "a flag not a bool": (lambda: _conf(instanceHosts="yes"), Refused(ConfigError, "is not true or false")),
}


@pytest.mark.parametrize("case", list(PURE))
def test_a_bad_value_is_refused_typed_where_it_is_given_or_taken_exactly(case):
    _verdict(*PURE[case])


def _store(tmp_path: Path) -> str:
    """A store with one committed checkpoint (a count of two keys), written without Spark."""
    from spark_state.executor.aggregates import Aggregate
    from spark_state.executor.columns import KEY_GROUP_COLUMN
    from spark_state.executor.resident import ResidentState
    from spark_state.keyspace import key_group_range, key_groups_for_columns
    from spark_state.storage import open_storage
    from spark_state.store.manifest import ComponentSpec, QueryBinding
    from tests.stores import Store

    count = Aggregate("count", None, "count")
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], count.state_fields())
    state = ResidentState(schema, key_group_range(0, 1, 8))
    keys = pa.array(["a", "b"])
    rows = pa.table({KEY_GROUP_COLUMN: pa.array(key_groups_for_columns([keys], 8).astype("int32")), "key": keys})
    count.apply(state.table, rows, ("key",))
    store = Store(open_storage(str(tmp_path / "store")))
    blob, _ = state.checkpoint(store.blobs, "c", 1, 0)
    binding = QueryBinding("q-1", "0f1e2d3c-0000-4000-8000-0000000000aa", 0, str(tmp_path / "chk"), {})
    store.commit(1, {"c": (ComponentSpec("c", 8, 1, schema), [blob])}, {}, binding=binding)
    return str(tmp_path / "store")


CLI = {
    # (arguments, with "{store}" for a real store and "{file}" for a regular file; exit code; a phrase of the output)
    "verify of no store": (["verify", "{missing}"], 1, "holds no spark-state store"),
    "checkpoints of a file": (["checkpoints", "{file}"], 1, "holds no spark-state store"),
    "describe of no store": (["describe", "{missing}"], 1, "holds no spark-state store"),
    "drain of no store": (["drain", "{missing}", "0f1e2d3c-0000-4000-8000-0000000000aa"], 1, "holds no"),
    "drain of a run never seen": (["drain", "{store}", "0f1e2d3c-0000-4000-8000-0000000000bb"], 1, "--force"),
    "drain of a run seen": (["drain", "{store}", "0f1e2d3c-0000-4000-8000-0000000000aa"], 0, "requested a drain"),
    "show with a negative limit": (["show", "{store}", "c", "--limit", "-1"], 2, "-1 is not in the range"),
    "show into a missing directory": (["show", "{store}", "c", "-o", "{missing}/x.parquet"], 2, "does not exist"),
    "show into an unknown format": (["show", "{store}", "c", "-o", "{dir}/x.txt"], 2, "use a .parquet or .csv"),
    "show of a missing component": (["show", "{store}", "nope"], 1, "nope"),
    "savepoint of a word checkpoint": (["savepoint", "create", "{store}", "sp", "-c", "abc"], 2, "a checkpoint id"),
    "savepoint of a checkpoint not kept": (["savepoint", "create", "{store}", "sp", "-c", "99"], 1, "not retained"),
    "verify of a store": (["verify", "{store}"], 0, "OK"),
}


@pytest.mark.parametrize("case", list(CLI))
def test_the_cli_refuses_a_mistake_in_one_line_without_a_traceback(case, tmp_path):
    from spark_state.ops.cli import cli

    arguments, code, phrase = CLI[case]
    (tmp_path / "a-file").write_text("not a store")
    places = {
        "{store}": _store(tmp_path),
        "{missing}": str(tmp_path / "no-such-store"),
        "{file}": str(tmp_path / "a-file"),
        "{dir}": str(tmp_path),
    }
    words = []
    for word in arguments:
        for name, value in places.items():
            word = word.replace(name, value)
        words.append(word)
    result = CliRunner().invoke(cli, words)
    assert result.exit_code == code, result.output
    assert phrase in result.output, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception  # none escaped
    assert not (tmp_path / "no-such-store").exists()  # nothing is created where no store was


def _stream(spark):
    return (
        spark.readStream.format("rate")
        .load()
        .selectExpr(
            "cast(value % 5 as string) as key",
            "value",
            "timestamp",
            "map('a', value) as m",
            "array(value) as a",
            "cast(value as double) as d",
        )
    )


SPARK = {
    "key column missing": (lambda s: _keyed(s, "nope"), Refused(ConfigError, "not in the DataFrame")),
    "a map key": (lambda s: _keyed(s, "m"), Refused(UnsupportedKeyError, "'m' has Spark type map")),
    "an array key": (lambda s: _keyed(s, "a"), Refused(UnsupportedKeyError, "'a' has Spark type array")),
    "a double key": (lambda s: _keyed(s, "d"), Refused(UnsupportedKeyError, "'d' has Spark type double")),
    "a timestamp key": (lambda s: _keyed(s, "timestamp"), Refused(UnsupportedKeyError, "'timestamp'")),
    "a long component name": (lambda s: _keyed(s, "key", name="c" * 10_000), Refused(ConfigError, "at most 200")),
    "count named like a key": (lambda s: _keyed(s, "key").count(output="key"), Refused(ConfigError, "of its own")),
    "sum of a string": (lambda s: _keyed(s, "key").sum("key"), Refused(ConfigError, "needs a numeric column")),
    "sum of a missing column": (lambda s: _keyed(s, "key").sum("nope"), Refused(ConfigError, "no such column")),
    "an unknown aggregate": (lambda s: _keyed(s, "key").aggregate("median", "value"), Refused(ConfigError, "median")),
    "a state schema that does not parse": (
        lambda s: _keyed(s, "key").apply(lambda k, r, st: None, state_schema="total lng,", output_schema="k string"),
        Refused(ConfigError, "does not parse"),
    ),
    "an output schema that does not parse": (
        lambda s: _keyed(s, "key").apply(lambda k, r, st: None, state_schema="total long", output_schema="((("),
        Refused(ConfigError, "does not parse"),
    ),
    "a ttl of zero": (
        lambda s: _keyed(s, "key").apply(
            lambda k, r, st: None, state_schema="t long", output_schema="k string", ttl="0 seconds"
        ),
        Refused(ConfigError, "longer than zero"),
    ),
    "a watermark on a missing column": (
        lambda s: _keyed(s, "key").withWatermark("nope", "1 minute"),
        Refused(ConfigError, "no such column"),
    ),
    "a watermark delay that is no duration": (
        lambda s: _keyed(s, "key").withWatermark("timestamp", "soon"),
        Refused(ConfigError, "is not a duration"),
    ),
    "a session gap of zero": (
        lambda s: _keyed(s, "key").withWatermark("timestamp", "1 minute").session_window("0 seconds"),
        Refused(ConfigError, "longer than zero"),
    ),
}


def _keyed(spark, column: str, name: str = "c"):
    from spark_state import keyed

    return keyed(_stream(spark), column, name=name)


@pytest.mark.spark
@pytest.mark.parametrize("case", list(SPARK))
def test_a_bad_argument_to_the_api_is_refused_at_the_call(spark, case):
    call, expected = SPARK[case]
    _verdict(lambda: call(spark), expected)


@pytest.mark.spark
def test_a_parallelism_beyond_the_store_s_key_space_is_refused_at_set_parallelism(spark, tmp_path):
    """After a new store's first batch the key space is the store's (1024 at parallelism 2), not the largest one:
    set_parallelism(2000) must refuse at once, not let the next batch fail and stop the query."""
    import datasources
    from spark_state import keyed

    datasources.register(spark)
    spark.range(200).selectExpr("cast(id % 20 as string) as key").write.format("replayable").mode("append").option(
        "keyColumn", "key"
    ).save(str(tmp_path / "events"))
    spark.conf.set("spark.state.parallelism", "2")
    try:
        events = spark.readStream.format("replayable").option("path", str(tmp_path / "events")).load()
        seen: list = []
        query = (
            keyed(events, "key", name="c")
            .count()
            .writeStream.foreachBatch(lambda df, b: seen.append(df.count()))
            .option("checkpointLocation", str(tmp_path / "chk"))
            .start()
        )
        try:
            assert query.await_batches(1, timeout=120)
            for parallelism, says in [(2000, "the key space of the store, 1024"), (0, "between 1 and")]:
                with pytest.raises(ConfigError, match=says):
                    query.set_parallelism(parallelism)
            query.set_parallelism(3)  # within the store's key space: taken
            assert query.isActive and query.exception() is None
        finally:
            query.stop()
    finally:
        spark.conf.unset("spark.state.parallelism")
    assert seen == [20]


def test_describe_of_a_watermark_past_the_calendar_says_so_instead_of_failing():
    from spark_state.ops.inspect import iso

    assert "past the years a calendar date can name" in iso(1_700_000_000_000_000 / 1000)
    assert iso(1_700_000_000) == "2023-11-14T22:13:20+00:00"
    assert json.dumps(iso(None)) == "null"
