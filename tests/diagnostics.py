"""What a failed Spark test leaves for its reader, beyond its assertion: where every thread was at the failure.

A Spark test that fails by timing out (a batch that never ends) says
nothing of where it stalled. ``failure_sections`` collects, for the report
of a failed test, the stacks of this process's Python threads (the driver),
those of the JVM's query and task threads, and the logs of the instance
hosts that wrote anything during the test (a host writes its stacks there
when a worker has waited long for it: ``hosts._answer``). ``stalled`` gives
the same as the message of a wait for a batch that timed out, while the
query still runs.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import threading
import time
from pathlib import Path

JVM_THREADS = ("stream execution", "Executor task launch", "python", "dag-scheduler")
"""The JVM's threads whose stacks a failed test reports (by the start of their names, in lower case)."""
JVM_SECONDS = 30.0
"""How long a failed test's report waits for the JVM's stacks."""
LOG_CHARS = 20_000
"""How much of the end of each host's log a failed test reports."""


def failure_sections(spark, since: float) -> list[tuple[str, str]]:
    """``(title, text)`` sections for the report of a test that failed after ``since`` (seconds since the epoch)."""
    sections = [("driver threads", _python_threads()), ("JVM threads", _bounded(_jvm_threads, spark))]
    for log in _host_logs(since):
        text = log.read_text(errors="replace")
        sections.append((f"host log {log}", text[-LOG_CHARS:]))
    return sections


def stalled(spark, window: float = 600.0) -> str:
    """Where every thread is now, as one text: the message of a failed wait for a batch, made before the test's
    ``finally`` stops the query (host logs written in the last ``window`` seconds)."""
    return "\n".join(f"--- {title} ---\n{text}" for title, text in failure_sections(spark, time.time() - window))


def _bounded(read, spark) -> str:
    """``read(spark)``, or why it gave nothing: it raised, or its JVM did not answer in ``JVM_SECONDS`` (a
    failed test's report must not hang the run)."""
    result: list[str] = []

    def run() -> None:
        try:
            result.append(read(spark))
        except Exception as error:  # noqa: BLE001 - a JVM that does not answer is itself worth reporting
            result.append(f"(not read: {error!r})")

    thread = threading.Thread(target=run, name="spark-state test diagnostics", daemon=True)
    thread.start()
    thread.join(JVM_SECONDS)
    return result[0] if result else f"(the JVM did not answer within {JVM_SECONDS:g} s)"


def _python_threads() -> str:
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        return dump.read()


def _jvm_threads(spark) -> str:
    traces = spark.sparkContext._jvm.java.lang.Thread.getAllStackTraces()
    lines = []
    for thread in traces.keySet().toArray():
        name = thread.getName()
        if not name.lower().startswith(tuple(n.lower() for n in JVM_THREADS)):
            continue
        lines.append(f'"{name}" {thread.getState().toString()}')
        lines.extend(f"    at {frame.toString()}" for frame in list(traces.get(thread))[:40])
    return "\n".join(lines) or "(none of the query's threads)"


def _host_logs(since: float) -> list[Path]:
    """The instance hosts' logs on this machine written to since ``since`` (every executor's, this run's too)."""
    root, level = Path(tempfile.gettempdir()), f"spark-state-{os.getuid()}"
    logs = []  # below Spark's local directory of each executor (local mode: /tmp/blockmgr-*), or the temporary one
    for log in [*root.glob(f"{level}/*/*.log"), *root.glob(f"*/{level}/*/*.log")]:
        try:
            status = log.stat()
        except FileNotFoundError:
            continue
        if status.st_size and status.st_mtime >= since:
            logs.append(log)
    return sorted(logs)
