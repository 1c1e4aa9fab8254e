"""The keyed state of one instance, in memory, with change tracking for incremental checkpoints.

``InstanceState`` holds, for each key group of the instance's range, a dict
from key (a tuple of key column values) to value (a tuple of value column
values). It remembers which keys changed since the last snapshot, so that
``snapshot`` writes only those (as ``delta`` entries), and, per key group,
the chain of blobs in the store that its content reflects. The chain drives
two things: a ``full`` entry is written instead of a delta when the chain
would exceed ``max_chain_length`` (compaction bounds what a restore reads) or
when most of the key group changed anyway; and ``catch_up`` brings resident
state to any committed checkpoint by reading only what differs (the missing
delta suffix of a chain, or the whole chain of a key group whose content is
unknown or diverged, for example after a failed attempt).

``catch_up``, ``restore_instance`` and ``checkpoint_instance`` connect it to
a ``CheckpointStore``; they are the only I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from spark_state.blob import DELETED_COLUMN, EntryKind, blob_schema, serialize_schema
from spark_state.checkpoint import CheckpointStore, FetchStats
from spark_state.errors import ConfigError, KeyGroupOwnershipError
from spark_state.keygroups import KeyGroupRange, key_group_range
from spark_state.manifest import BlobRef, ComponentManifest, ComponentSpec, check_compatible
from spark_state.restore import InstanceRestorePlan, plan_instance_restore

Key = tuple
Value = tuple
Chain = tuple[str, ...]
DEFAULT_MAX_CHAIN_LENGTH = 8
CATCH_UP_MAX_GAP_BYTES = 8192
"""Catch-up reads through holes up to this size (entries superseded by later full entries) in one request."""
PENDING = "<pending>"  # chain link of an entry snapshotted but not yet written (see record_blob)
_PlannedEntry = tuple[int, EntryKind, list[Key], list[Value], list[Key]]  # group, kind, live keys/values, deleted


@dataclass(frozen=True)
class StateLayout:
    """Column layout of a component's state: key columns first, then value columns."""

    schema: pa.Schema
    key_columns: tuple[str, ...]

    def __post_init__(self) -> None:
        names = self.schema.names
        if not self.key_columns:
            raise ConfigError("a keyed state needs at least one key column")
        if list(self.key_columns) != names[: len(self.key_columns)]:
            raise ConfigError(
                f"state schema {names} must start with the key columns {list(self.key_columns)}, in order"
            )
        blob_schema(self.schema)  # validates the column names and types

    @property
    def value_columns(self) -> tuple[str, ...]:
        return tuple(self.schema.names[len(self.key_columns) :])

    @property
    def blob_schema(self) -> pa.Schema:
        return blob_schema(self.schema)

    def spec(self, name: str, parallelism: int, max_parallelism: int) -> ComponentSpec:
        return ComponentSpec(name, max_parallelism, parallelism, self.key_columns, serialize_schema(self.blob_schema))


class InstanceItems:
    """Non-keyed state of one instance: a list of JSON values (buffers, positions, ...).

    On a rescale the items of all old instances are split or merged across
    the new instances (``redistribute_items``), never dropped. Mutate it
    through its methods so the next checkpoint knows to write it.
    """

    def __init__(self, values: Sequence[Any] = ()):
        self._values = list(values)
        self.changed = False

    def append(self, value: Any) -> None:
        self._values.append(value)
        self.changed = True

    def extend(self, values: Sequence[Any]) -> None:
        self._values.extend(values)
        self.changed = True

    def replace(self, values: Sequence[Any]) -> None:
        self._values = list(values)
        self.changed = True

    def clear(self) -> None:
        self.replace(())

    def __iter__(self):
        return iter(list(self._values))

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index):
        return self._values[index]

    def to_list(self) -> list:
        return list(self._values)


