"""Tests of spark_state.store.restore: the pure restore plan and the fold of chains (no Spark, no storage).

Manifests are built two ways: synthetically (one ``BlobRef`` per old instance
with a made-up index, fed through ``manifest.next_component``) for exhaustive
sweeps over small key spaces, and from real ``ResidentState.snapshot`` blobs
over several checkpoints and a rescale, decoded through the plan and compared
with a dict model.
"""

from __future__ import annotations

import random
import zlib

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import CheckpointError, CorruptBlobError, InvalidParallelismError
from spark_state.executor.resident import ResidentState
from spark_state.keyspace import KeyGroupRange, instance_for_key_group, key_group_range
from spark_state.model.schema import KeyedSchema, StateVariable
from spark_state.store.blob import BlobEntry, BlobIndex, decode_entry, encode_blob
from spark_state.store.manifest import BlobRef, ComponentManifest, ComponentSpec, ComponentUpdate, next_component
from spark_state.store.restore import (
    InstanceRestorePlan,
    apply_entries,
    fold_chain,
    plan_instance_restore,
    plan_restore,
)

SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])
HEADER = 600  # synthetic blobs: bytes before the first entry


# --------------------------------------------------------------------------- synthetic manifests


def _entry_length(key_group: int) -> int:
    return 200 + (key_group * 37) % 101  # varied, so a wrong entry cannot add up to the right bytes


def _synthetic_blob(checkpoint_id: int, instance: int, owned: KeyGroupRange, with_state, gaps=None) -> BlobRef:
    """A blob of instance ``instance`` with one full entry per key group in ``with_state``.

    ``gaps[g]`` bytes (default 0) separate entry ``g`` from the one before it.
    """
    entries = []
    offset = HEADER
    for g in sorted(with_state):
        offset += (gaps or {}).get(g, 0)
        length = _entry_length(g)
        entries.append(BlobEntry(g, "full", offset, length, 1 + g % 3, g * 7919 % 2**32))
        offset += length
    path = f"blobs/c/{checkpoint_id:020d}/{instance:05d}-{owned.start}-{owned.end}-x.arrow"
    return BlobRef(path, checkpoint_id, instance, owned, offset + 400, instance, BlobIndex(tuple(entries)))


def _single_snapshot(max_parallelism: int, parallelism: int, with_state: set[int]) -> ComponentManifest:
    spec = ComponentSpec("c", max_parallelism, parallelism, SCHEMA)
    blobs = []
    for i in range(parallelism):
        owned = key_group_range(i, parallelism, max_parallelism)
        mine = [g for g in owned if g in with_state]
        if mine:  # an instance without state writes no blob
            blobs.append(_synthetic_blob(1, i, owned, mine))
    return next_component(None, 1, ComponentUpdate(spec, blobs))


def _state_pattern(max_parallelism: int, parallelism: int) -> set[int]:
    """Most key groups have state, with irregular holes (depending on both arguments)."""
    return {g for g in range(max_parallelism) if (g * 5 + parallelism * 3) % 7 not in (0, 4)}


