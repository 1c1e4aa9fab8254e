"""Registers ``format("replayable")`` in every Spark session: Spark 4 imports installed top-level
``pyspark_*`` modules and registers their ``DefaultSource`` (see ``datasources.replayable``)."""

from datasources.replayable import ReplayableDataSource as DefaultSource

__all__ = ["DefaultSource"]
