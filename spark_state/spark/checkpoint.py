"""Spark's own checkpoint of a query, read on the driver.

Layout Spark writes under ``checkpointLocation`` (the parts read here)::

    metadata        {"id": "<query id>"}, written when the query first starts
    offsets/<N>     "v1", a metadata line, then one offset per source: micro-batch N's end offsets
    commits/<N>     micro-batch N is done

The files are read through spark-state's own storage layer (``StoredFiles``)
wherever it has a backend for the location's scheme (local disk,
``webhdfs:``, ``s3:``/``s3a:``): public calls only, the same on a classic
session and over Spark Connect. A location on any other file system Spark
can write (``abfs:``, ``gs:``, ``dbfs:`` ...) is read through Hadoop's
``FileSystem`` in the driver's JVM (``HadoopFiles``, py4j: classic sessions
only). A path without a scheme is on Hadoop's default file system
(``qualified_location``). Spark writes each file with
``CheckpointFileManager.createAtomic``: a hidden temp file
``.<name>.<uuid>.tmp`` renamed into place (on local disk with a
``..<name>.<uuid>.tmp.crc`` checksum beside it). A driver killed during the
very first write leaves only those temp files in ``offsets/``, and Spark then
refuses to start the query ("offsets should be empty on batch 0");
``clear_interrupted_first_batch`` recognises exactly that and removes them.

The parsing and the classification of leftovers are pure functions; the
``SparkCheckpoint`` class does the I/O through its ``CheckpointFiles``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from spark_state.errors import CheckpointLocationError
from spark_state.store.sources import canonical_offsets, canonical_source_id

_LOG = logging.getLogger(__name__)
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_TEMP = re.compile(rf"\.(?P<batch>\d+)\.{_UUID}\.tmp")
_TEMP_CRC = re.compile(rf"\.\.(?P<batch>\d+)\.{_UUID}\.tmp\.crc")


def source_key(offsets: Any, position: int) -> str:
    """The id under which a source's offsets are recorded: its own ``source_id`` (canonical,
    ``store.sources``), else its position."""
    source_id = offsets.get("source_id") if isinstance(offsets, dict) else None
    return canonical_source_id(source_id) if isinstance(source_id, str) else f"spark-source-{position}"


def parse_offsets_entry(text: str) -> dict[str, Any]:
    """Source end offsets from the text of ``offsets/N``, keyed by ``source_key``.

    The entry holds a version line, a metadata line and one offset per
    source in the query's source order; ``-`` (or an empty line) means the
    source has no offset yet and is left out.
    """
    result: dict[str, Any] = {}
    for position, line in enumerate(text.splitlines()[2:]):
        if line.strip() in ("", "-"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = line
        result[source_key(value, position)] = canonical_offsets(value)
    return result


def batch_timestamp_ms(text: str) -> int:
    """The batch's processing time from the metadata line of ``offsets/N`` (``batchTimestampMs``)."""
    try:
        return int(json.loads(text.splitlines()[1])["batchTimestampMs"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise CheckpointLocationError(f"Spark's offsets entry has no readable batchTimestampMs: {exc!r}") from exc


def _nothing_to_clear(offsets: Iterable[str]) -> bool:
    """Whether the names listed in ``offsets/`` leave ``interrupted_first_batch`` nothing to clear: there are
    none, or a complete entry (a name of digits) is among them."""
    offsets = list(offsets)
    return not offsets or any(name.isdigit() for name in offsets)


def interrupted_first_batch(offsets: Iterable[str], commits: Iterable[str], where: str) -> list[str]:
    """Names in ``offsets/`` to delete so that Spark can start batch 0; ``[]`` when nothing needs doing.

    ``offsets`` and ``commits`` are the raw file names of the two
    directories. Acts only when ``offsets/`` holds no complete entry (a
    name of digits) and ``commits/`` none either; then every name must be a
    temp file of an interrupted write of entry 0 (or its checksum), else
    ``CheckpointLocationError`` names the first file it does not recognise.
    """
    offsets, commits = sorted(offsets), sorted(commits)
    if _nothing_to_clear(offsets):
        return []
    if any(name.isdigit() for name in commits):
        raise CheckpointLocationError(
            f"{where}/commits holds committed batches but {where}/offsets holds no entry; Spark cannot start "
            "from this checkpoint location. Restore its offsets/ directory, or start over with a new "
            "checkpointLocation"
        )
    for name in offsets:
        match = _TEMP.fullmatch(name) or _TEMP_CRC.fullmatch(name)
        if match is None or match.group("batch") != "0":
            raise CheckpointLocationError(
                f"{where}/offsets holds no complete entry, only {offsets}; {name!r} is not the leftover of an "
                "interrupted write of the first micro-batch's offsets, so it is left alone. If no query is "
                f"running there, delete {where}/offsets/{name} by hand and start the query again"
            )
    return offsets


class _Jvm:
    """The JVM classes and methods a ``HadoopFiles`` calls, looked up once per driver JVM: each dotted lookup
    of a JVM class costs a py4j round trip per name (``org``, ``apache``, ...), and a query's start looked up
    about twenty."""

    def __init__(self, jvm, gateway):
        self.path = jvm.org.apache.hadoop.fs.Path
        self.checksummed = jvm.java.lang.Class.forName("org.apache.hadoop.fs.ChecksumFileSystem")
        self.not_found = jvm.java.lang.Class.forName("java.io.FileNotFoundException")
        self.to_bytes = jvm.org.apache.commons.io.IOUtils.toByteArray
        self.to_paths = jvm.org.apache.hadoop.fs.FileUtil.stat2Paths
        self.copy = jvm.java.lang.System.arraycopy
        self.join = jvm.org.apache.commons.lang3.StringUtils.join
        self.objects = lambda n, kind=jvm.java.lang.Object: gateway.new_array(kind, n)


_JVMS: dict[Any, _Jvm] = {}
"""Per py4j gateway client (one per driver, kept across Spark contexts of the process)."""


def _jvm_of(session) -> _Jvm:
    context = session.sparkContext
    client = context._gateway._gateway_client
    found = _JVMS.get(client)
    if found is None:
        found = _JVMS[client] = _Jvm(context._jvm, context._gateway)
    return found


def has_jvm(session) -> bool:
    """Whether ``session`` is a classic session, with Spark's JVM in this process (not Spark Connect)."""
    return getattr(session, "_jsparkSession", None) is not None


class CheckpointFiles(Protocol):
    """The three file operations a ``SparkCheckpoint`` needs, on paths relative to the location (``a/b``)."""

    uri: str

    def names(self, directory: str) -> list[str]:
        """The names in ``directory`` (hidden ones too), ``[]`` when it does not exist."""
        ...

    def read(self, path: str) -> str | None:
        """The text of ``path``, None when it does not exist."""
        ...

    def delete(self, path: str) -> None: ...


class StoredFiles:
    """Spark's checkpoint files through spark-state's own storage layer (``spark_state.storage``): the public
    path, on classic sessions and over Spark Connect, for the schemes it has (local disk, ``webhdfs://``,
    ``s3://``/``s3a://``)."""

    def __init__(self, store: str, uri: str):
        from spark_state.storage import open_storage

        self.store, self.uri = store, uri
        self.storage = open_storage(store)

    def __reduce__(self):  # shipped to Spark Connect's server with the query's batch function: opened there
        return StoredFiles, (self.store, self.uri)

    def names(self, directory: str) -> list[str]:
        return self.storage.list(directory)

    def read(self, path: str) -> str | None:
        from spark_state.errors import BlobNotFoundError

        try:
            return self.storage.read(path).decode("utf-8")
        except BlobNotFoundError:
            return None

    def delete(self, path: str) -> None:
        self.storage.delete(path)


class HadoopFiles:
    """Spark's checkpoint files through Hadoop's ``FileSystem`` in the driver's JVM (py4j): for a location on a
    file system spark-state's storage has no backend for (``abfs:``, ``gs:``, ``dbfs:`` ...), classic sessions
    only."""

    def __init__(self, session, location: str):
        self._jvm = jvm = _jvm_of(session)
        conf = session._jsparkSession.sessionState().newHadoopConf()
        path = jvm.path(location)
        fs = path.getFileSystem(conf)
        self._root = fs.makeQualified(path)
        # A checksummed (local) file system hides ``.crc`` files from listings: look at the raw one.
        self._fs = fs.getRawFileSystem() if jvm.checksummed.isInstance(fs) else fs
        self.uri = self._root.toString()

    def _path(self, path: str = ""):
        return self._jvm.path(self._root, path) if path else self._root

    def names(self, directory: str) -> list[str]:
        """A few py4j round trips however many files there are (one or more per file otherwise: a query keeps a
        hundred batches' files in each directory by default)."""
        path = self._path(directory)
        if not self._fs.exists(path):
            return []
        jvm = self._jvm
        paths = jvm.to_paths(self._fs.listStatus(path))
        count = len(paths)
        if not count:
            return []
        objects = jvm.objects(count)  # py4j passes a Path[] to no Object[] parameter, but copies it into one
        jvm.copy(paths, 0, objects, 0, count)
        names = [line.rsplit("/", 1)[-1] for line in jvm.join(objects, "\n").split("\n")]
        if len(names) != count:  # a name holding a line break: one round trip per name
            names = [p.getName() for p in paths]
        return names

    def read(self, path: str) -> str | None:
        from py4j.protocol import Py4JJavaError

        try:
            stream = self._fs.open(self._path(path))
        except Py4JJavaError as error:
            if self._jvm.not_found.isInstance(error.java_exception):
                return None
            raise
        try:
            data = self._jvm.to_bytes(stream)
        finally:
            stream.close()
        return bytes(data).decode("utf-8")

    def delete(self, path: str) -> None:
        self._fs.delete(self._path(path), False)


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def qualified_location(session, location: str) -> str:
    """``location`` as Spark qualifies a checkpoint location: a path without a scheme is on the default file
    system, which Hadoop's configuration names. On a classic session Hadoop says (one py4j call); without a JVM
    here (Spark Connect) ``spark.hadoop.fs.defaultFS`` does if the session sets it, else it is a local path,
    absolute from this process's directory. A local path comes back as ``file:/path``, as Hadoop writes it."""
    if _SCHEME.match(location) and not location.startswith("file:"):
        return location
    if has_jvm(session):
        return HadoopFiles(session, location).uri
    if location.startswith("file:"):
        path = location[len("file://") :] if location.startswith("file://") else location[len("file:") :]
    else:
        default_fs = (session.conf.get("spark.hadoop.fs.defaultFS", None) or "").rstrip("/")
        if default_fs and not default_fs.startswith("file:"):
            return default_fs + "/" + location.lstrip("/") if location.startswith("/") else location
        path = location
    return "file:" + os.path.abspath(path)


def checkpoint_files(session, location: str, storage_uri: Callable[[str], str | None]) -> CheckpointFiles:
    """The files of Spark's checkpoint at ``location``: through spark-state's storage where ``storage_uri`` maps
    the qualified location to a store URI (``conf.checkpoint_storage_uri``), else through Hadoop (classic
    sessions); a location neither can read is refused with what to do."""
    uri = qualified_location(session, location)
    store = storage_uri(uri)
    if store is not None:
        return StoredFiles(store, uri)
    if has_jvm(session):
        return HadoopFiles(session, uri)
    raise CheckpointLocationError(
        f"checkpointLocation {location!r}: over Spark Connect spark-state reads Spark's checkpoint through its own "
        "storage, which has no backend for that scheme; put the checkpoint on local disk (a Connect server on this "
        "machine), webhdfs:// or s3://, or run the query on a classic session"
    )


class SparkCheckpoint:
    """Spark's checkpoint (see the module docstring), read through ``files`` (``checkpoint_files``)."""

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.uri = files.uri
        self._entries: dict[int, tuple[dict[str, Any], int]] = {}
        """The offsets entries read lately, by batch id (Spark never rewrites one)."""

    @classmethod
    def open(cls, session, location: str, storage_uri: Callable[[str], str | None]) -> SparkCheckpoint:
        return cls(checkpoint_files(session, location, storage_uri))

    def _names(self, directory: str) -> list[str]:
        return self.files.names(directory)

    def _read(self, *parts: str) -> str | None:
        return self.files.read("/".join(parts))

    def query_id(self) -> str | None:
        """The query id Spark recorded in ``metadata``, or None before the query first started."""
        text = self._read("metadata")
        if text is None:
            return None
        try:
            return json.loads(text.splitlines()[0])["id"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CheckpointLocationError(f"{self.uri}/metadata is not Spark's query metadata: {exc!r}") from exc

    def offsets(self, batch_id: int) -> dict[str, Any] | None:
        """Micro-batch ``batch_id``'s end offsets per source (``parse_offsets_entry``), None if no entry."""
        entry = self.offsets_entry(batch_id)
        return None if entry is None else entry[0]

    def offsets_entry(self, batch_id: int) -> tuple[dict[str, Any], int] | None:
        """Micro-batch ``batch_id``'s end offsets and processing time (``batchTimestampMs``), None if no entry.

        The last few entries read are kept (Spark writes an entry once, and
        each batch also needs the one before it), so a batch reads one entry.
        """
        entry = self._entries.get(batch_id)
        if entry is None:
            text = self._read("offsets", str(batch_id))
            if text is None:
                return None
            entry = (parse_offsets_entry(text), batch_timestamp_ms(text))
            self._entries = {b: e for b, e in self._entries.items() if batch_id - 2 <= b <= batch_id + 2}
            self._entries[batch_id] = entry
        return copy.deepcopy(entry)

    def last_committed_batch(self) -> int | None:
        """The highest micro-batch id in ``commits/``, or None."""
        ids = [int(name) for name in self._names("commits") if name.isdigit()]
        return max(ids) if ids else None

    def latest_planned_batch(self) -> int | None:
        """The highest micro-batch id in ``offsets/`` (planned, committed or not), or None."""
        ids = [int(name) for name in self._names("offsets") if name.isdigit()]
        return max(ids) if ids else None

    def has_planned_batch(self) -> bool:
        """Whether Spark wrote any micro-batch's offsets (``offsets/N``) here: a query that has none starts as new,
        and Spark then requires ``<checkpointLocation>/state`` to be empty."""
        return any(name.isdigit() for name in self._names("offsets"))

    def clear_interrupted_first_batch(self) -> list[str]:
        """Delete the leftovers of a first ``offsets/0`` write that a killed driver interrupted; return them."""
        offsets = self._names("offsets")
        if _nothing_to_clear(offsets):  # nothing to clear: commits/ need not be listed
            return []
        doomed = interrupted_first_batch(offsets, self._names("commits"), self.uri)
        for name in doomed:
            self.files.delete(f"offsets/{name}")
        if doomed:
            _LOG.warning(
                "removed %s from %s/offsets: the leftovers of a driver killed while writing the first "
                "micro-batch's offsets, which would stop Spark from starting the query",
                ", ".join(doomed),
                self.uri,
            )
        return doomed


def batch_start_offsets(session, query_id: str | None, batch_id: int, checkpoint: SparkCheckpoint) -> dict[str, Any]:
    """Where each source of micro-batch ``batch_id`` starts, keyed like ``parse_offsets_entry``.

    After batch 0 it is the previous batch's end (``offsets/<batch_id - 1>``).
    For batch 0 it is each source's initial offset, asked from the running
    query: a DataSource V2 stream's ``initialOffset()``, or None (the
    beginning) for a V1 source, which has no offset before its first batch.
    Sources whose start cannot be determined are left out (see
    ``coordinator.SparkBatch``).
    """
    if batch_id > 0:
        previous = checkpoint.offsets(batch_id - 1)
        return {} if previous is None else previous
    if not has_jvm(session):  # Spark Connect tells no source's initial offset
        _LOG.info("query %s: the first batch's start offsets are unknown over Spark Connect", query_id)
        return {}
    try:
        query = session._jsparkSession.streams().get(query_id)
        sources = query.streamingQuery().sources()
    except Exception:  # noqa: BLE001 - internal API; without it the start is unknown, which is safe
        _LOG.warning("could not read the initial offsets of query %s; its start offsets are unknown", query_id)
        return {}
    v1 = session.sparkContext._jvm.java.lang.Class.forName("org.apache.spark.sql.execution.streaming.Source")
    result: dict[str, Any] = {}
    for position in range(sources.size()):
        source = sources.apply(position)
        if v1.isInstance(source):
            result[f"spark-source-{position}"] = None
            continue
        try:
            value = json.loads(source.initialOffset().json())
        except Exception:  # noqa: BLE001 - a source that cannot say where it starts is left unknown
            continue
        result[source_key(value, position)] = value
    return result


__all__ = [
    "CheckpointFiles",
    "HadoopFiles",
    "SparkCheckpoint",
    "StoredFiles",
    "checkpoint_files",
    "qualified_location",
    "batch_timestamp_ms",
    "batch_start_offsets",
    "interrupted_first_batch",
    "parse_offsets_entry",
    "source_key",
]
