"""Resident state catching up with the store: delta suffixes, diverged attempts, clears, lazy folding."""

from __future__ import annotations

import copy
import random
import zlib
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import CorruptBlobError, KeyGroupNotLoadedError, KeyGroupOwnershipError
from spark_state.executor import order as key_ordering
from spark_state.executor import search
from spark_state.executor import table as keyed_table
from spark_state.executor.aggregates import PARTIAL_PREFIX, Aggregate
from spark_state.executor.chain import FetchedChain
from spark_state.executor.columns import KEY_GROUP_COLUMN
from spark_state.executor.order import key_order
from spark_state.executor.resident import EXACT_TIMERS_EVERY, ResidentState, keep, resident_instances, take
from spark_state.executor.table import SET_ENTRY_BYTES, KeyGroupTable
from spark_state.keyspace import key_group_for, key_group_range
from spark_state.model.schema import DELETED_COLUMN, KeyedSchema, StateVariable
from spark_state.model.timers import TIMERS, minima
from spark_state.storage.memory import MemoryStorage
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifest import ComponentSpec
from spark_state.store.restore import plan_instance_restore
from tests.stores import Store

M = 4
SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])


def _contents(state: ResidentState) -> dict[str, int]:
    return {key[0]: value[0] for _, key, value in state.table.items()}


def _commit(store: Store, checkpoint_id: int, state: ResidentState, parallelism: int = 1):
    ref, _ = state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=10)
    spec = ComponentSpec("c", M, parallelism, SCHEMA)
    return store.commit(checkpoint_id, {"c": (spec, [ref] if ref else [])}, {}).components["c"]


@pytest.fixture
def store() -> Store:
    return Store(MemoryStorage(), retained=5)


def _dense_state() -> ResidentState:
    state = ResidentState(SCHEMA, key_group_range(0, 1, M))
    for n in range(200):
        key = f"k{n}"
        state.table.put(key_group_for(key, M), (key,), (n,))
    return state


def _put(state: ResidentState, key: str, value: int) -> None:
    state.table.put(key_group_for(key, M), (key,), (value,))


def test_stale_resident_state_reads_only_the_missing_deltas(store):
    live = _dense_state()
    _commit(store, 1, live)
    stale = copy.deepcopy(live)
    _put(live, "k1", 1000)
    live.table.delete(key_group_for("k2", M), ("k2",))
    _commit(store, 2, live)
    _put(live, "new", 7)
    component = _commit(store, 3, live)

    caught = stale.catch_up(store.blobs, component, 0, 1)
    plan, stats = caught.plan, caught.stats

    touched = {key_group_for(k, M) for k in ("k1", "k2", "new")}
    assert set(plan.appends) == touched and set(plan.chains) == touched
    assert all(entry.kind == "delta" for links in plan.chains.values() for _, entry in links)
    full_size = sum(b.size for b in component.blobs.values() if b.checkpoint_id == 1)
    assert stats.bytes_read < full_size / 4
    expected = {f"k{n}": n for n in range(200)} | {"k1": 1000, "new": 7}
    del expected["k2"]
    assert _contents(stale) == expected == _contents(live)
    held = stale.chains.held()
    assert held == {g: component.chains.get(g, ()) for g in held}


def test_uncommitted_attempt_is_reloaded_not_trusted(store):
    live = _dense_state()
    component = _commit(store, 1, live)
    _put(live, "k3", -1)
    live.checkpoint(store.blobs, "c", 2, 0, max_chain_length=10)  # written, never committed
    _put(live, "k4", -1)  # changed, never snapshotted

    plan = live.catch_up(store.blobs, component, 0, 1).plan

    changed = {key_group_for("k3", M), key_group_for("k4", M)}
    assert changed <= set(plan.chains) and not (changed & set(plan.appends))
    assert _contents(live) == {f"k{n}": n for n in range(200)}


def test_key_group_emptied_in_store_is_cleared_in_memory(store):
    state = ResidentState(SCHEMA, key_group_range(0, 1, M))
    _put(state, "only", 1)
    _commit(store, 1, state)
    stale = copy.deepcopy(state)
    state.table.delete(key_group_for("only", M), ("only",))
    component = _commit(store, 2, state)

    plan = stale.catch_up(store.blobs, component, 0, 1).plan

    assert plan.clear == frozenset({key_group_for("only", M)})
    assert _contents(stale) == {}


def test_catch_up_refuses_another_instances_range(store):
    state = _dense_state()
    component = _commit(store, 1, state)
    with pytest.raises(KeyGroupOwnershipError, match="owns"):
        state.catch_up(store.blobs, component, 0, 2)


def test_restore_folds_a_key_group_only_when_it_is_first_accessed(store):
    live = _dense_state()
    _commit(store, 1, live)
    _put(live, "k1", 1000)
    live.table.delete(key_group_for("k2", M), ("k2",))
    _put(live, "new", 7)
    component = _commit(store, 2, live)  # chains: full, then a delta with a tombstone in some key groups

    restored = ResidentState(SCHEMA, key_group_range(0, 1, M))
    restored.catch_up(store.blobs, component, 0, 1)

    table = restored.table
    assert table._groups == {} and set(table._unloaded) == set(range(M))  # nothing folded yet
    assert len(restored) == len(live) == 200  # counted from the Arrow batches: 200 - k2 + new
    assert restored.has_keys() and not ResidentState(SCHEMA, key_group_range(0, 1, M)).has_keys()
    assert table._groups == {}
    g = key_group_for("k1", M)
    assert table.get(g, ("k1",)) == (1000,)
    assert set(table._groups) == {g} and g not in table._unloaded
    assert restored.chains.held() == {k: component.chains[k] for k in range(M)}  # folding keeps the chain
    # a put into an unloaded key group keeps the rest of the group
    _put(restored, "k5", 55)
    _put(live, "k5", 55)
    assert _contents(restored) == _contents(live)


def test_a_chain_not_starting_with_a_full_entry_is_refused_at_restore(store, monkeypatch):
    live = _dense_state()
    component = _commit(store, 1, live)
    real = BlobStore.fetch

    def deltas_only(self, *args, **kwargs):
        entries, stats = real(self, *args, **kwargs)
        return {g: [("delta", batch) for _, batch in batches] for g, batches in entries.items()}, stats

    monkeypatch.setattr(BlobStore, "fetch", deltas_only)
    with pytest.raises(CorruptBlobError, match="must start with a full entry"):
        ResidentState(SCHEMA, key_group_range(0, 1, M)).catch_up(store.blobs, component, 0, 1)


