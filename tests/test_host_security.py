"""What an instance host trusts (``spark_state.hosts.trust``): its private directory, its peer, its key.

Each test plays a hostile local user: a second user of the machine (made with ``useradd`` when the tests run as
root, skipped with the reason otherwise), a process that does not hold the executor's key, or a peer that names a
path. Every attack here worked against the hosts before they checked anything (a pickled task or answer ran code
in the other end); each assertion checks what the attacker would have got.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from spark_state.hosts import naming, process, serving, trust, wire, worker
from spark_state.hosts import trust as host_trust
from spark_state.hosts.trust import HostAuthenticationError, UnsafeHostDirectoryError

ATTACKER = "ssattacker"
"""The second local user the tests create (as root) to attack the hosts of this one."""


class _SideEffect:
    """Unpickled, it creates ``marker``: proof that a process unpickled what an attacker sent."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture
def base(monkeypatch, tmp_path):
    """A fresh temporary directory like ``/tmp`` (1777, so a second user can write into it) as the hosts' base,
    with no Spark local directory, under umask 000 (the worst a user may run with)."""
    directory = Path(tempfile.mkdtemp(prefix="ss-sec-", dir="/tmp"))
    os.chmod(directory, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    monkeypatch.delenv(host_trust.SPARK_SECRET, raising=False)
    host_trust.forget_directories()
    old = os.umask(0)
    try:
        yield directory
    finally:
        os.umask(old)
        host_trust.forget_directories()
        shutil.rmtree(directory, ignore_errors=True)


def _attacker_python() -> str:
    """A Python the second user can run (the tests' own may live below a home only its owner enters)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(candidate).st_mode & stat.S_IXOTH:
            return candidate
    pytest.skip("no Python that another user may run (/usr/bin/python3)")


@pytest.fixture(scope="module")
def attacker():
    """The second local user's name, created for this module and removed after it."""
    if os.geteuid() != 0:
        pytest.skip(
            "a second local user can be created only as root (useradd); run the tests as root to check "
            "that another user cannot reach the hosts"
        )
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no second local user can be made")
    created = False
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER], check=True)
        created = True
    try:
        yield ATTACKER
    finally:
        if created:
            subprocess.run(["userdel", ATTACKER], check=False)


def _as_attacker(attacker: str, script: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_attacker_python(), "-c", textwrap.dedent(script)],
        user=attacker,
        group=attacker,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )


@contextlib.contextmanager
def _forked_host(store: Path):
    """A real host, forked by ``worker._connect`` as a worker forks it, at its address of instance 0 of component
    ``c`` in ``store``; killed and reaped after the test."""
    import gc

    address = naming.host_address(os.getpid(), str(store), "c", 0)
    try:
        with worker._connect(address, os.getpid(), str(store)):
            pass
        (host,) = process._STARTED
        yield address, host
    finally:
        for pid in process._STARTED:
            os.kill(pid, signal.SIGKILL)
        process.reap_hosts()
        gc.unfreeze()  # the fork froze this process's objects, as it freezes a worker's
        process._WORKER_FROZEN = False


# The private directory ------------------------------------------------------------------------


def test_the_hosts_directory_is_made_private_whatever_the_umask_and_so_are_their_files(base, tmp_path):
    with _forked_host(tmp_path / "state") as (address, host):
        directory = address.parent
        assert directory == base / f"spark-state-{os.getuid()}" / host_trust.executor_name(os.getpid())
        for level in (directory, directory.parent):
            info = os.lstat(level)
            assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700, oct(info.st_mode)
        modes = {path.name: stat.S_IMODE(os.lstat(path).st_mode) for path in directory.iterdir()}
        assert modes == {
            address.name: 0o600,
            address.with_suffix(".lock").name: 0o600,
            address.with_suffix(".log").name: 0o600,
            host_trust.KEY_FILE: 0o600,
        }, modes


@pytest.mark.parametrize("why", ["open to all", "a link", "a file"])
def test_a_pre_made_hosts_directory_that_is_not_private_is_refused_and_left_as_it_is(base, why):
    level = base / f"spark-state-{os.getuid()}"
    if why == "open to all":
        level.mkdir()
        os.chmod(level, 0o777)
    elif why == "a link":
        (base / "elsewhere").mkdir(mode=0o700)
        level.symlink_to(base / "elsewhere")
    else:
        level.write_text("")
    before = os.lstat(level)
    with pytest.raises(UnsafeHostDirectoryError, match=str(level)):
        naming.host_address(os.getpid(), "/store", "c", 0)
    after = os.lstat(level)
    assert (after.st_mode, after.st_uid, after.st_ino) == (before.st_mode, before.st_uid, before.st_ino)
    assert not (base / "elsewhere" / str(os.getpid())).exists()


def test_one_an_earlier_version_left_readable_is_closed_and_used(base):
    level = base / f"spark-state-{os.getuid()}"
    level.mkdir()
    os.chmod(level, 0o755)  # nobody else could put anything in it
    address = naming.host_address(os.getpid(), "/store", "c", 0)
    assert address.parent.parent == level and stat.S_IMODE(os.lstat(level).st_mode) == 0o700


