"""Write the benchmarks page's results section (``docs/benchmarks.md``) from ``benchmarks/results/*.json``: no number in it is typed by hand.

Run: ``./run bench report`` rewrites the part of docs/benchmarks.md between
``<!-- results:begin -->`` and ``<!-- results:end -->``; ``./run bench report
--check`` exits 1 if the page is out of date with the results (the test
suite runs it). For each benchmark the full-mode results are used when they
exist, the quick ones otherwise; every table names the file and the command
it comes from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
"""The page whose results section this writes (the documentation, built by ``mkdocs``)."""
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


class MissingResults(Exception):
    pass


def load(name: str, results: Path = RESULTS, command: str | None = None) -> tuple[dict, str]:
    """The full-mode results of benchmark ``name`` if present, else the quick ones, and the file name."""
    for file in (f"{name}_full.json", f"{name}.json"):
        path = results / file
        if path.exists():
            return json.loads(path.read_text()), file
    raise MissingResults(
        f"no {name}.json or {name}_full.json in {results}: run {command or f'./run bench bench_{name}'} first"
    )


def _optional(name: str, results: Path) -> tuple[dict, str] | None:
    """``load(name)`` when the benchmark was run (its full or quick results exist), else None."""
    if any((results / f).exists() for f in (f"{name}.json", f"{name}_full.json")):
        return load(name, results)
    return None


def _optional_file(file: str, results: Path) -> tuple[dict, str] | None:
    """The results in ``file`` (one mode's), or None."""
    path = results / file
    return (json.loads(path.read_text()), file) if path.exists() else None


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _x(r: float) -> str:
    return f"{r:.2f}x"


def _x_exact(r: float) -> str:
    """``_x``, with a third decimal when two would round a ratio other than 1 to 1.00x."""
    return f"{r:.3f}x" if r != 1 and f"{r:.2f}" == "1.00" else _x(r)


def _targets(targets: list[dict]) -> str:
    """The line listing a benchmark's targets, each met or missed."""
    return (
        "Targets: "
        + "; ".join(f"{t['target']}: {t['value']} ({'met' if t['met'] else 'missed'})" for t in targets)
        + "."
    )


def _targets_and_figure(data: dict, file: str, alt: str) -> list[str]:
    """A section's last lines: its targets, then its benchmark's figure (the PNG beside ``file``)."""
    return [_targets(data["targets"]), "", f"![{alt}](../benchmarks/results/{file.replace('.json', '.png')})", ""]


def _slower_than_naive(size: dict) -> tuple[list[dict], float, float, float] | None:
    """Pairs where the naive store restarted faster, ours' worst ratio, max restore and min first-batch seconds."""
    slower = [r for r in size["summary"] if r["ours_vs_naive"] < 1]
    if not slower:
        return None
    ours = [r for r in size["runs"] if r["system"] == "keyed_count"]
    return (
        slower,
        min(r["ours_vs_naive"] for r in slower),
        max(r["max_restore_seconds"] for r in ours),
        min(r["first_batch_seconds"] for r in ours),
    )


def _python_cpu(size: dict) -> dict[str, tuple[float, float, float]] | None:
    """Per stored system: medians over pairs of the Python processes' CPU seconds per restart, the kernel's share
    of them and their page faults (``bench_rescale``'s ``python_cpu``); None for results without them."""
    rows = [r.get("python_cpu") for r in size["summary"]]
    if not rows or not all(row and all(row.values()) for row in rows):
        return None
    out = {}
    for system in rows[0]:
        used = [row[system] for row in rows]
        seconds = [u["user_seconds"] + u["system_seconds"] for u in used]
        out[system] = (
            statistics.median(seconds),
            statistics.median(u["system_seconds"] / total for u, total in zip(used, seconds) if total),
            statistics.median(u["page_faults"] for u in used),
        )
    return out


def _hosts(rows: list[dict]) -> tuple[int, int] | None:
    """Over ``bench_rescale`` summary rows: our new instances that adopted a host and that forked one; None for
    results without the counts."""
    counts = [r["hosts"] for r in rows if r.get("hosts")]
    if not counts:
        return None
    return sum(c["adopted"] for c in counts), sum(c["forked"] for c in counts)


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f} for every pair" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"


def _source_line(data: dict, file: str) -> str:
    load = data["environment"]["load_average_1m"]
    return f"From `benchmarks/results/{file}` (`{data['command']}`, load average {load:.1f} at start)."