def test_a_process_drops_resident_states_of_another_parallelism():
    store, component = "memory://resident-test", "c"
    for instance in range(4):
        keep(store, component, instance, take(store, component, instance, 4, M, SCHEMA))
    assert resident_instances(store, component) == [0, 1, 2, 3]
    state = take(store, component, 1, 2, M, SCHEMA)  # a task of the new parallelism 2
    assert state.key_group_range == key_group_range(1, 2, M) and len(state) == 0
    assert resident_instances(store, component) == []  # instance 0 at 4 owns another range than at 2
    keep(store, component, 1, state)
    assert take(store, component, 1, 2, M, SCHEMA) is state


@pytest.mark.parametrize("overlay", [False, True])
def test_compaction_merges_or_folds_the_stored_chain_with_the_changes_and_restores_exactly(store, overlay):
    """Batches as Spark runs them (catch up, change, checkpoint); chains of at most 2 entries compact.

    In the process that wrote a chain since its full entry, compaction writes
    a merge entry: the keys changed since the full entry, from memory. A new
    process every batch (``overlay``) knows that only of a chain that is one
    full entry; any other is written as its stored chain read back and folded
    with the batch's changes (deletions included), and its key groups stay
    Arrow under overlays (``get_many``/``put_many``): nothing folds them.
    Every checkpoint restores to the model.
    """
    state, model = _dense_state(), {f"k{n}": n for n in range(200)}
    spec = ComponentSpec("c", M, 1, SCHEMA)
    blob, _ = state.checkpoint(store.blobs, "c", 1, 0, max_chain_length=2)
    component = store.commit(1, {"c": (spec, [blob])}, {}).components["c"]
    compacted, merges = 0, 0
    for checkpoint_id in range(2, 12):
        if overlay:  # a new process: its key groups are restored as Arrow and stay so under overlays
            state = ResidentState(SCHEMA, key_group_range(0, 1, M))
        state.catch_up(store.blobs, component, 0, 1)
        changed = [f"k{(checkpoint_id * 7 + i) % 220}" for i in range(9)]
        groups = [key_group_for(k, M) for k in changed]
        olds = state.table.get_many(groups, list(changed))
        state.table.put_many(groups, list(changed), [((o[0] if o else 0) + 1,) for o in olds])
        for key, old in zip(changed, olds):
            model[key] = (old[0] if old else 0) + 1
        gone = f"k{checkpoint_id * 11 % 200}"
        if not overlay:
            state.table.delete(key_group_for(gone, M), (gone,))
            model.pop(gone, None)
        blob, _ = state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=2)
        compacted += state.compaction.get("key_groups", 0)
        merges += sum(entry.kind == "merge" for entry in blob.index.entries) if blob else 0
        if overlay:
            assert len(state.table._unloaded) == M  # nothing was folded, merged or compacted
        component = store.commit(checkpoint_id, {"c": (spec, [blob] if blob else [])}, {}).components["c"]
        restored = ResidentState(SCHEMA, key_group_range(0, 1, M))
        restored.catch_up(store.blobs, component, 0, 1)
        assert _contents(restored) == model, checkpoint_id
        assert all(len(chain) <= 2 for chain in component.chains.values())
    assert merges > 0 and compacted > 0  # both paths ran
    if not overlay:  # the store path only once half of a key group changed since its full entry
        assert merges > 2 * compacted


def test_a_restored_unsorted_key_group_is_hashed_for_lookups_once_then_folded(store, monkeypatch):
    """Entries not in key order (a store written before they were sorted) cannot be searched: the first batch
    after a restore hashes them in Arrow, and key groups it hashed are folded when asked again, at most an
    eighth of those unloaded (at least one) per call.

    Otherwise a stream bringing new keys every batch would hash the same
    chains every batch.
    """
    state = _dense_state()
    with monkeypatch.context() as old_writer:
        old_writer.setattr(KeyedSchema, "sorted_key", property(lambda self: None))
        blob, _ = state.checkpoint(store.blobs, "c", 1, 0, max_chain_length=10)
    spec = ComponentSpec("c", M, 1, SCHEMA)
    component = store.commit(1, {"c": (spec, [blob])}, {}).components["c"]
    restored = ResidentState(SCHEMA, key_group_range(0, 1, M))
    restored.catch_up(store.blobs, component, 0, 1)
    assert all(restored.table._unloaded[g].searchable() is None for g in range(M))
    first = [f"k{n}" for n in range(0, 200, 50)] + ["new-a"]
    groups = [key_group_for(k, M) for k in first]
    assert restored.table.get_many(groups, list(first)) == [(n,) for n in range(0, 200, 50)] + [None]
    assert set(restored.table._unloaded) == set(range(M))  # looked up, not folded
    again = ["k7", "new-b"]
    looked = {key_group_for(k, M) for k in again}
    assert restored.table.get_many([key_group_for(k, M) for k in again], list(again)) == [(7,), None]
    assert len(looked - set(restored.table._unloaded)) == 1  # hashed once already: folded, a share per call
    assert len(restored) == 200


def _entry(keys: list[str], values: list[int | None], deleted: list[bool]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array(keys),
            pa.array([None if v is None else {"value": v} for v in values], SCHEMA.blob_schema.field(1).type),
            pa.array(deleted),
        ],
        schema=SCHEMA.blob_schema,
    )


def test_live_rows_of_many_chains_are_what_each_chain_folds_to():
    """Chains of one full entry, of several with an overwrite and a tombstone, one folded before: the rows of
    the fold of all at once (one kernel call for the unfolded ones) are the union of each chain's fold."""

    def chains():
        return [
            FetchedChain(0, [("full", _entry(["a", "b"], [1, 2], [False, False]))], SCHEMA),
            FetchedChain(
                1,
                [
                    ("full", _entry(["c", "d", "e"], [3, 4, 5], [False, False, False])),
                    ("delta", _entry(["d", "c"], [40, None], [False, True])),
                ],
                SCHEMA,
            ),
            FetchedChain(
                2,
                [("full", _entry(["f"], [6], [False])), ("delta", _entry(["g", "f"], [7, 60], [False, False]))],
                SCHEMA,
            ),
        ]

    def rows(table: pa.Table) -> list[tuple]:
        return sorted(zip(table.column("key").to_pylist(), table.column(1).to_pylist()))

    each = chains()
    expected = rows(pa.concat_tables([chain.folded() for chain in each]))
    assert expected == [
        ("a", {"value": 1}),
        ("b", {"value": 2}),
        ("d", {"value": 40}),
        ("e", {"value": 5}),
        ("f", {"value": 60}),
        ("g", {"value": 7}),
    ]
    together = chains()
    together[2].folded()  # folded before: its fold is used as it is
    assert rows(FetchedChain.live_rows(together, SCHEMA.key_columns)) == expected
    assert together[0]._folded is None and together[1]._folded is None  # the others' folds are not kept
    together[0].release()
    with pytest.raises(KeyGroupNotLoadedError):
        FetchedChain.live_rows(together, SCHEMA.key_columns)


