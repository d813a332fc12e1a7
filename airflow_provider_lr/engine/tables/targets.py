"""Where a source's rows go on a sink: each federated table's *target* (the sink's table, its
shape, and whether the source is its primary origin or shares it), and the lookup a stream's sink
transactions make of them.

A target is read inside the transaction that applies to it, every time: the sink's table may be
altered, dropped and created again, its ``lr.sink_tables`` row may turn ``conflict``, another source
may take rows of it, between any two transactions. What a connection keeps across them is only
which tables its session's transactions used lately (``TargetLookup``), a statement prepared on it,
and text it composed: the targets of those tables are read again, all in one statement that rides
with the transaction's first one, so a stream's table change pays no round trip of its own for them
(three before, each planned anew: the session's row, the table's definition, its origin).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field, replace

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db import prepared, schema
from airflow_provider_lr.engine.db.encoding import as_json
from airflow_provider_lr.engine.db.prepared import Prepared
from airflow_provider_lr.engine.errors import SchemaMismatchError
from airflow_provider_lr.engine.tables.definition import (
    COMPOSITES_NOW,
    SHAPE_COLUMNS,
    TableDefinition,
    TableName,
    narrowed,
    read_definition,
    retyped,
    shape,
)
from airflow_provider_lr.engine.tables.sink_catalog import (
    ALWAYS,
    GUARDED,
    INHERITED,
    KEY_ALWAYS,
    REFERENCED,
    RULES,
    UNLOGGED,
    key_facts,
)


class TableState:
    SYNCING = "syncing"
    SYNCED = "synced"
    CONFLICT = "conflict"
    REFUSED = "refused"


@dataclass
class Target:
    """A sink table that takes a source's rows, and how (see ``tables.sink``'s rules)."""

    definition: TableDefinition
    source: str
    primary: bool  # rows of this source are the unlisted ones
    shared: bool  # another origin writes here too: keep lr.table_row_origin
    left_out: tuple[str, ...] = ()  # of the source's extras, when lr created the table now (tables/create)
    deferrable_key: bool = False  # the sink's primary key is DEFERRABLE: no ON CONFLICT arbiter (``tables.sink``)
    always: tuple[str, ...] = ()  # the sink's non-key GENERATED ALWAYS identity columns (``tables.upsert``)
    key_always: bool = False  # a key column is GENERATED ALWAYS: no UPDATE may move a key (``runs._moves``)
    # the sink's columns made another type than a lossless widening since its snapshot
    # (``definition.narrowed``), each with how: their changes are refused (the sink would change them)
    narrowed: tuple[tuple[str, str], ...] = ()
    guarded_by: str = ""  # lr's role at the sink, when the table's row-level security applies to it
    rules: str = (
        ""  # the sink table's rules that rewrite lr's writes to it (``sink_catalog.RULES``), quoted, comma-separated
    )
    unlogged: bool = False  # the sink's table is UNLOGGED: a crash of the sink empties it, lr's position stays
    referenced: bool = False  # a foreign key references it: key changes moved layer by layer (``runs.layers``)
    inherited: str = ""  # the sink table's inheritance children (not partitions: ``sink_catalog``), comma-separated
    # the user-defined types its columns hold that the sink altered since its snapshot so that the
    # source's values no longer read as they are (a composite reordered: ``definition.retyped``), each
    # with how: every change of the table is refused, unless it carries the source's types (V0049)
    retyped: tuple[str, ...] = ()

    @property
    def table(self) -> TableName:
        return self.definition.table

    def refuse_guarded(self, where: str) -> None:
        """Refuse to write the table while its row-level security applies to lr's role: its policies
        would hide rows from lr's updates and deletes (the snapshot's clearing too), which PostgreSQL
        then skips without an error: the sink kept rows the source deleted, and said it was synced."""
        if self.guarded_by:
            raise SchemaMismatchError(
                f"{where}: the row-level security of the sink's table {self.table} applies to {self.guarded_by}, "
                "the role lr applies it as: its policies could hide rows from lr's updates and deletes, which "
                f"would be skipped silently. Nothing was applied; exempt the role (ALTER ROLE {self.guarded_by} "
                "BYPASSRLS) or disable the table's row-level security"
            )
        if self.unlogged:
            raise SchemaMismatchError(
                f"{where}: the sink's table {self.table} is unlogged: a crash of the sink's server empties it while "
                "lr's position there stays, so the rows it held would be lost silently. Nothing was applied; "
                f"make it logged (ALTER TABLE {self.table} SET LOGGED)"
            )
        if self.inherited:
            first = self.inherited.split(", ")[0]
            raise SchemaMismatchError(
                f"{where}: the sink's table {self.table} has inheritance children ({self.inherited}): a DELETE or "
                "UPDATE of a table reaches its children's rows too, so lr's deletes, key moves and a snapshot's or "
                "TRUNCATE's clearing would change rows that are not the source's, silently. Nothing was applied; take "
                f"them out of the hierarchy (ALTER TABLE {first} NO INHERIT {self.table}) or sync into a table "
                "without children (a partitioned table's partitions are fine)"
            )
        if self.rules:
            first = self.rules.split(", ")[0]
            raise SchemaMismatchError(
                f"{where}: the sink's table {self.table} has rules that rewrite lr's writes to it ({self.rules}): "
                "a DO INSTEAD rule would skip or redirect its changes silently, and PostgreSQL refuses lr's upserts "
                "on a table with INSERT or UPDATE rules. Nothing was applied; drop them "
                f"(DROP RULE {first} ON {self.table}) or disable them (ALTER TABLE {self.table} DISABLE RULE {first})"
            )

    def refuse_retyped(self, where: str) -> None:
        """Refuse a change of the table when a type its columns hold was altered at the sink since its
        snapshot (``retyped``): a composite's value travels by position, so a sink whose ``public.pair``
        became ``(b, a)`` took the source's ``(a, b)`` values with their fields swapped, silently."""
        if self.retyped:
            raise SchemaMismatchError(
                f"{where}: a type of the sink's table {self.table} changed at the sink since its snapshot: "
                f"{'; '.join(self.retyped)}. Nothing of the batch was applied; give the sink's type the source's "
                "definition again (ALTER TYPE ... at the sink), and the batch is applied"
            )

    def refuse_narrowed(self, columns: Iterable[str], where: str) -> None:
        """Refuse a change of ``columns`` when one of them was made another type at the sink since its
        snapshot than a lossless widening: the sink would take its value rounded, cut or read in
        another zone, silently (a too-long text failed with PostgreSQL's raw error)."""
        wanted = set(columns)
        narrow = [why for column, why in self.narrowed if column in wanted]
        if narrow:
            raise SchemaMismatchError(
                f"{where}: the sink's table {self.table} changed since its snapshot: {'; '.join(narrow)}, which "
                "would round, cut or otherwise change its values (docs/tables.md lists the widenings that keep "
                "them). Nothing of the batch was applied; give the sink's column the source's type (ALTER TABLE "
                "... ALTER COLUMN ... TYPE) or a widening of it"
            )

    @property
    def note(self) -> str | None:
        """What ``lr status`` says on the table's line when lr created it here without some extras."""
        return f"created here without {'; '.join(self.left_out)}" if self.left_out else None

    def key_object(self, row: sql.Composable, value: Callable[[str], sql.Composable] | None = None) -> sql.Composed:
        """The jsonb form of a row's key (``row.k``; ``row`` an alias or a record expression; or
        ``value(k)``), as the origin ledger stores it."""
        parts = []
        for k in self.definition.key:
            parts += [sql.Literal(k), value(k) if value else sql.SQL("{}.{}").format(row, sql.Identifier(k))]
        return sql.SQL("jsonb_build_object({})").format(sql.SQL(", ").join(parts))


