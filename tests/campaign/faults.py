"""The fault kinds of the campaign and how each is injected: the home of a new fault kind.

Every kind is named in ``FAULT_KINDS`` (or ``SAVEPOINT_KINDS``) and described
in ``DESCRIPTIONS``; a cycle's kind is injected by the table of its shape:

- ``TIMED``: at a random moment while the driver runs (the supervisor calls
  the kind's function with a ``Moment`` each tenth of a second once the
  moment is due; it returns what it injected, or None to try again);
- ``PATTERNS``: the moment a file appears in Spark's checkpoint (the driver
  is killed then);
- ``storage_rule``: a storage call that fails, stalls, truncates or kills
  its process (a fault plan the driver's processes read, ``storage.faults``).

**A new fault kind of one of these shapes is one entry here**: its name in
``FAULT_KINDS``, a line in ``DESCRIPTIONS``, and its injection in the table of
its shape. The checks need no change: whatever the fault, every batch must
come out exact (``supervisor``). Kinds with a protocol of their own (the
refusals ``delete_newest_record`` and ``second_checkpoint``, ``drain``,
``fork``, ``stop_before_first_batch``) are driven by the supervisor's ``run_cycle``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spark_state.storage.faults import kill_session

FIRST_OFFSETS_TEMP = r"\.0\.[0-9a-f-]{36}\.tmp"

DESCRIPTIONS = {
    "kill_random": "SIGKILL of the driver's whole session at a random moment",
    "kill_after_blob": "SIGKILL once a task wrote its 1st-3rd state blob",
    "kill_after_manifest": "SIGKILL once the driver wrote its 1st-3rd checkpoint record",
    "kill_after_offsets": "SIGKILL once Spark wrote an offsets entry",
    "kill_after_commit": "SIGKILL once Spark wrote a commit entry",
    "kill_first_offsets": "SIGKILL while Spark writes a new query's first offsets entry",
    "stop_before_first_batch": "a new query, its store in its checkpoint location, stopped right after it started",
    "kill_after_sink_commit": "SIGKILL once the replayable sink committed a batch",
    "kill_worker": "SIGKILL of a Python worker",
    "kill_host": "SIGKILL of an instance host, one running a task if any",
    "kill_executor": "SIGKILL of an executor of a standalone cluster",
    "decommission_executor": "an executor of a standalone cluster decommissioned (SIGPWR, with "
    "spark.decommission.enabled): it takes no more tasks and leaves; the master starts another",
    "dynamic_allocation": "a query on a standalone cluster under dynamic allocation with a trigger gap: Spark "
    "removes executors idle between batches and adds executors for the next ones",
    "clean_stop": "the driver stops its query (query.stop) at a random moment",
    "drain": "a drain requested while the query runs",
    "fail_write": "a storage create fails with an I/O error",
    "fail_read": "a storage read fails with an I/O error",
    "enospc": "a storage create fails with no space left on the device",
    "stall": "a storage call hangs past its time bound",
    "truncate": "a storage create writes a truncated file",
    "delete_newest_record": "the store's newest checkpoint record is deleted before a restart (refused, typed)",
    "second_checkpoint": "a second checkpoint location is started on the same store (refused, typed)",
    "savepoint": "a savepoint created with the CLI while the query runs",
    "fork": "a new query started from a savepoint, sometimes killed while it copies",
}
KILLS = (
    "kill_random",
    "kill_after_blob",
    "kill_after_manifest",
    "kill_after_offsets",
    "kill_after_commit",
    "kill_first_offsets",
    "kill_after_sink_commit",
    "kill_worker",
    "kill_host",
)
STORAGE = ("fail_write", "fail_read", "enospc", "stall", "truncate")
REFUSALS = ("delete_newest_record", "second_checkpoint")
CLUSTER = ("kill_executor", "decommission_executor", "dynamic_allocation")
"""Kinds whose cycle runs its driver on a standalone cluster of one-core executors (``tests.cluster``)."""
FAULT_KINDS = (
    KILLS
    + ("kill_executor", "clean_stop", "drain", "stop_before_first_batch")
    + STORAGE
    + REFUSALS
    + ("decommission_executor", "dynamic_allocation")
)
SAVEPOINT_KINDS = ("savepoint", "fork")
"""With ``--savepoints``: a savepoint created while the query runs, and a new query forked from one."""
assert set(DESCRIPTIONS) == set(FAULT_KINDS + SAVEPOINT_KINDS), "every fault kind is described"


@dataclass
class Moment:
    """What a ``TIMED`` injection may use: the campaign, the driver process, the cycle, and the time past due."""

    campaign: Any  # the supervisor's ``Campaign``
    process: Any  # the driver's ``subprocess.Popen``; its pid is its session's
    query: Any
    cycle_dir: Path
    control: Path
    cluster: Any
    late_s: float  # how long past the moment it is now
    query_started: bool


def _kill_random(moment: Moment) -> str:
    kill_session(moment.process.pid)
    return "random"


def _savepoint(moment: Moment) -> str:
    return moment.campaign.make_savepoint(moment.query, moment.cycle_dir) or "no savepoint"


def _kill_worker(moment: Moment) -> str | None:
    worker = moment.campaign.python_process(moment.process.pid, "worker")
    if worker is None:
        return None
    os.kill(worker, signal.SIGKILL)
    return f"worker {worker}"


def _kill_host(moment: Moment) -> str | None:
    """One running a task if any does within 3 s of the moment, else an idle one."""
    host, what = moment.campaign.busy_host(moment.process.pid), "busy"
    if host is None and moment.late_s >= 3.0:
        host, what = moment.campaign.python_process(moment.process.pid, "host"), "idle"
    if host is None:
        return None
    os.kill(host, signal.SIGKILL)
    return f"{what} host {host}"


def _kill_executor(moment: Moment) -> str | None:
    executor = moment.campaign.executor(moment.cluster)
    if executor is None:
        return None
    os.kill(executor, signal.SIGKILL)
    return f"executor {executor}"


def _decommission_executor(moment: Moment) -> str | None:
    executor = moment.campaign.executor(moment.cluster)
    if executor is None:
        return None
    os.kill(executor, signal.SIGPWR)  # Spark's executor decommission signal (spark.executor.decommission.signal)
    return f"decommissioned executor {executor}"


def _dynamic_allocation(moment: Moment) -> str | None:
    """Injected once the driver saw Spark remove an executor and add one (``control/executors.json``)."""
    path = moment.control / "executors.json"
    if not path.exists():
        return None
    seen = json.loads(path.read_text())
    added = [e for e in seen["seen"] if e not in seen["first"]]
    if not (added and seen["removed"]):
        return None
    return f"executors removed {seen['removed']}, added {added}"


def _clean_stop(moment: Moment) -> str | None:
    if not moment.query_started:
        return None
    (moment.control / "stop").write_text("")
    return "stop"


TIMED: dict[str, Callable[[Moment], str | None]] = {
    "kill_random": _kill_random,
    "savepoint": _savepoint,
    "kill_worker": _kill_worker,
    "kill_host": _kill_host,
    "kill_executor": _kill_executor,
    "decommission_executor": _decommission_executor,
    "dynamic_allocation": _dynamic_allocation,
    "clean_stop": _clean_stop,
}
"""Kinds injected at a random moment of the run; each returns what it injected, None to try again."""

PATTERNS: dict[str, tuple[str, str]] = {
    "kill_first_offsets": ("offsets", FIRST_OFFSETS_TEMP),
    "kill_after_offsets": ("offsets", r"\d+"),
    "kill_after_commit": ("commits", r"\d+"),
}
"""Kinds injected the moment a file matching the pattern appears in the directory of Spark's checkpoint."""

