"""The driver's per-batch Spark calls that can be checked without a Spark session."""

from __future__ import annotations

import json

import pyarrow as pa

from spark_state.executor.report import InstanceReport
from spark_state.executor.task import META_COLUMN
from spark_state.spark.microbatch import _strip_reports, reports_of, task_output_schema


def test_task_output_columns_are_nullable_even_when_the_input_declares_them_not_null():
    output = pa.schema(
        [
            pa.field("key", pa.string()),
            pa.field("split", pa.int32(), nullable=False),
            pa.field("offset", pa.int64(), nullable=False),
        ]
    )
    schema = task_output_schema(output)
    assert schema.names == ["key", "split", "offset"]
    assert all(f.nullable for f in schema)


def test_a_memory_bound_on_a_component_with_timers_is_reported_once_not_ignored_silently(caplog):
    from types import SimpleNamespace

    from spark_state.driver.conf import StateConf
    from spark_state.model.schema import KeyedSchema
    from spark_state.model.timers import TIMERS
    from spark_state.spark.microbatch import MicroBatch

    value = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])
    timed = KeyedSchema(value.keys, (value.value, TIMERS))
    bounded = StateConf.from_mapping({"spark.state.residentMemory": "64m"}, default_store="/s", default_parallelism=2)
    for schema, expected in ((value, 0), (timed, 1)):
        stream = SimpleNamespace(schema=schema, keyed=SimpleNamespace(name="sessions"))
        batch = MicroBatch(stream, None, "/chk", None, None)
        with caplog.at_level("WARNING", logger="spark_state.spark.microbatch"):
            caplog.clear()
            for _ in range(3):
                batch._warn_if_unbounded(bounded)
        assert [r.getMessage() for r in caplog.records if "residentMemory" in r.getMessage()] == (
            [
                "spark.state.residentMemory does not bound component 'sessions': it has timers or a time to live, and "
                "its state stays in memory whole; its batch reports say bounded=false"
            ]
            * expected
        )


def _meta(instance: int, blob_rows: int) -> str:
    return json.dumps(InstanceReport(instance, None, None, {"rows_in": blob_rows}).to_json())


def test_reports_of_keeps_one_attempt_and_the_last_report_of_each_instance():
    received = [
        ("old", _meta(0, 1)),  # a late report of an earlier attempt
        ("now", _meta(1, 2)),
        ("now", _meta(0, 3)),
        ("now", _meta(1, 4)),  # the output was computed again (a second action): the last report counts
    ]
    reports = reports_of(received, "now")
    assert sorted(reports) == [0, 1]
    assert reports[0].info["rows_in"] == 3 and reports[1].info["rows_in"] == 4
    assert reports_of(received, "other") == {}


def test_a_tasks_report_batch_goes_to_the_accumulator_and_its_output_keeps_the_declared_schema():
    output = pa.schema([pa.field("key", pa.string()), pa.field("count", pa.int64(), nullable=False)])
    rows = pa.RecordBatch.from_arrays([pa.array(["a", "b"]), pa.array([1, 2])], schema=output)
    report = pa.RecordBatch.from_arrays([pa.array([_meta(1, 7)])], names=[META_COLUMN])

    class Accumulator:
        added: list = []

        def add(self, value):
            self.added.extend(value)

    sent = Accumulator()
    emitted = list(_strip_reports([rows, report], sent, "now", task_output_schema(output)))
    assert [b.to_pydict() for b in emitted] == [{"key": ["a", "b"], "count": [1, 2]}]
    assert emitted[0].schema == task_output_schema(output)
    assert [(attempt, InstanceReport.from_json(json.loads(m)).instance) for attempt, m in sent.added] == [("now", 1)]


def test_a_running_query_keeps_the_store_it_started_with_and_says_so_once(caplog):
    from types import SimpleNamespace

    from spark_state.spark.microbatch import MicroBatch

    settings = {"spark.state.store": "/stores/first", "spark.sql.shuffle.partitions": "2"}
    conf = SimpleNamespace(getAll=settings, get=lambda key, default=None: settings.get(key, default))
    session = SimpleNamespace(conf=conf, sparkContext=SimpleNamespace(master="local[2]"))
    stream = SimpleNamespace(keyed=SimpleNamespace(name="counts"))
    batch = MicroBatch(stream, session, "/chk", None, None)
    batch.started_store = batch.conf().store
    settings["spark.state.store"] = "/stores/second"
    with caplog.at_level("WARNING", logger="spark_state.spark.microbatch"):
        stores = [batch.conf().store for _ in range(3)]
    assert stores == ["/stores/first"] * 3
    assert len([r for r in caplog.records if "keeps the store it started with" in r.getMessage()]) == 1


def test_a_session_without_the_internals_or_a_setting_against_them_takes_the_public_path():
    from types import SimpleNamespace

    from spark_state.spark.plan import accelerated

    connect_like = SimpleNamespace(conf=None)  # a Spark Connect session has no JVM in this process
    assert accelerated(connect_like) is False
    broken = SimpleNamespace(_jsparkSession=object(), sparkContext=SimpleNamespace())  # no _jvm: the check fails
    assert accelerated(broken) is False
    assert accelerated(broken, wanted=False) is False
