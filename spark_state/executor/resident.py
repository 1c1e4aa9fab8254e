"""The state of one instance kept in a process between micro-batches, and how it meets the store.

``ResidentState`` is one instance's keyed state (``KeyGroupTable``), the
chains it reflects (``ChainTracker``), its instance items (``InstanceItems``)
and, when its component has timers, the index of its due timers
(``timers.TimerIndex``). A task uses it in three steps:

1. ``catch_up(blobs, component, ...)`` brings it to exactly a committed
   checkpoint, reading only what differs (``restore.plan_instance_restore``
   with what it holds): nothing when this process ran the instance last
   batch, the missing delta suffix of a stale chain, the whole chain of a key
   group that diverged (a failed attempt) or of every key group after a
   rescale. Uncommitted changes are discarded first. After a rescale its
   share of the old instances' items is taken (``redistribute_items``).
2. the keyed function reads and changes it;
3. ``checkpoint(blobs, ...)`` writes the changed key groups as the instance's
   blob for the checkpoint, and the items if they changed (step 1 of the
   commit protocol in ``manifestlog``). A key group it compacts (``chains``)
   gets a ``merge`` entry, the keys changed since its full entry, when the
   state knows them and they are under half of its keys (never under a
   memory bound: those keys would be Python objects it does not hold to the
   bound); otherwise it is written as its stored chain (read back from the
   store, as a restore would) folded with this batch's changes, in Arrow:
   what compaction costs grows with the bytes of the key group, not with
   Python work per key, and a key group kept as Arrow under an overlay stays
   so. A *native* state (``native``: a built-in aggregate merged with Arrow
   kernels, ``functions.Aggregate.vectorized``) keeps its key groups as
   Arrow chains: their entries are folded or looked up in them
   (``KeyGroupTable.arrow_rows``, ``arrow_key_rows``), never read back from
   the store or from dicts, and the written entries replace the chains'
   pending ones.

Under a memory bound (``spark.state.residentMemory``, a component without
timers), the state is *bounded*: a new one loads nothing at catch-up; before
the function runs, ``load`` reads the whole chains of the key groups the
batch touches that are not in memory (a lazy restore, also after a
rescale); after the checkpoint, written key groups stay Arrow
(``KeyGroupTable.settle``) and ``bound_memory`` evicts the least recently
used key groups until the estimate fits (they are in the store). A cold key
group is loaded from whatever checkpoint the next catch-up reaches, so an
eviction is never wrong, whether or not the checkpoint commits.

Between batches the state stays in the process (``take``/``keep``), keyed by
store, component and instance: the instance's host (``hosts``), or with
``spark.state.instanceHosts=false`` the Python worker that ran the task,
which Spark does not pin to the instance. A task may find no resident state
(a cold catch-up) or state left behind by an older attempt (a catch-up that
reloads what diverged); states of another parallelism are dropped when a
task of the new one arrives.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import overload

import numpy as np
import pyarrow as pa

from spark_state.errors import KeyGroupOwnershipError
from spark_state.executor.chain import FetchedChain
from spark_state.executor.order import key_order, sort_rows
from spark_state.executor.table import ChangedRows, KeyGroupTable
from spark_state.keyspace import KeyGroupRange, key_group_range
from spark_state.model.instance_items import InstanceItems, redistribute_items
from spark_state.model.schema import KeyedSchema
from spark_state.model.timers import TIMERS, TimerIndex, earlier, minima
from spark_state.store.blob import EntryKind
from spark_state.store.blobstore import BlobStore, FetchStats
from spark_state.store.chains import DEFAULT_MAX_CHAIN_LENGTH, ChainTracker, PlannedEntry
from spark_state.store.manifest import BlobRef, ComponentManifest, ComponentSpec, ItemsRef, check_compatible
from spark_state.store.restore import InstanceRestorePlan, chain_links, fold_chain, plan_instance_restore, plan_links

EXACT_TIMERS_EVERY = 4
"""A key group's recorded earliest timers are recomputed over all its keys once the keys changed since the last
recomputation reach 1 / ``EXACT_TIMERS_EVERY`` of its keys with timers (``ResidentState.timer_bound``)."""


@dataclass(frozen=True)
class CatchUp:
    """What a catch-up read: the plan it executed, the fetch's cost, and bytes of instance items read."""

    plan: InstanceRestorePlan
    stats: FetchStats
    items_bytes: int


