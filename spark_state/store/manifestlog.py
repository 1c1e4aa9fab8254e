"""The driver side of a state store: the log of checkpoint manifests, the commit point, retention and cleanup.

Layout under the store's root (``blobstore`` owns ``blobs/`` and ``instance-items/``)::

    checkpoints/<checkpoint_id:020d>.json     the commit record of a checkpoint (``commitlog`` framing)

A record is *full* (the whole manifest) or a *delta* on the record of the
previous checkpoint (``manifest.Manifest.to_json``), so a checkpoint writes
what changed, not the whole key space. A full record is written at least
every ``MAX_DELTAS`` checkpoints and whenever the deltas since the last full
one add up to half its size, which bounds what a cold reader reads; a reader
with the previous manifest in memory reads one small record.

Commit protocol for checkpoint N (``coordinator.Coordinator`` runs it; the code follows these steps):

1. Every instance that changed state writes its blob (and its instance items,
   if they changed) for N under a fresh attempt name (``BlobStore``).
   Nothing references them yet, so no reader can see them; a retried or
   speculative task writes another attempt and only one is committed.
2. Every instance reports its ``BlobRef`` and ``ItemsRef`` to the driver.
3. The driver derives manifest N from manifest N-1, the reports and the
   sources' end offsets of N (``manifest.next_component``), which checks that
   each blob came from the instance that owns its key groups.
4. ``commit`` atomically creates ``checkpoints/N.json`` without overwrite.
   **This is the commit point**: N is committed exactly when that file
   exists, and no other step makes anything visible. If it already exists, N
   was committed before and ``CheckpointExistsError`` says so.
5. ``cleanup`` (driver only, best effort, after the commit): delete manifests
   that fell out of ``consistent_checkpoints`` and are pinned by no savepoint
   (``savepoints``), oldest first, then every blob and items file under a
   checkpoint id <= N that no retained or pinned manifest references and that
   is older than the grace period (the time in its attempt name,
   ``blobstore.written_ms``). A crash at any point of 1-5 leaves the newest
   committed manifest and all its files intact: files are only deleted once
   no retained or pinned manifest names them, and manifests before files.
   The grace period keeps the files of attempts that may still be running
   (a zombie task of a batch that was given up writes late); cleanup deletes
   files one by one, never a directory, so such a late write cannot make it
   fail, and it never deletes a file some retained commit references.

The latest checkpoint is the highest id listed, whose checksum is verified on
load; a file listing never decides what is committed. Cleanup keeps every
record a retained or pinned checkpoint is read from (its chain back to a full
record). Such a record may exist only as the base of a delta: the checkpoints
a store can be restored from are the latest's ``consistent_checkpoints`` and
the savepoints' (``restorable``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    CheckpointError,
    ConfigError,
    CorruptBlobError,
    NoCheckpointError,
)
from spark_state.storage.base import Storage, join
from spark_state.store.blobstore import BLOBS_DIR, ITEMS_DIR, written_ms
from spark_state.store.commitlog import CommitLog
from spark_state.store.manifest import Manifest, with_retention
from spark_state.store.savepoints import Savepoints
from spark_state.store.sources import canonical_source_id

_LOG = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
DEFAULT_RETAINED = 3
MAX_DELTAS = 16
"""At most this many delta records follow a full one."""
DEFAULT_ORPHAN_GRACE_SECONDS = 3600
"""Unreferenced blobs and items younger than this are kept: longer than any task attempt should take."""
FILE_SWEEPS_PER_GRACE = 60
"""A running query lists its store's files (``cleanup(files=True)``) at most this many times per grace period
(``Coordinator.cleanup``): a file is deleted at most 1/60 of the grace period later than it may be (one minute
by default), and the batches in between list no blob or items directory (on an object store, a request per
retained checkpoint directory)."""
CACHED_MANIFESTS = 32
"""Parsed manifests a reader keeps (least recently used dropped first)."""


@dataclass(frozen=True)
class _Lineage:
    """How a checkpoint's record is read: its base (None for a full record), and the delta chain back to it."""

    base: int | None
    full: int
    deltas: int
    delta_bytes: int
    full_bytes: int


@dataclass(frozen=True)
class CleanupPlan:
    """What a cleanup deletes, in this order: ``records`` (checkpoint ids), then ``files``."""

    upto: int
    """The checkpoint it cleans up after; nothing written for a higher id is touched."""
    records: tuple[int, ...]
    files: tuple[str, ...]


