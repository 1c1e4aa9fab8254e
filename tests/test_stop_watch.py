"""``stop_watch``: a watched run's end recorded by the driver's watching thread, with stand-ins for queries."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from spark_state.spark import stop_watch
from spark_state.spark.stop_watch import record_ended, unwatch, watch, watched_runs


class _Batch:
    def __init__(self):
        self.stopped: list[str] = []

    def record_stop(self, run_id: str) -> None:
        self.stopped.append(run_id)


class _Gone:
    """A query whose JVM is gone: asking it anything fails."""

    runId = "run-gone"

    @property
    def isActive(self) -> bool:
        raise ConnectionError("the JVM is gone")


def _query(run_id: str, active: bool = True):
    return SimpleNamespace(runId=run_id, isActive=active)


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.fixture(autouse=True)
def fast_watch(monkeypatch):
    monkeypatch.setattr(stop_watch, "POLL_SECONDS", 0.01)
    yield
    for run_id in watched_runs():
        unwatch(run_id)
    assert _until(lambda: stop_watch._THREAD is None)


def test_each_watched_run_is_recorded_once_when_found_ended_and_the_thread_leaves_after_the_last():
    first, second = _Batch(), _Batch()
    one, two = _query("run-1"), _query("run-2")
    watch(one, first)
    watch(two, second)
    thread = stop_watch._THREAD
    assert thread is not None and thread.daemon and watched_runs() == {"run-1", "run-2"}
    time.sleep(0.1)
    assert (first.stopped, second.stopped) == ([], [])  # both active: nothing recorded
    one.isActive = False
    assert _until(lambda: first.stopped == ["run-1"])
    assert second.stopped == [] and watched_runs() == {"run-2"} and thread.is_alive()
    two.isActive = False
    assert _until(lambda: second.stopped == ["run-2"])
    assert _until(lambda: stop_watch._THREAD is None) and not thread.is_alive()
    time.sleep(0.05)
    assert (first.stopped, second.stopped) == (["run-1"], ["run-2"])  # once each
    watch(_query("run-3", active=False), third := _Batch())  # a new watch starts a new thread
    assert _until(lambda: third.stopped == ["run-3"])


def test_record_ended_records_only_runs_no_longer_active_as_at_exit():
    ended, running = _Batch(), _Batch()
    stop_watch._RUNS.update({"run-1": (ended, _query("run-1", active=False)), "run-2": (running, _query("run-2"))})
    assert record_ended() == 1
    assert (ended.stopped, running.stopped) == (["run-1"], []) and watched_runs() == {"run-2"}
    assert record_ended() == 0 and ended.stopped == ["run-1"]


def test_an_unwatched_run_is_not_recorded_again():
    batch = _Batch()
    query = _query("run-1")
    watch(query, batch)
    unwatch("run-1")  # StatefulQuery recorded the stop itself
    query.isActive = False
    time.sleep(0.1)
    assert batch.stopped == [] and watched_runs() == set()


def test_a_run_whose_query_cannot_be_asked_is_dropped_without_a_record():
    batch = _Batch()
    stop_watch._RUNS["run-gone"] = (batch, _Gone())
    assert record_ended() == 0 and batch.stopped == [] and watched_runs() == set()


def test_a_record_at_exit_waits_for_the_threads_recording_in_flight():
    started, release = threading.Event(), threading.Event()

    class _SlowBatch(_Batch):
        def record_stop(self, run_id: str) -> None:
            started.set()
            release.wait(5)  # the store's write, in flight
            super().record_stop(run_id)

    batch = _SlowBatch()
    stop_watch._RUNS["run-1"] = (batch, _query("run-1", active=False))
    watcher = threading.Thread(target=record_ended)  # the watching thread's step: takes run-1 off the watch
    watcher.start()
    assert started.wait(5) and watched_runs() == set()
    at_exit = threading.Thread(target=record_ended)
    at_exit.start()
    at_exit.join(0.2)
    assert at_exit.is_alive() and batch.stopped == []  # the driver's exit waits for the write
    release.set()
    at_exit.join(5)
    watcher.join(5)
    assert not at_exit.is_alive() and batch.stopped == ["run-1"]


def test_a_record_at_exit_waits_a_bounded_time_for_a_stuck_recording_then_records_the_other_runs(monkeypatch):
    monkeypatch.setattr(stop_watch, "RECORDING_WAIT_SECONDS", 0.1)
    batch = _Batch()
    stop_watch._RUNS["run-2"] = (batch, _query("run-2", active=False))
    recorded: list[int] = []
    at_exit = threading.Thread(target=lambda: recorded.append(record_ended()), daemon=True)
    with stop_watch._RECORDING:  # the thread's recording, stuck (a store that does not answer)
        at_exit.start()
        at_exit.join(0.05)
        assert at_exit.is_alive() and batch.stopped == []  # it waits for the recording in flight...
        at_exit.join(3)
        assert not at_exit.is_alive()  # ...for a bounded time
    assert recorded == [1] and batch.stopped == ["run-2"] and watched_runs() == set()
