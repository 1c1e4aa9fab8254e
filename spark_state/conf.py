"""Configuration through ``spark.conf``, parsed once on the driver into a frozen dataclass.

=====================================  ==========================  =====================================================
key                                    default                     meaning
=====================================  ==========================  =====================================================
``spark.state.store``                  ``<checkpointLocation>/``   where checkpoints live: a path or ``file://`` URI
                                       ``state``                   (local disk), ``hdfs://host:port/path`` (WebHDFS)
``spark.state.parallelism``            ``spark.sql.shuffle.``      number of instances; read again at every micro-batch,
                                       ``partitions``              so it may change between batches and restarts
``spark.state.maxParallelism``         4096                        the key space; fixed by the first checkpoint, a
                                                                   different value is refused on restore
``spark.state.checkpointsRetained``    3                           committed checkpoints kept (>= 2: a replayed batch
                                                                   recomputes from the one before it)
``spark.state.maxChainLength``         8                           compaction: a key group's chain of delta entries is
                                                                   rewritten as one full entry at this length
``spark.state.compression``            ``none``                    Arrow IPC codec of state blobs: none, lz4, zstd
``spark.state.orphanGraceSeconds``     3600                        unreferenced blobs and items (of failed, retried or
                                                                   zombie attempts) are deleted once this old
``spark.state.restoreFrom``            unset                       recovery: a new checkpointLocation starts from this
                                                                   retained checkpoint id instead of the latest
=====================================  ==========================  =====================================================

Spark hands options over as strings: ``StateConf.parse`` converts them once
and raises ``ConfigError`` naming the key, the value and the valid range.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from spark_state.errors import ConfigError
from spark_state.keygroups import DEFAULT_MAX_PARALLELISM, UPPER_BOUND_MAX_PARALLELISM

PREFIX = "spark.state."
STORE = PREFIX + "store"
PARALLELISM = PREFIX + "parallelism"
MAX_PARALLELISM = PREFIX + "maxParallelism"
RETAINED = PREFIX + "checkpointsRetained"
MAX_CHAIN_LENGTH = PREFIX + "maxChainLength"
COMPRESSION = PREFIX + "compression"
ORPHAN_GRACE = PREFIX + "orphanGraceSeconds"
RESTORE_FROM = PREFIX + "restoreFrom"
KNOWN_KEYS = (STORE, PARALLELISM, MAX_PARALLELISM, RETAINED, MAX_CHAIN_LENGTH, COMPRESSION, ORPHAN_GRACE, RESTORE_FROM)
COMPRESSIONS = ("none", "lz4", "zstd")


def check_known(keys: Iterable[str]) -> None:
    """Raise ``ConfigError`` for a ``spark.state.*`` key this version does not know (a typo is never ignored)."""
    unknown = sorted(k for k in keys if k.startswith(PREFIX) and k not in KNOWN_KEYS)
    if unknown:
        names = {k[len(PREFIX):].lower(): k for k in KNOWN_KEYS}
        hints = []
        for key in unknown:
            match = difflib.get_close_matches(key[len(PREFIX):].lower(), names, 1, cutoff=0.75)
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


@dataclass(frozen=True)
class StateConf:
    """Validated settings of one stateful query (see the module docstring for the keys)."""

    store: str
    parallelism: int
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    checkpoints_retained: int = 3
    max_chain_length: int = 8
    compression: str | None = None
    orphan_grace_seconds: int = 3600
    restore_from: int | None = None

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError(f"{STORE} is empty; set it to a path, file:// or hdfs:// URI")
        if not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            raise ConfigError(
                f"{MAX_PARALLELISM}={self.max_parallelism} is out of range; set it between 1 and "
                f"{UPPER_BOUND_MAX_PARALLELISM}"
            )
        if not 1 <= self.parallelism <= self.max_parallelism:
            raise ConfigError(
                f"{PARALLELISM}={self.parallelism} must be between 1 and {MAX_PARALLELISM}="
                f"{self.max_parallelism}; lower the parallelism (the key space cannot be split finer)"
            )
        if self.checkpoints_retained < 2:
            raise ConfigError(f"{RETAINED}={self.checkpoints_retained} must be >= 2")
        if self.max_chain_length < 1:
            raise ConfigError(f"{MAX_CHAIN_LENGTH}={self.max_chain_length} must be >= 1")

    @classmethod
    def parse(
        cls,
        get: Callable[[str], str | None],
        *,
        default_store: str | Callable[[], str],
        default_parallelism: int,
    ) -> "StateConf":
        """Build from a lookup like ``lambda k: spark.conf.get(k, None)``; unset keys take defaults.

        ``default_store`` may be a function, called only when the store is not set.
        """
        def value(key: str) -> str | None:
            text = get(key)
            return None if text is None or str(text).strip() == "" else str(text).strip()

        compression = (value(COMPRESSION) or "none").lower()
        if compression not in COMPRESSIONS:
            raise ConfigError(f"{COMPRESSION}={compression!r} is not one of {', '.join(COMPRESSIONS)}")
        max_parallelism = (
            _int(MAX_PARALLELISM, value(MAX_PARALLELISM), 1, UPPER_BOUND_MAX_PARALLELISM)
            if value(MAX_PARALLELISM)
            else DEFAULT_MAX_PARALLELISM
        )
        return cls(
            store=value(STORE) or (default_store() if callable(default_store) else default_store),
            parallelism=_int(PARALLELISM, value(PARALLELISM), 1) if value(PARALLELISM) else default_parallelism,
            max_parallelism=max_parallelism,
            checkpoints_retained=_int(RETAINED, value(RETAINED), 2) if value(RETAINED) else 3,
            max_chain_length=_int(MAX_CHAIN_LENGTH, value(MAX_CHAIN_LENGTH), 1) if value(MAX_CHAIN_LENGTH) else 8,
            compression=None if compression == "none" else compression,
            orphan_grace_seconds=_int(ORPHAN_GRACE, value(ORPHAN_GRACE), 0) if value(ORPHAN_GRACE) else 3600,
            restore_from=_int(RESTORE_FROM, value(RESTORE_FROM), 0) if value(RESTORE_FROM) else None,
        )

    @classmethod
    def from_mapping(cls, conf: Mapping[str, str], **defaults) -> "StateConf":
        """``parse`` over a plain dict (tests, scripts); unknown ``spark.state.*`` keys are refused."""
        check_known(conf)
        return cls.parse(conf.get, **defaults)

    @classmethod
    def from_session(cls, session: Any, *, default_store: str | Callable[[], str]) -> "StateConf":
        """``parse`` over a Spark session's conf; unknown ``spark.state.*`` keys are refused.

        The parallelism defaults to ``spark.sql.shuffle.partitions``.
        """
        conf = session.conf
        check_known(conf.getAll)
        return cls.parse(
            lambda key: conf.get(key, None),
            default_store=default_store,
            default_parallelism=int(conf.get("spark.sql.shuffle.partitions", "200")),
        )
