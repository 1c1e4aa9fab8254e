"""The campaign's input: keyed events it generates and appends to a replayable log, and its record of them.

The supervisor is the log's only writer. It appends through
``datasources.log.ReplayableLog`` directly (no Spark), each append with the
sink mark ``("campaign", append number)`` so a retried append lands once, and
keeps its own record of every event's split and offset from the commit that
placed it. ``EventLog.verify`` reads the log back and checks it holds every
append exactly once, in order.

Keys are Zipf-skewed (``k<rank>``), uniform over a large range (``u<n>``),
or odd: empty, very long, non-ASCII, with NUL and control characters.
Event times advance with the append sequence, with jitter and some rows far
behind (late once a watermark passes them).
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from datasources.log import ReplayableLog
from datasources.logindex import Commit, LogMeta, SinkMark
from datasources.routing import splits_of_keys
from spark_state.storage import open_storage

SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),
        pa.field("value", pa.int64()),
        pa.field("event_time", pa.timestamp("us", tz="UTC")),
        pa.field("seq", pa.int64()),
    ]
)
NUM_SPLITS = 4
BASE_MS = 1_700_000_000_000
ODD_KEYS = ("", "x" * 5000, "ключ-ü-鍵-🔑", "a\x00b", "\x00", "tab\tnew\nline", " space ", "ÅÆØ" * 40)
ZIPF_RANKS = 40_000
SINK_ID = "campaign"


@dataclass(frozen=True)
class Event:
    key: str
    value: int
    event_ms: int
    seq: int
    split: int
    offset: int


class KeyGenerator:
    """Zipf-skewed keys over ``ZIPF_RANKS`` ranks, uniform keys over a million, and the odd keys."""

    def __init__(self, rng: random.Random, skew: float = 1.1):
        weights = 1.0 / np.arange(1, ZIPF_RANKS + 1) ** skew
        self._cumulative = np.cumsum(weights / weights.sum())
        self._rng = rng

    def key(self) -> str:
        roll = self._rng.random()
        if roll < 0.03:
            return self._rng.choice(ODD_KEYS)
        if roll < 0.35:
            return f"u{self._rng.randrange(1_000_000)}"
        rank = int(np.searchsorted(self._cumulative, self._rng.random()))
        return f"k{min(rank, ZIPF_RANKS - 1)}"


class EventLog:
    """The events log at ``uri`` and the supervisor's record of every event in it."""

    def __init__(self, uri: str, rng: random.Random):
        self.uri = uri
        self.rng = rng
        self.keys = KeyGenerator(rng)
        self.log = ReplayableLog.create(open_storage(uri), LogMeta("events", NUM_SPLITS, SCHEMA))
        self.splits: list[list[Event]] = [[] for _ in range(NUM_SPLITS)]
        self.appends = 0
        self.seq = 0

    def end_offsets(self) -> dict[int, int]:
        return {split: len(events) for split, events in enumerate(self.splits)}

    def events_between(self, start: dict[int, int], end: dict[int, int]) -> list[Event]:
        """The events of ``[start, end)``, split by split, in offset order (the order a batch holds them)."""
        out: list[Event] = []
        for split in range(NUM_SPLITS):
            out.extend(self.splits[split][start.get(split, 0) : end.get(split, 0)])
        return out

    def _generate(self, n: int) -> list[tuple[str, int, int, int]]:
        rows = []
        for _ in range(n):
            self.seq += 1
            jitter = self.rng.randint(-1500, 300)
            if self.rng.random() < 0.04:
                jitter -= self.rng.randint(3000, 20_000)  # far behind: late once the watermark passed it
            rows.append((self.keys.key(), self.rng.randint(-50, 1000), BASE_MS + self.seq * 25 + jitter, self.seq))
        return rows

    def append(self, n: int) -> int:
        """Append ``n`` new events in one commit (retried until it lands, exactly once); returns ``n``."""
        rows = self._generate(n)
        table = pa.table(
            {
                "key": [r[0] for r in rows],
                "value": [r[1] for r in rows],
                "event_time": [dt.datetime.fromtimestamp(r[2] / 1000, dt.timezone.utc) for r in rows],
                "seq": [r[3] for r in rows],
            },
            schema=SCHEMA,
        )
        splits = splits_of_keys(table.column("key"), NUM_SPLITS)
        mark = SinkMark(SINK_ID, self.appends)
        self.appends += 1
        writer = self.log.segment_writer(order=0, max_records=1_000_000)
        per_split: list[list[tuple]] = [[] for _ in range(NUM_SPLITS)]
        for split in range(NUM_SPLITS):
            chosen = np.flatnonzero(splits == split)
            if chosen.size:
                writer.add(split, table.take(pa.array(chosen)).to_batches()[0])
                per_split[split] = [rows[i] for i in chosen]
        staged = writer.finish()
        commit = self.log.append(staged, mark)
        if commit is None:
            raise AssertionError(f"append {mark.batch} was skipped: the log already holds it")
        for ref in sorted(commit.segments, key=lambda r: (r.split, r.start)):
            assert ref.start == len(self.splits[ref.split]), "the log placed an append where the record says not"
        for split, part in enumerate(per_split):
            base = len(self.splits[split])
            self.splits[split].extend(Event(k, v, t, s, split, base + i) for i, (k, v, t, s) in enumerate(part))
        return n

    def reconcile(self) -> int:
        """Take into the record the appends the log holds beyond it (made by a cycle that was interrupted before
        the record was saved); returns how many. Their rows are read back from the log: this run generated them."""
        log = ReplayableLog.open(open_storage(self.uri))
        marks = {}
        for n in log.commits.ids():
            commit = Commit.from_json(log.commits.load(n), log.commits.where(n))
            if commit.sink is not None and commit.sink.sink_id == SINK_ID and commit.sink.batch >= self.appends:
                marks[commit.sink.batch] = commit
        for batch in sorted(marks):
            if batch != self.appends:
                raise AssertionError(f"the log skips append {self.appends}: it holds {sorted(marks)}")
            for ref in sorted(marks[batch].segments, key=lambda r: (r.split, r.start)):
                if ref.start != len(self.splits[ref.split]):
                    raise AssertionError(f"append {batch} does not continue split {ref.split} where the record ends")
                table = log.load_segment(ref)
                times = table.column("event_time").cast(pa.int64()).to_pylist()
                for i, (key, value, micros, seq) in enumerate(
                    zip(
                        table.column("key").to_pylist(),
                        table.column("value").to_pylist(),
                        times,
                        table.column("seq").to_pylist(),
                    )
                ):
                    self.splits[ref.split].append(Event(key, value, micros // 1000, seq, ref.split, ref.start + i))
                    self.seq = max(self.seq, seq)
            self.appends += 1
        return len(marks)

    def verify(self, since: dict[int, int] | None = None) -> list[str]:
        """Problems found reading the log back from ``since`` (default: the start); [] when it matches exactly."""
        log = ReplayableLog.open(open_storage(self.uri))
        index = log.index()
        problems = []
        if index.end_offsets() != self.end_offsets():
            problems.append(f"log ends at {index.end_offsets()}, the record at {self.end_offsets()}")
        marks = index.sinks.get(SINK_ID, -1)
        if marks != self.appends - 1:
            problems.append(f"log holds appends up to {marks}, the record {self.appends - 1}")
        start = since or {s: 0 for s in range(NUM_SPLITS)}
        for batch in log.read_range(start, self.end_offsets()):
            seqs = batch.column("seq").to_pylist()
            splits = batch.column("split").to_pylist()
            offsets = batch.column("offset").to_pylist()
            for seq, split, offset in zip(seqs, splits, offsets):
                if self.splits[split][offset].seq != seq:
                    problems.append(
                        f"split {split} offset {offset} holds seq {seq}, the record {self.splits[split][offset].seq}"
                    )
                    return problems
        return problems
