"""What an instance host trusts, and how both ends of its socket prove it (no pyspark).

A host unpickles the tasks it is sent and runs them, and a worker re-raises
the errors a host sends back: whoever can talk to either end runs code as
the query's user. So nothing may reach either end but processes of the same
executor. Three checks, each enough to keep another user of the machine out:

1. **Place.** An executor's sockets, locks, logs and key live in a private
   directory, ``<base>/spark-state-<uid>/<daemon>/``, ``<daemon>`` naming
   the executor's Python daemon by its pid and, where the system tells
   (Linux), when it started (``executor_name``): pids wrap (at 32768 by
   default on many kernels), and a daemon given a dead one's pid must not
   meet the dead one's hosts, whose key is not its own. ``base`` is
   Spark's local directory of the executor (the first of
   ``SPARK_LOCAL_DIRS``, which Spark removes with the executor) when the
   longest socket path there fits ``AF_UNIX`` (``MAX_SOCKET_PATH``), else
   the system's temporary directory. Each level below ``base`` is created
   0700 whatever the umask and, before anything in it is used, checked: a
   directory, not a link, owned by this user, writable by nobody else
   (then closed to them: 0700). ``base``
   itself must be owned by this user or root and, if others may write to
   it, sticky (as ``/tmp`` is), so that nobody can rename our directory
   away. A level that fails is refused with ``UnsafeHostDirectoryError``,
   which names it: never reused, never chmod-ed.
2. **Peer.** On Linux each end asks the kernel who is at the other end
   (``SO_PEERCRED``) and refuses a process of another user.
3. **Key.** Each end proves that it holds the executor's host key before
   the other unpickles anything (HMAC-SHA256 over fresh nonces, compared
   with ``hmac.compare_digest``). The key is derived from the secret Spark
   gives its Python daemon (``PYTHON_WORKER_FACTORY_SECRET``, in the
   environment of the executor's Python processes, which only their user
   can read), or, where Spark gives none (its Unix-domain-socket mode), is
   32 random bytes in the private directory's ``host.key`` (0600).

The handshake, one round trip before the task (frames as in ``hosts``)::

    worker -> host   HELLO   nonce_w (32 bytes)
    host -> worker   PROOF   nonce_h + HMAC(key, "host" | nonce_w | nonce_h)
    worker -> host   PROOF   HMAC(key, "worker" | nonce_h | nonce_w)

The worker checks the host's proof before it sends its task; the host checks
the worker's before it reads the next frame. A host answers a peer that
fails with nothing: it closes the connection and writes a line to its log.
A worker that finds a host it cannot trust raises
``HostAuthenticationError``. Both nonces are fresh per connection, so no
recorded proof is worth anything later, and the two proofs are tagged
differently, so a host's proof is never a worker's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path

from spark_state.errors import SparkStateError
from spark_state.hosts import wire

MAX_SOCKET_PATH = 107
"""The longest socket path ``AF_UNIX`` binds on Linux (``sun_path`` holds 108 bytes with its terminating NUL)."""
LONGEST_SOCKET_NAME = 32
"""Room kept for a socket's name in its directory (``hosts.host_address``: a 16-digit digest, '-', an instance
index of up to 5 digits, ``.sock``; a spare's ``spare-<pid>.sock``)."""
KEY_FILE = "host.key"
KEY_BYTES = 32
NONCE_BYTES = 32
HANDSHAKE_SECONDS = 10.0
"""How long a host waits for a connected peer to prove itself before it closes the connection."""
SPARK_SECRET = "PYTHON_WORKER_FACTORY_SECRET"
"""The environment variable in which Spark hands its Python daemon (and so every worker) its secret."""

HELLO, PROOF = b"H", b"P"


class UnsafeHostDirectoryError(SparkStateError):
    """A directory the instance hosts would keep their sockets in is not private to this user; nothing was put
    in it. The message names the directory, what is wrong and what to do."""


class HostAuthenticationError(SparkStateError):
    """The process at an instance host's socket did not prove that it is a host of this executor; the task was
    not sent to it."""


# The private directory ------------------------------------------------------------------------


def socket_directory(daemon_pid: int) -> Path:
    """The private directory of the hosts of the executor whose Python daemon is ``daemon_pid``; made and checked
    once per process (see the module docstring), ``UnsafeHostDirectoryError`` if it cannot be private."""
    directory = _DIRECTORIES.get(daemon_pid)
    if directory is None or directory[0] != os.getpid():
        path = _private_levels(_base(), (f"spark-state-{os.getuid()}", executor_name(daemon_pid)))
        directory = _DIRECTORIES[daemon_pid] = (os.getpid(), path)
    return directory[1]


