"""Where a keyed query's output goes: one write per micro-batch id, idempotent under replays.

The driver calls ``sink.write(output, batch_id)`` once per micro-batch, and
again with the same id when Spark replays the batch after a failure, so a
sink must leave the same result however often it is called for one id:

- ``ForeachBatchSink(fn)``: the user's ``fn(output_df, batch_id)``, which
  must itself be idempotent per batch id; each action on ``output_df`` runs
  the batch's tasks (``microbatch``), so ``fn`` should persist it to use it
  more than once;
- ``FileSink``: any Spark file format (``parquet``, ``json``, ...), each
  batch written with mode overwrite to ``<path>/batch_id=N``, so a replay
  replaces itself;
- sinks registered by other packages under the entry-point group
  ``spark_state.spark.sinks``: the entry point's name is the format name, its
  value a factory ``factory(options, default_sink_id) -> BatchSink``. The
  ``replayable`` log registers itself this way (it records each batch id
  once per sink id); ``default_sink_id`` identifies the query across
  restarts of one checkpoint location.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from spark_state.errors import ConfigError

ENTRY_POINT_GROUP = "spark_state.sinks"


class BatchSink(Protocol):
    """Writes one micro-batch's output; calling it again with the same id must change nothing more."""

    def write(self, output: Any, batch_id: int) -> None: ...


@dataclass(frozen=True)
class ForeachBatchSink:
    """Hands ``(output_df, batch_id)`` to a user function (which must be idempotent per batch id)."""

    fn: Callable[[Any, int], None]

    def write(self, output: Any, batch_id: int) -> None:
        self.fn(output, batch_id)


@dataclass(frozen=True)
class FileSink:
    """A Spark file format; batch N overwrites ``<path>/batch_id=N``."""

    format: str
    path: str
    options: Mapping[str, str]

    def write(self, output: Any, batch_id: int) -> None:
        output.write.format(self.format).mode("overwrite").options(**self.options).save(
            f"{self.path.rstrip('/')}/batch_id={batch_id}"
        )


def registered_sinks() -> dict[str, Any]:
    """Format name -> entry point of every sink registered under ``spark_state.spark.sinks``."""
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def open_sink(
    format: str | None,
    options: Mapping[str, str],
    foreach_batch: Callable[[Any, int], None] | None,
    *,
    default_sink_id: str,
) -> BatchSink:
    """The sink a ``StatefulStreamWriter`` describes (``foreachBatch`` wins over ``format``)."""
    if foreach_batch is not None:
        return ForeachBatchSink(foreach_batch)
    if format is None:
        raise ConfigError("choose a sink: .format(name).option('path', ...) or .foreachBatch(fn)")
    registered = registered_sinks().get(format)
    if registered is not None:
        return registered.load()(dict(options), default_sink_id)
    rest = dict(options)
    path = rest.pop("path", None)
    if not path:
        raise ConfigError(
            f"sink format {format!r} needs option('path', ...): batch N is written to <path>/batch_id=N "
            f"(registered sink formats: {sorted(registered_sinks()) or 'none'})"
        )
    return FileSink(format, path, rest)
