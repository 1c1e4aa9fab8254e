"""A host's socket and the files beside it: bind, admit a peer, date the socket, leave an address."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

from spark_state.hosts import naming, tasks, wire
from spark_state.hosts.trust import admit, host_key, log_refusal, private_file

BUSY_MARK_SECONDS = 365 * 24 * 3600.0
"""A host running a task dates its socket this far ahead (``mark``)."""


def mark(address: Path, *, busy: bool) -> None:
    """Date the socket at ``address``: now, when its host is done with a task (``adoption.adopt`` asks the most recently
    used idle hosts first), or ``BUSY_MARK_SECONDS`` ahead while it runs one (``adoption.adopt`` asks none of those: it
    would wait for an answer that comes after the task)."""
    now = time.time()
    with contextlib.suppress(OSError):
        os.utime(address, (now, now + BUSY_MARK_SECONDS if busy else now))


def bound(address: Path) -> socket.socket:
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


def admitted(connection: socket.socket, address: Path) -> bool:
    """Whether the peer at ``connection`` proved it is a worker or host of this executor (``host_trust.admit``);
    one that did not is logged and gets nothing more."""
    refused = admit(connection, host_key(address.parent))
    if refused is not None:
        log_refusal(refused, connection)
    return refused is None


def log_to(log: Path) -> None:
    """Send this process's standard output and error to ``log`` (a host's log is beside its socket)."""
    output = private_file(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)


def vacate(address: Path, listener: socket.socket) -> bool:
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
        except (TimeoutError, BlockingIOError):
            return served
        with connection:
            connection.setblocking(True)
            if not admitted(connection, naming.listener_address(listener)):
                continue
            if wire.first_frame_kind(connection) == wire.ADOPT:
                with contextlib.suppress(OSError):
                    wire.send(connection, wire.REFUSED)
                continue
            tasks.serve_task(connection)
            served += 1
