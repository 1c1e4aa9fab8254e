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