def redistribute_items(old: Mapping[int, Sequence[Any]], old_parallelism: int, new_parallelism: int) -> list[list]:
    """Split or merge per-instance items for a new parallelism (Flink's split redistribution).

    The items of old instances ``0 <= i < old_parallelism`` (missing ones
    hold none) are concatenated in instance order and cut into
    ``new_parallelism`` contiguous slices whose sizes differ by at most one,
    larger first. Every item lands in exactly one new instance, in order.
    """
    if old_parallelism < 1 or new_parallelism < 1:
        raise ConfigError(f"parallelism must be >= 1, got {old_parallelism} -> {new_parallelism}")
    stray = [i for i in old if not 0 <= i < old_parallelism]
    if stray:
        raise KeyGroupOwnershipError(f"items of instance(s) {stray} outside old parallelism {old_parallelism}")
    flat = [item for i in range(old_parallelism) for item in old.get(i, ())]
    size, extra = divmod(len(flat), new_parallelism)
    result, start = [], 0
    for j in range(new_parallelism):
        end = start + size + (1 if j < extra else 0)
        result.append(flat[start:end])
        start = end
    return result


class _FetchedChain:
    """A key group's chain as fetched (oldest entry first, starting with a full one), not yet folded into a dict."""

    def __init__(
        self, key_group: int, batches: Sequence[tuple[EntryKind, pa.RecordBatch]], key_columns: tuple[str, ...]
    ):
        if not batches or batches[0][0] != "full":
            raise ValueError(f"key group {key_group}: a chain must start with a full entry, got "
                             f"{[kind for kind, _ in batches] or 'no entries'}")
        self.batches = batches
        self._key_columns = key_columns
        self._live_rows: int | None = None

    def live_rows(self) -> int:
        """Keys the chain holds once folded (Arrow kernels: each key's last occurrence decides); computed once."""
        if self._live_rows is None:
            if len(self.batches) == 1:
                batch = self.batches[0][1]
                self._live_rows = batch.num_rows - batch.column(DELETED_COLUMN).true_count
            else:
                table = pa.Table.from_batches([batch for _, batch in self.batches])
                last = table.group_by(list(self._key_columns), use_threads=False).aggregate(
                    [(DELETED_COLUMN, "last")]
                )
                self._live_rows = last.num_rows - (pc.sum(last.column(f"{DELETED_COLUMN}_last")).as_py() or 0)
        return self._live_rows


