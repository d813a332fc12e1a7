"""Read-once fan-out of a source's shared log to every sink in log-entry sync (seed 003's relay).

The Spark job ``spark_jobs/lr_fanout.py`` runs it in three steps; this module has every rule, the
job only parallelizes step 2 (and tests can run step 2 with a plain ``map``):

1. **plan** (driver): every session of the source takes its lease (the epoch travels with the plan)
   and negotiates exactly as a session cycle does; the sessions in log-entry sync become
   *demands*: a sink, a client, the position the sink has processed, the split of its base
   snapshot. The range to move is ``(min demand, commit barrier]`` (capped by ``max_entries``
   at a transaction boundary), cut into position sub-ranges of about equal entry counts.
2. **stage** (one call per sub-range, in parallel): read the sub-range of the shared log ONCE with
   a binary ``COPY TO STDOUT``; the source server computes, per entry, the bit mask of the demands
   that want it (destination tag, client, after the sink's position, not covered by its base
   snapshot); each entry is rewritten once for the sinks (destinations stripped) and appended to
   every demanded sink's ``lr.spark_staging`` with binary ``COPY FROM STDIN``. Per sink this is
   one transaction that first deletes what an earlier attempt staged for the sub-range and ends
   with a record of the staged sub-range: a task retry, a speculative duplicate (serialized by an
   advisory lock on the sub-range) or a rerun of the whole job writes nothing twice.
3. **commit** (driver, per session): one fenced sink transaction (``sink._SinkWrite``: lease epoch
   checked) that refuses unless the staged sub-ranges of this plan cover the whole range, then
   moves the rows into ``lr.receive_queue`` in (position, entry id) order — so ``seq`` follows
   source order and a subscriber never sees a later entry before an earlier one — sets
   ``last_log_entry_processed`` to the range end, deletes the staged rows and wakes subscribers.
   Rerunning it is a no-op.

Memory stays bounded whatever the backlog: rows stream through a partition (one block per sink
of at most ``pgcopy.DEFAULT_BLOCK_BYTES``); the driver holds only the plan and small summaries.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping

import psycopg2
import psycopg2.extensions
from psycopg2 import sql
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import lease as leases, sink
from airflow_provider_lr.engine.errors import ConfigurationError, FencedError, StaleBatchError
from airflow_provider_lr.engine.faults import FAULT_ENV, fault_point
from airflow_provider_lr.engine.log_reader import BaseSplit, LogReader, commit_barrier
from airflow_provider_lr.engine.negotiation import Decision
from airflow_provider_lr.engine.pgcopy import RowReader, StagingWriter, staging_prefix, staging_row
from airflow_provider_lr.engine.session import SessionRunner, SessionSettings
from airflow_provider_lr.engine.topology import SessionKey, Topology, site_conninfo
from airflow_provider_lr.engine.transmit import STREAM_LOG_ENTRIES

log = logging.getLogger(__name__)

# Backlog from which a catch-up goes through Spark rather than in-process cycles, counted as
# ``session_backlogs`` / ``status.source_backlog`` count it: entries still to deliver summed over
# the source's sessions in log-entry sync (= deliveries). Measured on the 2-core machine
# (docs/spark.md "Choosing the path"): spark-submit costs ~14 s before the first row moves (JVM,
# context, Python workers), in-process log-entry sync delivers ~20k deliveries/s, the warm Spark
# fan-out ~130k+/s; break-even 14 s / (1/20k - 1/130k) ≈ 330k deliveries. The DAG reads the
# topology setting ``spark_min_backlog`` with this as its default.
SPARK_MIN_BACKLOG = 300_000
PARTITION_ENTRIES = 250_000  # default sub-range size when the caller does not fix a count
MAX_DEMANDS = 63  # one bit per demand in the source-side bigint mask
STAGING_LOCK_CLASS = 0x6C72_7366  # "lrsf": pg_advisory_xact_lock(class, hashtext(range)) while staging
# A row of the partition's read, binary: field count, then (length, value) of position, entry id
# and demand mask (int8 each), then the message's length (the message follows).
_ENTRY_ROW = struct.Struct(">hiqiqiqi")


@dataclass(frozen=True)
class Demand:
    """One session in log-entry sync: what its sink still needs."""

    sink: str
    client: str
    client_id: int
    tag_id: int
    after: int  # the sink's last processed commit position
    base: int  # the snapshot base the sink is at (the commit refuses a sink that moved to another)
    split: BaseSplit | None  # what the base snapshot covered
    epoch: int  # lease epoch, checked by every sink write

    @property
    def session(self) -> str:
        return f"{self.sink}/{self.client}"


@dataclass(frozen=True)
class PositionRange:
    """One partition: commit positions ``(lo, hi]`` holding about ``entries`` log entries."""

    index: int
    lo: int
    hi: int
    entries: int


@dataclass(frozen=True)
class FanoutPlan:
    """What one fan-out run moves. Picklable; DSNs are shipped inside it to the partitions and
    never shown (``repr``/``describe`` leave them out)."""

    plan_id: str
    source: str
    lo: int
    end: int
    barrier: int
    demands: tuple[Demand, ...]
    ranges: tuple[PositionRange, ...]
    source_dsn: str = field(repr=False)
    sink_dsns: Mapping[str, str] = field(repr=False)
    skipped: Mapping[str, str] = field(default_factory=dict)
    blocked_by: tuple[str, ...] = ()
    faults: str | None = field(default=None, repr=False)  # $LR_FAULT of the driver (tests)

    @property
    def entries(self) -> int:
        return sum(r.entries for r in self.ranges)

    def describe(self) -> str:
        sessions = ", ".join(f"{d.session}@{d.after}" for d in self.demands) or "none"
        return (f"plan {self.plan_id[:8]} of {self.source}: positions ({self.lo}, {self.end}] "
                f"barrier {self.barrier}, {self.entries} entries in {len(self.ranges)} partitions; "
                f"sessions {sessions}")


@dataclass
class StagedPartition:
    """What one partition did (small: it is all a Spark task returns to the driver)."""

    index: int
    lo: int
    hi: int
    read: int = 0  # log entries read from the source
    staged: dict[str, int] = field(default_factory=dict)  # session -> rows staged
    seconds: float = 0.0
    peak_rss_kb: int = 0  # of the process that ran it (an executor's Python worker)
    jvm_peak_kb: int = 0  # of the executor JVM it ran under (set by the Spark job)
    pid: int = 0


@dataclass
class FanoutResult:
    plan_id: str
    source: str
    lo: int
    end: int
    deliveries: dict[str, int] = field(default_factory=dict)  # session -> entries made visible
    positions: dict[str, int] = field(default_factory=dict)  # session -> sink's last processed
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    blocked_by: list[str] = field(default_factory=list)  # what held the commit barrier back
    partitions: int = 0
    entries_read: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # plan, stage, commit
    peak_rss_kb: dict[str, int] = field(default_factory=dict)  # driver, executors

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict:
        return {**asdict(self), "total_deliveries": sum(self.deliveries.values()), "ok": self.ok}


def peak_rss_kb() -> int:
    """This process's peak resident memory (KiB, Linux ``ru_maxrss``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def ancestor_peak_kb(command: str) -> int:
    """Peak resident memory (KiB) of the nearest ancestor process named ``command`` (e.g. the
    executor JVM above a Spark Python worker); 0 if there is none or /proc is unreadable."""
    pid = os.getppid()
    try:
        while pid > 1:
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
            if status.get("Name", "").strip() == command:
                return int(status.get("VmHWM", "0 kB").split()[0])
            pid = int(status.get("PPid", "0").strip())
    except (OSError, ValueError):
        pass
    return 0


