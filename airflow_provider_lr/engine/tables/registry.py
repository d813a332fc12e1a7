"""Which tables a site replicates (CorfuDB's federated tables): ``lr.registry`` rows of kind ``table``.

Opening a table as federated for a client records it and installs its capture triggers (one
statement-level trigger per operation, ``lr.capture_table_changes``, V0008 as replaced since; given the client, the
table id, its columns' types (V0038) and the composites it holds, if any (V0049)): from the commit of
``open_table`` on, every change to the table is written to the shared log in the writer's
transaction, tagged for the client's sinks, under the same commit-position barrier as the client's
routing-queue messages. Each federation draws a new ``table_id``: a sink that synced an older one
takes a new snapshot (changes made while the table was not federated were never captured).

Opening it with ``federated=False`` records that this site does not replicate it: on a source the
capture stops; on a sink, data for it from any source is dropped and its registry entry is kept.

A failover moves a table's capture (``tables/handover``): the promoted site federates it here
(``federate``), the old source's capture triggers become guards that refuse its applications'
writes (``guard_writes``, ``lr.refuse_table_writes`` in V0014); opening the table again drops them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.local_settings import on_callers_connection
from airflow_provider_lr.engine.errors import TableError
from airflow_provider_lr.engine.source import closed_tables, moved
from airflow_provider_lr.engine.tables import closed_notes, sink
from airflow_provider_lr.engine.tables.capturable import (
    not_capturable,
    unread_held_keys,
    without_binary_copy,
    without_key,
)
from airflow_provider_lr.engine.tables.definition import TableName, read_definition

log = logging.getLogger(__name__)

_TRIGGERS = {  # operation -> its transition tables (statement-level triggers see all rows at once)
    "INSERT": "REFERENCING NEW TABLE AS lr_new",
    "UPDATE": "REFERENCING OLD TABLE AS lr_old NEW TABLE AS lr_new",
    "DELETE": "REFERENCING OLD TABLE AS lr_old",
    "TRUNCATE": "",
}
OPERATIONS = tuple(_TRIGGERS)


def trigger_name(operation: str) -> str:
    return f"lr_capture_{operation.lower()}"


def guard_name(operation: str) -> str:
    """The old source's guard after a failover handed the table over (``guard_writes``)."""
    return f"lr_refuse_{operation.lower()}"


def is_closed(federated: bool | None, table_id: int | None, source_site_id: str | None) -> bool:
    """A registry row of a table opened here as federated, then closed (``close_table``): still
    registered, captured no more (a sink's row names its source instead)."""
    return bool(federated) and table_id is None and source_site_id is None


@dataclass(frozen=True)
class RegisteredTable:
    table: TableName
    federated: bool
    client_name: str | None
    table_id: int | None  # this site's current federation of it (None: not captured here)
    source_site_id: str | None  # sink side: the source that registered it here first
    closed_onward: bool = False  # its copy federated onward from here (both ways), closed since (``list_tables``)

    @property
    def closed(self) -> bool:
        return is_closed(self.federated, self.table_id, self.source_site_id)

    def describe(self) -> str:
        if self.closed_onward:
            return f"{self.table} closed (not captured; its sinks keep their copy) client={self.client_name or '-'}"
        if self.source_site_id and self.federated and self.table_id is None:  # a sink's registration
            return (
                f"{self.table} registered by {self.source_site_id} client={self.client_name or '-'}, no copy held now"
            )
        flag = "federated" if self.federated else "not federated"
        flag = "closed (not captured; its sinks keep their copy)" if self.closed else flag
        origin = f" (from {self.source_site_id})" if self.source_site_id else ""
        return f"{self.table} {flag} client={self.client_name or '-'}{origin}"


@dataclass(frozen=True)
class HeldCopy:
    """A copy of a source's federated table this site holds as its sink (``lr.sink_tables``)."""

    table: TableName
    source_site_id: str
    client_name: str
    state: str  # syncing, synced, conflict, refused
    source_table_id: int
    rows: int | None  # rows of its last snapshot
    closed_at_source: bool = False  # its source told this site of a close (``closed_notes``)

    def describe(self, closed_at_source: bool = False) -> str:
        rows = f", {self.rows} rows in its snapshot" if self.rows is not None else ""
        shut = f" (closed at {self.source_site_id}: this copy is kept, no longer updated)" if closed_at_source else ""
        return f"{self.table} copy from {self.source_site_id} client={self.client_name}: {self.state}{rows}{shut}"


