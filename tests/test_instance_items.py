"""Instance items (non-keyed state): split and merged on rescale, never dropped, checksummed in the store."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spark_state.errors import CorruptBlobError, KeyGroupOwnershipError
from spark_state.executor.resident import ResidentState
from spark_state.keyspace import key_group_range
from spark_state.model.instance_items import redistribute_items
from spark_state.model.schema import KeyedSchema
from spark_state.storage.memory import MemoryStorage
from spark_state.store.manifest import ComponentSpec
from tests.stores import Store

M = 4
SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])


@pytest.fixture
def store() -> Store:
    return Store(MemoryStorage(), retained=5)


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
    refs = {}
    for i, state in enumerate(states):
        _, ref = state.checkpoint(store.blobs, "c", checkpoint_id, i)
        if ref:
            refs[i] = ref
    spec = ComponentSpec("c", M, parallelism, SCHEMA)
    return store.commit(checkpoint_id, {"c": (spec, [])}, {}, items={"c": refs}).components["c"]


def _states(parallelism):
    return [ResidentState(SCHEMA, key_group_range(i, parallelism, M)) for i in range(parallelism)]


def test_instance_items_are_split_and_merged_on_rescale_never_dropped(store):
    three = _states(3)
    for i, state in enumerate(three):
        state.items.extend([f"{i}-{n}" for n in range(i + 1)])  # 1, 2 and 3 items
    component = _commit_items(store, 1, three, 3)

    two = _states(2)
    for j, state in enumerate(two):
        state.catch_up(store.blobs, component, j, 2)
    assert [s.items.to_list() for s in two] == [["0-0", "1-0", "1-1"], ["2-0", "2-1", "2-2"]]
    component = _commit_items(store, 2, two, 2)  # redistributed items are rewritten at the new parallelism
    assert sorted(component.instance_items) == [0, 1]

    four = _states(4)
    for j, state in enumerate(four):
        state.catch_up(store.blobs, component, j, 4)
    merged = [item for s in four for item in s.items]
    assert merged == ["0-0", "1-0", "1-1", "2-0", "2-1", "2-2"]


def test_unchanged_items_are_not_rewritten_and_resident_items_are_not_reread(store):
    states = _states(1)
    states[0].items.append("watermark")
    component = _commit_items(store, 1, states, 1)
    assert states[0].checkpoint(store.blobs, "c", 2, 0) == (None, None)
    assert states[0].catch_up(store.blobs, component, 0, 1).items_bytes == 0
    fresh = _states(1)[0]
    assert fresh.catch_up(store.blobs, component, 0, 1).items_bytes > 0
    assert fresh.items.to_list() == ["watermark"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "not-a-list"])
def test_damaged_items_are_never_served(store, damage):
    states = _states(1)
    states[0].items.extend(["a", "b"])
    component = _commit_items(store, 1, states, 1)
    ref = component.instance_items[0]
    data = store.storage.read(ref.path)
    damaged = {"flip": data[:3] + b"X" + data[4:], "truncate": data[:-2], "not-a-list": b'{"a":1}'}[damage]
    store.storage.create(ref.path, damaged, overwrite=True)
    with pytest.raises(CorruptBlobError, match=ref.path):
        _states(1)[0].catch_up(store.blobs, component, 0, 1)
