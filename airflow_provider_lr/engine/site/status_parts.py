"""Each part of a site's status read on its own (and the reads of those parts), so one lr table another session
(VACUUM FULL, an admin's ``LOCK``, an ALTER) costs only the part that reads it: the part is said
not read and who holds the lock. Before, the first such table waited the whole ``lock_timeout``
(5 s by default) and blanked the site: ``UNREADABLE``, its sessions hidden, health unreachable.

A login without lr's replicator grant (an application's writer) is told apart as a refusal
(``Refused``): the site answered, the role may not read it; it was called unreachable."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from typing import TypeVar

import psycopg2
import psycopg2.extensions
from psycopg2 import errorcodes

from airflow_provider_lr.engine.errors import one_line
from airflow_provider_lr.engine.store import members, sink_sessions, source_sessions
from airflow_provider_lr.engine.vocabulary import OPEN_STATUSES_SQL

T = TypeVar("T")

# a status read waits this long for a lock (a SELECT waits only for an ACCESS EXCLUSIVE holder);
# once one part found its table locked, the next parts wait only ``LOCKED_WAIT`` (a site with a few
# tables locked is said in about a second, not a second per part)
STATUS_LOCK_WAIT, LOCKED_WAIT = "1s", "100ms"

# the parts whose figures ``lr metrics`` leaves out when not read (a made-up 0 would say "none")
TOPOLOGY, SESSIONS, MEMBERS = "topology", "sessions", "members"
HELD_BACK, DIVERGED = "what holds the log back", "diverged tables"
NOT_READ = " not read: "  # a line of ``unread``: the part, this, why


def was_read(unread: list[str], what: str) -> bool:
    """Whether the part ``what`` was read (``read_part`` said none of ``unread`` of it)."""
    return not any(line.startswith(what + NOT_READ) for line in unread)


# lr's tables (and their indexes' tables) held in a mode a SELECT waits for, by another backend
_LOCKED_LR_TABLES = (
    "SELECT DISTINCT n.nspname OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) c.relname, l.pid, l.mode "
    "FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) l.relation "
    "JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace "
    "WHERE l.granted AND l.mode OPERATOR(pg_catalog.=) 'AccessExclusiveLock' AND n.nspname OPERATOR(pg_catalog.=) 'lr' "
    "AND c.relkind IN ('r', 'p', 'v', 'm') AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid() ORDER BY 1, 2"
)


class Refused(str):
    """A site's status its login may not read (a privilege), as ``lr status`` says it."""


def refused(conn_id: str, exc: psycopg2.Error, user: str | None) -> Refused:
    """Why ``user`` could not read a site's lr tables, and the grant that lets it."""
    who = f"role {user!r}" if user else "this connection's role"
    denied = getattr(getattr(exc, "diag", None), "message_primary", None) or str(exc)
    return Refused(
        f"REFUSED ({who} lacks the replicator grant here ({one_line(denied)}): run it as a replicator or the "
        f"owner of the lr schema, or grant it: lr roles grant replicator --role {user or 'ROLE'} --site {conn_id}; "
        "docs/security.md)"
    )


@contextmanager
def short_lock_waits(conn: psycopg2.extensions.connection) -> Iterator[None]:
    """Within the block, ``conn`` waits ``STATUS_LOCK_WAIT`` for a lock (``read_part`` shortens it
    once a lock was met); its own setting after it."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.current_setting('lock_timeout')")
        before = cur.fetchone()[0]
        cur.execute("SELECT pg_catalog.set_config('lock_timeout', %s, false)", (STATUS_LOCK_WAIT,))
    conn.commit()

    def restore() -> None:
        conn.rollback()
        with conn.cursor() as cur:
            cur.execute("SELECT pg_catalog.set_config('lock_timeout', %s, false)", (before,))
        conn.commit()

    try:
        yield
    except BaseException:
        if not conn.closed:
            with suppress(psycopg2.Error):  # a connection lost or cut: the read's own error is what is said
                restore()
        raise
    restore()


def locked_by(conn: psycopg2.extensions.connection) -> str:
    """Which of lr's tables another backend holds locked, and by which pid."""
    with conn.cursor() as cur:
        cur.execute(_LOCKED_LR_TABLES)
        held = cur.fetchall()
    conn.commit()
    if not held:
        return "a lock it needs was held by another transaction (lock_timeout), released since"
    return "; ".join(
        f"{table} is locked by {f'pid {pid}' if pid is not None else 'a prepared transaction'} ({mode})"
        for table, pid, mode in held
    )


def read_part(conn: psycopg2.extensions.connection, unread: list[str], what: str, read: Callable[[], T]) -> T | None:
    """``read()``, or None when a lock another session holds kept it from its table (``unread``
    gets the line that says so); any other error is the site's."""
    try:
        return read()
    except psycopg2.Error as exc:
        if exc.pgcode != errorcodes.LOCK_NOT_AVAILABLE:
            raise
        conn.rollback()
        unread.append(f"{what}{NOT_READ}{locked_by(conn)}")
        with conn.cursor() as cur:
            cur.execute("SELECT pg_catalog.set_config('lock_timeout', %s, false)", (LOCKED_WAIT,))
        conn.commit()
        return None


def read_alone(conn: psycopg2.extensions.connection, what: str, read: Callable[[], T]) -> tuple[T | None, list[str]]:
    """One part read as ``lr status`` reads each of its parts (``short_lock_waits``, ``read_part``),
    for a caller that reads only it: (what ``read()`` returned, or None; the line that says it was
    not read and who holds the lock, if so)."""
    unread: list[str] = []
    with short_lock_waits(conn):
        return read_part(conn, unread, what, read), unread


