"""The storage contract (``spark_state/storage/base.py``), run against every backend.

Every test taking ``storage`` runs on ``LocalStorage`` (a temp dir),
``MemoryStorage``, ``WebHdfsStorage`` (against ``tests/webhdfs_server.py``) and
``S3Storage`` (against SeaweedFS's S3 gateway, ``tests/s3_server.py``). The
tests after them check what only one backend can show: the publish step of
``LocalStorage``, the request sequence and error mapping of ``WebHdfsStorage``,
and ``open_storage``; ``tests/test_s3_storage.py`` does the same for S3.
"""

from __future__ import annotations

import os
import queue
import random
import stat
import threading
import uuid

import pytest

from spark_state.errors import (
    BlobExistsError,
    BlobNotFoundError,
    ConfigError,
    InvalidPathError,
    ShortReadError,
    StorageError,
)
from spark_state.redaction import redact
from spark_state.storage import LocalStorage, MemoryStorage, S3Storage, WebHdfsStorage, open_storage
from spark_state.storage.base import TEMP_PREFIX
from tests.webhdfs_server import WebHdfsServer

BACKENDS = ["local", "memory", "webhdfs", "s3"]


def random_bytes(size: int, seed: int) -> bytes:
    """Non-periodic bytes, so that a read at a wrong offset cannot return the right answer."""
    return random.Random(seed).randbytes(size)


@pytest.fixture(scope="module")
def webhdfs_server():
    with WebHdfsServer() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path):
    if request.param == "local":
        yield LocalStorage(str(tmp_path / "root"))
    elif request.param == "memory":
        yield MemoryStorage()
    elif request.param == "s3":
        yield open_storage(request.getfixturevalue("s3_uri")("contract"))
    else:
        server = request.getfixturevalue("webhdfs_server")
        yield WebHdfsStorage(server.url, f"/tests/{uuid.uuid4().hex}", user="tester")
        server.clear_faults()


@pytest.fixture
def hdfs_storage(webhdfs_server):
    yield WebHdfsStorage(webhdfs_server.url, f"/tests/{uuid.uuid4().hex}", user="tester")
    webhdfs_server.clear_faults()


def backing_dir(storage, server: WebHdfsServer | None = None) -> str:
    """The local directory holding a Local or WebHDFS storage's root."""
    if isinstance(storage, LocalStorage):
        return storage.root
    return server.local_path(storage.root)


def temp_files(directory: str) -> list[str]:
    """Names starting with the temp prefix anywhere below ``directory``."""
    return [name for _, _, names in os.walk(directory) for name in names if name.startswith(TEMP_PREFIX)]


# --- create and read -------------------------------------------------------------


def test_created_blobs_read_back_whole(storage):
    blobs = {
        "small": b"hello",
        "empty": b"",
        "nested/deeper/big.arrow": random_bytes(5 << 20, seed=1),
    }
    for path, data in blobs.items():
        storage.create(path, data)
    for path, data in blobs.items():
        result = storage.read(path)
        assert type(result) is bytes
        assert result == data
        assert storage.size(path) == len(data)


def test_create_accepts_bytes_like_data_and_copies_it(storage):
    data = bytearray(b"mutable")
    storage.create("blob", data)
    data[:] = b"changed"
    assert storage.read("blob") == b"mutable"
    storage.create("view", memoryview(b"0123456789")[2:5])
    assert storage.read("view") == b"234"


def test_create_without_overwrite_refuses_an_existing_blob_and_keeps_it(storage):
    storage.create("dir/blob", b"old")
    with pytest.raises(BlobExistsError, match="dir/blob"):
        storage.create("dir/blob", b"new")
    assert storage.read("dir/blob") == b"old"
    assert storage.list("dir") == ["blob"]