def test_a_restored_chain_takes_the_key_count_its_last_entry_recorded_instead_of_folding(store):
    """A built-in aggregate's entries record how many keys their chains hold; a restore at a new parallelism
    counts its chains from those records (no fold), and the counts are the chains' true counts."""
    from spark_state.executor.aggregates import PARTIAL_PREFIX, Aggregate
    from spark_state.executor.columns import KEY_GROUP_COLUMN

    agg = Aggregate("count", None, "count")
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], agg.state_fields())
    many = 16

    def batch(keys):
        keys = sorted(keys, key=lambda k: key_group_for(k, many))
        return pa.table(
            {
                KEY_GROUP_COLUMN: pa.array([key_group_for(k, many) for k in keys], pa.int32()),
                "key": pa.array(keys),
                PARTIAL_PREFIX + "0": pa.array([1] * len(keys), pa.int64()),
            }
        )

    writer = ResidentState(schema, key_group_range(0, 1, many), native=True)
    component = None
    for checkpoint_id, keys in enumerate([[f"k{i}" for i in range(200)], [f"k{i}" for i in range(150, 260)]], 1):
        agg.apply(writer.table, batch(keys), ("key",))
        ref, _ = writer.checkpoint(store.blobs, "c", checkpoint_id, 0)
        component = store.commit(checkpoint_id, {"c": (ComponentSpec("c", many, 1, schema), [ref])}, {}).components["c"]
    recorded = {e.key_group: e.live for ref in component.blobs.values() for e in ref.index.entries}
    assert None not in recorded.values()
    total = 0
    for instance in range(2):
        restored = ResidentState(schema, key_group_range(instance, 2, many), native=True)
        restored.catch_up(store.blobs, component, instance, 2)
        chains = restored.table._unloaded
        assert any(len(chain.batches) > 1 for chain in chains.values())
        assert all(chain._live is not None and chain._folded is None for chain in chains.values())
        assert [chain._live for chain in chains.values()] == [
            FetchedChain(0, chain.batches, schema).live_keys() for chain in chains.values()
        ]
        total += len(restored)
    assert total == 260


def test_a_key_count_no_chain_of_its_entries_could_hold_is_ignored():
    entries = [("full", _entry(["a", "b"], [1, 2], [False, False])), ("delta", _entry(["c"], [3], [False]))]
    assert FetchedChain(0, entries, SCHEMA, live=4)._live is None
    assert FetchedChain(0, entries, SCHEMA, live=-1).live_keys() == 3
    assert FetchedChain(0, entries, SCHEMA, live=2).live_keys() == 2  # within bounds: taken as recorded


def test_a_chain_counts_the_keys_its_fold_holds_without_folding_a_lone_entry():
    """One entry: its rows less its tombstones (no fold); several: the fold's rows (overwrites count once)."""
    lone = FetchedChain(0, [("full", _entry(["a", "b", "c"], [1, None, 3], [False, True, False]))], SCHEMA)
    chain = FetchedChain(
        1,
        [
            ("full", _entry(["c", "d", "e"], [3, 4, 5], [False, False, False])),
            ("delta", _entry(["d", "c", "f"], [40, None, 6], [False, True, False])),
        ],
        SCHEMA,
    )
    assert lone.live_keys() == 2 and lone._folded is None
    assert chain.live_keys() == 3
    assert [FetchedChain(g, c.batches, SCHEMA).folded().num_rows for g, c in ((0, lone), (1, chain))] == [2, 3]


real_search = KeyGroupTable._search
INT_SCHEMA = KeyedSchema.of_values([pa.field("key", pa.int64())], [pa.field("value", pa.int64())])


def _int_commit(store: Store, checkpoint_id: int, state: ResidentState, max_chain_length: int = 10):
    ref, _ = state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=max_chain_length)
    spec = ComponentSpec("c", M, 1, INT_SCHEMA)
    return store.commit(checkpoint_id, {"c": (spec, [ref] if ref else [])}, {}).components["c"]


def _int_put_many(state: ResidentState, items: dict[int, int]) -> None:
    """What a built-in aggregate does: the keys sorted by key group, with their Arrow columns."""
    pairs = sorted(items.items(), key=lambda kv: key_group_for(kv[0], M))
    keys, values = [k for k, _ in pairs], [(v,) for _, v in pairs]
    state.table.get_many([key_group_for(k, M) for k in keys], keys)
    state.table.put_many(
        [key_group_for(k, M) for k in keys],
        keys,
        values,
        key_columns=[pa.array(keys, pa.int64())],
        value_columns=[pa.array([v for (v,) in values])],
    )


def _stored_entries(store: Store, component) -> list[tuple[int, str, list[int]]]:
    return [
        (g, kind, batch.column("key").to_pylist())
        for g, chain in store.blobs.fetch(component, plan_instance_restore(component, 0, 1), INT_SCHEMA)[0].items()
        for kind, batch in chain
    ]


