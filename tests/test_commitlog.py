"""The numbered commit log shared by checkpoint manifests and the replayable log (``spark_state.store.commitlog``)."""

from __future__ import annotations

import json
import threading

import pytest

from spark_state.errors import BlobExistsError, BlobNotFoundError, CorruptBlobError
from spark_state.storage.local import LocalStorage
from spark_state.storage.memory import MemoryStorage
from spark_state.store.commitlog import CommitLog, decode_record, encode_record


@pytest.fixture(params=["memory", "local"])
def log(request, tmp_path) -> CommitLog:
    storage = MemoryStorage() if request.param == "memory" else LocalStorage(str(tmp_path / "store"))
    return CommitLog(storage, "commits", what="commit")


def test_records_roundtrip_and_list_in_order(log):
    for n in (2, 0, 1):
        log.create(n, {"n": n, "items": [n] * n})
    assert log.ids() == [0, 1, 2] and log.latest_id() == 2
    assert log.load(1) == {"n": 1, "items": [1]}
    assert log.load_if_exists(7) is None
    with pytest.raises(BlobNotFoundError):
        log.load(7)


def test_a_record_is_created_once_and_racing_writers_have_one_winner(log):
    log.create(0, {"first": True})
    with pytest.raises(BlobExistsError, match="commit 0 already exists"):
        log.create(0, {"first": False})
    wins, barrier = [], threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        try:
            log.create(1, {"writer": i})
            wins.append(i)
        except BlobExistsError:
            pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1 and log.load(1) == {"writer": wins[0]}


def test_every_flipped_byte_and_every_truncation_is_detected():
    data = encode_record({"a": [1, 2, 3], "b": "x"})
    for i in range(len(data)):
        flipped = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
        try:
            body = decode_record(flipped, "r")
        except CorruptBlobError:
            continue
        assert body == {"a": [1, 2, 3], "b": "x"}, f"byte {i} changed the body without detection"
    for n in range(len(data)):
        with pytest.raises(CorruptBlobError, match="r "):
            decode_record(data[:n], "r")


def test_unframed_records_are_read_only_where_a_legacy_log_allows_them():
    legacy = json.dumps({"commit": 3}).encode()
    assert decode_record(legacy, "r", accept_unframed=True) == {"commit": 3}
    with pytest.raises(CorruptBlobError, match="not a checksummed record"):
        decode_record(legacy, "r")
    with pytest.raises(CorruptBlobError):
        decode_record(b"[1, 2]", "r", accept_unframed=True)


def test_names_that_are_not_records_are_ignored(log):
    log.create(5, {})
    log.storage.create("commits/notes.txt", b"x")
    log.storage.create("commits/123.json", b"{}")
    assert log.ids() == [5]


def test_a_damaged_frame_is_never_read_as_a_legacy_record():
    framed = json.loads(encode_record({"commit": 1}))
    damaged = json.dumps({"crc33": framed["crc32"], "body": framed["body"]}).encode()
    with pytest.raises(CorruptBlobError, match="damaged frame"):
        decode_record(damaged, "r", accept_unframed=True)