def executor_name(daemon_pid: int) -> str:
    """The name of the private directory of the executor whose Python daemon is ``daemon_pid``: ``<pid>-<start>``,
    ``<start>`` when the process started (``process_started``), or ``<pid>`` where the system does not tell."""
    started = process_started(daemon_pid)
    return str(daemon_pid) if started is None else f"{daemon_pid}-{started}"


def executor_alive(name: str) -> bool:
    """Whether the Python daemon that directory ``name`` (``executor_name``) is of still runs: its pid is alive
    and, where the name says when it started, is still that process (not a later one given the same pid)."""
    pid, _, started = name.partition("-")
    return pid.isdigit() and process_alive(int(pid), started or None)


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether a process ``pid`` exists (a zombie counts) and, given ``started`` (``process_started``), is still
    the process that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or process_started(pid) == started


def process_started(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``) in hexadecimal
    (short: it is part of socket paths), or None where there is no ``/proc`` or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()  # the command, field 2, may hold spaces and ')'
    except (OSError, IndexError):
        return None
    return format(int(fields[19]), "x") if len(fields) > 19 else None  # fields[0] is field 3


_DIRECTORIES: dict[int, tuple[int, Path]] = {}
"""daemon pid -> (the process that checked it, its private directory): a fork checks again."""


def forget_directories() -> None:
    """Check every directory again at its next use (after a test removed one)."""
    _DIRECTORIES.clear()
    _KEYS.clear()


def _base() -> Path:
    """Spark's local directory of this executor when the hosts' socket paths fit there, else the temporary one."""
    # the uid; a daemon's pid (at most 2**22) and start (10 hexadecimal digits last 30 years at 1,000 ticks a second)
    room = len("/spark-state-/") + len(str(os.getuid())) + 7 + 1 + 10 + 1 + LONGEST_SOCKET_NAME
    local = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0].strip()
    if local and os.path.isabs(local) and os.path.isdir(local) and len(os.fsencode(local)) + room <= MAX_SOCKET_PATH:
        return Path(local)
    temporary = tempfile.gettempdir()
    if len(os.fsencode(temporary)) + room > MAX_SOCKET_PATH:
        raise UnsafeHostDirectoryError(
            f"the instance hosts' socket paths would be longer than AF_UNIX allows ({MAX_SOCKET_PATH} bytes) under "
            f"Spark's local directory {local or '(none)'} and under the temporary directory {temporary}; set TMPDIR "
            "(spark.executorEnv.TMPDIR) to a short private path, or spark.state.instanceHosts=false"
        )
    return Path(temporary)


def _private_levels(base: Path, levels: tuple[str, ...]) -> Path:
    """``base / levels...``, each level made 0700 or checked to be private, ``base`` checked to be safe to hold it."""
    _check_base(base)
    path = base
    for level in levels:
        path = path / level
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        else:
            os.chmod(path, 0o700, follow_symlinks=False)  # the umask may have taken the owner's bits too
        _check_private(path)
    return path


def _check_base(base: Path) -> None:
    info = os.stat(base)  # a link here is the administrator's (/tmp on some systems): followed
    others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if info.st_uid not in (0, os.getuid()) or (others_write and not info.st_mode & stat.S_ISVTX):
        raise UnsafeHostDirectoryError(
            f"{base} may hold the instance hosts' private directory only if it is owned by this user or root and, "
            f"when others may write to it, sticky; it is owned by uid {info.st_uid} with mode "
            f"{stat.filemode(info.st_mode)}. Set TMPDIR (spark.executorEnv.TMPDIR) or SPARK_LOCAL_DIRS to a "
            "directory of your own"
        )


def _check_private(path: Path) -> None:
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by other users (mode {stat.filemode(info.st_mode)})"
    elif info.st_mode & 0o077:  # ours, and nobody else could put anything in it (one an earlier version made)
        os.chmod(path, 0o700, follow_symlinks=False)
    if problem is not None:
        raise UnsafeHostDirectoryError(
            f"the instance hosts' directory {path} {problem}: someone else may have made it to read or run what "
            "the hosts receive, so spark-state will not use it. Remove it (or have its owner remove it) and run "
            "again, or set TMPDIR (spark.executorEnv.TMPDIR) to a directory of your own"
        )


def private_file(path: Path, flags: int = os.O_RDWR) -> int:
    """A descriptor of the file ``path`` in a private directory, created 0600 if missing, never through a link."""
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


# The key --------------------------------------------------------------------------------------


def host_key(directory: Path) -> bytes:
    """The key of the executor whose hosts live in ``directory`` (see the module docstring)."""
    key = _KEYS.get(directory)
    if key is None:
        secret = os.environ.get(SPARK_SECRET)
        if secret:
            key = hmac.new(secret.encode(), b"spark-state instance hosts", hashlib.sha256).digest()
        else:
            key = _key_file(directory)
        _KEYS[directory] = key
    return key


