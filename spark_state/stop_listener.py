"""Record a keyed run's stop in its store however the run ended: Spark's query events, at the driver.

``StatefulQuery.stop()``, a drain and ``StatefulQuery.awaitTermination()``
record a stopped run themselves (``stops``). A run can also end without
them: stopped through the raw ``StreamingQuery`` (``spark.streams.active``,
``query.query``), an ``availableNow`` run nobody awaits through
``StatefulQuery``, a failure. ``watch(session, query, batch)`` covers those:
a Python ``StreamingQueryListener`` on the session (over py4j's callback
server, which ``foreachBatch`` already runs) calls ``MicroBatch.record_stop``
when Spark reports the run terminated, so its instance hosts free their
memory at their next check instead of at their idle limit.

One listener per session, registered by the first watched run and removed
(from a thread of its own: not from inside Spark's event delivery) once no
watched run is left, so queries of the session that run later, keyed or
not, do not pay for its events.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
_WATCHERS: dict[int, "_Watcher"] = {}  # id of the SparkSession -> its watcher, while it watches a run


def watch(session, query, batch) -> None:
    """Have ``batch.record_stop`` called with ``query``'s run id once Spark reports that run terminated."""
    run_id = str(query.runId)
    with _LOCK:
        watcher = _WATCHERS.get(id(session))
        if watcher is None:
            watcher = _Watcher(session)
            try:
                session.streams.addListener(watcher.listener)
            except Exception as error:  # noqa: BLE001  (the query runs either way)
                _LOG.warning("spark-state: cannot listen for the end of run %s (%s); if it ends other than through "
                             "StatefulQuery, its instance hosts keep its state until they idle out", run_id, error)
                return
            _WATCHERS[id(session)] = watcher
        watcher.runs[run_id] = batch
    if not query.isActive:  # it may have ended before the listener knew the run: record it now
        watcher.terminated(run_id)


def watched_runs(session) -> set[str]:
    """The run ids of ``session`` whose end is still awaited."""
    with _LOCK:
        watcher = _WATCHERS.get(id(session))
        return set(watcher.runs) if watcher is not None else set()


class _Watcher:
    """The watched runs of one session, and the listener that reports their end."""

    def __init__(self, session) -> None:
        from pyspark.sql.streaming import StreamingQueryListener

        self.session = session
        self.runs: dict[str, Any] = {}  # run id -> its MicroBatch
        watcher = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event) -> None:
                pass

            def onQueryProgress(self, event) -> None:
                pass

            def onQueryIdle(self, event) -> None:
                pass

            def onQueryTerminated(self, event) -> None:
                watcher.terminated(str(event.runId))

        self.listener = Listener()

    def terminated(self, run_id: str) -> None:
        with _LOCK:
            batch = self.runs.pop(run_id, None)
            done = batch is not None and not self.runs and _WATCHERS.get(id(self.session)) is self
            if done:
                del _WATCHERS[id(self.session)]
        if batch is not None:
            batch.record_stop(run_id)  # once per run; a store that cannot be written only leaves a warning
        if done:
            threading.Thread(target=self._remove, name="spark-state-unwatch", daemon=True).start()

    def _remove(self) -> None:
        try:
            self.session.streams.removeListener(self.listener)
        except Exception:  # noqa: BLE001  (a stopped session has no listeners left to remove)
            pass
