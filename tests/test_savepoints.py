"""Savepoints (``spark_state.store.savepoints``): pinned checkpoints that retention and cleanup keep. No Spark."""

from __future__ import annotations

import shutil

import pytest

from spark_state.errors import (
    ConfigError,
    CorruptBlobError,
    NoCheckpointError,
    SavepointError,
    SavepointExistsError,
    SavepointNotFoundError,
    StorageError,
)
from spark_state.storage.base import ForwardingStorage, Storage
from spark_state.storage.local import LocalStorage
from spark_state.storage.memory import MemoryStorage
from spark_state.store.commitlog import encode_record
from spark_state.store.manifestlog import ManifestLog, manifest_path
from spark_state.store.savepoints import (
    SAVEPOINTS_DIR,
    Savepoints,
    create_savepoint,
    parse_savepoint_uri,
    savepoint_path,
)
from tests.stores import Store
from tests.test_manifestlog import (
    COMPONENT,
    KEYS,
    Job,
    M,
    _CrashingDeletes,
    files_under,
    restore_all,
)


def _history(store: Store, checkpoints: int, *, savepoint_at: dict[int, str] | None = None) -> Job:
    """``checkpoints`` checkpoints at parallelism 2 with cleanup, each changing some keys; savepoints on the way."""
    job = Job(store, 2)
    for checkpoint_id in range(1, checkpoints + 1):
        for g in range(M):
            job.put(KEYS[g][checkpoint_id % 12], checkpoint_id * 10 + g)
            if checkpoint_id % 3 == 0:
                job.delete(KEYS[g][(checkpoint_id + 5) % 12])
        job.checkpoint(checkpoint_id)
        if savepoint_at and checkpoint_id in savepoint_at:
            create_savepoint(store.manifests, savepoint_at[checkpoint_id], reason="test")
    return job


def test_a_savepoint_survives_retention_and_cleanup_over_many_checkpoints(tmp_path):
    store = Store(LocalStorage(tmp_path / "state"), retained=2)
    job = _history(store, 30, savepoint_at={3: "before-upgrade", 11: "nightly"})
    latest = store.latest()
    assert latest.checkpoint_id == 30 and latest.consistent_checkpoints == (30, 29)
    assert store.manifests.restorable() == {30: [], 29: [], 11: ["nightly"], 3: ["before-upgrade"]}
    for checkpoint_id in (3, 11):
        for parallelism in (1, 3, 8):
            assert restore_all(Store(store.storage), checkpoint_id, parallelism) == job.committed[checkpoint_id]
    # what is kept: the retained and pinned checkpoints' records (with their delta bases) and files, nothing else
    kept_ids = {30, 29, 11, 3}
    records = store.manifests.records_needed(kept_ids)
    assert store.committed_ids() == sorted(records) and len(records) < 30
    pinned_refs = set()
    for checkpoint_id in kept_ids:
        component = store.load(checkpoint_id).components[COMPONENT]
        pinned_refs |= set(component.blobs)
    assert files_under(store.storage, "blobs") == pinned_refs

    # deleting a savepoint frees its checkpoint at the next cleanup
    Savepoints(store.storage).delete("before-upgrade")
    store.cleanup(store.latest())
    assert 3 not in store.committed_ids()
    with pytest.raises(NoCheckpointError):
        Store(store.storage).load(3)
    assert restore_all(Store(store.storage), 11, 4) == job.committed[11]
    assert store.manifests.restorable() == {30: [], 29: [], 11: ["nightly"]}


def test_savepoint_records_the_plan_and_the_offsets():
    store = Store(MemoryStorage(), retained=3)
    _history(store, 4)
    savepoint = create_savepoint(store.manifests, "sp-1", 3)
    again = Savepoints(store.storage).get("sp-1")
    assert again == savepoint
    assert savepoint.checkpoint_id == 3 and savepoint.sources == {"src": {"offset": 3}}
    plan = savepoint.components[COMPONENT]
    assert (plan.max_parallelism, plan.parallelism, plan.key_columns) == (M, 2, ("key",))
    assert plan.schema == store.load(3).components[COMPONENT].schema
    assert savepoint.uri == f"{store.storage.uri}/{SAVEPOINTS_DIR}/sp-1"
    assert parse_savepoint_uri(savepoint.uri) == (store.storage.uri, "sp-1")


