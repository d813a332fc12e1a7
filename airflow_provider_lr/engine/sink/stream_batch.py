"""A stream's sink transactions: every session of one sink site in ONE round trip.

A source's stream knows where it left each session's sink, so a session's transaction needs nothing
read first: BEGIN, a guard that moves the session's row on only from there (``lr.stream_advance``),
its table changes composed from the targets the connection last read for it and a check that they
still are, its rows, its subscribers' wake-up, COMMIT, committed asynchronously (acknowledged once
the sink's WAL flush passed it: ``session/durable_acks``). Anything else takes the general path
(``writes.apply_log_stream``), which reads each row and target, adds only what is new and says what
is wrong.

The guard and the usual row (consecutive entries pack into one: ``queue_rows``) with its wake-up are
statements prepared on the connection (``STREAM_ADVANCE``, ``STREAM_ROW``): as text, the sink's
backend spent a tenth to a fifth of the transaction parsing and planning them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine.db import prepared
from airflow_provider_lr.engine.errors import TableError
from airflow_provider_lr.engine.sink.queue_rows import Packer
from airflow_provider_lr.engine.sink.writes import INSERT_BYTES, INSERT_ENTRIES, sink_entries
from airflow_provider_lr.engine.source.log_reader import LogBatch
from airflow_provider_lr.engine.store import receive_queue, sink_sessions
from airflow_provider_lr.engine.tables.sink import ChangeApplier
from airflow_provider_lr.engine.tables.targets import expected
from airflow_provider_lr.engine.vocabulary import NOTIFY_CHANNEL, wakeup_payload


@dataclass(frozen=True)
class StreamWrite:
    """One session's batch as a stream writes it: where the stream left the session's sink
    (``batch.after``), at its lease ``epoch`` and snapshot ``base``."""

    client: str
    epoch: int
    batch: LogBatch
    base: int


def stream_batches(
    conn: psycopg2.extensions.connection, source: str, batches: Sequence[StreamWrite]
) -> list[int | None]:
    """Sessions' batches, each in its own transaction, all in ONE round trip (committed
    asynchronously, as ``apply_log_stream(synchronous=False)``): per session BEGIN, its row moved
    from ``batch.after`` to ``batch.end`` under its lock (``sink_sessions.STREAM_BEGIN``), its
    table changes, its rows, its wake-up, COMMIT. The sink's position after each; None for a batch
    left to ``apply_log_stream``: one larger than one INSERT, or with changes of a table whose
    target this connection has not read for the session (``targets.expected``), and every batch of
    the round trip when a session's row was not where the stream left it (a fence, a failover,
    another writer), a table's target changed, or the sink refused a table change (the
    transactions before it may have committed: the general path reads each row, adds only what is
    new and says what is wrong). ``conn`` is autocommit, the queues are registered (a session's
    first write takes the general path)."""
    ends: list[int | None] = [None] * len(batches)
    statements: list[bytes] = []
    tables = False
    prepared.ensure(conn, sink_sessions.STREAM_ADVANCE, receive_queue.STREAM_ROW)
    with conn.cursor() as cur:
        for n, write in enumerate(batches):
            made = _stream_transaction(cur, source, write)
            if made is not None:
                statements += made[0]
                ends[n] = write.batch.end
                tables = tables or made[1]
        if not statements:
            return ends
        try:
            cur.execute(b"; ".join(statements))
        except psycopg2.Error as exc:
            if not conn.closed:
                with contextlib.suppress(psycopg2.Error):
                    cur.execute("ROLLBACK")
            if isinstance(exc, psycopg2.errors.InvalidSqlStatementName):
                prepared.forget(conn)  # gone (a pooler's DISCARD ALL): the next round prepares them again
            elif exc.pgcode != sink_sessions.NOT_WHERE_LEFT and not (tables and _refused(exc)):
                raise
            return [None] * len(batches)
    return ends


def _refused(exc: psycopg2.Error) -> bool:
    """The sink refused a statement (a constraint, trigger, privilege), not the connection or a lock."""
    return not isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError))


def _stream_transaction(
    cur: psycopg2.extensions.cursor, source: str, write: StreamWrite
) -> tuple[list[bytes], bool] | None:
    """``stream_batches``' transaction of one session, its statements as text (joined once with the
    other sessions': a large table change is not copied once more per join), and whether it changes
    tables; None when it takes the general path."""
    batch, client = write.batch, write.client
    if batch.end <= batch.after or batch.bytes > INSERT_BYTES or len(batch.records) > INSERT_ENTRIES:
        return None
    tids = {r.table_id for r in batch.records if r.table_id is not None and r.position > batch.after}
    tables = None
    if tids:
        found = expected(cur.connection, source, client, tids)
        if found is None:
            return None
        tables = ChangeApplier(cur, source, client, found)
    writer = receive_queue.QueueWriter(source, client)
    packer = Packer(writer.add)
    try:
        for entry in sink_entries(batch.records, batch.after, source, client, tables):
            packer.add(*entry)
    except TableError:  # a change that does not fit the table: the general path says so
        return None
    packer.flush()
    guard = {"source": source, "client": client, "epoch": write.epoch, "base": write.base}
    statements = [cur.mogrify(sink_sessions.STREAM_BEGIN, {**guard, "after": batch.after, "end": batch.end})]
    if tables is not None:
        tables.flush()
        statements += tables.statements or []
    if writer.rows:
        statements.append(writer.stream_statement(cur, NOTIFY_CHANNEL, wakeup_payload(client, source)))
    statements.append(b"COMMIT")
    return statements, tables is not None