_INTEGER_TYPES = [
    (pa.int8(), -(2**7), 2**7 - 1),
    (pa.int32(), -(2**31), 2**31 - 1),
    (pa.int64(), -(2**63), 2**63 - 1),
    (pa.uint64(), 0, 2**64 - 1),
]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_key_order_sorts_each_run_by_key_in_place(data):
    """Integers by value, whatever their span (one sort of (run, key) as one integer, or a lexsort when that
    overflows), strings by their bytes; in one call, or run by run: the row counts that choose between the two
    (``LEXSORT_ROWS``, ``SHORT_RUN_ROWS``) are drawn small, so that small examples take every path."""
    kind, low, high = data.draw(st.sampled_from(_INTEGER_TYPES + [(pa.string(), 0, 0)]))
    if kind == pa.string():
        values = st.text("ab\x00\u00e9", max_size=3)
    else:
        narrow = data.draw(st.booleans())
        values = st.integers(low, high) if not narrow else st.integers(max(low, -50), min(high, 50))
    sizes = data.draw(st.lists(st.integers(0, 6), max_size=8))
    keys = data.draw(st.lists(values, min_size=sum(sizes), max_size=sum(sizes)))
    lexsort_rows = data.draw(st.sampled_from([0, 4, key_ordering.LEXSORT_ROWS]))
    short_run_rows = data.draw(st.sampled_from([0, 2, key_ordering.SHORT_RUN_ROWS]))
    with (
        mock.patch.object(key_ordering, "LEXSORT_ROWS", lexsort_rows),
        mock.patch.object(key_ordering, "SHORT_RUN_ROWS", short_run_rows),
    ):
        order = key_order(pa.array(keys, kind), sizes)
    runs = np.repeat(np.arange(len(sizes)), sizes)
    by = (lambda k: k.encode()) if kind == pa.string() else (lambda k: k)
    ordered = sorted(zip(runs.tolist(), keys), key=lambda rk: (rk[0], by(rk[1])))
    assert [keys[i] for i in order] == [k for _, k in ordered]  # each run in its place
    assert order.tolist() == sorted(range(len(keys)), key=lambda i: (runs[i], by(keys[i])))  # ties keep their order


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_search_of_sorted_entries_finds_each_key_in_the_newest_entry_holding_it(data):
    """``search_entries`` (integers of any width, strings) against a dict model: each asked key, in any order,
    found in its own key group's newest entry holding it, with that row's value. With ``owned``, each key is in
    one key group only and asked of it, as keys are by their hash (the newer entries hashed, the oldest
    searched); without, a key may be in several key groups and asked of any (every level searched)."""
    kind, low, high = data.draw(st.sampled_from(_INTEGER_TYPES + [(pa.string(), 0, 0)]))
    wide = st.integers(low, high) | st.sampled_from([low, high])  # the extremes of the type, and any value
    narrow = st.integers(max(low, -4), min(high, 4))  # a few values: asked keys hit the entries' keys often
    values = (
        st.text("abc\x00\u00e9", max_size=3) if kind == pa.string() else narrow if data.draw(st.booleans()) else wide
    )
    groups = data.draw(st.lists(st.integers(0, 5), unique=True, min_size=1, max_size=4))
    owned = data.draw(st.booleans())

    def group_of(k):
        return groups[(zlib.crc32(k.encode()) if isinstance(k, str) else k) % len(groups)]

    entries, model = {}, {}
    for g in groups:
        levels = []
        for level in range(data.draw(st.integers(1, 3))):  # newest first
            keys = [k for k in data.draw(st.sets(values, max_size=6)) if not owned or group_of(k) == g]
            keys.sort(key=lambda k: k.encode() if isinstance(k, str) else k)
            named = pa.array([f"{g}/{level}/{k}" for k in keys], pa.string())
            batch = pa.record_batch([pa.array(keys, kind), named], ["k", "v"])
            levels.append((batch, batch.column(0)))
            for k in keys:
                model.setdefault((g, k), f"{g}/{level}/{k}")
        entries[g] = levels
    asked = [
        (group_of(k) if owned else g, k)
        for g, k in data.draw(st.lists(st.tuples(st.sampled_from(groups), values), max_size=12))
    ]
    owner = np.array([g for g, _ in asked], np.int64)
    wider = {pa.string(): pa.large_string(), pa.int8(): pa.int16(), pa.int32(): pa.int64()}.get(kind)
    asked_type = wider if wider is not None and data.draw(st.booleans()) else kind  # then every level searched
    found, chunks = search.search_entries(owner, pa.array([k for _, k in asked], asked_type), entries)
    got = dict(zip(found.tolist(), pa.concat_arrays(chunks).to_pylist() if chunks else []))
    assert got == {i: model[key] for i, key in enumerate(asked) if key in model}


def _ascending_alone(batch: pa.RecordBatch, key: str) -> bool:
    """One entry's keys strictly ascending without nulls, checked on their own: the reference for the one-pass
    checks."""
    column = batch.column(key)
    n = len(column)
    return not column.null_count and (n < 2 or pc.all(pc.less(column.slice(0, n - 1), column.slice(1))).as_py())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_entries_keys_checked_sorted_all_at_once_are_those_each_entry_has_in_strictly_ascending_order(data):
    """``keys_ascending`` against each entry checked alone: equal or descending neighbours within an entry
    make it unsorted, across two entries they do not; a null key makes it unsorted; empty entries are sorted."""
    kind = data.draw(st.sampled_from([pa.int64(), pa.string()]))
    values = st.integers(-3, 3) if kind == pa.int64() else st.text("ab", max_size=2)
    batches = [
        pa.record_batch([pa.array(data.draw(st.lists(values | st.none(), max_size=5)), kind)], ["k"])
        for _ in range(data.draw(st.integers(0, 5)))
    ]
    checked = key_ordering.keys_ascending(batches, "k")
    assert checked == [_ascending_alone(b, "k") for b in batches]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_chains_checked_searchable_all_at_once_are_those_each_chain_finds_searchable(data):
    """``FetchedChain.searchable_all`` and ``searchable`` per chain, on two copies of the same chains, against each
    entry checked alone: a chain is searchable when every entry's keys are strictly ascending without nulls, its
    entries newest first; a released chain never is, and a chain already checked keeps its answer."""

    def entry(kind: str):
        keys = data.draw(st.lists(st.text("abc", max_size=2) | st.none(), max_size=4))
        return kind, pa.record_batch(
            [pa.array(keys, pa.string()), pa.array([False] * len(keys), pa.bool_())], ["key", DELETED_COLUMN]
        )

    plans = [
        ([entry("full")] + [entry("delta") for _ in range(deltas)], released, checked)
        for deltas, released, checked in data.draw(
            st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), max_size=6)
        )
    ]

    def chains() -> list[FetchedChain]:
        made = []
        for g, (entries, released, checked) in enumerate(plans):
            chain = FetchedChain(g, entries, SCHEMA)
            chain._search = None if checked else False  # checked before: not searchable, whatever its entries
            if released:
                chain.release()
            made.append(chain)
        return made

    together = FetchedChain.searchable_all(chains())
    each = [chain.searchable() for chain in chains()]
    expected = [
        not released and not checked and all(_ascending_alone(batch, "key") for _, batch in entries)
        for entries, released, checked in plans
    ]
    assert [found is not None for found in together] == expected
    assert [found is not None for found in each] == expected
    for found, alone, (entries, _, _) in zip(together, each, plans):
        if found is not None:
            assert [batch for batch, _ in found] == [batch for _, batch in reversed(entries)]
            assert all(keys.equals(batch.column("key")) for batch, keys in found)
            assert all(a.equals(b) for (_, a), (_, b) in zip(found, alone))


def test_chains_whose_entries_differ_in_key_type_are_checked_entry_by_entry():
    """One pass compares keys of one type; chains fetched with string and large-string keys are checked per
    entry instead, with the same answers."""

    def entry(keys, kind):
        return "full", pa.record_batch(
            [pa.array(keys, kind), pa.array([False] * len(keys), pa.bool_())], ["key", DELETED_COLUMN]
        )

    chains = [
        FetchedChain(0, [entry(["a", "b"], pa.string())], SCHEMA),
        FetchedChain(1, [entry(["b", "a"], pa.large_string())], SCHEMA),
        FetchedChain(2, [entry(["c", "d"], pa.large_string())], SCHEMA),
    ]
    assert [found is not None for found in FetchedChain.searchable_all(chains)] == [True, False, True]


