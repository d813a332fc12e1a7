"""What to tell the user when a sink refuses lr's writes to a federated table: the server's error
is kept, and this says what to do about it (``tables.sink``, ``tables.range_copy``)."""

from __future__ import annotations

import re

import psycopg2

# SQLSTATEs of a name PostgreSQL did not find: a table, a column, a function or operator, an object, a schema
_NOT_FOUND = {"42P01", "42703", "42883", "42704", "3F000"}
_ENCODING = {"22P05", "22021"}  # untranslatable_character, character_not_in_repertoire
# a value the sink's type does not take: invalid_text_representation (an enum's label, a record's
# fields), numeric_value_out_of_range, string_data_right_truncation, invalid_datetime_format
_VALUE = {"22P02", "22003", "22001", "22007"}


def refusal_fix(exc: psycopg2.Error) -> str:
    """What to do about the sink's refusal ``exc`` of lr's writes to a table. A name that a function
    lr's write ran (the table's trigger, a default's or check's function) did not find is the search
    path's doing: lr's connections search pg_catalog alone (``conninfo.catalog_first``), as
    PostgreSQL's replication workers do, so a trigger naming the site's tables unqualified works for
    the applications and fails lr's apply. Another failure in a function is most often a trigger of
    the sink's doing again what the source's did (a copy of the source's trigger, writing rows the
    source replicates too: their keys collide, or, once the sink's sequence passed them, the sink
    holds them twice): it must skip lr's apply. Before, the refusal said to fix a constraint, trigger
    or privilege, and the user found the trigger's table there, or nothing to fix; as it did for a
    character the sink's database encoding (LATIN1) has not, where no constraint is to blame."""
    if exc.pgcode in _ENCODING:
        return (
            "the sink's database encoding cannot hold a character of the source's rows (its server converts every "
            "text to it): the sink's database must be UTF8 (or the source's encoding), or the source's row changed "
            "and a full sync asked (lr full-sync)"
        )
    if exc.pgcode in _VALUE and "function" not in (exc.diag.context or ""):
        return (
            "a value of the source's rows does not fit a type of the sink's table as the sink defines it: a type "
            "the table uses differs there (an enum lacking a label, a composite with other attributes, a domain "
            "over another type), or was altered at the source after the snapshot (ALTER TYPE ... ADD VALUE, ADD "
            "ATTRIBUTE): give the sink's type the source's definition"
        )
    if exc.pgcode == "23503" and "function" not in (exc.diag.context or ""):  # foreign_key_violation
        constraint, table = exc.diag.constraint_name, exc.diag.table_name
        named = (
            f"{_ident(constraint)} of table {_ident(exc.diag.schema_name or 'public')}.{_ident(table)}"
            if constraint and table
            else "of the sink's"
        )
        fix = (
            f"ALTER TABLE {_ident(exc.diag.schema_name or 'public')}.{_ident(table)} ALTER CONSTRAINT "
            f"{_ident(constraint)} DEFERRABLE"
            if constraint and table
            else "ALTER TABLE ... ALTER CONSTRAINT ... DEFERRABLE"
        )
        return (
            f"the sink's foreign key {named} refuses it: one the source has not, or one the apply meets in an order "
            "the source did not (one statement moved a key onto another's old key, or a row and one referencing it: "
            f"docs/tables.md): make it DEFERRABLE ({fix}; checked at the apply's commit), or drop it"
        )
    if "function" not in (exc.diag.context or ""):
        return "the sink's table has a constraint, trigger or privilege the source's has not: fix it there"
    if exc.pgcode in _NOT_FOUND:
        return (
            "a function it ran names something without its schema, and lr writes with search_path = pg_catalog "
            "(as PostgreSQL's replication workers do): qualify the names in the function (public.audit), or give "
            "it its own path (ALTER FUNCTION ... SET search_path = public)"
        )
    return (
        "a function of the sink's that lr's write ran (a trigger: the sink's triggers fire on lr's writes) failed: "
        "fix it there; a trigger that does again what the source's did (writes rows the source replicates too) "
        "must skip lr's apply: IF pg_catalog.current_setting('lr.applying', true) = 'on' THEN RETURN COALESCE(NEW, "
        "OLD); END IF (NEW or OLD, not NULL: a BEFORE row trigger returning NULL skips lr's write of the row, silently)"
    )


def _ident(name: str) -> str:
    """``name`` as SQL would need it written (quoted unless a plain lower-case identifier), for a message."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) else '"' + name.replace('"', '""') + '"'
