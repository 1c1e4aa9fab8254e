"""Reading state out of a store without Spark (``spark_state.ops.reader``): state, one key, the change feed."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from spark_state.errors import ConfigError, NoCheckpointError, SavepointNotFoundError
from spark_state.keyspace import KeyGroupRange
from spark_state.ops.reader import read_changes, read_state, split_key_groups
from spark_state.storage.memory import MemoryStorage
from spark_state.store.savepoints import create_savepoint
from tests.stores import Store
from tests.test_manifestlog import COMPONENT, KEYS, Job, M


def as_dict(table: pa.Table) -> dict[str, int]:
    assert table.column_names == ["key", "value"]
    rows = table.to_pylist()
    result = {r["key"]: r["value"] for r in rows}
    assert len(result) == len(rows)  # every key once
    return result


def history(seed: int, checkpoints: int = 12, retained: int = 3) -> tuple[Store, Job]:
    """Random puts and deletes over 96 keys with compaction (chains of at most 3), a rescale, a savepoint at 4."""
    rng = random.Random(seed)
    store = Store(MemoryStorage(), retained=retained)
    job = Job(store, 2, max_chain_length=3)
    keys = [k for g in range(M) for k in KEYS[g]]
    for checkpoint_id in range(1, checkpoints + 1):
        if checkpoint_id == 7:
            job.rescale(3)
        for _ in range(rng.choice([2, 10, 60])):
            key = rng.choice(keys)
            if rng.random() < 0.25:
                job.delete(key)
            else:
                job.put(key, rng.randrange(5))  # small values: some puts rewrite the same value
        job.checkpoint(checkpoint_id)
        if checkpoint_id == 4:
            create_savepoint(store.manifests, "four")
    return store, job


@pytest.mark.parametrize("seed", range(4))
def test_read_state_is_the_committed_state_of_every_restorable_checkpoint(seed):
    store, job = history(seed)
    restorable = store.manifests.restorable()
    assert sorted(restorable) == [4, 10, 11, 12]
    for checkpoint_id in restorable:
        assert as_dict(read_state(store.storage, COMPONENT, checkpoint_id)) == job.committed[checkpoint_id]
    assert as_dict(read_state(store.storage, COMPONENT)) == job.committed[12]
    assert as_dict(read_state(store.storage, COMPONENT, "four")) == job.committed[4]


def test_read_state_of_one_key_reads_its_key_group_only():
    store, job = history(0)
    present = next(iter(job.committed[12]))
    assert read_state(store.storage, COMPONENT, key=present).to_pylist() == [
        {"key": present, "value": job.committed[12][present]}
    ]
    assert read_state(store.storage, COMPONENT, key=("never-seen",)).num_rows == 0
    with pytest.raises(ConfigError, match="has 1 column"):
        read_state(store.storage, COMPONENT, key=("a", "b"))


def test_only_restorable_checkpoints_are_read():
    store, _ = history(1)
    with pytest.raises(NoCheckpointError, match=r"checkpoint 6 .* not restorable.*\[12, 11, 10, 4\]"):
        read_state(store.storage, COMPONENT, 6)
    with pytest.raises(SavepointNotFoundError):
        read_state(store.storage, COMPONENT, "nope")
    with pytest.raises(ConfigError, match="no component 'other'.*'counts'"):
        read_state(store.storage, "other")
    with pytest.raises(NoCheckpointError, match="holds no checkpoint"):
        read_state(MemoryStorage(), COMPONENT)


def apply_changes(state: dict[str, int], changes: pa.Table) -> dict[str, int]:
    state = dict(state)
    ids = changes.column("checkpoint_id").to_pylist()
    assert ids == sorted(ids)
    for row in changes.to_pylist():
        if row["change_type"] == "delete":
            assert row["value"] is None
            del state[row["key"]]
        else:
            assert row["change_type"] == "upsert" and state.get(row["key"]) != row["value"]
            state[row["key"]] = row["value"]
    return state


@pytest.mark.parametrize("seed", range(6))
def test_the_change_feed_from_a_to_b_applied_to_a_gives_b(seed):
    store, job = history(seed)
    committed = job.committed
    for start, end in [(4, 10), (4, 12), (10, 11), (11, 12), (10, 12), ("four", None)]:
        changes = read_changes(store.storage, COMPONENT, start, end)
        a = 4 if start == "four" else start
        b = 12 if end is None else end
        assert changes.column_names == ["change_type", "checkpoint_id", "key", "value"]
        assert apply_changes(committed[a], changes) == committed[b], (start, end)
        assert all(a < c <= b for c in changes.column("checkpoint_id").to_pylist())
    # consecutive restorable checkpoints: exactly the keys whose value changed, each at that checkpoint
    for a, b in [(10, 11), (11, 12)]:
        changes = read_changes(store.storage, COMPONENT, a, b).to_pylist()
        changed = {k for k in committed[a].keys() | committed[b].keys() if committed[a].get(k) != committed[b].get(k)}
        assert sorted(r["key"] for r in changes) == sorted(changed)
        assert {r["checkpoint_id"] for r in changes} <= {b}


def test_the_change_feed_splits_by_key_group_ranges():
    store, job = history(2)
    whole = read_changes(store.storage, COMPONENT, 4, 12)
    parts = [read_changes(store.storage, COMPONENT, 4, 12, key_groups=KeyGroupRange(s, e)) for s, e in [(0, 2), (3, 7)]]
    assert sorted(map(str, whole.to_pylist())) == sorted(str(r) for p in parts for r in p.to_pylist())
    with pytest.raises(ConfigError, match="start checkpoint before its end"):
        read_changes(store.storage, COMPONENT, 12, 4)


def test_key_group_ranges_for_parallel_reads_cover_the_state_once():
    store, job = history(3)
    component = store.latest().components[COMPONENT]
    for parts in (1, 2, 3, 8):
        pieces = split_key_groups(component, parts)
        assert 1 <= len(pieces) <= parts
        covered = [g for p in pieces for g in p.plan.chains]
        assert sorted(covered) == sorted(component.chains)
        ranges = [p.key_group_range for p in pieces]
        assert all(a.end < b.start for a, b in zip(ranges, ranges[1:]))


def test_state_in_an_older_schema_reads_in_the_current_one_and_timers_on_request():
    from spark_state.model.timers import TIMERS  # noqa: F401 - the timers variable of V_TIMERS
    from tests.test_evolution import V1, V2, schema
    from tests.test_evolution import Job as EvolvingJob

    store = Store(MemoryStorage())
    job = EvolvingJob(store, V1, 2)
    for i in range(30):
        job.put(f"u{i}", (i, f"l{i}"))
    job.checkpoint(1)
    with_timers = schema(*V2.value.fields, timers=True)
    job.restart(with_timers, 3)
    table = job.instances[0].table
    g, key, _ = next(table.items())
    table.put(g, key, ([5], [], None), variable=1)  # one key gets an event-time timer
    job.checkpoint(2)
    state = read_state(store.storage, "c")
    assert state.column_names == ["user", "count", "label", "total"]
    assert state.schema.field("count").type == pa.int64() and state.schema.field("label").type == pa.large_string()
    assert sorted(state.to_pylist(), key=lambda r: int(r["user"][1:])) == [
        {"user": f"u{i}", "count": i, "label": f"l{i}", "total": 7} for i in range(30)
    ]
    timed = read_state(store.storage, "c", timers=True)
    assert timed.column_names[-3:] == ["timers_event", "timers_processing", "timers_expires"]
    assert [r["timers_event"] for r in timed.to_pylist() if r["timers_event"]] == [[5]]
    changes = read_changes(store.storage, "c", 1, 2, timers=True).to_pylist()
    assert [(c["change_type"], c["user"], c["timers_event"]) for c in changes] == [("upsert", key[0], [5])]
    assert read_changes(store.storage, "c", 1, 2).num_rows == 0  # the value did not change
