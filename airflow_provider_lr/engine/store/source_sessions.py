"""The one owner of ``lr.source_sessions``: a source's row per (sink, client) session, with its
lease (owner, epoch, expiry), state, positions and last outcome.

Every statement naming the table is here, as a function of a cursor (the caller's transaction:
none of these commits) and plain values. What the values mean — when a lease may be taken, what
a backlog is for — is the callers' (``session/lease.py``, ``source/backlog.py``, ...).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db.durable_commits import THIS_TRANSACTION
from airflow_provider_lr.engine.db.encoding import storable
from airflow_provider_lr.engine.errors import FencedError
from airflow_provider_lr.engine.store import members
from airflow_provider_lr.engine.store.topology import config_id
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES, RequestStatus


class Holding(Protocol):
    """Who holds a session's lease, as far as fencing a write needs (``session/lease.Lease`` is one)."""

    @property
    def owner(self) -> str: ...

    @property
    def epoch(self) -> int: ...


# --- the lease ------------------------------------------------------------------------------------
def take_lease(cur: psycopg2.extensions.cursor, sink: str, client: str, owner: str, seconds: float) -> int | None:
    """Take or renew the session's lease for ``seconds``; its epoch, bumped unless ``owner`` held it
    unexpired. None when another owner holds an unexpired one (or there is no such session), unless
    that owner is a replicator member found dead (``members.dead_member``): taken at once. A bumped
    epoch commits durably (``_durable_epoch``); a renewal, the repeated case, as the server does."""
    cur.execute(
        f"""
        UPDATE lr.source_sessions
        SET lease_epoch = CASE WHEN lease_owner = %(owner)s AND lease_expires_at > now()
                               THEN lease_epoch ELSE lease_epoch + 1 END,
            lease_acquired_at = CASE WHEN lease_owner = %(owner)s AND lease_expires_at > now()
                                     THEN lease_acquired_at ELSE now() END,  -- V0016: since when
            lease_owner = %(owner)s,
            lease_expires_at = now() + make_interval(secs => %(seconds)s)
        WHERE sink_site_id = %(sink)s AND client_name = %(client)s
          AND (lease_owner IS NULL OR lease_owner = %(owner)s OR lease_expires_at <= now()
               OR {members.dead_member("lease_owner")})
        RETURNING lease_epoch, lease_acquired_at = now()
        """,
        {"owner": owner, "seconds": seconds, "sink": sink, "client": client},
    )
    row = cur.fetchone()
    if row is None:
        return None
    epoch, bumped = row  # lease_acquired_at is now() (this transaction's start) only when it was taken anew
    if bumped:
        _durable_epoch(cur)
    return epoch


def _durable_epoch(cur: psycopg2.extensions.cursor) -> None:
    """The transaction that moves a lease's epoch commits durably (``db/durable_commits``). Before, a
    source whose ``synchronous_commit`` is ``off`` and that crashed right after forgot the epoch its
    holder had fenced the sinks with, and gave the next holder the same one: the sinks took both, and
    the one whose lease was lost was not refused there (``test_async_source_writes.py``)."""
    cur.execute(THIS_TRANSACTION)


def current_holder(cur: psycopg2.extensions.cursor, sink: str, client: str) -> tuple[bool, str | None]:
    """(the session exists, the owner of its unexpired lease or None)."""
    cur.execute(
        "SELECT CASE WHEN lease_expires_at > now() THEN lease_owner END FROM lr.source_sessions "
        "WHERE sink_site_id = %s AND client_name = %s",
        (sink, client),
    )
    row = cur.fetchone()
    return (False, None) if row is None else (True, row[0])


def raise_epoch(cur: psycopg2.extensions.cursor, sink: str, client: str, held: Holding, to: int) -> int | None:
    """Set the epoch of a lease ``held`` unexpired to ``to``; the new epoch, None when it is not held so."""
    cur.execute(
        "UPDATE lr.source_sessions SET lease_epoch = %s WHERE sink_site_id = %s AND client_name = %s "
        "AND lease_owner = %s AND lease_epoch = %s AND lease_expires_at > now() RETURNING lease_epoch",
        (to, sink, client, held.owner, held.epoch),
    )
    row = cur.fetchone()
    return row[0] if row else None