def rescale_section(data: dict, file: str) -> list[str]:
    out = [
        "## Rescale: stop, change parallelism, first batch done",
        "",
        _source_line(data, file),
        "",
        "Seconds from the stopped query to the end of the first batch at the new parallelism (the "
        "restore included); Spark's offline repartition is part of its time. `spark_pinned` restarts "
        "Spark without changing parallelism: the floor. Amplification = bytes an instance read / bytes "
        "of the state it owns (max over new instances); requests per instance (max)."
        + (
            f" Each time is the median of {data['repeats']} restarts"
            + (f" ({', '.join(data['measured_once'])}: one)" if data.get("measured_once") else "")
            + "."
            if data.get("repeats", 1) > 1
            else ""
        ),
        "",
        "| keys | pair | ours s | naive hash-mod s | Spark repartition + restart s (repartition alone) "
        "| Spark pinned s | Spark repartition / ours | read amp. ours / naive | MB read per instance "
        "ours / naive | requests ours / naive |",
        "| ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in data["sizes"]:
        for r in size["summary"]:
            t = r["restart_seconds"]
            amp, mb, req = r["read_amplification"], r["max_bytes_read_per_instance"], r["max_requests_per_instance"]
            out.append(
                f"| {size['keys']:,} | {r['pair']} | {t['keyed_count']:.2f} | {t['naive_hash_mod']:.2f} "
                f"| {t['spark_repartition']:.2f} ({r['spark_repartition_seconds']:.2f}) | {t['spark_pinned']:.2f} "
                f"| {_x(r['ours_vs_spark_repartition'])} | {amp['keyed_count']:.2f} / {amp['naive_hash_mod']:.2f} "
                f"| {mb['keyed_count'] / 1e6:.2f} / {mb['naive_hash_mod'] / 1e6:.2f} "
                f"| {req['keyed_count']} / {req['naive_hash_mod']} |"
            )
    head = data["headline"]
    out += [
        "",
        "Medians over the pairs: Spark's repartition + restart takes "
        + ", ".join(f"{_x(h['ours_vs_spark_repartition'])} our time at {int(k):,} keys" for k, h in head.items())
        + "; our rescaling restart takes "
        + ", ".join(f"{_x(h['ours_over_spark_pinned'])}" for h in head.values())
        + " the time of Spark's restart without rescaling (median over pairs of the per-pair ratio), and the "
        "naive store's takes " + ", ".join(f"{_x(h['ours_vs_naive'])}" for h in head.values()) + " ours (same sizes).",
    ]
    hosts = _hosts([r for size in data["sizes"] for r in size["summary"]])
    if hosts is not None:
        out += [
            "",
            f"Our new instances, over all pairs and sizes (the median repeats): {hosts[0]} took an idle "
            f"instance host that an earlier run left (`hosts.adoption.adopt`), {hosts[1]} forked a new one.",
        ]
    restart = [t for t in data.get("targets", []) if t.get("kind") == "restart"]
    if restart:
        out += ["", _targets(restart)]
    out += ["", f"![rescale](../benchmarks/results/{file.replace('.json', '.png')})", ""]
    if data.get("live"):
        out += live_rescale_lines(data)
    return out


def rescale_long_lines(data: dict, file: str) -> list[str]:
    """``bench_rescale --keys long``: the same restarts and live rescales with long keys, one paragraph."""
    head = data["headline"]
    load = data["environment"]["load_average_1m"]
    per_size = "; ".join(
        f"at {int(k):,} keys Spark's repartition + restart takes {_x(h['ours_vs_spark_repartition'])} our time, our "
        f"rescaling restart {_x(h['ours_over_spark_pinned'])} the time of Spark's restart without rescaling, and the "
        f"naive store's {_x(h['ours_vs_naive'])} ours (read amplification ours {h['max_read_amplification_ours']:.2f}, "
        f"naive {h['max_read_amplification_naive']:.2f})"
        for k, h in head.items()
    )
    live = ", ".join(
        f"{_x(live['median_ratio'])} at {live['keys']:,} keys"
        + (", final state exact" if live["final_state_exact"] else ", final state **not** exact")
        for live in data.get("live", [])
    )
    return [
        f"With long keys (`benchmarks/results/{file}`, `{data['command']}`, load average {load:.1f} at start): "
        f"{per_size}. Live rescale, the first batch at the new parallelism / the steady batches after it "
        f"(median over changes): {live}. " + _targets(data.get("targets", [])),
        "",
    ]


def live_rescale_lines(data: dict) -> list[str]:
    """The live rescales: a running query's first batch at each new parallelism against its steady batches."""
    first = data["live"][0]
    out = [
        "## Live rescale: the parallelism of a running query changed between batches",
        "",
        f"One running count per size, batches of {first['rows_per_batch']:,} rows over all keys, parallelism "
        f"walking {' → '.join(map(str, first['chain']))} ({len(first['batches']) - 1} batches after the "
        "prefill). Ratio: the first batch at the new parallelism / the median of the steady batches after "
        "it at that parallelism.",
        "",
        "| keys | " + " | ".join(c["pair"] for c in first["changes"]) + " | median | final state exact |",
        "| ---: | " + " | ".join("---:" for _ in first["changes"]) + " | ---: | --- |",
    ]
    for live in data["live"]:
        out.append(
            f"| {live['keys']:,} | "
            + " | ".join(f"{c['ratio']:.2f}x ({c['rescale_batch_seconds']:.2f} s)" for c in live["changes"])
            + f" | {_x(live['median_ratio'])} | {'yes' if live['final_state_exact'] else '**no**'} |"
        )
    out += ["", _targets([t for t in data["targets"] if t.get("kind") != "restart"]), ""]
    return out


def rescale_s3_section(data: dict, file: str) -> list[str]:
    out = [
        "## Rescale with the state on S3",
        "",
        _source_line(data, file),
        "",
        f"The same restarts as above with both stores' state in a bucket of {data['s3_server']} (Spark's "
        "checkpoints on local disk; Spark's own state store cannot use S3 here). Bytes and requests are what "
        "the S3 backend counted for each new instance's restore; seconds are the median of "
        f"{data['repeats']} restarts.",
        "",
        "| keys | pair | ours s | naive hash-mod s | naive / ours time | read amp. ours / naive "
        "| MB read, all new instances, ours / naive | naive / ours bytes | max MB per instance ours / naive "
        "| max requests per instance ours / naive |",
        "| ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in data["sizes"]:
        for r in size["summary"]:
            t, amp = r["restart_seconds"], r["read_amplification"]
            total, per, req = r["total_bytes_read"], r["max_bytes_read_per_instance"], r["max_requests_per_instance"]
            out.append(
                f"| {size['keys']:,} | {r['pair']} | {t['keyed_count']:.2f} | {t['naive_hash_mod']:.2f} "
                f"| {_x(r['ours_vs_naive'])} | {amp['keyed_count']:.2f} / {amp['naive_hash_mod']:.2f} "
                f"| {total['keyed_count'] / 1e6:.2f} / {total['naive_hash_mod'] / 1e6:.2f} "
                f"| {_x(r['naive_vs_ours_total_bytes_read'])} "
                f"| {per['keyed_count'] / 1e6:.2f} / {per['naive_hash_mod'] / 1e6:.2f} "
                f"| {req['keyed_count']} / {req['naive_hash_mod']} |"
            )
    out += [
        "",
        *_targets_and_figure(data, file, "rescale on S3"),
    ]
    return out


def commit_section(data: dict, file: str) -> list[str]:
    names = {
        "blob_write_seconds": "blob write (slowest instance)",
        "commit_seconds": "driver commit (record)",
        "checkpoint_seconds": "blob write + commit",
        "cleanup_seconds": "cleanup (driver)",
        "batch_seconds": "whole batch",
    }
    local, s3 = data["runs"]["local"], data["runs"]["s3"]
    out = [
        "## Checkpoint cost on S3 vs local disk",
        "",
        _source_line(data, file),
        "",
        f"The same keyed count ({data['state_keys']:,} keys of state, {data['batches']} batches of "
        f"{data['rows_per_batch']:,} rows, parallelism {data['parallelism']}) with its state on local disk and "
        "in a bucket of SeaweedFS on loopback, side by side; milliseconds per batch.",
        "",
        "| step | local median | local p95 | S3 median | S3 p95 | S3 / local (medians) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for metric, name in names.items():
        a, b = local["stats"][metric], s3["stats"][metric]
        ratio = data["s3_vs_local_median"][metric]
        out.append(
            f"| {name} | {a['median'] * 1000:.1f} | {a['p95'] * 1000:.1f} | {b['median'] * 1000:.1f} "
            f"| {b['p95'] * 1000:.1f} | {_x(ratio) if ratio is not None else '—'} |"
        )
    requests = s3["median_requests"]
    out += [
        "",
        f"Requests per batch on S3 (medians): {requests['blob_write_requests']:g} per instance's blob write, "
        f"{requests['commit_requests']:g} for the driver's commit, {requests['cleanup_requests']:g} for cleanup. "
        "Loopback answers in a few milliseconds; against a real region, budget each request's latency "
        "(tens of milliseconds) times these counts per checkpoint.",
        "",
        f"![commit](../benchmarks/results/{file.replace('.json', '.png')})",
        "",
    ]
    return out


def skewed_keys_lines(data: dict, file: str) -> list[str]:
    """``bench_keyed --distribution zipf``: the throughput ratios over Zipf-skewed keys, one paragraph."""
    t = data["throughput"]
    ratios = "; ".join(
        f"at parallelism {p}: "
        + ", ".join(f"{_x_exact(v['ratio'])} {system}" for system, v in n["keyed_count_vs"].items())
        for p, n in t["by_parallelism"].items()
    )
    load = data["environment"]["load_average_1m"]
    return [
        f"With Zipf-skewed keys, as words in text (`benchmarks/results/{file}`, `{data['command']}`, load average "
        f"{load:.1f} at start; {t['distinct_keys']:,} keys, {t['rows_per_batch']:,} rows per batch): ours / "
        f"theirs {ratios}.",
        "",
    ]


def long_keys_lines(data: dict, file: str) -> list[str]:
    """``bench_keyed --keys long``: the same throughput and state-size ratios with long keys, one paragraph."""
    t, s = data["throughput"], data["state_size"]
    ratios = "; ".join(
        f"at parallelism {p}: "
        + ", ".join(f"{_x_exact(v['ratio'])} {system}" for system, v in n["keyed_count_vs"].items())
        for p, n in t["by_parallelism"].items()
    )
    largest = max(s["versus_smallest"], key=int)
    load = data["environment"]["load_average_1m"]
    return [
        f"With long keys (`benchmarks/results/{file}`, `{data['command']}`, load average {load:.1f} at start): "
        f"ours / theirs {ratios}. A steady batch over "
        f"{int(largest):,} keys of state takes {_x(s['versus_smallest'][largest]['batch_time_ratio'])} the time "
        f"of one over {min(map(int, s['versus_smallest'])):,}"
        + (
            f"; the instance hosts hold {memory[largest]['resident_bytes_per_key']:,.0f} B per key of state and "
            f"store {memory[largest]['stored_bytes_per_key']:,.1f} (Spark's RocksDB store: "
            f"{rocks['memory_bytes_per_key']:,.1f} B per key in memory, {rocks['sst_bytes_per_key']:,.1f} in SST "
            "files)"
            if (memory := s.get("memory"))
            and (rocks := data.get("rocksdb_memory"))
            and memory[largest]["resident_bytes_per_key"]
            else ""
        )
        + ".",
        "",
    ]


def _rates_table(by_parallelism: dict, systems: list[str]) -> list[str]:
    """Rows/s per system and ours' ratio on each other system, one row per parallelism (``bench_keyed``)."""
    rows = [
        "| parallelism | "
        + " | ".join(f"{s} rows/s" for s in systems)
        + " | "
        + " | ".join(f"ours vs {s}" for s in systems[1:])
        + " |",
        "| ---: | " + " | ".join("---:" for _ in systems) + " | " + " | ".join("---:" for _ in systems[1:]) + " |",
    ]
    for parallelism, numbers in by_parallelism.items():
        rows.append(
            f"| {parallelism} | "
            + " | ".join(f"{numbers['rows_per_s'][s]:,}" for s in systems)
            + " | "
            + " | ".join(_x(numbers["keyed_count_vs"][s]["ratio"]) for s in systems[1:])
            + " |"
        )
    return rows


def throughput_section(data: dict, file: str) -> list[str]:
    t = data["throughput"]
    systems = list(next(iter(t["by_parallelism"].values()))["rows_per_s"])
    out = [
        "## Throughput and state size",
        "",
        _source_line(data, file),
        "",
        f"Rows/s of a running count per key over the same files ({t['distinct_keys']:,} keys, "
        f"{t['rows_per_batch']:,}-row batches); ratio = ours / theirs over the batches both ran.",
        "",
        *_rates_table(t["by_parallelism"], systems),
    ]
    limits = {s: n for s, n in t["measured_batches_by_system"].items() if n < t["measured_batches"]}
    if limits:
        out += [
            "",
            "Too slow to run every batch, measured on the first only: "
            + ", ".join(f"{s} ({n} batch{'es' if n > 1 else ''})" for s, n in limits.items())
            + ".",
        ]
    s = data["state_size"]
    out += [
        "",
        f"The same steady batches ({s['rows_per_batch']:,} rows over {s['steady_batch_keys']:,} keys) "
        "over growing state, run side by side: median paired ratio to the smallest state.",
        "",
        "| keys of state | median batch s | batch time ratio | checkpoint bytes of the same change, ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    memory = s.get("memory")
    if memory is None:
        for label, v in s["versus_smallest"].items():
            run = s["runs"][label]
            out.append(
                f"| {run['state_keys']:,} | {run['steady']['batch_seconds']['median']:.2f} "
                f"| {_x(v['batch_time_ratio'])} | {_x(v['checkpoint_bytes_ratio'])} |"
            )
    else:
        out[-2] += " slowest / median steady batch | steady batches reloading state | resident B/key | stored B/key |"
        out[-1] += " ---: | ---: | ---: | ---: |"
        for label, v in s["versus_smallest"].items():
            run, m = s["runs"][label], memory[label]
            per_key = m["resident_bytes_per_key"]
            per_key = "—" if per_key is None else "< noise" if per_key <= 0 else f"{per_key:,.0f}"
            out.append(
                f"| {run['state_keys']:,} | {run['steady']['batch_seconds']['median']:.2f} "
                f"| {_x(v['batch_time_ratio'])} | {_x(v['checkpoint_bytes_ratio'])} "
                f"| {_x(run['steady']['max_over_median'])} | {len(run['steady']['batches_that_reloaded_state'])} "
                f"| {per_key} | {m['stored_bytes_per_key']:,.0f} |"
            )
    largest = max(s["versus_smallest"], key=int)
    if memory is not None and s["versus_smallest"][largest]["checkpoint_bytes_ratio"] > 1.1:
        out += [
            "",
            f"Checkpoint bytes at {int(largest):,} keys include the share of compaction every steady batch "
            "carries: compaction is spread over batches (a key group rewritten in full from half of "
            "`maxChainLength` on, a budget per batch), so with much state each batch rewrites some key groups "
            "instead of one batch in `maxChainLength` rewriting all of them; `bench_checkpoint` measures what a "
            "change costs alone.",
        ]
    rocks = data.get("rocksdb_memory")
    if rocks is not None:
        out += [
            "",
            f"Resident B/key: the RSS growth of the processes holding the instances (the instance hosts) "
            "over the smallest state's, per extra key (`< noise`: no growth measured, the state being smaller "
            "than the run-to-run spread of the processes' RSS); stored B/key: the prefill checkpoint's blob bytes "
            f"per key. Spark's RocksDB store holding {rocks['state_keys']:,} keys reports "
            f"{rocks['memory_bytes_per_key']:,.1f} B/key of memory (`memoryUsedBytes`, its own estimate of "
            f"memtables and block cache) and {rocks['sst_bytes_per_key']:,.1f} B/key of SST files.",
        ]
    if "targets" in data:
        out += [
            "",
            _targets(
                [
                    {
                        **t,
                        "value": f"{t['measured']}"
                        + (
                            f" at parallelism {t['parallelism']}"
                            if "parallelism" in t
                            else f" ({t.get('compares', t.get('rule'))})"
                        ),
                    }
                    for t in data["targets"]
                ]
            ),
        ]
    out += ["", f"![keyed](../benchmarks/results/{file.replace('.json', '.png')})", ""]
    return out


CONNECT_TARGETS = (
    "public_path_vs_groupby_hdfs",
    "connect_vs_groupby_hdfs",
    "connect_vs_transform_with_state",
    "connect_rescaled_restart_vs_spark_restart",
)


def connect_section(data: dict, file: str) -> list[str]:
    """``bench_keyed``'s Connect column and its public path beside the plan accelerator."""
    over, classic = data["connect"], data["throughput"]["by_parallelism"]
    t = over["throughput"]
    systems = list(next(iter(t["by_parallelism"].values()))["rows_per_s"])
    restart = over["restart"]
    out = [
        "## Over Spark Connect, and the public path",
        "",
        _source_line(data, file),
        "",
        "The same files over a Spark Connect server on this machine (a client process; `docs/connect.md`), "
        f"{t['rounds']} round{'s' if t['rounds'] > 1 else ''} in rotated order; ratio = ours / theirs over the "
        "batches both ran.",
        "",
        *_rates_table(t["by_parallelism"], systems),
    ]
    runs = restart["runs"]
    out += [
        "",
        f"A restart over Connect with {restart['state_keys']:,} keys of state, its first batch "
        f"{restart['steady_rows']:,} rows: seconds from `start()` to its end (its batch's `triggerExecution`).",
        "",
        "| system | parallelism | restart s (batch s) | vs Spark's restart |",
        "| --- | --- | ---: | ---: |",
    ]
    versus = restart["versus_spark_restart"]
    for system, run in runs.items():
        ratio = versus.get(system, {}).get("wall_ratio")
        out.append(
            f"| {system} | {run['first']['parallelism']} -> {run['restart']['parallelism']} "
            f"| {run['restart']['wall_seconds']:.2f} ({run['restart_batch_seconds']:.2f}) "
            f"| {_x(ratio) if ratio is not None else '1.00x'} |"
        )
    public = [
        f"{_x(n['keyed_count_public_vs']['groupby_count_hdfs']['ratio'])} at parallelism {p} "
        f"({_x(n['keyed_count_vs']['keyed_count_public']['ratio'])} with the accelerator over without)"
        for p, n in classic.items()
        if "keyed_count_public_vs" in n
    ]
    if public:
        out += [
            "",
            "On a classic session without the plan accelerator (PySpark's public calls only, as over Connect), "
            "ours against `groupBy().count()` on the HDFS-backed store: " + ", ".join(public) + ".",
        ]
    targets = [t for t in data["targets"] if t["target"] in CONNECT_TARGETS]
    out += [
        "",
        _targets(
            [
                {
                    **t,
                    "value": f"{t['measured']}"
                    + (f" at parallelism {t['parallelism']}" if "parallelism" in t else f" ({t.get('compares')})"),
                }
                for t in targets
            ]
        ),
        "",
    ]
    return out


def memory_section(data: dict, file: str) -> list[str]:
    """``bench_memory``: the state kept under each bound, the peak of a batch, the hosts' RSS, the batch cost."""
    runs, mib = data["runs"], 1 << 20
    out = [
        "## Memory bound",
        "",
        _source_line(data, file),
        "",
        f"{data['state_keys']:,} keys of state, parallelism {data['parallelism']} (one executor), steady batches of "
        f"{data['rows_per_batch']:,} rows: {len(data['uniform_batch_ids'])} uniform over all keys (every key group "
        f"touched), then {len(data['hot_batch_ids'])} over {data['hot_keys']:,} hot keys. Estimates are the "
        "instances' own (Arrow buffers, and Python objects measured by sampling), summed; the RSS is the instance "
        "hosts' high-water mark (`VmHWM`) above that of hosts holding no state "
        f"({data['baseline_host_rss_bytes'] / mib:,.0f} MiB each).",
        "",
        "| run | bound | state kept between batches, max | peak in a batch | hosts' RSS above baseline "
        "| read back per steady batch | batch time vs unbounded, uniform / hot | final state exact |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, run in runs.items():
        if label == "baseline":
            continue
        bounded = label != "unbounded"
        times = (
            (
                f"{run['uniform_batch_time_vs_unbounded']['median']:.2f}x / "
                f"{run['hot_batch_time_vs_unbounded']['median']:.2f}x"
            )
            if bounded
            else "1 / 1"
        )
        out.append(f"| {label} | {run['limit_bytes'] / mib:,.0f} MiB | " if bounded else f"| {label} | none | ")
        out[-1] += (
            f"{run['state_kept_between_batches_bytes']['max'] / mib:,.1f} MiB | "
            f"{run['peak_estimate_bytes'] / mib:,.1f} MiB | {run['rss_growth_over_baseline_bytes'] / mib:,.0f} MiB | "
            + (f"{run['bytes_read_back_per_steady_batch'] / mib:,.1f} MiB | " if bounded else "0 | ")
            + f"{times} | "
            + ("yes" if not bounded or run["final_state_equals_unbounded"] else "**no**")
            + " |"
        )
    out += [
        "",
        "Between batches a bounded query keeps at most its bound (evicting the least recently used key groups, "
        "kept as Arrow chains); during a batch it also holds the keys the batch changes, as Python objects until "
        "its checkpoint, and the chains of one chunk of key groups, so the peak and the RSS follow the batch "
        "size, not the state size.",
        "",
        *_targets_and_figure(data, file, "memory"),
    ]
    return out


def checkpoint_section(data: dict, file: str) -> list[str]:
    runs = data["runs"]
    out = [
        "## Checkpoint cost",
        "",
        _source_line(data, file),
        "",
        f"{data['state_keys']:,} keys of state, {data['rounds']} rounds of batches changing each number of "
        f"keys; full state {_mb(runs['compaction']['full_state_bytes'])}. Median bytes and the slowest "
        "instance's checkpoint seconds, with compaction (`maxChainLength` "
        f"{runs['compaction']['max_chain_length']}) and without.",
        "",
        "| keys changed | bytes, compaction | bytes, none | fraction of full state (none) "
        "| checkpoint s, compaction (max) | checkpoint s, none (max) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fractions = data["comparison"]["fraction_of_full_state_by_keys_changed"]
    for n in data["changed_keys"]:
        a, b = runs["compaction"]["by_keys_changed"][str(n)], runs["no_compaction"]["by_keys_changed"][str(n)]
        out.append(
            f"| {n:,} | {_mb(a['median_bytes'])} | {_mb(b['median_bytes'])} | {fractions[str(n)]:.4f} "
            f"| {a['median_checkpoint_seconds']:.3f} ({a['max_checkpoint_seconds']:.3f}) "
            f"| {b['median_checkpoint_seconds']:.3f} ({b['max_checkpoint_seconds']:.3f}) |"
        )
    ra, rb = runs["compaction"]["restore"], runs["no_compaction"]["restore"]
    out += [
        "",
        f"Restoring the last checkpoint cold, as a task does: with compaction {_mb(ra['bytes_read'])} in "
        f"{ra['requests']:,} requests, {ra['seconds']} s (longest chain {ra['longest_chain']}); without "
        f"{_mb(rb['bytes_read'])} in {rb['requests']:,} requests, {rb['seconds']} s (longest chain "
        f"{rb['longest_chain']}). Compaction writes "
        f"{_x(1 / data['comparison']['bytes_written_no_compaction_vs_compaction'])} the bytes of deltas alone "
        "over these batches. Bytes per checkpoint fit "
        f"{runs['no_compaction']['bytes_model']['bytes_per_entry']:.0f} B per key group touched + "
        f"{runs['no_compaction']['bytes_model']['bytes_per_row']:.1f} B per changed key.",
        "",
        f"![checkpoint](../benchmarks/results/{file.replace('.json', '.png')})",
        "",
    ]
    return out


def time_section(data: dict, file: str) -> list[str]:
    s, t, m, c = data["sessions"], data["ttl"], data["timers"], data["config"]
    systems = s["systems"]
    names = {
        "ours": "ours (`session_window`)",
        "spark_native": "Spark `groupBy(session_window(...))`",
        "spark_tws": "Spark `transformWithStateInPandas` with timers",
    }
    first, last = t["compared_batches"]
    out = [
        "## Time: sessions, time to live, timers",
        "",
        _source_line(data, file),
        "",
        f"Session windows over the same {systems['ours']['rows']:,} keyed events ({c['session_keys']:,} keys, "
        f"{systems['ours']['batches']} batches, parallelism {c['parallelism']}). Same sessions: "
        f"{'yes' if s['same_sessions'] else 'NO'}, all {s['sessions_compared']:,} that close by our last "
        "watermark compared row for row across the three.",
        "",
        "| system | rows/s | ours / it |",
        "| --- | ---: | ---: |",
    ]
    for system, name in names.items():
        ratio = "" if system == "ours" else _x(systems["ours"]["rows_per_s"] / systems[system]["rows_per_s"])
        out.append(f"| {name} | {systems[system]['rows_per_s']:,} | {ratio} |")
    with_ttl = t["runs"]["with_ttl"]
    out += [
        "",
        f"Time to live: {c['ttl_batches']} batches of {c['ttl_keys']:,} new keys each; stored bytes at batch "
        f"{last} / batch {first}: {t['bytes_last_vs_batch_10']:.2f} with a time to live "
        f"({with_ttl['expired']:,} keys expired), {t['without_ttl_bytes_last_vs_batch_10']:.2f} without; batch "
        f"time {t['seconds_last_vs_batch_10']:.2f}. Timers: {m['timer_keys']:,} registered, "
        f"{m['fired_per_batch_target']:,} firing per batch: the median steady batch takes "
        f"{_x(m['ratio'])} the same batch with no timers registered.",
        "",
        *_timer_checkpoint_lines(data.get("timer_checkpoint")),
        *_idle_lines(data.get("idle")),
        *_targets_and_figure(data, file, "time"),
    ]
    return out


def _touched(s: dict) -> str:
    """bench_cluster's share of steady tasks resident or reading only what they touch (none in older results)."""
    if "steady_tasks_resident_or_reading_only_touched" not in s:
        return "not measured"
    return (
        f"{s['steady_tasks_resident_or_reading_only_touched']:.0%} ({s['median_key_groups_touched_per_task']:g} / "
        f"{s['key_groups_per_instance']:g})"
    )


def cluster_section(data: dict, file: str) -> list[str]:
    c = data["config"]
    out = [
        "## On a cluster",
        "",
        _source_line(data, file),
        "",
        f"A standalone cluster of {c['executors']} one-core executors on this machine; a keyed count at "
        f"parallelism {c['parallelism']} over {c['keys']:,} keys of state, {c['batches']} batches of "
        f"{c['rows']:,} rows, uniform and Zipf-skewed (s = {c['zipf_s']}), against `groupBy().count()` at as many "
        "shuffle partitions. Steady instance tasks: resident / caught up / restored (with a memory bound, a "
        "restore reads only the key groups its rows touch), and the share resident or reading from the store no key "
        "group their rows do not touch (with the key groups a task's rows touch, of those its instance owns). Hosts: "
        "the proportional set size of the hosts "
        f"whose instance ran last elsewhere, at the last batch and {c['settle_seconds']:g} s later, idle; and of "
        "every host against those holding the latest copies, settled.",
        "",
        "| keys | rows/s ours | HDFS | RocksDB | ours / HDFS | ours / RocksDB | tasks resident / caught up / "
        "restored | resident or reading only touched (touched / owned) | bound per host | stale hosts' PSS, last "
        "batch / settled | all hosts / latest copies' |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for distribution, s in data["summary"].items():
        rates, tasks = s["rows_per_second"], s["steady_tasks"]
        bound = s["memory_bound_bytes_per_host"]
        out.append(
            f"| {distribution} | {rates['keyed_count']:,.0f} | {rates['groupby_count_hdfs']:,.0f} | "
            f"{rates['groupby_count_rocksdb']:,.0f} | {_x(s['ours_vs_hdfs'])} | {_x(s['ours_vs_rocksdb'])} | "
            f"{tasks['resident']} / {tasks['caught_up']} / {tasks['restored']} | {_touched(s)} | "
            f"{_mb(bound) if bound else 'none'} | {s['stale_hosts']}: {_mb(s['stale_hosts_pss_bytes_at_last_batch'])}"
            f" / {_mb(s['stale_hosts_pss_bytes_settled'])} | {_x(s['hosts_vs_latest_copies_hosts'])} |"
        )
    rescale = data.get("rescale")
    if rescale is not None:  # results from before the rescale section have none
        path = " -> ".join(str(p) for p in rescale["parallelisms"])
        out += [
            "",
            f"A rescale {path} (uniform keys; each restart one steady batch, Spark's `groupBy().count()` restarted "
            f"at {rescale['parallelisms'][0]}, as it cannot change it): "
            + "; ".join(
                f"at {r['parallelism']} our batch {r['batch_seconds']['keyed_count']:.2f} s against "
                f"{r['batch_seconds']['groupby_count_hdfs']:.2f} s ({_x(r['batch_ratio'])}), from `start()` to its "
                f"end {r['wall_seconds']['keyed_count']:.1f} s against {r['wall_seconds']['groupby_count_hdfs']:.1f} s "
                f"({_x(r['wall_ratio'])})"
                for r in rescale["restarts"]
            )
            + ".",
        ]
    out += [
        "",
        *_targets_and_figure(data, file, "cluster"),
    ]
    return out


def _idle_lines(idle: dict | None) -> list[str]:
    """bench_time's ``idle``: processing-time timers on a source that stopped (none in older results)."""
    if idle is None:
        return []
    out = [
        "On an idle source (the query's clock): one key re-registers a processing-time timer every "
        f"{idle['ticks']['default']['tick_ms'] / 1000:g} s for {idle['ticks']['default']['idle_seconds']:g} s "
        "after its one file.",
        "",
        "| trigger | alerts | wait before its batch, median / p95 s | lateness, median / p95 s "
        "| batches without a timer |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, run in idle["ticks"].items():
        wait, late = run["wait_s"], run["lateness_s"]
        out.append(
            f"| {label} | {run['alerts']} | {wait['median']} / {wait['p95']} | {late['median']} / {late['p95']} "
            f"| {run['batches_without_a_timer']} |"
        )
    busy = idle["busy_query"]
    out += [
        "",
        f"With nothing due, a count ran {idle['nothing_due']['extra_batches']} extra batches in "
        f"{idle['nothing_due']['idle_seconds']:g} idle seconds; the clock's CPU on an idle query under the default "
        f"trigger: {idle['clock_idle_cpu_seconds_per_second']:.3f} s per second. A busy query's median steady "
        f"batch with the clock takes {_x(busy['with_vs_without'])} the one without "
        f"({busy['steady_batch_s_with_clock']} s / {busy['steady_batch_s_without_clock']} s).",
        "",
    ]
    return out


def _timer_checkpoint_lines(k: dict | None) -> list[str]:
    """bench_time's ``timer_checkpoint``: a checkpoint with timers against state size (none in older results)."""
    if k is None:
        return []
    sizes = list(k["runs"])
    cells = ", ".join(f"{int(s):,} keys {k['runs'][s]['timers']['median_seconds'] * 1000:.0f} ms" for s in sizes)
    return [
        f"Checkpoint after {k['changed_keys']:,} changed keys of a state with timers (in-process, memory "
        f"storage, median): {cells}; the largest state takes {_x(k['largest_vs_smallest'])} the smallest's, "
        f"without timers {_x(k['largest_vs_smallest_without_timers'])} (growth with / without timers "
        f"{_x(k['growth_vs_without_timers'])}); at the largest size the checkpoint with timers takes "
        f"{_x(k['timers_vs_none_at_largest'])} the one without.",
        "",
    ]


def manifest_section(data: dict, file: str) -> list[str]:
    out = [
        "## Manifest per checkpoint",
        "",
        f"From `benchmarks/results/{file}` (`{data['command']}`, load average "
        f"{data['environment']['load_average_1m']} at start).",
        "",
        "Every key group holds state; each checkpoint changes 1% of the key groups. The same blobs are committed "
        "as delta records on the previous checkpoint (a full record at least every 16) and, side by side, as a "
        "full record every checkpoint. Medians over the checkpoints.",
        "",
        "| key groups | record bytes, delta / full | record / state delta bytes | driver commit s, delta / full "
        "| executor read s warm, delta / full | executor read s cold, delta / full |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in data["sizes"]:
        d, f = size["delta_records"], size["full_records"]
        out.append(
            f"| {size['max_parallelism']:,} | {d['record_bytes']['median']:,.0f} / {f['record_bytes']['median']:,.0f} "
            f"| {d['record_to_state_delta']['median']:.3f} | {d['commit_seconds']['median']:.4f} / "
            f"{f['commit_seconds']['median']:.4f} | {d['warm_load_seconds']['median']:.4f} / "
            f"{f['warm_load_seconds']['median']:.4f} | {d['cold_load_seconds']['median']:.3f} / "
            f"{f['cold_load_seconds']['median']:.3f} |"
        )
    out += [
        "",
        *_targets_and_figure(data, file, "manifest"),
    ]
    return out


def reader_section(data: dict, file: str) -> list[str]:
    store, rates, cli = data["store"], data["rows_per_s"], data["cli"]
    out = [
        "## Reading state out: the `spark-state` source and the CLI",
        "",
        _source_line(data, file),
        "",
        f"A store of {store['keys']:,} keys (max parallelism 4096, parallelism 8, {_mb(store['store_bytes'])} of "
        "blobs; the last checkpoint changed 1% of the keys with delta entries) read into a DataFrame written to "
        f"Spark's `noop` sink ({data['partitions']} partitions), against the same keys and counts in Parquet "
        f"({_mb(store['parquet_bytes'])}); best of {data['config']['repeats']}.",
        "",
        "| what | rows/s | ratio |",
        "| --- | ---: | ---: |",
        f'| `spark.read.format("spark-state")` | {rates["spark_state_source"]:,} | '
        f"{_x(data['source_vs_parquet'])} of Parquet |",
        f"| `spark.read.parquet` | {rates['parquet']:,} | |",
        f"| the same Parquet through a Python data source (pyarrow, no work) | {rates['python_source_ceiling']:,} | "
        f"{_x(data['ceiling_vs_parquet'])} of Parquet; the state reader is at {_x(data['source_vs_ceiling'])} of it |",
        f"| `spark_state.read_state` (no Spark) | {rates['read_state']:,} | "
        f"{_x(data['read_state_vs_pyarrow_parquet'])} of pyarrow |",
        f"| `pyarrow.parquet.read_table` | {rates['pyarrow_parquet']:,} | |",
        "",
        f"`spark-state verify` read and checked {_mb(cli['verify_bytes'])} in {cli['verify_seconds']:.2f} s; "
        f"`spark-state plan -p 7` planned {cli['plan_requests']:,} ranged reads in {cli['plan_seconds']:.2f} s "
        "(console script wall time, Python start-up included).",
        "",
        *_targets_and_figure(data, file, "reader"),
    ]
    return out


def parts_section(keygroups: tuple[dict, str], source: tuple[dict, str], restore: tuple[dict, str]) -> list[str]:
    k, kf = keygroups
    s, sf = source
    r, rf = restore
    read, batch, write = s["read_rows_per_s"], s["batch_read_rows_per_s"], s["write_rows_per_s"]
    amps = [p["read_amplification"] for p in r["pairs"]]
    whole = [p["whole_blob_amplification"] for p in r["pairs"]]
    pairs = ", ".join(f"{p['old_parallelism']}→{p['new_parallelism']}" for p in r["pairs"])
    return [
        "## Key-group math, restore planning and the source",
        "",
        "| what | command | result |",
        "| --- | --- | --- |",
        f"| key-group mapping, {k['n_vector']:,}-row columns | `{k['command']}` | vectorized: "
        f"{k['keys_per_s']['vector_int64'] / 1e6:.0f}M int64 keys/s, "
        f"{k['keys_per_s']['vector_short_string'] / 1e6:.0f}M short strings/s; scalar `key_group_for`: "
        f"{k['keys_per_s']['scalar_int64'] / 1e6:.1f}M keys/s |",
        f"| restore read amplification, {r['keys']:,} keys, pairs "
        f"{pairs} | `{r['command']}` | "
        f"{_span(amps)} (reading whole overlapping blobs: {_span(whole)}) |",
        f"| streaming read, {s['rows']:,} rows, rows/s of the batches' processing time | `{s['command']}` | "
        + ", ".join(f"{name} {v['processing_rows_per_s']:,}" for name, v in read.items())
        + f"; log / Parquet {_x(s['log_vs_parquet_read_processing'])} |",
        "| batch read and write, rows/s | same | read: "
        + ", ".join(f"{name} {v['rows_per_s']:,}" for name, v in batch.items())
        + "; write: "
        + ", ".join(f"{name} {v['rows_per_s']:,}" for name, v in write.items())
        + " |",
        "",
        f"Plots: `benchmarks/results/{kf.replace('.json', '.png')}`, `{rf.replace('.json', '.png')}`, "
        f"`{sf.replace('.json', '.png')}`.",
        "",
    ]


def _spread_line(keys: int, steady: dict, batches: int) -> str:
    """The "behind" line of a steady batch above 1.5x the median: how many batches compacted, and what the
    hypervisor and the JVM took during the slowest (results from before they were recorded have none)."""
    slowest = steady.get("slowest_batch") or {}
    taken = [
        f"{what} {slowest[counter]:.2f} s (median {slowest[f'median_{counter}']:.2f} s)"
        for counter, what in (
            ("cpu_steal_seconds", "the hypervisor took"),
            ("io_stall_seconds", "tasks waited for I/O for"),
            ("jvm_gc_seconds", "the JVM collected garbage for"),
        )
        if slowest.get(counter) is not None
    ]
    listed = ", ".join(taken[:-1]) + " and " + taken[-1] if len(taken) > 1 else "".join(taken)
    stolen = f"; while the slowest ran, {listed}" if taken else ""
    return (
        f"- With {keys:,} keys of state, the slowest steady batch took {_x(steady['max_over_median'])} the median "
        f"steady batch ({len(steady['batches_with_full_entries'])} of {batches} steady batches wrote key groups "
        f"in full: compaction, or at least half of a key group's keys changed{stolen})."
    )


def behind_section(
    rescale: dict,
    keyed: dict,
    checkpoint: dict,
    source: dict,
    reader: dict | None = None,
    rescale_s3: dict | None = None,
    commit: dict | None = None,
    time: dict | None = None,
    keyed_long: dict | None = None,
    rescale_long: dict | None = None,
) -> list[str]:
    """Every place the numbers show us behind what a user would use instead, with by how much."""
    out = ["## Where we are behind", ""]
    for target in rescale.get("targets", []):
        if not target["met"]:
            out.append(f"- Rescale, target missed: {target['target']}: {target['value']}.")
    for target in (rescale_long or {}).get("targets", []):
        if not target["met"]:
            out.append(f"- Rescale with long keys, target missed: {target['target']}: {target['value']}.")
    for target in (time or {}).get("targets", []):
        if not target["met"]:
            out.append(f"- Time, target missed: {target['target']}: {target['value']}.")
    for target in (rescale_s3 or {}).get("targets", []):
        if not target["met"]:
            out.append(
                f"- Rescale on S3, target missed: {target['target']}: {target['value']}"
                + (f" (pairs {', '.join(target['slower_pairs'])})" if target.get("slower_pairs") else "")
                + "."
            )
    if rescale_s3 is not None:
        for size in rescale_s3["sizes"]:
            if (naive := _slower_than_naive(size)) is not None:
                slower, worst, restore, batch = naive
                out.append(
                    f"- Rescale on S3 at {size['keys']:,} keys: the naive hash-mod store restarts faster in "
                    f"{len(slower)} of {len(size['summary'])} pairs (ours takes up to {1 / worst:.2f}x its "
                    f"time), although it reads far more. Our restores, S3 reads included, take at most "
                    f"{restore:.2f} s of a first batch of at least {batch:.2f} s: the difference is the rest "
                    "of our batch (folding the key groups the batch touches, one delta entry per touched key "
                    "group; see Checkpoint cost), as on local disk."
                )
    if commit is not None:
        ratio = commit["s3_vs_local_median"]["checkpoint_seconds"]
        if ratio is not None and ratio > 1:
            s3 = commit["runs"]["s3"]["stats"]["checkpoint_seconds"]
            out.append(
                f"- A checkpoint (blob write + commit) on S3 takes {_x(ratio)} its time on local disk "
                f"(median {s3['median'] * 1000:.0f} ms, p95 {s3['p95'] * 1000:.0f} ms on loopback)."
            )
    for parallelism, numbers in keyed["throughput"]["by_parallelism"].items():
        for system, v in numbers["keyed_count_vs"].items():
            if v["ratio"] < 1:
                slower = (1 - v["ratio"]) * 100
                out.append(
                    f"- Throughput at parallelism {parallelism}: {_x_exact(v['ratio'])} of `{system}` "
                    f"({slower:.{1 if slower < 1 else 0}f}% slower)."
                )
    for target in keyed.get("targets", []):
        if not target["met"] and target["target"].startswith("throughput"):
            out.append(
                f"- Throughput target missed at parallelism {target['parallelism']}: {target['target']} "
                f"{_x_exact(target['measured'])} (at least {_x(target['at_least'])})."
            )
    for target in (keyed_long or {}).get("targets", []):
        if not target["met"] and target["target"].startswith("throughput"):
            out.append(
                f"- With long keys, throughput target missed at parallelism {target['parallelism']}: "
                f"{target['target']} {_x_exact(target['measured'])} (at least {_x(target['at_least'])})."
            )
    for size in rescale["sizes"]:
        rows = size["summary"]
        slower_pinned = [r for r in rows if r["ours_vs_spark_pinned"] < 1]
        if slower_pinned:
            worst = min(r["ours_vs_spark_pinned"] for r in slower_pinned)
            out.append(
                f"- Rescale at {size['keys']:,} keys: our restart at the new parallelism takes up to "
                f"{1 / worst:.2f}x Spark's restart without rescaling ({len(slower_pinned)} of {len(rows)} "
                "pairs slower than that floor)."
            )
        if (naive := _slower_than_naive(size)) is not None:
            slower_naive, worst, restore, batch = naive
            cpu = _python_cpu(size)
            spent = ""
            if cpu is not None:
                (ours, ours_kernel, ours_faults), (theirs, their_kernel, their_faults) = (
                    cpu["keyed_count"],
                    cpu["naive_hash_mod"],
                )
                spent = (
                    f"; the difference is CPU on two cores: per restart (median over pairs) the Python workers "
                    f"and our instance hosts used {ours:.2f} s ({ours_kernel:.0%} of it in the kernel, "
                    f"{ours_faults:,.0f} page faults), {_x(ours / theirs)} the naive store's {theirs:.2f} s "
                    f"({their_kernel:.0%}, {their_faults:,.0f} page faults)"
                )
            hosts = _hosts(rows)
            fork = (
                "a fork of a Python worker whose first task faults in every page it touches, those it "
                "shares with the worker and all it allocates"
            )
            if hosts is None:
                new = f"each of our new instances is {fork}"
            else:
                adopted, forked = hosts
                new = (
                    f"{adopted} of our {adopted + forked} new instances took an idle instance host an earlier "
                    f"run left, and {forked} were each {fork}"
                    if forked
                    else f"all {adopted} of our new instances took an idle instance host an earlier run left (a new "
                    f"host would be {fork})"
                )
            out.append(
                f"- Rescale at {size['keys']:,} keys: the naive hash-mod store restarts faster in "
                f"{len(slower_naive)} of {len(rows)} pairs (ours takes up to {1 / worst:.2f}x its time). Our "
                f"restore reads take at most {restore:.2f} s of a first batch of at least {batch:.2f} s{spent}. "
                f"The benchmark restarts on a copy of the store, so every instance is new: {new}; a task "
                "passes its rows and output through a Python worker to its host; and its work per key group the "
                "batch touches (its keys searched in its chain, one entry written) is a few Arrow calls each, "
                "where the naive store, in workers that keep their memory, does one join over its rows."
            )
        slower_repartition = [r for r in rows if r["ours_vs_spark_repartition"] < 1]
        if slower_repartition:
            out.append(
                f"- Rescale at {size['keys']:,} keys: Spark's repartition + restart beats ours in "
                f"{len(slower_repartition)} of {len(rows)} pairs."
            )
    state = keyed["state_size"]
    for label, v in state["versus_smallest"].items():
        if v["batch_time_ratio"] > 1.5 and "targets" not in keyed:
            out.append(
                f"- The same batch over {int(label):,} keys of state takes {_x(v['batch_time_ratio'])} "
                "its time over the smallest state."
            )
    largest = max(state["versus_smallest"], key=int)
    reloaded = state["runs"][largest]["steady"]["batches_that_reloaded_state"]
    ratios = dict(zip(state["steady_batch_ids"], state["versus_smallest"][largest]["paired_ratios"]))
    grown = int(largest) > int(min(state["versus_smallest"], key=int))
    spread = state["runs"][largest]["steady"].get("max_over_median")
    if spread is not None and spread > 1.5 and grown:
        out.append(_spread_line(int(largest), state["runs"][largest]["steady"], len(ratios)))
    if reloaded and grown:
        out.append(
            f"- With {int(largest):,} keys of state, {len(reloaded)} of {len(ratios)} steady batches "
            f"reloaded an instance from the store; those batches took up to "
            f"{_x(max(ratios[b] for b in reloaded))} the small-state batch."
        )
    memory, rocks = state.get("memory"), keyed.get("rocksdb_memory")
    if memory and rocks and memory[largest]["resident_bytes_per_key"] is not None:
        out.append(
            f"- Memory: with {int(largest):,} keys of state our instance hosts hold "
            f"{memory[largest]['resident_bytes_per_key']:,.0f} B per key (every key resident, as Arrow chains), "
            f"Spark's RocksDB store {rocks['memory_bytes_per_key']:,.1f} B per key in memory and "
            f"{rocks['sst_bytes_per_key']:,.1f} B on local disk, by default (no bound); under "
            '`spark.state.residentMemory` see "Memory bound".'
        )
    for target in keyed.get("targets", []):
        if not target["met"] and "at_most" in target:
            out.append(
                f"- Keyed count, target missed: {target['target']} ({target.get('compares', target.get('rule'))}): "
                f"{target['measured']} (at most {target['at_most']})."
            )
    none = checkpoint["runs"]["no_compaction"]
    compacted = checkpoint["runs"]["compaction"]
    restored = compacted["restore"]
    out.append(
        f"- A cold restore after compaction reads {_x(restored['bytes_read'] / compacted['full_state_bytes'])} "
        f"the bytes of the live state ({_mb(restored['bytes_read'])} in {restored['requests']:,} requests, "
        f"{checkpoint['state_keys']:,} keys): a chain is its full entry, a merge of up to half of its keys "
        f"and the deltas since (the catch-up reads through the bytes between the entries it needs only within "
        "5% of them), so entries spread over many blobs cost requests (on object stores, round "
        "trips)."
    )
    fewest = checkpoint["changed_keys"][0]
    out.append(
        f"- Sparse checkpoints pay about {none['bytes_model']['bytes_per_entry']:.0f} B per key group "
        f"touched: changing {fewest:,} of {checkpoint['state_keys']:,} keys writes "
        f"{_mb(none['by_keys_changed'][str(fewest)]['median_bytes'])}."
    )
    if source["log_vs_parquet_read_processing"] < 1:
        out.append(
            f"- The `replayable` source reads at {_x(source['log_vs_parquet_read_processing'])} of Parquet "
            f"(batches' processing time) and {_x(source['log_vs_parquet_read'])} counting query start-up; "
            f"it matches a Python source doing no work ({_x(source['log_vs_python_ceiling_batch_read'])}), so "
            "Spark's Python data source transfer is the ceiling."
        )
    if source["log_vs_parquet_write"] < 1:
        out.append(f"- Writing the log runs at {_x(source['log_vs_parquet_write'])} of Parquet.")
    if reader is not None and reader["source_vs_parquet"] < 1:
        out.append(
            f"- The `spark-state` reader reads state into a DataFrame at {_x(reader['source_vs_parquet'])} of "
            "Parquet's rows/s: its rows cross from Python workers to the JVM as Arrow batches, Parquet's are "
            "decoded in the JVM; a Python data source that only hands over the Parquet files' batches reaches "
            f"{_x(reader['ceiling_vs_parquet'])}, and the reader is at {_x(reader['source_vs_ceiling'])} of that."
        )
    return out + [""]


CAMPAIGN_CYCLES, CAMPAIGN_PER_KIND = 200, 5
"""What a committed fault campaign must reach: scheduled cycles, and injections of every fault kind."""
CAMPAIGN_PROBLEM_COUNTS = (
    "wrong",
    "lost",
    "duplicated",
    "hangs",
    "untyped_faults",
    "unexplained_failures",
    "corrupt_commits",
    "log_problems",
)
"""A campaign summary's counters of what went wrong (all must be 0)."""


def campaign_section(data: dict, file: str) -> list[str]:
    kinds = data.get("fault_kinds") or sorted(data["faults"])
    faults = {k: data["faults"].get(k, 0) for k in kinds}
    scheduled = data.get("scheduled_cycles", data["cycles"] - data["queries"])
    bad = {k: data.get(k, 0) for k in CAMPAIGN_PROBLEM_COUNTS}
    fewest = min(faults, key=faults.get)
    resumed = data.get("resumes", 0)
    complete = data.get("complete", True)
    run = scheduled if complete else data["cycles"]
    cycles = (
        f"{data['cycles']} cycles ({scheduled} scheduled, then the final drains of its {data['queries']} queries)"
        if complete
        else f"{data['cycles']} of {scheduled} scheduled cycles so far (stopped; no "
        f"final drains yet; `./run campaign --resume DIR` continues it), {data['queries']} queries,"
    )
    out = [
        "## Fault campaign",
        "",
        f"From `benchmarks/results/{file}` (`{data.get('command', 'seed ' + str(data['seed']))}`"
        + (f", stopped and resumed {resumed} time{'s' if resumed > 1 else ''} with `--resume`" if resumed else "")
        + (")." if complete else "; NOT complete)."),
        "",
        f"{cycles} in {data['elapsed_s'] / 3600:.1f} h: {sum(faults.values())} faults of {len(kinds)} kinds injected; "
        f"{data['batches_checked']:,} micro-batches, {data['keys_checked']:,} distinct keys and "
        f"{data['states_checked']} drained final states checked against the model over {data['events']:,} "
        "events. "
        + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in bad.items())
        + f". The longest recovery (restart to the first committed batch) took {data['longest_recovery_s']} s.",
        "",
        "| fault | injected |",
        "| --- | ---: |",
    ]
    out += [f"| `{k}` | {n} |" for k, n in faults.items()]
    clean = not any(bad.values()) and not data["problems"]
    out += [
        "",
        _targets(
            [
                {
                    "target": f"at least {CAMPAIGN_CYCLES} cycles run",
                    "value": run,
                    "met": complete and run >= CAMPAIGN_CYCLES,
                },
                {
                    "target": f"every fault kind at least {CAMPAIGN_PER_KIND} times",
                    "value": f"fewest {fewest} {faults[fewest]}",
                    "met": faults[fewest] >= CAMPAIGN_PER_KIND,
                },
                {
                    "target": "nothing wrong, lost, duplicated, hung or untyped",
                    "value": "none"
                    if clean
                    else f"{sum(bad.values())} ({'; '.join(p[:160] + ('...' if len(p) > 160 else '') for p in data['problems'][:3])})",
                    "met": clean,
                },
            ]
        ),
        "",
    ]
    return out


def campaign_run_lines(data: dict, file: str, label: str, what: str) -> list[str]:
    """A shorter run with more of the product in it (``--s3``, ``--savepoints``): one paragraph under the
    committed run; ``what`` says what it adds."""
    bad = sum(data.get(k, 0) for k in CAMPAIGN_PROBLEM_COUNTS)
    faults = ", ".join(f"`{k}` {n}" for k, n in data["faults"].items() if n)
    return [
        f"**{label}** (`benchmarks/results/{file}`, `{data['command']}`): {data['cycles']} cycles, {what}; "
        f"faults {faults}; {data['batches_checked']:,} micro-batches and {data['states_checked']} drained final "
        f"states checked: {'nothing' if not bad and not data['problems'] else bad} wrong, lost, duplicated, "
        "hung or untyped.",
        "",
    ]


def campaign_s3_lines(data: dict, file: str) -> list[str]:
    """A run with ``--s3``: its stores partly on S3."""
    return campaign_run_lines(
        data, file, "On S3", f"{data['queries_on_s3']} of {data['queries']} queries with their state store on SeaweedFS"
    )


def campaign_savepoints_lines(data: dict, file: str) -> list[str]:
    """A run with ``--savepoints``: savepoints taken while queries run, queries forked from them."""
    on_s3 = data.get("queries_on_s3", 0)
    return campaign_run_lines(
        data,
        file,
        "With savepoints",
        f"{data['faults'].get('savepoint', 0)} savepoints taken while their queries ran and "
        f"{data['queries_forked']} of {data['queries']} queries forked from them"
        + (f", {on_s3} queries with their state store on SeaweedFS" if on_s3 else ""),
    )


def campaign_hosts_lines(data: dict, file: str) -> list[str]:
    """A run on instance hosts (the committed 200-cycle run predates them)."""
    killed = data["faults"].get("kill_host", 0)
    return campaign_run_lines(
        data,
        file,
        "On instance hosts",
        f"{data['queries']} queries with their state in "
        "instance hosts (a killed worker is a courier, a killed executor ends its hosts"
        + (
            f"; {killed} host{'s' if killed > 1 else ''} killed, each restored from the store by its next task"
            if killed
            else ""
        )
        + ")",
    )


def campaign_current_lines(data: dict, file: str) -> list[str]:
    """A shorter run of every fault kind on the current code (the committed 200-cycle run is older)."""
    kinds = [k for k, n in data["faults"].items() if n]
    return campaign_run_lines(
        data,
        file,
        "On the current code",
        f"{data['queries']} queries, all {len(kinds)} of the {len(data['fault_kinds'])} fault kinds injected "
        "(the two cluster kinds decommission_executor and dynamic_allocation included; its drivers are classic "
        "sessions, none over Spark Connect)",
    )


def campaign_cluster_lines(data: dict, file: str) -> list[str]:
    """A run of the cluster kinds: executors killed, decommissioned, and removed and added by dynamic allocation."""
    faults = data["faults"]
    return campaign_run_lines(
        data,
        file,
        "On a cluster",
        f"{data['queries']} queries on a standalone cluster of 2 one-core executors: "
        f"{faults.get('kill_executor', 0)} executors killed, {faults.get('decommission_executor', 0)} "
        f"decommissioned and {faults.get('dynamic_allocation', 0)} runs under dynamic allocation in which Spark "
        "removed an idle executor and added another",
    )


def campaign_memory_lines(data: dict, file: str) -> list[str]:
    """A run with every query under a memory bound far below its state (evictions in every batch), with
    ``--s3`` and ``--savepoints`` when they were given."""
    on_s3, forked = data.get("queries_on_s3", 0), data.get("queries_forked", 0)
    label = "Under a memory bound" + (", on S3" if on_s3 else "") + (", with savepoints" if forked else "")
    return campaign_run_lines(
        data,
        file,
        label,
        f"{data['queries']} queries with "
        f"`spark.state.residentMemory={data['memory_bound']}`, far below their state "
        f"({data.get('key_groups_evicted', 0):,} key groups evicted and "
        f"{data.get('key_groups_loaded_back', 0):,} read back)"
        + (f", {on_s3} with their state store on SeaweedFS" if on_s3 else "")
        + (f", {forked} forked from a savepoint" if forked else ""),
    )


def campaign_key_space_lines(data: dict, file: str) -> list[str]:
    """A run where half the queries leave ``spark.state.maxParallelism`` unset (the default key space)."""
    on_s3, forked = data.get("queries_on_s3", 0), data.get("queries_forked", 0)
    return campaign_run_lines(
        data,
        file,
        "At the default key space",
        f"{data['queries_default_key_space']} of {data['queries']} queries with `spark.state.maxParallelism` "
        "unset, so their stores take the default key space of their first parallelism and keep it through "
        "restarts and rescales"
        + (f", {forked} of all {data['queries']} forked from a savepoint" if forked else "")
        + (f", {on_s3} with their state store on SeaweedFS" if on_s3 else ""),
    )


def render(results: Path = RESULTS) -> str:
    rescale, keyed, checkpoint = load("rescale", results), load("keyed", results), load("checkpoint", results)
    keygroups, source, restore = load("keygroups", results), load("source", results), load("restore", results)
    reader = load("reader", results)
    env = rescale[0]["environment"]
    lines = [
        BEGIN,
        "",
        "_Generated by `./run bench report` from `benchmarks/results/`; do not edit by hand._",
        "",
        f"Machine: {env['cpus']} cores, shared with other jobs; Python {env['python']}, "
        f"pyspark {env['spark']}, pyarrow {env['pyarrow']}, `{rescale[0]['master']}`"
        + (", Python workers on Unix sockets" if env.get("python_workers_on_unix_sockets") else "")
        + ". Every ratio is "
        "measured side by side in one run; absolute seconds on this machine are noisy.",
        "",
    ]
    lines += rescale_section(*rescale)
    rescale_long = _optional("rescale_long", results)
    if rescale_long is not None:
        lines += rescale_long_lines(*rescale_long)
    rescale_s3 = load("rescale_s3", results, "./run bench bench_rescale --store s3")
    commit = load("commit", results)
    lines += rescale_s3_section(*rescale_s3)
    lines += commit_section(*commit)
    lines += throughput_section(*keyed)
    keyed_long = _optional("keyed_long", results)
    if keyed_long is not None:
        lines += long_keys_lines(*keyed_long)
    keyed_zipf = _optional("keyed_zipf", results)
    if keyed_zipf is not None:
        lines += skewed_keys_lines(*keyed_zipf)
    over_connect = next(
        (found for found in (keyed, _optional_file("keyed.json", results)) if found and "connect" in found[0]), None
    )
    if over_connect is not None:
        lines += connect_section(*over_connect)
    lines += memory_section(*load("memory", results))
    lines += checkpoint_section(*checkpoint)
    lines += manifest_section(*load("manifest", results))
    cluster = _optional("cluster", results)
    if cluster is not None:
        lines += cluster_section(*cluster)
    time = load("time", results)
    lines += time_section(*time)
    lines += reader_section(*reader)
    lines += campaign_section(*load("campaign", results, "./run campaign --cycles 200 --seed 20261123"))
    if (results / "campaign_s3.json").exists():
        lines += campaign_s3_lines(*load("campaign_s3", results))
    if (results / "campaign_savepoints.json").exists():
        lines += campaign_savepoints_lines(*load("campaign_savepoints", results))
    if (results / "campaign_hosts.json").exists():
        lines += campaign_hosts_lines(*load("campaign_hosts", results))
    if (results / "campaign_cluster.json").exists():
        lines += campaign_cluster_lines(*load("campaign_cluster", results))
    if (results / "campaign_current.json").exists():
        lines += campaign_current_lines(*load("campaign_current", results))
    for name in ("campaign_memory", "campaign_memory_s3"):
        if (results / f"{name}.json").exists():
            lines += campaign_memory_lines(*load(name, results))
    if (results / "campaign_key_space.json").exists():
        lines += campaign_key_space_lines(*load("campaign_key_space", results))
    lines += parts_section(keygroups, source, restore)
    lines += behind_section(
        rescale[0],
        keyed[0],
        checkpoint[0],
        source[0],
        reader[0],
        rescale_s3[0],
        commit[0],
        time[0],
        keyed_long[0] if keyed_long is not None else None,
        rescale_long[0] if rescale_long is not None else None,
    )
    lines.append(END)
    return "\n".join(lines)


def updated_page(readme: str, section: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise MissingResults(f"{PAGE} must contain {BEGIN} and {END} once each")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return head + section + tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md differs from the results")
    args = parser.parse_args(argv)
    readme = PAGE.read_text()
    new = updated_page(readme, render())
    if args.check:
        if new != readme:
            print(f"the results section of {PAGE} is out of date: run ./run bench report", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote the results section of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
