"""Reading a component's state out of a store, without the query and without Spark: state and change feed.

``read_state(store, component, checkpoint=None)`` returns the keys and values
of a checkpoint as one ``pyarrow.Table`` (for notebooks and pandas); the
``spark-state`` data source (``datasources.state_reader``) and the CLI's
``show`` use the same functions per key-group range. Only checkpoints a query
could restore from are read: the latest's retained ones and the savepoints'
(``ManifestReader.restorable``); a record that exists only as the base of a
delta may have lost its blobs.

**Columns.** The key columns, then the ``value`` variable's columns (a
built-in aggregate's state, or a function's ``state_schema``); with
``timers=True`` also ``timers_event``, ``timers_processing`` and
``timers_expires`` (a key's timers and TTL expiry; ``timers`` state
variable, when the component has it). Without ``timers`` a key is listed
when it has a value; with it, when it has any state. Values are in the
component's current schema: entries written in an older one are cast
(``evolution``).

**Change feed.** ``read_changes(store, component, start, end)`` returns one
row per change between checkpoints ``start`` (exclusive) and ``end``
(inclusive): ``change_type`` (``"upsert"`` or ``"delete"``),
``checkpoint_id`` (the checkpoint that made it), then the columns above
(null for a delete). Applying the rows in ``checkpoint_id`` order to the
state at ``start`` gives the state at ``end``. A change is reported where a
key's value differs (a rewrite of the same value is no change). It is
computed per key group from the chains of the restorable checkpoints
between ``start`` and ``end``: each delta entry is attributed to the
checkpoint that wrote it; a full entry (compaction) or a key group cleared
is diffed against the state before it, and changes of checkpoints that are
no longer restorable are attributed to the next restorable one.

Reads verify every entry's CRC-32 (``CorruptBlobError`` names the blob) and
fold many key groups per Arrow kernel call (``restore.fold_chains``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import ConfigError, NoCheckpointError
from spark_state.keyspace import KeyGroupRange, key_groups_for_columns
from spark_state.model.schema import VALUE, KeyedSchema
from spark_state.model.timers import TIMERS
from spark_state.storage.base import Storage
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifest import ComponentManifest, Manifest
from spark_state.store.manifestlog import ManifestReader
from spark_state.store.restore import InstanceRestorePlan, chain_links, fold_chains, plan_key_groups, plan_links
from spark_state.store.savepoints import Savepoints

CHANGE_TYPE = "change_type"
CHECKPOINT_ID = "checkpoint_id"
UPSERT, DELETE = "upsert", "delete"
PART_BYTES = 64 << 20
"""A read part (one Spark partition of the reader) covers about this many bytes of entries."""

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``."""


def resolve_checkpoint(manifests: ManifestReader, checkpoint: int | str | None) -> Manifest:
    """The manifest of a restorable checkpoint: an id, a savepoint name, or None for the latest.

    ``NoCheckpointError`` (naming the restorable ones) for an empty store or
    a checkpoint that is neither retained nor pinned by a savepoint.
    """
    if isinstance(checkpoint, str) and not checkpoint.isdigit():
        return manifests.load(Savepoints(manifests.storage).get(checkpoint).checkpoint_id)
    restorable = manifests.restorable()
    if not restorable:
        raise NoCheckpointError(f"{manifests.storage.uri} holds no checkpoint")
    wanted = max(restorable) if checkpoint is None else int(checkpoint)
    if wanted not in restorable:
        raise NoCheckpointError(
            f"checkpoint {wanted} of {manifests.storage.uri} is not restorable; the restorable checkpoints "
            f"(retained, or pinned by a savepoint) are {sorted(restorable, reverse=True)}"
        )
    return manifests.load(wanted)


def component_of(manifest: Manifest, component: str, where: str) -> ComponentManifest:
    try:
        return manifest.components[component]
    except KeyError:
        raise ConfigError(
            f"checkpoint {manifest.checkpoint_id} of {where} has no component {component!r}; it has "
            f"{sorted(manifest.components)}"
        ) from None


