"""Instance hosts: one long-lived process per instance and executor, so state survives Spark's task placement.

Spark hands a task to whichever Python worker is idle, so the worker that
ran instance i last batch is often not the one that runs it next; state kept
in the worker (``resident``) then had to be reloaded from the store, costing
a multiple of a normal batch at millions of keys. With hosts, the task's
worker is only a courier: ``run_hosted(task, instance, batches)`` sends the
task and its input rows to the host of (this executor, store, component,
instance) over a Unix socket, and relays the output rows the host's
``operator.run_instance`` produces. The host keeps the instance's state
between batches, whichever worker carries the next task.

Protocol (one connection per task; a host serves one connection at a time,
so two attempts of one instance never run at once): after the handshake in
which each end proves it belongs to the executor (``host_trust``), the
worker sends frames ``TASK`` (the pickled task and instance), ``BATCH`` (one Arrow IPC stream per
input record batch) and ``END``; the host restores the instance as soon as
the task comes, reads the rows while Spark is still preparing them, and
answers ``BATCH`` frames of output and ``END``, or, once it has read the
rows, ``ERROR`` (the pickled exception, re-raised in the worker, so a typed
error reaches the driver as it would without hosts). A worker that
sees the connection close without ``END`` raises ``InstanceHostLostError``:
the task fails and Spark retries it, which starts a new host. A worker waits
for an answer as long as it takes, but one that has waited a minute writes to
the executor's log which host it waits for and that host's stacks
(``_answer``).

Lifetime: a worker starts the host when none answers (under a file lock, so
two workers start one). It first asks idle hosts of its executor that the
store no longer needs, spares first, to serve the instance instead
(``_adopt``): a host whose run stopped, whose store was deleted or that was
rescaled away from its instance, idle at least ``ADOPT_IDLE_SECONDS`` and
holding at most ``ADOPT_MAX_KEYS`` keys, drops its state and moves to the
new address; a new host's first task would otherwise copy every page it
touches from its worker (0.3-0.7 s of CPU in a restart at 100k keys and
eight new instances). Only when none agrees does the worker fork one
(forking skips an interpreter start-up, which would cost each new instance
a third of a second; the worker reaps it once it has exited). An obsolete
host that no worker adopted becomes a spare holding nothing (``_spare``,
at most ``SPARE_HOSTS`` per executor, each leaving after ``IDLE_SECONDS``),
so that a restart in the same application, or a later rescale, takes
warm hosts as PySpark's idle workers are taken. The host exits when the
executor's Python daemon (its starter's parent, which lives as long as the
executor) is gone, after ``idle_limit``
without a task (``IDLE_SECONDS``, or three times its recent gaps between
tasks when they are longer, so that a query with a slow trigger keeps its
state between batches), or as soon as an idle host finds that the store has
no more use for its state (``obsolete``: the run of its last task was
stopped, the query was rescaled away from its instance, or the store was
deleted) and enough spares wait, so that the memory of stopped, rescaled
or removed queries does not linger. It keeps the worker's process group and
environment, and none of its descriptors, resident states or storage
clients. SIGTERM or SIGHUP make
it leave, its socket removed, even when Python drops the handler's exit (one
raised inside a finalizer or a garbage-collection hook): the serving loop
also checks a flag the handler sets.

Garbage: a host freezes what it inherits from its worker when it starts,
and after each task collects the young garbage the task left and freezes
what survives (``gc.freeze``), so Python's collector never walks the state's
millions of objects in a later batch: at 5M keys per host, a full collection
paused whichever batch it fell in by 0.1-0.6 s. Objects are still freed when
their last reference goes; only cyclic garbage that aged during a task, or
among frozen objects, waits for the full collection a host runs once every
``FULL_COLLECTION_TASKS`` tasks. A worker freezes its own objects (PySpark,
pyarrow, pandas: most of its heap) at its first task for a host and before
each fork (``freeze_worker``, as Python's documentation advises before a fork
without exec): its collector no longer walks them. Those walks cost each
worker about 55 ms of CPU per task and dirtied the pages it shares with the
hosts it forked (each first write copies the page).

Trust: sockets, locks and logs live in the executor's private directory,
and both ends of a connection prove they belong to the executor before
anything is unpickled (``host_trust``). No pyspark, except its bundled
``cloudpickle`` for user functions, its ``Broadcast`` for the broadcast
variables they read (``_pickled_task``) and its ``TaskContext``, which a
host sets to its worker's for each task (``_task_context``).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import fcntl
import functools
import gc
import hashlib
import os
import pickle
import re
import select
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa

from spark_state.errors import SparkStateError
from spark_state.host_trust import (
    admit, host_key, log_refusal, peer_credentials, private_file, prove_to_host, socket_directory,
)

IDLE_SECONDS = 300.0
"""A host with no task for this long exits (its state is in the store; the next task reloads it), unless its
tasks come further apart (``idle_limit``)."""
IDLE_GAPS = 3.0
"""A host waits at least this many times the longest of its recent gaps between tasks before idling out."""
GAPS_KEPT = 8
"""How many of its latest gaps between tasks a host remembers (``idle_limit``)."""
MAX_IDLE_SECONDS = 4 * 3600.0
"""The longest a host waits for a task, however far apart its tasks came."""
ACCEPT_SECONDS = 1.0
"""How often a host waiting for a task checks its executor, its idle time and its store."""
OBSOLETE_CHECK_SECONDS = 15.0
"""An idle host asks the store this often whether its state is still of use (``obsolete``)."""
UNCOMMITTED_SECONDS = 60.0
"""A host whose first task's checkpoint is still not committed this long after it holds state no task will use."""
FULL_COLLECTION_TASKS = 500
"""A host walks its whole heap for cyclic garbage once per this many tasks (``collect_garbage``)."""
START_SECONDS = 60.0
"""How long a worker waits for a host it started to listen."""
SLOW_ANSWER_SECONDS = 60.0
"""A worker that has waited this long for its host's next frame logs it, with the host's stacks, and again each
time its wait doubles (``_answer``); it keeps waiting."""
STACKS_SIGNAL = signal.SIGUSR1
"""Makes a host write its threads' stacks to its log (``faulthandler``); sent by a worker that waits long."""