class CheckpointExistsError(CheckpointError):
    """Checkpoint N is already committed; the existing manifest is attached as ``manifest``."""

    def __init__(self, message: str, manifest: Manifest):
        super().__init__(message)
        self.manifest = manifest


def manifest_path(checkpoint_id: int) -> str:
    return join(CHECKPOINTS_DIR, f"{checkpoint_id:020d}.json")


class ManifestReader:
    """Reads the committed checkpoints of one state store; parsed manifests are cached (they never change).

    Executors get only this (to find a task's base checkpoint); the driver's
    ``ManifestLog`` adds the commit and cleanup.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self._log = CommitLog(storage, CHECKPOINTS_DIR, what="checkpoint")
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._lineage: dict[int, _Lineage] = {}

    # Reading ----------------------------------------------------------------

    def ids(self) -> list[int]:
        """Ids of the manifests present, ascending (discovery only; see the module docstring)."""
        return self._log.ids()

    def latest(self) -> Manifest | None:
        """The newest committed checkpoint's manifest, or None if there is none."""
        latest = self._log.latest_id()
        return self.load(latest) if latest is not None else None

    def _remember(self, manifest: Manifest, lineage: _Lineage) -> None:
        self._manifests[manifest.checkpoint_id] = manifest
        self._manifests.move_to_end(manifest.checkpoint_id)
        self._lineage[manifest.checkpoint_id] = lineage
        while len(self._manifests) > CACHED_MANIFESTS:
            self._manifests.popitem(last=False)

    def load(self, checkpoint_id: int) -> Manifest:
        """The manifest of ``checkpoint_id``; ``NoCheckpointError`` if it was never committed or was cleaned up.

        A delta record is read on top of its base, itself loaded (from the
        cache when it is there) the same way.
        """
        cached = self._manifests.get(checkpoint_id)
        if cached is not None:
            self._manifests.move_to_end(checkpoint_id)
            return cached
        pending: list[tuple[int, dict, int]] = []
        wanted, base = checkpoint_id, None
        while True:
            try:
                body, size = self._log.load_sized(wanted)
            except CorruptBlobError as exc:
                raise CorruptBlobError(
                    f"{exc}. Restore the file, or start a new checkpointLocation from an older retained checkpoint "
                    f"(spark.state.restoreFrom=<id>; retained ids: {self.ids()[-5:]})"
                ) from exc
            except BlobNotFoundError:
                if not pending:
                    raise NoCheckpointError(
                        f"checkpoint {checkpoint_id} does not exist in {self.storage.uri} (committed: {self.ids()[-5:]})"
                    ) from None
                raise CorruptBlobError(
                    f"checkpoint {pending[-1][0]} in {self.storage.uri} is stored as a delta on checkpoint {wanted}, "
                    f"whose record {self._log.where(wanted)} is missing; restore it, or start from a checkpoint "
                    "stored in full"
                ) from None
            pending.append((wanted, body, size))
            parent = Manifest.base_of(body, where=self._log.where(wanted))
            if parent is None:
                break
            base = self._manifests.get(parent)
            if base is not None:
                break
            wanted = parent
        for record_id, body, size in reversed(pending):
            where = self._log.where(record_id)
            manifest = Manifest.from_json(body, where=where, base=base)
            if manifest.checkpoint_id != record_id:
                raise CorruptBlobError(f"{where} holds checkpoint {manifest.checkpoint_id}, not {record_id}")
            self._remember(manifest, self._lineage_of(record_id, base, size))
            base = manifest
        assert base is not None, "pending holds the record asked for at least"
        return base

    def _lineage_of(self, checkpoint_id: int, base: Manifest | None, size: int) -> _Lineage:
        if base is None:
            return _Lineage(None, checkpoint_id, 0, 0, size)
        parent = self._lineage[base.checkpoint_id]
        return _Lineage(
            base.checkpoint_id, parent.full, parent.deltas + 1, parent.delta_bytes + size, parent.full_bytes
        )

    def records_needed(self, checkpoint_ids) -> set[int]:
        """The records the given checkpoints are read from: each one's chain back to a full record."""
        needed: set[int] = set()
        for checkpoint_id in checkpoint_ids:
            try:
                self.load(checkpoint_id)
            except NoCheckpointError:
                continue
            record: int | None = checkpoint_id
            while record is not None and record not in needed:
                needed.add(record)
                record = self._lineage[record].base
        return needed

    def restorable(self) -> dict[int, list[str]]:
        """The checkpoints a query can start from, newest first: each retained or pinned id -> the savepoints on it.

        Other records present may be only the bases of delta records; their
        blobs may be gone, so they are not listed.
        """
        latest = self.latest()
        ids: dict[int, list[str]] = {i: [] for i in (latest.consistent_checkpoints if latest is not None else ())}
        for savepoint in Savepoints(self.storage).list().savepoints:
            ids.setdefault(savepoint.checkpoint_id, []).append(savepoint.name)
        return {i: sorted(ids[i]) for i in sorted(ids, reverse=True)}

    def forget_cached_manifests(self) -> None:
        """Drop parsed manifests kept in memory (the store was replaced behind this object's back)."""
        self._manifests.clear()
        self._lineage.clear()


