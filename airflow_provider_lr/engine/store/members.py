"""The one owner of ``lr.replicator_members``: the replicator processes working a source's sessions
(V0020), and the rule that says which of them are alive.

A member holds a session-level advisory lock (``MEMBER_LOCK_CLASS``, its lock key) on a connection
of its own to the source and moves its heartbeat every fraction of a second. It is **alive** while
both hold: the lock is granted (its process's backend exits with the process, so a SIGKILL shows at
once) and its heartbeat is younger than its own ``dead_after_s`` (the backstop for a process that
hangs with its connection open, or a network that lost it). Every statement is a function of a
cursor (the caller's transaction, except the lock: session-level, it outlives transactions).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg2.extensions

from airflow_provider_lr.engine.vocabulary import MEMBER_LOCK_CLASS

# A member row ``m`` is alive (the rule, once). The lock is looked up in this database's locks only:
# advisory locks are per database, and two databases on one server may both run lr.
_ALIVE = f"""(
    m.heartbeat_at > now() - make_interval(secs => m.dead_after_s)
    AND EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
          AND l.classid = {MEMBER_LOCK_CLASS}::oid AND l.objid = m.lock_key::oid
          AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                            WHERE d.datname = pg_catalog.current_database())
    )
)"""


@dataclass(frozen=True)
class Member:
    """A live member as ``lr status`` shows it."""

    owner: str
    joined_at: datetime
    heartbeat_age_s: float  # seconds since its last heartbeat
    unreached: tuple[str, ...] = ()  # the sites it cannot reach now (V0050; read when asked)


def dead_member(owner: str) -> str:
    """SQL that is true when the lease owner ``owner`` (an SQL expression, e.g. a column) is a
    registered member that is dead; false for a live member and for an owner that never
    registered (an Airflow task, older code: its lease keeps the expiry rule)."""
    return f"EXISTS (SELECT 1 FROM lr.replicator_members m WHERE m.owner = {owner} AND NOT {_ALIVE})"


def join(cur: psycopg2.extensions.cursor, owner: str, dead_after: float) -> int:
    """Register ``owner`` with a fresh lock key, taken on this cursor's connection (which must be
    the member's own: the lock lives as long as that connection); the key."""
    while True:
        cur.execute("SELECT nextval('lr.replicator_member_lock_seq')::int")
        key = cur.fetchone()[0]
        cur.execute("SELECT pg_catalog.pg_try_advisory_lock(%s, %s)", (MEMBER_LOCK_CLASS, key))
        if cur.fetchone()[0]:  # not granted only when the sequence wrapped onto a key still held
            break
    cur.execute(
        """
        INSERT INTO lr.replicator_members (owner, lock_key, dead_after_s) VALUES (%s, %s, %s)
        ON CONFLICT (owner) DO UPDATE
        SET lock_key = EXCLUDED.lock_key, dead_after_s = EXCLUDED.dead_after_s, joined_at = now(), heartbeat_at = now()
        """,
        (owner, key, dead_after),
    )
    return key


def beat(cur: psycopg2.extensions.cursor, owner: str, key: int, unreached: list[str] | None = None) -> bool:
    """Move the member's heartbeat, and say the sites it cannot reach now (``unreached``, on a site
    at V0050 or later; None leaves them); False when its row is gone or names another key (it was
    found dead and forgotten, or its lock connection was replaced): the member must join again."""
    if unreached is None:
        cur.execute(
            "UPDATE lr.replicator_members SET heartbeat_at = now() WHERE owner = %s AND lock_key = %s", (owner, key)
        )
    else:
        cur.execute(
            "UPDATE lr.replicator_members SET heartbeat_at = now(), unreached = %s::text[] "
            "WHERE owner = %s AND lock_key = %s",
            (unreached, owner, key),
        )
    return cur.rowcount > 0


def live(cur: psycopg2.extensions.cursor, with_unreached: bool = False) -> list[Member]:
    """The live members, by owner (the same order for every member that reads them); with the sites
    each cannot reach when asked (a site at V0050 or later)."""
    cur.execute(
        "SELECT m.owner, m.joined_at, round(extract(epoch FROM greatest(now(), m.heartbeat_at) - m.heartbeat_at)::numeric, 2)::float8"
        + (", m.unreached " if with_unreached else " ")
        + f"FROM lr.replicator_members m WHERE {_ALIVE} ORDER BY m.owner"
    )
    return [Member(row[0], row[1], row[2], tuple(row[3]) if with_unreached else ()) for row in cur.fetchall()]


def registered(cur: psycopg2.extensions.cursor) -> dict[str, bool]:
    """Every registered member (live or dead, not yet forgotten) → whether it is alive."""
    cur.execute(f"SELECT m.owner, {_ALIVE} FROM lr.replicator_members m")
    return dict(cur.fetchall())


def forget_dead(cur: psycopg2.extensions.cursor, after: float) -> list[str]:
    """Remove the members dead whose last heartbeat is more than ``after`` seconds old (kept until
    then so that a lease they held is still known as a dead member's); their owners."""
    cur.execute(
        f"DELETE FROM lr.replicator_members m WHERE NOT {_ALIVE} "
        "AND m.heartbeat_at < now() - make_interval(secs => %s) RETURNING m.owner",
        (after,),
    )
    return sorted(owner for (owner,) in cur.fetchall())


def leave(cur: psycopg2.extensions.cursor, owner: str, key: int) -> None:
    """Unregister the member and give its lock up (on its own connection): the others see it gone
    on their next heartbeat."""
    cur.execute("DELETE FROM lr.replicator_members WHERE owner = %s AND lock_key = %s", (owner, key))
    cur.execute("SELECT pg_catalog.pg_advisory_unlock(%s, %s)", (MEMBER_LOCK_CLASS, key))
