"""Drain requests: ask a running keyed query, identified by its run id, to drain and stop.

A drain finishes a query gracefully before an incompatible upgrade: the next
micro-batch processes its rows, then fires every timer as if the watermark
and the clock had reached the end of time (closing every session and window),
commits a checkpoint marked drained, and the query stops once Spark has
committed that batch. A restart from a drained checkpoint (the same query or
a new one, at any parallelism) has no pending timers or open sessions and
reads the sources from where the drain stopped; its watermark continues from
the last real one. Values under a time to live do not expire at a drain.

``query.drain()`` asks from the process running the query. From elsewhere (the
operations CLI), ``request_drain(store, run_id)`` writes
``drain-requests/<run_id>.json`` into the query's state store; the query reads
the requests at the start of every batch, drains on one naming its own run
id, and reports requests naming another run id (a stale request, for an
earlier run) without acting on them. A run id is Spark's ``query.runId``; it
changes at every start, so a request can never drain a later run.

A drain takes effect at the next micro-batch. On an idle source the query's
clock (``datasources.clock``) finds the new request in the store and has
Spark run that batch; a query whose checkpoint began without the clock
drains at its next batch with rows. ``query.drain()`` writes its request
here too, so both ways reach the clock.
"""

from __future__ import annotations

import json
import re
import time

from spark_state.errors import ConfigError
from spark_state.storage.base import Storage, join

REQUESTS_DIR = "drain-requests"
_RUN_ID = re.compile(r"[0-9a-fA-F-]{8,64}")


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} is not a Spark run id (the UUID of query.runId)")
    return run_id


def request_drain(storage: Storage, run_id: str, *, reason: str = "") -> str:
    """Ask the run ``run_id`` of the query whose state store is ``storage`` to drain; return the request's path."""
    path = join(REQUESTS_DIR, f"{_check_run_id(run_id)}.json")
    body = {"run_id": run_id, "requested_at": time.time(), "reason": reason}
    storage.create(path, json.dumps(body).encode(), overwrite=True)
    return path


def pending_requests(storage: Storage) -> list[str]:
    """The run ids that drain requests in ``storage`` name."""
    return sorted(name[: -len(".json")] for name in storage.list(REQUESTS_DIR) if name.endswith(".json"))


def finish_request(storage: Storage, run_id: str) -> None:
    """Remove the request of ``run_id`` once its drained checkpoint is committed."""
    storage.delete(join(REQUESTS_DIR, f"{_check_run_id(run_id)}.json"))