def _check_single_snapshot_plans(component: ComponentManifest, new_parallelism: int, with_state: set[int]) -> None:
    m = component.max_parallelism
    old_p = component.parallelism
    path_of = {b.instance: b.path for b in component.blobs.values()}
    plans = plan_restore(component, new_parallelism)
    assert [p.instance for p in plans] == list(range(new_parallelism))
    covered: list[int] = []
    for plan in plans:
        owned = key_group_range(plan.instance, new_parallelism, m)
        assert plan.key_group_range == owned
        expected_groups = sorted(g for g in owned if g in with_state)
        assert sorted(plan.chains) == expected_groups
        covered.extend(plan.chains)
        for g, links in plan.chains.items():
            assert len(links) == 1
            path, entry = links[0]
            assert path == path_of[instance_for_key_group(g, old_p, m)]
            assert (entry.key_group, entry.kind) == (g, "full")
        # the reads fetch exactly the chains' entries, each byte once
        read_entries = sorted((r.path, e.key_group) for r in plan.reads for e in r.entries)
        assert read_entries == sorted((links[0][0], g) for g, links in plan.chains.items())
        owned_bytes = sum(_entry_length(g) for g in expected_groups)
        assert plan.bytes_owned == owned_bytes
        assert plan.bytes_to_read == owned_bytes
        for read in plan.reads:
            assert read.offset == read.entries[0].offset
            assert read.length == sum(e.length for e in read.entries)
        # one read per old blob holding some of the owned key groups, never more
        holding = {path_of[instance_for_key_group(g, old_p, m)] for g in expected_groups}
        intersecting = {b.path for b in component.blobs.values() if b.key_group_range.intersection(owned) is not None}
        assert sorted(r.path for r in plan.reads) == sorted(holding)
        assert len(plan.reads) <= len(intersecting)
    assert len(covered) == len(set(covered))
    assert set(covered) == with_state


@pytest.mark.parametrize("max_parallelism", [1, 2, 7, 16, 37])
def test_every_rescale_of_a_small_key_space(max_parallelism):
    for old_p in range(1, max_parallelism + 1):
        with_state = _state_pattern(max_parallelism, old_p)
        component = _single_snapshot(max_parallelism, old_p, with_state)
        for new_p in range(1, max_parallelism + 1):
            _check_single_snapshot_plans(component, new_p, with_state)


def test_every_key_group_with_state_in_a_small_key_space():
    """All 2**7 subsets of key groups with state, every old and new parallelism."""
    m = 7
    for mask in range(2**m):
        with_state = {g for g in range(m) if mask >> g & 1}
        for old_p in (1, 3, 7):
            component = _single_snapshot(m, old_p, with_state)
            for new_p in range(1, m + 1):
                _check_single_snapshot_plans(component, new_p, with_state)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), max_parallelism=st.integers(38, 1024))
def test_rescale_property_for_larger_key_spaces(data, max_parallelism):
    old_p = data.draw(st.integers(1, min(max_parallelism, 64)), label="old parallelism")
    new_p = data.draw(st.integers(1, min(max_parallelism, 64)), label="new parallelism")
    density = data.draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]), label="density")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    with_state = {g for g in range(max_parallelism) if (g * 2654435761 + seed) % 1000 < density * 1000}
    component = _single_snapshot(max_parallelism, old_p, with_state)
    _check_single_snapshot_plans(component, new_p, with_state)


def test_empty_component_plans_no_reads():
    component = _single_snapshot(16, 4, set())
    assert component.blobs == {}
    for plan in plan_restore(component, 3):
        assert (plan.reads, plan.chains, plan.bytes_owned, plan.bytes_to_read) == ((), {}, 0, 0)


@pytest.mark.parametrize("parallelism", [0, 17, -1])
def test_parallelism_out_of_range_is_rejected(parallelism):
    component = _single_snapshot(16, 4, {1, 2})
    with pytest.raises(InvalidParallelismError):
        plan_restore(component, parallelism)


def test_plan_instance_restore_matches_plan_restore():
    component = _single_snapshot(37, 5, _state_pattern(37, 5))
    plans = plan_restore(component, 6)
    for j in range(6):
        assert plan_instance_restore(component, j, 6) == plans[j]


# --------------------------------------------------------------------------- gaps and coalescing


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.integers(0, 500), min_size=1, max_size=20),
    max_gap=st.integers(0, 600),
)
def test_max_gap_merges_reads_and_costs_exactly_the_gaps(gaps, max_gap):
    """One old blob, its entries separated by ``gaps``; one new instance reads them all."""
    m = len(gaps)
    owned = KeyGroupRange(0, m - 1)
    blob = _synthetic_blob(1, 0, owned, range(m), gaps=dict(enumerate(gaps)))
    component = next_component(None, 1, ComponentUpdate(ComponentSpec("c", m, 1, SCHEMA), [blob]))
    plan = plan_instance_restore(component, 0, 1, max_gap_bytes=max_gap)
    inner = gaps[1:]  # the gap before the first entry is never read
    assert plan.bytes_owned == sum(_entry_length(g) for g in range(m))
    assert plan.bytes_to_read == plan.bytes_owned + sum(g for g in inner if g <= max_gap)
    assert len(plan.reads) == 1 + sum(1 for g in inner if g > max_gap)
    assert [e.key_group for r in plan.reads for e in r.entries] == list(range(m))
    for read in plan.reads:
        assert read.offset == read.entries[0].offset
        assert read.offset + read.length == read.entries[-1].offset + read.entries[-1].length


