"""Full-sync requests (server side) and their supply by the client's provider (client side).

The server records a request per session; at most one is open per (sink, client): a new one
cancels the others (CorfuDB A1.5). The client's provider runs in one REPEATABLE READ transaction
on the source that writes the start marker, the provider's messages and the end marker into
``LRQ_Send_SnapSync`` and marks the request supplied, all or nothing. That transaction also fixes
the split of the log at the base snapshot (guarantee 6 in docs/architecture.md):

* ``base``: a commit barrier noted *before* the provider's snapshot, so every position <= base was
  final when the snapshot was taken (committed ones are in it);
* ``snapshot``/``upto``: the provider's ``pg_current_snapshot()`` and the commit positions drawn
  by then. A position in ``(base, upto]`` whose transaction is visible in the snapshot is covered
  by the full sync; every other position after ``base`` follows as a log entry.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from enum import Enum

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine import progress, vocabulary
from airflow_provider_lr.engine.db import conninfo, durable_commits, encoding
from airflow_provider_lr.engine.db.local_settings import on_callers_connection, whole_transactions
from airflow_provider_lr.engine.errors import ConfigurationError, FullSyncError, one_line, require_seconds
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.source import closed_tables
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL, commit_barrier
from airflow_provider_lr.engine.source.loading import load_function
from airflow_provider_lr.engine.source.log_reader import BaseSplit, LogRecord
from airflow_provider_lr.engine.source.log_writer import CLIENT_ID_OF, LogWriter
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.source_sessions import Holding
from airflow_provider_lr.engine.vocabulary import (
    OPEN_STATUSES,
    OPEN_STATUSES_SQL,
    STREAM_SNAP_SYNC,
    RequestStatus,
    SessionKey,
)
from airflow_provider_lr.proto import lr_pb2

DEFAULT_DATA_TIMEOUT = 120.0  # seconds without client data before a request is restarted
NOTE_CHARS = 2000  # a note kept on a request (a reason, a failure): lr.full_sync_requests bounds it (V0046)


@dataclass(frozen=True)
class FullSyncRequest:
    request_id: str
    sink_site_id: str
    client_name: str
    forced: bool
    reason: str
    status: str
    requested_at: datetime
    data_deadline: datetime
    supplied_tx: str | None
    base_position: int | None
    base_snapshot: str | None
    base_upto: int | None
    entries: int | None
    note: str | None = None  # why it was closed, or who applied it

    @property
    def split(self) -> BaseSplit:
        assert self.base_snapshot is not None and self.base_upto is not None, "request not supplied"
        return BaseSplit(self.base_snapshot, self.base_upto)


_COLUMNS = ", ".join(f.name for f in fields(FullSyncRequest))


def _request(row: tuple) -> FullSyncRequest:
    values = list(row)
    values[0], values[8] = str(values[0]), (str(values[8]) if values[8] is not None else None)
    return FullSyncRequest(*values)


@on_callers_connection
def request_full_sync(
    conn: psycopg2.extensions.connection,
    sink: str,
    client: str,
    reason: str = "",
    forced: bool = False,
    data_timeout: float = DEFAULT_DATA_TIMEOUT,
    lease: Holding | None = None,
) -> FullSyncRequest:
    """Record a full-sync request for the session (sink, client) on this source, cancelling any
    open one for the same session first. Commits. A replicator passes its ``lease``: the request is
    made only while that lease is current (a stale one must not cancel its successor's sync). An
    open request under supply now (its transaction holds the row for as long as the provider takes,
    minutes for a large one) is not waited for: the next look at the session's open request
    cancels it (``open_request``). On a caller's connection, ``on_callers_connection``'s rule."""
    require_seconds(data_timeout=data_timeout)
    reason = encoding.storable(conn, vocabulary.flattened_reason(reason))  # whatever the site's encoding
    try:
        with conn.cursor() as cur:
            if lease is not None and not source_sessions.lock_held(cur, sink, client, lease):
                raise source_sessions.lost(cur, sink, client, lease)  # taken over, or removed from the topology
            if not source_sessions.exists(cur, sink, client):
                known = source_sessions.names(cur)
                raise ConfigurationError(
                    f"no session to sink {sink!r} for client {client!r} on this source; sessions are {known}"
                )
            cur.execute(
                f"{durable_commits.THIS_TRANSACTION}UPDATE lr.full_sync_requests SET status = '{RequestStatus.CANCELLED}', "
                "finished_at = now(), note = 'superseded by a newer request' WHERE request_id IN (SELECT request_id "
                f"FROM lr.full_sync_requests WHERE sink_site_id = %s AND client_name = %s AND status IN {OPEN_STATUSES_SQL} "
                "FOR UPDATE SKIP LOCKED)",
                (sink, client),
            )
            cur.execute(
                f"INSERT INTO lr.full_sync_requests (request_id, sink_site_id, client_name, forced, reason, data_deadline) "
                f"VALUES (%s, %s, %s, %s, %s, now() + make_interval(secs => %s)) RETURNING {_COLUMNS}",
                (str(uuid.uuid4()), sink, client, forced, reason, data_timeout),
            )
            request = _request(cur.fetchone())
        conn.commit()
        return request
    except BaseException:
        conn.rollback()
        raise


@on_callers_connection
def open_request(conn: psycopg2.extensions.connection, sink: str, client: str) -> FullSyncRequest | None:
    """The session's open (pending or supplied) request, newest first. Requests a newer one or a
    topology apply could not cancel while their supply ran (``close_superseded``) are closed first."""
    with conn.cursor() as cur:
        close_superseded(cur)
        cur.execute(
            f"SELECT {_COLUMNS} FROM lr.full_sync_requests WHERE sink_site_id = %s AND client_name = %s "
            f"AND status IN {OPEN_STATUSES_SQL} ORDER BY requested_at DESC LIMIT 1",
            (sink, client),
        )
        row = cur.fetchone()
    conn.commit()
    return _request(row) if row else None


def close_superseded(cur: psycopg2.extensions.cursor) -> None:
    """Cancel every open request that a newer open request of its session supersedes, or whose
    session the topology removed: ``request_full_sync`` and a topology apply skip a request under
    supply (its supply holds the row for as long as the provider takes) rather than wait for it.
    A request under supply now is skipped here too; its turn comes at the next look."""
    cur.execute(
        f"UPDATE lr.full_sync_requests SET status = '{RequestStatus.CANCELLED}', finished_at = now(), "
        "note = CASE WHEN x.removed THEN 'session removed from the topology' ELSE 'superseded by a newer request' END "
        f"FROM (SELECT r.request_id, NOT {source_sessions.recorded('r')} AS removed FROM lr.full_sync_requests r "
        f"WHERE r.status IN {OPEN_STATUSES_SQL} AND (NOT {source_sessions.recorded('r')} OR EXISTS (SELECT 1 "
        "FROM lr.full_sync_requests n WHERE n.sink_site_id = r.sink_site_id AND n.client_name = r.client_name "
        f"AND n.status IN {OPEN_STATUSES_SQL} AND n.requested_at > r.requested_at)) FOR UPDATE OF r SKIP LOCKED) x "
        "WHERE lr.full_sync_requests.request_id = x.request_id"
    )


@on_callers_connection
def sessions_requested(conn: psycopg2.extensions.connection, forced_only: bool = True) -> set[tuple[str, str]]:
    """(sink, client) of each session of this source with an open request, forced ones only unless
    told (a stream hands those back: negotiation acts on no other, so a stream handing a session
    back for an unforced one saw the cycle send it straight back, at every check). One statement."""
    with conn.cursor() as cur:
        sql = "SELECT DISTINCT sink_site_id, client_name FROM lr.full_sync_requests WHERE (forced OR NOT %s) "
        cur.execute(sql + f"AND status IN {OPEN_STATUSES_SQL}", (forced_only,))
        found = {(sink, client) for sink, client in cur.fetchall()}
    conn.commit()
    return found


@on_callers_connection
def get_request(conn: psycopg2.extensions.connection, request_id: str) -> FullSyncRequest | None:
    with conn.cursor() as cur:
        cur.execute(f"SELECT {_COLUMNS} FROM lr.full_sync_requests WHERE request_id = %s", (request_id,))
        row = cur.fetchone()
    conn.commit()
    return _request(row) if row else None


def request_for_sessions(
    keys: list[SessionKey],
    connect: Callable[[str], psycopg2.extensions.connection],
    reason: str,
    catch_up_wait: float = closed_tables.CATCH_UP_WAIT,
) -> dict[SessionKey, FullSyncRequest]:
    """A forced full sync of each of ``keys`` (``lr full-sync``, the lr_full_sync DAG: a sink, a
    source, a client or every session at once), one connection per source. None is requested
    until every sink holds the changes its client's closed tables had before their close
    (``closed_tables.wait_for_closes``: a full sync would pass them)."""
    vocabulary.checked_reason(reason)
    sources = sorted({k.source for k in keys})
    conns: dict[str, psycopg2.extensions.connection] = {}
    try:
        for source in sources:
            conns[source] = connect(source)
            for key in (k for k in keys if k.source == source):
                closed_tables.wait_for_closes(conns[source], key.sink, key.client, catch_up_wait)
        ordered = sorted(keys, key=lambda k: k.source)  # a source's together, each in the order given
        return {k: request_full_sync(conns[k.source], k.sink, k.client, reason, forced=True) for k in ordered}
    finally:
        for conn in conns.values():
            conn.close()


class Outcome(str, Enum):
    APPLIED = "applied"  # the sink holds a full sync requested no earlier than this request
    PENDING = "pending"  # not yet: this request, or a newer one of its session, is still open
    FAILED = "failed"  # closed without being applied, and no newer request of its session was


@dataclass(frozen=True)
class RequestOutcome:
    """What became of a full-sync request, whichever replicator worked on it (a DAG's step, the
    stream, ``lr sync``). A newer request of the same session cancels it (one open per session)
    but satisfies it once applied: the sink then holds a full sync requested after this one."""

    request: FullSyncRequest
    outcome: Outcome
    applied_request: str | None = None  # the request whose apply satisfied this one
    note: str = ""

    @property
    def final(self) -> bool:
        return self.outcome is not Outcome.PENDING

    def describe(self) -> str:
        own = self.applied_request == self.request.request_id
        if self.outcome is Outcome.APPLIED:
            by = "" if own else f" (through newer request {self.applied_request})"
            # the note is "applied by <owner>" when the apply closed it: not "applied: applied by ..."
            if self.note.startswith("applied by "):
                return f"full sync {self.request.request_id} {self.note}{by}"
            return f"full sync {self.request.request_id} applied{by}" + (f": {self.note}" if self.note else "")
        if self.outcome is Outcome.PENDING:
            return f"full sync {self.request.request_id} not applied yet ({self.request.status})"
        return f"full sync {self.request.request_id} {self.request.status}" + (f": {self.note}" if self.note else "")


@on_callers_connection
def outcome(conn: psycopg2.extensions.connection, request_id: str) -> RequestOutcome | None:
    """The outcome of a request (``RequestOutcome``); None when there is no such request."""
    request = get_request(conn, request_id)
    if request is None:
        return None
    if request.status == RequestStatus.APPLIED:
        return RequestOutcome(request, Outcome.APPLIED, request.request_id, request.note or "")
    with conn.cursor() as cur:
        cur.execute(
            "SELECT request_id::text, status, note FROM lr.full_sync_requests WHERE sink_site_id = %s "
            "AND client_name = %s AND requested_at > %s ORDER BY requested_at",
            (request.sink_site_id, request.client_name, request.requested_at),
        )
        newer = cur.fetchall()
    conn.commit()
    for newer_id, status, note in newer:
        if status == RequestStatus.APPLIED:
            return RequestOutcome(request, Outcome.APPLIED, newer_id, note or "")
    if request.status in OPEN_STATUSES or any(status in OPEN_STATUSES for _, status, _ in newer):
        return RequestOutcome(request, Outcome.PENDING)
    return RequestOutcome(request, Outcome.FAILED, note=request.note or "")


@on_callers_connection
def finish_request(
    conn: psycopg2.extensions.connection, request_id: str, status: str, note: str = "", unless_supplying: bool = False
) -> bool:
    """Close an open request ('applied', 'cancelled' or 'timed_out'); its data becomes trimmable.
    A closed request keeps its first outcome (closing it again is a no-op, so callers on both sides
    of a crash window may close it). ``unless_supplying``: leave it (rolled back, False) while a
    provider's supply holds it (a client's own serve loop), rather than wait for that supply's
    lock. Commits; True when this call closed it."""
    skip = " FOR UPDATE SKIP LOCKED" if unless_supplying else ""
    try:
        with conn.cursor() as cur:
            cur.execute(
                "UPDATE lr.full_sync_requests SET status = %s, finished_at = now(), note = coalesce(%s, note) "
                f"WHERE request_id = (SELECT request_id FROM lr.full_sync_requests WHERE request_id = %s "
                f"AND status IN {OPEN_STATUSES_SQL}{skip})",
                (status, encoding.storable(conn, note[:NOTE_CHARS]) if note else None, request_id),
            )
            closed = cur.rowcount == 1
        if unless_supplying and not closed:
            conn.rollback()  # what the caller wrote with it is undone too
            return False
        conn.commit()
        return closed
    except BaseException:
        conn.rollback()
        raise


def supply_again(
    conn: psycopg2.extensions.connection, request_id: str, note: str, data_timeout: float = DEFAULT_DATA_TIMEOUT
) -> FullSyncRequest | None:
    """Send a supplied request back to ``pending`` under the same id (who waits for it keeps waiting
    for it): its data, at a base the sink has since passed, is left for trim and supplied anew.
    Commits; the request, or None when it was no longer supplied (closed meanwhile)."""
    try:
        with conn.cursor() as cur:
            cur.execute(
                f"UPDATE lr.full_sync_requests SET status = '{RequestStatus.PENDING}', supplied_at = NULL, "
                "supplied_tx = NULL, base_position = NULL, base_snapshot = NULL, base_upto = NULL, entries = NULL, "
                "note = %s, data_deadline = now() + make_interval(secs => %s) "
                f"WHERE request_id = %s AND status = '{RequestStatus.SUPPLIED}' RETURNING {_COLUMNS}",
                (encoding.storable(conn, note[:NOTE_CHARS]), data_timeout, request_id),
            )
            row = cur.fetchone()
        conn.commit()
        return _request(row) if row else None
    except BaseException:
        conn.rollback()
        raise


def supplied_records(
    conn: psycopg2.extensions.connection, request: FullSyncRequest, after_entry: int, limit: int, max_bytes: int
) -> list[LogRecord]:
    """The request's supplied messages after source entry ``after_entry``, in entry order: at most
    ``limit``, and only while the bytes before each stay under ``max_bytes`` (at least one). Commits."""
    with conn.cursor() as cur:
        # Sizes are read from the tuples without fetching the messages.
        # One transaction, so one commit position: read apart. The entries in primary-key order
        # (tx, entry_id), never sorted: right after the supplying transaction the table's
        # statistics are stale (a handful of rows expected), and the planner sorted every remaining
        # entry for each chunk: a full sync of 1M entries took 75 s in process, quadratic.
        cur.execute("SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off")
        tx = request.supplied_tx  # the request's client's entries of it only (``CLIENT_ID_OF``)
        cur.execute(
            "SELECT (SELECT position FROM lr.log_commits WHERE tx = %s::xid8), entry_id, message FROM ("
            " SELECT e.entry_id, e.message,"
            "  sum(octet_length(e.message)) OVER (ORDER BY e.entry_id) - octet_length(e.message) AS before"
            " FROM lr.log_entries e"
            " WHERE e.tx = %s::xid8 AND e.stream = %s AND e.entry_id > %s"
            f" AND e.client_id = {CLIENT_ID_OF} ORDER BY e.entry_id LIMIT %s) chunk "
            "WHERE before < %s ORDER BY entry_id",
            (tx, tx, STREAM_SNAP_SYNC, after_entry, request.client_name, limit, max_bytes),
        )
        rows = [LogRecord(p, e, bytes(m)) for p, e, m in cur.fetchall()]
    conn.commit()
    return rows


def expired(conn: psycopg2.extensions.connection, request: FullSyncRequest) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.now() > %s", (request.data_deadline,))
        late = cur.fetchone()[0]
    conn.commit()
    return late


FLUSH_ROWS = 1000  # a provider's messages are written every this many...
FLUSH_BYTES = 4 << 20  # ...or this many bytes, whichever comes first


class FullSyncContext:
    """What a provider gets: ``transmit(payload)`` per message, inside the supplying transaction.
    ``conn`` is that transaction (REPEATABLE READ): read the application's data through it."""

    def __init__(self, client: LogWriter, request: FullSyncRequest, base: int, split: BaseSplit) -> None:
        self.client = client
        self.conn = client.conn
        self.request = request
        self.destination = request.sink_site_id
        self.reason = request.reason
        self.base = base
        self.split = split
        self.count = 0
        self._rows: list = []
        self.tracker = progress.track(
            f"full sync {request.request_id[:8]} {SessionKey(client.source_site_id, request.sink_site_id, request.client_name)}: "
            "supply",
            unit="messages",
        )
        self._bytes = 0  # of the messages in ``_rows``

    def _add(
        self, payload: bytes, kind: lr_pb2.ReplicationType, base_snapshot_xids: str = "", base_snapshot_upto: int = 0
    ) -> None:
        row = self.client._row(
            STREAM_SNAP_SYNC,
            payload,
            [self.destination],
            kind,
            snapshot_request_id=self.request.request_id,
            base_snapshot=self.base,
            base_snapshot_xids=base_snapshot_xids,
            base_snapshot_upto=base_snapshot_upto,
        )
        self._rows.append(row)
        self._bytes += len(row[2])
        if len(self._rows) >= FLUSH_ROWS or self._bytes >= FLUSH_BYTES:  # bounded by bytes too
            self.flush()

    def transmit(self, payload: bytes) -> None:
        """One full-sync message for this request's destination."""
        self._add(payload, lr_pb2.SNAPSHOT_SYNC)
        self.count += 1
        if self.count % FLUSH_ROWS == 0:  # progress as often as the rows are written
            self.tracker.update(self.count)

    def flush(self) -> None:
        if self._rows:
            self.client._insert(self._rows)
            self._rows, self._bytes = [], 0


