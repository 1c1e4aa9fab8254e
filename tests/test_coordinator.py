"""The exactly-once decision of every micro-batch, without Spark (``spark_state.driver.coordinator``)."""

from __future__ import annotations

import pytest

from spark_state.driver.coordinator import SparkBatch, check_query_start, plan_batch
from spark_state.errors import (
    CheckpointError,
    NoCheckpointError,
    StateBehindQueryError,
    StateMissingError,
    StateOfAnotherQueryError,
    StateQueryMismatchError,
    StoreOwnedByAnotherQueryError,
)
from spark_state.store.manifest import Manifest, QueryBinding

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


# --------------------------------------------------------------------------- the Coordinator around plan_batch

import pyarrow as pa  # noqa: E402

from spark_state.driver.coordinator import Coordinator  # noqa: E402
from spark_state.errors import IncompatibleCheckpointError, KeyGroupOwnershipError  # noqa: E402
from spark_state.executor.report import InstanceReport  # noqa: E402
from spark_state.executor.resident import ResidentState  # noqa: E402
from spark_state.keyspace import key_group_for, key_group_range  # noqa: E402
from spark_state.model.schema import KeyedSchema  # noqa: E402
from spark_state.storage.memory import MemoryStorage  # noqa: E402
from spark_state.store.manifest import ComponentSpec  # noqa: E402
from spark_state.store.manifestlog import ManifestLog  # noqa: E402
from tests.stores import Store  # noqa: E402

SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])
M = 8


def _reports(store: Store, checkpoint_id: int, parallelism: int, keys: list[str]) -> list[InstanceReport]:
    reports = []
    for i in range(parallelism):
        state = ResidentState(SCHEMA, key_group_range(i, parallelism, M))
        for key in keys:
            g = key_group_for(key, M)
            if g in state.key_group_range:
                state.table.put(g, (key,), (1,))
        blob, items = state.checkpoint(store.blobs, "c", checkpoint_id, i)
        reports.append(InstanceReport(i, blob, items, {"rows_in": len(keys)}))
    return reports


def _coordinator(storage) -> tuple[Coordinator, Store]:
    store = Store(storage)
    return Coordinator(ManifestLog(storage), store="memory://state"), store


def test_a_batch_is_planned_committed_with_its_binding_and_a_replay_commits_nothing():
    coordinator, store = _coordinator(MemoryStorage())
    spec = ComponentSpec("c", M, 2, SCHEMA)
    first = batch(0, 0, 10)
    plan = coordinator.begin(first, spec)
    manifest = coordinator.commit(plan, first, spec, _reports(store, plan.checkpoint_id, 2, ["a", "b", "c"]))
    assert manifest.binding == first.binding() and manifest.sources == first.end
    assert sorted(manifest.components["c"].chains) == sorted({key_group_for(k, M) for k in "abc"})
    replay = coordinator.begin(first, spec)  # the driver died after the commit, before Spark's
    assert replay.replayed and replay.checkpoint_id == 0
    assert coordinator.commit(replay, first, spec, _reports(store, 0, 2, ["a"])) is None
    assert store.committed_ids() == [0]
    report = InstanceReport.from_json(InstanceReport(1, None, None, {"keys": 3}).to_json())
    assert (report.instance, report.blob, report.items, dict(report.info)) == (1, None, None, {"keys": 3})


@pytest.mark.parametrize("instances", [[0], [0, 0, 1], [0, 1, 2]])
def test_a_missing_duplicated_or_foreign_report_commits_nothing(instances):
    coordinator, store = _coordinator(MemoryStorage())
    spec = ComponentSpec("c", M, 2, SCHEMA)
    plan = coordinator.begin(batch(0, 0, 10), spec)
    reports = [InstanceReport(i, None, None) for i in instances]
    with pytest.raises(KeyGroupOwnershipError, match="expected one report from each of 2 instances"):
        coordinator.commit(plan, batch(0, 0, 10), spec, reports)
    assert store.committed_ids() == []


def test_begin_refuses_a_component_that_cannot_continue_its_base():
    coordinator, store = _coordinator(MemoryStorage())
    spec = ComponentSpec("c", M, 2, SCHEMA)
    plan = coordinator.begin(batch(0, 0, 10), spec)
    coordinator.commit(plan, batch(0, 0, 10), spec, _reports(store, 0, 2, ["a"]))
    with pytest.raises(IncompatibleCheckpointError, match="max parallelism is 16"):
        coordinator.begin(batch(1, 10, 20), ComponentSpec("c", 16, 2, SCHEMA))


def test_a_second_query_committing_the_same_checkpoint_is_told_to_use_its_own_store():
    storage = MemoryStorage()
    (one, store), (two, _) = _coordinator(storage), _coordinator(storage)
    spec = ComponentSpec("c", M, 1, SCHEMA)
    plans = [one.begin(batch(0, 0, 10), spec), two.begin(batch(0, 0, 10, query_id="q2"), spec)]
    one.commit(plans[0], batch(0, 0, 10), spec, _reports(store, 0, 1, ["a"]))
    with pytest.raises(StoreOwnedByAnotherQueryError, match="another query owns the state store .* query q1"):
        two.commit(plans[1], batch(0, 0, 10, query_id="q2"), spec, _reports(store, 0, 1, ["b"]))
    assert store.committed_ids() == [0] and store.latest().binding.query_id == "q1"


def test_a_query_whose_store_moved_past_its_plan_is_told_another_query_owns_it():
    """The other query committed several checkpoints while this one ran its first batch."""
    storage = MemoryStorage()
    (one, store), (two, _) = _coordinator(storage), _coordinator(storage)
    spec = ComponentSpec("c", M, 1, SCHEMA)
    late = two.begin(batch(0, 0, 10, query_id="q2"), spec)
    for batch_id in range(3):
        plan = one.begin(batch(batch_id, 10 * batch_id, 10 * batch_id + 10), spec)
        one.commit(
            plan,
            batch(batch_id, 10 * batch_id, 10 * batch_id + 10),
            spec,
            _reports(store, plan.checkpoint_id, 1, ["a"]),
        )
    with pytest.raises(StoreOwnedByAnotherQueryError, match="checkpoint 2 was committed by query q1"):
        two.commit(late, batch(0, 0, 10, query_id="q2"), spec, _reports(store, 0, 1, ["b"]))
    assert store.committed_ids() == [0, 1, 2]
