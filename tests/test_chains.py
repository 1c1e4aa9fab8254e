"""Snapshot planning: full, delta or merge entries, compaction, and key groups whose written entries were never recorded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import ConfigError
from spark_state.store.chains import ChainTracker, compaction_due


def keys(n: int, first: int = 0) -> set[str]:
    return {f"k{i}" for i in range(first, first + n)}


def test_a_new_key_group_gets_a_full_entry_then_deltas_then_merges_at_the_chain_limit():
    """The same key changing: compaction merges it into one entry after the full one, never rewriting the rest."""
    chains = ChainTracker()
    kinds, previous = [], []
    for n in range(7):
        (entry,) = chains.plan({0: {"k0"}}, lambda g: 100, max_chain_length=3)
        kinds.append(entry.kind)
        previous.append(entry.previous)
        chains.record(f"b{n}")
    assert kinds == ["full", "delta", "delta", "merge", "delta", "merge", "delta"]
    assert previous[3] == ("b0",) and previous[5] == ("b0",)  # a merge extends the full entry alone
    assert chains.held()[0] == ("b0", "b5", "b6")
    assert chains.since_full(0) == {"k0"}


def test_a_merge_holds_every_key_changed_since_the_full_entry_until_they_are_half_of_the_key_group():
    chains = ChainTracker()
    written = []
    for n in range(12):
        (entry,) = chains.plan({0: {f"k{n}"}}, lambda g: 10, max_chain_length=2)
        written.append((entry.kind, None if entry.keys is None else sorted(entry.keys)))
        chains.record(f"b{n}")
    assert written[:5] == [
        ("full", None),
        ("delta", ["k1"]),
        ("merge", ["k1", "k2"]),
        ("merge", ["k1", "k2", "k3"]),
        ("merge", ["k1", "k2", "k3", "k4"]),
    ]
    assert written[5] == ("full", None)  # five keys changed since the full entry: half of the ten
    assert written[6:8] == [("delta", ["k6"]), ("merge", ["k6", "k7"])]


def test_what_changed_since_the_full_entry_is_known_only_for_chains_this_tracker_wrote_or_a_lone_full_entry():
    chains = ChainTracker()
    chains.set(0, ("a", "b"))  # read from the store: the deltas' keys are not known
    chains.set(1, ("c",))
    assert chains.since_full(0) is None and chains.since_full(1) == set()
    plan = chains.plan({0: {"x"}, 1: {"y"}}, lambda g: 100, max_chain_length=2)  # 0 is due, 1 is not
    assert [(e.kind, e.compacted) for e in plan] == [("full", True), ("delta", False)]
    chains.record("d")
    assert chains.since_full(0) == set() and chains.since_full(1) == {"y"}
    chains.forget([1])
    assert chains.since_full(1) is None
    chains.set(1, ("e",))
    chains.drop(1)
    assert chains.since_full(1) is None


def test_a_planned_entry_is_unknown_until_recorded_so_an_unwritten_one_is_never_extended():
    chains = ChainTracker()
    chains.plan({0: {"k"}}, lambda g: 100, max_chain_length=8)
    chains.record("b0")
    (lost,) = chains.plan({0: {"k"}}, lambda g: 100, max_chain_length=8)
    assert lost.kind == "delta" and chains.held()[0] is None  # its blob may never be committed
    assert chains.since_full(0) is None
    (entry,) = chains.plan({0: {"k"}}, lambda g: 100, max_chain_length=8)  # no record: the delta was lost
    assert entry.kind == "full"


@pytest.mark.parametrize("changed, size, kind", [(1, 12, "delta"), (6, 12, "full"), (5, 11, "delta"), (1, 0, "full")])
def test_half_the_keys_changed_makes_a_full_entry(changed, size, kind):
    chains = ChainTracker()
    chains.set(0, ("base",))
    (entry,) = chains.plan({0: keys(changed)}, lambda g: size, max_chain_length=8)
    assert entry.kind == kind and entry.empty == (size == 0)
    chains.record("next")
    assert chains.held()[0] == (() if size == 0 else ("next",) if kind == "full" else ("base", "next"))


def test_a_key_group_never_stored_and_empty_again_writes_nothing():
    chains = ChainTracker()
    assert chains.plan({3: keys(2)}, lambda g: 0, max_chain_length=8) == []
    assert 3 not in chains.held()


def test_the_chain_limit_must_be_positive():
    with pytest.raises(ConfigError, match="max chain length must be >= 1"):
        ChainTracker().plan({}, lambda g: 0, max_chain_length=0)


def _fulls_per_batch(key_groups: int, max_chain_length: int, batches: int, touched=None) -> list[int]:
    """Full entries per batch when ``touched(batch)`` (default: every key group) change one of 3 keys.

    Two of the three keys take turns, so by the time a chain is due, as many
    keys changed since its full entry as a merge would allow: every
    compaction is a full entry, as in a stream that changes a key group's
    keys evenly.
    """
    chains, fulls = ChainTracker(), []
    for batch in range(batches):
        changed = touched(batch) if touched else range(key_groups)
        plan = chains.plan({g: {f"k{batch % 2}"} for g in changed}, lambda g: 3, max_chain_length=max_chain_length)
        fulls.append(sum(entry.kind == "full" for entry in plan))
        chains.record(f"b{batch}")
        assert all(len(chain) <= max_chain_length for chain in chains.held().values() if chain)
    return fulls


def test_a_stream_touching_every_key_group_compacts_a_share_of_them_per_batch_not_all_at_once():
    """Chains growing in lockstep are compacted from half the limit on, longest first, a few per batch.

    Without spreading, every key group would be written in full every 8th
    batch (2048 full entries) and none in between; spread, the first round
    compacts a fifth per batch and every batch after an eighth, the same
    total.
    """
    fulls = _fulls_per_batch(2048, 8, 40)
    assert fulls[0] == 2048  # new key groups
    assert fulls[1:4] == [0, 0, 0]  # chains shorter than half the limit
    assert max(fulls[1:]) <= -(-2048 // 5)
    assert fulls[9:] == [256] * 31
    assert sum(fulls[1:33]) == 2048 * 4  # as many compactions as every-8th-batch would make


def test_one_key_group_compacts_only_at_the_chain_limit_and_a_few_take_turns():
    assert _fulls_per_batch(1, 8, 18) == [1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    assert _fulls_per_batch(3, 8, 17) == [3, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]


@given(
    key_groups=st.integers(1, 60),
    max_chain_length=st.integers(1, 10),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=150, deadline=None)
def test_chains_never_exceed_the_limit_and_are_compacted_only_when_due(key_groups, max_chain_length, seed):
    rng = random.Random(seed)
    chains = ChainTracker()
    for batch in range(40):
        changed = {g: {f"k{rng.randrange(12)}"} for g in rng.sample(range(key_groups), rng.randint(0, key_groups))}
        before = dict(chains.held())
        since = {g: set(chains.since_full(g)) for g in changed if chains.since_full(g) is not None}
        plan = chains.plan(changed, lambda g: 100, max_chain_length=max_chain_length)
        for entry in plan:
            previous = before.get(entry.key_group) or ()
            if entry.kind != "delta" and previous:
                assert len(previous) >= compaction_due(max_chain_length)  # compacted, never before it is due
            assert entry.kind != "delta" or len(previous) < max_chain_length
            if entry.kind == "merge":  # every key changed since the full entry, which it extends alone
                assert (
                    entry.previous == previous[:1] and entry.keys == since[entry.key_group] | changed[entry.key_group]
                )
        chains.record(f"b{batch}")
        assert all(len(chain) <= max_chain_length for chain in chains.held().values() if chain)