def release_lease(cur: psycopg2.extensions.cursor, sink: str, client: str, held: Holding) -> None:
    """Clear the lease's owner and expiry if ``held`` is still the current one (the epoch stays)."""
    cur.execute(
        "UPDATE lr.source_sessions SET lease_owner = NULL, lease_expires_at = NULL "
        "WHERE sink_site_id = %s AND client_name = %s AND lease_owner = %s AND lease_epoch = %s",
        (sink, client, held.owner, held.epoch),
    )


def update_held(
    cur: psycopg2.extensions.cursor, sink: str, client: str, held: Holding, values: Mapping[str, object]
) -> bool:
    """Set ``values`` (column -> value) on the session row while ``held`` is its current lease;
    False when it is not (taken over)."""
    return (sink, client) in update_each_held(cur, [(sink, client, held, values)])


def update_each_held(
    cur: psycopg2.extensions.cursor, updates: Sequence[tuple[str, str, Holding, Mapping[str, object]]]
) -> set[tuple[str, str]]:
    """``update_held`` of several sessions, each with its own values, in ONE statement (a stream
    acknowledges or renews all its sessions in one round trip); the (sink, client) of the rows set,
    the others' leases were taken over."""
    if not updates:
        return set()
    parts, params = [], []
    for n, (sink, client, held, values) in enumerate(updates):
        sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(column)) for column in values)
        parts.append(
            sql.SQL(
                "{} AS (UPDATE lr.source_sessions SET {}, updated_at = now() WHERE sink_site_id = %s "
                "AND client_name = %s AND lease_owner = %s AND lease_epoch = %s RETURNING sink_site_id, client_name)"
            ).format(sql.Identifier(f"u{n}"), sets)
        )
        params += [*values.values(), sink, client, held.owner, held.epoch]
    union = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT * FROM {}").format(sql.Identifier(f"u{n}")) for n in range(len(updates))
    )
    cur.execute(sql.SQL("WITH {} {}").format(sql.SQL(", ").join(parts), union), params)
    return {(sink, client) for sink, client in cur.fetchall()}


def lock_held(cur: psycopg2.extensions.cursor, sink: str, client: str, held: Holding) -> bool:
    """Lock the session row (FOR UPDATE) while ``held`` is its current lease; False when it is not."""
    cur.execute(
        "SELECT 1 FROM lr.source_sessions WHERE sink_site_id = %s AND client_name = %s "
        "AND lease_owner = %s AND lease_epoch = %s FOR UPDATE",
        (sink, client, held.owner, held.epoch),
    )
    return cur.fetchone() is not None


def release_owned(cur: psycopg2.extensions.cursor, owner: str, session: tuple[str, str] | None = None) -> int:
    """Clear every lease ``owner`` still holds here, or only that of ``session`` (sink, client); the
    epochs stay; how many. A lease is only taken over with a new owner, so one still naming
    ``owner`` is its own, whatever its epoch."""
    only = "" if session is None else " AND sink_site_id = %s AND client_name = %s"
    cur.execute(
        "UPDATE lr.source_sessions SET lease_owner = NULL, lease_expires_at = NULL WHERE lease_owner = %s" + only,
        (owner, *(session or ())),
    )
    return cur.rowcount


def release_expired_leases(cur: psycopg2.extensions.cursor) -> list[tuple[str, str, str]]:
    """Clear every expired lease, and every lease of a dead member (epochs stay); (sink, client,
    owner) of each cleared."""
    cur.execute(
        f"""
        WITH stale AS (
            SELECT sink_site_id, client_name, lease_owner FROM lr.source_sessions
            WHERE lease_owner IS NOT NULL AND (lease_expires_at <= now() OR {members.dead_member("lease_owner")})
            FOR UPDATE
        )
        UPDATE lr.source_sessions s SET lease_owner = NULL, lease_expires_at = NULL
        FROM stale WHERE s.sink_site_id = stale.sink_site_id AND s.client_name = stale.client_name
        RETURNING stale.sink_site_id, stale.client_name, stale.lease_owner
        """
    )
    return cur.fetchall()


