"""Federated tables at a sink: which apply here, and applying them.

Everything here runs inside a fenced ``SinkTransaction`` (or, for a Spark range, a transaction that
checked the session's epoch), with ``lr.applying`` set so the sink's own capture triggers, if the
table is federated onward from here, do not capture it again.

The rules (CorfuDB's federated-table rules, its issue #3502):

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

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine.db.encoding import require_utf8
from airflow_provider_lr.engine.errors import ApplyError, SchemaMismatchError, one_line
from airflow_provider_lr.engine.source.log_reader import BaseSplit, LogRecord
from airflow_provider_lr.engine.tables.clearing import clearing, clearing_together
from airflow_provider_lr.engine.tables.create import create_table
from airflow_provider_lr.engine.tables.definition import (
    COMPOSITES_OF,
    EXPECT_COMPOSITES,
    TableDefinition,
    TableName,
    changed_composites,
    changed_types,
    check_same,
    misfit,
    read_definition,
)
from airflow_provider_lr.engine.tables.refusals import refusal_fix
from airflow_provider_lr.engine.tables.runs import Run, compose, layers
from airflow_provider_lr.engine.tables.sink_catalog import guards, key_facts
from airflow_provider_lr.engine.tables.targets import (
    GENERIC,
    Expected,
    TableState,
    Target,
    TargetLookup,
    origin,
    types_at_snapshot,
)
from airflow_provider_lr.engine.vocabulary import SessionKey

FLUSH_BYTES = 4 << 20  # table changes buffered before they are applied (in the same transaction)


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
    return sessions_tables(cur, source, [client])[client]


def sessions_tables(
    cur: psycopg2.extensions.cursor, source: str, clients: Sequence[str]
) -> dict[str, dict[TableName, SinkTable]]:
    """``session_tables`` of several clients of one source in ONE statement (a stream's check of
    all the sessions it writes to this sink)."""
    cur.execute(
        "SELECT client_name, table_name, source_table_id, state, run_id::text, split_snapshot, split_upto, detail "
        "FROM lr.sink_tables WHERE source_site_id = %s AND client_name = ANY(%s)",
        (source, list(clients)),
    )
    found: dict[str, dict[TableName, SinkTable]] = {client: {} for client in clients}
    for client, name, tid, state, run_id, snapshot, upto, detail in cur.fetchall():
        split = BaseSplit(snapshot, upto) if snapshot is not None and upto is not None else None
        found[client][TableName.parse(name)] = SinkTable(TableName.parse(name), tid, state, run_id, split, detail)
    return found


def record(
    cur: psycopg2.extensions.cursor,
    source: str,
    client: str,
    table: TableName,
    source_table_id: int,
    state: str,
    **values: object,
) -> None:
    """Upsert the session's row for ``table`` (columns not given keep their value, or NULL)."""
    values = {**values, **types_at_snapshot(cur, table)} if state == TableState.SYNCED else values
    cols = ["source_site_id", "client_name", "table_name", "source_table_id", "state", *values]
    params = [source, client, str(table), source_table_id, state, *values.values()]
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols[3:])
    cur.execute(
        f"INSERT INTO lr.sink_tables ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))}) "
        f"ON CONFLICT (source_site_id, client_name, table_name) DO UPDATE SET {updates}, updated_at = now()",
        params,
    )


KEPT_OUT = "opened on this sink with is_federated = false: its data is not applied here"


def keep_out(cur: psycopg2.extensions.cursor, table: TableName) -> None:
    """This site opened ``table`` as not federated: the copies it holds from sources take nothing more
    (state ``conflict``, its rows kept, its own now), as one it never had would take nothing. Before,
    a copy taken before the sink kept out stayed ``synced`` and took every later change."""
    cur.execute(
        "UPDATE lr.sink_tables SET state = %s, run_id = NULL, detail = %s, updated_at = now() "
        "WHERE table_name = %s AND state IN (%s, %s)",
        (TableState.CONFLICT, KEPT_OUT, str(table), TableState.SYNCING, TableState.SYNCED),
    )


