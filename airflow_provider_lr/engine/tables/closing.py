"""A table closed while one of its sinks has not taken its snapshot yet.

A closed table takes no snapshot any more. A sink that lacks its snapshot of the table's current
federation (its first one, or the one after a full sync, which forgets the session's tables, is
still to come: a replicator killed in between, or none running) would keep, for good, the copy it
had before (or none), without the changes made before the close that its peers hold. So ``lr
tables close`` first lets each sink it reaches take that snapshot: while a replicator holds the
session it waits, bounded; otherwise, or past the bound, the close is refused saying what to do.
A sink that will not take the table (it keeps out of it, or refused it: its state says why) is not
waited for, nor a table dropped or renamed at the source (no snapshot can take it: closing it is
what frees its sessions). A forced full sync asked after the close has its own rule
(``source/closed_tables``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import LRError, TableError, one_line
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.closed_tables import CATCH_UP_WAIT
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables.definition import TableName
from airflow_provider_lr.engine.tables.targets import TableState

Connect = Callable[[str], psycopg2.extensions.connection]


def _lacks(sink: psycopg2.extensions.connection, source: str, client: str, table: str, table_id: int) -> bool:
    """Whether ``sink`` has yet to take its snapshot of ``table``'s federation ``table_id``."""
    try:
        with sink.cursor() as cur:
            cur.execute(
                "SELECT (SELECT state || ':' || source_table_id FROM lr.sink_tables WHERE source_site_id = %s "
                "AND client_name = %s AND table_name = %s), "
                "(SELECT is_federated FROM lr.registry WHERE stream_name = %s AND kind = 'table')",
                (source, client, table, table),
            )
            held, federated = cur.fetchone()
    finally:
        if not sink.closed:  # (lost: its error is the one to say)
            sink.rollback()
    if federated is False:  # kept out of it (--no-federated): it takes nothing of it
        return False
    state, _, held_id = (held or "").partition(":")
    if state in (TableState.CONFLICT, TableState.REFUSED):
        return False
    return not (state == TableState.SYNCED and held_id == str(table_id))


def wait_for_snapshots(
    source: psycopg2.extensions.connection,
    connect: Connect,
    source_id: str,
    sinks: list[str],
    client: str,
    table: str,
    table_id: int,
    timeout: float = CATCH_UP_WAIT,
) -> None:
    """Return once every sink reached holds its snapshot of ``table``'s federation ``table_id``
    and none has a full sync of ``client`` still open (it forgets the tables); while a replicator
    holds each such session, within ``timeout`` seconds; else raise ``TableError`` naming them.
    A sink not reached is left to the caller (it says so when telling the sinks of the close). A
    table dropped or renamed at the source is not waited for: no snapshot can take it, and closing
    it is what frees its sessions."""
    with source.cursor() as cur:
        captured = registry.capturing(cur, TableName.parse(table))
    source.rollback()
    if not captured:
        return
    conns: dict[str, psycopg2.extensions.connection | None] = {}
    for sink in sinks:
        try:
            conns[sink] = connect(sink)
        except (LRError, psycopg2.Error):
            continue
    try:
        deadline = time.monotonic() + timeout
        while True:
            requested = full_sync.sessions_requested(source, forced_only=False)  # any forgets the tables
            federation = (source_id, client, table, table_id)
            looked = {sink: _looked(conns, connect, sink, (sink, client) in requested, federation) for sink in conns}
            lacking = {sink: why for sink, why in looked.items() if why is not None}
            if not lacking:
                return
            with source.cursor() as cur:
                holders = {sink: source_sessions.current_holder(cur, sink, client)[1] for sink in lacking}
            source.rollback()
            if all(holders.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            raise TableError(
                f"{table} not closed at {source_id}: "
                + "; ".join(
                    f"{sink} has not taken its snapshot of it yet ({why}; "
                    + (
                        f"its replicator {holders[sink]} did not take it within {timeout:g}s)"
                        if holders[sink]
                        else "no replicator holds the session: run `lr sync`)"
                    )
                    for sink, why in sorted(lacking.items())
                )
                + ". Closed now, a closed table takes no snapshot: that copy would lack the changes made before "
                "the close, for good. Close it once `lr tables list` shows the copy synced"
            )
    finally:
        for conn in conns.values():
            if conn is not None:
                conn.close()


def _looked(
    conns: dict[str, psycopg2.extensions.connection | None],
    connect: Connect,
    sink: str,
    requested: bool,
    federation: tuple[str, str, str, int],
) -> str | None:
    """Why ``sink`` (reached when the wait began) still lacks its snapshot of the ``federation``
    (source, client, table, table id), or None once it holds it. A sink that stopped answering
    (restarting) lacks it for now: looked at again, connected anew, at the next look (its loss
    ended the close with one line, though its replicator took the snapshot moments later)."""
    if requested:
        return "a full sync of it is still open"
    try:
        conn = conns[sink] = conns[sink] or connect(sink)
        return "its snapshot is to come" if _lacks(conn, *federation) else None
    except (LRError, psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
        lost = conns[sink]
        conns[sink] = None
        if lost is not None:
            lost.close()
        return f"it does not answer now: {one_line(exc)}"
