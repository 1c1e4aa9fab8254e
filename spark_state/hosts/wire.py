"""The frames a worker and its host exchange over their Unix socket, and Arrow batches as frame payloads.

A frame is a one-byte kind and an 8-byte big-endian length, then the payload
(``send``, ``receive``). A task: the worker sends ``TASK`` (the pickled task,
``tasks.pickled_task``), ``BATCH`` (one Arrow IPC stream per input record
batch) and ``END``; the host answers ``BATCH`` frames of output and ``END``,
or ``ERROR`` (a pickled exception). Adoption: ``ADOPT`` (a socket name),
``READY`` or ``REFUSED``, ``GO``, ``DONE`` (``adoption``). Before any of them,
the handshake of ``trust`` (its ``HELLO`` and ``PROOF`` frames).
"""

from __future__ import annotations

import socket
import struct

import pyarrow as pa

TASK, BATCH, END, ERROR = b"T", b"B", b"E", b"X"


ADOPT, READY, REFUSED, GO, DONE = b"A", b"R", b"N", b"G", b"D"


_HEADER = struct.Struct("!cQ")


def send(connection: socket.socket, kind: bytes, payload: bytes | memoryview = b"") -> None:
    connection.sendall(_HEADER.pack(kind, len(payload)))
    if payload:
        connection.sendall(payload)


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = connection.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def receive(connection: socket.socket, *, max_size: int | None = None) -> tuple[bytes, bytes] | None:
    """The next frame, or None when the peer closed the connection (or announced more than ``max_size`` bytes)."""
    header = _receive_exactly(connection, _HEADER.size)
    if header is None:
        return None
    kind, size = _HEADER.unpack(header)
    if max_size is not None and size > max_size:
        return None
    payload = _receive_exactly(connection, size) if size else b""
    return None if payload is None else (kind, payload)


def next_kind(connection: socket.socket) -> bytes | None:
    """The kind of the next frame (``receive``, its payload dropped); None when the peer closed the connection."""
    frame = receive(connection)
    return None if frame is None else frame[0]


def batch_bytes(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def batch(payload: bytes) -> pa.RecordBatch:
    return pa.ipc.open_stream(payload).read_next_batch()


def first_frame_kind(connection: socket.socket) -> bytes:
    """The kind of the connection's first frame, left unread (empty when the peer closed it)."""
    return connection.recv(1, socket.MSG_PEEK)
