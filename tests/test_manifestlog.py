"""The commit protocol, retention and cleanup (``spark_state.store.manifestlog``) and resident checkpointing (no Spark).

Every scenario keeps a plain dict model of the live state and of the state
committed with each checkpoint, and checks restores against it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import uuid
import zlib

import pyarrow as pa
import pytest

from spark_state.driver.coordinator import Coordinator
from spark_state.errors import (
    CheckpointError,
    ConfigError,
    CorruptBlobError,
    IncompatibleCheckpointError,
    InvalidParallelismError,
    KeyGroupOwnershipError,
    NoCheckpointError,
    StorageError,
)
from spark_state.executor.resident import ResidentState, restore_instance
from spark_state.executor.table import KeyGroupTable
from spark_state.keyspace import KeyGroupRange, instance_for_key_group, key_group_for, key_group_range
from spark_state.model.schema import KeyedSchema
from spark_state.storage import open_storage
from spark_state.storage.base import ForwardingStorage, Storage, join
from spark_state.storage.local import LocalStorage
from spark_state.storage.memory import MemoryStorage
from spark_state.store.blob import BlobIndex
from spark_state.store.blobstore import BLOBS_DIR, ITEMS_DIR
from spark_state.store.commitlog import decode_record, encode_record
from spark_state.store.manifest import ComponentSpec, Manifest
from spark_state.store.manifestlog import (
    CHECKPOINTS_DIR,
    FILE_SWEEPS_PER_GRACE,
    CheckpointExistsError,
    ManifestLog,
    latest_source_offsets,
    manifest_path,
    retained_source_offsets,
)
from tests.stores import Store

M = 8  # max parallelism
COMPONENT = "counts"
SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])


def _keys_by_group(per_group: int = 12) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {g: [] for g in range(M)}
    n = 0
    while min(len(keys) for keys in groups.values()) < per_group:
        key = f"k{n}"
        group = groups[key_group_for(key, M)]
        if len(group) < per_group:
            group.append(key)
        n += 1
    return groups


KEYS = _keys_by_group()


@pytest.fixture(params=["memory", "local"])
def storage(request, tmp_path) -> Storage:
    return MemoryStorage() if request.param == "memory" else LocalStorage(tmp_path / "state")


# --------------------------------------------------------------------------- helpers


class Job:
    """``parallelism`` instances of one component, checkpointing into ``store``, with a dict model."""

    def __init__(self, store: Store, parallelism: int, *, max_chain_length: int = 3):
        self.store = store
        self.max_chain_length = max_chain_length
        self.live: dict[str, int] = {}
        self.committed: dict[int, dict[str, int]] = {}
        self.written: dict[int, dict[int, str]] = {}  # checkpoint id -> key group -> entry kind written
        self.paths: list[str] = []  # every blob written
        self.p = parallelism
        self.instances = [ResidentState(SCHEMA, key_group_range(i, parallelism, M)) for i in range(parallelism)]

    def _owner(self, key: str) -> tuple[int, ResidentState]:
        g = key_group_for(key, M)
        return g, self.instances[instance_for_key_group(g, self.p, M)]

    def put(self, key: str, value: int) -> None:
        g, state = self._owner(key)
        state.table.put(g, (key,), (value,))
        self.live[key] = value

    def delete(self, key: str) -> None:
        g, state = self._owner(key)
        state.table.delete(g, (key,))
        self.live.pop(key, None)

    def write_blobs(self, checkpoint_id: int):
        refs = [
            s.checkpoint(self.store.blobs, COMPONENT, checkpoint_id, i, max_chain_length=self.max_chain_length)[0]
            for i, s in enumerate(self.instances)
        ]
        refs = [r for r in refs if r is not None]
        self.paths.extend(r.path for r in refs)
        return refs

    def checkpoint(self, checkpoint_id: int, *, cleanup: bool = True, refs=None) -> Manifest:
        """Steps 1-5; ``refs`` are blobs already written for ``checkpoint_id`` (then step 1 is skipped)."""
        refs = self.write_blobs(checkpoint_id) if refs is None else refs
        manifest = self.store.commit(
            checkpoint_id,
            {COMPONENT: (ComponentSpec(COMPONENT, M, self.p, SCHEMA), refs)},
            {"src": {"offset": checkpoint_id}},
        )
        self.committed[checkpoint_id] = dict(self.live)
        self.written[checkpoint_id] = {e.key_group: e.kind for ref in refs for e in ref.index.entries}
        if cleanup:
            self.store.cleanup(manifest)
        return manifest

    def rescale(self, parallelism: int) -> None:
        """Restart from the latest checkpoint at ``parallelism`` (the live state is the committed one)."""
        manifest = self.store.latest()
        self.p = parallelism
        self.instances = [
            restore_instance(self.store.blobs, manifest.components[COMPONENT], SCHEMA, i, parallelism, M)[0]
            for i in range(parallelism)
        ]
        self.live = dict(self.committed[manifest.checkpoint_id])


def restore_all(store: Store, checkpoint_id: int, parallelism: int) -> dict[str, int]:
    component = store.load(checkpoint_id).components[COMPONENT]
    result: dict[str, int] = {}
    for i in range(parallelism):
        state, caught = restore_instance(store.blobs, component, SCHEMA, i, parallelism, M)
        assert caught.stats.bytes_read == caught.plan.bytes_to_read
        assert caught.stats.requests == len(caught.plan.reads)
        for g, key, value in state.table.items():
            assert g in key_group_range(i, parallelism, M)
            assert key_group_for(key[0], M) == g
            assert key[0] not in result
            result[key[0]] = value[0]
    return result


def files_under(storage: Storage, top: str) -> set[str]:
    """Every path below ``top`` with no children: the blobs (and any empty directory left behind)."""
    found = set()
    pending = [top]
    while pending:
        path = pending.pop()
        children = storage.list(path)
        if not children and path != top:
            found.add(path)
        pending.extend(join(path, c) for c in children)
    return found


def referenced_files(store: Store, manifest: Manifest) -> set[str]:
    refs: set[str] = set()
    for checkpoint_id in manifest.consistent_checkpoints:
        for component in store.load(checkpoint_id).components.values():
            refs.update(component.blobs)
            refs.update(ref.path for ref in component.instance_items.values())
    return refs


def run_history(store: Store, *, cleanup: bool) -> Job:
    """Seven checkpoints at parallelism 2, a rescale to 3, with a key group untouched since checkpoint 1."""
    job = Job(store, 2)
    for g in range(M):
        for n, key in enumerate(KEYS[g][:6]):
            job.put(key, g * 100 + n)
    job.checkpoint(1, cleanup=cleanup)
    for checkpoint_id in range(2, 8):
        if checkpoint_id == 5:
            job.rescale(3)
        for g in range(1, M):  # key group 0 is never touched again
            if g % 2 == checkpoint_id % 2:
                for n, key in enumerate(KEYS[g][:6]):  # every key changes: full entries
                    job.put(key, checkpoint_id * 1000 + n)
            else:
                job.put(KEYS[g][checkpoint_id], -checkpoint_id)  # one new key: delta
                if checkpoint_id == 6:
                    job.delete(KEYS[g][1])
        job.checkpoint(checkpoint_id, cleanup=cleanup)
    return job


# --------------------------------------------------------------------------- commit and visibility


def test_commit_makes_the_checkpoint_visible(storage):
    store = Store(storage)
    assert store.latest() is None
    assert store.committed_ids() == []
    job = Job(store, 2)
    job.put("a", 1)
    job.put("b", 2)
    manifest = job.checkpoint(1)
    assert manifest.checkpoint_id == 1
    assert manifest.consistent_checkpoints == (1,)
    fresh = Store(storage)
    assert fresh.committed_ids() == [1]
    assert fresh.latest() == manifest
    assert fresh.latest().sources == {"src": {"offset": 1}}
    assert restore_all(fresh, 1, 2) == {"a": 1, "b": 2}


def test_blobs_without_a_commit_are_invisible(storage):
    """A coordinator crash between step 1 and step 4: the blobs exist, the checkpoint does not."""
    store = Store(storage)
    job = Job(store, 2)
    job.put("a", 1)
    job.checkpoint(1)
    job.put("a", 2)
    job.put("b", 3)
    orphans = job.write_blobs(2)  # crash: never committed
    assert orphans and all(storage.exists(ref.path) for ref in orphans)
    for reader in (store, Store(storage)):
        assert reader.committed_ids() == [1]
        assert reader.latest().checkpoint_id == 1
        assert restore_all(reader, 1, 1) == {"a": 1}
        with pytest.raises(NoCheckpointError, match="checkpoint 2 does not exist"):
            reader.load(2)
    # the orphans are in flight as far as checkpoint 1's cleanup knows: kept
    store.cleanup(store.latest())
    assert all(storage.exists(ref.path) for ref in orphans)
    # the job restarts from 1, redoes checkpoint 2 under new attempt names, and cleanup drops the orphans
    restarted = Job(Store(storage), 2)
    restarted.committed = {1: {"a": 1}}
    restarted.rescale(2)
    restarted.put("a", 2)
    restarted.put("b", 3)
    restarted.checkpoint(2)
    assert not any(storage.exists(ref.path) for ref in orphans)
    assert restore_all(Store(storage), 2, 3) == {"a": 2, "b": 3}


def test_committing_an_existing_id_raises_with_the_manifest(storage):
    store = Store(storage)
    job = Job(store, 1)
    job.put("a", 1)
    committed = job.checkpoint(1)
    before = storage.read(manifest_path(1))
    for coordinator in (store, Store(storage)):
        with pytest.raises(CheckpointExistsError, match="checkpoint 1 is already committed") as info:
            coordinator.commit(1, {}, {"src": "other"})
        assert info.value.manifest == committed
        assert info.value.manifest.sources == {"src": {"offset": 1}}
    assert storage.read(manifest_path(1)) == before


def test_a_lower_id_is_rejected(storage):
    store = Store(storage, retained=5)
    for checkpoint_id in (1, 3):
        store.commit(checkpoint_id, {}, {})
    with pytest.raises(CheckpointError, match="older than the latest committed checkpoint 3") as info:
        store.commit(2, {}, {})
    assert not isinstance(info.value, CheckpointExistsError)
    with pytest.raises(CheckpointError):
        store.commit(1, {}, {})
    assert store.committed_ids() == [1, 3]


class _BarrierOnCommit(ForwardingStorage):
    """A manifest create waits until ``parties`` coordinators reach it."""

    def __init__(self, inner: Storage, barrier: threading.Barrier):
        super().__init__(inner)
        self.barrier = barrier

    def create(self, path, data, *, overwrite=False):
        if path.startswith(CHECKPOINTS_DIR + "/"):
            self.barrier.wait(timeout=10)
        self.inner.create(path, data, overwrite=overwrite)


def test_racing_coordinators_exactly_one_wins(storage):
    """Both coordinators see the same latest checkpoint and reach step 4 together."""
    for checkpoint_id in range(1, 6):
        barrier = threading.Barrier(2)
        stores = [Store(_BarrierOnCommit(storage, barrier)) for _ in range(2)]
        outcomes: list = [None, None]

        def coordinator(i: int) -> None:
            try:
                outcomes[i] = stores[i].commit(checkpoint_id, {}, {"src": f"coordinator {i}"})
            except CheckpointExistsError as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=coordinator, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [o for o in outcomes if isinstance(o, Manifest)]
        losers = [o for o in outcomes if isinstance(o, CheckpointExistsError)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert "concurrently" in str(losers[0])
        assert losers[0].manifest == winners[0]
        assert Store(storage).latest() == winners[0]


def test_latest_picks_the_highest_id(storage):
    store = Store(storage, retained=10)
    for checkpoint_id in (1, 2, 9, 10, 100):
        store.commit(checkpoint_id, {}, {"src": checkpoint_id})
    storage.create(f"{CHECKPOINTS_DIR}/notes.txt", b"x")
    storage.create(f"{CHECKPOINTS_DIR}/latest.json", b"{}")
    storage.create(f"{CHECKPOINTS_DIR}/{200:020d}.json.partial", b"")
    fresh = Store(storage)
    assert fresh.committed_ids() == [1, 2, 9, 10, 100]
    assert fresh.latest().checkpoint_id == 100
    assert fresh.latest().sources == {"src": 100}
    assert fresh.latest().consistent_checkpoints == (100, 10, 9, 2, 1)


# --------------------------------------------------------------------------- manifests


def _sample_manifest(storage: Storage) -> tuple[Store, Manifest]:
    store = Store(storage)
    job = Job(store, 2)
    for g in (0, 5):
        for key in KEYS[g][:4]:
            job.put(key, g)
    job.checkpoint(1)
    job.put(KEYS[0][4], 7)  # one key of five: a delta
    return store, job.checkpoint(2)


def test_manifest_roundtrip():
    store, manifest = _sample_manifest(MemoryStorage())
    data = encode_record(manifest.to_json())
    again = Manifest.from_json(decode_record(data, "m"))
    assert again == manifest
    assert encode_record(again.to_json()) == data
    assert Store(store.storage).load(2) == manifest
    component = again.components[COMPONENT]
    assert [component.blobs[p].checkpoint_id for p in component.chains[0]] == [1, 2]
    assert [component.blobs[p].checkpoint_id for p in component.chains[5]] == [1]
    assert sorted(component.chains) == [0, 5]


def test_every_flipped_manifest_bit_is_detected():
    _, manifest = _sample_manifest(MemoryStorage())
    data = encode_record(manifest.to_json())
    for position in range(len(data)):
        corrupted = bytearray(data)
        corrupted[position] ^= 1 << (position % 8)
        with pytest.raises(CorruptBlobError):
            Manifest.from_json(decode_record(bytes(corrupted), "m"))


def test_a_corrupt_manifest_in_storage_is_never_read_as_a_checkpoint(storage):
    store, manifest = _sample_manifest(storage)
    data = bytearray(storage.read(manifest_path(2)))
    data[len(data) // 2] ^= 0x20
    storage.create(manifest_path(2), bytes(data), overwrite=True)
    fresh = Store(storage)
    with pytest.raises(CorruptBlobError, match="00000000000000000002.json"):
        fresh.latest()
    with pytest.raises(CorruptBlobError):
        fresh.load(2)


def test_a_manifest_under_the_wrong_id_is_corrupt(storage):
    store, _ = _sample_manifest(storage)
    storage.create(manifest_path(3), storage.read(manifest_path(1)))
    with pytest.raises(CorruptBlobError, match="holds checkpoint 1, not 3"):
        Store(storage).load(3)


def test_a_manifest_from_a_newer_format_is_refused():
    _, manifest = _sample_manifest(MemoryStorage())
    outer = json.loads(encode_record(manifest.to_json()))
    body = json.loads(outer["body"])
    body["format_version"] += 1
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    data = json.dumps({"crc32": zlib.crc32(text.encode()), "body": text}).encode()
    with pytest.raises(IncompatibleCheckpointError, match="upgrade spark-state"):
        Manifest.from_json(decode_record(data, "m"))


# --------------------------------------------------------------------------- retention and cleanup


@pytest.mark.parametrize("deltas", [0, 16])
@pytest.mark.parametrize("retained", [1, 2, 3])
def test_retention_and_cleanup(storage, retained, deltas, monkeypatch):
    monkeypatch.setattr("spark_state.store.manifestlog.MAX_DELTAS", deltas)  # 0: every record is full
    store = Store(storage, retained=retained)
    job = run_history(store, cleanup=True)
    latest = store.latest()
    assert latest.checkpoint_id == 7
    expected_ids = list(range(7, 7 - retained, -1))
    assert list(latest.consistent_checkpoints) == expected_ids
    # the retained checkpoints' records, and the earlier records they are read from (deltas on them)
    needed = Store(storage).manifests.records_needed(expected_ids)
    assert needed == set(expected_ids) if deltas == 0 else needed >= set(expected_ids)
    assert Store(storage).committed_ids() == sorted(needed)
    for gone in set(range(1, 8)) - needed:
        with pytest.raises(NoCheckpointError):
            Store(storage).load(gone)
    # exactly the referenced blobs remain
    assert files_under(storage, BLOBS_DIR) == referenced_files(store, latest)
    # key group 0 was written only at checkpoint 1 (by instance 0 of 2): its blob is still there
    (path,) = latest.components[COMPONENT].chains[0]
    assert latest.components[COMPONENT].blobs[path].checkpoint_id == 1
    assert storage.exists(path)
    (name,) = storage.list(f"{BLOBS_DIR}/{COMPONENT}/{1:020d}")  # instance 1's blob of checkpoint 1 is gone
    assert name.startswith("00000-0-3-")
    assert len(files_under(storage, BLOBS_DIR)) < len(job.paths)
    # every retained checkpoint restores to exactly its state, at several parallelisms
    for checkpoint_id in expected_ids:
        for parallelism in (1, 2, 3, 8):
            assert restore_all(Store(storage), checkpoint_id, parallelism) == job.committed[checkpoint_id]


def test_each_manifest_lists_its_retained_predecessors():
    store = Store(MemoryStorage(), retained=3)
    lists = [store.commit(i, {}, {}).consistent_checkpoints for i in (1, 2, 4, 5, 6)]
    assert lists == [(1,), (2, 1), (4, 2, 1), (5, 4, 2), (6, 5, 4)]


class _CrashingDeletes(ForwardingStorage):
    """The delete after ``allowed`` successful ones raises (a crash)."""

    def __init__(self, inner: Storage, allowed: int | None):
        super().__init__(inner)
        self.allowed = allowed
        self.deletes = 0

    def delete(self, path):
        if self.allowed is not None and self.deletes >= self.allowed:
            raise StorageError(f"injected crash before deleting {path}")
        self.deletes += 1
        self.inner.delete(path)


def _garbage_history(storage: Storage) -> tuple[Job, Store]:
    store = Store(_CrashingDeletes(storage, None), retained=2)
    job = run_history(store, cleanup=False)
    job.put(KEYS[3][0], 123)
    job.write_blobs(8)  # in flight
    return job, store


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_cleanup_crashing_at_every_delete_leaves_a_restorable_store(backend, tmp_path):
    if backend == "memory":

        def fresh_storage(k: int) -> Storage:
            storage = MemoryStorage()
            _garbage_history(storage)
            return storage
    else:
        _garbage_history(LocalStorage(tmp_path / "template"))

        def fresh_storage(k: int) -> Storage:  # a copy of one history is much faster than fsyncing another
            shutil.copytree(tmp_path / "template", tmp_path / f"run-{k}")
            return LocalStorage(tmp_path / f"run-{k}")

    reference_storage = MemoryStorage() if backend == "memory" else LocalStorage(tmp_path / "reference")
    job, store = _garbage_history(reference_storage)
    store.cleanup(store.latest())
    total = store.storage.deletes
    assert total > 10  # the scenario leaves plenty of garbage
    expected_files = files_under(reference_storage, "")
    committed = job.committed
    for k in range(total):
        storage = fresh_storage(k)
        crashing = Store(_CrashingDeletes(storage, k), retained=2)
        in_flight = files_under(storage, f"{BLOBS_DIR}/{COMPONENT}/{8:020d}")
        assert in_flight
        with pytest.raises(StorageError, match="injected crash"):
            crashing.cleanup(crashing.latest())
        survivor = Store(storage)
        latest = survivor.latest()
        assert latest.checkpoint_id == 7
        for checkpoint_id in latest.consistent_checkpoints:
            assert restore_all(survivor, checkpoint_id, 3) == committed[checkpoint_id], (k, checkpoint_id)
        assert files_under(storage, f"{BLOBS_DIR}/{COMPONENT}/{8:020d}") == in_flight
        # a rerun (by a restarted coordinator) finishes the job
        survivor.cleanup(latest)
        assert files_under(storage, f"{BLOBS_DIR}/{COMPONENT}/{8:020d}") == in_flight
        records = survivor.manifests.records_needed([6, 7])
        assert survivor.committed_ids() == sorted(records) and {6, 7} <= records
        kept = {manifest_path(i) for i in records} | referenced_files(survivor, latest) | in_flight
        assert files_under(storage, "") == kept
        assert len(kept) == len(expected_files)


def test_cleanup_never_touches_checkpoints_above_the_committed_one(storage):
    store = Store(storage, retained=1)
    job = run_history(store, cleanup=False)
    job.put(KEYS[2][0], 5)
    in_flight = job.write_blobs(8)
    items = store.blobs.write_items(COMPONENT, 8, 0, ["watermark"])
    assert in_flight
    store.cleanup(store.latest())
    for ref in in_flight:
        assert storage.exists(ref.path)
    assert store.blobs.read_items(items) == ["watermark"]
    # a late cleanup for an older manifest does not hurt the newer checkpoint either
    job.checkpoint(8, cleanup=False, refs=in_flight)
    store.cleanup(store.load(7))
    assert restore_all(Store(storage), 8, 2) == job.committed[8]
    assert Store(storage).committed_ids() == sorted(Store(storage).manifests.records_needed([7, 8]))


def test_instance_items_are_carried_over_and_cleaned_up(storage):
    store = Store(storage, retained=1)
    spec = ComponentSpec(COMPONENT, M, 2, SCHEMA)
    first = store.blobs.write_items(COMPONENT, 1, 0, ["one"])
    store.cleanup(store.commit(1, {COMPONENT: (spec, [])}, {}, items={COMPONENT: {0: first}}))
    second = store.blobs.write_items(COMPONENT, 2, 0, ["two"])
    store.cleanup(store.commit(2, {COMPONENT: (spec, [])}, {}, items={COMPONENT: {0: second}}))
    third = store.commit(3, {COMPONENT: (spec, [])}, {})
    store.cleanup(third)
    assert third.components[COMPONENT].instance_items == {0: second}
    assert not storage.exists(first.path)
    assert store.blobs.read_items(second) == ["two"]
    assert files_under(storage, ITEMS_DIR) == {second.path}


def _orphan(storage: Storage, checkpoint_id: int, written_ms: int | None) -> str:
    """An unreferenced items file under ``checkpoint_id``, named as an attempt written at ``written_ms``."""
    stamp = f"{written_ms:013d}-" if written_ms is not None else ""
    path = join(ITEMS_DIR, COMPONENT, f"{checkpoint_id:020d}", f"00000-{stamp}{uuid.uuid4().hex[:12]}.json")
    storage.create(path, b"[]")
    return path


def test_cleanup_deletes_only_unreferenced_files_older_than_the_grace_period(storage):
    store = Store(storage, retained=1)
    spec = ComponentSpec(COMPONENT, M, 1, SCHEMA)
    kept = store.blobs.write_items(COMPONENT, 1, 0, ["kept"])
    manifest = store.commit(1, {COMPONENT: (spec, [])}, {}, items={COMPONENT: {0: kept}})
    now = 1_800_000_000_000
    old, young, unnamed = (
        _orphan(storage, 1, now - 61_000),
        _orphan(storage, 1, now - 59_000),
        _orphan(storage, 0, None),
    )
    deleted = store.manifests.cleanup(manifest, grace_seconds=60, now_ms=now)
    assert sorted(deleted) == sorted([old, unnamed])  # a name without a time counts as old
    assert storage.exists(young) and store.blobs.read_items(kept) == ["kept"]
    assert store.manifests.cleanup(manifest, grace_seconds=0, now_ms=now) == [young]
    assert store.blobs.read_items(kept) == ["kept"]  # referenced: never deleted, whatever its age


def test_a_running_query_deletes_records_every_batch_and_lists_its_files_sixty_times_per_grace_period(
    storage, monkeypatch
):
    """``Coordinator.cleanup`` deletes the records retention drops at every batch, but lists the blob and items
    directories (for files past the grace period) at most ``FILE_SWEEPS_PER_GRACE`` times per grace period: on an
    object store each listing is a request per retained checkpoint directory. With a grace of 0, every batch."""
    monkeypatch.setattr("spark_state.store.manifestlog.MAX_DELTAS", 0)  # every record full: retention drops each one
    store = Store(storage, retained=1)
    spec = ComponentSpec(COMPONENT, M, 1, SCHEMA)
    now = [1000.0]
    coordinator = Coordinator(store.manifests, store="test", clock=lambda: now[0])
    assert FILE_SWEEPS_PER_GRACE == 60
    store.commit(1, {COMPONENT: (spec, [])}, {})
    first = _orphan(storage, 1, None)  # a name without a time counts as old
    manifest = store.commit(2, {COMPONENT: (spec, [])}, {})
    assert sorted(coordinator.cleanup(manifest, grace_seconds=60)) == sorted([manifest_path(1), first])

    second = _orphan(storage, 2, None)
    manifest = store.commit(3, {COMPONENT: (spec, [])}, {})
    now[0] += 0.99  # under 60 / 60 s since the files were listed: records only
    assert coordinator.cleanup(manifest, grace_seconds=60) == [manifest_path(2)] and storage.exists(second)
    now[0] += 0.01
    assert coordinator.cleanup(manifest, grace_seconds=60) == [second]

    third = _orphan(storage, 3, None)
    assert coordinator.cleanup(manifest, grace_seconds=0) == [third]  # no time since: listed all the same


def test_a_zombie_writing_late_cannot_make_cleanup_fail_and_keeps_its_file(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path / "store")
    store = Store(storage, retained=1)
    spec = ComponentSpec(COMPONENT, M, 1, SCHEMA)
    store.commit(1, {COMPONENT: (spec, [])}, {})
    orphan = _orphan(storage, 1, 0)
    manifest = store.commit(2, {COMPONENT: (spec, [])}, {})
    real_rmdir = os.rmdir
    zombie: list[str] = []

    def rmdir_while_a_zombie_writes(path, *args, **kwargs):
        if not zombie:  # a task of a given-up attempt writes into the directory as cleanup empties it
            zombie.append(store.blobs.write_items(COMPONENT, 1, 0, ["late"]).path)
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_while_a_zombie_writes)
    assert store.manifests.cleanup(manifest, grace_seconds=60) == [orphan]
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    assert zombie and storage.read(zombie[0]) == b'["late"]'


# --------------------------------------------------------------------------- compatibility


def _committed_component(storage: Storage):
    store = Store(storage)
    job = Job(store, 2)
    for g in range(M):
        job.put(KEYS[g][0], g)
    return store, job.checkpoint(1).components[COMPONENT]


def test_restore_refuses_a_changed_max_parallelism():
    store, component = _committed_component(MemoryStorage())
    with pytest.raises(IncompatibleCheckpointError, match="max parallelism is 16 .* set spark.state.maxParallelism=8"):
        restore_instance(store.blobs, component, SCHEMA, 0, 2, 16)


@pytest.mark.parametrize(
    "schema, what",
    [
        (KeyedSchema.of_values([pa.field("value", pa.string())], [pa.field("key", pa.int64())]), "key columns"),
        (
            KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int32())]),
            "'value.value' cannot change from int64 to int32: only widening",
        ),
        (KeyedSchema.of_values([pa.field("key", pa.string()), pa.field("value", pa.int64())], []), "key columns"),
    ],
)
def test_restore_refuses_changed_key_columns_or_schema(schema, what):
    store, component = _committed_component(MemoryStorage())
    with pytest.raises(IncompatibleCheckpointError, match=what) as info:
        restore_instance(store.blobs, component, schema, 0, 2, M)
    assert "start a new state store location" in str(info.value) or "from a savepoint" in str(info.value)


def test_restore_refuses_another_hash_version():
    store, component = _committed_component(MemoryStorage())
    with pytest.raises(IncompatibleCheckpointError, match="hash version 99.*spark-state version that wrote them"):
        restore_instance(store.blobs, dataclasses.replace(component, hash_version=99), SCHEMA, 0, 2, M)


def test_commit_refuses_a_changed_max_parallelism():
    store, _ = _committed_component(MemoryStorage())
    with pytest.raises(IncompatibleCheckpointError, match="spark.state.maxParallelism=8"):
        store.commit(2, {COMPONENT: (ComponentSpec(COMPONENT, 16, 2, SCHEMA), [])}, {})
    assert store.committed_ids() == [1]


def test_parallelism_may_change_freely():
    store, component = _committed_component(MemoryStorage())
    expected = {KEYS[g][0]: g for g in range(M)}
    for parallelism in range(1, M + 1):
        assert restore_all(store, 1, parallelism) == expected


# --------------------------------------------------------------------------- ownership


def _one_blob(store: Store, checkpoint_id: int, instance: int, kgr: KeyGroupRange, key_group: int):
    state = ResidentState(SCHEMA, kgr)
    state.table.put(key_group, ("x",), (1,))
    return store.blobs.write_blob(COMPONENT, checkpoint_id, instance, kgr, SCHEMA.blob_schema, state.snapshot())


@pytest.mark.parametrize(
    "instance, kgr, parallelism, error",
    [
        (0, KeyGroupRange(0, 3), 4, KeyGroupOwnershipError),  # right for parallelism 2, committed at 4
        (1, KeyGroupRange(0, 3), 2, KeyGroupOwnershipError),  # another instance's range
        (0, KeyGroupRange(0, 2), 2, KeyGroupOwnershipError),  # a sub-range
        (0, KeyGroupRange(0, 7), 2, KeyGroupOwnershipError),  # a super-range
        (1, KeyGroupRange(4, 7), 1, InvalidParallelismError),  # no instance 1 at parallelism 1
    ],
)
def test_a_blob_for_the_wrong_range_is_refused(instance, kgr, parallelism, error):
    store = Store(MemoryStorage())
    ref = _one_blob(store, 1, instance, kgr, kgr.start)
    with pytest.raises(error):
        store.commit(1, {COMPONENT: (ComponentSpec(COMPONENT, M, parallelism, SCHEMA), [ref])}, {})
    assert store.latest() is None
    assert not store.storage.exists(manifest_path(1))


def test_a_blob_whose_range_does_not_match_its_instance_raises_ownership_error():
    store = Store(MemoryStorage())
    ref = _one_blob(store, 1, 0, KeyGroupRange(0, 3), 1)
    with pytest.raises(KeyGroupOwnershipError, match=r"covers key groups \[0, 3\] but instance 0 owns \[0, 1\]"):
        store.commit(1, {COMPONENT: (ComponentSpec(COMPONENT, M, 4, SCHEMA), [ref])}, {})


def test_a_blob_entry_outside_its_range_raises_ownership_error():
    store = Store(MemoryStorage())
    ref = _one_blob(store, 1, 0, KeyGroupRange(0, 3), 2)
    moved = ref.index.entries[0]._replace(key_group=5)
    forged = dataclasses.replace(ref, index=BlobIndex((moved,)))
    with pytest.raises(KeyGroupOwnershipError, match="holds key group 5, outside its range"):
        store.commit(1, {COMPONENT: (ComponentSpec(COMPONENT, M, 2, SCHEMA), [forged])}, {})


def test_two_blobs_from_one_instance_are_refused():
    store = Store(MemoryStorage())
    refs = [_one_blob(store, 1, 0, KeyGroupRange(0, 3), g) for g in (0, 1)]  # two attempts
    with pytest.raises(CheckpointError, match="two blobs from instance 0"):
        store.commit(1, {COMPONENT: (ComponentSpec(COMPONENT, M, 2, SCHEMA), refs)}, {})
    assert store.latest() is None
    manifest = store.commit(1, {COMPONENT: (ComponentSpec(COMPONENT, M, 2, SCHEMA), refs[1:])}, {})
    assert manifest.components[COMPONENT].chains == {1: (refs[1].path,)}


def test_a_blob_of_another_checkpoint_is_refused():
    store = Store(MemoryStorage())
    ref = _one_blob(store, 2, 0, KeyGroupRange(0, 3), 0)
    with pytest.raises(CheckpointError, match="written for checkpoint 2, not 1"):
        store.commit(1, {COMPONENT: (ComponentSpec(COMPONENT, M, 2, SCHEMA), [ref])}, {})


def test_the_keyed_table_refuses_key_groups_outside_its_range():
    state = KeyGroupTable(SCHEMA, KeyGroupRange(2, 5))
    for g in (2, 5):  # both bounds are inclusive
        state.put(g, ("k",), (g,))
        assert state.get(g, ("k",)) == (g,)
    for g in (1, 6, -1):
        with pytest.raises(KeyGroupOwnershipError, match=r"key group -?\d+ is not owned .*owns \[2, 5\]"):
            state.put(g, ("k",), (0,))
        with pytest.raises(KeyGroupOwnershipError):
            state.get(g, ("k",))
        with pytest.raises(KeyGroupOwnershipError):
            state.delete(g, ("k",))
    assert len(state) == 2


def test_corrupt_blob_bytes_fail_the_restore(tmp_path):
    storage = LocalStorage(tmp_path)
    store, component = _committed_component(storage)
    (path,) = [p for p in component.blobs if component.blobs[p].instance == 1]
    entry = component.blobs[path].index.entries[0]
    local_file = tmp_path / path
    data = bytearray(local_file.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0x01
    local_file.write_bytes(bytes(data))
    restore_instance(store.blobs, component, SCHEMA, 0, 2, M)  # instance 0 does not read that blob
    with pytest.raises(CorruptBlobError, match=f"key group {entry.key_group} in .*/{path} fails its checksum"):
        restore_instance(store.blobs, component, SCHEMA, 1, 2, M)


# --------------------------------------------------------------------------- source offsets


def test_source_offsets_through_a_memory_uri():
    uri = f"memory://test-offsets-{uuid.uuid4().hex}"
    assert latest_source_offsets(uri, "kafka") is None
    assert retained_source_offsets(uri, "kafka") == []
    store = Store(open_storage(uri), retained=3)
    for checkpoint_id in range(1, 6):
        sources = {"kafka": {"p0": checkpoint_id * 10, "p1": checkpoint_id}}
        if checkpoint_id != 4:
            sources["files"] = [f"f{checkpoint_id}"]
        store.cleanup(store.commit(checkpoint_id, {}, sources))
    assert latest_source_offsets(uri, "kafka") == {"p0": 50, "p1": 5}
    assert retained_source_offsets(uri, "kafka") == [{"p0": 50, "p1": 5}, {"p0": 40, "p1": 4}, {"p0": 30, "p1": 3}]
    assert retained_source_offsets(uri, "files") == [["f5"], ["f3"]]  # checkpoint 4 recorded none
    assert latest_source_offsets(uri, "unknown") is None
    assert retained_source_offsets(uri, "unknown") == []


# --------------------------------------------------------------------------- snapshot compaction


@pytest.mark.parametrize("max_chain_length", [1, 2, 3, 5])
def test_chains_never_exceed_max_chain_length(max_chain_length):
    store = Store(MemoryStorage(), retained=1)
    job = Job(store, 1, max_chain_length=max_chain_length)
    keys = KEYS[3]
    for n, key in enumerate(keys):
        job.put(key, n)
    kinds, lengths = [], []
    for checkpoint_id in range(1, 13):
        if checkpoint_id > 1:
            job.put(keys[checkpoint_id % len(keys)], -checkpoint_id)  # one key of twelve
        manifest = job.checkpoint(checkpoint_id)
        kinds.append(job.written[checkpoint_id][3])
        lengths.append(manifest.components[COMPONENT].chain_length(3))
    # At the limit a chain is compacted: a merge of the keys changed since its full entry while they are
    # under half of the twelve (one more each checkpoint), then a full entry again.
    expected = {
        1: (["full"] * 12, [1] * 12),
        2: (["full", "delta", "merge", "merge", "merge", "merge"] * 2, [1, 2, 2, 2, 2, 2] * 2),
        3: (
            ["full", "delta", "delta", "merge", "delta", "merge", "delta", "full", "delta", "delta", "merge", "delta"],
            [1, 2, 3, 2, 3, 2, 3, 1, 2, 3, 2, 3],
        ),
        5: (
            ["full", "delta", "delta", "delta", "delta", "merge", "delta", "delta", "delta", "full", "delta", "delta"],
            [1, 2, 3, 4, 5, 2, 3, 4, 5, 1, 2, 3],
        ),
    }
    assert (kinds, lengths) == expected[max_chain_length]
    assert restore_all(store, 12, 1) == job.live


def test_restored_instances_continue_the_chain_instead_of_restarting_it():
    store = Store(MemoryStorage(), retained=2)
    job = Job(store, 2, max_chain_length=3)
    keys = KEYS[6]
    for n, key in enumerate(keys):
        job.put(key, n)
    job.checkpoint(1)
    job.put(keys[0], -1)
    job.checkpoint(2)  # chain: full, delta
    job.rescale(4)
    job.put(keys[1], -2)
    job.checkpoint(3)  # delta: the chain has 2 entries, so it may have 3
    job.put(keys[2], -3)
    job.checkpoint(4)  # the chain is at its limit: full
    assert [job.written[i][6] for i in (1, 2, 3, 4)] == ["full", "delta", "delta", "full"]
    assert restore_all(store, 4, 3) == job.live


@pytest.mark.parametrize(
    "changed, deleted, kind",
    [
        (1, 0, "delta"),
        (5, 0, "delta"),
        (6, 0, "full"),
        (12, 0, "full"),
        (0, 3, "delta"),
        (0, 4, "full"),
        (2, 2, "delta"),
        (3, 2, "full"),
    ],
)
def test_a_key_group_where_most_keys_changed_gets_a_full_entry(changed, deleted, kind):
    """Twelve keys; full when 2 * (updated + deleted) >= keys remaining, else delta."""
    state = ResidentState(SCHEMA, KeyGroupRange(0, 0))
    for n in range(12):
        state.table.put(0, (f"k{n}",), (n,))
    state.checkpoint(Store(MemoryStorage()).blobs, COMPONENT, 1, 0, max_chain_length=10)  # the stored base
    for n in range(changed):
        state.table.put(0, (f"k{n}",), (-n,))
    for n in range(changed, changed + deleted):
        state.table.delete(0, (f"k{n}",))
    remaining = 12 - deleted
    ((g, got_kind, batch),) = state.snapshot(max_chain_length=10)
    table = pa.Table.from_batches([batch])
    assert (g, got_kind) == (0, kind)
    values = table.column("_spark_state_value").combine_chunks().field("value").to_pylist()
    rows = dict(zip(table.column("key").to_pylist(), zip(values, table.column("_deleted").to_pylist())))
    if kind == "full":
        assert len(rows) == remaining and not any(d for _, d in rows.values())
    else:
        assert len(rows) == changed + deleted
        assert sum(d for _, d in rows.values()) == deleted


def test_a_key_group_that_becomes_empty_is_cleared():
    store = Store(MemoryStorage())
    job = Job(store, 1)
    for key in KEYS[4][:3]:
        job.put(key, 1)
    job.put(KEYS[5][0], 2)
    job.checkpoint(1)
    for key in KEYS[4][:3]:
        job.delete(key)
    manifest = job.checkpoint(2)
    assert job.written[2] == {4: "full"}
    assert 4 not in manifest.components[COMPONENT].chains
    assert restore_all(store, 2, 2) == {KEYS[5][0]: 2}


def test_a_key_group_written_and_emptied_between_checkpoints_writes_nothing():
    state = ResidentState(SCHEMA, KeyGroupRange(0, 3))
    state.table.put(1, ("a",), (1,))
    state.table.put(2, ("b",), (2,))
    state.table.delete(2, ("b",))
    state.table.put(3, ("c",), (3,))
    assert [(g, kind, t.num_rows) for g, kind, t in state.snapshot()] == [(1, "full", 1), (3, "full", 1)]
    assert state.snapshot() == []


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("retained", [0, -1, 1.5, True, "3"])
def test_retained_must_be_a_positive_int(retained):
    with pytest.raises(ConfigError, match="retained checkpoints must be an integer >= 1"):
        ManifestLog(MemoryStorage(), retained=retained)


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", " padded"])
def test_component_names_are_validated(name):
    store = Store(MemoryStorage())
    with pytest.raises(ConfigError, match="component name"):
        store.blobs.write_items(name, 1, 0, [])
    with pytest.raises(ConfigError, match="component name"):
        store.commit(1, {name: (ComponentSpec(name or "x", M, 1, SCHEMA), [])}, {})


# --------------------------------------------------------------------------- full and delta records


def _many_key_groups(store: Store, max_parallelism: int, parallelism: int, checkpoints: int, changed: int):
    """Every key group holds state; then each checkpoint changes ``changed`` key groups (a delta entry each)."""
    states = [ResidentState(SCHEMA, key_group_range(i, parallelism, max_parallelism)) for i in range(parallelism)]

    def commit(checkpoint_id: int):
        refs = [
            r for r in (s.checkpoint(store.blobs, COMPONENT, checkpoint_id, i)[0] for i, s in enumerate(states)) if r
        ]
        spec = ComponentSpec(COMPONENT, max_parallelism, parallelism, SCHEMA)
        return store.commit(checkpoint_id, {COMPONENT: (spec, refs)}, {"src": checkpoint_id}), refs

    for g in range(max_parallelism):
        for n in range(3):
            states[instance_for_key_group(g, parallelism, max_parallelism)].table.put(g, (f"{g}-{n}",), (n,))
    manifests = [commit(0)[0]]
    for checkpoint_id in range(1, checkpoints + 1):
        for g in range(checkpoint_id, max_parallelism, max_parallelism // changed):
            states[instance_for_key_group(g, parallelism, max_parallelism)].table.put(g, (f"{g}-0",), (-checkpoint_id,))
        manifests.append(commit(checkpoint_id)[0])
    return manifests


def test_a_checkpoint_that_changes_few_key_groups_writes_a_small_delta_record(monkeypatch):
    storage = MemoryStorage()
    manifests = _many_key_groups(Store(storage, retained=2), 1024, 4, 5, changed=8)
    sizes = [len(storage.read(manifest_path(m.checkpoint_id))) for m in manifests]
    assert max(sizes[1:]) * 10 < sizes[0]  # 8 of 1024 key groups changed: a fraction of the full record
    cold = Store(storage)  # reads the deltas on top of the full record 0
    for manifest in manifests[1:]:
        assert cold.load(manifest.checkpoint_id) == manifest
    assert decode_record(storage.read(manifest_path(5)), "m")["kind"] == "delta"


def test_a_full_record_follows_at_most_max_deltas_deltas(monkeypatch):
    monkeypatch.setattr("spark_state.store.manifestlog.MAX_DELTAS", 3)
    storage = MemoryStorage()
    _many_key_groups(Store(storage, retained=2), 1024, 2, 9, changed=4)
    kinds = [decode_record(storage.read(manifest_path(i)), "m")["kind"] for i in Store(storage).committed_ids()]
    assert "delta" in kinds and all(run <= 3 for run in map(len, "".join(k[0] for k in kinds).split("f")))


def test_a_delta_record_whose_base_record_is_missing_or_damaged_is_never_read():
    storage = MemoryStorage()
    _many_key_groups(Store(storage, retained=5), 256, 2, 3, changed=4)
    data = storage.read(manifest_path(1))
    storage.delete(manifest_path(1))
    with pytest.raises(
        CorruptBlobError, match="delta on checkpoint 1, whose record .*00000000000000000001.json is missing"
    ):
        Store(storage).load(2)
    storage.create(manifest_path(1), data[:-3] + b"}}}")
    with pytest.raises(CorruptBlobError, match="00000000000000000001.json"):
        Store(storage).load(3)


def test_a_reader_keeps_a_bounded_number_of_parsed_manifests(monkeypatch):
    monkeypatch.setattr("spark_state.store.manifestlog.CACHED_MANIFESTS", 4)
    storage = MemoryStorage()
    store = Store(storage, retained=20)
    for checkpoint_id in range(12):
        store.commit(checkpoint_id, {}, {"src": checkpoint_id})
    reader = ManifestLog(storage)
    for checkpoint_id in range(12):
        assert reader.load(checkpoint_id).sources == {"src": checkpoint_id}
    assert len(reader._manifests) == 4


def test_a_delta_record_clears_key_groups_whose_only_new_blob_is_unreferenced():
    """A checkpoint that only empties key groups writes a blob of empty full entries, which no chain keeps."""
    storage = MemoryStorage()
    store = Store(storage)
    state = ResidentState(SCHEMA, key_group_range(0, 1, M))
    spec = ComponentSpec(COMPONENT, M, 1, SCHEMA)
    for key in KEYS[2][:3]:
        state.table.put(2, (key,), (1,))
    state.table.put(5, (KEYS[5][0],), (1,))
    store.commit(1, {COMPONENT: (spec, [state.checkpoint(store.blobs, COMPONENT, 1, 0)[0]])}, {})
    for key in KEYS[2][:3]:
        state.table.delete(2, (key,))
    emptied = store.commit(2, {COMPONENT: (spec, [state.checkpoint(store.blobs, COMPONENT, 2, 0)[0]])}, {})
    assert decode_record(storage.read(manifest_path(2)), "m")["kind"] == "delta"
    assert sorted(emptied.components[COMPONENT].chains) == [5]
    assert Store(storage).load(2) == emptied
