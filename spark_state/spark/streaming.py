"""The user API of keyed queries (the Spark edge; the driver's per-batch work is ``microbatch``).

Usage::

    from spark_state import keyed

    query = (
        keyed(events, "user", name="clicks")      # key column(s) and a component name
        .count()                                  # or .sum/.min/.max/.mean("amount") or .apply(fn, ...)
        .writeStream.format("replayable")         # any sink, written once per batch id
        .option("path", "/data/click-counts")
        .option("checkpointLocation", "/chk/clicks")
        .start()
    )

``start`` checks the settings, removes the leftovers of a first ``offsets/0``
write that a killed driver interrupted (Spark would refuse to start
otherwise), refuses a store that is behind Spark's commits, and starts a
Structured Streaming query whose ``foreachBatch`` is ``MicroBatch.run``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from spark_state.driver.conf import PARALLELISM, checkpoint_storage_uri, run_parallelism_key
from spark_state.driver.coordinator import check_query_start
from spark_state.errors import ConfigError, UnsupportedOverConnectError
from spark_state.executor.aggregates import AGGREGATES, Aggregate, AggregateDef, on_register
from spark_state.executor.columns import EVENT_MS_COLUMN
from spark_state.executor.functions import PythonFunction, TimeToLive
from spark_state.executor.timed import deduplicate_function, session_fields, session_function
from spark_state.model.eventtime import EventTime, check_event_time_type, parse_duration
from spark_state.model.evolution import with_default
from spark_state.model.schema import VALUE, KeyedSchema, StateVariable
from spark_state.model.timers import EVENT, PROCESSING, TIMERS
from spark_state.spark.checkpoint import SparkCheckpoint, has_jvm
from spark_state.spark.microbatch import MicroBatch, location_name
from spark_state.spark.plan import accelerated
from spark_state.spark.routing import check_key_type
from spark_state.spark.sinks import open_sink
from spark_state.spark.stop_watch import watch as watch_stops
from spark_state.store.drain import request_drain
from spark_state.store.manifest import check_component_name
from spark_state.store.reports import batch_reports, clear_batch_reports
from spark_state.store.sources import is_clock_source
from spark_state.store.startfrom import start_from_savepoint
from spark_state.store.stops import STOPPED, unneeded_stop_record

_LOG = logging.getLogger(__name__)

UNIX_SOCKETS = "spark.python.unix.domain.socket.enabled"
"""Spark's setting (4.1+, read when the session starts) that connects Python workers to the JVM by Unix sockets."""
_advised: list[bool] = []


def python_on_unix_sockets(session) -> bool:
    """Whether ``session``'s Python workers talk to the JVM over Unix sockets (``UNIX_SOCKETS``)."""
    if not has_jvm(session):
        return (session.conf.get(UNIX_SOCKETS, None) or "false").lower() == "true"
    # The running context's own SparkConf, read by one call (``getConf()`` copies every setting, one call each).
    return session.sparkContext._jsc.sc().conf().get(UNIX_SOCKETS, "false").lower() == "true"


def advise_unix_sockets(session) -> bool:
    """Say once per driver that Python tasks would be faster on Unix sockets, when they are on TCP; whether it did.

    Over Spark's default TCP loopback connection, a Python task whose input
    is small waits for a delayed acknowledgement (40 ms on Linux) before
    its last input arrives: a keyed batch of a hundred rows took about 40 ms
    longer per micro-batch than with ``UNIX_SOCKETS`` on.
    """
    if _advised or not has_jvm(session) or python_on_unix_sockets(session):
        return False  # over Spark Connect the server's settings are its operator's
    _advised.append(True)
    _LOG.warning(
        "%s is off: each Python task of a keyed query may wait about 40 ms on TCP. Set it to true when "
        "you build the SparkSession (SparkSession.builder.config(%r, 'true')) unless your platform "
        "has no Unix sockets",
        UNIX_SOCKETS,
        UNIX_SOCKETS,
    )
    return True


