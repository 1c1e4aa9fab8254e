"""Starting a query from a savepoint: check that it fits, then give a new store its first checkpoint. No Spark.

A new or changed query names a savepoint (``<store>/savepoints/<name>``,
``StatefulStreamWriter.fromSavepoint`` or ``spark.state.fromSavepoint``) and
writes to a new, empty state store (``spark.state.store``). At ``start``,
before Spark runs anything, ``start_from_savepoint``:

1. reads the savepoint record and checks the query against the plan it
   records (``check_fits``): the component must be in the savepoint with
   the same max parallelism, hash version and key columns, and a state
   schema the stored one can evolve to (``evolution``); savepoint components
   the query does not continue are refused unless ``allow_non_restored``
   (then dropped), and a query component the savepoint does not hold starts
   empty only with ``allow_non_restored`` too. Parallelism may differ: the
   first batch rescales. ``SavepointMismatchError`` lists every difference;
2. copies, byte for byte, the blobs and instance-items files the savepoint's
   checkpoint references for the components it continues, to the same
   relative paths in the new store, each checked against the size and CRC-32
   its manifest recorded (a rerun after a crash skips the files already
   copied intact);
3. commits, as the new store's first checkpoint, the savepoint's manifest
   restricted to those components, under the same checkpoint id, with the
   savepoint's source offsets, no query binding and ``origin`` naming the
   savepoint (carried into every later checkpoint).

**Copy, not reference.** The new store holds everything it needs: a
reference into the old store would tie the new query's state to a savepoint
that an operator may delete, to an old store that its own query keeps
cleaning up, and to that store's backend (a start from an HDFS savepoint into
an S3 store). A copy costs one read and one write of the state once, at the
start, and nothing after.

The query's sources then continue from the savepoint's offsets: the first
batch is refused (``StateOfAnotherQueryError``) unless every source starts
exactly there (``replayable``: ``option("startingOffsets", "checkpoint")``
with ``option("stateStore", <the new store>)``; other sources: their starting
offsets set to the values ``spark-state savepoint list`` prints). A restart
of the same query (the new store's state has this ``origin``) does nothing
here, also once the savepoint is deleted (the copy allows that); a non-empty
store of other origin is refused.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    CorruptBlobError,
    SavepointError,
    SavepointMismatchError,
    SavepointNotFoundError,
)
from spark_state.storage.base import Storage
from spark_state.store.manifest import ComponentManifest, ComponentSpec, Manifest, continuation_problems
from spark_state.store.manifestlog import ManifestLog, ManifestReader
from spark_state.store.savepoints import ComponentPlan, Savepoint, Savepoints, parse_savepoint_uri

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartReport:
    """What a start from a savepoint did: the checkpoint committed (None on a restart), files and bytes copied,
    and files an earlier, crashed start had copied intact already (not copied again)."""

    savepoint: Savepoint | None
    """None on a restart of the query the savepoint started after the savepoint was deleted."""
    checkpoint_id: int | None
    files_copied: int
    bytes_copied: int
    restored: tuple[str, ...]
    dropped: tuple[str, ...]
    files_present: int = 0


def origin_of(savepoint: Savepoint) -> dict:
    return {"store": savepoint.store, "savepoint": savepoint.name, "checkpoint_id": savepoint.checkpoint_id}


def check_fits(savepoint: Savepoint, spec: ComponentSpec, *, allow_non_restored: bool) -> tuple[str, ...]:
    """The savepoint components the query continues; ``SavepointMismatchError`` naming every difference."""
    problems: list[str] = []
    others = sorted(n for n in savepoint.components if n != spec.name)
    plan = savepoint.components.get(spec.name)
    if plan is None and not allow_non_restored:
        problems.append(
            f"the query's component {spec.name!r} is not in the savepoint (it holds {sorted(savepoint.components)}): "
            f"name the component like the one to continue, or pass allow_non_restored_state=True to start "
            f"{spec.name!r} empty from the savepoint's source offsets"
        )
    if others and not allow_non_restored:
        problems.append(
            f"the savepoint holds state of component(s) {others} that this query does not continue; pass "
            "allow_non_restored_state=True to drop it"
        )
    if plan is not None:
        problems.extend(_plan_problems(plan, spec))
    if problems:
        raise SavepointMismatchError(
            f"cannot start from savepoint {savepoint.uri} (checkpoint {savepoint.checkpoint_id}): "
            + "; ".join(problems)
        )
    return (spec.name,) if plan is not None else ()


def _plan_problems(plan: ComponentPlan, spec: ComponentSpec) -> list[str]:
    """Why ``spec`` cannot start from the savepoint's component (``manifest.continuation_problems``)."""
    problems, schema_error = continuation_problems(plan, spec, written="the savepoint's state was")
    return problems + ([str(schema_error)] if schema_error is not None else [])


