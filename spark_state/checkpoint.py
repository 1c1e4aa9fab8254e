"""The checkpoint store: writing blobs, committing checkpoints, restoring and cleaning up.

Storage layout under the store's root::

    checkpoints/<checkpoint_id:020d>.json            manifest = the commit record
    blobs/<component>/<checkpoint_id:020d>/<instance:05d>-<start>-<end>-<attempt>.arrow
    instance-state/<component>/<checkpoint_id:020d>/<instance:05d>-<attempt>.bin

Commit protocol for checkpoint N (the code below follows these steps):

1. Every instance that changed state writes its blob for N under a fresh
   attempt name, with an atomic ``create`` (``write_blob``). Nothing
   references the blob yet, so no reader can see it; a retried or
   speculative task writes another attempt and only one is committed.
2. Every instance hands its ``BlobRef`` to the coordinator (the driver).
3. The coordinator derives manifest N from manifest N-1, the blob refs and
   the sources' end offsets of N (``manifest.next_component``), which checks
   that each blob came from the instance that owns its key groups.
4. The coordinator atomically creates ``checkpoints/N.json`` without
   overwrite. **This is the commit point**: N is committed exactly when that
   file exists, and no other step makes anything visible. If it already
   exists, N was committed before and ``CheckpointExistsError`` says so.
5. Cleanup (``cleanup``, coordinator only, best effort, after the commit):
   delete manifests that fell out of ``consistent_checkpoints``, oldest
   first, then every blob under a checkpoint id <= N that no retained
   manifest references. A crash at any point of 1-5 leaves the newest
   committed manifest and all its blobs intact: blobs are only deleted once
   no retained manifest names them, and manifests before blobs.

Finding the latest checkpoint lists ``checkpoints/`` and reads the highest
id, whose checksum is verified: a manifest can only exist complete (step 4 is
atomic), and blob listings are never consulted to decide what is committed.
"""

from __future__ import annotations

import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa

from spark_state.blob import EntryKind, decode_entry, deserialize_schema, encode_blob
from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    CheckpointError,
    ConfigError,
    CorruptBlobError,
    NoCheckpointError,
)
from spark_state.keygroups import KeyGroupRange
from spark_state.manifest import (
    BlobRef,
    ComponentManifest,
    ComponentSpec,
    Manifest,
    QueryBinding,
    next_component,
    with_retention,
)
from spark_state.restore import InstanceRestorePlan, apply_chain
from spark_state.storage.base import Storage, join

CHECKPOINTS_DIR = "checkpoints"
BLOBS_DIR = "blobs"
INSTANCE_STATE_DIR = "instance-state"
DEFAULT_RETAINED = 3


class CheckpointExistsError(CheckpointError):
    """Checkpoint N is already committed; the existing manifest is attached as ``manifest``."""

    def __init__(self, message: str, manifest: Manifest):
        super().__init__(message)
        self.manifest = manifest


@dataclass(frozen=True)
class FetchStats:
    """What a fetch cost: bytes transferred and storage requests made."""

    bytes_read: int
    requests: int
    seconds: float


def manifest_path(checkpoint_id: int) -> str:
    return join(CHECKPOINTS_DIR, f"{checkpoint_id:020d}.json")


def _check_component_name(component: str) -> str:
    if not component or "/" in component or component.startswith(".") or component != component.strip():
        raise ConfigError(
            f"component name {component!r} is invalid: use a non-empty name without '/', "
            "surrounding spaces or a leading '.'"
        )
    return component


