"""A host as a process: forked from a worker, reaped by it, its modules loaded first, its garbage frozen."""

from __future__ import annotations

import gc
import os
import re
import shutil
import traceback
from pathlib import Path

from spark_state.hosts import listening, serving, trust

EXECUTOR_NAME = re.compile(r"\d+(-[0-9a-f]+)?")
"""The name of an executor's directory (``trust.executor_name``)."""

_WORKER_FROZEN = False
"""Whether this process froze its objects as a worker (``freeze_worker``)."""


def freeze_worker() -> None:
    """Freeze the objects this worker holds (``gc.freeze``): at its first task for a host, and before each fork.

    A PySpark worker holds tens of megabytes of objects (PySpark, pyarrow,
    pandas) that live as long as it does, and its collections walked them
    in every task. A walk also writes to every page it crosses, and each
    page a worker shares with a host it forked is copied on its first
    write: frozen, a worker's forks share most of its pages.
    A worker that carries tasks but never forks (started after the hosts,
    say once PySpark replaced an idle one) freezes at its first task.
    Frozen objects are still freed when their last reference goes; only
    reference cycles among them, made before a freeze and dropped after,
    are never collected: what a worker holds at its first task and at its
    forks, a handful of times in its life.
    """
    global _WORKER_FROZEN
    gc.freeze()
    _WORKER_FROZEN = True


def start_host(address: Path, daemon_pid: int, log: Path, store_uri: str) -> int:
    """Fork the host from this worker (its modules are loaded: no interpreter start-up); its pid.

    One fork, not the double fork of a daemon (the second fork would copy
    the page tables of a worker's heap again): the host is this worker's child, which the worker reaps
    once it exits (``reap_hosts``, at its next connection); a host whose
    worker is gone is an orphan, reaped by the system like any other.
    In the host, standard input is ``/dev/null``, output goes to ``log`` and
    every other inherited descriptor (the worker's connection to the JVM
    among them) is closed before it listens. The modules a host needs, and
    the store's client libraries and models, are loaded here first
    (``load_host_modules``), once per worker, so that no host loads them on
    its first task.
    """
    load_host_modules(store_uri)
    freeze_worker()  # what it loaded too: pages the host shares stay shared
    host = os.fork()
    if host == 0:
        _become_host(address, daemon_pid, log)  # never returns
    _STARTED.add(host)
    return host


_STARTED: set[int] = set()
"""The hosts this worker forked that it has not reaped yet."""


def reap_hosts() -> None:
    """Reap the hosts this worker started that have exited (a zombie holds no memory, but a pid)."""
    for pid in list(_STARTED):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (by the system, or by a wait of other code in this worker)
            done = pid
        if done:
            _STARTED.discard(pid)


def host_running(pid: int) -> bool:
    """Whether the host ``pid`` this worker forked still runs (``serving.alive`` would count it alive as a zombie)."""
    reap_hosts()
    return pid in _STARTED


_PRELOADED: set[str] = set()


def load_host_modules(store_uri: str) -> None:
    """Import what a host's first task would: the operator and the storage backends with what they import
    lazily (a thread pool for timeouts, fault injection), pandas and pyarrow's pandas layer, which pyarrow
    imports on its first conversion to NumPy (paid by every new host on its first batch otherwise), Acero,
    which a built-in aggregate whose partials are not Spark's imports on its first ``group_by``; and for a
    remote store its client library and models (``storage.preload``: for S3, boto3's models and the
    credentials), which every instance of a restart or a rescale would load again."""
    import concurrent.futures  # noqa: F401

    import pandas  # noqa: F401
    import pyarrow.acero
    import pyarrow.pandas_compat  # noqa: F401

    import spark_state.executor.task
    import spark_state.storage.faults
    import spark_state.storage.timeouts  # noqa: F401
    from spark_state.storage import preload

    if store_uri not in _PRELOADED:
        _PRELOADED.add(store_uri)
        try:
            preload(store_uri)
        except Exception:  # noqa: BLE001 - only a head start: the host's own first client raises it, typed, in its task
            pass


def _become_host(address: Path, daemon_pid: int, log: Path) -> None:
    failed = False
    try:
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)
        listening.log_to(log)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        from spark_state.executor.resident import forget_all
        from spark_state.executor.task import forget_stores

        _STARTED.clear()  # the worker's children, not the host's
        forget_all()  # states this worker held stay with the worker; the host starts empty
        forget_stores()  # storage clients (connection pools, threads) do not survive a fork
        listener = None
        serving_address: Path | None = address
        while (
            serving_address is not None
        ):  # a host adopted by another instance serves that one next (``adoption.answer_adoption``)
            serving_address, listener = serving.serve(serving_address, daemon_pid, listener=listener)
    except BaseException as error:  # noqa: BLE001  (the host must never return into the worker's code)
        if not (isinstance(error, SystemExit) and serving._SIGNALLED is not None):  # a signal's exit is no error
            traceback.print_exc()
            failed = True
    finally:  # asked to leave by a signal (its exit raised, or dropped on the way): 128 + the signal
        os._exit(1 if failed else 0 if serving._SIGNALLED is None else 128 + serving._SIGNALLED)


def remove_dead_executors(root: Path) -> None:
    """Remove the socket directories of executors whose Python daemon is gone (their hosts exited with it)."""
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if EXECUTOR_NAME.fullmatch(directory.name) and not trust.executor_alive(directory.name):
            shutil.rmtree(directory, ignore_errors=True)
