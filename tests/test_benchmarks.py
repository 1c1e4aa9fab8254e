"""Smoke tests of the benchmarks: every measuring code path runs on tiny inputs and its checks hold.

The Spark benchmarks run their ``SMOKE`` configuration in the test session
(the same code as quick and full mode, smaller sizes), then plot and render
the benchmarks page's section from what they produced. The last test fails when the
page's results section (``docs/benchmarks.md``) is out of date with ``benchmarks/results``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_checkpoint  # noqa: E402
import bench_commit  # noqa: E402
import bench_keyed  # noqa: E402
import bench_memory  # noqa: E402
import bench_reader  # noqa: E402
import bench_rescale  # noqa: E402
import bench_time  # noqa: E402
import common  # noqa: E402
import report  # noqa: E402
from pyspark import cloudpickle  # noqa: E402

# Run as scripts, benchmark functions are pickled by value (module __main__); here they must be too,
# since the Python workers do not have benchmarks/ on their path.
cloudpickle.register_pickle_by_value(bench_keyed)
cloudpickle.register_pickle_by_value(bench_time)
cloudpickle.register_pickle_by_value(bench_reader)


def _finish(spark, module, result: dict, name: str, out: Path) -> dict:
    """What each benchmark's ``main`` adds around ``run``; then plot and save as ``out/<name>.json``."""
    result = {**common.result_header(spark, name, "smoke", f"./run bench {module.__name__} --smoke"), **result}
    json.dumps(result)  # JSON-serialisable
    module.plot(result, out / f"{name}.png")
    assert (out / f"{name}.png").stat().st_size > 10_000
    (out / f"{name}.json").write_text(json.dumps(result))
    return result


@pytest.fixture(scope="module", autouse=True)
def _as_the_benchmarks_session(spark):
    """The benchmarks' session runs without the clock (``common.session``: they count batches as files)."""
    spark.conf.set("spark.state.clock", "false")
    yield
    spark.conf.set("spark.state.clock", "false")  # the test session's too (an unset would leave the default, on)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def rescale(spark, results, tmp_path_factory):
    bench_rescale.WORK = tmp_path_factory.mktemp("rescale-work")
    raw = bench_rescale.run(spark, bench_rescale.SMOKE)
    raw["headline"] = bench_rescale.headline(raw)
    raw["targets"] = bench_rescale.restart_targets(raw) + bench_rescale.live_targets(raw)
    return _finish(spark, bench_rescale, raw, "rescale", results)


@pytest.fixture(scope="module")
def rescale_s3(spark, results, tmp_path_factory, s3_server):
    bench_rescale.WORK = tmp_path_factory.mktemp("rescale-s3-work")
    raw = bench_rescale.run(spark, bench_rescale.S3_SMOKE, bench_rescale.Stores(s3_server))
    raw["headline"] = bench_rescale.headline(raw)
    raw["s3_server"] = "SeaweedFS " + s3_server.version()
    raw["targets"] = bench_rescale.s3_targets(raw)
    return _finish(spark, bench_rescale, raw, "rescale_s3", results)


@pytest.fixture(scope="module")
def commit(spark, results, tmp_path_factory, s3_server):
    bench_commit.WORK = tmp_path_factory.mktemp("commit-work")
    raw = bench_commit.run(spark, bench_commit.SMOKE, bench_rescale.Stores(s3_server))
    return _finish(spark, bench_commit, raw, "commit", results)


@pytest.fixture(scope="module")
def keyed(spark, results, tmp_path_factory):
    bench_keyed.WORK = tmp_path_factory.mktemp("keyed-work")
    return _finish(spark, bench_keyed, bench_keyed.run(spark, bench_keyed.SMOKE), "keyed", results)


@pytest.fixture(scope="module")
def memory(spark, results, tmp_path_factory):
    bench_memory.WORK = tmp_path_factory.mktemp("memory-work")
    return _finish(spark, bench_memory, bench_memory.run(spark, bench_memory.SMOKE), "memory", results)


