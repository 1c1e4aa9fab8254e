"""Configuration through ``spark.conf``, parsed once on the driver into a frozen dataclass.

=====================================  ==========================  =====================================================
key                                    default                     meaning
=====================================  ==========================  =====================================================
``spark.state.store``                  ``<checkpointLocation>/``   where checkpoints live: a path or ``file://`` URI
                                       ``state``                   (local disk), ``webhdfs://host:port/path``,
                                                                   ``s3://bucket/prefix`` (``default_store``)
``spark.state.parallelism``            ``spark.sql.shuffle.``      number of instances; read again at every micro-batch,
                                       ``partitions``              so it may change between batches and restarts
``spark.state.maxParallelism``         the store's; new: 1024, or  the key space; fixed by the first checkpoint, a
                                       32 x the parallelism        different value is refused on restore; unset: the
                                                                   store's, for a new store the power of two giving each
                                                                   instance >= 32 key groups, at least 1024
                                                                   (``keygroups.default_max_parallelism``)
``spark.state.checkpointsRetained``    3                           committed checkpoints kept (>= 2: a replayed batch
                                                                   recomputes from the one before it)
``spark.state.maxChainLength``         8                           compaction: a key group's chain of entries is
                                                                   compacted at this length at the latest, spread
                                                                   over batches from half of it: into a merge entry
                                                                   of the keys changed since its full entry, or one
                                                                   full entry (``chains``)
``spark.state.compression``            ``none``                    Arrow IPC codec of state blobs: none, lz4, zstd
``spark.state.s3.endpoint``            the AWS chain               an ``s3://`` store's endpoint (S3-compatible stores)
``spark.state.s3.region``              the AWS chain               an ``s3://`` store's signing region
``spark.state.s3.pathStyle``           the AWS config file         ``true``: path-style addressing
``spark.state.s3.profile``             the default chain           a profile of the AWS config and credentials files
``spark.state.s3.retrySeconds``        30                          how long transient S3 failures are retried
``spark.state.fromSavepoint``          (none)                      ``<store>/savepoints/<name>``: start an empty store
                                                                   from that savepoint (``startfrom``)
``spark.state.allowNonRestoredState``  ``false``                   with ``fromSavepoint``: drop savepoint state the
                                                                   query does not continue, start new components empty
``spark.state.orphanGraceSeconds``     3600                        unreferenced blobs and items (of failed, retried or
                                                                   zombie attempts) are deleted once this old (listed
                                                                   at most 60 times per grace period)
``spark.state.restoreFrom``            unset                       recovery: a new checkpointLocation starts from this
                                                                   retained checkpoint id instead of the latest
``spark.state.sharedLocalStore``       ``false``                   ``true``: the local store path is one shared
                                                                   filesystem mounted at the same place on every
                                                                   executor (NFS, or a cluster on this one machine)
``spark.state.instanceHosts``          ``true``                    each instance's state lives in one process per
                                                                   executor that every task of the instance uses
                                                                   (``hosts``); ``false``: in the Python worker that
                                                                   runs the task (reloaded when Spark picks another)
``spark.state.residentMemory``         local master: no bound;     bound on the query's keyed state kept in memory per
                                       else from Spark's memory    executor between batches (``512m``, ``4g``, bytes),
                                       settings (``default_``      shared equally by its instance hosts there; least
                                       ``resident_memory``)        recently used key groups are evicted and read again
                                                                   when touched (components without timers;
                                                                   ``resident``); ``none``: no bound
``spark.state.clock``                  ``true``                    a new query joins a clock source (``datasources.
                                                                   clock``): due timers, expiries and drains run a
                                                                   batch on an idle source; read at a query's first
                                                                   start (its checkpoint keeps the sources it began
                                                                   with)
``spark.state.clockPollSeconds``       1                           how often the clock reads the store for the next
                                                                   wake-up and drain requests (> 0)
``spark.state.planAccelerator``        ``true``                    a batch's plan made with Catalyst internals over
                                                                   py4j where the session has them (``spark.plan``),
                                                                   17-45 ms less per batch; ``false``: PySpark's
                                                                   public calls only
=====================================  ==========================  =====================================================

The ``spark.state.s3.*`` settings apply to an ``s3://`` store only; they are
added to the store URI as parameters (``storage.s3_location``), because
executors open the store from its URI alone. Credentials are never settings:
every process takes them from the standard AWS chain (environment, config
and credentials files, instance or container role).

The store must be reachable from every executor: a local path (or
``memory://``) is refused on a non-local master (``check_store_reachable``)
unless ``spark.state.sharedLocalStore`` says the path is a shared mount.

Spark hands options over as strings: ``StateConf.parse`` converts them once
and raises ``ConfigError`` naming the key, the value and the valid range.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from spark_state.errors import ConfigError
from spark_state.keyspace import UPPER_BOUND_MAX_PARALLELISM, default_max_parallelism
from spark_state.storage import s3_location

PREFIX = "spark.state."
STORE = PREFIX + "store"
PARALLELISM = PREFIX + "parallelism"
MAX_PARALLELISM = PREFIX + "maxParallelism"
RETAINED = PREFIX + "checkpointsRetained"
MAX_CHAIN_LENGTH = PREFIX + "maxChainLength"
COMPRESSION = PREFIX + "compression"
S3_PREFIX = PREFIX + "s3."
S3_KEYS = {S3_PREFIX + setting: parameter for parameter, setting in s3_location.PARAMETERS.items()}
"""``spark.state.s3.*`` key -> the store URI parameter it supplies."""
FROM_SAVEPOINT = PREFIX + "fromSavepoint"
ALLOW_NON_RESTORED = PREFIX + "allowNonRestoredState"
ORPHAN_GRACE = PREFIX + "orphanGraceSeconds"
RESTORE_FROM = PREFIX + "restoreFrom"
SHARED_LOCAL_STORE = PREFIX + "sharedLocalStore"
INSTANCE_HOSTS = PREFIX + "instanceHosts"
RESIDENT_MEMORY = PREFIX + "residentMemory"
CLOCK = PREFIX + "clock"
CLOCK_POLL = PREFIX + "clockPollSeconds"
PLAN_ACCELERATOR = PREFIX + "planAccelerator"
KNOWN_KEYS = (
    STORE,
    PARALLELISM,
    MAX_PARALLELISM,
    RETAINED,
    MAX_CHAIN_LENGTH,
    COMPRESSION,
    FROM_SAVEPOINT,
    ALLOW_NON_RESTORED,
    ORPHAN_GRACE,
    RESTORE_FROM,
    SHARED_LOCAL_STORE,
    INSTANCE_HOSTS,
    RESIDENT_MEMORY,
    CLOCK,
    CLOCK_POLL,
    PLAN_ACCELERATOR,
    *S3_KEYS,
)
COMPRESSIONS = ("none", "lz4", "zstd")
RUN_PREFIX = PREFIX + "run."
"""``spark.state.run.<run id>.parallelism``: the parallelism ``StatefulQuery.set_parallelism`` chose for one run
of a query over Spark Connect, where the driver's part of its batches runs in the server's Python process and
reads the client's session conf (``run_parallelism_key``)."""