_KEYS: dict[Path, bytes] = {}


def _key_file(directory: Path) -> bytes:
    """The 32 bytes of ``directory/host.key``, which the first process to ask writes (whole: a link of a full temp
    file, so a racing reader never sees it part-written)."""
    path = directory / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    temporary = directory / f".{KEY_FILE}-{os.getpid()}-{os.urandom(6).hex()}"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(descriptor, os.urandom(KEY_BYTES))
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass  # another process wrote it first: its key is the executor's
    finally:
        os.unlink(temporary)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(descriptor)
        key = os.read(descriptor, KEY_BYTES + 1)
    finally:
        os.close(descriptor)
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or len(key) != KEY_BYTES:
        raise UnsafeHostDirectoryError(
            f"the instance hosts' key {path} is not a private {KEY_BYTES}-byte file of this user (uid "
            f"{info.st_uid}, mode {stat.filemode(info.st_mode)}, {len(key)} bytes); remove it and run again"
        )
    return key


# The handshake --------------------------------------------------------------------------------


def prove_to_host(connection: socket.socket, key: bytes) -> None:
    """Worker side: check that the host at ``connection`` holds ``key`` and prove that this worker does too;
    ``HostAuthenticationError`` (the connection left as it is, for the caller to close) if the host does not."""
    _check_peer(connection, "the process at the instance host's socket")
    nonce_w = os.urandom(NONCE_BYTES)
    wire.send(connection, HELLO, nonce_w)
    answer = _receive(connection)
    if answer is None or answer[0] != PROOF or len(answer[1]) != NONCE_BYTES + 32:
        raise HostAuthenticationError(
            "the process at the instance host's socket did not answer the handshake (it is not a host of this "
            "version of spark-state, or it left); the task was not sent to it"
        )
    nonce_h, proof = answer[1][:NONCE_BYTES], answer[1][NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"host", nonce_w, nonce_h)):
        raise HostAuthenticationError(
            "the process at the instance host's socket does not hold this executor's host key: it is not one of "
            "this executor's hosts; the task was not sent to it"
        )
    wire.send(connection, PROOF, _mac(key, b"worker", nonce_h, nonce_w))


def connect(address: Path, timeout: float | None = None) -> socket.socket | None:
    """An authenticated connection to the host at ``address`` (``prove_to_host``), None when no host
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


def admit(connection: socket.socket, key: bytes) -> str | None:
    """Host side: None once the peer at ``connection`` proved it holds ``key`` (and this host proved it too), else
    why it was refused, for the host's log. Nothing the peer sent is unpickled here."""
    try:
        _check_peer(connection, "the connecting process")
        connection.settimeout(HANDSHAKE_SECONDS)
        hello = _receive(connection)
        if hello is None or hello[0] != HELLO or len(hello[1]) != NONCE_BYTES:
            return "it did not start the handshake"
        nonce_w, nonce_h = hello[1], os.urandom(NONCE_BYTES)
        wire.send(connection, PROOF, nonce_h + _mac(key, b"host", nonce_w, nonce_h))
        proof = _receive(connection)
        if (
            proof is None
            or proof[0] != PROOF
            or not hmac.compare_digest(proof[1], _mac(key, b"worker", nonce_h, nonce_w))
        ):
            return "it does not hold this executor's host key"
        connection.settimeout(None)
        return None
    except HostAuthenticationError as error:
        return str(error)
    except OSError as error:
        return f"the handshake failed: {error}"


def _mac(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + b"\0" + first + second, hashlib.sha256).digest()


def peer_credentials(connection: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket; None where the system does not say (not Linux)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", credentials)
    return pid, uid


def _check_peer(connection: socket.socket, who: str) -> None:
    credentials = peer_credentials(connection)
    if credentials is not None and credentials[1] != os.getuid():
        raise HostAuthenticationError(
            f"{who} (pid {credentials[0]}) runs as uid {credentials[1]}, not as this user (uid {os.getuid()})"
        )


def _receive(connection: socket.socket) -> tuple[bytes, bytes] | None:
    """A handshake frame (at most 1 KiB: a peer cannot make an end allocate more); None when it closed or lied."""
    try:
        return wire.receive(connection, max_size=1024)
    except (ConnectionResetError, BrokenPipeError):
        return None


def log_refusal(reason: str, connection: socket.socket) -> None:
    """Write to this host's log (its standard error) that it refused a peer, and why."""
    try:
        credentials = peer_credentials(connection)
    except OSError:
        credentials = None
    who = "a process" if credentials is None else f"pid {credentials[0]} (uid {credentials[1]})"
    print(
        f"spark-state: instance host {os.getpid()} refused a connection from {who}: {reason}; nothing it sent "
        "was read as a task",
        file=sys.stderr,
        flush=True,
    )
