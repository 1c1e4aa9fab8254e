"""Built-in keyed functions on event time: deduplication within a horizon, and session windows. No pyspark.

Both are ``PythonFunction``s written with the public state API (values,
timers, time to live), as a user could write them.

**Deduplication** (``deduplicate``): the first row of a key is emitted; the
key then remembers it until the watermark passes the row's event time plus
the horizon (an event-time time to live), so a repeat within the horizon is
dropped and the state of quiet keys goes away. "First" is by event time, not
by arrival: among a batch's rows of a new key, the one with the earliest
event time is emitted, ties broken by the row's other columns in order
(nested columns aside). Spark's shuffle delivers a key's rows in any order
(on a cluster, the order blocks are fetched in), so a replayed batch emits
the same row and stores the same event time as its first attempt.

**Session windows** (``sessions``): rows of a key whose event times are at
most ``gap`` apart belong to one session ``[first, last + gap)``; a row that
bridges two sessions merges them, and sessions that touch merge (Spark's
``session_window`` does the same). Each open
session has an event-time timer at its end; when the watermark reaches it the
session closes and one row is emitted: the key, ``session_start``,
``session_end`` and the session's aggregates (``count``, and the ``sum``,
``min`` and ``max`` of a column when one is given).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import ConfigError
from spark_state.executor.columns import EVENT_MS_COLUMN
from spark_state.executor.functions import KeyState, PythonFunction, TimeToLive
from spark_state.model.timers import EVENT, Timer

SESSIONS = "sessions"


def _timestamp(milliseconds: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(milliseconds / 1000, _dt.timezone.utc)


@dataclass(frozen=True)
class Deduplicate:
    """``fn`` of ``deduplicate``: emit a key's first row by event time (see the module docstring), remember the
    key for ``horizon_ms`` of event time."""

    horizon_ms: int

    def __call__(self, key: tuple, rows, state: KeyState):
        if state.exists:
            return None
        first = rows.slice(first_by_event_time(rows), 1)
        event_ms = first.column(EVENT_MS_COLUMN)[0].as_py()
        state.update((event_ms,))
        state.expires = event_ms + self.horizon_ms
        return first.drop_columns([EVENT_MS_COLUMN])


def first_by_event_time(rows: pa.RecordBatch | pa.Table) -> int:
    """Index of the row with the earliest event time, ties broken by the other columns in order (ascending,
    nulls last; nested and dictionary columns, which do not sort, are skipped): the same row whatever order
    ``rows`` arrive in, unless rows differ in skipped columns only."""
    if rows.num_rows == 1:
        return 0
    sortable = [
        name
        for name, field in zip(rows.schema.names, rows.schema)
        if name != EVENT_MS_COLUMN
        and not (
            pa.types.is_nested(field.type)
            or pa.types.is_dictionary(field.type)
            or pa.types.is_null(field.type)
            or isinstance(field.type, pa.ExtensionType)
        )
    ]
    order = pc.sort_indices(rows, sort_keys=[(name, "ascending") for name in [EVENT_MS_COLUMN, *sortable]])
    return order[0].as_py()


def deduplicate_function(horizon_ms: int) -> PythonFunction:
    return PythonFunction(Deduplicate(horizon_ms), style="arrow", ttl=TimeToLive(horizon_ms, EVENT))


def session_fields(column: str | None, value_type: pa.DataType | None) -> tuple[list[pa.Field], list[pa.Field]]:
    """The state's value columns (one list of sessions) and the output columns after the key columns."""
    aggregates = [pa.field("count", pa.int64())]
    if column is not None:
        if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            raise ConfigError(f"session_window aggregates {column!r}, which is {value_type}; it must be numeric")
        total = pa.int64() if pa.types.is_integer(value_type) else pa.float64()
        aggregates += [
            pa.field(f"sum_{column}", total),
            pa.field(f"min_{column}", value_type),
            pa.field(f"max_{column}", value_type),
        ]
    session = pa.struct([pa.field("start", pa.int64()), pa.field("end", pa.int64())] + aggregates)
    outputs = [
        pa.field("session_start", pa.timestamp("us", tz="UTC")),
        pa.field("session_end", pa.timestamp("us", tz="UTC")),
    ] + aggregates
    return [pa.field(SESSIONS, pa.list_(session))], outputs


