"""The executor side of a state store: write and fetch blobs and instance items, every byte checksummed.

Layout under the store's root (the driver's ``manifestlog`` owns ``checkpoints/``)::

    blobs/<component>/<checkpoint_id:020d>/<instance:05d>-<start>-<end>-<attempt>.arrow
    instance-items/<component>/<checkpoint_id:020d>/<instance:05d>-<attempt>.json

``<attempt>`` is ``<unix millis, 13 digits>-<12 random hex digits>``: when the
attempt wrote the file (``written_ms`` reads it back) and a fresh name. A
task writes under a fresh attempt name with an atomic ``create``; nothing
refers to the file until the driver commits a manifest naming it (step 1 of
the commit protocol in ``manifestlog``), so a failed, retried, speculative or
zombie attempt (one still running after its batch was given up) leaves at
most an unreferenced file, collected by ``cleanup`` once it is older than the
grace period. Every
read is verified against the size and CRC-32 the manifest recorded: a
damaged file raises ``CorruptBlobError`` naming it and is never served.
"""

from __future__ import annotations

import json
import re
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from spark_state.errors import BlobNotFoundError, CorruptBlobError, MissingFileError, ShortReadError
from spark_state.keyspace import KeyGroupRange
from spark_state.model.evolution import cached_evolution
from spark_state.model.schema import KeyedSchema
from spark_state.storage.base import Storage, join
from spark_state.store.blob import EntryKind, decode_entry, encode_blob
from spark_state.store.manifest import BlobRef, ComponentManifest, ItemsRef, check_component_name
from spark_state.store.restore import InstanceRestorePlan

RECOVERY = (
    "start a new checkpointLocation from an older retained checkpoint (spark.state.restoreFrom=<id>; see "
    "docs/guarantees.md)"
)
"""What to do about a damaged or missing file of a committed checkpoint, for messages."""
BLOBS_DIR = "blobs"
ITEMS_DIR = "instance-items"

FetchedEntries = dict[int, list[tuple[EntryKind, pa.RecordBatch]]]
"""Per key group, its ``(kind, batch)`` entries oldest first, in the blob schema (with ``_deleted``)."""


@dataclass(frozen=True)
class FetchStats:
    """What a fetch cost: bytes transferred and storage requests made."""

    bytes_read: int
    requests: int
    seconds: float


def entry_reader(component: ComponentManifest, ref: BlobRef, target: str) -> Callable[..., pa.RecordBatch]:
    """``convert(data, entry, where)``: decode an entry of blob ``ref`` (checksum checked) into schema ``target``.

    ``target`` is a serialized state schema (``KeyedSchema.serialize``); an
    entry written in another schema is cast (``evolution.cached_evolution``).
    """
    written = component.blob_schema_text(ref)
    key_columns = tuple(component.key_columns)
    blob_schema = component.blob_keyed_schema(ref).blob_schema
    if written == target:
        return lambda data, entry, where: decode_entry(data, blob_schema, entry, where=where)
    evolution = cached_evolution(component.name, written, target, key_columns)
    return lambda data, entry, where: evolution.conform(decode_entry(data, blob_schema, entry, where=where))


_WRITTEN = re.compile(r"-(\d{13})-[0-9a-f]{12}\.(?:arrow|json)$")


def _attempt(now_ms: int | None = None) -> str:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return f"{now_ms:013d}-{uuid.uuid4().hex[:12]}"


def written_ms(name: str) -> int | None:
    """The unix millis at which the attempt that wrote file ``name`` named it; None for older names without one."""
    match = _WRITTEN.search(name)
    return int(match.group(1)) if match else None