def test_overwrite_replaces_the_whole_blob(storage):
    storage.create("blob", random_bytes(1000, seed=2))
    storage.create("blob", b"new", overwrite=True)
    assert storage.read("blob") == b"new"
    assert storage.size("blob") == 3
    storage.create("fresh", b"first", overwrite=True)
    assert storage.read("fresh") == b"first"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_path_is_a_blob_or_a_directory_never_both(storage, overwrite):
    storage.create("dir/blob", b"1")
    with pytest.raises(BlobExistsError):
        storage.create("dir", b"2", overwrite=overwrite)
    with pytest.raises(BlobExistsError):
        storage.create("dir/blob/below", b"3", overwrite=overwrite)
    assert storage.read("dir/blob") == b"1"
    assert storage.list("dir") == ["blob"]
    assert storage.list("") == ["dir"]
    assert not storage.exists("dir/blob/below")


def test_racing_creators_exactly_one_wins(storage):
    racers = 8
    for round_ in range(3):
        path = f"race/{round_}"
        barrier = threading.Barrier(racers)
        outcomes: list[object] = [None] * racers

        def race(i: int) -> None:
            barrier.wait()
            try:
                storage.create(path, random_bytes(4096, seed=100 * round_ + i))
                outcomes[i] = "won"
            except BlobExistsError:
                outcomes[i] = "lost"
            except Exception as err:  # noqa: BLE001 - reported by the asserts below
                outcomes[i] = err

        threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [i for i, outcome in enumerate(outcomes) if outcome == "won"]
        assert sorted(map(str, outcomes)) == sorted(["won"] + ["lost"] * (racers - 1)), outcomes
        assert storage.read(path) == random_bytes(4096, seed=100 * round_ + winners[0])
    assert storage.list("race") == ["0", "1", "2"]


# --- ranged reads ------------------------------------------------------------------

DATA_1000 = random_bytes(1000, seed=3)


@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (0, 10),  # start
        (0, 1000),  # everything, explicitly
        (500, 123),  # middle
        (990, 10),  # ends exactly at the end
        (999, 1),  # last byte
        (0, 0),  # zero length at the start
        (500, 0),  # zero length in the middle
        (1000, 0),  # zero length at the end
        (0, None),  # to the end from the start
        (400, None),  # to the end from the middle
        (1000, None),  # to the end from the end
    ],
)
def test_ranged_read_returns_exactly_the_range(storage, offset, length):
    storage.create("blob", DATA_1000)
    expected = DATA_1000[offset:] if length is None else DATA_1000[offset : offset + length]
    assert storage.read("blob", offset, length) == expected


@pytest.mark.parametrize(
    ("offset", "length"),
    [(995, 10), (0, 1001), (1000, 1), (1001, 0), (1001, None), (5000, 1)],
)
def test_a_range_past_the_end_raises_short_read(storage, offset, length):
    storage.create("blob", DATA_1000)
    with pytest.raises(ShortReadError, match="blob"):
        storage.read("blob", offset, length)


def test_ranges_of_an_empty_blob(storage):
    storage.create("empty", b"")
    assert storage.read("empty") == b""
    assert storage.read("empty", 0, 0) == b""
    for offset, length in [(0, 1), (1, None), (1, 0)]:
        with pytest.raises(ShortReadError):
            storage.read("empty", offset, length)


@pytest.mark.parametrize(("offset", "length"), [(-1, None), (-1, 1), (0, -1)])
def test_a_negative_offset_or_length_is_a_config_error(storage, offset, length):
    storage.create("blob", b"abc")
    with pytest.raises(ConfigError):
        storage.read("blob", offset, length)


# --- missing paths, exists, list ----------------------------------------------------


def test_read_and_size_of_what_is_not_a_blob_raise_blob_not_found(storage):
    storage.create("dir/blob", b"x")
    for path in ["missing", "dir/missing", "dir", "dir/blob/below"]:
        with pytest.raises(BlobNotFoundError, match=path.split("/")[-1]):
            storage.read(path)
        with pytest.raises(BlobNotFoundError):
            storage.read(path, 0, 0)
        with pytest.raises(BlobNotFoundError):
            storage.size(path)


