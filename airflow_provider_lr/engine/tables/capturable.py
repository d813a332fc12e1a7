"""What a table must be for lr to capture it (``lr tables open`` refuses it otherwise, naming why):
an ordinary table outside lr's and the system's schemas, in no partition or inheritance hierarchy
(statement-level triggers see only writes that name the table), every column of a type a snapshot's
``COPY`` carries and a site accepts from a client (``tables.copy.uncarried``)."""

from __future__ import annotations

import psycopg2.extensions

from airflow_provider_lr.engine.tables import copy as table_copy
from airflow_provider_lr.engine.tables.definition import TableName


def without_binary_copy(cur: psycopg2.extensions.cursor, table: TableName) -> list[str]:
    """The columns of ``table`` (each with the type at fault) that no snapshot can carry
    (``tables.copy.uncarried``): a snapshot of such a table failed at every cycle, for good, long
    after it was opened."""
    return table_copy.uncarried(cur, table.ident)


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


def without_key(cur: psycopg2.extensions.cursor, table: TableName) -> str:
    """What ``lr tables open`` says of a table with no primary key: lr applies changes by key. A
    unique index that can become the key (immediate, on plain columns, over every row: PostgreSQL's
    logical replication could take it as the replica identity) is named, with the statement that
    makes it the key; lr takes the primary key only (before, only "it needs one" was said)."""
    cur.execute(
        "SELECT pg_catalog.quote_ident(c.relname) FROM pg_catalog.pg_index i "
        "JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indrelid = pg_catalog.to_regclass(%s) AND i.indisunique AND i.indimmediate AND i.indisvalid "
        "AND i.indpred IS NULL AND i.indexprs IS NULL AND i.indnatts = i.indnkeyatts "
        "ORDER BY EXISTS (SELECT FROM pg_catalog.pg_attribute a WHERE a.attrelid = i.indrelid "
        "AND a.attnum = ANY (i.indkey) AND NOT a.attnotnull), i.indnatts, c.relname LIMIT 1",  # NOT NULL first
        (table.ident.as_string(cur),),
    )
    found = cur.fetchone()
    how = (
        f"its unique index {found[0]} can be it: ALTER TABLE {table} ADD PRIMARY KEY USING INDEX {found[0]}"
        if found
        else f"ALTER TABLE {table} ADD PRIMARY KEY (...)"
    )
    return f"table {table} has no primary key; lr applies changes by key, so it needs one ({how}), then open it again"