def output_fields(schema: KeyedSchema, *, timers: bool = False) -> list[pa.Field]:
    """The columns of state read out: key columns, value columns, and with ``timers`` the ``timers_*`` ones."""
    fields = list(schema.keys) + [f.remove_metadata() for f in schema.value.fields]
    if timers and schema.has_variable(TIMERS.name):
        fields += [pa.field(f"{TIMERS.name}_{f.name}", f.type) for f in TIMERS.fields]
    names = [f.name for f in fields]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ConfigError(f"state columns {clash} appear twice (a key and a value column share a name)")
    return fields


def _variables(schema: KeyedSchema, timers: bool) -> list[int]:
    """Indexes of the variables read out (value, and timers when asked and present)."""
    chosen = [schema.variable_index(VALUE)]
    if timers and schema.has_variable(TIMERS.name):
        chosen.append(schema.variable_index(TIMERS.name))
    return chosen


def flatten(live: pa.Table, schema: KeyedSchema, *, timers: bool = False) -> pa.Table:
    """Folded rows (key columns and one struct per variable) as output columns; keys without state dropped."""
    n_keys = len(schema.keys)
    arrays = [live.column(i) for i in range(n_keys)]
    present = None
    for index in _variables(schema, timers):
        column = (
            live.column(n_keys + index).combine_chunks()
            if live.num_rows
            else pa.array([], schema.variables[index].arrow_type)
        )
        arrays.extend(column.flatten())
        valid = column.is_valid()
        present = valid if present is None else pc.or_(present, valid)
    table = pa.Table.from_arrays(arrays, schema=pa.schema(output_fields(schema, timers=timers)))
    if present is not None and present.false_count:
        table = table.filter(present)
    return table


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class ReadPart:
    """One piece of a read: key groups ``key_group_range`` (inclusive) and the reads of their chains."""

    key_group_range: KeyGroupRange
    plan: InstanceRestorePlan

    @property
    def bytes(self) -> int:
        return self.plan.bytes_to_read


