"""The exactly-once decision for each micro-batch, without Spark: is it new, a replay, or refused?

Spark runs micro-batch ``b`` of a query only after it committed ``b - 1`` in
its own checkpoint, and replays a failed batch with the same id and offsets.
Our state checkpoints are committed inside the batch, before Spark's commit,
and each records a ``QueryBinding`` (query id, batch id, the offsets the batch
started from; the end offsets are the manifest's ``sources``). So for the
latest state checkpoint ``L`` and Spark's batch ``b`` exactly one of these
holds, and ``plan_batch`` decides by it:

=============================================  =====================================================
``L`` is                                       then
=============================================  =====================================================
absent, ``b == 0``                             fresh: checkpoint 0, empty base
absent, ``b > 0``                              ``StateMissingError``: Spark committed batches whose
                                               state is not here (another store, or a deleted one)
this query's batch ``b - 1``                   fresh: checkpoint ``L + 1`` on base ``L``
this query's batch ``< b - 1``                 ``StateBehindQueryError``: a lost record
this query's batch ``>= b``                    replay of a committed batch: recompute ``b`` from the
                                               checkpoint before the one that committed it, commit
                                               nothing (``CheckpointError`` if retention dropped it)
another query's                                fresh on base ``L`` only if every source the state
                                               recorded starts exactly at the offsets it recorded;
                                               else ``StateOfAnotherQueryError``
=============================================  =====================================================

"This query" means the same Spark query id (stable across restarts of one
``checkpointLocation``). Offsets are compared as parsed JSON values; a source
the state never recorded cannot be counted twice and is not compared (nor is
a query's clock: ``spark.microbatch`` leaves it out of a batch, as it holds no
rows). Every
refusal happens before any task runs, so nothing is written or committed.

``Coordinator`` runs the driver's part of a batch around that decision:
``begin`` (the plan, and the component's compatibility with its base),
``commit`` (one report from every instance, then steps 3-4 of the commit
protocol in ``manifestlog``) and ``cleanup`` (step 5).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spark_state.errors import (
    CheckpointError,
    CorruptBlobError,
    KeyGroupOwnershipError,
    NoCheckpointError,
    StateBehindQueryError,
    StateMissingError,
    StateOfAnotherQueryError,
    StateQueryMismatchError,
    StoreOwnedByAnotherQueryError,
)
from spark_state.executor.report import InstanceReport
from spark_state.model.eventtime import EventTime
from spark_state.model.wake import Due, next_wake
from spark_state.store.manifest import (
    ComponentSpec,
    ComponentUpdate,
    Manifest,
    QueryBinding,
    check_compatible,
    next_manifest,
)
from spark_state.store.manifestlog import FILE_SWEEPS_PER_GRACE, CheckpointExistsError, ManifestLog

UNKNOWN = object()
"""A start offset that could not be determined (as opposed to None: the source's beginning)."""


@dataclass(frozen=True)
class SparkBatch:
    """What Spark says about the micro-batch it is running.

    ``end`` maps each source id to the batch's end offsets (Spark's offsets
    log entry ``batch_id``). ``start`` maps each source id to the offsets the
    batch starts from, None for "the source's beginning"; a source missing
    from ``start`` has unknown start offsets.
    """

    query_id: str | None
    """None only when Spark names no query id (no local property, no ``metadata`` in its checkpoint)."""
    run_id: str | None
    batch_id: int
    checkpoint_location: str
    end: Mapping[str, Any]
    start: Mapping[str, Any] = field(default_factory=dict)
    timestamp_ms: int = 0
    """The batch's processing time (Spark's ``batchTimestampMs``, the same when the batch is replayed)."""

    def binding(self) -> QueryBinding:
        """The binding a checkpoint committed for this batch records."""
        return QueryBinding(self.query_id, self.run_id, self.batch_id, self.checkpoint_location, dict(self.start))


@dataclass(frozen=True)
class BatchPlan:
    """What the driver does with a batch: which checkpoint to write, on which base, and whether to commit."""

    checkpoint_id: int
    base: Manifest | None
    replayed: bool
    restored: bool = False
    """The base is an older retained checkpoint chosen by ``spark.state.restoreFrom``, not the latest."""


def plan_batch(latest: Manifest | None, load: Callable[[int], Manifest], batch: SparkBatch, *, store: str) -> BatchPlan:
    """Decide how to run ``batch`` given the store's latest checkpoint; see the module docstring.

    ``load(checkpoint_id)`` returns a retained manifest (``NoCheckpointError``
    if it is gone); ``store`` names the state store in error messages.
    """
    if latest is None:
        if batch.batch_id > 0:
            raise StateMissingError(
                f"Spark's checkpoint {batch.checkpoint_location} has committed micro-batches 0..{batch.batch_id - 1} "
                f"of query {batch.query_id}, but the state store {store} holds no checkpoint, so their state is "
                "not there. Point spark.state.store at the store that holds it, or start over with a new "
                "checkpointLocation (the sources are then read from their starting offsets)"
            )
        return BatchPlan(0, None, False)
    written = latest.binding
    if written is None or not written.same_query(batch.query_id):
        _check_continues(latest, batch, store)
        return BatchPlan(latest.checkpoint_id + 1, latest, False)
    if written.batch_id == batch.batch_id - 1:
        _check_start_is_recorded_end(latest, batch, store)
        return BatchPlan(latest.checkpoint_id + 1, latest, False)
    if written.batch_id < batch.batch_id - 1:
        raise StateBehindQueryError(
            f"the state store {store} is behind Spark's checkpoint {batch.checkpoint_location}: Spark committed "
            f"micro-batch {batch.batch_id - 1} of query {batch.query_id}, but the newest state checkpoint "
            f"({latest.checkpoint_id}) is of micro-batch {written.batch_id}; the state checkpoints of micro-batches "
            f"{written.batch_id + 1}..{batch.batch_id - 1} are missing (a lost record). Running on would lose their "
            f"updates. Restore the missing files under {store}/checkpoints/ (ids above {latest.checkpoint_id}), "
            "or start a new checkpointLocation whose sources begin at the state's offsets (replayable: option "
            f"startingOffsets='checkpoint' with option stateStore={store!r}), which reprocesses from checkpoint "
            f"{latest.checkpoint_id}"
        )
    return _replay(latest, load, batch, store)


def plan_restore_from(manifests: ManifestLog, batch: SparkBatch, checkpoint_id: int, *, store: str) -> BatchPlan | None:
    """Recovery: the first batch of a new query starts from retained checkpoint ``checkpoint_id``, not the latest.

    None when this query already committed to the store (then the setting is
    spent and ``plan_batch`` decides). Otherwise the newest record may be
    damaged or of another query, and is not read: the batch must be the
    query's first (a new ``checkpointLocation``), its sources must start
    where ``checkpoint_id`` recorded them (replayable: ``startingOffsets``
    ``checkpoint:<id>``), and it commits under the next unused id, on top of
    ``checkpoint_id``; the checkpoints in between are discarded by cleanup.
    """
    try:
        latest = manifests.latest()
    except CorruptBlobError:
        latest = None  # the damage restoreFrom is there to get past
    if latest is not None and latest.binding is not None and latest.binding.same_query(batch.query_id):
        return None
    try:
        base = manifests.load(checkpoint_id)
    except NoCheckpointError as exc:
        raise NoCheckpointError(
            f"spark.state.restoreFrom={checkpoint_id}: {exc}; choose a retained checkpoint id"
        ) from exc
    if batch.batch_id != 0:
        raise StateQueryMismatchError(
            f"spark.state.restoreFrom={checkpoint_id} starts a new query from a retained checkpoint, but "
            f"{batch.checkpoint_location} has committed micro-batches 0..{batch.batch_id - 1} that are not in the "
            f"state store {store}; start the restored query with a new checkpointLocation"
        )
    _check_continues(base, batch, store)
    ids = manifests.ids()
    return BatchPlan(max(ids) + 1 if ids else checkpoint_id + 1, base, False, restored=True)


def check_query_start(
    latest: Manifest | None, query_id: str | None, last_committed: int | None, *, checkpoint_location: str, store: str
) -> None:
    """At query start: refuse early what ``plan_batch`` would refuse at the first batch without offsets.

    ``query_id`` and ``last_committed`` come from Spark's checkpoint (None
    for a new checkpoint location or one without committed batches).
    """
    if query_id is None or last_committed is None:
        return
    if latest is None:
        plan_batch(None, _no_load, SparkBatch(query_id, None, last_committed + 1, checkpoint_location, {}), store=store)
    elif latest.binding is not None and latest.binding.same_query(query_id):
        if latest.binding.batch_id < last_committed:
            plan_batch(
                latest, _no_load, SparkBatch(query_id, None, last_committed + 1, checkpoint_location, {}), store=store
            )


def _no_load(checkpoint_id: int) -> Manifest:
    raise NoCheckpointError(f"checkpoint {checkpoint_id} is not needed to check a query start")


def _show(offsets: Any) -> str:
    if offsets is UNKNOWN:
        return "unknown offsets"
    if offsets is None:
        return "the source's beginning"
    return json.dumps(offsets, sort_keys=True)


def _check_continues(latest: Manifest, batch: SparkBatch, store: str) -> None:
    """A new query may continue another's state only where its sources start at the state's offsets."""
    differ = [
        (source_id, recorded, batch.start.get(source_id, UNKNOWN))
        for source_id, recorded in sorted(latest.sources.items())
        if source_id in batch.end and batch.start.get(source_id, UNKNOWN) != recorded
    ]
    if not differ:
        return
    owner = latest.binding
    who = (
        f"query {owner.query_id or '(unrecorded id)'} of checkpointLocation {owner.checkpoint_location}, "
        f"micro-batch {owner.batch_id}"
        if owner is not None
        else "a query that recorded no binding"
    )
    details = "; ".join(
        f"source {source_id}: the state ends at {_show(recorded)}, this query starts at {_show(start)}"
        for source_id, recorded, start in differ
    )
    raise StateOfAnotherQueryError(
        f"another query owns the state store {store}: it holds state written by {who} (checkpoint {latest.checkpoint_id}); this query "
        f"({batch.query_id}, checkpointLocation {batch.checkpoint_location}) does not continue it: {details}. "
        "Running would count input twice or lose updates. Restart with the checkpointLocation that wrote the "
        "state, or start the sources at the state's offsets (replayable: option startingOffsets='checkpoint' "
        f"with option stateStore={store!r}; other sources: their starting offsets set to the values above), "
        "or set spark.state.store to a new location to start with empty state"
    )


def _check_start_is_recorded_end(latest: Manifest, batch: SparkBatch, store: str) -> None:
    """Batch ``b`` must start where the checkpoint of batch ``b - 1`` recorded its sources' end."""
    for source_id, start in sorted(batch.start.items()):
        recorded = latest.sources.get(source_id, UNKNOWN)
        if recorded is not UNKNOWN and start != recorded:
            raise StateQueryMismatchError(
                f"micro-batch {batch.batch_id} of query {batch.query_id} starts source {source_id} at "
                f"{_show(start)}, but state checkpoint {latest.checkpoint_id} in {store} recorded micro-batch "
                f"{batch.batch_id - 1} ending at {_show(recorded)}; Spark's offsets log "
                f"({batch.checkpoint_location}/offsets) was changed behind the query's back. Restore it, or start "
                "a new checkpointLocation from the state's offsets"
            )


def _replay(latest: Manifest, load: Callable[[int], Manifest], batch: SparkBatch, store: str) -> BatchPlan:
    """Batch ``b`` was committed before Spark recorded it: recompute it from the checkpoint before."""
    retained = latest.consistent_checkpoints
    for position, checkpoint_id in enumerate(retained):
        manifest = load(checkpoint_id)
        binding = manifest.binding
        if binding is None or not binding.same_query(batch.query_id):
            break
        if binding.batch_id != batch.batch_id:
            continue
        _check_same_offsets(manifest, batch, store)
        older = retained[position + 1] if position + 1 < len(retained) else None
        return BatchPlan(checkpoint_id, load(older) if older is not None else None, True)
    raise CheckpointError(
        f"Spark replays micro-batch {batch.batch_id} of query {batch.query_id}, which is older than the retained "
        f"checkpoints of {store} ({list(retained)}); raise spark.state.checkpointsRetained or restart from a new "
        "checkpointLocation"
    )


def _check_same_offsets(committed: Manifest, batch: SparkBatch, store: str) -> None:
    """A replayed batch must read exactly what its committed attempt read, or its output would differ."""
    binding = committed.binding
    assert binding is not None
    pairs = [
        ("end", source_id, committed.sources.get(source_id, UNKNOWN), offsets)
        for source_id, offsets in sorted(batch.end.items())
    ]
    pairs += [
        ("start", source_id, binding.start.get(source_id, UNKNOWN), offsets)
        for source_id, offsets in sorted(batch.start.items())
    ]
    for which, source_id, recorded, now in pairs:
        if recorded is not UNKNOWN and recorded != now:
            raise StateQueryMismatchError(
                f"Spark replays micro-batch {batch.batch_id} of query {batch.query_id} with {which} offsets "
                f"{_show(now)} for source {source_id}, but state checkpoint {committed.checkpoint_id} in {store} "
                f"committed that batch with {_show(recorded)}; the replay would not reproduce its output. Restart "
                f"the query with the source's starting offsets set to {_show(recorded)}"
                if which == "start"
                else f"Spark replays micro-batch {batch.batch_id} of query {batch.query_id} with end offsets "
                f"{_show(now)} for source {source_id}, but state checkpoint {committed.checkpoint_id} in {store} "
                f"committed it with {_show(recorded)}; Spark's offsets log was changed behind the query's back"
            )


@dataclass(frozen=True)
class BatchClock:
    """The times of a batch the driver records for an idle query (``model.wake``): the watermark it ran with,
    its event time (for ``idle_after``) and the kind of its component's time to live (None: none)."""

    watermark_ms: int | None
    event_time: EventTime | None
    ttl_kind: str | None


def _with_wake(
    manifest: Manifest, name: str, clock: BatchClock, reported: Sequence[Mapping[str, int]], batch: SparkBatch
) -> Manifest:
    component = manifest.components[name]
    wake = next_wake(
        Due.over(reported),
        processing_ms=batch.timestamp_ms,
        watermark_ms=component.watermark_ms,
        max_event_time_ms=component.max_event_time_ms,
        rows_at_ms=component.rows_at_ms,
        event_time=clock.event_time,
        ttl_kind=clock.ttl_kind,
    )
    return replace(manifest, components={**manifest.components, name: replace(component, wake_ms=wake)})


def check_reports(reports: Sequence[InstanceReport], parallelism: int) -> None:
    """Exactly one report from each instance ``0 <= i < parallelism``, else nothing may be committed."""
    seen = sorted(report.instance for report in reports)
    if seen != list(range(parallelism)):
        raise KeyGroupOwnershipError(
            f"expected one report from each of {parallelism} instances, got {seen}; not committing"
        )


class Coordinator:
    """The driver's part of every micro-batch around ``plan_batch``, for one state store."""

    def __init__(self, manifests: ManifestLog, *, store: str, clock: Callable[[], float] = time.monotonic):
        self.manifests = manifests
        self.store = store
        self._clock = clock
        self._files_listed: float | None = None  # ``clock()`` at the last cleanup that listed the files

    def plan(self, batch: SparkBatch, *, restore_from: int | None = None) -> BatchPlan:
        """Decide how to run ``batch``: its checkpoint id and the checkpoint it continues.

        With ``restore_from`` (``spark.state.restoreFrom``) a query that has
        not committed to the store yet starts from that retained checkpoint
        (``plan_restore_from``); once it has, the setting changes nothing.
        """
        plan = None
        if restore_from is not None:
            plan = plan_restore_from(self.manifests, batch, restore_from, store=self.store)
        if plan is None:
            plan = plan_batch(self.manifests.latest(), self.manifests.load, batch, store=self.store)
        return plan

    def begin(self, batch: SparkBatch, spec: ComponentSpec, *, restore_from: int | None = None) -> BatchPlan:
        """``plan``, and check that ``spec`` can continue its base's state."""
        plan = self.plan(batch, restore_from=restore_from)
        if plan.base is not None and spec.name in plan.base.components:
            check_compatible(plan.base.components[spec.name], spec)
        return plan

    def commit(
        self,
        plan: BatchPlan,
        batch: SparkBatch,
        spec: ComponentSpec,
        reports: Sequence[InstanceReport],
        *,
        drained: bool = False,
        clock: BatchClock | None = None,
    ) -> Manifest | None:
        """Commit ``plan``'s checkpoint from the instances' reports (steps 3-4); None for a replayed batch.

        A report's ``info["max_event_time_ms"]`` (the largest event time of
        its on-time rows) advances the component's watermark (``next_component``).
        With ``clock`` the checkpoint also records the watermark the batch ran
        with, the processing time of the last batch with rows, and when the
        component next has work without rows (``model.wake``, from the
        reports' ``info["next_due"]``); a drained checkpoint has none.
        """
        check_reports(reports, spec.parallelism)
        if plan.replayed:
            return None
        event_times = [r.info["max_event_time_ms"] for r in reports if r.info.get("max_event_time_ms") is not None]
        arrived = any(max(r.info.get("rows_arrived", 0), r.info.get("rows_received", 0)) for r in reports)
        update = ComponentUpdate(
            spec,
            [r.blob for r in reports if r.blob is not None],
            {r.instance: r.items for r in reports if r.items is not None},
            max(event_times) if event_times else None,
            watermark_ms=clock.watermark_ms if clock is not None else None,
            rows_at_ms=batch.timestamp_ms if arrived else None,
        )
        manifest = next_manifest(
            plan.base,
            plan.checkpoint_id,
            {spec.name: update},
            batch.end,
            binding=batch.binding(),
            committed_at=time.time(),
            drained=drained,
        )
        if clock is not None and not drained:
            manifest = _with_wake(manifest, spec.name, clock, [r.info.get("next_due", {}) for r in reports], batch)
        try:
            return self.manifests.commit(manifest, restored_from=plan.base if plan.restored else None)
        except CheckpointError as exc:
            latest = exc.manifest if isinstance(exc, CheckpointExistsError) else self.manifests.latest()
            if latest is None or latest.checkpoint_id < plan.checkpoint_id:
                raise
            owner = latest.binding
            who = (
                f"query {owner.query_id} (checkpointLocation {owner.checkpoint_location}, micro-batch {owner.batch_id})"
                if owner is not None
                else "a query that recorded no binding"
            )
            raise StoreOwnedByAnotherQueryError(
                f"another query owns the state store {self.store}: checkpoint {latest.checkpoint_id} was committed by "
                f"{who} while this query ({batch.query_id}, checkpointLocation {batch.checkpoint_location}) ran "
                f"micro-batch {batch.batch_id}. Nothing of this batch was committed and this query stops; two "
                "queries must not share a state store and component: give each query its own spark.state.store"
            ) from exc

    def cleanup(self, manifest: Manifest, *, grace_seconds: float) -> list[str]:
        """Step 5: delete what no retained checkpoint needs: records, and unreferenced files once ``grace_seconds``
        old, which it lists at most ``FILE_SWEEPS_PER_GRACE`` times per grace period (every batch with 0)."""
        now = self._clock()
        files = self._files_listed is None or now - self._files_listed >= grace_seconds / FILE_SWEEPS_PER_GRACE
        deleted = self.manifests.cleanup(manifest, grace_seconds=grace_seconds, files=files)
        if files:
            self._files_listed = now
        return deleted