def start_from_savepoint(
    target: ManifestLog,
    savepoint_uri: str,
    spec: ComponentSpec,
    *,
    allow_non_restored: bool = False,
    key_space_set: bool = True,
    open_storage: Callable[[str], Storage] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> StartReport:
    """Give ``target`` (the query's store) its first checkpoint from the savepoint; see the module docstring.

    ``progress(bytes_done, bytes_total)`` is called after each copied file.
    Without ``key_space_set`` (``spark.state.maxParallelism`` unset), the
    query takes the savepoint's key space instead of ``spec``'s.
    """
    if open_storage is None:
        from spark_state.storage import open_storage as open_default

        open_storage = open_default
    store_uri, name = parse_savepoint_uri(savepoint_uri)
    source = open_storage(store_uri)
    latest = target.latest()
    try:
        savepoint = Savepoints(source).get(name)
    except SavepointNotFoundError:
        if (
            latest is not None
            and latest.origin is not None
            and (latest.origin.get("store"), latest.origin.get("savepoint")) == (source.uri, name)
        ):
            # A restart of the query this savepoint started, deleted since (as the copy allows): the state
            # is in the query's own store.
            return StartReport(None, None, 0, 0, (), ())
        raise
    savepoint = replace(savepoint, store=source.uri)
    if latest is not None:
        if latest.origin is not None and _same(latest.origin, origin_of(savepoint)):
            return StartReport(savepoint, None, 0, 0, (), ())
        raise SavepointError(
            f"the state store {target.storage.uri} already holds state (checkpoint {latest.checkpoint_id}"
            + (f", started from {latest.origin}" if latest.origin else "")
            + f") and cannot start from savepoint {savepoint.uri}: a start from a savepoint writes to an empty "
            "store. Set spark.state.store to a new location, or remove fromSavepoint to continue this state"
        )
    if not key_space_set and spec.name in savepoint.components:
        spec = replace(spec, max_parallelism=savepoint.components[spec.name].max_parallelism)
    restored = check_fits(savepoint, spec, allow_non_restored=allow_non_restored)
    manifest = ManifestReader(source).load(savepoint.checkpoint_id)
    components = {n: manifest.components[n] for n in restored}
    files, copied, present = _copy_files(source, target.storage, list(components.values()), progress)
    first = Manifest(
        checkpoint_id=savepoint.checkpoint_id,
        consistent_checkpoints=(),
        sources=dict(savepoint.sources),
        components=components,
        committed_at=time.time(),
        binding=None,
        drained=manifest.drained,
        origin=origin_of(savepoint),
    )
    committed = target.commit(first)
    dropped = tuple(sorted(set(savepoint.components) - set(restored)))
    _LOG.warning(
        "started %s from savepoint %s: checkpoint %d, %d files (%d bytes) copied, %d there already, "
        "components %s, dropped %s",
        target.storage.uri,
        savepoint.uri,
        committed.checkpoint_id,
        files,
        copied,
        present,
        list(restored),
        list(dropped),
    )
    return StartReport(savepoint, committed.checkpoint_id, files, copied, restored, dropped, present)


def _same(a, b) -> bool:
    return (a.get("savepoint"), a.get("checkpoint_id"), a.get("store")) == (
        b["savepoint"],
        b["checkpoint_id"],
        b["store"],
    )


def _copy_files(
    source: Storage, target: Storage, components: list[ComponentManifest], progress: Callable[[int, int], None] | None
) -> tuple[int, int, int]:
    """Copy what ``components`` reference; (files and bytes copied, files already there intact)."""
    wanted = [(ref.path, ref.size, ref.crc32) for c in components for ref in c.blobs.values()]
    wanted += [(ref.path, ref.size, ref.crc32) for c in components for ref in c.instance_items.values()]
    total = sum(size for _, size, _ in wanted)
    done = files = copied = 0
    for path, size, crc in wanted:
        data = source.read(path)
        if len(data) != size or zlib.crc32(data) != crc:
            raise CorruptBlobError(
                f"{source.describe(path)} does not match its manifest ({len(data)} bytes, the manifest recorded {size} "
                "and a CRC-32); the savepoint is damaged: verify it with `spark-state verify`, restore the file "
                "from a replica, or start from another savepoint"
            )
        written = True
        try:
            target.create(path, data)
        except BlobExistsError:
            written = not _intact(target, path, size, crc)
            if written:
                target.create(path, data, overwrite=True)
        if written:
            files, copied = files + 1, copied + size
        done += size
        if progress is not None:
            progress(done, total)
    return files, copied, len(wanted) - files


def _intact(storage: Storage, path: str, size: int, crc: int) -> bool:
    try:
        data = storage.read(path)
    except BlobNotFoundError:
        return False
    return len(data) == size and zlib.crc32(data) == crc
