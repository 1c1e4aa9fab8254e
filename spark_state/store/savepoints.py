"""Savepoints: named checkpoints that retention and cleanup never delete, and what a query may start from.

A savepoint pins one committed checkpoint of a store: it copies no blob, it is
a record ``savepoints/<name>.json`` (``commitlog`` framing: CRC-checked) that
names the checkpoint, and ``ManifestLog.cleanup`` keeps everything a pinned
checkpoint is read from (its manifest record and the records its delta chain
needs, its blobs and instance items), as it does for retained checkpoints.
The ``replayable`` source's trimming keeps the offsets savepoints record too.

The record also holds what a later start must fit (``SavepointPlan``): per
component its key columns and types, state schema, max parallelism,
parallelism and hash version; and the sources' end offsets of the
checkpoint, where a query started from it continues. A query started from
a savepoint (``spark_state.store.startfrom``) is checked against the plan first.

Creating a savepoint (``create_savepoint``) is safe while the query runs and
cleans up:

1. the checkpoint must be retained by the latest manifest (or pinned by
   another savepoint);
2. the record is created atomically (never overwritten: a name is used once);
3. the latest manifest is read again: if the checkpoint is no longer retained
   (the query committed past it meanwhile) and no other savepoint pins it,
   the record is deleted and ``SavepointError`` says to retry. Otherwise the
   checkpoint is safe: a cleanup that could delete its files runs after a
   commit later than that read, and ``cleanup`` reads the latest manifest
   before it lists savepoints, so it sees the record.

Deleting a savepoint removes only its record; the next cleanup reclaims what
nothing else needs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    ConfigError,
    CorruptBlobError,
    NoCheckpointError,
    SavepointError,
    SavepointExistsError,
    SavepointNotFoundError,
)
from spark_state.storage.base import Storage, join
from spark_state.store.commitlog import decode_record, encode_record
from spark_state.store.manifest import ComponentManifest, Manifest, QueryBinding
from spark_state.store.sources import canonical_sources


class CheckpointSource(Protocol):
    """What ``create_savepoint`` reads a store's checkpoints through (a ``manifestlog.ManifestReader``, which
    imports this module: savepoints never import the log that keeps what they pin)."""

    storage: Storage

    def latest(self) -> Manifest | None: ...

    def load(self, checkpoint_id: int) -> Manifest: ...


SAVEPOINTS_DIR = "savepoints"
SUFFIX = ".json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_savepoint_name(name: str) -> str:
    """Return ``name`` if it can name a savepoint (letters, digits, '.', '_', '-'; at most 128), else ``ConfigError``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith(SUFFIX):
        raise ConfigError(
            f"savepoint name {name!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit, not ending in '.json'"
        )
    return name


def savepoint_path(name: str) -> str:
    return join(SAVEPOINTS_DIR, check_savepoint_name(name) + SUFFIX)


@dataclass(frozen=True)
class ComponentPlan:
    """What a query must declare to continue a component: its key space, keys, schema and hash."""

    name: str
    max_parallelism: int
    parallelism: int
    key_columns: tuple[str, ...]
    schema: str
    """``KeyedSchema.serialize()`` of the state schema (key columns with their types, state variables)."""
    hash_version: int
    format_version: int

    @classmethod
    def of(cls, component: ComponentManifest) -> ComponentPlan:
        return cls(
            component.name,
            component.max_parallelism,
            component.parallelism,
            tuple(component.key_columns),
            component.schema,
            component.hash_version,
            component.format_version,
        )

    def to_json(self) -> dict:
        return {
            "max_parallelism": self.max_parallelism,
            "parallelism": self.parallelism,
            "key_columns": list(self.key_columns),
            "schema": self.schema,
            "hash_version": self.hash_version,
            "format_version": self.format_version,
        }

    @classmethod
    def from_json(cls, name: str, obj: dict) -> ComponentPlan:
        return cls(
            name,
            obj["max_parallelism"],
            obj["parallelism"],
            tuple(obj["key_columns"]),
            obj["schema"],
            obj["hash_version"],
            obj["format_version"],
        )