def keyed(df, *key_columns: str, name: str) -> KeyedStream:
    """Key a streaming DataFrame by ``key_columns`` for rescalable state stored as component ``name``."""
    if not key_columns:
        raise ConfigError("keyed() needs at least one key column")
    missing = [c for c in key_columns if c not in df.columns]
    if missing:
        raise ConfigError(f"key column(s) {missing} are not in the DataFrame; it has {df.columns}")
    if not df.isStreaming:
        raise ConfigError("keyed() works on streaming DataFrames (spark.readStream...); use groupBy for batch data")
    check_component_name(name)
    types = {field.name: field.dataType for field in df.schema.fields}
    for index, column in enumerate(key_columns):
        check_key_type(types[column], index, column)  # UnsupportedKeyError now, not at the first batch
    return KeyedStream(df, tuple(key_columns), name)


def _to_arrow_schema(schema) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        try:
            schema = StructType.fromDDL(schema)
        except Exception as error:  # noqa: BLE001 - Spark's parser raises its own ParseException
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(
                f"the schema {schema!r} does not parse ({first}); write it as Spark DDL, like 'total long, n long'"
            ) from None
    if not isinstance(schema, StructType):
        raise ConfigError(
            f"a schema must be a DDL string, a StructType or a pyarrow.Schema, got {type(schema).__name__}"
        )
    return to_arrow_schema(schema, timezone="UTC")


