"""A small WebHDFS server for tests: the NameNode and DataNode REST calls the ``hdfs`` client makes.

It serves ``http://127.0.0.1:PORT/webhdfs/v1/<hdfs path>?op=...`` from a
temporary local directory and follows the WebHDFS REST spec (and Hadoop's
behaviour where the spec is silent) for exactly these operations:

- CREATE (PUT), two steps like a real cluster: the "NameNode" answers 307 with
  a ``Location`` back to this server carrying the DataNode marker parameter
  ``namenoderpcaddress``; the "DataNode" PUT with the bytes creates the file
  (parents too) and answers 201. Existence is checked at the DataNode step,
  as in Hadoop: an existing file with ``overwrite=false``, or a directory,
  answers 403 ``FileAlreadyExistsException``. The file is visible, growing,
  while the bytes are written, as on HDFS.
- OPEN (GET) with ``offset`` and ``length``, also redirected (307). The
  NameNode refuses ``offset >= length`` of a non-empty file (403
  ``IOException``), the DataNode ``offset > length`` (403 ``EOFException``);
  a range past the end is served short. A directory answers 404.
- RENAME (PUT, ``destination``): ``{"boolean": false}`` when the source is
  missing, the destination exists as a file, or its parent is missing; an
  existing destination directory receives the source inside it. With
  ``renameoptions`` (``NONE`` or ``OVERWRITE``: Hadoop's ``rename2``, which
  Spark's checkpoint writes use through ``FileContext``) it answers 200 or
  raises: an existing destination is refused (403
  ``FileAlreadyExistsException``) or, with OVERWRITE, replaced.
- DELETE (``recursive``): ``{"boolean": false}`` for a missing path, 403
  ``PathIsNotEmptyDirectoryException`` for a non-empty directory without
  ``recursive=true``.
- LISTSTATUS (a file lists as itself with an empty ``pathSuffix``),
  GETFILESTATUS, GETFILELINKSTATUS (no symlinks: the same answer), MKDIRS,
  GETHOMEDIRECTORY, GETSERVERDEFAULTS (asked by Hadoop's ``FileContext``
  before it creates a file).

``WebHdfsServer(label_json=False)`` sends JSON answers without a
``Content-Type``. pyspark's bundled Hadoop client (``hadoop-client-runtime``)
lacks the shaded Jersey ``RuntimeDelegate`` that its ``WebHdfsFileSystem``
needs to parse a labelled JSON answer (``ClassNotFoundException``, the
problem of HDFS-14466), so Spark itself can reach a WebHDFS server only if
that server does not label its JSON; a real NameNode does.

A missing path answers 404 ``FileNotFoundException``; a path below a file
answers 403 ``ParentNotDirectoryException``. Errors carry the WebHDFS body
``{"RemoteException": {"exception", "javaClassName", "message"}}``.

``server.fail_next(n, mode=..., op=..., datanode=...)`` makes the next ``n``
matching requests fail with a 500 ``IOException`` (``mode="error"``) or by
closing the connection without an answer (``mode="drop"``), before they
touch the namespace. ``server.requests`` logs every request.

Use it as a context manager (``with WebHdfsServer() as server: server.url``);
leaving it closes the listening socket and every open connection and joins
all server threads.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import socket
import stat
import tempfile
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

PREFIX = "/webhdfs/v1"
DATANODE_MARKER = "namenoderpcaddress"
"""The parameter a NameNode adds to the DataNode URL it redirects to; its presence marks the DataNode step."""

_JAVA_CLASSES = {
    "FileNotFoundException": "java.io.FileNotFoundException",
    "FileAlreadyExistsException": "org.apache.hadoop.fs.FileAlreadyExistsException",
    "ParentNotDirectoryException": "org.apache.hadoop.fs.ParentNotDirectoryException",
    "PathIsNotEmptyDirectoryException": "org.apache.hadoop.fs.PathIsNotEmptyDirectoryException",
    "IOException": "java.io.IOException",
    "EOFException": "java.io.EOFException",
    "IllegalArgumentException": "java.lang.IllegalArgumentException",
}


@dataclass(frozen=True)
class Request:
    """One request as the server saw it: ``op`` upper-cased, ``path`` the decoded HDFS path."""

    method: str
    op: str
    path: str
    params: dict[str, str]
    datanode: bool


class RemoteError(Exception):
    """An answer with a WebHDFS ``RemoteException`` body."""

    def __init__(self, status: int, exception: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.exception = exception
        self.message = message


@dataclass
class _Fault:
    remaining: int
    mode: str
    op: str | None
    datanode: bool | None

    def matches(self, op: str, datanode: bool) -> bool:
        return (self.op is None or self.op == op) and (self.datanode is None or self.datanode == datanode)


class _HttpServer(ThreadingMixIn, HTTPServer):
    daemon_threads = False  # so that server_close() joins every connection thread
    block_on_close = True
    allow_reuse_address = True
    request_queue_size = 128  # racing clients open many connections at once; the default 5 drops SYNs (1 s stalls)


class WebHdfsServer:
    """A WebHDFS endpoint on 127.0.0.1 backed by ``data_dir`` (a fresh temp dir unless given)."""

    def __init__(self, data_dir: str | None = None, *, label_json: bool = True) -> None:
        self.label_json = label_json
        self._own_dir = data_dir is None
        self.data_dir = tempfile.mkdtemp(prefix="webhdfs-") if data_dir is None else data_dir
        self.namespace_lock = threading.Lock()
        self.requests: list[Request] = []
        self._faults: list[_Fault] = []
        self._state_lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closing = False
        self._httpd: _HttpServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the base URL to give a WebHDFS client."""
        if self._httpd is None:
            raise RuntimeError("the WebHDFS test server is not running; call start() first")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> WebHdfsServer:
        httpd = _HttpServer(("127.0.0.1", 0), _Handler)
        httpd.webhdfs = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="webhdfs-test-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close open connections, join every thread, remove an owned data dir."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        self._thread.join()
        with self._state_lock:
            self._closing = True
            connections = list(self._connections)
        for connection in connections:
            _hang_up(connection)
        httpd.server_close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> WebHdfsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def fail_next(
        self, count: int = 1, *, mode: str = "error", op: str | None = None, datanode: bool | None = None
    ) -> None:
        """Make the next ``count`` requests with this ``op`` (any if None) and step fail.

        ``mode="error"`` answers 500 with an ``IOException`` body; ``mode="drop"``
        closes the connection without answering. ``datanode`` selects the
        redirected DataNode step (True), the NameNode step (False) or both (None).
        """
        if mode not in ("error", "drop"):
            raise ValueError(f"fault mode must be 'error' or 'drop', got {mode!r}")
        with self._state_lock:
            self._faults.append(_Fault(count, mode, op.upper() if op else None, datanode))

    def clear_faults(self) -> None:
        with self._state_lock:
            self._faults.clear()

    def local_path(self, hdfs_path: str) -> str:
        """The file in ``data_dir`` that holds absolute HDFS path ``hdfs_path``."""
        parts = [part for part in hdfs_path.split("/") if part]
        return os.path.join(self.data_dir, *parts)

    def _take_fault(self, op: str, datanode: bool) -> str | None:
        with self._state_lock:
            for fault in self._faults:
                if fault.remaining > 0 and fault.matches(op, datanode):
                    fault.remaining -= 1
                    return fault.mode
            return None

    def _track(self, connection: socket.socket, open_: bool) -> None:
        """Remember open connections so that ``stop`` can hang up on idle keep-alive ones."""
        with self._state_lock:
            if not open_:
                self._connections.discard(connection)
            elif self._closing:
                _hang_up(connection)  # accepted just before stop(): its handler ends at once
            else:
                self._connections.add(connection)