@dataclass(frozen=True)
class Savepoint:
    """A savepoint record: the pinned checkpoint, the plan that wrote it, and its sources' offsets."""

    name: str
    checkpoint_id: int
    created_at: float
    committed_at: float
    sources: Mapping[str, Any]
    components: Mapping[str, ComponentPlan]
    binding: QueryBinding | None = None
    reason: str = ""
    store: str = ""
    """The URI of the store it was created in (informative: a savepoint is read from where it is)."""

    @property
    def uri(self) -> str:
        """What ``fromSavepoint`` (or ``spark.state.fromSavepoint``) takes: ``<store>/savepoints/<name>``, the
        store's URI parameters (an S3 store's endpoint, say) after the name: ``s3://b/p/savepoints/n?endpoint=..``."""
        base, marked, params = self.store.partition("?")
        return f"{base.rstrip('/')}/{SAVEPOINTS_DIR}/{self.name}" + (f"?{params}" if marked else "")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "checkpoint_id": self.checkpoint_id,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "sources": dict(self.sources),
            "components": {n: c.to_json() for n, c in sorted(self.components.items())},
            "binding": self.binding.to_json() if self.binding is not None else None,
            "reason": self.reason,
            "store": self.store,
        }

    @classmethod
    def from_json(cls, obj: Any, *, where: str) -> Savepoint:
        try:
            binding = obj["binding"]
            return cls(
                name=obj["name"],
                checkpoint_id=int(obj["checkpoint_id"]),
                created_at=obj["created_at"],
                committed_at=obj["committed_at"],
                sources=canonical_sources(obj["sources"]),
                components={n: ComponentPlan.from_json(n, c) for n, c in obj["components"].items()},
                binding=QueryBinding.from_json(binding) if binding is not None else None,
                reason=obj.get("reason", ""),
                store=obj.get("store", ""),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptBlobError(f"{where} has a checksum but not the fields of a savepoint: {exc!r}") from exc

    @classmethod
    def of(
        cls, name: str, manifest: Manifest, *, store: str, reason: str = "", created_at: float | None = None
    ) -> Savepoint:
        return cls(
            name=check_savepoint_name(name),
            checkpoint_id=manifest.checkpoint_id,
            created_at=time.time() if created_at is None else created_at,
            committed_at=manifest.committed_at,
            sources=dict(manifest.sources),
            components={n: ComponentPlan.of(c) for n, c in manifest.components.items()},
            binding=manifest.binding,
            reason=reason,
            store=store,
        )


@dataclass(frozen=True)
class SavepointList:
    """The savepoints of a store; ``damaged`` names records that do not read (``verify`` reports them)."""

    savepoints: tuple[Savepoint, ...]
    damaged: Mapping[str, str] = field(default_factory=dict)

    def pinned(self) -> set[int]:
        """The checkpoint ids the savepoints pin."""
        return {s.checkpoint_id for s in self.savepoints}


class Savepoints:
    """The savepoint records of one store (see the module docstring)."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def where(self, name: str) -> str:
        return f"{self.storage.describe(savepoint_path(name))}"

    def names(self) -> list[str]:
        """Names of the records present (a listing: discovery only)."""
        return [n[: -len(SUFFIX)] for n in self.storage.list(SAVEPOINTS_DIR) if n.endswith(SUFFIX)]

    def get(self, name: str) -> Savepoint:
        """The savepoint ``name``; ``SavepointNotFoundError`` if there is none, ``CorruptBlobError`` if damaged."""
        try:
            data = self.storage.read(savepoint_path(name))
        except BlobNotFoundError:
            present = self.names()
            raise SavepointNotFoundError(
                f"no savepoint {name!r} in {self.storage.uri}; it has {present if present else 'none'}"
            ) from None
        where = self.where(name)
        savepoint = Savepoint.from_json(decode_record(data, where), where=where)
        if savepoint.name != name:
            raise CorruptBlobError(f"{where} holds savepoint {savepoint.name!r}, not {name!r}")
        return savepoint

    def list(self) -> SavepointList:
        """Every savepoint, newest checkpoint first; damaged records are listed apart, never skipped silently."""
        found, damaged = [], {}
        for name in self.names():
            try:
                found.append(self.get(name))
            except (CorruptBlobError, ConfigError) as exc:
                damaged[name] = str(exc)
            except SavepointNotFoundError:
                continue  # deleted between the listing and the read
        found.sort(key=lambda s: (-s.checkpoint_id, s.name))
        return SavepointList(tuple(found), damaged)

    def pinned(self) -> set[int]:
        """The checkpoint ids pinned by savepoints; ``CorruptBlobError`` if a record does not read.

        A damaged record might pin anything, so a caller about to delete must
        stop (``ManifestLog.cleanup`` then deletes nothing).
        """
        listing = self.list()
        if listing.damaged:
            name, problem = next(iter(listing.damaged.items()))
            raise CorruptBlobError(
                f"savepoint record {self.where(name)} does not read ({problem}); nothing is deleted while it is "
                f"damaged: restore it, or delete it with `spark-state savepoint delete {self.storage.uri} {name}`"
            )
        return listing.pinned()

    def delete(self, name: str) -> Savepoint | None:
        """Remove savepoint ``name``'s record (its files go at the next cleanup); return it (None if damaged)."""
        try:
            savepoint = self.get(name)
        except CorruptBlobError:
            savepoint = None
        self.storage.delete(savepoint_path(name))
        return savepoint


def create_savepoint(
    manifests: CheckpointSource, name: str, checkpoint_id: int | None = None, *, reason: str = ""
) -> Savepoint:
    """Pin ``checkpoint_id`` (the latest when None) as savepoint ``name``; see the module docstring's steps.

    ``NoCheckpointError`` if the store has no checkpoint or the checkpoint is
    not retained; ``SavepointExistsError`` if the name is taken;
    ``SavepointError`` if the checkpoint fell out of retention while the
    record was written (retry, with the latest checkpoint).
    """
    check_savepoint_name(name)
    storage = manifests.storage
    savepoints = Savepoints(storage)
    latest = manifests.latest()
    if latest is None:
        raise NoCheckpointError(f"{storage.uri} holds no checkpoint to savepoint")
    wanted = latest.checkpoint_id if checkpoint_id is None else checkpoint_id
    others = savepoints.list().pinned()
    if wanted not in latest.consistent_checkpoints and wanted not in others:
        raise NoCheckpointError(
            f"checkpoint {wanted} of {storage.uri} is not retained (retained: {list(latest.consistent_checkpoints)}, "
            f"pinned by savepoints: {sorted(others)}); savepoint one of those"
        )
    savepoint = Savepoint.of(name, manifests.load(wanted), store=storage.uri, reason=reason)
    try:
        storage.create(savepoint_path(name), encode_record(savepoint.to_json()))
    except BlobExistsError:
        raise SavepointExistsError(
            f"savepoint {name!r} already exists in {storage.uri}; choose another name (a name is never reused)"
        ) from None
    after = manifests.latest()
    retained = after is not None and wanted in after.consistent_checkpoints
    pinned_by_another = any(s.checkpoint_id == wanted and s.name != name for s in savepoints.list().savepoints)
    if not retained and not pinned_by_another:
        storage.delete(savepoint_path(name))
        raise SavepointError(
            f"checkpoint {wanted} of {storage.uri} fell out of retention while savepoint {name!r} was written "
            "(the query committed newer checkpoints meanwhile); nothing was kept. Retry: the latest checkpoint "
            "is retained"
        )
    return savepoint


def parse_savepoint_uri(uri: str) -> tuple[str, str]:
    """``(store URI, name)`` of a savepoint URI ``<store>/savepoints/<name>``; ``ConfigError`` otherwise."""
    marker = f"/{SAVEPOINTS_DIR}/"
    if not isinstance(uri, str) or marker not in uri:
        raise ConfigError(
            f"savepoint {uri!r} is not a savepoint URI: use <state store>/{SAVEPOINTS_DIR}/<name>, as "
            "`spark-state savepoint create` and `spark-state savepoint list` print it"
        )
    store, name = uri.rsplit(marker, 1)
    name, marked, params = name.partition("?")  # the store's URI parameters, after the name
    return store + (f"?{params}" if marked else ""), check_savepoint_name(name.removesuffix(SUFFIX))