def test_gap_from_a_superseded_entry_is_bridged_only_when_allowed():
    """Key group 2 got a new full entry in checkpoint 2: checkpoint 1's blob now has a hole."""
    m = 4
    spec = ComponentSpec("c", m, 1, SCHEMA)
    first = _synthetic_blob(1, 0, KeyGroupRange(0, 3), [1, 2, 3])
    second = _synthetic_blob(2, 0, KeyGroupRange(0, 3), [2])
    component = next_component(
        next_component(None, 1, ComponentUpdate(spec, [first])), 2, ComponentUpdate(spec, [second])
    )
    assert component.chains == {1: (first.path,), 2: (second.path,), 3: (first.path,)}
    hole = _entry_length(2)
    tight = plan_instance_restore(component, 0, 1)
    assert sorted((r.path, len(r.entries)) for r in tight.reads) == sorted(
        [(first.path, 1), (first.path, 1), (second.path, 1)]
    )
    assert tight.bytes_to_read == tight.bytes_owned == _entry_length(1) + 2 * _entry_length(2) + _entry_length(3) - hole
    for max_gap in (hole - 1, hole, 10**6):
        loose = plan_instance_restore(component, 0, 1, max_gap_bytes=max_gap)
        merged = max_gap >= hole
        assert len(loose.reads) == (2 if merged else 3)
        assert loose.bytes_owned == tight.bytes_owned
        assert loose.bytes_to_read == tight.bytes_owned + (hole if merged else 0)


# --------------------------------------------------------------------------- real chains


class _Job:
    """Instances of one component plus a dict model, snapshotting into real blobs (no storage)."""

    def __init__(self, max_parallelism: int, parallelism: int, max_chain_length: int):
        self.m = max_parallelism
        self.max_chain_length = max_chain_length
        self.files: dict[str, bytes] = {}
        self.component: ComponentManifest | None = None
        self.model: dict[int, dict[str, int]] = {}  # key group -> key -> value
        self.history: list[tuple[int, ComponentManifest, dict]] = []
        self._start(parallelism)

    def _start(self, parallelism: int) -> None:
        self.p = parallelism
        self.instances = []
        for i in range(parallelism):
            state = ResidentState(SCHEMA, key_group_range(i, parallelism, self.m))
            for g in state.key_group_range:
                if g in self.model and self.component is not None:
                    for key, value in self.model[g].items():
                        state.table.put(g, (key,), (value,))
                    state.chains.set(g, self.component.chains.get(g, ()))
            state.table.take_changes()  # loaded, not changed
            self.instances.append(state)

    def rescale(self, parallelism: int) -> None:
        self._start(parallelism)

    def put(self, g: int, key: str, value: int) -> None:
        self.instances[instance_for_key_group(g, self.p, self.m)].table.put(g, (key,), (value,))
        self.model.setdefault(g, {})[key] = value

    def delete(self, g: int, key: str) -> None:
        self.instances[instance_for_key_group(g, self.p, self.m)].table.delete(g, (key,))
        self.model.get(g, {}).pop(key, None)
        if g in self.model and not self.model[g]:
            del self.model[g]

    def checkpoint(self, checkpoint_id: int) -> dict[int, list[tuple[int, str]]]:
        """Snapshot every instance; return key group -> [(checkpoint_id, kind)] written now."""
        written = {}
        blobs = []
        for i, state in enumerate(self.instances):
            entries = state.snapshot(max_chain_length=self.max_chain_length)
            if not entries:
                continue
            data, index = encode_blob(SCHEMA.blob_schema, entries, key_group_range=state.key_group_range, metadata={})
            path = f"blobs/c/{checkpoint_id:020d}/{i:05d}.arrow"
            state.chains.record(path)
            self.files[path] = data
            blobs.append(BlobRef(path, checkpoint_id, i, state.key_group_range, len(data), zlib.crc32(data), index))
            for g, kind, _ in entries:
                written[g] = kind
        spec = ComponentSpec("c", self.m, self.p, SCHEMA)
        self.component = next_component(self.component, checkpoint_id, ComponentUpdate(spec, blobs))
        self.history.append((checkpoint_id, self.component, {g: dict(kv) for g, kv in self.model.items()}))
        return written


