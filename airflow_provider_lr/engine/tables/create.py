"""A federated table that a sink never had, created there as the source has it, in the transaction
that takes the source's rows (``tables.sink.prepare``): its shape (columns, types, NOT NULL, the
primary key) and, when the source's definition carries them (``TableDefinition.extras``), its
defaults, sequences, identity and generated columns, collations, UNIQUE / CHECK / EXCLUDE
constraints and indexes (``tables/extras`` says what is left out, and why).

* A column whose default is ``nextval`` of a sequence gets a sequence of its own, owned by the
  column, as ``serial`` makes (a sequence shared at the source is not the sink's to share), with
  the source sequence's parameters. Its value is not copied: a promotion advances it past the
  rows (``tables/sequences``).
* An identity column stays identity, with its sequence's parameters. ``GENERATED ALWAYS`` stays so
  on a key column (lr's apply inserts with ``OVERRIDING SYSTEM VALUE``, and COPY writes the given
  values, as PostgreSQL documents); a non-key one is created ``BY DEFAULT``: lr's apply updates a
  row's columns in place, and PostgreSQL lets an ``ALWAYS`` column be updated to DEFAULT only.
* The primary key keeps its name, never its ``DEFERRABLE`` (it is the apply's ON CONFLICT arbiter,
  which cannot be deferrable).

What the sink lacks for them (a type, function, collation, operator class, extension) refuses the
session before anything of the table is written, naming it: lr creates the table, not what it uses.
"""

from __future__ import annotations

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.errors import SchemaMismatchError, one_line
from airflow_provider_lr.engine.tables.definition import Column, TableDefinition
from airflow_provider_lr.engine.tables.extras import ColumnExtras, TableExtras

_SERIAL = {"smallint": "smallserial", "integer": "serial", "bigint": "bigserial"}


def create_table(cur: psycopg2.extensions.cursor, definition: TableDefinition, where: str) -> None:
    """Create ``definition``'s table (and its schema) in ``cur``'s transaction, with its extras."""
    _require_types(cur, definition, where)
    try:
        cur.execute(
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}; CREATE TABLE IF NOT EXISTS {} ({})").format(
                sql.Identifier(definition.table.schema), definition.table.ident, _columns(definition)
            )
        )
        after = [] if definition.extras is None else _after(cur, definition, definition.extras)
        if after:
            cur.execute(sql.SQL("; ").join(after))
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        raise  # the sink went away: the caller retries as ever
    except psycopg2.Error as exc:
        raise SchemaMismatchError(
            f"{where}: table {definition.table} could not be created on the sink as the source has it: "
            f"{one_line(exc)}. Nothing of it was written; lr creates the table, not what its defaults, constraints "
            "and indexes use: create that on the sink as on the source (a function, collation, operator class or "
            "extension), or create the table yourself (lr then takes it as it is), and the next cycle goes on"
        ) from exc


def _columns(definition: TableDefinition) -> sql.Composed:
    """The column list of ``CREATE TABLE``: the shape's columns (in the source's order, generated
    ones too, when the extras say it), then the primary key."""
    extras, key = definition.extras, definition.key
    shape = {c.name: c for c in definition.columns}
    if extras is None:
        cols = [_column(c, None, key) for c in definition.columns]
    else:
        cols = [_column(shape.get(e.name), e, key) for e in extras.columns]
    name = sql.SQL("CONSTRAINT {} ").format(sql.Identifier(extras.key_name)) if extras and extras.key_name else None
    cols.append(sql.SQL("{}PRIMARY KEY ({})").format(name or sql.SQL(""), sql.SQL(", ").join(map(sql.Identifier, key))))
    return sql.SQL(", ").join(cols)


