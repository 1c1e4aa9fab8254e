"""Keyed queries over Spark Connect: the same results as on a classic session, through restarts at another
parallelism, a live rescale, a kill of the server (the query's driver), a drain on an idle source, the
``replayable`` source and sink, a savepoint and ``format("spark-state")``.

The server is Spark's own Connect server from the pip package (``tests/connect.py``); each client is a process of
its own (``tests/connect_client.py``): a Connect client turns its whole process to Connect mode. Inputs are
Parquet files read one per micro-batch, outputs Parquet files per batch id, read back here with pyarrow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.savepoints import create_savepoint
from tests import connect_queries as queries
from tests.connect import REPO, ConnectServer, run_client
from tests.files import append_users, publish

pytestmark = [pytest.mark.spark, pytest.mark.connect]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    connect = ConnectServer(tmp_path_factory.mktemp("connect")).start()
    try:
        yield connect
    finally:
        connect.stop()


class Files:
    """Parquet input files, one per micro-batch, and the running count each batch should output."""

    def __init__(self, root: Path):
        self.dir = root / "input"
        self.dir.mkdir(parents=True)
        self.batches: list[list[tuple[str, int, int]]] = []

    def add(self, n: int, keys: int, salt: int) -> None:
        index = len(self.batches)
        base_ms = 1_700_000_000_000 + index * 15_000
        rows = [(f"u{(i * 7 + salt) % keys}", i % 5 + 1, base_ms + (i * 37) % 12_000) for i in range(n)]
        table = pa.table(
            {
                "user": [r[0] for r in rows],
                "amount": pa.array([r[1] for r in rows], pa.int64()),
                "ts": pa.array([r[2] for r in rows], pa.timestamp("ms", tz="UTC")),
            }
        )
        publish(table, self.dir / f"part-{index:05d}.parquet", index)
        self.batches.append(rows)

    def counts(self, batch_files: dict[int, list[int]] | None = None) -> dict[int, dict[str, int]]:
        """Per batch id, the running count of each user the batch read; ``batch_files`` says which files each
        batch read (``spark_batch_files``), else one file per batch."""
        batch_files = batch_files or {index: [index] for index in range(len(self.batches))}
        totals: Counter = Counter()
        expected = {}
        for batch_id, indices in sorted(batch_files.items()):
            rows = [row for index in indices for row in self.batches[index]]
            totals.update(user for user, _, _ in rows)
            expected[batch_id] = {user: totals[user] for user, _, _ in rows}
        return expected


def spark_batch_files(checkpoint: Path) -> dict[int, list[int]]:
    """Per batch id, the indices of the input files (``part-<index>.parquet``) Spark's file source gave it.

    Mostly one per batch (``maxFilesPerTrigger`` 1), but a kill between the source's log entry
    (``sources/0/N``) and the batch's offsets (``offsets/N``) makes the batch replanned after the restart take
    the next file too: Spark's own doing, which the expected counts must follow.
    """
    entries = {
        int(path.name): [int(m) for m in re.findall(r"part-(\d+)\.parquet", path.read_text())]
        for path in (checkpoint / "sources" / "0").iterdir()
        if path.name.isdigit()
    }
    by_batch, taken = {}, -1
    for path in sorted((p for p in (checkpoint / "offsets").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        offset = json.loads(path.read_text().splitlines()[-1])["logOffset"]
        by_batch[int(path.name)] = [index for entry in range(taken + 1, offset + 1) for index in entries[entry]]
        taken = offset
    return by_batch


def outputs(out: Path) -> dict[int, list[tuple]]:
    """Per batch id, the sorted rows of ``<out>/batch_id=N`` (timestamps as milliseconds)."""
    result = {}
    for directory in sorted(out.glob("batch_id=*")):
        table = pq.read_table(directory)
        columns = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in table.columns]
        rows = list(zip(*(c.to_pylist() for c in columns))) if columns else []
        result[int(directory.name.split("=")[1])] = sorted(rows, key=repr)
    return result


def counts_of(out: Path) -> dict[int, dict[str, int]]:
    return {batch: {row[0]: row[1] for row in rows} for batch, rows in outputs(out).items()}


def classic_outputs(spark, files: Files, root: Path, kind: str, parallelism: int) -> dict:
    """``kind``'s outputs on the classic session over every file, in one run at ``parallelism``: exactly once,
    a query's output per batch does not depend on where it was restarted or at which parallelism it ran."""
    out, checkpoint = root / "out", root / "chk"
    spark.conf.set("spark.state.parallelism", str(parallelism))
    try:
        queries.write(
            queries.build(kind, queries.stream(spark, str(files.dir))), str(out), str(checkpoint)
        ).awaitTermination()
    finally:
        spark.conf.unset("spark.state.parallelism")
    return outputs(out)


