"""The exactly-once decision of every micro-batch, without Spark (``spark_state.coordinator``)."""

from __future__ import annotations

import pytest

from spark_state.coordinator import SparkBatch, check_query_start, plan_batch
from spark_state.errors import (
    CheckpointError,
    NoCheckpointError,
    StateBehindQueryError,
    StateMissingError,
    StateOfAnotherQueryError,
    StateQueryMismatchError,
)
from spark_state.manifest import LEGACY_BINDING_SOURCE, Manifest, QueryBinding

LOG = "replayable:file:///data/events"
CHK_A, CHK_B = "/chk/a", "/chk/b"


def offsets(n: int) -> dict:
    return {"source_id": LOG, "0": n, "1": n}


class History:
    """Manifests committed one per batch by a query, as the driver commits them; newest first retained."""

    def __init__(self, retained: int = 3):
        self.retained = retained
        self.manifests: dict[int, Manifest] = {}

    def commit(self, query_id: str | None, batch_id: int, start: int | None, end: int, location: str = CHK_A):
        checkpoint_id = max(self.manifests, default=-1) + 1
        previous = self.manifests.get(checkpoint_id - 1)
        older = previous.consistent_checkpoints if previous else ()
        starts = {LOG: offsets(start) if start is not None else None}
        self.manifests[checkpoint_id] = Manifest(
            checkpoint_id,
            ((checkpoint_id,) + older)[: self.retained],
            {LOG: offsets(end)},
            {},
            binding=QueryBinding(query_id, "run", batch_id, location, starts),
        )
        return self

    def latest(self) -> Manifest | None:
        return self.manifests[max(self.manifests)] if self.manifests else None

    def load(self, checkpoint_id: int) -> Manifest:
        if checkpoint_id not in self.manifests:
            raise NoCheckpointError(f"checkpoint {checkpoint_id} is gone")
        return self.manifests[checkpoint_id]

    def plan(self, batch: SparkBatch):
        return plan_batch(self.latest(), self.load, batch, store="/state")


def batch(batch_id: int, start: int | None, end: int, query_id: str = "q1", location: str = CHK_A) -> SparkBatch:
    starts = {} if start == "unknown" else {LOG: offsets(start) if start is not None else None}
    return SparkBatch(query_id, "run", batch_id, location, {LOG: offsets(end)}, starts)


def three_batches() -> History:
    return History().commit("q1", 0, 0, 10).commit("q1", 1, 10, 20).commit("q1", 2, 20, 30)


def test_an_empty_store_starts_at_checkpoint_zero():
    plan = History().plan(batch(0, 0, 10))
    assert (plan.checkpoint_id, plan.base, plan.replayed) == (0, None, False)


def test_the_next_batch_of_the_same_query_builds_on_the_latest():
    history = three_batches()
    plan = history.plan(batch(3, 30, 40))
    assert (plan.checkpoint_id, plan.base.checkpoint_id, plan.replayed) == (3, 2, False)


def test_a_batch_committed_before_sparks_commit_is_recomputed_from_the_one_before():
    history = three_batches()
    plan = history.plan(batch(2, 20, 30))
    assert (plan.checkpoint_id, plan.base.checkpoint_id, plan.replayed) == (2, 1, True)
    replay_of_first = History().commit("q1", 0, 0, 10).plan(batch(0, 0, 10))
    assert (replay_of_first.checkpoint_id, replay_of_first.base, replay_of_first.replayed) == (0, None, True)


def test_a_lost_newest_record_is_refused_not_run_on_older_state():
    history = three_batches()
    del history.manifests[2]  # the record of batch 2 is lost; Spark committed batch 2 and now runs 3
    with pytest.raises(StateBehindQueryError, match=r"micro-batches 2\.\.2 are missing"):
        history.plan(batch(3, 30, 40))


def test_a_store_without_checkpoints_under_a_query_that_committed_batches_is_refused():
    with pytest.raises(StateMissingError, match="committed micro-batches 0..4"):
        History().plan(batch(5, 50, 60))


def test_a_new_query_on_an_old_store_reading_from_the_start_is_refused():
    history = three_batches()
    with pytest.raises(StateOfAnotherQueryError) as error:
        history.plan(batch(0, 0, 12, query_id="q2", location=CHK_B))
    message = str(error.value)
    assert '"0": 30' in message and '"0": 0' in message and "startingOffsets='checkpoint'" in message


