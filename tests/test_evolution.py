"""State schema evolution (``spark_state.model.evolution``): the rules, the cast, and restores across schema changes. No Spark."""

from __future__ import annotations

import pyarrow as pa
import pytest

from spark_state.errors import ConfigError, IncompatibleSchemaError
from spark_state.executor.resident import ResidentState, restore_instance
from spark_state.keyspace import instance_for_key_group, key_group_for, key_group_range
from spark_state.model.evolution import default_of, plan_evolution, widens, with_default
from spark_state.model.schema import VALUE, KeyedSchema, StateVariable
from spark_state.model.timers import TIMERS
from spark_state.storage.memory import MemoryStorage
from spark_state.store.manifest import ComponentSpec, schema_fingerprint
from tests.stores import Store

M = 16
KEY = pa.field("user", pa.string())


def schema(*fields: pa.Field, timers: bool = False, keys=(KEY,)) -> KeyedSchema:
    value = StateVariable(VALUE, tuple(fields))
    return KeyedSchema(tuple(keys), (value, TIMERS) if timers else (value,))


V1 = schema(pa.field("count", pa.int32()), pa.field("label", pa.string()))
V2 = schema(
    pa.field("count", pa.int64()), pa.field("label", pa.large_string()), with_default(pa.field("total", pa.int64()), 7)
)
V3 = schema(pa.field("count", pa.int64()), with_default(pa.field("total", pa.int64()), 7))


# --------------------------------------------------------------------------- rules


@pytest.mark.parametrize(
    "old, new",
    [
        (pa.int8(), pa.int64()),
        (pa.int32(), pa.int64()),
        (pa.uint16(), pa.int32()),
        (pa.uint32(), pa.uint64()),
        (pa.float32(), pa.float64()),
        (pa.float16(), pa.float32()),
        (pa.string(), pa.large_string()),
        (pa.binary(), pa.large_binary()),
        (pa.decimal128(5, 2), pa.decimal128(9, 2)),
        (pa.list_(pa.int32()), pa.large_list(pa.int64())),
        (pa.int64(), pa.int64()),
    ],
)
def test_widenings(old, new):
    assert widens(old, new)


@pytest.mark.parametrize(
    "old, new",
    [
        (pa.int64(), pa.int32()),
        (pa.float64(), pa.float32()),
        (pa.large_string(), pa.string()),
        (pa.int32(), pa.float64()),
        (pa.int64(), pa.string()),
        (pa.uint64(), pa.int64()),
        (pa.int32(), pa.uint64()),
        (pa.decimal128(9, 2), pa.decimal128(9, 3)),
        (pa.large_list(pa.int64()), pa.list_(pa.int64())),
        (pa.string(), pa.binary()),
    ],
)
def test_narrowing_or_other_kinds_do_not_widen(old, new):
    assert not widens(old, new)


def test_allowed_changes_are_described():
    evolution = plan_evolution("c", V1, V2)
    assert evolution.changes == (
        "value.count widened from int32 to int64",
        "value.label widened from string to large_string",
        "value.total added (default 7 for stored keys)",
    )
    assert plan_evolution("c", V2, V3).changes == ("value.label removed",)
    with_timers = plan_evolution("c", V3, schema(*V3.value.fields, timers=True))
    assert with_timers.changes == ("state variable 'timers' added (null for stored keys)",)
    assert plan_evolution("c", schema(*V3.value.fields, timers=True), V3).changes == (
        "state variable 'timers' removed",
    )
    nullable = plan_evolution("c", schema(pa.field("n", pa.int64(), nullable=False)), schema(pa.field("n", pa.int64())))
    assert nullable.changes == ()


@pytest.mark.parametrize(
    "new, column, old_type, new_type, why",
    [
        (
            schema(pa.field("count", pa.int16()), pa.field("label", pa.string())),
            "value.count",
            "int32",
            "int16",
            "only widening",
        ),
        (
            schema(pa.field("count", pa.string()), pa.field("label", pa.string())),
            "value.count",
            "int32",
            "string",
            "changes the kind",
        ),
        (
            schema(
                pa.field("count", pa.int32()), pa.field("label", pa.string()), pa.field("n", pa.int64(), nullable=False)
            ),
            "value.n",
            None,
            "int64",
            "needs a declared default",
        ),
        (
            schema(pa.field("count", pa.int32(), nullable=False), pa.field("label", pa.string())),
            "value.count",
            "int32",
            "int32",
            "now non-nullable",
        ),
        (
            schema(*V1.value.fields, keys=(pa.field("user", pa.large_string()),)),
            "user",
            "string",
            "large_string",
            "key columns never change",
        ),
        (
            schema(*V1.value.fields, keys=(pa.field("id", pa.string()),)),
            "user",
            "string",
            None,
            "key columns never change",
        ),
        (
            schema(*V1.value.fields, keys=(KEY, pa.field("region", pa.string()))),
            "region",
            None,
            "string",
            "key columns never change",
        ),
    ],
)
def test_refusals_name_the_column_the_types_and_what_to_do(new, column, old_type, new_type, why):
    with pytest.raises(IncompatibleSchemaError, match=why) as info:
        plan_evolution("clicks", V1, new)
    error = info.value
    assert (error.component, error.column, error.old_type, error.new_type) == ("clicks", column, old_type, new_type)
    assert f"state column {column!r}" in str(error) and "from a savepoint" in str(error)
    assert "new component name" in str(error)


def test_defaults_are_checked_against_their_type():
    assert default_of(with_default(pa.field("x", pa.string()), "n/a")) == (True, "n/a")
    assert default_of(pa.field("x", pa.string())) == (False, None)
    with pytest.raises(ConfigError, match="default 'abc' of state column 'x' does not fit its type int64"):
        with_default(pa.field("x", pa.int64()), "abc")