class BlobStore:
    """Blobs and instance items in ``storage``; see the module docstring."""

    def __init__(self, storage: Storage):
        self.storage = storage

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
        earliest=None,
        live=None,
    ) -> BlobRef:
        """Write one instance's entries for ``checkpoint_id`` as a new, unreferenced blob.

        ``schema`` is the blob schema; ``entries`` are ``(key_group, kind,
        rows)`` in increasing key-group order, all inside ``key_group_range``
        (the instance's range, inclusive); ``earliest`` the earliest timers and
        ``live`` the keys held per key group (``blob.encode_blob``). Returns
        the ``BlobRef`` to report to the driver.
        """
        check_component_name(component)
        path = join(
            BLOBS_DIR,
            component,
            f"{checkpoint_id:020d}",
            f"{instance:05d}-{key_group_range.start}-{key_group_range.end}-{_attempt()}.arrow",
        )
        data, index = encode_blob(
            schema,
            entries,
            key_group_range=key_group_range,
            metadata={"component": component, "checkpoint_id": str(checkpoint_id), "instance": str(instance)},
            compression=compression,
            earliest=earliest,
            live=live,
        )
        self.storage.create(path, data)
        return BlobRef(path, checkpoint_id, instance, key_group_range, len(data), zlib.crc32(data), index)

    def write_items(self, component: str, checkpoint_id: int, instance: int, items: Sequence[Any]) -> ItemsRef:
        """Write one instance's items (a JSON list) for ``checkpoint_id`` as a new, unreferenced file."""
        check_component_name(component)
        path = join(ITEMS_DIR, component, f"{checkpoint_id:020d}", f"{instance:05d}-{_attempt()}.json")
        data = json.dumps(list(items)).encode()
        self.storage.create(path, data)
        return ItemsRef(path, len(data), zlib.crc32(data))

    def _read(self, what: str, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of a file a committed checkpoint references; a missing or truncated one is a typed error."""
        try:
            return self.storage.read(path, offset, length)
        except BlobNotFoundError as exc:
            raise MissingFileError(
                f"{what} {self.storage.describe(path)} is missing, but a committed checkpoint references it; restore "
                f"the file, or {RECOVERY}"
            ) from exc
        except ShortReadError as exc:
            raise CorruptBlobError(
                f"{what} {self.storage.describe(path)} is truncated (the checkpoint recorded bytes up to "
                f"{offset + (length or 0)}); restore the file, or {RECOVERY}"
            ) from exc

    def read_items(self, ref: ItemsRef) -> list:
        """The items of ``ref``, verified against its size and CRC-32."""
        data = self._read("instance items", ref.path)
        if len(data) != ref.size or zlib.crc32(data) != ref.crc32:
            raise CorruptBlobError(
                f"instance items {self.storage.describe(ref.path)} fail their checksum (corrupt or truncated: "
                f"{len(data)} bytes, the manifest recorded {ref.size}); restore the file, or {RECOVERY}"
            )
        try:
            items = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise CorruptBlobError(f"instance items {self.storage.describe(ref.path)} are not JSON: {exc}") from exc
        if not isinstance(items, list):
            raise CorruptBlobError(f"instance items {self.storage.describe(ref.path)} are not a JSON list")
        return items

    def fetch(
        self, component: ComponentManifest, plan: InstanceRestorePlan, schema: KeyedSchema | None = None
    ) -> tuple[FetchedEntries, FetchStats]:
        """Execute ``plan``'s reads, verifying every entry's checksum; the entries per key group and the cost.

        Entries come in ``schema`` (the component's current one when None):
        an entry of a blob written in another schema is cast as it is read
        (``evolution``; ``IncompatibleSchemaError`` if it cannot be).
        """
        started = time.perf_counter()
        target = (schema or component.keyed_schema).serialize()
        decoded: dict[tuple[str, int], pa.RecordBatch] = {}
        bytes_read = 0
        for read in plan.reads:
            data = self._read("state blob", read.path, read.offset, read.length)
            bytes_read += len(data)
            view = memoryview(data)
            convert = entry_reader(component, component.blobs[read.path], target)
            for entry in read.entries:
                start = entry.offset - read.offset
                decoded[(read.path, entry.key_group)] = convert(
                    view[start : start + entry.length], entry, f"{self.storage.describe(read.path)}"
                )
        entries = {
            key_group: [(entry.kind, decoded[(path, key_group)]) for path, entry in links]
            for key_group, links in plan.chains.items()
        }
        return entries, FetchStats(bytes_read, len(plan.reads), time.perf_counter() - started)
