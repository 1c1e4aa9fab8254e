"""Killing a driver process tree at a precise moment, for crash tests and the fault campaign (Linux only).

``kill_when_created(process, directory, pattern)`` watches ``directory`` with
inotify and, the instant a file whose name matches ``pattern`` appears,
freezes the process's whole group (SIGSTOP, so the JVM cannot finish the
write it began) and then kills it (SIGKILL). The process must have been
started with ``start_new_session=True`` so that its group holds the JVM and
its Python workers and nothing else.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import struct
import subprocess
import time

IN_CREATE = 0x00000100
IN_MOVED_TO = 0x00000080
_EVENT = struct.Struct("iIII")
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group of ``process`` (a session leader) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def kill_when_created(process: subprocess.Popen, directory: str, pattern: str, timeout: float) -> str | None:
    """Freeze then kill ``process``'s group when a name matching ``pattern`` is created in ``directory``.

    ``directory`` must exist. Returns the name that triggered the kill, or
    None when ``timeout`` seconds passed or the process exited first (the
    group is killed either way).
    """
    deadline = time.monotonic() + timeout
    name = wait_for_created(directory, pattern, lambda: time.monotonic() >= deadline or process.poll() is not None)
    if name is not None:
        os.killpg(process.pid, signal.SIGSTOP)
    kill_group(process)
    return name


def _names(data: bytes):
    offset = 0
    while offset < len(data):
        _, _, _, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        yield data[offset : offset + length].rstrip(b"\0").decode()
        offset += length


def wait_for_created(directory: str, pattern: str, stop) -> str | None:
    """Block until a name matching ``pattern`` is created in ``directory`` (which must exist); return it.

    Returns None once ``stop()`` is true (checked every 0.2 s). The caller
    decides what to kill, and how, the instant it returns.
    """
    wanted = re.compile(pattern)
    fd = _LIBC.inotify_init1(os.O_NONBLOCK)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1 failed")
    try:
        if _LIBC.inotify_add_watch(fd, os.fsencode(directory), IN_CREATE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch({directory}) failed")
        while not stop():
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                for name in _names(os.read(fd, 65536)):
                    if wanted.fullmatch(name):
                        return name
        return None
    finally:
        os.close(fd)
