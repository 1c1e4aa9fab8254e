"""Which split a key goes to: one definition, over Arrow columns. No I/O, no pyspark.

The split of a key is murmur3 x86 32-bit (seed 0, unsigned) of the key's
canonical bytes, modulo ``num_splits``: UTF-8 for strings, the raw bytes for
binary, 8-byte little-endian two's complement for integers. Null keys go to
split 0. The hash is ``spark_state.keyspace.murmur3_32`` (vectorized,
standard Murmur3: no padding), so ``mmh3.hash(key_bytes, 0, signed=False) %
num_splits`` is the reference. The mapping is part of the on-disk format:
changing it would put new records of a key in another split than its old ones.
Never Python's ``hash()``: it differs between processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from datasources.errors import UnsupportedKeyColumnError
from spark_state.keyspace import murmur3_32

SPLIT_HASH_SEED = 0


def is_key_type(arrow_type: pa.DataType) -> bool:
    """Whether a column of this Arrow type can be a ``keyColumn``: string, binary, or a signed or 8-32 bit integer.

    ``uint64`` is not (its values do not all fit the 8-byte signed encoding);
    Spark never produces it.
    """
    return (
        pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or pa.types.is_binary(arrow_type)
        or pa.types.is_large_binary(arrow_type)
        or (pa.types.is_integer(arrow_type) and not pa.types.is_uint64(arrow_type))
    )


def splits_of_keys(column: pa.Array, num_splits: int) -> np.ndarray:
    """The split of every key of an Arrow column (int32, ``0 <= split < num_splits``); nulls go to 0.

    ``num_splits >= 1``. Raises ``UnsupportedKeyColumnError`` for a column
    type ``is_key_type`` refuses.
    """
    if not is_key_type(column.type):
        raise UnsupportedKeyColumnError(
            f"a key column of Arrow type {column.type} has no canonical key bytes; "
            "use a string, binary or integer key column"
        )
    splits = (murmur3_32(column, SPLIT_HASH_SEED).astype(np.int64) % num_splits).astype(np.int32)
    if column.null_count:
        splits[column.is_null().to_numpy(zero_copy_only=False)] = 0
    return splits


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
