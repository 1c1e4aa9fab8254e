"""A task as it crosses from a worker to its host, and how a host runs it (``serve_task``).

A worker pickles ``(task, instance, context)``: its user functions with
PySpark's ``cloudpickle``, each broadcast variable they read by value (a
host cannot resolve PySpark's broadcast ids), and the attributes of its
``TaskContext``, which the host sets for the task's functions.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import socket
import traceback
from collections.abc import Iterator

import pyarrow as pa

from spark_state.hosts import wire


def pickled_task(task, instance: int) -> bytes:
    """``(task, instance, context)`` pickled for the host, each broadcast variable its functions read carried by
    value, ``context`` the attributes of this task's ``TaskContext`` (``task_context``).

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
        (task, instance, None if context is None else dict(vars(context)))
    )
    return buffer.getvalue()


@contextlib.contextmanager
def task_context(attributes: dict | None):
    """In a host: the worker's ``TaskContext`` (its ``attributes``, ``pickled_task``) is the one its task's
    functions get from ``TaskContext.get()``, as in the worker; none once the task is done.

    A host is a fork of the worker that ran some earlier task, or of one
    that ran another instance (``adoption.adopt``): without this, a function would
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
    """``pickled_task``'s pickler class, made once per worker (not per task)."""
    from pyspark import cloudpickle
    from pyspark.core.broadcast import Broadcast

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if isinstance(obj, Broadcast):
                return _loaded_broadcast, (obj.value,)
            return super().reducer_override(obj)

    return Pickler


def _loaded_broadcast(value):
    """In a host: a broadcast variable of a task's function, holding ``value`` (``pickled_task``)."""
    from pyspark.core.broadcast import Broadcast

    broadcast = Broadcast.__new__(Broadcast)
    broadcast._jbroadcast = broadcast._sc = broadcast._pickle_registry = broadcast._path = None
    broadcast._value = value
    return broadcast


class _WorkerGone(Exception):
    """The worker closed the connection before it sent all of its task's rows (its task failed)."""


def _received_batches(connection: socket.socket) -> Iterator[pa.RecordBatch]:
    """The task's input rows, read as they come, until ``wire.END``."""
    while True:
        frame = wire.receive(connection)
        if frame is None:
            raise _WorkerGone
        kind, payload = frame
        if kind == wire.END:
            return
        yield wire.batch(payload)


def serve_task(connection: socket.socket):
    """Receive one task, run it on its rows, send its output (or its error); the task, once received.

    The rows are read as the instance takes them, after its restore: the
    worker sends the task first and its rows as Spark hands them over (once
    the JVM has read and aggregated them), so the restore runs meanwhile.
    """
    from spark_state.executor.task import run_instance

    frame = wire.receive(connection)
    if frame is None or frame[0] != wire.TASK:
        return None
    task, instance, context = pickle.loads(frame[1])
    batches = _received_batches(connection)
    try:
        with task_context(context):
            for batch in run_instance(task, instance, batches):
                wire.send(connection, wire.BATCH, memoryview(wire.batch_bytes(batch)))
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
        wire.send(connection, wire.END)
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
        wire.send(connection, wire.ERROR, payload)
    except (BrokenPipeError, ConnectionResetError):
        pass
