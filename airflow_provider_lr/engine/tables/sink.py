"""Federated tables at a sink: which apply here, and applying them.

Everything here runs inside a fenced ``SinkTransaction`` (or, for a Spark range, a transaction that
checked the session's epoch), with ``lr.applying`` set so the sink's own capture triggers, if the
table is federated onward from here, do not capture it again.

The rules (seed 002, CorfuDB #3502):

* a table this sink opened with ``is_federated = false`` is not applied and its registry entry is
  not overwritten (state ``conflict``, shown by ``lr status``);
* a table it never opened is created (from the source's definition) if missing, applied and
  registered, with the source as its *primary origin*;
* a table whose shape differs from the source's refuses the session (``SchemaMismatchError``)
  before anything of it is written;
* several sources into one table: rows belong to the primary origin (the source that registered
  the table here first, or this site when it opened the table itself) unless
  ``lr.table_row_origin`` lists them under another source; a snapshot or TRUNCATE from a source
  clears only that source's rows. Last writer wins on a key written by two sources.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.errors import SchemaMismatchError
from airflow_provider_lr.engine.source.log_reader import BaseSplit, LogRecord
from airflow_provider_lr.engine.tables.definition import TableDefinition, TableName, check_same, read_definition
from airflow_provider_lr.engine.vocabulary import SessionKey

FLUSH_BYTES = 4 << 20  # table changes buffered before they are applied (in the same transaction)


class TableState:
    SYNCING = "syncing"
    SYNCED = "synced"
    CONFLICT = "conflict"
    REFUSED = "refused"


@dataclass(frozen=True)
class SinkTable:
    """A session's table as the sink has it (``lr.sink_tables``)."""

    table: TableName
    source_table_id: int
    state: str
    run_id: str | None
    split: BaseSplit | None
    detail: str | None


def session_tables(cur: psycopg2.extensions.cursor, source: str, client: str) -> dict[TableName, SinkTable]:
    cur.execute(
        "SELECT table_name, source_table_id, state, run_id::text, split_snapshot, split_upto, detail "
        "FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s",
        (source, client),
    )
    found = {}
    for name, tid, state, run_id, snapshot, upto, detail in cur.fetchall():
        split = BaseSplit(snapshot, upto) if snapshot is not None and upto is not None else None
        found[TableName.parse(name)] = SinkTable(TableName.parse(name), tid, state, run_id, split, detail)
    return found


def record(cur: psycopg2.extensions.cursor, source: str, client: str, table: TableName, source_table_id: int,
           state: str, **values: object) -> None:
    """Upsert the session's row for ``table`` (columns not given keep their value, or NULL)."""
    cols = ["source_site_id", "client_name", "table_name", "source_table_id", "state", *values]
    params = [source, client, str(table), source_table_id, state, *values.values()]
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols[3:])
    cur.execute(
        f"INSERT INTO lr.sink_tables ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))}) "
        f"ON CONFLICT (source_site_id, client_name, table_name) DO UPDATE SET {updates}, updated_at = now()",
        params,
    )


