"""What a source table has beyond its shape, for a sink that lr creates the table on: column
defaults (a sequence of the column's own, as ``serial`` makes), identity and generated columns,
collations, the primary key's name, UNIQUE / CHECK / EXCLUDE constraints and the other indexes.

Read at the source in the snapshot's transaction (``read``), carried with the table's definition
(``TableDefinition.extras``, its JSON form in a Spark task), created at the sink in the transaction
that creates the table (``tables/create``). Never compared: a sink table the user created has the
extras the user gave it (``TableDefinition.mismatch`` looks at the shape only).

Expressions and definitions are PostgreSQL's own deparsing (``pg_get_expr``, ``pg_get_constraintdef``,
``pg_get_indexdef``) with ``search_path`` set to ``pg_catalog`` for the read, so every name outside
``pg_catalog`` is printed with its schema: the sink reads them whatever its ``search_path``. None of
them names the table; an index's definition does, so only the part after ``USING`` is kept, cut at
a prefix built from the catalog (its name, the table's) and checked against the text.

Not copied, on purpose: foreign keys (the referenced table may not exist at the sink yet, and each
table's snapshot is its own transaction: a copy in between would break them), triggers (an
application's trigger acts at the sink on lr's apply; lr installs its own capture at promotion),
row-level security policies and grants (roles differ between sites), ownership (the replicator
creates the table), comments, storage parameters, tablespaces, a constraint the source has
``NOT VALID`` (the source holds rows against it, which the sink must take), and a default that uses
a sequence otherwise than as ``nextval(seq)`` of an integer column (an expression is not lr's to
rewrite, and the sequence is the source's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg2.extensions
from psycopg2 import sql


@dataclass(frozen=True)
class SequenceOptions:
    """A sequence's parameters (``pg_sequence``), as ``CREATE SEQUENCE`` takes them."""

    type: str
    start: int
    increment: int
    min: int
    max: int
    cache: int
    cycle: bool

    def clause(self, with_type: bool) -> sql.Composed:
        """``[AS type] START WITH .. INCREMENT BY .. MINVALUE .. MAXVALUE .. CACHE .. [NO] CYCLE``
        (an identity's sequence takes its column's type: no ``AS``)."""
        return sql.SQL("{}START WITH {} INCREMENT BY {} MINVALUE {} MAXVALUE {} CACHE {} {}").format(
            sql.SQL("AS {} ").format(sql.SQL(self.type)) if with_type else sql.SQL(""),
            *map(sql.Literal, (self.start, self.increment, self.min, self.max, self.cache)),
            sql.SQL("CYCLE" if self.cycle else "NO CYCLE"),
        )


@dataclass(frozen=True)
class ColumnExtras:
    """One column of the source table (all of them, in its order, generated ones too)."""

    name: str
    type: str  # format_type's, qualified outside pg_catalog (used for generated columns)
    expression: str | None  # its default, or its generation expression
    generated: str  # '' | 's' (stored) | 'v' (virtual)
    identity: str  # '' | 'a' (ALWAYS) | 'd' (BY DEFAULT)
    sequence: SequenceOptions | None  # an identity's, or the one its default is nextval() of
    collation: str | None  # quoted and qualified, when not its type's
    shared: str | None = None  # that sequence, quoted and qualified, when the column does not own it


@dataclass(frozen=True)
class Index:
    name: str
    unique: bool
    using: str  # pg_get_indexdef after "... USING ": method, columns, INCLUDE, WITH, WHERE


@dataclass(frozen=True)
class TableExtras:
    columns: tuple[ColumnExtras, ...]
    key_name: str | None
    constraints: tuple[tuple[str, str], ...]  # (name, pg_get_constraintdef)
    indexes: tuple[Index, ...]

    def to_json(self) -> dict:
        return {
            "columns": [{**c.__dict__, "sequence": c.sequence.__dict__ if c.sequence else None} for c in self.columns],
            "key_name": self.key_name,
            "constraints": [list(c) for c in self.constraints],
            "indexes": [i.__dict__ for i in self.indexes],
        }

    @classmethod
    def from_json(cls, doc: dict) -> TableExtras:
        return cls(
            tuple(
                ColumnExtras(**{**c, "sequence": SequenceOptions(**c["sequence"]) if c["sequence"] else None})
                for c in doc["columns"]
            ),
            doc["key_name"],
            tuple((n, d) for n, d in doc["constraints"]),
            tuple(Index(**i) for i in doc["indexes"]),
        )