class InstanceState:
    """Keyed state of one instance: ``key_group -> {key: value}`` for the key groups it owns.

    ``key_group_range`` is inclusive. Every access names the key group;
    touching a key group outside the range raises ``KeyGroupOwnershipError``
    (routing and store disagree), never silently stores it.

    Restoring is lazy: ``catch_up`` keeps each fetched chain as Arrow record
    batches and folds it into a dict only when the key group is first
    accessed, so a restart at a new parallelism pays per key group a batch
    touches, not per key of state.
    """

    def __init__(self, layout: StateLayout, key_group_range: KeyGroupRange):
        self.layout = layout
        self.key_group_range = key_group_range
        self._groups: dict[int, dict[Key, Value]] = {}
        self._unloaded: dict[int, _FetchedChain] = {}  # fetched, folded into _groups on first access
        self._dirty: dict[int, set[Key]] = {}
        self._chains: dict[int, Chain | None] = {}
        self.instance_items = InstanceItems()
        self._items_path: str | None = None  # the instance-state blob ``items`` reflects
        self._blob_schema = layout.blob_schema

    # Access -----------------------------------------------------------------

    def _check(self, key_group: int) -> None:
        if key_group not in self.key_group_range:
            raise KeyGroupOwnershipError(
                f"key group {key_group} is not owned by this instance (owns {self.key_group_range}); "
                "rows were routed with a different parallelism or max parallelism than the store uses"
            )

    def _ensure(self, key_group: int) -> None:
        """Fold the key group's fetched chain into its dict, if it has not been yet."""
        fetched = self._unloaded.pop(key_group, None)
        if fetched is not None:
            self._groups[key_group] = self._fold(fetched.batches)

    def _ensure_many(self, key_groups: Sequence[int]) -> None:
        if self._unloaded:
            for key_group in self._unloaded.keys() & set(key_groups):
                self._ensure(key_group)

    def get(self, key_group: int, key: Key, default: Any = None) -> Value | Any:
        self._check(key_group)
        if self._unloaded:
            self._ensure(key_group)
        return self._groups.get(key_group, {}).get(key, default)

    def put(self, key_group: int, key: Key, value: Value) -> None:
        self._check(key_group)
        if self._unloaded:
            self._ensure(key_group)
        self._groups.setdefault(key_group, {})[key] = value
        self._dirty.setdefault(key_group, set()).add(key)

    def get_many(self, key_groups: Sequence[int], keys: Sequence[Key], default: Any = None) -> list[Value | Any]:
        """``[get(g, k, default) for g, k in zip(key_groups, keys)]``, checking ownership once."""
        self._check_all(key_groups)
        self._ensure_many(key_groups)
        groups, empty = self._groups, {}
        return [groups.get(g, empty).get(k, default) for g, k in zip(key_groups, keys)]

    def put_many(self, key_groups: Sequence[int], keys: Sequence[Key], values: Sequence[Value]) -> None:
        """``put(g, k, v)`` for each ``(g, k, v)`` of the zipped sequences, in order."""
        self._check_all(key_groups)
        self._ensure_many(key_groups)
        groups, dirty = self._groups, self._dirty
        for g, k, v in zip(key_groups, keys, values):
            group = groups.get(g)
            if group is None:
                group = groups[g] = {}
            group[k] = v
            changed = dirty.get(g)
            if changed is None:
                changed = dirty[g] = set()
            changed.add(k)

    def _check_all(self, key_groups: Sequence[int]) -> None:
        if len(key_groups) == 0:
            return
        low, high = min(key_groups), max(key_groups)
        if low < self.key_group_range.start or high > self.key_group_range.end:
            self._check(next(g for g in key_groups if g not in self.key_group_range))

    def delete(self, key_group: int, key: Key) -> None:
        self._check(key_group)
        if self._unloaded:
            self._ensure(key_group)
        group = self._groups.get(key_group)
        if group is not None and key in group:
            del group[key]
            self._dirty.setdefault(key_group, set()).add(key)

    def group(self, key_group: int) -> dict[Key, Value]:
        """The live dict of one key group (mutations through it are NOT tracked; use put/delete)."""
        self._check(key_group)
        self._ensure(key_group)
        return self._groups.get(key_group, {})

    def items(self) -> Iterator[tuple[int, Key, Value]]:
        for key_group in list(self._unloaded):
            self._ensure(key_group)
        for key_group in sorted(self._groups):
            for key, value in self._groups[key_group].items():
                yield key_group, key, value

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values()) + sum(f.live_rows() for f in self._unloaded.values())

    @property
    def dirty_key_groups(self) -> int:
        return len(self._dirty)

    # Checkpointing ----------------------------------------------------------

    def snapshot(
        self, *, max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH
    ) -> list[tuple[int, EntryKind, pa.Table]]:
        """Entries for the changes since the last snapshot, in key-group order; clears the change set.

        A key group gets a ``delta`` (changed keys, deleted ones as
        tombstones) unless it has no stored base, its chain already has
        ``max_chain_length`` entries, or at least half of its keys changed;
        then it gets a ``full`` entry (zero rows when it became empty).
        The chains record the new entries as ``PENDING`` until
        ``record_blob`` names the blob they were written to. If that blob is
        never committed, ``catch_up`` notices (the manifest's chain differs)
        and reloads those key groups.
        """
        if max_chain_length < 1:
            raise ConfigError(f"max chain length must be >= 1, got {max_chain_length}")
        planned: list[_PlannedEntry] = []
        for key_group in sorted(self._dirty):
            changed = self._dirty[key_group]
            group = self._groups.get(key_group, {})
            chain = self._chains.get(key_group, ())
            if chain == () and not group:  # never stored and empty again: nothing to write
                self._groups.pop(key_group, None)
                continue
            if not chain or len(chain) >= max_chain_length or 2 * len(changed) >= max(len(group), 1):
                planned.append((key_group, "full", list(group), list(group.values()), []))
                self._chains[key_group] = (PENDING,) if group else ()
            else:
                live = [k for k in changed if k in group]
                gone = [k for k in changed if k not in group]
                planned.append((key_group, "delta", live, [group[k] for k in live], gone))
                self._chains[key_group] = chain + (PENDING,)
            if not group:
                self._groups.pop(key_group, None)
        self._dirty.clear()
        return self._tables(planned)

    def _tables(self, planned: Sequence[_PlannedEntry]) -> list[tuple[int, EntryKind, pa.Table]]:
        """One table per planned entry: its live rows, then its deleted keys as tombstones.

        The rows of all entries become one array per column, then each entry
        gets compact copies of its slices (a zero-copy slice would be padded
        differently in the blob); the cost is per row, not per key group.
        """
        if not planned:
            return []
        tombstone = (None,) * len(self.layout.value_columns)
        keys: list[Key] = []
        values: list[Value] = []
        flags: list[bool] = []
        bounds: list[tuple[int, int]] = []
        for _, _, live_keys, live_values, deleted in planned:
            start = len(keys)
            keys.extend(live_keys)
            values.extend(live_values)
            keys.extend(deleted)
            values.extend([tombstone] * len(deleted))
            flags.extend([False] * len(live_keys))
            flags.extend([True] * len(deleted))
            bounds.append((start, len(keys) - start))
        schema = self._blob_schema
        rows = [keys] * len(self.layout.key_columns) + [values] * len(tombstone)
        positions = list(range(len(self.layout.key_columns))) + list(range(len(tombstone)))
        arrays = [
            pa.array(list(map(itemgetter(i), part)), type=t) for part, i, t in zip(rows, positions, schema.types)
        ]
        arrays.append(pa.array(flags, pa.bool_()))
        return [
            (g, kind, pa.Table.from_arrays([pa.concat_arrays([a.slice(start, n)]) for a in arrays], schema=schema))
            for (g, kind, *_), (start, n) in zip(planned, bounds)
        ]

    def record_blob(self, path: str) -> None:
        """Name the blob the last snapshot's entries were written to (replaces ``PENDING`` links)."""
        for key_group, chain in self._chains.items():
            if chain and PENDING in chain:
                self._chains[key_group] = tuple(path if link == PENDING else link for link in chain)

    def discard_uncommitted(self) -> None:
        """Forget that changes since the last snapshot happened: their key groups reload on ``catch_up``."""
        for key_group in self._dirty:
            self._chains[key_group] = None
        self._dirty.clear()

    def items_snapshot(self) -> bytes | None:
        """The items as JSON if they changed since the last snapshot, else None; clears the flag."""
        if not self.instance_items.changed:
            return None
        self.instance_items.changed = False
        self._items_path = PENDING
        return json.dumps(self.instance_items.to_list()).encode()

    def catch_up_items(
        self, store: CheckpointStore, component: ComponentManifest, instance: int, parallelism: int
    ) -> int:
        """Bring ``items`` to ``component``'s; after a rescale take this instance's share. Returns bytes read."""
        if component.parallelism == parallelism:
            target = component.instance_state.get(instance)
            if target == self._items_path and not self.instance_items.changed:
                return 0
            data = store.storage.read(target) if target else b"[]"
            self.instance_items = InstanceItems(json.loads(data))
            self._items_path = target
            return len(data) if target else 0
        old, read = {}, 0
        for old_instance, path in component.instance_state.items():
            data = store.storage.read(path)
            read += len(data)
            old[old_instance] = json.loads(data)
        mine = redistribute_items(old, component.parallelism, parallelism)[instance]
        self.instance_items = InstanceItems(mine)
        self.instance_items.changed = bool(mine)  # must be written at the new parallelism (manifest.next_component)
        self._items_path = None
        return read

    def chains(self) -> dict[int, Chain | None]:
        """Per key group, the store chain its content reflects (None: unknown, reload on catch-up)."""
        return dict(self._chains)

    def load(self, key_group: int, rows: pa.Table, chain: Chain) -> None:
        """Install a key group's live rows (no ``_deleted``) reflecting store chain ``chain`` (blob paths)."""
        self._check(key_group)
        n_keys = len(self.layout.key_columns)
        columns = [rows.column(name).to_pylist() for name in self.layout.schema.names]
        keys = zip(*columns[:n_keys])
        values = zip(*columns[n_keys:]) if len(columns) > n_keys else (() for _ in range(rows.num_rows))
        self._groups[key_group] = dict(zip(keys, values))
        self._unloaded.pop(key_group, None)
        self._dirty.pop(key_group, None)
        self._chains[key_group] = tuple(chain)

    def _apply_deltas(self, key_group: int, batches: list[tuple[str, pa.RecordBatch]]) -> None:
        self._ensure(key_group)
        group = self._groups.setdefault(key_group, {})
        n_keys = len(self.layout.key_columns)
        for _, batch in batches:
            columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            for row in zip(*columns):
                key, value, deleted = row[:n_keys], row[n_keys:-1], row[-1]
                if deleted:
                    group.pop(key, None)
                else:
                    group[key] = value
        if not group:
            del self._groups[key_group]

    def _fold(self, batches: Sequence[tuple[str, pa.RecordBatch]]) -> dict[Key, Value]:
        """The dict of a whole chain (oldest first); the same rows, in the same order, as ``apply_chain``.

        A key's last occurrence wins and a last occurrence with ``_deleted``
        removes it; keys keep the order of their last occurrence. Folded in
        Python, once per row, instead of Arrow kernels per key group.
        """
        n_keys = len(self.layout.key_columns)
        group: dict[Key, Value] = {}
        for _, batch in batches:
            columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            keys = zip(*columns[:n_keys])
            values = zip(*columns[n_keys:-1]) if batch.num_columns > n_keys + 1 else (() for _ in range(batch.num_rows))
            deleted = columns[-1]
            if not group and not any(deleted):
                group = dict(zip(keys, values))  # an entry holds each key at most once
                continue
            for key, value, gone in zip(keys, values, deleted):
                group.pop(key, None)
                if not gone:
                    group[key] = value
        return group

    def catch_up(
        self, store: CheckpointStore, component: ComponentManifest, instance: int, parallelism: int
    ) -> tuple[InstanceRestorePlan, FetchStats]:
        """Bring every owned key group to exactly ``component``'s state, reading only what differs.

        ``instance`` at ``parallelism`` must own this object's key-group
        range. Uncommitted changes are discarded first.
        """
        owned = key_group_range(instance, parallelism, component.max_parallelism)
        if owned != self.key_group_range:
            raise KeyGroupOwnershipError(
                f"instance {instance} at parallelism {parallelism} owns {owned}, this state holds "
                f"{self.key_group_range}; build a new InstanceState for the new parallelism"
            )
        self.discard_uncommitted()
        plan = plan_instance_restore(
            component, instance, parallelism, have=self._chains, max_gap_bytes=CATCH_UP_MAX_GAP_BYTES
        )
        entries, stats = store.fetch_entries(component, plan)
        for key_group in plan.clear:
            self._groups.pop(key_group, None)
            self._unloaded.pop(key_group, None)
            self._chains[key_group] = ()
        for key_group, batches in entries.items():
            if key_group in plan.appends:
                self._apply_deltas(key_group, batches)
            else:
                self._unloaded[key_group] = _FetchedChain(key_group, batches, self.layout.key_columns)
                self._groups.pop(key_group, None)
                self._dirty.pop(key_group, None)
            self._chains[key_group] = component.chains[key_group]
        return plan, stats