def test_exists_for_blobs_directories_and_missing_paths(storage):
    storage.create("a/b/c", b"x")
    assert storage.exists("a/b/c")
    assert storage.exists("a/b")
    assert storage.exists("a")
    for path in ["z", "a/bx", "a/b/cc", "a/b/c/d", "a/x/c"]:
        assert not storage.exists(path), path


def test_list_returns_sorted_immediate_children(storage):
    for path in ["d/b", "d/a", "d/c/x", "d/c/y", "dd/z", "e", "d/B"]:
        storage.create(path, path.encode())
    assert storage.list() == ["d", "dd", "e"]
    assert storage.list("") == ["d", "dd", "e"]
    assert storage.list("d") == ["B", "a", "b", "c"]
    assert storage.list("d/c") == ["x", "y"]
    assert storage.list("missing") == []
    assert storage.list("d/missing/deeper") == []
    assert storage.list("e") == []  # a blob has no children
    assert storage.list("e/below") == []


def test_names_that_need_escaping_round_trip(storage):
    names = ["sp ace", "per%cent", "q?mark", "hash#tag", "plus+sign", "eq=ual", "ünïcødé", "semi;colon"]
    for i, name in enumerate(names):
        storage.create(f"{name}/{name}", bytes([i]))
    assert storage.list() == sorted(names)
    for i, name in enumerate(names):
        assert storage.list(name) == [name]
        assert storage.read(f"{name}/{name}") == bytes([i])
        storage.delete(name)
    assert storage.list() == []


def test_list_of_an_empty_storage_is_empty(storage):
    assert storage.list() == []


def test_temp_files_of_a_crashed_create_are_never_listed(storage, request):
    if isinstance(storage, MemoryStorage):
        pytest.skip("MemoryStorage publishes under a lock and has no temporary files")
    if isinstance(storage, S3Storage):
        pytest.skip("S3Storage publishes with one PUT and has no temporary files")
    server = request.getfixturevalue("webhdfs_server") if isinstance(storage, WebHdfsStorage) else None
    storage.create("d/blob", b"x")
    with open(os.path.join(backing_dir(storage, server), "d", f"{TEMP_PREFIX}crashed-blob2"), "wb") as file:
        file.write(b"half a blo")
    assert storage.list("d") == ["blob"]
    assert not storage.exists("d/blob2")
    storage.delete("d")
    assert storage.list() == []


# --- delete -------------------------------------------------------------------------


def test_delete_removes_blobs_and_trees(storage):
    for path in ["t/a/1", "t/a/2", "t/b", "tt/keep", "u"]:
        storage.create(path, path.encode())
    storage.delete("t/a/1")
    assert not storage.exists("t/a/1")
    with pytest.raises(BlobNotFoundError):
        storage.read("t/a/1")
    assert storage.list("t/a") == ["2"]
    storage.delete("t/a")
    assert not storage.exists("t/a")
    assert not storage.exists("t/a/2")
    assert storage.list("t") == ["b"]
    storage.delete("t")
    assert storage.list() == ["tt", "u"]
    assert storage.read("tt/keep") == b"tt/keep"
    storage.create("t/a/1", b"again")
    assert storage.read("t/a/1") == b"again"


def test_delete_of_a_missing_path_is_not_an_error(storage):
    storage.create("u", b"blob")
    storage.delete("missing")
    storage.delete("missing/deeper")
    storage.delete("u/below")
    assert storage.read("u") == b"blob"
    assert storage.list() == ["u"]


def test_delete_removes_the_directories_it_empties(storage):
    storage.create("p/q/r/blob", b"1")
    storage.create("p/other", b"2")
    storage.delete("p/q/r/blob")
    assert not storage.exists("p/q/r")
    assert not storage.exists("p/q")
    assert storage.list("p") == ["other"]
    storage.delete("p/other")
    assert not storage.exists("p")
    assert storage.list() == []


# --- paths ---------------------------------------------------------------------------

BAD_PATHS = ["/a", "a/", "a//b", "./a", "a/./b", "..", "a/../b", ".tmp-x", "d/.tmp-x", "/", b"a", None, 3]