def held_leases(cur: psycopg2.extensions.cursor, since_known: bool) -> list[tuple]:
    """(sink, client, owner, acquired at, held seconds, seconds left) of each unexpired lease;
    ``since_known``: the schema records when it was taken (v16 on; else those two are NULL)."""
    acquired = "lease_acquired_at" if since_known else "NULL::timestamptz"
    cur.execute(
        f"SELECT sink_site_id, client_name, lease_owner, {acquired}, "
        f"round(extract(epoch FROM greatest(now(), {acquired}) - {acquired})::numeric, 1)::float8, "
        "round(extract(epoch FROM lease_expires_at - now())::numeric, 1)::float8 "
        "FROM lr.source_sessions WHERE lease_owner IS NOT NULL AND lease_expires_at > now()"
    )
    return cur.fetchall()


# --- the sessions a source has ----------------------------------------------------------------
def exists(cur: psycopg2.extensions.cursor, sink: str, client: str) -> bool:
    cur.execute("SELECT 1 FROM lr.source_sessions WHERE sink_site_id = %s AND client_name = %s", (sink, client))
    return cur.fetchone() is not None


def no_session(sink: str, client: str, applied: str | None) -> str:
    """What a source without the session (sink, client) says: the topology ``applied`` here lacks it."""
    return (
        f"this source has no session to {sink!r} for client {client!r} (topology {applied or '(none)'} is applied here)"
    )


def lost(cur: psycopg2.extensions.cursor, sink: str, client: str, held: Holding) -> FencedError:
    """Why ``held`` no longer holds the session's lease, in the caller's transaction: another
    replicator took the session over, or the session left the topology applied here (a
    ``FencedError`` either way: its callers stop writing for it and leave its row, if any, to
    whoever holds it now)."""
    if exists(cur, sink, client):
        return FencedError(
            f"session to {sink!r} for {client!r}: lease epoch {held.epoch} of {held.owner} was taken over; stopping"
        )
    return FencedError(
        f"{no_session(sink, client, config_id(cur))}: the session was removed from the topology "
        f"while lease epoch {held.epoch} of {held.owner} worked on it; stopping"
    )


def recorded(alias: str) -> str:
    """SQL fragment for another owner's statement: the session of row ``alias`` (its sink_site_id
    and client_name) is one this source has (a topology apply removes the others)."""
    return (
        f"EXISTS (SELECT 1 FROM lr.source_sessions s WHERE s.sink_site_id = {alias}.sink_site_id "
        f"AND s.client_name = {alias}.client_name)"
    )


def names(cur: psycopg2.extensions.cursor) -> list[str]:
    """Every session as "sink/client", sorted."""
    cur.execute("SELECT sink_site_id || '/' || client_name FROM lr.source_sessions ORDER BY 1")
    return [r[0] for r in cur.fetchall()]


def sessions_of(cur: psycopg2.extensions.cursor, clients: Collection[str]) -> list[tuple[str, str]]:
    """(sink, client) of each session of ``clients``, sorted."""
    cur.execute(
        "SELECT sink_site_id, client_name FROM lr.source_sessions WHERE client_name = ANY (%s) ORDER BY 1, 2",
        (list(clients),),
    )
    return cur.fetchall()


def clients_with_sessions(cur: psycopg2.extensions.cursor) -> set[str]:
    """The clients this site is the source of at least one session for."""
    cur.execute("SELECT DISTINCT client_name FROM lr.source_sessions")
    return {client for (client,) in cur.fetchall()}