def test_savepoint_names_checkpoints_and_duplicates_are_checked():
    store = Store(MemoryStorage(), retained=2)
    with pytest.raises(NoCheckpointError, match="no checkpoint"):
        create_savepoint(store.manifests, "a")
    _history(store, 5)
    for bad in ("", "../x", "a/b", ".hidden", "x.json", "a" * 129):
        with pytest.raises(ConfigError, match="savepoint name"):
            create_savepoint(store.manifests, bad)
    with pytest.raises(NoCheckpointError, match="checkpoint 2 .* is not retained"):
        create_savepoint(store.manifests, "old", 2)
    create_savepoint(store.manifests, "a", 4)
    with pytest.raises(SavepointExistsError, match="already exists"):
        create_savepoint(store.manifests, "a")
    assert Savepoints(store.storage).get("a").checkpoint_id == 4
    # a pinned checkpoint can be savepointed again after it left retention
    _history_more(store, 6, 8)
    assert create_savepoint(store.manifests, "b", 4).checkpoint_id == 4
    with pytest.raises(SavepointNotFoundError, match="no savepoint 'c'.*'a', 'b'"):
        Savepoints(store.storage).get("c")
    with pytest.raises(ConfigError, match="not a savepoint URI"):
        parse_savepoint_uri("/state/checkpoints/3")


def test_a_savepoint_uri_puts_its_store_s_parameters_after_the_name():
    from spark_state.store.savepoints import Savepoint

    store = "s3://bucket/jobs/state?endpoint=http://127.0.0.1:9000&path_style=true"
    savepoint = Savepoint("sp", 1, 0.0, 0.0, {}, {}, store=store)
    assert savepoint.uri == "s3://bucket/jobs/state/savepoints/sp?endpoint=http://127.0.0.1:9000&path_style=true"
    assert parse_savepoint_uri(savepoint.uri) == (store, "sp")
    assert parse_savepoint_uri(f"{store}/savepoints/sp") == (store, "sp")  # the form earlier versions printed
    assert parse_savepoint_uri("s3://bucket/state/savepoints/sp") == ("s3://bucket/state", "sp")


def _history_more(store: Store, first: int, last: int) -> None:
    for checkpoint_id in range(first, last + 1):
        store.cleanup(store.commit(checkpoint_id, {}, {"src": {"offset": checkpoint_id}}))


