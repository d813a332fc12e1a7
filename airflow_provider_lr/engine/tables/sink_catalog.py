"""What a sink's catalog says of a federated table lr writes to, beyond its shape: the SQL of each
fact (for one table's oid ``{oid}``), read both by a cycle's ``tables.sink.prepare`` and, for a
stream's transactions, inside ``targets``' one lookup of the session's tables."""

from __future__ import annotations

from typing import Any

import psycopg2.extensions

from airflow_provider_lr.engine.tables.definition import TableName

# lr's role (quoted) when the row-level security of table oid {oid} applies to it, else ''
GUARDED = "CASE WHEN pg_catalog.row_security_active({oid}) THEN pg_catalog.quote_ident(current_user) ELSE '' END"

# The enabled rules of table oid {oid} that rewrite lr's apply (quoted, comma-separated; '' when none):
# every DO INSTEAD rule (a delete or update it turns into nothing, or into a write elsewhere, is
# skipped without an error: the sink kept rows the source deleted, and said it was synced) and every
# INSERT or UPDATE rule (PostgreSQL refuses an upsert's ON CONFLICT on such a table). A DO ALSO
# rule on DELETE acts beside lr's delete, as a trigger does.
RULES = (
    "COALESCE((SELECT pg_catalog.string_agg(pg_catalog.quote_ident(r.rulename::text), ', ' ORDER BY r.rulename) "
    "FROM pg_catalog.pg_rewrite r WHERE r.ev_class = {oid} AND r.ev_type IN ('2', '3', '4') "
    "AND r.ev_enabled IN ('O', 'A') AND (r.is_instead OR r.ev_type <> '4')), '')"
)

# The inheritance children of table oid {oid} (not its partitions), comma-separated ('' when none)
INHERITED = (
    "COALESCE((SELECT pg_catalog.string_agg(pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident("
    "c.relname), ', ' ORDER BY 1) FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE i.inhparent = {oid} AND NOT c.relispartition), '')"
)

# Whether table oid {oid} is UNLOGGED (crash recovery empties it: lr's position would outlive its rows)
UNLOGGED = "(SELECT c.relpersistence = 'u' FROM pg_catalog.pg_class c WHERE c.oid = {oid})"

# Whether a foreign key (of any table, the table's own included) references table oid {oid}: only then
# are a statement's key changes moved in place layer by layer (``runs.layers``: a statement each,
# ~10x a delete and re-insert of the moved rows), so that no referencing row is cascaded, nulled or
# refused by a delete of the row it references. Found through what depends on the table (an index
# lookup of pg_depend: a foreign key depends on the columns it references), not by a scan of every
# constraint of the database on each of a stream's table transactions (confrelid has no index)
REFERENCED = (
    "EXISTS (SELECT FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_constraint c ON c.oid = d.objid "
    "WHERE d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjid = {oid} "
    "AND d.classid = 'pg_catalog.pg_constraint'::pg_catalog.regclass AND c.contype = 'f' AND c.confrelid = {oid})"
)


# The sink's non-key ``GENERATED ALWAYS`` identity columns of table oid {oid}, in column order (NULL: none)
ALWAYS = (
    "(SELECT pg_catalog.array_agg(a.attname::text ORDER BY a.attnum) FROM pg_catalog.pg_attribute a WHERE a.attrelid = {oid} "
    "AND a.attnum > 0 AND NOT a.attisdropped AND a.attidentity = 'a' AND NOT EXISTS (SELECT FROM pg_catalog.pg_index i "
    "WHERE i.indrelid = a.attrelid AND i.indisprimary AND a.attnum = ANY (i.indkey)))"
)


KEY_ALWAYS = (
    "(SELECT pg_catalog.bool_or(a.attidentity = 'a') FROM pg_catalog.pg_index i JOIN pg_catalog.pg_attribute a "
    "ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) WHERE i.indrelid = {oid} AND i.indisprimary)"
)


def key_facts(cur: psycopg2.extensions.cursor, table: TableName) -> dict[str, Any]:
    """The sink table's non-key ``GENERATED ALWAYS`` identity columns (``Target.always``), whether a
    key column is one (``Target.key_always``) and whether a foreign key references it
    (``Target.referenced``), as ``Target``'s fields."""
    oid = "%(t)s::regclass"
    cur.execute(
        f"SELECT {ALWAYS.format(oid=oid)}, {KEY_ALWAYS.format(oid=oid)}, {REFERENCED.format(oid=oid)}",
        {"t": table.ident.as_string(cur)},
    )
    always, key_always, referenced = cur.fetchone()
    return {"always": tuple(always or ()), "key_always": bool(key_always), "referenced": bool(referenced)}


def guards(cur: psycopg2.extensions.cursor, table: TableName) -> tuple[str, str, bool, str]:
    """What would hide or lose rows lr writes to ``table`` here (``Target.refuse_guarded``): lr's role
    when the table's row-level security applies to it, the rules that rewrite its writes (each ''
    if none), whether it is unlogged, and its inheritance children ('' if none)."""
    oid = "pg_catalog.to_regclass(%(t)s)"
    cur.execute(
        f"SELECT {GUARDED.format(oid=oid)}, {RULES.format(oid=oid)}, {UNLOGGED.format(oid=oid)}, "
        f"{INHERITED.format(oid=oid)}",
        {"t": table.ident.as_string(cur)},
    )
    guard, rules, unlogged, inherited = cur.fetchone()
    return guard, rules, unlogged, inherited