@pytest.fixture(scope="module")
def checkpoint(spark, results, tmp_path_factory):
    bench_checkpoint.WORK = tmp_path_factory.mktemp("checkpoint-work")
    return _finish(spark, bench_checkpoint, bench_checkpoint.run(spark, bench_checkpoint.SMOKE), "checkpoint", results)


@pytest.fixture(scope="module")
def time_result(spark, results, tmp_path_factory):
    bench_time.WORK = tmp_path_factory.mktemp("time-work")
    return _finish(spark, bench_time, bench_time.run(spark, bench_time.SMOKE), "time", results)


@pytest.mark.spark
def test_time_smoke(time_result):
    sessions = time_result["sessions"]
    assert sessions["same_sessions"] and sessions["sessions_compared"] > 20
    assert sessions["systems"]["ours"]["late_rows"] == 0
    ttl = time_result["ttl"]["runs"]
    assert ttl["without_ttl"]["keys"][-1] == 8 * 100 and max(ttl["with_ttl"]["keys"]) <= 4 * 100
    fired = time_result["timers"]["runs"]["timers"]["timers_fired"]
    assert fired[0] == 0 and all(n == 20 for n in fired[2:]), fired  # 1% of 2,000 keys per steady batch
    assert sum(time_result["timers"]["runs"]["no_timers"]["timers_fired"]) == 0
    checkpoint = time_result["timer_checkpoint"]["runs"]
    assert list(checkpoint) == ["1000", "20000"]
    assert all(len(run[label]["checkpoint_seconds"]) == 3 for run in checkpoint.values() for label in run)
    idle = time_result["idle"]
    for run in idle["ticks"].values():  # an idle source: a batch per due timer, none without one
        assert run["alerts"] >= 2 and run["batches_without_a_timer"] == 0, run
        assert all(a["wait_s"] >= 0 for a in run["per_alert"])  # never early
    assert idle["nothing_due"]["extra_batches"] == 0 and idle["nothing_due_without_clock"]["extra_batches"] == 0
    busy = idle["busy_query"]
    assert busy["batches_measured"] == {"with": 2, "without": 2} and busy["with_vs_without"] > 0


@pytest.fixture(scope="module")
def reader(spark, results, tmp_path_factory):
    bench_reader.WORK = tmp_path_factory.mktemp("reader-work")
    return _finish(spark, bench_reader, bench_reader.run(spark, bench_reader.SMOKE), "reader", results)


@pytest.mark.spark
def test_reader_smoke(reader):
    assert reader["store"]["keys"] == 20_000 and reader["partitions"] >= 1
    assert all(rate > 0 for rate in reader["rows_per_s"].values())
    assert reader["cli"]["verify_bytes"] == reader["store"]["store_bytes"]  # verify read every blob byte
    assert [t["target"] for t in reader["targets"]][0].startswith("state reader rows/s")


@pytest.mark.spark
def test_rescale_smoke(rescale):
    (size,) = rescale["sizes"]
    (row,) = size["summary"]
    assert row["pair"] == "2->3"
    # ours reads exactly the owned key groups; hash mod p must read all old state: ~3x for 2 -> 3
    assert row["read_amplification"]["keyed_count"] == pytest.approx(1.0, abs=0.01)
    assert row["read_amplification"]["naive_hash_mod"] > 2.5
    runs = {r["system"]: r for r in size["runs"]}
    assert runs["spark_repartition"]["state_partitions"] == 3
    assert runs["spark_pinned"]["state_partitions"] == 2
    assert "repartition_seconds" in runs["spark_repartition"] and "repartition_seconds" not in runs["spark_pinned"]
    assert [i["instance"] for i in runs["keyed_count"]["instances"]] == [0, 1, 2]
    # each restart's CPU, per kind of process: three new hosts fork and fault pages in; the JVM runs the query
    python = row["python_cpu"]["keyed_count"]
    assert python["user_seconds"] + python["system_seconds"] > 0 and python["page_faults"] > 100
    hosts = runs["keyed_count"]["hosts"]  # the three new instances' hosts, each adopted or forked
    assert hosts["adopted"] + hosts["forked"] == 3 and row["hosts"] == hosts
    assert all(r["cpu"]["jvm"]["user_seconds"] > 0 for r in runs.values())
    # a running query changed 2 -> 3 between batches: one change measured, the state read back exact
    (live,) = rescale["live"]
    assert [b["parallelism"] for b in live["batches"]] == [2, 2, 2, 2, 3, 3, 3]
    (change,) = live["changes"]
    assert change["pair"] == "2->3" and change["bytes_read"] > 0 and live["final_state_exact"] is True
    assert [t["kind"] for t in rescale["targets"]] == ["restart", "restart", "live"]


