"""A federated table's rows copied out of a source snapshot into the sinks that take it: whole
(``copy_to_targets`` with no range, the in-process snapshot and the nearest copy) or one key range
at a time (the parallel snapshot: ``plan_ranges`` cuts the ranges, ``copy_range`` is one Spark task).

A range task joins the driver's exported snapshot (``SET TRANSACTION SNAPSHOT``), and at each sink
records the range in the same transaction that writes its rows, so a retried task writes nothing
twice; a task whose lease epoch is stale is refused (``_range_target``). ``tables/snapshot.py`` holds
the snapshot itself: its split, the sinks' tables prepared and finished.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.errors import ApplyError, FencedError, StaleBatchError, TableError, one_line
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.store import sink_sessions
from airflow_provider_lr.engine.tables import copy as table_copy
from airflow_provider_lr.engine.tables import sink as sink_tables
from airflow_provider_lr.engine.tables import upsert
from airflow_provider_lr.engine.tables.definition import TableDefinition
from airflow_provider_lr.engine.tables.refusals import refusal_fix
from airflow_provider_lr.engine.tables.sink import TableState, Target
from airflow_provider_lr.engine.tables.targets import target_of
from airflow_provider_lr.engine.vocabulary import SessionKey

RANGE_ROWS = 100_000  # rows per key range a Spark task reads (about 20 MB of 200-byte rows)
_INTEGER_TYPES = {"smallint", "integer", "bigint"}
# The planner's row count, or for a table never analyzed (reltuples -1) its size at ~200 bytes a row:
# an unanalyzed large table must not pass for an empty one.
ROWS_ESTIMATE = "CASE WHEN reltuples >= 0 THEN reltuples ELSE pg_relation_size(oid) / 200 END"


@dataclass(frozen=True)
class KeyRange:
    """Part of one table: its key in ``[lo, hi)`` (text forms cast to the key's type; None: open)."""

    table: str
    range_no: int
    lo: str | None = None
    hi: str | None = None

    def where(self, definition: TableDefinition) -> sql.Composable | None:
        if self.lo is None and self.hi is None:
            return None
        key = definition.key[0]
        kind = next(c.type for c in definition.columns if c.name == key)
        parts = []
        if self.lo is not None:
            parts.append(sql.SQL("{} >= {}::{}").format(sql.Identifier(key), sql.Literal(self.lo), sql.SQL(kind)))
        if self.hi is not None:
            parts.append(sql.SQL("{} < {}::{}").format(sql.Identifier(key), sql.Literal(self.hi), sql.SQL(kind)))
        return sql.SQL(" AND ").join(parts)


def copy_to_targets(
    source: psycopg2.extensions.cursor,
    definition: TableDefinition,
    where: sql.Composable | None,
    targets: list[tuple[psycopg2.extensions.cursor, Target]],
) -> tuple[int, list[int]]:
    """Rows of ``definition``'s table (``where``: a key range) from the source's snapshot into each
    target: straight into the table when only this source writes it (it was just cleared), else
    through a temporary table and an upsert that keeps the origin ledger; by binary COPY, or by
    text where binary carries a column wrong (``copy.by_text``). Returns the bytes read and the
    rows written at each target."""
    hidden = table_copy.hidden_rows(source, definition)
    if hidden:
        raise TableError(hidden)
    text = table_copy.by_text(source, definition)
    sinks, staged = [], []
    for cur, target in targets:
        if target.shared:
            stage = sql.Identifier(f"lr_stage_{uuid.uuid4().hex[:12]}")
            cur.execute(sql.SQL("CREATE TEMP TABLE {} (LIKE {}) ON COMMIT DROP").format(stage, definition.table.ident))
            sinks.append((cur, table_copy.insert_statement(definition, stage, text)))
            staged.append((cur, target, stage))
        else:
            sinks.append((cur, table_copy.insert_statement(definition, text=text)))
    select = table_copy.select_statement(definition, where, text)
    try:
        with table_copy.copy_settings(source, [cur for cur, _ in targets], text):
            copied = table_copy.copy_rows(source, select, sinks)
            rows = [max(cur.rowcount, 0) for cur, _ in targets]  # each COPY's, before the settings go back
        for cur, target, stage in staged:
            rows[[c for c, _ in targets].index(cur)] = upsert.upsert_from(cur, target, stage)
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        raise  # a site went away: not the data's fault, the caller retries as ever
    except psycopg2.Error as exc:
        if getattr(exc.cursor, "connection", None) not in {cur.connection for cur, _ in targets}:
            raise  # the source's
        raise ApplyError(  # a sink's trigger, constraint or privilege: said as a streamed change's refusal is
            f"the sink refused the snapshot of table {definition.table}: {one_line(exc)}. Nothing of it was "
            f"applied; {refusal_fix(exc)}, and the next cycle takes the snapshot"
        ) from exc
    return copied, rows


def plan_ranges(
    cur: psycopg2.extensions.cursor, definition: TableDefinition, parts: int | None = None
) -> list[KeyRange]:
    """Key ranges of one table: ``parts`` of them (default: about ``RANGE_ROWS`` rows each) on a
    single-column key, evenly between min and max for an integer key, by percentiles otherwise; a
    composite key is one range."""
    name = str(definition.table)
    if len(definition.key) != 1:
        return [KeyRange(name, 0)]
    key = sql.Identifier(definition.key[0])
    kind = next(c.type for c in definition.columns if c.name == definition.key[0])
    if parts is None:
        cur.execute(f"SELECT ({ROWS_ESTIMATE})::bigint FROM pg_class WHERE oid = %s::regclass", (name,))
        parts = max(1, -(-cur.fetchone()[0] // RANGE_ROWS))
    if parts <= 1:
        return [KeyRange(name, 0)]
    if kind in _INTEGER_TYPES:
        cur.execute(sql.SQL("SELECT min({k}), max({k}) FROM ONLY {t}").format(k=key, t=definition.table.ident))
        lo, hi = cur.fetchone()
        if lo is None:
            return [KeyRange(name, 0)]
        step = max(1, -(-(hi - lo + 1) // parts))
        bounds = [str(b) for b in range(lo + step, hi + 1, step)]
    else:
        cur.execute(_PERCENTILES.format(k=key, t=definition.table.ident), ([i / parts for i in range(1, parts)],))
        bounds = list(cur.fetchone()[0] or [])  # distinct keys, in the key's order (its column's collation)
    edges: list[str | None] = [None, *bounds, None]
    return [KeyRange(name, i, edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


# The keys at those fractions of the table in the key's order: what percentile_disc(fractions) gives,
# but as text, so that a key of an array type (which has no array type to hold its percentiles:
# "could not find array type for data type integer[]", on every run) is cut like any other. Keys are
# unique and come in the order of their positions: the column's own order, its collation's too (the
# bounds were sorted again by the type's default collation, which a column of another collation
# does not share: ranges that overlap or leave keys out).
_PERCENTILES = sql.SQL(
    "SELECT array_agg(x.k::text ORDER BY x.n) FROM (SELECT {k} AS k, row_number() OVER (ORDER BY {k}) AS n "
    "FROM ONLY {t}) x WHERE x.n = ANY (SELECT ceil(f * (SELECT count(*) FROM ONLY {t})) FROM unnest(%s::float8[]) f)"
)


def copy_range(task: dict, key_range: KeyRange, connect: Callable[[str], psycopg2.extensions.connection]) -> int:
    """One Spark task: the range read in the exported snapshot on the source, written at every sink
    of the task that takes its table, one sink transaction each that first records the range (a
    range already recorded is skipped: a retried task writes nothing twice). Returns rows written."""
    definition = TableDefinition.from_json(task["definitions"][key_range.table])
    sides = [s for s in task["sinks"] if key_range.table in s["tables"]]
    source = connect(sides[0]["source"]) if sides else None
    conns: list[psycopg2.extensions.connection] = []
    written = 0
    try:
        if source is None:
            return 0
        with source.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            cur.execute("SET TRANSACTION SNAPSHOT %s", (task["exported"],))
        targets = []
        for side in sides:
            conn = connect(side["sink"])
            conns.append(conn)
            cur = conn.cursor()
            target = _range_target(cur, task, side, key_range, definition)
            if target is not None:
                targets.append((cur, target))
        if targets:
            with source.cursor() as cur:
                _, rows = copy_to_targets(cur, definition, key_range.where(definition), targets)
            fault_point("table_range_before_commit")
            for (cur, _), count in zip(targets, rows):
                written += count
                cur.execute(
                    "UPDATE lr.sink_table_ranges SET rows_copied = %s "
                    "WHERE run_id = %s AND table_name = %s AND range_no = %s",
                    (count, task["run_id"], key_range.table, key_range.range_no),
                )
        for conn in conns:
            conn.commit()
        return written
    finally:
        for conn in [*conns, *([source] if source else [])]:
            if not conn.closed:
                conn.rollback()
                conn.close()


def _range_target(
    cur: psycopg2.extensions.cursor, task: dict, side: dict, key_range: KeyRange, definition: TableDefinition
) -> Target | None:
    """Fence and claim one range at one sink: None when the range is written already there."""
    where = f"session {SessionKey(side['source'], side['sink'], task['client'])}"
    epoch = sink_sessions.share_epoch(cur, side["source"], task["client"])
    if epoch is None or epoch > side["epoch"]:
        raise FencedError(
            f"{where}: lease epoch {side['epoch']} is stale (the sink has seen "
            f"{'none' if epoch is None else epoch}); another replicator owns this session"
        )
    cur.execute(
        "SELECT state, run_id::text FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s "
        "AND table_name = %s",
        (side["source"], task["client"], key_range.table),
    )
    state = cur.fetchone()
    if state is None or state[0] == TableState.CONFLICT:
        return None
    if state != (TableState.SYNCING, task["run_id"]):
        raise StaleBatchError(f"{where}: table {key_range.table} is not being written by run {task['run_id']}")
    cur.execute(
        "INSERT INTO lr.sink_table_ranges (run_id, table_name, range_no, rows_copied) VALUES (%s, %s, %s, 0) "
        "ON CONFLICT DO NOTHING",
        (task["run_id"], key_range.table, key_range.range_no),
    )
    if cur.rowcount == 0:
        return None  # written by an earlier attempt of this task
    sink_tables.applying(cur)
    return target_of(cur, side["source"], definition.table, lambda: where)