def _fetch(files: dict[str, bytes], component: ComponentManifest, plan: InstanceRestorePlan) -> dict[int, dict]:
    """Execute a plan against in-memory files: only the planned byte ranges are sliced."""
    schema = component.keyed_schema.blob_schema
    decoded = {}
    for read in plan.reads:
        data = files[read.path][read.offset : read.offset + read.length]
        assert len(data) == read.length
        for entry in read.entries:
            start = entry.offset - read.offset
            decoded[(read.path, entry.key_group)] = decode_entry(data[start : start + entry.length], schema, entry)
    result = {}
    for g, links in plan.chains.items():
        groups = [{}]
        apply_entries(groups, [(entry.kind, decoded[(path, g)]) for path, entry in links], SCHEMA, whole_chain=True)
        result[g] = {key[0]: value[0] for key, value in groups[0].items()}
    return result


def _run_job(max_chain_length: int = 4) -> _Job:
    """Ten checkpoints over 16 key groups: parallelism 2, then 3, then 1; puts, overwrites, deletes."""
    job = _Job(16, 2, max_chain_length)
    checkpoint_id = 0
    for round_ in range(10):
        if round_ == 4:
            job.rescale(3)
        if round_ == 7:
            job.rescale(1)
        for g in range(16):
            if g == 5:  # key group 5 is written once and never touched again
                if round_ == 0:
                    for k in range(3):
                        job.put(g, f"k{k}", k)
                continue
            if g == 9:  # key group 9 gets one small change per checkpoint: a long delta chain
                for k in range(8) if round_ == 0 else ():
                    job.put(g, f"base{k}", k)
                job.put(g, f"k{round_}", round_)
                continue
            if (g + round_) % 3 == 0:
                for k in range(6):
                    job.put(g, f"k{k}", round_ * 100 + k)  # everything changes: full entry
            elif (g * round_) % 4 == 1:
                job.put(g, f"k{round_ % 6}", -round_)  # one key: delta
            elif (g + round_) % 5 == 2 and g in job.model:
                job.delete(g, sorted(job.model[g])[0])
            if g == 11 and round_ == 6:
                for key in list(job.model.get(11, {})):
                    job.delete(11, key)  # key group 11 becomes empty
        checkpoint_id += 1
        job.checkpoint(checkpoint_id)
    return job


def test_chains_are_planned_oldest_first_full_then_a_merge_or_deltas():
    job = _run_job()
    component = job.component
    assert any(len(chain) > 1 for chain in component.chains.values())  # the scenario has deltas
    merges = 0
    for new_p in range(1, 17):
        for plan in plan_restore(component, new_p):
            for g, links in plan.chains.items():
                ids = [component.blobs[path].checkpoint_id for path, _ in links]
                assert ids == sorted(ids) and len(set(ids)) == len(ids)
                kinds = [entry.kind for _, entry in links]
                merges += kinds[1:2] == ["merge"]
                assert kinds[0] == "full" and set(kinds[1:2]) <= {"delta", "merge"} and set(kinds[2:]) <= {"delta"}
                assert [path for path, _ in links] == list(component.chains[g])
                assert all(entry.key_group == g for _, entry in links)