@dataclass(frozen=True)
class KeyedStream:
    """A streaming DataFrame keyed for rescalable state; choose what to compute per key."""

    df: Any
    key_columns: tuple[str, ...]
    name: str
    event_time: EventTime | None = None

    def withWatermark(self, column: str, delay, *, late: str = "drop", idle_after=None) -> KeyedStream:
        """Give the stream event time: ``column`` (a timestamp, or a long of milliseconds) and an allowed delay.

        Like Spark's ``withWatermark``: each batch runs with watermark
        ``max(previous, largest event time so far - delay)``. Rows older
        than it are late: dropped and counted in ``query.batches``
        (``late="drop"``), or handed to the function with ``_late = true``
        (``late="pass"``). ``delay`` is a duration such as ``"10 minutes"``.
        With ``idle_after`` (a duration, like Flink's ``withIdleness``), once
        the source has had no rows for that long the watermark follows the
        clock: event time is taken to pass as processing time does since the
        last rows, so event-time timers and sessions close on an idle source
        (``eventtime.idle_watermark``; rows arriving later below it are late).
        """
        if column not in self.df.columns:
            raise ConfigError(f"withWatermark({column!r}): no such column; the DataFrame has {self.df.columns}")
        check_event_time_type(column, _to_arrow_schema(self.df.schema).field(column).type)
        idle = None if idle_after is None else parse_duration(idle_after, "withWatermark idle_after")
        return replace(
            self, event_time=EventTime(column, parse_duration(delay, "withWatermark delay"), late, idle_ms=idle)
        )

    def _key_fields(self) -> list[pa.Field]:
        schema = _to_arrow_schema(self.df.schema)
        return [schema.field(c) for c in self.key_columns]

    def aggregate(self, kind: str, column: str | None = None, output: str | None = None) -> StatefulStream:
        """The built-in aggregate ``kind`` (``executor.aggregates.AGGREGATES``) of ``column`` per key, emitted as
        ``output`` (default ``<kind>`` without a column, ``<kind>_<column>`` with one). Each aggregate is also a
        method of its name: ``count()``, ``sum(column)``, ``min``, ``max``, ``mean``."""
        definition = AGGREGATES.get(kind)
        if definition is None:
            raise ConfigError(f"unknown aggregate {kind!r}; the aggregates are {sorted(AGGREGATES)}")
        input_type = None
        if definition.needs_column:
            if column is None:
                raise ConfigError(f"{kind}() needs a column of the DataFrame: {self.df.columns}")
            if column not in self.df.columns:
                raise ConfigError(f"{kind}({column!r}): no such column; the DataFrame has {self.df.columns}")
            input_type = _to_arrow_schema(self.df.schema).field(column).type
        elif column is not None:
            raise ConfigError(f"{kind}() takes no column (got {column!r})")
        output = output or definition.output_name(column)
        if not isinstance(output, str) or not output or output in self.key_columns:
            raise ConfigError(
                f"{kind}(output={output!r}): the output column needs a name of its own, not a key column's "
                f"({', '.join(self.key_columns)}); the output rows are the keys and it"
            )
        function = Aggregate(kind, column, output, input_type, definition)
        keys = self._key_fields()
        schema = KeyedSchema.of_values(keys, function.state_fields())
        outputs = pa.schema(keys + [pa.field(function.output_name, function.output_type())])
        return StatefulStream(self, function, schema, outputs, () if column is None else (column,))

    if TYPE_CHECKING:  # each aggregate's method, made from its definition (``_aggregate_method``)

        def __getattr__(self, name: str) -> Callable[..., StatefulStream]: ...

    def apply(
        self,
        fn: Callable,
        *,
        state_schema,
        output_schema,
        style: str = "pandas",
        on_timer: Callable | None = None,
        ttl=None,
        ttl_kind: str = PROCESSING,
        state_defaults: dict[str, Any] | None = None,
    ) -> StatefulStream:
        """Call ``fn(key, rows, state)`` once per key and batch; see ``functions.PythonFunction``.

        ``state_schema`` holds the value columns of the per-key state (DDL
        string, StructType or pyarrow schema; the key columns are not
        repeated); ``output_schema`` the columns ``fn`` returns.
        ``state_defaults`` maps value columns to the value stored keys get
        when the column is added to an existing state (schema evolution,
        ``spark_state.model.evolution``); a column added without one reads as null.
        ``on_timer(key, timer, state)`` is called for each due timer a key
        registered with ``state.timers.register(time, kind)``; ``ttl`` (a
        duration) expires a value that was not updated for that long, in
        processing time or, with ``ttl_kind="event"``, against the watermark.
        """
        values = _to_arrow_schema(state_schema)
        clash = [f.name for f in values if f.name in self.key_columns]
        if clash:
            raise ConfigError(f"state_schema repeats key column(s) {clash}; list only the value columns")
        defaults = dict(state_defaults or {})
        unknown = sorted(set(defaults) - set(values.names))
        if unknown:
            raise ConfigError(f"state_defaults names {unknown}, which state_schema does not have: {values.names}")
        values = pa.schema([with_default(f, defaults[f.name]) if f.name in defaults else f for f in values])
        time_to_live = TimeToLive(parse_duration(ttl, "ttl"), ttl_kind) if ttl is not None else None
        if time_to_live is not None and ttl_kind == EVENT and self.event_time is None:
            raise ConfigError("ttl_kind='event' needs event time: key the stream with .withWatermark(column, delay)")
        function = PythonFunction(fn, style, on_timer, time_to_live)
        return StatefulStream(
            self,
            function,
            self._schema(list(values), function.uses_timers),
            _to_arrow_schema(output_schema),
            tuple(self.df.columns),
        )

    def _require_event_time(self, what: str) -> EventTime:
        if self.event_time is None:
            raise ConfigError(f"{what} needs event time: key the stream with .withWatermark(column, delay) first")
        return self.event_time

    def deduplicate(self, horizon) -> StatefulStream:
        """Emit the first row of each key; drop repeats until the watermark passes its event time + ``horizon``.

        The output has the input's columns. A key's state expires after the
        horizon (event time), so the state of quiet keys goes away. "First"
        is the earliest event time among a batch's rows of the key (ties: the
        smallest by the other columns in order), never arrival order, so a
        replayed batch emits the same row (``timed`` module docstring).
        """
        self._require_event_time("deduplicate()")
        function = deduplicate_function(parse_duration(horizon, "deduplicate horizon"))
        schema = self._schema([pa.field("first_event_ms", pa.int64())], True)
        outputs = _to_arrow_schema(self.df.schema)
        return StatefulStream(self, function, schema, outputs, tuple(self.df.columns) + (EVENT_MS_COLUMN,))

    def session_window(self, gap, column: str | None = None) -> StatefulStream:
        """Per key, sessions of rows at most ``gap`` apart in event time; one row per session when it closes.

        A session ``[first event, last event + gap)`` closes when the
        watermark reaches its end. The output has the key columns,
        ``session_start``, ``session_end``, ``count`` and, with ``column``,
        ``sum_<column>``, ``min_<column>`` and ``max_<column>``.
        """
        self._require_event_time("session_window()")
        gap_ms = parse_duration(gap, "session_window gap")
        if gap_ms <= 0:
            raise ConfigError(f"session_window gap {gap!r} must be longer than zero")
        value_type = None
        if column is not None:
            if column not in self.df.columns:
                raise ConfigError(
                    f"session_window column {column!r}: no such column; the DataFrame has {self.df.columns}"
                )
            value_type = _to_arrow_schema(self.df.schema).field(column).type
        state_fields, output_fields = session_fields(column, value_type)
        function = session_function(gap_ms, column, self.key_columns)
        outputs = pa.schema(self._key_fields() + output_fields)
        inputs = (EVENT_MS_COLUMN,) + ((column,) if column is not None else ())
        return StatefulStream(self, function, self._schema(state_fields, True), outputs, inputs)

    def _schema(self, value_fields: list[pa.Field], timers: bool) -> KeyedSchema:
        value = StateVariable(VALUE, tuple(value_fields))
        return KeyedSchema(tuple(self._key_fields()), (value, TIMERS) if timers else (value,))


