"""A Spark standalone cluster on loopback for the integration test, and a driver process that uses it.

``StandaloneCluster`` starts one master and ``workers`` workers from the pip
package (``$SPARK_HOME/bin/spark-class``, which ``exec``s java, so each
child's pid is its JVM's). Everything binds to 127.0.0.1 on free ports and
writes logs and work directories below one directory. Each worker offers
one core, so an application gets one single-core executor per worker: two
executors are two JVMs, each with its own Python workers. ``stop`` ends the
JVMs it started by pid (TERM, then KILL after a grace period), then any
process they left behind (executors, Python workers).

Only one SparkContext may live in a process and the test session may already
have a ``local[2]`` one, so the driver is a subprocess (``Driver``): each
``Driver.run`` is one application, a new SparkSession whose runs each append
to a ``replayable`` log and run ``keyed(events, "user", name=...).count()``
over it with ``trigger(availableNow=True)`` at a parallelism of their own
(a restart in the same application); then the session stops. Every daemon, executor
and driver has its own scratch directory: the processes of the cluster share
no local directory, so state and input must live on shared storage (S3).
Its result holds, per run, the output of every batch, the per-batch
reports of ``StatefulQuery.batches`` and, for every pid that reported, the
working directory of that process, which Spark sets to the executor's own
directory ``<worker work dir>/<app id>/<executor id>``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

from tests.jvm import JVM_OPTIONS, driver_jvm_options

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    """A port that was free on loopback a moment ago (another process may still take it)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _processes() -> dict[int, tuple[int, int]]:
    """Every running process: pid -> (parent pid, start time in clock ticks), from ``/proc/*/stat``."""
    result = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the fields after "pid (comm)"
        except (OSError, IndexError):
            continue  # exited meanwhile
        result[int(stat.parent.name)] = (int(fields[1]), int(fields[19]))
    return result


def _descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, start time)`` of ``pid``'s children, grandchildren, ... now running."""
    processes = _processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in processes.items():
        children.setdefault(parent, []).append(child)
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append((child, processes[child][1]))
            queue.append(child)
    return found


