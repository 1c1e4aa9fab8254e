"""The extension recipes, followed in the test itself: a new aggregate and a new storage backend, then used.

Each recipe is written where its home is (``executor.aggregates``, ``storage.base.Backend``); a recipe that needs
a step it does not say fails here.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pyarrow as pa
import pytest
from click.testing import CliRunner

from spark_state.errors import BlobExistsError, BlobNotFoundError, ConfigError, ShortReadError
from spark_state.executor.aggregates import AGGREGATES, Aggregate, AggregateDef, register_aggregate
from spark_state.executor.columns import KEY_GROUP_COLUMN
from spark_state.executor.resident import ResidentState
from spark_state.keyspace import key_group_range, key_groups_for_columns
from spark_state.model.schema import KeyedSchema
from spark_state.storage import Backend, open_storage, register_backend
from spark_state.storage.base import Storage, check_path, check_range

# A new aggregate: one definition ---------------------------------------------------------------


def _spread() -> AggregateDef:
    """The toy aggregate, its functions made here: a definition's functions travel with the task (by value, for a
    module a worker may not import)."""

    def integers(name: str, column: str, kind: pa.DataType) -> None:
        if not pa.types.is_integer(kind):
            raise ConfigError(f"{name}({column!r}) needs an integer column, it is {kind}")

    return AggregateDef(
        "spread",
        True,
        integers,
        lambda t: (pa.int64(), pa.int64()),
        ("min", "max"),
        ("min", "max"),
        lambda _: pa.int64(),
        lambda s: None if s[0] is None else s[1] - s[0],
        in_jvm=lambda t: t is not None and pa.types.is_integer(t),
        doc="The largest minus the smallest value of ``column`` per key so far.",
        finish_arrow=lambda columns: pa.compute.subtract(columns[1], columns[0]),
        in_arrow=lambda t: t is not None and pa.types.is_integer(t),
    )


SPREAD = _spread()


@pytest.fixture
def spread():
    from spark_state.spark.streaming import KeyedStream

    register_aggregate(SPREAD)
    try:
        assert KeyedStream.spread.__doc__ == SPREAD.doc  # its method, made from the definition
        yield SPREAD
    finally:
        AGGREGATES.pop("spread")
        delattr(KeyedStream, "spread")


def _rows(keys: list[str], values: list[int]) -> pa.Table:
    column = pa.array(keys)
    return pa.table(
        {
            KEY_GROUP_COLUMN: pa.array(key_groups_for_columns([column], 8).astype("int32")),
            "key": column,
            "v": pa.array(values, pa.int64()),
        }
    )


@pytest.mark.parametrize("native", [False, True])
def test_a_new_aggregate_is_one_definition_merged_per_key_in_python_and_in_arrow(spread, native):
    aggregate = Aggregate("spread", "v", "spread_v", pa.int64())
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], aggregate.state_fields())
    state = ResidentState(schema, key_group_range(0, 1, 8), native=native)
    first = aggregate.apply(state.table, _rows(["a", "b", "a"], [5, 7, 1]), ("key",))
    second = aggregate.apply(state.table, _rows(["a", "b"], [9, 7]), ("key",))
    assert dict(zip(*first.sort_by("key").to_pydict().values())) == {"a": 4, "b": 0}
    assert dict(zip(*second.sort_by("key").to_pydict().values())) == {"a": 8, "b": 0}
    assert aggregate.vectorized() and SPREAD.output_name("v") == "spread_v"


def test_a_registered_aggregate_is_refused_twice_and_one_with_an_unknown_partial_at_once(spread):
    with pytest.raises(ConfigError, match="exists already"):
        register_aggregate(SPREAD)
    with pytest.raises(ConfigError, match="read a column, so it needs one"):
        AggregateDef(
            "largest",
            False,
            SPREAD.check,
            lambda t: (t,),
            ("max",),
            ("max",),
            lambda t: t,
            lambda s: s[0],
            lambda _: True,
        )
    with pytest.raises(ConfigError, match="each partial one of"):
        AggregateDef(
            "median",
            True,
            SPREAD.check,
            lambda t: (t,),
            ("median",),
            ("min",),
            lambda t: t,
            lambda s: s[0],
            lambda _: False,
        )


@pytest.mark.spark
@pytest.mark.parametrize("in_jvm", [True, False])
def test_a_new_aggregate_runs_in_a_query_with_its_method_and_its_partials_in_spark(
    spark, spread, tmp_path, in_jvm, monkeypatch
):
    from spark_state import keyed
    from tests.files import publish

    if not in_jvm:
        monkeypatch.setitem(AGGREGATES, "spread", AggregateDef(**{**SPREAD.__dict__, "in_jvm": lambda _: False}))
    (tmp_path / "input").mkdir()
    batches = [[("a", 5), ("b", 7), ("a", 1)], [("a", 9), ("c", -2)], [("b", 10)]]
    for i, rows in enumerate(batches):
        publish(
            pa.table({"user": [u for u, _ in rows], "amount": [a for _, a in rows]}),
            tmp_path / "input" / f"part-{i:05d}.parquet",
            i,
        )
    spark.conf.set("spark.state.store", str(tmp_path / "state"))
    outputs: dict[int, dict] = {}
    events = (
        spark.readStream.schema("user string, amount long")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(tmp_path / "input"))
    )
    stream = keyed(events, "user", name="spreads").spread("amount")
    query = (
        stream.writeStream.foreachBatch(
            lambda df, batch_id: outputs.__setitem__(batch_id, {r["user"]: r["spread_amount"] for r in df.collect()})
        )
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination()
    finally:
        query.stop()
        spark.conf.unset("spark.state.store")
    assert outputs == {0: {"a": 4, "b": 0}, 1: {"a": 8, "c": 0}, 2: {"b": 3}}
    assert stream.function.partials_in_jvm() == in_jvm


# A new storage backend: one module (here, this test) -------------------------------------------


class DictStorage(Storage):
    """Blobs in a dict, named by ``toy://NAME``: the smallest backend that keeps the storage contract."""

    stores: dict[str, dict[str, bytes]] = defaultdict(dict)

    def __init__(self, name: str):
        self.uri = f"toy://{name}"
        self.blobs = self.stores[name]

    def create(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        check_path(path)
        if any(p.startswith(path + "/") for p in self.blobs) or any(path.startswith(p + "/") for p in self.blobs):
            raise BlobExistsError(f"{path!r} is a directory or below a blob in {self.uri}")
        if path in self.blobs and not overwrite:
            raise BlobExistsError(f"{path!r} exists in {self.uri}")
        self.blobs[path] = bytes(data)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        check_path(path)
        check_range(offset, length)
        if path not in self.blobs:
            raise BlobNotFoundError(f"{path!r} does not exist in {self.uri}")
        data = self.blobs[path]
        end = len(data) if length is None else offset + length
        if offset > len(data) or end > len(data):
            raise ShortReadError(f"read of {path!r} past its end")
        return data[offset:end]

    def size(self, path: str) -> int:
        return len(self.read(path))

    def exists(self, path: str) -> bool:
        check_path(path)
        return path in self.blobs or any(p.startswith(path + "/") for p in self.blobs)

    def list(self, path: str = "") -> list[str]:
        check_path(path, allow_root=True)
        prefix = path + "/" if path else ""
        return sorted({p[len(prefix) :].split("/", 1)[0] for p in self.blobs if p.startswith(prefix)})

    def delete(self, path: str) -> None:
        check_path(path)
        for p in [p for p in self.blobs if p == path or p.startswith(path + "/")]:
            del self.blobs[p]


def _open_toy(uri: str) -> DictStorage:
    name = uri[len("toy://") :]
    if not name or "/" in name:
        raise ConfigError(f"invalid toy URI {uri!r}: use toy://NAME")
    return DictStorage(name)


def test_a_new_backend_is_one_registration_and_every_entry_point_opens_its_stores():
    from spark_state.ops.reader import read_state
    from spark_state.store.manifest import ComponentSpec
    from tests.stores import Store

    register_backend(Backend(("toy",), _open_toy, "toy://NAME"))
    storage = open_storage("toy://extension")
    assert isinstance(storage, DictStorage)
    count = Aggregate("count", None, "value")
    schema = KeyedSchema.of_values([pa.field("key", pa.string())], count.state_fields())
    state = ResidentState(schema, key_group_range(0, 1, 8))
    count.apply(state.table, _rows(["a", "b", "b"], [0, 0, 0]), ("key",))
    store = Store(storage)
    blob, _ = state.checkpoint(store.blobs, "c", 1, 0)
    store.commit(1, {"c": (ComponentSpec("c", 8, 1, schema), [blob])}, {})
    assert sorted(read_state("toy://extension", "c").to_pylist(), key=lambda r: r["key"]) == [
        {"key": "a", "value": 1},
        {"key": "b", "value": 2},
    ]  # through the reader
    from spark_state.ops.cli import cli

    verified = CliRunner().invoke(cli, ["verify", "toy://extension", "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["ok"] is True
    with pytest.raises(ConfigError, match="toy://NAME"):
        open_storage("gs://bucket/key")  # the new scheme is among those an error lists