def run_parallelism_key(run_id: str) -> str:
    """The setting through which ``set_parallelism`` reaches run ``run_id``'s batches over Spark Connect."""
    return f"{RUN_PREFIX}{run_id}.parallelism"


def check_known(keys: Iterable[str]) -> None:
    """Raise ``ConfigError`` for a ``spark.state.*`` key this version does not know (a typo is never ignored)."""
    unknown = sorted(k for k in keys if k.startswith(PREFIX) and k not in KNOWN_KEYS and not _is_run_parallelism(k))
    if unknown:
        names = {k[len(PREFIX) :].lower(): k for k in KNOWN_KEYS}
        hints = []
        for key in unknown:
            match = difflib.get_close_matches(key[len(PREFIX) :].lower(), names, 1, cutoff=0.75)
            hints.append(f"{key} (did you mean {names[match[0]]}?)" if match else key)
        raise ConfigError(f"unknown setting(s) {', '.join(hints)}; the settings are: {', '.join(KNOWN_KEYS)}")


def _int(key: str, text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not an integer; set it to a whole number >= {low}") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{key}={value} is out of range; set it {bound}")
    return value


def _seconds(key: str, text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a number of seconds; set it to a number > 0, like 0.5") from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{key}={text!r} is out of range; set it to a number of seconds > 0, like 0.5")
    return value


