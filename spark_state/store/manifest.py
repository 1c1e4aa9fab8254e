"""Checkpoint manifests: what a committed checkpoint holds, and how the next one is derived.

A manifest is the single source of truth for a checkpoint. It records:

- ``checkpoint_id`` and ``consistent_checkpoints``: the retained committed
  checkpoint ids, newest first, starting with this one;
- ``sources``: one opaque JSON value per source id (its end offsets for this
  checkpoint), so that sources and state form one consistent cut;
- ``binding``: the Spark query and micro-batch that wrote the checkpoint
  (``QueryBinding``: query id, run id, batch id, checkpoint location and the
  offsets the batch started from), which ``coordinator.plan_batch`` checks
  against Spark's own checkpoint before every batch;
- per component: ``max_parallelism`` (the key space, fixed for the whole
  chain), the ``parallelism`` that wrote this checkpoint, hash and format
  versions, key columns, the state schema (``schema.KeyedSchema``: key columns
  and state variables), every blob still referenced (path, writer instance,
  key-group range, size, CRC-32, entry index), for every key group with state
  its *chain*: the blobs holding its entries, oldest first, and each
  instance's non-keyed *instance items* (path, size, CRC-32). A chain starts
  with a ``full`` entry followed by ``delta`` entries; a key group without a
  chain has no state.

Everything here is pure: no I/O. ``next_component`` derives a component's
manifest from the previous one plus the blobs written for the new checkpoint,
and raises instead of guessing when the blobs disagree with the routing.

A checkpoint is stored as one record (``Manifest.to_json``): either *full*
(everything above) or a *delta* on the record of an earlier checkpoint (its
base): per component that changed, the new and dropped blobs and the changed
and cleared chains, so what a checkpoint writes grows with what changed, not
with the key space. ``manifestlog`` chooses between them and reads a delta
on top of its base.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Protocol

from spark_state.errors import (
    CheckpointError,
    ConfigError,
    CorruptBlobError,
    IncompatibleCheckpointError,
    IncompatibleSchemaError,
    KeyGroupOwnershipError,
)
from spark_state.keyspace import HASH_VERSION, UPPER_BOUND_MAX_PARALLELISM, KeyGroupRange, key_group_range
from spark_state.model.eventtime import next_watermark
from spark_state.model.evolution import plan_evolution
from spark_state.model.schema import KeyedSchema
from spark_state.store.blob import FORMAT_VERSION, MAX_ENTRY_ROWS, BlobIndex
from spark_state.store.sources import canonical_sources


@dataclass(frozen=True)
class BlobRef:
    """A written blob: where it is, who wrote it for which key groups, and its index."""

    path: str
    checkpoint_id: int
    instance: int
    key_group_range: KeyGroupRange
    size: int
    crc32: int
    index: BlobIndex
    schema: str | None = None
    """The fingerprint (``schema_fingerprint``) of the state schema the blob was written in, when it is not
    its component's current schema (after a schema evolution); None: the component's schema."""

    def to_json(self) -> list:
        """Compact: ``[path, checkpoint_id, instance, key_group_start, key_group_end, size, crc32, index]``,
        then the schema fingerprint when there is one."""
        kgr = self.key_group_range
        obj = [
            self.path,
            self.checkpoint_id,
            self.instance,
            kgr.start,
            kgr.end,
            self.size,
            self.crc32,
            self.index.to_json(),
        ]
        return obj if self.schema is None else obj + [self.schema]

    @classmethod
    def from_json(cls, obj: list) -> BlobRef:
        path, checkpoint_id, instance, start, end, size, crc32, index, *schema = obj
        return cls(
            path,
            checkpoint_id,
            instance,
            KeyGroupRange(start, end),
            size,
            crc32,
            BlobIndex.from_json(index),
            schema[0] if schema else None,
        )


def schema_fingerprint(schema: str) -> str:
    """A short name of a serialized state schema (``KeyedSchema.serialize``) inside one component's manifest."""
    return f"{zlib.crc32(schema.encode()):08x}"


