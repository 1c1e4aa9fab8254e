"""The fault campaign's supervisor: no Spark in this process; it keeps the truth and checks every cycle.

    ./run campaign --cycles N --seed S [--root DIR] [--out FILE] [--cycle-timeout SECONDS] [--s3] [--savepoints]
                   [--memory-bound SIZE]
    ./run campaign --resume DIR [--out FILE]      continue a run (after its last finished cycle)

One cycle: pick a query (one of the shapes of ``model``, each with its own
state store, Spark checkpoint and replayable sink; sometimes a new one), append
events, run a driver process (``driver``) at a random parallelism 1..9,
sometimes with a live parallelism change, append more events while it runs,
and inject at most one fault (``FAULT_KINDS``); then check:

- the events log holds every append exactly once (``EventLog.verify``);
- every micro-batch the sink holds equals the model's output for that batch,
  matched by Spark's batch id (the batch's input is the offsets range of
  Spark's ``offsets/N``, its processing time that entry's
  ``batchTimestampMs``); a batch Spark committed must be in the sink unless
  its output is empty; a batch id twice in the sink is a duplicate;
- every retained checkpoint of the store loads and every file it references
  has the size and CRC-32 it recorded;
- refusals (a deleted newest record: ``StateBehindQueryError``, or
  ``StateMissingError`` when it was the only one; a second checkpoint
  location on the store) stop the driver with the typed error, and change
  nothing;
- a storage fault stops what it hit with a typed error naming the path;
- a driver that stops with an error no injected fault explains is a problem.

A scheduled fault a cycle could not inject (a refusal needs a batch Spark
committed, a kill its moment) is owed: the next cycle scheduled without a
fault injects it instead, so every kind reaches its count.

With ``--memory-bound SIZE``, every query runs with
``spark.state.residentMemory=SIZE`` (a size far below its state makes every
batch evict key groups and read evicted ones back; the summary counts both).

With ``--s3``, every other new query keeps its state store on a SeaweedFS
S3 server on loopback (``tests/s3_server.py``, started by the supervisor,
its data under the run's directory): the same faults, storage faults
included, hit the S3 backend, and the checks read the store through
``open_storage``. Spark's checkpoint, the events log and the sinks stay on
local disk.

With ``--savepoints``, two more kinds join (``SAVEPOINT_KINDS``):
``savepoint`` runs ``spark-state savepoint create`` on a query's store at a
random moment while the query runs, counted from its first commit in a
query's first cycle (retrying when the command says the checkpoint fell out
of retention meanwhile); ``fork`` starts a new query from
one of those savepoints into a new, empty store (``spark.state.fromSavepoint``,
the source at ``startingOffsets=checkpoint``), half the time killed while it
starts (during the copy or just after) and started again. A fork is a query
like the others from then on: every start names its savepoint, faults hit it,
its batches are checked against the parent's model replayed to the
savepoint's batch and continued, and it is drained at the end. Half the
forks' savepoints are deleted after the fork's first run (the fork must not
need them). Every checkpoint a savepoint pins must stay loadable and intact.

A cycle past ``--cycle-timeout`` is a hang: the stacks of the driver's JVM
(``jstack``) and Python processes (SIGUSR1, see ``site/sitecustomize.py``)
are dumped into the cycle's directory, then its processes are killed. At the
end every query is drained and its stored state must equal the model's over
the whole log. The summary is one JSON line (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from datasources.log import ReplayableLog
from datasources.logindex import Commit
from spark_state.executor.resident import restore_instance
from spark_state.storage import open_storage
from spark_state.storage.faults import FAULT_PLAN_ENV, kill_session, session_members
from spark_state.store.blobstore import BlobStore
from spark_state.store.manifestlog import ManifestReader, manifest_path
from spark_state.store.savepoints import Savepoints, parse_savepoint_uri
from tests.campaign.events import EventLog
from tests.campaign.faults import (
    CLUSTER,
    FAULT_KINDS,
    PATTERNS,
    SAVEPOINT_KINDS,
    STORAGE,
    TIMED,
    Moment,
    storage_rule,
    uses_storage_plan,
)
from tests.campaign.model import MODELS, SHAPES, Model
from tests.jvm import driver_jvm_options
from tests.kills import wait_for_created

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
MAX_PARALLELISM = 128
STORAGE_TIMEOUT_S = 4.0
S3_BUCKET = "campaign"
FINAL_DRAIN_RECORDS = 4000  # records per batch of the final drains
FINAL_DRAIN_EVENTS_PER_S = 500  # the final drain's bound: the cycle's, plus a second per this many events of backlog
AWS_FILES = ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
PROBLEM_COUNTS = (
    "wrong",
    "lost",
    "duplicated",
    "hangs",
    "untyped_faults",
    "unexplained_failures",
    "corrupt_commits",
    "log_problems",
)
"""The summary's counters of what went wrong: a run is clean when all are 0 and it lists no problem."""
TYPED_ERRORS = ("InjectedStorageError", "StorageError", "StorageTimeoutError", "CommitFailedError")


def _now() -> float:
    return time.monotonic()


@dataclass
class Query:
    """One query of the campaign: its shape, where it keeps everything, and the model of its output so far."""

    name: str
    shape: str
    root: Path
    starting: dict[int, int]
    model: Model
    retained: int
    max_chain: int
    next_batch: int = 0
    drained: set[int] = field(default_factory=set)
    sink_commits: int = 0
    sink: dict[int, list[tuple]] = field(default_factory=dict)
    runs: int = 0
    s3_prefix: str | None = None
    """``<bucket>/<prefix>`` of its state store on the campaign's S3 server; None: on local disk."""
    origin: str | None = None
    """The savepoint URI a fork started from (its every start names it, as a user's code would)."""
    base: Model | None = None
    """A fork's model at its start (the parent's after the savepoint's batch); None: an empty model."""
    key_space: int | None = None
    """``spark.state.maxParallelism`` its every start sets; None: unset, so the store's key space (or, for a new
    store, the default for its first parallelism) applies, as for a user who never sets it."""

    @property
    def store(self) -> Path:
        """Beside the checkpoint, or (``in_checkpoint``) the default store, ``<checkpointLocation>/state``."""
        return self.checkpoint / "state" if getattr(self, "in_checkpoint", False) else self.root / "state"

    def store_uri(self, s3=None) -> str:
        """Its state store: the local path, or the ``s3://`` URI on ``s3`` (the campaign's ``SeaweedS3``)."""
        if self.s3_prefix is None:
            return str(self.store)
        bucket, prefix = self.s3_prefix.split("/", 1)
        return s3.uri(bucket, prefix)

    def store_location(self) -> str:
        """Its state store as storage faults match it (``<storage uri>/<path>``): no URI parameters."""
        return str(self.store) if self.s3_prefix is None else f"s3://{self.s3_prefix}"

    @property
    def checkpoint(self) -> Path:
        return self.root / "chk"

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def sink_id(self) -> str:
        return f"sink:spark-state:{self.checkpoint}"


