"""A federated table that a sink never had, created there as the source has it, in the transaction
that takes the source's rows (``tables.sink.prepare``): its shape (columns, types, NOT NULL, the
primary key) and, when the source's definition carries them (``TableDefinition.extras``), its
defaults, sequences, identity and generated columns, collations, UNIQUE / CHECK / EXCLUDE
constraints and indexes (``tables/extras`` says what is left out, and why).

* A column whose default is ``nextval`` of a sequence it owns (``serial``) gets a sequence of its
  own, owned by the column, with the source sequence's parameters. One whose sequence it does not
  own (shared between tables, or made on its own) draws from the sink's sequence of that name,
  created with the source's parameters when the sink has none (a relation of that name that is
  not a sequence: a sequence of its own). No value is copied: a promotion advances each sequence
  past the rows of every table that draws from it (``tables/sequences``).
* An identity column stays identity, with its sequence's parameters. ``GENERATED ALWAYS`` stays so
  on a key column (lr's apply inserts with ``OVERRIDING SYSTEM VALUE``, and COPY writes the given
  values, as PostgreSQL documents); a non-key one is created ``BY DEFAULT``: lr's apply updates a
  row's columns in place, and PostgreSQL lets an ``ALWAYS`` column be updated to DEFAULT only.
* The primary key keeps its name, never its ``DEFERRABLE`` (it is the apply's ON CONFLICT arbiter,
  which cannot be deferrable).

What the sink lacks for the columns (a type, a collation, what a generated column's expression
calls) refuses the session before anything of the table is written, naming it: lr creates the
table, not what it uses, and a table without one of its columns cannot take the source's rows.
What the sink lacks for a default, a constraint or an index (a function, an operator class, an
extension) leaves that one out, each tried on its own: the table replicates without it, and
``create_table`` returns what was left out and why (``lr status`` shows it on the table's line).
A name taken at the sink by another relation (an index's, a constraint's, the key's) is left to
PostgreSQL to choose.

Every statement runs with ``search_path`` set to ``pg_catalog`` (as the extras were read): the
source's text means at the sink what it meant at the source, whatever functions or operators the
sink's own schemas hold.
"""

from __future__ import annotations

import logging

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db.local_settings import local_settings
from airflow_provider_lr.engine.errors import SchemaMismatchError, one_line
from airflow_provider_lr.engine.tables.definition import Column, TableDefinition
from airflow_provider_lr.engine.tables.extras import AS_PRINTED, ColumnExtras, TableExtras

log = logging.getLogger(__name__)

# The sink's settings that the source's text is read under, as it was printed (``tables/extras``):
# names outside pg_catalog carry their schema, a backslash in a string literal is a character, a
# constant reads as it was printed (``extras.AS_PRINTED``).
_AS_READ = {"search_path": "pg_catalog, pg_temp", "standard_conforming_strings": "on", **AS_PRINTED}

_SERIAL = {"smallint": "smallserial", "integer": "serial", "bigint": "bigserial"}


def create_table(cur: psycopg2.extensions.cursor, definition: TableDefinition, where: str) -> tuple[str, ...]:
    """Create ``definition``'s table (and its schema) in ``cur``'s transaction, with its extras;
    returns what of them the sink could not create (each with PostgreSQL's reason)."""
    _require_types(cur, definition, where)
    try:
        with local_settings(cur, _AS_READ):
            left_out = _create(cur, definition)
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        raise  # the sink went away: the caller retries as ever
    except psycopg2.Error as exc:
        raise SchemaMismatchError(
            f"{where}: table {definition.table} could not be created on the sink as the source has it: "
            f"{_reason(exc)}. Nothing of it was written; lr creates the table, not what its columns use: create "
            "that on the sink as on the source (a type, a collation, what a generated column's expression calls), "
            "or create the table yourself (lr then takes it as it is), and the next cycle goes on"
        ) from exc
    if left_out:
        log.warning("%s: table %s created on the sink without %s", where, definition.table, "; ".join(left_out))
    return left_out