MIN_RESIDENT_MEMORY = 64 << 10
"""The smallest memory bound accepted: a smaller number is a size written without its unit."""
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
}


def parse_bytes(key: str, text: str) -> int:
    """A size as Spark writes it (``512m``, ``4g``, ``1048576``; binary units, case-insensitive), in bytes."""
    cleaned = str(text).strip().lower()
    digits = cleaned.rstrip("kmgtb")
    unit = cleaned[len(digits) :]
    if not digits.isdigit() or unit not in _BYTE_UNITS:
        raise ConfigError(f"{key}={text!r} is not a size; write it as bytes or with a unit, like 512m or 4g")
    value = int(digits) * _BYTE_UNITS[unit]
    if value < MIN_RESIDENT_MEMORY:
        raise ConfigError(
            f"{key}={text!r} is below 64k, which is surely a missing unit; write the unit (512m, "
            "4g), or unset it for no bound"
        )
    return value


@dataclass(frozen=True)
class StateConf:
    """Validated settings of one stateful query (see the module docstring for the keys)."""

    store: str
    parallelism: int
    max_parallelism: int | None = None
    """The key space when set; None: the store's, or ``default_max_parallelism`` for a new store (``key_space``)."""
    checkpoints_retained: int = 3
    max_chain_length: int = 8
    compression: str | None = None
    from_savepoint: str | None = None
    allow_non_restored: bool = False
    orphan_grace_seconds: int = 3600
    restore_from: int | None = None
    shared_local_store: bool = False
    instance_hosts: bool = True
    resident_memory: int | None = None
    clock: bool = True
    clock_poll_seconds: float = 1.0
    plan_accelerator: bool = True

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError(f"{STORE} is empty; set it to a path, a webhdfs:// or an s3:// URI")
        if self.max_parallelism is not None and not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            raise ConfigError(
                f"{MAX_PARALLELISM}={self.max_parallelism} is out of range; set it between 1 and "
                f"{UPPER_BOUND_MAX_PARALLELISM}"
            )
        self.key_space(None)  # the parallelism fits the key space when it is set
        if self.checkpoints_retained < 2:
            raise ConfigError(f"{RETAINED}={self.checkpoints_retained} must be >= 2")
        if self.max_chain_length < 1:
            raise ConfigError(f"{MAX_CHAIN_LENGTH}={self.max_chain_length} must be >= 1")

    def key_space(self, stored: int | None) -> int:
        """The key space this query runs with: the setting, else ``stored`` (the store's), else a new store's default.

        Raises ``ConfigError`` when the parallelism exceeds it (the key space
        cannot be split finer); a setting that differs from ``stored`` is
        refused later, with the restore (``manifest.check_compatible``).
        """
        if self.max_parallelism is not None:
            space, source = self.max_parallelism, f"{MAX_PARALLELISM}={self.max_parallelism}"
        elif stored is not None:
            space, source = stored, f"the key space of the store, {stored} (fixed when it was created)"
        else:
            space, source = UPPER_BOUND_MAX_PARALLELISM, f"{UPPER_BOUND_MAX_PARALLELISM}, the largest key space"
        if not 1 <= self.parallelism <= space:
            raise ConfigError(
                f"{PARALLELISM}={self.parallelism} must be between 1 and {source}; lower the parallelism (the key "
                "space cannot be split finer)"
            )
        if self.max_parallelism is None and stored is None:
            return default_max_parallelism(self.parallelism)
        return space

    @classmethod
    def parse(
        cls,
        get: Callable[[str], str | None],
        *,
        default_store: str | Callable[[], str],
        default_parallelism: int,
    ) -> StateConf:
        """Build from a lookup like ``lambda k: spark.conf.get(k, None)``; unset keys take defaults.

        ``default_store`` may be a function, called only when the store is not set.
        """

        def value(key: str) -> str | None:
            text = get(key)
            return None if text is None or str(text).strip() == "" else str(text).strip()

        def flag(key: str, default: str = "false") -> bool:
            text = (value(key) or default).lower()
            if text not in ("true", "false"):
                raise ConfigError(f"{key}={text!r} is not true or false")
            return text == "true"

        compression = (value(COMPRESSION) or "none").lower()
        if compression not in COMPRESSIONS:
            raise ConfigError(f"{COMPRESSION}={compression!r} is not one of {', '.join(COMPRESSIONS)}")
        max_parallelism = (
            _int(MAX_PARALLELISM, text, 1, UPPER_BOUND_MAX_PARALLELISM) if (text := value(MAX_PARALLELISM)) else None
        )
        store = value(STORE) or (default_store() if callable(default_store) else default_store)
        return cls(
            store=_with_s3_settings(store, {parameter: value(key) for key, parameter in S3_KEYS.items()}),
            parallelism=_int(PARALLELISM, text, 1) if (text := value(PARALLELISM)) else default_parallelism,
            max_parallelism=max_parallelism,
            checkpoints_retained=_int(RETAINED, text, 2) if (text := value(RETAINED)) else 3,
            max_chain_length=_int(MAX_CHAIN_LENGTH, text, 1) if (text := value(MAX_CHAIN_LENGTH)) else 8,
            compression=None if compression == "none" else compression,
            from_savepoint=value(FROM_SAVEPOINT),
            allow_non_restored=flag(ALLOW_NON_RESTORED),
            orphan_grace_seconds=_int(ORPHAN_GRACE, text, 0) if (text := value(ORPHAN_GRACE)) else 3600,
            restore_from=_int(RESTORE_FROM, text, 0) if (text := value(RESTORE_FROM)) else None,
            shared_local_store=flag(SHARED_LOCAL_STORE),
            instance_hosts=flag(INSTANCE_HOSTS, "true"),
            resident_memory=(
                parse_bytes(RESIDENT_MEMORY, text)
                if (text := value(RESIDENT_MEMORY)) and text.lower() != UNBOUNDED
                else None
            ),
            clock=flag(CLOCK, "true"),
            clock_poll_seconds=_seconds(CLOCK_POLL, text) if (text := value(CLOCK_POLL)) else 1.0,
            plan_accelerator=flag(PLAN_ACCELERATOR, "true"),
        )

    @classmethod
    def from_mapping(cls, conf: Mapping[str, str], **defaults) -> StateConf:
        """``parse`` over a plain dict (tests, scripts); unknown ``spark.state.*`` keys are refused."""
        check_known(conf)
        return cls.parse(conf.get, **defaults)

    @classmethod
    def from_session(
        cls, session: Any, *, default_store: str | Callable[[], str], run_id: str | None = None
    ) -> StateConf:
        """``parse`` over a Spark session's conf; unknown ``spark.state.*`` keys are refused.

        The parallelism defaults to ``spark.sql.shuffle.partitions``; the
        memory bound to ``default_resident_memory`` of Spark's settings.
        With ``run_id``, ``run_parallelism_key(run_id)`` overrides the
        parallelism where set.
        """
        every = _settings(session)
        settings = {key: value for key, value in every.items() if key.startswith(PREFIX)}
        check_known(settings)
        partitions = every.get(SHUFFLE_PARTITIONS) or session.conf.get(SHUFFLE_PARTITIONS, "200")
        conf = cls.parse(settings.get, default_store=default_store, default_parallelism=int(partitions))
        override = settings.get(run_parallelism_key(run_id)) if run_id is not None else None
        if override is not None:
            conf = replace(conf, parallelism=_int(PARALLELISM, override.strip(), 1))
        if conf.resident_memory is None and not settings.get(RESIDENT_MEMORY, "").strip():
            master = every.get("spark.master") or session_master(session)
            derived = default_resident_memory(every, master)
            if derived is not None:
                conf = replace(conf, resident_memory=derived)
        return conf


SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"

UNBOUNDED = "none"
"""``spark.state.residentMemory=none``: no bound, on any master."""

STATE_SHARE_OF_PYTHON_MEMORY = 0.5
"""The share of an executor's Python memory (``default_resident_memory``) its hosts keep state in; the rest is
for the Python workers, the rows in flight and the hosts' own interpreters."""


def default_resident_memory(settings: Mapping[str, str], master: str) -> int | None:
    """The memory bound per executor when ``spark.state.residentMemory`` is unset: None on a ``local`` master (one
    machine, the driver's, bounded by nothing Spark sets), else ``STATE_SHARE_OF_PYTHON_MEMORY`` of the memory
    Spark gives the executor's Python processes: ``spark.executor.pyspark.memory`` where set, else its memory
    overhead, which YARN and Kubernetes count the Python processes against (``spark.executor.memoryOverhead``, or
    ``spark.executor.memoryOverheadFactor`` (0.1) of ``spark.executor.memory`` (1g), at least 384m: Spark's
    defaults)."""
    if str(master).startswith("local"):
        return None

    def size(key: str, unit: str = "m") -> int | None:
        text = str(settings.get(key) or "").strip()
        if not text:
            return None
        return parse_bytes(key, text + unit if text.isdigit() else text)  # Spark reads a bare number as MiB

    python = size("spark.executor.pyspark.memory")
    if python is None:
        python = size("spark.executor.memoryOverhead")
    if python is None:
        executor = size("spark.executor.memory") or (1 << 30)
        try:
            factor = float(settings.get("spark.executor.memoryOverheadFactor") or 0.1)
        except ValueError:
            factor = 0.1
        python = max(384 << 20, int(factor * executor))
    return max(MIN_RESIDENT_MEMORY, int(STATE_SHARE_OF_PYTHON_MEMORY * python))


