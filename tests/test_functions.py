"""Built-in aggregates (a table of definitions) and user functions over a key-group table (no Spark)."""

from __future__ import annotations

import math
from collections import defaultdict

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import ConfigError
from spark_state.executor.aggregates import AGGREGATES, Aggregate
from spark_state.executor.columns import KEY_GROUP_COLUMN
from spark_state.executor.functions import BatchTime, PythonFunction
from spark_state.executor.resident import ResidentState
from spark_state.executor.table import KeyGroupTable
from spark_state.keyspace import KeyGroupRange, key_group_for
from spark_state.model.schema import KeyedSchema
from spark_state.model.timers import minima

M = 8
KEY = pa.field("key", pa.string())
TIME = BatchTime(None, 1_700_000_000_000)


PART = pa.field("part", pa.int64())


def _rows(pairs: list[tuple[str, object]], kind: pa.DataType, *, two_keys: bool = False) -> pa.Table:
    """The rows, keyed by ``key`` (with ``two_keys``, by ``key`` and ``part``, a function of ``key``)."""
    keys = [k for k, _ in pairs]
    parts = [len(k) % 2 for k in keys]
    groups = [key_group_for((k, p) if two_keys else k, M) for k, p in zip(keys, parts)]
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            **({"part": pa.array(parts, pa.int64())} if two_keys else {}),
            "x": pa.array([v for _, v in pairs], kind),
            KEY_GROUP_COLUMN: pa.array(groups, pa.int32()),
        }
    )


def _run(
    aggregate: Aggregate, batches: list[list[tuple[str, object]]], kind: pa.DataType, *, two_keys: bool = False
) -> list[dict]:
    key_fields = [KEY, PART] if two_keys else [KEY]
    table = KeyGroupTable(KeyedSchema.of_values(key_fields, aggregate.state_fields()), KeyGroupRange(0, M - 1))
    assert table.bare != two_keys  # one key column: the dicts hold bare keys; two: tuples
    outputs = []
    for pairs in batches:
        result = aggregate.apply(table, _rows(pairs, kind, two_keys=two_keys), tuple(f.name for f in key_fields))
        assert result.schema.field(aggregate.output_name).type == aggregate.output_type()
        outputs.append(dict(zip(result.column("key").to_pylist(), result.column(aggregate.output_name).to_pylist())))
    return outputs


