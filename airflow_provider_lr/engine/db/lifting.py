"""Lifting a connection's bounds for long work it owns (a provider's full sync, a table snapshot, a
bulk task's transaction): no statement or idle-in-transaction timeout and no call deadline, its calls
watched by the heartbeat instead (``timeouts.Deadlines``), and the bounds back after it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.timeouts import BoundedConnection

log = logging.getLogger(__name__)


def _set(conn: psycopg2.extensions.connection, statement: str) -> None:
    """Run a SET; outside a transaction, commit it at once (psycopg2 opened one for it)."""
    idle = not conn.autocommit and conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    with conn.cursor() as cur:
        cur.execute(statement)
    if idle:
        conn.commit()


_LIFT = "SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0"
_RESTORE = "RESET statement_timeout; RESET idle_in_transaction_session_timeout"
# while lifted, the server also checks the client is still there during a long statement (PostgreSQL
# 14+): a replicator killed in a full sync's apply no longer leaves it running, its locks held, to the end
_CHECK_CLIENT = "; SET client_connection_check_interval = '5s'"
_UNCHECK_CLIENT = "; RESET client_connection_check_interval"


def lift(conn: psycopg2.extensions.connection) -> None:
    """Make a session connection a bulk one for the rest of its life (a connection the caller owns
    and closes): no statement or idle-in-transaction timeout, no call deadline; its calls watched by
    the heartbeat instead, as ``lifted``'s (a stopped server would hold them for good)."""
    _set(conn, _LIFT + (_CHECK_CLIENT if conn.server_version >= 140000 else ""))
    if isinstance(conn, BoundedConnection):
        if conn.deadline_s is not None:
            conn.stall_deadline_s = conn.deadline_s
        conn.deadline_s = None


@contextmanager
def lifted(*conns: psycopg2.extensions.connection) -> Iterator[None]:
    """Long work on session connections for a while (a provider's full sync, a table snapshot
    written in a cycle): unbounded like ``lift``, then the connection's own bounds again."""
    saved = [(conn, getattr(conn, "deadline_s", None), getattr(conn, "stall_deadline_s", None)) for conn in conns]
    for conn, deadline, stall in saved:
        lift(conn)
        if isinstance(conn, BoundedConnection):  # its COPYs still end when no byte moves that long
            conn.stall_deadline_s = deadline if deadline is not None else stall
    try:
        yield
    finally:
        for conn, deadline, stall in saved:
            if conn.closed:
                continue
            try:
                if conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_INERROR:
                    conn.rollback()  # failed: it can only be rolled back, and the bounds must come back
                _set(conn, _RESTORE + (_UNCHECK_CLIENT if conn.server_version >= 140000 else ""))
            except psycopg2.Error as exc:  # lost: the caller drops it
                log.debug("bounds not restored on a connection: %s", exc)
            if isinstance(conn, BoundedConnection):
                conn.deadline_s, conn.stall_deadline_s = deadline, stall
