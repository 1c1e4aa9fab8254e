"""Timers and time to live of keyed state, and how an instance finds the due ones. Pure: no I/O.

A key's timers are part of its state: the ``timers`` state variable
(``TIMERS``) holds, per key, its event-time timers, its processing-time
timers (each a sorted list of distinct int64 milliseconds) and the expiry of
its value under a time to live (``expires``; None without one). Like every
variable it lives in the key's key group, so a rescale moves a key's timers
with its value, and a checkpoint writes them incrementally.

An instance must find the timers due in a batch without scanning its keys.
Every blob entry records, for its key group, the earliest time of each kind
(``TIMER_KINDS``) over the key group's keys when it was written, or an
earlier one (recomputing it over every key costs the key group, so a batch
lowers it by the keys it changed and recomputes it only after a share of the
key group changed: ``ResidentState.timer_bound``); a restore knows each key
group's earliest times from the manifest without folding it.
``TimerIndex`` keeps those for key groups not folded yet, and a heap of
``(time, key group, key)`` for folded ones: a batch folds only key groups
whose earliest timer is due, so its cost follows the due timers, not the
keys. Heap entries are checked against the key's state when they come due
(a deleted or already fired timer is skipped), so deleting is cheap.
``TimerIndex.next_due`` finds the earliest pending time of a kind the same
way: it folds the key group whose bound is earliest and drops the heap's
stale entries until the earliest entry is a live timer, so an idle query
wakes up for timers that exist (``model.wake``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa

from spark_state.errors import ConfigError
from spark_state.model.eventtime import timestamp_millis
from spark_state.model.schema import Key, StateVariable

EVENT, PROCESSING, EXPIRES = "event", "processing", "expires"
TIMER_KINDS = (EVENT, PROCESSING, EXPIRES)
"""Kinds of timers: event time (fire at the watermark), processing time (at the batch time), value expiry (TTL)."""

TIMERS = StateVariable(
    "timers",
    (
        pa.field(EVENT, pa.list_(pa.int64())),
        pa.field(PROCESSING, pa.list_(pa.int64())),
        pa.field(EXPIRES, pa.int64()),
    ),
)
KeyTimers = tuple  # (event times, processing times, expires) of one key; the timers variable's value


@dataclass(frozen=True, order=True)
class Timer:
    """A timer of a key: fires at ``time_ms`` (milliseconds since the epoch) of its ``kind``."""

    time_ms: int
    kind: str


def minima(values: Iterable[KeyTimers]) -> tuple[int | None, int | None, int | None]:
    """The earliest event, processing and expiry time over some keys' timers (None where there is none)."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    event = [times[0] for times, _, _ in values if times]  # each list of times is sorted
    processing = [times[0] for _, times, _ in values if times]
    expires = [time_ms for _, _, time_ms in values if time_ms is not None]
    return (min(event) if event else None, min(processing) if processing else None, min(expires) if expires else None)


