"""Key groups and their assignment to instances: the second step of routing. Pure: no I/O, no pyspark.

Routing has two steps, both pure functions of their arguments (the first, ``key -> key_group``, is ``hashing``):

1. ``key -> key_group``: ``key_group = key_hash(key) mod max_parallelism``
   (``hashing.key_group_for``). ``max_parallelism`` is the size of the key
   space and is fixed for the life of a checkpoint chain; changing it moves
   almost every key to another key group.
2. ``key_group -> instance``: the key space is cut into ``parallelism``
   contiguous ranges whose sizes differ by at most one, the larger ranges
   first (see ``key_group_range``). Changing ``parallelism`` moves whole key
   groups between instances, never single keys; that is what makes state
   rescalable.

Every parameter states its valid range (``0 <= key_group < max_parallelism``,
``1 <= parallelism <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM``) and
every bound says whether it is inclusive.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from spark_state.errors import InvalidParallelismError

DEFAULT_MAX_PARALLELISM = 1024
"""Smallest key space a new store takes by default (``default_max_parallelism``).

With ``M`` key groups and ``p`` instances the largest instance owns
``ceil(M/p)`` key groups and the smallest ``floor(M/p)``, so with evenly
spread keys the busiest instance carries at most ``1/floor(M/p)`` more load
than the idlest: 3.2% while each instance owns at least 32 key groups. A
key group costs its instance one entry per checkpoint that touches it (an
IPC message, an index row, a compaction decision), so a key space far
larger than the parallelism needs makes every batch slower: at parallelism
2, a checkpoint of 27k changed keys took 35 ms over 512 key groups per
instance against 75-90 ms over 2048.
"""

KEY_GROUPS_PER_INSTANCE = 32
"""Key groups each instance owns at the first parallelism of a new store, at least (``default_max_parallelism``)."""

UPPER_BOUND_MAX_PARALLELISM = 32768
"""Largest allowed ``max_parallelism`` (inclusive): ``1 <= max_parallelism <= 32768``."""

# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: object) -> int:
    """Return ``value`` as an ``int``; reject ``bool``, ``float`` and every non-integer."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidParallelismError(
            f"{name} must be an int, got {type(value).__name__} {value!r}: pass a whole number"
        )
    return int(value)


def check_max_parallelism(max_parallelism: int) -> int:
    """Return ``max_parallelism`` as an ``int`` if ``1 <= max_parallelism <= 32768``.

    Raises:
        InvalidParallelismError: not an int, or out of range.
    """
    m = _check_int("max_parallelism", max_parallelism)
    if not 1 <= m <= UPPER_BOUND_MAX_PARALLELISM:
        raise InvalidParallelismError(
            f"max_parallelism={m} is out of range: need 1 <= max_parallelism <= {UPPER_BOUND_MAX_PARALLELISM}"
        )
    return m


def default_max_parallelism(parallelism: int) -> int:
    """The key space of a new store when ``spark.state.maxParallelism`` is unset.

    The smallest power of two that gives each of ``parallelism`` instances
    at least ``KEY_GROUPS_PER_INSTANCE`` key groups (at most 3.2% extra load
    on the busiest), and at least ``DEFAULT_MAX_PARALLELISM``, so a query
    started small can scale to 1024 instances; at most 32768. The key space
    is fixed for the life of a store: set ``spark.state.maxParallelism`` to
    scale further, or to keep the load even at a much larger parallelism.
    """
    p, _ = check_parallelism(parallelism, UPPER_BOUND_MAX_PARALLELISM)
    wanted = 1 << (KEY_GROUPS_PER_INSTANCE * p - 1).bit_length()
    return min(UPPER_BOUND_MAX_PARALLELISM, max(DEFAULT_MAX_PARALLELISM, wanted))


def check_parallelism(parallelism: int, max_parallelism: int) -> tuple[int, int]:
    """Return ``(parallelism, max_parallelism)`` as ints if ``1 <= parallelism <= max_parallelism``.

    ``max_parallelism`` is checked first, as by ``check_max_parallelism``.

    Raises:
        InvalidParallelismError: not ints, or out of range.
    """
    m = check_max_parallelism(max_parallelism)
    p = _check_int("parallelism", parallelism)
    if not 1 <= p <= m:
        raise InvalidParallelismError(
            f"parallelism={p} is out of range: need 1 <= parallelism <= max_parallelism (={m}). "
            "Lower the parallelism, or start a new checkpoint chain with a larger max_parallelism "
            "(it is fixed for the life of a chain)"
        )
    return p, m


def _check_instance(instance: object, parallelism: int) -> int:
    i = _check_int("instance", instance)
    if not 0 <= i < parallelism:
        raise InvalidParallelismError(
            f"instance={i} is out of range: need 0 <= instance < parallelism (={parallelism})"
        )
    return i