def forget_session(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """A session's full sync starts over: each of its tables takes a new snapshot after it."""
    cur.execute("DELETE FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s AND state <> %s",
                (source, client, TableState.CONFLICT))


def applying(cur: psycopg2.extensions.cursor) -> None:
    """Mark the transaction as lr's apply: the capture triggers of this site leave it alone."""
    cur.execute("SELECT set_config('lr.applying', 'on', true)")


@dataclass
class Target:
    """A sink table that takes a source's rows, and how (see the module's rules)."""

    definition: TableDefinition
    source: str
    primary: bool  # rows of this source are the unlisted ones
    shared: bool  # another origin writes here too: keep lr.table_row_origin
    created: bool = False

    @property
    def table(self) -> TableName:
        return self.definition.table

    def key_object(self, row: sql.Composable) -> sql.Composed:
        """The jsonb form of a row's key (``row.k``; ``row`` an alias or a record expression), as
        the origin ledger stores it."""
        parts = []
        for k in self.definition.key:
            parts += [sql.Literal(k), sql.SQL("{}.{}").format(row, sql.Identifier(k))]
        return sql.SQL("jsonb_build_object({})").format(sql.SQL(", ").join(parts))


def prepare(cur: psycopg2.extensions.cursor, source: str, client: str, source_def: TableDefinition,
            where: str) -> Target | None:
    """The target for ``source_def``'s rows on this sink, creating and registering the table when
    the sink never opened it; None when the sink opened it as not federated (a conflict: nothing
    is applied, its registry entry is kept). Raises ``SchemaMismatchError`` on another shape."""
    table = source_def.table
    cur.execute("SELECT is_federated, source_site_id, kind FROM lr.registry WHERE stream_name = %s FOR UPDATE",
                (str(table),))
    row = cur.fetchone()
    if row is not None and row[2] != "table":
        raise SchemaMismatchError(f"{where}: {table} is registered on the sink as a {row[2]}, not a table")
    if row is not None and not row[0]:
        return None
    sink_def = read_definition(cur, table)
    created = False
    if sink_def is None:
        cur.execute(source_def.create_statement())
        sink_def, created = read_definition(cur, table), True
        assert sink_def is not None
    check_same(source_def, sink_def, where)
    if row is None:  # never opened here: registered, with this source as the primary origin
        cur.execute(
            "INSERT INTO lr.registry (stream_name, kind, is_federated, client_name, source_site_id, key_columns, "
            "stream_tags) VALUES (%s, 'table', true, %s, %s, %s, ARRAY[%s])",
            (str(table), client, source, list(sink_def.key), f"lrq_table_{client}"),
        )
    return Target(sink_def, source, *origin(cur, table, source), created=created)


def target_of(cur: psycopg2.extensions.cursor, source: str, table: TableName, where: Callable[[], str]) -> Target:
    """The target of a table this sink already takes from ``source`` (nothing created)."""
    sink_def = read_definition(cur, table)
    if sink_def is None:
        raise SchemaMismatchError(f"{where()}: table {table} no longer exists on the sink")
    return Target(sink_def, source, *origin(cur, table, source))


def origin(cur: psycopg2.extensions.cursor, table: TableName, source: str) -> tuple[bool, bool]:
    """(primary, shared) of ``source``'s rows in ``table`` (see the module's rules)."""
    cur.execute(
        "SELECT (SELECT source_site_id FROM lr.registry WHERE stream_name = %(t)s) IS NOT DISTINCT FROM %(s)s, "
        "EXISTS (SELECT 1 FROM lr.sink_tables WHERE table_name = %(t)s AND source_site_id <> %(s)s "
        "AND state IN ('syncing', 'synced')) OR EXISTS (SELECT 1 FROM lr.table_row_origin WHERE table_name = %(t)s)",
        {"t": str(table), "s": source},
    )
    primary, others = cur.fetchone()
    return bool(primary), bool(others) or not primary


def clear(cur: psycopg2.extensions.cursor, target: Target) -> None:
    """Remove the rows that came from ``target.source`` (before its snapshot, and on its TRUNCATE)."""
    t, name = target.definition.table.ident, str(target.table)
    if not target.shared:
        cur.execute(sql.SQL("DELETE FROM {}").format(t))
    elif target.primary:
        cur.execute(sql.SQL(
            "DELETE FROM {} x WHERE NOT EXISTS (SELECT 1 FROM lr.table_row_origin o WHERE o.table_name = {} "
            "AND o.key = {})").format(t, sql.Literal(name), target.key_object(sql.Identifier("x"))))
    else:
        cur.execute(sql.SQL(
            "DELETE FROM {} x USING lr.table_row_origin o WHERE o.table_name = {} AND o.source_site_id = {} "
            "AND o.key = {}").format(t, sql.Literal(name), sql.Literal(target.source), target.key_object(sql.Identifier("x"))))
        cur.execute("DELETE FROM lr.table_row_origin WHERE table_name = %s AND source_site_id = %s",
                    (name, target.source))


def upsert_from(cur: psycopg2.extensions.cursor, target: Target, staging: sql.Composable) -> int:
    """Rows of ``staging`` (same columns) into the table, replacing rows with the same key; the
    origin ledger follows when the table is shared. Returns the rows written."""
    d = target.definition
    cols = sql.SQL(", ").join(map(sql.Identifier, d.column_names))
    cur.execute(sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} {}").format(
        d.table.ident, cols, cols, staging, _on_conflict(d)))
    rows = max(cur.rowcount, 0)
    if target.shared:
        _ledger(cur, target, sql.SQL("SELECT {} AS key FROM {} s").format(target.key_object(sql.Identifier("s")), staging))
    return rows