# --- 1. plan (driver) -------------------------------------------------------------------------
class FanoutDriver:
    """The driver side of one fan-out run: leases, plan, commits. Close it to release leases."""

    def __init__(self, topology: Topology, source: str, owner: str | None = None,
                 settings: SessionSettings | None = None,
                 connect: Callable[[str], psycopg2.extensions.connection] | None = None) -> None:
        self.topology = topology
        self.source = source
        self.owner = owner or leases.new_owner_id()
        self.settings = settings or SessionSettings.from_topology(topology)
        self.sessions = topology.sessions(source=source)
        if not self.sessions:
            raise ConfigurationError(f"site {source!r} is the source of no session in the topology")
        self._dsns = {site: site_conninfo(topology, site).dsn for site in {source, *(k.sink for k in self.sessions)}}
        self._connect = connect or (lambda site: psycopg2.connect(self._dsns[site]))
        self.src = self._connect(source)
        self.leases: dict[str, leases.Lease] = {}
        self._keeper: _LeaseKeeper | None = None

    def plan(self, max_entries: int | None = None, partitions: int | None = None,
             min_partitions: int = 1) -> FanoutPlan:
        """Take the sessions' leases, negotiate, and cut the range to move into partitions."""
        demands, skipped = [], {}
        for key in self.sessions:
            try:
                demand = self._demand(key)
            except Exception as exc:  # one sink down must not stop the others
                skipped[f"{key.sink}/{key.client}"] = f"{type(exc).__name__}: {exc}".strip()
                log.warning("fan-out of %s: session %s left out: %s", self.source, key, exc)
                continue
            if isinstance(demand, str):
                skipped[f"{key.sink}/{key.client}"] = demand
            else:
                demands.append(demand)
        if len(demands) > MAX_DEMANDS:
            raise ConfigurationError(f"{len(demands)} sessions in one fan-out of {self.source}; at most {MAX_DEMANDS}")
        self._keeper = _LeaseKeeper(self._dsns[self.source], list(self.leases.values()), self.settings.lease_seconds)
        plan_id = str(uuid.uuid4())
        base = dict(plan_id=plan_id, source=self.source, demands=tuple(demands), source_dsn=self._dsns[self.source],
                    sink_dsns={d.sink: self._dsns[d.sink] for d in demands}, skipped=skipped,
                    faults=os.environ.get(FAULT_ENV))
        if not demands:
            return FanoutPlan(lo=0, end=0, barrier=0, ranges=(), **base)
        barrier, blocked = commit_barrier(self.src, self.settings.barrier_timeout)
        lo = min(d.after for d in demands)
        if barrier is None or barrier <= lo:
            return FanoutPlan(lo=lo, end=lo, barrier=barrier or lo, ranges=(),
                              blocked_by=tuple(h.describe() for h in blocked), **base)
        ranges, end = self._ranges(lo, barrier, max_entries, partitions, min_partitions)
        return FanoutPlan(lo=lo, end=end, barrier=barrier, ranges=ranges, **base)

    def _demand(self, key: SessionKey) -> Demand | str:
        """The session's demand, or why it is left out (lease held elsewhere, snapshot needed)."""
        sink_conn = self._connect(key.sink)
        try:
            runner = SessionRunner(key, self.src, sink_conn, self.owner, self.settings)
            report, meta, negotiation = runner.begin()
            if runner.lease is not None:
                self.leases[f"{key.sink}/{key.client}"] = runner.lease
            if negotiation is None:
                return report.skipped or f"negotiation refused: {report.error}"
            if negotiation.decision is not Decision.LOG_ENTRY_SYNC:
                return f"needs {negotiation.decision.value} ({negotiation.reason}); left to the session cycle"
            assert meta is not None and runner.lease is not None
            reader = LogReader(self.src, key.sink, STREAM_LOG_ENTRIES, client_name=key.client)
            assert reader.client_id is not None
            leases.update_session(self.src, runner.lease, state="IN_LOG_ENTRY_SYNC",
                                  acked_position=meta.last_log_entry_processed, last_error=None)
            return Demand(key.sink, key.client, reader.client_id, reader.tag_id, meta.last_log_entry_processed,
                          meta.snapshot_applied, meta.split, runner.lease.epoch)
        finally:
            sink_conn.close()

    def _ranges(self, lo: int, barrier: int, max_entries: int | None, partitions: int | None,
                min_partitions: int = 1) -> tuple[tuple[PositionRange, ...], int]:
        """Sub-ranges of ``(lo, barrier]`` with about equal entry counts (whole transactions),
        capped at ``max_entries``; computed by the source, only the boundaries come back."""
        cap = max_entries or 2**62
        with self.src.cursor() as cur:
            cur.execute(
                """
                SELECT count(*), coalesce(sum(n), 0) FROM (
                    SELECT c.position, count(*) AS n FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx
                    WHERE c.position > %s AND c.position <= %s AND e.stream = %s GROUP BY c.position) per
                """,
                (lo, barrier, STREAM_LOG_ENTRIES),
            )
            _, total = cur.fetchone()
            wanted = min(int(total), cap)
            parts = partitions or max(min_partitions, math.ceil(wanted / PARTITION_ENTRIES))
            cur.execute(
                """
                WITH per AS (
                    SELECT c.position, count(*) AS n FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx
                    WHERE c.position > %(lo)s AND c.position <= %(hi)s AND e.stream = %(stream)s GROUP BY c.position
                ), cum AS (
                    SELECT position, sum(n) OVER (ORDER BY position) AS upto FROM per
                ), kept AS (  -- whole transactions up to the cap, at least one
                    SELECT position, upto FROM cum WHERE upto <= %(cap)s OR upto = (SELECT min(upto) FROM cum)
                )
                SELECT ceil(upto * %(parts)s::numeric / (SELECT max(upto) FROM kept))::int AS bucket,
                       max(position), max(upto)
                FROM kept GROUP BY 1 ORDER BY 1
                """,
                {"lo": lo, "hi": barrier, "stream": STREAM_LOG_ENTRIES, "cap": cap, "parts": parts},
            )
            bounds = cur.fetchall()
        self.src.commit()
        if not bounds:  # nothing for anyone up to the barrier: the sinks just advance
            return (), barrier
        capped = int(bounds[-1][2]) < int(total)
        ranges, prev_pos, prev_upto = [], lo, 0
        for i, (_, position, upto) in enumerate(bounds):
            hi = position if (capped or i < len(bounds) - 1) else barrier
            ranges.append(PositionRange(i, prev_pos, hi, int(upto) - prev_upto))
            prev_pos, prev_upto = hi, int(upto)
        return tuple(ranges), ranges[-1].hi

    # --- 3. commit (driver) -------------------------------------------------------------------
    def commit(self, plan: FanoutPlan, staged: Iterable[StagedPartition]) -> FanoutResult:
        """Make each session's range visible on its sink (in parallel across sessions)."""
        result = FanoutResult(plan.plan_id, plan.source, plan.lo, plan.end, skipped=dict(plan.skipped),
                              blocked_by=list(plan.blocked_by))
        parts = list(staged)
        result.partitions = len(parts)
        result.entries_read = sum(p.read for p in parts)
        result.peak_rss_kb["executor_python"] = max((p.peak_rss_kb for p in parts), default=0)
        result.peak_rss_kb["executor_jvm"] = max((p.jvm_peak_kb for p in parts), default=0)
        if self._keeper is not None:
            self._keeper.stop()
        if not plan.demands:
            return result

        fenced = {}
        for demand in plan.demands:  # a lease taken over since the plan fences its session
            try:
                _renew(self.src, self.leases[demand.session], self.settings.lease_seconds)
            except FencedError as exc:
                fenced[demand.session] = f"FencedError: {exc}"

        def one(demand: Demand) -> tuple[Demand, int | None, int | str]:
            if demand.session in fenced:
                return demand, None, fenced[demand.session]
            try:
                conn = psycopg2.connect(plan.sink_dsns[demand.sink])
                try:
                    delivered, position = commit_session(conn, plan, demand)
                finally:
                    conn.close()
                return demand, delivered, position
            except Exception as exc:
                return demand, None, f"{type(exc).__name__}: {exc}".strip()

        with ThreadPoolExecutor(max_workers=min(8, len(plan.demands))) as pool:
            outcomes = list(pool.map(one, plan.demands))
        for demand, delivered, outcome in outcomes:
            lease = self.leases[demand.session]
            if delivered is None:
                result.errors[demand.session] = str(outcome)
                log.error("fan-out %s: session %s not committed: %s", plan.plan_id[:8], demand.session, outcome)
                try:
                    leases.update_session(self.src, lease, last_error=f"fan-out: {outcome}"[:2000])
                except FencedError:
                    pass
                continue
            result.deliveries[demand.session] = delivered
            result.positions[demand.session] = int(outcome)
            leases.update_session(self.src, lease, acked_position=int(outcome), last_error=None)
            log.info("fan-out %s: %s committed %d entries, sink at position %s",
                     plan.plan_id[:8], demand.session, delivered, outcome)
        return result

    def close(self) -> None:
        """Release the leases taken by ``plan`` and close connections."""
        if self._keeper is not None:
            self._keeper.stop()
        for lease in self.leases.values():
            try:
                leases.release(self.src, lease)
            except psycopg2.Error:
                self.src.rollback()
        if not self.src.closed:
            self.src.close()