def rebase_schemas(blobs: dict[str, BlobRef], schemas: dict[str, str], old: str, new: str) -> None:
    """The component's schema changes from ``old`` to ``new``: name each blob's own schema, in place.

    Blobs written in the component's schema (``schema`` None) are in
    ``old``; blobs in ``new`` lose their fingerprint. Both the writer of a
    checkpoint and the reader of its delta record apply it.
    """
    if old == new:
        return
    old_id, new_id = schema_fingerprint(old), schema_fingerprint(new)
    if schemas.setdefault(old_id, old) != old:
        raise CorruptBlobError(f"two state schemas share the fingerprint {old_id}; write this state to a new store")
    for path, ref in list(blobs.items()):
        if ref.schema is None:
            blobs[path] = replace(ref, schema=old_id)
        elif ref.schema == new_id:
            blobs[path] = replace(ref, schema=None)


def _referenced_schemas(blobs: Mapping[str, BlobRef], schemas: Mapping[str, str]) -> dict[str, str]:
    used = {ref.schema for ref in blobs.values() if ref.schema is not None}
    return {fingerprint: text for fingerprint, text in schemas.items() if fingerprint in used}


@dataclass(frozen=True)
class ItemsRef:
    """A written instance-items file: where it is, its size and CRC-32 (checked when read)."""

    path: str
    size: int
    crc32: int

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "crc32": self.crc32}

    @classmethod
    def from_json(cls, obj: dict) -> ItemsRef:
        return cls(obj["path"], obj["size"], obj["crc32"])


@dataclass(frozen=True)
class ComponentSpec:
    """What the running job declares for a component at a checkpoint."""

    name: str
    max_parallelism: int
    parallelism: int
    schema: KeyedSchema
    delay_ms: int | None = None
    """The watermark delay of its event time; None when the component has no event time."""

    @property
    def key_columns(self) -> tuple[str, ...]:
        return self.schema.key_columns


@dataclass(frozen=True)
class ComponentUpdate:
    """What one checkpoint wrote for a component: its blobs, its instance items, the largest event time seen."""

    spec: ComponentSpec
    blobs: Sequence[BlobRef] = ()
    items: Mapping[int, ItemsRef] = field(default_factory=dict)
    max_event_time_ms: int | None = None
    watermark_ms: int | None = None
    """The watermark the batch ran with when it was above the recorded one (an idle advance), else None."""
    rows_at_ms: int | None = None
    """The batch's processing time if it had rows, else None (the recorded one stays)."""