def _create(cur: psycopg2.extensions.cursor, definition: TableDefinition) -> tuple[str, ...]:
    """The table with all its extras in one statement; when that fails, the table with its columns
    (which raises when it fails too), then each default, constraint and index on its own."""
    extras = definition.extras
    # only when the sink lacks the schema: PostgreSQL checks CREATE SCHEMA IF NOT EXISTS against CREATE
    # on the database before it looks for the schema (a replicator with CREATE on the schema was refused)
    cur.execute(
        "SELECT NOT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = %s)", (definition.table.schema,)
    )
    if cur.fetchone()[0]:
        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(definition.table.schema)))
    own = frozenset() if extras is None else _shared_sequences(cur, extras)

    def table(defaults: bool, key_name: bool) -> sql.Composed:
        return sql.SQL("CREATE TABLE {} ({})").format(
            definition.table.ident, _columns(definition, own, defaults=defaults, key_name=key_name)
        )

    if extras is None:
        cur.execute(table(defaults=True, key_name=True))
        return ()
    named = _named(definition, extras)
    left_out: list[str] = []
    if _attempt(cur, [table(defaults=True, key_name=True), *(statement for _, statement, _ in named)]) is not None:
        if _attempt(cur, [table(defaults=False, key_name=True)]) is not None:
            cur.execute(table(defaults=False, key_name=False))
            left_out.append(f"the primary key's name {extras.key_name} (another relation's at the sink)")
        for what, statement in _defaults(definition, extras, own):
            error = _attempt(cur, [statement])
            if error is not None:
                left_out.append(f"{what} ({_reason(error)})")
        for what, statement, unnamed in named:
            error = _attempt(cur, [statement])
            if isinstance(error, psycopg2.errors.DuplicateTable) and _attempt(cur, [unnamed]) is None:
                left_out.append(f"the name of {what} (another relation's at the sink: PostgreSQL chose one)")
            elif error is not None:
                left_out.append(f"{what} ({_reason(error)})")
    _sequences(cur, definition, extras, own)
    return tuple(left_out)


def _shared_sequences(cur: psycopg2.extensions.cursor, extras: TableExtras) -> frozenset[str]:
    """The sink's sequence of each column that draws from one it does not own, created when the
    sink has none; returns the columns that get a sequence of their own (``serial``)."""
    drawing = [e for e in extras.columns if e.sequence is not None and not e.identity and not e.generated]
    shared = {e.shared: e.sequence for e in drawing if e.shared}
    found: dict[str, str | None] = {}
    if shared:
        cur.execute(
            "SELECT n, (SELECT relkind FROM pg_catalog.pg_class WHERE oid = pg_catalog.to_regclass(n)) "
            "FROM pg_catalog.unnest(%s::text[]) n",
            (list(shared),),
        )
        found = dict(cur.fetchall())
        missing = [
            sql.SQL("CREATE SEQUENCE {} {}").format(sql.SQL(name), options.clause(with_type=True))
            for name, options in shared.items()
            if found[name] is None and options is not None
        ]
        if missing:
            cur.execute(sql.SQL("; ").join(missing))
    return frozenset(e.name for e in drawing if not e.shared or found[e.shared] not in (None, "S"))


def _reason(error: psycopg2.Error) -> str:
    """PostgreSQL's message without its hint (the note names what was left out, the message why)."""
    return error.diag.message_primary or one_line(error)


def _attempt(cur: psycopg2.extensions.cursor, statements: list[sql.Composable]) -> psycopg2.Error | None:
    """Run ``statements`` in a savepoint: None when they ran, else the error (they left nothing)."""
    try:
        cur.execute(sql.SQL("; ").join([sql.SQL("SAVEPOINT lr_create"), *statements, sql.SQL("RELEASE lr_create")]))
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        raise
    except psycopg2.Error as exc:
        cur.execute("ROLLBACK TO SAVEPOINT lr_create; RELEASE lr_create")
        return exc
    return None


def _columns(definition: TableDefinition, own: frozenset[str], defaults: bool, key_name: bool) -> sql.Composed:
    """The column list of ``CREATE TABLE``: the shape's columns (in the source's order, generated
    ones too, when the extras say it; a ``serial`` for the ``own`` ones), then the primary key (under
    the source's name: ``key_name``)."""
    extras, key = definition.extras, definition.key
    shape = {c.name: c for c in definition.columns}
    if extras is None:
        cols = [_column(c, None, key, False, defaults) for c in definition.columns]
    else:
        cols = [_column(shape.get(e.name), e, key, e.name in own, defaults) for e in extras.columns]
    named = extras.key_name if extras is not None and key_name else None
    name = sql.SQL("CONSTRAINT {} ").format(sql.Identifier(named)) if named else sql.SQL("")
    cols.append(sql.SQL("{}PRIMARY KEY ({})").format(name, sql.SQL(", ").join(map(sql.Identifier, key))))
    return sql.SQL(", ").join(cols)


