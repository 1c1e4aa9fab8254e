"""spark-state: rescalable, exactly-once keyed state for PySpark Structured Streaming.

The pure parts (``keygroups``, ``blob``, ``manifest``, ``restore``,
``checkpoint``, ``keyed_state``, ``storage``) import without pyspark;
``keyed`` (the Spark API, in ``streaming``) imports it on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"


def keyed(df, *key_columns: str, name: str):
    """Key a streaming DataFrame for rescalable state; see ``spark_state.streaming.keyed``."""
    from spark_state.streaming import keyed as _keyed

    return _keyed(df, *key_columns, name=name)


__all__ = ["keyed", "__version__"]