@pytest.mark.parametrize("asked_count", [1, 3, 12, 40])
def test_a_probe_finds_each_asked_key_whether_it_filters_the_chains_rows_first_or_not(asked_count):
    """``probe`` filters the chains' rows to the asked keys' first only when they are many per key asked
    (``PROBE_FILTER_RATIO``); either way each asked key gets its value, or null when absent."""
    live_keys = [f"k{n}" for n in range(40)]
    values = pa.array([{"value": n} for n in range(40)], SCHEMA.blob_schema.field(1).type)
    live = pa.Table.from_batches(
        [pa.record_batch([pa.array(live_keys[i : i + 5]), values.slice(i, 5)], ["key", "v"]) for i in range(0, 40, 5)]
    )  # one chunk per key group, as chains' rows come
    asked = [f"k{n}" for n in random.Random(asked_count).sample(range(60), asked_count)]
    assert (live.num_rows > search.PROBE_FILTER_RATIO * len(asked)) == (asked_count < 10)  # both routes
    found = search.probe(live, pa.array(asked)).to_pylist()
    assert found == [{"value": int(k[1:])} if int(k[1:]) < 40 else None for k in asked]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_full_entries_of_native_key_groups_are_their_folds_whether_a_batch_rewrote_every_key_or_some(data):
    """A native count's full entries (``arrow_rows``): a key group whose batch changed every key it holds
    gives that batch's rows (``whole_pending``), the others are folded, in the order asked; each checkpoint
    restores to a dict model."""
    agg = Aggregate("count", None, "count")
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], agg.state_fields())
    store = Store(MemoryStorage(), retained=3)
    state = ResidentState(schema, key_group_range(0, 1, M), native=True)
    universe = [f"u{n}" for n in range(24)]
    model: dict[str, int] = {}
    for checkpoint_id in range(1, data.draw(st.integers(2, 6)) + 1):
        every = data.draw(st.sets(st.integers(0, M - 1)))  # key groups whose keys all change
        keys = set(data.draw(st.sets(st.sampled_from(universe), max_size=10)))
        keys |= {k for k in model if key_group_for(k, M) in every}
        if not keys:
            continue
        ordered = sorted(keys, key=lambda k: key_group_for(k, M))
        groups = [key_group_for(k, M) for k in ordered]
        adds = data.draw(st.lists(st.integers(1, 3), min_size=len(ordered), max_size=len(ordered)))
        agg.apply(
            state.table,
            pa.table(
                {
                    KEY_GROUP_COLUMN: pa.array(groups, pa.int32()),
                    "key": ordered,
                    PARTIAL_PREFIX + "0": pa.array(adds, pa.int64()),
                }
            ),
            ("key",),
        )
        for k, n in zip(ordered, adds):
            model[k] = model.get(k, 0) + n
        held = sorted({g for g in range(M) if g in state.table._unloaded}, reverse=True)  # any order asked
        assert state.table.arrow_rows(held)[0].to_pylist() == state.table._folded_rows(held)[0].to_pylist()
        ref, _ = state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=3)
        spec = ComponentSpec("c", M, 1, schema)
        component = store.commit(checkpoint_id, {"c": (spec, [ref] if ref else [])}, {}).components["c"]
        restored = ResidentState(schema, key_group_range(0, 1, M))
        restored.catch_up(store.blobs, component, 0, 1)
        assert {key[0]: value[0] for _, key, value in restored.table.items()} == model


def test_a_checkpoint_checks_the_key_order_of_what_it_writes_so_later_searches_check_no_full_entry_again(monkeypatch):
    """``settle`` checks every written entry's key order in one pass: the search after a first batch of many
    keys, and after a compaction, checks none of the full entries' keys (it checked them all before), and
    finds what a dict model holds."""
    agg = Aggregate("count", None, "count")
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], agg.state_fields())
    store = Store(MemoryStorage(), retained=3)
    state = ResidentState(schema, key_group_range(0, 1, M), native=True)
    checked: list[int] = []
    real = key_ordering.keys_ascending
    monkeypatch.setattr(
        key_ordering,
        "keys_ascending",
        lambda batches, key: (checked.append(sum(batch.num_rows for batch in batches)), real(batches, key))[1],
    )
    universe = [f"k{n:04d}" for n in range(2_000)]
    model: dict[str, int] = {}
    rng = random.Random(3)
    for checkpoint_id in range(1, 9):
        keys = universe if checkpoint_id == 1 else rng.sample(universe, 12)
        ordered = sorted(keys, key=lambda k: key_group_for(k, M))
        groups = [key_group_for(k, M) for k in ordered]
        checked.clear()
        found = state.table.look_up(np.asarray(groups), pa.array(ordered))
        assert [None if v is None else v["count"] for v in found.to_pylist()] == [model.get(k) for k in ordered]
        assert sum(checked) == 0, checkpoint_id  # no key checked: every entry's order known since it was written
        agg.apply(
            state.table,
            pa.table(
                {
                    KEY_GROUP_COLUMN: pa.array(groups, pa.int32()),
                    "key": ordered,
                    PARTIAL_PREFIX + "0": pa.array([1] * len(ordered), pa.int64()),
                }
            ),
            ("key",),
        )
        for k in ordered:
            model[k] = model.get(k, 0) + 1
        state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=3)
    kinds = {kind for g in range(M) for kind, _ in state.table._unloaded[g].batches}
    assert kinds == {"full", "merge", "delta"}  # compactions happened: the searches after them checked nothing


def test_integer_keys_are_written_in_ascending_order_in_every_entry(store):
    """Full entries from the dicts, deltas from a put_many's columns or from the dicts, compacted full entries."""
    rng = random.Random(5)
    state = ResidentState(INT_SCHEMA, key_group_range(0, 1, M))
    keys = rng.sample(range(-(10**12), 10**12), 300)
    for k in keys:
        state.table.put(key_group_for(k, M), (k,), (k % 7,))
    component = _int_commit(store, 1, state, max_chain_length=3)
    for checkpoint_id in range(2, 6):
        _int_put_many(state, {k: checkpoint_id for k in rng.sample(keys, 20)})
        if checkpoint_id == 4:
            state.table.put(key_group_for(keys[0], M), (keys[0],), (-1,))  # a delta read back from the dicts
        component = _int_commit(store, checkpoint_id, state, max_chain_length=3)
    entries = _stored_entries(store, component)
    assert {kind for _, kind, _ in entries} >= {"full", "delta"} and len(entries) > M  # chains of several entries
    restored = ResidentState(INT_SCHEMA, key_group_range(0, 1, M))  # knows no keys changed since full entries
    restored.catch_up(store.blobs, component, 0, 1)
    _int_put_many(restored, {k: 6 for k in rng.sample(keys, 8)})
    compacted = _int_commit(store, 6, restored, max_chain_length=2)
    assert restored.compaction["key_groups"] > 0  # full entries folded from the stored chains
    for g, kind, stored in entries + _stored_entries(store, compacted):
        assert stored == sorted(stored) and len(stored) == len(set(stored)), (g, kind)


