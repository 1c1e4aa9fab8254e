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
