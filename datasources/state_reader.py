"""The ``spark-state`` Spark data source: a component's state, or its change feed, as a DataFrame (batch reads).

Installing spark-state registers it in every Spark session (``pyspark_spark_state``)::

    spark.read.format("spark-state").option("store", "/chk/counts/state").option("component", "counts").load()

    (spark.read.format("spark-state").option("store", s).option("component", "counts")
     .option("readChangeFeed", "true").option("changeStartCheckpoint", 12).load())

========================  ==========  ===================================================================
option                    default     meaning
========================  ==========  ===================================================================
``store``                 required    the state store URI (``spark.state.store`` of the query)
``component``             required    the component (``keyed(..., name=...)``)
``checkpoint``            latest      a restorable checkpoint id, or a savepoint name
``timers``                ``false``   add the keys' timers and TTL expiry (``timers_*`` columns)
``partitions``            by size     number of Spark partitions (key-group ranges of about equal bytes;
                                      by default one per ~32 MB of entries, at least 8 of >= 1 MB)
``readChangeFeed``        ``false``   one row per change instead of the state (``spark_state.ops.reader``)
``changeStartCheckpoint`` required    with ``readChangeFeed``: the checkpoint the changes start after
``changeEndCheckpoint``   latest      with ``readChangeFeed``: the last checkpoint whose changes are read
========================  ==========  ===================================================================

The columns are ``spark_state.ops.reader``'s: the key columns and the ``value``
variable's columns (``change_type`` and ``checkpoint_id`` first in a change
feed). The checkpoint is resolved once, on the driver, when the read is
planned; each partition reads the entries of its key-group range, checksum
checked, and folds them with Arrow (``restore.fold_chains``). A query that
keeps running may clean up the checkpoint while it is read: read a
savepoint of it for a long read of a live query's state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from datasources.errors import StateCheckpointGoneError, StateReaderOptionError
from spark_state.errors import BlobNotFoundError
from spark_state.keyspace import KeyGroupRange
from spark_state.store.manifest import ComponentManifest

if TYPE_CHECKING:
    from spark_state.store.restore import InstanceRestorePlan

OPTIONS = (
    "store",
    "component",
    "checkpoint",
    "timers",
    "partitions",
    "readchangefeed",
    "changestartcheckpoint",
    "changeendcheckpoint",
    "path",
)
PART_BYTES = 32 << 20
SPREAD = 8
"""Without option partitions: one partition per ``PART_BYTES`` of entries, and at least ``SPREAD`` (of >= 1 MB)."""


@dataclass(frozen=True)
class ReaderOptions:
    """The options, parsed once on the driver (Spark hands them over as strings)."""

    store: str
    component: str
    checkpoint: str | None
    timers: bool
    partitions: int | None
    change_feed: bool
    change_start: str | None
    change_end: str | None

    @classmethod
    def parse(cls, options) -> ReaderOptions:
        given = {str(k).lower(): str(v) for k, v in dict(options).items()}
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            raise StateReaderOptionError(
                f"unknown option(s) {unknown} of format spark-state; the options are "
                "store, component, checkpoint, timers, partitions, readChangeFeed, "
                "changeStartCheckpoint, changeEndCheckpoint"
            )
        store = given.get("store") or given.get("path")
        if not store or not given.get("component"):
            raise StateReaderOptionError(
                "format spark-state needs option('store', <state store URI>) and option('component', <component name>)"
            )
        partitions = None
        if given.get("partitions"):
            try:
                partitions = int(given["partitions"])
            except ValueError:
                partitions = 0
            if partitions < 1:
                raise StateReaderOptionError(f"option partitions={given['partitions']!r} must be a whole number >= 1")
        change_feed = _flag(given, "readchangefeed", "readChangeFeed")
        if change_feed and not given.get("changestartcheckpoint"):
            raise StateReaderOptionError(
                "readChangeFeed needs option('changeStartCheckpoint', <checkpoint id or "
                "savepoint>): the changes are those after it"
            )
        if not change_feed and ({"changestartcheckpoint", "changeendcheckpoint"} & set(given)):
            raise StateReaderOptionError(
                "changeStartCheckpoint and changeEndCheckpoint need option('readChangeFeed', 'true')"
            )
        return cls(
            store,
            given["component"],
            given.get("checkpoint"),
            _flag(given, "timers", "timers"),
            partitions,
            change_feed,
            given.get("changestartcheckpoint"),
            given.get("changeendcheckpoint"),
        )


def _flag(given: dict, key: str, name: str) -> bool:
    value = given.get(key, "false").strip().lower()
    if value not in ("true", "false"):
        raise StateReaderOptionError(f"option {name}={value!r} must be true or false")
    return value == "true"


def _storage(uri: str):
    from spark_state.storage import open_storage

    return open_storage(uri)


def _resolve(options: ReaderOptions) -> tuple[int, ComponentManifest, int | None]:
    """The checkpoint read (its id and component; the change feed's start id too)."""
    from spark_state.ops.reader import component_of, resolve_checkpoint
    from spark_state.store.manifestlog import ManifestReader

    manifests = ManifestReader(_storage(options.store))
    if options.change_feed:
        start = resolve_checkpoint(manifests, options.change_start)
        end = resolve_checkpoint(manifests, options.change_end)
        return end.checkpoint_id, component_of(end, options.component, options.store), start.checkpoint_id
    manifest = resolve_checkpoint(manifests, options.checkpoint)
    return manifest.checkpoint_id, component_of(manifest, options.component, options.store), None


class StateDataSource(DataSource):
    """``format("spark-state")``; see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "spark-state"

    def schema(self) -> StructType:
        from spark_state.ops.reader import change_fields, output_fields

        options = ReaderOptions.parse(self.options)
        _, component, _ = _resolve(options)
        fields = (change_fields if options.change_feed else output_fields)(
            component.keyed_schema, timers=options.timers
        )
        return from_arrow_schema(pa.schema(fields))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _Reader(ReaderOptions.parse(self.options), schema)


@dataclass(frozen=True)
class _Part:
    """One partition: a key-group range, and (state reads) a component trimmed to what the range reads."""

    key_groups: tuple[int, int]
    component: ComponentManifest | None
    plan: InstanceRestorePlan | None
    """With ``component``: both set for a state read's range, both None for a change feed's or an empty read."""


class _Reader(DataSourceReader):
    """Resolves the checkpoint once (on the driver); pickled to every task without the manifest."""

    def __init__(self, options: ReaderOptions, schema: StructType) -> None:
        self.options = options
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        self.checkpoint_id, self.component, self.start_id = _resolve(options)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "component": None}  # partitions carry what each reads

    def partitions(self) -> list[InputPartition]:
        from spark_state.ops.reader import split_key_groups

        component = self.component
        pieces = split_key_groups(component, self.options.partitions, part_bytes=PART_BYTES, spread=SPREAD)
        if self.options.change_feed:
            count = max(1, self.options.partitions or len(pieces))
            step = -(-component.max_parallelism // count)
            return [
                InputPartition(_Part((s, min(s + step, component.max_parallelism) - 1), None, None))
                for s in range(0, component.max_parallelism, step)
            ]
        parts = []
        for piece in pieces:
            paths = {path for links in piece.plan.chains.values() for path, _ in links}
            trimmed = replace(
                component,
                blobs={p: component.blobs[p] for p in paths},
                chains={g: component.chains[g] for g in piece.plan.chains},
                instance_items={},
            )
            parts.append(
                InputPartition(_Part((piece.key_group_range.start, piece.key_group_range.end), trimmed, piece.plan))
            )
        return parts or [InputPartition(_Part((0, 0), None, None))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        part: _Part = partition.value
        try:
            if self.options.change_feed:
                yield from self._changes(part)
            elif part.plan is not None:
                yield from self._state(part)
        except BlobNotFoundError as exc:
            raise StateCheckpointGoneError(
                f"checkpoint {self.checkpoint_id} of {self.options.store} was cleaned up while it was read ({exc}); "
                "the query went on past it. Read a savepoint (`spark-state savepoint create`) for a long read of a "
                "running query's state"
            ) from exc

    def _state(self, part: _Part) -> Iterator[pa.RecordBatch]:
        from spark_state.ops.reader import read_part
        from spark_state.store.blobstore import BlobStore

        assert part.component is not None and part.plan is not None, "partitions() pairs a plan with its component"
        blobs = BlobStore(_storage(self.options.store))
        for table in read_part(blobs, part.component, part.plan, timers=self.options.timers):
            yield from _conform(table, self.arrow_schema)

    def _changes(self, part: _Part) -> Iterator[pa.RecordBatch]:
        from spark_state.ops.reader import read_changes

        assert self.start_id is not None, "_resolve gives a change feed its start checkpoint"
        table = read_changes(
            _storage(self.options.store),
            self.options.component,
            self.start_id,
            self.checkpoint_id,
            timers=self.options.timers,
            key_groups=KeyGroupRange(*part.key_groups),
        )
        yield from _conform(table, self.arrow_schema)


def _conform(table: pa.Table, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """``table``'s rows in the Arrow schema Spark expects (e.g. large_string read as string), in large batches.

    A folded table has one chunk per entry read (a few hundred rows); Spark
    pays per batch, so the chunks are combined first.
    """
    if table.num_rows == 0:
        return
    table = table.rename_columns(schema.names).cast(schema) if not table.schema.equals(schema) else table
    yield from table.combine_chunks().to_batches(max_chunksize=1 << 17)