def test_a_restored_integer_keyed_key_group_is_searched_then_folded_a_share_per_batch(store, monkeypatch):
    """Binary search in sorted entries costs the keys asked; key groups looked up again are folded at most
    one per batch here (an eighth of four, at least one), so no batch folds all it touches. A tombstone is found
    as absent; counts include the keys written since."""
    state = ResidentState(INT_SCHEMA, key_group_range(0, 1, M))
    model = {}
    for k in range(0, 400, 2):
        state.table.put(key_group_for(k, M), (k,), (k,))
        model[k] = k
    _int_commit(store, 1, state)
    state.table.delete(key_group_for(10, M), (10,))
    del model[10]
    _int_put_many(state, {12: -12})
    model[12] = -12
    component = _int_commit(store, 2, state)  # chains: full, then a delta with a tombstone for some groups

    restored = ResidentState(INT_SCHEMA, key_group_range(0, 1, M))
    restored.catch_up(store.blobs, component, 0, 1)
    assert all(restored.table._unloaded[g].searchable() is not None for g in range(M))
    monkeypatch.setattr(keyed_table, "SEARCH_RATIO", 0)  # searched however few rows the chains hold
    searched = []
    monkeypatch.setattr(
        KeyGroupTable,
        "_search",
        lambda self, wanted, entries: (searched.append(len(wanted)), real_search(self, wanted, entries)),
    )
    for batch in range(4):
        asked = [10, 12, 14, 1001 + batch, 3 + 2 * batch]  # a tombstone, a delta, the full entry, new keys
        found = restored.table.get_many([key_group_for(k, M) for k in asked], asked)
        assert found == [(model[k],) if k in model else None for k in asked]
        _int_put_many(restored, {k: batch for k in asked})
        model.update({k: batch for k in asked})
        assert M - batch <= len(restored.table._unloaded) <= M  # searched; at most one folded per later batch
        assert len(restored) == len(model)
    assert len(restored.table._unloaded) < M and searched
    assert _contents(restored) == model  # folds everything


def test_a_bounded_integer_keyed_chain_stays_sorted_when_its_checkpoint_is_folded_into_it(store):
    state = ResidentState(INT_SCHEMA, key_group_range(0, 1, M))
    for k in range(0, 400, 2):
        state.table.put(key_group_for(k, M), (k,), (k,))
    component = _int_commit(store, 1, state)
    bounded = ResidentState(INT_SCHEMA, key_group_range(0, 1, M), bounded=True)
    bounded.catch_up(store.blobs, component, 0, 1)
    bounded.load(store.blobs, list(range(M)))
    written = {1: 1, 4: -4, 999: 9, -5: 5}
    _int_put_many(bounded, written)
    _int_commit(store, 2, bounded)
    for g in {key_group_for(k, M) for k in written}:
        assert bounded.table._unloaded[g].searchable() is not None  # the delta appended, in key order
    found = bounded.table.get_many([key_group_for(k, M) for k in written], list(written))
    assert found == [(v,) for v in written.values()]
    # A chain written before entries were sorted, once folded, merges an entry appended to it in key order
    legacy = INT_SCHEMA.fields_to_batch([pa.array([9, 3, 7])], [pa.array([90, 30, 70])])
    chain = FetchedChain(0, [("full", legacy)], INT_SCHEMA)
    assert chain.searchable() is None
    chain.folded()
    chain.append("delta", INT_SCHEMA.fields_to_batch([pa.array([1, 7])], [pa.array([10, 71])]))
    assert chain.searchable() is not None
    assert chain.folded().column("key").to_pylist() == [1, 3, 7, 9]


# Memory bound: evicted key groups, lazy loads, Arrow kept ----------------------------------------

BOUNDED_M = 16
BOUNDED_SPEC = ComponentSpec("c", BOUNDED_M, 1, SCHEMA)


def _bounded_batch(
    state: ResidentState,
    store: Store,
    component,
    checkpoint_id: int,
    keys: list[str],
    model: dict[str, int],
    *,
    commit: bool = True,
    release: bool = False,
):
    """One task as the operator runs it: catch up, load what the rows touch, count, checkpoint, commit, bound.

    With ``release``, the loaded chains are dropped after the count (a batch
    over its bound): the checkpoint writes their full entries from the store.
    """
    state.catch_up(store.blobs, component, 0, 1)
    groups = [key_group_for(k, BOUNDED_M) for k in keys]
    state.load(store.blobs, set(groups))
    olds = state.table.get_many(groups, list(keys))
    expected = [(model[k],) if k in model else None for k in keys]
    assert olds == expected, checkpoint_id
    if release:
        state.table.release(set(groups))
    state.table.put_many(groups, list(keys), [((o[0] if o else 0) + 1,) for o in olds])
    blob, _ = state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=3)
    if not commit:
        return component
    for k in keys:
        model[k] = model.get(k, 0) + 1
    return store.commit(checkpoint_id, {"c": (BOUNDED_SPEC, [blob] if blob else [])}, {}).components["c"]


def _restored(store: Store, component) -> dict[str, int]:
    state = ResidentState(SCHEMA, key_group_range(0, 1, BOUNDED_M))
    state.catch_up(store.blobs, component, 0, 1)
    return _contents(state)


def test_a_bounded_state_evicts_least_recently_used_key_groups_and_reads_them_back_exactly(store):
    """Batches touching shifting key sets under a bound far below the state: every read equals the model.

    Failed attempts (written, never committed) are replayed; every committed
    checkpoint restores to the model; the estimate ends under the bound after
    every batch, and the key groups the last batch touched are the ones kept.
    """
    import random

    rng = random.Random(7)
    base = ResidentState(SCHEMA, key_group_range(0, 1, BOUNDED_M))
    for n in range(800):
        base.table.put(key_group_for(f"k{n}", BOUNDED_M), (f"k{n}",), (1,))
    model = {f"k{n}": 1 for n in range(800)}
    blob, _ = base.checkpoint(store.blobs, "c", 1, 0, max_chain_length=3)
    component = store.commit(1, {"c": (BOUNDED_SPEC, [blob])}, {}).components["c"]
    limit = 4000
    state = ResidentState(SCHEMA, key_group_range(0, 1, BOUNDED_M), bounded=True)
    assert state.catch_up(store.blobs, component, 0, 1).stats.bytes_read == 0  # a lazy restore
    evicted, released = 0, 0
    for checkpoint_id in range(2, 60):
        low = rng.randrange(0, 900)
        dense = rng.random() < 0.15  # every key of a range: key groups mostly changed, written in full
        keys = sorted(
            {f"k{n}" for n in range(low, low + 300)}
            if dense
            else {f"k{rng.randrange(low, low + 120)}" for _ in range(40)}
        )
        failed, release = rng.random() < 0.2, rng.random() < 0.4
        component = _bounded_batch(
            state, store, component, checkpoint_id, keys, model, commit=not failed, release=release
        )
        assert not state.table.released()  # evicted by the checkpoint
        memory = state.bound_memory(limit)
        evicted += memory["evicted_key_groups"]
        released += release
        assert memory["resident_bytes"] <= limit, memory
        touched = {key_group_for(k, BOUNDED_M) for k in keys}
        kept = set(range(BOUNDED_M)) - state.table.cold
        if not release:
            assert kept <= touched or touched <= kept, (kept, touched)  # the last batch's key groups go last
        if failed:
            component = _bounded_batch(state, store, component, checkpoint_id, keys, model)
            state.bound_memory(limit)
        assert _restored(store, component) == model, checkpoint_id
    assert evicted > 0 and released > 5 and state.high_water_bytes > limit


