"""Two driver processes race on one state store and component: one owns it, the other stops, nothing is corrupted.

Both run the campaign's keyed count (``tests/campaign/driver.py``) over the
same replayable log from its start, each with its own checkpoint location and
sink, at the same time. Exactly one of them commits every checkpoint of the
store; the other stops with the typed error that says another query owns the
store; every retained checkpoint loads and every file it references has the
size and CRC-32 it recorded; and the owner's output is exactly the model's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from spark_state.storage import LocalStorage
from spark_state.store.manifestlog import ManifestReader
from tests.campaign.events import EventLog
from tests.campaign.model import CountModel
from tests.campaign.supervisor import REPO, SITE, read_offsets, sink_rows
from tests.jvm import driver_jvm_options

pytestmark = pytest.mark.spark


def _spec(root: Path, name: str, events: str, store: Path) -> Path:
    control = root / name / "control"
    control.mkdir(parents=True)
    (control / "finish").write_text("")  # process everything available, then stop
    spec = {
        "shape": "count",
        "events": events,
        "checkpoint": str(root / name / "chk"),
        "out": str(root / name / "out"),
        "starting_offsets": {str(s): 0 for s in range(4)},
        "max_records_per_batch": 700,
        "live_change": None,
        "control": str(control),
        "conf": {
            "spark.master": "local[1]",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "2",
            "spark.sql.adaptive.enabled": "false",
            "spark.driver.extraJavaOptions": driver_jvm_options(),
            "spark.state.parallelism": "2",
            "spark.state.store": str(store),
            "spark.state.checkpointsRetained": "50",
        },
    }
    path = root / name / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_two_drivers_on_one_store_one_owns_it_the_other_stops_and_nothing_is_corrupted(tmp_path):
    log = EventLog(str(tmp_path / "events"), random.Random(5))
    for _ in range(5):
        log.append(600)
    store = tmp_path / "state"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(REPO)]), PYSPARK_PYTHON=sys.executable)
    processes = {}
    for name in ("a", "b"):
        spec = _spec(tmp_path, name, log.uri, store)
        with open(tmp_path / name / "driver.log", "wb") as out:
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.campaign.driver", str(spec)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    codes = {name: process.wait(timeout=600) for name, process in processes.items()}
    assert sorted(codes.values()) == [0, 3], codes
    winner = next(name for name, code in codes.items() if code == 0)
    loser = "b" if winner == "a" else "a"
    error = json.loads((tmp_path / loser / "control" / "error.json").read_text())["message"]
    assert "another query owns the state store" in error
    assert "StoreOwnedByAnotherQueryError" in error or "StateOfAnotherQueryError" in error

    storage = LocalStorage(store)
    reader = ManifestReader(storage)
    ids = reader.ids()
    assert ids == list(range(len(ids))) and ids  # every checkpoint kept (retention 50), none skipped
    for checkpoint_id in ids:
        manifest = reader.load(checkpoint_id)
        assert manifest.binding.checkpoint_location == str(tmp_path / winner / "chk"), checkpoint_id
        for component in manifest.components.values():
            for ref in component.blobs.values():
                data = storage.read(ref.path)
                assert (len(data), zlib.crc32(data)) == (ref.size, ref.crc32), ref.path

    from datasources.log import ReplayableLog
    from datasources.logindex import Commit

    out = ReplayableLog.open(LocalStorage(tmp_path / winner / "out"))
    sink: dict[int, list] = {}
    for n in out.commits.ids():
        commit = Commit.from_json(out.commits.load(n), str(n))
        rows = [row for ref in commit.segments for row in sink_rows("count", out.load_segment(ref))]
        assert commit.sink.batch not in sink
        sink[commit.sink.batch] = sorted(rows)
    offsets = read_offsets(tmp_path / winner / "chk")
    model, start = CountModel(), {s: 0 for s in range(4)}
    for batch in sorted(offsets):
        end, processing_ms = offsets[batch]
        assert sink.get(batch, []) == model.batch(log.events_between(start, end), processing_ms, False), batch
        start = end
    assert start == log.end_offsets()
