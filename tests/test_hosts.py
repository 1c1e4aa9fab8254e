"""Instance hosts leave when the store has no more use for their state (no Spark: the host's own loop)."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from spark_state.executor.task import forget_stores
from spark_state.hosts import adoption, policy, process, serving, tasks, wire, worker
from spark_state.hosts.policy import FULL_COLLECTION_TASKS, collect_garbage
from spark_state.hosts.trust import host_key, peer_credentials, prove_to_host
from spark_state.model.schema import KeyedSchema
from spark_state.storage.local import LocalStorage
from spark_state.store.manifest import ComponentSpec
from spark_state.store.stops import record_stop, stopped_run
from tests.stores import Store

SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])


def _task(store: Path, checkpoint_id: int, base: int | None, parallelism: int, run_id: str | None = "run-1"):
    return SimpleNamespace(
        store_uri=str(store),
        component="c",
        checkpoint_id=checkpoint_id,
        base_checkpoint_id=base,
        parallelism=parallelism,
        run_id=run_id,
    )


def _commit(store: Path, checkpoint_id: int, parallelism: int) -> None:
    Store(LocalStorage(str(store))).commit(checkpoint_id, {"c": (ComponentSpec("c", 8, parallelism, SCHEMA), [])}, {})


@pytest.fixture(autouse=True)
def _fresh_readers():
    forget_stores()
    yield
    forget_stores()


def test_a_host_of_a_store_that_runs_its_instance_at_its_parallelism_stays(tmp_path):
    _commit(tmp_path, 1, 2)
    _commit(tmp_path, 2, 2)
    assert not policy.obsolete(_task(tmp_path, 2, 1, 2), idle_seconds=600)
    assert not policy.obsolete(_task(tmp_path, 3, 2, 2), idle_seconds=600)  # its checkpoint is not committed yet


def test_a_host_whose_instance_ran_since_on_another_executor_drops_its_stale_copy(tmp_path):
    _commit(tmp_path, 1, 2)
    _commit(tmp_path, 2, 2)  # instance i's task of checkpoint 2 ran elsewhere: this host served checkpoint 1 last
    assert policy.obsolete(_task(tmp_path, 1, None, 2), idle_seconds=policy.OBSOLETE_CHECK_SECONDS)


def test_a_host_rescaled_away_from_leaves_once_a_newer_checkpoint_runs_another_parallelism(tmp_path):
    _commit(tmp_path, 1, 2)
    _commit(tmp_path, 2, 3)
    assert policy.obsolete(_task(tmp_path, 1, None, 2), idle_seconds=1)
    assert policy.obsolete(_task(tmp_path, 2, 1, 2), idle_seconds=1)  # a failed attempt at 2, committed at 3


def test_a_host_of_a_deleted_store_leaves_and_one_of_a_first_batch_waits_for_its_commit(tmp_path):
    store = tmp_path / "state"
    (store / "blobs" / "c").mkdir(parents=True)
    (store / "blobs" / "c" / "first.arrow").write_bytes(b"its first task's blob")
    assert not policy.obsolete(_task(store, 1, None, 2), idle_seconds=1)  # the driver commits after the tasks
    assert policy.obsolete(_task(store, 1, None, 2), idle_seconds=policy.UNCOMMITTED_SECONDS)
    shutil.rmtree(store)  # deleted before its first checkpoint committed (or with it): its state is of no use
    assert policy.obsolete(_task(store, 1, None, 2), idle_seconds=1)
    _commit(store, 1, 2)
    assert not policy.obsolete(_task(store, 2, 1, 2), idle_seconds=1)
    shutil.rmtree(store)
    assert policy.obsolete(_task(store, 2, 1, 2), idle_seconds=1)


def test_a_host_of_a_stopped_run_leaves_and_one_of_a_later_run_stays(tmp_path):
    _commit(tmp_path, 1, 2)
    first, later = "0f1e2d3c-0000-4000-8000-000000000001", "0f1e2d3c-0000-4000-8000-000000000002"
    assert not policy.obsolete(_task(tmp_path, 1, None, 2, first), idle_seconds=1)
    record_stop(LocalStorage(str(tmp_path)), first)
    assert stopped_run(LocalStorage(str(tmp_path))) == first
    assert policy.obsolete(_task(tmp_path, 1, None, 2, first), idle_seconds=1)
    assert policy.obsolete(_task(tmp_path, 2, 1, 2, first), idle_seconds=1)  # its last checkpoint never committed
    assert not policy.obsolete(_task(tmp_path, 1, None, 2, later), idle_seconds=1)  # restarted: a new run id
    assert not policy.obsolete(_task(tmp_path, 1, None, 2, None), idle_seconds=1)
    record_stop(LocalStorage(str(tmp_path)), later)  # the later run stops too: the record names it instead
    assert policy.obsolete(_task(tmp_path, 1, None, 2, later), idle_seconds=1)
    assert not policy.obsolete(_task(tmp_path, 1, None, 2, first), idle_seconds=1)


def test_a_store_that_cannot_be_read_never_ends_a_host_early():
    assert not policy.obsolete(_task(Path("no-such-scheme://bucket/state"), 2, 1, 2), idle_seconds=10_000)


def _connected(address: Path, timeout: float = 10.0) -> socket.socket:
    """A connection to the host at ``address`` once it listens (it binds, then listens)."""
    deadline = time.monotonic() + timeout
    while True:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(str(address))
            prove_to_host(client, host_key(address.parent))
            return client
        except (FileNotFoundError, ConnectionRefusedError):
            client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@pytest.mark.parametrize("leaves", [False, True])
def test_an_idle_host_asks_whether_it_is_obsolete_and_leaves_when_it_is(monkeypatch, leaves):
    directory = Path(tempfile.mkdtemp(prefix="ss-host-", dir="/tmp"))  # a short path: AF_UNIX limits its length
    address = directory / "q-0.sock"
    task = _task(directory, 1, None, 2)
    asked = []

    def serve_task(connection):
        connection.recv(1)
        return task

    def obsolete(served, idle_seconds):
        asked.append(served)
        return leaves

    monkeypatch.setattr(policy, "OBSOLETE_CHECK_SECONDS", 0.0)
    monkeypatch.setattr(tasks, "serve_task", serve_task)
    monkeypatch.setattr(policy, "obsolete", obsolete)
    server = threading.Thread(
        target=serving.serve, args=(address, os.getpid()), kwargs={"idle_seconds": 30}, daemon=True
    )
    server.start()
    try:
        with _connected(address) as client:  # a task
            client.sendall(b"T")
        server.join(timeout=4)
        assert asked and asked[0] is task  # asked about the task it ran, only once idle
        assert server.is_alive() != leaves
        assert address.exists() != leaves
    finally:
        if server.is_alive():
            monkeypatch.setattr(policy, "obsolete", lambda served, idle_seconds: True)
            server.join(timeout=4)
        shutil.rmtree(directory, ignore_errors=True)


def test_the_idle_limit_follows_the_gaps_between_tasks_when_they_are_longer():
    assert policy.idle_limit([]) == policy.IDLE_SECONDS  # a first task
    assert policy.idle_limit([1.0, 2.0]) == policy.IDLE_SECONDS  # a fast trigger: the usual idle time
    assert policy.idle_limit([600.0, 30.0]) == 3 * 600.0  # a ten-minute trigger keeps its state
    assert policy.idle_limit([24 * 3600.0]) == policy.MAX_IDLE_SECONDS
    assert policy.idle_limit([0.5], idle_seconds=0.2) == 1.5


def test_a_host_whose_tasks_came_far_apart_waits_longer_before_idling_out(monkeypatch):
    directory = Path(tempfile.mkdtemp(prefix="ss-host-", dir="/tmp"))
    address = directory / "q-0.sock"

    def serve_task(connection):
        connection.recv(1)
        return None

    monkeypatch.setattr(serving, "ACCEPT_SECONDS", 0.02)
    monkeypatch.setattr(tasks, "serve_task", serve_task)
    server = threading.Thread(
        target=serving.serve, args=(address, os.getpid()), kwargs={"idle_seconds": 0.8}, daemon=True
    )
    server.start()
    try:
        for gap in (0.0, 0.5):  # two tasks 0.5 s apart: the host waits 1.5 s for a third
            time.sleep(gap)
            with _connected(address) as client:
                client.sendall(b"T")
        last = time.monotonic()
        time.sleep(1.1)
        assert server.is_alive()  # past the 0.8 s floor
        server.join(timeout=5)
        assert not server.is_alive()
        assert 1.4 <= time.monotonic() - last < 5
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_host_leaving_removes_its_own_socket_but_never_that_of_a_host_started_since_at_its_address(monkeypatch):
    directory = Path(tempfile.mkdtemp(prefix="ss-host-", dir="/tmp"))
    monkeypatch.setattr(serving, "ACCEPT_SECONDS", 0.02)
    try:
        addresses = [directory / "q-0.sock", directory / "q-1.sock"]
        servers = [
            threading.Thread(target=serving.serve, args=(a, os.getpid()), kwargs={"idle_seconds": 0.5}, daemon=True)
            for a in addresses
        ]
        serving_threads: set = set()  # those in their loop, past noting their socket's inode
        checked = serving.alive

        def alive(pid, started=None):
            serving_threads.add(threading.current_thread())
            return checked(pid, started)

        monkeypatch.setattr(serving, "alive", alive)
        for server in servers:
            server.start()
        deadline = time.monotonic() + 5
        while len(serving_threads) < len(servers) and time.monotonic() < deadline:
            time.sleep(0.01)
        # q-1's socket was removed and a newer host bound its address meanwhile (a worker found it gone)
        addresses[1].unlink()
        newer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        newer.bind(str(addresses[1]))
        inode = addresses[1].stat().st_ino
        try:
            for server in servers:
                server.join(timeout=5)
                assert not server.is_alive()
            assert not addresses[0].exists()  # its own socket goes with a host
            assert addresses[1].exists() and addresses[1].stat().st_ino == inode
        finally:
            newer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _forked_host():
    """A host ``_connect`` forked, as a worker forks it: its socket's address and its pid; killed if it still runs,
    reaped and its files removed after the test."""
    directory = Path(tempfile.mkdtemp(prefix="ss-host-", dir="/tmp"))
    address = directory / "x" / "q-0.sock"
    address.parent.mkdir(mode=0o700)
    try:
        with worker._connect(address, os.getpid(), str(directory / "state")):
            pass
        (host,) = process._STARTED
        yield address, host
    finally:
        for pid in process._STARTED:
            os.kill(pid, signal.SIGKILL)
        process.reap_hosts()
        shutil.rmtree(directory, ignore_errors=True)
        gc.unfreeze()  # the fork froze this process's objects, as it freezes a worker's
        process._WORKER_FROZEN = False


def _log(address: Path) -> str:
    log = address.with_suffix(".log")
    return "the host's log: " + (log.read_text(errors="replace")[-3000:] if log.exists() else "(none)")


class _SlowTask:
    """Unpickled by a host as a task, it sleeps there for ``seconds`` (then fails the host: it is no task)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        return time.sleep, (self.seconds,)