def test_a_cold_key_group_is_never_read_as_empty(store):
    from spark_state.errors import KeyGroupNotLoadedError

    base = _dense_state()
    blob, _ = base.checkpoint(store.blobs, "c", 1, 0, max_chain_length=10)
    component = store.commit(1, {"c": (ComponentSpec("c", M, 1, SCHEMA), [blob])}, {}).components["c"]
    state = ResidentState(SCHEMA, key_group_range(0, 1, M), bounded=True)
    state.catch_up(store.blobs, component, 0, 1)
    group = key_group_for("k1", M)
    with pytest.raises(KeyGroupNotLoadedError, match="evicted"):
        state.table.get_many([group], ["k1"])
    with pytest.raises(KeyGroupNotLoadedError):
        state.table.put(group, ("k1",), (5,))
    with pytest.raises(KeyGroupNotLoadedError):
        list(state.table.items())
    info = state.load(store.blobs, [group])
    assert info["key_groups"] == 1 and 0 < info["bytes_read"] < component.blobs[blob.path].size
    assert state.table.get_many([group], ["k1"]) == [(1,)]


def test_a_bounded_state_keeps_written_key_groups_as_arrow(store):
    """After a checkpoint a bounded state holds its key groups as Arrow chains, not dicts: a fraction of the bytes."""
    state = _dense_state()
    blob, _ = state.checkpoint(store.blobs, "c", 1, 0, max_chain_length=10)
    spec = ComponentSpec("c", M, 1, SCHEMA)
    component = store.commit(1, {"c": (spec, [blob])}, {}).components["c"]
    dicts = state.bound_memory(None)["resident_bytes"]
    bounded = ResidentState(SCHEMA, key_group_range(0, 1, M), bounded=True)
    for checkpoint_id in (2, 3, 4):
        bounded.catch_up(store.blobs, component, 0, 1)
        bounded.load(store.blobs, range(M))
        keys = [f"k{n}" for n in range(checkpoint_id, 200, 3)]
        groups = [key_group_for(k, M) for k in keys]
        olds = bounded.table.get_many(groups, list(keys))
        bounded.table.put_many(groups, list(keys), [(o[0] * 10,) for o in olds])
        blob, _ = bounded.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=10)
        component = store.commit(checkpoint_id, {"c": (spec, [blob])}, {}).components["c"]
    assert set(bounded.table._unloaded) == set(range(M)) and not bounded.table._groups
    arrow = bounded.bound_memory(None)["resident_bytes"]
    assert arrow < dicts / 2, (arrow, dicts)
    restored = ResidentState(SCHEMA, key_group_range(0, 1, M))
    restored.catch_up(store.blobs, component, 0, 1)
    assert _contents(bounded) == _contents(restored)


def test_the_keys_changed_since_a_full_entry_count_in_the_memory_estimate(store):
    """The tracked keys of a merge are memory too: a set entry each, and under Arrow their key objects."""
    state = _dense_state()
    _commit(store, 1, state)
    for n in range(5):
        _put(state, f"k{n}", -n)
    _commit(store, 2, state)  # deltas: the five keys are now known as changed since the full entries
    tracked = state.chains.since_full_counts()
    assert sum(tracked.values()) == 5
    plain = state.table.nbytes()
    counted = state.table.nbytes(tracked)
    assert all(
        counted[g] - plain[g] == tracked[g] * SET_ENTRY_BYTES for g in tracked
    )  # dicts hold the key objects already
    assert state.bound_memory(None)["after_checkpoint_bytes"] == sum(counted.values())


@pytest.mark.parametrize("bounded", [False, True])
def test_a_bounded_state_compacts_into_full_entries_only(bounded):
    """Under a memory bound the keys changed since a full entry are not kept: they would be memory it does not bound."""
    store, spec = Store(MemoryStorage(), retained=3), ComponentSpec("c", M, 1, SCHEMA)
    blob, _ = _dense_state().checkpoint(store.blobs, "c", 1, 0, max_chain_length=2)
    component = store.commit(1, {"c": (spec, [blob])}, {}).components["c"]
    state, kinds = ResidentState(SCHEMA, key_group_range(0, 1, M), bounded=bounded), []
    for checkpoint_id in range(2, 8):
        state.catch_up(store.blobs, component, 0, 1)
        key = "k0"  # one key of key group 0's fifty, again and again
        state.load(store.blobs, [key_group_for(key, M)])
        state.table.put(key_group_for(key, M), (key,), (checkpoint_id,))
        blob, _ = state.checkpoint(store.blobs, "c", checkpoint_id, 0, max_chain_length=2)
        kinds += [entry.kind for entry in blob.index.entries]
        component = store.commit(checkpoint_id, {"c": (spec, [blob])}, {}).components["c"]
    assert kinds == (["delta", "full"] * 3 if bounded else ["delta"] + ["merge"] * 5)
    assert state.chains.since_full_counts() == ({} if bounded else {key_group_for("k0", M): 1})