ADOPT_IDLE_SECONDS = 1.0
"""A worker that needs a new host first asks hosts idle at least this long whether the store still needs them
(``_adopt``)."""
ADOPT_CANDIDATES = 8
"""How many idle hosts a worker asks before it forks a new host instead: its own query's first, then the most
recently used (a stopped run's, at a restart)."""
ADOPT_ANSWER_SECONDS = 0.25
"""How long a worker waits for an asked host's answer: one busy with a task is skipped."""
SPARE_HOSTS = 8
"""At most this many obsolete hosts per executor stay, holding no state, for new instances to adopt (``_spare``);
each keeps 13-22 MB of memory of its own (measured after restarts at 100k keys)."""
SPARE = "spare"
"""A spare host's socket is ``spare-<pid>.sock`` in its executor's directory."""
ADOPT_MAX_KEYS = 250_000
"""A host holding more keys than this is neither adopted nor kept as a spare: dropping its state would cost more
than a fork, and leave more memory behind than a new host starts with."""

TASK, BATCH, END, ERROR = b"T", b"B", b"E", b"X"
ADOPT, READY, REFUSED, GO, DONE = b"A", b"R", b"N", b"G", b"D"
_HEADER = struct.Struct("!cQ")


class InstanceHostLostError(SparkStateError):
    """The instance host died while it ran a task (killed, or out of memory); Spark retries the task."""


def host_address(daemon_pid: int, store: str, component: str, instance: int) -> Path:
    """The socket of the host of ``instance`` of ``component`` in ``store``, for the executor of ``daemon_pid``,
    in the executor's private directory (``host_trust.socket_directory``)."""
    return socket_directory(daemon_pid) / host_name(store, component, instance)


def host_name(store: str, component: str, instance: int) -> str:
    """The name of the socket of the host of ``instance`` of ``component`` in ``store``."""
    digest = hashlib.sha1(f"{store}\0{component}".encode()).hexdigest()[:16]
    return f"{digest}-{instance}.sock"


SOCKET_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,80}\.sock")
"""A socket's name in its directory (``host_name``'s, a spare's): what an adopted host may bind (``_adoption``), never
a path elsewhere."""


# Frames -------------------------------------------------------------------------------------


def _send(connection: socket.socket, kind: bytes, payload: bytes | memoryview = b"") -> None:
    connection.sendall(_HEADER.pack(kind, len(payload)))
    if payload:
        connection.sendall(payload)


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = connection.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _receive(connection: socket.socket) -> tuple[bytes, bytes] | None:
    """The next frame, or None when the peer closed the connection."""
    header = _receive_exactly(connection, _HEADER.size)
    if header is None:
        return None
    kind, size = _HEADER.unpack(header)
    payload = _receive_exactly(connection, size) if size else b""
    return None if payload is None else (kind, payload)


def _next_kind(connection: socket.socket) -> bytes | None:
    """The kind of the next frame (``_receive``, its payload dropped); None when the peer closed the connection."""
    frame = _receive(connection)
    return None if frame is None else frame[0]