def test_every_kind_gives_the_classic_results_across_a_restart_at_another_parallelism(server, spark, tmp_path):
    files = Files(tmp_path)
    for salt in range(2):
        files.add(300, 40, salt)
    # the built-ins' path (count; sum takes it too), apply with state and event-time timers (apply and ttl take
    # it), and sessions (deduplicate takes the sessions' path of the watermark)
    kinds = ["count", "timers", "sessions"]
    common = {"input": str(files.dir), "out": str(tmp_path / "out"), "checkpoint": str(tmp_path / "chk")}
    first = run_client(server, "run", kinds=kinds, parallelism=3, **common)
    for salt in range(2, 4):
        files.add(300, 40, salt)
    second = run_client(server, "run", kinds=kinds, parallelism=5, **common)
    for kind in kinds:
        assert first[kind]["error"] is None and second[kind]["error"] is None, (first[kind], second[kind])
        assert [b["parallelism"] for b in first[kind]["batches"] + second[kind]["batches"]] == [3] * 2 + [5] * 2
    assert counts_of(tmp_path / "out" / "count") == files.counts()
    for kind in kinds:
        classic = classic_outputs(spark, files, tmp_path / "classic" / kind, kind, parallelism=2)
        assert outputs(tmp_path / "out" / kind) == classic, kind
    restored = second["count"]["batches"][0]["instances"]
    assert sum(i["restore"]["bytes_read"] for i in restored) > 0  # the restart read the state from the store
    quiet = [row for rows in outputs(tmp_path / "out" / "timers").values() for row in rows if row[1] == "quiet"]
    assert quiet  # timers fired over Connect, and (above) as on the classic session


def test_the_pure_python_pyspark_client_runs_and_restarts_a_keyed_query(server, tmp_path):
    """``pyspark-client`` (no JVM, no py4j) cannot be installed beside ``pyspark`` (both are the ``pyspark``
    package): it runs from a virtualenv of its own, against the same server."""
    from tests.connect import PYSPARK_CLIENT, pyspark_client_python

    python = pyspark_client_python()
    files = Files(tmp_path)
    for salt in range(2):
        files.add(200, 30, salt)
    common = {"input": str(files.dir), "out": str(tmp_path / "out"), "checkpoint": str(tmp_path / "chk")}
    first = run_client(server, "run", python=python, kind="count", parallelism=3, **common)
    assert (first["pyspark"], first["py4j"]) == (PYSPARK_CLIENT, False)
    files.add(200, 30, 2)
    second = run_client(server, "run", python=python, kind="count", parallelism=2, **common)
    assert first["error"] is None and second["error"] is None, (first, second)
    assert [b["parallelism"] for b in first["batches"] + second["batches"]] == [3, 3, 2]
    assert counts_of(tmp_path / "out") == files.counts()


def test_a_live_rescale_through_the_session_conf(server, tmp_path):
    files = Files(tmp_path)
    for salt in range(5):
        files.add(200, 30, salt)
    common = {"input": str(files.dir), "out": str(tmp_path / "out"), "checkpoint": str(tmp_path / "chk")}
    result = run_client(server, "live", kind="count", parallelism=2, rescale_after=2, rescaled=4, batches=5, **common)
    parallelisms = [b["parallelism"] for b in result["batches"]]
    assert parallelisms[:2] == [2, 2] and parallelisms[-1] == 4 and sorted(parallelisms) == parallelisms
    assert counts_of(tmp_path / "out") == files.counts()