def forget_session(
    cur: psycopg2.extensions.cursor, source: str, client: str, whole: Mapping[str, int] | None = None
) -> None:
    """A session's full sync starts over: each of its tables takes a new snapshot after it. A copy
    of a table its source closed takes none: in ``whole`` (table -> the closed table id) it is kept
    as synced, the full sync passing none of its changes (``closed_tables.whole_copies``)."""
    kept = whole or {}
    cur.execute(
        "DELETE FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s AND state <> %s "
        "AND NOT (state = %s AND (table_name, source_table_id) IN (SELECT * FROM unnest(%s::text[], %s::int[])))",
        (source, client, TableState.CONFLICT, TableState.SYNCED, list(kept), list(kept.values())),
    )


# lr's apply, whatever the sink's settings: money read as the capture prints it (lc_monetary C, V0041),
# an array's NULL element as NULL (array_nulls off refused {1,NULL} in an int[], made a text[]'s 'NULL')
_APPLYING = {"lr.applying": "on", "lc_monetary": "C", "array_nulls": "on"}
APPLYING_SQL = "SELECT " + ", ".join(f"set_config('{name}', '{value}', true)" for name, value in _APPLYING.items())
# a table change's sink transaction starts so: lr's apply, constraints as the source's, and the
# targets' read (prepared) planned generically
_OPEN = f"SET CONSTRAINTS ALL DEFERRED; {APPLYING_SQL}, {GENERIC}"


def applying(cur: psycopg2.extensions.cursor) -> None:
    """Mark the transaction as lr's apply: the capture triggers of this site leave it alone."""
    cur.execute(APPLYING_SQL)


def prepare(
    cur: psycopg2.extensions.cursor, source: str, client: str, source_def: TableDefinition, where: str
) -> Target | None:
    """The target for ``source_def``'s rows on this sink, creating and registering the table when
    the sink never opened it; None when the sink opened it as not federated (a conflict: nothing
    is applied, its registry entry is kept). Raises ``SchemaMismatchError`` on another shape."""
    table = source_def.table
    cur.execute(
        "SELECT is_federated, source_site_id, kind FROM lr.registry WHERE stream_name = %s FOR UPDATE", (str(table),)
    )
    row = cur.fetchone()
    if row is not None and row[2] != "table":
        raise SchemaMismatchError(f"{where}: {table} is registered on the sink as a {row[2]}, not a table")
    if row is not None and not row[0]:
        return None
    sink_def = read_definition(cur, table)
    left_out: tuple[str, ...] = ()
    if sink_def is None:
        left_out = create_table(cur, source_def, where)
        sink_def = read_definition(cur, table)
        assert sink_def is not None
    if source_def.mismatch(sink_def):  # refused: which of its columns are generated, to say so
        cur.execute(
            "SELECT a.attname::text FROM pg_catalog.pg_attribute a WHERE a.attrelid = pg_catalog.to_regclass(%s) "
            "AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated <> ''",
            (table.ident.as_string(cur),),
        )
        check_same(source_def, sink_def, where, [r[0] for r in cur.fetchall()])
    if row is None:  # never opened here: registered, with this source as the primary origin
        cur.execute(
            "INSERT INTO lr.registry (stream_name, kind, is_federated, client_name, source_site_id, key_columns, "
            "stream_tags) VALUES (%s, 'table', true, %s, %s, %s, ARRAY[%s])",
            (str(table), client, source, list(sink_def.key), f"lrq_table_{client}"),
        )
    target = Target(sink_def, source, *origin(cur, table, source), left_out, **key_facts(cur, table))
    target.guarded_by, target.rules, target.unlogged, target.inherited = guards(cur, table)
    target.refuse_guarded(where)
    return target


