"""The driver's per-batch Spark calls that can be checked without a Spark session."""

from __future__ import annotations

import pyarrow as pa

from spark_state.microbatch import task_output_schema
from spark_state.operator import META_COLUMN


def test_task_output_columns_are_nullable_even_when_the_input_declares_them_not_null():
    output = pa.schema([pa.field("key", pa.string()), pa.field("split", pa.int32(), nullable=False),
                        pa.field("offset", pa.int64(), nullable=False)])
    schema = task_output_schema(output)
    assert [f.name for f in schema.fields] == ["key", "split", "offset", META_COLUMN]
    assert all(f.nullable for f in schema.fields)


def test_a_memory_bound_on_a_component_with_timers_is_reported_once_not_ignored_silently(caplog):
    from types import SimpleNamespace

    from spark_state.conf import StateConf
    from spark_state.microbatch import MicroBatch
    from spark_state.schema import KeyedSchema
    from spark_state.timers import TIMERS

    value = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])
    timed = KeyedSchema(value.keys, (value.value, TIMERS))
    bounded = StateConf.from_mapping({"spark.state.residentMemory": "64m"}, default_store="/s", default_parallelism=2)
    for schema, expected in ((value, 0), (timed, 1)):
        stream = SimpleNamespace(schema=schema, keyed=SimpleNamespace(name="sessions"))
        batch = MicroBatch(stream, None, "/chk", None, None)
        with caplog.at_level("WARNING", logger="spark_state.microbatch"):
            caplog.clear()
            for _ in range(3):
                batch._warn_if_unbounded(bounded)
        assert [r.getMessage() for r in caplog.records if "residentMemory" in r.getMessage()] == (
            ["spark.state.residentMemory does not bound component 'sessions': it has timers or a time to live, and "
             "its state stays in memory whole; its batch reports say bounded=false"] * expected)