@pytest.mark.parametrize("path", BAD_PATHS + [""], ids=repr)
def test_invalid_paths_raise_invalid_path(storage, path):
    calls = [
        lambda: storage.create(path, b"x"),
        lambda: storage.create(path, b"x", overwrite=True),
        lambda: storage.read(path),
        lambda: storage.size(path),
        lambda: storage.exists(path),
        lambda: storage.delete(path),
    ]
    if path != "":  # "" is the root, which only list accepts
        calls.append(lambda: storage.list(path))
    for call in calls:
        with pytest.raises(InvalidPathError):
            call()
    assert storage.list("") == []


# --- atomic visibility -----------------------------------------------------------------


def test_a_concurrent_reader_never_sees_a_partial_blob(storage):
    old, new = random_bytes(300_000, seed=4), random_bytes(200_000, seed=5)
    reads_per_write = 5
    tokens: queue.Queue[bool] = queue.Queue()  # the writer hands out reads, so that they overlap its writes
    seen: list[str] = []

    def reader() -> None:
        while tokens.get():
            try:
                data = storage.read("blob")
                seen.append("old" if data == old else "new" if data == new else f"partial {len(data)} bytes")
            except BlobNotFoundError:
                seen.append("absent")
            except Exception as err:  # noqa: BLE001 - recorded, and the test fails on it
                seen.append(repr(err))
            tokens.task_done()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(21):
            for _ in range(reads_per_write):
                tokens.put(True)
            storage.create("blob", new if i % 2 else old, overwrite=i > 0)
            tokens.join()
    finally:
        tokens.put(False)
        thread.join()
    assert set(seen) <= {"old", "new", "absent"}, seen
    assert len(seen) == 21 * reads_per_write
    assert "old" in seen and "new" in seen
    if not isinstance(storage, WebHdfsStorage):
        # only HDFS overwrites by delete + rename; elsewhere "absent" is only before the first create
        first_present = next(i for i, result in enumerate(seen) if result != "absent")
        assert "absent" not in seen[first_present:]


def test_local_blob_is_invisible_until_the_publish_step(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.create("d/sibling", b"s")
    data = random_bytes(100_000, seed=6)
    observed = {}
    real_link = os.link

    def observing_link(source, destination, *args, **kwargs):
        observed["temp_size"] = os.stat(source, dir_fd=kwargs.get("src_dir_fd")).st_size
        observed["exists"] = storage.exists("d/blob")
        observed["listed"] = storage.list("d")
        with pytest.raises(BlobNotFoundError):
            storage.read("d/blob")
        return real_link(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "link", observing_link)
    storage.create("d/blob", data)
    assert observed == {"temp_size": len(data), "exists": False, "listed": ["sibling"]}
    assert storage.read("d/blob") == data
    assert temp_files(storage.root) == []


@pytest.mark.parametrize("failing", ["fsync", "link", "replace"])
def test_local_create_that_fails_midway_leaves_nothing(tmp_path, monkeypatch, failing):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.create("d/sibling", b"s")  # so that the directory exists and only the blob's steps remain
    storage.create("d/old", b"old")

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, failing, fail)
    target, overwrite = ("d/old", True) if failing == "replace" else ("d/blob", False)
    with pytest.raises(StorageError) as error:
        storage.create(target, b"new data", overwrite=overwrite)
    assert type(error.value) is StorageError
    assert target in str(error.value)
    monkeypatch.undo()
    assert temp_files(storage.root) == []
    assert storage.list("d") == ["old", "sibling"]
    assert storage.read("d/old") == b"old"


# --- WebHDFS: protocol and error mapping -----------------------------------------------


def test_webhdfs_create_uploads_to_a_temp_path_and_renames(hdfs_storage, webhdfs_server):
    hdfs_storage.create("d/blob", b"data")
    final = f"{hdfs_storage.root}/d/blob"
    mine = [r for r in webhdfs_server.requests if r.path.startswith(hdfs_storage.root)]
    creates = [r for r in mine if r.op == "CREATE"]
    renames = [r for r in mine if r.op == "RENAME"]
    assert [r.datanode for r in creates] == [False, True]
    assert all(f"/d/{TEMP_PREFIX}" in r.path and r.path.endswith("-blob") for r in creates)
    assert [(r.path, r.params["destination"]) for r in renames] == [(creates[0].path, final)]
    assert temp_files(webhdfs_server.local_path(hdfs_storage.root)) == []


