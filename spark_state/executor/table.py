"""One instance's keyed state in memory: per key group, one dict per state variable, with change tracking.

``KeyGroupTable`` holds, for each key group of the instance's range (inclusive
bounds), one dict per state variable of the component's ``KeyedSchema``
(``key -> value``; ``key`` a tuple of key column values, ``value`` a tuple of
the variable's column values). A key has state while any variable holds it.
Every access names the key group; one outside the range raises
``KeyGroupOwnershipError`` (routing and store disagree), never stores it.

It remembers which keys changed since ``take_changes`` was last called, so a
checkpoint writes only those. Restoring is lazy: a key group whose chain was
fetched stays Arrow record batches (``install``) and is folded into dicts by
``restore.apply_entries`` when first accessed, so a restart at a new
parallelism pays per key group a batch touches, not per key of state.

Lazier still, for a component with one state variable and one key column
(the built-in aggregates, and user functions of that shape; such a table is
*bare*: its dicts' keys are the key column's values, not 1-tuples, so no
access hashes or compares a tuple, and a key costs no tuple's memory): ``get_many``
and ``put_many`` (the built-ins' access) look the keys they are given up in
the fetched chains and keep only those keys in the group's dict, an
*overlay* over its chain; a key group is folded whole only when something
needs all of it (a full entry, ``values``, ``items``) or a single-key access
touches it. So a batch after a restart, a rescale or a task on a worker that
did not hold the instance converts to Python objects the keys it touches,
not the key groups they are in. Under one integer, string or binary key
column, whose entries are written sorted (``KeyedSchema.sorted_key``), a
lookup is a binary search per entry, costing the keys asked, not the key
groups' size; other chains (a store written before entries were sorted) are
hashed by one Arrow ``is_in`` over the key groups touched. Key groups looked
up again in later batches are folded a share per batch (``FOLD_SPREAD``), so
that no batch folds every key group it touches.

Memory (``nbytes``, ``evict``, ``release``, ``settle``): a key group is
*loaded* (dicts, or a fetched chain with its overlay) or *cold* (evicted: its
state is only in the store; ``install``, or ``clear`` for one the store has
nothing of, loads it again). Every access to a cold key group raises
``KeyGroupNotLoadedError``, never reads it as empty. With ``keep_arrow`` (a
memory bound), a fetched chain is never folded on a second lookup, and
``settle`` folds the entry a checkpoint wrote into it and drops its overlay:
the key group stays one Arrow table of its live rows, a tenth of its bytes
as dicts.

A *native* table (``native``: the built-in aggregates, bare, under a sorted
key) is served in Arrow, without a Python object per key: ``look_up`` finds
a batch's keys in the Arrow chains, ``put_arrow`` adds each key group's new
rows as a *pending* entry of its chain (a new chain for an empty key group),
``arrow_rows`` and ``arrow_key_rows`` give a checkpoint its entries, and
``settle`` replaces the pending entries with the entry written. Its key
groups stay Arrow chains from batch to batch; a key group something folds
into dicts (a single-key access) is served by the dicts until the checkpoint
writes it in full. No I/O.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import KeyGroupNotLoadedError, KeyGroupOwnershipError
from spark_state.executor.chain import Entries, FetchedChain, as_schema
from spark_state.executor.order import key_order, keys_ascending_each
from spark_state.executor.search import probe, search_entries
from spark_state.keyspace import KeyGroupRange
from spark_state.model.schema import DELETED_COLUMN, Key, KeyedSchema, Value, struct_values
from spark_state.store.blob import EntryKind
from spark_state.store.restore import apply_entries

DICT_ENTRY_BYTES = 64
"""Bytes a dict spends per key beyond its key and value objects (entry, index slot and spare room)."""
SET_ENTRY_BYTES = 48
"""Bytes a set spends per key it holds (slots of hash and pointer, kept at most 60% full)."""
SAMPLED_KEYS = 32
"""Keys whose objects are measured to estimate the bytes per key of a table's dicts."""


FOLD_SPREAD = 8
"""A batch folds into dicts at most 1 / ``FOLD_SPREAD`` of the restored key groups still in Arrow (at least one)
among those it looks up a second time; the others are searched or hashed again."""
SEARCH_RATIO = 4


def _runs(key_groups: Sequence[int] | np.ndarray) -> Iterator[tuple[int, int, int]]:
    """``(key group, start, end)`` of each run of equal consecutive key groups (one per key group when sorted)."""
    groups = np.asarray(key_groups)
    if len(groups) == 0:
        return iter(())
    starts = np.concatenate(([0], np.flatnonzero(groups[1:] != groups[:-1]) + 1))
    ends = np.append(starts[1:], len(groups))
    return zip(groups[starts].tolist(), starts.tolist(), ends.tolist())


@dataclass(frozen=True)
class ChangedRows:
    """The rows one ``put_many`` stored, as Arrow: their key groups, key columns and ``value`` variable columns."""

    key_groups: np.ndarray
    keys: tuple[pa.Array, ...]
    fields: tuple[pa.Array, ...]