def test_a_base_others_may_write_to_without_the_sticky_bit_is_refused(base):
    os.chmod(base, 0o777)  # anyone could rename the hosts' directory away and put their own in its place
    with pytest.raises(UnsafeHostDirectoryError, match="sticky"):
        naming.host_address(os.getpid(), "/store", "c", 0)


def test_spark_s_local_directory_holds_the_hosts_when_their_paths_fit_there(base, monkeypatch, tmp_path):
    local = base / "blockmgr-0f1e2d3c"  # as in local mode: /tmp/blockmgr-<uuid>
    local.mkdir(mode=0o755)
    monkeypatch.setenv("SPARK_LOCAL_DIRS", f"{local},/elsewhere")
    assert naming.host_address(
        4242, "/store", "c", 3
    ).parent == local / f"spark-state-{os.getuid()}" / host_trust.executor_name(4242)
    host_trust.forget_directories()
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(deep))  # its socket paths would not fit AF_UNIX: the base instead
    address = naming.host_address(4243, "/store", "c", 3)
    assert address.parent == base / f"spark-state-{os.getuid()}" / host_trust.executor_name(4243)
    assert len(os.fsencode(address)) <= host_trust.MAX_SOCKET_PATH


def test_a_daemon_given_a_dead_one_s_pid_never_meets_the_dead_one_s_hosts(base):
    """Pids wrap (at 32768 on this machine): an executor's directory names its daemon's start too, so a later
    daemon with the same pid gets a directory of its own, and the dead one's is removed as dead."""
    name = host_trust.executor_name(os.getpid())
    pid, _, started = name.partition("-")
    assert pid == str(os.getpid()) and started, name  # Linux tells when a process started
    before = format(int(started, 16) - 1, "x")
    earlier = f"{pid}-{before}"  # the same pid, given to a process that started before this one
    assert host_trust.executor_alive(name) and not host_trust.executor_alive(earlier)
    assert serving.alive(os.getpid(), started) and not serving.alive(os.getpid(), before)
    address = naming.host_address(os.getpid(), "/store", "c", 0)
    root = address.parent.parent
    (root / earlier).mkdir(mode=0o700)
    process.remove_dead_executors(root)
    assert not (root / earlier).exists() and address.parent.is_dir()


