"""Binary COPY streams with psycopg2, for the bulk paths (Spark partitions).

Why binary COPY: it is the fastest way in and out of PostgreSQL from Python (no text escaping of
``bytea``, no per-row statements; ``reference/perf_anchors.md`` §2b). psycopg2's ``copy_expert``
pushes a ``COPY ... TO STDOUT`` into any object with ``write`` (one call per row as the server
sends them) and pulls a ``COPY ... FROM STDIN`` from any object with ``read``, so:

* ``RowReader`` parses rows as they arrive and hands each to a callback: a read never holds more
  than one row (plus a partial one) in memory, whatever the size of the result;
* ``StagingWriter`` appends rows to ``lr.spark_staging`` in blocks of at most ``block_bytes``, one
  ``COPY FROM STDIN`` per block, all inside the caller's open transaction.
"""
from __future__ import annotations

import io
import struct
import uuid
from typing import Callable

import psycopg2.extensions

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
HEADER = SIGNATURE + bytes(8)  # signature, flags (int32 0), header extension length (int32 0)
TRAILER = b"\xff\xff"
DEFAULT_BLOCK_BYTES = 1 << 20

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


class RowReader:
    """``write`` target of ``copy_expert("COPY (...) TO STDOUT (FORMAT binary)")``: decodes each
    row into a tuple of ``bytes | None`` fields and calls ``on_row(fields)``."""

    def __init__(self, on_row: Callable[[list[bytes | None]], None]) -> None:
        self.on_row = on_row
        self._buf = bytearray()
        self._header_seen = False
        self.rows = 0

    def write(self, chunk: bytes) -> int:
        buf = self._buf
        buf += chunk
        pos = 0
        if not self._header_seen:
            if len(buf) < len(HEADER) + 4:
                return len(chunk)
            if not buf.startswith(SIGNATURE):
                raise ValueError("not a binary COPY stream")
            (extension,) = _I32.unpack_from(buf, 15)
            pos = 19 + extension
            self._header_seen = True
        end = len(buf)
        while pos + 2 <= end:
            (count,) = _I16.unpack_from(buf, pos)
            if count == -1:  # trailer
                pos += 2
                continue
            cursor, fields = pos + 2, []
            for _ in range(count):
                if cursor + 4 > end:
                    break
                (size,) = _I32.unpack_from(buf, cursor)
                cursor += 4
                if size < 0:
                    fields.append(None)
                    continue
                if cursor + size > end:
                    break
                fields.append(bytes(buf[cursor:cursor + size]))
                cursor += size
            if len(fields) < count:
                break  # partial row: wait for the rest
            self.on_row(fields)
            self.rows += 1
            pos = cursor
        del buf[:pos]
        return len(chunk)


def text(value: str) -> bytes:
    """A text field in binary COPY form."""
    raw = value.encode()
    return _I32.pack(len(raw)) + raw


def uuid_field(value: str | None) -> bytes:
    return b"\xff\xff\xff\xff" if value is None else _I32.pack(16) + uuid.UUID(value).bytes


_STAGED_ROW = struct.Struct(">iqiqihi")  # 8, position, 8, entry id, 2, kind, message length
STAGING_COLUMNS = "source_site_id, client_name, sync_id, source_position, source_entry_id, kind, message"


def staging_prefix(source: str, client: str, sync_id: str | None = None) -> bytes:
    """The leading fields of every staged row of one session (field count, source, client, sync)."""
    return _I16.pack(7) + text(source) + text(client) + uuid_field(sync_id)


def staging_row(prefix: bytes, position: int, entry_id: int, kind: int, message: bytes) -> bytes:
    return prefix + _STAGED_ROW.pack(8, position, 8, entry_id, 2, kind, len(message)) + message


class StagingWriter:
    """Appends binary rows to ``lr.spark_staging`` on one sink connection, a block at a time."""

    def __init__(self, conn: psycopg2.extensions.connection, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        self.conn = conn
        self.block_bytes = block_bytes
        self._block = bytearray(HEADER)
        self.rows = 0
        self.flushes = 0

    def add(self, row: bytes) -> None:
        self._block += row
        self.rows += 1
        if len(self._block) >= self.block_bytes:
            self.flush()

    def flush(self) -> None:
        if len(self._block) == len(HEADER):
            return
        self._block += TRAILER
        with self.conn.cursor() as cur:
            cur.copy_expert(f"COPY lr.spark_staging ({STAGING_COLUMNS}) FROM STDIN (FORMAT binary)",
                            io.BytesIO(self._block), size=len(self._block))
        self._block = bytearray(HEADER)
        self.flushes += 1
