"""A table federated both ways (site-a ↔ site-b, docs/tables.md): site-a's snapshot onto site-b
keeps site-b's own changes that have not reached site-a yet.

site-a's snapshot replaces the rows of its origin in site-b's copy, which are also the rows site-b's
applications write (site-b federates its copy onward, to site-a among others). A change site-b
committed that site-a had not applied when its snapshot was read is not in it: cleared, it was lost
at site-b, while site-b's captured change went on to site-a (the sites diverged for good). So, in the
sink's snapshot transaction, before the clear: the table is locked against site-b's writers (their
later changes follow the snapshot), the keys of site-b's own changes past what site-a had applied
from site-b in the snapshot (site-a's ``lr.sink_sessions`` read in the snapshot's own transaction)
are read from site-b's log, and site-b's rows of those keys set aside; after the copy, those keys
get site-b's rows back (or none, where site-b deleted them). site-a receives the changes as before,
so both end with site-b's rows. Nothing of this runs for a table the sink does not federate onward,
nor on the capture or the stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.errors import StaleBatchError
from airflow_provider_lr.engine.tables.targets import Target

Received = Mapping[tuple[str, str], int]  # (source, client) -> the last position applied from it


def onward(cur: psycopg2.extensions.cursor, table: str) -> tuple[str, int] | None:
    """(client, table_id) of this site's own federation of ``table``, which it takes a snapshot of
    from another site too: federated both ways (this site's copy opened onward, or its own table
    whose copy the other site federates back)."""
    cur.execute(
        "SELECT g.client_name, g.table_id FROM lr.registry g WHERE g.stream_name = %s AND g.kind = 'table' "
        "AND g.is_federated AND g.table_id IS NOT NULL",
        (table,),
    )
    row = cur.fetchone()
    return None if row is None else (row[0], row[1])


@dataclass
class Kept:
    """The sink's own rows of a table set aside before a snapshot's clear (``keep``)."""

    target: Target
    keys: sql.Identifier  # temporary table of the keys its unsent changes touched
    rows: sql.Identifier  # temporary table of its rows of those keys, as they were
    origins: sql.Identifier  # temporary table of those keys' entries in lr.table_row_origin, as they were


# this site's own changes of a table (its ``table_id``) for the site ``to`` the snapshot comes from,
# past the position ``after`` that site had applied from this one
_UNSENT_FROM = sql.SQL(
    "FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx "
    "JOIN lr.remote_sites r ON r.tag_id = ANY (e.tag_ids) AND r.site_id = %(to)s"
)
_UNSENT_WHERE = sql.SQL("WHERE c.position > %(after)s AND e.stream = 3 AND e.table_id = %(table_id)s")


def keep(cur: psycopg2.extensions.cursor, target: Target, site: str, positions: Received, n: int) -> Kept | None:
    """At the sink ``site``, before the clear of ``target.source``'s snapshot: set aside the rows
    of the keys this site's own changes past ``positions`` touched (None: there are none, or the
    table is not federated both ways). ``n`` numbers the temporary tables within the transaction."""
    table = str(target.table)
    found = onward(cur, table)
    if found is None:
        return None
    client, table_id = found
    # no writer of the table commits from here to the end of the snapshot's transaction: a change
    # committed after the read below would be cleared unseen
    cur.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(target.definition.table.ident))
    params = {"to": target.source, "after": positions.get((site, client), -1), "table_id": table_id}
    entry = sql.SQL("pg_catalog.convert_from(e.message, 'UTF8')::jsonb")
    cur.execute(
        sql.SQL("SELECT pg_catalog.count(*), pg_catalog.bool_or({} ->> 'op' = 't') {} {}").format(
            entry, _UNSENT_FROM, _UNSENT_WHERE
        ),
        params,
    )
    count, truncated = cur.fetchone()
    if not count:
        return None
    if truncated:
        raise StaleBatchError(
            f"table {table}: a TRUNCATE of it here has not reached {target.source} yet, whose snapshot "
            "would bring back the rows it removed; the snapshot is taken again once it has"
        )
    key = target.definition.key
    types = {c.name: c.type for c in target.definition.columns}  # read in this transaction, as SQL names them
    kept = Kept(target, *(sql.Identifier(f"lr_own_{what}_{n}") for what in ("keys", "rows", "origins")))
    cur.execute(
        sql.SQL(
            "CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT DISTINCT {} {} "
            "CROSS JOIN LATERAL pg_catalog.jsonb_array_elements({} -> 'rows') AS lr_row(d) {}"
        ).format(
            kept.keys,
            sql.SQL(", ").join(_key_value(entry, k, types[k]) for k in key),
            _UNSENT_FROM,
            entry,
            _UNSENT_WHERE,
        ),
        params,
    )
    cur.execute(
        sql.SQL("CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT x.* FROM {} x WHERE {}").format(
            kept.rows, target.definition.table.ident, _among(target, sql.Identifier("x"), kept.keys)
        )
    )
    cur.execute(
        sql.SQL("CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT o.* FROM lr.table_row_origin o WHERE {}").format(
            kept.origins, _listed(kept)
        )
    )
    return kept


def restore(cur: psycopg2.extensions.cursor, kept: Kept) -> None:
    """After the snapshot's copy: the set-aside keys hold the sink's own rows again (or none)."""
    t = kept.target.definition.table.ident
    cur.execute(sql.SQL("DELETE FROM {} x WHERE {}").format(t, _among(kept.target, sql.Identifier("x"), kept.keys)))
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in kept.target.definition.column_names)  # not generated
    cur.execute(
        sql.SQL("INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE SELECT {} FROM {}").format(t, columns, columns, kept.rows)
    )
    # their origins as they were: the snapshot's upsert listed them under its source (a second one)
    cur.execute(sql.SQL("DELETE FROM lr.table_row_origin o WHERE {}").format(_listed(kept)))
    cur.execute(sql.SQL("INSERT INTO lr.table_row_origin SELECT * FROM {}").format(kept.origins))
    cur.execute(sql.SQL("DROP TABLE {}, {}, {}").format(kept.keys, kept.rows, kept.origins))


def _key_value(entry: sql.Composable, column: str, type_: str) -> sql.Composed:
    """Key ``column`` of row ``lr_row.d`` of ``entry``, as the sink applies it: a column the entry
    carries as its text form (its ``text``: json and jsonb, floats) cast from that text, any other
    read as its JSON value. Before, every key was read as its JSON value: a jsonb key, carried as
    text, was read as a JSON string (never equal to the row's key), and the sink's own rows of it
    were lost to the snapshot."""
    k, typed = sql.Literal(column), sql.SQL(type_)
    return sql.SQL(
        "CASE WHEN ({e} -> 'text') ? {k} THEN (lr_row.d ->> {k})::{t} "
        "ELSE (SELECT q.{c} FROM pg_catalog.jsonb_to_record(lr_row.d) AS q({c} {t})) END AS {c}"
    ).format(e=entry, k=k, t=typed, c=sql.Identifier(column))


def _among(target: Target, alias: sql.Identifier, keys: sql.Identifier) -> sql.Composed:
    """``alias``'s key is one of ``keys``'s."""
    key = target.definition.key
    return sql.SQL("({}) IN (SELECT {} FROM {})").format(
        sql.SQL(", ").join(sql.SQL("{}.{}").format(alias, sql.Identifier(k)) for k in key),
        sql.SQL(", ").join(sql.Identifier(k) for k in key),
        keys,
    )


def _listed(kept: Kept) -> sql.Composed:
    """``lr.table_row_origin o``'s entry is one of the table's set-aside keys."""
    return sql.SQL("o.table_name = {} AND o.key IN (SELECT {} FROM {} k)").format(
        sql.Literal(str(kept.target.table)), kept.target.key_object(sql.Identifier("k")), kept.keys
    )
