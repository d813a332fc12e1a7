"""The commit barrier: which commit positions are final, and what holds the log back.

A writer draws its commit position at commit time under a shared advisory lock (see
``V0002__shared_log.sql``), so a position can be drawn by a commit still in flight. The barrier:

1. note ``N``, the commit-position sequence's last value;
2. wait until every transaction that held the commit lock at that moment has ended — any
   transaction with a position <= N drew it while holding the lock, so after this all of them are
   final (committed or rolled back) and visible to a new snapshot;
3. the log is then complete up to ``N``: a reader may read positions in ``(after, N]``.

The barrier never blocks writers (it polls ``pg_locks`` instead of queueing for the lock), and an
open transaction elsewhere in the database does not hold the reader back: only commits already in
flight do, and a prepared transaction holding its position until COMMIT PREPARED. ``holdback``
names those, and the open transactions whose entries are still to come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.vocabulary import COMMIT_LOCK_KEY

# The last commit position drawn (by a commit that may still be in flight), 0 before the first.
LAST_DRAWN_POSITION_SQL = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM lr.commit_position_seq"

# Runs on a writer's connection too (a client's full-sync supply), under its search_path: qualified,
# so a table of the writer's named pg_locks cannot hide the commits in flight from the barrier.
_HOLDERS_SQL = """
SELECT l.virtualtransaction, l.pid
FROM pg_catalog.pg_locks l
WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
  AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                         WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
  AND l.classid OPERATOR(pg_catalog.=) 0::pg_catalog.oid AND l.objid OPERATOR(pg_catalog.=) %s::pg_catalog.oid
  AND l.objsubid OPERATOR(pg_catalog.=) 1::pg_catalog.int2
"""


@dataclass(frozen=True)
class HoldBack:
    """Something that keeps entries from being delivered yet."""

    kind: str  # "in_flight_commit" | "prepared_transaction" | "open_transaction"
    pid: int | None
    age_seconds: float
    xact_start: str | None = None
    query_start: str | None = None
    state: str | None = None
    query: str | None = None
    gid: str | None = None

    def describe(self) -> str:
        who = f"prepared transaction {self.gid!r}" if self.gid else f"pid {self.pid}"
        what = {
            "in_flight_commit": "is committing and blocks the read barrier",
            "prepared_transaction": "holds its commit position until COMMIT/ROLLBACK PREPARED",
            "open_transaction": "has transmitted entries that are not committed yet",
        }[self.kind]
        # never the query text: it can carry application data (payload bytes in hex)
        return f"{who} {what} (for {self.age_seconds:.1f}s{', ' + self.state if self.state else ''})"


def commit_barrier(conn: psycopg2.extensions.connection, timeout: float = 5.0) -> tuple[int | None, list[HoldBack]]:
    """Note the commit sequence, then wait for the commits in flight at that moment to end.

    Returns ``(N, [])``, or ``(None, holders)`` when some outlast ``timeout`` (a prepared
    transaction, a stuck commit): their positions are drawn but invisible, so no position above
    what the caller already read is known to be final.
    """
    try:
        with conn.cursor() as cur:
            cur.execute(LAST_DRAWN_POSITION_SQL)
            noted = cur.fetchone()[0]
            cur.execute(_HOLDERS_SQL, (COMMIT_LOCK_KEY,))
            waiting = {vxid for vxid, _ in cur.fetchall()}
            conn.rollback()
            deadline = time.monotonic() + timeout
            pause = 0.0005
            while waiting:
                if time.monotonic() > deadline:
                    return None, in_flight_commits(conn, waiting)
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
                cur.execute(_HOLDERS_SQL, (COMMIT_LOCK_KEY,))
                waiting &= {vxid for vxid, _ in cur.fetchall()}
                conn.rollback()
        return noted, []
    except BaseException:
        conn.rollback()
        raise


def in_flight_commits(conn: psycopg2.extensions.connection, vxids: set[str] | None = None) -> list[HoldBack]:
    """Transactions holding the commit-position lock (committing now, or prepared)."""
    with conn.cursor() as cur:
        cur.execute(
            """
            SELECT l.virtualtransaction, l.pid, a.xact_start::pg_catalog.text, a.query_start::pg_catalog.text,
                   a.state, a.query, extract(epoch FROM pg_catalog.now() OPERATOR(pg_catalog.-)
                                 coalesce(a.xact_start, p.prepared, pg_catalog.now()))::pg_catalog.float8, p.gid
            FROM pg_catalog.pg_locks l
            LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid
            LEFT JOIN pg_catalog.pg_locks x ON l.pid IS NULL AND x.locktype OPERATOR(pg_catalog.=) 'transactionid'
                 AND x.virtualtransaction OPERATOR(pg_catalog.=) l.virtualtransaction
            LEFT JOIN pg_catalog.pg_prepared_xacts p ON p.transaction OPERATOR(pg_catalog.=) x.transactionid
            WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
              AND l.classid OPERATOR(pg_catalog.=) 0::pg_catalog.oid AND l.objid OPERATOR(pg_catalog.=) %s::pg_catalog.oid
              AND l.objsubid OPERATOR(pg_catalog.=) 1::pg_catalog.int2
              AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                                     WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
            """,
            (COMMIT_LOCK_KEY,),
        )
        rows = cur.fetchall()
    conn.rollback()
    found = []
    for vxid, pid, xact_start, query_start, state, query, age, gid in rows:
        if vxids is not None and vxid not in vxids:
            continue
        kind = "prepared_transaction" if gid or not pid else "in_flight_commit"
        found.append(HoldBack(kind, pid or None, age or 0.0, xact_start, query_start, state, query, gid))
    return found


def holdback(conn: psycopg2.extensions.connection) -> list[HoldBack]:
    """Everything that keeps entries from being read now, oldest first: in-flight commits and
    prepared transactions holding the barrier, and open transactions with uncommitted entries."""
    found = in_flight_commits(conn)
    with conn.cursor() as cur:
        cur.execute(
            """
            SELECT DISTINCT a.pid, a.xact_start::text, a.query_start::text, a.state, a.query,
                   extract(epoch FROM now() - a.xact_start)::float8
            FROM pg_locks l
            JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'relation' AND l.relation = 'lr.log_entries'::regclass
              AND l.mode = 'RowExclusiveLock' AND l.granted AND a.pid <> pg_backend_pid()
              AND a.backend_xid IS NOT NULL
            """
        )
        in_flight = {h.pid for h in found}
        for pid, xact_start, query_start, state, query, age in cur.fetchall():
            if pid not in in_flight:
                found.append(HoldBack("open_transaction", pid, age or 0.0, xact_start, query_start, state, query))
    conn.rollback()
    return sorted(found, key=lambda h: -h.age_seconds)