def _model(kind: str, batches: list[list[tuple[str, object]]]) -> list[dict]:
    """The running aggregates, computed plainly from all rows seen so far."""
    seen: dict[str, list] = defaultdict(list)
    outputs = []
    for pairs in batches:
        for key, value in pairs:
            seen[key].append(value)
        result = {}
        for key in {k for k, _ in pairs}:
            values = [v for v in seen[key] if v is not None]
            result[key] = {
                "count": len(seen[key]),
                "sum": sum(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "mean": sum(values) / len(values) if values else None,
            }[kind]
        outputs.append(result)
    return outputs


batches = st.lists(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d", "é", ""]), st.integers(-100, 100) | st.none()), max_size=12
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(batches=batches, kind=st.sampled_from(sorted(AGGREGATES)), two_keys=st.booleans(), floating=st.booleans())
def test_every_builtin_equals_the_running_aggregate_over_all_rows(batches, kind, two_keys, floating):
    input_type = pa.float64() if floating else pa.int64()
    if floating:
        batches = [[(k, None if v is None else v / 4) for k, v in pairs] for pairs in batches]
    aggregate = Aggregate(kind, None if kind == "count" else "x", "out", None if kind == "count" else input_type)
    got = _run(aggregate, batches, input_type, two_keys=two_keys)
    for have, want in zip(got, _model(kind, batches)):
        assert have.keys() == want.keys()
        for key in want:
            if isinstance(want[key], float):
                assert math.isclose(have[key], want[key])
            else:
                assert have[key] == want[key]


def test_min_and_max_keep_strings_and_the_input_type():
    batches = [[("a", "pear"), ("a", "apple")], [("a", "zebra"), ("b", None)]]
    assert _run(Aggregate("min", "x", "lo", pa.string()), batches, pa.string()) == [
        {"a": "apple"},
        {"a": "apple", "b": None},
    ]
    assert _run(Aggregate("max", "x", "hi", pa.string()), batches, pa.string())[1] == {"a": "zebra", "b": None}


def test_mean_state_is_a_sum_and_a_count():
    aggregate = Aggregate("mean", "x", "mean_x", pa.int64())
    assert [f.name for f in aggregate.state_fields()] == ["mean_x_sum", "mean_x_count"]
    assert aggregate.output_type() == pa.float64()


@pytest.mark.parametrize(
    "kind, column, input_type, match",
    [
        ("sum", "x", pa.string(), "needs a numeric column"),
        ("mean", "x", pa.bool_(), "needs a numeric column"),
        ("min", "x", pa.list_(pa.int64()), "numeric, string, date or timestamp"),
        ("median", "x", pa.int64(), "unknown aggregate 'median'"),
        ("sum", None, None, "needs a column"),
    ],
)
def test_bad_aggregates_are_refused_naming_the_column(kind, column, input_type, match):
    with pytest.raises(ConfigError, match=match):
        Aggregate(kind, column, "out", input_type)


def test_a_user_function_sees_each_keys_rows_and_state_once_per_batch():
    schema = KeyedSchema.of_values([KEY], [pa.field("total", pa.int64())])
    state = ResidentState(schema, KeyGroupRange(0, M - 1))
    table, items = state.table, state.items
    calls = []

    def fn(key, rows, state):
        calls.append((key, list(rows["x"])))
        total = (state.get()[0] if state.exists else 0) + int(rows["x"].sum())
        if total > 10:
            state.remove()
        else:
            state.update({"total": total})
        state.instance_items.append(key[0])
        return [{"key": key[0], "total": total}]

    function = PythonFunction(fn)
    out = pa.schema([KEY, pa.field("total", pa.int64())])
    rows = _rows([("a", 1), ("b", 7), ("a", 2)], pa.int64())
    first = function.apply(state, rows, ("key",), ("total",), ["key", "x"], out, TIME, False)
    assert sorted(first.to_pylist(), key=lambda r: r["key"]) == [{"key": "a", "total": 3}, {"key": "b", "total": 7}]
    assert sorted(calls) == [(("a",), [1, 2]), (("b",), [7])]
    function.apply(state, _rows([("b", 5)], pa.int64()), ("key",), ("total",), ["key", "x"], out, TIME, False)
    assert table.get(key_group_for("b", M), ("b",)) is None  # removed when it passed 10
    assert table.get(key_group_for("a", M), ("a",)) == (3,)
    assert sorted(items) == ["a", "b", "b"]


def test_a_value_that_expired_stays_expired_through_its_keys_timers():
    """Two timers of a key fire after its value's time to live ran out: both see no value, and it is gone after."""
    from spark_state.executor.functions import TimeToLive
    from spark_state.model.schema import VALUE, StateVariable
    from spark_state.model.timers import TIMERS

    schema = KeyedSchema((KEY,), (StateVariable(VALUE, (pa.field("n", pa.int64()),)), TIMERS))
    state = ResidentState(schema, KeyGroupRange(0, M - 1))
    seen = []

    def fn(key, rows, state):
        state.update((len(rows),))
        state.timers.register(1_000, "processing")
        state.timers.register(2_000, "processing")

    def on_timer(key, timer, state):
        seen.append((timer.time_ms, state.get()))

    function = PythonFunction(fn, on_timer=on_timer, ttl=TimeToLive(500, "processing"))
    out = pa.schema([KEY])
    function.apply(state, _rows([("a", 1)], pa.int64()), ("key",), ("n",), ["key", "x"], out, BatchTime(None, 0), False)
    late = BatchTime(None, 5_000)  # the value expired at 500; both timers are due
    function.fire(state, ("n",), out, late, False)
    assert seen == [(1_000, None), (2_000, None)]
    assert state.table.get(key_group_for("a", M), ("a",)) is None
    function.expire(state, late)
    assert state.table.get(key_group_for("a", M), ("a",)) is None


def _entries(entries) -> list[tuple[int, str, list]]:
    return [(g, kind, sorted(map(str, batch.to_pylist()))) for g, kind, batch in entries]


@settings(max_examples=60, deadline=None)
@given(batches=batches, kind=st.sampled_from(sorted(AGGREGATES)), put_between=st.booleans(), two_keys=st.booleans())
def test_a_checkpoint_writes_the_aggregates_rows_as_they_were_put_the_same_entries_as_read_from_the_dicts(
    batches, kind, put_between, two_keys
):
    aggregate = Aggregate(kind, None if kind == "count" else "x", "out", None if kind == "count" else pa.int64())
    key_fields = [KEY, PART] if two_keys else [KEY]
    schema = KeyedSchema.of_values(key_fields, aggregate.state_fields())
    fast, slow = ResidentState(schema, KeyGroupRange(0, M - 1)), ResidentState(schema, KeyGroupRange(0, M - 1))
    slow.table.changed_rows = lambda: None  # always read back from the dicts
    for pairs in batches:
        for state in (fast, slow):
            aggregate.apply(state.table, _rows(pairs, pa.int64(), two_keys=two_keys), tuple(f.name for f in key_fields))
            if put_between and pairs:  # another change than put_many's: the rows come from the dicts
                key = (pairs[0][0], len(pairs[0][0]) % 2) if two_keys else (pairs[0][0],)
                group = key_group_for(key if two_keys else key[0], M)
                state.table.put(group, key, state.table.get(group, key))
        used = fast.table.changed_rows() is not None
        assert used == (not (put_between and pairs))
        assert _entries(fast.snapshot(max_chain_length=3)) == _entries(slow.snapshot(max_chain_length=3))


times = st.lists(st.integers(-(2**62), 2**62), unique=True).map(sorted)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(times, times, st.integers(-(2**62), 2**62) | st.none())))
def test_minima_is_the_earliest_time_of_each_kind_over_the_keys(timers):
    def earliest(times):
        return min(times) if times else None

    expected = (
        earliest([t for event, _, _ in timers for t in event]),
        earliest([t for _, processing, _ in timers for t in processing]),
        earliest([e for _, _, e in timers if e is not None]),
    )
    assert minima(timers) == minima(iter(timers)) == minima({i: t for i, t in enumerate(timers)}.values()) == expected


