"""The Spark plan of a batch's step 3: rows routed to instances, each running its task in ``mapInArrow``.

``TaskPlan`` holds the Column expressions of one parallelism (the routed
columns, the instance, the JVM partial aggregates of built-in aggregates).
Two ways to make a batch's plan from them:

- ``TaskPlan.tasks``, the public path: PySpark's ``select``,
  ``repartitionById``, ``groupBy().agg`` and ``mapInArrow``, whatever the
  session (classic or Spark Connect);
- ``TaskPlan.java``, an accelerator on a classic session: the same plan with
  few py4j calls (``_JavaPlan``), reusing the analysed plan of an earlier
  batch (``_PlanTemplate``), Catalyst internals reached over py4j that save
  17-45 ms of planning per batch. ``accelerated`` says at a query's start
  whether the session has them (``spark.state.planAccelerator`` may turn it
  off); the public path is taken otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spark_state.executor.aggregates import PARTIAL_OPS, PARTIAL_PREFIX, ROWS_COLUMN, Aggregate
from spark_state.executor.columns import EVENT_MS_COLUMN, KEY_GROUP_COLUMN
from spark_state.executor.task import INSTANCE_COLUMN

_LOG = logging.getLogger(__name__)


def to_spark_schema(schema):
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def task_output_schema(output_schema):
    """The Arrow schema of what a task emits: the output columns, every one nullable.

    The output's schema as it always was: an earlier protocol sent each
    task's report as a last row with the output columns null, so a column
    the input declares not null (a source's ``split``, say, passed on by
    ``deduplicate``) became nullable, and sinks saw it so.
    """
    import pyarrow as pa

    return pa.schema([f.with_nullable(True) for f in output_schema])


@dataclass(frozen=True)
class TaskPlan:
    """Step 3's Spark expressions for one parallelism: the routed columns, the instance, the JVM partials.

    With ``partials`` (built-in aggregates whose partials Spark computes,
    ``functions.AggregateDef.in_jvm``, without event time), Spark groups the
    routed rows by ``partials_keys`` right after the shuffle to the
    instances: the instance column is among them, so Spark's aggregate keeps
    the instance partitioning (no second shuffle), and a task receives one
    row per key (``functions.PARTIAL_PREFIX`` columns and ``ROWS_COLUMN``)
    instead of every row, which ``Aggregate.apply`` merges as they are.
    The tasks' input keeps the instance column (they ignore it): dropping it
    would cost one more plan analysis per batch.
    """

    routed: tuple
    by: Any
    output_schema: Any
    partials_keys: tuple | None
    partials: tuple | None
    _java: list = field(default_factory=list, compare=False)  # its ``_JavaPlan``, built at first use

    def tasks(self, batch_df, parallelism: int, process: Callable):
        """The public path: ``batch_df`` routed to ``parallelism`` instances, each running ``process``."""
        routed = batch_df.select(*self.routed).repartitionById(parallelism, self.by)
        if self.partials is not None:
            assert self.partials_keys is not None, "TaskPlan.build sets partials_keys with partials"
            routed = routed.groupBy(*self.partials_keys).agg(*self.partials)
        return routed.mapInArrow(process, self.output_schema)

    def java(self, context) -> _JavaPlan:
        """This plan's JVM objects (see ``_JavaPlan``), built once in ``context`` (the ``SparkContext``)."""
        if not self._java:
            self._java.append(_JavaPlan.build(self, context))
        return self._java[0]

    @classmethod
    def build(cls, stream, parallelism: int, max_parallelism: int, *, accelerated: bool = True, frame=None) -> TaskPlan:
        """The plan of ``stream`` (a ``streaming.StatefulStream``, whose schema, function and event time every
        ``TaskSpec`` of the query repeats) at ``parallelism`` instances of ``max_parallelism`` key groups; its
        columns made by single JVM calls when ``accelerated``, else by ``pyspark.sql.functions``. The key
        columns' types are read from ``frame`` (a batch's rows), else from the stream's DataFrame."""
        from spark_state.spark.routing import routing_columns

        df = frame if frame is not None else stream.keyed.df
        jf = _JvmColumns(df.sparkSession.sparkContext) if accelerated else _PublicColumns()
        key_columns = list(stream.schema.key_columns)
        event_time = stream.keyed.event_time
        # The key types from the stream (its schema is resolved once), not from analysing every batch.
        key_group, instance = routing_columns(df, key_columns, parallelism, max_parallelism)
        event_column = [event_time.column] if event_time is not None else []
        inputs = [c for c in stream.input_columns if c != EVENT_MS_COLUMN]  # added by the task
        needed = list(dict.fromkeys(key_columns + inputs + event_column))
        partials = None
        function = stream.function
        if isinstance(function, Aggregate) and event_time is None and function.partials_in_jvm():
            partials = _spark_partials(function, jf)
        # Columns, not names: a name becomes a Column (a JVM round trip) every time a batch's plan names it.
        return cls(
            routed=(*map(jf.col, needed), jf.alias(key_group, KEY_GROUP_COLUMN), jf.alias(instance, INSTANCE_COLUMN)),
            by=jf.col(INSTANCE_COLUMN),
            output_schema=to_spark_schema(task_output_schema(stream.output_schema)),
            partials_keys=tuple(map(jf.col, (INSTANCE_COLUMN, KEY_GROUP_COLUMN, *key_columns)))
            if partials is not None
            else None,
            partials=partials,
        )