def trim_mark(cur: psycopg2.extensions.cursor) -> int:
    """The site's trim mark: log entries up to it are gone."""
    cur.execute("SELECT trim_mark FROM lr.log_trim")
    return int(cur.fetchone()[0])


def open_requests(cur: psycopg2.extensions.cursor) -> list[dict]:
    """Open full-sync requests, this site as their source."""
    cur.execute(
        "SELECT request_id::text, sink_site_id, client_name, status, forced, reason, "
        "round(extract(epoch FROM greatest(now(), requested_at) - requested_at)::numeric, 1)::float8, "
        "round(extract(epoch FROM data_deadline - now())::numeric, 1)::float8, note, entries, "
        f"{_SUPPLYING} FROM lr.full_sync_requests r WHERE status IN {OPEN_STATUSES_SQL} ORDER BY requested_at"
    )
    keys = (
        *("request_id", "sink", "client", "status", "forced", "reason", "age_s", "data_deadline_in_s", "note"),
        *("entries", "supplying"),
    )
    return [dict(zip(keys, r)) for r in cur.fetchall()]


def members_of(cur: psycopg2.extensions.cursor) -> tuple[list[dict], dict]:
    """The live replicator members (V0020), and every registered one (owner → alive)."""
    return [asdict(m) for m in members.live(cur)], members.registered(cur)


# A provider supplying a request holds its row locked (``full_sync.serve_full_sync_requests``) while it
# runs: the row's xmax is a transaction holding the lock on its own id (``pg_locks``, readable by every
# role). Seen with SELECT alone (lr status's privileges), waiting for nothing: no lock is taken.
_SUPPLYING = (
    "(r.xmax OPERATOR(pg_catalog.<>) '0'::pg_catalog.xid AND EXISTS (SELECT FROM pg_catalog.pg_locks l "
    "WHERE l.locktype OPERATOR(pg_catalog.=) 'transactionid' AND l.transactionid OPERATOR(pg_catalog.=) r.xmax "
    "AND l.mode OPERATOR(pg_catalog.=) 'ExclusiveLock' AND l.granted))"
)


_COLUMNS = (
    "role",
    "source_site_id",
    "sink_site_id",
    "client_name",
    "sync_type",
    "status",
    "base_snapshot",
    "last_applied_position",
    "remaining_entries_to_send",
    "data_consistent",
    "state",
    "last_error",
)


def sessions_of(cur: psycopg2.extensions.cursor, version: int) -> tuple[list[dict], dict]:
    """The site's sessions (``lr.replication_status``), each source session's lease holder; and the
    age of each source session's last success."""
    cur.execute(f"SELECT {', '.join(_COLUMNS)} FROM lr.replication_status ORDER BY 1, 2, 3, 4")
    sessions = [dict(zip(_COLUMNS, r)) for r in cur.fetchall()]
    last_ok = source_sessions.last_success_ages(cur) if version >= 7 else {}
    if version >= 10:  # a sink's session from a source its clients failed over from: closed for good
        failed_over = sink_sessions.failed_over(cur)
        for s in sessions:
            found = failed_over.get((s["source_site_id"], s["client_name"])) if s["role"] == "sink" else None
            if found:
                s["failed_over_to"], s["failover_note"] = found
    holders = lease_holders(cur, version)
    for s in sessions:
        if s["role"] == "source":
            s.update(holders.get((s["sink_site_id"], s["client_name"]), NO_HOLDER))
            s["lag_seconds"] = None  # until the backlog is read
    return sessions, last_ok


NO_HOLDER = {"lease_owner": None, "lease_acquired_at": None, "lease_held_s": None, "lease_expires_in_s": None}


def lease_holders(cur: psycopg2.extensions.cursor, version: int) -> dict[tuple[str, str], dict]:
    """Who holds each source session's lease now (an unexpired one), since when (schema v14 on)
    and for how much longer: (sink, client) → the ``NO_HOLDER`` keys, for sessions held only."""
    return {
        (sink, client): {
            "lease_owner": owner,
            "lease_acquired_at": since,
            "lease_held_s": held,
            "lease_expires_in_s": left,
        }
        for sink, client, owner, since, held, left in source_sessions.held_leases(cur, since_known=version >= 16)
    }


def refuses_writes(cur: psycopg2.extensions.cursor) -> str | None:
    """Why the site refuses every write lr makes there (its leases, fences, acks, errors), or None:
    a standby, or ``default_transaction_read_only`` set for the server or the database (a role's own,
    as a read-only monitoring login's, is that login's alone: not said; so is one set for the role in
    this database, ``ALTER ROLE ... IN DATABASE ... SET``, source ``database user``, which was said).
    Every session that writes there fails, and where it would record why is that site: its
    ``last_error`` stays unwritten."""
    cur.execute(
        "SELECT pg_catalog.pg_is_in_recovery(), s.setting = 'on' "
        "AND s.source NOT IN ('user', 'database user', 'session', 'client') "
        "FROM pg_catalog.pg_settings s WHERE s.name = 'default_transaction_read_only'"
    )
    standby, read_only = cur.fetchone()
    if standby:
        return "refuses writes: a standby (in recovery): lr cannot lease, fence or acknowledge here; promote it or give lr the primary"
    if read_only:
        return (
            "refuses writes: default_transaction_read_only is on for the server or this database: lr cannot "
            "lease, fence or acknowledge here, so its sessions fail and their errors go unrecorded; turn it off"
        )
    return None