wide_batches = st.lists(  # key groups of several keys, a few changed per batch: delta entries, then compactions
    st.lists(st.tuples(st.integers(0, 47).map("k{}".format), st.integers(-100, 100) | st.none()), max_size=10),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(
    batches=wide_batches,
    kind=st.sampled_from(sorted(AGGREGATES)),
    input_type=st.sampled_from(["int", "str"]),
    restart=st.integers(0, 5),
    parallelism=st.integers(1, 3),
    search=st.booleans(),
    touch=st.booleans(),
)
def test_the_arrow_merge_writes_and_outputs_what_the_python_merge_does(
    batches, kind, input_type, restart, parallelism, search, touch
):
    """A native state (``KeyGroupTable.native``: Arrow kernels, key groups kept as Arrow chains) against a plain
    one, batch by batch: the same outputs, the same checkpoint entries, the same state after a restart at a
    new parallelism (restored chains, searched or hashed). ``touch`` reads one key per batch through ``get``,
    which folds its key group into dicts: the next batch merges the two kinds at once."""
    batches = [[(f"k{n}", 1) for n in range(48)]] + batches  # every key first: later batches write deltas
    from unittest import mock

    from spark_state.executor import table as keyed_table
    from spark_state.executor.resident import restore_instance
    from spark_state.storage.memory import MemoryStorage
    from spark_state.store.manifest import ComponentSpec
    from tests.stores import Store

    kind_type = pa.int64() if input_type == "int" else pa.string()
    if kind in ("sum", "mean") and input_type == "str":
        kind_type = pa.int64()
    if kind_type == pa.string():
        batches = [[(k, None if v is None else f"v{v:+04d}") for k, v in pairs] for pairs in batches]
    aggregate = Aggregate(kind, None if kind == "count" else "x", "out", None if kind == "count" else kind_type)
    assert aggregate.vectorized()
    schema = KeyedSchema.of_values([KEY], aggregate.state_fields())
    stores = [Store(MemoryStorage(), retained=2), Store(MemoryStorage(), retained=2)]
    states = [[ResidentState(schema, KeyGroupRange(0, M - 1), native=native)] for native in (True, False)]
    assert states[0][0].table.native and not states[1][0].table.native
    ratio = 0 if search else keyed_table.SEARCH_RATIO
    with mock.patch.object(keyed_table, "SEARCH_RATIO", ratio):
        for checkpoint_id, pairs in enumerate(batches, 1):
            if checkpoint_id == restart + 1:
                for side, store in enumerate(stores):
                    component = store.latest().components.get("c") if store.latest() else None
                    states[side] = [
                        restore_instance(store.blobs, component, schema, i, parallelism, M, native=side == 0)[0]
                        for i in range(parallelism)
                    ]
            outputs, written = [], []
            for side, store in enumerate(stores):
                rows = _rows(pairs, kind_type)
                result, refs = {}, []
                for i, state in enumerate(states[side]):
                    mine = rows.filter(
                        pa.array(
                            [g in state.key_group_range for g in rows.column(KEY_GROUP_COLUMN).to_pylist()], pa.bool_()
                        )
                    )
                    if mine.num_rows:
                        out = aggregate.apply(state.table, mine, ("key",))
                        result.update(zip(out.column("key").to_pylist(), out.column("out").to_pylist()))
                        if touch:
                            key = mine.column("key")[0].as_py()
                            state.table.get(key_group_for(key, M), (key,))
                    ref = state.checkpoint(store.blobs, "c", checkpoint_id, i, max_chain_length=3)[0]
                    refs += [ref] if ref else []
                size = len(states[side])
                store.commit(checkpoint_id, {"c": (ComponentSpec("c", M, size, schema), refs)}, {})
                outputs.append(result)
                chains = store.latest().components["c"].chains  # the same chains: entries of the same checkpoints
                written.append({g: tuple(path.split("/")[2] for path in chain) for g, chain in chains.items()})
            assert outputs[0] == outputs[1]
            assert written[0] == written[1]
            contents = [{k[0]: v for s in side for _, k, v in s.table.items()} for side in states]
            assert contents[0] == contents[1]


@pytest.mark.parametrize("native", [True, False])
def test_a_sum_leaving_the_64_bit_range_fails_the_batch_with_a_typed_error_and_keeps_the_state(native):
    from spark_state.errors import AggregateOverflowError

    aggregate = Aggregate("sum", "x", "total", pa.int64())
    state = ResidentState(
        KeyedSchema.of_values([KEY], aggregate.state_fields()), KeyGroupRange(0, M - 1), native=native
    )
    assert state.table.native == native
    aggregate.apply(state.table, _rows([("a", 2**63 - 10), ("b", 1)], pa.int64()), ("key",))
    with pytest.raises(AggregateOverflowError, match=r"sum\('x'\) overflows .* cast the column to double"):
        aggregate.apply(state.table, _rows([("a", 5), ("a", 6), ("b", 1)], pa.int64()), ("key",))
    assert {k[0]: v[0] for _, k, v in state.table.items()} == {"a": 2**63 - 10, "b": 1}


def test_the_arrow_merge_refuses_rows_of_a_key_group_the_instance_does_not_own():
    from spark_state.errors import KeyGroupOwnershipError

    aggregate = Aggregate("count", None, "n")
    state = ResidentState(
        KeyedSchema.of_values([KEY], aggregate.state_fields()), KeyGroupRange(0, M // 2 - 1), native=True
    )
    rows = _rows([(k, 1) for k in "abcdefgh"], pa.int64())
    assert max(rows.column(KEY_GROUP_COLUMN).to_pylist()) >= M // 2  # some rows belong to another instance
    with pytest.raises(KeyGroupOwnershipError, match="not owned by this instance"):
        aggregate.apply(state.table, rows, ("key",))
    assert list(state.table.items()) == [] and state.table.take_changes() == {}


@pytest.mark.parametrize(
    "key_fields, native",
    [
        ([KEY], True),
        ([pa.field("key", pa.int32())], True),
        ([pa.field("key", pa.float64())], False),  # no sorted entries to search: the per-key path, folding as usual
        ([KEY, PART], False),
    ],
)
def test_a_table_is_native_only_under_one_sorted_key_column(key_fields, native):
    schema = KeyedSchema.of_values(key_fields, Aggregate("count", None, "n").state_fields())
    table = KeyGroupTable(schema, KeyGroupRange(0, M - 1), native=True)
    assert table.native == native
    assert table.keep_arrow == native  # a table that is not native folds key groups looked up twice, as before
