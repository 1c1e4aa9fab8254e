"""Resident state catching up with the store: delta suffixes, diverged attempts, clears."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest

from spark_state.checkpoint import CheckpointStore
from spark_state.errors import KeyGroupOwnershipError
from spark_state.keygroups import key_group_for, key_group_range
from spark_state.keyed_state import InstanceState, StateLayout, checkpoint_instance
from spark_state.storage.memory import MemoryStorage

M = 4
LAYOUT = StateLayout(pa.schema([("key", pa.string()), ("value", pa.int64())]), ("key",))


def _contents(state: InstanceState) -> dict[str, int]:
    return {key[0]: value[0] for _, key, value in state.items()}


def _commit(store: CheckpointStore, checkpoint_id: int, state: InstanceState, parallelism: int = 1):
    ref = checkpoint_instance(store, "c", checkpoint_id, 0, state, max_chain_length=10)
    spec = LAYOUT.spec("c", parallelism, M)
    return store.commit(checkpoint_id, {"c": (spec, [ref] if ref else [])}, {}).components["c"]


@pytest.fixture
def store() -> CheckpointStore:
    return CheckpointStore(MemoryStorage(), retained=5)


def _dense_state() -> InstanceState:
    state = InstanceState(LAYOUT, key_group_range(0, 1, M))
    for n in range(200):
        key = f"k{n}"
        state.put(key_group_for(key, M), (key,), (n,))
    return state


def _put(state: InstanceState, key: str, value: int) -> None:
    state.put(key_group_for(key, M), (key,), (value,))


def test_stale_resident_state_reads_only_the_missing_deltas(store):
    live = _dense_state()
    _commit(store, 1, live)
    stale = copy.deepcopy(live)
    _put(live, "k1", 1000)
    live.delete(key_group_for("k2", M), ("k2",))
    _commit(store, 2, live)
    _put(live, "new", 7)
    component = _commit(store, 3, live)

    plan, stats = stale.catch_up(store, component, 0, 1)

    touched = {key_group_for(k, M) for k in ("k1", "k2", "new")}
    assert set(plan.appends) == touched and set(plan.chains) == touched
    assert all(entry.kind == "delta" for links in plan.chains.values() for _, entry in links)
    full_size = sum(b.size for b in component.blobs.values() if b.checkpoint_id == 1)
    assert stats.bytes_read < full_size / 4
    expected = {f"k{n}": n for n in range(200)} | {"k1": 1000, "new": 7}
    del expected["k2"]
    assert _contents(stale) == expected == _contents(live)
    assert stale.chains() == {g: component.chains.get(g, ()) for g in stale.chains()}


def test_uncommitted_attempt_is_reloaded_not_trusted(store):
    live = _dense_state()
    component = _commit(store, 1, live)
    _put(live, "k3", -1)
    checkpoint_instance(store, "c", 2, 0, live, max_chain_length=10)  # written, never committed
    _put(live, "k4", -1)  # changed, never snapshotted

    plan, _ = live.catch_up(store, component, 0, 1)

    changed = {key_group_for("k3", M), key_group_for("k4", M)}
    assert changed <= set(plan.chains) and not (changed & set(plan.appends))
    assert _contents(live) == {f"k{n}": n for n in range(200)}


def test_key_group_emptied_in_store_is_cleared_in_memory(store):
    state = InstanceState(LAYOUT, key_group_range(0, 1, M))
    _put(state, "only", 1)
    _commit(store, 1, state)
    stale = copy.deepcopy(state)
    state.delete(key_group_for("only", M), ("only",))
    component = _commit(store, 2, state)

    plan, _ = stale.catch_up(store, component, 0, 1)

    assert plan.clear == frozenset({key_group_for("only", M)})
    assert _contents(stale) == {}


def test_catch_up_refuses_another_instances_range(store):
    state = _dense_state()
    component = _commit(store, 1, state)
    with pytest.raises(KeyGroupOwnershipError, match="owns"):
        state.catch_up(store, component, 0, 2)


# Non-keyed per-instance state ------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from spark_state.keyed_state import checkpoint_instance_items, redistribute_items  # noqa: E402


@given(
    old=st.lists(st.lists(st.integers(), max_size=6), min_size=1, max_size=8),
    new_parallelism=st.integers(1, 9),
)
def test_redistribution_keeps_every_item_once_in_order(old, new_parallelism):
    new = redistribute_items(dict(enumerate(old)), len(old), new_parallelism)
    assert len(new) == new_parallelism
    assert [x for part in new for x in part] == [x for part in old for x in part]
    sizes = [len(part) for part in new]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_redistribution_rejects_items_of_unknown_instances():
    with pytest.raises(KeyGroupOwnershipError):
        redistribute_items({3: ["x"]}, 3, 2)


def _commit_items(store, checkpoint_id, states, parallelism):
    paths = {}
    for i, state in enumerate(states):
        path = checkpoint_instance_items(store, "c", checkpoint_id, i, state)
        if path:
            paths[i] = path
    spec = LAYOUT.spec("c", parallelism, M)
    return store.commit(checkpoint_id, {"c": (spec, [])}, {}, instance_state={"c": paths}).components["c"]


def _states(parallelism):
    return [InstanceState(LAYOUT, key_group_range(i, parallelism, M)) for i in range(parallelism)]


def test_instance_items_are_split_and_merged_on_rescale_never_dropped(store):
    three = _states(3)
    for i, state in enumerate(three):
        state.instance_items.extend([f"{i}-{n}" for n in range(i + 1)])  # 1, 2 and 3 items
    component = _commit_items(store, 1, three, 3)

    two = _states(2)
    for j, state in enumerate(two):
        state.catch_up_items(store, component, j, 2)
    assert [s.instance_items.to_list() for s in two] == [["0-0", "1-0", "1-1"], ["2-0", "2-1", "2-2"]]
    component = _commit_items(store, 2, two, 2)  # redistributed items are rewritten at the new parallelism
    assert sorted(component.instance_state) == [0, 1]

    four = _states(4)
    for j, state in enumerate(four):
        state.catch_up_items(store, component, j, 4)
    merged = [item for s in four for item in s.instance_items]
    assert merged == ["0-0", "1-0", "1-1", "2-0", "2-1", "2-2"]


def test_unchanged_items_are_not_rewritten_and_resident_items_are_not_reread(store):
    states = _states(1)
    states[0].instance_items.append("watermark")
    component = _commit_items(store, 1, states, 1)
    assert checkpoint_instance_items(store, "c", 2, 0, states[0]) is None
    assert states[0].catch_up_items(store, component, 0, 1) == 0
    fresh = _states(1)[0]
    assert fresh.catch_up_items(store, component, 0, 1) > 0
    assert fresh.instance_items.to_list() == ["watermark"]


def test_restore_folds_a_key_group_only_when_it_is_first_accessed(store):
    live = _dense_state()
    _commit(store, 1, live)
    _put(live, "k1", 1000)
    live.delete(key_group_for("k2", M), ("k2",))
    _put(live, "new", 7)
    component = _commit(store, 2, live)  # chains: full, then a delta with a tombstone in some key groups

    restored = InstanceState(LAYOUT, key_group_range(0, 1, M))
    restored.catch_up(store, component, 0, 1)

    assert restored._groups == {} and set(restored._unloaded) == set(range(M))  # nothing folded yet
    assert len(restored) == len(live) == 200  # counted from the Arrow batches: 200 - k2 + new
    assert restored._groups == {}
    g = key_group_for("k1", M)
    assert restored.get(g, ("k1",)) == (1000,)
    assert set(restored._groups) == {g} and g not in restored._unloaded
    assert restored.chains() == {k: component.chains[k] for k in range(M)}  # folding keeps the chain
    # a put into an unloaded key group keeps the rest of the group
    _put(restored, "k5", 55)
    _put(live, "k5", 55)
    assert _contents(restored) == _contents(live)


def test_a_chain_not_starting_with_a_full_entry_is_refused_at_restore(store, monkeypatch):
    live = _dense_state()
    component = _commit(store, 1, live)
    real = CheckpointStore.fetch_entries

    def deltas_only(self, *args, **kwargs):
        entries, stats = real(self, *args, **kwargs)
        return {g: [("delta", batch) for _, batch in batches] for g, batches in entries.items()}, stats

    monkeypatch.setattr(CheckpointStore, "fetch_entries", deltas_only)
    with pytest.raises(ValueError, match="must start with a full entry"):
        InstanceState(LAYOUT, key_group_range(0, 1, M)).catch_up(store, component, 0, 1)