def test_conform_casts_fills_defaults_and_keeps_tombstones_and_missing_values():
    rows = V1.rows_to_columns([("a",), ("b",), ("c",)], [[(1, "x"), None, None]], [False, False, True])
    out = plan_evolution("c", V1, V2).conform(rows.to_batches()[0])
    assert out.schema.equals(V2.blob_schema)
    keys, values, deleted = V2.columns_to_rows(out)
    assert keys == [("a",), ("b",), ("c",)]
    assert values == [[(1, "x", 7), None, None]]
    assert deleted == [False, False, True]
    timers = schema(*V3.value.fields, timers=True)
    out = plan_evolution("c", V1, timers).conform(rows.to_batches()[0])
    assert timers.columns_to_rows(out)[1] == [[(1, 7), None, None], [None, None, None]]


# --------------------------------------------------------------------------- restores across three schemas


class Job:
    """Instances of one component in ``schema`` at ``parallelism``, checkpointing into ``store``; a dict model."""

    def __init__(self, store: Store, schema_: KeyedSchema, parallelism: int):
        self.store, self.schema, self.p = store, schema_, parallelism
        self.instances = [ResidentState(schema_, key_group_range(i, parallelism, M)) for i in range(parallelism)]

    def restart(self, schema_: KeyedSchema, parallelism: int) -> None:
        component = self.store.latest().components["c"]
        self.schema, self.p = schema_, parallelism
        self.instances = [
            restore_instance(self.store.blobs, component, schema_, i, parallelism, M)[0] for i in range(parallelism)
        ]

    def put(self, user: str, value: tuple) -> None:
        g = key_group_for(user, M)
        self.instances[instance_for_key_group(g, self.p, M)].table.put(g, (user,), value)

    def checkpoint(self, checkpoint_id: int):
        refs = [
            s.checkpoint(self.store.blobs, "c", checkpoint_id, i, max_chain_length=3)[0]
            for i, s in enumerate(self.instances)
        ]
        spec = ComponentSpec("c", M, self.p, self.schema)
        manifest = self.store.commit(checkpoint_id, {"c": (spec, [r for r in refs if r is not None])}, {})
        self.store.cleanup(manifest)
        return manifest

    def state(self) -> dict[str, tuple]:
        return {key[0]: value for s in self.instances for _, key, value in s.table.items()}


def restored(store: Store, schema_: KeyedSchema, parallelism: int) -> dict[str, tuple]:
    component = store.latest().components["c"]
    result = {}
    for i in range(parallelism):
        state, _ = restore_instance(store.blobs, component, schema_, i, parallelism, M)
        result.update({key[0]: value for _, key, value in state.table.items()})
    return result


def test_add_widen_then_drop_across_restarts_with_rescales():
    store = Store(MemoryStorage(), retained=2)
    users = [f"u{i}" for i in range(200)]
    job = Job(store, V1, 2)
    for i, user in enumerate(users):
        job.put(user, (i, f"l{i}"))
    job.checkpoint(1)
    for i, user in enumerate(users[:40]):
        job.put(user, (i + 1000, f"m{i}"))
    job.checkpoint(2)
    v1 = job.state()

    # add a column with a default and widen two types; restart at parallelism 3
    job.restart(V2, 3)
    expected = {u: (c, label, 7) for u, (c, label) in v1.items()}
    assert job.state() == expected == restored(store, V2, 5)
    for i, user in enumerate(users[:10]):  # a few key groups get delta entries in V2 over V1 full entries
        job.put(user, (i + 2**40, "big", i))
        expected[user] = (i + 2**40, "big", i)
    manifest = job.checkpoint(3)
    component = manifest.components["c"]
    assert schema_fingerprint(V1.serialize()) in component.schemas and component.schema == V2.serialize()
    old = [ref for ref in component.blobs.values() if ref.schema is not None]
    assert old and {ref.checkpoint_id for ref in old} <= {1, 2}
    assert Store(store.storage).load(3) == manifest  # a fresh reader derives the same per-blob schemas
    assert restored(store, V2, 1) == expected

    # drop a column; restart at parallelism 1
    job.restart(V3, 1)
    expected = {u: (c, total) for u, (c, _, total) in expected.items()}
    assert job.state() == expected == restored(store, V3, 4)
    for user in users:  # every key changes: full entries everywhere, no blob of an older schema left
        job.put(user, (expected[user][0] + 1, expected[user][1]))
        expected[user] = (expected[user][0] + 1, expected[user][1])
    component = job.checkpoint(4).components["c"]
    assert component.schemas == {} and all(ref.schema is None for ref in component.blobs.values())
    assert restored(store, V3, 2) == expected
    assert Store(store.storage).load(4) == store.latest()


def test_a_narrowing_restart_is_refused_before_reading():
    store = Store(MemoryStorage())
    job = Job(store, V2, 2)
    job.put("a", (1, "x", 2))
    job.checkpoint(1)
    narrowed = schema(
        pa.field("count", pa.int32()), pa.field("label", pa.large_string()), pa.field("total", pa.int64())
    )
    with pytest.raises(IncompatibleSchemaError, match="'value.count' cannot change from int64 to int32") as info:
        restore_instance(store.blobs, store.latest().components["c"], narrowed, 0, 2, M)
    assert info.value.column == "value.count"
    with pytest.raises(IncompatibleSchemaError):
        store.commit(2, {"c": (ComponentSpec("c", M, 2, narrowed), [])}, {})