@on_callers_connection
def list_copies(conn: psycopg2.extensions.connection) -> list[HeldCopy]:
    """Every copy of a federated table this site holds as a sink, by name and source: ``lr tables
    list`` said "no tables registered" at a sink that held them, or called them federated."""
    noted = "closed_at_source" if schema.at_least(conn, closed_notes.CLOSED_MARKS_SCHEMA) else "false"
    found = _read_all(
        conn,
        f"SELECT table_name, source_site_id, client_name, state, source_table_id, rows_copied, {noted} "
        "FROM lr.sink_tables ORDER BY table_name, source_site_id, client_name",
    )
    return [HeldCopy(TableName.parse(r[0]), *r[1:]) for r in found]


def _read_all(conn: psycopg2.extensions.connection, statement: str) -> list[tuple]:
    """The rows of ``statement``, its transaction ended (what ``lr tables list`` reads)."""
    with conn.cursor() as cur:
        cur.execute(statement)
        found = cur.fetchall()
    conn.rollback()
    return found


@on_callers_connection
def open_table(conn: psycopg2.extensions.connection, name: str, client: str, federated: bool = True) -> RegisteredTable:
    """Record ``name`` for ``client`` on this site and start (``federated``) or stop capturing it.
    One transaction; idempotent (re-opening a federated table as federated changes nothing)."""
    table = TableName.parse(name)
    try:
        with conn.cursor() as cur:
            # FOR SHARE: a switchover's drain (FOR UPDATE) sees this table opened, or this sees it switched
            cur.execute("SELECT 1 FROM lr.clients WHERE client_name = %s FOR SHARE", (client,))
            if federated and cur.fetchone() is None:
                raise TableError(
                    f"client {client!r} is not in the topology applied to this site; "
                    "apply a topology that replicates it first"
                )
            elsewhere = moved.not_sourced_here(cur, client) if federated else None
            if elsewhere is not None:  # its changes would be captured into a log no session reads
                raise TableError(
                    f"client {client!r} is not replicated from this site: {elsewhere}; open the table there"
                )
            current = read(cur, table, lock=True)
            if federated:
                result = federate(cur, table, client, current)
            else:
                stop_capture(cur, table)
                sink.keep_out(cur, table)
                if current is not None and current.table_id is not None:
                    _note_closed(conn, cur, table)
                cur.execute(
                    "INSERT INTO lr.registry (stream_name, kind, is_federated, client_name) VALUES (%s, 'table', false, %s) "
                    "ON CONFLICT (stream_name) DO UPDATE SET is_federated = false, client_name = EXCLUDED.client_name, "
                    "table_id = NULL, key_columns = NULL, registered_at = now() WHERE lr.registry.kind = 'table'",
                    (str(table), client),
                )
                written = read(cur, table)
                if written is None or written.federated:
                    raise TableError(f"{table} is registered here as something else than a table")
                result = written
        conn.commit()
        return result
    except BaseException:
        conn.rollback()
        raise


@on_callers_connection
def close_table(conn: psycopg2.extensions.connection, name: str) -> RegisteredTable:
    """Stop replicating ``name`` from this site (the counterpart of PostgreSQL's ``ALTER PUBLICATION
    ... DROP TABLE``): its capture triggers are dropped and its registry row is kept, closed (no
    ``table_id``), so no session carries it any more. Changes committed before stay in the log and
    reach the sinks; the sinks keep their copy, which is no longer updated. ``open_table`` again
    draws a new ``table_id``: each sink then takes a new snapshot. One transaction."""
    table = TableName.parse(name)
    try:
        with conn.cursor() as cur:
            current = read(cur, table, lock=True)
            if current is None:
                raise TableError(f"{table} is not registered on this site (lr tables list shows what is)")
            if not current.federated:
                raise TableError(f"{table} is opened here as not federated: nothing to close")
            if current.closed:
                conn.rollback()
                return current
            if current.table_id is None:
                raise TableError(
                    f"{table} is not captured on this site: it is a sink's copy from "
                    f"{current.source_site_id}; close it at its source"
                )
            stop_capture(cur, table)
            cur.execute(  # renamed at the source: its triggers went with it
                "SELECT " + _RENAMED.format(name="%(name)s", client="%(client)s", tid="%(tid)s"),
                {"name": str(table), "client": current.client_name, "tid": current.table_id},
            )
            renamed_to = cur.fetchone()[0]
            if renamed_to is not None:
                for operation in _TRIGGERS:
                    cur.execute(
                        sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
                            sql.Identifier(trigger_name(operation)), sql.Identifier(*renamed_to)
                        )
                    )
            _note_closed(conn, cur, table)
            cur.execute(
                "UPDATE lr.registry SET table_id = NULL, registered_at = now() "
                "WHERE stream_name = %s AND kind = 'table'",
                (str(table),),
            )
            result = read(cur, table)
            assert result is not None and result.table_id is None  # (a copy federated onward still names its origin)
        conn.commit()
        return result
    except BaseException:
        conn.rollback()
        raise