def test_a_worker_waiting_long_for_its_host_logs_the_host_s_stacks_and_keeps_waiting(monkeypatch, capsys):
    monkeypatch.setattr(worker, "SLOW_ANSWER_SECONDS", 0.4)
    with _forked_host() as (address, host):
        with worker._connect(address, os.getpid(), "unused") as connection:
            started = time.monotonic()
            wire.send(connection, wire.TASK, pickle.dumps(_SlowTask(2.5)))
            assert worker._answer(connection, 7, address) is None  # the host failed, once it woke
            waited = time.monotonic() - started
    logged = capsys.readouterr().err
    assert waited >= 2.5  # it kept waiting past its reports
    reports = logged.split("spark-state: the worker of instance 7")[1:]
    assert len(reports) == 3, logged  # at 0.4, 0.8 and 1.6 s
    assert f"from its host (pid {host}, {address})" in reports[0]
    assert all("in serve_task" in report for report in reports), logged  # the host's stacks, from its log


_FIRST_TASK = """
import sys, tempfile
from spark_state.hosts import adoption, policy, process, serving, tasks, wire, worker
store = tempfile.mkdtemp()
process.load_host_modules(store)
before = set(sys.modules)
import numpy as np
import pyarrow as pa
from spark_state.store.blobstore import BlobStore
from spark_state.executor.columns import KEY_GROUP_COLUMN
from spark_state.executor.aggregates import Aggregate
from spark_state.keyspace import key_group_range, key_groups_for_columns
from spark_state.executor.resident import ResidentState
from spark_state.model.schema import KeyedSchema
from spark_state.storage import open_storage
aggregate = Aggregate("sum", "x", "total", pa.int64())
schema = KeyedSchema.of_values([pa.field("key", pa.string())], aggregate.state_fields())
keys = pa.array(["a", "b", "a"])
rows = pa.table({KEY_GROUP_COLUMN: pa.array(key_groups_for_columns([keys], 8).astype(np.int32)), "key": keys,
                 "x": pa.array([1, 2, 3])})
state = ResidentState(schema, key_group_range(0, 1, 8))
aggregate.apply(state.table, rows, ("key",))
state.checkpoint(BlobStore(open_storage(store)), "c", 0, 0)
print(sorted(set(sys.modules) - before))
"""


