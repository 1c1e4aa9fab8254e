"""A Spark Connect server on loopback for the Connect tests, and the client processes that talk to it.

``ConnectServer`` starts Spark's own ``SparkConnectServer`` from the pip
package (``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``,
which ``exec``s java, so the child's pid is its JVM's) with the test
session's settings: ``local[2]``, 2 shuffle partitions, UI and AQE off,
Python workers on Unix sockets. ``kill`` SIGKILLs it and every process it
started (Python workers, instance hosts, the ``foreachBatch`` process): a
crash of the query's driver. ``start`` again is a new server on the same port.

A Connect client switches its whole Python process to Connect mode
(``SPARK_CONNECT_MODE_ENABLED``), which would break the classic session of
the other tests, so each client is a process of its own: ``run_client``
runs ``tests/connect_client.py`` and returns the JSON it printed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.cluster import LOOPBACK, _descendants, _kill_if_same, free_port, spark_home
from tests.jvm import JVM_OPTIONS

REPO = Path(__file__).resolve().parent.parent
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
SETTINGS = {
    "spark.sql.shuffle.partitions": "2",
    "spark.ui.enabled": "false",
    "spark.sql.adaptive.enabled": "false",
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.driver.memory": "2g",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


class ConnectServer:
    """A ``local[2]`` Spark Connect server on ``127.0.0.1:port``, its logs and scratch below ``root``."""

    def __init__(self, root: Path, port: int | None = None, *, settings: dict | None = None, paths: tuple = ()):
        self.root = Path(root)
        self.port = port or free_port()
        self.url = f"sc://{LOOPBACK}:{self.port}"
        self.settings = {**SETTINGS, **(settings or {})}
        self.paths = (str(REPO), *map(str, paths))  # the Python path of the server's Python processes
        self._proc: subprocess.Popen | None = None
        self.starts = 0

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(self.root / "conf"),  # empty: no site settings leak in
            SPARK_LOCAL_IP=LOOPBACK,
            SPARK_LOCAL_DIRS=str(self.root / "local"),
            PYSPARK_PYTHON=sys.executable,
            PYTHONPATH=os.pathsep.join([*self.paths, *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        return env

    def start(self, timeout: float = 120.0) -> ConnectServer:
        (self.root / "conf").mkdir(parents=True, exist_ok=True)
        self.starts += 1
        settings = {
            **self.settings,
            "spark.connect.grpc.binding.address": LOOPBACK,
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.driver.host": LOOPBACK,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.driver.extraJavaOptions": JVM_OPTIONS,
        }
        command = [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--master", "local[2]"]
        for key, value in settings.items():
            command += ["--conf", f"{key}={value}"]
        log = open(self.root / f"server-{self.starts}.log", "wb")
        self._proc = subprocess.Popen(
            [*command, "spark-internal"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            cwd=self.root,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the Connect server exited ({self._proc.returncode}):\n{self.log_tail()}")
            try:
                with socket.create_connection((LOOPBACK, self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"the Connect server did not listen within {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        text = (self.root / f"server-{self.starts}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def kill(self) -> None:
        """SIGKILL the server's JVM and everything it started (a crash of the query's driver)."""
        if self._proc is None:
            return
        leftovers = _descendants(self._proc.pid)
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
        for pid, started in leftovers:
            _kill_if_same(pid, started)
        self._proc = None

    def stop(self) -> None:
        self.kill()


PYSPARK_CLIENT = "4.2.0"
"""The pure-Python Connect client tested (``pyspark-client``: no JVM, no py4j; its newest release)."""
CLIENT_DIR = REPO / "work-dirs" / f"pyspark-client-{PYSPARK_CLIENT}"


def pyspark_client_python() -> Path:
    """The Python of a virtualenv with ``pyspark-client``, made once under ``work-dirs/`` and reused.

    ``pyspark-client`` is the same ``pyspark`` package as ``pyspark`` (less the JVM's parts), so it cannot be
    installed beside it. Its virtualenv takes every other package from this one (a directory of links to this
    environment's packages, all but ``pyspark`` and ``py4j``, named by a ``.pth`` file), so that only
    ``pyspark-client`` itself is downloaded.
    """
    import sysconfig

    python = CLIENT_DIR / "bin" / "python"
    stamp = CLIENT_DIR / ".installed"
    if stamp.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(CLIENT_DIR)], check=True)
    shared = CLIENT_DIR / "shared-site"
    shared.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if not entry.name.lower().startswith(("pyspark", "py4j", "_distutils_hack", "distutils-precedence")):
            (shared / entry.name).symlink_to(entry)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "spark-state-shared.pth").write_text(f"{shared}\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            f"pyspark-client=={PYSPARK_CLIENT}",
        ],
        check=True,
        timeout=600,
    )
    stamp.touch()
    return python


def run_client(
    server: ConnectServer, scenario: str, timeout: float = 240.0, python: Path | None = None, **arguments
) -> dict:
    """Run ``scenario`` of ``tests/connect_client.py`` against ``server`` in a process of its own (``python``'s,
    by default this one's); its JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    done = subprocess.run(
        [str(python or sys.executable), "-m", "tests.connect_client", server.url, scenario, json.dumps(arguments)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise AssertionError(
            f"the Connect client of {scenario!r} exited {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}"
            f"\n--- stderr ---\n{done.stderr[-6000:]}\n--- server ---\n{server.log_tail()}"
        )
    return json.loads(lines[-1])