def _note_closed(conn: psycopg2.extensions.connection, cur: psycopg2.extensions.cursor, table: TableName) -> None:
    """Keep the table id of the federation a close ends (V0031): its changes committed before
    stay in the log under it, and a forced full sync of a sink that has not received them waits
    for them or is refused (``closed_tables.wait_for_closes``); before, the full sync passed
    them and the sink's copy lacked them for good."""
    if schema.at_least(conn, closed_tables.CLOSED_TABLE_ID_SCHEMA):
        cur.execute(
            "UPDATE lr.registry SET closed_table_id = table_id WHERE stream_name = %s AND kind = 'table' "
            "AND table_id IS NOT NULL",
            (str(table),),
        )


def federate(
    cur: psycopg2.extensions.cursor, table: TableName, client: str, current: RegisteredTable | None
) -> RegisteredTable:
    definition = read_definition(cur, table)
    if definition is None:
        raise TableError(f"table {table} does not exist on this site")
    why = not_capturable(cur, table)
    if why:
        raise TableError(f"table {table} cannot be federated: {why}")
    if not definition.key:
        raise TableError(without_key(cur, table))
    why = unread_held_keys(cur, table)
    if why:
        raise TableError(f"table {table} cannot be federated: {why}")
    generated = [k for k in definition.key if k not in definition.column_names]  # the shape leaves them out
    if generated:
        raise TableError(
            f"table {table} cannot be federated: its primary key has generated columns ({', '.join(generated)}), "
            "which each site computes itself while lr applies changes by key; key it by ordinary columns"
        )
    copyless = without_binary_copy(cur, table)
    if copyless:
        raise TableError(
            f"table {table} cannot be federated: column(s) {', '.join(copyless)} have a type without binary "
            "input and output (a snapshot's COPY needs them) or one of PostgreSQL's internal types (no site "
            "accepts their values from a client): lr cannot carry it to another site; store such a value as "
            "text (or drop the column) before opening it"
        )
    if (
        current
        and current.federated
        and current.client_name == client
        and current.table_id is not None
        and capturing(cur, table)
    ):
        fire_always(cur, table, [trigger_name(op) for op in _TRIGGERS])  # opened before V0044: now
        return current
    cur.execute("SELECT nextval('lr.table_id_seq')")
    (table_id,) = cur.fetchone()
    cur.execute(
        "INSERT INTO lr.registry (stream_name, kind, is_federated, client_name, table_id, key_columns, stream_tags) "
        "VALUES (%s, 'table', true, %s, %s, %s, ARRAY[%s]) "
        "ON CONFLICT (stream_name) DO UPDATE SET is_federated = true, client_name = EXCLUDED.client_name, "
        "table_id = EXCLUDED.table_id, key_columns = EXCLUDED.key_columns, stream_tags = EXCLUDED.stream_tags, "
        "registered_at = now() WHERE lr.registry.kind = 'table'",
        (str(table), client, table_id, list(definition.key), f"lrq_table_{client}"),
    )
    if cur.rowcount != 1:
        raise TableError(f"{table} is registered here as something else than a table")
    stop_capture(cur, table)
    # the columns' types now: a statement made after one of them changed carries them (V0038)
    # and the composites they hold, if any: a statement made after one of them changed carries them (V0049)
    cur.execute(
        "SELECT lr.capture_column_types(%(t)s::regclass), lr.capture_composites(%(t)s::regclass)",
        {"t": table.ident.as_string(cur)},
    )
    given = [sql.Literal(v) for v in (client, str(table_id), *cur.fetchone()) if v is not None]
    for operation, referencing in _TRIGGERS.items():
        cur.execute(
            sql.SQL(
                "CREATE TRIGGER {} AFTER {} ON {} " + referencing + " FOR EACH STATEMENT"
                " EXECUTE FUNCTION lr.capture_table_changes({})"
            ).format(
                sql.Identifier(trigger_name(operation)), sql.SQL(operation), table.ident, sql.SQL(", ").join(given)
            )
        )
    fire_always(cur, table, [trigger_name(op) for op in _TRIGGERS])
    result = read(cur, table)
    assert result is not None
    return result


