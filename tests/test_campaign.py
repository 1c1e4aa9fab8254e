"""A short seeded run of the fault campaign (``tests/campaign``): every cycle's output exact, nothing hangs.

The committed long run is ``benchmarks/results/campaign.json`` (seed 20261123; see docs/guarantees.md).
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.campaign.supervisor import PROBLEM_COUNTS, Campaign, python_roles

# A savepoint taken while the query runs its first cycle (once it committed); a drain: the final cycle drains the
# query and checks its stored state. Each cycle is a driver process (about 25 s), so the other kinds are left to the
# suite's other tests: a query forked from a savepoint (two more drivers: its cycle and its drain) to test_ops_spark
# and test_savepoints, driver kills to test_driver_kill and test_keyed_spark, truncation to test_storage_faults,
# worker kills and a deleted newest record to test_keyed_spark.
KINDS = ["savepoint"]


@pytest.mark.spark
def test_a_short_seeded_campaign_finds_every_batch_and_the_final_state_exact(tmp_path):
    campaign = Campaign(
        tmp_path,
        seed=20261123,
        cycles=len(KINDS),
        cycle_timeout=300,
        cluster_cycles=False,
        max_parallelism=3,
        shapes=("timers",),
        kinds=KINDS,
        savepoints=True,
    )
    summary = campaign.run()
    assert summary["problems"] == []
    assert {k: summary[k] for k in PROBLEM_COUNTS} == dict.fromkeys(PROBLEM_COUNTS, 0)
    assert summary["faults"] == dict.fromkeys(KINDS, 1) and len(campaign.pending) == 1  # the savepoint, unforked
    assert summary["cycles"] == len(KINDS) + 1 and summary["states_checked"] == 1
    assert summary["batches_checked"] >= len(KINDS) and summary["keys_checked"] > 0


def test_kill_worker_and_kill_host_tell_spark_s_python_processes_apart():
    # The JVM (10) runs the daemon (20), which forked workers 21 and 22; 21 forked hosts 31 and 32; the worker
    # of host 33 died, so init (1, outside the session) adopted it.
    parents = {20: 10, 21: 20, 22: 20, 31: 21, 32: 21, 33: 1}
    roles = python_roles(parents, members={10, 20, 21, 22, 31, 32, 33})
    assert roles == {"daemon": [20], "worker": [21, 22], "host": [31, 32, 33]}


def test_a_resumed_run_takes_the_appends_of_an_interrupted_cycle_into_its_record(tmp_path):
    campaign = Campaign(tmp_path, seed=3, cycles=4, cycle_timeout=60, cluster_cycles=False)
    campaign.events.append(50)
    campaign.save()
    campaign.events.append(30)  # the next cycle appended, then the run was stopped before it saved
    resumed = Campaign.resume(tmp_path)
    assert sum(resumed.events.end_offsets().values()) == 80 and resumed.events.appends == 2
    assert resumed.events.verify() == []
    resumed.events.splits[0][0] = resumed.events.splits[0][1]  # the check can fail
    assert resumed.events.verify() != []


def test_a_memory_bound_reaches_every_query_and_the_command_that_reruns_the_run(tmp_path):
    import json

    bounded = Campaign(
        tmp_path / "bounded",
        seed=5,
        cycles=1,
        cycle_timeout=60,
        cluster_cycles=False,
        shapes=("count",),
        memory_bound="1m",
    )
    query = bounded.new_query()
    spec = json.loads(bounded.spec(query, tmp_path / "cycle", 2).read_text())
    assert spec["conf"]["spark.state.residentMemory"] == "1m"
    assert bounded.command().endswith("--memory-bound 1m")
    plain = Campaign(tmp_path / "plain", seed=5, cycles=1, cycle_timeout=60, cluster_cycles=False, shapes=("count",))
    spec = json.loads(plain.spec(plain.new_query(), tmp_path / "cycle2", 2).read_text())
    assert "spark.state.residentMemory" not in spec["conf"] and "--memory-bound" not in plain.command()


def test_batches_whose_offsets_spark_purged_are_not_stray_but_a_late_sink_write_is_wrong(tmp_path):
    campaign = Campaign(tmp_path, seed=5, cycles=1, cycle_timeout=60, cluster_cycles=False, shapes=("count",))
    query = campaign.new_query()
    truth = _count_batches(campaign, query, (5, 6, 0))
    _sink_batch(query, 0, truth[0])
    _sink_batch(query, 1, truth[1])  # batch 2 has no rows: nothing in the sink
    campaign.check_batches(query, "test")
    assert campaign.counts["batches_checked"] == 3 and campaign.problems == []
    (query.checkpoint / "offsets" / "0").unlink()  # Spark keeps the offsets of its last 100 batches only
    campaign.check_batches(query, "test")
    assert campaign.problems == []
    _sink_batch(query, 2, [("late", 1)])  # a sink write for a batch Spark committed as empty
    campaign.check_batches(query, "test")
    assert campaign.counts["wrong"] == 1 and "after Spark committed it" in campaign.problems[0]


def _sink_batch(query, batch_id: int, rows: list[tuple[str, int]], *, again: bool = False) -> None:
    """Append ``rows`` to ``query``'s sink as batch ``batch_id``, the way the replayable sink does (``again``:
    as a broken sink would, past the log's check that the batch is not in it yet)."""
    import pyarrow as pa

    from datasources.log import ReplayableLog
    from datasources.logindex import LogMeta, SinkMark
    from spark_state.storage import LocalStorage

    schema = pa.schema([pa.field("key", pa.string()), pa.field("count", pa.int64())])
    log = ReplayableLog.create(LocalStorage(query.out), LogMeta("out", 1, schema))
    writer = log.segment_writer()
    writer.add(0, pa.record_batch([pa.array([r[0] for r in rows]), pa.array([r[1] for r in rows])], schema=schema))
    if not again:
        log.append(writer.finish(), SinkMark(query.sink_id, batch_id))
        return
    from datasources.logindex import plan_append

    commit = plan_append(log.index(), writer.finish(), sink=SinkMark(query.sink_id, batch_id))
    log.commits.create(commit.commit_id, commit.to_json())


