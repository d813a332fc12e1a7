"""A federated table's sequences when its site becomes the table's source (a failover's promotion,
a planned switchover): each sequence a column of it draws from is moved past the rows it holds.

A sink's rows came with their values (lr's apply, as PostgreSQL's logical replication, never calls
``nextval``), so its sequences stayed where they were: the first application insert that relies on
a default after the promotion would draw a value a replicated row already has (duplicate key).
``advance`` runs in the promotion's transaction, holds the table against writers until the commit
(``SHARE`` lock: a row written meanwhile could take a value the sequence is then moved below), and moves every such sequence to the column's greatest value
(its least, for a descending sequence) when it is not past it already; never back.

A column "draws from" a sequence when it is an identity column (its own sequence), or its default
calls ``nextval`` of one (``serial``, or a sequence the user shares). Only integer columns are
considered (a sequence's value compared with the column's). A value beyond the sequence's bound is
clamped to it: the next insert then fails as the sequence is exhausted, as it would have at the source.
"""

from __future__ import annotations

import logging

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.tables.definition import TableName

log = logging.getLogger(__name__)

# (column, sequence schema, sequence name, sequence oid) of every integer column of table %(t)s
# that draws from a sequence
_SEQUENCES = """
SELECT a.attname, n.nspname, s.relname, s.oid
FROM pg_catalog.pg_attribute a
JOIN pg_catalog.pg_depend d ON (
       d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.deptype = 'i'
       AND d.refobjid = a.attrelid AND d.refobjsubid = a.attnum)
    OR (d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
       AND d.objid = (SELECT ad.oid FROM pg_catalog.pg_attrdef ad WHERE ad.adrelid = a.attrelid AND ad.adnum = a.attnum))
JOIN pg_catalog.pg_class s ON s.oid = CASE WHEN d.deptype = 'i' THEN d.objid ELSE d.refobjid END AND s.relkind = 'S'
JOIN pg_catalog.pg_namespace n ON n.oid = s.relnamespace
WHERE a.attrelid = %(t)s::pg_catalog.regclass AND a.attnum > 0 AND NOT a.attisdropped
  AND a.atttypid IN ('pg_catalog.int2'::pg_catalog.regtype, 'pg_catalog.int4'::pg_catalog.regtype,
                     'pg_catalog.int8'::pg_catalog.regtype)
ORDER BY a.attnum, s.oid"""

# setval to the column's greatest (least) value, within the sequence's bounds, when the sequence's
# next value is not past it; returns the value set (no row: nothing to do)
_ADVANCE = """
SELECT pg_catalog.setval({oid}, v.m, true)
FROM (SELECT CASE WHEN p.seqincrement > 0 THEN least(pg_catalog.max({col}), p.seqmax)
                  ELSE greatest(pg_catalog.min({col}), p.seqmin) END AS m, p.seqincrement AS inc
      FROM {table}, pg_catalog.pg_sequence p WHERE p.seqrelid = {oid}
      GROUP BY p.seqincrement, p.seqmax, p.seqmin) v, {seq} q
WHERE v.m IS NOT NULL
  AND (CASE WHEN v.inc > 0 THEN v.m > q.last_value ELSE v.m < q.last_value END OR (v.m = q.last_value AND NOT q.is_called))"""


def advance(cur: psycopg2.extensions.cursor, table: TableName) -> dict[str, int]:
    """Move every sequence a column of ``table`` draws from past the column's values (see the
    module). Returns ``column -> value set`` for the sequences moved."""
    cur.execute(_SEQUENCES, {"t": table.ident.as_string(cur)})
    found = cur.fetchall()
    if found:
        cur.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table.ident))
    moved = {}
    for column, schema, name, oid in found:
        cur.execute(
            sql.SQL(_ADVANCE).format(
                oid=sql.SQL("{}::pg_catalog.regclass").format(sql.Literal(oid)),
                col=sql.Identifier(column),
                table=table.ident,
                seq=sql.Identifier(schema, name),
            )
        )
        row = cur.fetchone()
        if row is not None:
            moved[column] = row[0]
            log.info("%s: sequence %s.%s of column %s set to %s", table, schema, name, column, row[0])
    return moved