@dataclass(frozen=True)
class ComponentManifest:
    """One component's state in one checkpoint."""

    name: str
    max_parallelism: int
    parallelism: int
    key_columns: tuple[str, ...]
    schema: str  # KeyedSchema.serialize()
    blobs: Mapping[str, BlobRef]
    chains: Mapping[int, tuple[str, ...]]
    hash_version: int = HASH_VERSION
    format_version: int = FORMAT_VERSION
    instance_items: Mapping[int, ItemsRef] = field(default_factory=dict)
    watermark_ms: int | None = None
    """The watermark the next micro-batch runs with (``eventtime``); None without event time or rows."""
    max_event_time_ms: int | None = None
    schemas: Mapping[str, str] = field(default_factory=dict)
    """Older state schemas that referenced blobs were written in, by fingerprint (``BlobRef.schema``)."""
    rows_at_ms: int | None = None
    """The processing time of the latest batch that had rows (idle event time: ``eventtime.idle_watermark``)."""
    wake_ms: int | None = None
    """The processing time at which the component next has work without rows (``model.wake``); None: none."""

    @property
    def keyed_schema(self) -> KeyedSchema:
        """The state schema (key columns and state variables) new blobs are written in."""
        return _deserialize(self.schema, tuple(self.key_columns))

    def blob_schema_text(self, ref: BlobRef) -> str:
        """The serialized state schema blob ``ref`` was written in."""
        if ref.schema is None:
            return self.schema
        try:
            return self.schemas[ref.schema]
        except KeyError:
            raise CorruptBlobError(
                f"component {self.name!r}: blob {ref.path} names state schema {ref.schema}, which the manifest does "
                "not hold; the manifest is damaged: restore it, or start from an earlier checkpoint"
            ) from None

    def blob_keyed_schema(self, ref: BlobRef) -> KeyedSchema:
        """The state schema blob ``ref`` was written in (its entries decode with its ``blob_schema``)."""
        return _deserialize(self.blob_schema_text(ref), tuple(self.key_columns))

    def chain_length(self, key_group: int) -> int:
        """Number of entries a restore of ``key_group`` reads (0 if it has no state)."""
        return len(self.chains.get(key_group, ()))

    def _header(self) -> dict:
        return {
            "max_parallelism": self.max_parallelism,
            "parallelism": self.parallelism,
            "hash_version": self.hash_version,
            "format_version": self.format_version,
            "key_columns": list(self.key_columns),
            "schema": self.schema,
            "instance_items": {str(i): ref.to_json() for i, ref in sorted(self.instance_items.items())},
            "watermark_ms": self.watermark_ms,
            "max_event_time_ms": self.max_event_time_ms,
            "rows_at_ms": self.rows_at_ms,
            "wake_ms": self.wake_ms,
        }

    def to_json(self) -> dict:
        """The whole component (a full record)."""
        paths = sorted(self.blobs)
        obj = {
            **self._header(),
            "blobs": [self.blobs[p].to_json() for p in paths],
            "chains": _chains_json(self.chains, sorted(self.chains)),
        }
        if self.schemas:
            obj["schemas"] = dict(sorted(self.schemas.items()))
        return obj

    def delta_json(self, previous: ComponentManifest) -> dict:
        """What changed since ``previous`` (a delta record): the new blobs, the key groups that became empty,
        and the blobs no chain needs any more.

        The other chains follow from the new blobs' entries (``advance_chains``),
        so the record grows with the change, not with the key space. (A blob
        holding only entries that emptied key groups is not referenced, so the
        emptied key groups are listed.)
        """
        header, before = self._header(), previous._header()
        return {
            **{key: value for key, value in header.items() if before[key] != value},
            "new_blobs": [self.blobs[p].to_json() for p in sorted(self.blobs.keys() - previous.blobs.keys())],
            "cleared": sorted(previous.chains.keys() - self.chains.keys()),
            "dropped_blobs": sorted(previous.blobs.keys() - self.blobs.keys()),
        }

    @classmethod
    def from_json(cls, name: str, obj: dict, previous: ComponentManifest | None = None) -> ComponentManifest:
        """Read a full record's component, or (with ``previous``) apply a delta record's to it (``delta_json``)."""
        if previous is not None:
            obj = {**previous._header(), **obj}  # a delta repeats only the header fields that changed
        schema, key_columns = obj["schema"], obj["key_columns"]
        if not isinstance(schema, str) or not (
            isinstance(key_columns, list) and key_columns and all(isinstance(c, str) for c in key_columns)
        ):
            raise ValueError(
                f"component {name!r} claims the state schema {str(schema)[:40]!r} and key columns "
                f"{str(key_columns)[:80]}"
            )  # made CorruptBlobError by the reader
        new_blobs = None
        if previous is None:
            blobs = {b.path: b for b in map(BlobRef.from_json, obj["blobs"])}
            chains = _chains_from_json(obj["chains"])
            schemas = dict(obj.get("schemas", {}))
            missing = {path for chain in chains.values() for path in chain if path not in blobs}
        else:
            blobs, chains, schemas = dict(previous.blobs), dict(previous.chains), dict(previous.schemas)
            rebase_schemas(blobs, schemas, previous.schema, obj["schema"])
            new_blobs = [BlobRef.from_json(b) for b in obj["new_blobs"]]
            advance_chains(chains, blobs, new_blobs)
            for key_group in obj["cleared"]:
                chains.pop(key_group, None)
            dropped = [blobs.pop(path) for path in obj["dropped_blobs"]]
            missing = {
                ref.path for ref in dropped for e in ref.index.entries if ref.path in chains.get(e.key_group, ())
            }
        if missing:
            raise CorruptBlobError(
                f"component {name!r}: chains name blobs the manifest does not list: {sorted(missing)[:3]}"
            )
        _check_plausible(
            name, obj, blobs if previous is None else new_blobs, chains if previous is None else obj.get("cleared", ())
        )
        return cls(
            name=name,
            max_parallelism=obj["max_parallelism"],
            parallelism=obj["parallelism"],
            key_columns=tuple(obj["key_columns"]),
            schema=obj["schema"],
            blobs=blobs,
            chains=chains,
            hash_version=obj["hash_version"],
            format_version=obj["format_version"],
            instance_items={int(i): ItemsRef.from_json(ref) for i, ref in obj["instance_items"].items()},
            watermark_ms=obj["watermark_ms"],
            max_event_time_ms=obj["max_event_time_ms"],
            schemas=_referenced_schemas(blobs, schemas),
            rows_at_ms=obj.get("rows_at_ms"),  # absent in records of versions before the clock
            wake_ms=obj.get("wake_ms"),
        )


