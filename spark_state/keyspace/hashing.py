"""Keys to key groups: the canonical encoding of a key and its hash, the first step of routing. Pure: no I/O.

``key_group_for(key, max_parallelism)`` is ``key_hash(key) mod max_parallelism``
(Python's ``%``, always in ``[0, max_parallelism)``); ``ranges`` assigns key
groups to instances.

The hash is Spark's ``hash()`` (Murmur3 x86_32, seed 42, nulls skipped) over a
canonical encoding of each key component, so the JVM computes the same key
group with ``pmod(hash(enc(c1), enc(c2), ...), max_parallelism)`` and no
Python UDF (``spark_state.spark.routing`` builds that expression). Encoding of one
component:

- ``None``: skipped; the running hash is unchanged (Spark skips nulls). A key
  whose components are all ``None`` hashes to ``HASH_SEED``.
- ``bool``: as the int 0 or 1 (so ``True`` and ``1`` share a key group).
- ``int`` (Python or numpy) in ``[-2**63, 2**63)``: 8 bytes, little-endian
  two's complement, i.e. Spark's ``hash(CAST(c AS BIGINT))``.
- ``str``: its UTF-8 bytes; ``bytes``/``bytearray``/``memoryview``: the bytes.
  Both are then zero-padded at the end to a multiple of 4 bytes (so ``"ab"``,
  ``b"ab"`` and ``"ab\\0"`` share a key group). Spark's Murmur3 mixes a
  1-3 byte tail differently from standard Murmur3; with no tail both agree.

Anything else (``float``, ``Decimal``, ``datetime``, nested tuples, ...) raises
``UnsupportedKeyError``: cast it to one of the supported types first, the same
way on the Spark side and in Python. Python's built-in ``hash()`` is never
used: it is randomised per process.

``murmur3_32(column, seed)`` is the same vectorized hash without Spark's
padding: standard Murmur3 x86_32 of each value's unpadded bytes, for hashes
that must equal ``mmh3.hash(data, seed, signed=False)`` (the ``replayable``
log routes keys to its splits with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mmh3
import numpy as np

from spark_state.errors import ConfigError, UnsupportedKeyError
from spark_state.keyspace.ranges import check_max_parallelism

HASH_SEED = 42
"""Initial value of the running hash; Spark's ``hash()`` uses 42 too."""

HASH_VERSION = 1
"""Version of the key encoding and hash. Checkpoints record it; a restore with
a different version must refuse, because every key could map to another key
group. Bump it on any change to ``key_hash``."""

_INT64_MIN = -(2**63)
_INT64_END = 2**63  # exclusive
_U32 = 0xFFFFFFFF
_SUPPORTED_COMPONENTS = "None, bool, int (64-bit signed range), str, bytes, bytearray, memoryview"
_SUPPORTED_ARROW = (
    "int8, int16, int32, int64, uint8, uint16, uint32, bool, string, large_string, "
    "binary, large_binary, string_view, binary_view, null"
)


# --------------------------------------------------------------------------- scalar hash


def _encode_component(component: object) -> bytes:
    """Return the canonical bytes of one non-null key component (see the module docstring)."""
    if isinstance(component, (bool, np.bool_)):
        component = int(component)
    if isinstance(component, (int, np.integer)):
        value = int(component)
        if not _INT64_MIN <= value < _INT64_END:
            raise UnsupportedKeyError(
                f"int key component {value} is outside the 64-bit signed range "
                "[-2**63, 2**63): use a str or bytes key instead"
            )
        return value.to_bytes(8, "little", signed=True)
    if isinstance(component, str):
        try:
            data = component.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnsupportedKeyError(
                f"str key component {component!r} is not valid Unicode (it has a lone surrogate) "
                "and cannot be encoded as UTF-8: clean the key or use bytes"
            ) from exc
    elif isinstance(component, (bytes, bytearray, memoryview)):
        data = bytes(component)
    else:
        raise UnsupportedKeyError(
            f"key component of type {type(component).__name__} ({component!r}) has no canonical "
            f"encoding; supported component types: {_SUPPORTED_COMPONENTS}. "
            "Cast it (for example to str) the same way on the Spark side"
        )
    return data + b"\0" * (-len(data) % 4)