def test_untouched_key_group_keeps_its_first_blob():
    job = _run_job()
    (path,) = job.component.chains[5]
    assert job.component.blobs[path].checkpoint_id == 1


@pytest.mark.parametrize("max_gap", [0, 700, 10**9])
def test_every_checkpoint_of_a_rescaled_chain_restores_exactly(max_gap):
    job = _run_job()
    for checkpoint_id, component, model in job.history:
        for new_p in (1, 2, 3, 5, 16):
            restored = {}
            for plan in plan_restore(component, new_p, max_gap_bytes=max_gap):
                assert plan.bytes_to_read >= plan.bytes_owned
                for read in plan.reads:  # within a read, gaps are at most max_gap
                    for a, b in zip(read.entries, read.entries[1:]):
                        assert 0 <= b.offset - (a.offset + a.length) <= max_gap
                by_path: dict[str, list] = {}
                for read in plan.reads:
                    by_path.setdefault(read.path, []).append(read)
                for reads in by_path.values():  # reads of one blob could not have been merged
                    reads.sort(key=lambda r: r.offset)
                    for a, b in zip(reads, reads[1:]):
                        assert b.offset - (a.offset + a.length) > max_gap
                part = _fetch(job.files, component, plan)
                assert not set(part) & set(restored)
                restored.update(part)
            assert restored == model, (checkpoint_id, new_p)


def test_chains_never_exceed_max_chain_length():
    for limit in (1, 2, 3):
        job = _run_job(max_chain_length=limit)
        longest = max(len(chain) for _, component, _ in job.history for chain in component.chains.values())
        assert longest == limit  # reached (the scenario has long delta runs), never exceeded
        if limit == 1:
            assert all(e.kind == "full" for b in job.component.blobs.values() for e in b.index.entries)


def test_delta_without_base_state_is_rejected_but_an_empty_one_is_ignored():
    spec = ComponentSpec("c", 4, 1, SCHEMA)
    schema = SCHEMA.blob_schema
    empty = SCHEMA.rows_to_columns([], [[]], [])
    one = SCHEMA.rows_to_columns([("a",)], [[(1,)]], [False])

    def ref(checkpoint_id, entries):
        data, index = encode_blob(schema, entries, key_group_range=KeyGroupRange(0, 3), metadata={})
        return BlobRef(f"b{checkpoint_id}", checkpoint_id, 0, KeyGroupRange(0, 3), len(data), zlib.crc32(data), index)

    base = next_component(None, 1, ComponentUpdate(spec, [ref(1, [(1, "full", one)])]))
    with pytest.raises(CheckpointError, match="delta entry for key group 2, which has no base state"):
        next_component(base, 2, ComponentUpdate(spec, [ref(2, [(2, "delta", one)])]))
    after = next_component(base, 2, ComponentUpdate(spec, [ref(2, [(1, "delta", one), (2, "delta", empty)])]))
    assert after.chains == {1: ("b1", "b2")}
    for plan in plan_restore(after, 2):
        for links in plan.chains.values():
            assert links[0][1].kind == "full"


