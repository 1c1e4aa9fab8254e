"""Generator mode: keyed events that are a pure function of ``(seed, split, offset)``.

No pyspark, no I/O. Every replay of the same offsets yields the same rows, in
any process, so benchmarks and tests need no data on disk.

The event at ``offset`` of ``split`` (``0 <= split < num_splits``, ``offset >= 0``):

- ``h1, h2`` = splitmix64 of ``seed * 0x9E3779B97F4A7C15 + split * 0xC2B2AE3D27D4EB4F + offset``
  (and of that value xor ``0xD6E8FEB86659FD93``), all arithmetic mod 2**64.
- ``u = (h1 >> 11) / 2**53`` (uniform in ``[0, 1)``).
- ``rank``: with ``skew == 0``, ``floor(u * keys)``; with ``skew = s > 0``, a
  Zipf-like rank from the inverse CDF of the density ``x**-s`` on ``[1, keys + 1)``
  minus 1. Rank 0 is the hottest key. Always ``0 <= rank < keys``.
- ``key``: ``keyPrefix + rank`` zero-padded to ``max(6, digits(keys - 1))`` digits
  (``"user-000042"``), or ``rank`` itself when ``keyType = long``.
- ``value = h2 % 1000`` (a long in ``[0, 1000)``).
- ``event_time = 2024-01-01T00:00:00Z + offset`` milliseconds (UTC timestamp).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from datasources.errors import ReplayableOptionError
from datasources.logindex import position_schema

KINDS = ("keyed",)
KEY_TYPES = ("string", "long")
DEFAULT_ROWS_PER_SECOND = 1000
BATCH_ROWS = 131072
EVENT_TIME_START_US = 1_704_067_200_000_000
"""2024-01-01T00:00:00Z in microseconds since the epoch."""
EVENT_TIME_STEP_US = 1000

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SPLIT_MULT = np.uint64(0xC2B2AE3D27D4EB4F)
_SECOND_DRAW = np.uint64(0xD6E8FEB86659FD93)


@dataclass(frozen=True)
class GeneratorSpec:
    """A generator's parameters; see the module docstring for the function they define.

    ``rows_per_split`` None means unbounded. ``rows_per_second`` is per split;
    None means all rows at once for a bounded generator and
    ``DEFAULT_ROWS_PER_SECOND`` for an unbounded one.
    """

    kind: str = "keyed"
    num_splits: int = 4
    keys: int = 1000
    key_type: str = "string"
    key_prefix: str = "user-"
    skew: float = 0.0
    seed: int = 0
    rows_per_split: int | None = None
    rows_per_second: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ReplayableOptionError(f"option generator must be one of {KINDS}, got {self.kind!r}")
        if self.num_splits < 1:
            raise ReplayableOptionError(f"option numSplits must be >= 1, got {self.num_splits}")
        if self.keys < 1:
            raise ReplayableOptionError(f"option keys must be >= 1, got {self.keys}")
        if self.key_type not in KEY_TYPES:
            raise ReplayableOptionError(f"option keyType must be one of {KEY_TYPES}, got {self.key_type!r}")
        if not self.skew >= 0:
            raise ReplayableOptionError(f"option skew must be >= 0, got {self.skew}")
        if self.rows_per_split is not None and self.rows_per_split < 0:
            raise ReplayableOptionError(f"option rowsPerSplit must be >= 0, got {self.rows_per_split}")
        if self.rows_per_second is not None and self.rows_per_second < 1:
            raise ReplayableOptionError(f"option rowsPerSecond must be >= 1, got {self.rows_per_second}")

    @property
    def bounded(self) -> bool:
        return self.rows_per_split is not None

    @property
    def key_width(self) -> int:
        return max(6, len(str(self.keys - 1)))

    def schema(self) -> pa.Schema:
        """The payload schema: ``key`` (string or int64), ``value`` (int64), ``event_time`` (timestamp UTC)."""
        key = pa.string() if self.key_type == "string" else pa.int64()
        return pa.schema(
            [
                pa.field("key", key),
                pa.field("value", pa.int64()),
                pa.field("event_time", pa.timestamp("us", tz="UTC")),
            ]
        )

    def available(self, base: Mapping[int, int], elapsed_seconds: float) -> dict[int, int]:
        """The end offsets available ``elapsed_seconds`` after a clock started at offsets ``base``."""
        rate = self.rows_per_second
        limit = self.rows_per_split  # None: unbounded (``bounded`` is False)
        if rate is None and limit is not None:
            return {split: limit for split in range(self.num_splits)}
        grown = int(max(0.0, elapsed_seconds) * (rate or DEFAULT_ROWS_PER_SECOND))
        out = {}
        for split in range(self.num_splits):
            end = base[split] + grown
            out[split] = end if limit is None else max(base[split], min(end, limit))
        return out


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def ranks(spec: GeneratorSpec, u: np.ndarray) -> np.ndarray:
    """Key ranks in ``[0, keys)`` for uniforms ``u`` in ``[0, 1)``."""
    k = spec.keys
    if spec.skew == 0:
        r = np.floor(u * k)
    elif spec.skew == 1.0:
        r = np.floor(np.power(float(k + 1), u)) - 1
    else:
        one_minus = 1.0 - spec.skew
        top = float(k + 1) ** one_minus
        r = np.floor(np.power((top - 1.0) * u + 1.0, 1.0 / one_minus)) - 1
    return np.clip(r, 0, k - 1).astype(np.int64)


def string_keys(prefix: str, width: int, rank: np.ndarray) -> pa.Array:
    """``prefix + zero-padded rank`` as an Arrow string array, built from buffers (no Python loop)."""
    head = np.frombuffer(prefix.encode("utf-8"), dtype=np.uint8)
    length = len(head) + width
    n = len(rank)
    data = np.empty((n, length), dtype=np.uint8)
    data[:, : len(head)] = head
    remaining = rank.copy()
    for column in range(length - 1, len(head) - 1, -1):
        data[:, column] = remaining % 10 + 48
        remaining //= 10
    offsets = np.arange(0, (n + 1) * length, length, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


def generate(
    spec: GeneratorSpec, split: int, start: int, end: int, schema: pa.Schema | None = None, batch_rows: int = BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """Yield the events ``[start, end)`` of ``split`` with ``split`` and ``offset`` columns appended.

    ``schema`` (default: payload + split int32 + offset int64) is attached to every batch.
    """
    if schema is None:
        schema = position_schema(spec.schema())
    seed_part = np.uint64((spec.seed * int(_GOLDEN) + split * int(_SPLIT_MULT)) % (1 << 64))
    for lo in range(start, end, batch_rows):
        hi = min(end, lo + batch_rows)
        offsets = np.arange(lo, hi, dtype=np.int64)
        x = offsets.astype(np.uint64) + seed_part
        h1 = splitmix64(x)
        h2 = splitmix64(x ^ _SECOND_DRAW)
        u = (h1 >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        rank = ranks(spec, u)
        key = string_keys(spec.key_prefix, spec.key_width, rank) if spec.key_type == "string" else pa.array(rank)
        value = pa.array((h2 % np.uint64(1000)).astype(np.int64))
        event_time = pa.array(EVENT_TIME_START_US + offsets * EVENT_TIME_STEP_US, type=pa.timestamp("us", tz="UTC"))
        columns = [key, value, event_time, pa.array(np.full(hi - lo, split, dtype=np.int32)), pa.array(offsets)]
        yield pa.RecordBatch.from_arrays(columns, schema=schema)
