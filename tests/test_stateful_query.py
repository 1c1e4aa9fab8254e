"""``StatefulQuery.await_batches``, with stand-ins for Spark's query and the micro-batch it reports from."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from spark_state.spark.streaming import StatefulQuery


class _Query:
    def __init__(self):
        self.isActive = True
        self.error: Exception | None = None
        self.lastProgress: dict | None = None

    def exception(self):
        return self.error


def _stateful():
    query, batch = _Query(), SimpleNamespace(history=[], session=SimpleNamespace(_jsparkSession=object()))  # classic
    return StatefulQuery(query, batch), query, batch


def test_await_batches_returns_once_the_run_completed_that_many():
    stateful, query, batch = _stateful()

    def complete():
        for batch_id in range(3):
            time.sleep(0.05)
            batch.history.append({"batch_id": batch_id})
            query.lastProgress = {"batchId": batch_id}  # Spark's trigger ends after the batch

    thread = threading.Thread(target=complete)
    thread.start()
    assert stateful.await_batches(3, timeout=30)
    assert len(batch.history) == 3
    thread.join()


def test_await_batches_waits_for_spark_to_finish_the_batch_s_trigger():
    """The batch is in ``batches`` once its output is written; Spark reports its progress after that."""
    stateful, query, batch = _stateful()
    batch.history.append({"batch_id": 4})
    query.lastProgress = {"batchId": 3}  # the trigger of batch 4 is not done yet
    assert not stateful.await_batches(1, timeout=0.2)
    query.lastProgress = {"batchId": 4}
    assert stateful.await_batches(1, timeout=5)
    assert stateful.await_batches(0)


def test_await_batches_is_false_at_the_timeout_or_when_the_query_stopped_first():
    stateful, query, batch = _stateful()
    batch.history.append({"batch_id": 0})
    query.lastProgress = {"batchId": 0}
    started = time.monotonic()
    assert not stateful.await_batches(2, timeout=0.2)
    assert 0.2 <= time.monotonic() - started < 5
    query.isActive = False
    assert not stateful.await_batches(2)  # no timeout: returns since nothing more can come
    assert stateful.await_batches(1)


def test_await_batches_raises_the_exception_of_a_failed_query():
    stateful, query, _ = _stateful()
    query.isActive, query.error = False, RuntimeError("the batch failed")
    with pytest.raises(RuntimeError, match="the batch failed"):
        stateful.await_batches(1)
