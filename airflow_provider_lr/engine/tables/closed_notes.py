"""A sink's notes that a source closed the federation of a table it holds a copy of (``lr tables
close`` tells each sink it reaches): a failover that promotes the sink leaves such a table closed,
and the copy its own; and the copy is not ``DIVERGED``. Kept per source, on that source's row of
``lr.sink_tables`` (V0037): a sink table may hold the rows of several sources, and a snapshot from
one ends only its own note.
"""

from __future__ import annotations

import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.source import closed_tables
from airflow_provider_lr.engine.tables.definition import TableName

# V0037: a sink's notes of closes are per source, on ``lr.sink_tables`` (``closed_at_source``)
CLOSED_MARKS_SCHEMA = 37

# A registry row (of ``lr.registry``, unaliased) of a copy federated onward from this site (both
# ways), then closed here: the close kept this site's table id and the row its own client, while
# the copy it holds is its origin's for another client. (A note of V0031 on a plain copy's row
# names that copy's source and client; so does a site a failover retired, its row naming the new
# source, once it holds that source's copy.)
CLOSED_ONWARD = (
    "(lr.registry.table_id IS NULL AND lr.registry.closed_table_id IS NOT NULL "
    "AND lr.registry.source_site_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM lr.sink_tables t "
    "WHERE t.table_name = lr.registry.stream_name AND t.source_site_id = lr.registry.source_site_id "
    "AND t.client_name = lr.registry.client_name))"
)


def note_closed_copy(conn: psycopg2.extensions.connection, name: str, source: str, client: str) -> bool:
    """At a sink: record that ``source`` closed ``name`` (``lr tables close`` tells each sink it
    reaches), on that source's row of the copy (V0037; V0031: on the table's registry row): the
    federation it holds is closed. A failover that promotes this site then leaves the table closed,
    and the copy's own: before, the promotion federated it again and every other sink's copy was
    replaced by this one's. Noted too where this site captures the table itself (its copy federated
    both ways): before, only a site that did not was told, so the other's copy read ``synced``.
    False: no copy here (or an older schema). One transaction."""
    table = TableName.parse(name)
    try:
        if not schema.at_least(conn, closed_tables.CLOSED_TABLE_ID_SCHEMA):
            return False
        with conn.cursor() as cur:
            if schema.at_least(conn, CLOSED_MARKS_SCHEMA):
                cur.execute(  # whether or not this site captures the table itself (both ways)
                    "UPDATE lr.sink_tables SET closed_at_source = true "
                    "WHERE table_name = %(name)s AND source_site_id = %(source)s AND client_name = %(client)s",
                    {"name": str(table), "source": source, "client": client},
                )
            else:
                cur.execute(
                    "UPDATE lr.registry g SET closed_table_id = t.source_table_id FROM lr.sink_tables t "
                    "WHERE g.stream_name = %(name)s AND g.kind = 'table' AND g.table_id IS NULL "
                    "AND t.table_name = g.stream_name AND t.source_site_id = %(source)s "
                    "AND t.client_name = %(client)s",
                    {"name": str(table), "source": source, "client": client},
                )
            noted = cur.rowcount > 0
        conn.commit()
        return noted
    except BaseException:
        conn.rollback()
        raise


def copy_renewed(cur: psycopg2.extensions.cursor, table: TableName, source: str, client: str) -> None:
    """At a sink taking a snapshot of ``table`` from ``source`` for ``client`` (a live federation):
    that source's noted close is over. Only that source's: before V0037 the one note of the table
    was cleared by any source's snapshot, so a second source's made the sink forget the first's
    close. (And table ids are drawn per site: a note kept as an id took a new source's live copy
    of an equal id for closed.)"""
    if schema.at_least(cur.connection, CLOSED_MARKS_SCHEMA):
        cur.execute(
            "UPDATE lr.sink_tables SET closed_at_source = false WHERE table_name = %s AND source_site_id = %s "
            "AND client_name = %s AND closed_at_source",
            (str(table), source, client),
        )
    elif schema.at_least(cur.connection, closed_tables.CLOSED_TABLE_ID_SCHEMA):
        cur.execute(
            "UPDATE lr.registry SET closed_table_id = NULL WHERE stream_name = %s AND kind = 'table' "
            "AND table_id IS NULL AND closed_table_id IS NOT NULL",
            (str(table),),
        )


def closed_copies(cur: psycopg2.extensions.cursor, source: str, client: str) -> set[str]:
    """The tables this site holds from ``source`` for ``client`` whose federation ``source`` closed
    (``note_closed_copy``): a failover leaves them closed, and they do not diverge."""
    if schema.at_least(cur.connection, CLOSED_MARKS_SCHEMA):
        cur.execute(
            "SELECT table_name FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s AND closed_at_source",
            (source, client),
        )
        return {name for (name,) in cur.fetchall()}
    if not schema.at_least(cur.connection, closed_tables.CLOSED_TABLE_ID_SCHEMA):
        return set()
    cur.execute(
        "SELECT t.table_name FROM lr.sink_tables t JOIN lr.registry g ON g.stream_name = t.table_name "
        "AND g.kind = 'table' AND g.closed_table_id = t.source_table_id AND g.table_id IS NULL "
        "WHERE t.source_site_id = %s AND t.client_name = %s",
        (source, client),
    )
    return {name for (name,) in cur.fetchall()}