def key_hash(key: Any) -> int:
    """Return the signed 32-bit hash of ``key``, equal to Spark's ``hash(enc(c1), enc(c2), ...)``.

    Args:
        key: a supported scalar, treated as the 1-tuple ``(key,)``, or a
            non-empty tuple of supported components (``None`` allowed).

    Returns:
        ``-2**31 <= hash < 2**31``.

    Raises:
        UnsupportedKeyError: an unsupported component type, an int outside
            64 bits, a str that is not valid Unicode, or the empty tuple.
    """
    components = key if isinstance(key, tuple) else (key,)
    if not components:
        raise UnsupportedKeyError(
            "the empty tuple is not a key: a key needs at least one component "
            "(Spark's hash() needs at least one argument)"
        )
    h = HASH_SEED
    for component in components:
        if component is not None:
            h = mmh3.hash(_encode_component(component), h & _U32, signed=True)
    return h


def key_group_for(key: Any, max_parallelism: int) -> int:
    """Return the key group of ``key``: ``key_hash(key) % max_parallelism``.

    Args:
        key: as for ``key_hash``.
        max_parallelism: ``1 <= max_parallelism <= 32768``.

    Returns:
        ``0 <= key_group < max_parallelism`` (Python's ``%``, which equals Spark's ``pmod``).

    Raises:
        InvalidParallelismError: bad ``max_parallelism``.
        UnsupportedKeyError: as for ``key_hash``.
    """
    m = check_max_parallelism(max_parallelism)
    return key_hash(key) % m


# --------------------------------------------------------------------------- vectorized hash

_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_TAIL_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF], dtype=np.uint32)
_MAX_VECTOR_BLOCKS = 16
"""Strings and binaries of at most 16 blocks (64 bytes) are hashed in numpy; longer ones by ``mmh3``."""


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _scramble(k: np.ndarray) -> np.ndarray:
    """Murmur3 x86_32's mixing of one 4-byte little-endian word, before it meets the hash."""
    return _rotl(k * _C1, 15) * _C2


