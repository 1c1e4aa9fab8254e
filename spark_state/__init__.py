"""spark-state: rescalable, exactly-once keyed state for PySpark Structured Streaming.

The pure parts (``keygroups``, ``blob``, ``manifest``, ``restore``,
``evolution``, ``reader``, ``storage``, ...) import without pyspark;
``keyed`` (the Spark API, in ``streaming``) imports it on first use, and
``read_state`` (``reader``) reads state without Spark.
"""

from __future__ import annotations

__version__ = "0.1.0"


def keyed(df, *key_columns: str, name: str):
    """Key a streaming DataFrame for rescalable state; see ``spark_state.spark.streaming.keyed``."""
    from spark_state.spark.streaming import keyed as _keyed

    return _keyed(df, *key_columns, name=name)


def read_state(store, component: str, checkpoint=None, **options):
    """A component's keys and values as a ``pyarrow.Table``, without Spark; see ``spark_state.ops.reader.read_state``."""
    from spark_state.ops.reader import read_state as _read_state

    return _read_state(store, component, checkpoint, **options)


def typed_error(error: BaseException):
    """The typed error of spark-state that ``error`` (a ``StreamingQueryException``, say) carries, or None; see
    ``spark_state.errors.typed_error``."""
    from spark_state.errors import typed_error as _typed_error

    return _typed_error(error)


__all__ = ["keyed", "read_state", "typed_error", "__version__"]