def test_restart_targets_take_the_median_over_pairs_of_ours_over_theirs_at_every_size():
    def size(keys, seconds):  # (ours, spark_pinned, naive) per pair
        return {
            "keys": keys,
            "summary": [
                {"restart_seconds": dict(zip(("keyed_count", "spark_pinned", "naive_hash_mod"), s))} for s in seconds
            ],
        }

    result = {
        "sizes": [size(1_000, [(1.0, 1.0, 2.0), (3.0, 2.0, 2.0), (1.3, 1.0, 1.0)]), size(9_000, [(2.0, 1.0, 4.0)])]
    }
    targets = bench_rescale.restart_targets(result)
    assert [(t["value"], t["met"]) for t in targets] == [(1.3, False), (1.3, False), (2.0, False), (0.5, True)]
    assert targets[0]["target"].startswith("restart at 1,000 keys: ours / Spark's restart without rescaling")
    assert (
        bench_rescale.headline(
            {
                "sizes": [
                    {
                        **result["sizes"][1],
                        "summary": [
                            {
                                **result["sizes"][1]["summary"][0],
                                "ours_vs_spark_pinned": 0.5,
                                "ours_vs_naive": 2.0,
                                "read_amplification": {"keyed_count": 1.0, "naive_hash_mod": 3.0},
                            }
                        ],
                    }
                ]
            }
        )["9000"]["ours_over_spark_pinned"]
        == 2.0
    )


@pytest.mark.spark
def test_keyed_smoke(keyed):
    rates = keyed["throughput"]["by_parallelism"]["2"]["rows_per_s"]
    assert set(rates) == {
        "keyed_count",
        "keyed_count_public",
        "groupby_count_rocksdb",
        "groupby_count_hdfs",
        "apply_in_pandas_with_state",
        "transform_with_state_in_pandas",
    }
    assert all(r > 0 for r in rates.values())
    sizes = keyed["state_size"]["versus_smallest"]
    assert sizes["1000"]["batch_time_ratio"] == 1.0 and set(sizes) == {"1000", "10000"}
    # the same change costs about the same bytes whatever the state size
    assert sizes["10000"]["checkpoint_bytes_ratio"] < 1.5
    # the instance hosts hold the state after the run: their RSS is measured, and grows with the state
    memory = keyed["state_size"]["memory"]
    assert memory["1000"]["resident_bytes_per_key"] is None and memory["10000"]["rss_bytes"] > 0
    assert keyed["rocksdb_memory"]["num_rows_total"] == 10_000 and keyed["rocksdb_memory"]["sst_bytes_per_key"] > 0
    targets = {t["target"] for t in keyed["targets"]}
    assert {"throughput_vs_groupby_hdfs", "steady_batches_reloading_state", "steady_batch_max_over_median"} <= targets
    # the public path beside the accelerator, and the Connect column: the same systems' rates over Connect, a
    # restart at 10k keys rescaled, at the same parallelism, and Spark's
    assert {"public_path_vs_groupby_hdfs", "connect_vs_groupby_hdfs", "connect_rescaled_restart_vs_spark_restart"} <= (
        targets
    )
    over = keyed["connect"]
    assert all(r > 0 for r in over["throughput"]["by_parallelism"]["2"]["rows_per_s"].values())
    restarts = over["restart"]["runs"]
    assert restarts["keyed_count_rescaled"]["restart"]["parallelism"] == 4
    assert all(run["restart"]["batches"][-1]["rows"] == 2_000 for run in restarts.values())
    # each batch records what the machine and the JVM took while it ran (a number, 0 when nothing: small runs often
    # collect no garbage in a batch); the slowest steady batch is named with them
    for run in keyed["state_size"]["runs"].values():
        for counter in common.INTERFERENCE:
            taken = [b[counter] for b in run["batches"]]
            assert all(isinstance(s, float) and s >= 0 for s in taken), (counter, taken)
        steady = [run["batches"][i] for i in keyed["state_size"]["steady_batch_ids"]]
        slowest = run["steady"]["slowest_batch"]
        assert slowest["seconds"] == max(b["seconds"] for b in steady)
        assert slowest["jvm_gc_seconds"] == run["batches"][slowest["batch_id"]]["jvm_gc_seconds"]