def lock_epochs(cur: psycopg2.extensions.cursor, clients: Collection[str]) -> dict[tuple[str, str], int]:
    """The lease epoch of each session of ``clients`` by (sink, client), the rows locked until the
    caller's transaction ends: no lease of theirs is taken at a higher epoch meanwhile."""
    cur.execute(
        "SELECT sink_site_id, client_name, lease_epoch FROM lr.source_sessions WHERE client_name = ANY (%s) "
        "ORDER BY 1, 2 FOR UPDATE",
        (list(clients),),
    )
    return {(sink, client): epoch for sink, client, epoch in cur.fetchall()}


def keep_only(cur: psycopg2.extensions.cursor, sessions: Collection[tuple[str, str]]) -> None:
    """Make the (sink, client) ``sessions`` the source's: others removed, missing ones created."""
    cur.execute(
        "DELETE FROM lr.source_sessions WHERE NOT (sink_site_id || '/' || client_name = ANY (%s::text[]))",
        ([f"{sink}/{client}" for sink, client in sessions],),
    )
    for sink, client in sessions:
        cur.execute(
            "INSERT INTO lr.source_sessions (sink_site_id, client_name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (sink, client),
        )


def start_unstarted(
    cur: psycopg2.extensions.cursor, clients: Collection[str], besides_sink: str, state: str, position: int
) -> None:
    """Set ``state`` and base = acked = ``position`` on the sessions of ``clients`` (but the one to
    ``besides_sink``) that never had a position acknowledged."""
    cur.execute(
        "UPDATE lr.source_sessions SET state = %s, base_position = %s, acked_position = %s, updated_at = now() "
        "WHERE client_name = ANY (%s) AND sink_site_id <> %s AND acked_position = -1",
        (state, position, position, list(clients), besides_sink),
    )


# --- what a session did last --------------------------------------------------------------------
def attempts(cur: psycopg2.extensions.cursor, sink: str, client: str) -> int:
    """The session's full-sync attempts; 0 for a session removed from the topology meanwhile (its
    next write, fenced, says so)."""
    cur.execute("SELECT attempts FROM lr.source_sessions WHERE sink_site_id = %s AND client_name = %s", (sink, client))
    found = cur.fetchone()
    return found[0] if found else 0


def set_last_error(cur: psycopg2.extensions.cursor, sink: str, client: str, error: str) -> None:
    cur.execute(
        "UPDATE lr.source_sessions SET last_error = %s, updated_at = now() "
        "WHERE sink_site_id = %s AND client_name = %s",
        (storable(cur.connection, error), sink, client),
    )


def last_error(cur: psycopg2.extensions.cursor, sink: str, client: str) -> str:
    """The session's last error ("" none): why a request waits, said where it is waited for."""
    cur.execute(
        "SELECT coalesce(last_error, '') FROM lr.source_sessions WHERE sink_site_id = %s AND client_name = %s",
        (sink, client),
    )
    found = cur.fetchone()
    return str(found[0]) if found else ""


def clear_last_error(cur: psycopg2.extensions.cursor, sink: str, client: str) -> None:
    """The session's step succeeded: its last error is past (nothing written when there is none)."""
    cur.execute(
        "UPDATE lr.source_sessions SET last_error = NULL, updated_at = now() "
        "WHERE sink_site_id = %s AND client_name = %s AND last_error IS NOT NULL",
        (sink, client),
    )


def last_success_ages(cur: psycopg2.extensions.cursor) -> dict[tuple[str, str], float | None]:
    """(sink, client) -> seconds since the session's last successful step (None: never)."""
    cur.execute(
        "SELECT sink_site_id, client_name, round(extract(epoch FROM greatest(now(), last_success_at) - last_success_at)::numeric, 1)"
        "::float8 FROM lr.source_sessions"
    )
    return {(sink, client): age for sink, client, age in cur.fetchall()}


# --- acknowledged positions -------------------------------------------------------------------
def acked_position(cur: psycopg2.extensions.cursor, sink: str, client: str) -> int:
    """The position the session's sink acknowledged; -1 when the source never recorded one (a
    session it lost and has again) or has no such session."""
    cur.execute(
        "SELECT acked_position FROM lr.source_sessions WHERE sink_site_id = %s AND client_name = %s", (sink, client)
    )
    row = cur.fetchone()
    return -1 if row is None or row[0] is None else row[0]