def _aggregate_method(definition: AggregateDef) -> None:
    """Give ``KeyedStream`` the method of aggregate ``definition``: ``name(output=...)`` for one without a column,
    ``name(column, output=None)`` for one with a column; its docstring is the definition's ``doc``."""
    name = definition.name

    def with_column(self, column: str, output: str | None = None) -> StatefulStream:
        return self.aggregate(name, column, output)

    def without_column(self, output: str | None = None) -> StatefulStream:
        return self.aggregate(name, None, output)

    method = with_column if definition.needs_column else without_column
    method.__name__ = method.__qualname__ = name
    method.__doc__ = definition.doc or f"The built-in aggregate {name!r} per key."
    setattr(KeyedStream, name, method)


on_register(_aggregate_method)  # the built-ins now, and each one ``register_aggregate`` adds later


@dataclass(frozen=True)
class StatefulStream:
    """A keyed computation ready to be written; ``writeStream`` starts it like any streaming DataFrame."""

    keyed: KeyedStream
    function: Aggregate | PythonFunction
    schema: KeyedSchema
    output_schema: pa.Schema
    input_columns: tuple[str, ...]

    @property
    def writeStream(self) -> StatefulStreamWriter:
        return StatefulStreamWriter(self)


class StatefulStreamWriter:
    """Mirrors ``DataStreamWriter``: ``format``, ``option(s)``, ``trigger``, ``queryName``, ``foreachBatch``, ``start``.

    The sink receives each batch's output once per batch id (``sinks``):
    ``replayable`` skips a batch id it already holds; file formats (parquet,
    json, ...) are written with mode overwrite to ``<path>/batch_id=N``;
    ``foreachBatch(fn)`` hands ``(output_df, batch_id)`` to ``fn``, which must
    be idempotent per batch id (Spark may call it again for the same id);
    each action on ``output_df`` runs the batch's tasks, so ``fn`` should
    persist it to use it more than once.
    """

    def __init__(self, stream: StatefulStream):
        self._stream = stream
        self._format: str | None = None
        self._options: dict[str, str] = {}
        self._trigger: dict[str, Any] | None = None
        self._query_name: str | None = None
        self._foreach_batch: Callable | None = None
        self._savepoint: tuple[str, bool] | None = None

    def format(self, source: str) -> StatefulStreamWriter:
        self._format = source
        return self

    def option(self, key: str, value: Any) -> StatefulStreamWriter:
        self._options[key] = str(value)
        return self

    def options(self, **options: Any) -> StatefulStreamWriter:
        for key, value in options.items():
            self.option(key, value)
        return self

    def trigger(self, **trigger: Any) -> StatefulStreamWriter:
        self._trigger = trigger
        return self

    def queryName(self, name: str) -> StatefulStreamWriter:
        self._query_name = name
        return self

    def foreachBatch(self, fn: Callable) -> StatefulStreamWriter:
        self._foreach_batch = fn
        return self

    def fromSavepoint(self, savepoint: str, *, allow_non_restored_state: bool = False) -> StatefulStreamWriter:
        """Start the query's (empty) state store from ``savepoint`` (``<store>/savepoints/<name>``).

        See ``spark_state.store.startfrom``: the savepoint must fit the query (else
        ``SavepointMismatchError`` at ``start``); its state is copied into
        the store as its first checkpoint, and the sources must start at the
        savepoint's offsets. ``allow_non_restored_state`` drops savepoint
        state the query does not continue and starts new components empty.
        Overrides ``spark.state.fromSavepoint``. A restart of the same query
        may keep it: it has no effect once the store started from it.
        """
        self._savepoint = (savepoint, allow_non_restored_state)
        return self

    def start(self, path: str | None = None) -> StatefulQuery:
        if path is not None:
            self._options["path"] = path
        options = dict(self._options)
        checkpoint_location = options.pop("checkpointLocation", None)
        if not checkpoint_location:
            raise ConfigError(
                "option('checkpointLocation', ...) is required: it holds Spark's offsets log, from which "
                "each state checkpoint records its source offsets"
            )
        session = self._stream.keyed.df.sparkSession
        advise_unix_sockets(session)
        spark_checkpoint = SparkCheckpoint.open(
            session,
            checkpoint_location,
            lambda uri: checkpoint_storage_uri(uri, lambda key: session.conf.get(key, None)),
        )
        name = location_name(spark_checkpoint.uri)
        batch = MicroBatch(
            stream=self._stream,
            session=session,
            checkpoint_location=name,
            spark_checkpoint=spark_checkpoint,
            sink=open_sink(self._format, options, self._foreach_batch, default_sink_id=f"spark-state:{name}"),
        )
        conf = batch.conf()  # fail now on bad settings, not at the first batch
        batch.started_store = conf.store
        batch.accelerated = accelerated(session, conf.plan_accelerator)
        spark_checkpoint.clear_interrupted_first_batch()
        manifests = batch.coordinator(conf).manifests
        if not has_jvm(session):  # over Spark Connect: earlier runs' batch reports (``store.reports``)
            clear_batch_reports(manifests.storage)
        _clear_unneeded_stop_record(spark_checkpoint, manifests.storage)
        savepoint, allow = self._savepoint or (conf.from_savepoint, conf.allow_non_restored)
        if not has_jvm(session):
            _check_connect_start(savepoint, spark_checkpoint, manifests)
        if savepoint and conf.restore_from is not None:
            raise ConfigError(
                f"spark.state.restoreFrom={conf.restore_from} and a start from savepoint {savepoint} both choose the "
                "state this query starts from; set one of them"
            )
        if savepoint:
            start_from_savepoint(
                manifests,
                savepoint,
                batch.component_spec(conf),
                allow_non_restored=allow,
                key_space_set=conf.max_parallelism is not None,
            )
        query_id = spark_checkpoint.query_id()
        if conf.restore_from is None or query_id is not None:  # restoring: the latest record may be the damaged one
            latest = manifests.latest()
            stored = latest.components.get(self._stream.keyed.name) if latest is not None else None
            if stored is not None:  # refuse a schema that cannot evolve, or another key space, now
                batch.continuing(conf, stored)
            check_query_start(
                latest,
                query_id,
                spark_checkpoint.last_committed_batch(),
                checkpoint_location=name,
                store=conf.store,
            )
        if _joins_clock(spark_checkpoint, conf.clock, self._stream.keyed.name):
            batch.stream = _with_clock(self._stream, conf)
        writer = batch.stream.keyed.df.writeStream.foreachBatch(batch.run).option(
            "checkpointLocation", checkpoint_location
        )
        if self._trigger:
            writer = writer.trigger(**self._trigger)
        if self._query_name:
            writer = writer.queryName(self._query_name)
        query = writer.start()
        batch.query = query
        watch_stops(query, batch)
        # The first batch's plan, built while Spark plans that batch (``prepare_plan``); last, as its thread takes
        # the interpreter from this one for a while.
        batch.prepare_plan(conf.parallelism, conf.key_space(batch.key_space))
        return StatefulQuery(query, batch)


