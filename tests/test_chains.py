"""Snapshot planning: full or delta entries, compaction, and key groups whose written entries were never recorded."""

from __future__ import annotations

import pytest

from spark_state.chains import ChainTracker
from spark_state.errors import ConfigError


def test_a_new_key_group_gets_a_full_entry_then_deltas_until_the_chain_limit():
    chains = ChainTracker()
    kinds = []
    for n in range(7):
        (entry,) = chains.plan({0: 1}, lambda g: 100, max_chain_length=3)
        kinds.append(entry.kind)
        chains.record(f"b{n}")
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert chains.held()[0] == ("b6",)


def test_a_planned_entry_is_unknown_until_recorded_so_an_unwritten_one_is_never_extended():
    chains = ChainTracker()
    chains.plan({0: 1}, lambda g: 100, max_chain_length=8)
    chains.record("b0")
    (lost,) = chains.plan({0: 1}, lambda g: 100, max_chain_length=8)
    assert lost.kind == "delta" and chains.held()[0] is None  # its blob may never be committed
    (entry,) = chains.plan({0: 1}, lambda g: 100, max_chain_length=8)  # no record: the delta was lost
    assert entry.kind == "full"


@pytest.mark.parametrize("changed, size, kind", [(1, 12, "delta"), (6, 12, "full"), (5, 11, "delta"), (1, 0, "full")])
def test_half_the_keys_changed_makes_a_full_entry(changed, size, kind):
    chains = ChainTracker()
    chains.set(0, ("base",))
    (entry,) = chains.plan({0: changed}, lambda g: size, max_chain_length=8)
    assert entry.kind == kind and entry.empty == (size == 0)
    chains.record("next")
    assert chains.held()[0] == (() if size == 0 else ("next",) if kind == "full" else ("base", "next"))


def test_a_key_group_never_stored_and_empty_again_writes_nothing():
    chains = ChainTracker()
    assert chains.plan({3: 2}, lambda g: 0, max_chain_length=8) == []
    assert 3 not in chains.held()


def test_the_chain_limit_must_be_positive():
    with pytest.raises(ConfigError, match="max chain length must be >= 1"):
        ChainTracker().plan({}, lambda g: 0, max_chain_length=0)