# (primary, others) of source {s}'s rows in table {t}: whether {s} is the table's primary origin, and
# whether another origin writes the table (another source syncing it, or rows listed under one)
_ORIGIN = (
    "(SELECT source_site_id FROM lr.registry WHERE stream_name = {t}) IS NOT DISTINCT FROM {s}, "
    "EXISTS (SELECT 1 FROM lr.sink_tables WHERE table_name = {t} AND source_site_id <> {s} "
    "AND state IN ('syncing', 'synced')) OR EXISTS (SELECT 1 FROM lr.table_row_origin WHERE table_name = {t})"
)


def _primary_shared(primary: bool | None, others: bool | None) -> tuple[bool, bool]:
    return bool(primary), bool(others) or not primary


def origin(cur: psycopg2.extensions.cursor, table: TableName, source: str) -> tuple[bool, bool]:
    """(primary, shared) of ``source``'s rows in ``table`` (see ``tables.sink``'s rules)."""
    cur.execute("SELECT " + _ORIGIN.format(t="%(t)s", s="%(s)s"), {"t": str(table), "s": source})
    return _primary_shared(*cur.fetchone())


COLUMN_TYPES_SCHEMA = 40  # V0040: lr.sink_tables.column_types
COMPOSITES_SCHEMA = 52  # V0052: lr.sink_tables.composites