class ManifestLog(ManifestReader):
    """The driver's view of a state store's checkpoints: reading, the commit point, retention and cleanup."""

    def __init__(self, storage: Storage, *, retained: int = DEFAULT_RETAINED):
        if not isinstance(retained, int) or isinstance(retained, bool) or retained < 1:
            raise ConfigError(f"retained checkpoints must be an integer >= 1, got {retained!r}")
        super().__init__(storage)
        self.retained = retained

    # Step 4 -----------------------------------------------------------------

    def commit(self, manifest: Manifest, *, restored_from: Manifest | None = None) -> Manifest:
        """Commit ``manifest`` (its ``consistent_checkpoints`` are set here); return what was committed.

        Its id must be greater than the latest committed id. Normally it
        follows the latest checkpoint; ``restored_from`` (``spark.state.restoreFrom``)
        makes it follow that older retained checkpoint instead: its retained
        list and its delta record continue that one, and the checkpoints in
        between (damaged or abandoned) are left to ``cleanup``.
        """
        checkpoint_id = manifest.checkpoint_id
        if restored_from is not None:
            latest_id = self._log.latest_id()
            if latest_id is not None and checkpoint_id <= latest_id:
                raise CheckpointExistsError(
                    f"checkpoint {checkpoint_id} is not above the latest id {latest_id}", restored_from
                )
            return self._create(manifest, restored_from)
        return self._create(manifest, self.latest())

    def _create(self, manifest: Manifest, previous: Manifest | None) -> Manifest:
        checkpoint_id = manifest.checkpoint_id
        if previous is not None and checkpoint_id <= previous.checkpoint_id:
            if checkpoint_id == previous.checkpoint_id:
                raise CheckpointExistsError(f"checkpoint {checkpoint_id} is already committed", previous)
            raise CheckpointError(
                f"checkpoint {checkpoint_id} is older than the latest committed checkpoint "
                f"{previous.checkpoint_id}; checkpoint ids must increase"
            )
        manifest = with_retention(manifest, previous, self.retained)
        lineage = self._lineage.get(previous.checkpoint_id) if previous is not None else None
        full = lineage is None or lineage.deltas >= MAX_DELTAS or 2 * lineage.delta_bytes >= lineage.full_bytes
        try:
            size = self._log.create(checkpoint_id, manifest.to_json(None if full else previous))
        except BlobExistsError:
            raise CheckpointExistsError(
                f"checkpoint {checkpoint_id} was committed concurrently by another coordinator",
                self.load(checkpoint_id),
            ) from None
        self._remember(manifest, self._lineage_of(checkpoint_id, None if full else previous, size))
        return manifest

    # Step 5 -----------------------------------------------------------------

    def plan_cleanup(
        self,
        manifest: Manifest,
        *,
        grace_seconds: float = DEFAULT_ORPHAN_GRACE_SECONDS,
        now_ms: int | None = None,
        files: bool = True,
    ) -> CleanupPlan:
        """What ``cleanup(manifest)`` deletes, without deleting anything (``spark-state cleanup --dry-run``).

        Kept: the checkpoints ``manifest`` retains and those savepoints pin
        (``savepoints``), every record they are read from, every blob and
        items file they reference, everything written for a checkpoint id
        above ``manifest.checkpoint_id`` (it may be in flight), and every
        unreferenced file written less than ``grace_seconds`` before
        ``now_ms`` (unix millis, default now): its attempt may still be
        running. Files named without a time count as old. The savepoints are
        listed after ``manifest`` was committed, so a savepoint created
        concurrently is either seen here or refused by ``create_savepoint``.
        ``CorruptBlobError`` if a savepoint record does not read (it might pin
        anything). With ``files=False`` only records: no blob or items
        directory is listed, and the files are left to a later cleanup.
        """
        cutoff = (int(time.time() * 1000) if now_ms is None else now_ms) - int(grace_seconds * 1000)
        kept_ids = set(manifest.consistent_checkpoints) | Savepoints(self.storage).pinned()
        records = self.records_needed(kept_ids)
        doomed_records = [i for i in self.ids() if i < manifest.checkpoint_id and i not in records]
        referenced: set[str] = set()
        for checkpoint_id in kept_ids:
            try:
                kept = self.load(checkpoint_id)
            except NoCheckpointError:
                continue
            for component in kept.components.values():
                referenced.update(component.blobs)
                referenced.update(ref.path for ref in component.instance_items.values())
        doomed: list[str] = []
        for top in (BLOBS_DIR, ITEMS_DIR) if files else ():
            for component_dir in self.storage.list(top):
                for checkpoint_dir in self.storage.list(join(top, component_dir)):
                    if not checkpoint_dir.isdigit() or int(checkpoint_dir) > manifest.checkpoint_id:
                        continue
                    directory = join(top, component_dir, checkpoint_dir)
                    for name in self.storage.list(directory):
                        path, written = join(directory, name), written_ms(name)
                        if path not in referenced and (written is None or written <= cutoff):
                            doomed.append(path)
        return CleanupPlan(manifest.checkpoint_id, tuple(doomed_records), tuple(doomed))

    def cleanup(
        self,
        manifest: Manifest,
        *,
        grace_seconds: float = DEFAULT_ORPHAN_GRACE_SECONDS,
        now_ms: int | None = None,
        files: bool = True,
    ) -> list[str]:
        """Delete what no retained checkpoint and no savepoint needs (step 5); return the deleted paths.

        Records first, then files, one by one (``plan_cleanup`` says which):
        never a directory, so a zombie attempt writing late cannot make it
        fail, and an emptied directory goes with its last file. Safe to run
        again after a crash. While a savepoint record is damaged it deletes
        nothing and returns ``[]``.
        """
        try:
            plan = self.plan_cleanup(manifest, grace_seconds=grace_seconds, now_ms=now_ms, files=files)
        except CorruptBlobError as exc:
            _LOG.warning("cleanup of %s skipped: %s", self.storage.uri, exc)
            return []
        return self.execute_cleanup(plan)

    def execute_cleanup(self, plan: CleanupPlan) -> list[str]:
        """Delete what ``plan`` names, records first, then files; return the deleted paths."""
        deleted: list[str] = []
        for checkpoint_id in plan.records:
            self._log.delete(checkpoint_id)
            self._manifests.pop(checkpoint_id, None)
            self._lineage.pop(checkpoint_id, None)
            deleted.append(manifest_path(checkpoint_id))
        for path in plan.files:
            self.storage.delete(path)
            deleted.append(path)
        return deleted

    # Sources ----------------------------------------------------------------

    def retained_source_offsets(self, source_id: str) -> list:
        """The offsets recorded for ``source_id`` in every retained checkpoint, newest first, then in every savepoint.

        A source must keep what any of them may restart from (``replayable``'s
        retention never trims below them).
        """
        source_id = canonical_source_id(source_id)
        latest = self.latest()
        result = []
        for checkpoint_id in latest.consistent_checkpoints if latest is not None else ():
            try:
                offsets = self.load(checkpoint_id).sources.get(source_id)
            except NoCheckpointError:
                continue
            if offsets is not None:
                result.append(offsets)
        for savepoint in Savepoints(self.storage).list().savepoints:
            offsets = savepoint.sources.get(source_id)
            if offsets is not None:
                result.append(offsets)
        return result


def open_manifest_log(uri: str, *, retained: int = DEFAULT_RETAINED) -> ManifestLog:
    """A ``ManifestLog`` over ``spark_state.storage.open_storage(uri)``."""
    from spark_state.storage import open_storage

    return ManifestLog(open_storage(uri), retained=retained)


def latest_source_offsets(state_store_uri: str, source_id: str):
    """The offsets recorded for ``source_id`` in the latest committed checkpoint, or None."""
    manifest = open_manifest_log(state_store_uri).latest()
    return None if manifest is None else manifest.sources.get(canonical_source_id(source_id))


def checkpoint_source_offsets(state_store_uri: str, source_id: str, checkpoint_id: int):
    """The offsets recorded for ``source_id`` in retained checkpoint ``checkpoint_id`` (``NoCheckpointError`` if
    it is gone), or None."""
    return open_manifest_log(state_store_uri).load(checkpoint_id).sources.get(canonical_source_id(source_id))


def retained_source_offsets(state_store_uri: str, source_id: str) -> list:
    """The offsets recorded for ``source_id`` in every retained checkpoint, newest first."""
    return open_manifest_log(state_store_uri).retained_source_offsets(source_id)
