"""Storage faults (``spark_state.storage.faults``), storage timeouts, and what the commit protocols make of them.

Each fault must give a typed error naming the path, commit nothing, and let a
retry after the fault clears succeed. No Spark here; the fault campaign
(``tests/campaign``) injects the same faults into real queries.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from spark_state.errors import (
    BlobNotFoundError,
    CommitFailedError,
    ConfigError,
    StorageError,
    StorageTimeoutError,
)
from spark_state.storage import LocalStorage, MemoryStorage, open_storage
from spark_state.storage.faults import FAULT_PLAN_ENV, FaultPlan, FaultStorage, InjectedStorageError
from spark_state.storage.timeouts import TimeoutStorage, unwrapped
from spark_state.store.commitlog import CommitLog
from spark_state.store.manifestlog import ManifestLog, manifest_path
from tests.stores import Store


def plan(tmp_path, *rules: dict, timeout: float | None = None) -> FaultPlan:
    path = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*')))}.json"
    path.write_text(json.dumps({"rules": list(rules), "timeout_seconds": timeout}))
    return FaultPlan.load(str(path))


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path):
    return LocalStorage(tmp_path / "root") if request.param == "local" else MemoryStorage()


def test_the_nth_matching_write_fails_with_a_typed_error_naming_the_path_and_writes_nothing(tmp_path, backend):
    storage = FaultStorage(backend, plan(tmp_path, {"op": "create", "path": "/blobs/", "nth": 2, "fault": "error"}))
    storage.create("blobs/a", b"1")
    storage.create("other/b", b"2")  # does not match: not counted
    with pytest.raises(InjectedStorageError, match="'blobs/c'"):
        storage.create("blobs/c", b"3")
    assert not backend.exists("blobs/c")
    storage.create("blobs/c", b"3")  # fired once: the retry succeeds
    assert backend.read("blobs/c") == b"3"


def test_rules_match_a_store_uri_without_its_parameters(tmp_path):
    """An s3:// store's URI carries its endpoint as parameters; a rule names the bucket and prefix only."""
    inner = MemoryStorage()
    inner.uri = "s3://bucket/q/state?endpoint=http://127.0.0.1:8333&path_style=true"
    storage = FaultStorage(
        inner,
        plan(tmp_path, {"op": "create", "path": r"^s3://bucket/q/state/checkpoints/", "nth": 1, "fault": "error"}),
    )
    storage.create("blobs/a", b"1")
    with pytest.raises(InjectedStorageError, match="'checkpoints/1.json'"):
        storage.create("checkpoints/1.json", b"{}")


def test_a_read_fault_and_no_space_left(tmp_path, backend):
    backend.create("d/x", b"data")
    storage = FaultStorage(
        backend,
        plan(
            tmp_path,
            {"op": "read", "path": "d/x", "nth": 1, "fault": "error"},
            {"op": "create", "path": "d/y", "nth": 1, "fault": "enospc"},
        ),
    )
    with pytest.raises(InjectedStorageError, match="read of 'd/x'"):
        storage.read("d/x")
    assert storage.read("d/x") == b"data"
    with pytest.raises(StorageError, match=f"'d/y'.*Errno {errno.ENOSPC}.*No space left on device"):
        storage.create("d/y", b"1")
    assert not backend.exists("d/y")


def test_counts_are_shared_by_every_process_that_loads_the_plan(tmp_path, backend):
    path = tmp_path / "shared.json"
    path.write_text(json.dumps({"rules": [{"op": "create", "path": "p/", "nth": 3, "fault": "error"}]}))
    first, second = FaultStorage(backend, FaultPlan.load(str(path))), FaultStorage(backend, FaultPlan.load(str(path)))
    first.create("p/1", b"")
    second.create("p/2", b"")
    with pytest.raises(InjectedStorageError):
        first.create("p/3", b"")
    assert [f["path"] for f in FaultPlan.load(str(path)).fired()] == [f"{backend.uri}/p/3"]


def test_a_stalled_call_times_out_with_a_typed_error_naming_the_path(tmp_path, backend):
    faults = plan(tmp_path, {"op": "read", "path": "slow", "nth": 1, "fault": "stall", "stall_seconds": 30})
    backend.create("slow", b"x")
    storage = TimeoutStorage(FaultStorage(backend, faults), timeout_seconds=0.2)
    with pytest.raises(StorageTimeoutError, match="read of 'slow'"):
        storage.read("slow")
    assert storage.read("slow") == b"x"  # the stalled thread is left behind; the next call is served