def types_at_snapshot(cur: psycopg2.extensions.cursor, table: TableName) -> dict[str, object]:
    """What a sink's row of ``table`` records as it is synced: its columns' types now, in the
    snapshot's transaction (the source's: the snapshot refused others), against which a column
    narrowed later is found (``Target.narrowed``). Nothing on a sink older than V0040."""
    if not schema.at_least(cur.connection, COLUMN_TYPES_SCHEMA):
        return {}
    sink_def = read_definition(cur, table)
    if sink_def is None:
        return {}
    recorded: dict[str, object] = {"column_types": as_json({c.name: c.type for c in sink_def.columns})}
    if schema.at_least(cur.connection, COMPOSITES_SCHEMA):  # and the types its columns hold (none: NULL)
        recorded["composites"] = as_json([list(c) for c in sink_def.composites]) if sink_def.composites else None
    return recorded


def target_of(cur: psycopg2.extensions.cursor, source: str, table: TableName, where: Callable[[], str]) -> Target:
    """The target of a table this sink already takes from ``source`` (nothing created)."""
    sink_def = read_definition(cur, table)
    if sink_def is None:
        raise _gone(table, where)
    return Target(sink_def, source, *origin(cur, table, source), **key_facts(cur, table))


def _gone(table: TableName, where: Callable[[], str]) -> SchemaMismatchError:
    return SchemaMismatchError(f"{where()}: table {table} no longer exists on the sink")


@dataclass(frozen=True)
class Gone:
    """A table the session syncs that the sink no longer has: refused when a change of it comes."""

    table: TableName


Found = Target | Gone | None  # None: not synced here (a conflict's changes are dropped)

# For each of the session's tables %(tids)s (source table ids) that it has in lr.sink_tables: its name,
# state, oid (NULL: no such table), shape, whether its primary key is deferrable, its non-key
# GENERATED ALWAYS identity columns, origin, types at the snapshot, row-level guard, rules, unlogged,
# inheritance children, whether a foreign key references it,
# the user-defined types its columns held at the snapshot and those they hold now (read only for a
# table that held some: the others pay nothing for it; V0052). Only the
# tables asked for are read (``LIMIT 1``: a table id twice, one of them, as before).
_TARGETS = (
    "SELECT st.tid, st.table_name, st.state, t.oid, "
    + SHAPE_COLUMNS
    + ", (SELECT NOT i.indimmediate FROM pg_catalog.pg_index i WHERE i.indrelid = t.oid AND i.indisprimary), "
    + ALWAYS.format(oid="t.oid")
    + ", "
    + KEY_ALWAYS.format(oid="t.oid")
    + ", "
    + _ORIGIN.format(t="st.table_name", s="%(source)s")
    + ", st.types, "
    + GUARDED.format(oid="t.oid")
    + ", "
    + RULES.format(oid="t.oid")
    + ", "
    + UNLOGGED.format(oid="t.oid")
    + ", "
    + INHERITED.format(oid="t.oid")
    + ", "
    + REFERENCED.format(oid="t.oid")
    + ", st.composites, "
    + COMPOSITES_NOW.format(recorded="st.composites")
    + " FROM pg_catalog.unnest(%(tids)s::int[]) w(tid) "
    # the types as the snapshot was taken (V0040, V0052; read so that a sink older than them reads none)
    "CROSS JOIN LATERAL (SELECT w.tid, s.table_name, s.state, pg_catalog.to_jsonb(s) -> 'column_types' AS types, "
    "NULLIF(pg_catalog.to_jsonb(s) -> 'composites', 'null'::pg_catalog.jsonb) AS composites "
    "FROM lr.sink_tables s WHERE s.source_site_id = %(source)s "
    "AND s.client_name = %(client)s AND s.source_table_id = w.tid LIMIT 1) st "
    "CROSS JOIN LATERAL (SELECT pg_catalog.to_regclass(pg_catalog.quote_ident(pg_catalog.split_part(st.table_name, "
    "'.', 1)) || '.' || pg_catalog.quote_ident(pg_catalog.split_part(st.table_name, '.', 2)))::oid AS oid) t"
)
# The sink's site id (for messages), then ``_TARGETS``' rows, each with its text form (what a
# ``CHECK`` expects). Always at least one row (the site id's).
LOOKUP_SQL = (
    "SELECT (SELECT site_id FROM lr.site_info), q.*, q::text FROM (SELECT 1) one LEFT JOIN LATERAL ("
    + _TARGETS
    + ") q ON true"
)
# ``_TARGETS`` read again, raising LR409 (V0023) unless its rows' text forms are %(expected)s, in
# table id order: the targets a transaction composed its statements from are still the sink's.
CHECK_SQL = (
    "SELECT lr.stream_expect(ARRAY(SELECT x::text FROM (" + _TARGETS + ") x ORDER BY x.tid) = %(expected)s, "
    "'the session''s tables changed on the sink since its last transaction')"
)