def sink_rows(shape: str, table: pa.Table) -> list[tuple]:
    """Output rows as the model's tuples."""
    if shape in ("sessions",):
        start = table.column("session_start").cast(pa.int64()).to_pylist()
        end = table.column("session_end").cast(pa.int64()).to_pylist()
        rest = [table.column(c).to_pylist() for c in ("count", "sum_value", "min_value", "max_value")]
        return [
            (k, s // 1000, e // 1000, *r) for k, s, e, *r in zip(table.column("key").to_pylist(), start, end, *rest)
        ]
    columns = {
        "count": ("key", "count"),
        "sum": ("key", "sum_value"),
        "apply": ("key", "n", "total", "top"),
        "dedup": ("key", "seq"),
        "timers": ("key", "n", "t"),
    }[shape]
    return list(zip(*[table.column(c).to_pylist() for c in columns]))


def read_offsets(checkpoint: Path) -> dict[int, tuple[dict[int, int], int]]:
    """Spark's ``offsets/N`` entries: batch id -> (end offsets per split, batchTimestampMs)."""
    entries = {}
    directory = checkpoint / "offsets"
    if not directory.is_dir():
        return entries
    for name in os.listdir(directory):
        if name.isdigit():
            lines = (directory / name).read_text().splitlines()
            meta, source = json.loads(lines[1]), json.loads(lines[2])
            end = {int(k): int(v) for k, v in source.items() if k.isdigit()}
            entries[int(name)] = (end, int(meta["batchTimestampMs"]))
    return entries


def store_files(storage, path: str = "") -> list[str]:
    """Every file below ``path`` of ``storage``, walked through the storage API (local disk and S3 alike).

    A path with children is a directory (an empty local directory counts as a file).
    """
    found = []
    for name in storage.list(path):
        child = f"{path}/{name}" if path else name
        below = store_files(storage, child)
        found.extend(below if below else [child])
    return sorted(found)


def committed_batches(checkpoint: Path) -> set[int]:
    directory = checkpoint / "commits"
    return {int(n) for n in os.listdir(directory) if n.isdigit()} if directory.is_dir() else set()


def _process_state(pid: int) -> str | None:
    """The scheduler state of ``pid`` (``R`` running, ``S`` sleeping, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def python_roles(parents: dict[int, int], members: set[int]) -> dict[str, list[int]]:
    """Spark's Python processes of a session by role (``Campaign.python_process``): ``parents`` maps each
    process forked from the daemon's command line to its parent, ``members`` are the session's processes."""
    daemons = {pid for pid, parent in parents.items() if parent not in parents and parent in members}
    return {
        "daemon": sorted(daemons),
        "worker": sorted(pid for pid, parent in parents.items() if parent in daemons),
        "host": sorted(pid for pid, parent in parents.items() if pid not in daemons and parent not in daemons),
    }


class Campaign:
    def __init__(
        self,
        root: Path,
        seed: int,
        cycles: int,
        cycle_timeout: float,
        *,
        cluster_cycles: bool = True,
        max_parallelism: int = 9,
        shapes: tuple[str, ...] = SHAPES,
        kinds: list[str] | None = None,
        s3: bool = False,
        savepoints: bool = False,
        memory_bound: str | None = None,
    ):
        self.root = root
        self.memory_bound = memory_bound
        self.use_s3 = s3
        self.use_savepoints = savepoints
        self.pending: list[dict] = []
        """Savepoints made by ``savepoint`` cycles that no fork started from yet."""
        self.s3 = None
        self.seed = seed
        self.cycles = cycles
        self.cycle_timeout = cycle_timeout
        self.rng = random.Random(seed)
        self.max_parallelism = max_parallelism
        self.cluster_cycles = cluster_cycles
        root.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(str(root / "events"), self.rng)
        self.queries: list[Query] = []
        self.faults: Counter = Counter()
        self.planned: Counter = Counter()
        self.problems: list[str] = []
        self.counts: Counter = Counter()
        self.keys_checked: set[str] = set()
        self.recoveries: list[float] = []
        self.cluster = None
        self.done = 0
        self.elapsed = 0.0
        self.stop_requested = False
        self.shapes = shapes
        self.schedule = (
            self._schedule()
            if kinds is None
            else ([None if k == "none" else k for k in kinds] + [None] * cycles)[:cycles]
        )
        self.explicit_kinds = kinds
        self.owed: list[str] = []
        """Scheduled kinds a cycle could not inject (a refusal needs a committed batch, a kill its moment):
        each takes the next cycle scheduled without a fault, so every kind reaches its count."""

    # -- choices -------------------------------------------------------------------------------

    def _schedule(self) -> list[str | None]:
        """Fault kinds by cycle: every kind at least ``per_kind`` times when cycles allow, the rest random or none."""
        kinds = self.kinds()
        per_kind = max(0, min(6, self.cycles // len(kinds)))
        plan: list[str | None] = [k for k in kinds for _ in range(per_kind)]
        while len(plan) < self.cycles:
            plan.append(self.rng.choice(kinds) if self.rng.random() < 0.5 else None)
        head = plan[: self.cycles]
        self.rng.shuffle(head)
        if per_kind == 0:  # a short run: as many different kinds as there are cycles
            local = [k for k in kinds if k not in CLUSTER]
            head = self.rng.sample(local, min(self.cycles, len(local)))
            head += [None] * (self.cycles - len(head))
        return head

    def new_query(self, fork: dict | None = None, *, in_checkpoint: bool = False) -> Query:
        """A new query of the next shape; with ``fork`` (a pending savepoint), one started from that savepoint."""
        shapes = self.shapes
        if fork is not None:
            parent = self.query(fork["parent"])
            shape = parent.shape
            model, starting = self.model_at(parent, fork["batch"], fork["drained"])
        else:
            shape = (
                shapes[len(self.queries) % len(shapes)] if len(self.queries) < len(shapes) else self.rng.choice(shapes)
            )
            model, starting = MODELS[shape](), self.events.end_offsets()
        name = f"q{len(self.queries):02d}-{shape}"
        query = Query(
            name,
            shape,
            self.root / name,
            starting,
            model,
            retained=self.rng.randint(2, 5),
            max_chain=self.rng.randint(2, 6),
            s3_prefix=f"{S3_BUCKET}/{name}/state" if self.use_s3 and len(self.queries) % 2 else None,
        )
        # Half the queries leave the key space to the default rule (two in a row, so that local and S3 stores both do).
        query.key_space = None if (len(self.queries) // 2) % 2 == 0 else MAX_PARALLELISM
        if fork is not None:
            query.origin, query.base = fork["uri"], copy.deepcopy(model)
            query.key_space = getattr(parent, "key_space", MAX_PARALLELISM)  # the savepoint's, or unset
        # Every third query (and each stopped before its first batch) keeps its store where a query does by default.
        query.in_checkpoint = (in_checkpoint or len(self.queries) % 3 == 2) and query.s3_prefix is None and fork is None
        self.queries.append(query)
        return query

    def query(self, name: str) -> Query:
        return next(q for q in self.queries if q.name == name)

    def model_at(self, query: Query, batch: int | None, drained: bool) -> tuple[Model, dict[int, int]]:
        """The query's model after Spark's batch ``batch`` (None: at its start), replayed from its start, and
        the offsets where that batch ended (what a fork from a savepoint of that batch starts at)."""
        model = copy.deepcopy(query.base) if query.base is not None else MODELS[query.shape]()
        offsets, start = read_offsets(query.checkpoint), query.starting
        for b in range(0 if batch is None else batch + 1):
            end, processing_ms = offsets[b]
            model.batch(
                self.events.events_between(start, end), processing_ms, b in query.drained or (b == batch and drained)
            )
            start = end
        return model, start

    # -- the driver ----------------------------------------------------------------------------

    def spec(
        self,
        query: Query,
        cycle_dir: Path,
        parallelism: int,
        *,
        live_change=None,
        checkpoint=None,
        out=None,
        cluster=None,
        max_records: int | None = None,
        dynamic: bool = False,
    ) -> Path:
        conf = {
            "spark.master": "local[2,4]",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "2",
            "spark.sql.adaptive.enabled": "false",
            "spark.driver.extraJavaOptions": driver_jvm_options(),
            "spark.sql.streaming.stopTimeout": "30s",
            # Every batch's offsets stay until the supervisor has checked it: Spark keeps its last 100 by
            # default, and one long run (a final drain of a large backlog) could purge unchecked ones.
            "spark.sql.streaming.minBatchesToRetain": "100000",
        }
        if query.s3_prefix is not None:  # the executors find the server's credentials as the driver does
            self.ensure_s3()
            conf.update({f"spark.executorEnv.{k}": os.environ[k] for k in AWS_FILES})
        if cluster is not None:
            conf.update(cluster.driver_conf())
            conf["spark.task.maxFailures"] = "4"
            conf["spark.state.sharedLocalStore"] = "true"  # the cluster's workers run on this machine
            conf["spark.decommission.enabled"] = "true"  # an executor sent SIGPWR leaves gracefully
        if cluster is not None and dynamic:  # executors removed when idle 1 s between batches, added for the next
            conf.update(
                {
                    "spark.dynamicAllocation.enabled": "true",
                    "spark.dynamicAllocation.shuffleTracking.enabled": "true",
                    "spark.dynamicAllocation.shuffleTracking.timeout": "1s",
                    "spark.dynamicAllocation.executorIdleTimeout": "1s",
                    "spark.dynamicAllocation.schedulerBacklogTimeout": "1s",
                    "spark.dynamicAllocation.sustainedSchedulerBacklogTimeout": "1s",
                    "spark.dynamicAllocation.minExecutors": "1",
                    "spark.dynamicAllocation.initialExecutors": str(cluster.workers),
                    "spark.dynamicAllocation.maxExecutors": str(cluster.workers),
                }
            )
        conf.update(
            {
                "spark.state.parallelism": str(parallelism),
                "spark.state.store": self.store_uri(query),
                "spark.state.checkpointsRetained": str(query.retained),
                "spark.state.maxChainLength": str(query.max_chain),
                "spark.state.orphanGraceSeconds": "60",
            }
        )
        key_space = getattr(query, "key_space", MAX_PARALLELISM)  # a query of a campaign resumed from before it
        if key_space is not None:
            conf["spark.state.maxParallelism"] = str(key_space)
        if query.origin is not None:  # every start names the savepoint, as a user's code would
            conf["spark.state.fromSavepoint"] = query.origin
        if getattr(self, "memory_bound", None) is not None:
            conf["spark.state.residentMemory"] = self.memory_bound
        control = cycle_dir / "control"
        control.mkdir(parents=True, exist_ok=True)
        spec = {
            "shape": query.shape,
            "events": str(self.root / "events"),
            "checkpoint": str(checkpoint or query.checkpoint),
            "out": str(out or query.out),
            # A fork's source starts where its store's first checkpoint (the savepoint's) says.
            "starting_offsets": "checkpoint" if query.origin else {str(s): o for s, o in query.starting.items()},
            "max_records_per_batch": max_records or self.rng.choice([500, 1500, 4000]),
            "live_change": live_change,
            "trigger": "4 seconds" if dynamic else None,  # gaps in which executors idle
            "control": str(control),
            "conf": conf,
        }
        path = cycle_dir / "spec.json"
        path.write_text(json.dumps(spec))
        return path

    def start_driver(self, spec: Path, cycle_dir: Path, plan: Path | None = None, cluster=None) -> subprocess.Popen:
        env = dict(cluster.process_env() if cluster is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SITE), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env["PYSPARK_PYTHON"] = sys.executable
        env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        env.pop(FAULT_PLAN_ENV, None)
        if plan is not None:
            env[FAULT_PLAN_ENV] = str(plan)
        log = open(cycle_dir / "driver.log", "ab")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "tests.campaign.driver", str(spec)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def dump_and_kill(self, process: subprocess.Popen, cycle_dir: Path) -> None:
        """A hang: dump every thread of the driver's processes, then kill them all."""
        dumps = cycle_dir / "stacks"
        dumps.mkdir(exist_ok=True)
        for pid in session_members(process.pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "java" in command.split(" ")[0]:
                with open(dumps / f"jstack-{pid}.txt", "wb") as out:
                    subprocess.run(["jstack", str(pid)], stdout=out, stderr=subprocess.STDOUT, timeout=60)
            elif "python" in command:
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)  # let faulthandler write (to the driver log)
        self.kill(process)

    def kill(self, process: subprocess.Popen) -> None:
        if process.poll() is None:
            kill_session(process.pid)
        for pid in session_members(process.pid):  # anything that outlived its session leader
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()

    # -- one cycle -----------------------------------------------------------------------------

    def run_cycle(self, number: int, kind: str | None) -> None:
        if kind == "fork" and not self.pending:
            kind = None  # owed until a savepoint cycle made one
        if kind == "fork":
            query = self.new_query(self.pending.pop(self.rng.randrange(len(self.pending))))
        elif (
            kind in ("kill_first_offsets", "stop_before_first_batch")
            or not self.queries
            or (len(self.queries) < len(self.shapes) and number % 2 == 0)
        ):
            query = self.new_query(in_checkpoint=kind == "stop_before_first_batch")
        elif kind == "savepoint" and any(q.runs for q in self.queries):
            query = self.rng.choice([q for q in self.queries if q.runs])
        else:
            query = self.rng.choice(self.queries)
        cycle_dir = self.root / "cycles" / f"{number:04d}-{query.name}-{kind or 'none'}"
        cycle_dir.mkdir(parents=True)
        self.events.append(self.rng.randint(50, 600))
        if kind == "delete_newest_record" and not self.refusal_applies(query):
            kind = None
        if kind == "second_checkpoint" and not self.refusal_applies(query):
            kind = None
        if kind in CLUSTER and not self.cluster_cycles:
            kind = None
        self.planned[kind or "none"] += 1
        if kind in ("delete_newest_record", "second_checkpoint"):
            self.refusal(query, cycle_dir, kind)
        else:
            self.run_driver(query, cycle_dir, kind)
        query.runs += 1
        if kind == "fork":
            if json.loads((cycle_dir / "cycle.json").read_text())["exit"] == -signal.SIGKILL:
                self.run_driver(query, cycle_dir / "restart", None)  # killed while it started: start it again
                query.runs += 1
            self.check_fork_started(query, cycle_dir)
        self.check(query, cycle_dir)
        if kind == "fork" and self.rng.random() < 0.5:
            self.delete_savepoint(query, cycle_dir)

    def store_uri(self, query: Query) -> str:
        """The query's state store URI (starting the S3 server if the store is on it)."""
        return query.store_uri(self.ensure_s3() if query.s3_prefix else None)

    def storage(self, query: Query):
        """The query's state store, as the checks read it."""
        return open_storage(self.store_uri(query))

    def refusal_applies(self, query: Query) -> bool:
        """Whether the store's newest checkpoint is of a batch Spark committed (so a start must be refused)."""
        try:
            latest = ManifestReader(self.storage(query)).latest()
        except Exception:  # noqa: BLE001 - a damaged store is for the checks to report
            return False
        commits = committed_batches(query.checkpoint)
        return latest is not None and latest.binding is not None and latest.binding.batch_id in commits

    def refusal(self, query: Query, cycle_dir: Path, kind: str) -> None:
        """Delete the newest state record, or start a second checkpoint location on the store: a typed refusal."""
        storage = self.storage(query)
        latest = ManifestReader(storage).latest()
        record = manifest_path(latest.checkpoint_id)
        saved = storage.read(record)
        files_before = store_files(storage)
        if kind == "delete_newest_record":
            storage.delete(record)
            spec = self.spec(query, cycle_dir, self.rng.randint(1, self.max_parallelism))
            # An older record left: the state is behind Spark's commits. None left: Spark committed batches
            # whose state is not there at all (a different error, as typed).
            expected = "StateBehindQueryError" if ManifestReader(storage).latest() is not None else "StateMissingError"
        else:
            spec = self.spec(
                query,
                cycle_dir,
                self.rng.randint(1, self.max_parallelism),
                checkpoint=cycle_dir / "second-chk",
                out=cycle_dir / "second-out",
            )
            expected = "StateOfAnotherQueryError"
        (cycle_dir / "control" / "finish").write_text("")  # a start that is not refused ends by itself
        process = self.start_driver(spec, cycle_dir)
        try:
            code = process.wait(self.cycle_timeout)
        except subprocess.TimeoutExpired:
            self.counts["hangs"] += 1
            self.problems.append(f"{cycle_dir.name}: the refused driver did not stop within {self.cycle_timeout} s")
            self.dump_and_kill(process, cycle_dir)
            code = None
        finally:
            if kind == "delete_newest_record":
                storage.create(record, saved, overwrite=True)
        error = self.driver_error(cycle_dir)
        if code == 0 or expected not in error:
            self.problems.append(f"{cycle_dir.name}: expected {expected}, the driver exited {code}: {error[-600:]}")
        else:
            self.faults[kind] += 1
        files_after = store_files(storage)
        if kind == "second_checkpoint" and files_after != files_before:
            self.problems.append(
                f"{cycle_dir.name}: the refused query changed the store: "
                f"{sorted(set(files_after) ^ set(files_before))[:5]}"
            )

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """``spark-state ARGS`` in a new process, as an operator runs it (beside a running query)."""
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run(
            [sys.executable, "-m", "spark_state", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )

    def make_savepoint(self, query: Query, cycle_dir: Path) -> str | None:
        """``spark-state savepoint create`` on the query's store while it runs; the savepoint joins ``pending``.

        None when the store holds no checkpoint yet. Retried when the checkpoint fell out of retention while
        the record was written (the query committed past it: the command says to retry); any other failure
        is a problem."""
        name = f"sp-{cycle_dir.name.split('-')[0]}"
        for _ in range(3):
            result = self.cli("savepoint", "create", self.store_uri(query), name, "--reason", cycle_dir.name, "--json")
            if result.returncode == 0:
                created = json.loads(result.stdout)
                binding = created["binding"]
                manifest = ManifestReader(self.storage(query)).load(created["checkpoint_id"])
                self.pending.append(
                    {
                        "parent": query.name,
                        "uri": created["uri"],
                        "drained": manifest.drained,
                        "batch": binding["batch_id"] if binding is not None else None,
                    }
                )
                return created["uri"]
            if "holds no checkpoint" in result.stderr:
                return None
            if "fell out of retention" not in result.stderr:
                break
        self.problems.append(f"{cycle_dir.name}: savepoint create on {query.name} failed: {result.stderr[-400:]}")
        return None

    def check_fork_started(self, query: Query, cycle_dir: Path) -> None:
        """A fork's store holds state from its savepoint (its first checkpoint's origin names it)."""
        latest = ManifestReader(self.storage(query)).latest()
        _, name = parse_savepoint_uri(query.origin)
        if latest is not None and latest.origin is not None and latest.origin["savepoint"] == name:
            self.faults["fork"] += 1
        else:
            self.problems.append(f"{cycle_dir.name}: {query.name} did not start from savepoint {query.origin}")

    def delete_savepoint(self, fork: Query, cycle_dir: Path) -> None:
        """``spark-state savepoint delete`` of the savepoint a fork started from: the fork must not need it."""
        store, name = parse_savepoint_uri(fork.origin)
        result = self.cli("savepoint", "delete", store, name)
        if result.returncode != 0:
            self.problems.append(f"{cycle_dir.name}: savepoint delete {fork.origin} failed: {result.stderr[-400:]}")

    def driver_error(self, cycle_dir: Path) -> str:
        path = cycle_dir / "control" / "error.json"
        return json.loads(path.read_text())["message"] if path.exists() else ""

    def storage_plan(self, query: Query, cycle_dir: Path, kind: str) -> Path:
        """The fault plan of storage kind ``kind`` (``faults.storage_rule``) over this query's paths."""
        rule = storage_rule(
            kind,
            self.rng,
            store=re.escape(query.store_location()),
            out=re.escape(str(query.out)),
            events=re.escape(str(self.root / "events")),
        )
        plan = cycle_dir / "faults.json"
        plan.write_text(
            json.dumps({"timeout_seconds": STORAGE_TIMEOUT_S, "rules": [rule], "protect_session": os.getsid(0)})
        )
        return plan

    def run_driver(
        self,
        query: Query,
        cycle_dir: Path,
        kind: str | None,
        *,
        max_records: int | None = None,
        bound: float | None = None,
        rows_after_drain: bool = True,
    ) -> None:
        """One cycle of ``query``'s driver with fault ``kind``. A drain (``kind="drain"``) gets new rows right after
        its request unless not ``rows_after_drain`` (the final drains: their drained batch must end at the end of
        the log, and the query's clock may run it before rows appended after the request arrive)."""
        parallelism = self.rng.randint(1, self.max_parallelism)
        live = None
        if self.rng.random() < 0.3:
            live = [self.rng.randint(1, self.max_parallelism), self.rng.randint(1, 3)]
        cluster = self.ensure_cluster() if kind in CLUSTER else None
        if kind in PATTERNS:
            (query.checkpoint / PATTERNS[kind][0]).mkdir(parents=True, exist_ok=True)
        plan = self.storage_plan(query, cycle_dir, kind) if uses_storage_plan(kind) else None
        if kind == "fork" and self.rng.random() < 0.5:  # killed at its store's 1st-3rd file: mostly in the copy
            plan = self.storage_plan(query, cycle_dir, "kill_after_blob")
        spec = self.spec(
            query,
            cycle_dir,
            parallelism,
            live_change=live,
            cluster=cluster,
            max_records=max_records,
            dynamic=kind == "dynamic_allocation",
        )
        if kind == "stop_before_first_batch":
            spec.write_text(json.dumps({**json.loads(spec.read_text()), "stop_at_start": True}))
        before = committed_batches(query.checkpoint)
        control = cycle_dir / "control"
        started = _now()
        process = self.start_driver(spec, cycle_dir, plan, cluster)
        done = threading.Event()
        injected: list[str] = []
        first_commit: list[float] = []

        def stop() -> bool:
            return process.poll() is not None

        def appender() -> None:
            for _ in range(self.rng.randint(0, 4)):
                if done.wait(self.rng.uniform(0.5, 3.0)):
                    return
                self.events.append(self.rng.randint(20, 400))

        def watcher() -> None:
            while not stop():
                if committed_batches(query.checkpoint) - before:
                    first_commit.append(_now() - started)
                    return
                time.sleep(0.1)

        def killer(directory: str, pattern: str) -> None:
            name = wait_for_created(directory, pattern, stop)
            if name is not None and process.poll() is None:
                kill_session(process.pid)
                injected.append(name)

        threads = [threading.Thread(target=appender, daemon=True), threading.Thread(target=watcher, daemon=True)]
        if kind in PATTERNS:
            sub, pattern = PATTERNS[kind]
            threads.append(threading.Thread(target=killer, args=(str(query.checkpoint / sub), pattern), daemon=True))
        for thread in threads:
            thread.start()
        # under dynamic allocation, long enough for Spark to remove an idle executor and start another
        run_for = self.rng.uniform(25.0, 40.0) if kind == "dynamic_allocation" else self.rng.uniform(1.0, 6.0)
        deadline = started + (bound or self.cycle_timeout)
        early = self.rng.random() < 0.2  # a timed fault during start-up, else while batches run
        fault_delay = self.rng.uniform(1.0, 8.0) if early else self.rng.uniform(0.0, run_for + 2.0)
        query_started = None
        finished = False
        while process.poll() is None and _now() < deadline:
            now = _now()
            if query_started is None and (control / "started").exists():
                query_started = now
            base = started if early else query_started
            if kind == "savepoint" and not before:  # a query's first cycle: its moment counts from its first commit
                base = started + first_commit[0] if first_commit else None
            due = base is not None and now >= base + fault_delay and not injected
            if due and kind in TIMED:
                what = TIMED[kind](
                    Moment(
                        self,
                        process,
                        query,
                        cycle_dir,
                        control,
                        cluster,
                        now - base - fault_delay,
                        query_started is not None,
                    )
                )
                if what is not None:
                    injected.append(what)
            if (
                not finished
                and query_started is not None
                and base is not None
                and now >= query_started + run_for
                and (kind not in TIMED or injected or now >= max(query_started, base) + run_for + fault_delay + 3)
            ):
                done.set()
                threads[0].join()
                if kind == "drain":
                    (control / "drain").write_text("")
                    while process.poll() is None and not (control / "drain-requested").exists() and _now() < deadline:
                        time.sleep(0.1)
                    if (control / "drain-requested").exists():
                        if rows_after_drain:
                            self.events.append(self.rng.randint(5, 30))
                        injected.append("drain")
                else:
                    (control / "finish").write_text("")
                finished = True
            time.sleep(0.1)
        if process.poll() is None:
            self.counts["hangs"] += 1
            self.problems.append(
                f"{cycle_dir.name}: past the cycle bound of {self.cycle_timeout} s; stacks in "
                f"{cycle_dir}/stacks and driver.log"
            )
            self.dump_and_kill(process, cycle_dir)
        done.set()
        for thread in threads:
            thread.join()
        self.kill(process)  # reap anything left of its session
        if kind == "stop_before_first_batch" and process.returncode == 0 and not read_offsets(query.checkpoint):
            injected.append("stopped before its first batch")
        if plan is not None:
            fired = json.loads(plan.read_text()) and self._fired(plan)
            if fired:
                injected.append(fired[0]["path"])
                if kind in STORAGE:
                    self.check_typed(cycle_dir, fired[0], process.returncode)
        report = cycle_dir / "control" / "report.json"
        batches = json.loads(report.read_text())["batches"] if report.exists() else []
        for batch in batches:  # under --memory-bound: how much the bound made the instances evict and read back
            self.counts["key_groups_evicted"] += batch.get("evicted", 0)
            self.counts["key_groups_loaded"] += batch.get("loaded", 0)
        if kind == "drain" and injected:
            drained = [b["batch_id"] for b in batches if b["drained"]]
            query.drained.update(drained)
            if not drained:
                injected.clear()
        if kind == "savepoint" and injected == ["no savepoint"]:
            injected.clear()
        if kind is not None and injected and kind != "fork":  # a fork counts once it started (run_cycle)
            self.faults[kind] += 1
        elif process.returncode not in (0, None, -signal.SIGKILL):
            self.counts["unexplained_failures"] += 1
            self.problems.append(
                f"{cycle_dir.name}: the driver stopped with exit {process.returncode} and no "
                f"injected fault explains it: {self.driver_error(cycle_dir)}"
            )
        if first_commit and query.runs > 0:
            self.recoveries.append(first_commit[0])
        (cycle_dir / "cycle.json").write_text(
            json.dumps(
                {
                    "kind": kind,
                    "injected": injected,
                    "parallelism": parallelism,
                    "live_change": live,
                    "exit": process.returncode,
                    "first_commit_s": first_commit[0] if first_commit else None,
                }
            )
        )

    def _fired(self, plan: Path) -> list[dict]:
        counters = Path(f"{plan}.d")
        if not counters.is_dir():
            return []
        return [json.loads((counters / n).read_text()) for n in sorted(os.listdir(counters)) if n.startswith("fired-")]

    def check_typed(self, cycle_dir: Path, fired: dict, code: int | None) -> None:
        """A storage fault must surface as a typed error naming the path (in the driver or a task's failure)."""
        text = (cycle_dir / "driver.log").read_text(errors="replace")
        relative = fired["path"].rsplit("/state/", 1)[-1].rsplit("/out/", 1)[-1].rsplit("/events/", 1)[-1]
        typed = any(f"{name}: " in text for name in TYPED_ERRORS) or any(
            phrase in text for phrase in ("injected fault", "did not finish within", "No space left on device")
        )
        if not typed or relative not in text:
            self.counts["untyped_faults"] += 1
            self.problems.append(
                f"{cycle_dir.name}: fault {fired} did not surface as a typed error naming "
                f"{relative!r} (driver exit {code})"
            )

    def python_process(self, session: int, role: str) -> int | None:
        """A random Python ``worker`` or instance ``host`` of the driver's session running now, if any.

        All are forks of Spark's Python daemon (their command line is its):
        a daemon is one whose parent is another process of the session (the
        JVM), a worker is a daemon's child, and a host is any other (a
        worker's child, or an orphan, its parent outside the session, once
        its worker died).
        """
        chosen = self._python_processes(session)[role]
        return self.rng.choice(chosen) if chosen else None

    def busy_host(self, session: int, watch_s: float = 0.5) -> int | None:
        """An instance host of the driver's session seen running (in a task) within ``watch_s``, if any: an
        idle host sleeps in ``accept``, a task's restore, apply and checkpoint run."""
        hosts = self._python_processes(session)["host"]
        deadline = time.monotonic() + watch_s
        while hosts and time.monotonic() < deadline:
            running = [pid for pid in hosts if _process_state(pid) == "R"]
            if running:
                return self.rng.choice(running)
            time.sleep(0.002)
        return None

    @staticmethod
    def _python_processes(session: int) -> dict[str, list[int]]:
        """``python_roles`` of the session's processes now."""
        parents, members = {}, set(session_members(session))
        for pid in members:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if b"pyspark.daemon" in command:
                parents[pid] = parent
        return python_roles(parents, members)

    def ensure_s3(self):
        """The campaign's S3 server (started on first use, and again after a resume, on the same ports and data)."""
        if self.s3 is None:
            from tests.s3_server import SeaweedS3

            state = getattr(self, "s3_state", None)
            (self.root / "s3").mkdir(parents=True, exist_ok=True)
            self.s3 = SeaweedS3(self.root / "s3")
            if state is not None:
                self.s3.__dict__.update(state)
            self.s3.start()
            self.s3_state = {k: v for k, v in self.s3.__dict__.items() if k != "_proc"}
            os.environ.update({name: str(self.root / "s3" / f"aws-{name.lower()}") for name in AWS_FILES})
            self.s3.write_aws_files(
                Path(os.environ["AWS_CONFIG_FILE"]), Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"])
            )
            self.s3.create_bucket(S3_BUCKET)
        return self.s3

    def ensure_cluster(self):
        if self.cluster is None:
            from tests.cluster import StandaloneCluster

            self.cluster = StandaloneCluster(self.root / "cluster", workers=2).start()
        return self.cluster

    def executor(self, cluster) -> int | None:
        from tests.cluster import _descendants

        found = []
        for _, proc in cluster._procs:
            for pid, _ in _descendants(proc.pid):
                try:
                    if b"CoarseGrainedExecutorBackend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        found.append(pid)
                except OSError:
                    continue
        return self.rng.choice(found) if found else None

    # -- checks --------------------------------------------------------------------------------

    def check(self, query: Query, cycle_dir: Path) -> None:
        problems = self.events.verify(
            since=None
            if len(self.queries) and self.counts["cycles"] % 10 == 0
            else {s: max(0, n - 2000) for s, n in self.events.end_offsets().items()}
        )
        self.problems.extend(f"{cycle_dir.name}: events log: {p}" for p in problems)
        self.counts["log_problems"] += len(problems)
        self.counts["cycles"] += 1
        try:
            self.record_drains(query)
            self.check_batches(query, cycle_dir.name)
            self.check_store(query, cycle_dir.name)
        except Exception as exc:  # noqa: BLE001 - a check that cannot even read is a finding
            self.counts["wrong"] += 1
            self.problems.append(f"{cycle_dir.name}: checking {query.name} failed: {type(exc).__name__}: {exc}")

    def record_drains(self, query: Query) -> None:
        reader = ManifestReader(self.storage(query))
        latest = reader.latest()
        if latest is None:
            return
        for checkpoint_id in latest.consistent_checkpoints:
            manifest = reader.load(checkpoint_id)
            if (
                manifest.drained
                and manifest.binding is not None
                and manifest.binding.checkpoint_location == str(query.checkpoint)
            ):
                query.drained.add(manifest.binding.batch_id)

    def read_sink(self, query: Query, where: str) -> None:
        """New commits of the query's sink: rows per batch id; a batch id twice is a duplicate."""
        if not (query.out / "_log.json").exists():
            return
        log = ReplayableLog.open(open_storage(str(query.out)))
        while True:
            body = log.commits.load_if_exists(query.sink_commits)
            if body is None:
                return
            commit = Commit.from_json(body, log.commits.where(query.sink_commits))
            query.sink_commits += 1
            if commit.sink is None or commit.sink.sink_id != query.sink_id:
                continue
            rows = []
            for ref in commit.segments:
                rows.extend(sink_rows(query.shape, log.load_segment(ref)))
            if commit.sink.batch in query.sink:
                self.counts["duplicated"] += 1
                self.problems.append(f"{where}: {query.name} sink holds batch {commit.sink.batch} twice")
                continue
            if commit.sink.batch < query.next_batch:  # checked as empty, written later
                self.counts["wrong"] += 1
                self.problems.append(
                    f"{where}: {query.name} sink wrote batch {commit.sink.batch} after Spark committed it"
                )
                continue
            query.sink[commit.sink.batch] = sorted(rows)

    def check_batches(self, query: Query, where: str) -> None:
        self.read_sink(query, where)
        offsets = read_offsets(query.checkpoint)
        commits = committed_batches(query.checkpoint)
        # Spark keeps the offsets of its last spark.sql.streaming.minBatchesToRetain (100) batches only: a batch
        # below next_batch was checked while its offsets were there.
        stray = [b for b in query.sink if b >= query.next_batch and b not in offsets]
        if stray:
            self.counts["wrong"] += len(stray)
            self.problems.append(f"{where}: {query.name} sink holds batches {stray} Spark never planned")
            for b in stray:
                del query.sink[b]
        while query.next_batch in offsets and query.next_batch in commits:
            batch = query.next_batch
            end, processing_ms = offsets[batch]
            start = offsets[batch - 1][0] if batch > 0 else query.starting
            events = self.events.events_between(start, end)
            expected = query.model.batch(events, processing_ms, batch in query.drained)
            actual = query.sink.get(batch, [])
            self.counts["batches_checked"] += 1
            self.keys_checked.update(row[0] for row in expected)
            if actual != expected:
                missing = Counter(expected) - Counter(actual)
                extra = Counter(actual) - Counter(expected)
                duplicate = {row: n for row, n in extra.items() if row in Counter(expected)}
                if duplicate and not missing and len(duplicate) == len(extra):
                    self.counts["duplicated"] += 1
                elif missing and not extra:
                    self.counts["lost"] += 1
                else:
                    self.counts["wrong"] += 1
                self.problems.append(
                    f"{where}: {query.name} batch {batch}: {len(missing)} rows missing "
                    f"(e.g. {list(missing)[:2]}), {len(extra)} unexpected (e.g. {list(extra)[:2]})"
                )
            query.next_batch += 1

    def check_store(self, query: Query, where: str) -> None:
        storage = self.storage(query)
        reader = ManifestReader(storage)
        latest = reader.latest()
        if latest is None:
            return
        pinned = Savepoints(storage).pinned()  # what savepoints pin must stay loadable and intact too
        for checkpoint_id in sorted(set(latest.consistent_checkpoints) | pinned):
            manifest = reader.load(checkpoint_id)
            for component in manifest.components.values():
                refs = [(b.path, b.size, b.crc32) for b in component.blobs.values()]
                refs += [(i.path, i.size, i.crc32) for i in component.instance_items.values()]
                for path, size, crc in refs:
                    data = storage.read(path)
                    if len(data) != size or zlib.crc32(data) != crc:
                        self.counts["corrupt_commits"] += 1
                        self.problems.append(
                            f"{where}: {query.name} checkpoint {checkpoint_id} references {path}, "
                            "which does not match its recorded size and CRC-32"
                        )

    def final_state(self, query: Query) -> dict:
        storage = self.storage(query)
        latest = ManifestReader(storage).latest()
        component = latest.components[query.shape]
        state, _ = restore_instance(
            BlobStore(storage), component, component.keyed_schema, 0, 1, component.max_parallelism
        )
        return {key[0]: value for _, key, value in state.table.items(0)}

    # -- the whole campaign --------------------------------------------------------------------

    STATE = "campaign-state.pickle"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "cluster": None, "s3": None}

    def save(self) -> None:
        """Everything the next cycle needs, so ``--resume`` continues this run in another process."""
        path = self.root / self.STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(self))
        os.replace(tmp, path)

    @classmethod
    def resume(cls, root: Path) -> Campaign:
        """The run saved in ``root``; appends of a cycle interrupted after the save are taken into the record
        (that cycle runs again, with fresh choices)."""
        campaign = pickle.loads((root / cls.STATE).read_bytes())
        campaign.__dict__.setdefault("use_s3", False)  # a run saved before --s3 existed
        campaign.__dict__.setdefault("use_savepoints", False)  # ... or --savepoints
        campaign.__dict__.setdefault("pending", [])
        campaign.__dict__.setdefault("memory_bound", None)
        campaign.s3 = None
        campaign.stop_requested = False
        campaign.resumes = getattr(campaign, "resumes", 0) + 1
        taken = campaign.events.reconcile()
        if taken:
            print(f"resume: {taken} appends of an interrupted cycle taken into the record", file=sys.stderr)
        return campaign

    def run(self, progress: Path | None = None) -> dict:
        """The cycles not run yet, then the final drains; the summary. ``progress`` is rewritten after every cycle."""
        started = _now() - self.elapsed
        try:
            for number, kind in enumerate(self.schedule):
                if number < self.done:
                    continue
                if kind is None and self.owed:
                    kind = self.owed.pop(0)
                injected_before = self.faults[kind] if kind else 0
                self.run_cycle(number, kind)
                if kind and self.faults[kind] == injected_before:
                    self.owed.append(kind)
                self.done = number + 1
                self.elapsed = _now() - started
                self.save()
                if self.stop_requested:
                    print(f"stopped after cycle {number}: continue with --resume {self.root}", file=sys.stderr)
                    return {**self.summary(_now() - started), "complete": False}
                print(
                    f"cycle {number}: {kind or 'none'}; faults so far {sum(self.faults.values())}, "
                    f"problems {len(self.problems)}",
                    file=sys.stderr,
                    flush=True,
                )
                if progress is not None:
                    progress.write_text(json.dumps({**self.summary(_now() - started), "complete": False}) + "\n")
            for query in self.queries:
                self.finish(query)
        finally:
            if self.cluster is not None:
                self.cluster.stop()
            if self.s3 is not None:
                self.s3.stop()
        return {**self.summary(_now() - started), "complete": True}

    def finish(self, query: Query) -> None:
        """Drain the query over the whole log, then compare its stored state with the model's."""
        for attempt in range(3):
            cycle_dir = self.root / "cycles" / f"final-{query.name}-{attempt}"
            cycle_dir.mkdir(parents=True)
            # The whole backlog of a query last run long ago, in the largest batches, within a bound that grows
            # with it: a drain that keeps committing batches is not a hang.
            offsets = read_offsets(query.checkpoint)
            done = offsets[query.next_batch - 1][0] if query.next_batch - 1 in offsets else query.starting
            backlog = sum(self.events.end_offsets().values()) - sum(done.values())
            self.run_driver(
                query,
                cycle_dir,
                "drain",
                max_records=FINAL_DRAIN_RECORDS,
                bound=self.cycle_timeout + backlog / FINAL_DRAIN_EVENTS_PER_S,
                rows_after_drain=False,
            )
            self.faults["drain"] -= 1 if json.loads((cycle_dir / "cycle.json").read_text())["injected"] else 0
            query.runs += 1
            self.check(query, cycle_dir)
            if query.drained and max(query.drained) == query.next_batch - 1:
                break
        else:
            self.problems.append(f"{query.name}: the final drain did not happen")
            return
        if (
            query.next_batch - 1 not in query.drained
            or self.events.end_offsets() != read_offsets(query.checkpoint)[query.next_batch - 1][0]
        ):
            self.problems.append(f"{query.name}: the drained batch does not end at the end of the log")
            return
        stored = self.final_state(query)
        expected = query.model.state()
        if query.shape == "sessions":
            expected = {}
        self.keys_checked.update(expected)
        self.counts["states_checked"] += 1
        if stored != expected:
            self.counts["wrong"] += 1
            diff = sorted(set(stored.items()) ^ set(expected.items()), key=repr)[:4]
            self.problems.append(
                f"{query.name}: final state differs from the model ({len(stored)} vs {len(expected)} keys), e.g. {diff}"
            )

    def kinds(self) -> list[str]:
        """The fault kinds this run may inject."""
        kinds = [k for k in FAULT_KINDS if self.cluster_cycles or k not in CLUSTER]
        return kinds + list(SAVEPOINT_KINDS) if getattr(self, "use_savepoints", False) else kinds

    def command(self) -> str:
        """The command that runs this campaign's schedule from the start."""
        options = [f"--cycles {len(self.schedule)}", f"--seed {self.seed}"]
        options += [] if self.cluster_cycles else ["--no-cluster"]
        options += [] if self.max_parallelism == 9 else [f"--max-parallelism {self.max_parallelism}"]
        options += [] if self.shapes == SHAPES else [f"--shapes {','.join(self.shapes)}"]
        kinds = getattr(self, "explicit_kinds", None)
        options += [] if kinds is None else [f"--kinds {','.join(kinds)}"]
        options += ["--s3"] if getattr(self, "use_s3", False) else []
        options += ["--savepoints"] if getattr(self, "use_savepoints", False) else []
        bound = getattr(self, "memory_bound", None)
        options += [] if bound is None else [f"--memory-bound {bound}"]
        return "./run campaign " + " ".join(options)

    def summary(self, elapsed: float) -> dict:
        return {
            "command": self.command(),
            "seed": self.seed,
            "scheduled_cycles": len(self.schedule),
            "cycles": self.counts["cycles"],
            "resumes": getattr(self, "resumes", 0),
            "queries": len(self.queries),
            "queries_on_s3": sum(1 for q in self.queries if getattr(q, "s3_prefix", None)),
            "queries_forked": sum(1 for q in self.queries if getattr(q, "origin", None)),
            "queries_default_key_space": sum(
                1 for q in self.queries if getattr(q, "key_space", MAX_PARALLELISM) is None
            ),
            "memory_bound": getattr(self, "memory_bound", None),
            "key_groups_evicted": self.counts["key_groups_evicted"],
            "key_groups_loaded_back": self.counts["key_groups_loaded"],
            "fault_kinds": self.kinds(),
            "faults": {k: n for k, n in sorted(self.faults.items()) if n},
            "batches_checked": self.counts["batches_checked"],
            "keys_checked": len(self.keys_checked),
            "states_checked": self.counts["states_checked"],
            "wrong": self.counts["wrong"],
            "lost": self.counts["lost"],
            "duplicated": self.counts["duplicated"],
            "hangs": self.counts["hangs"],
            "untyped_faults": self.counts["untyped_faults"],
            "unexplained_failures": self.counts["unexplained_failures"],
            "corrupt_commits": self.counts["corrupt_commits"],
            "log_problems": self.counts["log_problems"],
            "longest_recovery_s": round(max(self.recoveries), 1) if self.recoveries else None,
            "events": sum(self.events.end_offsets().values()),
            "elapsed_s": round(elapsed),
            "problems": self.problems[:50],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run campaign", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", type=Path, default=None, help="working directory (default: a fresh temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the summary JSON here")
    parser.add_argument("--cycle-timeout", type=float, default=240.0)
    parser.add_argument("--max-parallelism", type=int, default=9)
    parser.add_argument("--no-cluster", action="store_true", help="skip the executor kills on a standalone cluster")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"query shapes to use, of {','.join(SHAPES)}")
    parser.add_argument(
        "--kinds", default=None, help="the fault kind of each cycle, comma-separated ('none' for none); default: random"
    )
    parser.add_argument(
        "--s3",
        action="store_true",
        help="keep every other new query's state store on a SeaweedFS S3 server on loopback",
    )
    parser.add_argument(
        "--savepoints",
        action="store_true",
        help="also create savepoints while queries run and fork new queries from them",
    )
    parser.add_argument(
        "--memory-bound",
        default=None,
        metavar="SIZE",
        help="run every query with spark.state.residentMemory=SIZE (e.g. 1m: constant evictions)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="ROOT",
        help="continue the run whose working directory is ROOT after its last finished cycle",
    )
    args = parser.parse_args(argv)
    if args.resume is not None:
        campaign = Campaign.resume(args.resume.resolve())
    else:
        if args.root is None:
            import tempfile

            args.root = Path(tempfile.mkdtemp(prefix="campaign-"))
        campaign = Campaign(
            args.root.resolve(),
            args.seed,
            args.cycles,
            args.cycle_timeout,
            cluster_cycles=not args.no_cluster,
            max_parallelism=args.max_parallelism,
            shapes=tuple(args.shapes.split(",")),
            kinds=args.kinds.split(",") if args.kinds else None,
            s3=args.s3,
            savepoints=args.savepoints,
            memory_bound=args.memory_bound,
        )

    def stop(*_) -> None:
        """First SIGTERM: finish the cycle, save, stop (resumable). Second: stop now (the cluster too)."""
        if campaign.stop_requested:
            sys.exit(143)
        campaign.stop_requested = True

    signal.signal(signal.SIGTERM, stop)
    progress = None
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        progress = args.out.with_name(args.out.stem + ".progress.json")
    summary = campaign.run(progress)
    line = json.dumps(summary, sort_keys=False)
    print(line, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    if not summary.get("complete", True):
        return 2
    failed = any(summary[k] for k in PROBLEM_COUNTS) or summary["problems"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
