"""The worker's side: ``run_hosted`` hands a task to its instance's host and relays the host's answer."""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from spark_state.errors import SparkStateError
from spark_state.hosts import adoption, naming, policy, process, serving, tasks, wire
from spark_state.hosts.trust import connect, peer_credentials, private_file

SLOW_ANSWER_SECONDS = 60.0
"""A worker that has waited this long for its host's next frame logs it, with the host's stacks, and again each
time its wait doubles (``_answer``); it keeps waiting."""


class InstanceHostLostError(SparkStateError):
    """The instance host died while it ran a task (killed, or out of memory); Spark retries the task."""


def run_hosted(task, instance: int, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``operator.run_instance(task, instance, batches)``, run by the instance's host (see the module docstring)."""
    if not process._WORKER_FROZEN:
        process.freeze_worker()
    daemon_pid = os.getppid()
    address = naming.host_address(daemon_pid, task.store_uri, task.component, instance)
    connection = _connect(address, daemon_pid, task.store_uri)
    with connection:
        wire.send(connection, wire.TASK, tasks.pickled_task(task, instance))
        for batch in batches:
            wire.send(connection, wire.BATCH, memoryview(wire.batch_bytes(batch)))
        wire.send(connection, wire.END)
        while True:
            frame = _answer(connection, instance, address)
            if frame is None:
                raise InstanceHostLostError(
                    f"the host of instance {instance} closed the connection during its task (it died: killed, or out "
                    "of memory); Spark retries the task, which starts a new host from the committed state"
                )
            kind, payload = frame
            if kind == wire.BATCH:
                yield wire.batch(payload)
            elif kind == wire.END:
                return
            else:
                raise pickle.loads(payload)


def _answer(connection: socket.socket, instance: int, address: Path) -> tuple[bytes, bytes] | None:
    """The host's next frame (``wire.receive``), however long it takes; a long wait is logged (``_report_slow_host``).

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
    return wire.receive(connection)


def _report_slow_host(connection: socket.socket, instance: int, address: Path, waited: float) -> None:
    """Write to standard error that the host at ``address`` has sent nothing for ``waited`` seconds, and the
    stacks of its threads, which it writes to its log when sent ``serving.STACKS_SIGNAL`` (on Linux, which names the
    peer of a Unix socket: ``SO_PEERCRED``). A host that cannot be asked or read is reported as such: the
    report never fails the task it watches."""
    pid, stacks = None, "(not asked for: the system does not name a socket's peer)"
    try:
        log = address.with_suffix(".log")
        size = log.stat().st_size if log.exists() else 0
        if hasattr(socket, "SO_PEERCRED"):
            credentials = peer_credentials(connection)
            assert credentials is not None, "the system names a socket's peer (SO_PEERCRED)"
            pid = credentials[0]
            os.kill(pid, serving.STACKS_SIGNAL)
            time.sleep(0.5)  # the host writes them in its signal handler, even when its interpreter is stuck
            with open(log, "rb") as text:
                text.seek(size)
                stacks = text.read(64 << 10).decode(errors="replace")
    except OSError as error:
        stacks = f"(no stacks: {error})"
    print(
        f"spark-state: the worker of instance {instance} (pid {os.getpid()}) has waited {waited:.1f} s for an "
        f"answer from its host (pid {pid}, {address}); it keeps waiting. The host's threads:\n{stacks}",
        file=sys.stderr,
        flush=True,
    )


def _connect(address: Path, daemon_pid: int, store_uri: str) -> socket.socket:
    """A connection to the host at ``address``; starts the host (of a state in ``store_uri``) when none listens."""
    connection = connect(address)
    if connection is not None:
        return connection
    process.reap_hosts()
    process.remove_dead_executors(address.parent.parent)
    with open(private_file(address.with_suffix(".lock")), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        connection = connect(address)
        if connection is not None:
            return connection
        address.unlink(missing_ok=True)
        if adoption.adopt(address):
            connection = connect(address)
            if connection is not None:
                return connection
            address.unlink(missing_ok=True)  # the adopted host died since
        log = address.with_suffix(".log")
        host = process.start_host(address, daemon_pid, log, store_uri)
        deadline = time.monotonic() + policy.START_SECONDS
        while time.monotonic() < deadline:
            connection = connect(address)
            if connection is not None:
                return connection
            if not process.host_running(host):
                break
            time.sleep(0.001)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise InstanceHostLostError(f"the instance host at {address} did not start; its log ends with:\n{tail}")