def _on_conflict(d: TableDefinition) -> sql.Composed:
    rest = [c for c in d.column_names if c not in d.key]
    keys = sql.SQL(", ").join(map(sql.Identifier, d.key))
    if not rest:
        return sql.SQL("ON CONFLICT ({}) DO NOTHING").format(keys)
    return sql.SQL("ON CONFLICT ({}) DO UPDATE SET ({}) = ROW({})").format(
        keys, sql.SQL(", ").join(map(sql.Identifier, rest)),
        sql.SQL(", ").join(sql.SQL("EXCLUDED.{}").format(sql.Identifier(c)) for c in rest))


def _ledger(cur: psycopg2.extensions.cursor, target: Target, keys: sql.Composable) -> None:
    """Keep ``lr.table_row_origin`` for the rows upserted whose key objects ``keys`` yields: listed
    under a non-primary source; a primary source's rows leave the list."""
    if not target.primary:
        cur.execute(sql.SQL(
            "INSERT INTO lr.table_row_origin (table_name, key, source_site_id) SELECT DISTINCT {}, k.key, {} FROM ({}) k "
            "ON CONFLICT (table_name, key) DO UPDATE SET source_site_id = EXCLUDED.source_site_id").format(
            sql.Literal(str(target.table)), sql.Literal(target.source), keys))
    else:
        cur.execute(sql.SQL("DELETE FROM lr.table_row_origin o USING ({}) k WHERE o.table_name = {} AND o.key = k.key")
                    .format(keys, sql.Literal(str(target.table))))


@dataclass
class _Pending:
    ops: list[str] = field(default_factory=list)
    docs: list[bytes] = field(default_factory=list)


