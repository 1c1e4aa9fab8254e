"""Event time, watermarks and durations of keyed queries. Pure: no I/O, no pyspark.

A keyed query with event time names a column and an allowed delay
(``KeyedStream.withWatermark("ts", "10 minutes")``, like Spark's
``withWatermark``). Times are int64 milliseconds since the epoch: a
timestamp column is converted (any unit and time zone), an integer column is
taken as milliseconds.

The watermark follows Spark's rule. Micro-batch N runs with watermark
``W(N)``, computed after batch N-1: ``W(N) = max(W(N-1), E(N-1) - delay)``,
``E`` the largest event time seen so far (None before any row: no watermark,
nothing is late). A row with event time ``< W(N)`` is *late*: dropped and
counted (``late="drop"``, the default) or handed to the function marked late
(``late="pass"``); event-time timers with a time ``<= W(N)`` fire in batch N.
``W`` and ``E`` are recorded in every checkpoint of the component. Both are
global (the largest event time over all key groups), so a rescale cannot
move them; a drain advances the watermark to ``END_OF_TIME`` for its last
batch only.

Processing time is the batch's timestamp from Spark's offsets log
(``batchTimestampMs``), the same when Spark replays the batch.

An idle source holds the watermark where its last rows left it, so
event-time timers and sessions would wait for the next row. With
``idle_after`` (``withWatermark(..., idle_after="5 minutes")``, Flink's
``withIdleness``) a batch that runs at least that long after the last batch
with rows (``R``, the processing time recorded in the checkpoint) runs with
``max(W(N), E + (P - R) - delay)``, ``P`` its processing time: event time is
taken to pass as the clock does since the last row (``idle_watermark``).
Both ``R`` and ``P`` are recorded, so a replay runs with the same watermark;
the next checkpoint keeps the advance. A row that arrives later with an
event time below the advanced watermark is late, as any late row.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import ConfigError

END_OF_TIME = 2**63 - 1
"""The watermark of a drained batch: every event-time timer is due."""
LATE_POLICIES = ("drop", "pass")

_UNITS_MS = {
    "millisecond": 1,
    "ms": 1,
    "milli": 1,
    "second": 1_000,
    "sec": 1_000,
    "s": 1_000,
    "minute": 60_000,
    "min": 60_000,
    "hour": 3_600_000,
    "h": 3_600_000,
    "day": 86_400_000,
    "d": 86_400_000,
    "week": 604_800_000,
}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)")
_WHOLE = re.compile(r"(\s*\d+(?:\.\d+)?\s*[a-z]+\s*)+")


def parse_duration(text: Any, what: str) -> int:
    """Milliseconds of a Spark-style duration (``"10 minutes"``, ``"1 hour 30 minutes"``, ``"500 ms"``).

    An int is taken as milliseconds, a ``timedelta`` as itself. ``what`` names
    the setting in errors; a malformed or negative duration raises ``ConfigError``.
    """
    bad = ConfigError(f"{what}={text!r} is not a duration; write it like '10 minutes' or '1 hour 30 seconds'")
    if isinstance(text, bool):
        raise bad
    if isinstance(text, int):
        milliseconds = text
    elif isinstance(text, _dt.timedelta):
        milliseconds = round(text.total_seconds() * 1000)
    elif isinstance(text, str):
        cleaned = text.strip().lower().removeprefix("interval").strip()
        if cleaned.startswith("-"):
            raise ConfigError(f"{what}={text!r} is negative; a duration must be >= 0")
        if not _WHOLE.fullmatch(cleaned):
            raise bad
        total = 0.0
        for number, unit in _PART.findall(cleaned):
            if unit not in _UNITS_MS and unit.endswith("s") and unit[:-1] in _UNITS_MS:
                unit = unit[:-1]  # plural
            if unit not in _UNITS_MS:
                raise ConfigError(
                    f"{what}={text!r}: unknown unit {unit!r}; use milliseconds, seconds, minutes, hours, days or weeks"
                )
            total += float(number) * _UNITS_MS[unit]
        milliseconds = round(total)
    else:
        raise bad
    if milliseconds < 0:
        raise ConfigError(f"{what}={text!r} is negative; a duration must be >= 0")
    return milliseconds


@dataclass(frozen=True)
class EventTime:
    """The event-time column of a keyed query, its allowed delay (ms) and what happens to late rows."""

    column: str
    delay_ms: int
    late: str = "drop"
    idle_ms: int | None = None
    """After this much processing time without rows the watermark follows the clock (``idle_watermark``)."""

    def __post_init__(self) -> None:
        if self.late not in LATE_POLICIES:
            raise ConfigError(f"late={self.late!r} is not one of {', '.join(LATE_POLICIES)}")
        if self.delay_ms < 0:
            raise ConfigError(f"the watermark delay must be >= 0 ms, got {self.delay_ms}")
        if self.idle_ms is not None and self.idle_ms <= 0:
            raise ConfigError(
                f"idle_after={self.idle_ms} ms: the idle time must be longer than zero (or None: never idle)"
            )


def check_event_time_type(column: str, kind: pa.DataType) -> None:
    """Refuse an event-time column that is neither a timestamp nor an integer (milliseconds)."""
    if not (pa.types.is_timestamp(kind) or pa.types.is_integer(kind)):
        raise ConfigError(
            f"event-time column {column!r} has type {kind}; it must be a timestamp, or a long of milliseconds "
            "since the epoch: cast it first"
        )


def to_millis(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An event-time column as int64 milliseconds since the epoch (nulls become ``-2**63``: always late)."""
    kind = column.type
    if pa.types.is_timestamp(kind):
        column = column.cast(pa.timestamp("ms", tz=kind.tz), safe=False)
    elif not pa.types.is_integer(kind):
        check_event_time_type("event time", kind)
    values = pc.fill_null(column.cast(pa.int64()), -(2**63))
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def timestamp_millis(value: Any, what: str) -> int:
    """A timer time as int64 milliseconds: an int (ms), a ``datetime`` (naive is UTC) or a pandas Timestamp;
    ``ConfigError`` for anything else, a missing time (``NaT``) and a time outside int64 milliseconds."""
    bad = f"{what}: {value!r} is not a time; give milliseconds since the epoch (an int) or a datetime"
    if isinstance(value, bool) or value is None or type(value).__name__ in ("NaTType", "NAType"):
        raise ConfigError(bad)
    if isinstance(value, (int, np.integer)):
        milliseconds = int(value)
    else:
        if hasattr(value, "to_pydatetime"):
            try:
                value = value.to_pydatetime()
            except (ValueError, OverflowError):
                raise ConfigError(bad) from None
        if not isinstance(value, _dt.datetime):
            raise ConfigError(bad)
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        milliseconds = int(value.timestamp() * 1000)
    if not INT64_MIN <= milliseconds <= INT64_MAX:
        raise ConfigError(f"{what}: {value!r} ms is outside the times a timer can hold (int64 milliseconds)")
    return milliseconds