def acked_positions(cur: psycopg2.extensions.cursor, client: str) -> dict[str, int]:
    """sink -> the position it acknowledged, for each session of ``client``."""
    cur.execute("SELECT sink_site_id, acked_position FROM lr.source_sessions WHERE client_name = %s", (client,))
    return dict(cur.fetchall())


def tables_unsettled(cur: psycopg2.extensions.cursor, client: str, position: int | None = None) -> set[str]:
    """The sinks of ``client`` whose session has not noted holding (``settle_tables``) the tables of
    the table changes at commit ``position`` (None: every table the client federates here now); none
    on a site whose schema predates V0027. A writer may ask (``lr.sinks_lacking_tables``)."""
    cur.execute("SELECT pg_catalog.to_regprocedure('lr.sinks_lacking_tables(text,bigint)') IS NOT NULL")
    if not cur.fetchone()[0]:
        return set()
    cur.execute("SELECT lr.sinks_lacking_tables(%s, %s::bigint)", (client, position))
    return {sink for (sink,) in cur.fetchall()}


def settle_tables(cur: psycopg2.extensions.cursor, sink: str, client: str, upto: int) -> None:
    """Note that the session's sink holds every federated table of its client up to table id
    ``upto`` (it only grows: a table closed since does not take back what its sink held)."""
    cur.execute(
        "UPDATE lr.source_sessions SET tables_settled_upto = %s WHERE sink_site_id = %s AND client_name = %s "
        "AND (tables_settled_upto IS NULL OR tables_settled_upto < %s)",
        (upto, sink, client, upto),
    )


def acked_range(cur: psycopg2.extensions.cursor) -> tuple[int, int]:
    """(lowest, highest) acknowledged position over the sessions; (-1, -1) without any."""
    cur.execute("SELECT coalesce(min(acked_position), -1), coalesce(max(acked_position), -1) FROM lr.source_sessions")
    return cur.fetchone()


def lowest_ack_behind_trim(cur: psycopg2.extensions.cursor) -> int | None:
    """The lowest position acknowledged by a session that a retention trim left behind (its sink
    never got the entries trimmed past it); None when no session is behind the trim mark."""
    cur.execute(
        "SELECT min(s.acked_position) FROM lr.source_sessions s, lr.log_trim t "
        "WHERE s.acked_position >= 0 AND s.acked_position < t.trim_mark"
    )
    return cur.fetchone()[0]


def lowest_hold(cur: psycopg2.extensions.cursor) -> int | None:
    """The lowest position some session still needs: a sink's acknowledged one, or the base of a
    full sync supplied and not yet transferred; None when nothing holds one."""
    cur.execute(
        f"""
        SELECT min(p) FROM (
            SELECT acked_position AS p FROM lr.source_sessions WHERE acked_position >= 0
            UNION ALL
            SELECT base_position FROM lr.full_sync_requests WHERE status = '{RequestStatus.SUPPLIED}'
        ) holds
        """
    )
    return cur.fetchone()[0]


# The sessions with their sink's tag and region and their client's id, as a CTE ``s`` (acked, tag_id,
# region, client_id) for statements over the log that ask which sinks acknowledged an entry.
# connections whose site has lr.session_backlogs (V0051): asked of the catalog once per connection
# (not of the schema's version, which a login without lr's grants may not read: its refusal then
# named the version, not the privilege it lacks)
_WITH_SESSION_BACKLOGS: weakref.WeakSet[psycopg2.extensions.connection] = weakref.WeakSet()


def _has_session_backlogs(cur: psycopg2.extensions.cursor) -> bool:
    if cur.connection in _WITH_SESSION_BACKLOGS:
        return True
    cur.execute("SELECT pg_catalog.to_regprocedure('lr.session_backlogs(text,text,bigint)') IS NOT NULL")
    if cur.fetchone()[0]:
        _WITH_SESSION_BACKLOGS.add(cur.connection)
        return True
    return False


