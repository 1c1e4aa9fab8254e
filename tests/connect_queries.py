"""The keyed queries the Connect tests run, on a Spark Connect client and on the classic test session alike.

``stream(spark, input)`` reads a directory of Parquet files one per micro-batch
(``user string, amount long, ts timestamp``); ``build(kind, events)`` keys it
and chooses what to compute; ``write(stateful, ...)`` starts it with a Parquet
sink (``<out>/batch_id=N``, overwritten on a replay). The functions ``apply``
runs are here, importable by the server's Python workers and by the classic
session's alike.
"""

from __future__ import annotations

import pandas as pd

from spark_state import keyed

SCHEMA = "user string, amount long, ts timestamp"
KINDS = ("count", "sum", "apply", "timers", "sessions", "deduplicate", "ttl")


def stream(spark, input_dir: str):
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(input_dir)


def running_total(key, rows, state):
    total, n = state.get() if state.exists else (0, 0)
    total, n = total + int(rows["amount"].sum()), n + len(rows)
    state.update((total, n))
    return pd.DataFrame({"user": [key[0]], "total": [total], "n": [n]})


def remind(key, rows, state):
    """Registers an event-time timer 10 s after each key's latest row; ``on_timer`` says the key went quiet."""
    latest = int(rows["ts"].max().value // 1_000_000)
    state.update((latest,))
    state.timers.register(latest + 10_000, "event")
    return pd.DataFrame({"user": [key[0]], "event": ["seen"], "at_ms": [latest]})


def quiet(key, timer, state):
    return pd.DataFrame({"user": [key[0]], "event": ["quiet"], "at_ms": [timer.time_ms]})


def build(kind: str, events):
    """The keyed computation ``kind`` (one of ``KINDS``) of ``events``."""
    by_user = keyed(events, "user", name=f"{kind}-state")
    timed = by_user.withWatermark("ts", "5 seconds")
    if kind == "count":
        return by_user.count()
    if kind == "sum":
        return by_user.sum("amount")
    if kind == "apply":
        return by_user.apply(
            running_total, state_schema="total long, n long", output_schema="user string, total long, n long"
        )
    if kind == "timers":
        return timed.apply(
            remind, on_timer=quiet, state_schema="latest long", output_schema="user string, event string, at_ms long"
        )
    if kind == "sessions":
        return timed.session_window("20 seconds", "amount")
    if kind == "deduplicate":
        return timed.deduplicate("1 minute")
    if kind == "ttl":
        return by_user.apply(
            running_total,
            state_schema="total long, n long",
            output_schema="user string, total long, n long",
            ttl="1 hour",
        )
    raise ValueError(f"unknown kind {kind!r}; the kinds are {KINDS}")


def write(stateful, out: str, checkpoint: str, *, trigger: dict | None = None):
    writer = stateful.writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
    return writer.trigger(**(trigger or {"availableNow": True})).start()