def next_watermark(watermark: int | None, max_event_time: int | None, delay_ms: int) -> int | None:
    """``W(N+1) = max(W(N), E(N) - delay)``; None while no row has been seen."""
    if max_event_time is None:
        return watermark
    candidate = max_event_time - delay_ms
    return candidate if watermark is None else max(watermark, candidate)


def idle_watermark(
    watermark: int | None,
    max_event_time: int | None,
    rows_at: int | None,
    processing_ms: int,
    event_time: EventTime,
) -> int | None:
    """The watermark a batch at ``processing_ms`` runs with: ``watermark``, advanced with the clock once the source
    has been idle for ``event_time.idle_ms`` since the batch with rows at ``rows_at`` (see the module docstring)."""
    idle = event_time.idle_ms
    if idle is None or max_event_time is None or rows_at is None or processing_ms - rows_at < idle:
        return watermark
    advanced = max_event_time + (processing_ms - rows_at) - event_time.delay_ms
    return advanced if watermark is None else max(watermark, advanced)


def idle_due_at(
    time_ms: int, max_event_time: int | None, rows_at: int | None, event_time: EventTime | None
) -> int | None:
    """The processing time at which an idle watermark reaches ``time_ms`` (``idle_watermark``), None if never."""
    if event_time is None or event_time.idle_ms is None or max_event_time is None or rows_at is None:
        return None
    return max(time_ms - max_event_time + rows_at + event_time.delay_ms, rows_at + event_time.idle_ms)
