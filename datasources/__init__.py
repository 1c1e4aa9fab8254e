"""spark-state's Spark data sources: ``format("replayable")`` (``datasources.replayable``) and
``format("spark-state")``, the state reader (``datasources.state_reader``).

Installing spark-state registers both in every Spark session: Spark 4 imports
the installed top-level modules ``pyspark_replayable`` and
``pyspark_spark_state`` and registers their ``DefaultSource``. ``register``
registers them from Python as well, which a session should do before it
reads either source (see there).
"""

from datasources.replayable import ReplayableDataSource as DefaultSource

__all__ = ["DefaultSource", "register"]


def register(spark) -> None:
    """Register ``replayable`` and ``spark-state`` in ``spark`` from Python, so their tasks share the Python
    workers of the session's other Python tasks (a keyed query's instances among them).

    Spark keeps one pool of Python workers per executor and environment. A
    source Spark registered by itself (``pyspark_*`` modules) hands its tasks
    an environment of its own (``PYTHONPATH`` only), while PySpark gives every
    function made in Python, this registration's included, the context's
    (``PYTHONHASHSEED`` and the ``spark.executorEnv.*`` settings): so a query
    that reads ``replayable`` into ``keyed`` starts two pools on every
    executor, the second in its first batch (about 1.5 s here), and keeps both
    pools' processes. Call it once per session that reads either source,
    before the reads it should apply to (a DataFrame keeps the source it was
    loaded with); calling it again is harmless. It costs what a session's
    first read of a Python source by name costs anyway, Spark's one lookup of
    the installed ``pyspark_*`` modules (a Python process, about 2 s here): a
    session that reads neither source saves nothing and pays that. Optional:
    without it both sources work as they are.

    The session's ``spark.state.s3.*`` settings in force when it is called
    apply to the sources' ``s3://`` locations (``s3_defaults``): Spark shows a
    Python data source no session setting of its own.
    """
    from datasources.replayable import ReplayableDataSource
    from datasources.s3_defaults import session_settings, with_session_settings
    from datasources.state_reader import StateDataSource

    settings = session_settings(spark)
    for source in (ReplayableDataSource, StateDataSource):
        spark.dataSource.register(with_session_settings(source, settings))