class ResidentState:
    """See the module docstring. ``key_group_range`` is inclusive."""

    def __init__(
        self, schema: KeyedSchema, key_group_range: KeyGroupRange, *, bounded: bool = False, native: bool = False
    ):
        self.schema = schema
        self.key_group_range = key_group_range
        self.timers_variable = schema.variable_index(TIMERS.name) if schema.has_variable(TIMERS.name) else None
        self.timers = TimerIndex() if self.timers_variable is not None else None
        # Per key group with timers: a lower bound of its earliest timer of each kind, and how many keys changed
        # since the bound was last exact (``timer_bound``).
        self._timer_bounds: dict[int, tuple[tuple[int | None, ...], int]] = {}
        self.bounded = bounded and self.timers is None
        self.native = native  # asked for; the table is native when its schema allows (``KeyGroupTable``)
        self.table = KeyGroupTable(
            schema, key_group_range, keep_arrow=self.bounded, native=native and not self.bounded and self.timers is None
        )
        if self.bounded:
            self.table.evict_all()
        # Under a memory bound, the keys changed since each full entry would be Python objects the bound does not
        # hold (its key groups are kept as Arrow): a bounded state compacts into full entries only. So a released
        # key group (bounded states only), which holds just the keys this batch looked up, is never merged.
        self.chains = ChainTracker(merges=not self.bounded)
        self.items = InstanceItems()
        self._items_ref: ItemsRef | None = None  # the committed items file ``items`` reflects
        self._component: ComponentManifest | None = None  # the committed component the last catch-up reached
        self.compaction: dict = {}  # what the last checkpoint read to compact from the store
        self._batch = 0  # tasks run on this state, for least-recently-used order
        self._used: dict[int, int] = {}  # key group -> the task that last touched it
        self.high_water_bytes = 0
        self._peak = 0  # the largest estimate seen during the current task (``note_peak``)

    def __len__(self) -> int:
        return len(self.table)

    def has_keys(self) -> bool:
        """``len(self) > 0``, without counting every key (which, with two state variables, visits each one)."""
        return self.table.has_keys()

    # Step 1 -------------------------------------------------------------------------------

    def catch_up(self, blobs: BlobStore, component: ComponentManifest, instance: int, parallelism: int) -> CatchUp:
        """Bring the state to exactly ``component``'s, reading only what differs.

        ``instance`` at ``parallelism`` must own this state's key-group range.
        """
        owned = key_group_range(instance, parallelism, component.max_parallelism)
        if owned != self.key_group_range:
            raise KeyGroupOwnershipError(
                f"instance {instance} at parallelism {parallelism} owns {owned}, this state holds "
                f"{self.key_group_range}; build a new ResidentState for the new parallelism"
            )
        self.chains.forget(self.table.take_changes())
        self._batch += 1
        plan = plan_instance_restore(
            component,
            instance,
            parallelism,
            have=self.chains.held(),
            skip=self.table.cold,
        )
        entries, stats = blobs.fetch(component, plan, self.schema)
        for key_group in plan.clear:
            self.table.clear(key_group)
            self.chains.set(key_group, ())
            if self.timers is not None:
                self.timers.set_earliest(key_group, None)
                self._timer_bounds.pop(key_group, None)
        for key_group, batches in entries.items():
            chain = component.chains[key_group]
            last = component.blobs[chain[-1]].index.entry_for(key_group)
            assert last is not None, "the plan's chain_links found every entry of the chain"
            if key_group in plan.appends:
                self.table.apply(key_group, batches)
            else:
                self.table.install(key_group, FetchedChain(key_group, batches, self.schema, live=last.live))
            self.chains.set(key_group, chain)
            if self.timers is not None:
                earliest = last.earliest
                self.timers.set_earliest(key_group, earliest)
                if earliest is not None:  # what the entry's writer recorded: a lower bound (``timer_bound``)
                    self._timer_bounds[key_group] = (tuple(earliest), 0)
                else:
                    self._timer_bounds.pop(key_group, None)
        self._component = component
        return CatchUp(plan, stats, self._catch_up_items(blobs, component, instance, parallelism))

    def load(self, blobs: BlobStore, key_groups: Iterable[int]) -> dict:
        """Step 1b: load the cold key groups among ``key_groups`` (whole chains of the caught-up component).

        Marks ``key_groups`` used by this task (the eviction order of a
        bounded state; an unbounded one has nothing cold and skips it all).
        Returns what the load read.
        """
        if not self.bounded and not self.table.cold:
            return {}
        touched = [int(g) for g in key_groups]
        for g in touched:
            self._used[g] = self._batch
        cold = self.table.cold
        wanted = sorted(g for g in touched if g in cold)
        if not wanted:
            return {}
        component = self._component
        chains = component.chains if component is not None else {}
        for g in wanted:
            if g not in chains:
                self.table.clear(g)
                self.chains.set(g, ())
        stored = {g: chain_links(component, g) for g in wanted if g in chains} if component is not None else {}
        info = {"key_groups": len(wanted), "bytes_read": 0, "requests": 0, "seconds": 0.0}
        if stored and component is not None:  # ``stored`` is empty without a component
            plan = plan_links(stored, key_group_range=self.key_group_range)
            entries, stats = blobs.fetch(component, plan, self.schema)
            for g, batches in entries.items():
                last = component.blobs[chains[g][-1]].index.entry_for(g)
                assert last is not None, "chain_links found every entry of the chain"
                self.table.install(g, FetchedChain(g, batches, self.schema, live=last.live))
                self.chains.set(g, chains[g])
            info.update(bytes_read=stats.bytes_read, requests=stats.requests, seconds=round(stats.seconds, 4))
        return info

    def note_peak(self) -> int:
        """Record the current estimate as a candidate for this task's peak (between steps of a task); returns it."""
        now = sum(self.table.nbytes(self.chains.since_full_counts()).values())
        self._peak = max(self._peak, now)
        return now

    def bytes_to_load(self, key_groups: Iterable[int]) -> dict[int, int]:
        """Stored bytes of the chains ``load`` would read for each of ``key_groups`` (0: in memory or empty)."""
        cold, component = self.table.cold, self._component
        sizes = {}
        for g in key_groups:
            g = int(g)
            if g in cold and component is not None and g in component.chains:
                sizes[g] = sum(entry.length for _, entry in chain_links(component, g))
            else:
                sizes[g] = 0
        return sizes

    def bound_memory(self, limit: int | None) -> dict:
        """Step 4: evict least recently used key groups until the estimate is at most ``limit`` bytes.

        Call after ``checkpoint`` (no key group has unwritten changes).
        ``limit`` None only measures. Returns the estimate before and after,
        the high-water mark of this state, what was evicted and what is cold.
        """
        started = time.perf_counter()
        sizes = self.table.nbytes(self.chains.since_full_counts())
        before = sum(sizes.values())
        peak, self._peak = max(self._peak, before), 0
        self.high_water_bytes = max(self.high_water_bytes, peak)
        after, evicted = before, 0
        if limit is not None and self.bounded and before > limit:
            for g in sorted(sizes, key=lambda g: (self._used.get(g, -1), g)):
                if after <= limit:
                    break
                self.table.evict(g)
                self.chains.drop(g)
                self._used.pop(g, None)
                after -= sizes[g]
                evicted += 1
        if self.bounded:
            _release_freed_memory()
        return {
            "bounded": self.bounded,
            "limit_bytes": limit,
            "peak_bytes": peak,
            "after_checkpoint_bytes": before,
            "resident_bytes": after,
            "high_water_bytes": self.high_water_bytes,
            "evicted_key_groups": evicted,
            "cold_key_groups": len(self.table.cold),
            "seconds": round(time.perf_counter() - started, 4),
        }

    def _catch_up_items(self, blobs: BlobStore, component: ComponentManifest, instance: int, parallelism: int) -> int:
        """Bring the items to ``component``'s; after a rescale take this instance's share. Returns bytes read."""
        if component.parallelism == parallelism:
            target = component.instance_items.get(instance)
            if target == self._items_ref and not self.items.changed:
                return 0
            self.items = InstanceItems(blobs.read_items(target) if target else ())
            self._items_ref = target
            return target.size if target else 0
        old = {i: blobs.read_items(ref) for i, ref in component.instance_items.items()}
        mine = redistribute_items(old, component.parallelism, parallelism)[instance]
        self.items = InstanceItems(mine)
        self.items.changed = bool(mine)  # must be written at the new parallelism (manifest.next_component)
        self._items_ref = None
        return sum(ref.size for ref in component.instance_items.values())

    # Step 3 -------------------------------------------------------------------------------

    def snapshot(
        self, *, max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH, stored: StoredChains | None = None
    ) -> list[tuple[int, EntryKind, pa.RecordBatch]]:
        """Entries for the changes since the last snapshot, in key-group order (see ``chains``).

        The rows of all entries become one record batch, then each entry gets
        a compact copy of its slice (a zero-copy slice of a string column
        would take more bytes in the blob); the cost is per row, not per key
        group. When one ``put_many`` made every change (the built-in
        aggregates), its Arrow rows are the delta entries, sorted by key
        group, instead of rows read back from the dicts. Under one integer,
        string or binary key column (``KeyedSchema.sorted_key``) each
        entry's rows are in ascending key order, compacted ones included.
        With timers, ``earliest`` then holds each written key group's earliest
        timers (a lower bound: ``timer_bound``), for its index entry. With
        ``stored``, a key group compacted
        into a full entry (few of its keys changed, but too many since its
        full entry for a ``merge``) whose stored chain is the one this state
        reflects is written as that chain folded with its changed keys
        (``StoredChains``); a key group whose keys mostly changed is written
        from memory.
        """
        changed = self.table.changed_rows() if self.timers_variable is None else None
        changes = self.table.take_changes()
        self.earliest: dict[int, tuple] = {}
        planned = self.chains.plan(changes, self.table.key_count, max_chain_length)
        arrow_held = {e.key_group for e in planned if self.table.native and self.table.arrow_held(e.key_group)}
        from_store = {
            e.key_group
            for e in planned
            if stored is not None
            and e.kind == "full"
            and not e.empty
            and e.key_group not in arrow_held
            and (e.compacted or self.table.is_released(e.key_group))
            and stored.holds(e.key_group, e.previous)
        }
        # Only delta entries are written from the Arrow rows: a batch that writes every key group in full (most
        # of their keys changed) does not sort and copy them for nothing.
        wants_fast = changed is not None and any(entry.kind == "delta" for entry in planned)
        fast = self._changed_batch(changed, changes) if wants_fast and changed is not None else None
        arrow = self._arrow_entries(
            [e for e in planned if e.key_group in arrow_held and not (fast is not None and e.kind == "delta")]
        )
        keys: list = []
        values: list[list] = [[] for _ in self.schema.variables]
        deleted: list[bool] = []  # with several variables; with one, computed from its values at the end
        single = len(values) == 1
        bounds: list[tuple[PlannedEntry, pa.RecordBatch | None, int, int]] = []  # entry, rows (None: ``batch``
        # below, from the dicts), first row, rows
        for entry in planned:
            if fast is not None and entry.kind == "delta":  # exactly the rows the batch put in the key group
                first, rows = fast[1][entry.key_group]
                bounds.append((entry, fast[0], first, rows))
                self.table.drop_if_empty(entry.key_group)
                continue
            if entry.key_group in arrow:
                bounds.append((entry, *arrow[entry.key_group]))
                continue
            start = len(keys)
            wanted: Collection | None
            if entry.kind != "full":
                wanted = entry.keys  # a delta's changed keys, or a merge's keys changed since the full entry
            else:
                wanted = changes[entry.key_group] if entry.key_group in from_store else None
            if wanted is None and single:  # every key: straight from the dict (no copies per key group)
                held = self.table.values(entry.key_group, 0)
                keys.extend(held)
                values[0].extend(held.values())
                rows = len(held)
            else:
                chosen, per_variable = self.table.rows(entry.key_group, wanted)
                keys.extend(chosen)
                for column, part in zip(values, per_variable):
                    column.extend(part)
                if not single:
                    width = len(per_variable)
                    deleted.extend([values.count(None) == width for values in zip(*per_variable)])
                rows = len(chosen)
            bounds.append((entry, None, start, rows))
            if self.timers_variable is not None:
                self.earliest[entry.key_group] = self.timer_bound(entry.key_group, changes.get(entry.key_group, ()))
            self.table.drop_if_empty(entry.key_group)
        for key_group in changes:
            self.table.drop_if_empty(key_group)
        if not bounds:
            return []
        batch = None
        if any(rows is None for _, rows, _, _ in bounds):
            flags: list[bool] | np.ndarray = deleted
            if single:  # a key is deleted when its one variable has no value (a dict never holds None)
                flags = [value is None for value in values[0]] if None in values[0] else np.zeros(len(keys), bool)
            table = self.schema.rows_to_columns(keys, values, flags, bare=self.table.bare)
            batch = pa.RecordBatch.from_arrays(
                [column.combine_chunks() for column in table.columns], schema=table.schema
            )
            if self.schema.sorted_key is not None:  # each entry's rows by key, entries in place
                batch = sort_rows(batch, self.schema.sorted_key, [n for _, rows, _, n in bounds if rows is None])
        entries = []
        for entry, rows, start, n in bounds:
            if rows is None:
                assert batch is not None, "made above: some entry's rows are from the dicts"
                rows = batch
            entries.append((entry.key_group, entry.kind, pa.concat_batches([rows.slice(start, n)])))
        self.compaction = {}
        if from_store:
            assert stored is not None, "from_store is empty without stored chains"
            entries = stored.compact(entries, from_store)
            self.compaction = stored.last
        return entries

    def _arrow_entries(self, planned: list[PlannedEntry]) -> dict[int, tuple[pa.RecordBatch, int, int]]:
        """The rows of planned entries of key groups held as Arrow chains (``KeyGroupTable.arrow_held``), per key
        group its rows, first row and row count, made without Python objects per key: full entries folded from
        the chains (``arrow_rows``), the others (changed keys) looked up in them (``arrow_key_rows``). Entries
        with a null key are left to the dicts."""
        found: dict[int, tuple[pa.RecordBatch, int, int]] = {}
        full = [e.key_group for e in planned if e.kind == "full"]
        keyed_groups, keyed_keys = [], []
        for e in planned:
            if e.kind != "full":
                assert e.keys is not None, "a delta or merge entry names its keys (ChainTracker.plan)"
                if None not in e.keys:
                    keyed_groups.append(e.key_group)
                    keyed_keys.append(e.keys)
        for groups, made in (
            (full, self.table.arrow_rows(full) if full else None),
            (keyed_groups, self.table.arrow_key_rows(keyed_groups, keyed_keys) if keyed_groups else None),
        ):
            if made is not None:
                rows, sizes = made
                firsts = np.cumsum([0, *sizes[:-1]]).tolist()
                found.update((g, (rows, first, n)) for g, first, n in zip(groups, firsts, sizes))
        return found

    def timer_bound(self, key_group: int, changed: Collection) -> tuple[int | None, ...]:
        """The earliest timer of each kind in ``key_group`` at most: exact, or a lower bound; after ``changed``.

        Costs the changed keys, not the key group: the bound is the last one
        lowered by the changed keys' timers (a timer deleted or fired leaves it
        lower than the key group's earliest). It is recomputed over every key
        once the keys changed since reach a ``1 / EXACT_TIMERS_EVERY`` share of
        the key group's keys with timers, so recomputing costs at most that
        many times the changes. A bound written too early only makes a restore
        fold the key group at an earlier batch (``timers.TimerIndex``); it
        never makes a timer fire late.
        """
        assert self.timers_variable is not None, "only a component with timers bounds its timers"
        timers = self.table.values(key_group, self.timers_variable)
        if not timers:
            self._timer_bounds.pop(key_group, None)
            return (None, None, None)
        bound: tuple[int | None, ...] | None
        bound, since = self._timer_bounds.get(key_group, (None, 0))
        since += len(changed)
        if bound is None or since * EXACT_TIMERS_EVERY >= len(timers):
            bound, since = minima(timers.values()), 0
        else:
            bound = earlier(bound, minima([timers[key] for key in changed if key in timers]))
        self._timer_bounds[key_group] = (bound, since)
        return bound

    def _changed_batch(
        self, changed: ChangedRows, changes: Mapping[int, Collection]
    ) -> tuple[pa.RecordBatch, dict] | None:
        """The rows one ``put_many`` changed as one blob-schema batch in key-group order, and each group's slice.

        None (write from the dicts) when they are not exactly the changes.
        """
        if len(changed.key_groups) != sum(map(len, changes.values())):
            return None
        order = np.argsort(changed.key_groups, kind="stable")
        groups = changed.key_groups[order]
        present, firsts, counts = np.unique(groups, return_index=True, return_counts=True)
        if len(present) != len(changes):
            return None
        if self.schema.sorted_key is not None and not changed.keys[0].null_count:  # then by key in each group
            order = order[key_order(changed.keys[0].take(pa.array(order)), counts)]
        take = pa.array(order)
        batch = self.schema.fields_to_batch(
            [column.take(take) for column in changed.keys], [column.take(take) for column in changed.fields]
        )
        return batch, dict(zip(present.tolist(), zip(firsts.tolist(), counts.tolist())))

    def checkpoint(
        self,
        blobs: BlobStore,
        component: str,
        checkpoint_id: int,
        instance: int,
        *,
        max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH,
        compression: str | None = None,
    ) -> tuple[BlobRef | None, ItemsRef | None]:
        """Write this checkpoint's blob (None when no key group changed) and items (None when unchanged)."""
        stored = StoredChains(blobs, self._component, self.schema, self.key_group_range) if self._component else None
        entries = self.snapshot(max_chain_length=max_chain_length, stored=stored)
        blob = None
        if entries:
            counts = {g: self.table.recorded_count(g) for g, _, _ in entries}
            blob = blobs.write_blob(
                component,
                checkpoint_id,
                instance,
                self.key_group_range,
                self.schema.blob_schema,
                entries,
                compression=compression,
                earliest=self.earliest or None,
                live={g: n for g, n in counts.items() if n is not None},
            )
            self.chains.record(blob.path)
            if self.bounded or self.table.native:
                self.table.settle(entries)
        for key_group in self.table.released():  # their chains are in the store only now
            self.table.evict(key_group)
            self.chains.drop(key_group)
        items = None
        if self.items.changed:
            items = blobs.write_items(component, checkpoint_id, instance, self.items.to_list())
            self.items.changed = False
            self._items_ref = items
        return blob, items