@lru_cache(maxsize=256)
def _deserialize(text: str, key_columns: tuple[str, ...]) -> KeyedSchema:
    return KeyedSchema.deserialize(text, key_columns)


def _check_plausible(name: str, header: dict, blobs, key_groups) -> None:
    """Refuse numbers no real record holds (``ValueError``, made ``CorruptBlobError`` by the reader).

    A hostile or damaged record could otherwise make a reader loop over or
    allocate by them: a key space of 2**40 key groups, an entry of 2**40 rows.
    """
    max_parallelism, parallelism = header["max_parallelism"], header["parallelism"]
    if not (isinstance(max_parallelism, int) and 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM):
        raise ValueError(f"component {name!r} claims max parallelism {max_parallelism!r}")
    if not (isinstance(parallelism, int) and 1 <= parallelism <= max_parallelism):
        raise ValueError(f"component {name!r} claims parallelism {parallelism!r} of {max_parallelism}")
    if any(not isinstance(g, int) or not 0 <= g < max_parallelism for g in key_groups):
        raise ValueError(f"component {name!r} names key groups outside 0..{max_parallelism - 1}")
    for blob in blobs.values() if isinstance(blobs, Mapping) else blobs:
        kgr = blob.key_group_range
        if not (0 <= kgr.start <= kgr.end < max_parallelism and blob.size >= 0 and blob.checkpoint_id >= 0):
            raise ValueError(f"blob {blob.path!r} claims key groups {kgr}, {blob.size} bytes")
        for entry in blob.index.entries:
            if (
                not kgr.start <= entry.key_group <= kgr.end
                or entry.offset < 0
                or entry.length < 0
                or entry.offset + entry.length > blob.size
                or not 0 <= entry.rows <= MAX_ENTRY_ROWS
            ):
                raise ValueError(f"blob {blob.path!r} has an impossible entry {entry}")


def _chains_json(chains: Mapping[int, tuple[str, ...]], key_groups: Sequence[int]) -> dict:
    """Chains of ``key_groups`` as columns: key groups, and per key group its blobs as indexes into ``paths``."""
    paths = sorted({path for g in key_groups for path in chains[g]})
    position = {path: i for i, path in enumerate(paths)}
    return {
        "key_group": list(key_groups),
        "paths": paths,
        "blobs": [[position[p] for p in chains[g]] for g in key_groups],
    }


def _chains_from_json(obj: dict) -> dict[int, tuple[str, ...]]:
    paths = obj["paths"]
    path = paths.__getitem__
    return {g: tuple(map(path, refs)) for g, refs in zip(obj["key_group"], obj["blobs"], strict=True)}


