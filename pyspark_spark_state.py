"""Registers ``format("spark-state")`` (the state reader) in every Spark session: Spark 4 imports installed
top-level ``pyspark_*`` modules and registers their ``DefaultSource`` (see ``datasources.state_reader``)."""

from datasources.state_reader import StateDataSource as DefaultSource

__all__ = ["DefaultSource"]
