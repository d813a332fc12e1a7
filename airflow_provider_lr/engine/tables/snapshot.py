"""Snapshot sync of federated tables: a consistent read of the tables a session's sink lacks, from
one exported snapshot, written to the sink, then log-entry sync from exactly that snapshot.

The seam (the same base-split rule as a routing queue's full sync, ``BaseSplit``): the snapshot is
taken after every entry the sink has read is final, so each of them is in it; then ``upto``, the
commit positions drawn so far, is noted. A later change of the table is covered by the snapshot
when its position is <= ``upto`` and its transaction is visible in the snapshot; every other one is
applied as a log entry (``LogReader``'s ``TableSplits``). The session does not advance while the
snapshot is written (the cycle holding its lease does both), so nothing is lost or applied twice.

Two ways to write it:

* in process (``write``): per sink and table, ONE fenced sink transaction clears the source's rows,
  streams the rows in by binary COPY and records the table synced with its split: never half
  applied. Reading once for all the sinks that need the table.
* on Spark (``begin`` → ``range_copy.copy_range`` in parallel tasks → ``finish``): the tables' key ranges are
  read by tasks that join the exported snapshot (``SET TRANSACTION SNAPSHOT``); each range is one
  sink transaction that records the range as written, so a retried task skips it (no duplicate).
  The table reads ``syncing`` on the sink until ``finish``. The exported snapshot lives as long as
  the driver's transaction: a driver that dies leaves the table ``syncing``, and the next run takes
  a new snapshot and writes it again from a cleared table.
"""

from __future__ import annotations

import copy
import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.errors import StaleBatchError, require_counts
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL
from airflow_provider_lr.engine.source.log_reader import BaseSplit, TableSplits
from airflow_provider_lr.engine.store import sink_sessions
from airflow_provider_lr.engine.store.sink_sessions import FencedTransaction
from airflow_provider_lr.engine.tables import closed_notes, own_rows, references
from airflow_provider_lr.engine.tables import sink as sink_tables
from airflow_provider_lr.engine.tables.definition import TableDefinition, TableName, read_definitions
from airflow_provider_lr.engine.tables.range_copy import ROWS_ESTIMATE, KeyRange, copy_to_targets, plan_ranges
from airflow_provider_lr.engine.tables.registry import FederatedTable
from airflow_provider_lr.engine.tables.sink import TableState, Target
from airflow_provider_lr.engine.vocabulary import SessionKey

log = logging.getLogger(__name__)


@dataclass
class SinkSide:
    """One sink taking the snapshot: its session, connection and lease epoch, and the tables it lacks."""

    key: SessionKey
    conn: psycopg2.extensions.connection
    epoch: int
    tables: list[FederatedTable]


@dataclass
class SnapshotReport:
    tables: dict[str, str] = field(default_factory=dict)  # table -> state it ended in
    rows: int = 0
    bytes: int = 0


def needed(
    source: psycopg2.extensions.connection,
    sink: psycopg2.extensions.connection,
    key: SessionKey,
    federated: Sequence[FederatedTable],
) -> list[FederatedTable]:
    """The source's federated tables the session's sink has not synced (in their current
    federation), or holds as a conflict that no longer is one (the sink reopened the table)."""
    return needed_by_client(sink, key.source, {key.client: federated}).get(key.client, [])


def why_needed(tables: Sequence[FederatedTable]) -> str:
    """Why a session whose sink lacks ``tables`` (``needed_by_client``) goes back to the cycles:
    they take the snapshots, or hold it while a table renamed at the source keeps its new name."""
    renamed = [t for t in tables if t.renamed_to is not None]
    return renamed[0].renamed() if renamed else "a table was federated (its snapshot is taken by a cycle)"


