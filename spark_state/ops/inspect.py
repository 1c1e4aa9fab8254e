"""What the operations CLI reports, as plain JSON-able dicts: checkpoints, a description, a rescale plan, a verify.

Every function here only reads the store (through ``ManifestReader`` and
``Storage.read``/``size``/``list``); the CLI (``spark_state.ops.cli``) renders
the results as tables or JSON. Manifests are always read through
``ManifestReader`` (a record may be a delta on an earlier one), and only
restorable checkpoints (the latest's retained ones and the savepoints') are
listed as checkpoints.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from spark_state.errors import (
    BlobNotFoundError,
    ConfigError,
    IncompatibleCheckpointError,
    NoCheckpointError,
    SparkStateError,
    StorageError,
)
from spark_state.keyspace import check_parallelism, key_group_range
from spark_state.model.timers import TIMER_KINDS, TIMERS, earlier
from spark_state.store.blob import read_blob_file
from spark_state.store.manifest import ComponentManifest, Manifest
from spark_state.store.manifestlog import ManifestReader
from spark_state.store.restore import InstanceRestorePlan, chain_links, plan_restore
from spark_state.store.savepoints import Savepoints

Progress = Callable[[int, int], None]


def iso(seconds: float | None) -> str | None:
    """A time as ISO 8601 UTC (None stays None); one past the calendar's years (a watermark far in the future, or
    event times that were microseconds in a long column) as its seconds, said so, never an exception."""
    if not seconds:
        return None
    try:
        return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return f"{seconds:.0f} s since the epoch (past the years a calendar date can name: were they microseconds?)"


def component_bytes(component: ComponentManifest) -> int:
    """Bytes of the blobs and items files a component references."""
    return sum(b.size for b in component.blobs.values()) + sum(i.size for i in component.instance_items.values())


def list_checkpoints(manifests: ManifestReader) -> list[dict]:
    """The restorable checkpoints, newest first (see the module docstring)."""
    latest = manifests.latest()
    retained = set(latest.consistent_checkpoints) if latest is not None else set()
    result = []
    for checkpoint_id, savepoints in manifests.restorable().items():
        manifest = manifests.load(checkpoint_id)
        result.append(
            {
                "checkpoint_id": checkpoint_id,
                "committed_at": iso(manifest.committed_at),
                "retained": checkpoint_id in retained,
                "savepoints": savepoints,
                "components": {
                    name: {
                        "parallelism": c.parallelism,
                        "max_parallelism": c.max_parallelism,
                        "key_groups_with_state": len(c.chains),
                        "bytes": component_bytes(c),
                    }
                    for name, c in sorted(manifest.components.items())
                },
                "sources": dict(manifest.sources),
                "bytes_referenced": _bytes_referenced(manifest),
                "batch_id": manifest.binding.batch_id if manifest.binding is not None else None,
                "query_id": manifest.binding.query_id if manifest.binding is not None else None,
                "drained": manifest.drained,
                "origin": manifest.origin,
            }
        )
    return result


def _bytes_referenced(manifest: Manifest) -> int:
    return sum(component_bytes(c) for c in manifest.components.values())


def describe_component(component: ComponentManifest) -> dict:
    """Schema, key-group ranges per instance, chains, entries per key group, watermark and timers."""
    schema = component.keyed_schema
    per_group: list[dict[str, Any]] = []
    earliest: tuple[int | None, ...] = (None,) * len(TIMER_KINDS)
    groups_with_timers = 0
    for key_group in sorted(component.chains):
        links = chain_links(component, key_group)
        last = links[-1][1]
        per_group.append(
            {
                "key_group": key_group,
                "entries": len(links),
                "rows": sum(e.rows for _, e in links),
                "bytes": sum(e.length for _, e in links),
                "kinds": [e.kind for _, e in links],
            }
        )
        if last.earliest is not None and any(t is not None for t in last.earliest):
            groups_with_timers += 1
            earliest = earlier(earliest, last.earliest)
    instances = []
    for instance in range(component.parallelism):
        owned = key_group_range(instance, component.parallelism, component.max_parallelism)
        mine = [g for g in per_group if g["key_group"] in owned]
        instances.append(
            {
                "instance": instance,
                "key_groups": [owned.start, owned.end],
                "key_groups_with_state": len(mine),
                "entries": sum(g["entries"] for g in mine),
                "bytes": sum(g["bytes"] for g in mine),
                "items_bytes": component.instance_items[instance].size if instance in component.instance_items else 0,
            }
        )
    lengths = Counter(g["entries"] for g in per_group)
    return {
        "name": component.name,
        "max_parallelism": component.max_parallelism,
        "parallelism": component.parallelism,
        "hash_version": component.hash_version,
        "format_version": component.format_version,
        "schema": {
            "keys": [{"name": f.name, "type": str(f.type)} for f in schema.keys],
            "variables": [
                {
                    "name": v.name,
                    "columns": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in v.fields],
                }
                for v in schema.variables
            ],
            "older_schemas_in_use": len(component.schemas),
        },
        "blobs": len(component.blobs),
        "bytes": component_bytes(component),
        "key_groups_with_state": len(component.chains),
        "chain_lengths": {str(n): lengths[n] for n in sorted(lengths)},
        "longest_chain": max(lengths, default=0),
        "watermark_ms": component.watermark_ms,
        "watermark": iso(component.watermark_ms / 1000) if component.watermark_ms is not None else None,
        "max_event_time_ms": component.max_event_time_ms,
        "timers": {
            "variable": schema.has_variable(TIMERS.name),
            "key_groups_with_timers": groups_with_timers,
            "earliest_ms": dict(zip(TIMER_KINDS, earliest)),
        },
        "instances": instances,
        "key_groups": per_group,
    }


def describe(manifest: Manifest, component: str | None = None) -> dict:
    """``describe_component`` of one component (or all) of a checkpoint, with the checkpoint's header."""
    names = [component] if component is not None else sorted(manifest.components)
    missing = [n for n in names if n not in manifest.components]
    if missing:
        raise NoCheckpointError(
            f"checkpoint {manifest.checkpoint_id} has no component {missing[0]!r}; it has {sorted(manifest.components)}"
        )
    return {
        "checkpoint_id": manifest.checkpoint_id,
        "committed_at": iso(manifest.committed_at),
        "sources": dict(manifest.sources),
        "binding": manifest.binding.to_json() if manifest.binding is not None else None,
        "drained": manifest.drained,
        "origin": manifest.origin,
        "components": [describe_component(manifest.components[n]) for n in names],
    }