@pytest.mark.spark
def test_memory_smoke(memory):
    runs = memory["runs"]
    assert set(runs) == {"unbounded", "bound_1m", "bound_512k", "baseline"}
    for label in ("bound_1m", "bound_512k"):
        run = runs[label]
        assert run["final_state_equals_unbounded"] is True and run["batches_over_share"] == []
        assert run["state_kept_between_batches_bytes"]["max"] <= run["limit_bytes"]
    # the bounded runs keep less than the unbounded one, whose state exceeds the smaller bound
    assert runs["unbounded"]["state_kept_between_batches_bytes"]["max"] > runs["bound_512k"]["limit_bytes"]
    assert all(len(r["rss_high_water_by_host"]) == 2 for r in runs.values())
    assert all(t["met"] for t in memory["targets"]) and len(memory["targets"]) == 4


@pytest.mark.spark
def test_checkpoint_smoke(checkpoint):
    runs = checkpoint["runs"]
    # maxChainLength 2: a chain never grows past 2 entries; without compaction they grow with the batches
    assert runs["compaction"]["restore"]["longest_chain"] == 2
    assert runs["no_compaction"]["restore"]["longest_chain"] > 2
    assert all(runs[label]["restore"]["keys_restored"] == 20_000 for label in runs)

    def compacting_entries(label):  # after the prefill, full and merge entries are written only to compact
        return sum(c["full_entries"] + c.get("merge_entries", 0) for c in runs[label]["checkpoints"])

    assert compacting_entries("compaction") > compacting_entries("no_compaction")
    assert checkpoint["targets"][0]["met"]


def test_restore_benchmark_runs(tmp_path):
    out = tmp_path / "restore.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_restore.py"),
            "--keys",
            "20000",
            "--verify",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    assert data["all_within_target"] and all(p["state_equal"] for p in data["pairs"])
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_manifest_benchmark_runs(tmp_path):
    out = tmp_path / "manifest.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_manifest.py"), "--smoke", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    (size,) = data["sizes"]
    delta, full = size["delta_records"], size["full_records"]
    assert delta["record_bytes"]["median"] * 4 < full["record_bytes"]["median"]  # 1% changed: a small record
    assert len(delta["checkpoints"]) == len(full["checkpoints"]) == 4
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.spark
def test_report_renders_smoke_results(
    results, rescale, keyed, checkpoint, rescale_s3, commit, reader, time_result, memory
):
    """The results section renders from the smoke runs' files (plus the committed others)."""
    for name in ("keygroups.json", "source.json", "restore.json", "manifest.json", "campaign.json"):
        shutil.copy(report.RESULTS / name, results / name)
    text = report.render(results)
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert "| 4,000 | 2->3 |" in text
    assert "## Rescale with the state on S3" in text and "## Checkpoint cost on S3 vs local disk" in text
    assert "## Where we are behind" in text
    assert "## Reading state out" in text and "20,000 keys" in text
    assert "## Time: sessions, time to live, timers" in text
    assert "## Fault campaign" in text
    assert "## Memory bound" in text and "| bound_1m | 1 MiB |" in text


def _campaign(**changes) -> dict:
    summary = {
        "command": "./run campaign --cycles 200 --seed 1",
        "seed": 1,
        "scheduled_cycles": 200,
        "cycles": 206,
        "resumes": 0,
        "queries": 6,
        "fault_kinds": ["kill_random", "stall"],
        "faults": {"kill_random": 9, "stall": 5},
        "batches_checked": 900,
        "keys_checked": 12_000,
        "states_checked": 6,
        "wrong": 0,
        "lost": 0,
        "duplicated": 0,
        "hangs": 0,
        "untyped_faults": 0,
        "unexplained_failures": 0,
        "corrupt_commits": 0,
        "log_problems": 0,
        "longest_recovery_s": 40.1,
        "events": 90_000,
        "elapsed_s": 7200,
        "problems": [],
        "complete": True,
    }
    return {**summary, **changes}


