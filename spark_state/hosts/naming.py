"""Where a host listens: the socket of (executor, store, component, instance) in the executor's private directory."""

from __future__ import annotations

import hashlib
import re
import socket
from pathlib import Path

from spark_state.hosts.trust import socket_directory


def host_address(daemon_pid: int, store: str, component: str, instance: int) -> Path:
    """The socket of the host of ``instance`` of ``component`` in ``store``, for the executor of ``daemon_pid``,
    in the executor's private directory (``host_trust.socket_directory``)."""
    return socket_directory(daemon_pid) / host_name(store, component, instance)


def host_name(store: str, component: str, instance: int) -> str:
    """The name of the socket of the host of ``instance`` of ``component`` in ``store``."""
    digest = hashlib.sha1(f"{store}\0{component}".encode()).hexdigest()[:16]
    return f"{digest}-{instance}.sock"


SOCKET_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,80}\.sock")
"""A socket's name in its directory (``host_name``'s, a spare's): what an adopted host may bind (``adoption.answer_adoption``), never
a path elsewhere."""


def query_of(address: Path) -> str:
    """The digest of the store and component a host's address names: the same for all hosts of a query."""
    return address.name.rsplit("-", 1)[0]


def listener_address(listener: socket.socket) -> Path:
    """The path ``listener`` is bound to."""
    return Path(listener.getsockname())