# prepared once per connection: planned, it costs ~0.5 ms more than it runs (~0.15 ms for a table,
# ~0.03 ms each more). Its generic plan is the one to run (``GENERIC``: PostgreSQL would otherwise
# plan it anew each time, expecting a plan for the actual tables to be cheaper). The name is
# versioned, so a connection that holds an older lr's statement is not confused by it.
LOOKUP = Prepared("lr_sink_targets_v9", LOOKUP_SQL, {"tids": "int4[]", "source": "text", "client": "text"})
CHECK = Prepared(
    "lr_sink_targets_check_v8", CHECK_SQL, {"tids": "int4[]", "source": "text", "client": "text", "expected": "text[]"}
)
GENERIC = "set_config('plan_cache_mode', 'force_generic_plan', true)"  # for the transaction

# How many tables a connection's lookup reads ahead for a session: those its transactions used
# most lately. A stream's transactions mostly change the same few tables; one beyond these costs
# one round trip when it comes.
READ_AHEAD = 4
KEPT_STATEMENTS = 64  # statements composed for a connection's targets, kept (then all forgotten)


@dataclass
class _Kept:
    """What a sink connection keeps across its transactions: hints and text, never a target."""

    used: dict[tuple[str, str], dict[int, None]] = field(default_factory=dict)  # session -> its table ids,
    # least lately used first
    statements: dict[Hashable, str] = field(default_factory=dict)  # ``TargetLookup.statement``
    last: dict[tuple[str, str], dict[int, tuple[Found, str]]] = field(default_factory=dict)  # session -> the
    # targets its transactions on this connection last read, each with its row's text form (``Expected``)


_KEPT: weakref.WeakKeyDictionary[psycopg2.extensions.connection, _Kept] = weakref.WeakKeyDictionary()


