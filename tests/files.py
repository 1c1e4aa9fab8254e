"""Input files for the Spark tests' file-source streams, published so that a running query sees each whole, once.

Spark's file source takes the files it finds at each trigger, and ignores
for good any file whose modification time is more than its ``maxFileAge``
(a week) older than the newest it has seen. A test that wrote a file in
place and then set its time had two races with a query polling the
directory: a listing between the two saw the file with the current time,
so every later file, dated years back, was ignored and the query waited
forever for its next batch; and a listing during the write saw a partial
file. ``publish`` writes under a hidden name (the file source skips names
that start with ``.``), sets the time, then renames the file into place.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

BASE_MTIME = 1_700_000_000
"""The modification time of file 0; file ``i`` is ``i`` seconds later, so the file source takes them in order."""


def publish(table: pa.Table, path: Path, index: int) -> None:
    """Write ``table`` as the Parquet file ``path``, dated ``BASE_MTIME + index``, visible only when complete."""
    hidden = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, hidden)
    os.utime(hidden, (BASE_MTIME + index, BASE_MTIME + index))
    os.rename(hidden, path)


def append_users(log: str, users: list[str]) -> None:
    """Append ``users`` to the ``replayable`` log at ``log`` (created with 2 splits), half to each split."""
    from datasources.log import ReplayableLog
    from datasources.logindex import LogMeta
    from spark_state.storage.local import LocalStorage

    schema = pa.schema([pa.field("user", pa.string())])
    storage = LocalStorage(log)
    replayable = (
        ReplayableLog.open(storage)
        if storage.exists("_log.json")
        else ReplayableLog.create(storage, LogMeta("events", 2, schema))
    )
    writer = replayable.segment_writer(order=0, max_records=1_000_000)
    for split in (0, 1):
        writer.add(split, pa.record_batch([pa.array(users[split::2], pa.string())], schema=schema))
    replayable.append(writer.finish())