def test_a_new_host_s_first_aggregate_of_raw_rows_and_its_checkpoint_import_nothing_the_worker_did_not_load():
    """``_load_host_modules`` runs in the worker before it forks a host: every module a host's first task
    imports instead is paid again by each new host (Acero, for the partials of rows that are not Spark's)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _FIRST_TASK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_worker_starts_a_host_with_one_fork_and_reaps_it_once_it_exits():
    """``_connect`` forks the host as this process's child; once it exits, the next connection reaps it (no zombie)."""
    assert gc.get_freeze_count() == 0
    with _forked_host() as (address, host):
        assert gc.get_freeze_count() > 0  # the worker froze its objects first: the pages the host shares stay shared
        assert process.host_running(host)
        assert os.waitpid(host, os.WNOHANG) == (0, 0)  # this process's child, still running
        os.kill(host, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{host}/stat").read_text().split()[2] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not address.exists(), _log(address)  # it left, and is a zombie until reaped
        assert not process.host_running(host) and host not in process._STARTED
        assert not Path(f"/proc/{host}").exists()  # reaped


def test_a_host_signalled_while_a_garbage_collection_hook_runs_still_leaves_and_removes_its_socket(tmp_path):
    """A handler's exit raised inside a ``gc.callbacks`` hook is dropped by Python; the host leaves all the same.

    The hook is inherited from this process (hypothesis installs one in a
    test process); in the host it sleeps through the collection after the
    first task, and the signal arrives while it sleeps.
    """
    interrupted = tmp_path / "interrupted"
    here = os.getpid()

    def slow_hook(phase, info):
        if os.getpid() != here and phase == "start" and not interrupted.exists():
            try:
                time.sleep(3)
            except SystemExit:
                interrupted.touch()
                raise

    gc.callbacks.append(slow_hook)
    try:
        with _forked_host() as (address, host):
            time.sleep(0.3)  # the host ran the (empty) task and sleeps in its collection's hook
            os.kill(host, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (left := os.waitpid(host, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert interrupted.exists(), _log(address)  # the exit was raised inside the hook, where Python drops it
            assert left[0] == host and not address.exists(), _log(address)  # it left all the same, its socket too
            process._STARTED.discard(host)  # reaped here
            assert os.waitstatus_to_exitcode(left[1]) == 128 + signal.SIGTERM  # as a host leaving on a signal does
            assert "Traceback" not in _log(address)  # and a signal's exit prints no trace
    finally:
        gc.callbacks.remove(slow_hook)


class _Connected(Exception):
    """Raised by a test's stand-in for ``_connect``."""


def test_a_worker_freezes_its_objects_at_its_first_task_for_a_host_before_it_connects(monkeypatch, tmp_path):
    """A worker that never forks a host (the hosts were started by others) still stops walking its objects."""
    freezes = []

    def connect(address, daemon_pid, store_uri):
        freezes.append(gc.get_freeze_count())
        raise _Connected

    monkeypatch.setattr(worker, "_connect", connect)
    monkeypatch.setattr(process, "_WORKER_FROZEN", False)
    task = SimpleNamespace(store_uri=str(tmp_path), component="c")
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(_Connected):
            next(worker.run_hosted(task, 0, []))
        gc.unfreeze()
        with pytest.raises(_Connected):
            next(worker.run_hosted(task, 0, []))  # frozen once: a later task freezes nothing more
        assert freezes[0] > 0 and freezes[1] == 0 and process._WORKER_FROZEN
    finally:
        gc.unfreeze()


class _Node:
    def __init__(self):
        self.other = self  # a reference cycle: freed only by the collector


def test_after_a_task_a_host_collects_the_garbage_it_left_freezes_the_rest_and_walks_everything_now_and_then():
    assert gc.get_freeze_count() == 0  # nothing in the test process is frozen before
    try:
        left = weakref.ref(_Node())  # garbage of the task
        kept = _Node()  # the task's state: survives, and is frozen
        assert collect_garbage(0) == 1
        assert left() is None and gc.get_freeze_count() > 0
        gone = weakref.ref(kept)
        del kept  # frozen cyclic garbage: no collection walks it ...
        assert collect_garbage(1) == 2 and gone() is not None
        assert collect_garbage(FULL_COLLECTION_TASKS - 1) == 0  # ... until the full one
        assert gone() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def _serving(host_end: socket.socket) -> tuple[threading.Thread, list]:
    """``_serve_task`` on ``host_end`` in a thread that closes it afterwards, as ``serve`` does; its result."""
    served: list = []

    def run():
        with host_end:
            served.append(tasks.serve_task(host_end))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, served


@contextlib.contextmanager
def _task_sent(monkeypatch, tmp_path: Path, run_instance, context: dict | None = None):
    """The worker's end of a connection to a host (``_serve_task``, whose instances run ``run_instance``), the
    task sent; on exit, checks that the host finished and returned the task."""
    import pickle

    from spark_state.executor import task as operator

    monkeypatch.setattr(operator, "run_instance", run_instance)
    worker, host_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    task = _task(tmp_path, 1, None, 2)
    with worker:
        thread, served = _serving(host_end)
        wire.send(worker, wire.TASK, pickle.dumps((task, 0, context)))
        yield worker
        thread.join(10)
    assert served == [task]


def _send_rows(worker: socket.socket, batches: int, rows: int) -> None:
    batch = pa.RecordBatch.from_pydict({"key": [f"k{i:07d}" for i in range(rows)]})
    for _ in range(batches):
        wire.send(worker, wire.BATCH, memoryview(wire.batch_bytes(batch)))
    wire.send(worker, wire.END)


def test_a_host_starts_its_instance_when_the_task_comes_and_reads_the_rows_as_the_instance_takes_them(
    monkeypatch, tmp_path
):
    """The restore (the first thing ``run_instance`` does) overlaps the wait for rows Spark is still preparing."""
    started = threading.Event()

    def run_instance(task, instance, batches):
        started.set()
        yield pa.RecordBatch.from_pydict({"rows": [sum(batch.num_rows for batch in batches)]})

    with _task_sent(monkeypatch, tmp_path, run_instance) as worker:
        assert started.wait(10)  # no row sent yet
        _send_rows(worker, batches=3, rows=2)
        kind, payload = wire.receive(worker)
        assert kind == wire.BATCH and wire.batch(payload).column("rows").to_pylist() == [6]
        assert wire.receive(worker) == (wire.END, b"")


def test_a_host_whose_instance_fails_before_taking_its_rows_reads_them_all_then_answers_with_the_error(
    monkeypatch, tmp_path
):
    """The worker sends every row before it reads an answer: a host that answered and closed first would leave
    it a broken pipe instead of the typed error."""
    import pickle

    from spark_state.errors import ConfigError

    def run_instance(task, instance, batches):
        raise ConfigError("refused before the rows")
        yield  # a generator, as the operator's

    with _task_sent(monkeypatch, tmp_path, run_instance) as worker:
        _send_rows(worker, batches=40, rows=50_000)  # about 20 MB: far more than the socket buffers hold
        kind, payload = wire.receive(worker)
        assert kind == wire.ERROR
        error = pickle.loads(payload)
        assert isinstance(error, ConfigError) and "refused before the rows" in str(error)


# Adoption: a new instance takes an idle host the store no longer needs ---------------------------------------


@contextlib.contextmanager
def _threaded_host(monkeypatch, *, obsolete: bool):
    """A host serving ``<dir>/q-0.sock`` from a thread, each of its tasks a byte ``T`` (answered with ``K``; ``S``
    runs until one more byte comes), whose
    state the store ``obsolete``-ly no longer needs; yields its directory, address and the (address, byte) of
    every task it served. Asking to adopt it is possible once it has served a task."""
    directory = Path(tempfile.mkdtemp(prefix="ss-host-", dir="/tmp"))
    address = directory / "q-0.sock"
    served: list = []
    task = _task(directory, 1, None, 2)

    def serve_task(connection):
        served.append(connection.recv(1))
        if served[-1] == b"S":  # a slow task: it runs until its worker sends one more byte
            connection.recv(1)
        connection.sendall(b"K")
        return task

    monkeypatch.setattr(adoption, "ADOPT_IDLE_SECONDS", 0.05)
    monkeypatch.setattr(serving, "ACCEPT_SECONDS", 0.02)
    monkeypatch.setattr(tasks, "serve_task", serve_task)
    monkeypatch.setattr(policy, "obsolete", lambda served_task, idle_seconds: obsolete and served_task is task)
    results: list = []

    def run():
        at, listener = address, None
        while at is not None:
            at, listener = serving.serve(at, os.getpid(), idle_seconds=30, listener=listener)
            results.append(at)

    server = threading.Thread(target=run, daemon=True)
    server.start()
    try:
        _run_task(address)
        time.sleep(0.1)  # idle past ADOPT_IDLE_SECONDS
        yield SimpleNamespace(directory=directory, address=address, served=served, thread=server, results=results)
    finally:
        monkeypatch.setattr(policy, "obsolete", lambda served_task, idle_seconds: True)
        monkeypatch.setattr(policy, "OBSOLETE_CHECK_SECONDS", 0.0)
        server.join(timeout=5)
        shutil.rmtree(directory, ignore_errors=True)


def _run_task(address: Path) -> None:
    with _connected(address) as client:
        client.sendall(b"T")
        assert client.recv(1) == b"K"


def test_an_idle_host_the_store_no_longer_needs_is_adopted_by_a_new_instance_and_serves_it(monkeypatch):
    with _threaded_host(monkeypatch, obsolete=True) as host:
        new = host.directory / "r-3.sock"
        assert adoption.adopt(new)
        assert new.exists() and not host.address.exists()
        _run_task(new)  # the same host serves the new instance
        assert host.served == [b"T", b"T"] and host.thread.is_alive() and host.results == [new]


@pytest.mark.parametrize("why", ["needed", "large"])
def test_a_host_whose_state_is_still_needed_or_large_is_not_adopted_and_stays(monkeypatch, why):
    if why == "large":
        monkeypatch.setattr("spark_state.executor.resident.held_keys", lambda: adoption.ADOPT_MAX_KEYS + 1)
    with _threaded_host(monkeypatch, obsolete=why == "large") as host:
        new = host.directory / "r-3.sock"
        assert not adoption.adopt(new)
        assert host.address.exists() and not new.exists()
        _run_task(host.address)
        assert host.served == [b"T", b"T"] and host.results == []


def test_a_busy_host_is_skipped_and_a_late_request_to_adopt_it_changes_nothing(monkeypatch):
    with _threaded_host(monkeypatch, obsolete=True) as host:
        busy = _connected(host.address)  # a task whose byte has not come: the host waits in it
        try:
            started = time.monotonic()
            assert not adoption.adopt(host.directory / "r-3.sock")
            assert time.monotonic() - started < 2 * adoption.ADOPT_ANSWER_SECONDS
            busy.sendall(b"T")
            assert busy.recv(1) == b"K"
        finally:
            busy.close()
        _run_task(host.address)  # it read the request its asker had given up on, and stayed
        assert host.address.exists() and host.served == [b"T", b"T", b"T"] and host.results == []


def test_a_task_for_a_host_being_adopted_is_served_and_the_adoption_refused(monkeypatch):
    with _threaded_host(monkeypatch, obsolete=True) as host:
        new = host.directory / "r-3.sock"
        with _connected(host.address) as adopter:
            wire.send(adopter, wire.ADOPT, new.name.encode())
            assert wire.receive(adopter)[0] == wire.READY
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as worker:  # a task of its instance after all
                worker.connect(str(host.address))  # queued: the host proves itself once it takes the connection
                answers = []
                task = threading.Thread(
                    target=lambda: (
                        prove_to_host(worker, host_key(host.directory)),
                        worker.sendall(b"T"),
                        answers.append(worker.recv(1)),
                    )
                )
                task.start()
                wire.send(adopter, wire.GO)
                assert wire.receive(adopter)[0] == wire.REFUSED
                task.join(timeout=5)
                assert answers == [b"K"]
        host.thread.join(timeout=5)
        assert not host.thread.is_alive() and host.results == [None]  # it left, as an obsolete host does
        assert not new.exists() and not host.address.exists() and host.served == [b"T", b"T"]


def test_an_obsolete_host_stays_as_a_spare_holding_nothing_and_a_new_instance_adopts_it(monkeypatch):
    def serve_task(connection):  # the forked host inherits these
        if not connection.recv(1):
            return None  # ``_forked_host``'s first connection, which sends nothing
        connection.sendall(b"K")
        return its_task

    its_task = SimpleNamespace(resident_memory=None)  # no memory bound: it may stay as a spare
    monkeypatch.setattr(serving, "ACCEPT_SECONDS", 0.02)
    monkeypatch.setattr(policy, "OBSOLETE_CHECK_SECONDS", 0.2)
    monkeypatch.setattr(tasks, "serve_task", serve_task)
    monkeypatch.setattr(policy, "obsolete", lambda served, idle_seconds: served is its_task)
    with _forked_host() as (address, host):
        _run_task(address)
        deadline = time.monotonic() + 10
        while not list(address.parent.glob("spare-*.sock")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(p.name for p in address.parent.glob("spare-*")) == [f"spare-{host}.log", f"spare-{host}.sock"]
        assert not address.exists() and not address.with_suffix(".log").exists()
        new = address.parent / "r-5.sock"
        assert adoption.adopt(new)
        assert not list(address.parent.glob("spare-*")), _log(new)
        with _connected(new) as connection:
            assert peer_credentials(connection)[0] == host  # the spare, not a new fork
            connection.sendall(b"T")
            assert connection.recv(1) == b"K"
        assert process.host_running(host)


def test_no_more_spares_than_spare_hosts_stay(monkeypatch, tmp_path):
    monkeypatch.setattr(adoption, "SPARE_HOSTS", 2)
    for pid in (1, 2):
        (tmp_path / f"spare-{pid}.sock").touch()
    assert adoption.spare(tmp_path / "q-0.sock") == (None, None)


def test_under_a_memory_bound_an_obsolete_host_leaves_rather_than_stay_as_a_spare(monkeypatch, tmp_path):
    monkeypatch.setattr(adoption, "SPARE_HOSTS_BOUNDED", 1)
    monkeypatch.setattr(adoption, "start_afresh", lambda: None)
    (tmp_path / "spare-1.sock").touch()
    assert adoption.spare(tmp_path / "q-0.sock", bounded=True) == (None, None)  # one waits already
    spare, listener = adoption.spare(tmp_path / "q-1.sock")  # without a bound, up to SPARE_HOSTS wait
    assert spare is not None and listener is not None
    listener.close()


def test_a_host_that_held_a_large_state_leaves_rather_than_stay_as_a_spare(monkeypatch, tmp_path):
    monkeypatch.setattr("spark_state.executor.resident.held_keys", lambda: adoption.ADOPT_MAX_KEYS + 1)
    assert adoption.spare(tmp_path / "q-0.sock") == (None, None)
    assert not list(tmp_path.iterdir())


def test_a_host_runs_each_task_under_its_worker_s_task_context_not_the_one_it_was_forked_or_adopted_in(
    monkeypatch, tmp_path
):
    """A host is a fork of the worker that ran some earlier task (of another instance, once adopted): a user
    function asking ``TaskContext.get()`` must see the task it runs in."""
    import pickle

    from pyspark import TaskContext

    seen = []

    def run_instance(task, instance, batches):
        context = TaskContext.get()
        seen.append(
            (
                context.partitionId(),
                context.stageId(),
                context.attemptNumber(),
                context.getLocalProperty("spark.job.description"),
            )
        )
        yield pa.RecordBatch.from_pydict({"rows": [sum(batch.num_rows for batch in batches)]})

    TaskContext._setTaskContext(
        TaskContext(
            partitionId=5,
            stageId=7,
            attemptNumber=1,
            taskAttemptId=70,
            localProperties={"spark.job.description": "batch 3"},
        )
    )
    try:
        _, instance, context = pickle.loads(tasks.pickled_task(_task(tmp_path, 1, None, 8), 5))  # as a worker
        TaskContext._setTaskContext(TaskContext(partitionId=2, stageId=1, attemptNumber=0))  # what it forked in
        with _task_sent(monkeypatch, tmp_path, run_instance, context) as worker:
            _send_rows(worker, batches=1, rows=2)
            assert wire.receive(worker)[0] == wire.BATCH and wire.receive(worker) == (wire.END, b"")
        assert instance == 5 and seen == [(5, 7, 1, "batch 3")]
        assert TaskContext.get() is None  # none between tasks
    finally:
        TaskContext._setTaskContext(None)


def test_a_worker_asks_no_host_that_runs_a_task_so_it_never_waits_for_a_busy_one(monkeypatch):
    with _threaded_host(monkeypatch, obsolete=True) as host:
        busy = _connected(host.address)
        busy.sendall(b"S")  # a task the host runs until it gets one more byte
        try:
            deadline = time.monotonic() + 5
            while host.address.stat().st_mtime < time.time() and time.monotonic() < deadline:
                time.sleep(0.01)  # it dated its socket ahead as it took the task
            asked = []
            monkeypatch.setattr(adoption, "connect", lambda path, timeout=None: asked.append(path))
            started = time.monotonic()
            assert not adoption.adopt(host.directory / "r-3.sock")
            assert asked == [] and time.monotonic() - started < adoption.ADOPT_ANSWER_SECONDS
            busy.sendall(b".")
            assert busy.recv(1) == b"K"
        finally:
            busy.close()
        deadline = time.monotonic() + 5
        while host.address.stat().st_mtime > time.time() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.address.stat().st_mtime <= time.time()  # dated now once done: it may be asked again