def _is_run_parallelism(key: str) -> bool:
    return key.startswith(RUN_PREFIX) and key.endswith(".parallelism")


def session_master(session: Any) -> str:
    """The session's master (``local[2]``, ``spark://...``): its context's on a classic session, its
    ``spark.master`` setting over Spark Connect (which has no context)."""
    if getattr(session, "_jsparkSession", None) is not None:
        return session.sparkContext.master
    return session.conf.get("spark.master", None) or "local"


def checkpoint_storage_uri(location: str, get: Callable[[str], str | None] = lambda key: None) -> str | None:
    """The storage URI through which Spark's checkpoint at ``location`` (qualified: ``file:/path``,
    ``webhdfs://...``, ``s3a://...``) is read (``spark.checkpoint.StoredFiles``), None where spark-state has no
    backend for its scheme. An ``s3``/``s3a`` location takes the ``spark.state.s3.*`` settings that ``get``
    returns, as the store does (Hadoop's ``fs.s3a.*`` are the JVM's, which Spark Connect's clients do not see)."""
    location = location.rstrip("/")
    scheme = location.split(":", 1)[0].lower() if ":" in location else ""
    if scheme in ("", "file"):
        path = location[len("file:") :] if scheme else location
        path = "/" + path.lstrip("/") if path.startswith("//") else path
        return path if path.startswith("/") else None
    if scheme == "webhdfs":
        return location
    if scheme in s3_location.SCHEMES:
        settings = {parameter: (get(key) or None) for key, parameter in S3_KEYS.items()}
        return _with_s3_settings("s3" + location[len(scheme) :], settings)
    return None


def _settings(session: Any) -> dict[str, str]:
    """The settings set in the session's conf, in four JVM calls (``spark.conf.getAll`` costs one per setting,
    about 15 ms a batch, and reading each key one more); through ``getAll`` where there is no JVM in this
    process (Spark Connect)."""
    jsession = getattr(session, "_jsparkSession", None)
    if jsession is None:
        return dict(session.conf.getAll)
    # A Scala map's entries print as ``key -> value``, here separated by NUL, which no setting holds in practice.
    every = jsession.conf().getAll()
    entries = [entry for entry in str(every.mkString("\0")).split("\0") if entry]
    if len(entries) != every.size() or not all(" -> " in entry for entry in entries):
        conf = session.conf  # a value holding a NUL after all: a call per key
        return {key: conf.get(key, None) for key in str(every.keySet().mkString("\n")).split("\n")}
    return dict(entry.split(" -> ", 1) for entry in entries)


