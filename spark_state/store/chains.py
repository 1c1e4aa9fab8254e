"""Which stored chain each key group's resident content reflects, and what the next checkpoint writes. No I/O.

For every key group the manifest keeps a *chain*: the blob paths holding its
entries, oldest first, a ``full`` entry then ``delta`` entries. An instance's
``ChainTracker`` remembers, per key group it holds, the chain its content
reflects: ``()`` for "no state stored", None for "unknown" (uncommitted
changes, or an attempt whose blob may never be committed). Catch-up compares
it with the manifest (``restore.plan_instance_restore(have=...)``) to read
only what differs.

``plan`` decides each changed key group's next entry: ``full`` (every key)
when it has no stored base or at least half of its keys changed; ``delta``
(the changed keys, deleted ones as tombstones) when its chain is not
compacted; a compacted chain gets a ``merge`` entry or a ``full`` one.

A ``merge`` entry holds every key changed since the chain's full entry (the
union of its deltas and this batch's changes) and replaces the deltas: the
chain becomes ``(full, merge)``. The tracker knows that union for a key
group whose chain it wrote itself since the full entry, or that it holds as
a lone full entry (a tracker made with ``merges=False`` keeps none), and
merges while the union is under half of the key group's keys; otherwise
(unknown, mostly changed, or a chain limit of 1) compaction writes the key
group in full. So what compaction writes grows with the keys that changed,
not with the state: a stream updating the same few keys of a large key
group rewrites those keys every few batches, and the whole key group only
once half of it changed since it was last written in full. Folding a
``merge`` after the full entry gives the same content as folding the
deltas it replaces, since it holds the latest value (or a tombstone) of
every key they name. The price: a restore reads the full entry and the
merge, up to half as much again as the live keys.

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

import builtins
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spark_state.errors import ConfigError
from spark_state.store.blob import EntryKind

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
    changed. ``keys``: the keys a ``delta`` or ``merge`` entry holds (None
    for ``full``: every key). A merge's ``previous`` is the chain's full
    entry alone. ``since_full``: the keys changed since the full entry the
    chain will start with once recorded (None: unknown).
    """

    key_group: int
    kind: EntryKind
    empty: bool
    previous: Chain | None
    compacted: bool = False
    keys: Collection[Any] | None = None
    since_full: set | None = None


class ChainTracker:
    """See the module docstring."""

    def __init__(self, *, merges: bool = True) -> None:
        self._merges = merges  # False: keep no keys changed since full entries, compact into full entries only
        self._chains: dict[int, Chain | None] = {}
        self._since_full: dict[int, set] = {}  # key group -> keys changed since its chain's full entry
        self._planned: list[PlannedEntry] = []

    def held(self) -> Mapping[int, Chain | None]:
        """Per key group, the chain its content reflects (the ``have`` of a catch-up plan)."""
        return self._chains

    def since_full(self, key_group: int) -> set | None:
        """The keys changed since the key group's full entry, if known (do not change the set)."""
        return self._since_full.get(key_group)

    def since_full_counts(self) -> dict[int, int]:
        """Per key group whose changes since its full entry are known, how many keys changed."""
        return {g: len(keys) for g, keys in self._since_full.items() if keys}

    def set(self, key_group: int, chain: Chain) -> None:
        """The key group's content is now exactly stored chain ``chain`` (read from the store)."""
        self._chains[key_group] = tuple(chain)
        if len(chain) == 1 and self._merges:
            self._since_full[key_group] = set()
        else:
            self._since_full.pop(key_group, None)

    def drop(self, key_group: int) -> None:
        """The key group's content is no longer held (evicted): a catch-up neither reads nor clears it."""
        self._chains.pop(key_group, None)
        self._since_full.pop(key_group, None)

    def forget(self, key_groups) -> None:
        """Mark key groups unknown: their content no longer matches any stored chain."""
        for key_group in key_groups:
            self._chains[key_group] = None
            self._since_full.pop(key_group, None)

    def plan(
        self, changes: Mapping[int, Collection[Any]], size: Callable[[int], int], max_chain_length: int
    ) -> list[PlannedEntry]:
        """The entries to write for the changed key groups (``changes``: key group -> the keys changed).

        ``size(g)`` is the number of keys key group ``g`` holds now, or an
        estimate below it (0 exactly when it is empty): it only chooses between
        entry kinds. A key group never stored and empty again needs nothing.
        Planned key groups stay unknown until ``record``.
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
            changed = changes[key_group]
            since = self._since_full.pop(key_group, None)
            self._chains[key_group] = None
            if not chain or 2 * len(changed) >= max(keys, 1):  # new, or mostly changed
                planned.append(PlannedEntry(key_group, "full", keys == 0, chain, since_full=set()))
                continue
            if since is not None:
                since.update(changed)
            if key_group not in compacted:
                entry = PlannedEntry(key_group, "delta", False, chain, keys=changed, since_full=since)
            elif since is not None and 2 * len(since) < keys and max_chain_length >= 2:
                entry = PlannedEntry(key_group, "merge", False, chain[:1], keys=since, since_full=since)
            else:
                entry = PlannedEntry(key_group, "full", keys == 0, chain, compacted=True, since_full=set())
            planned.append(entry)
        self._planned = planned
        return planned

    def _compacted(self, changes: Mapping[int, Collection[Any]], max_chain_length: int) -> builtins.set[int]:
        """The changed key groups this batch compacts: every forced one, then due ones within the budget."""
        due_length = compaction_due(max_chain_length)
        lengths = {g: len(chain) for g in changes if (chain := self._chains.get(g))}
        forced = {g for g, length in lengths.items() if length >= max_chain_length}
        room = compaction_budget(list(lengths.values()), max_chain_length) - len(forced)
        due = sorted(
            (g for g, length in lengths.items() if due_length <= length < max_chain_length),
            key=lambda g: (-lengths[g], g),
        )
        return forced | set(due[: max(room, 0)])

    def record(self, path: str) -> None:
        """The last plan's entries were written to blob ``path``: their chains now end with it."""
        for entry in self._planned:
            if entry.kind == "full":
                self._chains[entry.key_group] = () if entry.empty else (path,)
            else:
                self._chains[entry.key_group] = (entry.previous or ()) + (path,)
            if entry.since_full is not None and self._chains[entry.key_group] and self._merges:
                self._since_full[entry.key_group] = entry.since_full
        self._planned = []