def test_webhdfs_creator_that_passed_the_existence_check_still_loses(hdfs_storage, webhdfs_server, monkeypatch):
    hdfs_storage.create("blob", b"first")
    real_status = hdfs_storage._status
    calls = []

    def status_missing_once(path, hdfs_path):
        calls.append(path)
        return None if len(calls) == 1 else real_status(path, hdfs_path)

    monkeypatch.setattr(hdfs_storage, "_status", status_missing_once)
    with pytest.raises(BlobExistsError, match="blob"):
        hdfs_storage.create("blob", b"second")
    assert hdfs_storage.read("blob") == b"first"
    assert temp_files(webhdfs_server.local_path(hdfs_storage.root)) == []


@pytest.mark.parametrize(
    ("op", "datanode", "mode"),
    [
        ("CREATE", False, "error"),
        ("CREATE", True, "error"),
        ("CREATE", True, "drop"),
        ("RENAME", None, "error"),
        ("RENAME", None, "drop"),
    ],
)
def test_webhdfs_failed_create_is_a_storage_error_and_leaves_nothing(hdfs_storage, webhdfs_server, op, datanode, mode):
    hdfs_storage.create("d/sibling", b"s")
    webhdfs_server.fail_next(1, mode=mode, op=op, datanode=datanode)
    with pytest.raises(StorageError, match="d/blob") as error:
        hdfs_storage.create("d/blob", b"data")
    assert type(error.value) is StorageError
    assert not hdfs_storage.exists("d/blob")
    assert temp_files(webhdfs_server.local_path(hdfs_storage.root)) == []
    hdfs_storage.create("d/blob", b"data")
    assert hdfs_storage.read("d/blob") == b"data"


@pytest.mark.parametrize("mode", ["error", "drop"])
@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("GETFILESTATUS", lambda s: s.exists("blob")),
        ("GETFILESTATUS", lambda s: s.size("blob")),
        ("OPEN", lambda s: s.read("blob")),
        ("OPEN", lambda s: s.read("blob", 1, 2)),
        ("LISTSTATUS", lambda s: s.list("")),
        ("DELETE", lambda s: s.delete("blob")),
    ],
)
def test_webhdfs_server_failures_are_never_mistaken_for_answers(hdfs_storage, webhdfs_server, op, call, mode):
    hdfs_storage.create("blob", b"abc")
    webhdfs_server.fail_next(1, mode=mode, op=op)
    with pytest.raises(StorageError) as error:
        call(hdfs_storage)
    assert type(error.value) is StorageError  # not "missing", not "exists", not a default
    assert hdfs_storage.root in str(error.value) or "blob" in str(error.value)
    assert hdfs_storage.read("blob") == b"abc"


def test_webhdfs_unreachable_endpoint_is_a_storage_error():
    with WebHdfsServer() as server:
        url = server.url
    storage = WebHdfsStorage(url, "/x", timeout=5)
    with pytest.raises(StorageError, match="reachable"):
        storage.exists("blob")


# --- open_storage ------------------------------------------------------------------------


def test_uri_maps_back_to_an_equal_storage(storage):
    reopened = open_storage(storage.uri)
    assert reopened == storage
    if isinstance(storage, MemoryStorage):
        assert reopened is storage
    storage.create("dir/blob", b"shared")
    assert reopened.read("dir/blob") == b"shared"


def test_open_storage_local_paths(tmp_path, monkeypatch):
    root = tmp_path / "with space"
    assert open_storage(str(root)) == LocalStorage(str(root))
    assert open_storage(str(root)).root == str(root)
    assert open_storage(LocalStorage(str(root)).uri).root == str(root)
    assert open_storage(f"file://{root}").root == str(root)
    monkeypatch.chdir(tmp_path)
    assert open_storage("relative/dir").root == str(tmp_path / "relative" / "dir")