def split_key_groups(
    component: ComponentManifest,
    parts: int | None = None,
    *,
    part_bytes: int = PART_BYTES,
    spread: int = 1,
    min_part_bytes: int = 1 << 20,
) -> list[ReadPart]:
    """Contiguous key-group ranges covering ``0..max_parallelism - 1`` with about equal bytes of entries.

    ``parts`` (>= 1) fixes the number of ranges; else about ``part_bytes``
    bytes each, but at least ``spread`` ranges of at least ``min_part_bytes``
    when there is that much (so small states still read in parallel).
    Ranges without state are left out.
    """
    sizes = [0] * component.max_parallelism
    for key_group in component.chains:
        sizes[key_group] = sum(e.length for _, e in chain_links(component, key_group))
    total = sum(sizes)
    count = parts if parts is not None else max(1, -(-total // part_bytes), min(spread, total // min_part_bytes))
    if count < 1:
        raise ConfigError(f"parts must be >= 1, got {parts}")
    target = total / count if total else 0
    bounds: list[tuple[int, int]] = []
    start, accumulated = 0, 0
    for key_group, size in enumerate(sizes):
        accumulated += size
        if len(bounds) < count - 1 and accumulated >= target * (len(bounds) + 1) and size:
            bounds.append((start, key_group))
            start = key_group + 1
    if start < component.max_parallelism:
        bounds.append((start, component.max_parallelism - 1))
    ranges = [KeyGroupRange(a, b) for a, b in bounds]
    result = []
    for key_groups in ranges:
        plan = plan_key_groups(component, key_groups)
        if plan.chains:
            result.append(ReadPart(key_groups, plan))
    return result


def read_part(
    blobs: BlobStore,
    component: ComponentManifest,
    plan: InstanceRestorePlan,
    *,
    timers: bool = False,
    schema: KeyedSchema | None = None,
    batch_key_groups: int = 256,
) -> Iterator[pa.Table]:
    """The state of ``plan``'s key groups as output tables, folding ``batch_key_groups`` key groups per call."""
    schema = schema or component.keyed_schema
    key_groups = sorted(plan.chains)
    for i in range(0, len(key_groups), batch_key_groups):
        chunk = key_groups[i : i + batch_key_groups]
        sub = plan_links({g: plan.chains[g] for g in chunk}, max_gap_bytes=1 << 20)
        entries, _ = blobs.fetch(component, sub, schema)
        live = fold_chains([entries[g] for g in chunk], schema.key_columns)
        yield flatten(live, schema, timers=timers)


def read_state(
    store: str | Storage,
    component: str,
    checkpoint: int | str | None = None,
    *,
    key: Sequence[Any] | None = None,
    timers: bool = False,
    progress: Progress | None = None,
) -> pa.Table:
    """The keys and values of ``component`` at ``checkpoint`` (an id, a savepoint name, or None: the latest).

    ``key`` (a tuple of key column values, or a single value for one key
    column) reads only that key's key group and returns at most its row.
    See the module docstring for the columns.
    """
    storage = _open(store)
    manifests = ManifestReader(storage)
    manifest = resolve_checkpoint(manifests, checkpoint)
    part = component_of(manifest, component, storage.uri)
    schema = part.keyed_schema
    blobs = BlobStore(storage)
    if key is not None:
        return read_key(blobs, part, key, timers=timers)
    pieces = split_key_groups(part)
    total = sum(p.bytes for p in pieces)
    tables: list[pa.Table] = []
    done = 0
    for piece in pieces:
        tables.extend(read_part(blobs, part, piece.plan, timers=timers, schema=schema))
        done += piece.bytes
        if progress is not None:
            progress(done, total)
    if not tables:
        return pa.schema(output_fields(schema, timers=timers)).empty_table()
    return pa.concat_tables(tables)


def read_key(
    blobs: BlobStore, component: ComponentManifest, key: Sequence[Any] | Any, *, timers: bool = False
) -> pa.Table:
    """The row of one key (empty if it has no state); ``key`` converts to the key columns' types."""
    schema = component.keyed_schema
    values = tuple(key) if isinstance(key, (tuple, list)) else (key,)
    if len(values) != len(schema.keys):
        raise ConfigError(
            f"a key of {component.name!r} has {len(schema.keys)} column(s) {list(schema.key_columns)}, "
            f"got {len(values)} value(s)"
        )
    try:
        columns = [
            pa.array([v], f.type)
            if not isinstance(v, str) or pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
            else pa.array([v]).cast(f.type)
            for v, f in zip(values, schema.keys)
        ]
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise ConfigError(f"key {values!r} does not convert to the key columns {schema.keys}: {exc}") from exc
    key_group = int(key_groups_for_columns(columns, component.max_parallelism)[0])
    plan = plan_key_groups(component, KeyGroupRange(key_group, key_group))
    wanted = pa.Table.from_arrays(columns, names=list(schema.key_columns))
    rows = [t for t in read_part(BlobStore(blobs.storage), component, plan, timers=timers, schema=schema)]
    table = pa.concat_tables(rows) if rows else pa.schema(output_fields(schema, timers=timers)).empty_table()
    mask = None
    for name in schema.key_columns:
        equal = pc.equal(table.column(name), wanted.column(name)[0])
        mask = equal if mask is None else pc.and_(mask, equal)
    return table.filter(mask) if mask is not None else table


def _open(store: str | Storage) -> Storage:
    if isinstance(store, Storage):
        return store
    from spark_state.storage import open_storage

    return open_storage(store)


# --------------------------------------------------------------------------- change feed


def change_fields(schema: KeyedSchema, *, timers: bool = False) -> list[pa.Field]:
    """The columns of the change feed: ``change_type``, ``checkpoint_id``, then ``output_fields``."""
    fields = output_fields(schema, timers=timers)
    if {CHANGE_TYPE, CHECKPOINT_ID} & {f.name for f in fields}:
        raise ConfigError(f"a state column is named {CHANGE_TYPE!r} or {CHECKPOINT_ID!r}, which the change feed uses")
    return [
        pa.field(CHANGE_TYPE, pa.string(), nullable=False),
        pa.field(CHECKPOINT_ID, pa.int64(), nullable=False),
    ] + fields


def waypoints(manifests: ManifestReader, start: int | str, end: int | str | None) -> list[Manifest]:
    """The restorable checkpoints from ``start`` to ``end`` (inclusive, ascending); ``start`` must be before ``end``."""
    first = resolve_checkpoint(manifests, start)
    last = resolve_checkpoint(manifests, end)
    if first.checkpoint_id >= last.checkpoint_id:
        raise ConfigError(
            f"the change feed needs a start checkpoint before its end; got {first.checkpoint_id} "
            f"and {last.checkpoint_id}"
        )
    between = [i for i in manifests.restorable() if first.checkpoint_id < i < last.checkpoint_id]
    return [first] + [manifests.load(i) for i in sorted(between)] + [last]


def read_changes(
    store: str | Storage,
    component: str,
    start: int | str,
    end: int | str | None = None,
    *,
    timers: bool = False,
    key_groups: KeyGroupRange | None = None,
) -> pa.Table:
    """One row per change of ``component`` after checkpoint ``start`` up to ``end`` (None: the latest).

    See the module docstring. ``key_groups`` restricts the feed to a range
    of key groups (a Spark partition of the data source reads one).
    """
    storage = _open(store)
    manifests = ManifestReader(storage)
    points = waypoints(manifests, start, end)
    schema = component_of(points[-1], component, storage.uri).keyed_schema
    fields = change_fields(schema, timers=timers)
    chosen = _variables(schema, timers)
    blobs = BlobStore(storage)
    rows: list[tuple] = []
    for before, after in zip(points, points[1:]):
        old = before.components.get(component)
        new = component_of(after, component, storage.uri)
        rows.extend(_pair_changes(blobs, old, new, after.checkpoint_id, schema, chosen, key_groups))
    columns: list[Sequence[Any]] = list(zip(*rows)) if rows else [[] for _ in fields]
    flat_types = [f.type for f in fields]
    return pa.Table.from_arrays([pa.array(list(c), t) for c, t in zip(columns, flat_types)], schema=pa.schema(fields))


def _pair_changes(
    blobs: BlobStore,
    old: ComponentManifest | None,
    new: ComponentManifest,
    checkpoint_id: int,
    schema: KeyedSchema,
    chosen: list[int],
    key_groups: KeyGroupRange | None,
) -> list[tuple]:
    old_chains = old.chains if old is not None else {}
    changed = sorted(
        g
        for g in set(old_chains) | set(new.chains)
        if old_chains.get(g) != new.chains.get(g) and (key_groups is None or g in key_groups)
    )
    if not changed:
        return []
    steps: dict[int, tuple[int, ...]] = {}  # key group -> positions of new.chains[g] to apply
    base_links: dict[int, tuple] = {}
    for g in changed:
        before, after = old_chains.get(g, ()), new.chains.get(g, ())
        extends = bool(before) and len(after) > len(before) and after[: len(before)] == before
        steps[g] = tuple(range(len(before), len(after))) if extends else tuple(range(len(after)))
        if before:
            assert old is not None, "old_chains is empty without an old component"
            base_links[g] = chain_links(old, g)
    base = _fetch(blobs, old, base_links, schema) if base_links and old is not None else {}
    wanted = {g: tuple(chain_links(new, g)[i] for i in steps[g]) for g in changed if steps[g]}
    fetched = _fetch(blobs, new, wanted, schema) if wanted else {}
    rows: list[tuple] = []
    width = sum(len(schema.variables[i].fields) for i in chosen)
    for g in changed:
        running = _state_of(base.get(g, []), schema, chosen)
        links = wanted.get(g, ())
        steps_of_g = [(path, kind, batch) for (path, _), (kind, batch) in zip(links, fetched.get(g, []))]
        for position, (path, kind, batch) in enumerate(steps_of_g):
            if kind == "merge" and position > 0 and steps_of_g[position - 1][1] == "full":
                continue  # folded with the full entry before it
            written_at = new.blobs[path].checkpoint_id
            keys, values = _rows(batch, schema, chosen)
            if kind == "full":
                incoming = dict(zip(keys, values))
                if position + 1 < len(steps_of_g) and steps_of_g[position + 1][1] == "merge":
                    # The full entry and the merge after it are one state, that of the merge's checkpoint:
                    # the full entry alone would undo changes the merge redoes.
                    merge_path, _, merge_batch = steps_of_g[position + 1]
                    written_at = new.blobs[merge_path].checkpoint_id
                    for k, v in zip(*_rows(merge_batch, schema, chosen)):
                        incoming.pop(k, None)
                        incoming[k] = v
                present = {k: v for k, v in incoming.items() if v is not None}
                for k in [k for k in running if k not in present]:
                    rows.append(_change(DELETE, written_at, k, None, width))
                for k, v in present.items():
                    if running.get(k) != v:
                        rows.append(_change(UPSERT, written_at, k, v, width))
                running = present
                continue
            for k, v in zip(keys, values):
                if v is None:
                    if k in running:
                        del running[k]
                        rows.append(_change(DELETE, written_at, k, None, width))
                elif running.get(k) != v:
                    running[k] = v
                    rows.append(_change(UPSERT, written_at, k, v, width))
        if not new.chains.get(g):
            rows.extend(_change(DELETE, checkpoint_id, k, None, width) for k in running)
    rows.sort(key=lambda r: r[1])  # stable: by checkpoint, then key group and entry order
    return rows


def _fetch(blobs: BlobStore, component: ComponentManifest, links: dict[int, tuple], schema: KeyedSchema) -> dict:
    entries, _ = blobs.fetch(component, plan_links(links, max_gap_bytes=1 << 20), schema)
    return entries


def _rows(batch: pa.RecordBatch, schema: KeyedSchema, chosen: list[int]) -> tuple[list[tuple], list[tuple | None]]:
    """Keys and, per row, the chosen variables' values flattened into one tuple (None: no state, or a tombstone)."""
    keys, values, deleted = schema.columns_to_rows(batch)
    widths = [len(schema.variables[i].fields) for i in chosen]
    out: list[tuple | None] = []
    for row in range(len(keys)):
        parts = [values[i][row] for i in chosen]
        if deleted[row] or all(p is None for p in parts):
            out.append(None)
        else:
            out.append(tuple(x for p, w in zip(parts, widths) for x in (p if p is not None else (None,) * w)))
    return keys, out


def _state_of(entries: list, schema: KeyedSchema, chosen: list[int]) -> dict[tuple, tuple]:
    state: dict[tuple, tuple] = {}
    for kind, batch in entries:
        if kind == "full":
            state = {}
        keys, values = _rows(batch, schema, chosen)
        for k, v in zip(keys, values):
            if v is None:
                state.pop(k, None)
            else:
                state[k] = v
    return state


def _change(kind: str, checkpoint_id: int, key: tuple, value: tuple | None, width: int) -> tuple:
    """A change row: kind, checkpoint, the key's columns, the value's columns (all None for a delete)."""
    return (kind, checkpoint_id, *key, *(value if value is not None else (None,) * width))


__all__ = [
    "CHANGE_TYPE",
    "CHECKPOINT_ID",
    "DELETE",
    "UPSERT",
    "change_fields",
    "output_fields",
    "read_changes",
    "read_state",
    "resolve_checkpoint",
    "split_key_groups",
]