class ChangeApplier:
    """Applies a sink transaction's table changes (stream 3 records) in commit order, a few MiB at
    a time. Per table and flush, the changes are reduced to the last one per key (a whole-row upsert
    or a delete) and applied by two set statements; a TRUNCATE applies what came before it, then
    clears the source's rows. The source reads only the tables this session has synced, so every
    record here has a target (or a conflict, whose changes are dropped)."""

    def __init__(self, cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
        self.cur, self.source, self.client = cur, source, client
        self.targets: dict[int, Target | None] = {}
        self.pending: dict[int, _Pending] = {}
        self.bytes = 0
        self.applied = 0  # change entries
        self._armed = False

    def add(self, record: LogRecord) -> None:
        if not self._armed:
            applying(self.cur)
            self._armed = True
        tid = record.table_id
        assert tid is not None
        if tid not in self.targets:
            self.targets[tid] = self._target(tid)
        if self.targets[tid] is None:
            return  # conflict: dropped here
        pending = self.pending.setdefault(tid, _Pending())
        op = _op(record.message)
        if op == "t":
            self._apply(tid)
            clear(self.cur, self.targets[tid])  # type: ignore[arg-type]
            self.applied += 1
            return
        pending.ops.append(op)
        pending.docs.append(record.message)
        self.bytes += len(record.message)
        if self.bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for tid in list(self.pending):
            self._apply(tid)
        self.bytes = 0

    def _target(self, tid: int) -> Target | None:
        self.cur.execute(
            "SELECT table_name, state FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s "
            "AND source_table_id = %s", (self.source, self.client, tid))
        row = self.cur.fetchone()
        if row is None or row[1] == TableState.CONFLICT:
            return None  # not synced here: the source sends none (a conflict's are dropped)
        return target_of(self.cur, self.source, TableName.parse(row[0]), self._where)

    def _where(self) -> str:
        self.cur.execute("SELECT site_id FROM lr.site_info")
        return f"session {SessionKey(self.source, self.cur.fetchone()[0], self.client)}"

    def _apply(self, tid: int) -> None:
        pending = self.pending.pop(tid, None)
        target = self.targets.get(tid)
        if not pending or not pending.ops or target is None:
            return
        d = target.definition
        params = {"ops": pending.ops, "docs": [psycopg2.Binary(m) for m in pending.docs],
                  "cols": d.column_names, "keys": list(d.key)}
        src = sql.SQL(
            "SELECT t.ord, r.i, t.op, r.d FROM unnest(%(ops)s::text[], %(docs)s::bytea[]) WITH ORDINALITY AS t(op, doc, ord) "
            "CROSS JOIN LATERAL jsonb_array_elements(convert_from(t.doc, 'UTF8')::jsonb -> 'rows') WITH ORDINALITY AS r(d, i)")
        self.cur.execute(sql.SQL(
            "SELECT count(*) FROM ({}) s WHERE (s.op = 'u' AND ((s.d - %(cols)s::text[]) <> '{{}}'::jsonb "
            "OR NOT s.d ?& %(cols)s::text[])) OR (s.op = 'd' AND NOT s.d ?& %(keys)s::text[])").format(src), params)
        (bad,) = self.cur.fetchone()
        if bad:
            raise SchemaMismatchError(
                f"{self._where()}: {bad} changed rows of {target.table} do not fit the sink's table "
                f"(columns {', '.join(d.column_names)}): the source's table changed shape. Nothing of the batch "
                "was applied; give the sink's table the same columns"
            )
        key_of_p = sql.SQL(", ").join(sql.SQL("(s.p).{}").format(sql.Identifier(k)) for k in d.key)
        ch = sql.SQL(
            "SELECT DISTINCT ON ({key}) s.op, s.p FROM (SELECT src.ord, src.i, src.op, "
            "jsonb_populate_record(NULL::{t}, src.d) AS p FROM ({src}) src) s ORDER BY {key}, s.ord DESC, s.i DESC"
        ).format(key=key_of_p, t=d.table.ident, src=src)
        x_key = sql.SQL(", ").join(sql.SQL("x.{}").format(sql.Identifier(k)) for k in d.key)
        c_key = sql.SQL(", ").join(sql.SQL("(ch.p).{}").format(sql.Identifier(k)) for k in d.key)
        c_cols = sql.SQL(", ").join(sql.SQL("(ch.p).{}").format(sql.Identifier(c)) for c in d.column_names)
        cols = sql.SQL(", ").join(map(sql.Identifier, d.column_names))
        ledger = sql.SQL("")
        if target.shared:
            key_obj = target.key_object(sql.SQL("(ch.p)"))
            name = sql.Literal(str(target.table))
            if target.primary:
                ledger = sql.SQL(", own AS (DELETE FROM lr.table_row_origin o USING ch WHERE o.table_name = {} "
                                 "AND o.key = {})").format(name, key_obj)
            else:
                ledger = sql.SQL(
                    ", own AS (DELETE FROM lr.table_row_origin o USING ch WHERE ch.op = 'd' AND o.table_name = {n} "
                    "AND o.key = {k}), mine AS (INSERT INTO lr.table_row_origin (table_name, key, source_site_id) "
                    "SELECT {n}, {k}, {s} FROM ch WHERE ch.op = 'u' ON CONFLICT (table_name, key) "
                    "DO UPDATE SET source_site_id = EXCLUDED.source_site_id)").format(
                    n=name, k=key_obj, s=sql.Literal(self.source))
        self.cur.execute(sql.SQL(
            "WITH ch AS ({ch}), gone AS (DELETE FROM {t} x USING ch WHERE ch.op = 'd' AND ({xk}) = ({ck})){ledger} "
            "INSERT INTO {t} ({cols}) SELECT {ccols} FROM ch WHERE ch.op = 'u' {conflict}"
        ).format(ch=ch, t=d.table.ident, xk=x_key, ck=c_key, ledger=ledger, cols=cols, ccols=c_cols,
                 conflict=_on_conflict(d)), params)
        self.applied += len(pending.ops)


def _op(message: bytes) -> str:
    """The change's operation: jsonb prints keys by length, so a message starts ``{"op": "x"``."""
    if not message.startswith(b'{"op": "') or len(message) < 10:
        raise SchemaMismatchError(f"a table change that is not lr's capture format: {message[:40]!r}")
    return chr(message[8])