class StoredChains:
    """The stored chains of ``component`` (the committed state a catch-up reached), to compact from.

    ``holds(g, chain)``: whether the store's chain of key group ``g`` is
    ``chain`` (then the state's content of ``g`` is that chain plus the keys
    changed since). ``compact(entries, key_groups)`` replaces the delta
    entries of ``key_groups`` (their changed keys, deletions as tombstones)
    by full ones: each key group's chain, read with one coalesced plan,
    folded with its delta (``restore.fold_chains``' rule). ``last`` says what
    that read.
    """

    def __init__(
        self, blobs: BlobStore, component: ComponentManifest, schema: KeyedSchema, key_group_range: KeyGroupRange
    ):
        self.blobs, self.component, self.schema, self.key_group_range = blobs, component, schema, key_group_range
        self.last: dict = {}

    def holds(self, key_group: int, chain: tuple[str, ...] | None) -> bool:
        assert chain is not None, "a compacted or released key group's entry extends a known chain"
        return self.component.chains.get(key_group) == tuple(chain)

    def compact(
        self, entries: list[tuple[int, EntryKind, pa.RecordBatch]], key_groups: set[int]
    ) -> list[tuple[int, EntryKind, pa.RecordBatch]]:
        plan = plan_links(
            {g: chain_links(self.component, g) for g in sorted(key_groups)},
            key_group_range=self.key_group_range,
        )
        fetched, stats = self.blobs.fetch(self.component, plan, self.schema)
        self.last = {
            "key_groups": len(key_groups),
            "bytes_read": stats.bytes_read,
            "requests": stats.requests,
            "seconds": round(stats.seconds, 4),
        }
        blob_schema = self.schema.blob_schema
        key_columns = list(self.schema.key_columns)
        order = sorted(key_groups)
        deltas = {g: t for g, _, t in entries if g in key_groups}
        folded = {}
        for g in order:
            chain = list(fetched[g])
            chain.append(("delta", deltas[g].cast(chain[0][1].schema)))
            live = fold_chain(chain, key_columns)
            if self.schema.sorted_key is not None:
                live = sort_rows(live, self.schema.sorted_key)
            kept = pa.array(np.zeros(live.num_rows, bool))
            folded[g] = pa.RecordBatch.from_arrays(
                [c.combine_chunks() for c in live.columns] + [kept], schema=blob_schema
            )
        return [(g, "full", folded[g]) if g in key_groups else (g, kind, table) for g, kind, table in entries]


