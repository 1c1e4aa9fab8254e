"""Finding asked keys in a key group's fetched entries, without folding them: binary search and hashing. No I/O.

Used by ``table.KeyGroupTable`` to look up a batch's keys in the chains a
restore fetched (``chain.FetchedChain``), so a batch after a restart converts
to Python objects the keys it touches, not the key groups they are in.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

"""Sorted chains are searched when they hold more than this many rows per key asked, else folded and hashed: a
search hashes the chains' newer entries and costs about twenty Arrow steps per key asked in the oldest ones,
folding and hashing sorts and probes every row."""
NEWER_RATIO = 32


PROBE_FILTER_RATIO = 4
"""``probe`` first keeps only the chains' rows of asked keys when they hold more than this many rows per key
asked; at fewer, hashing all their keys costs less than the filter (a third of it at one row per key asked:
the filter runs per chunk, and the chains' rows come as one chunk per key group)."""


def probe(live: pa.Table, asked_keys: pa.Array) -> pa.ChunkedArray:
    """The value struct (column 1) of each asked key in ``live``, the live rows of a bare table's chains (column 0
    the key, each key once), null where absent. When the chains hold many rows per key asked
    (``PROBE_FILTER_RATIO``), hashes the asked keys (a batch's worth), not the chains (all the state of the key
    groups touched): the chains' keys only probe, and the rows of asked keys are hashed."""
    if live.num_rows > PROBE_FILTER_RATIO * len(asked_keys):
        live = live.filter(pc.is_in(live.column(0), value_set=asked_keys, skip_nulls=False))
    return live.column(1).take(pc.index_in(asked_keys, value_set=live.column(0).combine_chunks(), skip_nulls=False))


def search_entries(
    owner: np.ndarray, asked_keys: pa.Array, entries: Mapping[int, list[tuple[pa.RecordBatch, pa.Array]]]
) -> tuple[np.ndarray, list[pa.Array]]:
    """Find each asked key (``asked_keys[i]`` of key group ``owner[i]``) in its key group's sorted entries.

    ``entries``: per key group, its entries newest first, each with its key
    column in strictly ascending order (``FetchedChain.searchable``).
    Returns the positions of the keys found, and their value structs (a
    tombstone's is null) as arrays in the order of the positions. A key's
    newest row wins.

    A chain's oldest entry holds most of its rows (a full entry; the newer
    ones are the keys changed since). The newer entries of all the chains,
    when they hold at most ``NEWER_RATIO`` rows per key asked, are hashed
    once: each asked key's first row there, newest first within a chain, is
    its newest. Only the keys not found there are searched, in their
    chains' oldest entries (``_search_levels``). A key group's keys are its
    own (its key group is a hash of the key); should an asked key's row be
    another key group's, or the asked keys' type not the entries', every
    level is searched instead. Costs the newer rows plus the keys asked
    times the log of the oldest entries' sizes: the full entries are
    concatenated once, not once per level of chains of different lengths.
    """
    newer = [(g, batch, keys) for g, chain in entries.items() for batch, keys in chain[:-1]]
    sizes = [len(keys) for _, _, keys in newer]
    if not newer or sum(sizes) > NEWER_RATIO * len(asked_keys) or newer[0][2].type != asked_keys.type:
        return _search_levels(owner, asked_keys, entries)
    rows = pa.concat_arrays([keys for _, _, keys in newer])
    at = pc.index_in(asked_keys, value_set=rows)
    at = at.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    hit = at >= 0
    if (np.repeat([g for g, _, _ in newer], sizes)[at[hit]] != owner[hit]).any():
        return _search_levels(owner, asked_keys, entries)
    found = np.flatnonzero(hit)
    values = (
        [pa.concat_arrays([batch.column(1) for _, batch, _ in newer]).take(pa.array(at[hit]))] if len(found) else []
    )
    rest = np.flatnonzero(~hit)
    if len(rest):
        oldest = {g: entries[g][-1:] for g in np.unique(owner[rest]).tolist()}
        more_at, more = _search_levels(owner[rest], asked_keys.take(pa.array(rest)), oldest)
        found, values = np.concatenate([found, rest[more_at]]), values + more
    return found, values


def _search_levels(
    owner: np.ndarray, asked_keys: pa.Array, entries: Mapping[int, list[tuple[pa.RecordBatch, pa.Array]]]
) -> tuple[np.ndarray, list[pa.Array]]:
    """``search_entries`` level by level, newest first: every asked key not found yet is searched in its key
    group's entry at that level, one binary search for all of them at once, each step one Arrow ``take`` and
    ``less`` over the asked keys. Costs the keys asked times the log of the entries' sizes, not their size.
    One array of values per level."""
    pending = np.arange(len(asked_keys))
    depth = {g: len(chain) for g, chain in entries.items()}
    found, values = [], []
    level = 0
    while len(pending):
        groups = [g for g in np.unique(owner[pending]).tolist() if depth[g] > level]
        if not groups:
            break
        sizes = [len(entries[g][level][1]) for g in groups]
        here = pending[np.isin(owner[pending], groups)]  # the keys whose chain has an entry at this level
        if not sum(sizes) or not len(here):
            level += 1
            continue
        keys = pa.concat_arrays([entries[g][level][1] for g in groups])  # one array: fast takes
        starts = np.cumsum([0] + sizes)
        at = np.searchsorted(np.asarray(groups), owner[here])
        low, high = starts[at], starts[at + 1]
        end, last, key = high, len(keys) - 1, asked_keys.take(pa.array(here))
        while (low < high).any():
            middle = (low + high) // 2
            less = pc.less(keys.take(pa.array(np.minimum(middle, last))), key).to_numpy(zero_copy_only=False)
            active = low < high
            low, high = np.where(active & less, middle + 1, low), np.where(active & ~less, middle, high)
        hit = (low < end) & pc.equal(keys.take(pa.array(np.minimum(low, last))), key).to_numpy(zero_copy_only=False)
        if hit.any():
            column = pa.chunked_array([entries[g][level][0].column(1) for g in groups])
            values.append(column.take(pa.array(low[hit])).combine_chunks())
            found.append(here[hit])
        pending = np.setdiff1d(pending, here[hit], assume_unique=True)
        level += 1
    return (np.concatenate(found) if found else np.zeros(0, np.int64)), values