def test_a_merge_entry_replaces_the_deltas_after_the_full_entry_and_needs_a_base():
    spec = ComponentSpec("c", 4, 1, SCHEMA)
    schema = SCHEMA.blob_schema

    def rows(*pairs, deleted=()):
        keys = [(k,) for k, _ in pairs]
        table = SCHEMA.rows_to_columns(keys, [[(v,) for _, v in pairs]], [k in deleted for k, _ in pairs])
        return table.combine_chunks().to_batches()[0]

    def ref(checkpoint_id, entries):
        data, index = encode_blob(schema, entries, key_group_range=KeyGroupRange(0, 3), metadata={})
        return BlobRef(f"b{checkpoint_id}", checkpoint_id, 0, KeyGroupRange(0, 3), len(data), zlib.crc32(data), index)

    component = next_component(
        None, 1, ComponentUpdate(spec, [ref(1, [(1, "full", rows(("a", 1), ("b", 2), ("c", 3)))])])
    )
    component = next_component(component, 2, ComponentUpdate(spec, [ref(2, [(1, "delta", rows(("a", 10)))])]))
    component = next_component(
        component, 3, ComponentUpdate(spec, [ref(3, [(1, "delta", rows(("b", 0), deleted={"b"}))])])
    )
    assert component.chains == {1: ("b1", "b2", "b3")}
    merged = rows(("a", 10), ("b", 0), ("d", 4), deleted={"b"})  # every key changed since the full entry
    component = next_component(component, 4, ComponentUpdate(spec, [ref(4, [(1, "merge", merged)])]))
    assert component.chains == {1: ("b1", "b4")} and sorted(component.blobs) == ["b1", "b4"]
    live = fold_chain([("full", rows(("a", 1), ("b", 2), ("c", 3))), ("merge", merged)], SCHEMA.key_columns)
    assert dict(
        zip(live.column("key").to_pylist(), [v["value"] for v in live.column("_spark_state_value").to_pylist()])
    ) == {"a": 10, "c": 3, "d": 4}
    with pytest.raises(CheckpointError, match="merge entry for key group 2, which has no base state"):
        next_component(component, 5, ComponentUpdate(spec, [ref(5, [(2, "merge", rows(("x", 1)))])]))


# --------------------------------------------------------------------------- the fold of chains
#
# Two forms of one rule: ``fold_chain`` (Arrow) and ``apply_entries`` (row by row onto dicts). Both are
# checked against ``reference_fold``, the rule written plainly: a key's last occurrence wins and moves to
# the end, a tombstone removes the key.

TWO = KeyedSchema(
    (pa.field("key", pa.string()),),
    (StateVariable("value", (pa.field("value", pa.int64()),)), StateVariable("extra", (pa.field("n", pa.int64()),))),
)


def _batch(rows: list[tuple[str, int | None, bool]], schema: KeyedSchema = SCHEMA) -> pa.RecordBatch:
    """Rows ``(key, value, deleted)``; a None value on a live row is a null value column (not an absent one)."""
    keys = [(k,) for k, _, _ in rows]
    values = [[None if d else (v,) for _, v, d in rows]] + [[None] * len(rows)] * (len(schema.variables) - 1)
    batches = schema.rows_to_columns(keys, values, [d for _, _, d in rows]).combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=schema.blob_schema)


def reference_fold(chain) -> list[tuple]:
    state: dict = {}
    for _, batch in chain:
        for row in batch.to_pylist():
            key = row["key"]
            state.pop(key, None)
            if not row["_deleted"]:
                state[key] = row["_spark_state_value"]["value"]
    return list(state.items())


def _folded(chain, schema: KeyedSchema = SCHEMA) -> list[tuple]:
    """Both forms of the fold, checked to agree with each other and with the reference."""
    table = fold_chain(chain, schema.key_columns)
    arrow = [(row["key"], row["_spark_state_value"]["value"]) for row in table.to_pylist()]
    groups = [{} for _ in schema.variables]
    apply_entries(groups, chain, schema, whole_chain=True)
    rows = [(key[0], value[0]) for key, value in groups[0].items()]
    assert arrow == rows == reference_fold(chain)
    return rows


def test_fold_full_only():
    chain = [("full", _batch([("a", 1, False), ("b", None, False)]))]
    assert fold_chain(chain, ("key",)).column_names == ["key", "_spark_state_value"]
    assert _folded(chain) == [("a", 1), ("b", None)]


def test_fold_full_then_deltas_last_write_wins_and_tombstones_delete():
    chain = [
        ("full", _batch([("a", 1, False), ("b", 2, False), ("c", 3, False)])),
        ("delta", _batch([("b", 20, False), ("d", 4, False)])),
        ("delta", _batch([("a", None, True), ("b", 200, False)])),
        ("delta", _batch([("c", None, True), ("zz", None, True)])),  # zz never existed
    ]
    assert sorted(_folded(chain)) == [("b", 200), ("d", 4)]