def test_a_two_variable_checkpoint_marks_deleted_only_the_keys_gone_from_every_variable(store):
    two = KeyedSchema(
        (pa.field("key", pa.string()),),
        (StateVariable("value", (pa.field("v", pa.int64()),)), StateVariable("extra", (pa.field("n", pa.int64()),))),
    )
    state = ResidentState(two, key_group_range(0, 1, M))
    g = key_group_for("a", M)
    fillers = [(f"f{i}", 0, (i,)) for i in range(20 * M)]  # the changed keys are a few of each key group's: deltas
    for key, variable, value in [("a", 0, (1,)), ("a", 1, (10,)), ("b", 0, (2,)), ("b", 1, (20,)), ("c", 1, (30,))]:
        state.table.put(key_group_for(key, M), (key,), value, variable)
    for key, variable, value in fillers:
        state.table.put(key_group_for(key, M), (key,), value, variable)
    _commit_two(store, 1, state, two)
    state.table.delete(g, ("a",), 0)  # "a" keeps its extra
    state.table.delete(key_group_for("b", M), ("b",), 0)
    state.table.delete(key_group_for("b", M), ("b",), 1)  # "b" is gone from both
    state.table.put(key_group_for("c", M), ("c",), (3,), 0)
    entries = state.snapshot(max_chain_length=8)
    rows = {r["key"]: r for _, _, batch in entries for r in batch.to_pylist()}
    assert {k: r[DELETED_COLUMN] for k, r in rows.items()} == {"a": False, "b": True, "c": False}
    component = _commit_two(store, 2, state, two, entries)
    restored = ResidentState(two, key_group_range(0, 1, M))
    restored.catch_up(store.blobs, component, 0, 1)
    fillers = [(key_group_for(key, M), (key,), value) for key, _, value in fillers]
    assert sorted(restored.table.items(0)) == sorted([(key_group_for("c", M), ("c",), (3,))] + fillers)
    assert sorted(restored.table.items(1)) == sorted([(g, ("a",), (10,)), (key_group_for("c", M), ("c",), (30,))])


def _commit_two(store, checkpoint_id, state, schema, entries=None):
    entries = state.snapshot(max_chain_length=8) if entries is None else entries
    blob = store.blobs.write_blob(
        "c", checkpoint_id, 0, state.key_group_range, schema.blob_schema, entries, earliest=state.earliest or None
    )  # as ``checkpoint`` records them
    state.chains.record(blob.path)
    return store.commit(checkpoint_id, {"c": (ComponentSpec("c", M, 1, schema), [blob])}, {}).components["c"]


TIMED = KeyedSchema((pa.field("key", pa.string()),), (StateVariable("value", (pa.field("v", pa.int64()),)), TIMERS))


def _set_timer(state: ResidentState, key: str, event_ms: int | None) -> None:
    """Give ``key`` one event-time timer at ``event_ms`` (None: no timer), as a function's write would."""
    group = key_group_for(key, M)
    if event_ms is None:
        state.table.delete(group, (key,), 1)
    else:
        state.table.put(group, (key,), ([event_ms], [], None), 1)


def _recorded(state: ResidentState) -> dict[int, tuple]:
    state.snapshot(max_chain_length=8)
    return dict(state.earliest)


def _true_earliest(state: ResidentState, key_group: int) -> tuple:
    return minima(state.table.values(key_group, 1).values())


def test_recorded_earliest_timers_cost_the_changed_keys_and_are_never_later_than_the_true_ones(store):
    state = ResidentState(TIMED, key_group_range(0, 1, M))
    keys = [f"k{n}" for n in range(400)]
    for n, key in enumerate(keys):
        state.table.put(key_group_for(key, M), (key,), (n,), 0)
        _set_timer(state, key, 1_000 + n)
    first = _recorded(state)  # a key group never recorded: computed over its keys, exact
    assert first == {g: _true_earliest(state, g) for g in first}
    group = key_group_for(keys[0], M)
    size = len(state.table.values(group, 1))
    _set_timer(state, keys[0], 50_000)  # its earliest timer moves later: one changed key of ~100
    stale = _recorded(state)[group]
    assert stale == (1_000, None, None)  # not recomputed over the key group: still the old, earlier time
    assert stale[0] < _true_earliest(state, group)[0]
    _set_timer(state, keys[4], 10)  # an earlier timer lowers it at once
    assert _recorded(state)[group] == (10, None, None)
    mine = [key for key in keys if key_group_for(key, M) == group]
    for key in mine[: size // EXACT_TIMERS_EVERY]:  # a quarter of its keys changed since: recomputed, exact
        _set_timer(state, key, 20_000)
    assert _recorded(state)[group] == _true_earliest(state, group)
    for key in mine:
        _set_timer(state, key, None)  # no timer left: none recorded
    assert _recorded(state)[group] == (None, None, None)


def test_earliest_timers_restored_from_the_store_stay_a_lower_bound_through_random_changes(store):
    import random

    rng = random.Random(7)
    state = ResidentState(TIMED, key_group_range(0, 1, M))
    keys = [f"k{n}" for n in range(300)]
    for key in keys:
        state.table.put(key_group_for(key, M), (key,), (0,), 0)
        _set_timer(state, key, rng.randrange(10_000))
    component = _commit_two(store, 1, state, TIMED)
    stale = 0
    for checkpoint_id in range(2, 12):
        if checkpoint_id == 6:  # a restore: bounds come from the entries' records
            state = ResidentState(TIMED, key_group_range(0, 1, M))
            state.catch_up(store.blobs, component, 0, 1)
            assert state._timer_bounds and all(since == 0 for _, since in state._timer_bounds.values())
        for key in rng.sample(keys, 15):
            _set_timer(state, key, None if rng.random() < 0.3 else rng.randrange(10_000))
        entries = state.snapshot(max_chain_length=8)
        for group, recorded in state.earliest.items():
            truth = _true_earliest(state, group)
            for bound, exact in zip(recorded, truth):
                if exact is not None:  # a kind with timers: recorded, and no later than its earliest
                    assert bound is not None and bound <= exact, (group, recorded, truth)
            stale += recorded != truth
        component = _commit_two(store, checkpoint_id, state, TIMED, entries)
    assert stale  # the run recorded bounds below the true earliest, not only exact ones


def test_a_key_groups_size_for_the_planner_is_its_largest_variables_and_zero_only_when_empty():
    table = ResidentState(TIMED, key_group_range(0, 1, M)).table
    group = key_group_for("a", M)
    same = [key for key in (f"s{n}" for n in range(400)) if key_group_for(key, M) == group][:3]
    for key in same:
        table.put(group, (key,), (1,), 0)
    table.put(group, (same[0],), ([5], [], None), 1)
    assert table.key_count(group) == 3  # the values' keys; the one key with a timer is among them
    for key in same:
        table.delete(group, (key,), 0)
    assert table.key_count(group) == 1  # a timer without a value still holds its key
    table.delete(group, (same[0],), 1)
    assert table.key_count(group) == 0


def test_a_task_reports_how_many_key_groups_it_read_that_its_rows_do_not_touch():
    from spark_state.executor.task import _note_touched

    info: dict = {}
    _note_touched(info, np.array([3, 4, 9], np.int64), np.array([4, 5], np.int64))
    assert info == {"key_groups_touched": 2, "key_groups_read_untouched": 2}  # 3 and 9: a move that read more
    info = {}
    _note_touched(info, np.empty(0, np.int64), np.array([4, 5], np.int64))
    assert info == {"key_groups_touched": 2, "key_groups_read_untouched": 0}  # a lazy restore reads them later