def _renew(conn: psycopg2.extensions.connection, lease: leases.Lease, seconds: float) -> None:
    """Extend our lease; FencedError when it was taken over since the plan (its epoch changed)."""
    leases.update_session(conn, lease, lease_expires_at=AsIs(f"now() + make_interval(secs => {float(seconds)})"))


class _LeaseKeeper:
    """Renews the plan's leases while partitions run (a long job must not lose them)."""

    def __init__(self, dsn: str, held: list[leases.Lease], seconds: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(dsn, held, seconds), daemon=True,
                                        name="lr-fanout-lease-keeper")
        if held:
            self._thread.start()

    def _run(self, dsn: str, held: list[leases.Lease], seconds: float) -> None:
        conn = None
        try:
            while not self._stop.wait(max(1.0, seconds / 3)):
                conn = conn if conn is not None and not conn.closed else psycopg2.connect(dsn)
                for lease in held:
                    try:
                        _renew(conn, lease, seconds)
                    except (FencedError, psycopg2.Error) as exc:
                        log.warning("lease of %s/%s not renewed: %s", lease.sink, lease.client, exc)
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


# --- 2. stage (one partition, anywhere) ---------------------------------------------------------
def _demand_mask_sql(plan: FanoutPlan, demands: list[tuple[int, Demand]]) -> sql.Composable:
    """Per entry, the bit of every demand that wants it, computed by the source server."""
    terms = []
    for bit, d in demands:
        cond = sql.SQL("e.client_id = {} AND e.tag_ids @> ARRAY[{}]::int[] AND c.position > {}").format(
            sql.Literal(d.client_id), sql.Literal(d.tag_id), sql.Literal(d.after))
        if d.split is not None and d.split.upto > d.after:
            cond = sql.SQL("{} AND NOT (c.position <= {} AND pg_visible_in_snapshot(c.tx, {}::pg_snapshot))").format(
                cond, sql.Literal(d.split.upto), sql.Literal(d.split.snapshot))
        terms.append(sql.SQL("CASE WHEN {} THEN {}::int8 ELSE 0 END").format(cond, sql.Literal(1 << bit)))
    return sql.SQL(" | ").join(terms)