# The extras of each table named in the array, by its name and as TableExtras.to_json's document (a
# name with no such table: no row); read with search_path = pg_catalog. One statement for all of a
# snapshot's tables: read one by one, 200 tables cost 200 savepoints and reads at its start. A column's default that uses a sequence (ds) is its "sequence" when it is
# plain nextval() of it on an integer column (and the sequence's name is "shared" when the column
# does not own it, as serial makes it own), and left out otherwise: an expression is not lr's to
# rewrite. An index whose definition does not start as the catalog says it does (never seen) is left out.
_EXTRAS = """
WITH t AS (SELECT u.name, to_regclass(u.name) AS oid FROM unnest(%s::text[]) u(name))
SELECT t.name, jsonb_build_object(
  'columns', coalesce((SELECT jsonb_agg(jsonb_build_object(
      'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod), 'generated', a.attgenerated,
      'identity', a.attidentity,
      'expression', CASE WHEN ds.seq IS NULL OR ds.plain THEN pg_get_expr(d.adbin, d.adrelid) END,
      'collation', (SELECT quote_ident(n.nspname) || '.' || quote_ident(co.collname) FROM pg_collation co
                    JOIN pg_namespace n ON n.oid = co.collnamespace
                    WHERE co.oid = a.attcollation
                      AND co.oid <> (SELECT typcollation FROM pg_type WHERE oid = a.atttypid)),
      'sequence', (SELECT jsonb_build_object('type', format_type(s.seqtypid, NULL), 'start', s.seqstart,
                          'increment', s.seqincrement, 'min', s.seqmin, 'max', s.seqmax, 'cache', s.seqcache,
                          'cycle', s.seqcycle)
                   FROM pg_sequence s
                   WHERE s.seqrelid = CASE WHEN a.attidentity <> ''
                       THEN (SELECT dep.objid FROM pg_depend dep WHERE dep.classid = 'pg_class'::regclass
                             AND dep.refobjid = t.oid AND dep.refobjsubid = a.attnum AND dep.deptype = 'i')
                       WHEN ds.plain THEN ds.seq END),
      'shared', CASE WHEN ds.plain AND NOT EXISTS (
                       SELECT 1 FROM pg_depend o WHERE o.classid = 'pg_class'::regclass AND o.objid = ds.seq
                       AND o.refobjid = t.oid AND o.refobjsubid = a.attnum AND o.deptype = 'a')
                     THEN (SELECT quote_ident(n.nspname) || '.' || quote_ident(sq.relname) FROM pg_class sq
                           JOIN pg_namespace n ON n.oid = sq.relnamespace WHERE sq.oid = ds.seq) END
    ) ORDER BY a.attnum)
    FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    LEFT JOIN LATERAL (
      SELECT dep.refobjid AS seq,
             a.atttypid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype)
             AND pg_get_expr(d.adbin, d.adrelid) = format('nextval(%%L::regclass)', dep.refobjid::regclass) AS plain
      FROM pg_depend dep JOIN pg_class sq ON sq.oid = dep.refobjid AND sq.relkind = 'S'
      WHERE dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid AND dep.refclassid = 'pg_class'::regclass
      ORDER BY 2 DESC LIMIT 1) ds ON true
    WHERE a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped), '[]'),
  'key_name', (SELECT conname FROM pg_constraint WHERE conrelid = t.oid AND contype = 'p'),
  'constraints', coalesce((SELECT jsonb_agg(jsonb_build_array(c.conname, pg_get_constraintdef(c.oid)) ORDER BY c.oid)
                  FROM pg_constraint c WHERE c.conrelid = t.oid AND c.contype IN ('c', 'u', 'x') AND c.convalidated),
                  '[]'),
  'indexes', coalesce((SELECT jsonb_agg(jsonb_build_object('name', ic.relname, 'unique', i.indisunique,
                        'using', substr(def.text, length(def.prefix) + 1)) ORDER BY i.indexrelid)
      FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
      CROSS JOIN LATERAL (
        SELECT pg_get_indexdef(i.indexrelid) AS text,
               format('CREATE %%sINDEX %%s ON %%s%%s.%%s USING ', CASE WHEN i.indisunique THEN 'UNIQUE ' END,
                      quote_ident(ic.relname), CASE WHEN ic.relkind = 'I' THEN 'ONLY ' END,
                      quote_ident(n.nspname), quote_ident(c.relname)) AS prefix
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = t.oid) def
      WHERE i.indrelid = t.oid AND i.indisvalid AND NOT i.indisprimary AND starts_with(def.text, def.prefix)
        AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conrelid = t.oid AND c.conindid = i.indexrelid)), '[]'))
FROM t WHERE t.oid IS NOT NULL"""


# The settings a constant of a default, constraint or index may be printed by (an interval by
# IntervalStyle, money by lc_monetary; the rest as at any text's other end), and the sink reads it
# by (``tables/create``): before, each site used its own, and a default of minus a day and two hours,
# printed '-1 2:00:00' by a source of the SQL standard's style, read minus a day plus two hours.
AS_PRINTED = {
    "DateStyle": "ISO",
    "IntervalStyle": "postgres",
    "TimeZone": "UTC",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "lc_monetary": "C",
}


def _printed() -> str:
    return "; ".join(f"SET LOCAL {name} = '{value}'" for name, value in AS_PRINTED.items())


def read(cur: psycopg2.extensions.cursor, table: sql.Composable) -> TableExtras | None:
    """The extras of ``table`` as ``cur``'s transaction sees it; None when there is no such table."""
    name = table.as_string(cur)
    return read_many(cur, [name]).get(name)


def read_many(cur: psycopg2.extensions.cursor, tables: Sequence[str]) -> dict[str, TableExtras]:
    """The extras of each of ``tables`` (quoted, qualified names) as ``cur``'s transaction sees them,
    by name, in one statement; a name with no such table is not in the answer. ``search_path`` is
    ``pg_catalog`` and the settings a constant's text depends on are fixed (``AS_PRINTED``: the sink
    reads the text under the same) for the read only (a savepoint rolled back: the caller's
    transaction, a snapshot's, goes on as it was)."""
    if not tables:
        return {}
    cur.execute("SAVEPOINT lr_extras; SET LOCAL search_path = pg_catalog, pg_temp; " + _printed())
    try:
        cur.execute(_EXTRAS, (list(tables),))
        rows = cur.fetchall()
    finally:
        cur.execute("ROLLBACK TO SAVEPOINT lr_extras; RELEASE SAVEPOINT lr_extras")
    return {name: TableExtras.from_json(doc) for name, doc in rows}