def needed_by_client(
    sink: psycopg2.extensions.connection, source: str, federated: Mapping[str, Sequence[FederatedTable]]
) -> dict[str, list[FederatedTable]]:
    """``needed`` for the sessions of several clients of ``source`` on one sink, in one round trip
    whatever their number: a stream checks every session it writes there every second. Only the
    clients that lack a table are in the answer."""
    wanted = sorted(client for client, tables in federated.items() if tables)
    if not wanted:
        return {}
    with sink.cursor() as cur:
        have = sink_tables.sessions_tables(cur, source, wanted)
        cur.execute("SELECT stream_name FROM lr.registry WHERE kind = 'table' AND NOT is_federated")
        not_here = {r[0] for r in cur.fetchall()}
    sink.rollback()
    lacking: dict[str, list[FederatedTable]] = {}
    for client in wanted:
        for table in federated[client]:
            held = have[client].get(table.table)
            if (
                held is not None
                and table.renamed_to is None  # renamed at the source: its session's cycle says what to do
                and held.source_table_id == table.table_id
                and (
                    held.state == TableState.SYNCED
                    or (held.state == TableState.CONFLICT and str(table.table) in not_here)
                )
            ):
                continue
            lacking.setdefault(client, []).append(table)
    if lacking:  # a table the sink links by a foreign key to one it lacks is written with it (``references``)
        with sink.cursor() as cur:
            for client, tables in lacking.items():
                every = {t.table: t for t in federated[client]}
                found = references.edges(cur, every)
                if found:
                    taken = references.linked([t.table for t in tables], every, found)
                    lacking[client] = [every[t] for t in sorted(taken)]
        sink.rollback()
    return lacking


def splits(sink: psycopg2.extensions.connection, key: SessionKey) -> TableSplits:
    """The session's synced tables as the reader takes them (``TableSplits``)."""
    with sink.cursor() as cur:
        held = sink_tables.session_tables(cur, key.source, key.client)
    sink.rollback()
    synced = sorted((t.source_table_id, t.split) for t in held.values() if t.state == TableState.SYNCED and t.split)
    return TableSplits(
        tuple(i for i, _ in synced), tuple(s.upto for _, s in synced), tuple(s.snapshot for _, s in synced)
    )