def earlier(a: tuple[int | None, ...], b: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """Per kind, the earlier of two ``minima`` results (None where neither has a time)."""
    return tuple(y if x is None else x if y is None else min(x, y) for x, y in zip(a, b))


def with_timer(timers: KeyTimers | None, kind: str, time_ms: int, *, remove: bool = False) -> KeyTimers | None:
    """A key's timers with one event or processing timer added (or removed); None when none are left."""
    event, processing, expires = timers if timers is not None else ((), (), None)
    index = (EVENT, PROCESSING).index(kind)
    current = (event, processing)[index]
    changed = sorted(set(current) - {time_ms}) if remove else sorted(set(current) | {time_ms})
    parts = [list(event), list(processing)]
    parts[index] = changed
    return _none_if_empty((parts[0], parts[1], expires))


def with_expiry(timers: KeyTimers | None, expires: int | None) -> KeyTimers | None:
    event, processing, _ = timers if timers is not None else ((), (), None)
    return _none_if_empty((list(event), list(processing), expires))


def _none_if_empty(timers: KeyTimers) -> KeyTimers | None:
    event, processing, expires = timers
    return None if not event and not processing and expires is None else (event, processing, expires)


class TimerIndex:
    """The due timers of one instance's key groups, per kind; see the module docstring."""

    def __init__(self) -> None:
        self._earliest: dict[str, dict[int, int]] = {kind: {} for kind in TIMER_KINDS}
        self._heaps: dict[str, list[tuple[int, int, int, Key]]] = {kind: [] for kind in TIMER_KINDS}
        self._order = itertools.count()  # ties never compare keys (they may hold None)

    def set_earliest(self, key_group: int, earliest: tuple[int | None, int | None, int | None] | None) -> None:
        """A key group's content was (re)loaded from the store: its earliest times, from its last entry."""
        for kind, time_ms in zip(TIMER_KINDS, earliest or (None, None, None)):
            if time_ms is None:
                self._earliest[kind].pop(key_group, None)
            else:
                self._earliest[kind][key_group] = time_ms

    def push(self, kind: str, time_ms: int, key_group: int, key: Key) -> None:
        """A timer was registered on a folded key group (a duplicate entry is harmless: it is checked when due)."""
        heapq.heappush(self._heaps[kind], (time_ms, key_group, next(self._order), key))

    def due(
        self, kind: str, now_ms: int, fold: Callable[[int], Iterable[tuple[int, Key]]]
    ) -> list[tuple[int, int, Key]]:
        """Every ``(time, key_group, key)`` of ``kind`` with ``time <= now_ms``, in time order, off the heap.

        ``fold(key_group)`` yields ``(time, key)`` for every timer of
        ``kind`` in the key group; it is called for key groups whose
        earliest known timer is due and that were not folded into the heap.
        Entries may name timers deleted since: the caller checks each one.
        """
        earliest, heap = self._earliest[kind], self._heaps[kind]
        for key_group in [g for g, time_ms in earliest.items() if time_ms <= now_ms]:
            del earliest[key_group]
            for time_ms, key in fold(key_group):
                heapq.heappush(heap, (time_ms, key_group, next(self._order), key))
        result = []
        while heap and heap[0][0] <= now_ms:
            time_ms, key_group, _, key = heapq.heappop(heap)
            result.append((time_ms, key_group, key))
        return result

    def next_due(
        self,
        kind: str,
        fold: Callable[[int], Iterable[tuple[int, Key]]],
        live: Callable[[int, int, Key], bool],
    ) -> int | None:
        """The earliest time of a live ``kind`` timer, or None when there is none.

        ``fold`` is ``due``'s; ``live(time, key_group, key)`` says whether a
        heap entry is still a timer of the key. Folds at most the key groups
        whose bound is below the earliest live entry (one, when the bounds are
        exact) and drops the stale entries it passes, which ``due`` would skip.
        """
        earliest, heap = self._earliest[kind], self._heaps[kind]
        while True:
            group = min(earliest, key=earliest.__getitem__) if earliest else None
            if group is not None and (not heap or earliest[group] <= heap[0][0]):
                del earliest[group]
                for time_ms, key in fold(group):
                    heapq.heappush(heap, (time_ms, group, next(self._order), key))
                continue
            while heap and not live(heap[0][0], heap[0][1], heap[0][3]):
                heapq.heappop(heap)
            if heap and (group is None or heap[0][0] < earliest[group]):
                return heap[0][0]
            if not heap and group is None:
                return None

    def pending(self) -> int:
        """Entries known (heap entries plus not-yet-folded key groups): an upper bound on pending timers."""
        return sum(len(h) for h in self._heaps.values()) + sum(len(e) for e in self._earliest.values())


class KeyTimersHandle:
    """A key's timers inside a user function call: register, delete and list; changes are written back."""

    def __init__(self, timers: KeyTimers | None, *, event_time: bool):
        self.value = timers
        self.changed = False
        self._event_time = event_time
        self.registered: list[tuple[str, int]] = []

    def _kind(self, kind: str) -> str:
        if kind not in (EVENT, PROCESSING):
            raise ConfigError(f"timer kind {kind!r} is not one of {EVENT!r}, {PROCESSING!r}")
        if kind == EVENT and not self._event_time:
            raise ConfigError(
                "an event-time timer needs event time: key the stream with .withWatermark(column, delay) first, "
                "or register a processing-time timer (kind='processing')"
            )
        return kind

    def register(self, time, kind: str = EVENT) -> None:
        """Fire ``on_timer`` for this key once the watermark (or the batch's processing time) reaches ``time``."""
        time_ms = timestamp_millis(time, f"a {kind}-time timer")
        self.value = with_timer(self.value, self._kind(kind), time_ms)
        self.changed = True
        self.registered.append((kind, time_ms))

    def delete(self, time, kind: str = EVENT) -> None:
        time_ms = timestamp_millis(time, f"a {kind}-time timer")
        self.value = with_timer(self.value, self._kind(kind), time_ms, remove=True)
        self.changed = True

    def list(self, kind: str | None = None) -> list[Timer]:
        """This key's timers (of one kind, or both), earliest first."""
        if self.value is None:
            return []
        event, processing, _ = self.value
        timers = [Timer(t, EVENT) for t in event] + [Timer(t, PROCESSING) for t in processing]
        return sorted(t for t in timers if kind is None or t.kind == kind)

    def __iter__(self) -> Iterator[Timer]:
        return iter(self.list())