class TargetLookup:
    """The targets of one sink transaction of a session, read in the transaction: those of the tables
    the session's transactions on this connection used lately with the transaction's first statement
    (``open``), any other in a round trip of its own when it comes (``get``)."""

    def __init__(self, cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
        self.cur, self.source, self.client = cur, source, client
        self.kept = _KEPT.setdefault(cur.connection, _Kept())
        self.used = self.kept.used.setdefault((source, client), {})
        self.found: dict[int, Found] = {}
        self.site_id = "this sink"  # for messages, once ``open`` read it

    def open(self, before: str) -> None:
        """Read the site id and the targets read ahead, in one round trip with ``before``: the caller's
        statements, among them ``GENERIC`` (the lookup runs its generic plan). The first on a
        connection prepares ``LOOKUP`` and ``CHECK`` on it, in this transaction (a prepared statement
        outlives the transaction, whatever its end); one gone (a pooler's ``DISCARD ALL``) fails this
        transaction, and the next prepares them again."""
        prepared.ensure(self.cur.connection, LOOKUP, CHECK)
        ahead = list(self.used)
        try:
            self.cur.execute(f"{before}; ".encode() + self._statement(ahead))
        except psycopg2.errors.InvalidSqlStatementName:
            prepared.forget(self.cur.connection)
            raise
        rows = self.cur.fetchall()
        self.site_id = rows[0][0] or self.site_id
        self._found(ahead, rows)

    def statement(self, key: Hashable, compose: Callable[[], sql.Composable]) -> str:
        """The text of the statement ``compose`` makes, kept on the connection under ``key`` (which
        names everything it is made of: a target's definition and origin, what it does): composing
        it costs more than sending it."""
        kept = self.kept.statements
        if key not in kept:
            if len(kept) >= KEPT_STATEMENTS:
                kept.clear()
            kept[key] = compose().as_string(self.cur)
        return kept[key]

    def get(self, tid: int, where: Callable[[], str]) -> Target | None:
        """The target of the session's table ``tid`` (None: its changes are dropped here); refuses
        (``SchemaMismatchError``) a table the sink no longer has."""
        if tid not in self.found:
            self.cur.execute(self._statement([tid]))
            self._found([tid], self.cur.fetchall())
        self.used.pop(tid, None)
        self.used[tid] = None  # the most lately used
        if len(self.used) > READ_AHEAD:
            del self.used[next(iter(self.used))]
        found = self.found[tid]
        if isinstance(found, Gone):
            raise _gone(found.table, where)
        return found

    def _statement(self, tids: list[int]) -> bytes:
        return self.cur.mogrify(LOOKUP.execute_sql, {"tids": tids, "source": self.source, "client": self.client})

    def _found(self, tids: Iterable[int], rows: list[tuple]) -> None:
        read: dict[int, tuple[Found, str]] = {}
        for (
            _site,
            tid,
            name,
            state,
            oid,
            columns,
            key,
            deferrable,
            always,
            key_always,
            primary,
            others,
            types,
            guard,
            rules,
            unlogged,
            inherited,
            referenced,
            composites_then,
            composites_now,
            text,
        ) in rows:
            if tid is None:  # the site id's row
                continue
            table = TableName.parse(name)
            if state == TableState.CONFLICT:
                read[tid] = (None, text)
            elif oid is None:
                read[tid] = (Gone(table), text)
            else:
                target = Target(shape(table, columns, key), self.source, *_primary_shared(primary, others))
                narrow = tuple(narrowed(types or {}, target.definition).items())
                target = replace(
                    target,
                    deferrable_key=bool(deferrable),
                    always=tuple(always or ()),
                    key_always=bool(key_always),
                    narrowed=narrow,
                    guarded_by=guard,
                    rules=rules,
                    unlogged=bool(unlogged),
                    inherited=inherited,
                    referenced=bool(referenced),
                    retyped=tuple(retyped(composites_then or (), composites_now or ())),
                )
                read[tid] = (target, text)
        last = self.kept.last.setdefault((self.source, self.client), {})
        if len(last) >= KEPT_STATEMENTS:
            last.clear()
        for tid in tids:
            self.found[tid] = read[tid][0] if tid in read else None
            if tid in read:
                last[tid] = read[tid]
            else:  # not synced here: only the general path drops its changes
                last.pop(tid, None)


@dataclass(frozen=True)
class Expected:
    """The targets a session's last transactions on a connection read, for a transaction that
    composes its statements from them without reading them first: ``check`` (sent ahead of those
    statements, in the same transaction) raises LR409 unless the sink still has them so."""

    found: dict[int, Target | None]  # None: a conflict's changes are dropped
    texts: list[str]  # the rows' text forms, in table id order

    def check(self, cur: psycopg2.extensions.cursor, source: str, client: str) -> bytes:
        tids = sorted(self.found)
        return cur.mogrify(
            CHECK.execute_sql, {"tids": tids, "source": source, "client": client, "expected": self.texts}
        )


def expected(conn: psycopg2.extensions.connection, source: str, client: str, tids: Iterable[int]) -> Expected | None:
    """The targets of ``tids`` as the session's transactions on ``conn`` last read them; None when one
    was not read there (or is gone from the sink: the general path refuses it), or ``CHECK`` is not
    prepared on ``conn``."""
    kept = _KEPT.get(conn)
    last = kept.last.get((source, client), {}) if kept is not None and prepared.ready(conn, CHECK) else {}
    found: dict[int, Target | None] = {}
    texts = []
    for tid in sorted(set(tids)):
        entry = last.get(tid)
        if entry is None:
            return None
        target, text = entry
        if isinstance(target, Gone):
            return None
        found[tid] = target
        texts.append(text)
    return Expected(found, texts)