def test_fold_reput_after_delete():
    chain = [
        ("full", _batch([("a", 1, False)])),
        ("delta", _batch([("a", None, True)])),
        ("delta", _batch([("a", 7, False)])),
    ]
    assert _folded(chain) == [("a", 7)]
    deleted_again = chain + [("delta", _batch([("a", None, True)]))]
    assert _folded(deleted_again) == []


def test_fold_rows_follow_their_last_occurrence():
    chain = [
        ("full", _batch([("a", 1, False), ("b", 2, False), ("c", 3, False)])),
        ("delta", _batch([("a", 10, False)])),
    ]
    assert _folded(chain) == [("b", 2), ("c", 3), ("a", 10)]


def test_fold_composite_keys_with_nulls():
    schema = KeyedSchema.of_values(
        [pa.field("k1", pa.string()), pa.field("k2", pa.int64())], [pa.field("v", pa.int64())]
    )

    def batch(rows):
        return schema.rows_to_columns(
            [(k1, k2) for k1, k2, _, _ in rows], [[None if d else (v,) for _, _, v, d in rows]], [d for *_, d in rows]
        ).to_batches()[0]

    chain = [
        ("full", batch([("x", 1, 1, False), ("x", 2, 2, False), ("y", 1, 3, False), (None, 1, 4, False)])),
        ("delta", batch([("x", 2, None, True), ("y", 1, 30, False), (None, 1, 40, False), ("x", None, 5, False)])),
    ]
    expected = sorted([("x", 1, 1), ("y", 1, 30), (None, 1, 40), ("x", None, 5)], key=repr)
    folded = fold_chain(chain, ("k1", "k2")).to_pylist()
    assert sorted(((r["k1"], r["k2"], r["_spark_state_value"]["v"]) for r in folded), key=repr) == expected
    groups = [{}]
    apply_entries(groups, chain, schema, whole_chain=True)
    assert sorted(((k1, k2, v[0]) for (k1, k2), v in groups[0].items()), key=repr) == expected


def test_a_null_variable_removes_the_key_from_that_variable_only():
    keys, first, second = [("a",), ("b",)], [(1,), (2,)], [(10,), None]
    full = TWO.rows_to_columns(keys, [first, second], [False, False]).to_batches()[0]
    delta = TWO.rows_to_columns([("a",)], [[None], [(11,)]], [False]).to_batches()[0]
    groups = [{}, {}]
    apply_entries(groups, [("full", full), ("delta", delta)], TWO, whole_chain=True)
    assert groups == [{("b",): (2,)}, {("a",): (11,)}]
    folded = fold_chain([("full", full), ("delta", delta)], TWO.key_columns).to_pylist()
    assert [(r["key"], r["_spark_state_value"], r["_spark_state_extra"]) for r in folded] == [
        ("b", {"value": 2}, None),
        ("a", None, {"n": 11}),
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(-3, 3) | st.none(), st.booleans()), max_size=8),
        min_size=1,
        max_size=5,
    )
)
def test_both_forms_of_the_fold_agree_with_the_reference(entries):
    chain = []
    for n, rows in enumerate(entries):
        unique = list({key: (key, value, deleted and n > 0) for key, value, deleted in rows}.values())
        chain.append(("full" if n == 0 else "delta", _batch(unique)))
    _folded(chain)


def test_a_chain_must_start_full():
    with pytest.raises(CorruptBlobError, match="must start with a full entry"):
        fold_chain([("delta", _batch([("a", 1, False)]))], ("key",))
    with pytest.raises(CorruptBlobError, match="must start with a full entry"):
        apply_entries([{}], [("delta", _batch([("a", 1, False)]))], SCHEMA, whole_chain=True)
    with pytest.raises(CheckpointError, match="at least one entry"):
        fold_chain([], ("key",))


# --------------------------------------------------------------------------- the read bound, and plan == restore


