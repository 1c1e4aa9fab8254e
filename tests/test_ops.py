"""What the CLI reports (``spark_state.ops.inspect``) and the state reader's options, on stores written without Spark."""

from __future__ import annotations

import pytest

from datasources.errors import StateReaderOptionError
from datasources.state_reader import ReaderOptions
from spark_state.ops.inspect import describe, list_checkpoints, plan_rescale, verify_store
from spark_state.storage.memory import MemoryStorage
from spark_state.store.manifestlog import ManifestReader, manifest_path
from spark_state.store.savepoints import Savepoints, create_savepoint, savepoint_path
from tests.stores import Store
from tests.test_manifestlog import COMPONENT, KEYS, Job, M


def _store(retained: int = 2) -> tuple[Store, Job]:
    store = Store(MemoryStorage(), retained=retained)
    job = Job(store, 2)
    for checkpoint_id in range(1, 6):
        for g in range(M):
            job.put(KEYS[g][checkpoint_id], checkpoint_id)
        job.checkpoint(checkpoint_id)
        if checkpoint_id == 2:
            create_savepoint(store.manifests, "two")
    return store, job


def test_checkpoints_are_the_restorable_ones_newest_first():
    store, _ = _store()
    listed = list_checkpoints(ManifestReader(store.storage))
    assert [(c["checkpoint_id"], c["retained"], c["savepoints"]) for c in listed] == [
        (5, True, []),
        (4, True, []),
        (2, False, ["two"]),
    ]
    assert listed[0]["components"][COMPONENT] == {
        "parallelism": 2,
        "max_parallelism": M,
        "key_groups_with_state": M,
        "bytes": listed[0]["bytes_referenced"],
    }
    assert listed[0]["sources"] == {"src": {"offset": 5}}


def test_describe_and_plan():
    store, job = _store()
    data = describe(store.latest(), COMPONENT)["components"][0]
    assert [i["key_groups"] for i in data["instances"]] == [[0, 3], [4, 7]]
    assert sum(i["entries"] for i in data["instances"]) == sum(g["entries"] for g in data["key_groups"])
    assert sum(g["rows"] for g in data["key_groups"]) >= len(job.committed[5])
    assert data["chain_lengths"] and data["timers"]["variable"] is False
    planned = plan_rescale(store.latest().components[COMPONENT], 3)
    assert [i["key_groups"] for i in planned["target"]["instances"]] == [[0, 2], [3, 5], [6, 7]]
    assert planned["target"]["bytes"] == planned["current"]["bytes"] == planned["state_bytes"]


def test_verify_reports_a_damaged_record_and_a_savepoint_without_its_checkpoint():
    store, _ = _store()
    reader = ManifestReader(store.storage)
    assert verify_store(reader)["ok"]
    data = store.storage.read(manifest_path(5))
    store.storage.create(manifest_path(5), data[:-3] + b"xx}", overwrite=True)
    store.storage.delete(manifest_path(2))
    report = verify_store(ManifestReader(store.storage), deep=True)
    assert not report["ok"]
    whats = sorted((p["what"], p["path"]) for p in report["problems"])
    assert ("record", manifest_path(5)) in whats
    assert any(p["what"] == "record" and "pinned by savepoint 'two'" in p["detail"] for p in report["problems"])
    store.storage.create(savepoint_path("bad"), b"{}")
    assert any(p["what"] == "savepoint" for p in verify_store(ManifestReader(store.storage))["problems"])
    assert "bad" in Savepoints(store.storage).list().damaged


@pytest.mark.parametrize(
    "options, message",
    [
        ({"store": "/s"}, "needs option"),
        ({"store": "/s", "component": "c", "componet": "x"}, "unknown option"),
        ({"store": "/s", "component": "c", "partitions": "0"}, "partitions='0'"),
        ({"store": "/s", "component": "c", "readChangeFeed": "true"}, "needs option\\('changeStartCheckpoint'"),
        ({"store": "/s", "component": "c", "changeStartCheckpoint": "3"}, "need option\\('readChangeFeed'"),
        ({"store": "/s", "component": "c", "timers": "yes"}, "timers='yes' must be true or false"),
    ],
)
def test_state_reader_options_are_checked(options, message):
    with pytest.raises(StateReaderOptionError, match=message):
        ReaderOptions.parse(options)


def test_state_reader_options_parse_case_insensitively():
    parsed = ReaderOptions.parse(
        {
            "STORE": "/s",
            "Component": "c",
            "readchangefeed": "TRUE",
            "changeStartCheckpoint": "before",
            "partitions": "3",
        }
    )
    assert (parsed.store, parsed.component, parsed.change_feed, parsed.change_start, parsed.partitions) == (
        "/s",
        "c",
        True,
        "before",
        3,
    )


def test_verify_names_a_chain_whose_entries_are_out_of_order():
    """A chain starts with its full entry; a merge entry may only follow it directly (``chains``)."""
    from dataclasses import replace

    from spark_state.ops.inspect import _check_chains

    store = Store(MemoryStorage(), retained=8)
    job = Job(store, 1, max_chain_length=3)
    for key in KEYS[0]:
        job.put(key, 0)
    for checkpoint_id in range(1, 6):
        job.put(KEYS[0][0], checkpoint_id)  # one key of twelve, again and again: full, delta, delta, merge, delta
        job.checkpoint(checkpoint_id)
    component = store.manifests.load(5).components[COMPONENT]
    full, merge, delta = component.chains[0]
    assert [component.blobs[p].index.entry_for(0).kind for p in (full, merge, delta)] == ["full", "merge", "delta"]
    for chain, wrong in [
        ((full, merge, delta), None),
        ((merge,), "starts with a merge entry"),
        ((full, delta, merge), "may only follow the full"),
        ((full, merge, full), "may only start it"),
    ]:
        problems = []
        _check_chains(replace(component, chains={0: chain}), 5, lambda *args: problems.append(args))
        assert [wrong in p[2] for p in problems] == ([] if wrong is None else [True]), (chain, problems)
