"""A forced full sync meets a federated table closed while its sink lagged.

``lr tables close`` keeps the changes committed before the close in the log (they are delivered,
in order), and the table, closed, takes no snapshot any more. A full sync's base passes every
entry up to it, so a sink that had not received those changes when a full sync was forced lost
them for good: its copy stayed older than the table at the close, while its peers had it whole.
A forced full sync (``lr full-sync``, the lr_full_sync DAG) therefore first lets the sink catch up
to the close: while a replicator holds the session (``lr sync`` streams it) the request waits,
bounded, for the sink to acknowledge them; otherwise, or past the bound, it is refused saying what
to do. The close keeps the ended federation's table id (``lr.registry.closed_table_id``, V0031).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import FullSyncError
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.vocabulary import STREAM_TABLE_CHANGES, SessionKey

CLOSED_TABLE_ID_SCHEMA = 31
CATCH_UP_WAIT = 15.0  # seconds a forced full sync waits for a streamed sink to reach a close


@dataclass(frozen=True)
class PendingClose:
    table: str
    entries: int  # commits after the sink's acknowledged position carrying changes of it
    last: int  # the last such commit position


# Driven by the commits after the sink's acknowledged position (the cost follows its backlog, not
# the size of the log), each looked up for a change of a closed table tagged for the sink.
_PENDING = f"""
SELECT g.stream_name, count(*), max(c.position)
FROM lr.log_commits c
JOIN lr.log_entries e ON e.tx = c.tx
JOIN lr.registry g ON g.closed_table_id = e.table_id
WHERE c.position > %(acked)s AND e.stream = {STREAM_TABLE_CHANGES} AND e.tag_ids @> ARRAY[%(tag)s]::integer[]
  AND g.kind = 'table' AND g.table_id IS NULL AND g.client_name = %(client)s
GROUP BY g.stream_name ORDER BY g.stream_name
"""


# The closed tables of a client, and of them those with a change tagged for the sink in a range.
_CLOSED = (
    "SELECT stream_name, closed_table_id FROM lr.registry WHERE kind = 'table' AND table_id IS NULL "
    "AND closed_table_id IS NOT NULL AND client_name = %(client)s"
)
_PASSED = f"""
SELECT DISTINCT g.stream_name
FROM lr.log_commits c
JOIN lr.log_entries e ON e.tx = c.tx
JOIN lr.registry g ON g.closed_table_id = e.table_id
WHERE c.position > %(after)s AND c.position <= %(base)s AND e.stream = {STREAM_TABLE_CHANGES}
  AND e.tag_ids @> ARRAY[%(tag)s]::integer[]
  AND g.kind = 'table' AND g.table_id IS NULL AND g.client_name = %(client)s
"""


def whole_copies(conn: psycopg2.extensions.connection, sink: str, client: str, after: int, base: int) -> dict[str, int]:
    """table -> the table id its close ended, for each closed table of ``client`` whose copy at
    ``sink`` (which processed the log up to ``after``) a full sync based at ``base`` leaves whole:
    none of its changes tagged for the sink lies in the range the full sync passes. The sink keeps
    its record of such a copy (``lr status``: synced, closed at the source); before, every full
    sync dropped it, and a copy a forced full sync had waited for was said to lack changes. A
    trimmed range cannot be read: then no copy counts as whole. Ends its transaction."""
    if not schema.at_least(conn, CLOSED_TABLE_ID_SCHEMA):
        return {}
    try:
        with conn.cursor() as cur:
            cur.execute(_CLOSED, {"client": client})
            closed = dict(cur.fetchall())
            tag = source_sessions.sink_tags(cur, client).get(sink)
            cur.execute("SELECT trim_mark FROM lr.log_trim")
            (trimmed,) = cur.fetchone()
            if not closed or tag is None or after < 0 or trimmed > after:
                return {}
            cur.execute(_PASSED, {"after": after, "base": base, "tag": tag, "client": client})
            for (name,) in cur.fetchall():
                closed.pop(name, None)
            return closed
    finally:
        conn.rollback()


def pending(conn: psycopg2.extensions.connection, sink: str, client: str) -> tuple[list[PendingClose], str | None]:
    """(the closed tables of ``client`` with changes made before their close that ``sink`` has not
    acknowledged, the replicator holding the session or None). Ends its transaction."""
    if not schema.at_least(conn, CLOSED_TABLE_ID_SCHEMA):
        return [], None
    try:
        with conn.cursor() as cur:
            acked = source_sessions.acked_position(cur, sink, client)
            tag = source_sessions.sink_tags(cur, client).get(sink)
            _, holder = source_sessions.current_holder(cur, sink, client)
            if acked < 0 or tag is None:  # never synced: no copy to miss anything
                return [], holder
            cur.execute(_PENDING, {"acked": acked, "tag": tag, "client": client})
            return [PendingClose(*row) for row in cur.fetchall()], holder
    finally:
        conn.rollback()


def wait_for_closes(
    conn: psycopg2.extensions.connection, sink: str, client: str, timeout: float = CATCH_UP_WAIT
) -> None:
    """Return once ``sink`` acknowledged every change of ``client``'s closed tables made before
    their close: at once when it did; while a replicator holds the session, within ``timeout``
    seconds (a streamed sink acknowledges within a second); else raise ``FullSyncError`` naming the
    tables and what to do."""
    deadline = time.monotonic() + timeout
    found, holder = pending(conn, sink, client)
    while found and holder is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        found, holder = pending(conn, sink, client)
    if not found:
        return
    key = SessionKey(schema.site_identity(conn)[0], sink, client)
    tables = ", ".join(f"{p.table} ({p.entries} commit(s), the last at position {p.last})" for p in found)
    waited = (
        f"its replicator {holder} did not deliver them within {timeout:g}s"
        if holder is not None
        else "no replicator holds the session: run `lr sync` (or unpause lr_streaming)"
    )
    raise FullSyncError(
        f"no full sync requested for {key}: its sink has not received the changes of {tables} made before "
        f"the table was closed here, and a full sync would pass them (a closed table takes no snapshot), "
        f"leaving its copy without them for good; {waited}. Ask again once it has them (lr status: its "
        "acknowledged position past the last), or open the table again (lr tables open ... --client "
        f"{client}): the full sync then takes a new snapshot of it"
    )