KILLED_AT_WRITE = {"kill_after_blob": "blobs", "kill_after_manifest": "checkpoints", "kill_after_sink_commit": "sink"}
"""Kinds that kill the writing process at its 1st-3rd create below a path (a storage fault plan)."""


def storage_rule(kind: str, rng: random.Random, *, store: str, events: str, out: str) -> dict:
    """The fault plan rule of storage kind ``kind`` (``STORAGE`` or ``KILLED_AT_WRITE``), over the paths of the
    query's store, the events log and the sink (each a regular expression)."""
    writes = [f"{store}/blobs/", f"{store}/checkpoints/", f"{out}/data/", f"{out}/_commits/"]
    reads = [f"{store}/checkpoints/", f"{events}/data/", f"{events}/_commits/"]
    if kind in ("fail_write", "enospc"):
        return {
            "op": "create",
            "path": rng.choice(writes),
            "nth": rng.randint(1, 3),
            "fault": "error" if kind == "fail_write" else "enospc",
        }
    if kind == "fail_read":  # paths read in every run: a cold store's records, the log's commits and segments
        path, nth = rng.choice([(reads[0], 1), (reads[1], rng.randint(1, 3)), (reads[2], rng.randint(1, 6))])
        return {"op": "read", "path": path, "nth": nth, "fault": "error"}
    if kind == "stall":
        return {
            "op": rng.choice(["create", "read", "list"]),
            "path": rng.choice([store, events, out]),
            "nth": rng.randint(1, 6),
            "fault": "stall",
            "stall_seconds": 120,
        }
    if kind == "truncate":
        return {
            "op": "create",
            "path": rng.choice([f"{store}/checkpoints/", f"{out}/_commits/"]),
            "nth": rng.randint(1, 2),
            "fault": "truncate",
        }
    target = {"blobs": f"{store}/blobs/", "checkpoints": f"{store}/checkpoints/", "sink": f"{out}/_commits/"}[
        KILLED_AT_WRITE[kind]
    ]
    return {"op": "create", "path": target, "nth": rng.randint(1, 3), "fault": "kill"}


def uses_storage_plan(kind: str | None) -> bool:
    return kind in STORAGE or kind in KILLED_AT_WRITE


def escaped(path: Path | str) -> str:
    return re.escape(str(path))
