"""A host's loop: tasks one connection at a time, until its executor is gone, it idles out or is obsolete."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import os
import signal
import socket
import threading
import time
from pathlib import Path

from spark_state.hosts import adoption, listening, naming, policy, tasks, trust, wire

ACCEPT_SECONDS = 1.0
"""How often a host waiting for a task checks its executor, its idle time and its store."""


STACKS_SIGNAL = signal.SIGUSR1
"""Makes a host write its threads' stacks to its log (``faulthandler``); sent by a worker that waits long."""


def alive(pid: int, started: str | None = None) -> bool:
    """``trust.process_alive``: the host's loop checks its daemon through this name (tests watch it)."""
    return trust.process_alive(pid, started)


def serve(
    address: Path, daemon_pid: int, *, idle_seconds: float = policy.IDLE_SECONDS, listener: socket.socket | None = None
) -> tuple[Path | None, socket.socket | None]:
    """Run tasks sent to ``address``, one connection at a time, until the daemon is gone or the host idles out.

    ``idle_seconds`` is ``policy.idle_limit``'s floor; ``listener``, when given, is
    already bound to ``address``. Returns None twice, or, when another
    instance adopted this host (``adoption.answer_adoption``), that instance's address and a
    socket bound to it, which the host serves next.
    """
    is_host = threading.current_thread() is threading.main_thread()  # a test may serve from a thread
    if is_host:
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGHUP, _exit_on_signal)
        faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)  # to its log (``worker._report_slow_host``)
    if listener is None:
        listener = listening.bound(address)
    inode = os.stat(address).st_ino
    daemon_started = trust.process_started(daemon_pid)  # the daemon runs: it started the worker that forked this
    try:  # from here on, however the host leaves (a signal while it starts included), its socket goes with it
        listener.settimeout(ACCEPT_SECONDS)
        from spark_state.executor import resident

        query = naming.query_of(address)
        resident.set_peers(lambda: max(1, sum(1 for _ in address.parent.glob(f"{query}-*.sock"))))
        last_task = last_check = time.monotonic()
        served = None  # the last task this host ran
        since_full = 0  # tasks since the last full collection of garbage
        if is_host:
            gc.freeze()  # what it made since the fork (the worker froze what it inherits)
        # The gaps between the starts of its latest tasks.
        gaps: collections.deque[float] = collections.deque(maxlen=policy.GAPS_KEPT)
        last_start: float | None = None
        while (
            _SIGNALLED is None
            and alive(daemon_pid, daemon_started)
            and time.monotonic() - last_task < policy.idle_limit(gaps, idle_seconds)
        ):
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                now = time.monotonic()
                if served is not None and now - max(last_task, last_check) >= policy.OBSOLETE_CHECK_SECONDS:
                    last_check = now
                    if policy.obsolete(served, now - last_task):
                        if listening.vacate(address, listener) and is_host:
                            return adoption.spare(address, bounded=served.resident_memory is not None)
                        break
                continue
            with connection:
                connection.settimeout(None)
                if not listening.admitted(connection, address):
                    continue
                if wire.first_frame_kind(connection) == wire.ADOPT:
                    adopted = adoption.answer_adoption(
                        connection, served, time.monotonic() - last_task, listener, address
                    )
                    if adopted is not None or not address.exists():
                        return adopted or (None, None)
                    continue
                started = time.monotonic()
                if last_start is not None:
                    gaps.append(started - last_start)
                last_start = started
                listening.mark(address, busy=True)
                served = tasks.serve_task(connection) or served
            if is_host:
                since_full = policy.collect_garbage(since_full)
            last_task = time.monotonic()
            listening.mark(address, busy=False)
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            if os.stat(address).st_ino == inode:  # not the socket of a host started since at this address
                address.unlink()
    return None, None


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