def fire_always(cur: psycopg2.extensions.cursor, table: TableName, triggers: list[str]) -> bool:
    """Make lr's ``triggers`` on ``table`` fire whatever the writer's ``session_replication_role``
    (V0044): in the role ``replica`` (a restore, another tool's apply) only ENABLE ALWAYS ones fire.
    Only the table's owner may alter it: lr's owner holding TRIGGER alone says what to run (False)."""
    statement = sql.SQL("ALTER TABLE {} ").format(table.ident) + sql.SQL(", ").join(
        sql.SQL("ENABLE ALWAYS TRIGGER {}").format(sql.Identifier(name)) for name in triggers
    )
    cur.execute("SAVEPOINT lr_always")
    try:
        cur.execute(statement)
    except psycopg2.errors.InsufficientPrivilege:
        cur.execute("ROLLBACK TO SAVEPOINT lr_always; RELEASE SAVEPOINT lr_always")
        log.warning(
            "%s: lr's triggers fire for writers in session_replication_role = origin only (lr's owner "
            "does not own the table): a writer in the role replica is not captured; the table's owner may run %s",
            table,
            statement.as_string(cur),
        )
        return False
    cur.execute("RELEASE SAVEPOINT lr_always")
    return True


def capturing(cur: psycopg2.extensions.cursor, table: TableName) -> bool:
    cur.execute(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND pg_catalog.starts_with(tgname, 'lr_capture_')",
        (table.ident.as_string(cur),),
    )
    return cur.fetchone()[0] == len(_TRIGGERS)


def capture_skipped(cur: psycopg2.extensions.cursor, table: TableName) -> list[str]:
    """The capture triggers of ``table`` that an ordinary writer's change does not fire: disabled
    (``ALTER TABLE ... DISABLE TRIGGER``, as a data-only restore with --disable-triggers runs and
    enables again at its end) or enabled for the role ``replica`` only."""
    cur.execute(
        "SELECT pg_catalog.array_agg(tgname::text ORDER BY tgname) FROM pg_catalog.pg_trigger "
        "WHERE tgrelid = pg_catalog.to_regclass(%s) AND pg_catalog.starts_with(tgname, 'lr_capture_') AND tgenabled IN ('D', 'R')",
        (table.ident.as_string(cur),),
    )
    return cur.fetchone()[0] or []


def stop_capture(cur: psycopg2.extensions.cursor, table: TableName) -> None:
    """Drop the table's capture triggers (and a failover's guards: the site decides anew)."""
    cur.execute("SELECT to_regclass(%s)", (table.ident.as_string(cur),))
    if cur.fetchone()[0] is None:
        return
    for operation in _TRIGGERS:
        for name in (trigger_name(operation), guard_name(operation)):
            cur.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(name), table.ident))


def guard_writes(cur: psycopg2.extensions.cursor, table: TableName, client: str, source: str) -> None:
    """Capture stops and applications' writes are refused (``lr.refuse_table_writes``, V0014): the
    table is ``source``'s now, written here by lr's apply only (a failover's old source)."""
    stop_capture(cur, table)
    for operation in _TRIGGERS:
        cur.execute(
            sql.SQL(
                "CREATE TRIGGER {} BEFORE {} ON {} FOR EACH STATEMENT EXECUTE FUNCTION lr.refuse_table_writes({}, {})"
            ).format(
                sql.Identifier(guard_name(operation)),
                sql.SQL(operation),
                table.ident,
                sql.Literal(client),
                sql.Literal(source),
            )
        )
    fire_always(cur, table, [guard_name(op) for op in _TRIGGERS])


def read(cur: psycopg2.extensions.cursor, table: TableName, lock: bool = False) -> RegisteredTable | None:
    cur.execute(
        "SELECT stream_name, is_federated, client_name, table_id, source_site_id FROM lr.registry "
        "WHERE stream_name = %s AND kind = 'table'" + (" FOR UPDATE" if lock else ""),
        (str(table),),
    )
    row = cur.fetchone()
    return None if row is None else RegisteredTable(TableName.parse(row[0]), *row[1:])


@on_callers_connection
def list_tables(conn: psycopg2.extensions.connection) -> list[RegisteredTable]:
    """Every table registered on this site, by name, and whether a copy federated onward from here
    was closed since (``closed_notes.CLOSED_ONWARD``)."""
    onward = closed_notes.CLOSED_ONWARD if schema.at_least(conn, closed_tables.CLOSED_TABLE_ID_SCHEMA) else "false"
    rows = _read_all(
        conn,
        f"SELECT stream_name, is_federated, client_name, table_id, source_site_id, {onward} FROM lr.registry "
        "WHERE kind = 'table' ORDER BY stream_name",
    )
    return [RegisteredTable(TableName.parse(r[0]), *r[1:]) for r in rows]