def _column(column: Column | None, extras: ColumnExtras | None, key: tuple[str, ...]) -> sql.Composed:
    """One column: the shape's (``column``; None for a generated one), with its extras."""
    if column is None:
        assert extras is not None and extras.generated and extras.expression is not None
        return sql.SQL("{} {}{} GENERATED ALWAYS AS ({}) {}").format(
            sql.Identifier(extras.name),
            sql.SQL(extras.type),
            _collate(extras),
            sql.SQL(extras.expression),
            sql.SQL("VIRTUAL" if extras.generated == "v" else "STORED"),
        )
    parts: list[sql.Composable] = [sql.Identifier(column.name)]
    serial = extras is not None and extras.sequence is not None and not extras.identity
    parts.append(sql.SQL(_SERIAL[column.type] if serial else column.type))
    if extras is not None:
        parts.append(_collate(extras))
        if extras.identity:
            assert extras.sequence is not None
            always = extras.identity == "a" and column.name in key
            parts.append(
                sql.SQL(" GENERATED {} AS IDENTITY ({})").format(
                    sql.SQL("ALWAYS" if always else "BY DEFAULT"), extras.sequence.clause(with_type=False)
                )
            )
        elif extras.expression is not None and not serial:
            parts.append(sql.SQL(" DEFAULT {}").format(sql.SQL(extras.expression)))
    if column.not_null:
        parts.append(sql.SQL(" NOT NULL"))
    return sql.Composed(parts[:1] + [sql.SQL(" ")] + parts[1:])


def _collate(extras: ColumnExtras) -> sql.Composable:
    return sql.SQL(" COLLATE {}").format(sql.SQL(extras.collation)) if extras.collation else sql.SQL("")


def _after(cur: psycopg2.extensions.cursor, definition: TableDefinition, extras: TableExtras) -> list[sql.Composed]:
    """What follows the ``CREATE TABLE``: each serial column's sequence given the source's
    parameters (and its NOT NULL dropped where the source's column has none), the constraints, the
    indexes. One round trip to learn the sequences' names (PostgreSQL chose them)."""
    t = definition.table.ident
    nullable = {c.name for c in definition.columns if not c.not_null}
    serials = [e for e in extras.columns if e.sequence is not None and not e.identity and not e.generated]
    done: list[sql.Composed] = []
    if serials:
        cur.execute(
            "SELECT n.nspname, c.relname FROM unnest(%s::text[]) WITH ORDINALITY x(col, i) "
            "JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.pg_get_serial_sequence(%s, x.col)::pg_catalog.regclass "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace ORDER BY x.i",
            ([e.name for e in serials], t.as_string(cur)),
        )
        for e, (schema, name) in zip(serials, cur.fetchall(), strict=True):
            assert e.sequence is not None
            done.append(
                sql.SQL("ALTER SEQUENCE {} {} RESTART").format(
                    sql.Identifier(schema, name), e.sequence.clause(with_type=True)
                )
            )
            if e.name in nullable:
                done.append(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(t, sql.Identifier(e.name)))
    done += [
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(t, sql.Identifier(name), sql.SQL(text))
        for name, text in extras.constraints
    ]
    done += [
        sql.SQL("CREATE {}INDEX {} ON {} USING {}").format(
            sql.SQL("UNIQUE " if i.unique else ""), sql.Identifier(i.name), t, sql.SQL(i.using)
        )
        for i in extras.indexes
    ]
    return done


def _require_types(cur: psycopg2.extensions.cursor, source_def: TableDefinition, where: str) -> None:
    """lr creates a missing table, not the types it uses: a type the sink lacks (an enum, composite
    or domain of the source's) refuses the session, naming it."""
    types = sorted({c.type for c in source_def.columns})
    cur.execute("SELECT t FROM unnest(%s::text[]) t WHERE to_regtype(t) IS NULL", (types,))
    missing = [r[0] for r in cur.fetchall()]
    if missing:
        raise SchemaMismatchError(
            f"{where}: table {source_def.table} uses type(s) {', '.join(missing)} that the sink does not have. "
            "lr creates the table, not its types: create them on the sink as on the source (for an enum, the "
            "same labels) and the next cycle goes on"
        )