@dataclass(frozen=True)
class QueryBinding:
    """Which Spark query and micro-batch wrote a checkpoint.

    ``query_id`` is Spark's query id (``<checkpointLocation>/metadata``,
    stable across restarts of one checkpoint location), ``run_id`` the id of
    the run that committed, ``batch_id`` Spark's micro-batch id and
    ``checkpoint_location`` the qualified URI of Spark's checkpoint. ``start``
    maps each source id to the offsets the batch started from (None: the
    source's beginning); the end offsets are the manifest's ``sources``.
    ``query_id`` is None only in manifests written before it was recorded;
    those are matched by ``checkpoint_location``.
    """

    query_id: str | None
    run_id: str | None
    batch_id: int
    checkpoint_location: str
    start: Mapping[str, Any] = field(default_factory=dict)

    def same_query(self, query_id: str | None) -> bool:
        """Whether the query ``query_id`` is the one that wrote this binding."""
        return self.query_id == query_id

    def to_json(self) -> dict:
        return {
            "query_id": self.query_id,
            "run_id": self.run_id,
            "batch_id": self.batch_id,
            "checkpoint_location": self.checkpoint_location,
            "start": dict(self.start),
        }

    @classmethod
    def from_json(cls, obj: dict) -> QueryBinding:
        return cls(
            obj["query_id"], obj["run_id"], obj["batch_id"], obj["checkpoint_location"], canonical_sources(obj["start"])
        )


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint."""

    checkpoint_id: int
    consistent_checkpoints: tuple[int, ...]
    sources: Mapping[str, Any]
    components: Mapping[str, ComponentManifest]
    committed_at: float = 0.0
    binding: QueryBinding | None = None
    drained: bool = False
    """The batch of this checkpoint was a drain: every event-time timer fired, the query stopped after it."""
    origin: Mapping[str, Any] | None = None
    """The savepoint this store's state started from (``startfrom``): ``store``, ``savepoint``,
    ``checkpoint_id``; carried into every later checkpoint. None for a store started empty."""

    def to_json(self, previous: Manifest | None = None) -> dict:
        """The record committing this manifest: the whole of it, or (given ``previous``) a delta on it.

        A delta names its base (``previous.checkpoint_id``) and holds, per
        component that changed, only the new and dropped blobs and the changed
        and cleared chains; reading it needs the base (``from_json``).
        """
        body = {
            "format_version": FORMAT_VERSION,
            "kind": "full" if previous is None else "delta",
            "base": None if previous is None else previous.checkpoint_id,
            "checkpoint_id": self.checkpoint_id,
            "consistent_checkpoints": list(self.consistent_checkpoints),
            "committed_at": self.committed_at,
            "sources": dict(self.sources),
            "binding": self.binding.to_json() if self.binding is not None else None,
            "drained": self.drained,
        }
        if self.origin is not None:
            body["origin"] = dict(self.origin)
        if previous is None:
            body["components"] = {name: c.to_json() for name, c in sorted(self.components.items())}
        else:
            body["components"] = {
                name: c.delta_json(previous.components[name]) if name in previous.components else {"full": c.to_json()}
                for name, c in sorted(self.components.items())
                if previous.components.get(name) is not c
            }
        return body

    @staticmethod
    def base_of(body: Any, *, where: str = "manifest") -> int | None:
        """The id of the record a record body is a delta on, or None for a full record."""
        try:
            base = body["base"]
            if body["kind"] not in ("full", "delta") or (base is None) != (body["kind"] == "full"):
                raise ValueError(f"kind {body['kind']!r} with base {base!r}")
            return base
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlobError(f"{where} is not a manifest record: {exc!r}") from exc

    @classmethod
    def from_json(cls, body: Any, *, where: str = "manifest", base: Manifest | None = None) -> Manifest:
        """Read a record; a delta record needs its ``base`` manifest (the one ``base_of`` names)."""
        try:
            version = body["format_version"]
        except (KeyError, TypeError) as exc:
            raise CorruptBlobError(f"{where} is not a manifest: {exc!r}") from exc
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"{where} has format version {body['format_version']}, this spark-state reads "
                f"up to {FORMAT_VERSION}; upgrade spark-state"
            )
        if version < FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"{where} has format version {version} (spark-state 0.1, flat value columns); this spark-state "
                f"reads format {FORMAT_VERSION} (one struct column per state variable). Finish the query with "
                "the spark-state version that wrote it, or start this one on a new spark.state.store"
            )
        wanted = cls.base_of(body, where=where)
        if wanted is not None and (base is None or base.checkpoint_id != wanted):
            raise CorruptBlobError(f"{where} is a delta on checkpoint {wanted}, which was not given to read it")
        try:
            components = dict(base.components) if base is not None else {}
            for name, obj in body["components"].items():
                if base is None or "full" in obj:
                    components[name] = ComponentManifest.from_json(name, obj.get("full", obj))
                else:
                    components[name] = ComponentManifest.from_json(name, obj, base.components[name])
            binding = body["binding"]
            return cls(
                checkpoint_id=body["checkpoint_id"],
                consistent_checkpoints=tuple(body["consistent_checkpoints"]),
                sources=canonical_sources(body["sources"]),
                components=components,
                committed_at=body["committed_at"],
                binding=QueryBinding.from_json(binding) if binding is not None else None,
                drained=body["drained"],
                origin=body.get("origin"),
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise CorruptBlobError(f"{where} has a checksum but not the fields of a manifest: {exc!r}") from exc


def check_component_name(component: str) -> str:
    """Return ``component`` if it can name a directory of the store, else raise ``ConfigError``."""
    if (
        not isinstance(component, str)
        or not component
        or "/" in component
        or "\\" in component
        or component.startswith(".")
        or component != component.strip()
        or any(ord(c) < 32 for c in component)
    ):
        raise ConfigError(
            f"component name {component!r} is invalid: use a non-empty name without '/', '\\', control "
            "characters, surrounding spaces or a leading '.'"
        )
    if len(component.encode()) > MAX_COMPONENT_NAME_BYTES:
        raise ConfigError(
            f"component name {component[:40]!r}... is {len(component.encode())} bytes long: a component names a "
            f"directory of the store, so use at most {MAX_COMPONENT_NAME_BYTES} bytes"
        )
    return component


MAX_COMPONENT_NAME_BYTES = 200
"""A component's name is a directory of its store: file systems take names of at most 255 bytes."""


