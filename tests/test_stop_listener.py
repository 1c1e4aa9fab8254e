"""``stop_listener``: a watched run's end recorded from Spark's query events, with stand-ins for the session."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from spark_state.stop_listener import watch, watched_runs


class _Streams:
    def __init__(self, fail: bool = False):
        self.listeners: list = []
        self.fail = fail

    def addListener(self, listener) -> None:
        if self.fail:
            raise RuntimeError("no callback server")
        self.listeners.append(listener)

    def removeListener(self, listener) -> None:
        self.listeners.remove(listener)


class _Batch:
    def __init__(self):
        self.stopped: list[str] = []

    def record_stop(self, run_id: str) -> None:
        self.stopped.append(run_id)


def _query(run_id: str, active: bool = True):
    return SimpleNamespace(runId=run_id, isActive=active)


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_each_watched_run_is_recorded_once_when_spark_reports_its_end_and_the_listener_leaves_after_the_last():
    session = SimpleNamespace(streams=_Streams())
    first, second = _Batch(), _Batch()
    watch(session, _query("run-1"), first)
    watch(session, _query("run-2"), second)
    (listener,) = session.streams.listeners  # one listener per session
    assert watched_runs(session) == {"run-1", "run-2"}
    listener.onQueryTerminated(SimpleNamespace(runId="another-query's-run"))  # not watched: ignored
    listener.onQueryTerminated(SimpleNamespace(runId="run-1"))
    assert (first.stopped, second.stopped) == (["run-1"], [])
    assert session.streams.listeners == [listener]  # run-2 is still watched
    listener.onQueryTerminated(SimpleNamespace(runId="run-2"))
    listener.onQueryTerminated(SimpleNamespace(runId="run-2"))  # a repeated event records nothing more
    assert (first.stopped, second.stopped) == (["run-1"], ["run-2"])
    assert watched_runs(session) == set()
    assert _until(lambda: session.streams.listeners == [])  # removed from a thread of its own


def test_a_run_that_ended_before_it_was_watched_is_recorded_at_once():
    session = SimpleNamespace(streams=_Streams())
    batch = _Batch()
    watch(session, _query("run-1", active=False), batch)
    assert batch.stopped == ["run-1"] and watched_runs(session) == set()


def test_a_session_that_cannot_take_a_listener_starts_the_query_all_the_same_and_says_why(caplog):
    session = SimpleNamespace(streams=_Streams(fail=True))
    batch = _Batch()
    with caplog.at_level(logging.WARNING, logger="spark_state.stop_listener"):
        watch(session, _query("run-1"), batch)
    assert watched_runs(session) == set() and batch.stopped == []
    assert "no callback server" in caplog.text and "idle out" in caplog.text