class CheckpointStore:
    """Checkpoints of all components of one job in one ``Storage``; see the module docstring."""

    def __init__(self, storage: Storage, *, retained: int = DEFAULT_RETAINED):
        if not isinstance(retained, int) or isinstance(retained, bool) or retained < 1:
            raise ConfigError(f"retained checkpoints must be an integer >= 1, got {retained!r}")
        self.storage = storage
        self.retained = retained
        self._manifests: dict[int, Manifest] = {}

    # Step 1 -----------------------------------------------------------------

    def write_blob(
        self,
        component: str,
        checkpoint_id: int,
        instance: int,
        key_group_range: KeyGroupRange,
        schema: pa.Schema,
        entries: Iterable[tuple[int, EntryKind, pa.Table | pa.RecordBatch]],
        *,
        compression: str | None = None,
    ) -> BlobRef:
        """Write one instance's entries for ``checkpoint_id`` as a new, unreferenced blob.

        ``schema`` is the blob schema; ``entries`` are ``(key_group, kind,
        rows)`` in increasing key-group order, all inside ``key_group_range``
        (the instance's range, inclusive). Returns the ``BlobRef`` to hand to
        the coordinator (step 2).
        """
        _check_component_name(component)
        attempt = uuid.uuid4().hex[:12]
        path = join(
            BLOBS_DIR,
            component,
            f"{checkpoint_id:020d}",
            f"{instance:05d}-{key_group_range.start}-{key_group_range.end}-{attempt}.arrow",
        )
        data, index = encode_blob(
            schema,
            entries,
            key_group_range=key_group_range,
            metadata={"component": component, "checkpoint_id": str(checkpoint_id), "instance": str(instance)},
            compression=compression,
        )
        self.storage.create(path, data)
        return BlobRef(path, checkpoint_id, instance, key_group_range, len(data), zlib.crc32(data), index)

    def write_instance_state(self, component: str, checkpoint_id: int, instance: int, data: bytes) -> str:
        """Write one instance's non-keyed state (opaque bytes) for ``checkpoint_id``; return its path."""
        _check_component_name(component)
        path = join(
            INSTANCE_STATE_DIR, component, f"{checkpoint_id:020d}", f"{instance:05d}-{uuid.uuid4().hex[:12]}.bin"
        )
        self.storage.create(path, data)
        return path

    # Steps 3 and 4 ----------------------------------------------------------

    def commit(
        self,
        checkpoint_id: int,
        components: Mapping[str, tuple[ComponentSpec, Sequence[BlobRef]]],
        sources: Mapping[str, Any],
        *,
        instance_state: Mapping[str, Mapping[int, str]] | None = None,
        binding: QueryBinding | None = None,
    ) -> Manifest:
        """Commit checkpoint ``checkpoint_id`` (steps 3 and 4); return its manifest.

        ``components`` maps each component name to its spec and the blobs
        written for this checkpoint (possibly none). Components of the
        previous checkpoint that are not named carry over unchanged.
        ``checkpoint_id`` must be greater than the latest committed id.
        ``sources`` are the end offsets of the batch, ``binding`` the Spark
        query and batch that wrote it (both recorded as given).
        """
        previous = self.latest()
        if previous is not None and checkpoint_id <= previous.checkpoint_id:
            existing = self.load(checkpoint_id) if checkpoint_id == previous.checkpoint_id else None
            if existing is not None:
                raise CheckpointExistsError(f"checkpoint {checkpoint_id} is already committed", existing)
            raise CheckpointError(
                f"checkpoint {checkpoint_id} is older than the latest committed checkpoint "
                f"{previous.checkpoint_id}; checkpoint ids must increase"
            )
        merged = dict(previous.components) if previous else {}
        for name, (spec, blobs) in components.items():
            _check_component_name(name)
            state = (instance_state or {}).get(name)
            merged[name] = next_component(merged.get(name), spec, checkpoint_id, blobs, state)
        manifest = with_retention(
            Manifest(checkpoint_id, (), dict(sources), merged, committed_at=time.time(), binding=binding),
            previous,
            self.retained,
        )
        try:
            self.storage.create(manifest_path(checkpoint_id), manifest.to_bytes())
        except BlobExistsError:
            raise CheckpointExistsError(
                f"checkpoint {checkpoint_id} was committed concurrently by another coordinator",
                self.load(checkpoint_id),
            ) from None
        self._manifests[checkpoint_id] = manifest
        return manifest

    # Reading ----------------------------------------------------------------

    def committed_ids(self) -> list[int]:
        """Ids of the manifests present, ascending (discovery only; see the module docstring)."""
        ids = []
        for name in self.storage.list(CHECKPOINTS_DIR):
            stem, _, ext = name.partition(".")
            if ext == "json" and stem.isdigit():
                ids.append(int(stem))
        return sorted(ids)

    def latest(self) -> Manifest | None:
        """The newest committed checkpoint's manifest, or None if there is none."""
        ids = self.committed_ids()
        return self.load(ids[-1]) if ids else None

    def load(self, checkpoint_id: int) -> Manifest:
        """The manifest of ``checkpoint_id``; ``NoCheckpointError`` if it was never committed or was cleaned up."""
        cached = self._manifests.get(checkpoint_id)
        if cached is not None:
            return cached
        path = manifest_path(checkpoint_id)
        try:
            data = self.storage.read(path)
        except BlobNotFoundError:
            raise NoCheckpointError(
                f"checkpoint {checkpoint_id} does not exist in {self.storage.uri} "
                f"(committed: {self.committed_ids()[-5:]})"
            ) from None
        manifest = Manifest.from_bytes(data, where=f"{self.storage.uri}/{path}")
        if manifest.checkpoint_id != checkpoint_id:
            raise CorruptBlobError(f"{path} holds checkpoint {manifest.checkpoint_id}, not {checkpoint_id}")
        self._manifests[checkpoint_id] = manifest
        return manifest

    def forget_cached_manifests(self) -> None:
        """Drop parsed manifests kept in memory (the store was replaced behind this object's back)."""
        self._manifests.clear()

    def fetch_entries(
        self, component: ComponentManifest, plan: InstanceRestorePlan
    ) -> tuple[dict[int, list[tuple[str, pa.RecordBatch]]], FetchStats]:
        """Execute ``plan``'s reads and verify every entry's checksum.

        Returns, per planned key group, its ``(kind, batch)`` entries oldest
        first (batches in the blob schema, with ``_deleted``), and the cost.
        """
        started = time.perf_counter()
        schema = deserialize_schema(component.schema)
        decoded: dict[tuple[str, int], pa.RecordBatch] = {}
        bytes_read = 0
        for read in plan.reads:
            data = self.storage.read(read.path, read.offset, read.length)
            bytes_read += len(data)
            view = memoryview(data)
            for entry in read.entries:
                start = entry.offset - read.offset
                decoded[(read.path, entry.key_group)] = decode_entry(
                    view[start : start + entry.length], schema, entry, where=read.path
                )
        entries = {
            key_group: [(entry.kind, decoded[(path, key_group)]) for path, entry in links]
            for key_group, links in plan.chains.items()
        }
        return entries, FetchStats(bytes_read, len(plan.reads), time.perf_counter() - started)

    def fetch(
        self, component: ComponentManifest, plan: InstanceRestorePlan
    ) -> tuple[dict[int, pa.Table], FetchStats]:
        """Execute a plan made without ``have``: the live rows of every planned key group, and the cost."""
        if plan.appends:
            raise ValueError("fetch folds whole chains; use fetch_entries for a catch-up plan")
        entries, stats = self.fetch_entries(component, plan)
        rows = {g: apply_chain(batches, component.key_columns) for g, batches in entries.items()}
        return rows, stats

    # Step 5 -----------------------------------------------------------------

    def cleanup(self, manifest: Manifest) -> list[str]:
        """Delete what no retained checkpoint needs (step 5); return the deleted paths.

        Safe to run again after a crash; never touches anything written for a
        checkpoint id above ``manifest.checkpoint_id`` (it may be in flight).
        """
        retained = set(manifest.consistent_checkpoints)
        deleted: list[str] = []
        for checkpoint_id in self.committed_ids():
            if checkpoint_id < manifest.checkpoint_id and checkpoint_id not in retained:
                self.storage.delete(manifest_path(checkpoint_id))
                self._manifests.pop(checkpoint_id, None)
                deleted.append(manifest_path(checkpoint_id))
        referenced: set[str] = set()
        for checkpoint_id in retained:
            try:
                kept = self.load(checkpoint_id)
            except NoCheckpointError:
                continue
            for component in kept.components.values():
                referenced.update(component.blobs)
                referenced.update(component.instance_state.values())
        for top in (BLOBS_DIR, INSTANCE_STATE_DIR):
            for component in self.storage.list(top):
                for checkpoint_dir in self.storage.list(join(top, component)):
                    if not checkpoint_dir.isdigit() or int(checkpoint_dir) > manifest.checkpoint_id:
                        continue
                    directory = join(top, component, checkpoint_dir)
                    names = self.storage.list(directory)
                    garbage = [join(directory, n) for n in names if join(directory, n) not in referenced]
                    for path in garbage:
                        self.storage.delete(path)
                    deleted.extend(garbage)
                    if len(garbage) == len(names):
                        self.storage.delete(directory)
        return deleted


def open_checkpoint_store(uri: str, *, retained: int = DEFAULT_RETAINED) -> CheckpointStore:
    """A ``CheckpointStore`` over ``spark_state.storage.open_storage(uri)``."""
    from spark_state.storage import open_storage

    return CheckpointStore(open_storage(uri), retained=retained)


def latest_source_offsets(state_store_uri: str, source_id: str) -> Any | None:
    """The offsets recorded for ``source_id`` in the latest committed checkpoint, or None."""
    manifest = open_checkpoint_store(state_store_uri).latest()
    if manifest is None:
        return None
    return manifest.sources.get(source_id)


def retained_source_offsets(state_store_uri: str, source_id: str) -> list[Any]:
    """The offsets recorded for ``source_id`` in every retained checkpoint, newest first."""
    store = open_checkpoint_store(state_store_uri)
    manifest = store.latest()
    if manifest is None:
        return []
    result = []
    for checkpoint_id in manifest.consistent_checkpoints:
        try:
            offsets = store.load(checkpoint_id).sources.get(source_id)
        except NoCheckpointError:
            continue
        if offsets is not None:
            result.append(offsets)
    return result
