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
    and the system's are not an application's to replicate. An unlogged table is emptied by the
    server's crash recovery, which fires no trigger: the sinks kept every row the source lost, and
    said they were synced (PostgreSQL's publications refuse such a table too)."""
    cur.execute(
        "SELECT c.relkind, c.relispartition, n.nspname, c.relpersistence = 'u', "
        "EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhrelid = c.oid OR i.inhparent = c.oid) "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = pg_catalog.to_regclass(%s)",
        (table.ident.as_string(cur),),
    )
    kind, partition, schema, unlogged, inherits = cur.fetchone()
    if schema == "lr" or schema in ("pg_catalog", "information_schema") or schema.startswith(("pg_toast", "pg_temp")):
        return f"it is one of {'lr' if schema == 'lr' else 'the system'}'s own tables"
    if kind == "p" or partition:
        return "it is partitioned or a partition (a write through the parent or straight to a partition would not be captured)"
    if kind != "r":
        return "it is not an ordinary table"
    if inherits:
        return "it has inheritance parents or children (a write to one of them would not be captured)"
    if unlogged:
        return (
            "it is unlogged: a crash of this server empties it without a TRUNCATE lr could capture, and the sinks "
            f"would keep every row it lost (ALTER TABLE {table} SET LOGGED)"
        )
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


def unread_held_keys(cur: psycopg2.extensions.cursor, table: TableName) -> str | None:
    """Why the capture could not follow a key held twice in ``table``, or None. With a DEFERRABLE
    primary key a key may be held by two rows between statements: the capture (``SECURITY
    DEFINER``) then reads the table itself, as the lr schema's owner (V0038). An owner that may not
    read it made every UPDATE and DELETE of the application fail (``permission denied``) once the
    table was open; one its row-level security applies to would run the application's policies as
    lr's owner, which the capture refuses (``row_security = off``, V0042): both are said at the open."""
    cur.execute(
        "SELECT pg_catalog.quote_ident(r.rolname), pg_catalog.has_table_privilege(r.oid, c.oid, 'SELECT'), "
        "c.relrowsecurity AND NOT r.rolsuper AND NOT r.rolbypassrls "
        "AND (c.relforcerowsecurity OR NOT pg_catalog.pg_has_role(r.oid, c.relowner, 'USAGE')) "
        "FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indrelid "
        "CROSS JOIN pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner "
        "WHERE n.nspname = 'lr' AND i.indrelid = pg_catalog.to_regclass(%s) AND i.indisprimary AND NOT i.indimmediate",
        (table.ident.as_string(cur),),
    )
    found = cur.fetchone()
    if found is None:
        return None
    owner, readable, policed = found
    why = (
        None
        if readable and not policed
        else f"GRANT SELECT ON {table} TO {owner}"
        if not readable
        else f"its row-level security applies to {owner} (disable it, or make {owner} BYPASSRLS)"
    )
    if why is None:
        return None
    return (
        f"its primary key is DEFERRABLE: a key two rows hold between statements is followed by reading the "
        f"table as the lr schema's owner {owner}, which {'may not read it' if not readable else 'it would limit'}: "
        f"{why}, or make the key NOT DEFERRABLE, then open it again"
    )