def test_the_campaign_section_meets_its_targets_only_when_every_kind_reached_five_and_nothing_went_wrong():
    def targets(data):
        line = next(line for line in report.campaign_section(data, "campaign.json") if line.startswith("Targets"))
        return line.count("(met)"), line.count("(missed)")

    assert targets(_campaign()) == (3, 0)
    assert targets(_campaign(faults={"kill_random": 9})) == (2, 1)  # a kind never injected counts as 0
    assert targets(_campaign(wrong=1, problems=["q01 batch 3: 1 row missing"])) == (2, 1)
    assert targets(_campaign(scheduled_cycles=120)) == (2, 1)
    assert targets(_campaign(complete=False, cycles=60)) == (2, 1)
    assert "NOT complete" in report.campaign_section(_campaign(complete=False), "campaign.json")[2]


@pytest.mark.spark
def test_rescale_s3_smoke(rescale_s3):
    (size,) = rescale_s3["sizes"]
    (row,) = size["summary"]
    assert set(row["restart_seconds"]) == {"keyed_count", "naive_hash_mod"}
    # counted by the S3 backend: ours reads exactly the owned key groups, hash mod p all old state (~3x for 2 -> 3)
    assert row["read_amplification"]["keyed_count"] == pytest.approx(1.0, abs=0.01)
    assert row["read_amplification"]["naive_hash_mod"] > 2.5
    runs = {r["system"]: r for r in size["runs"]}
    assert {i["counted_by"] for r in runs.values() for i in r["instances"]} == {"storage backend"}
    assert [t["met"] for t in rescale_s3["targets"]][:1] == [True]


@pytest.mark.spark
def test_commit_smoke(commit):
    local, s3 = commit["runs"]["local"], commit["runs"]["s3"]
    assert len(local["batches"]) == len(s3["batches"]) == bench_commit.SMOKE.batches
    assert all(b["commit_requests"] is None for b in local["batches"])  # local disk does not count requests
    # on S3 a blob write is a structure check and one conditional PUT; a commit lists, then creates its record
    assert all(b["blob_write_requests"] >= 1 and b["commit_requests"] >= 2 for b in s3["batches"])
    assert s3["stats"]["checkpoint_seconds"]["p95"] >= s3["stats"]["checkpoint_seconds"]["median"] > 0


def test_rescale_with_long_keys_renders_its_restarts_live_rescales_and_missed_targets():
    data, file = report.load("rescale_long")
    (line, _) = report.rescale_long_lines(data, file)
    assert line.startswith(f"With long keys (`benchmarks/results/{file}`") and "final state exact" in line
    size = data["sizes"][0]["keys"]
    broken = {
        **data,
        "live": [{**data["live"][0], "final_state_exact": False}],
        "targets": [{**t, "met": False} for t in data["targets"]],
    }
    (line, _) = report.rescale_long_lines(broken, file)
    assert "final state **not** exact" in line and "(met)" not in line
    keyed, rescale = report.load("keyed")[0], report.load("rescale")[0]
    behind = report.behind_section(
        rescale, keyed, *(report.load(n)[0] for n in ("checkpoint", "source")), rescale_long=broken
    )
    assert sum(f"Rescale with long keys, target missed: restart at {size:,} keys" in b for b in behind) == 2


def test_the_benchmarks_page_results_match_the_results_files():
    assert report.main(["--check"]) == 0, (
        "docs/benchmarks.md is out of date with benchmarks/results: ./run bench report"
    )


def test_report_refuses_missing_results(tmp_path):
    with pytest.raises(report.MissingResults, match="run ./run bench bench_rescale"):
        report.render(tmp_path)


