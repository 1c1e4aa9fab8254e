"""Options of the ``replayable`` format, parsed once into frozen dataclasses; offsets JSON.

No pyspark. Spark hands options over as a case-insensitive dict of strings
(keys arrive lower-cased); ``parse_read_options`` / ``parse_write_options``
convert them once and raise ``ReplayableOptionError`` subclasses that name the
option. Spark adds ``path``, ``checkpointLocation`` and ``queryName`` itself;
those are accepted where they make sense.

Offsets, as Spark stores them: a JSON object mapping each split (a decimal
string, ``"0"``) to the next offset to read. A micro-batch reads
``[start[s], end[s])`` of every split ``s``. Offsets of a log also carry
``"source_id": log_source_id(path)``, so a state checkpoint can key them by
source and a checkpoint pointed at another log is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import overload
from urllib.parse import urlparse

from datasources.errors import InvalidOffsetsError, ReplayableOptionError, UnknownOptionError
from datasources.generator import KEY_TYPES, KINDS, GeneratorSpec
from datasources.log import DEFAULT_ORPHAN_GRACE_SECONDS
from datasources.logindex import Offsets
from spark_state.driver.conf import COMPRESSIONS
from spark_state.store.sources import canonical_source_id

READ, STREAM_READ, WRITE, STREAM_WRITE = "read", "readStream", "write", "writeStream"
ANY_READ = "read or readStream"
"""``DataSource.schema()`` serves both reads and cannot tell which one asked."""

DEFAULT_NUM_SPLITS = 4
DEFAULT_MAX_RECORDS_PER_PARTITION = 1_000_000
DEFAULT_MAX_RECORDS_PER_SEGMENT = 1_000_000
EARLIEST, LATEST = -2, -1
"""Per-split markers allowed in explicit offsets JSON (as in Kafka's startingOffsets)."""

_LOG_READ = ("path", "startingOffsets", "stateStore", "maxRecordsPerPartition")
_GENERATOR = (
    "generator",
    "numSplits",
    "keys",
    "keyType",
    "keyPrefix",
    "skew",
    "seed",
    "rowsPerSplit",
    "rowsPerSecond",
    "startingOffsets",
    "maxRecordsPerPartition",
)
_WRITE = ("path", "numSplits", "keyColumn", "maxRecordsPerSegment", "compression")
ALLOWED = {
    (READ, "log"): _LOG_READ + ("endingOffsets",),
    (STREAM_READ, "log"): _LOG_READ + ("maxRecordsPerBatch", "retention"),
    (READ, "generator"): _GENERATOR + ("endingOffsets",),
    (STREAM_READ, "generator"): _GENERATOR + ("maxRecordsPerBatch",),
    (ANY_READ, "log"): _LOG_READ + ("endingOffsets", "maxRecordsPerBatch", "retention"),
    (ANY_READ, "generator"): _GENERATOR + ("endingOffsets", "maxRecordsPerBatch"),
    (WRITE, "log"): _WRITE + ("sinkId", "batchId", "orphanGraceSeconds"),
    (STREAM_WRITE, "log"): _WRITE + ("sinkId", "checkpointLocation", "queryName"),
}
"""Option names each mode accepts (documented spelling; matched case-insensitively)."""

ALL_OPTIONS = sorted({name for names in ALLOWED.values() for name in names})


# ---------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------


def normalize_log_uri(path: str | None) -> str:
    """The canonical URI of a log location.

    A plain path (relative paths resolve against the current directory) and a
    ``file:`` URI become ``file:///absolute/path``; other URIs (``memory://NAME``,
    ``hdfs://host:port/path``) keep their text. Trailing '/' are dropped. A missing
    (None or blank) path raises ``ReplayableOptionError``.
    """
    if not isinstance(path, str) or not path.strip():
        raise ReplayableOptionError("option path is missing: give the log's location with .option('path', ...)")
    path = path.strip()
    parsed = urlparse(path)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:
        local = parsed.path if parsed.scheme == "file" else path
        return Path(os.path.abspath(local)).as_uri()
    return path.rstrip("/")


def log_source_id(path: str) -> str:
    """The id under which a state checkpoint records this log's offsets: ``"replayable:"`` and the log's location.

    The location is its identity (``storage.location_identity``), never its
    spelling or its client's options: ``/data/log`` and ``file:///data/log/``,
    ``s3a://b/events/`` and ``s3://b/events?path_style=true&endpoint=...``
    give the same id, and a checkpoint recorded under another spelling of the
    same log reads as this source's (``store.sources``).
    """
    return canonical_source_id("replayable:" + normalize_log_uri(path))


# ---------------------------------------------------------------------------
# Offsets
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OffsetsSpec:
    """A parsed ``startingOffsets`` / ``endingOffsets``.

    ``kind`` is ``earliest``, ``latest``, ``checkpoint`` (the latest state
    checkpoint's offsets, or with ``checkpoint_id`` those of that retained
    checkpoint: ``checkpoint:<id>``) or ``explicit``; for ``explicit``,
    ``offsets`` maps every split to an offset, ``EARLIEST`` (-2) or ``LATEST`` (-1).
    """

    option: str
    kind: str
    offsets: tuple[tuple[int, int], ...] = ()
    checkpoint_id: int | None = None

    def resolve(self, earliest: Offsets, latest: Offsets) -> Offsets:
        """Concrete offsets given the log's earliest and latest offsets (``checkpoint`` is resolved elsewhere)."""
        if self.kind == "earliest":
            return dict(earliest)
        if self.kind == "latest":
            return dict(latest)
        if self.kind != "explicit":
            raise ReplayableOptionError(
                f"option {self.option}={self.kind} names the offsets of a state checkpoint, which this "
                "source cannot resolve; use earliest, latest or explicit offsets here"
            )
        given = dict(self.offsets)
        missing = sorted(set(earliest) - set(given))
        extra = sorted(set(given) - set(earliest))
        if missing or extra:
            raise InvalidOffsetsError(
                f"option {self.option} must name every split 0..{len(earliest) - 1} exactly once "
                f"(missing {missing}, unknown {extra}); use -2 for earliest, -1 for latest"
            )
        return {
            split: earliest[split] if o == EARLIEST else latest[split] if o == LATEST else o
            for split, o in sorted(given.items())
        }


def parse_offsets_option(option: str, text: str | None, default: str, allowed: tuple[str, ...]) -> OffsetsSpec:
    """Parse an offsets option: one of the words in ``allowed`` or a JSON object of split -> offset."""
    text = default if text is None else text.strip()
    if text.lower() in allowed:
        return OffsetsSpec(option, text.lower())
    if "checkpoint" in allowed and text.lower().startswith("checkpoint:"):
        number = text.split(":", 1)[1].strip()
        if not number.isdigit():
            raise InvalidOffsetsError(
                f"option {option}={text!r}: after 'checkpoint:' give a retained checkpoint id (a whole number)"
            )
        return OffsetsSpec(option, "checkpoint", checkpoint_id=int(number))
    try:
        raw = json.loads(text)
    except ValueError:
        raw = None
    if not isinstance(raw, dict) or not raw:
        raise InvalidOffsetsError(
            f"option {option}={text!r} is neither one of {list(allowed)} nor a JSON object like "
            '{"0": 42, "1": -2} (split -> next offset; -2 earliest, -1 latest)'
        )
    offsets = offsets_from_json(raw, f"option {option}", allow_markers=True)
    return OffsetsSpec(option, "explicit", tuple(sorted(offsets.items())))


SOURCE_ID_KEY = "source_id"


def offsets_from_json(raw, what: str, allow_markers: bool = False, source_id: str | None = None) -> Offsets:
    """Split -> offset from a JSON object (keys decimal strings); ``InvalidOffsetsError`` naming ``what``.

    A ``"source_id"`` entry is not a split: it is checked against ``source_id``
    when that is given (offsets of another source are refused) and dropped.
    """
    if not isinstance(raw, Mapping):
        raise InvalidOffsetsError(f"{what} must be a JSON object of split -> offset, got {raw!r}")
    out: Offsets = {}
    low = EARLIEST if allow_markers else 0
    recorded = raw.get(SOURCE_ID_KEY)
    if (
        source_id is not None
        and recorded is not None
        and canonical_source_id(str(recorded)) != canonical_source_id(source_id)
    ):
        raise InvalidOffsetsError(
            f"{what} belong to {recorded!r}, not to {source_id!r}: the checkpoint was made for another "
            "source; use a new checkpointLocation (or the path the checkpoint was made with)"
        )
    for key, value in raw.items():
        if key == SOURCE_ID_KEY:
            continue
        try:
            split = int(key)
        except (TypeError, ValueError):
            split = -1
        if split < 0 or str(split) != str(key).strip():
            raise InvalidOffsetsError(f"{what}: split {key!r} is not a non-negative integer")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidOffsetsError(
                f"{what}: offset {value!r} of split {split} must be an integer >= {low}"
                + (" (-2 earliest, -1 latest)" if allow_markers else "")
            )
        out[split] = value
    return dict(sorted(out.items()))


def offsets_to_json(offsets: Mapping[int, int], source_id: str | None = None) -> dict:
    """The JSON form Spark stores: ``source_id`` first if given, then splits as decimal strings in order.

    The order is fixed so that equal offsets always give equal JSON (Spark compares the text).
    """
    head = {} if source_id is None else {SOURCE_ID_KEY: source_id}
    return {**head, **{str(split): int(offsets[split]) for split in sorted(offsets)}}


def admit(start: Mapping[int, int], end: Mapping[int, int], max_rows: int) -> Offsets:
    """End offsets of a batch of at most ``max_rows`` records between ``start`` and ``end``.

    The budget is shared evenly among splits that have records (water-filling:
    a split that needs less than its share passes the rest on); any remainder
    goes to the lowest split ids. Deterministic; admits at least one record
    when ``max_rows >= 1`` and any is pending.
    """
    if max_rows < 1:
        raise ReplayableOptionError(f"option maxRecordsPerBatch={max_rows} must be >= 1")
    pending = {split: max(0, end[split] - start[split]) for split in start}
    grant = {split: 0 for split in start}
    budget = max_rows
    active = [split for split in sorted(pending) if pending[split] > 0]
    while budget > 0 and active:
        share = max(1, budget // len(active))
        still = []
        for split in active:
            take = min(share, pending[split] - grant[split], budget)
            grant[split] += take
            budget -= take
            if grant[split] < pending[split]:
                still.append(split)
        active = still
    return {split: start[split] + grant[split] for split in sorted(start)}


# ---------------------------------------------------------------------------
# Parsed options
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadOptions:
    """Options of ``spark.read`` / ``spark.readStream`` for a log or a generator."""

    mode: str
    uri: str | None
    generator: GeneratorSpec | None
    starting: OffsetsSpec
    ending: OffsetsSpec
    state_store: str | None
    max_records_per_batch: int | None
    max_records_per_partition: int
    retention: int | None
    """Records to keep per split below the committed offsets; None keeps everything."""


@dataclass(frozen=True)
class WriteOptions:
    """Options of ``df.write`` / ``df.writeStream`` into a log."""

    mode: str
    uri: str
    num_splits: int | None
    """None: not given (the existing log's count, or ``DEFAULT_NUM_SPLITS`` for a new log)."""
    key_column: str | None
    max_records_per_segment: int
    compression: str
    sink_id: str | None
    """Streaming sink, or a batch write that is one batch of an idempotent job: who appends."""
    batch_id: int | None
    """A batch write's batch id under ``sink_id``: appended once, skipped when the log already holds it."""
    orphan_grace_seconds: int = DEFAULT_ORPHAN_GRACE_SECONDS
    """After a batch write's commit, unreferenced files under ``data/`` at least this old are deleted."""


class _Options:
    """Case-insensitive access to string options, with typed, option-naming conversions."""

    def __init__(self, options: Mapping[str, str], mode: str, source: str) -> None:
        self.mode = mode
        self.values = {str(k).lower(): v for k, v in dict(options).items()}
        allowed = {name.lower(): name for name in ALLOWED[(mode, source)]}
        unknown = sorted(set(self.values) - set(allowed))
        if unknown:
            elsewhere = [name for name in ALL_OPTIONS if name.lower() in unknown]
            hint = f"; {elsewhere} apply to other modes" if elsewhere else ""
            raise UnknownOptionError(
                f"unknown option(s) {unknown} for replayable {mode}"
                f"{' (generator)' if source == 'generator' else ''}: valid options are "
                f"{sorted(allowed.values())}{hint}"
            )

    def text(self, name: str) -> str | None:
        return self.values.get(name.lower())

    @overload
    def integer(self, name: str, default: int, minimum: int) -> int: ...

    @overload
    def integer(self, name: str, default: None, minimum: int) -> int | None: ...

    def integer(self, name: str, default: int | None, minimum: int) -> int | None:
        raw = self.text(name)
        if raw is None:
            return default
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise ReplayableOptionError(f"option {name}={raw!r} is not an integer") from None
        if value < minimum:
            raise ReplayableOptionError(f"option {name}={value} must be >= {minimum}")
        return value

    def number(self, name: str, default: float, minimum: float) -> float:
        raw = self.text(name)
        if raw is None:
            return default
        try:
            value = float(str(raw).strip())
        except ValueError:
            raise ReplayableOptionError(f"option {name}={raw!r} is not a number") from None
        if not value >= minimum:
            raise ReplayableOptionError(f"option {name}={value} must be >= {minimum}")
        return value

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        raw = self.text(name)
        value = default if raw is None else str(raw).strip().lower()
        if value not in choices:
            raise ReplayableOptionError(f"option {name}={raw!r} must be one of {list(choices)}")
        return value


def read_source(options: Mapping[str, str]) -> str:
    """``generator`` if the generator option is set, else ``log``."""
    return "generator" if any(str(k).lower() == "generator" for k in options) else "log"


def parse_read_options(options: Mapping[str, str], mode: str) -> ReadOptions:
    """Parse the options of a read (``READ``), stream read (``STREAM_READ``) or either (``ANY_READ``)."""
    source = read_source(options)
    opts = _Options(options, mode, source)
    generator = None
    uri = None
    starting_words: tuple[str, ...] = ("earliest", "latest")
    if source == "generator":
        generator = _parse_generator(opts)
    else:
        uri = normalize_log_uri(opts.text("path"))
        starting_words += ("checkpoint",)
    state_store = opts.text("stateStore")
    starting = parse_offsets_option("startingOffsets", opts.text("startingOffsets"), "earliest", starting_words)
    if starting.kind == "checkpoint" and not state_store:
        raise ReplayableOptionError(
            "option startingOffsets=checkpoint needs option stateStore (the state store URI whose "
            "latest checkpoint holds this log's offsets)"
        )
    ending = parse_offsets_option("endingOffsets", opts.text("endingOffsets"), "latest", ("latest",))
    retention_text = opts.text("retention")
    retention = None
    if retention_text is not None and str(retention_text).strip().lower() != "all":
        retention = opts.integer("retention", None, 0)
    return ReadOptions(
        mode=mode,
        uri=uri,
        generator=generator,
        starting=starting,
        ending=ending,
        state_store=state_store,
        max_records_per_batch=opts.integer("maxRecordsPerBatch", None, 1),
        max_records_per_partition=opts.integer("maxRecordsPerPartition", DEFAULT_MAX_RECORDS_PER_PARTITION, 1),
        retention=retention,
    )


def _parse_generator(opts: _Options) -> GeneratorSpec:
    key_prefix = opts.text("keyPrefix")
    return GeneratorSpec(
        kind=opts.choice("generator", "keyed", KINDS),
        num_splits=opts.integer("numSplits", DEFAULT_NUM_SPLITS, 1),
        keys=opts.integer("keys", 1000, 1),
        key_type=opts.choice("keyType", "string", KEY_TYPES),
        key_prefix=key_prefix if key_prefix is not None else "user-",
        skew=opts.number("skew", 0.0, 0.0),
        seed=opts.integer("seed", 0, -(1 << 63)),
        rows_per_split=opts.integer("rowsPerSplit", None, 0),
        rows_per_second=opts.integer("rowsPerSecond", None, 1),
    )


def parse_write_options(options: Mapping[str, str], mode: str) -> WriteOptions:
    """Parse the options of a batch write (``WRITE``) or a streaming sink (``STREAM_WRITE``)."""
    opts = _Options(options, mode, "log")
    sink_id, batch_id = None, None
    if mode == STREAM_WRITE:
        sink_id = _sink_id(opts)
    elif opts.text("sinkId") is not None or opts.text("batchId") is not None:
        if not opts.text("sinkId") or opts.text("batchId") is None:
            raise ReplayableOptionError(
                "options sinkId and batchId go together: a batch write with both is appended once per "
                "(sinkId, batchId); give both or neither"
            )
        sink_id = _sink_id(opts)
        batch_id = opts.integer("batchId", None, 0)
    return WriteOptions(
        mode=mode,
        uri=normalize_log_uri(opts.text("path")),
        num_splits=opts.integer("numSplits", None, 1),
        key_column=opts.text("keyColumn"),
        max_records_per_segment=opts.integer("maxRecordsPerSegment", DEFAULT_MAX_RECORDS_PER_SEGMENT, 1),
        compression=opts.choice("compression", "none", COMPRESSIONS),
        sink_id=sink_id,
        batch_id=batch_id,
        orphan_grace_seconds=opts.integer("orphanGraceSeconds", DEFAULT_ORPHAN_GRACE_SECONDS, 0),
    )


def _sink_id(opts: _Options) -> str:
    """The sink's identity across restarts: sinkId, else the checkpoint location, else the query name."""
    sink_id, checkpoint, query_name = opts.text("sinkId"), opts.text("checkpointLocation"), opts.text("queryName")
    if sink_id:
        return "sink:" + sink_id.strip()
    if checkpoint:
        return "checkpoint:" + normalize_log_uri(checkpoint)
    if query_name:
        return "query:" + query_name.strip()
    raise ReplayableOptionError(
        "the replayable sink needs a stable identity to append each micro-batch exactly once: set "
        "option checkpointLocation (recommended), option sinkId, or a queryName"
    )
