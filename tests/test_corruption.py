"""Corruption is detected, never served, and recoverable (no Spark).

For every kind of file we write (state blob, instance items, checkpoint
record, log segment, log commit) a flipped byte, a truncated file and a
missing file raise a typed error that names the file and says what to do.
The recovery: a new query starts from an older retained checkpoint
(``spark.state.restoreFrom``), commits on top of it, and the damaged
checkpoints are discarded by cleanup.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from datasources.errors import CorruptLogError, SegmentMissingError
from datasources.log import ReplayableLog
from datasources.logindex import LogMeta, SinkMark
from spark_state.driver.coordinator import Coordinator, SparkBatch
from spark_state.errors import (
    CorruptBlobError,
    MissingFileError,
    NoCheckpointError,
    StateOfAnotherQueryError,
    StorageError,
)
from spark_state.executor.report import InstanceReport
from spark_state.executor.resident import restore_instance
from spark_state.storage import LocalStorage
from spark_state.store.manifest import ComponentSpec, QueryBinding
from spark_state.store.manifestlog import ManifestLog, ManifestReader, manifest_path
from tests.stores import Store
from tests.test_manifestlog import COMPONENT, KEYS, SCHEMA, Job, M, restore_all

DAMAGES = ("flip", "truncate", "delete")


def damage(storage: LocalStorage, path: str, how: str) -> None:
    data = storage.read(path)
    storage.delete(path)
    if how == "flip":
        position = len(data) // 2
        storage.create(path, data[:position] + bytes([data[position] ^ 0x40]) + data[position + 1 :])
    elif how == "truncate":
        storage.create(path, data[: len(data) // 2])


def history(tmp_path) -> tuple[Store, Job]:
    store = Store(LocalStorage(tmp_path / "state"), retained=3)
    job = Job(store, 2)
    for checkpoint_id in range(1, 5):
        for g in range(M):
            job.put(KEYS[g][checkpoint_id], checkpoint_id)
        job.checkpoint(checkpoint_id)
    return store, job


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_state_blob_is_a_typed_error_naming_it(tmp_path, how):
    store, _ = history(tmp_path)
    component = store.latest().components[COMPONENT]
    path = sorted(component.blobs)[-1]
    damage(store.storage, path, how)
    with pytest.raises((CorruptBlobError, MissingFileError)) as error:
        for instance in range(2):
            restore_instance(store.blobs, component, SCHEMA, instance, 2, M)
    assert path in str(error.value) and "restoreFrom" in str(error.value)


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_instance_items_are_a_typed_error_naming_them(tmp_path, how):
    store = Store(LocalStorage(tmp_path / "state"))
    ref = store.blobs.write_items(COMPONENT, 1, 0, ["a", {"b": 1}])
    damage(store.storage, ref.path, how)
    with pytest.raises((CorruptBlobError, MissingFileError)) as error:
        store.blobs.read_items(ref)
    assert ref.path in str(error.value) and "restoreFrom" in str(error.value)


@pytest.mark.parametrize("how", ("flip", "truncate"))
def test_a_damaged_checkpoint_record_is_a_typed_error_naming_it(tmp_path, how):
    store, _ = history(tmp_path)
    damage(store.storage, manifest_path(4), how)
    with pytest.raises(CorruptBlobError) as error:
        ManifestReader(store.storage).latest()
    assert manifest_path(4) in str(error.value) and "restoreFrom" in str(error.value)


def test_a_missing_record_a_delta_is_read_from_is_a_typed_error_naming_it(tmp_path):
    store, _ = history(tmp_path)
    base = store.load(4).to_json(store.load(3))["base"]
    store.storage.delete(manifest_path(base))
    with pytest.raises(CorruptBlobError, match=f"{base:020d}.json.* is missing"):
        ManifestReader(store.storage).load(4)


def _log(tmp_path) -> ReplayableLog:
    schema = pa.schema([pa.field("k", pa.string())])
    log = ReplayableLog.create(LocalStorage(tmp_path / "log"), LogMeta("log", 2, schema))
    for n in range(3):
        writer = log.segment_writer()
        writer.add(n % 2, pa.record_batch([pa.array([f"r{n}-{i}" for i in range(5)])], schema=schema))
        log.append(writer.finish(), SinkMark("s", n))
    return log


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_log_segment_is_a_typed_error_naming_it(tmp_path, how):
    log = _log(tmp_path)
    path = log.index().splits[0].segments[0].path
    damage(log.storage, path, how)
    fresh = ReplayableLog.open(LocalStorage(tmp_path / "log"))
    with pytest.raises((CorruptLogError, SegmentMissingError)) as error:
        list(fresh.read_range({0: 0, 1: 0}, fresh.index().end_offsets()))
    assert path in str(error.value) and ("restore" in str(error.value) or "start from" in str(error.value))


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_log_commit_is_a_typed_error_naming_it(tmp_path, how):
    """A missing commit in the middle used to end the log silently there; every later record was dropped."""
    log = _log(tmp_path)
    path = log.commits.path(1)
    damage(log.storage, path, how)
    with pytest.raises(CorruptLogError) as error:
        ReplayableLog.open(LocalStorage(tmp_path / "log")).index()
    assert path in str(error.value) and "restore the file" in str(error.value).lower()


# --- recovery: spark.state.restoreFrom -----------------------------------------------------------


def _batch(query: str, batch_id: int, start: int, end: int) -> SparkBatch:
    return SparkBatch(
        query, None, batch_id, f"/chk/{query}", {"src": {"offset": end}}, {"src": {"offset": start} if start else None}
    )


def test_restore_from_an_older_checkpoint_past_a_damaged_newest_one(tmp_path):
    store, job = history(tmp_path)  # checkpoints 1..4, each recording {"src": {"offset": id}}
    damage(store.storage, manifest_path(4), "flip")
    manifests = ManifestLog(store.storage, retained=3)
    coordinator = Coordinator(manifests, store=str(tmp_path / "state"))
    spec = ComponentSpec(COMPONENT, M, 2, SCHEMA)
    with pytest.raises(StateOfAnotherQueryError, match="the state ends at"):  # must start at checkpoint 3's offsets
        coordinator.begin(_batch("new", 0, 0, 9), spec, restore_from=3)
    plan = coordinator.begin(_batch("new", 0, 3, 9), spec, restore_from=3)
    assert (plan.checkpoint_id, plan.base.checkpoint_id, plan.restored) == (5, 3, True)
    reports = [InstanceReport(i, None, None) for i in range(2)]
    committed = coordinator.commit(plan, _batch("new", 0, 3, 9), spec, reports)
    assert committed.consistent_checkpoints == (5, 3, 2)
    coordinator.cleanup(committed, grace_seconds=0)
    assert manifest_path(4) not in [manifest_path(i) for i in ManifestReader(store.storage).ids()]
    assert restore_all(Store(store.storage), 5, 3) == job.committed[3]  # the state of checkpoint 3, intact
    # the setting is spent once the restored query committed: its next batch follows its own checkpoint
    later = coordinator.begin(_batch("new", 1, 9, 12), spec, restore_from=3)
    assert (later.checkpoint_id, later.base.checkpoint_id, later.restored) == (6, 5, False)
    assert ManifestReader(store.storage).latest().binding == QueryBinding(
        "new", None, 0, "/chk/new", {"src": {"offset": 3}}
    )


def test_restore_from_a_checkpoint_that_is_gone_says_which_are_retained(tmp_path):
    store, _ = history(tmp_path)
    coordinator = Coordinator(ManifestLog(store.storage), store="s")
    with pytest.raises(
        NoCheckpointError, match=r"restoreFrom=99: checkpoint 99 does not exist .*committed: \[1, 2, 3, 4\]"
    ):
        coordinator.begin(_batch("new", 0, 1, 9), ComponentSpec(COMPONENT, M, 2, SCHEMA), restore_from=99)


def test_random_damage_to_any_file_is_never_served(tmp_path):
    """Every file of a store, damaged at a random byte: a restore either raises a typed error or is exact."""
    store, job = history(tmp_path)
    rng = random.Random(4)
    files = []
    pending = [""]
    while pending:
        path = pending.pop()
        children = store.storage.list(path)
        if not children and path:
            files.append(path)
        pending.extend(f"{path}/{c}" if path else c for c in children)
    for path in files:
        data = store.storage.read(path)
        if not data:
            continue
        position = rng.randrange(len(data))
        store.storage.delete(path)
        store.storage.create(path, data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :])
        try:
            assert restore_all(Store(store.storage), 4, 2) == job.committed[4]
        except StorageError:
            pass  # typed (CorruptBlobError, MissingFileError, ...)
        store.storage.delete(path)
        store.storage.create(path, data)
