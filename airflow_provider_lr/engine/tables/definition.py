"""A federated table's name and shape: what source and sink must agree on before rows move.

Names are ``schema.table`` (both parts plain identifiers, as PostgreSQL folds them); the shape is
its columns (name, type as ``format_type`` prints it, a type outside ``pg_catalog`` always with its
schema: the sink reads it whatever its search_path, and ``mood`` of one schema is not another's),
nullability) and its primary key, and the attributes of every composite type its columns hold (in
an array, a domain, a range or another composite). A sink
table of the same name with another shape refuses the session (``SchemaMismatchError``): rows
carried into a table missing a column would lose it silently, and a composite's value travels by
position (its text and binary forms alike), so a sink whose ``public.pair`` is ``(b int, a int)``
where the source's is ``(a int, b int)`` took every value with its fields swapped.

A source's definition may also carry its *extras* (``tables/extras``: defaults, sequences,
constraints, indexes): what lr gives a sink table it creates (``tables/create``). They are never
compared: a sink table the user created keeps the extras the user gave it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.errors import SchemaMismatchError, TableError
from airflow_provider_lr.engine.tables import extras as table_extras
from airflow_provider_lr.engine.tables.extras import TableExtras

_PART = r"[a-z_][a-z0-9_$]{0,62}"
_NAME = re.compile(rf"({_PART})\.({_PART})")


@dataclass(frozen=True, order=True)
class TableName:
    schema: str
    name: str

    @classmethod
    def parse(cls, text: str) -> TableName:
        """``schema.table``; a bare ``table`` is in ``public``."""
        text = text.strip()
        if "." not in text:
            text = f"public.{text}"
        match = _NAME.fullmatch(text)
        if match is None:
            schema, _, name = text.rpartition(".")  # a table of a quoted schema: the schema is what to rename
            fix = (
                f"rename its schema to such a name first (ALTER SCHEMA {schema} RENAME TO sales)"
                if re.fullmatch(_PART, name) and not re.fullmatch(_PART, schema)
                else "rename the table to such a name first (ALTER TABLE ... RENAME TO line_items)"
            )
            raise TableError(
                f"table name {text!r} is not schema.table with lower-case identifiers "
                "(letters, digits, _ and $, at most 63 characters each): lr federates a table by that name "
                f'on every site, and a quoted name (upper case, spaces, quotes: "Orders", sales."Line Items") '
                f"is not supported; {fix}"
            )
        return cls(match.group(1), match.group(2))

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def ident(self) -> sql.Composed:
        return sql.Identifier(self.schema, self.name)


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    not_null: bool


@dataclass(frozen=True)
class TableDefinition:
    table: TableName
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    extras: TableExtras | None = field(default=None, compare=False)  # a source's, for a sink that creates it
    # each composite type its columns hold, with its attributes ("a integer, b text"), by type name;
    # () from a read that did not look (targets', an older lr's definition): not compared then
    composites: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def to_json(self) -> dict:
        doc: dict = {
            "table": str(self.table),
            "key": list(self.key),
            "columns": [[c.name, c.type, c.not_null] for c in self.columns],
        }
        if self.extras is not None:
            doc["extras"] = self.extras.to_json()
        if self.composites:
            doc["composites"] = [list(c) for c in self.composites]
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> TableDefinition:
        """A definition ``to_json`` wrote (one written before extras existed has none)."""
        extras = doc.get("extras")
        return cls(
            TableName.parse(doc["table"]),
            tuple(Column(n, t, bool(nn)) for n, t, nn in doc["columns"]),
            tuple(doc["key"]),
            TableExtras.from_json(extras) if extras is not None else None,
            tuple((n, a) for n, a in doc.get("composites", ())),
        )

    def mismatch(self, other: TableDefinition) -> list[str]:
        """How ``other`` (the sink's table) differs in what replication needs: the same columns with
        the same types and the same key (nullability and column order may differ)."""
        mine = {c.name: c.type for c in self.columns}
        theirs = {c.name: c.type for c in other.columns}
        problems = [f"column {n} is missing on the sink" for n in mine if n not in theirs]
        problems += [f"column {n} exists only on the sink" for n in theirs if n not in mine]
        problems += [
            f"column {n} is {mine[n]} on the source but {theirs[n]} on the sink"
            for n in mine
            if n in theirs and mine[n] != theirs[n]
        ]
        theirs_composite = dict(other.composites)
        problems += [
            _type_problem(n, attributes, theirs_composite[n])
            for n, attributes in self.composites
            if n in theirs_composite and not _type_holds(attributes, theirs_composite[n])
        ]
        if tuple(self.key) != tuple(other.key):
            problems.append(
                f"primary key ({', '.join(self.key)}) on the source but ({', '.join(other.key) or 'none'}) on the sink"
            )
        return problems


def _is_enum(what: str) -> bool:
    """Whether ``what`` describes an enum (a composite's first attribute may be named enum, never of a type "[")."""
    return what.startswith(_ENUM + "[")


def _type_holds(mine: str, theirs: str) -> bool:
    """Whether the sink's type (``theirs``, as ``SHAPE_COMPOSITES`` describes it) takes every value of
    the source's (``mine``) unchanged: the same description, or an enum with the source's labels and more."""
    if _is_enum(mine) and _is_enum(theirs):
        return set(json.loads(mine[len(_ENUM) :])) <= set(json.loads(theirs[len(_ENUM) :]))
    return mine == theirs


def _show(what: str) -> str:
    """A type as ``SHAPE_COMPOSITES`` describes it, for a message: an enum's labels as SQL literals."""
    if _is_enum(what):
        labels = json.loads(what[len(_ENUM) :])
        return "an enum (" + ", ".join("'" + label.replace("'", "''") + "'" for label in labels) + ")"
    return f"a {what}" if what.startswith((_DOMAIN, _RANGE)) else f"({what})"


def _type_problem(name: str, mine: str, theirs: str) -> str:
    """How type ``name`` differs between source and sink, with both definitions and what to do."""
    said = f"type {name} is {_show(mine)} on the source but {_show(theirs)} on the sink"
    if _is_enum(mine) and _is_enum(theirs):
        lacking = [label for label in json.loads(mine[len(_ENUM) :]) if label not in json.loads(theirs[len(_ENUM) :])]
        return (
            f"{said}, which lacks {_show(_ENUM + json.dumps(lacking))[len('an enum ') :]} (an enum's value travels "
            f"as its label: add them to the sink's type, ALTER TYPE {name} ADD VALUE ...)"
        )
    if any(_is_enum(w) or w.startswith((_DOMAIN, _RANGE)) for w in (mine, theirs)):
        return f"{said} (the sink would read every value by its own definition: give the sink's type the source's)"
    return (
        f"{said} (a composite's value travels by position: give the sink's type the source's attributes, in its order)"
    )


def _type_name(oid: str, typmod: str) -> str:
    """SQL: the name of type ``oid`` as the shape prints a column's (a type outside pg_catalog with its schema)."""
    return f"""(SELECT CASE WHEN tn.nspname = 'pg_catalog' OR NOT pg_catalog.pg_type_is_visible(ty.oid)
                   THEN pg_catalog.format_type({oid}, {typmod})
                   ELSE pg_catalog.quote_ident(tn.nspname) || '.' || pg_catalog.format_type({oid}, {typmod}) END
            FROM pg_catalog.pg_type ty JOIN pg_catalog.pg_namespace tn ON tn.oid = ty.typnamespace WHERE ty.oid = {oid})"""


# What of a user-defined type the values its columns hold depend on, besides composites' attributes:
# a domain's base type (a numeric(12,4) domain whose sink's base is numeric(12,2) rounded every value,
# silently), an enum's labels (a value travels as its label: one the sink lacks refused a whole batch
# in the server's words; their order is the sink's own, as its ORDER BY), a range's subtype and
# collation (a tsrange's bounds read in another zone, a text range's bounds ordered otherwise).
_DOMAIN, _ENUM, _RANGE = "domain over ", "enum ", "range of "  # an enum's labels follow as a JSON array

# The user-defined types the columns of the table whose oid is ``t.oid`` hold, through arrays, domains,
# ranges, multiranges and other composites: [name, what] each, in name order; a composite's "what" is
# "attribute type, ...", a domain's, an enum's and a range's start with the words above.
SHAPE_COMPOSITES = f"""
       ARRAY(WITH RECURSIVE reach(oid) AS (
                 SELECT a.atttypid FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
                 UNION
                 SELECT m.oid FROM reach r JOIN pg_catalog.pg_type y ON y.oid = r.oid
                 CROSS JOIN LATERAL (
                     SELECT y.typelem WHERE y.typelem <> 0
                     UNION ALL SELECT y.typbasetype WHERE y.typbasetype <> 0
                     UNION ALL SELECT g.rngsubtype FROM pg_catalog.pg_range g WHERE g.rngtypid = y.oid
                     UNION ALL SELECT g.rngtypid FROM pg_catalog.pg_range g WHERE g.rngmultitypid = y.oid
                     UNION ALL SELECT a.atttypid FROM pg_catalog.pg_attribute a
                               WHERE y.typtype = 'c' AND a.attrelid = y.typrelid AND a.attnum > 0 AND NOT a.attisdropped
                 ) m(oid))
             SELECT ARRAY[{_type_name("y.oid", "-1")}, CASE y.typtype
                 WHEN 'c' THEN pg_catalog.array_to_string(ARRAY(
                              SELECT pg_catalog.quote_ident(a.attname) || ' ' || {_type_name("a.atttypid", "a.atttypmod")}
                              FROM pg_catalog.pg_attribute a
                              WHERE a.attrelid = y.typrelid AND a.attnum > 0 AND NOT a.attisdropped
                              ORDER BY a.attnum), ', ')
                 WHEN 'd' THEN '{_DOMAIN}' || {_type_name("y.typbasetype", "y.typtypmod")}
                 WHEN 'e' THEN '{_ENUM}' || pg_catalog.to_json(ARRAY(
                              SELECT e.enumlabel::text FROM pg_catalog.pg_enum e WHERE e.enumtypid = y.oid
                              ORDER BY e.enumsortorder))::text
                 ELSE (SELECT '{_RANGE}' || {_type_name("g.rngsubtype", "-1")}
                              || COALESCE(' collate ' || (SELECT pg_catalog.quote_ident(c.collname)
                                 FROM pg_catalog.pg_collation c WHERE c.oid = g.rngcollation), '')
                       FROM pg_catalog.pg_range g WHERE g.rngtypid = y.oid) END]
             FROM reach r JOIN pg_catalog.pg_type y ON y.oid = r.oid
             WHERE y.typtype = 'c' OR (y.typtype IN ('d', 'e', 'r')
                   AND y.typnamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace))
             ORDER BY 1)"""


# The attributes now of each composite of %s (SQL: a jsonb array of [name, what] as ``SHAPE_COMPOSITES``
# reads them; its domains, enums and ranges left out), each found by its name: no walk of the
# table's types (``SHAPE_COMPOSITES`` costs ~0.4 ms a table; this an index lookup a composite).
# A name that is no composite now has NULL attributes (``retyped``)
COMPOSITES_NOW = f"""
       (SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_array(e ->> 0, (
                   SELECT pg_catalog.array_to_string(ARRAY(
                              SELECT pg_catalog.quote_ident(a.attname) || ' ' || {_type_name("a.atttypid", "a.atttypmod")}
                              FROM pg_catalog.pg_attribute a
                              WHERE a.attrelid = y.typrelid AND a.attnum > 0 AND NOT a.attisdropped
                              ORDER BY a.attnum), ', ')
                   FROM pg_catalog.pg_type y WHERE y.oid = pg_catalog.to_regtype(e ->> 0) AND y.typtype = 'c')))
        FROM pg_catalog.jsonb_array_elements({{recorded}}) e
        WHERE NOT (e ->> 1 LIKE '{_DOMAIN}%%' OR e ->> 1 LIKE '{_ENUM}%%' OR e ->> 1 LIKE '{_RANGE}%%'))"""


# The shape of the table whose oid is ``t.oid``: its columns (name, type as the module says, "true"
# when NOT NULL) and its primary key's columns, in order (``read_definition``; ``targets`` reads it
# for several tables in one statement). A column's type by index lookups, not a join of pg_type.
SHAPE_COLUMNS = """
       ARRAY(SELECT ARRAY[a.attname::text,
                          (SELECT CASE WHEN n.nspname = 'pg_catalog' OR NOT pg_catalog.pg_type_is_visible(y.oid)
                                  THEN pg_catalog.format_type(a.atttypid, a.atttypmod)
                                  ELSE pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.format_type(a.atttypid, a.atttypmod) END
                           FROM pg_catalog.pg_type y JOIN pg_catalog.pg_namespace n ON n.oid = y.typnamespace WHERE y.oid = a.atttypid),
                          a.attnotnull::text]
             FROM pg_catalog.pg_attribute a
             WHERE a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
             ORDER BY a.attnum),
       ARRAY(SELECT a.attname::text FROM pg_catalog.pg_index i
             JOIN LATERAL pg_catalog.unnest(i.indkey) WITH ORDINALITY k(attnum, n) ON true
             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             WHERE i.indrelid = t.oid AND i.indisprimary ORDER BY k.n)"""


def read_definition(cur: psycopg2.extensions.cursor, table: TableName, extras: bool = False) -> TableDefinition | None:
    """The table's shape as ``cur``'s transaction sees it (one round trip); None when there is no such
    table. ``extras``: with them (a source's, for the sinks; two more round trips)."""
    return read_definitions(cur, [table], extras)[table]


def read_definitions(
    cur: psycopg2.extensions.cursor, tables: Sequence[TableName], extras: bool = False
) -> dict[TableName, TableDefinition | None]:
    """``read_definition`` of each of ``tables``, in one round trip for all their shapes (and two for
    all their extras) whatever their number: a snapshot of 200 tables read them one by one, four
    statements a table. Extras whose columns are not the shape's (the table altered between the two
    reads) are left out."""
    names = {table.ident.as_string(cur): table for table in dict.fromkeys(tables)}
    found: dict[TableName, TableDefinition | None] = dict.fromkeys(names.values())
    if not names:
        return found
    cur.execute(
        "WITH t AS (SELECT u.name, pg_catalog.to_regclass(u.name) AS oid FROM pg_catalog.unnest(%s::text[]) u(name)) "
        f"SELECT t.name, {SHAPE_COLUMNS}, {SHAPE_COMPOSITES} FROM t WHERE t.oid IS NOT NULL",
        (list(names),),
    )
    for name, columns, key, composites in cur.fetchall():
        found[names[name]] = shape(names[name], columns, key, composites)
    more = table_extras.read_many(cur, [n for n, t in names.items() if found[t] is not None]) if extras else {}
    for name, extra in more.items():
        definition = found[names[name]]
        if definition is not None and [c.name for c in extra.columns if not c.generated] == definition.column_names:
            found[names[name]] = replace(definition, extras=extra)
    return found


def shape(
    table: TableName, columns: list[list[str]], key: list[str], composites: Sequence[Sequence[str]] = ()
) -> TableDefinition:
    """The definition ``SHAPE_COLUMNS`` (and ``SHAPE_COMPOSITES``) read."""
    return TableDefinition(
        table,
        tuple(Column(n, t, nn == "true") for n, t, nn in columns),
        tuple(key),
        composites=tuple((n, a) for n, a in composites),
    )


def changed_types(sink: TableDefinition, types: Mapping[str, str], columns: Iterable[str]) -> list[str]:
    """The ``columns`` of a change whose type at the source (``types``, what the capture carries once
    a column's type changed there since the table was opened: V0038) is not the sink's, nor one the
    sink's widens (``widens``): the sink would take their values by its own type (a numeric rounded
    to its scale, a timestamp read in another zone), so the change is refused instead. (A sink
    column widened first, as the docs advise, took the source's narrower change: refused before.)"""
    mine = {c.name: c.type for c in sink.columns}
    return [
        f"column {n} is {types[n]} on the source but {mine[n]} on the sink"
        for n in columns
        if n in types and n in mine and not widens(types[n], mine[n])
    ]


# The composites the columns of the table named %(t)s hold, as ``SHAPE_COMPOSITES`` reads them (all
# of its user-defined types: ``changed_composites`` compares composites only)
COMPOSITES_OF = f"SELECT {SHAPE_COMPOSITES} FROM (SELECT pg_catalog.to_regclass(%(t)s)::oid AS oid) t"

# Raises LR409 (V0023) unless the table named %(t)s holds every composite of %(carried)s (JSON:
# [[name, attributes], ...]) as it is there: a transaction composed without reading them checks it
# (the stream's, which then takes the general path: ``changed_composites`` says what differs)
EXPECT_COMPOSITES = (
    "SELECT lr.stream_expect(NOT EXISTS (SELECT FROM pg_catalog.jsonb_array_elements(%(carried)s::jsonb) c "
    "WHERE NOT EXISTS (SELECT FROM pg_catalog.jsonb_array_elements(pg_catalog.to_jsonb("
    + SHAPE_COMPOSITES
    + ")) s WHERE s = c)), 'the composites of a session''s table differ between source and sink') "
    "FROM (SELECT pg_catalog.to_regclass(%(t)s)::oid AS oid) t"
)


def changed_composites(carried: Sequence[Sequence[str]], sink: Sequence[Sequence[str]]) -> list[str]:
    """How the composites a change carries (the source's, once they changed there since the table
    was opened: V0049) differ from those the sink's table holds (``COMPOSITES_OF``): a value of one
    would arrive with its fields in the source's order, read by the sink's, so the change is refused."""
    theirs = {n: a for n, a in sink}
    return [
        _type_problem(n, attributes, theirs[n])
        if n in theirs
        else f"type {n} is ({attributes}) on the source, and the sink's table holds no such type"
        for n, attributes in carried
        if theirs.get(n) != attributes
    ]


def retyped(recorded: Sequence[Sequence[str]], sink: Sequence[Sequence[str | None]]) -> list[str]:
    """How the user-defined types a sink's table holds now (``sink``, as ``SHAPE_COMPOSITES`` reads
    them) differ from those it held at its snapshot (``recorded``: the source's then, V0052) so that
    a value of the source's would not read as it is: a composite reordered or retyped at the sink,
    one no longer held. (An enum given more labels still takes every value: ``_type_holds``.) Only
    the source's changes were compared (V0049): the sink's reorder took values fields swapped."""
    theirs = {n: a for n, a in sink}  # (``COMPOSITES_NOW``: composites only, None when gone)
    problems = []
    for n, attributes in recorded:
        if n not in theirs:
            continue
        now = theirs[n]
        if now is None:
            problems.append(f"type {n} is ({attributes}) on the source, and the sink has no such composite type now")
        elif not _type_holds(attributes, now):
            problems.append(_type_problem(n, attributes, now))
    return problems


def misfit(sink: TableDefinition, rows: Sequence[Mapping[str, object]]) -> str:
    """What of a change's ``rows`` the sink's table cannot take, naming each column and what to do
    (``tables.sink`` refuses the batch): the columns they carry that it lacks, and its key columns
    they lack. Before, the refusal listed the sink's columns only, and the user had to guess which."""
    have = set(sink.column_names)
    extra = [c for c in dict.fromkeys(c for r in rows for c in r) if c not in have]
    lacking = [k for k in sink.key if any(k not in r for r in rows)]
    said = []
    if extra:
        said.append(
            f"they carry column(s) {', '.join(extra)}, which the sink's table lacks (added or renamed at the source, "
            f"or dropped at the sink: add them to the sink's table as the source has them, ALTER TABLE {sink.table} "
            "ADD COLUMN ... or RENAME COLUMN ...)"
        )
    if lacking:
        said.append(
            f"they lack the sink's key column(s) {', '.join(lacking)} (renamed or dropped at the source: "
            "give the sink's table the source's key)"
        )
    return "; ".join(said) or "their columns differ from one another"


def check_same(source: TableDefinition, sink: TableDefinition, where: str, sink_generated: Iterable[str] = ()) -> None:
    """Refuse (``SchemaMismatchError``) when the sink's table cannot take the source's rows. A column
    generated at one site and not at the other is said so (``sink_generated``: the sink's generated
    columns; the source's are in its extras): a shape leaves generated columns out, so the refusal
    said such a column was missing on the sink, or existed only there, where both sites have it."""
    problems = source.mismatch(sink)
    theirs = set(sink_generated)
    mine = {c.name for c in source.extras.columns if c.generated} if source.extras is not None else set()
    for n, problem in enumerate(problems):
        column = problem.split(" ")[1] if problem.startswith("column ") else ""
        if problem.endswith(" is missing on the sink") and column in theirs:
            problems[n] = (
                f"column {column} is generated on the sink but not on the source (its rows carry the source's "
                f"values, which no write may give a generated column: ALTER TABLE {sink.table} ALTER COLUMN {column} "
                "DROP EXPRESSION makes it the source's)"
            )
        elif problem.endswith(" exists only on the sink") and column in mine:
            problems[n] = (
                f"column {column} is generated on the source but not on the sink (each site computes a generated "
                "column, so its rows carry no value for it: make the sink's generated as the source's)"
            )
    if problems:
        raise SchemaMismatchError(
            f"{where}: table {source.table} differs between source and sink: {'; '.join(problems)}. "
            "Nothing of it was applied; make the two tables alike (or open it with --no-federated on the sink)"
        )


# A type with a modifier that bounds its values, as ``format_type`` prints it: the base's name, the
# modifier's numbers, and what follows (a time's zone); a wider modifier holds every value of a narrower
_BOUNDED = re.compile(
    r"(numeric|character varying|character|bit varying|timestamp|time|interval)(?:\((\d+)(?:,(\d+))?\))?( .*)?"
)
_DEFAULT_PRECISION = {"timestamp": 6, "time": 6, "interval": 6}


def narrowed(recorded: Mapping[str, str], sink: TableDefinition) -> dict[str, str]:
    """The sink's columns whose type is not the one they had when its snapshot was taken
    (``recorded``: the source's types then) nor a lossless widening of it (``widens``), each with
    how. The sink would take their values by its own type: rounded or cut (a narrower modifier, a
    ``double precision`` made ``real``, a ``numeric`` made ``integer``), read in its zone (a
    ``timestamptz`` made ``timestamp``), or otherwise changed (a ``jsonb`` made ``json`` keeps what
    arrives, not one value per key), silently. Before, only a narrower modifier of the same type was
    found, and every other type took the changes."""
    return {
        column.name: f"column {column.name} is {recorded[column.name]} on the source but {column.type} on the sink"
        for column in sink.columns
        if column.name in recorded and not widens(recorded[column.name], column.type)
    }


# The types whose every value another type takes unchanged, besides a wider modifier of the same
# type (docs/tables.md, "DDL"): integers into larger ones, real into double precision, a text of
# any length into an unbounded one (varchar without a length is text). An integer goes into a
# numeric with enough digits before the point (``_DIGITS``).
_WIDER = {
    ("smallint", "integer"),
    ("smallint", "bigint"),
    ("integer", "bigint"),
    ("real", "double precision"),
    ("text", "character varying"),
    ("character varying", "text"),
}
_DIGITS = {"smallint": 5, "integer": 10, "bigint": 19}


def widens(was: str, now: str) -> bool:
    """Whether a column of type ``now`` (as ``format_type`` prints it) takes every value of type
    ``was`` unchanged: the same type, a wider modifier of it (``_holds``), one of ``_WIDER``, an
    integer into a numeric that holds its digits; an array of such, of as many dimensions."""
    dims = len(was) - len(was.rstrip("[]"))
    if now[len(now) - dims :] != was[len(was) - dims :] or now[: len(now) - dims].endswith("]"):
        return False
    was, now = was[: len(was) - dims], now[: len(now) - dims]
    if was == now or (was, now) in _WIDER:
        return True
    old, new = _BOUNDED.fullmatch(was), _BOUNDED.fullmatch(now)
    if new is not None and new[1] == "numeric" and was in _DIGITS:
        return new[2] is None or int(new[2]) - int(new[3] or 0) >= _DIGITS[was]
    if old is not None and old[1] == "character varying" and now == "text":
        return True
    return old is not None and new is not None and (old[1], old[4]) == (new[1], new[4]) and _holds(old, new)


def _holds(old: re.Match, new: re.Match) -> bool:
    """Whether type ``new`` holds every value of ``old`` (the same base; a missing modifier: unbounded,
    or a time's default precision)."""
    base, default = old[1], _DEFAULT_PRECISION.get(old[1])
    if new[2] is None and default is None:
        return True  # numeric, varchar, varbit without a modifier: any value
    if old[2] is None and default is None:
        return False
    if base == "numeric":  # digits before the point, and after it
        p0, s0, p1, s1 = int(old[2]), int(old[3] or 0), int(new[2]), int(new[3] or 0)
        return s1 >= s0 and p1 - s1 >= p0 - s0
    return int(new[2] or default or 0) >= int(old[2] or default or 0)
