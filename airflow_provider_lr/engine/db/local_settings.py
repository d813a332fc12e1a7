"""Settings for a while within a transaction, then back as they were.

Text that one site prints and another reads (a created table's defaults and constraints, a text
COPY's values) must be printed and read under the same settings (DateStyle, IntervalStyle,
search_path, ...): they are set local to the transaction for the work, in one round trip that
also returns what they were, and set back after it, since the transaction goes on.

On a connection lr did not open (an engine API caller's, an application's), the one rule for lr's
statements is ``catalog_path`` (``on_callers_connection`` for a public function): pg_catalog alone
for them, the caller's path set back after, whole transactions on an autocommit connection.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Concatenate, ParamSpec, TypeVar

import psycopg2.extensions

from airflow_provider_lr.engine.errors import ConfigurationError

P = ParamSpec("P")
R = TypeVar("R")

# each setting's value before, read as it is set (the lateral read comes first, row by row)
_SWAP = """
SELECT pg_catalog.array_agg(v.name), pg_catalog.array_agg(s.setting),
       pg_catalog.array_agg(pg_catalog.set_config(v.name, v.value, true))
FROM ROWS FROM (pg_catalog.unnest(%s::pg_catalog.text[]), pg_catalog.unnest(%s::pg_catalog.text[])) v(name, value)
CROSS JOIN LATERAL pg_catalog.current_setting(v.name) s(setting)"""
_RESTORE = """
SELECT pg_catalog.set_config(v.name, v.value, true)
FROM ROWS FROM (pg_catalog.unnest(%s::pg_catalog.text[]), pg_catalog.unnest(%s::pg_catalog.text[])) v(name, value)"""


@contextlib.contextmanager
def local_settings(cur: psycopg2.extensions.cursor, settings: Mapping[str, str]) -> Iterator[None]:
    """``settings`` for ``cur``'s transaction while the block runs, then back as they were (not
    after a failure: the transaction is over then)."""
    cur.execute(_SWAP, (list(settings), list(settings.values())))
    names, before = cur.fetchone()[:2]
    yield
    cur.execute(_RESTORE, (names, before))


_IDLE = psycopg2.extensions.TRANSACTION_STATUS_IDLE
_FAILED = psycopg2.extensions.TRANSACTION_STATUS_INERROR


@contextlib.contextmanager
def catalog_path(conn: psycopg2.extensions.connection, what: str = "lr") -> Iterator[None]:
    """The one rule for lr's statements on a connection lr did not open (an engine API caller's, an
    application's): in the block they search pg_catalog alone, as on lr's own connections
    (``conninfo.catalog_first``), so no function or operator of a schema the caller's search_path
    names before pg_catalog (``lookalike.=(text, text)``, ``lookalike.<=(bigint, bigint)``) stands
    in for the built-ins they name; the caller's path is set back after. For code that commits
    what it keeps (and rolls back on failure): what the block leaves open is rolled back when it
    was entered outside a transaction. A connection in autocommit mode is taken out of it for the
    block, so the block's transactions are whole (a request cancelled without its successor
    written, a trim half done) and set back. A transaction already failed is refused at once
    (``ConfigurationError`` naming ``what``). Nothing to do on lr's own connections."""
    if getattr(conn, "site_path", None) is not None:
        yield
        return
    if conn.closed:
        raise ConfigurationError(f"{what}: the connection is closed; give an open connection to the site")
    if conn.info.transaction_status == _FAILED:
        raise ConfigurationError(
            f"{what}: the connection's transaction has already failed; roll it back first (nothing was done)"
        )
    entered_idle = conn.info.transaction_status == _IDLE
    with whole_transactions(conn):
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_catalog.current_setting('search_path'), "
                "pg_catalog.set_config('search_path', 'pg_catalog', false)"
            )
            path = cur.fetchone()[0]
        if entered_idle:
            conn.commit()
        try:
            yield
        finally:
            _set_back(conn, path, entered_idle)


def _set_back(conn: psycopg2.extensions.connection, path: str, entered_idle: bool) -> None:
    try:
        status = conn.info.transaction_status
        if status == _FAILED or (entered_idle and status != _IDLE):
            conn.rollback()  # what the block left open (it commits what it keeps)
        idle = conn.info.transaction_status == _IDLE
        with conn.cursor() as cur:
            cur.execute("SELECT pg_catalog.set_config('search_path', %s, false)", (path,))
        if idle:  # else the caller's own transaction (a refusal inside it): its end decides
            conn.commit()
    except psycopg2.Error:  # the connection is gone: the block's own error says why
        pass


@contextlib.contextmanager
def whole_transactions(conn: psycopg2.extensions.connection) -> Iterator[None]:
    """``conn`` out of autocommit mode for the block, set back after: for code that begins and ends
    transactions of its own on a caller's connection (a full sync's supply), whose statements in
    autocommit mode were each a transaction of their own."""
    autocommit = conn.autocommit
    if autocommit:
        conn.autocommit = False
    try:
        yield
    finally:
        if autocommit and not conn.closed:
            try:
                conn.rollback()  # what the block left open (it commits what it keeps)
                conn.autocommit = True
            except psycopg2.Error:  # the connection is gone: the block's own error says why
                pass


def on_callers_connection(
    fn: Callable[Concatenate[psycopg2.extensions.connection, P], R],
) -> Callable[Concatenate[psycopg2.extensions.connection, P], R]:
    """A public engine function taking a connection first runs under ``catalog_path``: every one
    an engine API caller may call on a connection of its own (full-sync requests, trim, the tables'
    registry, status) goes through this one rule."""

    @functools.wraps(fn)
    def pinned(conn: psycopg2.extensions.connection, *args: P.args, **kwargs: P.kwargs) -> R:
        with catalog_path(conn, fn.__name__):
            return fn(conn, *args, **kwargs)

    return pinned