def _mix_block(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    """One Murmur3 x86_32 body step: mix the 4-byte little-endian block ``k`` into ``h``."""
    h = _rotl(h ^ _scramble(k), 13)
    return h * np.uint32(5) + np.uint32(0xE6546B64)


def _finalize(h: np.ndarray, n_bytes: np.ndarray | int) -> np.ndarray:
    """Murmur3 x86_32 finalization; ``n_bytes`` is the hashed length (the padded one when padding)."""
    h = h ^ np.asarray(n_bytes, dtype=np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _hash_int64(values: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Hash each int64 as 8 little-endian bytes (two blocks), seeded per row."""
    blocks = values.astype("<i8", copy=False).view("<u4").reshape(-1, 2)
    h = _mix_block(seeds, blocks[:, 0])
    h = _mix_block(h, blocks[:, 1])
    return _finalize(h, 8)


def _hash_var_bytes(array: Any, seeds: np.ndarray, valid: np.ndarray, pad: bool) -> np.ndarray:
    """Hash each value of a (large_)string/(large_)binary Arrow array, seeded per row.

    ``pad=True`` (key groups, Spark's variant): each value is zero-padded to a
    multiple of 4 bytes, so every byte is in a body block and finalization
    uses the padded length. ``pad=False`` (standard Murmur3): ``length // 4``
    body blocks, then the 1-3 byte tail scrambled into the hash without the
    body's rotate-multiply-add, and finalization with the true length.

    Reads the Arrow offsets and data buffers directly. Rows are bucketed by
    their number of body blocks ``b``; a bucket with ``b <= 16`` is hashed in
    numpy as a ``(b, rows)`` matrix of words gathered from the data buffer,
    with the bytes of the next value masked off wherever a word reaches past
    its value. Longer valid values fall back to ``mmh3`` one row at a time.
    Null rows are hashed too (from whatever bytes their offsets span); the
    caller discards them.
    """
    import pyarrow as pa

    n = len(array)
    offset_type = "<i8" if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type) else "<i4"
    offsets = np.frombuffer(array.buffers()[1], dtype=offset_type)[array.offset : array.offset + n + 1]
    offsets = offsets.astype(np.int64)
    base, stop = int(offsets[0]), int(offsets[-1])
    padded = np.zeros(stop - base + 4, dtype=np.uint8)
    if stop > base:
        padded[: stop - base] = np.frombuffer(array.buffers()[2], dtype=np.uint8)[base:stop]
    # words[i] is the little-endian uint32 starting at byte i (unaligned view, no copy).
    words = np.ndarray(shape=(len(padded) - 3,), dtype="<u4", buffer=padded, strides=(1,))

    starts = offsets[:-1] - base
    lengths = offsets[1:] - offsets[:-1]
    if pad:
        n_blocks = (lengths + 3) // 4
        hashed_lengths = 4 * n_blocks
    else:
        n_blocks = lengths // 4
        hashed_lengths = lengths
    h = seeds.copy()
    counts = np.bincount(np.minimum(n_blocks, _MAX_VECTOR_BLOCKS + 1), minlength=_MAX_VECTOR_BLOCKS + 2)
    for blocks in np.flatnonzero(counts[: _MAX_VECTOR_BLOCKS + 1]):
        if not blocks:
            continue
        rows = slice(None) if counts[blocks] == n else np.flatnonzero(n_blocks == blocks)
        block_words = words[np.add.outer(np.arange(0, 4 * blocks, 4), starts[rows])]
        if pad:
            block_words[-1] &= _TAIL_MASKS[lengths[rows] - 4 * (blocks - 1)]
        acc = h[rows]
        for block in block_words:
            acc = _mix_block(acc, block)
        h[rows] = acc
    vectorized = n_blocks <= _MAX_VECTOR_BLOCKS
    if not pad:
        tails = lengths - 4 * n_blocks
        rows = np.flatnonzero(vectorized & (tails > 0))
        h[rows] ^= _scramble(words[starts[rows] + 4 * n_blocks[rows]] & _TAIL_MASKS[tails[rows]])
    h[vectorized] = _finalize(h[vectorized], hashed_lengths[vectorized])
    for row in np.flatnonzero(~vectorized & valid):
        start, length = int(starts[row]), int(lengths[row])
        data = padded[start : start + length].tobytes()
        if pad:
            data += b"\0" * (-length % 4)
        h[row] = mmh3.hash(data, int(h[row]), signed=False)
    return h


def _hash_arrow_chunk(array: Any, seeds: np.ndarray, column_index: int, pad: bool = True) -> np.ndarray:
    """Fold one key column (a non-chunked Arrow array) into the running hashes ``seeds``.

    ``pad`` as for ``_hash_var_bytes``; integers (8 bytes) hash the same either way.
    """
    import pyarrow as pa

    kind = array.type
    if pa.types.is_null(kind):
        return seeds
    if array.null_count:
        valid = array.is_valid().to_numpy(zero_copy_only=False)
    else:
        valid = np.ones(len(array), dtype=bool)
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
        array = array.cast(pa.large_binary())
        kind = array.type
    if (pa.types.is_integer(kind) and not pa.types.is_uint64(kind)) or pa.types.is_boolean(kind):
        array = array.cast(pa.int64())
        values = np.frombuffer(array.buffers()[1], dtype=np.int64)[array.offset : array.offset + len(array)]
        hashed = _hash_int64(values, seeds)
    elif kind in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary()):
        hashed = _hash_var_bytes(array, seeds, valid, pad)
    else:
        raise UnsupportedKeyError(
            f"key column {column_index} has Arrow type {kind}, which has no canonical encoding; "
            f"supported types: {_SUPPORTED_ARROW}. Cast it (for example uint64 or a timestamp "
            "to int64) the same way on the Spark side"
        )
    return np.where(valid, hashed, seeds)


def _as_arrow(column: Any, column_index: int) -> Any:
    """Return ``column`` as a pyarrow Array or ChunkedArray; numpy arrays are converted."""
    import pyarrow as pa

    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        return column
    if isinstance(column, np.ndarray):
        if column.ndim != 1:
            raise ConfigError(f"key column {column_index} has shape {column.shape}: pass 1-dimensional columns")
        try:
            return pa.array(column)
        except (pa.ArrowException, OverflowError) as exc:
            raise UnsupportedKeyError(
                f"key column {column_index} (numpy dtype {column.dtype}) cannot be converted to Arrow "
                f"({exc}); use one supported type per column: {_SUPPORTED_ARROW}"
            ) from exc
    raise UnsupportedKeyError(
        f"key column {column_index} is a {type(column).__name__}; pass a pyarrow.Array, "
        "pyarrow.ChunkedArray or 1-dimensional numpy.ndarray"
    )


def key_hashes_for_columns(columns: Sequence[Any]) -> np.ndarray:
    """Vectorized ``key_hash``: row ``i`` hashes the tuple ``(columns[0][i], columns[1][i], ...)``.

    Nulls are skipped per row exactly like ``None`` components in ``key_hash``.

    Args:
        columns: one or more key columns of equal length, each a
            ``pyarrow.Array``, ``pyarrow.ChunkedArray`` or 1-dimensional
            ``numpy.ndarray`` of a supported type (integers up to 64 bits
            signed or 32 bits unsigned, bool, string, binary; see
            ``key_groups_for_columns``).

    Returns:
        ``int32`` array of length ``len(columns[0])``, ``-2**31 <= hash < 2**31``.

    Raises:
        UnsupportedKeyError: no columns, or a column of an unsupported type.
        ConfigError: columns of different lengths, or not 1-dimensional.
    """
    import pyarrow as pa

    if isinstance(columns, (pa.Array, pa.ChunkedArray, pa.Table, pa.RecordBatch, np.ndarray)) or not len(columns):
        raise UnsupportedKeyError(
            f"columns must be a non-empty sequence of key columns, got {type(columns).__name__}: "
            "pass e.g. [table['user_id']]; a key needs at least one component"
        )
    arrays = [_as_arrow(column, index) for index, column in enumerate(columns)]
    n_rows = len(arrays[0])
    for index, array in enumerate(arrays):
        if len(array) != n_rows:
            raise ConfigError(
                f"key column {index} has {len(array)} rows but column 0 has {n_rows}: "
                "all key columns must have the same length"
            )
    h = np.full(n_rows, HASH_SEED, dtype=np.uint32)
    for index, array in enumerate(arrays):
        chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
        start = 0
        for chunk in chunks:
            stop = start + len(chunk)
            h[start:stop] = _hash_arrow_chunk(chunk, h[start:stop], index)
            start = stop
    return h.view(np.int32)


def key_groups_for_columns(columns: Sequence[Any], max_parallelism: int) -> np.ndarray:
    """Vectorized ``key_group_for``: the key group of every row of the key columns.

    Row ``i``'s key is the tuple ``(columns[0][i], columns[1][i], ...)``;
    nulls are skipped like ``None`` components. Supported Arrow types (numpy
    arrays are converted with ``pyarrow.array``): int8..int64 and
    uint8..uint32 (hashed as int64), bool (as 0/1), string and large_string
    (UTF-8 bytes), binary and large_binary, the string/binary view types, and
    null (an all-null column, skipped).

    Args:
        columns: one or more key columns of equal length.
        max_parallelism: ``1 <= max_parallelism <= 32768``.

    Returns:
        ``int32`` array, ``0 <= key_group < max_parallelism``, one per row.

    Raises:
        InvalidParallelismError: bad ``max_parallelism``.
        UnsupportedKeyError, ConfigError: as for ``key_hashes_for_columns``.
    """
    m = check_max_parallelism(max_parallelism)
    return np.mod(key_hashes_for_columns(columns), np.int32(m))


def murmur3_32(column: Any, seed: int = 0) -> np.ndarray:
    """Standard Murmur3 x86_32 of every value of one column: ``mmh3.hash(data, seed, signed=False)``.

    ``data`` is the value's canonical encoding without padding: UTF-8 for
    strings, the bytes of binaries, 8 little-endian bytes (two's complement)
    for integers and for bools (0 or 1). Unlike ``key_hashes_for_columns``
    (Spark's variant: zero-padded bytes, seed ``HASH_SEED``), a 1-3 byte tail
    is mixed the standard way and finalization uses the true length, so
    ``"ab"`` and ``"ab\\0"`` hash differently.

    Args:
        column: a ``pyarrow.Array``, ``pyarrow.ChunkedArray`` or 1-dimensional
            ``numpy.ndarray`` of a type ``key_groups_for_columns`` supports.
        seed: ``0 <= seed < 2**32``.

    Returns:
        ``uint32`` array, one hash per row. A null row holds ``seed``: tell
        nulls apart with the column's validity, not by the value.

    Raises:
        UnsupportedKeyError: a column of an unsupported type.
        ConfigError: ``seed`` out of range, or a column that is not 1-dimensional.
    """
    import pyarrow as pa

    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= _U32:
        raise ConfigError(f"murmur3 seed must be an int with 0 <= seed < 2**32, got {seed!r}")
    array = _as_arrow(column, 0)
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    hashes = np.empty(len(array), dtype=np.uint32)
    start = 0
    for chunk in chunks:
        stop = start + len(chunk)
        hashes[start:stop] = _hash_arrow_chunk(chunk, np.full(len(chunk), seed, dtype=np.uint32), 0, pad=False)
        start = stop
    return hashes