@dataclass(frozen=True)
class FederatedTable:
    table: TableName
    table_id: int
    renamed_to: tuple[str, str] | None = None  # (schema, name) its capture runs on now (renamed at the source)

    def renamed(self) -> str:
        """What to do about a table renamed at the source while it replicates (lr follows a table by its
        registered name: each sink applies to its table of that name, and a snapshot reads it so)."""
        assert self.renamed_to is not None
        schema, name = self.renamed_to
        now = ".".join(_quoted(part) for part in self.renamed_to)
        back = [f"ALTER TABLE {now} RENAME TO {self.table.name}"] if name != self.table.name else []
        if schema != self.table.schema:
            back.append(f"ALTER TABLE {_quoted(schema)}.{self.table.name} SET SCHEMA {self.table.schema}")
        said = (
            f"federated table {self.table} was renamed to {now} at the source, and lr replicates a table by its "
            f"name: its sessions wait (their changes stay in the log). Give it its name back ({'; '.join(back)}) "
            "and nothing is lost"
        )
        try:
            TableName.parse(f"{schema}.{name}")
        except TableError:  # a name lr cannot federate (quoted): back is the only way
            return said
        return (
            f"{said}; or replicate it under its new name: lr tables close {self.table}, then lr tables open "
            f"{schema}.{name} (each sink takes a snapshot of it; its copy of {self.table} stays as it was)"
        )


def _quoted(identifier: str) -> str:
    """``identifier`` as SQL spells it: plain when it is a plain lower-case name, else quoted."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", identifier):
        return identifier
    return '"' + identifier.replace('"', '""') + '"'


# The relation a table's capture triggers run on, by the table id and client they carry (a table renamed
# at the source keeps its triggers), when the relation of the registered name {name} has no such trigger
# (none has that name, or a table made since under it): looked for only then, by the triggers' name.
# Their first two arguments (a trigger made since V0038 has a third, the columns' types)
_ARGS = (  # a NUL byte by decode: a session whose standard_conforming_strings is off reads '\\x00' as a NUL character
    "pg_catalog.convert_to({client}, 'UTF8') || pg_catalog.decode('00', 'hex') "
    "|| pg_catalog.convert_to({tid}::text, 'UTF8') || pg_catalog.decode('00', 'hex')"
)
_RENAMED = (
    "CASE WHEN NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger h WHERE h.tgrelid = pg_catalog.to_regclass("
    "pg_catalog.quote_ident(pg_catalog.split_part({name}, '.', 1)) || '.' "
    "|| pg_catalog.quote_ident(pg_catalog.split_part({name}, '.', 2))) AND h.tgname = 'lr_capture_insert' "
    "AND pg_catalog.substring(h.tgargs, 1, pg_catalog.length(" + _ARGS + ")) = " + _ARGS + ") THEN ("
    "SELECT ARRAY[n.nspname::text, c.relname::text] "
    "FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE t.tgname = 'lr_capture_insert' "
    "AND pg_catalog.substring(t.tgargs, 1, pg_catalog.length(" + _ARGS + ")) = " + _ARGS + " LIMIT 1) END"
)


def federated_tables(conn: psycopg2.extensions.connection, client: str) -> list[FederatedTable]:
    """The client's tables this source captures now (the set every sync re-reads)."""
    return federated_tables_of(conn, [client])[client]


def federated_tables_of(
    conn: psycopg2.extensions.connection, clients: Iterable[str]
) -> dict[str, list[FederatedTable]]:
    """Each client's tables this source captures now, in ONE statement: a stream looks for newly
    federated tables every second for all its clients, which one read per client made a query per
    client per second on an idle source."""
    wanted = sorted(set(clients))
    idle = conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    with conn.cursor() as cur:
        cur.execute(
            "SELECT client_name, stream_name, table_id, "
            + _RENAMED.format(name="stream_name", client="client_name", tid="table_id")
            + " FROM lr.registry WHERE kind = 'table' AND is_federated "
            "AND client_name = ANY(%s) AND table_id IS NOT NULL ORDER BY client_name, stream_name",
            (wanted,),
        )
        rows = cur.fetchall()
    if idle:
        conn.rollback()
    out: dict[str, list[FederatedTable]] = {client: [] for client in wanted}
    for client, name, table_id, renamed_to in rows:
        out[client].append(FederatedTable(TableName.parse(name), table_id, tuple(renamed_to) if renamed_to else None))
    return out


def no_queue_data(ctx: object) -> None:
    """The full-sync provider of a client that has federated tables and no routing-queue data to
    supply: its full sync carries no messages, and its tables follow it by their own snapshot.
    The session uses it when the topology names no provider for such a client."""
