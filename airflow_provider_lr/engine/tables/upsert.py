"""Rows written by key into a sink's federated table: the upsert of a run of changes (its conflict
clause, ``tables.sink``), a snapshot's rows from a staging table into a table another origin writes
too (``upsert_from``), and the origin ledger ``lr.table_row_origin`` that follows them.

A sink table whose primary key is ``DEFERRABLE`` has no ``ON CONFLICT`` arbiter (PostgreSQL refuses
one): its rows are updated where the sink has their key and inserted where it has not.

A sink table with a non-key ``GENERATED ALWAYS`` identity column (``Target.always``: the user made it
with the source's DDL) takes the source's values as PostgreSQL's own apply worker writes them: rows
are inserted ``OVERRIDING SYSTEM VALUE``, but PostgreSQL lets no ``UPDATE`` (nor ``ON CONFLICT DO
UPDATE``) set such a column other than to ``DEFAULT``. So an upsert leaves it out of what it updates,
and a row whose value there differs from the source's (``UPDATE ... SET ref = DEFAULT`` at the source,
another origin's row under the same key) is deleted first (``moved``) and inserted with the source's.
A table without such columns gets the statements it always had.

A snapshot's rows may hold a ``UNIQUE`` value another of its rows holds at the sink (the sending
site swapped two values, or moved one to a new row, before the snapshot was read; the sink has not
had those changes, which follow the snapshot's split). Written row by row, the first such row
collides with the sink's row still holding its value, on every attempt, for good. So the sink's
rows the snapshot rewrites with other values in a unique index's or exclusion constraint's
columns are deleted and inserted anew first, in one statement (``rewritten``): a foreign key that
refers to them (``NO ACTION``) finds their keys again at its end.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.tables.definition import TableDefinition
from airflow_provider_lr.engine.tables.targets import Target


def upsert_from(cur: psycopg2.extensions.cursor, target: Target, staging: sql.Composable) -> int:
    """Rows of ``staging`` (same columns) into the table, replacing rows with the same key; the
    origin ledger follows when the table is shared. Returns the rows written."""
    d = target.definition
    same = sql.SQL(" AND ").join(
        sql.SQL("x.{k} OPERATOR(pg_catalog.=) s.{k}").format(k=sql.Identifier(k)) for k in d.key
    )
    if target.always:
        cur.execute(moved(target, staging, same, lambda c: sql.SQL("s.{}").format(sql.Identifier(c))))
    cols = sql.SQL(", ").join(map(sql.Identifier, d.column_names))
    insert = sql.SQL("INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE SELECT {} FROM {} s").format(
        d.table.ident, cols, cols, staging
    )
    unique = unique_columns(cur, d)
    if unique:
        cur.execute(rewritten(d, staging, same, unique))
    cur.execute(
        "SELECT NOT indimmediate FROM pg_catalog.pg_index WHERE indrelid = %s::regclass AND indisprimary",
        (d.table.ident.as_string(cur),),
    )
    found = cur.fetchone()
    if found is None or not found[0]:
        cur.execute(sql.SQL("{} {}").format(insert, on_conflict(d, target.always)))
        rows = max(cur.rowcount, 0)
    else:  # a DEFERRABLE key is no ON CONFLICT arbiter: the rows the sink has updated, the others inserted
        rest = [c for c in d.column_names if c not in d.key and c not in target.always]
        rows = 0
        if rest:
            cur.execute(
                sql.SQL("UPDATE {} x SET ({}) = ROW({}) FROM {} s WHERE {}").format(
                    d.table.ident,
                    sql.SQL(", ").join(map(sql.Identifier, rest)),
                    sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(c)) for c in rest),
                    staging,
                    same,
                )
            )
            rows = max(cur.rowcount, 0)
        cur.execute(sql.SQL("{} WHERE NOT EXISTS (SELECT FROM {} x WHERE {})").format(insert, d.table.ident, same))
        rows += max(cur.rowcount, 0)
    if target.shared:
        cur.execute(
            ledger(
                target,
                sql.SQL("SELECT {} AS key FROM {} s").format(target.key_object(sql.Identifier("s")), staging),
                upserted=True,
            )
        )
    return rows


def unique_columns(cur: psycopg2.extensions.cursor, d: TableDefinition) -> list[str]:
    """The columns of the sink table's unique indexes and exclusion constraints other than its
    primary key (every column when one has an expression or a predicate); none: no such index."""
    cur.execute(
        "SELECT i.indexprs IS NOT NULL OR i.indpred IS NOT NULL, ARRAY(SELECT a.attname::text "
        "FROM pg_catalog.pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)) "
        "FROM pg_catalog.pg_index i WHERE i.indrelid = %s::regclass AND NOT i.indisprimary "
        "AND (i.indisunique OR i.indisexclusion)",
        (d.table.ident.as_string(cur),),
    )
    found = cur.fetchall()
    if any(opaque for opaque, _ in found):
        return [c for c in d.column_names if c not in d.key]
    named = {c for _, columns in found for c in columns}
    return [c for c in d.column_names if c in named and c not in d.key]


def rewritten(d: TableDefinition, staging: sql.Composable, same: sql.Composable, unique: list[str]) -> sql.Composed:
    """Delete the sink's rows (``x``) that ``staging`` (``s``) gives other values in ``unique`` and
    insert them as ``staging`` has them, in one statement (see the module). The insert's rows are
    read in the statement's snapshot, which still shows the deleted rows; the count of the delete's
    rows, a one-time filter, runs the whole delete before the first insert."""
    cols = sql.SQL(", ").join(map(sql.Identifier, d.column_names))
    differs = sql.SQL("ROW({}) IS DISTINCT FROM ROW({})").format(
        sql.SQL(", ").join(sql.SQL("x.{}").format(sql.Identifier(c)) for c in unique),
        sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(c)) for c in unique),
    )
    return sql.SQL(
        "WITH lr_gone AS (DELETE FROM {t} x USING {s} s WHERE {same} AND {differs} RETURNING 1) "
        "INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {scols} FROM {s} s JOIN {t} x ON {same} "
        "WHERE {differs} AND (SELECT pg_catalog.count(*) FROM lr_gone) >= 0"
    ).format(
        t=d.table.ident,
        s=staging,
        same=same,
        differs=differs,
        cols=cols,
        scols=sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(c)) for c in d.column_names),
    )


def moved(
    target: Target,
    rows: sql.Composable,
    same: sql.Composable,
    value: Callable[[str], sql.Composable],
    absent: tuple[str, ...] = (),
) -> sql.Composed:
    """Delete the sink's rows (``x``) that ``rows`` (``s``, matched by ``same``) upserts with another
    value of a non-key ``GENERATED ALWAYS`` column (``value(c)``; those ``absent`` from the changes
    kept): the insert that follows writes the source's value, which no update may (see the module)."""
    always = [c for c in target.always if c not in absent]
    if not always:
        return sql.Composed([])
    return sql.SQL("DELETE FROM {t} x USING {rows} s WHERE {same} AND ROW({xa}) IS DISTINCT FROM ROW({sa}); ").format(
        t=target.definition.table.ident,
        rows=rows,
        same=same,
        xa=sql.SQL(", ").join(sql.SQL("x.{}").format(sql.Identifier(c)) for c in always),
        sa=sql.SQL(", ").join(value(c) for c in always),
    )


