"""Instance items: the non-keyed state of one instance, split or merged on rescale, never dropped. No I/O.

A user function reaches its instance's items as ``state.instance_items``: a
list of JSON values (buffers, positions, ...) shared by every key the
instance processes. On a parallelism change the items of all old instances
are concatenated in instance order and cut into contiguous slices for the
new instances (``redistribute_items``, Flink's split redistribution).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from spark_state.errors import ConfigError, KeyGroupOwnershipError


class InstanceItems:
    """A list of JSON values; mutate it through its methods so the next checkpoint knows to write it."""

    def __init__(self, values: Sequence[Any] = ()):
        self._values = list(values)
        self.changed = False

    def append(self, value: Any) -> None:
        self._values.append(value)
        self.changed = True

    def extend(self, values: Sequence[Any]) -> None:
        self._values.extend(values)
        self.changed = True

    def replace(self, values: Sequence[Any]) -> None:
        self._values = list(values)
        self.changed = True

    def clear(self) -> None:
        self.replace(())

    def __iter__(self):
        return iter(list(self._values))

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index):
        return self._values[index]

    def to_list(self) -> list:
        return list(self._values)


def redistribute_items(old: Mapping[int, Sequence[Any]], old_parallelism: int, new_parallelism: int) -> list[list]:
    """Split or merge per-instance items for a new parallelism.

    The items of old instances ``0 <= i < old_parallelism`` (missing ones
    hold none) are concatenated in instance order and cut into
    ``new_parallelism`` contiguous slices whose sizes differ by at most one,
    larger first. Every item lands in exactly one new instance, in order.
    """
    if old_parallelism < 1 or new_parallelism < 1:
        raise ConfigError(f"parallelism must be >= 1, got {old_parallelism} -> {new_parallelism}")
    stray = [i for i in old if not 0 <= i < old_parallelism]
    if stray:
        raise KeyGroupOwnershipError(f"items of instance(s) {stray} outside old parallelism {old_parallelism}")
    flat = [item for i in range(old_parallelism) for item in old.get(i, ())]
    size, extra = divmod(len(flat), new_parallelism)
    result, start = [], 0
    for j in range(new_parallelism):
        end = start + size + (1 if j < extra else 0)
        result.append(flat[start:end])
        start = end
    return result