def _joins_clock(spark_checkpoint: SparkCheckpoint, wanted: bool, component: str) -> bool:
    """Whether the query reads the clock source (``datasources.clock``): a new query when ``spark.state.clock``
    says so, a restarted one when its checkpoint began with it (Spark restarts a query only with the sources its
    offsets log holds)."""
    latest = spark_checkpoint.latest_planned_batch()
    if latest is None:
        return wanted
    offsets = spark_checkpoint.offsets(latest) or {}
    if any(is_clock_source(source_id) for source_id in offsets):
        return True
    if wanted:
        _LOG.warning(
            "component %r: the query's checkpoint %s began without spark-state's clock, so a timer, an expiry "
            "or a drain takes effect only at the next batch with rows; to have them on time on an idle source, "
            "take a savepoint and start the query from it with a new checkpointLocation",
            component,
            spark_checkpoint.uri,
        )
    return False


def _with_clock(stream: StatefulStream, conf) -> StatefulStream:
    """``stream`` with its rows unioned with the clock's (none): Spark plans a batch whenever the clock's offset
    moves, which it does when the store says the component has work without rows."""
    from datasources.clock import NAME, ClockDataSource

    df = stream.keyed.df
    session = df.sparkSession
    session.dataSource.register(ClockDataSource)
    clock = (
        session.readStream.format(NAME)
        .schema(df.schema)
        .option("store", conf.store)
        .option("component", stream.keyed.name)
        .option("pollSeconds", str(conf.clock_poll_seconds))
        .load()
    )
    return replace(stream, keyed=replace(stream.keyed, df=df.unionByName(clock)))