class _CommitsWhileCreating(ForwardingStorage):
    """Commits newer checkpoints (with cleanup) right after a savepoint record is created: a query racing it."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self.store: Store | None = None

    def create(self, path, data, *, overwrite=False):
        super().create(path, data, overwrite=overwrite)
        if path.startswith(SAVEPOINTS_DIR + "/") and self.store is not None:
            store, self.store = self.store, None
            latest = store.latest().checkpoint_id
            for checkpoint_id in range(latest + 1, latest + 4):
                store.cleanup(store.commit(checkpoint_id, {}, {}))


def test_a_checkpoint_that_leaves_retention_while_it_is_savepointed_is_refused_not_half_kept():
    racing = _CommitsWhileCreating(MemoryStorage())
    store = Store(racing, retained=2)
    _history(store, 4)
    racing.store = store
    with pytest.raises(SavepointError, match="fell out of retention.*Retry"):
        create_savepoint(store.manifests, "late", 4)
    assert Savepoints(store.storage).names() == []
    # pinned by another savepoint first, the same race is harmless
    store2 = Store(_CommitsWhileCreating(MemoryStorage()), retained=2)
    job = _history(store2, 4, savepoint_at={4: "first"})
    store2.storage.store = store2
    create_savepoint(store2.manifests, "second", 4)
    assert sorted(Savepoints(store2.storage).names()) == ["first", "second"]
    assert restore_all(Store(store2.storage), 4, 3) == job.committed[4]


def test_a_damaged_savepoint_record_stops_cleanup_instead_of_guessing(monkeypatch):
    monkeypatch.setattr("spark_state.store.manifestlog.MAX_DELTAS", 0)  # full records: old ones are garbage
    store = Store(MemoryStorage(), retained=2)
    _history(store, 3, savepoint_at={2: "good"})
    store.storage.create(savepoint_path("bad"), b'{"crc32": 1, "body": "{}"}')
    listing = Savepoints(store.storage).list()
    assert [s.name for s in listing.savepoints] == ["good"] and set(listing.damaged) == {"bad"}
    before = files_under(store.storage, "")
    for checkpoint_id in range(4, 8):
        manifest = store.commit(checkpoint_id, {}, {})
        assert store.cleanup(manifest) == []
    assert before <= files_under(store.storage, "")
    with pytest.raises(CorruptBlobError, match="savepoint delete"):
        store.manifests.plan_cleanup(store.latest())
    Savepoints(store.storage).delete("bad")
    assert store.cleanup(store.latest())  # now it deletes again


def test_sources_keep_the_offsets_savepoints_record():
    store = Store(MemoryStorage(), retained=2)
    _history(store, 6, savepoint_at={2: "sp"})
    assert store.manifests.retained_source_offsets("src") == [{"offset": 6}, {"offset": 5}, {"offset": 2}]


def test_plan_cleanup_is_what_cleanup_deletes():
    store = Store(MemoryStorage(), retained=2)
    job = _history(store, 6)
    job.put(KEYS[1][0], 1)
    for checkpoint_id in range(7, 10):
        job.checkpoint(checkpoint_id, cleanup=False)
    orphan = store.blobs.write_items(COMPONENT, 8, 0, ["an attempt never committed"])
    young = store.manifests.plan_cleanup(store.latest())  # within the grace period the orphan is kept
    assert orphan.path not in young.files
    plan = store.manifests.plan_cleanup(store.latest(), grace_seconds=0)
    assert plan.records and orphan.path in plan.files
    before = files_under(store.storage, "")
    deleted = store.cleanup(store.latest())
    assert deleted == [manifest_path(i) for i in plan.records] + list(plan.files)
    assert files_under(store.storage, "") == before - set(deleted)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_cleanup_crashing_at_every_delete_keeps_the_savepoint(backend, tmp_path):
    def build(storage: Storage) -> tuple[Job, Store]:
        store = Store(_CrashingDeletes(storage, None), retained=2)
        job = Job(store, 2)
        for checkpoint_id in range(1, 9):
            for g in range(M):
                job.put(KEYS[g][checkpoint_id], checkpoint_id)
            job.checkpoint(checkpoint_id, cleanup=False)
        return job, store

    template = MemoryStorage() if backend == "memory" else LocalStorage(tmp_path / "template")
    job, store = build(template)
    _pin(store, "pin", 3)  # nothing was cleaned up yet, so checkpoint 3 still loads
    reference = MemoryStorage() if backend == "memory" else LocalStorage(tmp_path / "reference")
    _copy(template, reference, tmp_path, backend)
    reference_store = Store(_CrashingDeletes(reference, None), retained=2)
    reference_store.cleanup(reference_store.latest())
    total = reference_store.storage.deletes
    assert total > 5
    for k in range(total):
        storage = MemoryStorage() if backend == "memory" else LocalStorage(tmp_path / f"run-{k}")
        _copy(template, storage, tmp_path, backend, k)
        crashing = Store(_CrashingDeletes(storage, k), retained=2)
        with pytest.raises(StorageError, match="injected crash"):
            crashing.cleanup(crashing.latest())
        survivor = Store(storage)
        assert restore_all(survivor, 3, 3) == job.committed[3], k
        assert restore_all(survivor, 8, 1) == job.committed[8], k
        survivor.cleanup(survivor.latest())
        assert restore_all(survivor, 3, 2) == job.committed[3], k


def _pin(store: Store, name: str, checkpoint_id: int) -> None:
    """A savepoint of ``checkpoint_id`` as ``create_savepoint`` writes it (the id must still be loadable)."""
    from spark_state.store.savepoints import Savepoint

    savepoint = Savepoint.of(name, store.load(checkpoint_id), store=store.storage.uri)
    store.storage.create(savepoint_path(name), encode_record(savepoint.to_json()))


def _copy(source: Storage, target: Storage, tmp_path, backend: str, k: int | None = None) -> None:
    if backend == "local":
        if k is None:
            shutil.copytree(tmp_path / "template", tmp_path / "reference", dirs_exist_ok=True)
        else:
            shutil.copytree(tmp_path / "template", tmp_path / f"run-{k}")
        return
    for path in sorted(files_under(source, "")):
        target.create(path, source.read(path))


def test_replayable_retention_never_trims_below_a_savepoint():
    from datasources.sources import retained_checkpoint_offsets, retention_floors

    storage = MemoryStorage.named("savepoint-floors")
    store = Store(storage, retained=2)
    source = "replayable:memory://events"
    for checkpoint_id in range(1, 7):
        store.cleanup(store.commit(checkpoint_id, {}, {source: {"source_id": source, "0": 100 * checkpoint_id}}))
        if checkpoint_id == 2:
            create_savepoint(store.manifests, "keep-200")
    retained = retained_checkpoint_offsets(storage.uri, source)
    assert retained == [{0: 600}, {0: 500}, {0: 200}]
    assert retention_floors({0: 700}, 10, retained) == {0: 200}
    Savepoints(storage).delete("keep-200")
    assert retention_floors({0: 700}, 10, retained_checkpoint_offsets(storage.uri, source)) == {0: 500}


# --------------------------------------------------------------------------- starting a new store from a savepoint


def _started(tmp_path):
    """Store A with history at parallelism 2 and a savepoint at checkpoint 5; B empty."""
    from spark_state.store.manifestlog import ManifestLog

    a = Store(LocalStorage(tmp_path / "a"), retained=2)
    job = _history(a, 5, savepoint_at={5: "sp"})
    _history_more(a, 6, 9)  # the query goes on past the savepoint
    b = ManifestLog(LocalStorage(tmp_path / "b"))
    return a, job, b


def _spec(schema=None, max_parallelism=M, parallelism=5, name=COMPONENT):
    from spark_state.store.manifest import ComponentSpec
    from tests.test_manifestlog import SCHEMA

    return ComponentSpec(name, max_parallelism, parallelism, schema or SCHEMA)


def test_a_new_store_starts_from_a_savepoint_by_copying_what_it_needs(tmp_path):
    from spark_state.store.startfrom import start_from_savepoint

    a, job, b = _started(tmp_path)
    uri = Savepoints(a.storage).get("sp").uri
    report = start_from_savepoint(b, uri, _spec())
    pinned = a.load(5)
    assert report.checkpoint_id == 5 and report.restored == (COMPONENT,) and report.dropped == ()
    first = b.latest()
    assert first.checkpoint_id == 5 and first.sources == pinned.sources == {"src": {"offset": 5}}
    assert first.components == pinned.components and first.binding is None
    assert first.origin == {"store": a.storage.uri, "savepoint": "sp", "checkpoint_id": 5}
    assert report.files_copied == len(pinned.components[COMPONENT].blobs)
    assert report.bytes_copied == sum(r.size for r in pinned.components[COMPONENT].blobs.values())
    assert restore_all(Store(b.storage), 5, 5) == job.committed[5]
    # a restart of the same query: nothing to do; the origin is carried into later checkpoints
    b.commit(_next(b, 6))
    again = start_from_savepoint(b, uri, _spec())
    assert again.checkpoint_id is None and b.latest().origin == first.origin
    # the old store is untouched and its savepoint still pins checkpoint 5
    assert a.manifests.restorable()[5] == ["sp"]
    # a restart once the savepoint is deleted: the new store holds its state, the record is not needed
    Savepoints(a.storage).delete("sp")
    assert start_from_savepoint(b, uri, _spec()).checkpoint_id is None


def _next(log, checkpoint_id):
    from spark_state.store.manifest import next_manifest

    return next_manifest(log.latest(), checkpoint_id, {}, {"src": {"offset": checkpoint_id}})


def test_a_start_that_does_not_fit_the_savepoint_is_refused_with_what_differs(tmp_path):
    import pyarrow as pa

    from spark_state.errors import SavepointMismatchError
    from spark_state.model.schema import KeyedSchema
    from spark_state.store.startfrom import start_from_savepoint

    a, _, b = _started(tmp_path)
    uri = Savepoints(a.storage).get("sp").uri
    cases = [
        (
            _spec(max_parallelism=32),
            "max parallelism is 32 but the savepoint's state was written with 8: set spark.state.maxParallelism=8",
        ),
        (
            _spec(KeyedSchema.of_values([pa.field("key", pa.int64())], [pa.field("value", pa.int64())])),
            "state column 'key' cannot change from string to int64",
        ),
        (
            _spec(KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int32())])),
            "'value.value' cannot change from int64 to int32",
        ),
        (_spec(name="renamed"), "component 'renamed' is not in the savepoint.*allow_non_restored_state=True"),
    ]
    for spec, message in cases:
        with pytest.raises(SavepointMismatchError, match=message):
            start_from_savepoint(b, uri, spec)
    assert b.latest() is None and files_under(b.storage, "") == set()
    # with spark.state.maxParallelism unset, the query takes the savepoint's key space
    assert start_from_savepoint(b, uri, _spec(max_parallelism=32), key_space_set=False).restored == (COMPONENT,)
    assert b.latest().components[COMPONENT].max_parallelism == M == 8
    b = ManifestLog(LocalStorage(tmp_path / "b2"))
    # allowed: the renamed component starts empty from the savepoint's offsets, the old state is dropped
    report = start_from_savepoint(b, uri, _spec(name="renamed"), allow_non_restored=True)
    assert report.restored == () and report.dropped == (COMPONENT,) and report.files_copied == 0
    assert b.latest().components == {} and b.latest().sources == {"src": {"offset": 5}}
    # a store that holds other state is never overwritten
    other = Store(LocalStorage(tmp_path / "c"))
    _history(other, 1)
    with pytest.raises(SavepointError, match="already holds state .* writes to an empty store"):
        start_from_savepoint(other.manifests, uri, _spec())
    # widening is fine
    from spark_state.store.startfrom import check_fits

    savepoint = Savepoints(a.storage).get("sp")
    assert check_fits(
        savepoint,
        _spec(
            KeyedSchema.of_values(
                [pa.field("key", pa.string())], [pa.field("value", pa.int64()), pa.field("extra", pa.string())]
            )
        ),
        allow_non_restored=False,
    ) == (COMPONENT,)


def test_a_damaged_savepoint_blob_is_not_copied_and_a_crashed_copy_resumes(tmp_path):
    from spark_state.store.startfrom import start_from_savepoint

    a, job, b = _started(tmp_path)
    uri = Savepoints(a.storage).get("sp").uri
    blobs = sorted(a.load(5).components[COMPONENT].blobs)
    victim = tmp_path / "a" / blobs[0]
    original = victim.read_bytes()
    victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(CorruptBlobError, match="does not match its manifest"):
        start_from_savepoint(b, uri, _spec())
    assert b.latest() is None
    victim.write_bytes(original)
    # a copy that stopped half way (one file truncated in the new store) is finished by the next start
    (tmp_path / "b" / blobs[0]).parent.mkdir(parents=True)
    (tmp_path / "b" / blobs[0]).write_bytes(original[:10])
    (tmp_path / "b" / blobs[1]).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "a" / blobs[1], tmp_path / "b" / blobs[1])  # ... and one copied whole: not copied again
    report = start_from_savepoint(b, uri, _spec())
    assert (report.files_copied, report.files_present) == (len(blobs) - 1, 1)
    assert restore_all(Store(b.storage), 5, 3) == job.committed[5]


def test_a_savepoint_of_an_s3_store_starts_a_local_store_through_the_uri_it_prints(s3_uri, tmp_path):
    from spark_state.storage import open_storage
    from spark_state.store.manifestlog import ManifestLog
    from spark_state.store.startfrom import start_from_savepoint

    a = Store(open_storage(s3_uri("a")), retained=2)
    job = _history(a, 3, savepoint_at={3: "sp"})
    uri = Savepoints(a.storage).get("sp").uri
    assert "/savepoints/sp?endpoint=" in uri  # the store's parameters after the name
    b = ManifestLog(LocalStorage(tmp_path / "b"))
    assert start_from_savepoint(b, uri, _spec()).checkpoint_id == 3
    assert restore_all(Store(b.storage), 3, 5) == job.committed[3]
    Savepoints(a.storage).delete("sp")  # the copy made it unneeded: a restart with the same setting goes on
    assert start_from_savepoint(b, uri, _spec()).checkpoint_id is None
