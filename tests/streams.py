"""Waiting for a running query in tests."""

from __future__ import annotations

import time


def process(query, batches: int, timeout: float = 120.0) -> None:
    """``processAllAvailable`` until the query ran ``batches`` micro-batches.

    Spark's call can return before a file written while the query polls is
    taken: a trigger that listed the directory before the file existed ends
    with no new data after the call began, which is the signal the call
    waits for (``StreamExecution`` resets ``noNewData`` and returns at the
    next trigger that finds nothing new).
    """
    deadline = time.monotonic() + timeout
    while len(query.batches) < batches:
        assert time.monotonic() < deadline, f"{len(query.batches)} of {batches} micro-batches after {timeout} s"
        query.processAllAvailable()