def _kill_if_same(pid: int, started: int) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``started`` (not a reused pid)."""
    if _processes().get(pid, (None, None))[1] == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class StandaloneCluster:
    """A master and ``workers`` one-core workers on loopback, all below ``root``; ``start``, then ``stop``."""

    def __init__(self, root: Path, workers: int = 2, worker_memory: str = "1g"):
        self.root = Path(root)
        self.workers = workers
        self.worker_memory = worker_memory
        self.master_port = free_port()
        self.master_ui_port = free_port()
        self.master_url = f"spark://{LOOPBACK}:{self.master_port}"
        self.work_dirs = [self.root / f"worker-{i}" for i in range(workers)]
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def process_env(self, local_dir: str = "local") -> dict[str, str]:
        """Environment of every process of the cluster and of its drivers; ``local_dir`` its own scratch space."""
        conf_dir = self.root / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(conf_dir),  # empty: no site settings leak in
            SPARK_LOCAL_IP=LOOPBACK,
            SPARK_LOG_DIR=str(self.root / "logs"),
            SPARK_LOCAL_DIRS=str(self.root / local_dir),  # scratch: one per process of the cluster, never shared
            SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
            PYSPARK_PYTHON=sys.executable,
        )
        return env

    def _spawn(self, name: str, args: list[str]) -> None:
        """Start daemon ``name``; it and the executors it launches get their own scratch directory."""
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        properties = self.root / "conf" / "daemon.properties"
        with open(logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args, "--properties-file", str(properties)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.process_env(f"local-{name}"),
                cwd=self.root,
            )
        self._procs.append((name, proc))

    def start(self, timeout: float = 90.0) -> StandaloneCluster:
        """Start the master, then (once it leads) the workers; return once every worker is registered.

        A worker that registers while the master is still in standby is
        told so and retries only 5-15 s later, hence the two steps.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "conf").mkdir(exist_ok=True)
        (self.root / "conf" / "daemon.properties").write_text(
            "spark.master.rest.enabled false\nspark.worker.cleanup.enabled false\n"
        )
        deadline = time.monotonic() + timeout
        self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                LOOPBACK,
                "--port",
                str(self.master_port),
                "--webui-port",
                str(self.master_ui_port),
            ],
        )
        self._wait_until(lambda status: status.get("status") == "ALIVE", "the master to lead", deadline)
        for i, work_dir in enumerate(self.work_dirs):
            work_dir.mkdir(parents=True, exist_ok=True)
            self._spawn(
                f"worker-{i}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    LOOPBACK,
                    "--cores",
                    "1",
                    "--memory",
                    self.worker_memory,
                    "--work-dir",
                    str(work_dir),
                    "--webui-port",
                    "0",
                    self.master_url,
                ],
            )
        self._wait_until(
            lambda status: status.get("aliveworkers") == self.workers,
            f"{self.workers} workers to register",
            deadline,
        )
        return self

    def _wait_until(self, ready, what: str, deadline: float) -> None:
        """Poll the master's status page until ``ready(status)``; fail early if a daemon exits."""
        status: dict = {}
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{self.master_ui_port}/json/", timeout=2) as reply:
                    status = json.load(reply)
            except (OSError, ValueError):  # not up yet, or a page that is not the status (HTML while it starts)
                status = {}
            if ready(status):
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"timed out waiting for {what} at {self.master_url} (last status {status}):\n"
            + "\n".join(self.log_tail(name) for name, _ in self._procs)
        )

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.root / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return f"--- {name} ---\n" + "\n".join(text[-lines:])

    def stop(self, grace: float = 15.0) -> None:
        """End the workers, then the master (TERM, KILL after ``grace`` s), then anything they left running."""
        leftovers: list[tuple[int, int]] = []
        for _, proc in reversed(self._procs):  # workers first: they kill their executors on TERM
            leftovers += _descendants(proc.pid)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid, started in leftovers:
            _kill_if_same(pid, started)
        self._procs.clear()

    def driver_conf(self) -> dict[str, str]:
        """Settings of a driver that uses every worker as one single-core executor."""
        return {
            "spark.master": self.master_url,
            "spark.driver.host": LOOPBACK,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.executor.cores": "1",
            "spark.cores.max": str(self.workers),
            "spark.executor.memory": "512m",
            "spark.driver.extraJavaOptions": driver_jvm_options(),
            "spark.executor.extraJavaOptions": JVM_OPTIONS,
            # Start no job before every executor is up, so tasks really spread over the workers.
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "90s",
            "spark.locality.wait": "0",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.adaptive.enabled": "false",
            "spark.sql.shuffle.partitions": "2",
            "spark.pyspark.python": sys.executable,
            "spark.pyspark.driver.python": sys.executable,
            "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.executorEnv.PYTHONPATH": str(REPO),
        }


