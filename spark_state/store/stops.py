"""Stopped runs: the run id of a keyed query's last stopped run, recorded in its state store.

Instance hosts (``hosts``) keep a query's state in memory between batches
and leave after an idle time that grows with the gaps between the query's
batches (hours, for a slow trigger). A run stopped through
``StatefulQuery.stop()`` or by a drain, found terminated by
``StatefulQuery.awaitTermination()``, or found no longer active by the
driver's watch (``stop_watch``) records its run id here (Spark's ``query.runId``),
and an idle host whose last task belongs to that run
leaves at its next check (``hosts.obsolete``) instead, so a stopped query
frees its memory within seconds. A later run of the query has another run
id: its hosts stay. No pyspark.
"""

from __future__ import annotations

import json
import time

from spark_state.errors import BlobNotFoundError
from spark_state.storage.base import Storage
from spark_state.store.blobstore import BLOBS_DIR
from spark_state.store.manifestlog import CHECKPOINTS_DIR

STOPPED = "stopped-run.json"


def record_stop(storage: Storage, run_id: str) -> bool:
    """Record in ``storage`` that the run ``run_id`` stopped (replacing the record of an earlier run); whether it
    did.

    A store that holds nothing yet (no blob, no checkpoint) gets no record:
    no task of the run wrote anything (a task writes its blob first), so no
    host holds its state, and the default store is Spark's
    ``<checkpointLocation>/state``, which Spark requires to be empty when a
    query without offsets starts: a record there would stop every later start
    of the query (``unneeded_stop_record`` removes one an earlier version left).
    """
    if not (storage.exists(BLOBS_DIR) or storage.exists(CHECKPOINTS_DIR)):
        return False
    body = {"run_id": run_id, "stopped_at": time.time()}
    storage.create(STOPPED, json.dumps(body).encode(), overwrite=True)
    return True


def unneeded_stop_record(storage: Storage) -> bool:
    """Whether ``storage`` holds our stop record and nothing else: a run stopped before any of its tasks wrote
    (an earlier version recorded it), which the caller may delete so that Spark can start the query."""
    return storage.list("") == [STOPPED]


def stopped_run(storage: Storage) -> str | None:
    """The run id of the last run recorded as stopped in ``storage``; None if none was."""
    try:
        return json.loads(storage.read(STOPPED))["run_id"]
    except BlobNotFoundError:
        return None
