"""The documented recovery from a damaged checkpoint, end to end: a new query from an older retained checkpoint.

The newest state record is damaged: the query refuses to run, naming the file.
A new ``checkpointLocation`` with ``spark.state.restoreFrom=<older id>`` and
the source starting at that checkpoint's offsets (``checkpoint:<id>``)
reprocesses from there; its counts continue exactly from the older state, and
the sink sees the reprocessed range again, under the new query's batch ids.
"""

from __future__ import annotations

from collections import Counter

import pytest

from spark_state import keyed
from spark_state.errors import CorruptBlobError
from spark_state.store.manifestlog import open_manifest_log

pytestmark = pytest.mark.spark


@pytest.fixture(autouse=True)
def _clean_conf(spark):
    yield
    for key in ("spark.state.parallelism", "spark.state.store", "spark.state.restoreFrom"):
        spark.conf.unset(key)


def test_a_damaged_newest_checkpoint_is_refused_and_a_query_restored_from_an_older_one_is_exact(spark, tmp_path):
    log, store = str(tmp_path / "events"), str(tmp_path / "state")
    users = [f"u{i % 11}" for i in range(600)]
    spark.createDataFrame([(u,) for u in users], "user string").write.format("replayable").mode("append").option(
        "numSplits", 2
    ).option("keyColumn", "user").save(log)
    outputs: dict[str, dict[int, dict[str, int]]] = {}

    def run(name: str, starting: str, restore_from: int | None = None):
        spark.conf.set("spark.state.parallelism", "2")
        spark.conf.set("spark.state.store", store)
        if restore_from is not None:
            spark.conf.set("spark.state.restoreFrom", str(restore_from))
        events = (
            spark.readStream.format("replayable")
            .option("path", log)
            .option("maxRecordsPerBatch", 200)
            .option("startingOffsets", starting)
            .option("stateStore", store)
            .load()
        )
        query = (
            keyed(events, "user", name="clicks")
            .count()
            .writeStream.foreachBatch(
                lambda out, b: outputs.setdefault(name, {}).update({b: {r[0]: r[1] for r in out.collect()}})
            )
            .option("checkpointLocation", str(tmp_path / name))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run("chk-a", "earliest")
    assert len(outputs["chk-a"]) == 3  # three batches of 200
    manifests = open_manifest_log(store)
    newest, older = manifests.ids()[-1], manifests.latest().consistent_checkpoints[1]
    record = tmp_path / "state" / "checkpoints" / f"{newest:020d}.json"
    data = bytearray(record.read_bytes())
    data[len(data) // 2] ^= 0x20
    record.write_bytes(bytes(data))
    with pytest.raises(CorruptBlobError, match=f"{newest:020d}.json.*restoreFrom"):
        run("chk-a", "earliest")

    run("chk-b", f"checkpoint:{older}", restore_from=older)
    # the range after checkpoint `older` is processed again, under the new query's batch ids, from its state
    assert list(outputs["chk-b"]) == [0]
    # the keys the reprocessed batch updates, at their final counts: exactly what the damaged batch had emitted
    assert outputs["chk-b"][0] == outputs["chk-a"][2]
    totals = Counter(users)
    assert outputs["chk-b"][0] and all(n == totals[u] for u, n in outputs["chk-b"][0].items())
    latest = open_manifest_log(store).latest()
    assert latest.checkpoint_id == newest + 1 and latest.consistent_checkpoints[:2] == (newest + 1, older)
    assert newest not in open_manifest_log(store).ids()  # the damaged record went with cleanup