def restore_instance(
    store: CheckpointStore,
    component: ComponentManifest | None,
    layout: StateLayout,
    instance: int,
    parallelism: int,
    max_parallelism: int,
) -> tuple[InstanceState, InstanceRestorePlan | None, FetchStats | None]:
    """Build instance ``instance``'s state at ``parallelism`` from ``component`` (None: start empty)."""
    owned = key_group_range(instance, parallelism, max_parallelism)
    state = InstanceState(layout, owned)
    if component is None:
        return state, None, None
    check_compatible(component, layout.spec(component.name, parallelism, max_parallelism))
    plan, stats = state.catch_up(store, component, instance, parallelism)
    return state, plan, stats


def checkpoint_instance(
    store: CheckpointStore,
    component: str,
    checkpoint_id: int,
    instance: int,
    state: InstanceState,
    *,
    max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH,
    compression: str | None = None,
) -> BlobRef | None:
    """Step 1 of the commit protocol for one instance; None when nothing changed."""
    entries = state.snapshot(max_chain_length=max_chain_length)
    if not entries:
        return None
    ref = store.write_blob(
        component,
        checkpoint_id,
        instance,
        state.key_group_range,
        state.layout.blob_schema,
        entries,
        compression=compression,
    )
    state.record_blob(ref.path)
    return ref


def checkpoint_instance_items(
    store: CheckpointStore, component: str, checkpoint_id: int, instance: int, state: InstanceState
) -> str | None:
    """Write the instance's items for ``checkpoint_id`` if they changed; return the path to commit."""
    data = state.items_snapshot()
    if data is None:
        return None
    path = store.write_instance_state(component, checkpoint_id, instance, data)
    state._items_path = path
    return path