def _plan_json(plans: tuple[InstanceRestorePlan, ...]) -> list[dict]:
    return [
        {
            "instance": p.instance,
            "key_groups": [p.key_group_range.start, p.key_group_range.end],
            "key_groups_with_state": len(p.chains),
            "requests": len(p.reads),
            "bytes": p.bytes_to_read,
            "reads": [
                {"path": r.path, "offset": r.offset, "length": r.length, "entries": len(r.entries)} for r in p.reads
            ],
        }
        for p in plans
    ]


def plan_rescale(component: ComponentManifest, parallelism: int) -> dict:
    """The pure restore plan (``restore.plan_restore``) at ``parallelism`` and at the current parallelism."""
    check_parallelism(parallelism, component.max_parallelism)
    target = plan_restore(component, parallelism)
    current = plan_restore(component, component.parallelism)
    state = sum(e.length for g in component.chains for _, e in chain_links(component, g))

    def summary(plans):
        return {
            "parallelism": len(plans),
            "requests": sum(len(p.reads) for p in plans),
            "bytes": sum(p.bytes_to_read for p in plans),
            "max_bytes_per_instance": max((p.bytes_to_read for p in plans), default=0),
            "max_requests_per_instance": max((len(p.reads) for p in plans), default=0),
            "instances": _plan_json(plans),
        }

    return {
        "component": component.name,
        "max_parallelism": component.max_parallelism,
        "state_bytes": state,
        "target": summary(target),
        "current": summary(current),
    }


# --------------------------------------------------------------------------- verify