def _check_key_group(key_group: object, max_parallelism: int) -> int:
    g = _check_int("key_group", key_group)
    if not 0 <= g < max_parallelism:
        raise InvalidParallelismError(
            f"key_group={g} is out of range: need 0 <= key_group < max_parallelism "
            f"(={max_parallelism}); compute it with key_group_for(key, max_parallelism)"
        )
    return g


# --------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class KeyGroupRange:
    """The key groups ``start..end``, both ends inclusive, never empty.

    Attributes:
        start: first key group, ``0 <= start <= end``.
        end: last key group (inclusive), ``start <= end < 32768``.

    Length is ``end - start + 1``. ``intersection`` returns ``None`` rather than
    an empty range when two ranges are disjoint.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        start = _check_int("start", self.start)
        end = _check_int("end", self.end)
        if not 0 <= start <= end < UPPER_BOUND_MAX_PARALLELISM:
            raise InvalidParallelismError(
                f"KeyGroupRange(start={start}, end={end}) is invalid: need "
                f"0 <= start <= end < {UPPER_BOUND_MAX_PARALLELISM} (end is inclusive)"
            )
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __contains__(self, key_group: object) -> bool:
        if isinstance(key_group, (bool, np.bool_)) or not isinstance(key_group, (int, np.integer)):
            return False
        return bool(self.start <= key_group <= self.end)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange | None:
        """Return the key groups in both ranges, or ``None`` if they share none."""
        start = max(self.start, other.start)
        end = min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else None

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"


def key_group_range(instance: int, parallelism: int, max_parallelism: int) -> KeyGroupRange:
    """Return the key groups owned by ``instance``.

    With ``q, r = divmod(max_parallelism, parallelism)``, instances ``0..r-1``
    own ``q + 1`` key groups each and instances ``r..parallelism-1`` own ``q``;
    the ranges are contiguous, in instance order, and cover
    ``[0, max_parallelism)`` with no gap or overlap.

    Args:
        instance: ``0 <= instance < parallelism``.
        parallelism: ``1 <= parallelism <= max_parallelism``.
        max_parallelism: ``1 <= max_parallelism <= 32768``.

    Raises:
        InvalidParallelismError: an argument is not an int or out of range.
    """
    p, m = check_parallelism(parallelism, max_parallelism)
    i = _check_instance(instance, p)
    q, r = divmod(m, p)
    start = i * q + min(i, r)
    size = q + 1 if i < r else q
    return KeyGroupRange(start, start + size - 1)


def instance_for_key_group(key_group: int, parallelism: int, max_parallelism: int) -> int:
    """Return the instance that owns ``key_group``: the ``i`` with ``key_group in key_group_range(i, ...)``.

    Args:
        key_group: ``0 <= key_group < max_parallelism``.
        parallelism: ``1 <= parallelism <= max_parallelism``.
        max_parallelism: ``1 <= max_parallelism <= 32768``.

    Returns:
        ``0 <= instance < parallelism``.

    Raises:
        InvalidParallelismError: an argument is not an int or out of range.
    """
    p, m = check_parallelism(parallelism, max_parallelism)
    g = _check_key_group(key_group, m)
    q, r = divmod(m, p)
    first_small = r * (q + 1)  # first key group of the first q-sized range
    if g < first_small:
        return g // (q + 1)
    return r + (g - first_small) // q


def instances_for_key_groups(key_groups: np.ndarray, parallelism: int, max_parallelism: int) -> np.ndarray:
    """Vectorized ``instance_for_key_group``: the owning instance of every element.

    Args:
        key_groups: integer array (any shape), every element
            ``0 <= key_group < max_parallelism``.
        parallelism: ``1 <= parallelism <= max_parallelism``.
        max_parallelism: ``1 <= max_parallelism <= 32768``.

    Returns:
        ``int32`` array of the same shape, ``0 <= instance < parallelism``.

    Raises:
        InvalidParallelismError: a non-integer array, an element out of range,
            or bad ``parallelism``/``max_parallelism``.
    """
    p, m = check_parallelism(parallelism, max_parallelism)
    groups = np.asarray(key_groups)
    if groups.dtype.kind not in "iu":
        raise InvalidParallelismError(
            f"key_groups must be an integer array, got dtype {groups.dtype}: compute them with key_groups_for_columns"
        )
    if groups.size:
        bad = (groups < 0) | (groups >= m)
        if bad.any():
            _check_key_group(groups[bad].flat[0], m)
    q, r = divmod(m, p)
    owner = np.repeat(np.arange(p, dtype=np.int32), [q + 1] * r + [q] * (p - r))
    return owner[groups]