Provider = Callable[[FullSyncContext], None]


def load_provider(target: str) -> Provider:
    """A client's full-sync provider, named ``package.module:function``."""
    return load_function(target, "full-sync provider")


def serve_full_sync_requests(
    client: LogWriter, provider: Provider, max_requests: int | None = None, sink: str | None = None
) -> list[str]:
    """Supply every pending request of the client's sessions (one transaction each), or only those of
    ``sink`` (a replicator's cycle supplies its own session's request, never one that another
    session, still streaming past its base, would apply later); returns the request ids supplied.
    The connection must be open and not inside a transaction; one in autocommit mode is taken out of
    it meanwhile (each statement was its own transaction: the request named another than its data's,
    no sink found that, each supply failed again)."""
    conn = client.conn
    if conn.closed or conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
        state = "closed" if conn.closed else "inside a transaction (commit or roll back first)"
        raise FullSyncError(f"serve_full_sync_requests needs an open connection outside any transaction: it is {state}")
    with whole_transactions(conn):
        return _serve(client, provider, max_requests, sink)


def _serve(client: LogWriter, provider: Provider, max_requests: int | None, sink: str | None) -> list[str]:
    conn = client.conn
    served: list[str] = []
    while max_requests is None or len(served) < max_requests:
        base, blocked = commit_barrier(conn)
        if base is None:
            break  # a commit in flight outlasted the barrier: try again on the next call
        try:
            with conn.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                # fixes the transaction's snapshot, and what was drawn by then
                cur.execute(f"SELECT pg_catalog.pg_current_snapshot()::pg_catalog.text, ({LAST_DRAWN_POSITION_SQL})")
                snapshot, upto = cur.fetchone()
                cur.execute(
                    f"SELECT {_COLUMNS} FROM lr.full_sync_requests WHERE client_name OPERATOR(pg_catalog.=) %s "
                    f"AND status OPERATOR(pg_catalog.=) '{RequestStatus.PENDING}' AND (%s::pg_catalog.text IS NULL "
                    "OR sink_site_id OPERATOR(pg_catalog.=) %s) ORDER BY requested_at LIMIT 1 FOR UPDATE SKIP LOCKED",
                    (client.client_name, sink, sink),
                )
                row = cur.fetchone()
                if row is None:
                    conn.rollback()
                    break
                request = _request(row)
                ctx = FullSyncContext(client, request, base, BaseSplit(snapshot, upto))
                ctx._add(b"", lr_pb2.SNAPSHOT_SYNC_START, base_snapshot_xids=snapshot, base_snapshot_upto=upto)
                try:
                    with conninfo.site_path(conn):
                        provider(ctx)
                except Exception as exc:
                    raise FullSyncError(
                        f"full-sync provider for client {client.client_name!r} failed on request "
                        f"{request.request_id} (sink {request.sink_site_id}): {one_line(exc)}"
                    ) from exc
                ctx._add(b"", lr_pb2.LAST_FULL_SYNC_ENTRY)
                ctx.flush()
                ctx.tracker.update(ctx.count)
                ctx.tracker.finish()
                fault_point("during_supply")
                cur.execute(
                    f"UPDATE lr.full_sync_requests SET status = '{RequestStatus.SUPPLIED}', supplied_at = pg_catalog.now(), "
                    "supplied_tx = pg_catalog.pg_current_xact_id(), base_position = %s, base_snapshot = %s, base_upto = %s, "
                    "entries = %s WHERE request_id OPERATOR(pg_catalog.=) %s",
                    (base, snapshot, upto, ctx.count, request.request_id),
                )
            conn.commit()
            served.append(request.request_id)
        except psycopg2.errors.SerializationFailure:
            conn.rollback()  # the request changed (cancelled) after our snapshot: look again
        except BaseException as exc:
            if not conn.closed:  # lost (cut by its deadline): its own error says why, not a rollback's
                conn.rollback()
                if isinstance(exc, FullSyncError):
                    _note(conn, request.request_id, one_line(exc))
            raise
    return served


def _note(conn: psycopg2.extensions.connection, request_id: str, note: str) -> None:
    with conn.cursor() as cur:
        sql = "UPDATE lr.full_sync_requests SET note = %s WHERE request_id OPERATOR(pg_catalog.=) %s"
        cur.execute(sql, (encoding.storable(conn, note[:NOTE_CHARS]), request_id))
    conn.commit()