def test_a_killed_server_restarts_the_query_at_another_parallelism_exactly(server, tmp_path):
    files = Files(tmp_path)
    for salt in range(6):  # 3 before the kill, a 4th may be under way: files left for the restart
        files.add(200, 30, salt)
    common = {"input": str(files.dir), "out": str(tmp_path / "out"), "checkpoint": str(tmp_path / "chk")}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    arguments = json.dumps({"kind": "count", "parallelism": 3, "batches": 3, **common})
    client = subprocess.Popen(
        [sys.executable, "-m", "tests.connect_client", server.url, "start", arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        line = client.stdout.readline() if client.stdout is not None else ""
        assert json.loads(line)["started"], line
        server.kill()  # mid-stream: the query's driver is gone, with its foreachBatch process and hosts
    finally:
        client.kill()
        client.wait()
    committed = open_manifest_log(str(tmp_path / "chk" / "state")).latest()
    assert committed is not None and committed.checkpoint_id >= 2
    server.start()
    result = run_client(server, "run", kind="count", parallelism=5, **common)
    assert result["error"] is None, result
    assert {b["parallelism"] for b in result["batches"]} == {5}
    assert counts_of(tmp_path / "out") == files.counts(spark_batch_files(tmp_path / "chk"))


def test_a_drain_on_an_idle_source_completes_through_the_clock(server, tmp_path):
    files = Files(tmp_path)
    for salt in range(2):
        files.add(100, 20, salt)
    common = {"input": str(files.dir), "out": str(tmp_path / "out"), "checkpoint": str(tmp_path / "chk")}
    result = run_client(server, "drain", kind="timers", parallelism=2, batches=2, **common)
    assert result["drained"], result
    assert result["batches"][-1]["drained"] and len(result["batches"]) == result["idle_batches"] + 1
    quiet = [row for rows in outputs(tmp_path / "out").values() for row in rows if row[1] == "quiet"]
    assert {row[0] for row in quiet} == {user for rows in files.batches for user, _, _ in rows}  # every timer fired


def test_replayable_source_and_sink_a_savepoint_and_the_state_reader(server, spark, tmp_path):
    """A start from a savepoint cannot be checked over Connect (its first batch's start offsets are the JVM's):
    refused at ``start()`` with the way round, a first batch on a classic session; the query then goes on over
    Connect at another parallelism, and the store reads back over Connect with ``format("spark-state")``."""
    log = str(tmp_path / "events")
    batches = [[f"u{(i * 7 + b) % 23}" for i in range(300)] for b in range(3)]
    append_users(log, batches[0])
    common = {"log": log, "out": str(tmp_path / "out-a"), "checkpoint": str(tmp_path / "chk-a")}
    first = run_client(server, "replayable", store=str(tmp_path / "a"), parallelism=3, **common)
    assert first["error"] is None and first["state"] == Counter(batches[0]), first
    assert {b["parallelism"] for b in first["batches"]} == {3} and len(first["batches"]) == 2  # 150 rows a batch
    savepoint = create_savepoint(open_manifest_log(str(tmp_path / "a")), "sp", reason="connect test")
    append_users(log, batches[1])
    from_savepoint = {"log": log, "out": str(tmp_path / "out-b"), "checkpoint": str(tmp_path / "chk-b")}
    uri = f"{tmp_path / 'a'}/savepoints/{savepoint.name}"
    refused = run_client(
        server, "replayable", store=str(tmp_path / "b"), parallelism=5, savepoint=uri, **from_savepoint
    )
    assert refused["refused"].startswith("UnsupportedOverConnectError: a start from savepoint"), refused
    assert "classic session" in refused["refused"]

    # the first batch from the savepoint on the classic session, then on over Connect at another parallelism
    classic = _classic_replayable(spark, log, tmp_path / "b", tmp_path / "chk-b", uri, parallelism=2)
    assert classic == 1
    append_users(log, batches[2])
    second = run_client(server, "replayable", store=str(tmp_path / "b"), parallelism=5, **from_savepoint)
    assert second["error"] is None, second
    assert {b["parallelism"] for b in second["batches"]} == {5}
    assert second["state"] == Counter(u for rows in batches for u in rows)
    assert second["output_rows"] > 0


def _classic_replayable(spark, log: str, store: Path, checkpoint: Path, savepoint: str, parallelism: int) -> int:
    """One batch of the ``replayable`` scenario's query on the classic session, started from ``savepoint``."""
    from spark_state import keyed

    spark.conf.set("spark.state.parallelism", str(parallelism))
    spark.conf.set("spark.state.store", str(store))
    try:
        events = (
            spark.readStream.format("replayable")
            .option("path", log)
            .option("startingOffsets", "checkpoint")
            .option("stateStore", str(store))
            .option("maxRecordsPerBatch", 150)
            .load()
        )
        query = (
            keyed(events, "user", name="clicks")
            .count()
            .writeStream.format("replayable")
            .option("path", str(checkpoint.parent / "out-b"))
            .option("keyColumn", "user")
            .option("checkpointLocation", str(checkpoint))
            .fromSavepoint(savepoint)
            .trigger(processingTime="1 second")
            .start()
        )
        assert query.await_batches(1, timeout=120)
        query.stop()
        return len(query.batches)
    finally:
        spark.conf.unset("spark.state.parallelism")
        spark.conf.unset("spark.state.store")
