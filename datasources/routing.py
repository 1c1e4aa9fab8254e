"""Which split a key goes to: one definition, for scalars and Arrow columns. No I/O, no pyspark.

``split_of_key(key, num_splits)`` is murmur3 x86 32-bit (seed 0, unsigned) of
the key's canonical bytes, modulo ``num_splits``: UTF-8 for strings, the raw
bytes for binary, 8-byte little-endian two's complement for integers. Null
keys go to split 0. Never Python's ``hash()``: it differs between processes.
"""

from __future__ import annotations

from typing import Iterator

import mmh3
import numpy as np
import pyarrow as pa

from datasources.errors import UnsupportedKeyColumnError


def key_bytes(key) -> bytes | None:
    """The canonical bytes of a key: UTF-8 for str, raw bytes, 8-byte little-endian signed for int.

    ``None`` (a null key) has no bytes. Other types raise ``UnsupportedKeyColumnError``.
    """
    if key is None:
        return None
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key).to_bytes(8, "little", signed=True)
    raise UnsupportedKeyColumnError(
        f"a key of type {type(key).__name__} has no canonical bytes; use a string, binary or integer key column"
    )


def split_of_key(key, num_splits: int) -> int:
    """The split of ``key``: murmur3 x86 32-bit (seed 0) of its canonical bytes, mod ``num_splits``.

    Null keys go to split 0. The same key maps to the same split in every process.
    """
    data = key_bytes(key)
    if data is None:
        return 0
    return mmh3.hash(data, 0, signed=False) % num_splits


def is_key_type(arrow_type: pa.DataType) -> bool:
    """Whether a column of this Arrow type can be a ``keyColumn``."""
    return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type)
            or pa.types.is_integer(arrow_type))


def splits_of_keys(column: pa.Array, num_splits: int) -> np.ndarray:
    """``split_of_key`` for every value of an Arrow column (int32 array)."""
    if pa.types.is_integer(column.type):
        def split(k):
            return 0 if k is None else mmh3.hash(k.to_bytes(8, "little", signed=True), 0, signed=False) % num_splits
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        def split(k):
            return 0 if k is None else mmh3.hash(k, 0, signed=False) % num_splits
    else:
        def split(k):
            return split_of_key(k, num_splits)
    return np.fromiter(map(split, column.to_pylist()), dtype=np.int32, count=len(column))


def route_batch(batch: pa.RecordBatch, splits: np.ndarray, num_splits: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Group the rows of ``batch`` by split (``splits[i]`` is row i's split), keeping row order."""
    order = np.argsort(splits, kind="stable")
    counts = np.bincount(splits, minlength=num_splits)
    ordered = batch.take(pa.array(order))
    position = 0
    for split, count in enumerate(counts.tolist()):
        if count:
            yield split, ordered.slice(position, count)
            position += count