def test_a_temporary_directory_too_long_for_a_socket_path_is_a_typed_error(base, monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(UnsafeHostDirectoryError, match="AF_UNIX"):
        naming.host_address(os.getpid(), "/store", "c", 0)


# Another user of the machine ------------------------------------------------------------------


def test_another_user_cannot_connect_to_a_running_host(base, tmp_path, attacker):
    marker = base / "ran-in-the-host"
    with _forked_host(tmp_path / "state") as (address, host):
        attack = _as_attacker(
            attacker,
            f"""
            import socket, struct, sys
            task = {pickle.dumps(_SideEffect(marker))!r}
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect({str(address)!r})
            except OSError as error:
                print("refused", type(error).__name__); sys.exit(0)
            s.sendall(struct.pack("!cQ", b"T", len(task)) + task)
            print("connected")
        """,
        )
        assert attack.returncode == 0, attack.stderr
        assert attack.stdout.split() == ["refused", "PermissionError"], attack.stdout
        time.sleep(0.2)
        assert not marker.exists()
        assert process.host_running(host)


def test_another_user_s_directory_and_socket_planted_before_the_query_starts_are_never_used(base, attacker):
    """The attack that ran code in a worker: the other user makes the hosts' directory first and binds a socket
    where the worker would look for its host; the worker refuses the directory and sends nothing there."""
    address = (
        base / f"spark-state-{os.getuid()}" / host_trust.executor_name(os.getpid()) / naming.host_name("/store", "c", 0)
    )
    got = base / "what-the-attacker-got"
    attack = subprocess.Popen(
        [
            _attacker_python(),
            "-c",
            textwrap.dedent(f"""
        import os, socket, pathlib
        os.umask(0)
        os.makedirs({str(address.parent)!r}, mode=0o777)
        os.chmod({str(address.parent.parent)!r}, 0o777); os.chmod({str(address.parent)!r}, 0o777)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind({str(address)!r}); os.chmod({str(address)!r}, 0o777); s.listen(1)
        print("ready", flush=True)
        s.settimeout(5)
        try:
            c, _ = s.accept()
            pathlib.Path({str(got)!r}).write_bytes(c.recv(1 << 16) or b"(connected)")
        except socket.timeout:
            pass
    """),
        ],
        user=attacker,
        group=attacker,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert attack.stdout.readline().strip() == "ready"
        with pytest.raises(UnsafeHostDirectoryError, match=f"owned by uid {pwd.getpwnam(attacker).pw_uid}"):
            worker._connect(naming.host_address(os.getpid(), "/store", "c", 0), os.getpid(), "/store")
    finally:
        attack.wait(timeout=15)
    assert not got.exists(), got.read_bytes()


# The key ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _threaded_host(directory: Path):
    """The real serving loop (the real ``_serve_task``, which unpickles its task) at ``directory/q-0.sock`` in a
    thread; yields its address. Ends once the test's connections are done and it idles out."""
    address = directory / "q-0.sock"
    in_loop = threading.Event()  # set once it checks its daemon: it listens from then on
    checked = serving.alive

    def alive(pid, started=None):
        in_loop.set()
        return checked(pid, started)

    serving.alive = alive
    server = threading.Thread(
        target=serving.serve, args=(address, os.getpid()), kwargs={"idle_seconds": 1.0}, daemon=True
    )
    server.start()
    try:
        assert in_loop.wait(5), "the host did not start serving"
        yield address
    finally:
        server.join(timeout=10)
        serving.alive = checked


@pytest.mark.parametrize("attempt", ["no handshake", "a wrong key", "a replayed proof"])
def test_a_peer_without_the_executor_s_key_is_refused_before_anything_it_sends_is_unpickled(
    monkeypatch, capfd, attempt
):
    monkeypatch.setattr(serving, "ACCEPT_SECONDS", 0.05)
    directory = Path(tempfile.mkdtemp(prefix="ss-sec-", dir="/tmp"))
    marker = directory / "ran-in-the-host"
    payload = pickle.dumps((_SideEffect(marker), 0, None))
    try:
        with _threaded_host(directory) as address, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.connect(str(address))
            if attempt == "a wrong key":
                with pytest.raises(HostAuthenticationError, match="does not hold this executor's host key"):
                    host_trust.prove_to_host(peer, os.urandom(32))
                wire.send(peer, host_trust.PROOF, os.urandom(32))  # and a proof of its own, made up
            elif attempt == "a replayed proof":
                wire.send(peer, host_trust.HELLO, b"\0" * 32)
                host_trust._receive(peer)
                key = host_trust.host_key(directory)  # a proof made for other nonces is worth nothing
                wire.send(peer, host_trust.PROOF, host_trust._mac(key, b"worker", b"\1" * 32, b"\0" * 32))
            with contextlib.suppress(OSError):  # the host may have closed the connection already
                wire.send(peer, wire.TASK, payload)
            peer.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert peer.recv(1) == b""  # closed, nothing answered
        assert not marker.exists()
        assert "refused a connection from pid" in capfd.readouterr().err
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("answer", ["a pickled error", "a made-up proof"])
def test_a_worker_sends_nothing_to_and_unpickles_nothing_from_a_process_that_is_not_its_host(tmp_path, answer):
    directory = Path(tempfile.mkdtemp(prefix="ss-sec-", dir="/tmp"))
    marker, received = directory / "ran-in-the-worker", []
    address = directory / "q-0.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(address))
    listener.listen(1)

    def impostor():
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(5)
            received.append(wire.receive(connection))  # the worker's first frame: HELLO and its nonce
            if answer == "a pickled error":
                wire.send(connection, wire.ERROR, pickle.dumps(_SideEffect(marker)))
            else:
                wire.send(connection, host_trust.PROOF, os.urandom(64))
            rest = b""
            with contextlib.suppress(OSError):
                while chunk := connection.recv(1 << 16):  # until the worker closes the connection
                    rest += chunk
            received.append(rest)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(HostAuthenticationError):
            trust.connect(address)
        thread.join(timeout=10)
        assert not marker.exists()
        assert len(received) == 2 and received[0][0] == host_trust.HELLO and received[1] == b"", received  # no task
    finally:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_an_adopting_worker_names_a_socket_never_a_path_elsewhere(monkeypatch, capfd):
    from tests.test_hosts import _run_task
    from tests.test_hosts import _threaded_host as _adoptable_host

    outside = Path(tempfile.mkdtemp(prefix="ss-sec-outside-", dir="/tmp"))
    try:
        with _adoptable_host(monkeypatch, obsolete=True) as host:
            for name in (str(outside / "evil.sock"), "../evil.sock", "evil"):
                with contextlib.closing(trust.connect(host.address)) as connection:
                    wire.send(connection, wire.ADOPT, name.encode())
                    assert wire.receive(connection) is None  # refused: closed
            _run_task(host.address)  # it still serves its own instance
            assert not list(outside.iterdir()) and not (host.directory.parent / "evil.sock").exists()
            assert host.results == []
        assert "not an instance's socket name" in capfd.readouterr().err
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_the_key_comes_from_spark_s_secret_when_the_daemon_has_one(monkeypatch, tmp_path):
    host_trust.forget_directories()
    monkeypatch.setenv(host_trust.SPARK_SECRET, "the daemon's secret")
    first = host_trust.host_key(tmp_path)
    host_trust.forget_directories()
    monkeypatch.setenv(host_trust.SPARK_SECRET, "another executor's secret")
    assert host_trust.host_key(tmp_path) != first and not (tmp_path / host_trust.KEY_FILE).exists()
    host_trust.forget_directories()
    monkeypatch.delenv(host_trust.SPARK_SECRET)
    key = host_trust.host_key(tmp_path)
    assert len(key) == 32 and (tmp_path / host_trust.KEY_FILE).read_bytes() == key
    assert stat.S_IMODE(os.lstat(tmp_path / host_trust.KEY_FILE).st_mode) == 0o600
    host_trust.forget_directories()