def accelerated(session, wanted: bool = True) -> bool:
    """Whether ``TaskPlan.java`` can make this session's plans: a classic session (a JVM in this process)
    whose PySpark has the internals it uses; never when not ``wanted`` (``spark.state.planAccelerator``)."""
    if not wanted or getattr(session, "_jsparkSession", None) is None:
        return False
    try:
        from pyspark.sql.classic.column import Column, _to_java_column, _to_seq  # noqa: F401

        context = session.sparkContext
        jvm = context._jvm
        return all(
            jvm.org.apache.spark.util.Utils.classIsLoadable(name)
            for name in (
                "org.apache.spark.sql.classic.Dataset",
                "org.apache.spark.api.python.SimplePythonFunction",
                "org.apache.spark.sql.catalyst.plans.logical.MapInArrow",
            )
        )
    except Exception:  # noqa: BLE001 - an internal missing in this Spark: the public path
        return False


class _PublicColumns:
    """``_JvmColumns``' calls made by ``pyspark.sql.functions``: the public API, on classic and Connect."""

    @staticmethod
    def col(name: str):
        from pyspark.sql import functions as F

        return F.col(name)

    @staticmethod
    def call(name: str, *columns):
        from pyspark.sql import functions as F

        return getattr(F, name)(*columns)

    @staticmethod
    def lit(value):
        from pyspark.sql import functions as F

        return F.lit(value)

    @staticmethod
    def alias(column, name: str):
        return column.alias(name)


class _JvmColumns:
    """Columns made by single calls to the JVM's ``org.apache.spark.sql.functions`` and ``Column``.

    PySpark's own ``functions.col``, ``count``, ``lit`` and ``Column.alias``
    first record the caller's stack for error messages (a stack walk, an
    import attempt and four more JVM round trips: 3-5 ms a call, against
    0.5-1 ms here). The plan of a parallelism makes about twenty of them on
    the critical path of its first batch: the first batch of every restart
    and of every live rescale.
    """

    def __init__(self, context):
        self.functions = context._jvm.org.apache.spark.sql.functions

    def col(self, name: str):
        from pyspark.sql.classic.column import Column

        return Column(self.functions.col(name))

    def call(self, name: str, *columns):
        """``functions.<name>(*columns)`` of Spark's aggregates and the like, on Columns."""
        from pyspark.sql.classic.column import Column

        return Column(getattr(self.functions, name)(*(c._jc for c in columns)))

    def lit(self, value):
        from pyspark.sql.classic.column import Column

        return Column(self.functions.lit(value))

    @staticmethod
    def alias(column, name: str):
        from pyspark.sql.classic.column import Column

        return Column(column._jc.alias(name))


