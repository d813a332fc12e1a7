"""Rows of a table straight from a source's binary COPY into one or more sinks' COPY, streamed.

The bytes are never decoded: source and sink tables have the same column types (checked before,
``definition.check_same``), and binary COPY names the columns on both sides, so their order may
differ. Each sink's ``COPY FROM STDIN`` runs in a thread of its own and reads from a bounded
queue: memory stays at a few MiB whatever the size of the range, and the slowest sink sets the pace.

The server sends ``COPY TO STDOUT`` one row per message, and psycopg2 hands each message to
``write``; the rows are gathered into blocks of ``COPY_BLOCK`` bytes before they are queued, and each
sink's ``copy_expert`` reads a whole block at a time. Queueing row by row (one queue hand-off per row
and sink, one ``read`` and one send per row at each sink) made Python the bottleneck: 1M rows of
216 bytes to 2 sinks took 8.3 s (12.0 s of CPU) in one read, against 1.8 s (3.3 s of CPU) in 128 KiB
blocks; 64 KiB to 2 MiB blocks measured alike (docs/tables-bench.md, bench/table_bench.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db.timeouts import DEADLINES, Clock
from airflow_provider_lr.engine.tables.definition import TableDefinition

COPY_BLOCK = 128 * 1024  # rows of the source's output gathered into blocks of this size (bytes)
QUEUE_CHUNKS = 16  # blocks buffered per sink (2 MiB)
_END = b""


class _QueueReader:
    """``read`` target of ``copy_expert(COPY ... FROM STDIN)``: the chunks put in its queue."""

    def __init__(self, clock: Clock) -> None:
        self.chunks: queue.Queue[bytes] = queue.Queue(QUEUE_CHUNKS)
        self.pending = b""
        self.ended = False
        self.clock = clock

    def read(self, size: int = -1) -> bytes:
        while not self.pending and not self.ended:
            chunk = self.chunks.get()
            self.clock.moved()
            if chunk == _END:
                self.ended = True
            self.pending = chunk
        if size is None or size < 0 or size >= len(self.pending):
            out, self.pending = self.pending, b""
        else:
            out, self.pending = self.pending[:size], self.pending[size:]
        return out

    readline = read


class _Tee:
    """``write`` target of the source's ``COPY ... TO STDOUT``: every block to every sink."""

    def __init__(self, readers: Sequence[_QueueReader], failed: list[BaseException], clock: Clock) -> None:
        self.readers, self.failed, self.clock = readers, failed, clock
        self.bytes = 0
        self.block = bytearray()

    def write(self, chunk: bytes) -> int:
        if self.failed:
            raise self.failed[0]  # a sink gave up: stop the source's COPY too
        self.clock.moved()
        size = len(chunk)
        self.bytes += size
        self.block += chunk
        if len(self.block) >= COPY_BLOCK:
            self.flush()
        return size

    def flush(self) -> None:
        """Hand the rows gathered so far to every sink (never an empty block: it reads as the end)."""
        if self.block:
            data = bytes(self.block)
            self.block.clear()
            for reader in self.readers:
                reader.chunks.put(data)


def select_statement(definition: TableDefinition, where: sql.Composable | None = None) -> sql.Composed:
    """The source's rows of the table (``where``: a key range), its columns by name: ``ONLY`` its own,
    as its capture follows only statements naming it. A table given an inheritance child after it
    was opened (the open refuses one that has any) has the child's rows in a plain ``SELECT``: they
    were copied into the sinks, where a key the child shares with the table refused every snapshot
    of it, for good."""
    cols = sql.SQL(", ").join(map(sql.Identifier, definition.column_names))
    query = sql.SQL("SELECT {} FROM ONLY {}").format(cols, definition.table.ident)
    if where is not None:
        query = sql.SQL("{} WHERE {}").format(query, where)
    return sql.SQL("COPY ({}) TO STDOUT (FORMAT binary)").format(query)


def insert_statement(definition: TableDefinition, target: sql.Composable | None = None) -> sql.Composed:
    cols = sql.SQL(", ").join(map(sql.Identifier, definition.column_names))
    return sql.SQL("COPY {} ({}) FROM STDIN (FORMAT binary)").format(target or definition.table.ident, cols)


def copy_rows(
    source: psycopg2.extensions.cursor,
    select: sql.Composed,
    sinks: Sequence[tuple[psycopg2.extensions.cursor, sql.Composed]],
) -> int:
    """Run ``select`` (a ``COPY ... TO STDOUT``) on ``source`` and feed its output to each sink's
    ``COPY ... FROM STDIN`` in the sinks' open transactions. Returns the bytes copied. A failure on
    any side raises here, with the sinks' transactions left for the caller to roll back.

    On connections ``lifted`` for it (a table snapshot in a cycle) each side's call is cut once no
    byte moved anywhere in the copy for the call deadline it had (``DEADLINES.stalled``): a stopped
    sink or a stalled link fails the copy instead of holding it, and the cycle, for good."""
    clock = Clock()
    readers = [_QueueReader(clock) for _ in sinks]
    failed: list[BaseException] = []

    def load(cur: psycopg2.extensions.cursor, statement: sql.Composed, reader: _QueueReader) -> None:
        try:
            with DEADLINES.stalled(cur.connection, clock):
                cur.copy_expert(statement, reader, size=COPY_BLOCK)
        except BaseException as exc:  # noqa: BLE001 - handed to the source's thread
            failed.append(exc)
            while not reader.ended:  # drain, so the source's writer never blocks on a full queue
                reader.read()

    threads = [
        threading.Thread(target=load, args=(cur, stmt, reader), daemon=True)
        for (cur, stmt), reader in zip(sinks, readers)
    ]
    for thread in threads:
        thread.start()
    tee = _Tee(readers, failed, clock)
    try:
        with DEADLINES.stalled(source.connection, clock):
            source.copy_expert(select, tee)
        tee.flush()  # the last rows (the binary trailer with them); after a failure, none: no cut row
    finally:
        for reader in readers:
            reader.chunks.put(_END)
        for thread in threads:
            thread.join()
    if failed:
        raise failed[0]
    return tee.bytes
