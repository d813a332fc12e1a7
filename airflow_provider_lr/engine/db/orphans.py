"""Backends whose calls lr cut (``timeouts.Deadlines``), ended on lr's next connection to their server.

lr cuts a call by shutting its own socket; behind a link that stalled (a proxy or load balancer
that takes every byte and answers none) the server never learns of it, and the backend keeps its
transaction, and the locks it holds (a session's row, a table written in a snapshot), until its side
of the link fails: hours with the system's keepalives, for good behind a proxy that answers them.
Every retry meanwhile fails on ``lock_timeout``. lr knows each such backend's pid: ``reap`` (run by
``conninfo`` on every connection it opens) terminates those of that server as the same user.
"""

from __future__ import annotations

import logging
import time

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import error_line

log = logging.getLogger(__name__)

# by server (host, port, dbname): pid -> when its call was cut (monotonic)
CUT: dict[tuple[str, str, str], dict[int, float]] = {}


def server(conn: psycopg2.extensions.connection) -> tuple[str, str, str]:
    """The server (host, port, database) ``conn`` reached: noted when lr opened it (any thread may
    ask then: ``BoundedConnection.opened``), else asked of libpq (its own thread only)."""
    known = getattr(conn, "identity", None)
    if known is not None:
        return known
    info = conn.info
    return (str(info.host), str(info.port), str(info.dbname))


def record(conn: psycopg2.extensions.connection) -> None:
    """``conn``'s call was just cut: its backend is to be ended on the next connection there."""
    pid = getattr(conn, "backend_pid", 0)  # noted when lr opened it: the deadline thread asks no libpq
    if pid:
        CUT.setdefault(server(conn), {})[pid] = time.monotonic()


def reap(conn: psycopg2.extensions.connection) -> None:
    """On a new connection to a server: terminate the backends there whose calls lr cut; one started
    since the cut (its pid reused) is left alone. Best effort: a failure is logged, not raised."""
    cut = CUT.get(server(conn))
    if not cut:
        return
    now = time.monotonic()
    pids, ages = list(cut), [now - cut[pid] for pid in cut]
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT a.pid, pg_catalog.pg_terminate_backend(a.pid) "
                "FROM ROWS FROM (pg_catalog.unnest(%s::int[]), pg_catalog.unnest(%s::float8[])) AS o(pid, age) "
                "JOIN pg_catalog.pg_stat_activity a ON a.pid = o.pid WHERE a.usename = current_user "
                "AND a.backend_start < pg_catalog.now() - pg_catalog.make_interval(secs => o.age)",
                (pids, ages),
            )
            ended = [pid for pid, done in cur.fetchall() if done]
        conn.rollback()
    except psycopg2.Error as exc:
        log.info("%s: the backends of calls lr cut were not ended: %s", _describe(conn), error_line(exc))
        if not conn.closed:
            conn.rollback()
        return
    for pid in pids:
        cut.pop(pid, None)
    if ended:
        log.warning("%s: ended backend(s) %s, left behind by calls lr cut", _describe(conn), ended)


def _describe(conn: psycopg2.extensions.connection) -> str:
    describe = getattr(conn, "describe", None)
    return describe() if callable(describe) else "a connection"
