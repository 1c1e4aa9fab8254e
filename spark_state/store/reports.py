"""Reports that travel through the store where Spark gives no other channel: over Spark Connect.

On a classic session a task's report reaches the driver through an
accumulator and the driver keeps a query's batch reports in its own memory.
Over Spark Connect neither exists: the driver's part of each batch runs in the
server's Python process (``foreachBatch``), which has no accumulators, and the
client that started the query is another process. So there:

- each task writes its instance's report to ``task-reports/<attempt>/<instance>.json``
  (``write_task_report``), the batch reads them once its output is written
  (``task_reports``), and deletes them after its commit (``clear_task_reports``:
  every attempt's, so a failed attempt leaves nothing for long);
- each completed batch's report (``StatefulQuery.batches``) is written to
  ``runs/<run id>/<batch id>.json`` (``write_batch_report``), which the client
  reads (``batch_reports``); a run keeps its last ``KEPT_BATCH_REPORTS``, and a
  query's start deletes earlier runs' (``clear_batch_reports``).

The files are small JSON documents; a batch over Connect makes one create per
instance, a listing, one read per instance, one create and two deletes more
than on a classic session.
"""

from __future__ import annotations

import json
import re

from spark_state.errors import BlobNotFoundError, ConfigError
from spark_state.storage.base import Storage, join

TASK_REPORTS = "task-reports"
BATCH_REPORTS = "runs"
KEPT_BATCH_REPORTS = 100
"""Batch reports a run keeps in the store: the client reads them as they come, so a few would do."""
_NAME = re.compile(r"[0-9A-Za-z-]{1,64}")


def _checked(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} must be 1-64 letters, digits or '-'")
    return name


def write_task_report(storage: Storage, attempt: str, instance: int, report: str) -> None:
    """Record ``report`` (an instance's report as JSON text) for batch attempt ``attempt``; a task that runs
    again replaces its earlier report (the last one counts, as with the accumulator)."""
    path = join(TASK_REPORTS, _checked(attempt, "attempt"), f"{int(instance)}.json")
    storage.create(path, report.encode("utf-8"), overwrite=True)


def task_reports(storage: Storage, attempt: str) -> list[str]:
    """The reports the tasks of ``attempt`` wrote, as JSON texts, in instance order."""
    directory = join(TASK_REPORTS, _checked(attempt, "attempt"))
    names = sorted((n for n in storage.list(directory) if n.endswith(".json")), key=lambda n: int(n[:-5]))
    texts = []
    for name in names:
        try:
            texts.append(storage.read(join(directory, name)).decode("utf-8"))
        except BlobNotFoundError:  # deleted meanwhile by a clear of an attempt that overlapped: not this one's
            continue
    return texts


def clear_task_reports(storage: Storage) -> None:
    """Delete the task reports of every attempt (the batch that read its own is committed)."""
    storage.delete(TASK_REPORTS)


def write_batch_report(storage: Storage, run_id: str, report: dict) -> None:
    """Record a completed batch's report (``report["batch_id"]``) for run ``run_id``; drop the one
    ``KEPT_BATCH_REPORTS`` batches older."""
    directory = join(BATCH_REPORTS, _checked(run_id, "run id"))
    batch_id = int(report["batch_id"])
    storage.create(join(directory, f"{batch_id}.json"), json.dumps(report).encode("utf-8"), overwrite=True)
    if batch_id >= KEPT_BATCH_REPORTS:
        storage.delete(join(directory, f"{batch_id - KEPT_BATCH_REPORTS}.json"))


def batch_reports(storage: Storage, run_id: str, after: int = -1) -> list[dict]:
    """The batch reports of run ``run_id`` whose batch id is above ``after``, in batch order."""
    directory = join(BATCH_REPORTS, _checked(run_id, "run id"))
    ids = sorted(int(n[:-5]) for n in storage.list(directory) if n.endswith(".json") and n[:-5].isdigit())
    reports = []
    for batch_id in ids:
        if batch_id <= after:
            continue
        try:
            reports.append(json.loads(storage.read(join(directory, f"{batch_id}.json"))))
        except BlobNotFoundError:  # dropped as older than the kept ones
            continue
    return reports


def clear_batch_reports(storage: Storage) -> None:
    """Delete every run's batch reports (a query starts a new run; nobody reads an earlier run's)."""
    storage.delete(BATCH_REPORTS)
