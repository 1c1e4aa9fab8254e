"""``format("spark-state-clock")``: a source whose offset moves only when a keyed query has work without rows.

Spark runs a micro-batch only when a source has new data (its own stateful
operators aside), so a processing-time timer, an expiry, an event-time timer
the watermark passed, or a drain request would wait for the next row. A
keyed query joins this source into its stream from its first batch
(``spark.streaming``). It yields no rows; its offset,
``{"source_id": "spark-state-clock:<component>", "wake": W}``, moves when:

- the processing time the latest checkpoint records for the component's next
  work without rows (``ComponentManifest.wake_ms``, ``model.wake``) has
  come and is later than ``W``: the offset becomes that time;
- or a drain request (``store.drain``) appeared that this reader has not
  woken the query for: the offset becomes the current time.

So Spark plans one batch per wake-up and records it in its offsets log (a
replay plans the same batch), and with nothing due the offset stays and Spark
runs no batch for it. Spark takes a batch's processing time after it asks the
sources for their offsets, so the batch a wake-up at ``W`` starts runs at a
processing time of at least ``W``, and what was due by then is done in it.
The store is read at most every ``pollSeconds`` (Spark asks an idle query's
sources for their offsets every few milliseconds); a wake-up already read
is acted on at its time, so only one that a checkpoint records less than
``pollSeconds`` before it is due can be that much late.

Options (set by ``spark.streaming``, not by users): ``store``, ``component``,
``pollSeconds``; the schema is the keyed stream's, so the two union by name.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from datasources.errors import ClockReadError
from spark_state.store.sources import SOURCE_ID_KEY, clock_source_id

NAME = "spark-state-clock"
WAKE = "wake"


class ClockDataSource(DataSource):
    """See the module docstring."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        raise ClockReadError(
            f"format({NAME!r}) is joined into a keyed query by spark-state with the query's schema; "
            "it is not read on its own"
        )

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = self.options
        return ClockReader(options["store"], options["component"], float(options.get("pollSeconds", "1")))


class ClockReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The clock's offsets (see the module docstring); it reads no row.

    Under ``Trigger.AvailableNow`` the clock moves at most once, to what is
    due when the query starts (``prepareForTriggerAvailableNow``): a run that
    finds a timer due or a drain asked gets a batch for it even without rows,
    and ends like any ``availableNow`` run.
    """

    def __init__(self, store: str, component: str, poll_seconds: float, now=time.time, monotonic=time.monotonic):
        self.store, self.component, self.poll_seconds = store, component, poll_seconds
        self.source_id = clock_source_id(component)
        self._now, self._monotonic = now, monotonic
        self._wake: int | None = None  # the latest checkpoint's wake-up, as last read
        self._drains: set[str] = set()  # the drain requests this reader woke the query for
        self._new_drain = False
        self._read_at: float | None = None  # ``monotonic()`` of the last read of the store
        self._reader: Any = None
        self._available_now: int | None = None  # under ``Trigger.AvailableNow``: the one moment it moves to (0: none)

    def initialOffset(self) -> dict:
        return {SOURCE_ID_KEY: self.source_id, WAKE: 0}

    def prepareForTriggerAvailableNow(self) -> None:
        self._read_store()
        now_ms = int(self._now() * 1000)
        due = self._wake if self._wake is not None and self._wake <= now_ms else None
        self._available_now = due if due is not None else (now_ms if self._new_drain else 0)

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        last = int((start or {}).get(WAKE, 0))
        if self._available_now is not None:
            return {SOURCE_ID_KEY: self.source_id, WAKE: max(last, self._available_now)}
        if self._read_at is None or self._monotonic() - self._read_at >= self.poll_seconds:
            self._read_store()
            self._read_at = self._monotonic()
        now_ms = int(self._now() * 1000)
        if self._wake is not None and last < self._wake <= now_ms:
            return {SOURCE_ID_KEY: self.source_id, WAKE: self._wake}
        if self._new_drain:
            self._new_drain = False
            return {SOURCE_ID_KEY: self.source_id, WAKE: max(last + 1, now_ms)}
        return {SOURCE_ID_KEY: self.source_id, WAKE: last}

    def _read_store(self) -> None:
        """The latest checkpoint's wake-up of the component, and whether a drain request is new."""
        from spark_state.errors import SparkStateError
        from spark_state.storage import open_storage
        from spark_state.store.drain import pending_requests
        from spark_state.store.manifestlog import ManifestReader

        try:
            if self._reader is None:
                self._reader = ManifestReader(open_storage(self.store))
            latest = self._reader.latest()
            component = latest.components.get(self.component) if latest is not None else None
            self._wake = component.wake_ms if component is not None else None
            requests = set(pending_requests(self._reader.storage))
        except (SparkStateError, OSError):  # an unreadable store: the query's own batches report it, typed
            return
        if requests - self._drains:
            self._new_drain = True
        self._drains = requests

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return []

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        return iter(())

    def commit(self, end: dict) -> None:
        pass
