"""A federated table's sequences when its site becomes the table's source (a failover's promotion,
a planned switchover): each sequence a column of it draws from is moved past the rows it holds.

A sink's rows came with their values (lr's apply, as PostgreSQL's logical replication, never calls
``nextval``), so its sequences stayed where they were: the first application insert that relies on
a default after the promotion would draw a value a replicated row already has (duplicate key).
``advance`` runs in the promotion's transaction and holds the table against writers until the
commit (``SHARE``: a row written meanwhile could take a value the sequence is then moved below).
It moves every such sequence to the column's greatest value (its least, for a descending
sequence) when it is not past it already; never back. (``setval`` is not rolled back with a
promotion that fails after it: the sequence is then past the rows earlier, which harms nothing.)

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
FROM pg_attribute a
LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
JOIN pg_depend d ON (d.classid = 'pg_class'::regclass AND d.deptype = 'i'
                     AND d.refobjid = a.attrelid AND d.refobjsubid = a.attnum)
                 OR (d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid AND d.refclassid = 'pg_class'::regclass)
JOIN pg_class s ON s.oid = CASE WHEN d.deptype = 'i' THEN d.objid ELSE d.refobjid END AND s.relkind = 'S'
JOIN pg_namespace n ON n.oid = s.relnamespace
WHERE a.attrelid = %(t)s::regclass AND a.attnum > 0 AND NOT a.attisdropped
  AND a.atttypid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype)
ORDER BY a.attnum, s.oid"""

# setval to the column's greatest (least) value, within the sequence's bounds, when the sequence's
# next value is not past it; returns the value set (no row: nothing to do). The column is read by
# lr's alias of the table: a column named like one of pg_sequence's (seqmax) made it ambiguous, and
# a table named p clashed with pg_sequence's alias; either failed the promotion.
_ADVANCE = """
SELECT setval({oid}, v.m, true)
FROM (SELECT CASE WHEN p.seqincrement > 0 THEN least(max(lr_t.{col}), p.seqmax) ELSE greatest(min(lr_t.{col}), p.seqmin) END AS m,
             p.seqincrement AS inc
      FROM {table} lr_t, pg_sequence p WHERE p.seqrelid = {oid}
      GROUP BY p.seqincrement, p.seqmax, p.seqmin) v, {seq} q
WHERE v.m IS NOT NULL
  AND (CASE WHEN v.inc > 0 THEN v.m > q.last_value ELSE v.m < q.last_value END
       OR (v.m = q.last_value AND NOT q.is_called))"""


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
                oid=sql.SQL("{}::regclass").format(sql.Literal(oid)),
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
