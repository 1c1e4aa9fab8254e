"""A Python streaming source for the tests that fails its first ``latestOffset`` while a marker file exists.

``spark.readStream.format("failing_once").option("marker", PATH).option("rows", N)``: N rows ``key`` (a string of
``i % 7``) in one micro-batch. While ``PATH`` exists, ``latestOffset`` deletes it and raises: the query fails
before it planned any batch, as a first start that fails does (Spark's Python worker timing out, say).
"""

from __future__ import annotations

import os

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition


class InjectedStartFailure(RuntimeError):
    """The failure ``failing_once`` injects."""


class FailingOnceSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "failing_once"

    def schema(self) -> str:
        return "key string"

    def streamReader(self, schema) -> DataSourceStreamReader:
        return _Reader(self.options)


class _Reader(DataSourceStreamReader):
    def __init__(self, options):
        self.marker = options["marker"]
        self.rows = int(options["rows"])

    def initialOffset(self) -> dict:
        return {"row": 0}

    def latestOffset(self) -> dict:
        try:
            os.unlink(self.marker)
        except FileNotFoundError:
            return {"row": self.rows}
        raise InjectedStartFailure("the injected failure of a query's first start")

    def partitions(self, start: dict, end: dict):
        return [InputPartition((start["row"], end["row"]))]

    def read(self, partition):
        first, end = partition.value
        for i in range(first, end):
            yield (str(i % 7),)

    def commit(self, end: dict) -> None:
        pass