def test_a_truncated_commit_record_commits_nothing_and_the_retry_commits(tmp_path, backend):
    faults = plan(tmp_path, {"op": "create", "path": "/log/", "nth": 1, "fault": "truncate"})
    log = CommitLog(FaultStorage(backend, faults), "log", what="log commit")
    with pytest.raises(CommitFailedError, match="log commit 0 was not committed.*deleted"):
        log.create(0, {"n": 0})
    assert log.ids() == []  # the partial record was removed
    log.create(0, {"n": 0})
    assert log.load(0) == {"n": 0}


def test_a_manifest_commit_that_failed_but_published_counts_as_committed(tmp_path, backend):
    """A create that raises after publishing (an unknown outcome) is settled by reading the record back."""

    class PublishThenFail(FaultStorage):
        def create(self, path, data, *, overwrite=False):
            self.inner.create(path, data, overwrite=overwrite)
            if path.startswith("checkpoints/"):
                raise StorageError(f"create of {path!r}: connection reset after the upload")

    store = Store(backend)
    storage = PublishThenFail(backend, plan(tmp_path))
    manifests = ManifestLog(storage)
    from spark_state.store.manifest import next_manifest

    manifest = manifests.commit(next_manifest(None, 0, {}, {"s": 1}))
    assert manifest.checkpoint_id == 0 and store.latest().sources == {"s": 1}
    assert backend.exists(manifest_path(0))


def test_a_commit_whose_read_back_fails_too_says_the_outcome_is_unknown(tmp_path, backend):
    faults = plan(
        tmp_path,
        {"op": "create", "path": "log/", "nth": 1, "fault": "error"},
        {"op": "read", "path": "log/", "nth": 1, "fault": "error"},
    )
    log = CommitLog(FaultStorage(backend, faults), "log")
    with pytest.raises(CommitFailedError, match="may or may not be committed"):
        log.create(0, {"n": 0})


def test_open_storage_injects_faults_only_when_the_plan_variable_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_PLAN_ENV, raising=False)
    plain = open_storage(str(tmp_path / "s"))
    assert isinstance(plain, TimeoutStorage) and isinstance(unwrapped(plain), LocalStorage)
    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps({"timeout_seconds": 7, "rules": [{"op": "create", "path": "x", "nth": 1, "fault": "error"}]})
    )
    monkeypatch.setenv(FAULT_PLAN_ENV, str(path))
    faulty = open_storage(str(tmp_path / "s"))
    assert isinstance(faulty.inner, FaultStorage) and faulty.timeout_seconds == 7
    with pytest.raises(InjectedStorageError, match="'x'"):
        faulty.create("x", b"")
    assert faulty == plain and faulty.root == plain.root


def test_bad_rules_are_refused():
    from spark_state.storage.faults import FaultRule

    with pytest.raises(ConfigError, match="truncate"):
        FaultRule("read", "x", 1, "truncate")
    with pytest.raises(ConfigError, match="nth"):
        FaultRule("create", "x", 0, "error")


# --- delete against concurrent creates (the storage contract) -------------------------------


def test_local_delete_of_a_directory_that_a_concurrent_create_fills_does_not_fail(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path / "root")
    storage.create("dir/old", b"old")
    real_rmdir = os.rmdir
    created = []

    def rmdir_after_a_create(path, *args, **kwargs):
        if not created:  # another process creates a blob in the directory as the delete empties it
            created.append(True)
            LocalStorage(tmp_path / "root").create("dir/new", b"new")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_after_a_create)
    storage.delete("dir")  # 'Directory not empty' before the contract said otherwise
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    assert created and not storage.exists("dir/old")
    assert storage.read("dir/new") == b"new"


def test_deletes_racing_creates_never_fail_and_creates_publish_whole_or_fail(backend):
    stop = threading.Event()
    failures: list[BaseException] = []
    published: list[str] = []

    def creator() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                backend.create(f"dir/{n}", b"x" * 100)
                published.append(f"dir/{n}")
            except StorageError:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

    thread = threading.Thread(target=creator)
    thread.start()
    try:
        for _ in range(200):
            backend.delete("dir")
    finally:
        stop.set()
        thread.join()
    assert failures == []
    for path in published:
        try:
            assert backend.read(path) == b"x" * 100
        except BlobNotFoundError:
            pass  # deleted after it was published
