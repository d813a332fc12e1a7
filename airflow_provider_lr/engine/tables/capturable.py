"""What a table must be for lr to capture it (``lr tables open`` refuses it otherwise, naming why):
an ordinary table outside lr's and the system's schemas, in no partition or inheritance hierarchy
(statement-level triggers see only writes that name the table), every column of a type binary
``COPY`` carries (a snapshot is copied so)."""

from __future__ import annotations

import psycopg2.extensions

from airflow_provider_lr.engine.tables.definition import TableName

_COPYLESS = """
WITH RECURSIVE lr_parts (attname, attnum, typid, depth) AS (
    SELECT a.attname::text, a.attnum, a.atttypid, 0 FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = pg_catalog.to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
    UNION ALL  -- what a value of the type is made of: a domain's base, an array's element, a range's
    SELECT p.attname, p.attnum, x.typid, p.depth + 1  -- subtype, a multirange's range, a composite's fields
    FROM lr_parts p JOIN pg_catalog.pg_type t ON t.oid = p.typid
    CROSS JOIN LATERAL (
        SELECT t.typbasetype WHERE t.typtype = 'd'
        UNION ALL SELECT t.typelem WHERE t.typcategory = 'A' AND t.typelem <> 0
        UNION ALL SELECT r.rngsubtype FROM pg_catalog.pg_range r WHERE r.rngtypid = t.oid
        UNION ALL SELECT r.rngtypid FROM pg_catalog.pg_range r WHERE r.rngmultitypid = t.oid
        UNION ALL SELECT f.atttypid FROM pg_catalog.pg_attribute f
                  WHERE t.typtype = 'c' AND f.attrelid = t.typrelid AND f.attnum > 0 AND NOT f.attisdropped
    ) x (typid)
    WHERE p.depth < 10
)
SELECT pg_catalog.format('%%I (%%s)', p.attname, pg_catalog.string_agg(DISTINCT pg_catalog.format_type(t.oid, NULL), ', '))
FROM lr_parts p JOIN pg_catalog.pg_type t ON t.oid = p.typid
WHERE t.typsend = 0 OR t.typreceive = 0
GROUP BY p.attnum, p.attname ORDER BY p.attnum
"""


def without_binary_copy(cur: psycopg2.extensions.cursor, table: TableName) -> list[str]:
    """The columns of ``table`` (each with the type at fault) that binary COPY cannot carry: their
    type, or one a value of it is made of (an array's element, a domain's base, a composite's field,
    a range's subtype), has no binary send or receive function (``aclitem``, some extensions'
    types). A snapshot of such a table failed at every cycle, for good, long after it was opened."""
    cur.execute(_COPYLESS, (table.ident.as_string(cur),))
    return [column for (column,) in cur.fetchall()]


def not_capturable(cur: psycopg2.extensions.cursor, table: TableName) -> str | None:
    """Why the capture triggers would not see every change of ``table`` (or must not be put on it),
    or None. They are statement-level: a write to a partition or an inheritance child fires the
    triggers of the table it names only, so a partitioned table, a partition, or a table with
    inheritance parents or children would lose the writes made through the other; lr's own tables
    and the system's are not an application's to replicate."""
    cur.execute(
        "SELECT c.relkind, c.relispartition, n.nspname, "
        "EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhrelid = c.oid OR i.inhparent = c.oid) "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = pg_catalog.to_regclass(%s)",
        (table.ident.as_string(cur),),
    )
    kind, partition, schema, inherits = cur.fetchone()
    if schema == "lr" or schema in ("pg_catalog", "information_schema") or schema.startswith(("pg_toast", "pg_temp")):
        return f"it is one of {'lr' if schema == 'lr' else 'the system'}'s own tables"
    if kind == "p" or partition:
        return "it is partitioned or a partition (a write through the parent or straight to a partition would not be captured)"
    if kind != "r":
        return "it is not an ordinary table"
    if inherits:
        return "it has inheritance parents or children (a write to one of them would not be captured)"
    return None