def test_open_storage_memory_names_are_process_wide():
    name = f"shared-{uuid.uuid4().hex}"
    first = open_storage(f"memory://{name}")
    assert isinstance(first, MemoryStorage)
    assert open_storage(f"memory://{name}") is first
    assert open_storage(f"memory://{name}-other") is not first
    first.create("blob", b"x")
    assert open_storage(f"memory://{name}").read("blob") == b"x"
    with pytest.raises(ConfigError, match=name):
        MemoryStorage(name)


@pytest.mark.parametrize(
    ("uri", "url", "root", "user"),
    [
        ("webhdfs://127.0.0.1:9870/state/job?user=alice", "http://127.0.0.1:9870", "/state/job", "alice"),
        ("hdfs://namenode:50070/state", "http://namenode:50070", "/state", None),
        ("webhdfs://namenode:9870", "http://namenode:9870", "/", None),
        ("webhdfs://namenode:9870/with%20space/", "http://namenode:9870", "/with space", None),
    ],
)
def test_open_storage_webhdfs(uri, url, root, user):
    storage = open_storage(uri)
    assert isinstance(storage, WebHdfsStorage)
    assert (storage.url, storage.root, storage.user) == (url, root, user)
    assert open_storage(storage.uri) == storage


@pytest.mark.parametrize(
    "uri",
    [
        "gs://bucket/key",
        "s3://Bad_Bucket/key",
        "s3://bucket/key?endpoint=ftp://host",
        "s3://bucket/key?unknown=1",
        "s3://bucket/a/../b",
        "mistyped:/x",
        "file://somehost/path",
        "memory://",
        "memory://bad name",
        "memory://name/path",
        "webhdfs://namenode/path",
        "hdfs://namenode:port/path",
        "webhdfs://namenode:9870/p?user=",
        "webhdfs://namenode:9870/p?user=a&user=b",
        "webhdfs://namenode:9870/p?user=a&other=1",
        "webhdfs://alice@namenode:9870/p",
        "webhdfs://namenode:9870/a/../b",
    ],
)
def test_open_storage_rejects_what_it_cannot_open(uri):
    with pytest.raises(ConfigError) as error:
        open_storage(uri)
    named = redact(uri)  # as every message names a URI: user information masked
    assert named.split("?")[0] in str(error.value) or repr(named) in str(error.value)


def test_open_storage_lists_the_supported_schemes():
    with pytest.raises(ConfigError) as error:
        open_storage("gs://bucket/key")
    message = str(error.value)
    for scheme in ["file://", "memory://", "webhdfs://", "hdfs://", "s3://"]:
        assert scheme in message


@pytest.mark.parametrize(("client", "uri"), [("hdfs", "webhdfs://localhost:1/x"), ("boto3", "s3://bucket/x")])
def test_a_remote_client_is_imported_only_for_its_store(client, uri):
    import subprocess
    import sys

    code = (
        "import sys, spark_state.executor.task, spark_state.spark.microbatch, spark_state.driver.conf, datasources.sources\n"
        "import spark_state.storage as s\n"
        f"assert {client!r} not in sys.modules, 'imported eagerly'\n"
        f"s.open_storage('/tmp/x'); assert {client!r} not in sys.modules, 'imported for a local store'\n"
        f"s.open_storage({uri!r}); assert {client!r} in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_local_files_and_directories_are_never_writable_by_others_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        storage = LocalStorage(str(tmp_path / "root"))
        storage.create("blobs/c/00000000000000000001/blob.arrow", b"state")
        storage.create("manifests/1.json", b"{}", overwrite=True)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes == {
        "root": 0o755,
        "root/blobs": 0o755,
        "root/blobs/c": 0o755,
        "root/blobs/c/00000000000000000001": 0o755,
        "root/blobs/c/00000000000000000001/blob.arrow": 0o644,
        "root/manifests": 0o755,
        "root/manifests/1.json": 0o644,
    }, modes