class StoredComponent(Protocol):
    """What a stored component must show for a query to continue it (a ``ComponentManifest``, or a savepoint's
    ``savepoints.ComponentPlan``), read-only (both are frozen dataclasses)."""

    @property
    def max_parallelism(self) -> int: ...

    @property
    def hash_version(self) -> int: ...

    @property
    def schema(self) -> str: ...  # ``KeyedSchema.serialize()``

    @property
    def key_columns(self) -> Sequence[str]: ...


def continuation_problems(
    stored: StoredComponent, spec: ComponentSpec, *, written: str = "the checkpoints were"
) -> tuple[list[str], IncompatibleSchemaError | None]:
    """Why ``spec`` cannot continue ``stored``: the one compatibility rule of a state (checkpoints, savepoints).

    The key space (``max_parallelism``), the hash and the key columns never
    change within a state: every stored key group would silently belong to
    the wrong keys. Parallelism may change freely. The state schema may
    change as ``evolution`` allows; the schema problem, if any, is the typed
    ``IncompatibleSchemaError`` (naming the column). ``written`` names the
    stored state in messages ("the checkpoints were", "the savepoint's state
    was").
    """
    problems = []
    if spec.max_parallelism != stored.max_parallelism:
        problems.append(
            f"max parallelism is {spec.max_parallelism} but {written} written with {stored.max_parallelism}: set "
            f"spark.state.maxParallelism={stored.max_parallelism} (the key space of a state is fixed), or start a "
            "new state store location"
        )
    if stored.hash_version != HASH_VERSION:
        problems.append(
            f"{written} written with key hash version {stored.hash_version}, this spark-state uses {HASH_VERSION}: "
            "restore with the spark-state version that wrote them"
        )
    if spec.key_columns != tuple(stored.key_columns):
        problems.append(
            f"key columns are {list(spec.key_columns)} but {written} keyed by {list(stored.key_columns)}; restore "
            "with the original key columns, or start a new state store location"
        )
        return problems, None
    schema_error = None
    if spec.schema.serialize() != stored.schema:
        try:
            plan_evolution(spec.name, _deserialize(stored.schema, tuple(stored.key_columns)), spec.schema)
        except IncompatibleSchemaError as error:
            schema_error = error
    return problems, schema_error


