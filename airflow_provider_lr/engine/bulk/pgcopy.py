"""Binary COPY streams with psycopg2, for the bulk paths (Spark partitions).

Why binary COPY: it is the fastest way in and out of PostgreSQL from Python (no text escaping of
``bytea``, no per-row statements; ``reference/perf_anchors.md`` §2b). psycopg2's ``copy_expert``
pushes a ``COPY ... TO STDOUT`` into any object with ``write`` (one call per row as the server
sends them) and pulls a ``COPY ... FROM STDIN`` from any object with ``read``, so:

* ``RowReader`` parses rows as they arrive and hands each to a callback: a read never holds more
  than one row (plus a partial one) in memory, whatever the size of the result;
* ``CopyWriter`` appends rows to a table in blocks of at most ``block_bytes``, one ``COPY FROM
  STDIN`` per block, all inside the caller's open transaction, from a sender thread of its own;
  ``ReceiveQueueWriter`` (the fan-out, straight into ``lr.receive_queue``) and ``StagingWriter``
  (snapshot transfer, ``lr.spark_staging``) are its two uses.
"""

from __future__ import annotations

import io
import queue
import struct
import threading
import uuid
from collections.abc import Callable, Sequence

import psycopg2.extensions

from airflow_provider_lr.engine.sink.queue_rows import Packer, QueueRow
from airflow_provider_lr.engine.store.receive_queue import QueueWriter

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
HEADER = SIGNATURE + bytes(8)  # signature, flags (int32 0), header extension length (int32 0)
TRAILER = b"\xff\xff"
DEFAULT_BLOCK_BYTES = 1 << 20

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


class RowReader:
    """``write`` target of ``copy_expert("COPY (...) TO STDOUT (FORMAT binary)")``: decodes each
    row into a tuple of ``bytes | None`` fields and calls ``on_row(fields)``."""

    def __init__(
        self,
        on_row: Callable[[list[bytes | None]], None],
        fixed: struct.Struct | None = None,
        on_fixed: Callable[[tuple, bytes], None] | None = None,
    ) -> None:
        self.on_row = on_row
        # Optional fast path for rows of fixed-width fields then one variable one: ``fixed``
        # unpacks (field count, then length/value pairs, ending with the last field's length);
        # ``on_fixed(values, last_field)`` gets them. Other chunks take the general path.
        if (fixed is None) != (on_fixed is None):
            raise ValueError("the fixed-row fast path needs both fixed and on_fixed")
        self.fixed, self.on_fixed = fixed, on_fixed
        self._buf = bytearray()
        self._header_seen = False
        self.rows = 0

    def write(self, chunk: bytes) -> int:
        if self._header_seen and not self._buf and self.fixed is not None and self.on_fixed and len(chunk) > 2:
            # PostgreSQL sends one CopyData message per row: parse the usual case without copying.
            head = self.fixed.unpack_from(chunk)
            size = head[-1]
            if self.fixed.size + size == len(chunk):
                self.on_fixed(head, chunk[self.fixed.size :])
                self.rows += 1
                return len(chunk)
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
            cursor = pos + 2
            fields: list[bytes | None] = []
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
                fields.append(bytes(buf[cursor : cursor + size]))
                cursor += size
            if len(fields) < count:
                break  # partial row: wait for the rest
            self.on_row(fields)
            self.rows += 1
            pos = cursor
        del buf[:pos]
        return len(chunk)

    def between_rows(self) -> bool:
        """The header read and no partial row kept: the next chunk starts a row."""
        return self._header_seen and not self._buf


def text(value: str) -> bytes:
    """A text field in binary COPY form."""
    raw = value.encode()
    return _I32.pack(len(raw)) + raw


def uuid_field(value: str | None) -> bytes:
    return b"\xff\xff\xff\xff" if value is None else _I32.pack(16) + uuid.UUID(value).bytes