class _JavaPlan:
    """A ``TaskPlan`` as JVM objects, so that a batch's Spark calls cost a few py4j round trips, not dozens.

    PySpark's ``select``, ``groupBy``, ``agg`` and ``mapInArrow`` convert
    their Python lists of columns into Java sequences one element per round
    trip, and ``mapInArrow`` reads the frame's columns back from the JVM
    first: about 90 round trips in every batch before its job starts, on the
    driver's critical path. The sequences are the same in every batch of a
    parallelism, so they are built here once and the plan is made with one
    call per step on the batch's Java ``Dataset``. Spark analyses each step
    again (17-45 ms a batch), so later batches take that plan from the last
    one built this way (``_PlanTemplate``), and the first batch of a query
    run (or of a parallelism set with ``set_parallelism``) from the stream's
    own plan, made before it (``prepare_first``, ``MicroBatch.prepare_plan``). The template of a batch's plan is
    made by a thread of its own once the batch is committed (``prepare``;
    ``pending`` until then, ``building`` while it runs), while Spark commits
    the batch and plans the next, and the next batch waits for it: its
    10-60 ms of py4j calls, one per element of each node, are on no batch's
    critical path, and not in a job's either. One that fails (the session
    stopped under it, say) leaves the next batch to PySpark's calls.
    ``mapInArrow``'s input is every column of the frame it maps (as PySpark's
    own ``mapInArrow`` passes them), named once from the first batch's
    schema, which a stream keeps.
    """

    def __init__(self, plan: TaskPlan, context, routed, by, keys, first, rest):
        self.plan, self.context = plan, context
        self.routed, self.by, self.keys, self.first, self.rest = routed, by, keys, first, rest
        self.inputs = None  # mapInArrow's input columns, as a Java sequence (``tasks``)
        self.template: _PlanTemplate | None = None  # the plan PySpark's calls built last, for the next batches
        self.pending: tuple | None = None  # (session, rows, Java Dataset, return type, settings): not templated yet
        self.building: tuple[threading.Thread, list] | None = None  # the thread making the next template, its result
        self.declined = False  # whether the template declined a batch's function (``_PlanTemplate.rebase``)

    @classmethod
    def build(cls, plan: TaskPlan, context) -> _JavaPlan:
        from pyspark.sql.classic.column import _to_java_column, _to_seq

        keys = first = rest = None
        if plan.partials is not None:
            assert plan.partials_keys is not None, "TaskPlan.build sets partials_keys with partials"
            keys = _to_seq(context, plan.partials_keys, _to_java_column)
            first, rest = plan.partials[0]._jc, _to_seq(context, plan.partials[1:], _to_java_column)
        return cls(plan, context, _to_seq(context, plan.routed, _to_java_column), plan.by._jc, keys, first, rest)

    def tasks(self, batch_df, parallelism: int, process: Callable):
        """``batch_df`` routed to ``parallelism`` instances, each running ``process`` (``MicroBatch._run_tasks``)."""
        from pyspark.sql.classic.dataframe import DataFrame

        session = batch_df.sparkSession
        rows = batch_df._jdf.queryExecution().analyzed()
        if self.building is not None:
            self.template = self._built()
        if self.template is not None:
            if self.template.fits(rows):
                mapped = self.template.rebase(rows, process)
                if mapped is not None:
                    return DataFrame(mapped, session)
                self.declined = True  # so will every batch's function: no more templates to build and drop
            self.template = None  # the plan built next takes its place (and holds this batch's rows, not older ones)
        # The first batch, one whose rows or context changed, or a function the template declines: PySpark's calls.
        mapped, return_type = self._mapped(self._routed(batch_df._jdf, parallelism), session, process)
        if not self.declined:
            self.pending = (session, rows, mapped, return_type, _PlanTemplate.settings_of(self.context))
        return DataFrame(mapped, session)

    def _mapped(self, routed, session, process: Callable):
        """``routed`` (a Java ``Dataset``) mapped by ``process`` in ``mapInArrow``, and the UDF's return type."""
        from pyspark.sql.classic.dataframe import DataFrame
        from pyspark.sql.pandas.functions import pandas_udf
        from pyspark.util import PythonEvalType

        if self.inputs is None:
            self._name_inputs(DataFrame(routed, session).columns)
        # pyspark's stub of pandas_udf has no overload for SQL_MAP_ARROW_ITER_UDF (207), which its mapInArrow uses
        udf = pandas_udf(  # type: ignore[call-overload]
            process, returnType=self.plan.output_schema, functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF
        )._unwrapped
        return routed.mapInArrow(udf._judf.apply(self.inputs), False, None), udf.returnType

    def _routed(self, frame, parallelism: int):
        """The Java ``Dataset`` of ``frame``'s rows routed to ``parallelism`` instances (and their JVM partials)."""
        routed = frame.select(self.routed).repartitionById(parallelism, self.by)
        return routed.groupBy(self.keys).agg(self.first, self.rest) if self.keys is not None else routed

    def _name_inputs(self, names: list[str]) -> None:
        """``mapInArrow``'s input columns: every column of the routed rows, by name."""
        from pyspark.sql.classic.column import _to_java_column, _to_seq

        from spark_state.spark.routing import quoted_identifier

        jf = _JvmColumns(self.context)
        self.inputs = _to_seq(self.context, [jf.col(quoted_identifier(name)) for name in names], _to_java_column)

    def prepare_first(self, stream_df, parallelism: int) -> None:
        """Before the first batch, make the template its plan takes (``_PlanTemplate``) from ``stream_df``, the
        stream itself, routed and mapped as a batch's rows are.

        Spark gives each batch's rows the attributes of the stream's own
        (its ``foreachBatch`` frame is the query's plan over the batch's
        data), so the plan of the stream holds over them as the plan of an
        earlier batch does (``_PlanTemplate.fits`` checks it), with the
        batch's function in place of a placeholder. The first batch then
        costs a dozen py4j calls instead of Spark's analysis of each step.
        """

        def process(batches):  # named as the batches' own function (``MicroBatch._run_tasks``): the plan names it
            raise AssertionError("a plan made for no batch ran (a defect of spark-state, please report it)")

        session = stream_df.sparkSession
        mapped, return_type = self._mapped(self._routed(stream_df._jdf, parallelism), session, process)
        rows = stream_df._jdf.queryExecution().analyzed()
        self.template = _PlanTemplate.build(
            self.context, session, rows, mapped, return_type, _PlanTemplate.settings_of(self.context)
        )

    def prepare(self) -> None:
        """Start making the template of the plan ``tasks`` made last, if any, in a thread (``_built`` waits)."""
        if self.pending is None:
            return
        arguments, self.pending = (self.context, *self.pending), None
        self.building = in_thread("spark-state plan template", lambda: _PlanTemplate.build(*arguments))

    def _built(self) -> _PlanTemplate | None:
        """The template the thread ``prepare`` started made (waiting for it), or None."""
        building, self.building = self.building, None
        assert building is not None, "tasks() waits only for a template being made"
        return joined(
            building, "make the plan template of the last batch", "this batch's plan is made by PySpark's calls"
        )