def _check_connect_start(savepoint: str | None, spark_checkpoint: SparkCheckpoint, manifests) -> None:
    """Over Spark Connect, refuse a first batch that would continue state another checkpoint wrote (a start from
    a savepoint, a new ``checkpointLocation`` on a store that holds state).

    Such a batch is safe only if its sources start where that state ends,
    and Spark tells the first batch's start offsets (the sources' initial
    offsets) to the JVM's own API only: over Connect they are unknown, and
    the first batch would be refused (``coordinator``) after the query started.
    """
    if spark_checkpoint.has_planned_batch():
        return
    what = f"a start from savepoint {savepoint}" if savepoint else None
    if what is None and manifests.latest() is not None:
        what = (
            f"a new checkpointLocation ({spark_checkpoint.uri}) on the store {manifests.storage.uri}, which holds state"
        )
    if what is not None:
        raise UnsupportedOverConnectError(
            f"{what} cannot be checked over Spark Connect: its first batch must prove that its sources start where "
            "the state ends, and Spark tells a query's initial offsets only to its JVM API, which Connect clients "
            "do not have. Run the query's first batch on a classic session (trigger availableNow), then run it "
            "over Connect with the same checkpointLocation; or start over Connect with an empty store"
        )


def _clear_unneeded_stop_record(spark_checkpoint: SparkCheckpoint, storage) -> None:
    """Before a query's first batch, delete a stop record that is all its store holds (``stops``): an earlier
    version recorded a run stopped before its first batch, and in the default store, Spark's
    ``<checkpointLocation>/state``, it made every later start fail (``STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY``)."""
    if not spark_checkpoint.has_planned_batch() and unneeded_stop_record(storage):
        storage.delete(STOPPED)
        _LOG.warning(
            "removed %s/%s, the record of a run stopped before its first batch: the store held nothing "
            "else, and Spark starts a new query only on an empty state directory",
            storage.uri,
            STOPPED,
        )