class TableSnapshot:
    """One snapshot of a client's federated tables on a source, for one or more sinks."""

    def __init__(self, source: psycopg2.extensions.connection, client: str, sinks: Sequence[SinkSide]) -> None:
        self.source, self.client, self.sinks = source, client, list(sinks)
        self.exported: str = ""
        self.split: BaseSplit | None = None
        self.definitions: dict[TableName, TableDefinition] = {}
        self.run_id = str(uuid.uuid4())
        self.report = SnapshotReport()
        self.received: dict[tuple[str, str], int] = {}  # what the source had applied from others (``own_rows``)

    # --- the source ---------------------------------------------------------------------------
    def open(self) -> BaseSplit:
        """Start the snapshot: a REPEATABLE READ transaction on the source, exported so parallel
        readers can join it, its split, and the tables' definitions as it sees them."""
        if self.source.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            self.source.rollback()
        with self.source.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            cur.execute("SELECT pg_export_snapshot(), pg_current_snapshot()::text")  # fixes the snapshot
            self.exported, snapshot = cur.fetchone()
            cur.execute(LAST_DRAWN_POSITION_SQL)  # after the snapshot: what it may not hold is above
            self.split = BaseSplit(snapshot, cur.fetchone()[0])
            self.received = sink_sessions.processed(cur)
            tables = {t.table: t for side in self.sinks for t in side.tables}
            read = read_definitions(cur, list(tables), extras=True)  # every table's in one read
            for name, table in tables.items():
                definition = read[name]
                if definition is None and table.renamed_to is not None:
                    raise StaleBatchError(table.renamed())
                if definition is None:
                    raise StaleBatchError(
                        f"federated table {table.table} was dropped on the source: create it again and "
                        f"run lr tables open {table.table} there, or lr tables close {table.table}"
                    )
                self.definitions[name] = definition
        return self.split

    def close(self) -> None:
        """End the source's snapshot transaction."""
        if not self.source.closed:
            self.source.rollback()

    def estimated_rows(self) -> int:
        with self.source.cursor() as cur:
            cur.execute(
                f"SELECT coalesce(sum({ROWS_ESTIMATE}), 0)::bigint FROM pg_class WHERE oid = ANY (%s::regclass[])",
                ([str(t) for t in self.definitions],),
            )
            return cur.fetchone()[0]

    def plan(self, ranges_per_table: int | None = None) -> list[KeyRange]:
        """Key ranges of every table, read in the snapshot (about ``RANGE_ROWS`` rows each).

        Read in a savepoint rolled back after: the tables' ACCESS SHARE locks are released, so the
        snapshot's transaction holds none while the tasks run. Held, a TRUNCATE (or ALTER) queued
        behind it would queue every task's read behind itself, and the tasks never end: a deadlock
        PostgreSQL cannot see (the driver waits in Spark, not on a lock). Unheld, the TRUNCATE
        commits; a range read after it is empty in the snapshot, and the TRUNCATE itself, after
        the split, is applied from the log: the sink ends the same."""
        require_counts(ranges_per_table=ranges_per_table)
        found: list[KeyRange] = []
        with self.source.cursor() as cur:
            cur.execute("SAVEPOINT lr_plan")
            for definition in self.definitions.values():
                found += plan_ranges(cur, definition, ranges_per_table)
            cur.execute("ROLLBACK TO SAVEPOINT lr_plan")
        return found

    # --- in process ---------------------------------------------------------------------------
    def write(self) -> SnapshotReport:
        """The whole snapshot in this process, the rows of each table read once for every sink that
        needs it. A table is one sink transaction at each sink (atomic there); tables a sink links by
        foreign keys are one transaction together, cleared children first and copied parents first
        (``references``): written table by table in name order, a child copied before its parent
        was refused for good, and a parent cleared after it cascaded the child's rows away."""
        assert self.split is not None
        tracker = progress.track(f"table snapshot {self.client}", len(self.definitions), "tables")
        found: set[references.Edge] = set()
        for side in self.sinks:
            with side.conn.cursor() as cur:
                found |= references.edges(cur, [t.table for t in side.tables])
            side.conn.rollback()
        done = 0
        for group in references.write_groups(references.load_order(list(self.definitions), found), found):
            self._write_together(group)
            done += len(group)
            tracker.update(done)
        tracker.finish()
        return self.report

    def _write_together(self, group: Sequence[TableName]) -> None:
        """``group`` (in load order) in one transaction at each sink that lacks any of it."""
        assert self.split is not None
        opened: list[tuple[SinkSide, FencedTransaction]] = []
        copies: dict[TableName, list[tuple[SinkSide, FencedTransaction, Target, int]]] = {}
        written: list[tuple[SinkSide, TableName, int]] = []
        kept: list[tuple[FencedTransaction, own_rows.Kept]] = []  # a sink's own rows not sent back yet
        try:
            for side in self.sinks:
                mine = {t.table: t for t in side.tables if t.table in group}
                if not mine:
                    continue
                write = FencedTransaction(side.conn, side.key.source, side.key.client, side.epoch)
                write.open()
                opened.append((side, write))
                targets = {}
                for table in (t for t in group if t in mine):
                    targets[table] = self._prepare(
                        write.cur, side, mine[table], self.definitions[table], TableState.SYNCED, clear=False
                    )
                for table, target in reversed(targets.items()):  # children cleared before their parents
                    if target is not None:
                        found = own_rows.keep(write.cur, target, side.key.sink, self.received, len(kept))
                        kept += [(write, found)] if found is not None else []
                        self._clear(write.cur, side, mine[table], target, TableState.SYNCED)
                        copies.setdefault(table, []).append((side, write, target, mine[table].table_id))
            for table in group:  # parents copied before their children
                writes = copies.get(table, [])
                if not writes:
                    continue
                with self.source.cursor() as cur:
                    copied, rows = copy_to_targets(
                        cur, self.definitions[table], None, [(w.cur, t) for _, w, t, _ in writes]
                    )
                self.report.bytes += copied
                for (side, write, _, table_id), count in zip(writes, rows):
                    sink_tables.record(
                        write.cur,
                        side.key.source,
                        side.key.client,
                        table,
                        table_id,
                        TableState.SYNCED,
                        run_id=None,
                        split_snapshot=self.split.snapshot,
                        split_upto=self.split.upto,
                        rows_copied=count,
                    )
                    written.append((side, table, count))
            for write, found in kept:
                own_rows.restore(write.cur, found)
            if written:
                fault_point("table_snapshot_before_commit")
            while opened:
                side, write = opened.pop(0)
                write.commit()
                for by, table, count in written:
                    if by is side:
                        self.report.tables[f"{side.key}:{table}"] = TableState.SYNCED
                        self.report.rows += count
        finally:
            for _, write in opened:
                write.abort()

    # --- on Spark -----------------------------------------------------------------------------
    def linked(self) -> set[TableName]:
        """The tables the driver writes in process (``part(...).write()``, in one sink transaction,
        as a cycle does), not by range tasks, each range in a transaction of its own: those a sink
        links by a foreign key to another of this snapshot's (a child's range copied before its
        parent's was refused), and those a sink federates onward, both ways (its own rows not sent
        back yet are kept through the snapshot's transaction: ``own_rows``)."""
        found: set[references.Edge] = set()
        onward: set[TableName] = set()
        for side in self.sinks:
            with side.conn.cursor() as cur:
                found |= references.edges(cur, [t.table for t in side.tables])
                onward |= {t.table for t in side.tables if own_rows.onward(cur, str(t.table)) is not None}
            side.conn.rollback()
        return {table for edge in found for table in edge} | onward

    def part(self, tables: Collection[TableName]) -> TableSnapshot:
        """This snapshot (its source's transaction, split, run and report) for ``tables`` only."""
        part = copy.copy(self)
        sides = [replace(side, tables=[t for t in side.tables if t.table in tables]) for side in self.sinks]
        part.sinks = [side for side in sides if side.tables]
        part.definitions = {t: d for t, d in self.definitions.items() if t in tables}
        return part

    def begin(self) -> None:
        """Before the parallel tasks: each sink's tables prepared, cleared of this source's rows and
        marked ``syncing`` under this run (one sink transaction per sink)."""
        for side in self.sinks:
            with FencedTransaction(side.conn, side.key.source, side.key.client, side.epoch) as (cur, _):
                found = references.edges(cur, [t.table for t in side.tables])
                mine = {t.table: t for t in side.tables}
                order = references.load_order(list(mine), found)
                targets = {
                    t: self._prepare(cur, side, mine[t], self.definitions[t], TableState.SYNCING, False) for t in order
                }
                for table, target in reversed(targets.items()):  # children cleared before their parents
                    if target is not None:
                        self._clear(cur, side, mine[table], target, TableState.SYNCING)

    def finish(self, ranges: Sequence[KeyRange]) -> SnapshotReport:
        """After the tasks: each sink's tables whose ranges are all written are recorded synced with
        the split; a missing range is an error (the run is left ``syncing``: the next one starts over)."""
        assert self.split is not None
        expected: dict[str, int] = {}
        for r in ranges:
            expected[r.table] = expected.get(r.table, 0) + 1
        for side in self.sinks:
            with FencedTransaction(side.conn, side.key.source, side.key.client, side.epoch) as (cur, _):
                held = sink_tables.session_tables(cur, side.key.source, side.key.client)
                for table in side.tables:
                    row = held.get(table.table)
                    if row is None or row.state == TableState.CONFLICT:
                        self.report.tables[f"{side.key}:{table.table}"] = TableState.CONFLICT
                        continue
                    if row.run_id != self.run_id:
                        raise StaleBatchError(
                            f"session {side.key}: table {table.table} is now written by run "
                            f"{row.run_id}, not {self.run_id}"
                        )
                    cur.execute(
                        "SELECT count(*), coalesce(sum(rows_copied), 0) FROM lr.sink_table_ranges "
                        "WHERE run_id = %s AND table_name = %s",
                        (self.run_id, str(table.table)),
                    )
                    done, rows = cur.fetchone()
                    if done != expected.get(str(table.table), 0):
                        raise StaleBatchError(
                            f"session {side.key}: table {table.table} has {done} of "
                            f"{expected.get(str(table.table), 0)} ranges written"
                        )
                    sink_tables.record(
                        cur,
                        side.key.source,
                        side.key.client,
                        table.table,
                        table.table_id,
                        TableState.SYNCED,
                        run_id=None,
                        split_snapshot=self.split.snapshot,
                        split_upto=self.split.upto,
                        rows_copied=rows,
                    )
                    cur.execute(
                        "DELETE FROM lr.sink_table_ranges WHERE run_id = %s AND table_name = %s",
                        (self.run_id, str(table.table)),
                    )
                    self.report.tables[f"{side.key}:{table.table}"] = TableState.SYNCED
        return self.report

    def task(self) -> dict:
        """What a parallel task needs, as plain data (see ``copy_range``)."""
        assert self.split is not None
        return {
            "exported": self.exported,
            "run_id": self.run_id,
            "client": self.client,
            "definitions": {str(t): d.to_json() for t, d in self.definitions.items()},
            "sinks": [
                {
                    "source": s.key.source,
                    "sink": s.key.sink,
                    "epoch": s.epoch,
                    "tables": [str(t.table) for t in s.tables],
                }
                for s in self.sinks
            ],
        }

    # --- shared -------------------------------------------------------------------------------
    def _prepare(
        self,
        cur: psycopg2.extensions.cursor,
        side: SinkSide,
        table: FederatedTable,
        definition: TableDefinition,
        state: str,
        clear: bool = True,
    ) -> Target | None:
        """The sink's target for ``table`` (None: a conflict, recorded), cleared of this source's rows
        (``clear``; else by ``_clear`` after). The range records of a run that was writing the table
        and never finished (fenced, its sink restarted: left ``syncing``) go too: only that run's
        finish would have removed them."""
        sink_tables.applying(cur)
        cur.execute(
            "DELETE FROM lr.sink_table_ranges r USING lr.sink_tables t WHERE t.source_site_id = %s "
            "AND t.client_name = %s AND t.table_name = %s AND r.run_id = t.run_id "
            "AND r.table_name = t.table_name",
            (side.key.source, side.key.client, str(table.table)),
        )
        where = f"session {side.key}"
        target = sink_tables.prepare(cur, side.key.source, side.key.client, definition, where)
        if target is None:
            sink_tables.record(
                cur,
                side.key.source,
                side.key.client,
                table.table,
                table.table_id,
                TableState.CONFLICT,
                run_id=None,
                split_snapshot=None,
                split_upto=None,
                detail=sink_tables.KEPT_OUT,
            )
            log.warning("%s: %s is not federated on the sink; its data is dropped there", where, table.table)
            self.report.tables[f"{side.key}:{table.table}"] = TableState.CONFLICT
            return None
        if clear:
            self._clear(cur, side, table, target, state)
        return target

    def _clear(
        self, cur: psycopg2.extensions.cursor, side: SinkSide, table: FederatedTable, target: Target, state: str
    ) -> None:
        """The source's rows of ``target`` cleared, the table recorded in ``state`` under this run."""
        sink_tables.clear(cur, target)
        closed_notes.copy_renewed(cur, table.table, side.key.source, side.key.client)
        sink_tables.record(
            cur,
            side.key.source,
            side.key.client,
            table.table,
            table.table_id,
            state,
            run_id=self.run_id,
            split_snapshot=None,
            split_upto=None,
            detail=target.note,
            rows_copied=None,
        )