_STAGED_ROW = struct.Struct(">iqiqihiii")  # 8, position, 8, entry id, 2, kind, 4, count, message length
STAGING_COLUMNS = "source_site_id, client_name, sync_id, source_position, source_entry_id, kind, entry_count, message"


def staging_prefix(source: str, client: str, sync_id: str | None = None) -> bytes:
    """The leading fields of every staged row of one session (field count, source, client, sync)."""
    return _I16.pack(8) + text(source) + text(client) + uuid_field(sync_id)


def staging_head(prefix: bytes, position: int, entry_id: int, kind: int, count: int, message: bytes) -> bytes:
    """A staged receive-queue row (``queue_rows.QueueRow``: ``entry_id`` its last entry's, ``count``
    entries) up to its message, which follows it."""
    return prefix + _STAGED_ROW.pack(8, position, 8, entry_id, 2, kind, 4, count, len(message))


def staging_row(prefix: bytes, position: int, entry_id: int, kind: int, count: int, message: bytes) -> bytes:
    """A whole staged receive-queue row (``staging_head``, then the message)."""
    return staging_head(prefix, position, entry_id, kind, count, message) + message


class CopyWriter:
    """Appends binary rows to ``copy_sql``'s table on one sink connection, a block at a time.

    Blocks go to the sink from a thread of their own (psycopg2 releases the GIL while the server
    ingests), so reading the source, routing rows and the sinks' ingest overlap; at most
    ``QUEUED_BLOCKS`` blocks wait per sink, which bounds memory. The caller owns the transaction:
    ``close`` waits for the last block, then the caller commits."""

    QUEUED_BLOCKS = 2
    # a failed sink stops the caller at its next block; a writer of one of several sessions fed by one
    # read (the tee) fails late instead: only its session is refused, at its commit, the others go on
    FAIL_LATE = False

    COPY_SQL = ""
    _last_block: tuple[list[bytes], bytes] = ([], b"")  # the parts of the last block joined, and the join

    def __init__(self, conn: psycopg2.extensions.connection, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        self.conn = conn
        self.block_bytes = block_bytes
        self.block = [HEADER]  # the next block's parts, joined once when it is handed over
        self.size = len(HEADER)
        self.rows = 0
        self.copied = 0  # rows the server reported copied (blocks sent so far)
        self.flushes = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=self.QUEUED_BLOCKS)
        self._error: BaseException | None = None
        self._abandoned = False
        self._thread = threading.Thread(target=self._send, daemon=True, name="lr-staging-copy")
        self._thread.start()

    def add(self, row: bytes, rest: bytes = b"") -> None:
        """A row in binary COPY form: ``row``, then ``rest`` (a message kept as it is: its bytes
        are copied once, when the block is joined, not into a growing buffer)."""
        self.block += (row, rest)
        self.size += len(row) + len(rest)
        self.rows += 1
        if self.size >= self.block_bytes:
            self.flush()

    def flush(self) -> None:
        """Hand the current block to the sender (blocks while ``QUEUED_BLOCKS`` are waiting). After
        the sender failed: its error, or, ``FAIL_LATE``, the block dropped (``close`` raises)."""
        if self._error is not None:
            if not self.FAIL_LATE:
                raise self._error
            self.block, self.size = [HEADER], len(HEADER)
            return
        if len(self.block) == 1:
            return
        self.block.append(TRAILER)
        parts, joined = CopyWriter._last_block
        if parts != self.block:  # writers fed the same rows (a broadcast's sessions) join each block once
            joined = b"".join(self.block)
            CopyWriter._last_block = self.block, joined
        self._queue.put(joined)
        self.block, self.size = [HEADER], len(HEADER)
        self.flushes += 1

    def sync(self) -> None:
        """Wait until every block handed over so far is in the sink (inside the open transaction)."""
        self.flush()
        self._queue.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Send what is left, wait for it and stop the sender; raises the sender's error."""
        try:
            self.sync()
        finally:
            self._queue.put(None)
            self._thread.join()

    def abandon(self) -> None:
        """Stop the sender without waiting for the sink (error paths; the transaction is dropped)."""
        if self._thread.is_alive():
            self._abandoned = True
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass

    def _send(self) -> None:
        while True:
            block = self._queue.get()
            try:
                if block is None or self._abandoned:
                    return
                if self._error is None:
                    with self.conn.cursor() as cur:
                        # a BytesIO made from bytes hands them to read() as they are
                        cur.copy_expert(self.COPY_SQL, io.BytesIO(block), size=len(block))
                        self.copied += max(cur.rowcount, 0)
            except BaseException as exc:  # reported to the producer at its next flush/close
                self._error = exc
            finally:
                self._queue.task_done()


