"""A local store never leaves its root: links planted inside it are neither followed nor listed (``storage.local``).

Whoever can write into a store could otherwise make its owner read or delete anything the owner may: a link
``STORE/blobs/planted/0 -> /outside`` made ``spark-state cleanup`` delete ``/outside/victim.txt`` and a
directory beside it. Each test plants links to an outside directory and checks that nothing outside changed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from spark_state.errors import StoreLinkError
from spark_state.model.schema import KeyedSchema
from spark_state.ops.cli import cli
from spark_state.storage.local import LocalStorage
from spark_state.store.manifest import ComponentSpec
from tests.stores import Store

SCHEMA = KeyedSchema.of_values([pa.field("key", pa.string())], [pa.field("value", pa.int64())])


def _outside(tmp_path: Path) -> tuple[Path, dict]:
    """A directory outside the store with a file and a directory in it, and a snapshot of everything there."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim.txt").write_text("not the store's")
    (outside / "dir" / "inner.txt").write_text("nor this")
    return outside, _snapshot(outside)


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir(), None if p.is_dir() else p.read_bytes()) for p in root.rglob("*")}


def test_reads_writes_and_deletes_through_a_link_are_refused_and_change_nothing_outside(tmp_path, caplog):
    outside, before = _outside(tmp_path)
    storage = LocalStorage(tmp_path / "store")
    storage.create("blobs/c/real", b"x")
    (tmp_path / "store" / "blobs" / "link").symlink_to(outside)
    (tmp_path / "store" / "blobs" / "c" / "file-link").symlink_to(outside / "victim.txt")
    for call in (
        lambda: storage.read("blobs/link/victim.txt"),
        lambda: storage.size("blobs/link/victim.txt"),
        lambda: storage.exists("blobs/link/victim.txt"),
        lambda: storage.list("blobs/link"),
        lambda: storage.delete("blobs/link/victim.txt"),
        lambda: storage.delete("blobs/link/dir"),
        lambda: storage.create("blobs/link/new", b"y"),
        lambda: storage.create("blobs/link/dir/new", b"y"),
        lambda: storage.read("blobs/c/file-link"),
        lambda: storage.size("blobs/c/file-link"),
    ):
        with pytest.raises(StoreLinkError, match="symbolic link"):
            call()
    with caplog.at_level(logging.WARNING, logger="spark_state.storage.local"):
        assert storage.list("blobs") == ["c"] and storage.list("blobs/c") == ["real"]
    assert "blobs/link" in caplog.text and "blobs/c/file-link" in caplog.text
    storage.delete("blobs/c/file-link")  # the link itself goes; what it points to stays
    storage.delete("blobs")  # a whole tree holding a link to a directory: the link goes, not what it points to
    assert not (tmp_path / "store" / "blobs").exists()
    assert _snapshot(outside) == before


def test_the_root_itself_may_be_a_link(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "store").symlink_to(tmp_path / "disk")
    storage = LocalStorage(tmp_path / "store")
    storage.create("a/b", b"data")
    assert storage.read("a/b") == b"data" and (tmp_path / "disk" / "a" / "b").read_bytes() == b"data"


def _store_with_a_planted_link(tmp_path: Path) -> tuple[Path, Path, dict]:
    store = tmp_path / "store"
    Store(LocalStorage(store)).commit(1, {"c": (ComponentSpec("c", 8, 2, SCHEMA), [])}, {})
    outside, before = _outside(tmp_path)
    (store / "blobs" / "planted").mkdir(parents=True)
    (store / "blobs" / "planted" / "0").symlink_to(outside)  # what made cleanup delete outside the store
    (store / "blobs" / "c" / "0").mkdir(parents=True)
    (store / "blobs" / "c" / "0" / "link").symlink_to(outside / "dir")
    return store, outside, before


def test_the_cli_s_cleanup_never_deletes_through_a_planted_link(tmp_path):
    store, outside, before = _store_with_a_planted_link(tmp_path)
    result = CliRunner().invoke(cli, ["cleanup", str(store), "--grace-seconds", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == []
    assert _snapshot(outside) == before


def test_a_query_s_own_cleanup_never_deletes_through_a_planted_link(tmp_path):
    store, outside, before = _store_with_a_planted_link(tmp_path)
    log = Store(LocalStorage(store))
    latest = log.commit(2, {"c": (ComponentSpec("c", 8, 2, SCHEMA), [])}, {})
    deleted = log.cleanup(latest)
    assert not [path for path in deleted if path.startswith(("blobs/planted", "blobs/c/0"))], deleted
    assert _snapshot(outside) == before
    assert os.path.islink(store / "blobs" / "planted" / "0")  # left for its owner to see and remove


@pytest.mark.spark
def test_a_running_query_s_cleanup_leaves_what_a_planted_link_points_to(spark, tmp_path):
    from tests.test_keyed_spark import Job

    job = Job(spark, tmp_path / "job")
    job.add_batch(200, 20, 0)
    job.run(2)
    outside, before = _outside(tmp_path)
    planted = tmp_path / "job" / "state" / "blobs" / "planted"
    planted.mkdir()
    (planted / "0").symlink_to(outside)
    job.add_batch(200, 20, 1)
    spark.conf.set("spark.state.orphanGraceSeconds", "0")
    try:
        job.run(3)  # a rescale, whose cleanup deletes the blobs of the parallelism left behind
    finally:
        spark.conf.unset("spark.state.orphanGraceSeconds")
    assert job.outputs == job.expected()
    assert _snapshot(outside) == before and (planted / "0").is_symlink()
