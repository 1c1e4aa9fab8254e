"""The ``replayable`` log as the sink of a keyed query (``spark_state.spark.sinks`` entry point ``replayable``).

Each micro-batch is appended with the log's sink mark ``(sinkId, batch id)``,
so a batch id the log already holds for that sink is skipped: a replayed
batch is appended once. ``sinkId`` defaults to the query's identity across
restarts of one checkpoint location.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from datasources.errors import ReplayableOptionError


@dataclass(frozen=True)
class ReplayableBatchSink:
    """Appends batch N to the log with ``batchId=N`` under ``options['sinkId']``."""

    options: Mapping[str, str]

    def write(self, output: Any, batch_id: int) -> None:
        options = dict(self.options, batchId=str(batch_id))
        output.write.format("replayable").mode("append").options(**options).save()


def replayable_sink(options: Mapping[str, str], default_sink_id: str) -> ReplayableBatchSink:
    """The entry point: a sink over the write ``options`` (``path`` required, as for ``df.write``)."""
    if "batchId" in options:
        raise ReplayableOptionError(
            "option batchId is set by the keyed query for every micro-batch; remove it from the sink options"
        )
    return ReplayableBatchSink({"sinkId": default_sink_id, **options})
