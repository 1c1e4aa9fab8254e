"""When an idle keyed query next has work without new rows: its wake-up time. Pure: no I/O, no pyspark.

Spark runs a micro-batch only when a source has new data, so a keyed query
gets none for a processing-time timer, an expiry or an event-time timer the
watermark has passed while its sources are quiet. The driver therefore
records with every checkpoint the processing time at which the component next
has such work (``ComponentManifest.wake_ms``), and the query's clock source
(``datasources.clock``) moves its offset at that time, so Spark plans a batch
then. ``next_wake`` computes it from what the instances reported
(``Due``: the earliest pending time of each kind over all of them) and the
times the next batch will run with:

- a processing-time timer, and an expiry under a processing-time time to
  live, at its time;
- an event-time timer, and an expiry under an event-time time to live, at
  the next batch if the next watermark has reached it (the batch that raised
  the watermark ran the timers it already had); else, with ``idle_after``,
  when the idle watermark reaches it (``eventtime.idle_due_at``); else never
  without rows.

A wake-up is never earlier than one millisecond after the batch's own
processing time: what is due at or before it is due in the next batch, which
runs then. None: nothing is due without rows (the clock stays put, and Spark
runs no batch for it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spark_state.model.eventtime import EventTime, idle_due_at
from spark_state.model.timers import EVENT, EXPIRES, PROCESSING


@dataclass(frozen=True)
class Due:
    """The earliest pending event-time timer, processing-time timer and expiry of a component (None: none)."""

    event: int | None = None
    processing: int | None = None
    expires: int | None = None

    @classmethod
    def over(cls, reported: Iterable[Mapping[str, int]]) -> Due:
        """The earliest of each kind over the instances' reports (``PythonFunction.next_due``)."""
        earliest: dict[str, int] = {}
        for due in reported:
            for kind in (EVENT, PROCESSING, EXPIRES):
                time_ms = due.get(kind)
                if time_ms is not None and (kind not in earliest or time_ms < earliest[kind]):
                    earliest[kind] = int(time_ms)
        return cls(earliest.get(EVENT), earliest.get(PROCESSING), earliest.get(EXPIRES))


def next_wake(
    due: Due,
    *,
    processing_ms: int,
    watermark_ms: int | None,
    max_event_time_ms: int | None,
    rows_at_ms: int | None,
    event_time: EventTime | None,
    ttl_kind: str | None,
) -> int | None:
    """The processing time at which the component next has work without rows (see the module docstring).

    ``processing_ms`` is the batch's processing time; ``watermark_ms``,
    ``max_event_time_ms`` and ``rows_at_ms`` are what the checkpoint records
    for the next batch; ``ttl_kind`` is the time to live's kind (None: none).
    """
    on_clock = [due.processing] + ([due.expires] if ttl_kind == PROCESSING else [])
    on_watermark = [due.event] + ([due.expires] if ttl_kind == EVENT else [])
    candidates = [t for t in on_clock if t is not None]
    for time_ms in on_watermark:
        if time_ms is None:
            continue
        if watermark_ms is not None and time_ms <= watermark_ms:
            candidates.append(processing_ms)
            continue
        idle = idle_due_at(time_ms, max_event_time_ms, rows_at_ms, event_time)
        if idle is not None:
            candidates.append(idle)
    if not candidates:
        return None
    return max(min(candidates), processing_ms + 1)