def stage_partition(plan: FanoutPlan, part: PositionRange, fault_tag: str = "") -> StagedPartition:
    """Stage one sub-range for every demanded sink (idempotent; see the module docstring).

    ``fault_tag`` names this attempt for fault points (e.g. ``_p1_a0``: partition 1, attempt 0):
    ``LR_FAULT=fanout_mid_write_p1_a0`` kills the process after the first block reached the sinks,
    ``fanout_after_stage_p1_a0`` after every sink committed the partition."""
    started = time.monotonic()
    out = StagedPartition(part.index, part.lo, part.hi)
    active = [(bit, d) for bit, d in enumerate(plan.demands) if d.after < part.hi]
    if not active:
        out.seconds, out.peak_rss_kb, out.pid = time.monotonic() - started, peak_rss_kb(), os.getpid()
        return out
    sinks = sorted({d.sink for _, d in active})
    conns = {s: psycopg2.connect(plan.sink_dsns[s]) for s in sinks}
    src = psycopg2.connect(plan.source_dsn)
    faults = _armed(plan.faults)
    writers: dict[str, StagingWriter] = {}
    try:
        writers.update({s: StagingWriter(conns[s]) for s in sinks})
        for s in sinks:
            _clear_range(conns[s], plan.source, [d.client for _, d in active if d.sink == s], part)
        prefixes = {d.client: staging_prefix(plan.source, d.client) for _, d in active}
        by_bit = dict(active)
        routes: dict[int, tuple[bytes, list[StagingWriter]]] = {}
        masks: dict[int, int] = {}
        halfway = max(1, part.entries // 2)

        def route(mask: int) -> tuple[bytes, list[StagingWriter]]:
            # every demand whose bit is set wants the entry's client: one prefix, one row for all
            wanted = [d for bit, d in by_bit.items() if mask >> bit & 1]
            routes[mask] = (prefixes[wanted[0].client], [writers[d.sink] for d in wanted])
            masks[mask] = 0
            return routes[mask]

        def deliver(head: tuple, message: bytes) -> None:
            _, _, position, _, entry_id, _, mask, _ = head
            prefix, targets = routes.get(mask) or route(mask)
            kind, stripped = sink.rewrite_for_sink(message)
            row = staging_row(prefix, position, entry_id, kind, stripped)
            for writer in targets:
                writer.add(row)
            masks[mask] += 1
            out.read += 1
            if faults and out.read == halfway:  # some rows in the sinks' open transactions, none committed
                for writer in writers.values():
                    writer.sync()
                fault_point(f"fanout_mid_write{fault_tag}")

        def on_row(fields: list[bytes | None]) -> None:  # the general path (unusual chunking)
            values = [int.from_bytes(f or b"", "big", signed=True) for f in fields[:3]]
            deliver((4, 8, values[0], 8, values[1], 8, values[2], 0), fields[3] or b"")

        query = sql.SQL(
            "COPY (SELECT position, entry_id, mask, message FROM ("
            " SELECT c.position, e.entry_id, ({mask}) AS mask, e.message FROM lr.log_commits c"
            " CROSS JOIN LATERAL (SELECT e.entry_id, e.client_id, e.tag_ids, e.message FROM lr.log_entries e"
            "  WHERE e.tx = c.tx AND e.stream = {stream} OFFSET 0) e"  # per-commit index lookups: only the sub-range is read
            " WHERE c.position > {lo} AND c.position <= {hi}) r WHERE mask <> 0)"
            " TO STDOUT (FORMAT binary)"
        ).format(mask=_demand_mask_sql(plan, active), lo=sql.Literal(part.lo), hi=sql.Literal(part.hi),
                 stream=sql.Literal(STREAM_LOG_ENTRIES))
        with src.cursor() as cur:
            cur.copy_expert(query.as_string(src), RowReader(on_row, _ENTRY_ROW, deliver))
        src.rollback()
        for writer in writers.values():
            writer.close()
        out.staged = {d.session: sum(n for mask, n in masks.items() if mask >> bit & 1) for bit, d in active}
        for s in sinks:
            with conns[s].cursor() as cur:
                for _, d in active:
                    if d.sink == s:
                        _record_range(cur, plan.source, d.client, plan.plan_id, part.lo, part.hi, out.staged[d.session])
            conns[s].commit()
        if faults:
            fault_point(f"fanout_after_stage{fault_tag}")
    finally:
        for writer in writers.values():
            writer.abandon()
        for conn in (src, *conns.values()):
            conn.close()
    out.seconds, out.peak_rss_kb, out.pid = time.monotonic() - started, peak_rss_kb(), os.getpid()
    return out


def _armed(faults: str | None) -> bool:
    """Fault points follow the driver's environment, in whatever process runs the partition (on
    a cluster the executors do not share it; a reused Python worker must not keep an old one)."""
    if faults:
        os.environ[FAULT_ENV] = faults
    else:
        os.environ.pop(FAULT_ENV, None)
    return bool(faults)


def _clear_range(conn: psycopg2.extensions.connection, source: str, clients: list[str], part: PositionRange) -> None:
    """Open the partition's transaction on a sink: serialize with any other attempt of the same
    sub-range, then drop whatever an earlier attempt staged there."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                    (STAGING_LOCK_CLASS, f"{source}/{part.lo}/{part.hi}"))
        cur.execute(
            "DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = ANY(%s) AND sync_id IS NULL "
            "AND source_position > %s AND source_position <= %s",
            (source, clients, part.lo, part.hi),
        )


def _record_range(cur: psycopg2.extensions.cursor, source: str, client: str, plan_id: str,
                  lo: int, hi: int, rows: int) -> None:
    cur.execute(
        "INSERT INTO lr.spark_staged_ranges (source_site_id, client_name, plan_id, range_lo, range_hi, staged_rows) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (source_site_id, client_name, plan_id, range_lo) "
        "DO UPDATE SET range_hi = EXCLUDED.range_hi, staged_rows = EXCLUDED.staged_rows, staged_at = now()",
        (source, client, plan_id, lo, hi, rows),
    )


def staged_coverage(cur: psycopg2.extensions.cursor, source: str, client: str, plan_id: str,
                    lo: int, hi: int) -> int | None:
    """Rows staged for ``(lo, hi]`` by the plan's partitions, or None unless they cover it all."""
    cur.execute(
        "SELECT range_lo, range_hi, staged_rows FROM lr.spark_staged_ranges "
        "WHERE source_site_id = %s AND client_name = %s AND plan_id = %s ORDER BY range_lo",
        (source, client, plan_id),
    )
    reach, rows = None, 0
    for range_lo, range_hi, staged in cur.fetchall():
        if range_hi <= lo:
            continue
        if (reach is None and range_lo > lo) or (reach is not None and range_lo != reach):
            return None
        reach, rows = range_hi, rows + staged
        if reach >= hi:
            return rows
    return None


# --- 3. commit (one session) --------------------------------------------------------------------
def commit_session(conn: psycopg2.extensions.connection, plan: FanoutPlan, demand: Demand) -> tuple[int, int]:
    """Move the session's staged range into its receive queue; returns (entries made visible, the
    sink's last processed position). Fenced; a no-op when already done."""
    write = sink._SinkWrite(conn, plan.source, demand.client, demand.epoch)
    with write as (cur, meta):
        if not meta.data_consistent or meta.snapshot_applied != demand.base:
            raise StaleBatchError(
                f"fan-out for base {demand.base} but the sink of {plan.source}/{demand.client} is at base "
                f"{meta.snapshot_applied} (consistent: {meta.data_consistent}); renegotiate")
        last = meta.last_log_entry_processed
        if plan.end <= last:
            return 0, last
        if demand.after > last:
            raise StaleBatchError(f"fan-out range starts after {demand.after} but {demand.session} "
                                  f"has only processed up to {last}")
        staged = staged_coverage(cur, plan.source, demand.client, plan.plan_id, last, plan.end) if plan.ranges else 0
        if staged is None:
            raise StaleBatchError(f"fan-out {plan.plan_id[:8]}: positions ({last}, {plan.end}] are not all staged on "
                                  f"{demand.sink} for {demand.client} (a partition failed or the sink restarted); rerun")
        delivered = _copy_staged(cur, plan.sink_dsns[demand.sink], plan.source, demand.client, last, plan.end)
        if last == demand.after and delivered != staged:
            raise StaleBatchError(f"fan-out {plan.plan_id[:8]}: {demand.session} has {delivered} staged rows, "
                                  f"the partitions recorded {staged}; rerun")
        cur.execute("DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s AND sync_id IS NULL "
                    "AND source_position <= %s", (plan.source, demand.client, plan.end))
        cur.execute("DELETE FROM lr.spark_staged_ranges WHERE source_site_id = %s AND client_name = %s "
                    "AND (plan_id = %s OR range_hi <= %s)", (plan.source, demand.client, plan.plan_id, plan.end))
        write.update(last_log_entry_processed=plan.end)
        if delivered:
            write.announce()
        return delivered, plan.end


_STAGED = ("FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s AND sync_id IS NULL "
           "AND source_position > %s AND source_position <= %s")


def _copy_staged(cur: psycopg2.extensions.cursor, dsn: str, source: str, client: str, last: int, end: int) -> int:
    """COPY the staged rows of ``(last, end]`` into ``lr.receive_queue`` in (position, entry id)
    order, inside the fenced transaction of ``cur``: a second connection streams them out of the
    staging table (binary COPY, ordered by its primary key) through a pipe into the COPY in, so
    ``seq`` follows source order and the rows take PostgreSQL's multi-row insert path.
    Returns the rows copied; raises unless they are exactly the staged rows."""
    params = (source, client, last, end)
    cur.execute("SELECT count(*) " + _STAGED, params)
    expected = cur.fetchone()[0]
    if not expected:
        return 0
    read_fd, write_fd = os.pipe()
    failure: list[BaseException] = []

    def pump() -> None:
        pipe = os.fdopen(write_fd, "wb", buffering=1 << 20)  # closed whatever happens: the COPY in sees EOF
        try:
            out = psycopg2.connect(dsn)
            try:
                with out.cursor() as ocur:
                    ocur.copy_expert(ocur.mogrify(
                        "COPY (SELECT source_site_id, client_name, kind, source_position, source_entry_id, true, "
                        "message " + _STAGED + " ORDER BY source_position, source_entry_id) TO STDOUT (FORMAT binary)",
                        params).decode(), pipe)
            finally:
                out.close()
            pipe.close()
        except BaseException as exc:  # a broken pipe when the COPY in failed first: reported there
            failure.append(exc)
            try:
                pipe.close()
            except OSError:
                pass

    thread = threading.Thread(target=pump, name="lr-fanout-commit-copy", daemon=True)
    thread.start()
    try:
        with os.fdopen(read_fd, "rb", buffering=1 << 20) as pipe:
            cur.copy_expert("COPY lr.receive_queue (source_site_id, client_name, kind, source_position, "
                            "source_entry_id, visible, message) FROM STDIN (FORMAT binary)", pipe, size=1 << 20)
    finally:
        thread.join()
    if failure:
        raise StaleBatchError(f"reading staged rows of {source}/{client} failed: {failure[0]}")
    if cur.rowcount != expected:
        raise StaleBatchError(f"{source}/{client}: copied {cur.rowcount} of {expected} staged rows; rerun")
    return expected


# --- the whole run, and choosing it -------------------------------------------------------------
MapPartitions = Callable[[FanoutPlan], Iterable[StagedPartition]]


def run_fanout(driver: FanoutDriver, map_partitions: MapPartitions, max_entries: int | None = None,
               partitions: int | None = None, min_partitions: int = 1) -> FanoutResult:
    """Plan, stage every partition with ``map_partitions`` (Spark, or a local map), commit."""
    t0 = time.monotonic()
    plan = driver.plan(max_entries, partitions, min_partitions)
    log.info("fan-out %s", plan.describe())
    t1 = time.monotonic()
    staged = list(map_partitions(plan)) if plan.ranges else []
    t2 = time.monotonic()
    result = driver.commit(plan, staged)
    t3 = time.monotonic()
    result.seconds = {"plan": round(t1 - t0, 3), "stage": round(t2 - t1, 3), "commit": round(t3 - t2, 3),
                      "total": round(t3 - t0, 3)}
    result.peak_rss_kb["driver"] = peak_rss_kb()
    return result


def local_map(plan: FanoutPlan) -> Iterable[StagedPartition]:
    """Stage the partitions one after the other in this process (no Spark)."""
    return [stage_partition(plan, part) for part in plan.ranges]


@dataclass(frozen=True)
class SessionBacklog:
    sink: str
    client: str
    state: str
    entries: int  # log entries committed for the session after what its sink acknowledged


def session_backlogs(conn: psycopg2.extensions.connection) -> list[SessionBacklog]:
    """Per session of this source: entries still to deliver (what decides in-process vs Spark)."""
    with conn.cursor() as cur:
        cur.execute(
            """
            SELECT s.sink_site_id, s.client_name, s.state, count(e.entry_id)
            FROM lr.source_sessions s
            JOIN lr.remote_sites r ON r.site_id = s.sink_site_id
            LEFT JOIN lr.clients k ON k.client_name = s.client_name
            LEFT JOIN lr.log_commits c ON c.position > greatest(s.acked_position, 0)
            LEFT JOIN lr.log_entries e ON e.tx = c.tx AND e.stream = %s AND e.tag_ids @> ARRAY[r.tag_id]
                 AND e.client_id = k.client_id
            GROUP BY 1, 2, 3 ORDER BY 1, 2
            """,
            (STREAM_LOG_ENTRIES,),
        )
        rows = [SessionBacklog(*row) for row in cur.fetchall()]
    conn.commit()
    return rows


def use_spark(backlogs: Iterable[SessionBacklog], threshold: int = SPARK_MIN_BACKLOG) -> bool:
    """Spark pays off when the entries to deliver in log-entry sync reach ``threshold``."""
    return sum(b.entries for b in backlogs if b.state == "IN_LOG_ENTRY_SYNC") >= threshold
