"""Which stored chain each key group's resident content reflects, and what the next checkpoint writes. No I/O.

For every key group the manifest keeps a *chain*: the blob paths holding its
entries, oldest first, a ``full`` entry then ``delta`` entries. An instance's
``ChainTracker`` remembers, per key group it holds, the chain its content
reflects: ``()`` for "no state stored", None for "unknown" (uncommitted
changes, or an attempt whose blob may never be committed). Catch-up compares
it with the manifest (``restore.plan_instance_restore(have=...)``) to read
only what differs.

``plan`` decides each changed key group's next entry: ``full`` (every key)
when it has no stored base, its chain already has ``max_chain_length``
entries (compaction: bounds what a restore reads), or at least half of its
keys changed; else ``delta`` (the changed keys, deleted ones as tombstones).
Planned key groups are unknown until ``record`` names the blob their entries
went to; if that never happens, the next catch-up reloads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from spark_state.blob import EntryKind
from spark_state.errors import ConfigError

Chain = tuple[str, ...]
DEFAULT_MAX_CHAIN_LENGTH = 8


@dataclass(frozen=True)
class PlannedEntry:
    """The entry a checkpoint writes for a key group; ``previous`` is the chain it extends."""

    key_group: int
    kind: EntryKind
    empty: bool
    previous: Chain | None


class ChainTracker:
    """See the module docstring."""

    def __init__(self) -> None:
        self._chains: dict[int, Chain | None] = {}
        self._planned: list[PlannedEntry] = []

    def held(self) -> Mapping[int, Chain | None]:
        """Per key group, the chain its content reflects (the ``have`` of a catch-up plan)."""
        return self._chains

    def set(self, key_group: int, chain: Chain) -> None:
        self._chains[key_group] = tuple(chain)

    def forget(self, key_groups) -> None:
        """Mark key groups unknown: their content no longer matches any stored chain."""
        for key_group in key_groups:
            self._chains[key_group] = None

    def plan(self, changes: Mapping[int, int], size: Callable[[int], int], max_chain_length: int) -> list[PlannedEntry]:
        """The entries to write for the changed key groups (``changes``: key group -> keys changed).

        ``size(g)`` is the number of keys key group ``g`` holds now. A key
        group never stored and empty again needs nothing. Planned key groups
        stay unknown until ``record``.
        """
        if max_chain_length < 1:
            raise ConfigError(f"max chain length must be >= 1, got {max_chain_length}")
        planned = []
        for key_group in sorted(changes):
            chain = self._chains.get(key_group, ())
            keys = size(key_group)
            if chain == () and keys == 0:
                continue
            full = not chain or len(chain) >= max_chain_length or 2 * changes[key_group] >= max(keys, 1)
            planned.append(PlannedEntry(key_group, "full" if full else "delta", keys == 0, chain))
            self._chains[key_group] = None
        self._planned = planned
        return planned

    def record(self, path: str) -> None:
        """The last plan's entries were written to blob ``path``: their chains now end with it."""
        for entry in self._planned:
            if entry.kind == "full":
                self._chains[entry.key_group] = () if entry.empty else (path,)
            else:
                self._chains[entry.key_group] = (entry.previous or ()) + (path,)
        self._planned = []