def check_compatible(previous: ComponentManifest, spec: ComponentSpec) -> None:
    """Raise ``IncompatibleCheckpointError`` if ``spec`` cannot continue ``previous``'s chain
    (``continuation_problems``), ``IncompatibleSchemaError`` if only its state schema cannot."""
    problems, schema_error = continuation_problems(previous, spec)
    if problems:
        raise IncompatibleCheckpointError(f"component {spec.name!r}: " + "; ".join(problems))
    if schema_error is not None:
        raise schema_error


def next_component(
    previous: ComponentManifest | None, checkpoint_id: int, update: ComponentUpdate
) -> ComponentManifest:
    """Derive a component's manifest for ``checkpoint_id`` from the previous one and what was written.

    Each new blob must have been written for ``checkpoint_id`` by an instance
    that, at ``spec.parallelism``, owns exactly the blob's key-group range;
    at most one blob per instance. The chains follow from the new blobs'
    entries (``advance_chains``); unreferenced blobs drop out. With event time
    (``spec.delay_ms``) the largest event time and the next batch's watermark
    advance (``eventtime.next_watermark``, from the higher of the recorded
    watermark and the one the batch ran with), never backwards.
    """
    spec = update.spec
    if previous is not None:
        check_compatible(previous, spec)
    chains: dict[int, tuple[str, ...]] = dict(previous.chains) if previous else {}
    blobs: dict[str, BlobRef] = dict(previous.blobs) if previous else {}
    schema = spec.schema.serialize()
    schemas: dict[str, str] = dict(previous.schemas) if previous else {}
    if previous is not None:
        rebase_schemas(blobs, schemas, previous.schema, schema)
    seen_instances: set[int] = set()
    for blob in update.blobs:
        _check_blob(blob, spec, checkpoint_id, seen_instances)
    advance_chains(chains, blobs, update.blobs)
    referenced = {path for chain in chains.values() for path in chain}
    watermark = max_event_time = None
    if spec.delay_ms is not None:
        seen = [
            t for t in (previous.max_event_time_ms if previous else None, update.max_event_time_ms) if t is not None
        ]
        max_event_time = max(seen) if seen else None
        ran_with = [w for w in (previous.watermark_ms if previous else None, update.watermark_ms) if w is not None]
        watermark = next_watermark(max(ran_with) if ran_with else None, max_event_time, spec.delay_ms)
    kept = {p: b for p, b in blobs.items() if p in referenced}
    return ComponentManifest(
        name=spec.name,
        max_parallelism=spec.max_parallelism,
        parallelism=spec.parallelism,
        key_columns=spec.key_columns,
        schema=schema,
        blobs=kept,
        chains=chains,
        instance_items=_next_instance_items(previous, spec, update.items),
        watermark_ms=watermark,
        max_event_time_ms=max_event_time,
        schemas=_referenced_schemas(kept, schemas),
        rows_at_ms=update.rows_at_ms if update.rows_at_ms is not None else (previous.rows_at_ms if previous else None),
    )


