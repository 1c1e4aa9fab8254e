"""Unit and property tests of spark_state.keyspace (no Spark).

The hash known-answer values were computed by Spark 4.3's ``hash()`` (for
example ``SELECT hash(1L)``, ``SELECT hash(X'61626300')``); they pin
HASH_VERSION 1.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import mmh3
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_state.errors import ConfigError, InvalidParallelismError, UnsupportedKeyError
from spark_state.keyspace import (
    DEFAULT_MAX_PARALLELISM,
    HASH_SEED,
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    default_max_parallelism,
    instance_for_key_group,
    instances_for_key_groups,
    key_group_for,
    key_group_range,
    key_groups_for_columns,
    key_hash,
    key_hashes_for_columns,
    murmur3_32,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _le8(value: int) -> bytes:
    return value.to_bytes(8, "little", signed=True)


# --------------------------------------------------------------------------- ranges


def _check_assignment(parallelism: int, max_parallelism: int) -> None:
    """Assert every range property for one (parallelism, max_parallelism) pair."""
    q, r = divmod(max_parallelism, parallelism)
    ranges = [key_group_range(i, parallelism, max_parallelism) for i in range(parallelism)]
    assert ranges[0].start == 0
    assert ranges[-1].end == max_parallelism - 1
    for before, after in zip(ranges, ranges[1:]):
        assert after.start == before.end + 1
    assert [len(kgr) for kgr in ranges] == [q + 1] * r + [q] * (parallelism - r)
    expected = [i for i, kgr in enumerate(ranges) for _ in kgr]
    actual = [instance_for_key_group(g, parallelism, max_parallelism) for g in range(max_parallelism)]
    assert actual == expected
    vectorized = instances_for_key_groups(np.arange(max_parallelism), parallelism, max_parallelism)
    assert vectorized.tolist() == expected


def test_assignment_exhaustive_up_to_64_key_groups():
    for max_parallelism in range(1, 65):
        for parallelism in range(1, max_parallelism + 1):
            _check_assignment(parallelism, max_parallelism)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_assignment_properties_for_large_key_spaces(data):
    max_parallelism = data.draw(st.integers(1, UPPER_BOUND_MAX_PARALLELISM), label="max_parallelism")
    parallelism = data.draw(st.integers(1, max_parallelism), label="parallelism")
    key_group = data.draw(st.integers(0, max_parallelism - 1), label="key_group")
    q, r = divmod(max_parallelism, parallelism)

    instance = instance_for_key_group(key_group, parallelism, max_parallelism)
    owned = key_group_range(instance, parallelism, max_parallelism)
    assert key_group in owned
    assert len(owned) == (q + 1 if instance < r else q)
    if instance > 0:
        assert key_group_range(instance - 1, parallelism, max_parallelism).end == owned.start - 1
    else:
        assert owned.start == 0
    if instance < parallelism - 1:
        assert key_group_range(instance + 1, parallelism, max_parallelism).start == owned.end + 1
    else:
        assert owned.end == max_parallelism - 1


def test_assignment_known_values():
    assert [str(key_group_range(i, 3, 10)) for i in range(3)] == ["[0, 3]", "[4, 6]", "[7, 9]"]
    assert key_group_range(0, 1, 4096) == KeyGroupRange(0, 4095)
    assert key_group_range(4095, 4096, 4096) == KeyGroupRange(4095, 4095)
    # 001's example: 2000 key groups on 900 instances; 0..199 own 3, 200..899 own 2.
    assert key_group_range(199, 900, 2000) == KeyGroupRange(597, 599)
    assert key_group_range(200, 900, 2000) == KeyGroupRange(600, 601)
    # 001's else-branch forgot "+ overflow_partition_count" and would give 0 and 350 here.
    assert instance_for_key_group(600, 900, 2000) == 200
    assert instance_for_key_group(1999, 900, 2000) == 899
    assert instances_for_key_groups(np.array([599, 600, 1999]), 900, 2000).tolist() == [199, 200, 899]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_instances_for_key_groups_matches_scalar(data):
    max_parallelism = data.draw(st.integers(1, UPPER_BOUND_MAX_PARALLELISM))
    parallelism = data.draw(st.integers(1, max_parallelism))
    groups = data.draw(st.lists(st.integers(0, max_parallelism - 1), max_size=50))
    dtype = data.draw(st.sampled_from([np.int16, np.int32, np.int64, np.uint16, np.uint64]))
    if dtype == np.int16 and max_parallelism > 2**15 - 1:
        dtype = np.int32
    result = instances_for_key_groups(np.array(groups, dtype=dtype), parallelism, max_parallelism)
    assert result.dtype == np.int32
    assert result.tolist() == [instance_for_key_group(g, parallelism, max_parallelism) for g in groups]


def test_instances_for_key_groups_keeps_shape():
    groups = np.array([[0, 9], [5, 4]])
    assert instances_for_key_groups(groups, 3, 10).tolist() == [[0, 2], [1, 1]]


def test_default_max_parallelism_imbalance():
    def extra_load(parallelism: int, max_parallelism: int) -> Fraction:
        sizes = [len(key_group_range(i, parallelism, max_parallelism)) for i in range(parallelism)]
        return Fraction(max(sizes) - min(sizes), min(sizes))

    # At its first parallelism a new store's instances own >= 32 key groups each: <= 3.2% extra load.
    assert max(extra_load(p, default_max_parallelism(p)) for p in range(1, 1025)) == Fraction(1, 32)
    assert [default_max_parallelism(p) for p in (1, 2, 32, 33, 64, 65, 200, 1024, 1025, 32768)] == [
        1024,
        1024,
        1024,
        2048,
        2048,
        4096,
        8192,
        32768,
        32768,
        32768,
    ]
    assert extra_load(200, DEFAULT_MAX_PARALLELISM) == Fraction(1, 5)  # a store started small, scaled to 200
    with pytest.raises(InvalidParallelismError, match="parallelism=0 is out of range"):
        default_max_parallelism(0)


# --------------------------------------------------------------------------- KeyGroupRange


def test_key_group_range_basics():
    kgr = KeyGroupRange(3, 7)
    assert len(kgr) == 5
    assert list(kgr) == [3, 4, 5, 6, 7]
    assert str(kgr) == "[3, 7]"
    assert len(KeyGroupRange(4, 4)) == 1
    assert 3 in kgr and 7 in kgr and np.int64(5) in kgr and np.int32(7) in kgr
    assert 2 not in kgr and 8 not in kgr and np.int64(8) not in kgr
    assert True not in KeyGroupRange(0, 3) and 3.0 not in kgr and "3" not in kgr
    assert KeyGroupRange(np.int64(3), np.int32(7)) == kgr
    assert type(KeyGroupRange(np.int64(3), 7).start) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        kgr.start = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 9), (5, 20), (5, 9)),
        ((5, 20), (0, 9), (5, 9)),
        ((0, 9), (9, 9), (9, 9)),
        ((0, 9), (3, 4), (3, 4)),
        ((0, 9), (10, 12), None),
        ((10, 12), (0, 9), None),
        ((4, 4), (4, 4), (4, 4)),
    ],
)
def test_key_group_range_intersection(a, b, expected):
    result = KeyGroupRange(*a).intersection(KeyGroupRange(*b))
    assert result == (None if expected is None else KeyGroupRange(*expected))


@pytest.mark.parametrize(
    ("start", "end", "match"),
    [
        (5, 4, "0 <= start <= end"),
        (-1, 4, "0 <= start <= end"),
        (0, UPPER_BOUND_MAX_PARALLELISM, "end < 32768"),
        (0.0, 4, "start must be an int, got float"),
        (0, True, "end must be an int, got bool"),
    ],
)
def test_key_group_range_validation(start, end, match):
    with pytest.raises(InvalidParallelismError, match=match):
        KeyGroupRange(start, end)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: key_group_range(0, 0, 10),
            r"parallelism=0 is out of range: need 1 <= parallelism <= max_parallelism \(=10\)",
        ),
        (lambda: key_group_range(0, 11, 10), r"parallelism=11 is out of range.*larger max_parallelism"),
        (lambda: key_group_range(0, 2, 0), r"max_parallelism=0 is out of range: need 1 <= max_parallelism <= 32768"),
        (lambda: key_group_range(0, 2, 32769), r"max_parallelism=32769 is out of range"),
        (lambda: key_group_range(3, 3, 10), r"instance=3 is out of range: need 0 <= instance < parallelism \(=3\)"),
        (lambda: key_group_range(-1, 3, 10), r"instance=-1 is out of range"),
        (lambda: key_group_range(True, 3, 10), r"instance must be an int, got bool"),
        (lambda: key_group_range(0, 2.0, 10), r"parallelism must be an int, got float 2.0"),
        (lambda: key_group_range(0, 2, "10"), r"max_parallelism must be an int, got str"),
        (
            lambda: instance_for_key_group(10, 3, 10),
            r"key_group=10 is out of range: need 0 <= key_group < max_parallelism \(=10\)",
        ),
        (lambda: instance_for_key_group(-1, 3, 10), r"key_group=-1 is out of range"),
        (lambda: instance_for_key_group(1.0, 3, 10), r"key_group must be an int, got float"),
        (lambda: instance_for_key_group(0, 4, 3), r"parallelism=4 is out of range"),
        (lambda: instance_for_key_group(0, False, 3), r"parallelism must be an int, got bool"),
        (lambda: key_group_for(1, 0), r"max_parallelism=0 is out of range"),
        (lambda: key_group_for(1, 32769), r"max_parallelism=32769 is out of range"),
        (lambda: key_group_for(1, True), r"max_parallelism must be an int, got bool"),
        (lambda: key_groups_for_columns([np.arange(3)], 0), r"max_parallelism=0 is out of range"),
        (lambda: instances_for_key_groups(np.array([0, 10]), 3, 10), r"key_group=10 is out of range"),
        (lambda: instances_for_key_groups(np.array([-1, 0]), 3, 10), r"key_group=-1 is out of range"),
        (lambda: instances_for_key_groups(np.array([0.0, 1.0]), 3, 10), r"must be an integer array, got dtype float64"),
        (lambda: instances_for_key_groups(np.array([True]), 1, 10), r"must be an integer array, got dtype bool"),
        (lambda: instances_for_key_groups(np.array([0]), 11, 10), r"parallelism=11 is out of range"),
    ],
)
def test_invalid_arguments(call, match):
    with pytest.raises(InvalidParallelismError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)


def test_extreme_valid_arguments():
    assert key_group_range(32767, 32768, 32768) == KeyGroupRange(32767, 32767)
    assert instance_for_key_group(0, 1, 1) == 0
    assert key_group_for("x", 1) == 0
    assert instances_for_key_groups(np.array([], dtype=np.int32), 1, 1).tolist() == []


# --------------------------------------------------------------------------- scalar hash


def test_key_hash_matches_spark_known_answers():
    # Values from Spark: SELECT hash(1L), hash(-1L), hash(X'61626300'), hash(X''), ...
    assert key_hash(1) == -1712319331
    assert key_hash(-1) == -939490007
    assert key_hash(INT64_MAX) == -1604625029
    assert key_hash(INT64_MIN) == -853646085
    assert key_hash("abc") == -1622552323
    assert key_hash("") == 142593372
    assert key_hash("é") == -1129025055  # X'c3a90000'
    assert key_hash((1, "x", None)) == -198301728  # hash(1L, X'78000000', null)
    assert key_hash(None) == HASH_SEED == 42  # hash(CAST(NULL AS BIGINT))


def test_key_hash_is_murmur3_of_the_canonical_encoding():
    assert key_hash(1) == mmh3.hash(_le8(1), 42)
    assert key_hash(-(2**40) - 7) == mmh3.hash(_le8(-(2**40) - 7), 42)
    assert key_hash("abcd") == mmh3.hash(b"abcd", 42)
    assert key_hash("abc") == mmh3.hash(b"abc\0", 42)
    assert key_hash("abcde") == mmh3.hash(b"abcde\0\0\0", 42)
    # Without padding the tails disagree: Spark gives 814637928 for hash(X'6162636465').
    assert mmh3.hash(b"abcde", 42) != 814637928
    assert key_hash("日本") == mmh3.hash("日本".encode() + b"\0\0", 42)


def test_key_hash_equivalent_encodings():
    assert key_hash(True) == key_hash(1) and key_hash(False) == key_hash(0)
    assert key_hash(np.int8(-3)) == key_hash(-3) == key_hash(np.int64(-3))
    assert key_hash(np.uint32(2**32 - 1)) == key_hash(2**32 - 1)
    assert key_hash(np.bool_(True)) == key_hash(1)
    assert key_hash(b"ab") == key_hash("ab") == key_hash(bytearray(b"ab")) == key_hash(memoryview(b"ab"))
    assert key_hash(np.str_("ab")) == key_hash("ab")
    assert key_hash("ab") == key_hash("ab\0")  # zero padding is not injective
    assert key_hash(1) != key_hash("1") and key_hash(0) != key_hash("")


def test_key_hash_folds_tuples_and_skips_none():
    first = mmh3.hash(_le8(1), 42)
    assert first < 0  # so folding must pass the seed as unsigned
    assert key_hash((1, "a")) == mmh3.hash(b"a\0\0\0", first & 0xFFFFFFFF, signed=True)
    assert key_hash((1,)) == key_hash(1)
    assert key_hash((1, None)) == key_hash((None, 1)) == key_hash(1)
    assert key_hash((None, None)) == key_hash((None,)) == 42
    assert key_hash((1, 2)) != key_hash((2, 1))
    assert key_hash((1, 2, 3)) == mmh3.hash(_le8(3), mmh3.hash(_le8(2), first & 0xFFFFFFFF) & 0xFFFFFFFF)


def test_key_group_for_is_non_negative_modulo():
    assert key_hash(1) % 4096 == 4096 - (1712319331 % 4096)
    assert key_group_for(1, 4096) == 4096 - (1712319331 % 4096)
    assert key_group_for((1, "x", None), 7) == -198301728 % 7
    assert key_group_for(None, 10) == 2
    assert key_group_for(INT64_MIN, 32768) == (-853646085) % 32768


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (1.0, "type float"),
        (float("nan"), "type float"),
        ({"a": 1}, "type dict"),
        ([1], "type list"),
        ((1, (2,)), "type tuple"),
        ((1, 2.5), "type float"),
        (np.float32(1), "type float32"),
        (2**63, "outside the 64-bit signed range"),
        (-(2**63) - 1, "outside the 64-bit signed range"),
        (np.uint64(2**63), "outside the 64-bit signed range"),
        ("a\ud800", "not valid Unicode"),
        ((), "empty tuple is not a key"),
    ],
)
def test_unsupported_keys(key, match):
    with pytest.raises(UnsupportedKeyError, match=match) as info:
        key_hash(key)
    assert isinstance(info.value, TypeError)
    if "type" in match:
        assert "supported component types: None, bool, int" in str(info.value)
    with pytest.raises(UnsupportedKeyError):
        key_group_for(key, 10)


# --------------------------------------------------------------------------- vectorized hash

_INT_TYPES = {
    pa.int8(): (-(2**7), 2**7 - 1),
    pa.int16(): (-(2**15), 2**15 - 1),
    pa.int32(): (-(2**31), 2**31 - 1),
    pa.int64(): (INT64_MIN, INT64_MAX),
    pa.uint8(): (0, 2**8 - 1),
    pa.uint16(): (0, 2**16 - 1),
    pa.uint32(): (0, 2**32 - 1),
}
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@st.composite
def _column(draw, n_rows):
    """Draw (arrow type, python values) for one key column of ``n_rows`` rows."""
    kind = draw(st.sampled_from(["int", "bool", "string", "large_string", "binary", "large_binary"]))
    if kind == "int":
        arrow_type = draw(st.sampled_from(list(_INT_TYPES)))
        lo, hi = _INT_TYPES[arrow_type]
        values = st.one_of(st.sampled_from([lo, hi, 0, -1 if lo < 0 else 1]), st.integers(lo, hi))
    elif kind == "bool":
        arrow_type, values = pa.bool_(), st.booleans()
    elif kind.endswith("string"):
        arrow_type = getattr(pa, kind)()
        values = st.one_of(_TEXT, _TEXT.map(lambda s: s * 8))  # up to ~1 KiB, past the 64-byte fallback
    else:
        arrow_type = getattr(pa, kind)()
        values = st.binary(max_size=80)
    return arrow_type, draw(st.lists(st.one_of(st.none(), values), min_size=n_rows, max_size=n_rows))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_vectorized_matches_scalar(data):
    n_rows = data.draw(st.integers(0, 40), label="n_rows")
    columns = data.draw(st.lists(_column(n_rows), min_size=1, max_size=3), label="columns")
    max_parallelism = data.draw(st.integers(1, UPPER_BOUND_MAX_PARALLELISM), label="max_parallelism")
    arrays = [pa.array(values, type=arrow_type) for arrow_type, values in columns]
    keys = [tuple(values[row] for _, values in columns) for row in range(n_rows)]

    hashes = key_hashes_for_columns(arrays)
    assert hashes.dtype == np.int32
    assert hashes.tolist() == [key_hash(key) for key in keys]
    groups = key_groups_for_columns(arrays, max_parallelism)
    assert groups.dtype == np.int32
    assert groups.tolist() == [key_group_for(key, max_parallelism) for key in keys]


def test_vectorized_strings_of_every_length():
    values = ["".join("aé日😀"[i % 4] for i in range(n)) for n in range(40)] + ["x" * n for n in range(60, 70)]
    values += [None, "", "y" * 200]
    for arrow_type in (pa.string(), pa.large_string(), pa.string_view()):
        array = pa.array(values, type=arrow_type)
        assert key_hashes_for_columns([array]).tolist() == [key_hash(v) for v in values]
    binary = pa.array([None if v is None else v.encode() for v in values], type=pa.binary_view())
    assert key_hashes_for_columns([binary]).tolist() == [key_hash(v) for v in values]


def test_vectorized_slices_and_chunks():
    strings = pa.array(["a", None, "bcdef", "", "g" * 70, "hij", "klmn", None, "opq"])
    ints = pa.array([1, 2, None, 4, INT64_MIN, 6, INT64_MAX, 8, 9], type=pa.int64())
    keys = list(zip(ints.to_pylist(), strings.to_pylist()))
    expected = [key_hash(key) for key in keys]
    assert key_hashes_for_columns([ints.slice(2, 5), strings.slice(2, 5)]).tolist() == expected[2:7]
    chunked_strings = pa.chunked_array([strings.slice(0, 4), strings.slice(4, 0), strings.slice(4)])
    chunked_ints = pa.chunked_array([ints.slice(0, 2), ints.slice(2)])
    assert key_hashes_for_columns([chunked_ints, chunked_strings]).tolist() == expected


def test_vectorized_null_slots_ignore_their_bytes():
    # Row 1 is null but its offsets span 70 bytes, row 2 is null over 3 bytes.
    data = b"ab" + b"z" * 70 + b"cde" + b"fg"
    offsets = np.array([0, 2, 72, 75, 77], dtype=np.int32)
    validity = pa.array([True, False, False, True]).buffers()[1]
    array = pa.Array.from_buffers(pa.string(), 4, [validity, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)])
    assert array.to_pylist() == ["ab", None, None, "fg"]
    assert key_hashes_for_columns([array]).tolist() == [key_hash("ab"), 42, 42, key_hash("fg")]
    assert key_hashes_for_columns([pa.array([7, 8, 9, 10]), array]).tolist() == [
        key_hash((7, "ab")),
        key_hash(8),
        key_hash(9),
        key_hash((10, "fg")),
    ]


def test_vectorized_numpy_and_null_columns():
    assert key_hashes_for_columns([np.array([1, INT64_MIN, INT64_MAX])]).tolist() == [
        key_hash(1),
        key_hash(INT64_MIN),
        key_hash(INT64_MAX),
    ]
    assert key_hashes_for_columns([np.array([-3, 5], dtype=np.int8)]).tolist() == [key_hash(-3), key_hash(5)]
    assert key_hashes_for_columns([np.array([True, False])]).tolist() == [key_hash(1), key_hash(0)]
    assert key_hashes_for_columns([np.array(["ab", "日本語"])]).tolist() == [key_hash("ab"), key_hash("日本語")]
    assert key_hashes_for_columns([np.array([b"ab", b"xyz"])]).tolist() == [key_hash(b"ab"), key_hash(b"xyz")]
    assert key_hashes_for_columns([np.array(["ab", None], dtype=object)]).tolist() == [key_hash("ab"), 42]
    mixed = [np.array([1, 2]), pa.array([None, None], type=pa.null()), pa.array(["x", "y"])]
    assert key_hashes_for_columns(mixed).tolist() == [key_hash((1, None, "x")), key_hash((2, None, "y"))]


@pytest.mark.parametrize(
    ("columns", "error", "match"),
    [
        ([pa.array([1.0])], UnsupportedKeyError, "Arrow type double"),
        ([np.array([1.0, 2.0])], UnsupportedKeyError, "Arrow type double"),
        ([pa.array([1], type=pa.uint64())], UnsupportedKeyError, "Arrow type uint64"),
        ([pa.array([1], type=pa.timestamp("s"))], UnsupportedKeyError, r"Arrow type timestamp\[s\]"),
        ([pa.array([[1]])], UnsupportedKeyError, "Arrow type list"),
        ([np.array([1, "a"], dtype=object)], UnsupportedKeyError, "cannot be converted to Arrow"),
        ([[1, 2]], UnsupportedKeyError, "key column 0 is a list"),
        ([], UnsupportedKeyError, "non-empty sequence"),
        (pa.array([1, 2]), UnsupportedKeyError, "non-empty sequence of key columns, got Int64Array"),
        (pa.table({"k": [1, 2]}), UnsupportedKeyError, "non-empty sequence of key columns, got Table"),
        ([np.zeros((2, 2), dtype=np.int64)], ConfigError, r"shape \(2, 2\)"),
        ([pa.array([1, 2]), pa.array(["a"])], ConfigError, "key column 1 has 1 rows but column 0 has 2"),
    ],
)
def test_vectorized_rejections(columns, error, match):
    with pytest.raises(error, match=match):
        key_groups_for_columns(columns, 16)


def test_vectorized_groups_use_python_modulo():
    groups = key_groups_for_columns([pa.array([1, -1, INT64_MIN])], 4096)
    assert groups.tolist() == [(-1712319331) % 4096, (-939490007) % 4096, (-853646085) % 4096]


# --------------------------------------------------------------------------- standard murmur3_32


def _standard_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes):
        return value
    return int(value).to_bytes(8, "little", signed=True)


_VAR_TYPES = [pa.string(), pa.large_string(), pa.string_view(), pa.binary(), pa.large_binary(), pa.binary_view()]


@settings(max_examples=300, deadline=None)
@given(
    arrow_type=st.sampled_from(_VAR_TYPES + [pa.int64(), pa.int16(), pa.bool_()]),
    data=st.data(),
    seed=st.one_of(st.sampled_from([0, HASH_SEED, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    cuts=st.lists(st.integers(0, 50), max_size=3),
)
def test_murmur3_32_is_standard_murmur3_with_any_seed(arrow_type, data, seed, cuts):
    if pa.types.is_integer(arrow_type):
        bits = arrow_type.bit_width
        values = st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    elif pa.types.is_boolean(arrow_type):
        values = st.booleans()
    elif arrow_type in (pa.string(), pa.large_string(), pa.string_view()):
        values = st.one_of(st.text(max_size=100), st.text(alphabet="\x00aé日😀", max_size=100))
    else:
        values = st.binary(max_size=100)
    keys = data.draw(st.lists(st.none() | values, max_size=40))
    expected = [seed if k is None else mmh3.hash(_standard_bytes(k), seed, signed=False) for k in keys]
    array = pa.array(keys, type=arrow_type)
    hashes = murmur3_32(array, seed)
    assert hashes.dtype == np.uint32
    assert hashes.tolist() == expected
    bounds = sorted({0, len(keys), *(min(c, len(keys)) for c in cuts)})
    chunked = pa.chunked_array([array.slice(a, b - a) for a, b in zip(bounds, bounds[1:])], type=arrow_type)
    assert murmur3_32(chunked, seed).tolist() == expected


def test_murmur3_32_differs_from_the_padded_key_hash_only_where_a_tail_exists():
    values = ["", "abcd", "ab", "ab\x00\x00", "abcde"]
    standard = murmur3_32(pa.array(values), HASH_SEED).view(np.int32).tolist()
    padded = key_hashes_for_columns([pa.array(values)]).tolist()
    assert [s == p for s, p in zip(standard, padded)] == [True, True, False, True, False]
    assert padded[2] == padded[3] and standard[2] != standard[3]


@pytest.mark.parametrize("seed", [-1, 2**32, 1.0, True, "0"])
def test_murmur3_32_rejects_seeds_outside_32_bits(seed):
    with pytest.raises(ConfigError, match="seed"):
        murmur3_32(pa.array(["a"]), seed)