def on_conflict(d: TableDefinition, absent: tuple[str, ...] = ()) -> sql.Composed:
    """The upsert's conflict clause: a row's columns other than the key, those ``absent`` (a column
    the sink has and the source not yet, or a ``GENERATED ALWAYS`` identity: ``moved``) kept."""
    rest = [c for c in d.column_names if c not in d.key and c not in absent]
    keys = sql.SQL(", ").join(map(sql.Identifier, d.key))
    if not rest:
        return sql.SQL("ON CONFLICT ({}) DO NOTHING").format(keys)
    return sql.SQL("ON CONFLICT ({}) DO UPDATE SET ({}) = ROW({})").format(
        keys,
        sql.SQL(", ").join(map(sql.Identifier, rest)),
        sql.SQL(", ").join(sql.SQL("EXCLUDED.{}").format(sql.Identifier(c)) for c in rest),
    )


def ledger(target: Target, keys: sql.Composable, upserted: bool) -> sql.Composed:
    """Keep ``lr.table_row_origin`` for the rows whose key objects ``keys`` yields (a query with a
    ``key`` column): rows upserted by a non-primary source are listed under it; a primary source's
    rows, and deleted rows, leave the list."""
    name = sql.Literal(str(target.table))
    if upserted and not target.primary:
        return sql.SQL(
            "INSERT INTO lr.table_row_origin (table_name, key, source_site_id) SELECT DISTINCT {}, k.key, {} FROM ({}) k "
            "ON CONFLICT (table_name, key) DO UPDATE SET source_site_id = EXCLUDED.source_site_id"
        ).format(name, sql.Literal(target.source), keys)
    return sql.SQL("DELETE FROM lr.table_row_origin o USING ({}) k WHERE o.table_name = {} AND o.key = k.key").format(
        keys, name
    )
