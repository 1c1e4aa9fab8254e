"""Which stored chain each key group's resident content reflects, and what the next checkpoint writes. No I/O.

For every key group the manifest keeps a *chain*: the blob paths holding its
entries, oldest first, a ``full`` entry then ``delta`` entries. An instance's
``ChainTracker`` remembers, per key group it holds, the chain its content
reflects: ``()`` for "no state stored", None for "unknown" (uncommitted
changes, or an attempt whose blob may never be committed). Catch-up compares
it with the manifest (``restore.plan_instance_restore(have=...)``) to read
only what differs.

``plan`` decides each changed key group's next entry: ``full`` (every key)
when it has no stored base, or at least half of its keys changed, or it is
compacted; else ``delta`` (the changed keys, deleted ones as tombstones).

Compaction bounds what a restore reads, and is spread over batches: a chain
is *due* from ``compaction_due(L)`` entries (about half of
``max_chain_length`` L) and *forced* at L, so no chain ever has more than L
entries. A batch compacts every forced key group and, within a budget of
``compaction_budget`` compactions (forced ones included), due ones, longest
chain first (ties: lowest key group). The budget is the steady rate of the
changed key groups, raised where chains would otherwise be forced together,
so compaction writes about as much as when every chain waited for L; but
when a stream touches every key group every batch, their chains no longer
all reach L in the same batch (which made that batch rewrite the whole
state): with L = 8 the first round compacts a fifth of them per batch, and
every batch after an eighth.

Planned key groups are unknown until ``record`` names the blob their entries
went to; if that never happens, the next catch-up reloads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections import Counter
from typing import Callable, Mapping, Sequence

from spark_state.blob import EntryKind
from spark_state.errors import ConfigError

Chain = tuple[str, ...]
DEFAULT_MAX_CHAIN_LENGTH = 8


def compaction_due(max_chain_length: int) -> int:
    """The chain length (entries, >= 1) from which a key group may be compacted: half of ``max_chain_length``."""
    return max(1, max_chain_length // 2)


def compaction_budget(lengths: Sequence[int], max_chain_length: int) -> int:
    """Compactions a batch makes unless more are forced, given the chain lengths of its changed key groups.

    The steady rate ``len(lengths) // L`` (a chain grows by one entry per
    change), or more where that would leave chains to be forced together:
    ``#{length >= l} // (L - l + 1)`` for every due length ``l`` (the chains
    at least ``l`` long, spread over the batches before they are forced).
    Rounded down: a few changed key groups compact only when forced, as
    without spreading.
    """
    budget = len(lengths) // max_chain_length
    longer = 0
    counts = Counter(lengths)
    for length in range(max_chain_length - 1, compaction_due(max_chain_length) - 1, -1):
        longer += counts.get(length, 0)
        budget = max(budget, longer // (max_chain_length - length + 1))
    return budget


@dataclass(frozen=True)
class PlannedEntry:
    """The entry a checkpoint writes for a key group; ``previous`` is the chain it extends.

    ``compacted``: a full entry written only to bound the chain (few of its
    keys changed), as opposed to a new key group or one whose keys mostly
    changed.
    """

    key_group: int
    kind: EntryKind
    empty: bool
    previous: Chain | None
    compacted: bool = False


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

    def drop(self, key_group: int) -> None:
        """The key group's content is no longer held (evicted): a catch-up neither reads nor clears it."""
        self._chains.pop(key_group, None)

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
        compacted = self._compacted(changes, max_chain_length)
        planned = []
        for key_group in sorted(changes):
            chain = self._chains.get(key_group, ())
            keys = size(key_group)
            if chain == () and keys == 0:
                continue
            mostly_changed = 2 * changes[key_group] >= max(keys, 1)
            full = not chain or key_group in compacted or mostly_changed
            planned.append(PlannedEntry(key_group, "full" if full else "delta", keys == 0, chain,
                                        compacted=bool(chain) and key_group in compacted and not mostly_changed))
            self._chains[key_group] = None
        self._planned = planned
        return planned

    def _compacted(self, changes: Mapping[int, int], max_chain_length: int) -> set[int]:
        """The changed key groups this batch compacts: every forced one, then due ones within the budget."""
        due_length = compaction_due(max_chain_length)
        lengths = {g: len(chain) for g in changes if (chain := self._chains.get(g))}
        forced = {g for g, length in lengths.items() if length >= max_chain_length}
        room = compaction_budget(list(lengths.values()), max_chain_length) - len(forced)
        due = sorted((g for g, length in lengths.items() if due_length <= length < max_chain_length),
                     key=lambda g: (-lengths[g], g))
        return forced | set(due[:max(room, 0)])

    def record(self, path: str) -> None:
        """The last plan's entries were written to blob ``path``: their chains now end with it."""
        for entry in self._planned:
            if entry.kind == "full":
                self._chains[entry.key_group] = () if entry.empty else (path,)
            else:
                self._chains[entry.key_group] = (entry.previous or ()) + (path,)
        self._planned = []
