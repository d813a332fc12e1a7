"""Settings for a while within a transaction, then back as they were.

Text that one site prints and another reads (a created table's defaults and constraints, a text
COPY's values) must be printed and read under the same settings (DateStyle, IntervalStyle,
search_path, ...): they are set local to the transaction for the work, in one round trip that
also returns what they were, and set back after it, since the transaction goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import psycopg2.extensions

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


def catalog_only(cur: psycopg2.extensions.cursor) -> None:
    """For the rest of ``cur``'s transaction, the built-ins lr's statements name (an ``=`` of oids,
    of texts) are PostgreSQL's own: an engine API caller's connection may search a schema of
    lookalike operators before pg_catalog, which then stood in for them. For code that ends the
    transaction it runs in (the end sets the path back); lr's own connections search pg_catalog
    alone already (``conninfo.catalog_first``)."""
    if getattr(cur.connection, "site_path", None) is None:
        cur.execute("SELECT pg_catalog.set_config('search_path', 'pg_catalog', true)")