class StagingWriter(CopyWriter):
    """Rows of ``staging_row`` into ``lr.spark_staging`` (snapshot transfer)."""

    COPY_SQL = f"COPY lr.spark_staging ({STAGING_COLUMNS}) FROM STDIN (FORMAT binary)"


# --- receive-queue rows (the fan-out writes them directly) -----------------------------------------
class PackedRows(CopyWriter):
    """Entries appended one by one (``append``: ``(queue_rows.piece(message), kind, position, entry
    id)``), packed into receive-queue rows (``queue_rows.Packer``) in the order added: a
    ``CopyWriter`` whose ``packer`` emits each row into its block, in the form of the subclass's table."""

    FAIL_LATE = True  # a chunk's read goes on for the other sessions (``bulk/tee.py``)
    packer: Packer
    append: Callable[[tuple[bytes, int, int, int]], None]  # the packer's, bound by the subclass

    def pack(self, alike: Sequence[PackedRows] = ()) -> None:
        """Turn the entries appended so far into rows (the unfinished last pack waits for more);
        the same rows into the ``alike`` writers, whose entries waiting are the same."""
        self.packer.flush(final=False, alike=[writer.packer for writer in alike])

    @property
    def entries(self) -> int:
        return self.packer.entries + len(self.packer.pending)

    def sync(self) -> None:
        self.packer.flush()  # a pack in progress ends here: what was added is all in the sink
        super().sync()


class ReceiveQueueWriter(PackedRows):
    """One session's visible entries into ``lr.receive_queue``, packed (``queue_rows.Packer``) in
    the order added, so ``seq`` follows it: the COPY form of the queue's writer
    (``store.receive_queue.QueueWriter``, which also says what a role under row-level security
    copies into). ``entries`` counts what was added, ``rows`` the rows."""

    def __init__(
        self, conn: psycopg2.extensions.connection, source: str, client: str, block_bytes: int = DEFAULT_BLOCK_BYTES
    ) -> None:
        self.queue = QueueWriter(source, client)
        self.COPY_SQL = self.queue.copy_sql(conn)
        super().__init__(conn, block_bytes)
        self.packer = Packer(self._add_row)
        self.append = self.packer.append  # (queue_rows.piece(message), kind, position, entry id)

    def _add_row(self, row: QueueRow) -> None:
        """A row appended to the block in its binary COPY form."""
        self.add(self.queue.copy_head(row), row.message)

    def close(self) -> None:
        super().close()
        moved = self.queue.copy_finish(self.conn)  # the temporary table's rows, in the order copied
        if moved is not None:
            self.copied = moved


class StagedQueueWriter(PackedRows, StagingWriter):
    """One session's log entries of a staged fan-out chunk (``bulk/staged_tee.py``), packed as the
    receive queue holds them, into ``lr.spark_staging`` (no sync id); fed like ``ReceiveQueueWriter``."""

    def __init__(self, conn: psycopg2.extensions.connection, source: str, client: str) -> None:
        super().__init__(conn)
        self.prefix = staging_prefix(source, client)
        self.packer = Packer(self._add_row)
        self.append = self.packer.append

    def _add_row(self, row: QueueRow) -> None:
        self.add(
            staging_head(self.prefix, row.position, row.entry_id, row.kind, row.entry_count, row.message), row.message
        )
