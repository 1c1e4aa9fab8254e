"""Adoption and spares: an idle host the store no longer needs serves a new instance instead of a new fork.

A new instance's host is otherwise a fork of the worker, and its first task
copies every page it touches from the worker. A worker that needs a host
asks idle hosts of its executor first (``adopt``); each decides for itself
(``answer_adoption``). An obsolete host no worker adopted stays as a spare
holding nothing (``spare``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

from spark_state.hosts import listening, naming, policy, wire
from spark_state.hosts.trust import connect, log_refusal

ADOPT_IDLE_SECONDS = 1.0
"""A worker that needs a new host first asks hosts idle at least this long whether the store still needs them
(``adopt``)."""


ADOPT_CANDIDATES = 8
"""How many idle hosts a worker asks before it forks a new host instead: its own query's first, then the most
recently used (a stopped run's, at a restart)."""


ADOPT_ANSWER_SECONDS = 0.25
"""How long a worker waits for an asked host's answer: one busy with a task is skipped."""


SPARE_HOSTS = 8
"""At most this many obsolete hosts per executor stay, holding no state, for new instances to adopt (``spare``);
each keeps some memory of its own (tens of megabytes)."""


SPARE_HOSTS_BOUNDED = 0
"""Under a memory bound (``spark.state.residentMemory``, or the bound Spark's settings give on a cluster), no spare
stays: each would keep tens of megabytes that no state bound counts, in the memory a container limit does count (a
cluster's executors move instances between them every batch, leaving an obsolete host behind at each move)."""


SPARE = "spare"
"""A spare host's socket is ``spare-<pid>.sock`` in its executor's directory."""


ADOPT_MAX_KEYS = 250_000
"""A host holding more keys than this is neither adopted nor kept as a spare: dropping its state would cost more
than a fork, and leave more memory behind than a new host starts with."""


def adopt(address: Path) -> bool:
    """Whether an idle host of this executor, whose state the store no longer needs, now listens at ``address``.

    A new instance's host is otherwise a fork of this worker, and its first
    task writes to a few thousand pages it shares with the worker, each
    copied on that first write, which costs a restart much of its CPU. An idle host of a stopped run,
    of a deleted store or rescaled away from its instance (``policy.obsolete``), as
    left by a restart at a new parallelism, has all of those pages of its
    own already. The worker asks up to ``ADOPT_CANDIDATES`` hosts: spares
    (``spare``) first, then its own query's hosts, then the others, each
    group the most recently used first (a host dates its socket after each
    task: a stopped run's hosts are the latest idle ones at a restart), each
    but a spare idle at least ``ADOPT_IDLE_SECONDS``, none running a task (a
    host dates its socket ahead while it runs one, ``listening.mark``: asking it would
    cost ``ADOPT_ANSWER_SECONDS``, as in a live rescale, whose other
    instances' hosts are busy with the same batch); each decides for itself
    (``answer_adoption``). Called with ``address``'s lock held and no host at it.
    """
    now, query, candidates = time.time(), naming.query_of(address), []
    for path in address.parent.glob("*.sock"):
        try:
            idle = now - path.stat().st_mtime
        except OSError:  # gone meanwhile
            continue
        if is_spare(path):
            candidates.append((0, idle, path))
        elif path != address and idle >= ADOPT_IDLE_SECONDS:  # not running a task (``listening.mark``), nor just done
            candidates.append((1 if naming.query_of(path) == query else 2, idle, path))
    for *_, path in sorted(candidates)[:ADOPT_CANDIDATES]:
        try:
            connection = connect(path, ADOPT_ANSWER_SECONDS)
        except OSError:  # busy with a task (timed out), or gone
            continue
        if connection is None:
            continue
        with connection:
            try:
                wire.send(connection, wire.ADOPT, address.name.encode())
                if wire.next_kind(connection) != wire.READY:
                    continue
                connection.settimeout(policy.START_SECONDS)
                wire.send(connection, wire.GO)
                if wire.next_kind(connection) == wire.DONE:
                    return True
            except OSError:  # busy (timed out), or gone
                continue
    return False


def spare(address: Path, *, bounded: bool = False) -> tuple[Path | None, socket.socket | None]:
    """An obsolete host at ``address`` (unlinked): a spare's address and socket, or None twice (it leaves).

    It stays as a spare, holding no state, when fewer than ``SPARE_HOSTS``
    spares wait on its executor (``SPARE_HOSTS_BOUNDED`` when its last task ran under a memory bound,
    ``bounded``) and it held at most ``ADOPT_MAX_KEYS`` keys
    (a larger state would leave more memory behind, fragments the
    allocators keep, than a new host starts with): the next new instance
    there adopts it (``adopt``) instead of forking a host whose first task
    copies the pages it touches. Its states and storage clients are dropped
    and the memory they held handed back to the system; it leaves after
    ``policy.IDLE_SECONDS`` unless adopted.
    """
    from spark_state.executor.resident import held_keys

    limit = SPARE_HOSTS_BOUNDED if bounded else SPARE_HOSTS
    if held_keys() > ADOPT_MAX_KEYS or sum(1 for _ in address.parent.glob(f"{SPARE}-*.sock")) >= limit:
        return None, None
    start_afresh()
    spare = address.parent / f"{SPARE}-{os.getpid()}.sock"
    listening.log_to(spare.with_suffix(".log"))
    address.with_suffix(".log").unlink(missing_ok=True)
    return spare, listening.bound(spare)


def start_afresh() -> None:
    """Drop this host's states and storage clients, hand the memory they held back to the system and reset its
    peak resident size (``VmHWM``, which its tasks report), as a newly forked host starts."""
    from spark_state.executor.resident import forget_all
    from spark_state.executor.task import forget_stores

    forget_all(release_memory=True)
    forget_stores()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:  # Linux 4.0+
        refs.write("5")


def is_spare(address: Path) -> bool:
    return address.name.startswith(SPARE + "-")


def answer_adoption(
    connection: socket.socket, served, idle_seconds: float, listener: socket.socket, address: Path
) -> tuple[Path, socket.socket] | None:
    """Answer an ``wire.ADOPT`` frame (``adopt``): the new address and a socket bound to it, when this host now
    serves that instance; None when it stays at ``address`` (or, if that is gone, leaves).

    The host agrees (``wire.READY``) only when it is idle long enough, its last
    task's state is of no more use to the store (``policy.obsolete``) and holds at
    most ``ADOPT_MAX_KEYS`` keys. On the worker's ``wire.GO`` it stops listening at
    its address first; a worker that connected there meanwhile (a task of
    that instance after all) is served, the adoption refused and the host
    leaves, as an obsolete host does. Otherwise it drops its states and
    storage clients, as a new host starts, moves its log beside the new
    address, binds it and answers ``wire.DONE``. A worker that gave up waiting
    leaves the host as it was.
    """
    from spark_state.executor.resident import held_keys

    frame = wire.receive(connection)
    if frame is None:
        return None
    name = frame[1].decode(errors="replace")
    if not naming.SOCKET_NAME.fullmatch(
        name
    ):  # a worker names an instance's socket, never a path: it stays in this directory
        log_refusal(f"it asked this host to serve at {name[:80]!r}, which is not an instance's socket name", connection)
        return None
    new_address = address.parent / name
    agreed = is_spare(address) or (
        served is not None
        and idle_seconds >= ADOPT_IDLE_SECONDS
        and held_keys() <= ADOPT_MAX_KEYS
        and policy.obsolete(served, idle_seconds)
    )
    try:
        wire.send(connection, wire.READY if agreed else wire.REFUSED)
        if not agreed or wire.next_kind(connection) != wire.GO:
            return None
    except OSError:  # the worker gave up waiting
        return None
    if not listening.vacate(address, listener):
        with contextlib.suppress(OSError):
            wire.send(connection, wire.REFUSED)
        return None
    start_afresh()
    if threading.current_thread() is threading.main_thread():  # a host (a test may serve from a thread)
        listening.log_to(new_address.with_suffix(".log"))
        if is_spare(address):
            address.with_suffix(".log").unlink(missing_ok=True)
    new_listener = listening.bound(new_address)
    try:
        wire.send(connection, wire.DONE)
    except OSError:  # the worker is gone: it starts no host of its own while it holds the lock; leave
        new_listener.close()
        new_address.unlink(missing_ok=True)
        return None
    return new_address, new_listener
