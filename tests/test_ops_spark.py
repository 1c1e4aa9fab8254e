"""Operating stores written by real queries: the ``spark-state`` CLI (as a subprocess of the installed console
script), the ``spark-state`` data source, savepoint starts and schema evolution across restarts.

One keyed query per store is run through a rescale (local disk, and the loopback WebHDFS server), and the
tests read what it left; the expected state is a plain Python model of the input.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spark_state import keyed
from spark_state.errors import IncompatibleSchemaError, SavepointMismatchError
from spark_state.ops.reader import read_changes, read_state
from spark_state.store.manifestlog import open_manifest_log
from spark_state.store.restore import MAX_OVERREAD
from tests.files import append_users
from tests.test_keyed_spark import Job

pytestmark = pytest.mark.spark

CLI = Path(sys.executable).with_name("spark-state")


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """Run the installed console script; with ``ok`` it must exit 0."""
    assert CLI.exists(), f"the console script is not installed at {CLI}"
    result = subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120)
    if ok:
        assert result.returncode == 0, result.stderr
    return result


def cli_json(*args: str) -> dict:
    return json.loads(cli(*args, "--json").stdout)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root`` with its size and modification time: a store's fingerprint."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(autouse=True)
def _clean_conf(spark):
    yield
    for key in (
        "spark.state.parallelism",
        "spark.state.store",
        "spark.state.maxParallelism",
        "spark.state.checkpointsRetained",
    ):
        spark.conf.unset(key)


@pytest.fixture(scope="module")
def rescaled(spark, tmp_path_factory):
    """A keyed count run at parallelism 3 (two batches), then 2 (one more): the job and its store."""
    root = tmp_path_factory.mktemp("rescaled")
    job = Job(spark, root)
    job.add_batch(400, keys=120, salt=0)
    job.add_batch(300, keys=150, salt=1)
    job.run(3)
    job.add_batch(300, keys=90, salt=2)
    job.run(2)
    spark.conf.unset("spark.state.store")
    assert job.outputs == job.expected()
    totals = Counter(user for rows in job.files for user, _ in rows)
    return job, root / "state", dict(totals)


def test_the_state_reader_returns_exactly_the_operators_state_after_a_rescale(spark, rescaled):
    job, store, totals = rescaled
    df = (
        spark.read.format("spark-state")
        .option("store", str(store))
        .option("component", job.name)
        .option("partitions", 3)
        .load()
    )
    assert df.columns == ["user", "count"] and df.rdd.getNumPartitions() == 3
    rows = df.collect()
    assert len(rows) == len(totals) and {r["user"]: r["count"] for r in rows} == totals
    assert dict(zip(*read_state(str(store), job.name).to_pydict().values())) == totals
    # an earlier retained checkpoint reads as the state after its batch
    first = Counter(user for rows in job.files[:2] for user, _ in rows)
    earlier = spark.read.format("spark-state").options(store=str(store), component=job.name, checkpoint="1").load()
    assert {r["user"]: r["count"] for r in earlier.collect()} == first


def test_the_change_feed_from_a_to_b_applied_to_a_gives_b(spark, rescaled):
    job, store, totals = rescaled
    feed = (
        spark.read.format("spark-state")
        .option("store", str(store))
        .option("component", job.name)
        .option("readChangeFeed", "true")
        .option("changeStartCheckpoint", 0)
        .option("partitions", 4)
        .load()
    )
    assert feed.columns == ["change_type", "checkpoint_id", "user", "count"]
    state = dict(zip(*read_state(str(store), job.name, 0).to_pydict().values()))
    for row in sorted(feed.collect(), key=lambda r: r["checkpoint_id"]):
        assert row["change_type"] == "upsert" and row["checkpoint_id"] in (1, 2)  # a count never deletes
        state[row["user"]] = row["count"]
    assert state == totals
    assert read_changes(str(store), job.name, 0, 2).num_rows == feed.count()


def test_cli_inspects_a_store_without_changing_it(rescaled, tmp_path):
    job, store, totals = rescaled
    before = tree(store)
    listed = cli_json("checkpoints", str(store))["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == [2, 1, 0]
    latest = listed[0]
    component = latest["components"][job.name]
    assert (component["parallelism"], component["max_parallelism"]) == (2, 1024)
    assert latest["batch_id"] == 2 and latest["bytes_referenced"] > 0 and latest["savepoints"] == []
    assert len(latest["sources"]) == 1
    text = cli("checkpoints", str(store)).stdout
    assert "clicks p=2 max=1024" in text and "clicks p=3 max=1024" in text

    described = cli_json("describe", str(store), job.name)["components"][0]
    assert described["schema"]["keys"] == [{"name": "user", "type": "string"}]
    assert [i["key_groups"] for i in described["instances"]] == [[0, 511], [512, 1023]]
    assert sum(g["rows"] >= 1 for g in described["key_groups"]) == described["key_groups_with_state"]
    assert described["longest_chain"] >= 1 and described["watermark"] is None

    planned = cli_json("plan", str(store), job.name, "--parallelism", "5")
    assert planned["target"]["parallelism"] == 5 and planned["current"]["parallelism"] == 2
    assert [i["key_groups"][0] for i in planned["target"]["instances"]] == [0, 205, 410, 615, 820]
    state_bytes = planned["state_bytes"]  # every entry is read; the gaps read through stay within MAX_OVERREAD
    for plan in (planned["target"], planned["current"]):
        assert state_bytes <= plan["bytes"] <= state_bytes * (1 + MAX_OVERREAD)
    assert all(r["length"] > 0 for i in planned["target"]["instances"] for r in i["reads"])

    user, count = next(iter(totals.items()))
    shown = cli_json("show", str(store), job.name, "--key", user)
    assert shown["rows"] == [{"user": user, "count": count}]
    out = tmp_path / "state.parquet"
    cli("show", str(store), job.name, "--output", str(out))
    assert dict(zip(*pq.read_table(out).to_pydict().values())) == totals
    assert "rows" in cli("show", str(store), job.name, "--limit", "2").stdout

    verified = cli_json("verify", str(store))
    assert verified["ok"] and verified["problems"] == [] and verified["checked"]["files"] > 0
    assert "would delete" in cli("cleanup", str(store), "--dry-run").stdout
    assert cli_json("savepoint", "list", str(store)) == {"savepoints": [], "damaged": {}}
    assert tree(store) == before  # nothing above wrote to the store

    failed = cli("describe", str(store), "missing", ok=False)
    assert failed.returncode == 1 and "no component 'missing'" in failed.stderr


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing"])
def test_cli_verify_catches_damage(rescaled, tmp_path, damage):
    _, store, _ = rescaled
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    blob = sorted(copy.glob("blobs/*/*/*.arrow"))[-1]
    data = blob.read_bytes()
    if damage == "flipped byte":
        blob.write_bytes(data[:100] + bytes([data[100] ^ 0x40]) + data[101:])
    elif damage == "truncated":
        blob.write_bytes(data[:-7])
    else:
        blob.unlink()
    result = cli("verify", str(copy), "--json", ok=False)
    assert result.returncode == 1
    problems = json.loads(result.stdout)["problems"]
    assert [(p["what"], p["path"]) for p in problems] == [
        ({"flipped byte": "crc", "truncated": "size", "missing": "missing"}[damage], str(blob.relative_to(copy)))
    ]
    text = cli("verify", str(copy), ok=False)
    assert text.returncode == 1 and "PROBLEM" in text.stdout and "1 problem(s)" in text.stdout


def test_cli_savepoints_drain_cleanup_and_repair(rescaled, tmp_path):
    _, store, _ = rescaled
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    created = cli_json("savepoint", "create", str(copy), "before-upgrade", "--checkpoint", "1", "--reason", "test")
    assert created["checkpoint_id"] == 1 and created["uri"].endswith("/savepoints/before-upgrade")
    listed = cli_json("checkpoints", str(copy))["checkpoints"]
    assert [c["savepoints"] for c in listed] == [[], ["before-upgrade"], []]
    again = cli("savepoint", "create", str(copy), "before-upgrade", ok=False)
    assert again.returncode == 1 and "already exists" in again.stderr
    assert [s["name"] for s in cli_json("savepoint", "list", str(copy))["savepoints"]] == ["before-upgrade"]
    cli("savepoint", "delete", str(copy), "before-upgrade")
    assert cli_json("savepoint", "list", str(copy))["savepoints"] == []

    run_id = str(uuid.uuid4())
    unknown = cli("drain", str(copy), run_id, ok=False)  # a run the store never saw: refused, nothing written
    assert unknown.returncode == 1 and "--force" in unknown.stderr and not (copy / "drain-requests").exists()
    assert run_id in cli("drain", str(copy), run_id, "--force").stdout
    assert (copy / "drain-requests" / f"{run_id}.json").exists()

    orphan = copy / "blobs" / "clicks" / f"{1:020d}" / "00009-0-0-orphan.arrow"
    orphan.write_bytes(b"an attempt that was never committed")
    dry = cli_json("cleanup", str(copy), "--dry-run")
    assert str(orphan.relative_to(copy)) in dry["files"] and orphan.exists()
    done = cli_json("cleanup", str(copy))
    assert str(orphan.relative_to(copy)) in done["files"] and not orphan.exists()
    assert cli_json("verify", str(copy))["ok"]

    location = tmp_path / "chk"
    (location / "offsets").mkdir(parents=True)
    leftovers = [f".0.{uuid.uuid4()}.tmp", f"..0.{uuid.uuid4()}.tmp.crc"]
    for name in leftovers:
        (location / "offsets" / name).write_bytes(b"half an offsets entry")
    assert "would delete" in cli("repair-checkpoint", str(location), "--dry-run").stdout
    repaired = cli("repair-checkpoint", str(location))
    assert all(f"offsets/{n}" in repaired.stdout for n in leftovers) and not list((location / "offsets").glob("*"))
    (location / "offsets").mkdir(exist_ok=True)
    (location / "offsets" / "stranger").write_text("?")
    refused = cli("repair-checkpoint", str(location), ok=False)
    assert refused.returncode == 1 and "'stranger' is not the leftover" in refused.stderr


def test_cli_on_a_store_on_hdfs(spark, tmp_path):
    from tests.webhdfs_server import WebHdfsServer

    job = Job(spark, tmp_path)
    with WebHdfsServer(str(tmp_path / "namenode")) as server:
        store = server.url.replace("http://", "hdfs://") + "/jobs/clicks-state"

        def run(parallelism: int) -> None:
            spark.conf.set("spark.state.parallelism", str(parallelism))
            spark.conf.set("spark.state.store", store)
            query = (
                keyed(job.stream(), "user", name="clicks")
                .count()
                .writeStream.foreachBatch(job.sink)
                .option("checkpointLocation", str(tmp_path / "chk"))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination()

        job.add_batch(300, keys=50, salt=0)
        run(2)
        job.add_batch(300, keys=70, salt=1)
        run(3)
        totals = Counter(user for rows in job.files for user, _ in rows)
        listed = cli_json("checkpoints", store)["checkpoints"]
        assert [c["components"]["clicks"]["parallelism"] for c in listed] == [3, 2]
        shown = cli_json("show", store, "clicks")
        assert {r["user"]: r["count"] for r in shown["rows"]} == totals and shown["total_rows"] == len(totals)
        assert cli_json("verify", store)["ok"]
        df = spark.read.format("spark-state").option("store", store).option("component", "clicks").load()
        assert {r["user"]: r["count"] for r in df.collect()} == totals
        blob = next(Path(server.local_path("/jobs/clicks-state/blobs")).rglob("*.arrow"))
        blob.write_bytes(blob.read_bytes()[:-1])
        result = cli("verify", store, "--json", ok=False)
        assert result.returncode == 1 and [p["what"] for p in json.loads(result.stdout)["problems"]] == ["size"]


# --------------------------------------------------------------------------- savepoints and schema evolution


def test_a_query_started_from_a_savepoint_continues_with_exact_output(spark, tmp_path):
    log, store_a, store_b = str(tmp_path / "events"), str(tmp_path / "a"), str(tmp_path / "b")
    latest: dict[str, int] = {}

    def sink(out, batch_id):
        latest.update({r["user"]: r["count"] for r in out.collect()})

    def start(checkpoint: str, store: str, parallelism: int, savepoint: str | None = None, key: str = "user"):
        spark.conf.set("spark.state.parallelism", str(parallelism))
        spark.conf.set("spark.state.store", store)
        spark.conf.set("spark.state.checkpointsRetained", "2")
        events = (
            spark.readStream.format("replayable")
            .option("path", log)
            .option("startingOffsets", "checkpoint")
            .option("stateStore", store)
            .option("maxRecordsPerBatch", 150)
            .load()
        )
        writer = keyed(events, key, name="clicks").count().writeStream.foreachBatch(sink)
        if savepoint is not None:
            writer = writer.fromSavepoint(savepoint)
        query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
        query.awaitTermination()
        return query

    batches = [[f"u{(i * 7 + b) % 23}" for i in range(300)] for b in range(2)]
    append_users(log, batches[0])
    start(str(tmp_path / "chk-a"), store_a, 3)  # two micro-batches of 150 rows: checkpoints 0 and 1
    savepoint = cli_json("savepoint", "create", store_a, "sp", "--checkpoint", "0")["uri"]
    append_users(log, batches[1])
    start(str(tmp_path / "chk-a"), store_a, 3)  # the old query goes on: checkpoint 0 leaves retention
    assert latest == Counter(u for rows in batches for u in rows)
    assert open_manifest_log(store_a).restorable() == {3: [], 2: [], 0: ["sp"]}
    assert cli_json("verify", store_a)["ok"]

    # a start that does not fit is refused before anything runs
    spark.conf.set("spark.state.maxParallelism", "64")
    with pytest.raises(SavepointMismatchError, match="set spark.state.maxParallelism=1024"):
        start(str(tmp_path / "chk-x"), str(tmp_path / "x"), 2, savepoint)
    spark.conf.unset("spark.state.maxParallelism")
    with pytest.raises(SavepointMismatchError, match="key columns are \\['split'\\].*keyed by \\['user'\\]"):
        start(str(tmp_path / "chk-x"), str(tmp_path / "x"), 2, savepoint, key="split")
    assert not os.path.exists(tmp_path / "x" / "checkpoints")

    # a new query on a new store, at another parallelism, from the savepoint: it counts on from its offsets
    latest.clear()
    query = start(str(tmp_path / "chk-b"), store_b, 5, savepoint)
    assert [b["parallelism"] for b in query.batches] == [5, 5, 5]  # the 450 rows after the savepoint
    assert latest == Counter(u for rows in batches for u in rows)
    origin = open_manifest_log(store_b).latest().origin
    assert (origin["savepoint"], origin["checkpoint_id"]) == ("sp", 0)


def test_schema_evolution_across_three_restarts_with_rescales(spark, tmp_path):
    job = Job(spark, tmp_path, name="totals")
    amounts: dict[str, int] = Counter()
    rows_since: dict[str, int] = Counter()

    def run(parallelism: int, state_schema: str, fn, defaults=None):
        def stream(k):
            return k.apply(
                fn, state_schema=state_schema, output_schema="user string, count long", state_defaults=defaults
            )

        return job.run(parallelism, stream)

    def step(batch: int, keys: int, counting: bool):
        job.add_batch(200, keys=keys, salt=batch)
        for user, amount in job.files[-1]:
            amounts[user] += amount
            if counting:
                rows_since[user] += 1

    def total_only(key, rows, state):
        total = (state.get()[0] if state.exists else 0) + int(rows["amount"].sum())
        state.update((total,))
        return [{"user": key[0], "count": total}]

    def with_rows(key, rows, state):
        total, n = state.get() if state.exists else (0, 0)
        state.update((total + int(rows["amount"].sum()), n + len(rows)))
        return [{"user": key[0], "count": total + int(rows["amount"].sum())}]

    def state_now():
        return {
            r["user"]: tuple(v for k, v in r.items() if k != "user")
            for r in read_state(str(tmp_path / "state"), "totals").to_pylist()
        }

    step(0, 40, False)
    run(2, "total int", total_only)
    assert state_now() == {u: (t,) for u, t in amounts.items()}
    step(1, 60, True)  # add a column with a default; parallelism 3
    run(3, "total int, n int", with_rows, {"n": 0})
    assert state_now() == {u: (t, rows_since.get(u, 0)) for u, t in amounts.items()}
    step(2, 80, True)  # widen total int -> bigint; parallelism 1
    run(1, "total bigint, n int", with_rows)
    assert state_now() == {u: (t, rows_since.get(u, 0)) for u, t in amounts.items()}
    assert read_state(str(tmp_path / "state"), "totals").schema.field("total").type.bit_width == 64
    step(3, 90, False)  # drop n; parallelism 4
    run(4, "total bigint", total_only)
    assert state_now() == {u: (t,) for u, t in amounts.items()}
    assert job.outputs[3] == {u: amounts[u] for u, _ in job.files[3]}

    with pytest.raises(IncompatibleSchemaError, match="'value.total' cannot change from int64 to int32") as info:
        run(2, "total int", total_only)
    assert (info.value.column, info.value.old_type, info.value.new_type) == ("value.total", "int64", "int32")
