"""The key space: keys to key groups (``hashing``) and key groups to instances (``ranges``). Pure: no I/O.

The one routing definition: the JVM's routing expressions (``spark.routing``)
and the store's ownership checks compute these same functions, so a key is
never routed to an instance that does not own its key group.

May import: ``spark_state.errors`` only (and numpy, mmh3). Everything else of
spark-state may import it.
"""

from spark_state.keyspace.hashing import (
    HASH_SEED,
    HASH_VERSION,
    key_group_for,
    key_groups_for_columns,
    key_hash,
    key_hashes_for_columns,
    murmur3_32,
)
from spark_state.keyspace.ranges import (
    DEFAULT_MAX_PARALLELISM,
    KEY_GROUPS_PER_INSTANCE,
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    check_max_parallelism,
    check_parallelism,
    default_max_parallelism,
    instance_for_key_group,
    instances_for_key_groups,
    key_group_range,
)

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "HASH_SEED",
    "HASH_VERSION",
    "KEY_GROUPS_PER_INSTANCE",
    "UPPER_BOUND_MAX_PARALLELISM",
    "KeyGroupRange",
    "check_max_parallelism",
    "check_parallelism",
    "default_max_parallelism",
    "instance_for_key_group",
    "instances_for_key_groups",
    "key_group_for",
    "key_group_range",
    "key_groups_for_columns",
    "key_hash",
    "key_hashes_for_columns",
    "murmur3_32",
]
