"""The built-in event-time functions without Spark: which row ``deduplicate`` emits."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.executor.columns import EVENT_MS_COLUMN
from spark_state.executor.functions import KeyState
from spark_state.executor.timed import Deduplicate, first_by_event_time

ROWS = st.lists(
    st.tuples(
        st.integers(0, 3), st.one_of(st.none(), st.integers(-2, 2)), st.sampled_from(["x", "y", "é"]), st.integers(0, 5)
    ),
    min_size=1,
    max_size=12,
).flatmap(lambda rows: st.tuples(st.just(rows), st.permutations(range(len(rows)))))


def _batch(rows: list[tuple]) -> pa.RecordBatch:
    event_ms, value, label, nested = zip(*rows) if rows else ((), (), (), ())
    return pa.RecordBatch.from_pydict(
        {
            "key": ["k"] * len(rows),
            "value": pa.array(value, pa.int64()),
            "label": list(label),
            "tags": pa.array([[n] for n in nested], pa.list_(pa.int64())),  # nested: not part of the order
            EVENT_MS_COLUMN: pa.array(event_ms, pa.int64()),
        }
    )


def _emit(rows: list[tuple]) -> dict:
    state = KeyState(None, ("first_event_ms",))
    out = Deduplicate(horizon_ms=1000)(("k",), _batch(rows), state)
    row = out.to_pylist()[0]
    del row["tags"]  # rows that differ only in a nested column may emit either (documented)
    return {"row": row, "stored": state.get(), "expires": state.expires}


@settings(max_examples=200, deadline=None)
@given(ROWS)
def test_deduplicate_emits_and_stores_the_same_row_whatever_order_the_rows_arrive_in(case):
    rows, permutation = case
    expected = min(rows, key=lambda r: (r[0], r[1] is None, r[1] or 0, r[2]))  # event time, then value (nulls
    shuffled = [rows[i] for i in permutation]  # last), then label
    emitted = _emit(shuffled)
    assert emitted == _emit(rows)
    assert (emitted["row"]["value"], emitted["row"]["label"]) == (expected[1], expected[2])
    assert emitted["stored"] == (expected[0],) and emitted["expires"] == expected[0] + 1000


def test_the_earliest_event_time_wins_over_arrival_order():
    rows = [(30_101, 1, "x", 0), (30_034, 7, "y", 0), (30_050, 0, "x", 0)]
    assert first_by_event_time(_batch(rows)) == 1
    assert _emit(rows)["row"]["value"] == 7


def test_a_key_with_state_emits_nothing():
    state = KeyState((5,), ("first_event_ms",))
    assert Deduplicate(horizon_ms=1000)(("k",), _batch([(1, 1, "x", 0)]), state) is None