def _hang_up(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: without this, 40 ms stalls
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.server.webhdfs._track(self.connection, True)

    def finish(self) -> None:
        self.server.webhdfs._track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean; server.requests is the log

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- plumbing -----------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        body = self._read_body()
        server = self.server.webhdfs
        split = urlsplit(self.path)
        params = {key.lower(): values[-1] for key, values in parse_qs(split.query, keep_blank_values=True).items()}
        op = params.get("op", "").upper()
        datanode = DATANODE_MARKER in params
        try:
            path = _hdfs_path(split.path)
            server.requests.append(Request(method, op, path, params, datanode))
            fault = server._take_fault(op, datanode)
            if fault == "drop":
                self.close_connection = True
                return
            if fault == "error":
                raise RemoteError(500, "IOException", f"injected fault on {op} {path}")
            handler = _OPS.get((method, op))
            if handler is None:
                raise RemoteError(
                    400,
                    "IllegalArgumentException",
                    f'Invalid value for webhdfs parameter "op": {op or "(missing)"} with {method}',
                )
            handler(self, server, path, params, body, datanode)
        except RemoteError as err:
            self._send_json(
                err.status,
                {
                    "RemoteException": {
                        "exception": err.exception,
                        "javaClassName": _JAVA_CLASSES.get(err.exception, "java.io.IOException"),
                        "message": err.message,
                    }
                },
            )
        except Exception as err:  # noqa: BLE001 - a bug in this server: answer it visibly
            self._send_json(
                500,
                {
                    "RemoteException": {
                        "exception": "RuntimeException",
                        "javaClassName": "java.lang.RuntimeException",
                        "message": f"test server bug: {type(err).__name__}: {err}",
                    }
                },
            )

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str | None = "application/octet-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, status: int, document: object) -> None:
        self._send(
            status, json.dumps(document).encode(), "application/json" if self.server.webhdfs.label_json else None
        )

    def _redirect_to_datanode(self, path: str, params: dict[str, str]) -> None:
        host, port = self.server.server_address[:2]
        query = urlencode({**params, DATANODE_MARKER: f"{host}:{port}"})
        self._send(307, headers={"Location": f"http://{host}:{port}{PREFIX}{quote(path)}?{query}"})

    # --- operations -----------------------------------------------------------------

    def _create(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        overwrite = _parse_bool(params, "overwrite", False)
        if not datanode:
            self._redirect_to_datanode(path, params)
            return
        local = server.local_path(path)
        with server.namespace_lock:
            _check_parents(server, path)
            if os.path.isdir(local):
                raise RemoteError(403, "FileAlreadyExistsException", f"{path} already exists as a directory")
            if os.path.exists(local) and not overwrite:
                raise RemoteError(403, "FileAlreadyExistsException", f"{path} for client 127.0.0.1 already exists")
            os.makedirs(os.path.dirname(local), exist_ok=True)
            file = open(local, "wb")
        with file:  # outside the lock: like HDFS, the file is visible while it grows
            for start in range(0, len(body), 1 << 16):
                file.write(body[start : start + (1 << 16)])
                file.flush()
        host, port = self.server.server_address[:2]
        self._send(201, headers={"Location": f"hdfs://{host}:{port}{quote(path)}"})

    def _open(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        offset = _parse_int(params, "offset", 0)
        length = _parse_int(params, "length", None)
        _check_parents(server, path)
        try:
            if not datanode:
                info = os.stat(server.local_path(path))
                size = info.st_size if stat.S_ISREG(info.st_mode) else 0
                if size > 0 and offset >= size:
                    raise RemoteError(
                        403, "IOException", f"Offset={offset} out of the range [0, {size}); OPEN, path={path}"
                    )
                self._redirect_to_datanode(path, params)
                return
            with open(server.local_path(path), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if offset > size:
                    raise RemoteError(403, "EOFException", "Cannot seek after EOF")
                count = size - offset if length is None else min(size - offset, length)
                file.seek(offset)
                data = file.read(count)
        except FileNotFoundError:
            raise RemoteError(404, "FileNotFoundException", f"File does not exist: {path}") from None
        except IsADirectoryError:
            raise RemoteError(404, "FileNotFoundException", f"Path is not a file: {path}") from None
        self._send(200, data)

    def _rename(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        destination = params.get("destination")
        if not destination or not destination.startswith("/"):
            raise RemoteError(400, "IllegalArgumentException", f"Invalid value for destination: {destination!r}")
        destination = posixpath.normpath(destination)
        options = params.get("renameoptions")
        with server.namespace_lock:
            if options is None:
                self._send_json(200, {"boolean": _rename(server, path, destination)})
                return
            if options.upper() not in ("NONE", "OVERWRITE"):
                raise RemoteError(400, "IllegalArgumentException", f"Invalid value for renameoptions: {options}")
            _rename2(server, path, destination, overwrite=options.upper() == "OVERWRITE")
        self._send(200, b"", None)

    def _delete(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        recursive = _parse_bool(params, "recursive", False)
        local = server.local_path(path)
        with server.namespace_lock:
            _check_parents(server, path)
            if path == "/" or not os.path.lexists(local):
                self._send_json(200, {"boolean": False})
                return
            if os.path.isdir(local):
                if os.listdir(local) and not recursive:
                    raise RemoteError(
                        403, "PathIsNotEmptyDirectoryException", f"`{path} is non empty': Directory is not empty"
                    )
                shutil.rmtree(local)
            else:
                os.unlink(local)
        self._send_json(200, {"boolean": True})

    def _list_status(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        local = server.local_path(path)
        with server.namespace_lock:
            _check_parents(server, path)
            if not os.path.exists(local):
                raise RemoteError(404, "FileNotFoundException", f"File {path} does not exist.")
            if os.path.isdir(local):
                names = sorted(os.listdir(local), key=lambda name: name.encode())
                statuses = [_file_status(os.path.join(local, name), name) for name in names]
            else:
                statuses = [_file_status(local, "")]
        self._send_json(200, {"FileStatuses": {"FileStatus": statuses}})

    def _get_file_status(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        local = server.local_path(path)
        with server.namespace_lock:
            _check_parents(server, path)
            if not os.path.exists(local):
                raise RemoteError(404, "FileNotFoundException", f"File does not exist: {path}")
            status = _file_status(local, "")
        self._send_json(200, {"FileStatus": status})

    def _mkdirs(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        local = server.local_path(path)
        with server.namespace_lock:
            _check_parents(server, path)
            if os.path.exists(local) and not os.path.isdir(local):
                raise RemoteError(403, "FileAlreadyExistsException", f"Path is not a directory: {path}")
            os.makedirs(local, exist_ok=True)
        self._send_json(200, {"boolean": True})

    def _get_home_directory(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        self._send_json(200, {"Path": f"/user/{params.get('user.name', 'dr.who')}"})

    def _get_server_defaults(self, server: WebHdfsServer, path: str, params, body: bytes, datanode: bool) -> None:
        """What Hadoop's ``WebHdfs`` (FileContext) asks before its first create: a NameNode's defaults."""
        self._send_json(
            200,
            {
                "FsServerDefaults": {
                    "blockSize": 134217728,
                    "bytesPerChecksum": 512,
                    "writePacketSize": 65536,
                    "replication": 1,
                    "fileBufferSize": 4096,
                    "encryptDataTransfer": False,
                    "trashInterval": 0,
                    "checksumType": 2,
                    "keyProviderUri": "",
                    "defaultStoragePolicyId": 7,
                }
            },
        )


_OPS = {
    ("PUT", "CREATE"): _Handler._create,
    ("GET", "OPEN"): _Handler._open,
    ("PUT", "RENAME"): _Handler._rename,
    ("DELETE", "DELETE"): _Handler._delete,
    ("GET", "LISTSTATUS"): _Handler._list_status,
    ("GET", "GETFILESTATUS"): _Handler._get_file_status,
    ("GET", "GETFILELINKSTATUS"): _Handler._get_file_status,  # no symlinks here: a link's status is the file's
    ("PUT", "MKDIRS"): _Handler._mkdirs,
    ("GET", "GETHOMEDIRECTORY"): _Handler._get_home_directory,
    ("GET", "GETSERVERDEFAULTS"): _Handler._get_server_defaults,
}


def _hdfs_path(url_path: str) -> str:
    if not url_path.startswith(PREFIX):
        raise RemoteError(404, "FileNotFoundException", f"not a WebHDFS URL: {url_path}")
    path = unquote(url_path[len(PREFIX) :]) or "/"
    if not path.startswith("/") or ".." in path.split("/"):
        raise RemoteError(400, "IllegalArgumentException", f"Invalid path: {path}")
    return posixpath.normpath(path)


def _check_parents(server: WebHdfsServer, path: str) -> None:
    """Raise 403 ``ParentNotDirectoryException`` if a proper ancestor of ``path`` is a file."""
    parts = [part for part in path.split("/") if part]
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if os.path.isfile(server.local_path(ancestor)):
            raise RemoteError(403, "ParentNotDirectoryException", f"{ancestor} (is not a directory)")


def _rename(server: WebHdfsServer, source: str, destination: str) -> bool:
    """Hadoop's old ``rename(src, dst)``; the caller holds the namespace lock."""
    for path in (source, destination):
        try:
            _check_parents(server, path)
        except RemoteError:
            return False
    local_source = server.local_path(source)
    if source == "/" or not os.path.exists(local_source):
        return False
    if destination == source:
        return True
    if destination.startswith(source.rstrip("/") + "/"):
        return False
    if os.path.isdir(server.local_path(destination)):
        destination = posixpath.join(destination, posixpath.basename(source))
    local_destination = server.local_path(destination)
    if os.path.exists(local_destination) or not os.path.isdir(os.path.dirname(local_destination)):
        return False
    os.rename(local_source, local_destination)
    return True


def _rename2(server: WebHdfsServer, source: str, destination: str, *, overwrite: bool) -> None:
    """Hadoop's ``rename2`` (RENAME with ``renameoptions``): errors instead of false; the caller holds the lock.

    The destination is never a parent for the source: an existing destination
    is replaced (a file, or an empty directory) with OVERWRITE and refused
    without it.
    """
    _check_parents(server, source)
    _check_parents(server, destination)
    local_source, local_destination = server.local_path(source), server.local_path(destination)
    if source == "/" or not os.path.exists(local_source):
        raise RemoteError(404, "FileNotFoundException", f"rename source {source} is not found.")
    if destination.startswith(source.rstrip("/") + "/"):
        raise RemoteError(403, "IOException", f"rename destination {destination} is a directory or file under source")
    if not os.path.isdir(os.path.dirname(local_destination)):
        raise RemoteError(404, "FileNotFoundException", f"rename destination parent {destination} not found.")
    if os.path.lexists(local_destination):
        if not overwrite:
            raise RemoteError(403, "FileAlreadyExistsException", f"rename destination {destination} already exists.")
        if os.path.isdir(local_destination) and os.listdir(local_destination):
            raise RemoteError(403, "IOException", f"rename destination directory is not empty: {destination}")
        if os.path.isdir(local_destination) != os.path.isdir(local_source):
            raise RemoteError(403, "IOException", f"rename {source} and {destination} are not both files or dirs")
    os.replace(local_source, local_destination)


def _file_status(local: str, suffix: str) -> dict[str, object]:
    info = os.stat(local)
    is_dir = stat.S_ISDIR(info.st_mode)
    return {
        "accessTime": 0 if is_dir else int(info.st_atime * 1000),
        "blockSize": 0 if is_dir else 134217728,
        "childrenNum": len(os.listdir(local)) if is_dir else 0,
        "fileId": info.st_ino,
        "group": "supergroup",
        "length": 0 if is_dir else info.st_size,
        "modificationTime": int(info.st_mtime * 1000),
        "owner": "webhdfs-test",
        "pathSuffix": suffix,
        "permission": "755" if is_dir else "644",
        "replication": 0 if is_dir else 1,
        "storagePolicy": 0,
        "type": "DIRECTORY" if is_dir else "FILE",
    }


def _parse_bool(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return default
    if value.lower() not in ("true", "false"):
        raise RemoteError(400, "IllegalArgumentException", f'Invalid value for webhdfs parameter "{name}": {value}')
    return value.lower() == "true"


def _parse_int(params: dict[str, str], name: str, default: int | None) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise RemoteError(400, "IllegalArgumentException", f'Invalid value for webhdfs parameter "{name}": {value}')
    return number