class Driver:
    """A driver process for ``cluster``: each ``run`` is one application (a new SparkSession, new executors).

    The process (``python tests/cluster.py --serve FD``) reads one spec per
    line on stdin, runs it with ``run_application`` and writes the result to
    ``spec["result"]``, then ``ok`` or ``error`` on the pipe FD. Its JVM is
    its child: the first run starts it, later runs reuse it. ``close`` ends
    the process; one that overruns is killed with its process group.
    """

    def __init__(self, cluster: StandaloneCluster, root: Path):
        self.cluster = cluster
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "driver.log"
        env = cluster.process_env(f"local-driver-{self.root.name}")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        env.pop("PYSPARK_SUBMIT_ARGS", None)
        self._done, done_writer = os.pipe()
        try:
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--serve", str(done_writer)],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.root,
                    pass_fds=(done_writer,),
                    start_new_session=True,
                )
        finally:
            os.close(done_writer)
        self._runs = 0

    def run(self, spec: dict, timeout: float = 120.0) -> dict:
        """Run one application with ``spec`` (see ``run_application``; ``conf`` is added) and return its result."""
        self._runs += 1
        result = self.root / f"run-{self._runs}.json"
        spec = dict(spec, conf={**self.cluster.driver_conf(), **spec.get("conf", {})}, result=str(result))
        self._proc.stdin.write((json.dumps(spec) + "\n").encode())
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._done], [], [], timeout)
        status = os.read(self._done, 64).decode().strip() if ready else "timeout"
        if status != "ok":
            self.close(grace=0)
            raise RuntimeError(f"driver run {self._runs}: {status or 'exited'}\n{_tail(self.log_path)}")
        return json.loads(result.read_text())

    def close(self, grace: float = 30.0) -> None:
        """Let the driver finish (end of stdin) within ``grace`` s, then kill what is left of its group."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(grace)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the group id is the driver's pid; its JVM is in it
        except ProcessLookupError:
            pass
        self._proc.wait()
        if self._done >= 0:
            os.close(self._done)
            self._done = -1


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_application(spec: dict) -> dict:
    """One application: for each of its runs, append to a ``replayable`` log, then count per key everything in it.

    ``spec``: ``conf`` (Spark settings, master included), ``log`` (the log's
    URI), ``component``, ``store`` (``spark.state.store``), ``checkpoint``
    (``checkpointLocation``, used by the driver only) and ``runs``, each
    with a ``parallelism``, ``append`` (users to append to the log first,
    written by the executors) and optionally ``try_local_store`` (a local
    path: try to start the query with it as the store first, and report the
    refusal). Each run starts the query at its parallelism (a restart, in
    the same application: the same executors) and stops it once it has
    processed everything. Returns the application id and, per run, the
    output rows per batch id, the query's batch reports, the working
    directory of each reporting pid and the refusal's message.
    """
    from pyspark.sql import SparkSession

    import datasources
    from spark_state import keyed
    from spark_state.errors import ConfigError

    builder = SparkSession.builder.appName("spark-state-cluster")
    for key, value in spec["conf"].items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    try:
        session.sparkContext.setLogLevel("WARN")
        datasources.register(session)  # the source's tasks in the instances' worker pool on every executor
        runs = []
        for run in spec["runs"]:
            session.conf.set("spark.state.parallelism", str(run["parallelism"]))
            if run["append"]:
                (
                    session.createDataFrame([(user,) for user in run["append"]], "user string")
                    .write.format("replayable")
                    .mode("append")
                    .option("numSplits", 2)
                    .option("keyColumn", "user")
                    .save(spec["log"])
                )
            outputs: dict[int, dict[str, int]] = {}

            def sink(out, batch_id: int, outputs=outputs) -> None:
                outputs[batch_id] = {r["user"]: r["count"] for r in out.collect()}

            def start(sink=sink):
                events = session.readStream.format("replayable").option("maxRecordsPerBatch", 300).load(spec["log"])
                return (
                    keyed(events, "user", name=spec["component"])
                    .count()
                    .writeStream.foreachBatch(sink)
                    .option("checkpointLocation", spec["checkpoint"])
                    .trigger(availableNow=True)
                    .start()
                )

            refused = None
            if run.get("try_local_store"):
                session.conf.set("spark.state.store", run["try_local_store"])
                try:
                    start().stop()
                except ConfigError as err:
                    refused = str(err)
            session.conf.set("spark.state.store", spec["store"])
            query = start()
            try:
                query.awaitTermination()
            finally:
                query.stop()
            pids = {m["pid"] for b in query.batches for m in b["instances"]}
            runs.append(
                {
                    "outputs": outputs,
                    "batches": query.batches,
                    "process_dirs": {str(pid): _process_dir(pid) for pid in sorted(pids)},
                    "local_store_refused": refused,
                }
            )
        return {"app_id": session.sparkContext.applicationId, "runs": runs}
    finally:
        session.stop()


def _process_dir(pid: int) -> str | None:
    """The working directory of process ``pid`` (None if it has exited)."""
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def serve(done_fd: int) -> None:
    """The driver loop: a spec per stdin line; write its result file, then report on ``done_fd``."""
    for line in sys.stdin:
        spec = json.loads(line)
        try:
            result = run_application(spec)
        except Exception:  # noqa: BLE001 - printed for the test that reads the application's output
            traceback.print_exc()
            sys.stdout.flush()
            os.write(done_fd, b"error\n")
            sys.exit(1)
        tmp = Path(spec["result"] + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, spec["result"])
        os.write(done_fd, b"ok\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        sys.exit("usage: cluster.py --serve DONE_FD (started by cluster.Driver)")
    serve(int(sys.argv[2]))