class StatefulQuery:
    """A running stateful query: the ``StreamingQuery`` plus rescaling and restore reports."""

    def __init__(self, query, batch: MicroBatch):
        self.query = query
        self._batch = batch
        self._remote = not has_jvm(batch.session)  # Spark Connect: the batches run in the server (``__getstate__``)
        self._remote_history: list[dict] = []

    def set_parallelism(self, parallelism: int) -> None:
        """Use ``parallelism`` instances from the next micro-batch on (no restart needed).

        Over Spark Connect it is set in the session's conf for this run
        (``conf.run_parallelism_key``), which the server reads at each batch.
        """
        if not isinstance(parallelism, int) or isinstance(parallelism, bool):
            raise ConfigError(
                f"set_parallelism({parallelism!r}): the parallelism must be a whole number (an int), like {PARALLELISM}"
            )
        conf = self._batch.conf()
        key_space = replace(conf, parallelism=parallelism).key_space(self._stored_key_space(conf))
        if self._remote:
            self._batch.session.conf.set(run_parallelism_key(self.run_id), str(parallelism))
            return
        self._batch.parallelism_override = parallelism
        self._batch.prepare_plan(parallelism, key_space)  # built while the current batch runs

    def _stored_key_space(self, conf) -> int | None:
        """The store's key space: known to this process once a batch ran here, else from the store's latest
        checkpoint (over Spark Connect the batches run in the server)."""
        if self._batch.key_space is not None or not self._remote:
            return self._batch.key_space
        latest = self._batch.coordinator(conf).manifests.latest()
        stored = latest.components.get(self._batch.stream.keyed.name) if latest is not None else None
        return stored.max_parallelism if stored is not None else None

    def drain(self, timeout: float | None = None) -> bool:
        """Drain the query at its next micro-batch and stop it (see ``spark_state.store.drain``).

        Waits until the query stopped, at most ``timeout`` seconds (None:
        as long as it takes); returns whether it drained. On an idle source
        the query's clock runs that batch (``datasources.clock``); a query
        whose checkpoint began without the clock drains at its next batch
        with rows.
        """
        self.request_drain()
        self.awaitTermination(timeout)
        drained = self._batch.drained_batch is not None or any(entry["drained"] for entry in self.batches)
        return drained and not self.query.isActive

    def stop(self) -> None:
        """Stop the query (``StreamingQuery.stop``) and record in its store that this run stopped: the instance
        hosts holding its state free their memory within seconds instead of at their idle limit (``stops``)."""
        try:
            self.query.stop()
        finally:
            self._batch.record_stop(self.run_id)

    def awaitTermination(self, timeout: float | None = None) -> bool | None:
        """``StreamingQuery.awaitTermination``; a query found terminated (``availableNow``, a failure, a stop
        from elsewhere) is recorded as stopped in its store, as ``stop`` does."""
        try:
            return self.query.awaitTermination(timeout)
        finally:
            if not self.query.isActive:
                self._batch.record_stop(self.run_id)

    def await_batches(self, count: int, timeout: float | None = None) -> bool:
        """Wait until this run completed ``count`` micro-batches (``len(batches)``); returns whether it did.

        A batch is complete once its state is committed and its output
        written, and Spark has finished its trigger (its progress reported,
        ``lastProgress``): a ``stop()`` right after returns loses neither the
        batch nor its progress. Returns False at ``timeout`` seconds (None:
        no limit) or when the query stopped first, and raises the query's
        exception if it failed. Unlike Spark's ``processAllAvailable``, it
        does not return before a file written while the query polls a
        directory is taken: that call returns at the first trigger after it
        began that found nothing new, which can be one that listed the
        directory before the file existed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._completed(count):
            if not self.query.isActive:
                error = self.query.exception()
                if error is not None:
                    raise error
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.2 if self._remote else 0.05)  # over Spark Connect each look lists the store
        return True

    def _completed(self, count: int) -> bool:
        history = self.batches
        if len(history) < count:
            return False
        if count == 0:
            return True
        progress = self.query.lastProgress  # Spark reports a batch's progress at the end of its trigger
        return progress is not None and progress["batchId"] >= history[count - 1]["batch_id"]

    def request_drain(self) -> None:
        """Drain at the next micro-batch and stop, without waiting (``drain`` waits). The request is also
        written to the store, where the query's clock finds it and runs that batch on an idle source."""
        self._batch.drain_requested = True
        storage = self._batch.coordinator(self._batch.conf()).manifests.storage
        request_drain(storage, self.run_id, reason="query.drain()")

    @property
    def run_id(self) -> str:
        """The id of this run of the query (Spark's ``runId``): what an external drain request names."""
        return str(self.query.runId)

    @property
    def batches(self) -> list[dict]:
        """Per completed micro-batch: ids, parallelism and each instance's report (restore cost, keys).

        Over Spark Connect they are read from the store, where the server
        writes each (``store.reports``): its last ``KEPT_BATCH_REPORTS``.
        """
        if not self._remote:
            return list(self._batch.history)
        history = self._remote_history
        storage = self._batch.coordinator(self._batch.conf()).manifests.storage
        history.extend(batch_reports(storage, self.run_id, history[-1]["batch_id"] if history else -1))
        return list(history)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.query, name)
