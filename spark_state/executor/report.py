"""The report one instance's task sends the driver: what it wrote, and what it cost. No I/O, no pyspark.

A task emits it after its output rows (``task.run_instance``); the driver
commits the blobs and instance items it names (``driver.coordinator``) and
keeps its ``info`` in the batch's history (``StatefulQuery.batches``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_state.store.manifest import BlobRef, ItemsRef


@dataclass(frozen=True)
class InstanceReport:
    """What one instance reports after its task: what it wrote, and what it cost (``info``, free-form)."""

    instance: int
    blob: BlobRef | None
    items: ItemsRef | None
    info: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            **self.info,
            "instance": self.instance,
            "blob": self.blob.to_json() if self.blob is not None else None,
            "items": self.items.to_json() if self.items is not None else None,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> InstanceReport:
        info = {k: v for k, v in obj.items() if k not in ("instance", "blob", "items")}
        blob = BlobRef.from_json(obj["blob"]) if obj.get("blob") else None
        items = ItemsRef.from_json(obj["items"]) if obj.get("items") else None
        return cls(obj["instance"], blob, items, info)