def clear(cur: psycopg2.extensions.cursor, target: Target) -> None:
    """Remove the rows that came from ``target.source`` (before its snapshot, and on its TRUNCATE)."""
    cur.execute(clearing(target))


class ChangeApplier:
    """Applies a sink transaction's table changes (stream 3 records) in the source's order, a few
    MiB at a time.

    The source's order is the order PostgreSQL accepted: transactions in commit order, statements
    in the order they ran, rows in the order each statement changed them. Replayed in that order,
    the sink's table after each source statement is as the source's was (within a statement, the
    keys an UPDATE moved away from are deleted first), so a sink table with the source's
    constraints accepts every valid history (a swap of UNIQUE values through a temporary
    one, a chain a->b->c->a, a value deleted under one key and inserted under another, key
    changes). Reducing changes to the last one per key would reorder them across keys and break
    exactly those. What the sink checks at commit, the source did too: the transaction sets its
    deferrable constraints DEFERRED (a source whose constraint is deferrable swaps in one
    statement; a sink with the same constraint checks the swap at commit, as the source did).

    For speed, consecutive changes of one table and one kind become one set statement (a run):
    deletes in one ``DELETE``; key changes (old keys with their new ones, V0049) in one statement
    that moves each row in place where it meets no other key, deletes it elsewhere
    (``runs._moves``); upserts in one ``INSERT ... ON CONFLICT DO UPDATE`` that takes its
    rows in order, cut before a key comes back (one statement cannot change a row twice, and the
    second change must follow what came between). A TRUNCATE applies what came before it, then
    clears the source's rows. The source reads only the tables this session has synced, so every
    record here has a target (or a conflict, whose changes are dropped).

    With ``expected`` (the targets the session's last transactions read: ``targets.expected``) it
    runs nothing: ``statements`` collects the transaction's statements, the check that the targets
    are still so first, for the caller to send with the rest of its transaction."""

    def __init__(
        self, cur: psycopg2.extensions.cursor, source: str, client: str, expected: Expected | None = None
    ) -> None:
        self.cur, self.source, self.client = cur, source, client
        self.lookup = TargetLookup(cur, source, client)
        self.targets: dict[int, Target | None] = {}
        self.runs: list[Run] = []
        self.clearing: list[Target] = []  # consecutive TRUNCATEs: cleared together (``clearing_together``)
        self.bytes = 0
        self.statements: list[bytes] | None = None
        self._here: str | None = None
        if expected is not None:
            require_utf8(cur.connection, f"session {SessionKey(source, 'this sink', client)}")
            self.targets = dict(expected.found)
            self.statements = [_OPEN.encode(), expected.check(cur, source, client)]
            self._here = f"session {SessionKey(source, 'this sink', client)}"

    def add(self, record: LogRecord) -> None:
        if self._here is None:  # marked as lr's apply (``applying``), constraints as the source's, and the
            # targets of the tables the session's last transactions used (``TargetLookup``): one round trip
            require_utf8(self.cur.connection, f"session {SessionKey(self.source, 'this sink', self.client)}")
            self.lookup.open(_OPEN)
            self._here = f"session {SessionKey(self.source, self.lookup.site_id, self.client)}"
        tid = record.table_id
        assert tid is not None
        if tid not in self.targets:
            assert self.statements is None, f"table {tid} is not among the expected targets"
            self.targets[tid] = self.lookup.get(tid, self._where)
        target = self.targets[tid]
        if target is None:
            return  # conflict: dropped here
        op = _op(record.message)
        if op == "t":
            if not self.clearing:
                self.flush()
            self.clearing.append(target)
            return
        self._clear()
        self._queue(tid, target, op, record.message)
        self.bytes += len(record.message)
        if self.bytes >= FLUSH_BYTES:
            self.flush()

    def _queue(self, tid: int, target: Target, op: str, message: bytes) -> None:
        """The entry's rows onto the runs, checked against the sink's columns. A row may lack columns
        the sink has, as PostgreSQL's logical replication allows (a column added at the sink first,
        then at the source: the changes captured in between do not carry it): an insert gives them
        the sink's default, an update keeps them. A column the sink lacks, or a key, refuses the batch."""
        d = target.definition
        entry = json.loads(message, parse_float=Decimal)
        rows, text = entry["rows"], tuple(entry.get("text", ()))
        columns, key_columns = set(d.column_names), set(d.key)
        carried = set(rows[0]) if rows and op == "u" else columns
        bad = sum(1 for r in rows if not key_columns <= set(r) or (op == "u" and not set(r) == carried <= columns))
        moved_to: list = []
        if op == "d" and "to" in entry:  # a key change (V0049): each old key with its row's new key
            op = "k"
            moved_to = entry["to"]
            bad += abs(len(moved_to) - len(rows)) + sum(1 for r in moved_to if not key_columns <= set(r))
        if bad:
            raise SchemaMismatchError(
                f"{self._where()}: {bad} changed rows of {target.table} do not fit the sink's table "
                f"(columns {', '.join(d.column_names)}): {misfit(d, rows)}. Nothing of the batch was applied"
            )
        changed = changed_types(d, entry.get("types") or {}, carried if op == "u" else key_columns)
        if changed:
            raise SchemaMismatchError(
                f"{self._where()}: the source's table {target.table} changed: {'; '.join(changed)}. Nothing of the "
                "batch was applied; give the sink's column the source's type or a widening of it (ALTER TABLE ... "
                "ALTER COLUMN ... TYPE)"
            )
        if entry.get("composites") is not None:
            self._same_composites(target, entry["composites"])
        else:  # the source's types are those of the snapshot: the sink's must still be
            target.refuse_retyped(self._where())
        target.refuse_guarded(self._where())
        if target.narrowed and not entry.get("types"):  # (a change of the source's type: checked above)
            target.refuse_narrowed(carried if op == "u" else key_columns, self._where())
        absent = tuple(c for c in d.column_names if c not in carried)
        floats = {c.name for c in d.columns if c.name in text and c.type in _FLOATS}
        run = self.runs[-1] if self.runs else None
        for n, row in enumerate(rows, start=1):
            key = _key(row, d.key, floats) if op == "u" else None
            if (
                run is None
                or (run.tid, run.op, run.text, run.absent) != (tid, op, text, absent)
                or key in run.keys
                or (target.deferrable_key and run.keys)  # one row a run: see ``_compose``
                or (op == "k" and n == 1 and target.referenced)  # a statement's moves a run: ``runs.layers``
            ):
                run = Run(tid, op, text, absent)
                self.runs.append(run)
            if key is not None:
                run.keys.add(key)
            run.take(message, n)
        if op == "k" and run is not None and target.referenced:  # in the order the source's key took them
            run.layers = layers([_key(r, d.key, floats) for r in rows], [_key(r, d.key, floats) for r in moved_to])

    def _same_composites(self, target: Target, carried: list) -> None:
        """Refuse a change whose composites (the source's, carried once they changed there: V0049)
        are not the sink's table's: checked by the sink in the transaction when it is composed without
        round trips (the stream's: it then takes this path, which reads them and says how they differ)."""
        if self.statements is not None:
            self.statements.append(
                self.cur.mogrify(
                    EXPECT_COMPOSITES, {"t": target.table.ident.as_string(self.cur), "carried": json.dumps(carried)}
                )
            )
            return
        self.cur.execute(COMPOSITES_OF, {"t": target.table.ident.as_string(self.cur)})
        differ = changed_composites(carried, self.cur.fetchone()[0] or [])
        if differ:
            raise SchemaMismatchError(
                f"{self._where()}: the composites of table {target.table} changed at the source since it was opened: "
                f"{'; '.join(differ)}. Nothing of the batch was applied; give the sink's types the source's definitions "
                "(ALTER TYPE ... at the sink), and the batch is applied"
            )

    def _clear(self) -> None:
        """Apply the TRUNCATEs queued (what came before them was applied first)."""
        if self.clearing:
            targets, self.clearing = self.clearing, []
            self._send(clearing_together(targets).as_string(self.cur).encode())

    def flush(self) -> None:
        """Apply the runs (or TRUNCATEs) queued, in order, in one round trip. The changes travel as
        their JSON text (UTF-8, as captured) on a UTF8 connection (lr's own are), not as
        bytea: a hex escape doubled every value in the statement (a 50 MB row: ~150 MB more)."""
        self._clear()
        runs, self.runs, self.bytes = self.runs, [], 0
        if runs:
            as_text = self.cur.connection.encoding in _UTF8  # else its encoding may not hold every character
            doc = bytes.decode if as_text else psycopg2.Binary
            self._send(
                *(
                    self.cur.mogrify(
                        self._statement(run, as_text),
                        {
                            "docs": [doc(m) for m in run.docs],
                            "lo": run.lo,
                            "hi": run.hi,
                            "text": list(run.text),
                            "layers": run.layers,
                        },
                    )
                    for run in runs
                )
            )

    def _send(self, *statements: bytes) -> None:
        """Run ``statements`` in the transaction (kept for the caller, with ``expected``); a refusal of
        the sink's (a constraint, trigger, privilege) is an ``ApplyError`` naming the table."""
        if self.statements is not None:
            self.statements += statements
            return
        try:
            self.cur.execute(b";\n".join(statements))  # (one statement: joined, it is not copied)
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            raise  # the sink went away (or a deadlock): not the data's fault, the caller retries as ever
        except psycopg2.Error as exc:
            failed = getattr(exc.diag, "table_name", None)
            tables = sorted({str(t.table) for t in self.targets.values() if t is not None})
            named = f"table {exc.diag.schema_name}.{failed}" if failed else f"changes of {', '.join(tables)}"
            if exc.pgcode == "23503" and failed:  # the foreign key's table, not always the one lr wrote
                named = f"changes of {', '.join(tables)}"
            raise ApplyError(
                f"{self._where()}: the sink refused {named}: {one_line(exc)}. Nothing of the batch was applied; "
                f"{refusal_fix(exc)}, and the next cycle applies the batch"
            ) from exc

    def _statement(self, run: Run, as_text: bool) -> str:
        target = self.targets[run.tid]
        assert target is not None
        t = target
        key = (t.definition, t.source, t.primary, t.shared, t.deferrable_key, t.always, t.key_always)
        return self.lookup.statement(
            (*key, run.op, run.text, run.absent, as_text, max(run.layers, default=0)),
            lambda: compose(target, run, as_text),
        )

    def _where(self) -> str:
        assert self._here is not None
        return self._here


_UTF8 = ("UTF8", "UNICODE")  # psycopg2's names of a UTF8 connection's encoding


_FLOATS = ("real", "double precision")


def _key(row: dict, key: Sequence[str], floats: set[str] | frozenset[str] = frozenset()) -> object:
    """A row's key as a hashable value, equal for two rows PostgreSQL sees under one key (numbers
    by value: 1.0 and 1.00 are one numeric, the texts -0 and 0 one float, NaN one NaN; composite and
    array parts as sorted JSON)."""
    parts = []
    for k in key:
        value = row[k]
        if k in floats and isinstance(value, str) and value != "NaN":
            value = float(value)  # -0.0 == 0.0, with one hash
        elif isinstance(value, Decimal):
            value = value.normalize()
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, default=str)
        parts.append(value)
    return tuple(parts)


def _op(message: bytes) -> str:
    """The change's operation: jsonb prints keys by length, so a message starts ``{"op": "x"``."""
    if not message.startswith(b'{"op": "') or len(message) < 10:
        raise SchemaMismatchError(f"a table change that is not lr's capture format: {message[:40]!r}")
    return chr(message[8])
