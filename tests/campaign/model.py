"""What every query shape of the campaign must output, in plain Python, independently of the operator.

A model is fed one micro-batch at a time: the batch's events (in offset
order), its processing time (Spark's ``batchTimestampMs``) and whether it
drained; it returns the batch's output rows as a sorted list of tuples and
keeps its state. Shapes with event time compute the watermark themselves:
batch N runs with ``W(N) = max(W(N-1), E(N-1) - delay)``, ``E`` the largest
event time of the on-time rows seen so far; rows with event time ``< W(N)``
are late and dropped. ``state()`` is the keyed state a drained query must
hold at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.campaign.events import Event

DELAY_MS = 2000
GAP_MS = 500
HORIZON_MS = 3000
TIMER_AFTER_MS = 1000
TTL_MS = 4000
SHAPES = ("count", "sum", "apply", "sessions", "dedup", "timers")


class Model:
    """Base: the watermark bookkeeping of the event-time shapes."""

    event_time = False

    def __init__(self) -> None:
        self.watermark: int | None = None
        self.max_event: int | None = None

    def batch(self, events: list[Event], processing_ms: int, drained: bool) -> list[tuple]:
        watermark = self.watermark
        on_time = [e for e in events if watermark is None or e.event_ms >= watermark] if self.event_time else events
        rows = self.apply(on_time, watermark, processing_ms, drained)
        if self.event_time and on_time:
            top = max(e.event_ms for e in on_time)
            self.max_event = top if self.max_event is None else max(self.max_event, top)
        if self.event_time and self.max_event is not None:
            candidate = self.max_event - DELAY_MS
            self.watermark = candidate if self.watermark is None else max(self.watermark, candidate)
        return sorted(rows)

    def apply(self, events, watermark, processing_ms, drained) -> list[tuple]:
        raise NotImplementedError

    def state(self) -> dict:
        raise NotImplementedError


class CountModel(Model):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def apply(self, events, watermark, processing_ms, drained):
        seen = {}
        for e in events:
            self.counts[e.key] = self.counts.get(e.key, 0) + 1
            seen[e.key] = None
        return [(k, self.counts[k]) for k in seen]

    def state(self):
        return {k: (v,) for k, v in self.counts.items()}


class SumModel(CountModel):
    def apply(self, events, watermark, processing_ms, drained):
        seen = {}
        for e in events:
            self.counts[e.key] = self.counts.get(e.key, 0) + e.value
            seen[e.key] = None
        return [(k, self.counts[k]) for k in seen]


class ApplyModel(Model):
    """(n, total, top seq) per key; emits it for every key of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, tuple[int, int, int]] = {}

    def apply(self, events, watermark, processing_ms, drained):
        seen = {}
        for e in events:
            n, total, top = self.values.get(e.key, (0, 0, -1))
            self.values[e.key] = (n + 1, total + e.value, max(top, e.seq))
            seen[e.key] = None
        return [(k, *self.values[k]) for k in seen]

    def state(self):
        return dict(self.values)


class SessionsModel(Model):
    """Sessions of on-time events at most ``GAP_MS`` apart; a session is emitted once the watermark reaches its end."""

    event_time = True

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[str, list[tuple[int, int]]] = {}  # key -> (event ms, value) not yet in a closed session

    def apply(self, events, watermark, processing_ms, drained):
        for e in events:
            self.pending.setdefault(e.key, []).append((e.event_ms, e.value))
        due = None if drained else watermark
        out = []
        for key in list(self.pending):
            keep = []
            for session in _clusters(sorted(self.pending[key])):
                start, end = session[0][0], session[-1][0] + GAP_MS
                if drained or (due is not None and end <= due):
                    values = [v for _, v in session]
                    out.append((key, start, end, len(session), sum(values), min(values), max(values)))
                else:
                    keep.extend(session)
            if keep:
                self.pending[key] = keep
            else:
                del self.pending[key]
        return out

    def state(self):
        return {k: v for k, v in self.pending.items()}


def _clusters(points: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Sorted points grouped so that each is at most the end (last + gap) of the group so far (touching merges)."""
    groups: list[list[tuple[int, int]]] = []
    end = None
    for point in points:
        if end is not None and point[0] <= end:
            groups[-1].append(point)
            end = max(end, point[0] + GAP_MS)
        else:
            groups.append([point])
            end = point[0] + GAP_MS
    return groups


def _dedup_order(e: Event) -> tuple[int, int, int]:
    return e.event_ms, e.value, e.seq


class DedupModel(Model):
    """A new key's first on-time row by event time is emitted (ties: the smaller value, then the smaller seq: the
    operator orders ties by the other columns, ``key, value, event_time, seq``); the key is remembered until the
    watermark passes that event time + horizon. Arrival order does not count: on a cluster it is the shuffle's."""

    event_time = True

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[str, int] = {}  # key -> event ms of the row emitted

    def apply(self, events, watermark, processing_ms, drained):
        first: dict[str, Event] = {}
        for e in events:
            remembered = self.first.get(e.key)
            if remembered is not None and (watermark is None or remembered + HORIZON_MS > watermark):
                continue
            if e.key not in first or _dedup_order(e) < _dedup_order(first[e.key]):
                first[e.key] = e
        out = []
        for key, e in first.items():
            self.first[key] = e.event_ms
            out.append((key, e.seq))
        if watermark is not None:
            self.first = {k: t for k, t in self.first.items() if t + HORIZON_MS > watermark}
        return out

    def state(self):
        return {k: (t,) for k, t in self.first.items()}


@dataclass
class _Timed:
    n: int | None = None
    expires: int | None = None
    timers: set = field(default_factory=set)


class TimersModel(Model):
    """A count per key whose value expires ``TTL_MS`` of processing time after its last update; each batch a
    key appears in registers an event-time timer at its latest event + ``TIMER_AFTER_MS``, which reports the
    key's count (-1 when it has none) when the watermark reaches it."""

    event_time = True

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, _Timed] = {}

    def _value(self, key: str, now: int) -> int | None:
        entry = self.keys.get(key)
        if entry is None or entry.n is None:
            return None
        return None if entry.expires is not None and entry.expires <= now else entry.n

    def apply(self, events, watermark, processing_ms, drained):
        out = []
        by_key: dict[str, list[Event]] = {}
        for e in events:
            by_key.setdefault(e.key, []).append(e)
        for key, rows in by_key.items():
            n = (self._value(key, processing_ms) or 0) + len(rows)
            entry = self.keys.setdefault(key, _Timed())
            entry.n, entry.expires = n, processing_ms + TTL_MS
            entry.timers.add(max(e.event_ms for e in rows) + TIMER_AFTER_MS)
            out.append((key, n, -1))
        due = []
        for key, entry in self.keys.items():
            due += [(t, key) for t in entry.timers if drained or (watermark is not None and t <= watermark)]
        for t, key in sorted(due):
            self.keys[key].timers.discard(t)
            value = self._value(key, processing_ms)
            out.append((key, -1 if value is None else value, t))
        for key, entry in list(self.keys.items()):
            if entry.n is not None and entry.expires is not None and entry.expires <= processing_ms:
                entry.n = entry.expires = None
            if entry.n is None and not entry.timers:
                del self.keys[key]
        return out

    def state(self):
        return {k: (e.n,) for k, e in self.keys.items() if e.n is not None}


MODELS = {
    "count": CountModel,
    "sum": SumModel,
    "apply": ApplyModel,
    "sessions": SessionsModel,
    "dedup": DedupModel,
    "timers": TimersModel,
}