def in_thread(name: str, make: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """Start ``make`` in a daemon thread named ``name``; the list receives what it returns or the exception it
    raised (``joined``)."""
    result: list = []

    def run() -> None:
        try:
            result.append(make())
        except Exception as error:  # noqa: BLE001  (handed to ``joined``)
            result.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def joined(started: tuple[threading.Thread, list], failed: str, instead: str) -> Any:
    """What ``in_thread``'s thread made (waiting for it); None when it raised, with a warning that it could not
    ``failed`` and what happens ``instead``."""
    thread, result = started
    thread.join()
    made = result[0] if result else None
    if isinstance(made, Exception):
        _LOG.warning("spark-state: could not %s (%s: %s); %s", failed, type(made).__name__, made, instead)
        return None
    return made


class _PlanTemplate:
    """A batch's analysed plan in about a dozen py4j calls: the plan of an earlier batch, on this batch's rows.

    Spark analyses a plan again at every ``Dataset`` step (the ``select``
    with the key-group expression, ``repartitionById``, the partial
    aggregate, ``mapInArrow``): 17-45 ms in every batch, on the driver's
    critical path. Two parts of the plan differ between the batches of a
    parallelism: the batch's rows (a leaf whose output, the same attributes
    with the same ids, a stream keeps) and the pickled function. So this
    keeps the analysed plan that PySpark's calls built for one batch and
    makes each next batch's as Spark would: a copy of each node of the chain
    above the rows with its child replaced (case-class copies, from the
    node's elements: that holds across Spark versions, whatever their
    constructors take), the top one around a copy of its ``PythonUDF`` with
    a new ``SimplePythonFunction`` made as PySpark makes it, from the new
    pickled ``(function, return type)`` and the first one's other parts.
    The result is marked analysed, as Spark marks what it has analysed, so
    the ``Dataset`` over it is not analysed again: it is the plan Spark's
    analysis gives, as ``tests/test_keyed_spark.py`` checks against it.

    It does not fit (``fits``) a batch whose rows have other attributes, or
    a context whose environment or includes changed since (PySpark puts both
    into the function), and ``rebase`` declines (returns None) what PySpark
    would ship differently: a pickled function past Spark's broadcast
    threshold, or one that pickles broadcast variables. That batch's plan
    is built the usual way, and becomes the template of the next batches
    (made once that batch is committed); except after a declined function:
    a function of the same query reads the same broadcasts in every batch,
    so ``_JavaPlan`` builds no more templates for it (each would cost about
    15 py4j calls, to be declined again). A template holds the nodes of the latest batch it
    made (``rebase`` keeps them), so no older batch's rows stay referenced:
    their RDD, and the shuffle files of a stream that shuffles before
    ``keyed``, are released as Spark releases them.
    """

    def __init__(
        self, context, session, rows, chain, udf, udf_parts, function_index, function_parts, return_type, settings
    ):
        self.context, self.session, self.return_type = context, session._jsparkSession, return_type
        self.rows_output = rows.output()
        self.chain = chain  # (node, its elements, the index of its child), from the top down to the rows
        self.udf, self.udf_parts, self.function_index = udf, udf_parts, function_index
        self.function_parts = function_parts  # all but the first, the pickled function (kilobytes to copy)
        self.threshold = context._jvm.PythonUtils.getBroadcastThreshold(context._jsc)
        self.new_function = context._jvm.SimplePythonFunction
        self.datasets = context._jvm.org.apache.spark.sql.classic.Dataset
        self.settings = settings

    @classmethod
    def build(cls, context, session, rows, mapped, return_type, settings) -> _PlanTemplate | None:
        """The template of ``mapped`` (a Java ``Dataset``) over ``rows`` (the batch's analysed plan), built in
        the context's ``settings`` (``settings_of``), if its plan is a chain of one-child nodes down to ``rows``
        whose top node's first element is the Python UDF."""
        node, chain = mapped.queryExecution().analyzed(), []
        while not node.fastEquals(rows):
            if node.children().size() != 1:
                return None
            child = node.children().head()
            parts = _elements(node)
            index = _index_of(parts, child)
            if index is None:
                return None
            chain.append((node, parts, index))
            node = child
        if not chain or chain[0][0].nodeName() != "MapInArrow":
            return None
        udf = chain[0][1][0]
        if udf.getClass().getSimpleName() != "PythonUDF":
            return None
        udf_parts, function = _elements(udf), udf.func()
        function_index = _index_of(udf_parts, function)
        if function_index is None:
            return None
        function_parts = _elements(function, first=1)
        return cls(context, session, rows, chain, udf, udf_parts, function_index, function_parts, return_type, settings)

    @staticmethod
    def settings_of(context) -> tuple:
        """What of ``context`` PySpark puts into a Python function: its environment and includes."""
        return dict(context.environment), list(context._python_includes)

    def fits(self, rows) -> bool:
        """Whether the template's plan holds over ``rows`` (a batch's analysed plan) in the context as it is."""
        return self.settings_of(self.context) == self.settings and rows.output().equals(self.rows_output)

    def rebase(self, rows, process: Callable):
        """The template's plan over ``rows`` mapped by ``process``, as a Java ``Dataset``; None where PySpark
        would ship the function differently."""
        from pyspark.serializers import CloudPickleSerializer

        pickled = CloudPickleSerializer().dumps((process, self.return_type))
        broadcasts = self.context._pickled_broadcast_vars  # (a registry, always true: it has no len)
        if next(iter(broadcasts), None) is not None or len(pickled) > self.threshold:
            broadcasts.clear()  # PySpark pickles the function again, and collects them again
            return None
        function = self.new_function(bytearray(pickled), *self.function_parts)
        udf = self.udf.copy(*_replaced(self.udf_parts, self.function_index, function))
        plan, chain = rows, []
        for depth in range(len(self.chain) - 1, -1, -1):
            node, parts, child = self.chain[depth]
            parts = _replaced(parts, child, plan)
            if depth == 0:
                parts = _replaced(parts, 0, udf)
            plan = node.copy(*parts)
            chain.append((plan, parts, child))
        self.chain = chain[::-1]  # the next batch copies these: the template holds no older batch's rows
        plan.setAnalyzed()
        return self.datasets.ofRows(self.session, plan)


def _elements(node, first: int = 0) -> list:
    """The elements of a JVM case class (its first parameter list), in order, from the ``first``."""
    return [node.productElement(i) for i in range(first, node.productArity())]


def _index_of(parts: list, element) -> int | None:
    """The index of the JVM object ``element`` among ``parts`` (None if it is not one of them)."""
    return next((i for i, part in enumerate(parts) if hasattr(part, "equals") and part.equals(element)), None)


def _replaced(parts: list, index: int, value) -> list:
    return [value if i == index else part for i, part in enumerate(parts)]


def _spark_partials(function: Aggregate, jf: _JvmColumns | _PublicColumns) -> tuple:
    """Spark's aggregates of ``function``'s partials (see ``TaskPlan``), each the Spark function
    ``aggregates.PARTIAL_OPS`` names for it, and the row count."""
    # ``function.column`` is None only for an aggregate registered without ``needs_column`` whose partials read a
    # column, which ``AggregateDef`` does not refuse: Spark's ``col`` is then called on null and fails.
    arguments = {"one": lambda: jf.lit(1), "column": lambda: jf.col(function.column)}  # type: ignore[arg-type]
    partials = []
    for i, op in enumerate(function.definition.partials):
        spark_function, argument = PARTIAL_OPS[op]
        partials.append(jf.alias(jf.call(spark_function, arguments[argument]()), f"{PARTIAL_PREFIX}{i}"))
    return (*partials, jf.alias(jf.call("count", jf.lit(1)), ROWS_COLUMN))
