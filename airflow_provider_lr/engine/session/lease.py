"""Session leases with a fencing epoch (DESIGN §6 property 5).

A replicator works on a session only while it holds the session's lease on the source. Taking a
lease from nobody, or from an owner whose lease expired, bumps the epoch; every sink write carries
the epoch and the sink refuses any epoch lower than the highest it has seen. So two replicators on
one session never both write: the one that lost its lease is refused even if it wakes up later.
"""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine.errors import ConfigurationError, FencedError

DEFAULT_LEASE_SECONDS = 60.0


def new_owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Lease:
    sink: str
    client: str
    owner: str
    epoch: int


def acquire(
    conn: psycopg2.extensions.connection, sink: str, client: str, owner: str, seconds: float = DEFAULT_LEASE_SECONDS
) -> Lease | None:
    """Take or renew the session's lease; None when another owner holds an unexpired one. Commits."""
    try:
        with conn.cursor() as cur:
            cur.execute(
                """
                UPDATE lr.source_sessions
                SET lease_epoch = CASE WHEN lease_owner = %(owner)s AND lease_expires_at > now()
                                       THEN lease_epoch ELSE lease_epoch + 1 END,
                    lease_acquired_at = CASE WHEN lease_owner = %(owner)s AND lease_expires_at > now()
                                             THEN lease_acquired_at ELSE now() END,  -- V0016: since when
                    lease_owner = %(owner)s,
                    lease_expires_at = now() + make_interval(secs => %(seconds)s)
                WHERE sink_site_id = %(sink)s AND client_name = %(client)s
                  AND (lease_owner IS NULL OR lease_owner = %(owner)s OR lease_expires_at <= now())
                RETURNING lease_epoch
                """,
                {"owner": owner, "seconds": seconds, "sink": sink, "client": client},
            )
            row = cur.fetchone()
        conn.commit()
        return Lease(sink, client, owner, row[0]) if row else None
    except BaseException:
        conn.rollback()
        raise


def holder(conn: psycopg2.extensions.connection, sink: str, client: str) -> str | None:
    """Who holds the session's lease now (None: nobody, or an expired holder); ConfigurationError
    when this source has no such session (the topology applied here does not have it). Commits."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT CASE WHEN lease_expires_at > now() THEN lease_owner END FROM lr.source_sessions "
            "WHERE sink_site_id = %s AND client_name = %s",
            (sink, client),
        )
        row = cur.fetchone()
        if row is None:
            cur.execute("SELECT topology_config_id FROM lr.topology")
            applied = cur.fetchone()
    conn.commit()
    if row is None:
        raise ConfigurationError(
            f"this source has no session to {sink!r} for client {client!r} (topology "
            f"{applied[0] if applied else '(none)'} is applied here): apply the topology that has it, or use the "
            "topology file the sites run"
        )
    return row[0]


def advance_epoch(conn: psycopg2.extensions.connection, lease: Lease, above: int) -> Lease:
    """Move a held lease's epoch past ``above``, an epoch a sink has seen that this source does
    not remember (the session was removed from the topology and added back, or the source's
    metadata restored): epochs never go backwards. Only the current holder can; FencedError
    otherwise. Commits."""
    try:
        with conn.cursor() as cur:
            cur.execute(
                "UPDATE lr.source_sessions SET lease_epoch = %s WHERE sink_site_id = %s AND client_name = %s "
                "AND lease_owner = %s AND lease_epoch = %s AND lease_expires_at > now() RETURNING lease_epoch",
                (above + 1, lease.sink, lease.client, lease.owner, lease.epoch),
            )
            row = cur.fetchone()
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    if row is None:
        raise FencedError(f"session to {lease.sink!r} for {lease.client!r}: lease epoch {lease.epoch} of "
                          f"{lease.owner} was taken over; stopping")
    return Lease(lease.sink, lease.client, lease.owner, row[0])


def release(conn: psycopg2.extensions.connection, lease: Lease) -> None:
    """Give the lease up (the epoch stays, so the next owner bumps past it). Commits."""
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE lr.source_sessions SET lease_owner = NULL, lease_expires_at = NULL "
            "WHERE sink_site_id = %s AND client_name = %s AND lease_owner = %s AND lease_epoch = %s",
            (lease.sink, lease.client, lease.owner, lease.epoch),
        )
    conn.commit()


def release_quietly(conn: psycopg2.extensions.connection, lease: Lease) -> None:
    """``release`` when the site can be reached; otherwise nothing (the lease expires on its own
    after ``lease_seconds``). For clean-up paths, which must not turn a lost connection into a
    second failure."""
    try:
        release(conn, lease)
    except psycopg2.Error:
        if not conn.closed:
            try:
                conn.rollback()
            except psycopg2.Error:
                pass


def renew(conn: psycopg2.extensions.connection, lease: Lease, seconds: float, **values: object) -> None:
    """Extend a held lease by ``seconds`` from now (and set ``values`` on the session row with it);
    FencedError when it was taken over since (its epoch changed). Commits."""
    update_session(conn, lease, lease_expires_at=AsIs(f"now() + make_interval(secs => {float(seconds)})"), **values)


def update_session(conn: psycopg2.extensions.connection, lease: Lease, commit: bool = True, **values: object) -> None:
    """Update the source session row, only while ``lease`` is still the current one. Commits,
    unless ``commit`` is False (the caller commits more with it, in one transaction)."""
    sets = ", ".join(f"{k} = %s" for k in values)
    try:
        with conn.cursor() as cur:
            cur.execute(
                f"UPDATE lr.source_sessions SET {sets}, updated_at = now() "
                "WHERE sink_site_id = %s AND client_name = %s AND lease_owner = %s AND lease_epoch = %s",
                (*values.values(), lease.sink, lease.client, lease.owner, lease.epoch),
            )
            if cur.rowcount == 0:
                raise FencedError(
                    f"session to {lease.sink!r} for {lease.client!r}: lease epoch {lease.epoch} of {lease.owner} "
                    "was taken over; stopping"
                )
        if commit:
            conn.commit()
    except BaseException:
        conn.rollback()
        raise