def _count_batches(campaign, query, appends: tuple[int, ...]) -> list[list[tuple[str, int]]]:
    """Append ``appends[i]`` events (none for 0) as Spark's batch ``i`` of the ``count`` query; each batch's
    expected output: the running count of every key the batch holds."""
    truth = []
    for batch_id, appended in enumerate(appends):
        start = campaign.events.end_offsets()
        if appended:
            campaign.events.append(appended)
        _spark_batch(query, campaign, batch_id)
        end = campaign.events.end_offsets()
        counts = Counter(e.key for e in campaign.events.events_between(query.starting, end))
        truth.append(sorted((k, counts[k]) for k in {e.key for e in campaign.events.events_between(start, end)}))
    return truth


def _spark_batch(query, campaign, batch_id: int) -> None:
    """Spark's offsets and commit entries for ``batch_id``, ending at the log's end."""
    import json

    for directory in ("offsets", "commits"):
        (query.checkpoint / directory).mkdir(parents=True, exist_ok=True)
    end = {str(s): o for s, o in campaign.events.end_offsets().items()}
    (query.checkpoint / "offsets" / str(batch_id)).write_text(
        "v1\n" + json.dumps({"batchTimestampMs": 1}) + "\n" + json.dumps(end) + "\n"
    )
    (query.checkpoint / "commits" / str(batch_id)).write_text("v1\n{}\n")


def test_the_checks_find_a_wrong_a_lost_and_a_duplicated_batch(tmp_path):
    campaign = Campaign(tmp_path, seed=4, cycles=1, cycle_timeout=60, cluster_cycles=False, shapes=("count",))
    query = campaign.new_query()
    truth = _count_batches(campaign, query, (5, 6, 7))
    _sink_batch(query, 0, truth[0])  # right
    _sink_batch(query, 1, truth[1][:-1] + [(truth[1][-1][0], truth[1][-1][1] + 1)])  # one count off: wrong
    # batch 2 is never written: lost (its output is not empty)
    campaign.check_batches(query, "test")
    assert (campaign.counts["batches_checked"], campaign.counts["wrong"], campaign.counts["lost"]) == (3, 1, 1)
    _sink_batch(query, 1, truth[1], again=True)
    campaign.check_batches(query, "test")
    assert campaign.counts["duplicated"] == 1  # batch 1 twice under one sink id: found
