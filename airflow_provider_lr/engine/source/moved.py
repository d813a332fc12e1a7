"""Clients a site no longer sources: their writers refused, their unreplicated entries remembered.

After a failover or a planned switchover the old source is a sink of the clients it gave away, but
an application's client object made there before the switch keeps its routes in memory, and would
go on committing entries no session reads (and a federated table's captured changes with them).
After each topology apply on a site (once it committed), one guard on ``lr.log_entries`` is set for
the clients the site registered (it sourced them once) and does not source in the topology it
runs: a BEFORE INSERT row trigger that fires only for those clients (``WHEN``) and raises, naming
where the client is replicated from now (V0028). A site that never lost a client has no such
trigger, so transmit pays nothing for it; the trigger is rewritten only when that set changes and
dropped when the site sources them all again (a fail-back).

Its DDL locks the log against writers, so it runs in a transaction of its own, holding no other
lock, and waits for the log's lock only briefly (``lock_timeout``) and again: in the apply's
transaction, which also locks the clients' federated tables (their guards), it would deadlock with
a writer that locks them in the other order, and the deadlock could abort a failover.

The entries an old source committed after a failover's cut and before it rejoined reached nobody;
their positions are recorded (``lr.unreplicated_ranges``) so that a wait on one of their tickets
says so instead of counting on a later session's positions (after a fail-back those are past them).
"""

from __future__ import annotations

import time

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.errors import LRError, one_line
from airflow_provider_lr.engine.store.topology import applied_document

GUARD = "log_entries_moved_clients"


def refuse_moved_writers(conn: psycopg2.extensions.connection, attempts: int = 40) -> None:
    """Set this site's guard against the writers of the clients it registered and does not source
    in the topology applied to it, in a transaction of its own (commits; call it with none open).
    Its wait for the log's lock is cut short (a deadlock too) and tried again up to ``attempts``
    times; then ``LRError``: applying the topology again sets it. Nothing is done on a site
    without a topology or whose schema predates the guard (V0028)."""
    for attempt in range(attempts):
        try:
            with conn.cursor() as cur:
                cur.execute("SET LOCAL lock_timeout = '500ms'")
                _set_guard(cur)
            conn.commit()
            return
        except (psycopg2.errors.LockNotAvailable, psycopg2.errors.DeadlockDetected) as exc:
            conn.rollback()
            if attempt + 1 == attempts:
                raise LRError(
                    f"the guard against writers of clients this site no longer sources was not set: writers held "
                    f"lr.log_entries throughout ({one_line(exc)}); apply the topology again"
                ) from exc
            time.sleep(0.05 * (attempt % 5))
        except BaseException:
            conn.rollback()
            raise


def _set_guard(cur: psycopg2.extensions.cursor) -> None:
    cur.execute("SELECT pg_catalog.to_regprocedure('lr.refuse_moved_transmit()') IS NOT NULL")
    if not cur.fetchone()[0]:
        return
    document = applied_document(cur)
    if document is None:
        return
    site_id, sources = _sources(cur, document)
    cur.execute("SELECT client_id, client_name FROM lr.clients ORDER BY client_id")
    args: list[str] = []
    for client_id, client in cur.fetchall():
        where = _elsewhere(site_id, sources.get(client, set()))
        if where is not None:
            args += [str(client_id), client, where]
    cur.execute(
        "SELECT t.tgargs FROM pg_catalog.pg_trigger t WHERE t.tgrelid = 'lr.log_entries'::pg_catalog.regclass "
        "AND t.tgname = %s",
        (GUARD,),
    )
    row = cur.fetchone()
    have = None if row is None else [a.decode() for a in bytes(row[0]).split(b"\x00")[:-1]]
    if have == (args or None):
        return
    if row is not None:
        cur.execute(sql.SQL("DROP TRIGGER {} ON lr.log_entries").format(sql.Identifier(GUARD)))
    if args:
        ids = sql.SQL(", ").join(sql.Literal(int(a)) for a in args[0::3])
        cur.execute(
            sql.SQL(
                "CREATE TRIGGER {} BEFORE INSERT ON lr.log_entries FOR EACH ROW WHEN (NEW.client_id IN ({})) "
                "EXECUTE FUNCTION lr.refuse_moved_transmit({})"
            ).format(sql.Identifier(GUARD), ids, sql.SQL(", ").join(sql.Literal(a) for a in args))
        )  # a writer in session_replication_role = replica is refused too (V0044)
        cur.execute(sql.SQL("ALTER TABLE lr.log_entries ENABLE ALWAYS TRIGGER {}").format(sql.Identifier(GUARD)))


def _sources(cur: psycopg2.extensions.cursor, document: dict) -> tuple[str, dict[str, set[str]]]:
    """This site's id, and each client's sources in the applied topology ``document``."""
    cur.execute("SELECT site_id FROM lr.site_info")
    site_id = cur.fetchone()[0]
    sources: dict[str, set[str]] = {}
    for replication in document.get("replication") or []:
        for client in replication.get("clients") or []:
            sources.setdefault(client, set()).add(replication.get("source"))
    return site_id, sources


def _elsewhere(site_id: str, sources: set[str]) -> str | None:
    """Where a client with ``sources`` is replicated from, when not (also) from ``site_id``."""
    if site_id in sources:
        return None
    if sources:
        return f"it is replicated from site {' and site '.join(sorted(sources))} now: transmit there"
    return "the topology applied here has no source of it"


def sourced_elsewhere(cur: psycopg2.extensions.cursor, client: str) -> list[str] | None:
    """The sources of ``client`` in the topology applied here when this site is not one of them
    (a failover's old source); None when it is, or no topology is applied."""
    document = applied_document(cur)
    if document is None:
        return None
    site_id, sources = _sources(cur, document)
    found = sources.get(client, set())
    return None if site_id in found else sorted(found)


def not_sourced_here(cur: psycopg2.extensions.cursor, client: str) -> str | None:
    """Why this site does not source ``client`` in the topology applied to it (None: it does, or no
    topology is applied): what opening a table of the client here is refused with."""
    document = applied_document(cur)
    if document is None:
        return None
    site_id, sources = _sources(cur, document)
    return _elsewhere(site_id, sources.get(client, set()))


def record_unreplicated(cur: psycopg2.extensions.cursor, client: str, after: int, note: str) -> None:
    """Remember that this site's entries of ``client`` after position ``after``, up to the last
    drawn now, reached nobody (``note`` says why); a wait on one of their tickets is refused."""
    cur.execute("SELECT pg_catalog.to_regclass('lr.unreplicated_ranges') IS NOT NULL")
    if not cur.fetchone()[0]:
        return
    cur.execute(
        "INSERT INTO lr.unreplicated_ranges (client_name, after_position, upto_position, note) "
        "SELECT %s, %s, CASE WHEN s.is_called THEN s.last_value ELSE 0 END, %s FROM lr.commit_position_seq s "
        "ON CONFLICT (client_name, after_position) DO UPDATE SET upto_position = EXCLUDED.upto_position, "
        "note = EXCLUDED.note",
        (client, after, note),
    )


def unreplicated(conn: psycopg2.extensions.connection, client: str, position: int) -> str | None:
    """Why ``client``'s entry at ``position`` reached nobody, or None (also on a site without V0028)."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.to_regprocedure('lr.unreplicated_note(text, bigint)') IS NOT NULL")
        note = None
        if cur.fetchone()[0]:
            cur.execute("SELECT lr.unreplicated_note(%s, %s)", (client, position))
            note = cur.fetchone()[0]
    conn.commit()
    return note
