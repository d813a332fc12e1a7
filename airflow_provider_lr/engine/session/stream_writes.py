"""How a source's stream writes one sink site's sessions.

Each session's batch is its own fenced sink transaction, committed asynchronously (acknowledged
once the sink's WAL flush passed it: ``durable_acks``). A session the stream wrote to before stands
on its sink where the stream left it, so its transaction needs nothing read first: the site's such
sessions go in ONE round trip (``stream_batch.stream_batches``: per session BEGIN, a guard that moves the
session's row on only from there, table changes composed from the targets the connection last read
for it and a check that they still are, rows, wake-up, COMMIT). The others (a session's first write,
which registers its queue; a change of a table the connection has not read for it; a batch too large)
take the general path (``writes.apply_log_stream``: the row read under its lock, then written), and
so does every session of the round trip when one was not where the stream left it (a fence, a
failover, another writer), a table's target changed or the sink refused a change: the general path
reads each row and target, adds only what is new and says what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg2.extensions

from airflow_provider_lr.engine.db.autocommit import autocommit
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session.stream_member import Member
from airflow_provider_lr.engine.sink import stream_batch, writes
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogStream


def apply_site(
    conn: psycopg2.extensions.connection, jobs: Sequence[tuple[Member, LogBatch]], source: str
) -> list[int | Exception]:
    """``jobs`` (one site's sessions and their batches) written on ``conn``; the sink's position
    after each, or what it raised (the stream decides what it means for the session). Once the
    connection is lost, the sessions not written yet get what lost it, not the closed connection's
    ``InterfaceError``: the cause is what their hand-back records and ``lr status`` shows."""
    done: dict[int, int | Exception] = {}
    lost: Exception | None = None  # what closed ``conn`` during this round trip
    fast = [n for n, (member, _) in enumerate(jobs) if member.registered]
    if fast:
        batches = [
            stream_batch.StreamWrite(member.key.client, member.position.epoch, batch, member.position.base)
            for member, batch in (jobs[n] for n in fast)
        ]
        try:
            with autocommit(conn):  # BEGIN and COMMIT ride with the statements
                ends = stream_batch.stream_batches(conn, source, batches)
        except Exception as exc:  # the site's: every session of the round trip says so
            done.update(dict.fromkeys(fast, exc))
            lost = exc if conn.closed else None
        else:
            for n, end in zip(fast, ends):
                if end is not None:
                    done[n] = _after_apply(end)
    for n, (member, batch) in enumerate(jobs):
        if n in done:
            continue
        if lost is not None:
            done[n] = lost
            continue
        try:
            done[n] = apply_one(conn, source, member, batch)
        except Exception as exc:
            done[n] = exc
            lost = exc if conn.closed else None
    return [done[n] for n in range(len(jobs))]


def apply_one(conn: psycopg2.extensions.connection, source: str, member: Member, batch: LogBatch | LogStream) -> int:
    """One session's batch by the general path (a batch of any size: ``LogStream``); the sink's
    position after it."""
    p = member.position
    with autocommit(conn):  # BEGIN and COMMIT ride with its first and last statements
        after = writes.apply_log_stream(
            conn, source, member.key.client, p.epoch, batch, p.base, not member.registered, False
        )
    fault_point("stream_after_sink_apply")
    return after


def _after_apply(end: int) -> int | Exception:
    """A batch committed on its sink, in the crash window before the stream learns it (a fault point)."""
    try:
        fault_point("stream_after_sink_apply")
    except Exception as exc:  # a test's fault: as if the commit's answer was lost
        return exc
    return end
