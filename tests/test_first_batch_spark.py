"""A keyed query stopped, or failed, before its first batch starts again: nothing of ours is in Spark's
``<checkpointLocation>/state`` (the default store) before Spark has planned a batch, and a stop record an earlier
version left there is removed (``store.stops``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spark_state import keyed
from spark_state.store.stops import STOPPED

pytestmark = pytest.mark.spark

ROWS = 700


@pytest.fixture(scope="module", autouse=True)
def _source(spark):
    from tests.failing_source import FailingOnceSource

    spark.dataSource.register(FailingOnceSource)


def _start(spark, chk: Path, marker: Path, outputs: dict, *, available_now: bool = True):
    events = spark.readStream.format("failing_once").option("marker", str(marker)).option("rows", ROWS).load()
    writer = (
        keyed(events, "key", name="counts")
        .count()
        .writeStream.foreachBatch(lambda df, b: outputs.update({b: {r["key"]: r["count"] for r in df.collect()}}))
        .option("checkpointLocation", str(chk))
    )
    return (writer.trigger(availableNow=True) if available_now else writer).start()


EXPECTED = {0: dict(Counter(str(i % 7) for i in range(ROWS)))}


def test_a_query_stopped_before_its_first_batch_starts_again_exactly(spark, tmp_path):
    outputs: dict = {}
    query = _start(spark, tmp_path / "chk", tmp_path / "no-marker", outputs, available_now=False)
    query.stop()  # at once: no batch planned
    assert not list((tmp_path / "chk" / "offsets").glob("[0-9]*"))
    assert not (tmp_path / "chk" / "state").exists() or not any((tmp_path / "chk" / "state").iterdir())
    query = _start(spark, tmp_path / "chk", tmp_path / "no-marker", outputs)
    query.awaitTermination()
    assert outputs == EXPECTED


def test_a_query_whose_first_start_failed_starts_again_exactly(spark, tmp_path):
    marker = tmp_path / "fail-once"
    marker.touch()
    outputs: dict = {}
    query = _start(spark, tmp_path / "chk", marker, outputs)
    with pytest.raises(Exception, match="injected failure"):  # Spark wraps it
        query.awaitTermination()
    assert not marker.exists() and outputs == {}
    query = _start(spark, tmp_path / "chk", marker, outputs)
    query.awaitTermination()
    assert outputs == EXPECTED


def test_the_stop_record_an_earlier_version_left_before_the_first_batch_is_removed(spark, tmp_path, caplog):
    state = tmp_path / "chk" / "state"
    state.mkdir(parents=True)
    (state / STOPPED).write_text('{"run_id": "0f1e2d3c-0000-4000-8000-000000000001", "stopped_at": 0}')
    outputs: dict = {}
    query = _start(spark, tmp_path / "chk", tmp_path / "no-marker", outputs)
    query.awaitTermination()
    assert outputs == EXPECTED
    assert "the record of a run stopped before its first batch" in caplog.text