@settings(max_examples=100, deadline=None)
@given(gaps=st.lists(st.integers(0, 2000), min_size=1, max_size=24))
def test_a_plan_reads_through_the_smallest_gaps_within_the_bound_and_no_more(gaps):
    """The default plan reads at most MAX_OVERREAD more than it needs, and as few requests as that allows: the
    smallest gaps are the ones read through."""
    from spark_state.store.restore import MAX_OVERREAD

    m = len(gaps)
    blob = _synthetic_blob(1, 0, KeyGroupRange(0, m - 1), range(m), gaps=dict(enumerate(gaps)))
    component = next_component(None, 1, ComponentUpdate(ComponentSpec("c", m, 1, SCHEMA), [blob]))
    plan = plan_instance_restore(component, 0, 1)
    assert plan.bytes_to_read <= (1 + MAX_OVERREAD) * plan.bytes_owned
    inner, budget, joinable = sorted(gaps[1:]), MAX_OVERREAD * plan.bytes_owned, 0
    for gap in inner:  # the most gaps whose sum fits the budget are the smallest ones
        if gap and gap > budget:
            break
        budget -= gap
        joinable += 1
    assert len(plan.reads) == 1 + len(inner) - joinable


def _layout_with_superseded_entries(parallelism: int):
    """A store whose blobs hold entries later ones superseded: eight checkpoints of 3,000 keys at ``parallelism``,
    each after the first changing the keys of a fifth of the key groups, with a short chain length: those key
    groups' chains move to full entries in newer blobs, and the older blobs keep needed entries with holes between
    them."""
    from spark_state.executor.resident import ResidentState
    from spark_state.keyspace import key_group_for
    from spark_state.storage import CountingStorage, MemoryStorage
    from tests.stores import Store

    storage = CountingStorage(MemoryStorage())
    store, m = Store(storage, retained=6), 64
    states = [ResidentState(SCHEMA, key_group_range(j, parallelism, m)) for j in range(parallelism)]
    rng = random.Random(62)
    for checkpoint_id in range(1, 9):
        refs = []
        touched = set(range(m)) if checkpoint_id == 1 else set(rng.sample(range(m), m // 5))
        for n in range(3000):
            key = f"k{n:05d}"
            group = key_group_for((key,), m)
            if group not in touched:
                continue
            owner = next(s for s in states if group in s.key_group_range)
            owner.table.put(group, (key,), (n * checkpoint_id,))
        for j, state in enumerate(states):
            ref, _ = state.checkpoint(store.blobs, "c", checkpoint_id, j, max_chain_length=2)
            if ref is not None:
                refs.append(ref)
        manifest = store.commit(checkpoint_id, {"c": (ComponentSpec("c", m, parallelism, SCHEMA), refs)}, {})
    return storage, store, manifest.components["c"]


@pytest.mark.parametrize("old, new", [(3, 3), (3, 5), (4, 2)])
def test_what_plan_says_a_restore_reads_is_what_the_storage_counts(old, new):
    """The plan ``spark-state plan`` prints is the plan a restore fetches: bytes and requests as the backend
    counted them, within the read bound, at the same and at another parallelism."""
    from spark_state.executor.resident import ResidentState
    from spark_state.ops.inspect import plan_rescale
    from spark_state.store.restore import MAX_OVERREAD

    storage, store, component = _layout_with_superseded_entries(old)
    planned = {p["instance"]: p for p in plan_rescale(component, new)["target"]["instances"]}
    for j in range(new):
        before_bytes, before_requests = storage.bytes_read, storage.requests
        state = ResidentState(SCHEMA, key_group_range(j, new, component.max_parallelism))
        caught = state.catch_up(store.blobs, component, j, new)
        read, requests = storage.bytes_read - before_bytes, storage.requests - before_requests
        assert (read, requests) == (caught.plan.bytes_to_read, len(caught.plan.reads))
        assert (planned[j]["bytes"], planned[j]["requests"]) == (read, requests)
        assert read <= (1 + MAX_OVERREAD) * caught.plan.bytes_owned