def advance_chains(chains: dict[int, tuple[str, ...]], blobs: dict[str, BlobRef], new_blobs: Sequence[BlobRef]) -> None:
    """Apply the entries of a checkpoint's new blobs to the chains, in place; add the blobs.

    For every entry: ``full`` replaces the key group's chain (a ``full``
    entry with zero rows clears it), ``delta`` appends to it, ``merge``
    replaces its entries after the full one; a delta or merge with rows for
    a key group without a chain raises ``CheckpointError``. Both the writer
    of a checkpoint and the reader of its delta record apply it.
    """
    for blob in new_blobs:
        blobs[blob.path] = blob
        for entry in blob.index.entries:
            if entry.kind == "full":
                if entry.rows:
                    chains[entry.key_group] = (blob.path,)
                else:
                    chains.pop(entry.key_group, None)
            elif entry.key_group in chains:
                kept = chains[entry.key_group] if entry.kind == "delta" else chains[entry.key_group][:1]
                chains[entry.key_group] = kept + (blob.path,)
            elif entry.rows:
                raise CheckpointError(
                    f"blob {blob.path} has a {entry.kind} entry for key group {entry.key_group}, which has no "
                    "base state; the writer must write a full entry first"
                )


def _next_instance_items(
    previous: ComponentManifest | None, spec: ComponentSpec, written: Mapping[int, ItemsRef]
) -> dict[int, ItemsRef]:
    """Per-instance items: the previous ones updated with the newly written ones.

    They are indexed by instance, so after a parallelism change only those
    written at the new parallelism count: every new instance that holds items
    after redistribution writes them in its first checkpoint.
    """
    for instance in written:
        if not 0 <= instance < spec.parallelism:
            raise KeyGroupOwnershipError(
                f"instance items written by instance {instance}, outside parallelism {spec.parallelism}"
            )
    keep = previous is not None and previous.parallelism == spec.parallelism
    items = dict(previous.instance_items) if keep and previous is not None else {}
    items.update(written)
    return items


def _check_blob(blob: BlobRef, spec: ComponentSpec, checkpoint_id: int, seen: set[int]) -> None:
    if blob.checkpoint_id != checkpoint_id:
        raise CheckpointError(f"blob {blob.path} was written for checkpoint {blob.checkpoint_id}, not {checkpoint_id}")
    if blob.instance in seen:
        raise CheckpointError(
            f"two blobs from instance {blob.instance} of {spec.name!r} for checkpoint {checkpoint_id}; "
            "the coordinator must commit exactly one attempt per instance"
        )
    seen.add(blob.instance)
    owned = key_group_range(blob.instance, spec.parallelism, spec.max_parallelism)
    if blob.key_group_range != owned:
        raise KeyGroupOwnershipError(
            f"blob {blob.path} covers key groups {blob.key_group_range} but instance {blob.instance} "
            f"owns {owned} at parallelism {spec.parallelism}; routing and store disagree"
        )
    for entry in blob.index.entries:
        if entry.key_group not in owned:
            raise KeyGroupOwnershipError(
                f"blob {blob.path} holds key group {entry.key_group}, outside its range {owned}"
            )


def next_manifest(
    previous: Manifest | None,
    checkpoint_id: int,
    updates: Mapping[str, ComponentUpdate],
    sources: Mapping[str, Any],
    *,
    binding: QueryBinding | None = None,
    committed_at: float = 0.0,
    drained: bool = False,
) -> Manifest:
    """Manifest ``checkpoint_id`` derived from ``previous`` (the base) and what was written for it.

    ``updates`` maps each component written to its ``ComponentUpdate``
    (``next_component``); components of ``previous`` not named carry over
    unchanged. ``sources`` are the batch's end offsets. ``consistent_checkpoints``
    is set when it is committed (``with_retention``); ``origin`` carries over.
    """
    components = dict(previous.components) if previous is not None else {}
    for name, update in updates.items():
        check_component_name(name)
        components[name] = next_component(components.get(name), checkpoint_id, update)
    origin = previous.origin if previous is not None else None
    return Manifest(checkpoint_id, (), dict(sources), components, committed_at, binding, drained, origin)


def with_retention(manifest: Manifest, previous: Manifest | None, retained: int) -> Manifest:
    """Set ``consistent_checkpoints``: this id, then the previous list, ``retained`` ids in all."""
    older = previous.consistent_checkpoints if previous else ()
    return replace(manifest, consistent_checkpoints=((manifest.checkpoint_id,) + tuple(older))[:retained])
