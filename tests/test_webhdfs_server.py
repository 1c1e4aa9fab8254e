"""The WebHDFS test server answers the raw REST calls the way the WebHDFS spec says a NameNode does.

These pin the behaviours ``WebHdfsStorage`` relies on (redirects, error
bodies, RENAME's boolean), so that the contract suite's WebHDFS run tests the
backend against the protocol and not against a lenient stand-in.
"""

from __future__ import annotations

import threading
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

from tests.webhdfs_server import DATANODE_MARKER, WebHdfsServer


@pytest.fixture
def server():
    with WebHdfsServer() as server:
        yield server


def call(server: WebHdfsServer, method: str, path: str, **params) -> requests.Response:
    params.setdefault("user.name", "tester")
    return requests.request(method, f"{server.url}/webhdfs/v1{path}", params=params, allow_redirects=False, timeout=5)


def create(server: WebHdfsServer, path: str, data: bytes, overwrite: bool = False) -> requests.Response:
    first = call(server, "PUT", path, op="CREATE", overwrite=str(overwrite).lower())
    assert first.status_code == 307
    return requests.put(first.headers["Location"], data=data, timeout=5)


def remote_exception(response: requests.Response) -> tuple[int, str, str]:
    body = response.json()["RemoteException"]
    assert set(body) == {"exception", "javaClassName", "message"}
    assert body["javaClassName"].endswith("." + body["exception"])
    return response.status_code, body["exception"], body["message"]


def test_create_redirects_to_a_datanode_then_creates(server):
    first = call(server, "PUT", "/d/f", op="CREATE", overwrite="false")
    assert first.status_code == 307
    location = urlsplit(first.headers["Location"])
    assert f"{location.scheme}://{location.netloc}" == server.url
    query = parse_qs(location.query)
    assert query["op"] == ["CREATE"] and DATANODE_MARKER in query and query["user.name"] == ["tester"]
    assert not call(server, "GET", "/d/f", op="GETFILESTATUS").ok  # the NameNode step creates nothing
    second = requests.put(first.headers["Location"], data=b"abc", timeout=5)
    assert second.status_code == 201
    status = call(server, "GET", "/d/f", op="GETFILESTATUS").json()["FileStatus"]
    assert (status["type"], status["length"], status["pathSuffix"]) == ("FILE", 3, "")


def test_create_without_overwrite_on_an_existing_file_is_file_already_exists(server):
    assert create(server, "/f", b"old").status_code == 201
    status, exception, message = remote_exception(create(server, "/f", b"new"))
    assert (status, exception) == (403, "FileAlreadyExistsException") and "/f" in message
    assert create(server, "/f", b"newer", overwrite=True).status_code == 201
    assert requests.get(f"{server.url}/webhdfs/v1/f", params={"op": "OPEN"}, timeout=5).content == b"newer"


def test_open_redirects_and_serves_the_range(server):
    create(server, "/f", b"0123456789")
    first = call(server, "GET", "/f", op="OPEN", offset=2, length=3)
    assert first.status_code == 307 and DATANODE_MARKER in parse_qs(urlsplit(first.headers["Location"]).query)
    assert requests.get(first.headers["Location"], timeout=5).content == b"234"
    assert call(server, "GET", "/f", op="OPEN", offset=8, length=5).status_code == 307
    short = requests.get(f"{server.url}/webhdfs/v1/f", params={"op": "OPEN", "offset": 8, "length": 5}, timeout=5)
    assert short.content == b"89"  # a range past the end is served short, not refused
    assert remote_exception(call(server, "GET", "/f", op="OPEN", offset=10))[:2] == (403, "IOException")


def test_missing_paths_are_file_not_found_with_a_remote_exception_body(server):
    for op, method in [("GETFILESTATUS", "GET"), ("LISTSTATUS", "GET"), ("OPEN", "GET")]:
        status, exception, message = remote_exception(call(server, method, "/missing", op=op))
        assert (status, exception) == (404, "FileNotFoundException") and "/missing" in message
    assert call(server, "DELETE", "/missing", op="DELETE").json() == {"boolean": False}


