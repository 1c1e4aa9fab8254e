"""The order of keys in Arrow: sorting a key group's rows by key, and checking that entries are sorted. No I/O.

Entries of a component with one integer, string or binary key column are
written in ascending key order (``KeyedSchema.sorted_key``), so a lookup is a
binary search (``search``) and a merge of two sorted runs one stable sort.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

"""``search_entries`` hashes the entries newer than each chain's oldest when they hold at most this many rows
per key asked, else searches every level."""
LEXSORT_ROWS = 1 << 16
"""Up to this many rows, ``key_order`` sorts in one call; above, run by run (a global sort of millions of rows
misses the cache at every step: ten times slower than sorting each key group's rows on its own), unless the
runs are short (``SHORT_RUN_ROWS``)."""
SHORT_RUN_ROWS = 1 << 10


def key_order(keys: pa.Array | pa.ChunkedArray, sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Positions putting ``keys`` (no nulls) in ascending order within each consecutive run of the given sizes
    (each run keeps its place). Integers are sorted by value, strings and binaries by their bytes."""
    runs = len(sizes)
    short_runs = len(keys) <= SHORT_RUN_ROWS * runs
    if pa.types.is_integer(keys.type):
        values = keys.to_numpy()
        if len(values) <= LEXSORT_ROWS or short_runs:
            run_ids = np.repeat(np.arange(runs, dtype=np.int64), sizes)
            if len(values) and values.dtype != np.uint64:
                low = int(values.min())
                span = int(values.max()) - low + 1
                if span * runs < 1 << 62:  # one sort of (run, key) as one integer: four times a lexsort's speed
                    return np.argsort(run_ids * span + (values.astype(np.int64) - low), kind="stable")
            if len(values) <= LEXSORT_ROWS:
                return np.lexsort((values, run_ids))
        sort = lambda start, n: np.argsort(values[start : start + n], kind="stable")
    else:
        if len(keys) <= LEXSORT_ROWS or short_runs:
            table = pa.table({"run": np.repeat(np.arange(runs), sizes), "key": keys})
            return pc.sort_indices(table, [("run", "ascending"), ("key", "ascending")]).to_numpy()
        sort = lambda start, n: pc.sort_indices(keys.slice(start, n)).to_numpy()
    order, start = np.arange(len(keys)), 0
    for n in sizes:
        if n > 1:
            order[start : start + n] = start + sort(start, n)
        start += n
    return order


def sort_rows(batch: pa.RecordBatch | pa.Table, key: str, sizes: Sequence[int] | None = None):
    """``batch`` with its rows in ascending order of ``key`` within each consecutive run of ``sizes`` rows (all
    rows when None); unchanged when the key column has nulls."""
    column = batch.column(key)
    if column.null_count or batch.num_rows < 2:
        return batch
    return batch.take(pa.array(key_order(column, [batch.num_rows] if sizes is None else sizes)))


def keys_ascending(batches: Sequence[pa.RecordBatch], key: str) -> list[bool]:
    """Whether each batch's (of one schema) keys are in strictly ascending order without nulls, checked in one
    pass over all their keys, not a few Arrow calls per batch: a checkpoint writes an entry for each of hundreds
    of key groups, and a batch after a restore touches the chains of as many."""
    if not batches:
        return []
    at = batches[0].schema.get_field_index(key)  # one schema: by position, a name lookup per batch costs more
    columns = [batch.column(at) for batch in batches]
    keys = pa.chunked_array(columns, columns[0].type)  # not combined: a copy of every key, in a new allocation
    n = len(keys)
    ends = np.cumsum([len(column) for column in columns])
    descents = np.zeros(0, np.int64)
    if n > 1:  # rows i whose next row is not greater (or either is null)
        ascending = pc.fill_null(pc.less(keys.slice(0, n - 1), keys.slice(1)), False)
        descents = pc.indices_nonzero(pc.invert(ascending)).to_numpy().astype(np.int64)
    owners = np.searchsorted(ends, descents, side="right")  # the batch of row i; unsorted if row i + 1 is in it
    unsorted = set(owners[descents + 1 < ends[owners]].tolist()) if len(descents) else set()
    return [not column.null_count and i not in unsorted for i, column in enumerate(columns)]


def keys_ascending_each(batches: Sequence[pa.RecordBatch], key: str) -> list[bool]:
    """``keys_ascending`` of batches whose key columns may differ in type (a chain read from an older blob):
    one pass when they share one, else one per batch."""
    if len({batch.schema.field(key).type for batch in batches}) > 1:
        return [flag for batch in batches for flag in keys_ascending([batch], key)]
    return keys_ascending(batches, key)
