"""Session leases with a fencing epoch (guarantee 5 in docs/architecture.md).

A replicator works on a session only while it holds the session's lease on the source. Taking a
lease from nobody, or from an owner whose lease expired, bumps the epoch; every sink write carries
the epoch and the sink refuses any epoch lower than the highest it has seen. So two replicators on
one session never both write: the one that lost its lease is refused even if it wakes up later.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine.errors import ConfigurationError, FencedError, LRError
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import config_id

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
            epoch = source_sessions.take_lease(cur, sink, client, owner, seconds)
        conn.commit()
        return Lease(sink, client, owner, epoch) if epoch is not None else None
    except BaseException:
        conn.rollback()
        raise


def holder(conn: psycopg2.extensions.connection, sink: str, client: str) -> str | None:
    """Who holds the session's lease now (None: nobody, or an expired holder); ConfigurationError
    when this source has no such session (the topology applied here does not have it). Commits."""
    with conn.cursor() as cur:
        found, owner = source_sessions.current_holder(cur, sink, client)
        applied = None if found else config_id(cur)
    conn.commit()
    if not found:
        raise ConfigurationError(
            f"{source_sessions.no_session(sink, client, applied)}: apply the topology that has it, or use the topology file the sites run"
        )
    return owner


def works_on(conn: psycopg2.extensions.connection, sink: str, client: str) -> str:
    """Why a session's pending work (a full sync, a delivery) is not done yet, as a phrase to append
    ("; ..."): the replicator holding it, or nobody (no ``lr sync`` runs, lr_streaming is paused),
    and its last error (its sink unreachable, say), which a user otherwise has to guess. "" when it
    cannot be read (the session or its source gone meanwhile). Said by ``lr full-sync --wait`` and
    by the Airflow triggers while they wait and when they give up."""
    try:
        owner = holder(conn, sink, client)
        with conn.cursor() as cur:
            error = source_sessions.last_error(cur, sink, client)
        conn.commit()
    except (LRError, psycopg2.Error):
        if not conn.closed:
            conn.rollback()
        return ""
    why = f"; its last error: {error}" if error else ""
    if owner is None:
        return "; no replicator holds the session: run `lr sync` (or unpause lr_streaming)" + why
    return f"; the session is held by replicator {owner}" + why


def _no_session(sink: str, client: str, applied: str | None) -> str:
    return (
        f"this source has no session to {sink!r} for client {client!r} (topology {applied or '(none)'} is applied here)"
    )


def advance_epoch(conn: psycopg2.extensions.connection, lease: Lease, above: int) -> Lease:
    """Move a held lease's epoch past ``above``, an epoch a sink has seen that this source does
    not remember (the session was removed from the topology and added back, or the source's
    metadata restored): epochs never go backwards. Only the current holder can; FencedError
    otherwise. Commits."""
    try:
        with conn.cursor() as cur:
            epoch = source_sessions.raise_epoch(cur, lease.sink, lease.client, lease, above + 1)
            if epoch is None:
                raise source_sessions.lost(cur, lease.sink, lease.client, lease)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return Lease(lease.sink, lease.client, lease.owner, epoch)


def release(conn: psycopg2.extensions.connection, lease: Lease) -> None:
    """Give the lease up (the epoch stays, so the next owner bumps past it). Commits."""
    with conn.cursor() as cur:
        source_sessions.release_lease(cur, lease.sink, lease.client, lease)
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
    # commit given by position, so no key of ``values`` can be taken for it
    update_session(conn, lease, True, lease_expires_at=expiry(seconds), **values)


def expiry(seconds: float) -> AsIs:
    """A lease's expiry ``seconds`` from now (the source's clock), as a value of ``update_session(s)``."""
    return AsIs(f"now() + make_interval(secs => {float(seconds)})")


def update_session(conn: psycopg2.extensions.connection, lease: Lease, commit: bool = True, **values: object) -> None:
    """Update the source session row, only while ``lease`` is still the current one. Commits,
    unless ``commit`` is False (the caller commits more with it, in one transaction)."""
    try:
        with conn.cursor() as cur:
            if not source_sessions.update_held(cur, lease.sink, lease.client, lease, values):
                raise source_sessions.lost(cur, lease.sink, lease.client, lease)
        if commit:
            conn.commit()
    except BaseException:
        conn.rollback()
        raise


def update_sessions(
    conn: psycopg2.extensions.connection, updates: Sequence[tuple[Lease, Mapping[str, object]]]
) -> dict[Lease, FencedError]:
    """``update_session`` of several leases, each with its own values, in one statement; the leases
    taken over (or removed from the topology) since, with their error (nothing set for them). Commits."""
    try:
        with conn.cursor() as cur:
            held = source_sessions.update_each_held(
                cur, [(lease.sink, lease.client, lease, values) for lease, values in updates]
            )
            gone = {
                lease: source_sessions.lost(cur, lease.sink, lease.client, lease)
                for lease, _ in updates
                if (lease.sink, lease.client) not in held
            }
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return gone
