"""The state schema of a component: key columns and named state variables (``spark_state.model.schema``)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import ConfigError, CorruptBlobError
from spark_state.model.schema import DELETED_COLUMN, KeyedSchema, StateVariable

KEYS = (pa.field("tenant", pa.string()), pa.field("user", pa.int32()))
VALUE = StateVariable("value", (pa.field("note", pa.string()), pa.field("history", pa.list_(pa.int64()))))
TIMERS = StateVariable("timers", (pa.field("at", pa.list_(pa.int64())),))
TWO = KeyedSchema(KEYS, (VALUE, TIMERS))


def test_the_blob_schema_has_keys_then_one_struct_per_variable_then_a_non_null_deleted_column():
    schema = TWO.blob_schema
    assert schema.names == ["tenant", "user", "_spark_state_value", "_spark_state_timers", DELETED_COLUMN]
    assert schema.field("_spark_state_value").type == pa.struct(list(VALUE.fields))
    assert schema.field(DELETED_COLUMN).type == pa.bool_() and not schema.field(DELETED_COLUMN).nullable
    assert schema.metadata is None


def test_a_key_column_may_be_called_like_a_variable():
    schema = KeyedSchema.of_values([pa.field("value", pa.string())], [pa.field("count", pa.int64())])
    assert schema.blob_schema.names == ["value", "_spark_state_value", DELETED_COLUMN]


@pytest.mark.parametrize("name", [DELETED_COLUMN, "_spark_state_value", "_spark_state", ""])
def test_reserved_names_are_refused(name):
    with pytest.raises(ConfigError, match="reserved name"):
        KeyedSchema.of_values([pa.field(name, pa.int64())], [pa.field("v", pa.int64())])
    with pytest.raises(ConfigError, match="reserved name"):
        KeyedSchema.of_values([pa.field("k", pa.int64())], [pa.field(name, pa.int64())])


@pytest.mark.parametrize("where", ["key", "value"])
def test_dictionary_types_are_refused(where):
    dictionary = pa.field("d", pa.dictionary(pa.int32(), pa.string()))
    keys, values = (
        ([dictionary], [pa.field("v", pa.int64())]) if where == "key" else ([pa.field("k", pa.int64())], [dictionary])
    )
    with pytest.raises(ConfigError, match="'d' is dictionary-encoded"):
        KeyedSchema.of_values(keys, values)


def test_variables_start_with_value_and_are_unique():
    with pytest.raises(ConfigError, match="must start with 'value'"):
        KeyedSchema(KEYS, (TIMERS,))
    with pytest.raises(ConfigError, match="must start with 'value'"):
        KeyedSchema(KEYS, (VALUE, VALUE))
    with pytest.raises(ConfigError, match="at least one key column"):
        KeyedSchema((), (VALUE,))
    with pytest.raises(ConfigError, match="repeats a column"):
        StateVariable("x", (pa.field("a", pa.int64()), pa.field("a", pa.int64())))


def test_serialization_roundtrips_and_damage_is_typed():
    text = TWO.serialize()
    assert text.isascii()
    assert KeyedSchema.deserialize(text, TWO.key_columns) == TWO
    with pytest.raises(CorruptBlobError, match="does not start with the key columns"):
        KeyedSchema.deserialize(text, ("user",))
    with pytest.raises(CorruptBlobError, match="does not decode"):
        KeyedSchema.deserialize("bm90IGEgc2NoZW1h", TWO.key_columns)


values = st.one_of(
    st.none(), st.tuples(st.text(max_size=4) | st.none(), st.lists(st.integers(-5, 5), max_size=3) | st.none())
)
timers = st.one_of(st.none(), st.tuples(st.lists(st.integers(0, 10**12), max_size=3)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=3), st.integers(-(2**31), 2**31 - 1), values, timers), max_size=20))
def test_rows_and_columns_convert_both_ways(rows):
    keys = [(tenant, user) for tenant, user, _, _ in rows]
    per_variable = [[v for _, _, v, _ in rows], [t for _, _, _, t in rows]]
    deleted = [v is None and t is None for _, _, v, t in rows]
    table = TWO.rows_to_columns(keys, per_variable, deleted)
    assert table.schema == TWO.blob_schema
    for batch in table.combine_chunks().to_batches():
        assert TWO.columns_to_rows(batch) == (keys, per_variable, deleted)