def _with_s3_settings(store: str, settings: dict[str, str | None]) -> str:
    """``store`` with the ``spark.state.s3.*`` settings added as URI parameters (an ``s3://`` store only)."""
    given = sorted(f"{S3_PREFIX}{s3_location.PARAMETERS[p]}" for p, text in settings.items() if text is not None)
    if not s3_location.is_s3_uri(store):
        if given:
            raise ConfigError(
                f"{', '.join(given)} apply to an s3:// {STORE} only, and the store is {store!r}; unset them, or "
                "store state on S3 (a replayable log on S3 takes its endpoint in its path URI)"
            )
        return store
    return s3_location.parse(store).with_settings(settings).uri


def is_local_store(store: str) -> bool:
    """Whether ``store`` lives on this machine only: a path, a ``file:`` URI or ``memory://``."""
    scheme = store.split(":", 1)[0].lower() if ":" in store else ""
    return scheme in ("", "file", "memory") or len(scheme) == 1  # one letter: a Windows drive


def check_store_reachable(store: str, master: str, *, shared: bool = False) -> None:
    """Refuse a store that executors of ``master`` cannot reach: a local one on a non-``local`` master.

    ``local``, ``local[N]`` and ``local-cluster[...]`` run every executor on
    this machine; any other master (standalone, YARN, Kubernetes) may run
    them elsewhere, where a local path names another disk, unless ``shared``
    (``spark.state.sharedLocalStore``) says the path is one shared mount.
    ``memory://`` lives in one process and is refused whatever ``shared`` says.
    """
    if not is_local_store(store) or str(master).startswith("local"):
        return
    if shared and not store.startswith("memory:"):
        return
    raise ConfigError(
        f"{STORE}={store!r} is on local disk, but the master {master!r} runs executors on other machines, "
        "which would each write state to their own disk and lose it on a rescale or a restart. Set "
        f"{STORE} to storage every executor reaches: s3://BUCKET/PREFIX (with {S3_PREFIX}endpoint for an "
        "S3-compatible store) or webhdfs://NAMENODE:HTTP_PORT/path, or, if the path is one shared filesystem "
        f"mounted at the same place on every executor (NFS), set {SHARED_LOCAL_STORE}=true"
    )


def default_store(checkpoint_location: str) -> str:
    """``<checkpointLocation>/state`` where spark-state can store state beside Spark's checkpoint.

    ``checkpoint_location`` is the location as Hadoop qualifies it
    (``/path`` for local disk). Local paths, ``webhdfs://`` and
    ``s3://``/``s3a://`` (stored through the S3 backend, with the AWS chain's
    credentials and the ``spark.state.s3.*`` settings, not Hadoop's
    ``fs.s3a.*``) map to a store; any other scheme is refused with the fix.
    """
    location = checkpoint_location.rstrip("/")
    scheme = location.split(":", 1)[0].lower() if "://" in location else ""
    if location.startswith("/") or scheme == "file":
        return location[len("file://") :] + "/state" if scheme == "file" else location + "/state"
    if scheme == "webhdfs":
        return location + "/state"
    if scheme in s3_location.SCHEMES:
        return "s3" + location[len(scheme) :] + "/state"
    if scheme == "hdfs":
        raise ConfigError(
            f"checkpointLocation {checkpoint_location!r} is on HDFS through its RPC port, which spark-state does "
            f"not speak; set {STORE} to webhdfs://NAMENODE:HTTP_PORT/path (the NameNode's WebHDFS port, 9870 on "
            "Hadoop 3) or to an s3:// store"
        )
    raise ConfigError(
        f"checkpointLocation {checkpoint_location!r} is on a file system spark-state cannot store state on by "
        f"default; set {STORE} to a store URI: a local path (local masters only), "
        "webhdfs://NAMENODE:HTTP_PORT/path or s3://BUCKET/PREFIX"
    )