@dataclass(frozen=True)
class Sessions:
    """``fn`` and ``on_timer`` of ``session_window`` (see the module docstring)."""

    gap_ms: int
    column: str | None
    key_columns: tuple[str, ...]

    def _empty(self, start: int) -> dict:
        session: dict[str, Any] = {"start": start, "end": start, "count": 0}
        if self.column is not None:
            session.update({f"sum_{self.column}": 0, f"min_{self.column}": None, f"max_{self.column}": None})
        return session

    def _add(self, session: dict, event_ms: int, value: Any) -> None:
        session["start"] = min(session["start"], event_ms)
        session["end"] = max(session["end"], event_ms + self.gap_ms)
        session["count"] += 1
        if self.column is not None and value is not None:
            c = self.column
            session[f"sum_{c}"] += value
            session[f"min_{c}"] = value if session[f"min_{c}"] is None else min(session[f"min_{c}"], value)
            session[f"max_{c}"] = value if session[f"max_{c}"] is None else max(session[f"max_{c}"], value)

    def _merge(self, a: dict, b: dict) -> dict:
        merged = dict(a)
        merged["start"], merged["end"] = min(a["start"], b["start"]), max(a["end"], b["end"])
        merged["count"] = a["count"] + b["count"]
        if self.column is not None:
            c = self.column
            merged[f"sum_{c}"] = a[f"sum_{c}"] + b[f"sum_{c}"]
            for name, pick in ((f"min_{c}", min), (f"max_{c}", max)):
                values = [v for v in (a[name], b[name]) if v is not None]
                merged[name] = pick(values) if values else None
        return merged

    def __call__(self, key: tuple, rows, state: KeyState):
        stored = state.get()  # None: the key has no state (``state.exists`` is False)
        sessions = [dict(s) for s in (stored[0] if stored is not None else [])]
        ends_before = {s["end"] for s in sessions}
        times = rows.column(EVENT_MS_COLUMN).to_pylist()
        values = rows.column(self.column).to_pylist() if self.column is not None else [None] * len(times)
        for event_ms, value in sorted(zip(times, values), key=lambda p: p[0]):
            session = self._empty(event_ms)
            self._add(session, event_ms, value)
            keep = []
            for other in sessions:
                if other["start"] <= session["end"] and session["start"] <= other["end"]:
                    session = self._merge(session, other)
                else:
                    keep.append(other)
            sessions = keep + [session]
        sessions.sort(key=lambda s: s["start"])
        ends_after = {s["end"] for s in sessions}
        for end in ends_before - ends_after:
            state.timers.delete(end, EVENT)
        for end in ends_after - ends_before:
            state.timers.register(end, EVENT)
        state.update((sessions,))
        return None

    def on_timer(self, key: tuple, timer: Timer, state: KeyState):
        stored = state.get()
        if stored is None:  # not ``state.exists``
            return None
        sessions = list(stored[0])
        closed = [s for s in sessions if s["end"] == timer.time_ms]
        if not closed:
            return None
        rest = [s for s in sessions if s["end"] != timer.time_ms]
        if rest:
            state.update((rest,))
        else:
            state.remove()
        rows = []
        for s in closed:
            row = dict(zip(self.key_columns, key))
            row.update({k: v for k, v in s.items() if k not in ("start", "end")})
            row["session_start"], row["session_end"] = _timestamp(s["start"]), _timestamp(s["end"])
            rows.append(row)
        return rows


def session_function(gap_ms: int, column: str | None, key_columns: tuple[str, ...]) -> PythonFunction:
    sessions = Sessions(gap_ms, column, key_columns)
    return PythonFunction(sessions, style="arrow", on_timer=sessions.on_timer)