def test_rename_answers_false_instead_of_failing(server):
    create(server, "/a", b"a")
    create(server, "/b", b"b")
    assert call(server, "PUT", "/a", op="RENAME", destination="/b").json() == {"boolean": False}
    assert call(server, "PUT", "/missing", op="RENAME", destination="/c").json() == {"boolean": False}
    assert call(server, "PUT", "/a", op="RENAME", destination="/no/parent").json() == {"boolean": False}
    assert call(server, "PUT", "/a", op="RENAME", destination="/c").json() == {"boolean": True}
    names = [s["pathSuffix"] for s in call(server, "GET", "/", op="LISTSTATUS").json()["FileStatuses"]["FileStatus"]]
    assert names == ["b", "c"]


def test_rename_onto_a_directory_moves_the_source_inside(server):
    create(server, "/a", b"a")
    assert call(server, "PUT", "/dir", op="MKDIRS").json() == {"boolean": True}
    assert call(server, "PUT", "/a", op="RENAME", destination="/dir").json() == {"boolean": True}
    assert call(server, "GET", "/dir/a", op="GETFILESTATUS").ok


def test_delete_of_a_non_empty_directory_needs_recursive(server):
    create(server, "/d/f", b"x")
    assert remote_exception(call(server, "DELETE", "/d", op="DELETE", recursive="false"))[:2] == (
        403,
        "PathIsNotEmptyDirectoryException",
    )
    assert call(server, "DELETE", "/d", op="DELETE", recursive="true").json() == {"boolean": True}
    assert not call(server, "GET", "/d", op="GETFILESTATUS").ok


def test_a_file_lists_as_itself_and_a_path_below_it_is_not_a_directory(server):
    create(server, "/f", b"x")
    statuses = call(server, "GET", "/f", op="LISTSTATUS").json()["FileStatuses"]["FileStatus"]
    assert [(s["pathSuffix"], s["type"]) for s in statuses] == [("", "FILE")]
    assert remote_exception(call(server, "GET", "/f/below", op="GETFILESTATUS"))[:2] == (
        403,
        "ParentNotDirectoryException",
    )


def test_faults_hit_only_the_selected_requests(server):
    server.fail_next(1, op="GETFILESTATUS")
    assert call(server, "GET", "/", op="LISTSTATUS").ok
    assert remote_exception(call(server, "GET", "/", op="GETFILESTATUS"))[:2] == (500, "IOException")
    assert call(server, "GET", "/", op="GETFILESTATUS").ok
    server.fail_next(1, mode="drop")
    with pytest.raises(requests.ConnectionError):
        call(server, "GET", "/", op="GETFILESTATUS")


def test_stop_closes_keep_alive_connections_and_joins_every_thread():
    before = set(threading.enumerate())
    session = requests.Session()
    with WebHdfsServer() as server:
        for _ in range(3):  # keep-alive: the handler thread stays blocked on the idle connection
            assert session.get(f"{server.url}/webhdfs/v1/", params={"op": "LISTSTATUS"}, timeout=5).ok
    assert set(threading.enumerate()) == before
    session.close()


@pytest.mark.parametrize("options", ["NONE", "OVERWRITE"])
def test_rename_with_options_refuses_or_replaces_an_existing_destination(server, options):
    create(server, "/d/src", b"new")
    create(server, "/d/dst", b"old")
    answer = call(server, "PUT", "/d/src", op="RENAME", destination="/d/dst", renameoptions=options)
    if options == "NONE":
        assert remote_exception(answer)[:2] == (403, "FileAlreadyExistsException")
        expected = b"old"
    else:
        assert answer.status_code == 200
        expected = b"new"
    assert call(server, "GET", "/d/dst", op="OPEN", **{DATANODE_MARKER: "x"}).content == expected
    missing = call(server, "PUT", "/d/nothing", op="RENAME", destination="/d/x", renameoptions="NONE")
    assert remote_exception(missing)[:2] == (404, "FileNotFoundException")


def test_server_defaults_and_link_status_answer_like_a_namenode(server):
    defaults = call(server, "GET", "/", op="GETSERVERDEFAULTS").json()["FsServerDefaults"]
    assert defaults["blockSize"] > 0 and defaults["checksumType"] == 2
    create(server, "/f", b"abc")
    assert call(server, "GET", "/f", op="GETFILELINKSTATUS").json()["FileStatus"]["length"] == 3


def test_unlabelled_json_has_no_content_type():
    with WebHdfsServer(label_json=False) as bare:
        answer = call(bare, "GET", "/", op="GETFILESTATUS")
        assert "Content-Type" not in answer.headers and answer.json()["FileStatus"]["type"] == "DIRECTORY"
        assert remote_exception(call(bare, "GET", "/missing", op="GETFILESTATUS"))[1] == "FileNotFoundException"