def _release_freed_memory() -> None:
    """Hand memory freed by the task back to the system: Arrow's pool and (glibc) the C heap keep it otherwise."""
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def restore_instance(
    blobs: BlobStore,
    component: ComponentManifest | None,
    schema: KeyedSchema,
    instance: int,
    parallelism: int,
    max_parallelism: int,
    *,
    bounded: bool = False,
    native: bool = False,
) -> tuple[ResidentState, CatchUp | None]:
    """Build instance ``instance``'s state at ``parallelism`` from ``component`` (None: start empty)."""
    state = ResidentState(
        schema, key_group_range(instance, parallelism, max_parallelism), bounded=bounded, native=native
    )
    if component is None:
        return state, None
    check_compatible(component, ComponentSpec(component.name, max_parallelism, parallelism, schema))
    return state, state.catch_up(blobs, component, instance, parallelism)


# The process's resident states ---------------------------------------------------------

_LOCK = threading.Lock()
_RESIDENT: dict[tuple[str, str], dict[int, ResidentState]] = {}


def take(
    store: str,
    component: str,
    instance: int,
    parallelism: int,
    max_parallelism: int,
    schema: KeyedSchema,
    *,
    bounded: bool = False,
    native: bool = False,
) -> ResidentState:
    """This process's state of ``instance``, or a new empty one; drops states of another parallelism.

    A state held with another ``bounded`` (the memory bound was set or unset
    on a restart) or ``native`` is dropped too: the new one reloads from the
    store.
    """
    owned = key_group_range(instance, parallelism, max_parallelism)
    with _LOCK:
        states = _RESIDENT.setdefault((store, component), {})
        for other in [
            i
            for i, s in states.items()
            if i >= parallelism or s.key_group_range != key_group_range(i, parallelism, max_parallelism)
        ]:
            del states[other]
        state = states.pop(instance, None)
    if (
        state is None
        or state.key_group_range != owned
        or state.schema != schema
        or state.bounded != (bounded and state.timers is None)
        or state.native != native
    ):
        state = ResidentState(schema, owned, bounded=bounded, native=native)
    return state