def test_an_s3_campaign_renders_as_one_paragraph_naming_its_queries_on_s3():
    lines = report.campaign_s3_lines(
        _campaign(command="./run campaign --cycles 30 --seed 5 --s3", queries_on_s3=3), "campaign_s3.json"
    )
    assert "3 of 6 queries with their state store on SeaweedFS" in lines[0] and "nothing wrong" in lines[0]
    assert "`kill_random` 9" in lines[0]
    lines = report.campaign_s3_lines(_campaign(queries_on_s3=3, lost=2, problems=["x"]), "campaign_s3.json")
    assert "2 wrong, lost" in lines[0]


def test_a_savepoints_campaign_renders_as_one_paragraph_naming_its_savepoints_and_forks():
    data = _campaign(
        command="./run campaign --cycles 40 --seed 5 --savepoints",
        queries_forked=2,
        faults={"savepoint": 3, "fork": 2, "stall": 0},
    )
    (line, _) = report.campaign_savepoints_lines(data, "campaign_savepoints.json")
    assert "3 savepoints taken while their queries ran and 2 of 6 queries forked from them;" in line
    assert "`fork` 2" in line and "`stall`" not in line and "SeaweedFS" not in line and "nothing wrong" in line
    (line, _) = report.campaign_savepoints_lines({**data, "queries_on_s3": 3, "hangs": 1}, "campaign_savepoints.json")
    assert "3 queries with their state store on SeaweedFS" in line and "1 wrong, lost" in line


def test_the_report_counts_what_the_campaign_counts_as_wrong():
    from tests.campaign.supervisor import PROBLEM_COUNTS

    assert report.CAMPAIGN_PROBLEM_COUNTS == PROBLEM_COUNTS


def test_the_python_cpu_of_restarts_is_summarised_as_medians_over_pairs_and_absent_from_older_results():
    def cpu(user, system, faults):
        return {"user_seconds": user, "system_seconds": system, "page_faults": faults}

    rows = [
        {"python_cpu": {"keyed_count": cpu(0.3, 0.1, 30_000), "naive_hash_mod": cpu(0.2, 0.0, 5_000)}},
        {"python_cpu": {"keyed_count": cpu(0.2, 0.2, 20_000), "naive_hash_mod": cpu(0.1, 0.1, 3_000)}},
        {"python_cpu": {"keyed_count": cpu(0.4, 0.4, 40_000), "naive_hash_mod": cpu(0.2, 0.2, 4_000)}},
    ]
    summary = report._python_cpu({"summary": rows})
    assert summary["keyed_count"] == (pytest.approx(0.4), pytest.approx(0.5), 30_000)
    assert summary["naive_hash_mod"] == (pytest.approx(0.2), pytest.approx(0.5), 4_000)
    assert report._python_cpu({"summary": [{"pair": "2->3"}]}) is None


def test_a_slow_steady_batch_is_reported_with_what_the_machine_and_the_jvm_took_while_it_ran():
    steady = {
        "max_over_median": 1.62,
        "batches_with_full_entries": [3],
        "slowest_batch": {
            "batch_id": 8,
            "seconds": 0.83,
            "cpu_steal_seconds": 0.41,
            "median_cpu_steal_seconds": 0.05,
            "jvm_gc_seconds": 0.3,
            "median_jvm_gc_seconds": 0.02,
            "io_stall_seconds": 0.2,
            "median_io_stall_seconds": 0.01,
        },
    }
    line = report._spread_line(10_000_000, steady, 10)
    assert line.startswith("- With 10,000,000 keys of state, the slowest steady batch took 1.62x the median")
    assert "1 of 10 steady batches wrote key groups in full" in line
    assert (
        "; while the slowest ran, the hypervisor took 0.41 s (median 0.05 s), tasks waited for I/O for "
        "0.20 s (median 0.01 s) and the JVM collected garbage for 0.30 s (median 0.02 s))." in line
    )
    steady["slowest_batch"]["cpu_steal_seconds"] = None  # a machine that does not count steal
    assert "; while the slowest ran, tasks waited for I/O for 0.20 s" in report._spread_line(10_000_000, steady, 10)
    del steady["slowest_batch"]  # results from before they were recorded
    assert "hypervisor" not in report._spread_line(10_000_000, steady, 10)
