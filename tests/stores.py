"""A state store as a job uses it, for tests and benchmarks that drive instances by hand (no Spark).

Tasks write through the ``BlobStore``; the driver commits through the
``ManifestLog``; ``commit`` derives manifest N from the latest one, the way
``Coordinator.commit`` derives it from its base.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from spark_state.storage.base import Storage
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifest import (
    BlobRef,
    ComponentSpec,
    ComponentUpdate,
    ItemsRef,
    Manifest,
    QueryBinding,
    next_manifest,
)
from spark_state.store.manifestlog import DEFAULT_RETAINED, ManifestLog


class Store:
    """The blob store and the manifest log of one ``storage``."""

    def __init__(self, storage: Storage, *, retained: int = DEFAULT_RETAINED):
        self.storage = storage
        self.blobs = BlobStore(storage)
        self.manifests = ManifestLog(storage, retained=retained)

    def commit(
        self,
        checkpoint_id: int,
        components: Mapping[str, tuple[ComponentSpec, Sequence[BlobRef]]],
        sources: Mapping[str, Any],
        *,
        items: Mapping[str, Mapping[int, ItemsRef]] | None = None,
        binding: QueryBinding | None = None,
    ) -> Manifest:
        written = {
            name: ComponentUpdate(spec, refs, (items or {}).get(name, {})) for name, (spec, refs) in components.items()
        }
        manifest = next_manifest(
            self.manifests.latest(), checkpoint_id, written, sources, binding=binding, committed_at=time.time()
        )
        return self.manifests.commit(manifest)

    def latest(self) -> Manifest | None:
        return self.manifests.latest()

    def load(self, checkpoint_id: int) -> Manifest:
        return self.manifests.load(checkpoint_id)

    def committed_ids(self) -> list[int]:
        return self.manifests.ids()

    def cleanup(self, manifest: Manifest, *, grace_seconds: float = 0) -> list[str]:
        """Step 5; unreferenced files are deleted at once unless a ``grace_seconds`` is given."""
        return self.manifests.cleanup(manifest, grace_seconds=grace_seconds)