def keep(store: str, component: str, instance: int, state: ResidentState) -> None:
    """Keep ``state`` in this process for the next task of the same instance."""
    with _LOCK:
        _RESIDENT.setdefault((store, component), {})[instance] = state


def forget_all(*, release_memory: bool = False) -> None:
    """Drop every state this process holds (a forked instance host starts empty); with ``release_memory``, hand
    the memory they held back to the system."""
    with _LOCK:
        _RESIDENT.clear()
    if release_memory:
        _release_freed_memory()


def held_keys() -> int:
    """How many keys the states this process holds have."""
    with _LOCK:
        return sum(len(state) for states in _RESIDENT.values() for state in states.values())


_PEERS: Callable[[], int] | None = None


def set_peers(count: Callable[[], int]) -> None:
    """How many states share this executor's memory bound (an instance host counts its query's hosts)."""
    global _PEERS
    _PEERS = count


@overload
def memory_share(limit: int) -> int: ...


@overload
def memory_share(limit: None) -> None: ...


def memory_share(limit: int | None) -> int | None:
    """This state's share of the executor's bound ``limit``: an equal share among the states that hold memory.

    In an instance host, the states are the hosts of the same store and
    component on the executor (an idle host of a parallelism no longer run
    counts until it exits); in a Python worker
    (``spark.state.instanceHosts=false``), the states the worker holds.
    """
    if limit is None:
        return None
    if _PEERS is not None:
        peers = _PEERS()
    else:
        with _LOCK:
            peers = sum(len(states) for states in _RESIDENT.values()) + 1
    return limit // max(1, peers)


def resident_instances(store: str, component: str) -> list[int]:
    """The instances whose state this process holds (for reports and tests)."""
    with _LOCK:
        return sorted(_RESIDENT.get((store, component), {}))