def verify_store(manifests: ManifestReader, *, deep: bool = False, progress: Progress | None = None) -> dict:
    """Check a store; ``problems`` lists what is wrong (empty: intact).

    Every checkpoint record must parse (checksum, fields) and chain (a delta's
    base present and readable); the latest's retained checkpoints and every
    savepoint's must load; their chains must start with a full entry and name
    entries their blobs' indexes hold; every blob and items file they
    reference must exist with the recorded size and CRC-32 (``deep`` also
    decodes every entry against its index).
    """
    storage = manifests.storage
    problems: list[dict] = []

    def problem(what: str, path: str, detail: str) -> None:
        problems.append({"what": what, "path": path, "detail": detail})

    record_ids = manifests.ids()
    for checkpoint_id in record_ids:
        try:
            manifests.load(checkpoint_id)
        except (SparkStateError, ValueError) as exc:
            problem("record", f"checkpoints/{checkpoint_id:020d}.json", str(exc))
    latest = None
    for checkpoint_id in reversed(record_ids):
        try:
            latest = manifests.load(checkpoint_id)
            break
        except (SparkStateError, ValueError):
            continue
    wanted: dict[int, str] = {
        i: "retained by the latest checkpoint" for i in (latest.consistent_checkpoints if latest else ())
    }
    savepoints = Savepoints(storage).list()
    for name, detail in savepoints.damaged.items():
        problem("savepoint", f"savepoints/{name}.json", detail)
    for savepoint in savepoints.savepoints:
        wanted.setdefault(savepoint.checkpoint_id, f"pinned by savepoint {savepoint.name!r}")
    files: dict[str, tuple[int, int, Any]] = {}
    for checkpoint_id, why in sorted(wanted.items()):
        try:
            manifest = manifests.load(checkpoint_id)
        except NoCheckpointError:
            problem(
                "record", f"checkpoints/{checkpoint_id:020d}.json", f"checkpoint {checkpoint_id} ({why}) is missing"
            )
            continue
        except (SparkStateError, ValueError):
            continue  # reported above
        for component in manifest.components.values():
            _check_chains(component, checkpoint_id, problem)
            for ref in component.blobs.values():
                _expect(files, ref.path, ref.size, ref.crc32, (component, ref), problem)
            for items_ref in component.instance_items.values():
                _expect(files, items_ref.path, items_ref.size, items_ref.crc32, None, problem)
    total = sum(size for size, _, _ in files.values())
    done = 0
    for path, (size, crc, blob) in sorted(files.items()):
        _check_file(storage, path, size, crc, blob, deep, problem)
        done += size
        if progress is not None:
            progress(done, total)
    return {
        "store": storage.uri,
        "ok": not problems,
        "checked": {
            "records": len(record_ids),
            "restorable_checkpoints": len(wanted),
            "savepoints": len(savepoints.savepoints),
            "files": len(files),
            "bytes": total,
        },
        "problems": problems,
    }


def _check_chains(component: ComponentManifest, checkpoint_id: int, problem) -> None:
    for key_group in sorted(component.chains):
        try:
            links = chain_links(component, key_group)
        except SparkStateError as exc:
            problem("chain", f"checkpoint {checkpoint_id}", str(exc))
            continue
        kinds = [entry.kind for _, entry in links]
        if kinds[0] != "full":
            problem(
                "chain",
                f"checkpoint {checkpoint_id}",
                f"component {component.name!r} key group {key_group}: its chain starts with a {kinds[0]} entry",
            )
        elif "full" in kinds[1:] or "merge" in kinds[2:]:
            problem(
                "chain",
                f"checkpoint {checkpoint_id}",
                f"component {component.name!r} key group {key_group}: its chain has entries {kinds}; a full "
                "entry may only start it and a merge entry may only follow the full one",
            )


def _expect(files, path, size, crc, blob, problem) -> None:
    known = files.get(path)
    if known is not None and (known[0], known[1]) != (size, crc):
        problem(
            "manifest", path, f"two checkpoints record different sizes or CRC-32s for it ({known[0]} and {size} bytes)"
        )
    files.setdefault(path, (size, crc, blob))


def _check_file(storage, path: str, size: int, crc: int, blob, deep: bool, problem) -> None:
    try:
        data = storage.read(path)
    except BlobNotFoundError:
        problem("missing", path, "referenced by a restorable checkpoint, but not in the store")
        return
    except StorageError as exc:
        problem("unreadable", path, str(exc))
        return
    if len(data) != size:
        problem("size", path, f"{len(data)} bytes, the manifest recorded {size} (truncated or overwritten)")
        return
    if zlib.crc32(data) != crc:
        problem("crc", path, f"CRC-32 {zlib.crc32(data):08x}, the manifest recorded {crc:08x} (bytes changed)")
        return
    if deep and blob is not None:
        component, ref = blob
        try:
            read_blob_file(data, ref.index)
        except (SparkStateError, IncompatibleCheckpointError) as exc:
            problem("entries", path, str(exc))


def check_drainable(manifests: ManifestReader, run_id: str) -> None:
    """``ConfigError`` unless ``run_id`` is a run the store saw commit that is not recorded as stopped: a drain
    request for any other run would wait for a batch that never comes."""
    from spark_state.store.stops import stopped_run

    if stopped_run(manifests.storage) == run_id:
        raise ConfigError(f"run {run_id} of {manifests.storage.uri} is recorded as stopped: there is nothing to drain")
    latest = manifests.latest()
    seen = []
    for checkpoint_id in latest.consistent_checkpoints if latest is not None else ():
        binding = manifests.load(checkpoint_id).binding
        if binding is not None and binding.run_id not in seen:
            seen.append(binding.run_id)
    if run_id not in seen:
        raise ConfigError(
            f"{manifests.storage.uri} has no retained checkpoint of run {run_id} (the runs it has: "
            f"{', '.join(map(str, seen)) or 'none'}): use the query's current query.runId; a run that has not "
            "committed a batch yet can be asked with --force"
        )