class KeyGroupTable:
    """See the module docstring; ``variable`` arguments are indexes into ``schema.variables`` (0: ``value``)."""

    def __init__(
        self, schema: KeyedSchema, key_group_range: KeyGroupRange, *, keep_arrow: bool = False, native: bool = False
    ):
        self.schema = schema
        self.key_group_range = key_group_range
        self._width = len(schema.variables)
        self._groups: dict[int, list[dict[Key, Value]]] = {}
        self._unloaded: dict[int, FetchedChain] = {}
        self._dirty: dict[int, set[Key] | Sequence[Key]] = {}  # a sequence: one ``put_many``'s keys, each once
        self._changed_rows: list[ChangedRows] | None = []  # see ``changed_rows``; None: other changes too
        self._absent: dict[int, set[Key]] = {}  # per unloaded key group: keys looked up its chain does not hold
        self._added: dict[int, int] = {}  # per unloaded key group: keys of ``_absent`` since written (``put_many``)
        self._looked_up: set[int] = set()  # unloaded key groups whose chain a lookup pass already hashed
        # One key column and one variable: the dicts' keys are the key column's values (``held_key``), and
        # lookups keep overlays over fetched chains (``_look_up``).
        self.bare = self._width == 1 and len(schema.key_columns) == 1
        self._cold: set[int] = set()  # evicted key groups: state only in the store
        # ``native``: the built-in aggregates' Arrow access (``look_up``, ``put_arrow``): bare, under a sorted key.
        self.native = native and self.bare and schema.sorted_key is not None
        self.keep_arrow = keep_arrow and self.bare or self.native
        self._bytes_per_key: float | None = None

    # Ownership and lazy folding ---------------------------------------------------------

    def _check(self, key_group: int) -> None:
        if key_group not in self.key_group_range:
            raise KeyGroupOwnershipError(
                f"key group {key_group} is not owned by this instance (owns {self.key_group_range}); "
                "rows were routed with a different parallelism or max parallelism than the store uses"
            )
        if key_group in self._cold:
            self._not_loaded(key_group)

    def _check_all(self, key_groups: Sequence[int] | np.ndarray) -> None:
        if len(key_groups) == 0:
            return
        low, high = (
            (int(key_groups.min()), int(key_groups.max()))
            if isinstance(key_groups, np.ndarray)
            else (min(key_groups), max(key_groups))
        )
        if low < self.key_group_range.start or high > self.key_group_range.end:
            self._check(next(g for g in key_groups if g not in self.key_group_range))
        if self._cold and not self._cold.isdisjoint(key_groups):
            self._not_loaded(next(g for g in key_groups if g in self._cold))

    def _not_loaded(self, key_group: int) -> None:
        raise KeyGroupNotLoadedError(
            f"key group {key_group} was evicted from memory and not loaded again before this access; "
            "nothing was read or written; this is a defect of spark-state, please report it"
        )

    def _group(self, key_group: int) -> list[dict[Key, Value]]:
        """The key group's dicts, folding its fetched chain first if it has one (creates empty dicts).

        A fetched chain is folded under its overlay: the overlay's values win.
        """
        fetched = self._unloaded.pop(key_group, None)
        group = self._groups.get(key_group)
        if fetched is not None and fetched.released:
            self._unloaded[key_group] = fetched
            raise KeyGroupNotLoadedError(
                f"key group {key_group} was released after its lookups and cannot be folded (a defect of "
                "spark-state, please report it); nothing was written"
            )
        if fetched is not None:
            group = self._groups[key_group] = self._content(fetched, group)
            self._absent.pop(key_group, None)
            self._added.pop(key_group, None)
            self._looked_up.discard(key_group)
        elif group is None:
            group = self._groups[key_group] = [{} for _ in range(self._width)]
        return group

    def _content(self, fetched: FetchedChain, overlay: list[dict[Key, Value]] | None) -> list[dict[Key, Value]]:
        """A fetched chain's content as dicts, under its overlay (whose values win)."""
        group: list[dict[Key, Value]] = [{} for _ in range(self._width)]
        apply_entries(group, fetched.batches, self.schema, whole_chain=True, bare=self.bare)
        for values, written in zip(group, overlay or ()):
            values.update(written)
        return group

    def _fold_many(self, key_groups: Sequence[int], keys: Sequence[Key]) -> None:
        """Make the ``value`` of every ``(key_groups[i], keys[i])`` readable from the dicts."""
        if not self._unloaded:
            return
        if isinstance(key_groups, np.ndarray):
            key_groups = key_groups.tolist()
        if not self.bare:
            for key_group in self._unloaded.keys() & set(key_groups):
                self._group(key_group)
            return
        self._look_up(key_groups, keys)

    def _look_up(self, key_groups: Sequence[int], keys: Sequence[Key]) -> None:
        """Copy the chain values of the given keys of unloaded key groups into their overlays.

        A key the overlay already holds is not looked up (the overlay wins);
        one the chain does not hold is remembered in ``_absent`` (counted in
        ``_added`` once written, for ``key_count``). Sorted chains are
        searched (``_search``) when the keys asked are few for their size
        (``SEARCH_RATIO``), others hashed in one Arrow pass. Key groups
        looked up before are folded instead, at most ``FOLD_SPREAD``-th of
        the unloaded ones per call (a dict lookup is a hundred times cheaper
        than a search, and hashing costs the key group every batch; folding
        every key group a batch touches at once made the batch after a
        rescale several times slower than the others). Under a memory bound
        nothing is folded.
        """
        unloaded, groups, absent = self._unloaded, self._groups, self._absent
        wanted: dict[int, list[Key]] = {}
        for g, k in zip(key_groups, keys):
            if g in unloaded:
                overlay = groups.get(g)
                if (overlay is None or k not in overlay[0]) and k not in absent.get(g, ()):
                    wanted.setdefault(g, []).append(k)
        again = [g for g in wanted if g in self._looked_up]
        if again and not self.keep_arrow:  # folded a share per batch: dicts are faster, a fold of all is a spike
            for g in again[: max(1, -(-len(unloaded) // FOLD_SPREAD))]:
                self._group(g)
                del wanted[g]
        self._looked_up.update(wanted)
        sorted_chains = {}
        asked_count = sum(map(len, wanted.values()))
        rows = sum(batch.num_rows for g in wanted for _, batch in unloaded[g].batches)
        if asked_count * SEARCH_RATIO < rows:
            searchable = FetchedChain.searchable_all([unloaded[g] for g in wanted])
            for (g, asked), entries in zip(wanted.items(), searchable):
                if entries is not None and None not in asked:
                    sorted_chains[g] = entries
        if sorted_chains:
            self._search({g: wanted.pop(g) for g in sorted_chains}, sorted_chains)
        if not wanted:
            return
        rows = FetchedChain.live_rows([unloaded[g] for g in wanted], self.schema.key_columns)
        asked = [k for g in wanted for k in wanted[g]]
        asked_keys = pa.array(asked, rows.schema.field(0).type)  # an overlay's table is bare
        # A key lives in one key group, and a folded chain holds it once.
        values = struct_values(probe(rows, asked_keys), len(self.schema.variables[0].fields))
        self._remember([(g, k) for g in wanted for k in wanted[g]], values)

    def _search(self, wanted: dict[int, list[Key]], entries: dict[int, list[tuple[pa.RecordBatch, pa.Array]]]) -> None:
        """``_look_up`` of key groups whose entries are sorted (``FetchedChain.searchable``): ``search_entries``."""
        asked = [k for keys in wanted.values() for k in keys]
        owner = np.repeat(np.fromiter(wanted, np.int64, len(wanted)), [len(keys) for keys in wanted.values()])
        found_at, chunks = search_entries(owner, pa.array(asked, self.schema.keys[0].type), entries)
        width = len(self.schema.variables[0].fields)
        values = [v for chunk in chunks for v in struct_values(chunk, width)]
        missing = np.setdiff1d(np.arange(len(asked)), found_at, assume_unique=True)
        order = np.concatenate([found_at, missing]).tolist()
        owners = owner.tolist()
        self._remember([(owners[i], asked[i]) for i in order], values + [None] * len(missing))

    def _remember(self, asked: list[tuple[int, Key]], values: Sequence[Value | None]) -> None:
        """Record what a lookup found: ``values[i]`` for ``asked[i]``, None where the chain does not hold it."""
        groups, absent = self._groups, self._absent
        for (g, k), value in zip(asked, values):
            if value is not None:
                overlay = groups.get(g)
                if overlay is None:
                    overlay = groups[g] = [{}]
                overlay[0][k] = value
            else:
                missing = absent.get(g)
                if missing is None:
                    missing = absent[g] = set()
                missing.add(k)

    # Access -----------------------------------------------------------------------------

    def held_key(self, key: Key) -> Any:
        """``key`` (a tuple of key column values) as the dicts hold it: its one value when the table is bare."""
        return key[0] if self.bare else key

    def get(self, key_group: int, key: Key, default: Any = None, variable: int = 0) -> Value | Any:
        self._check(key_group)
        if key_group in self._unloaded:
            self._group(key_group)
        group = self._groups.get(key_group)
        return default if group is None else group[variable].get(self.held_key(key), default)

    def put(self, key_group: int, key: Key, value: Value, variable: int = 0) -> None:
        self._check(key_group)
        key = self.held_key(key)
        self._group(key_group)[variable][key] = value
        self._changes(key_group).add(key)
        self._changed_rows = None

    def delete(self, key_group: int, key: Key, variable: int | None = None) -> None:
        """Remove ``key`` from one variable, or (``variable=None``) all of its state."""
        self._check(key_group)
        key = self.held_key(key)
        group = self._group(key_group)
        targets = group if variable is None else [group[variable]]
        removed = [values.pop(key) for values in targets if key in values]
        if removed:
            self._changes(key_group).add(key)
            self._changed_rows = None

    def _changes(self, key_group: int) -> set[Key]:
        """The set of the key group's changed keys, to add to (made from the list one ``put_many`` left)."""
        changed = self._dirty.get(key_group)
        if changed is None:
            changed = self._dirty[key_group] = set()
        elif not isinstance(changed, set):
            changed = self._dirty[key_group] = set(changed)
        return changed

    def get_many(self, key_groups: Sequence[int], keys: Sequence[Any], default: Any = None) -> list[Value | Any]:
        """``[get(g, k, default) for g, k in zip(key_groups, keys)]`` for the ``value`` variable.

        ``keys`` as the dicts hold them (``held_key``), as for ``put_many``.
        """
        self._check_all(key_groups)
        self._fold_many(key_groups, keys)
        empty: tuple[dict[Key, Value]] = ({},)
        found: list[Value | Any] = []
        groups = self._groups
        for g, start, end in _runs(key_groups):
            values = groups.get(g, empty)[0]
            if default is None:
                found.extend(map(values.get, keys[start:end]))
            else:
                found.extend(map(values.get, keys[start:end], itertools.repeat(default, end - start)))
        return found

    def put_many(
        self,
        key_groups: Sequence[int],
        keys: Sequence[Any],
        values: Sequence[Value],
        *,
        key_columns: Sequence[pa.Array] | None = None,
        value_columns: Sequence[pa.Array] | None = None,
    ) -> None:
        """``put(g, k, v)`` of the ``value`` variable for each ``(g, k, v)`` of the zipped sequences.

        ``keys`` as the dicts hold them (``held_key``: bare values for a bare
        table, which a caller with the key column builds without tuples).

        ``key_columns`` and ``value_columns``, the same keys and values (each
        key once, no value None) as Arrow columns, let a checkpoint write the
        rows without reading them back from the dicts (``changed_rows``); a
        key group with no change before keeps its changed keys as the list
        of them (``take_changes``), not as a set built key by key.
        """
        self._check_all(key_groups)
        self._fold_many(key_groups, keys)
        once = key_columns is not None and value_columns is not None
        if key_columns is None or value_columns is None or self._changed_rows is None:  # not ``once``, or other changes
            self._changed_rows = None
        else:
            self._changed_rows.append(ChangedRows(np.asarray(key_groups), tuple(key_columns), tuple(value_columns)))
        groups, dirty, width, absent = self._groups, self._dirty, self._width, self._absent
        for g, start, end in _runs(key_groups):
            group = groups.get(g)
            if group is None:
                group = groups[g] = [{} for _ in range(width)]
            group[0].update(zip(keys[start:end], values[start:end]))
            if absent.get(g):  # keys the chain does not hold, now in the overlay
                added = absent[g].intersection(keys[start:end])
                absent[g] -= added
                self._added[g] = self._added.get(g, 0) + len(added)
            if once and g not in dirty:
                dirty[g] = keys[start:end]  # each key once: the list is the set of changed keys
            else:
                self._changes(g).update(keys[start:end])

    # Arrow access (``native``: the built-in aggregates) ----------------------------------------

    def native_groups(self, key_groups: Sequence[int] | np.ndarray) -> np.ndarray:
        """Which of ``key_groups`` ``look_up`` and ``put_arrow`` serve: held as an Arrow chain (not released)
        or empty, without dicts."""
        groups, cold, unloaded = self._groups, self._cold, self._unloaded
        return np.fromiter(
            (
                g not in groups and g not in cold and not (g in unloaded and unloaded[g].released)
                for g in np.asarray(key_groups).tolist()
            ),
            bool,
            len(key_groups),
        )

    def look_up(self, key_groups: np.ndarray, keys: pa.Array) -> pa.Array:
        """The ``value`` struct of each ``(key_groups[i], keys[i])`` as Arrow, null where the key has none.

        For key groups ``native_groups`` allows, keys without nulls. Nothing
        is converted to Python objects: sorted chains are searched when the
        keys asked are few for their rows (``SEARCH_RATIO``,
        ``search_entries``), others folded and hashed in one Arrow pass.
        """
        self._check_all(key_groups)
        value_type = self.schema.blob_schema.field(1).type
        unloaded = self._unloaded
        present = [g for g in np.unique(key_groups).tolist() if g in unloaded]
        if not present:
            return pa.nulls(len(keys), value_type)
        index = np.flatnonzero(np.isin(key_groups, present))
        asked = keys if len(index) == len(keys) else keys.take(pa.array(index))
        chains = {g: unloaded[g] for g in present}
        rows = sum(batch.num_rows for chain in chains.values() for _, batch in chain.batches)
        entries = (
            dict(zip(chains, FetchedChain.searchable_all(list(chains.values()))))
            if len(index) * SEARCH_RATIO < rows
            else {}
        )
        if entries and None not in entries.values():
            found_at, chunks = search_entries(np.asarray(key_groups)[index], asked, entries)
            at = np.full(len(index), -1, np.int64)
            at[found_at] = np.arange(len(found_at))
            found = (pa.concat_arrays(chunks) if chunks else pa.array([], value_type)).take(pa.array(at, mask=at < 0))
        else:
            found = probe(FetchedChain.live_rows(list(chains.values()), self.schema.key_columns), asked)
            found = found.combine_chunks()
        if len(index) == len(keys):
            return found
        where = np.full(len(keys), -1, np.int64)
        where[index] = np.arange(len(index))
        return found.take(pa.array(where, mask=where < 0))

    def put_arrow(
        self, key_groups: np.ndarray, keys: pa.Array, value_columns: Sequence[pa.Array], new_keys: np.ndarray
    ) -> None:
        """Set the ``value`` of each ``(key_groups[i], keys[i])`` from Arrow columns, without Python objects.

        For key groups ``native_groups`` allows, ``key_groups`` ascending,
        keys without nulls, each once; ``new_keys[i]``: the key had no
        value. Each key group's rows, sorted by key, become a pending entry
        of its chain (a new chain for an empty key group), which the
        checkpoint's entry replaces (``settle``), and the rows the
        checkpoint writes (``changed_rows``).
        """
        self._check_all(key_groups)
        runs = list(_runs(key_groups))
        if not runs:
            return
        order = pa.array(key_order(keys, [end - start for _, start, end in runs]))
        keys, value_columns = keys.take(order), [column.take(order) for column in value_columns]
        new_keys = np.asarray(new_keys)[order.to_numpy()]
        if self._changed_rows is not None:
            self._changed_rows.append(ChangedRows(np.asarray(key_groups), (keys,), tuple(value_columns)))
        batch = self.schema.fields_to_batch([keys], value_columns)
        held = keys.to_pylist()
        added = np.add.reduceat(new_keys.astype(np.int64), [start for _, start, _ in runs]).tolist()
        unloaded, dirty = self._unloaded, self._dirty
        for (g, start, end), new in zip(runs, added):
            rows = batch.slice(start, end - start)
            chain = unloaded.get(g)
            if chain is None:
                chain = unloaded[g] = FetchedChain(g, [("full", rows)], self.schema)
                chain.pending, chain._live = 1, end - start
            else:
                chain.add_pending(rows, new)
            self._absent.pop(g, None)
            self._added.pop(g, None)
            self._looked_up.discard(g)
            if g in dirty:
                self._changes(g).update(held[start:end])
            else:
                dirty[g] = held[start:end]

    def arrow_rows(self, key_groups: Sequence[int]) -> tuple[pa.RecordBatch, list[int]] | None:
        """The live rows of Arrow-held key groups (``native_groups``, holding a chain) as one blob-schema batch.

        Each key group's rows together, in the given order, by ascending
        key, and each one's row count: their full entries. A key group whose
        pending entry rewrote every key it holds gives that entry
        (``FetchedChain.whole_pending``); the others are folded by one sort of
        all their entries' rows by (key group, key, age) (a key's newest row
        wins; a tombstone removes it). None when a key is null.
        """
        schema = self.schema.blob_schema
        rows_of = {g: batch for g in key_groups if (batch := self._unloaded[g].whole_pending()) is not None}
        rest = [g for g in key_groups if g not in rows_of]
        if rest:
            folded = self._folded_rows(rest)
            if folded is None:
                return None
            if not rows_of:
                return folded
            rows, sizes = folded
            starts = np.cumsum([0, *sizes[:-1]]).tolist()
            rows_of.update((g, rows.slice(start, n)) for g, start, n in zip(rest, starts, sizes))  # their folds
        batches = [as_schema(rows_of[g], schema) for g in key_groups]
        return pa.concat_batches(batches), [batch.num_rows for batch in batches]

    def _folded_rows(self, key_groups: Sequence[int]) -> tuple[pa.RecordBatch, list[int]] | None:
        """``arrow_rows`` of ``key_groups`` by folding all their entries' rows in one sort."""
        schema = self.schema.blob_schema
        batches: list[pa.RecordBatch] = []
        runs: list[int] = []
        for g in key_groups:
            chain = self._unloaded[g].batches
            batches.extend(as_schema(b, schema) for _, b in chain)
            runs.append(sum(b.num_rows for _, b in chain))
        table = pa.Table.from_batches(batches, schema).combine_chunks()
        key = table.column(0).combine_chunks()
        if key.null_count:
            return None
        order = key_order(key, runs)  # stable: a key's rows stay oldest first
        ordered = key.take(pa.array(order))
        newest = np.ones(len(order), bool)  # a key group's last row never equals the next one's first key
        if len(order) > 1:
            newest[:-1] = pc.not_equal(ordered.slice(0, len(order) - 1), ordered.slice(1)).to_numpy(
                zero_copy_only=False
            )
        keep = newest & ~table.column(DELETED_COLUMN).combine_chunks().to_numpy(zero_copy_only=False)[order]
        sizes = np.bincount(np.repeat(np.arange(len(runs)), runs)[order][keep], minlength=len(runs))
        rows = table.take(pa.array(order[keep]))
        return pa.RecordBatch.from_arrays([c.combine_chunks() for c in rows.columns], schema=schema), sizes.tolist()

    def arrow_key_rows(
        self, key_groups: Sequence[int], keys: Sequence[Collection[Key]]
    ) -> tuple[pa.RecordBatch, list[int]]:
        """The rows of the given keys of Arrow-held key groups (``keys[i]`` of ``key_groups[i]``), no key None,
        as one blob-schema batch, each key group's together by ascending key (a key without a value: a
        tombstone), and each one's row count: their delta or merge entries."""
        sizes = [len(chosen) for chosen in keys]
        owners = np.repeat(np.asarray(key_groups, np.int64), sizes)
        asked = pa.array([k for chosen in keys for k in chosen], self.schema.keys[0].type)
        asked = asked.take(pa.array(key_order(asked, sizes)))
        values = self.look_up(owners, asked)
        deleted = values.is_null()
        batch = pa.RecordBatch.from_arrays([asked, values, deleted], schema=self.schema.blob_schema)
        return batch, sizes

    def values(self, key_group: int, variable: int) -> dict[Key, Value]:
        """One variable's ``key -> value`` of a key group (folds it; do not change the dict, use put/delete).

        The keys as the dicts hold them (``held_key``).
        """
        self._check(key_group)
        return self._group(key_group)[variable]

    def items(self, variable: int = 0) -> Iterator[tuple[int, Key, Value]]:
        """Every ``(key_group, key, value)`` of one variable, by key group (none may be cold).

        Reads fetched chains without folding them into the table.
        """
        if self._cold:
            self._not_loaded(min(self._cold))
        for key_group in sorted(self._groups.keys() | self._unloaded.keys()):
            fetched = self._unloaded.get(key_group)
            if fetched is not None and fetched.released:
                raise KeyGroupNotLoadedError(f"key group {key_group} was released and cannot be read (a defect)")
            group = self._groups[key_group] if fetched is None else self._content(fetched, self._groups.get(key_group))
            for key, value in group[variable].items():
                yield key_group, (key,) if self.bare else key, value

    def __len__(self) -> int:
        """Keys with any state in the loaded key groups (a cold key group's keys are in the store only)."""
        unloaded = self._unloaded
        loaded = sum(len(_keys(group)) for g, group in self._groups.items() if g not in unloaded)
        return loaded + sum(self._unloaded_count(g) for g in unloaded)

    def has_keys(self) -> bool:
        """``len(self) > 0`` without counting: stops at the first key group holding a key."""
        unloaded = self._unloaded
        return any(any(group) for g, group in self._groups.items() if g not in unloaded) or any(
            self._unloaded_count(g) for g in unloaded
        )

    def _unloaded_count(self, key_group: int) -> int:
        """Keys of an unloaded key group: its chain's live keys, and the overlay's keys the chain lacks."""
        return self._unloaded[key_group].live_keys() + self._added.get(key_group, 0)

    # Checkpointing ----------------------------------------------------------------------

    def take_changes(self) -> dict[int, set[Key] | Sequence[Key]]:
        """The keys changed per key group since the last call, which clears them (each key once, as the dicts
        hold it, in a set or a sequence: test membership only after making a set)."""
        changes, self._dirty, self._changed_rows = self._dirty, {}, []
        return changes

    def changed_rows(self) -> ChangedRows | None:
        """Every change since ``take_changes`` as Arrow rows, when ``put_many`` with ``columns`` and ``put_arrow``
        made them all (their rows concatenated: a key put twice makes more rows than changed keys, which
        ``resident`` checks).

        None when anything else changed the table since (a ``put``, a
        ``delete``, a ``put_many`` without columns, a key group cleared or
        replaced).
        """
        rows = self._changed_rows
        if not rows:
            return None
        if len(rows) == 1:
            return rows[0]
        return ChangedRows(
            np.concatenate([r.key_groups for r in rows]),
            tuple(pa.concat_arrays(list(c)) for c in zip(*(r.keys for r in rows))),
            tuple(pa.concat_arrays(list(c)) for c in zip(*(r.fields for r in rows))),
        )

    def recorded_count(self, key_group: int) -> int | None:
        """The keys ``key_group`` holds, for its entry to record (``BlobEntry.live``), when known exactly
        without counting: a bare table's dict, or a chain with no overlay whose count is known. None otherwise
        (several variables, an overlay, a cold key group, a chain not counted yet)."""
        if not self.bare or key_group in self._cold:
            return None
        fetched = self._unloaded.get(key_group)
        if fetched is None:  # a bare table's dict (or nothing): its size is exact
            return self.key_count(key_group)
        if key_group in self._groups or key_group in self._added or fetched.released:
            return None
        return fetched._live

    def key_count(self, key_group: int) -> int:
        """The keys ``key_group`` holds; with several variables, the most any one holds, without visiting a key.

        Exact when one variable holds every key (a value with timers: its
        timers are on keys with a value), else below the keys the variables
        hold together; 0 exactly when the key group is empty.
        """
        if key_group in self._unloaded:
            return self._unloaded_count(key_group)
        return max(map(len, self._groups[key_group])) if key_group in self._groups else 0

    def rows(self, key_group: int, keys: Collection[Key] | None = None) -> tuple[list[Key], list[list[Value | None]]]:
        """The given keys (all keys when None) and, per variable, their values (None where absent).

        Keys as the dicts hold them (``held_key``), given and returned.

        Keys an unloaded key group's overlay holds are served from it;
        anything else folds the key group first.
        """
        overlay = self._groups.get(key_group) if key_group in self._unloaded else None
        if overlay is not None and keys is not None and all(key in overlay[0] for key in keys):
            chosen = list(keys)
            return chosen, [list(map(values.get, chosen)) for values in overlay]
        group = self._group(key_group)
        if keys is None and len(group) == 1:  # every key of one variable: the dict as it is
            return list(group[0]), [list(group[0].values())]
        chosen = list(_keys(group)) if keys is None else list(keys)
        return chosen, [list(map(values.get, chosen)) for values in group]

    def drop_if_empty(self, key_group: int) -> None:
        group = self._groups.get(key_group)
        if group is not None and not any(group):
            del self._groups[key_group]
            self._absent.pop(key_group, None)
            self._added.pop(key_group, None)

    # Restoring --------------------------------------------------------------------------

    def install(self, key_group: int, fetched: FetchedChain) -> None:
        """Replace a key group's content by a fetched whole chain, folded on first access."""
        if key_group not in self.key_group_range:
            self._check(key_group)
        self._cold.discard(key_group)
        self._groups.pop(key_group, None)
        if self._dirty.pop(key_group, None) is not None:
            self._changed_rows = None
        self._absent.pop(key_group, None)
        self._added.pop(key_group, None)
        self._looked_up.discard(key_group)
        self._unloaded[key_group] = fetched

    def apply(self, key_group: int, batches: Entries) -> None:
        """Apply fetched delta entries on top of the key group's content (a native table's chain: appended)."""
        self._check(key_group)
        fetched = self._unloaded.get(key_group)
        if self.native and fetched is not None and not fetched.released and key_group not in self._groups:
            fetched.extend(batches)
            return
        apply_entries(self._group(key_group), batches, self.schema, whole_chain=False, bare=self.bare)
        self.drop_if_empty(key_group)

    def clear(self, key_group: int) -> None:
        """Make the key group empty (loaded, no state)."""
        self._cold.discard(key_group)
        self._groups.pop(key_group, None)
        self._unloaded.pop(key_group, None)
        if self._dirty.pop(key_group, None) is not None:
            self._changed_rows = None
        self._absent.pop(key_group, None)
        self._added.pop(key_group, None)
        self._looked_up.discard(key_group)

    # Memory -----------------------------------------------------------------------------

    @property
    def cold(self) -> set[int]:
        """The evicted key groups (do not change the set: use ``evict``, ``install``, ``clear``)."""
        return self._cold

    def evict_all(self) -> None:
        """Make every key group of the range cold (a state whose chains are loaded when touched)."""
        if self._dirty:
            raise KeyGroupNotLoadedError("cannot evict a table with changes not yet checkpointed (a defect)")
        for key_group in list(self._groups) + list(self._unloaded):
            self.clear(key_group)
        self._cold = set(range(self.key_group_range.start, self.key_group_range.end + 1))

    def evict(self, key_group: int) -> None:
        """Drop a key group's content; it must have no change since ``take_changes`` (it is in the store)."""
        if key_group in self._dirty:
            raise KeyGroupNotLoadedError(
                f"key group {key_group} has changes not yet checkpointed and cannot be evicted (a defect)"
            )
        self.clear(key_group)
        self._cold.add(key_group)

    def release(self, key_groups: Iterable[int]) -> None:
        """Drop the Arrow chains of the given fetched key groups; their overlays answer for the keys looked up.

        A released key group serves ``get_many``/``put_many``/``rows`` of the
        keys already looked up, and counts its keys; anything needing its
        chain raises ``KeyGroupNotLoadedError``. A checkpoint writes its full
        entries from the store (``resident.StoredChains``); after it, the key
        group is evicted. Bounds a batch's memory to its overlays.
        """
        for key_group in key_groups:
            fetched = self._unloaded.get(key_group)
            if fetched is not None:
                fetched.release()

    def released(self) -> list[int]:
        return [g for g, fetched in self._unloaded.items() if fetched.released]

    def arrow_held(self, key_group: int) -> bool:
        """Whether the key group is an Arrow chain alone: fetched or written in Arrow, not released, no dicts."""
        fetched = self._unloaded.get(key_group)
        return fetched is not None and not fetched.released and key_group not in self._groups

    def is_released(self, key_group: int) -> bool:
        fetched = self._unloaded.get(key_group)
        return fetched is not None and fetched.released

    def settle(self, entries: Sequence[tuple[int, EntryKind, pa.RecordBatch]]) -> None:
        """After a checkpoint wrote ``entries`` (``(key_group, kind, rows)``): keep their key groups as Arrow
        (``_settle``). The entries' keys are checked sorted once, all together: a chain's next search then
        checks none of them (a first batch of millions of keys otherwise made the next one check them all,
        and each compaction the whole chain it compacted)."""
        key = self.schema.sorted_key
        ascending = (
            keys_ascending_each([written for _, _, written in entries], key)
            if key is not None
            else [False] * len(entries)
        )
        for (key_group, kind, written), sorted_keys in zip(entries, ascending):
            self._settle(key_group, kind, written, sorted_keys)

    def _settle(self, key_group: int, kind: EntryKind, written: pa.RecordBatch, ascending: bool) -> None:
        """After a checkpoint wrote ``written`` (a ``kind`` entry) for ``key_group``: keep the group as Arrow.

        A fetched chain gets the entry appended and its overlay dropped; a
        folded key group whose entry is ``full`` becomes that entry. Other
        folded key groups stay dicts. The key group must have no change since.
        ``ascending``: as ``FetchedChain.write_pending``'s.
        """
        if key_group in self._dirty or key_group in self._cold or self.is_released(key_group):
            return
        fetched = self._unloaded.get(key_group)
        if fetched is None and (kind != "full" or key_group not in self._groups):
            return
        if fetched is not None:
            # With an overlay, the entry also wrote its changes (keys new to the chain among them), which the
            # pending entries' count lacks: the chain then holds what the key group held, overlay included.
            overlaid = key_group in self._groups or key_group in self._added
            live = self._unloaded_count(key_group) if overlaid else None
            if fetched.pending:
                fetched.write_pending(kind, written, ascending, live=live)
            else:
                fetched.append(kind, written)
            self._groups.pop(key_group, None)
            self._absent.pop(key_group, None)
            self._added.pop(key_group, None)
            self._looked_up.discard(key_group)
        else:
            self.install(key_group, FetchedChain(key_group, [("full", written)], self.schema))

    def nbytes(self, tracked: Mapping[int, int] | None = None) -> dict[int, int]:
        """Estimated bytes per loaded key group: Arrow buffers of fetched chains, objects of dicts and overlays.

        ``tracked`` counts keys held in a set per key group (the keys changed
        since its full entry, ``chains``): a set entry each, and under Arrow
        the whole cost of a dict key (they are the only Python objects of
        their keys).
        """
        per_key = self._estimate_bytes_per_key()
        sizes = {g: fetched.nbytes() for g, fetched in self._unloaded.items()}
        for g, group in self._groups.items():
            sizes[g] = sizes.get(g, 0) + int(sum(len(values) for values in group) * per_key)
        for g, count in (tracked or {}).items():
            if g in sizes:  # the set's entries; under Arrow also the key objects, which nothing else holds
                sizes[g] += int(count * (per_key if g in self._unloaded else SET_ENTRY_BYTES))
        return sizes

    def _estimate_bytes_per_key(self) -> float:
        """Bytes per key of a dict, from the objects of up to ``SAMPLED_KEYS`` keys (measured once enough exist)."""
        if self._bytes_per_key is not None:
            return self._bytes_per_key
        entries = (item for group in self._groups.values() for values in group for item in values.items())
        sample = [
            DICT_ENTRY_BYTES + _object_bytes(key) + _object_bytes(value)
            for key, value in itertools.islice(entries, SAMPLED_KEYS)
        ]
        estimate = sum(sample) / len(sample) if sample else float(DICT_ENTRY_BYTES)
        if len(sample) >= SAMPLED_KEYS:
            self._bytes_per_key = estimate
        return estimate


def _object_bytes(value: Any) -> int:
    """Bytes of a key or value object: a tuple, list or dict and what it holds, one level deep."""
    size = sys.getsizeof(value)
    if isinstance(value, (tuple, list)):
        size += sum(sys.getsizeof(part) for part in value)
    elif isinstance(value, dict):
        size += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in value.items())
    return size


def _keys(group: list[dict[Key, Value]]) -> dict[Key, None]:
    """The keys of a key group across its variables, in first-variable order (an ordered set)."""
    if len(group) == 1:
        return group[0]  # type: ignore[return-value]
    keys: dict[Key, None] = {}
    for values in group:
        keys.update(dict.fromkeys(values))
    return keys