ACKED_SINKS_CTE = """
    WITH s AS (
        SELECT s.acked_position AS acked, r.tag_id, r.region, k.client_id
        FROM lr.source_sessions s JOIN lr.remote_sites r ON r.site_id = s.sink_site_id
        JOIN lr.clients k ON k.client_name = s.client_name)
"""


def sink_tags(cur: psycopg2.extensions.cursor, client: str) -> dict[str, int]:
    """sink -> its tag id, for each session of ``client`` (in the caller's transaction: an
    application's, for the log writer)."""
    cur.execute(
        "SELECT r.site_id, r.tag_id FROM lr.source_sessions s JOIN lr.remote_sites r "
        "ON r.site_id OPERATOR(pg_catalog.=) s.sink_site_id WHERE s.client_name OPERATOR(pg_catalog.=) %s",
        (client,),
    )
    return dict(cur.fetchall())


def backlog_rows(
    cur: psycopg2.extensions.cursor, sink: str | None, client: str | None, at_most: int | None
) -> list[tuple]:
    """Per session (optionally of one sink and/or client), sorted: (sink, client, state, acked,
    entries, highest, lag seconds, first guarded, entries before it), where entries are the
    commits after ``acked`` carrying a log entry or table change tagged for the sink, of the
    session's client — the oldest ``at_most`` of them when given (``source/backlog.py``). The lag is
    never below 0, though commits may have begun after this transaction did. On a site at V0051 the
    rule is ``lr.session_backlogs``, read as the schema's owner for a caller that may read the client
    (a writer's ``wait_until_ready``: it may not read the log itself); the statement below is the same
    rule for a site before it."""
    if _has_session_backlogs(cur):
        cur.execute("SELECT * FROM lr.session_backlogs(%s, %s, %s)", (sink, client, at_most))
        return cur.fetchall()
    cur.execute(
        """
        SELECT s.sink_site_id, s.client_name, s.state, s.acked_position, p.n, p.highest, p.lag, g.first, p.before
        FROM lr.source_sessions s
        JOIN lr.remote_sites r ON r.site_id = s.sink_site_id
        LEFT JOIN lr.clients k ON k.client_name = s.client_name
        CROSS JOIN LATERAL (  -- the first guarded position (docs/delivery.md): producers waiting
            SELECT min(d.position) AS first FROM lr.delivery_guards d
            WHERE d.client_name = s.client_name AND s.sink_site_id = ANY (d.destinations) AND d.expires_at > now()
        ) g
        CROSS JOIN LATERAL (
            SELECT count(*) AS n, coalesce(max(c.position), -1) AS highest,
                   round(greatest(extract(epoch FROM now() - min(c.committed_at)), 0)::numeric, 1)::float8 AS lag,
                   count(*) FILTER (WHERE g.first IS NULL OR c.position < g.first) AS before
            FROM (
                SELECT c.position, c.committed_at FROM lr.log_commits c
                CROSS JOIN LATERAL (
                    SELECT 1 FROM lr.log_entries e
                    WHERE e.tx = c.tx AND e.stream IN (%(stream)s, %(tables)s) AND e.tag_ids @> ARRAY[r.tag_id]
                      AND e.client_id = k.client_id
                    OFFSET 0  -- per-commit index lookups, driven by the position range: the cost
                              -- follows the backlog, not the size of the log (a join of the whole
                              -- log cost 26 ms for a backlog of 200 among 60k entries)
                ) e
                WHERE c.position > greatest(s.acked_position, 0)
                ORDER BY c.position LIMIT %(at_most)s  -- NULL: no limit
            ) c
        ) p
        WHERE (%(sink)s::text IS NULL OR s.sink_site_id = %(sink)s)
          AND (%(client)s::text IS NULL OR s.client_name = %(client)s)
        ORDER BY 1, 2
        """,
        {
            "stream": STREAM_LOG_ENTRIES,
            "tables": STREAM_TABLE_CHANGES,
            "sink": sink,
            "client": client,
            "at_most": at_most,
        },
    )
    return cur.fetchall()