def _batch_bytes(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _batch(payload: bytes) -> pa.RecordBatch:
    return pa.ipc.open_stream(payload).read_next_batch()


# Worker side --------------------------------------------------------------------------------


def run_hosted(task, instance: int, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``operator.run_instance(task, instance, batches)``, run by the instance's host (see the module docstring)."""
    if not _WORKER_FROZEN:
        freeze_worker()
    daemon_pid = os.getppid()
    address = host_address(daemon_pid, task.store_uri, task.component, instance)
    connection = _connect(address, daemon_pid, task.store_uri)
    with connection:
        _send(connection, TASK, _pickled_task(task, instance))
        for batch in batches:
            _send(connection, BATCH, memoryview(_batch_bytes(batch)))
        _send(connection, END)
        while True:
            frame = _answer(connection, instance, address)
            if frame is None:
                raise InstanceHostLostError(
                    f"the host of instance {instance} closed the connection during its task (it died: killed, or out "
                    "of memory); Spark retries the task, which starts a new host from the committed state"
                )
            kind, payload = frame
            if kind == BATCH:
                yield _batch(payload)
            elif kind == END:
                return
            else:
                raise pickle.loads(payload)


def _answer(connection: socket.socket, instance: int, address: Path) -> tuple[bytes, bytes] | None:
    """The host's next frame (``_receive``), however long it takes; a long wait is logged (``_report_slow_host``).

    A worker has no way to tell a host that is slow (a large restore, a slow
    user function, a store that retries: its calls have their own time
    limit) from one that hangs, so it never gives up on its own: the task
    ends when Spark ends it (the query stopped). What it does is leave a
    trace: after ``SLOW_ANSWER_SECONDS``, and at each doubling of its wait,
    the worker's standard error (the executor's log) says which host it
    waits for and what that host's threads are doing.
    """
    poller = select.poll()
    poller.register(connection, select.POLLIN)
    started, report_at = time.monotonic(), SLOW_ANSWER_SECONDS
    while not poller.poll(max(0.0, report_at - (time.monotonic() - started)) * 1000):
        waited = time.monotonic() - started
        if waited >= report_at:
            _report_slow_host(connection, instance, address, waited)
            report_at *= 2
    return _receive(connection)


def _report_slow_host(connection: socket.socket, instance: int, address: Path, waited: float) -> None:
    """Write to standard error that the host at ``address`` has sent nothing for ``waited`` seconds, and the
    stacks of its threads, which it writes to its log when sent ``STACKS_SIGNAL`` (on Linux, which names the
    peer of a Unix socket: ``SO_PEERCRED``). A host that cannot be asked or read is reported as such: the
    report never fails the task it watches."""
    pid, stacks = None, "(not asked for: the system does not name a socket's peer)"
    try:
        log = address.with_suffix(".log")
        size = log.stat().st_size if log.exists() else 0
        if hasattr(socket, "SO_PEERCRED"):
            pid = peer_credentials(connection)[0]
            os.kill(pid, STACKS_SIGNAL)
            time.sleep(0.5)  # the host writes them in its signal handler, even when its interpreter is stuck
            with open(log, "rb") as text:
                text.seek(size)
                stacks = text.read(64 << 10).decode(errors="replace")
    except OSError as error:
        stacks = f"(no stacks: {error})"
    print(f"spark-state: the worker of instance {instance} (pid {os.getpid()}) has waited {waited:.1f} s for an "
          f"answer from its host (pid {pid}, {address}); it keeps waiting. The host's threads:\n{stacks}",
          file=sys.stderr, flush=True)


_WORKER_FROZEN = False
"""Whether this process froze its objects as a worker (``freeze_worker``)."""


def freeze_worker() -> None:
    """Freeze the objects this worker holds (``gc.freeze``): at its first task for a host, and before each fork.

    A PySpark worker holds about 95 MB of objects (PySpark, pyarrow,
    pandas) that live as long as it does, and its collections walked them:
    measured with ``spark.state.parallelism`` 2 and 100k-row batches, the
    two workers spent 1.0-1.1 s of CPU in nine batches (about 55 ms a
    task), against 0.1 s frozen. A walk also writes to every page it
    crosses, and each page a worker shares with a host it forked is copied
    on its first write: in a restart at 100k keys, a worker took about
    7,000 page faults per host it started (its task included), about
    1,300 frozen.
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


def _pickled_task(task, instance: int) -> bytes:
    """``(task, instance, context)`` pickled for the host, each broadcast variable its functions read carried by
    value, ``context`` the attributes of this task's ``TaskContext`` (``_task_context``).

    PySpark pickles a broadcast variable as its id, which only a process
    Spark sent the broadcast to can resolve: a worker cannot pickle one at
    all. The host gets its value instead (``_loaded_broadcast``), once per
    task.
    """
    import io

    from pyspark import TaskContext, cloudpickle

    context = TaskContext.get()
    buffer = io.BytesIO()
    _task_pickler()(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(
        (task, instance, None if context is None else dict(vars(context))))
    return buffer.getvalue()


@contextlib.contextmanager
def _task_context(attributes: dict | None):
    """In a host: the worker's ``TaskContext`` (its ``attributes``, ``_pickled_task``) is the one its task's
    functions get from ``TaskContext.get()``, as in the worker; none once the task is done.

    A host is a fork of the worker that ran some earlier task, or of one
    that ran another instance (``_adopt``): without this, a function would
    see that task's partition, stage and attempt.
    """
    from pyspark import TaskContext

    if attributes is None:
        TaskContext._setTaskContext(None)
        yield
        return
    context = object.__new__(TaskContext)  # not ``TaskContext()``: that returns the current one, to update
    context.__dict__.update(attributes)
    TaskContext._setTaskContext(context)
    try:
        yield
    finally:
        TaskContext._setTaskContext(None)


@functools.cache
def _task_pickler() -> type:
    """``_pickled_task``'s pickler class, made once per worker (not per task)."""
    from pyspark import cloudpickle
    from pyspark.core.broadcast import Broadcast

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if isinstance(obj, Broadcast):
                return _loaded_broadcast, (obj.value,)
            return super().reducer_override(obj)

    return Pickler


def _loaded_broadcast(value):
    """In a host: a broadcast variable of a task's function, holding ``value`` (``_pickled_task``)."""
    from pyspark.core.broadcast import Broadcast

    broadcast = Broadcast.__new__(Broadcast)
    broadcast._jbroadcast = broadcast._sc = broadcast._pickle_registry = broadcast._path = None
    broadcast._value = value
    return broadcast


def _connect(address: Path, daemon_pid: int, store_uri: str) -> socket.socket:
    """A connection to the host at ``address``; starts the host (of a state in ``store_uri``) when none listens."""
    connection = _try_connect(address)
    if connection is not None:
        return connection
    _reap_hosts()
    _remove_dead_executors(address.parent.parent)
    with open(private_file(address.with_suffix(".lock")), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        connection = _try_connect(address)
        if connection is not None:
            return connection
        address.unlink(missing_ok=True)
        if _adopt(address):
            connection = _try_connect(address)
            if connection is not None:
                return connection
            address.unlink(missing_ok=True)  # the adopted host died since
        log = address.with_suffix(".log")
        host = _start_host(address, daemon_pid, log, store_uri)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            connection = _try_connect(address)
            if connection is not None:
                return connection
            if not _host_running(host):
                break
            time.sleep(0.001)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise InstanceHostLostError(f"the instance host at {address} did not start; its log ends with:\n{tail}")


def _start_host(address: Path, daemon_pid: int, log: Path, store_uri: str) -> int:
    """Fork the host from this worker (its modules are loaded: no interpreter start-up); its pid.

    One fork, not the double fork of a daemon (a quarter of its cost: the
    second fork copied the page tables of a worker's heap again, about 9 ms
    per new host): the host is this worker's child, which the worker reaps
    once it exits (``_reap_hosts``, at its next connection); a host whose
    worker is gone is an orphan, reaped by the system like any other.
    In the host, standard input is ``/dev/null``, output goes to ``log`` and
    every other inherited descriptor (the worker's connection to the JVM
    among them) is closed before it listens. The modules a host needs, and
    the store's client libraries and models, are loaded here first
    (``_load_host_modules``), once per worker, so that no host loads them on
    its first task.
    """
    _load_host_modules(store_uri)
    freeze_worker()  # what it loaded too: pages the host shares stay shared
    host = os.fork()
    if host == 0:
        _become_host(address, daemon_pid, log)  # never returns
    _STARTED.add(host)
    return host


_STARTED: set[int] = set()
"""The hosts this worker forked that it has not reaped yet."""


def _query(address: Path) -> str:
    """The digest of the store and component a host's address names: the same for all hosts of a query."""
    return address.name.rsplit("-", 1)[0]


def _adopt(address: Path) -> bool:
    """Whether an idle host of this executor, whose state the store no longer needs, now listens at ``address``.

    A new instance's host is otherwise a fork of this worker, and its first
    task writes to a few thousand pages it shares with the worker, each
    copied on that first write: at 100k keys and eight new instances, the
    new hosts spent 0.3-0.7 s of CPU that way. An idle host of a stopped run,
    of a deleted store or rescaled away from its instance (``obsolete``), as
    left by a restart at a new parallelism, has all of those pages of its
    own already. The worker asks up to ``ADOPT_CANDIDATES`` hosts: spares
    (``_spare``) first, then its own query's hosts, then the others, each
    group the most recently used first (a host dates its socket after each
    task: a stopped run's hosts are the latest idle ones at a restart), each
    but a spare idle at least ``ADOPT_IDLE_SECONDS``, none running a task (a
    host dates its socket ahead while it runs one, ``_mark``: asking it would
    cost ``ADOPT_ANSWER_SECONDS``, as in a live rescale, whose other
    instances' hosts are busy with the same batch); each decides for itself
    (``_adoption``). Called with ``address``'s lock held and no host at it.
    """
    now, query, candidates = time.time(), _query(address), []
    for path in address.parent.glob("*.sock"):
        try:
            idle = now - path.stat().st_mtime
        except OSError:  # gone meanwhile
            continue
        if _is_spare(path):
            candidates.append((0, idle, path))
        elif path != address and idle >= ADOPT_IDLE_SECONDS:  # not running a task (``_mark``), nor just done
            candidates.append((1 if _query(path) == query else 2, idle, path))
    for *_, path in sorted(candidates)[:ADOPT_CANDIDATES]:
        try:
            connection = _try_connect(path, ADOPT_ANSWER_SECONDS)
        except OSError:  # busy with a task (timed out), or gone
            continue
        if connection is None:
            continue
        with connection:
            try:
                _send(connection, ADOPT, address.name.encode())
                if _next_kind(connection) != READY:
                    continue
                connection.settimeout(START_SECONDS)
                _send(connection, GO)
                if _next_kind(connection) == DONE:
                    return True
            except OSError:  # busy (timed out), or gone
                continue
    return False


def _reap_hosts() -> None:
    """Reap the hosts this worker started that have exited (a zombie holds no memory, but a pid)."""
    for pid in list(_STARTED):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (by the system, or by a wait of other code in this worker)
            done = pid
        if done:
            _STARTED.discard(pid)


def _host_running(pid: int) -> bool:
    """Whether the host ``pid`` this worker forked still runs (``_alive`` would count it alive as a zombie)."""
    _reap_hosts()
    return pid in _STARTED


_PRELOADED: set[str] = set()


def _load_host_modules(store_uri: str) -> None:
    """Import what a host's first task would: the operator and the storage backends with what they import
    lazily (a thread pool for timeouts, fault injection), pandas and pyarrow's pandas layer, which pyarrow
    imports on its first conversion to NumPy (a quarter of a second, paid by every new host on its first
    batch otherwise), Acero, which a built-in aggregate whose partials are not Spark's imports on its
    first ``group_by`` (20-30 ms per new host); and for a remote store its client library and models
    (``storage.preload``: for S3 a quarter of a second more per new host, every instance of a restart or a
    rescale)."""
    import concurrent.futures  # noqa: F401

    import pandas  # noqa: F401
    import pyarrow.acero  # noqa: F401
    import pyarrow.pandas_compat  # noqa: F401

    import spark_state.operator  # noqa: F401
    import spark_state.storage.faults  # noqa: F401
    import spark_state.storage.local  # noqa: F401
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
        _log_to(log)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        from spark_state.operator import forget_stores
        from spark_state.resident import forget_all

        _STARTED.clear()  # the worker's children, not the host's
        forget_all()  # states this worker held stay with the worker; the host starts empty
        forget_stores()  # storage clients (connection pools, threads) do not survive a fork
        listener = None
        while address is not None:  # a host adopted by another instance serves that one next (``_adoption``)
            address, listener = serve(address, daemon_pid, listener=listener)
    except BaseException as error:  # noqa: BLE001  (the host must never return into the worker's code)
        if not (isinstance(error, SystemExit) and _SIGNALLED is not None):  # a signal's exit is no error
            traceback.print_exc()
            failed = True
    finally:  # asked to leave by a signal (its exit raised, or dropped on the way): 128 + the signal
        os._exit(1 if failed else 0 if _SIGNALLED is None else 128 + _SIGNALLED)


def _remove_dead_executors(root: Path) -> None:
    """Remove the socket directories of executors whose Python daemon is gone (their hosts exited with it)."""
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if directory.name.isdigit() and not _alive(int(directory.name)):
            shutil.rmtree(directory, ignore_errors=True)


def _try_connect(address: Path, timeout: float | None = None) -> socket.socket | None:
    """An authenticated connection to the host at ``address`` (``host_trust.prove_to_host``), None when no host
    listens there; ``timeout`` bounds each step (``socket.timeout``, an ``OSError``, when a busy host does not
    answer), None: no bound. ``HostAuthenticationError`` when the process there is not a host of this executor."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(timeout)
        connection.connect(str(address))
        prove_to_host(connection, host_key(address.parent))
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        return None
    except BaseException:
        connection.close()
        raise
    return connection


# Host side ----------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def idle_limit(gaps: Iterable[float], idle_seconds: float = IDLE_SECONDS) -> float:
    """How long a host whose recent tasks came ``gaps`` seconds apart waits for the next before it exits.

    ``idle_seconds``, or ``IDLE_GAPS`` times the longest gap when that is
    longer (at most ``MAX_IDLE_SECONDS``): a query whose trigger fires every
    ten minutes finds its state in memory at every batch instead of
    reloading it from the store, and a query that stopped frees its memory
    after the usual idle time when its batches came often.
    """
    return max(idle_seconds, min(MAX_IDLE_SECONDS, IDLE_GAPS * max(gaps, default=0.0)))


def serve(address: Path, daemon_pid: int, *, idle_seconds: float = IDLE_SECONDS,
          listener: socket.socket | None = None) -> tuple[Path | None, socket.socket | None]:
    """Run tasks sent to ``address``, one connection at a time, until the daemon is gone or the host idles out.

    ``idle_seconds`` is ``idle_limit``'s floor; ``listener``, when given, is
    already bound to ``address``. Returns None twice, or, when another
    instance adopted this host (``_adoption``), that instance's address and a
    socket bound to it, which the host serves next.
    """
    is_host = threading.current_thread() is threading.main_thread()  # a test may serve from a thread
    if is_host:
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGHUP, _exit_on_signal)
        faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)  # to its log (``_report_slow_host``)
    if listener is None:
        listener = _bound(address)
    inode = os.stat(address).st_ino
    try:  # from here on, however the host leaves (a signal while it starts included), its socket goes with it
        listener.settimeout(ACCEPT_SECONDS)
        from spark_state import resident

        query = _query(address)
        resident.set_peers(lambda: max(1, sum(1 for _ in address.parent.glob(f"{query}-*.sock"))))
        last_task = last_check = time.monotonic()
        served = None  # the last task this host ran
        since_full = 0  # tasks since the last full collection of garbage
        if is_host:
            gc.freeze()  # what it made since the fork (the worker froze what it inherits)
        gaps, last_start = collections.deque(maxlen=GAPS_KEPT), None  # between the starts of its latest tasks
        while (_SIGNALLED is None and _alive(daemon_pid)
               and time.monotonic() - last_task < idle_limit(gaps, idle_seconds)):
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                now = time.monotonic()
                if served is not None and now - max(last_task, last_check) >= OBSOLETE_CHECK_SECONDS:
                    last_check = now
                    if obsolete(served, now - last_task):
                        if _vacate(address, listener) and is_host:
                            return _spare(address)
                        break
                continue
            with connection:
                connection.settimeout(None)
                if not _admitted(connection, address):
                    continue
                if _first_frame_kind(connection) == ADOPT:
                    adopted = _adoption(connection, served, time.monotonic() - last_task, listener, address)
                    if adopted is not None or not address.exists():
                        return adopted or (None, None)
                    continue
                started = time.monotonic()
                if last_start is not None:
                    gaps.append(started - last_start)
                last_start = started
                _mark(address, busy=True)
                served = _serve_task(connection) or served
            if is_host:
                since_full = collect_garbage(since_full)
            last_task = time.monotonic()
            _mark(address, busy=False)
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            if os.stat(address).st_ino == inode:  # not the socket of a host started since at this address
                address.unlink()
    return None, None


BUSY_MARK_SECONDS = 365 * 24 * 3600.0
"""A host running a task dates its socket this far ahead (``_mark``)."""


def _mark(address: Path, *, busy: bool) -> None:
    """Date the socket at ``address``: now, when its host is done with a task (``_adopt`` asks the most recently
    used idle hosts first), or ``BUSY_MARK_SECONDS`` ahead while it runs one (``_adopt`` asks none of those: it
    would wait for an answer that comes after the task)."""
    now = time.time()
    with contextlib.suppress(OSError):
        os.utime(address, (now, now + BUSY_MARK_SECONDS if busy else now))


def _spare(address: Path) -> tuple[Path | None, socket.socket | None]:
    """An obsolete host at ``address`` (unlinked): a spare's address and socket, or None twice (it leaves).

    It stays as a spare, holding no state, when fewer than ``SPARE_HOSTS``
    spares wait on its executor and it held at most ``ADOPT_MAX_KEYS`` keys
    (a larger state would leave more memory behind, fragments the
    allocators keep, than a new host starts with): the next new instance
    there adopts it (``_adopt``) instead of forking a host whose first task
    copies the pages it touches. Its states and storage clients are dropped
    and the memory they held handed back to the system; it leaves after
    ``IDLE_SECONDS`` unless adopted.
    """
    from spark_state.resident import held_keys

    if held_keys() > ADOPT_MAX_KEYS or sum(1 for _ in address.parent.glob(f"{SPARE}-*.sock")) >= SPARE_HOSTS:
        return None, None
    _start_afresh()
    spare = address.parent / f"{SPARE}-{os.getpid()}.sock"
    _log_to(spare.with_suffix(".log"))
    address.with_suffix(".log").unlink(missing_ok=True)
    return spare, _bound(spare)


def _start_afresh() -> None:
    """Drop this host's states and storage clients, hand the memory they held back to the system and reset its
    peak resident size (``VmHWM``, which its tasks report), as a newly forked host starts."""
    from spark_state.operator import forget_stores
    from spark_state.resident import forget_all

    forget_all(release_memory=True)
    forget_stores()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:  # Linux 4.0+
        refs.write("5")


def _is_spare(address: Path) -> bool:
    return address.name.startswith(SPARE + "-")


def _bound(address: Path) -> socket.socket:
    """A socket listening at ``address``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(address))
        os.chmod(address, 0o600)  # its directory is private already; the socket is too, whatever the umask
        listener.listen(8)
    except BaseException:
        listener.close()
        raise
    return listener


def _admitted(connection: socket.socket, address: Path) -> bool:
    """Whether the peer at ``connection`` proved it is a worker or host of this executor (``host_trust.admit``);
    one that did not is logged and gets nothing more."""
    refused = admit(connection, host_key(address.parent))
    if refused is not None:
        log_refusal(refused, connection)
    return refused is None


def listener_address(listener: socket.socket) -> Path:
    """The path ``listener`` is bound to."""
    return Path(listener.getsockname())


def _first_frame_kind(connection: socket.socket) -> bytes:
    """The kind of the connection's first frame, left unread (empty when the peer closed it)."""
    return connection.recv(1, socket.MSG_PEEK)


def _adoption(connection: socket.socket, served, idle_seconds: float, listener: socket.socket,
              address: Path) -> tuple[Path, socket.socket] | None:
    """Answer an ``ADOPT`` frame (``_adopt``): the new address and a socket bound to it, when this host now
    serves that instance; None when it stays at ``address`` (or, if that is gone, leaves).

    The host agrees (``READY``) only when it is idle long enough, its last
    task's state is of no more use to the store (``obsolete``) and holds at
    most ``ADOPT_MAX_KEYS`` keys. On the worker's ``GO`` it stops listening at
    its address first; a worker that connected there meanwhile (a task of
    that instance after all) is served, the adoption refused and the host
    leaves, as an obsolete host does. Otherwise it drops its states and
    storage clients, as a new host starts, moves its log beside the new
    address, binds it and answers ``DONE``. A worker that gave up waiting
    leaves the host as it was.
    """
    from spark_state.resident import held_keys

    frame = _receive(connection)
    if frame is None:
        return None
    name = frame[1].decode(errors="replace")
    if not SOCKET_NAME.fullmatch(name):  # a worker names an instance's socket, never a path: it stays in this directory
        log_refusal(f"it asked this host to serve at {name[:80]!r}, which is not an instance's socket name", connection)
        return None
    new_address = address.parent / name
    agreed = _is_spare(address) or (served is not None and idle_seconds >= ADOPT_IDLE_SECONDS
                                     and held_keys() <= ADOPT_MAX_KEYS and obsolete(served, idle_seconds))
    try:
        _send(connection, READY if agreed else REFUSED)
        if not agreed or _next_kind(connection) != GO:
            return None
    except OSError:  # the worker gave up waiting
        return None
    if not _vacate(address, listener):
        with contextlib.suppress(OSError):
            _send(connection, REFUSED)
        return None
    _start_afresh()
    if threading.current_thread() is threading.main_thread():  # a host (a test may serve from a thread)
        _log_to(new_address.with_suffix(".log"))
        if _is_spare(address):
            address.with_suffix(".log").unlink(missing_ok=True)
    new_listener = _bound(new_address)
    try:
        _send(connection, DONE)
    except OSError:  # the worker is gone: it starts no host of its own while it holds the lock; leave
        new_listener.close()
        new_address.unlink(missing_ok=True)
        return None
    return new_address, new_listener


def _log_to(log: Path) -> None:
    """Send this process's standard output and error to ``log`` (a host's log is beside its socket)."""
    output = private_file(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)


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


def _vacate(address: Path, listener: socket.socket) -> bool:
    """Stop serving ``address``: whether no task was waiting there. Its socket is removed first, so no new
    connection finds this host; tasks already queued are served (``_serve_queued``); with none, the listener is
    closed at once, so that a worker that found the socket a moment before starts a host of its own."""
    address.unlink(missing_ok=True)
    if _serve_queued(listener):
        return False
    listener.close()
    return True


def _serve_queued(listener: socket.socket) -> int:
    """Serve the tasks already waiting on ``listener`` (a worker connected just before the host left); how many
    there were. Another worker's request to adopt the host is refused."""
    listener.setblocking(False)
    served = 0
    while True:
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, socket.timeout):
            return served
        with connection:
            connection.setblocking(True)
            if not _admitted(connection, listener_address(listener)):
                continue
            if _first_frame_kind(connection) == ADOPT:
                with contextlib.suppress(OSError):
                    _send(connection, REFUSED)
                continue
            _serve_task(connection)
            served += 1


def obsolete(task, idle_seconds: float) -> bool:
    """Whether the store has no more use for the state a host holds after running ``task``.

    True when the task's run was stopped (``stops``); when the store holds
    no checkpoint although the task had a base, or no blob either after a
    first task (the store was deleted), or still no checkpoint
    ``UNCOMMITTED_SECONDS`` after a first task (its checkpoint was never
    committed); or when a checkpoint at
    least as new as the task's runs the component at another parallelism
    (the instance was rescaled away: a task at another parallelism builds
    its state anew from the store). Never when the store cannot be read:
    the idle timeout still ends the host.
    """
    from spark_state.blobstore import BLOBS_DIR
    from spark_state.operator import manifest_reader
    from spark_state.stops import stopped_run

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
    return component is None or component.parallelism != task.parallelism


_SIGNALLED: int | None = None
"""The signal that asked this host to leave, once one did."""


def _exit_on_signal(signum, frame) -> None:
    """Leave on ``signum``: now, by raising, and at the serving loop's next turn, by the flag.

    Python runs a handler at whatever Python code runs next, and an exception
    raised inside a finalizer or a ``gc.callbacks`` hook (a garbage collection
    after a task runs them) is printed and dropped: without the flag, the host
    would serve on with its socket in place until it idled out.
    """
    global _SIGNALLED
    _SIGNALLED = signum
    raise SystemExit(128 + signum)


class _WorkerGone(Exception):
    """The worker closed the connection before it sent all of its task's rows (its task failed)."""


def _received_batches(connection: socket.socket) -> Iterator[pa.RecordBatch]:
    """The task's input rows, read as they come, until ``END``."""
    while True:
        frame = _receive(connection)
        if frame is None:
            raise _WorkerGone
        kind, payload = frame
        if kind == END:
            return
        yield _batch(payload)


def _serve_task(connection: socket.socket):
    """Receive one task, run it on its rows, send its output (or its error); the task, once received.

    The rows are read as the instance takes them, after its restore: the
    worker sends the task first and its rows as Spark hands them over (once
    the JVM has read and aggregated them), so the restore runs meanwhile.
    """
    from spark_state.operator import run_instance

    frame = _receive(connection)
    if frame is None or frame[0] != TASK:
        return None
    task, instance, context = pickle.loads(frame[1])
    batches = _received_batches(connection)
    try:
        with _task_context(context):
            for batch in run_instance(task, instance, batches):
                _send(connection, BATCH, memoryview(_batch_bytes(batch)))
    except (_WorkerGone, BrokenPipeError, ConnectionResetError):
        return task  # the worker is gone: its task failed and will be retried
    except Exception as error:  # noqa: BLE001  (handed to the worker, which raises it in the task)
        if hasattr(error, "add_note"):
            error.add_note("raised in the instance host:\n" + traceback.format_exc())
        try:
            for _ in batches:  # the worker sends all of its rows before it reads an answer
                pass
        except (_WorkerGone, OSError):
            return task
        _send_error(connection, error)
        return task
    try:
        _send(connection, END)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return task


def _send_error(connection: socket.socket, error: Exception) -> None:
    from pyspark import cloudpickle

    try:
        payload = cloudpickle.dumps(error)
        pickle.loads(payload)
    except Exception:  # noqa: BLE001  (an exception that does not survive pickling is sent as its text)
        payload = cloudpickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
    try:
        _send(connection, ERROR, payload)
    except (BrokenPipeError, ConnectionResetError):
        pass