def test_a_new_query_on_an_old_store_from_the_beginning_of_a_v1_source_is_refused():
    history = three_batches()
    with pytest.raises(StateOfAnotherQueryError, match="the source's beginning"):
        history.plan(batch(0, None, 12, query_id="q2", location=CHK_B))


def test_a_new_query_whose_start_offsets_are_unknown_is_refused():
    history = three_batches()
    with pytest.raises(StateOfAnotherQueryError, match="unknown offsets"):
        history.plan(batch(0, "unknown", 40, query_id="q2", location=CHK_B))


def test_a_new_query_starting_at_the_states_offsets_continues_it():
    history = three_batches()
    plan = history.plan(batch(0, 30, 45, query_id="q2", location=CHK_B))
    assert (plan.checkpoint_id, plan.base.checkpoint_id, plan.replayed) == (3, 2, False)


def test_a_new_query_reading_only_sources_the_state_never_saw_continues_it():
    history = three_batches()
    other = SparkBatch("q2", "run", 0, CHK_B, {"replayable:file:///other": {"0": 5}}, {})
    assert history.plan(other).checkpoint_id == 3


def test_a_changed_offsets_log_under_the_same_query_is_refused():
    history = three_batches()
    with pytest.raises(StateQueryMismatchError, match="changed behind the query's back"):
        history.plan(batch(3, 25, 40))


def test_a_replay_with_other_offsets_than_the_committed_attempt_is_refused():
    history = three_batches()
    with pytest.raises(StateQueryMismatchError, match="end offsets"):
        history.plan(batch(2, 20, 35))
    with pytest.raises(StateQueryMismatchError, match=r"starting offsets set to .*\"0\": 20"):
        history.plan(batch(2, 25, 30))


def test_a_replay_older_than_retention_names_the_setting():
    history = History(retained=2).commit("q1", 0, 0, 10).commit("q1", 1, 10, 20).commit("q1", 2, 20, 30)
    with pytest.raises(CheckpointError, match="spark.state.checkpointsRetained"):
        history.plan(batch(0, 0, 10))


def test_the_replay_of_a_new_querys_first_batch_uses_the_other_querys_checkpoint_as_base():
    history = three_batches().commit("q2", 0, 30, 45, location=CHK_B)
    plan = history.plan(batch(0, 30, 45, query_id="q2", location=CHK_B))
    assert (plan.checkpoint_id, plan.base.checkpoint_id, plan.replayed) == (3, 2, True)


def test_legacy_manifests_are_matched_by_checkpoint_location():
    legacy = Manifest.from_bytes(
        Manifest(0, (0,), {LOG: offsets(10), LEGACY_BINDING_SOURCE: {"checkpoint_location": CHK_A, "batch_id": 0}},
                 {}).to_bytes()
    )
    assert legacy.binding == QueryBinding(None, None, 0, CHK_A) and LEGACY_BINDING_SOURCE not in legacy.sources
    plan = plan_batch(legacy, {0: legacy}.__getitem__, batch(1, 10, 20), store="/state")
    assert (plan.checkpoint_id, plan.replayed) == (1, False)
    with pytest.raises(StateOfAnotherQueryError):
        plan_batch(legacy, {0: legacy}.__getitem__, batch(0, 0, 20, location=CHK_B), store="/state")


def test_query_start_is_refused_early_when_the_store_is_behind_or_empty():
    history = three_batches()
    check_query_start(history.latest(), "q1", 2, checkpoint_location=CHK_A, store="/state")
    check_query_start(history.latest(), "q1", 1, checkpoint_location=CHK_A, store="/state")  # replay ahead
    check_query_start(history.latest(), "q2", 7, checkpoint_location=CHK_B, store="/state")  # checked per batch
    check_query_start(None, None, None, checkpoint_location=CHK_A, store="/state")
    with pytest.raises(StateBehindQueryError):
        check_query_start(history.latest(), "q1", 3, checkpoint_location=CHK_A, store="/state")
    with pytest.raises(StateMissingError):
        check_query_start(None, "q1", 0, checkpoint_location=CHK_A, store="/state")
