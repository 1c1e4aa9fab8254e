"""When a host leaves, and how it keeps Python's collector off its state: its decisions, apart from its loop.

``obsolete`` asks the store whether the state a host holds is still of use;
``idle_limit`` says how long a host waits for its next task; ``collect_garbage``
is what a host does with the garbage a task left.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

IDLE_SECONDS = 300.0
"""A host with no task for this long exits (its state is in the store; the next task reloads it), unless its
tasks come further apart (``idle_limit``)."""


IDLE_GAPS = 3.0
"""A host waits at least this many times the longest of its recent gaps between tasks before idling out."""


GAPS_KEPT = 8
"""How many of its latest gaps between tasks a host remembers (``idle_limit``)."""


MAX_IDLE_SECONDS = 4 * 3600.0
"""The longest a host waits for a task, however far apart its tasks came."""


OBSOLETE_CHECK_SECONDS = 5.0
"""An idle host asks the store this often whether its state is still of use (``obsolete``): a copy left behind on
an executor its instance moved away from is dropped this long after its last task (two requests to the store)."""


UNCOMMITTED_SECONDS = 60.0
"""A host whose first task's checkpoint is still not committed this long after it holds state no task will use."""


FULL_COLLECTION_TASKS = 500
"""A host walks its whole heap for cyclic garbage once per this many tasks (``collect_garbage``)."""


START_SECONDS = 60.0
"""How long a worker waits for a host it started to listen."""


def idle_limit(gaps: Iterable[float], idle_seconds: float = IDLE_SECONDS) -> float:
    """How long a host whose recent tasks came ``gaps`` seconds apart waits for the next before it exits.

    ``idle_seconds``, or ``IDLE_GAPS`` times the longest gap when that is
    longer (at most ``MAX_IDLE_SECONDS``): a query whose trigger fires every
    ten minutes finds its state in memory at every batch instead of
    reloading it from the store, and a query that stopped frees its memory
    after the usual idle time when its batches came often.
    """
    return max(idle_seconds, min(MAX_IDLE_SECONDS, IDLE_GAPS * max(gaps, default=0.0)))


def collect_garbage(since_full: int) -> int:
    """After a task: collect its young cyclic garbage, freeze the rest; returns the tasks since a full collection.

    The young generations are what the task made since the collector last
    ran (a millisecond to walk); what the task's own collections aged is
    frozen unwalked: a restore's millions of new objects cost no walk. Every
    ``FULL_COLLECTION_TASKS`` tasks, everything is unfrozen and walked once.
    Call only in a host process: frozen objects stay frozen for the life of
    the process.
    """
    if since_full + 1 >= FULL_COLLECTION_TASKS:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        return 0
    gc.collect(1)
    gc.freeze()
    return since_full + 1


def obsolete(task, idle_seconds: float) -> bool:
    """Whether the store has no more use for the state a host holds after running ``task``.

    True when the task's run was stopped (``stops``); when the store holds
    no checkpoint although the task had a base, or no blob either after a
    first task (the store was deleted), or still no checkpoint
    ``UNCOMMITTED_SECONDS`` after a first task (its checkpoint was never
    committed); or when a checkpoint at
    least as new as the task's runs the component at another parallelism
    (the instance was rescaled away: a task at another parallelism builds
    its state anew from the store); or when a newer checkpoint than the
    task's is committed at its parallelism: the instance ran since, and not
    here (a host serves every task of its instance on its executor), so Spark
    placed it on another executor, which holds it now. The copy here is
    stale, and dropping it keeps one copy of each instance in the cluster, as
    Spark unloads a state store another executor has loaded; if the instance
    comes back, its task restores from the store. Never when the store
    cannot be read: the idle timeout still ends the host.
    """
    from spark_state.executor.task import manifest_reader
    from spark_state.store.blobstore import BLOBS_DIR
    from spark_state.store.stops import stopped_run

    run_id = task.run_id
    try:
        reader = manifest_reader(task.store_uri)
        latest = reader.latest()
        stopped = stopped_run(reader.storage) if run_id is not None else None
        # No checkpoint and no blob: a first task's blob (written before its commit) is gone with the store.
        emptied = latest is None and task.base_checkpoint_id is None and not reader.storage.exists(BLOBS_DIR)
    except Exception:  # noqa: BLE001  (a store unreachable now may come back)
        return False
    if stopped is not None and stopped == run_id:
        return True
    if latest is None:
        return task.base_checkpoint_id is not None or emptied or idle_seconds >= UNCOMMITTED_SECONDS
    if latest.checkpoint_id < task.checkpoint_id:
        return False  # the task's checkpoint is not committed yet
    component = latest.components.get(task.component)
    if component is None or component.parallelism != task.parallelism:
        return True
    return latest.checkpoint_id > task.checkpoint_id  # it ran since on another executor