def _column(
    column: Column | None, extras: ColumnExtras | None, key: tuple[str, ...], serial: bool, default: bool
) -> sql.Composed:
    """One column: the shape's (``column``; None for a generated one), with its extras (a sequence
    of its own when ``serial``; its default only when ``default``: an identity, a generation and a
    sequence of its own are the column's)."""
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
        elif extras.expression is not None and not serial and default:
            parts.append(sql.SQL(" DEFAULT {}").format(sql.SQL(extras.expression)))
    if column.not_null:
        parts.append(sql.SQL(" NOT NULL"))
    return sql.Composed(parts[:1] + [sql.SQL(" ")] + parts[1:])


def _collate(extras: ColumnExtras) -> sql.Composable:
    return sql.SQL(" COLLATE {}").format(sql.SQL(extras.collation)) if extras.collation else sql.SQL("")


def _defaults(definition: TableDefinition, extras: TableExtras, own: frozenset[str]) -> list[tuple[str, sql.Composed]]:
    """Each default but an identity, a generation and a sequence of its own: what it is, its statement."""
    return [
        (
            f"the default of column {e.name}",
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT {}").format(
                definition.table.ident, sql.Identifier(e.name), sql.SQL(e.expression)
            ),
        )
        for e in extras.columns
        if e.expression is not None and not e.generated and not e.identity and e.name not in own
    ]


def _named(definition: TableDefinition, extras: TableExtras) -> list[tuple[str, sql.Composed, sql.Composed]]:
    """Each constraint and index: what it is, its statement, the same under a name PostgreSQL chooses."""
    t = definition.table.ident
    found = [
        (
            f"constraint {name}",
            sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(t, sql.Identifier(name), sql.SQL(text)),
            sql.SQL("ALTER TABLE {} ADD {}").format(t, sql.SQL(text)),
        )
        for name, text in extras.constraints
    ]
    for i in extras.indexes:
        create = sql.SQL("CREATE UNIQUE INDEX" if i.unique else "CREATE INDEX")
        found.append(
            (
                f"index {i.name}",
                sql.SQL("{} {} ON {} USING {}").format(create, sql.Identifier(i.name), t, sql.SQL(i.using)),
                sql.SQL("{} ON {} USING {}").format(create, t, sql.SQL(i.using)),
            )
        )
    return found


def _sequences(
    cur: psycopg2.extensions.cursor, definition: TableDefinition, extras: TableExtras, own: frozenset[str]
) -> None:
    """Each serial column's sequence given the source's parameters (and its NOT NULL dropped where
    the source's column has none). One round trip to learn the sequences' names (PostgreSQL chose them)."""
    t = definition.table.ident
    nullable = {c.name for c in definition.columns if not c.not_null}
    serials = [e for e in extras.columns if e.name in own]
    if not serials:
        return
    cur.execute(
        "SELECT n.nspname, c.relname FROM unnest(%s::text[]) WITH ORDINALITY x(col, i) "
        "JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.pg_get_serial_sequence(%s, x.col)::pg_catalog.regclass "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace ORDER BY x.i",
        ([e.name for e in serials], t.as_string(cur)),
    )
    done: list[sql.Composed] = []
    for e, (schema, name) in zip(serials, cur.fetchall(), strict=True):
        assert e.sequence is not None
        done.append(
            sql.SQL("ALTER SEQUENCE {} {} RESTART").format(
                sql.Identifier(schema, name), e.sequence.clause(with_type=True)
            )
        )
        if e.name in nullable:
            done.append(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(t, sql.Identifier(e.name)))
    cur.execute(sql.SQL("; ").join(done))


def _require_types(cur: psycopg2.extensions.cursor, source_def: TableDefinition, where: str) -> None:
    """lr creates a missing table, not the types its columns use: a type the sink lacks (an enum,
    composite or domain of the source's; a generated column's too) refuses the session, naming it."""
    extras = source_def.extras.columns if source_def.extras else ()
    types = sorted({c.type for c in source_def.columns} | {e.type for e in extras if e.generated})
    cur.execute("SELECT t FROM unnest(%s::text[]) t WHERE to_regtype(t) IS NULL", (types,))
    missing = [r[0] for r in cur.fetchall()]
    if missing:
        raise SchemaMismatchError(
            f"{where}: table {source_def.table} uses type(s) {', '.join(missing)} that the sink does not have. "
            "lr creates the table, not its types: create them on the sink as on the source (for an enum, the "
            "same labels) and the next cycle goes on"
        )
