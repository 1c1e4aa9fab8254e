"""Record a keyed run's stop in its store however the run ended: a driver thread that watches the runs.

``StatefulQuery.stop()``, a drain and ``StatefulQuery.awaitTermination()``
record a stopped run themselves (``MicroBatch.record_stop``, which
``unwatch``-es it). A run can
also end without them: stopped through the raw ``StreamingQuery``
(``spark.streams.active``, ``query.query``), an ``availableNow`` run nobody
awaits through ``StatefulQuery``, a failure. ``watch(query, batch)`` covers
those: one daemon thread per driver asks each watched run's query whether it
is still active every ``POLL_SECONDS`` and calls ``MicroBatch.record_stop``
for one that ended, so its instance hosts free their memory at their next
check instead of at their idle limit. The thread ends when no run is left
to watch; the next ``watch`` starts another.

When the Python driver exits, the watched runs found ended are recorded
(``atexit``): a script may await the raw query and exit before the thread's
next look. A recording in flight on the thread when the driver exits is
waited for (up to ``RECORDING_WAIT_SECONDS``): the interpreter would
otherwise end the daemon thread mid-write, and the run would go unrecorded.
Spark's query listeners would tell the end too, but Spark delivers their
events over py4j's callback server asynchronously, and an event still in
flight when the driver exits makes Spark log a stack trace; a question asked
from the driver has no such tail.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

_LOG = logging.getLogger(__name__)
POLL_SECONDS = 1.0
"""How often the watching thread asks whether each watched run is still active."""
RECORDING_WAIT_SECONDS = 30.0
"""How long ``record_ended`` waits for a recording in flight (its storage request has its own timeout) before it
records the other runs without waiting: a driver's exit is never held longer."""

_LOCK = threading.Lock()
_RECORDING = threading.Lock()  # held across each whole ``record_ended``: one records at a time
_RUNS: dict[str, tuple[Any, Any]] = {}  # run id -> (its MicroBatch, its StreamingQuery), while watched
_THREAD: threading.Thread | None = None
_EXIT_HOOKED = False


def watch(query, batch) -> None:
    """Have ``batch.record_stop`` called with ``query``'s run id once the run is no longer active."""
    global _THREAD, _EXIT_HOOKED
    run_id = str(query.runId)
    with _LOCK:
        _RUNS[run_id] = (batch, query)
        if not _EXIT_HOOKED:
            _EXIT_HOOKED = True
            atexit.register(record_ended)
        if _THREAD is None:
            _THREAD = threading.Thread(target=_watch_runs, name="spark-state-stop-watch", daemon=True)
            _THREAD.start()


def unwatch(run_id: str) -> None:
    """Stop watching run ``run_id`` (its stop is being recorded: ``MicroBatch.record_stop``)."""
    with _LOCK:
        _RUNS.pop(run_id, None)


def watched_runs() -> set[str]:
    """The run ids whose end is still awaited."""
    with _LOCK:
        return set(_RUNS)


def record_ended() -> int:
    """Record every watched run found no longer active; returns how many (the thread's step, and ``atexit``'s).

    A call made while another is recording waits for it (up to ``RECORDING_WAIT_SECONDS``), so that ``atexit``
    returns only once a run the thread took off the watch is written.
    """
    if not _RECORDING.acquire(timeout=RECORDING_WAIT_SECONDS):
        _LOG.warning(
            "spark-state: the record of a stopped run took over %s s; recording the other stopped runs without it",
            RECORDING_WAIT_SECONDS,
        )
        return _record_ended()
    try:
        return _record_ended()
    finally:
        _RECORDING.release()


def _record_ended() -> int:
    with _LOCK:
        runs = list(_RUNS.items())
    recorded = 0
    for run_id, (batch, query) in runs:
        try:
            active = query.isActive
        except Exception as error:  # noqa: BLE001  (the JVM is gone: no run can be asked, or recorded, any more)
            _LOG.debug("spark-state: cannot ask whether run %s is active (%s); not watching it", run_id, error)
            active = None
        with _LOCK:
            if _RUNS.get(run_id, (None, None))[1] is not query or active:
                continue
            del _RUNS[run_id]
        if active is False:
            batch.record_stop(run_id)  # once per run; a store that cannot be written only leaves a warning
            recorded += 1
    return recorded


def _watch_runs() -> None:
    global _THREAD
    while True:
        time.sleep(POLL_SECONDS)
        record_ended()
        with _LOCK:
            if not _RUNS:
                _THREAD = None
                return
