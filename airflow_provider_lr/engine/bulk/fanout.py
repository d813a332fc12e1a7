"""Read-once fan-out of a source's shared log to every sink in log-entry sync (seed 003's relay).

The Spark job ``spark_jobs/lr_fanout.py`` runs it in two steps; this module has every rule, the job
only decides where step 2 runs (and tests run it with a plain loop):

1. **plan** (driver): every session of the source takes its lease (the epoch travels with the plan)
   and negotiates exactly as a session cycle does; the sessions in log-entry sync become
   *demands*: a sink, a client, the position the sink has processed, the split of its base
   snapshot. The range to move is ``(min demand, commit barrier]`` (capped by ``max_entries``
   at a transaction boundary), cut into position *chunks* of about equal entry counts.
2. **tee** (the chunks of one source in order, in one task): for a chunk ``(lo, hi]`` every
   session that still needs it opens ONE fenced sink transaction (``writes.SinkTransaction``: session
   row locked, lease epoch checked); it refuses unless the sink's ``last_log_entry_processed`` is where
   the chunk starts for it and skips the chunk when the sink is already at or past ``hi``. The
   chunk is then read ONCE from the source with a binary ``COPY TO STDOUT`` in (position, entry id)
   order, the source server computing per entry the bit mask of the sessions that want it (tag,
   client, after the sink's position, not covered by its base snapshot); each entry, destinations
   stripped at the byte level (``vocabulary.strip_destinations``), is appended to every demanding
   session's packer (``queue_rows``: ~28 entries of 256 B per receive-queue row) and the rows to
   its binary ``COPY lr.receive_queue FROM STDIN`` — a sender thread per session, so the source
   read, the routing and the sinks' ingest overlap. Then each session checks its row and entry
   counts, sets ``last_log_entry_processed = hi``, wakes subscribers and commits.

Why exactly once and in order with no staging: a chunk's rows become visible only at its session's
commit, together with the new position; rows are inserted in source order, so ``seq`` follows it,
and a session's chunks commit one after the other. A killed task leaves its sink transactions
uncommitted (nothing visible); a retry or rerun resumes from each sink's own processed position
(chunks already committed are skipped, per session); a speculative duplicate waits on the session
row lock and then finds the chunk done; a lease taken over since the plan fences the session at
the sink (epoch), and only that session stops.

Memory stays bounded whatever the backlog, by bytes as well as entries: rows stream through the
task (at most ``PACK_EVERY`` entries, and ``PACK_EVERY_BYTES`` of large ones, wait to be packed, then
one block per session of at most ``pgcopy.DEFAULT_BLOCK_BYTES``, two queued); the driver holds
only the plan and small summaries.
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
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

import psycopg2
import psycopg2.extensions
from psycopg2 import sql
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import progress, vocabulary
from airflow_provider_lr.engine.bulk.pgcopy import ReceiveQueueWriter, RowReader
from airflow_provider_lr.engine.errors import ConfigurationError, FencedError, StaleBatchError
from airflow_provider_lr.engine.faults import FAULT_ENV, fault_point, hooked
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.session.runner import SessionRunner, SessionSettings
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.sink.queue_rows import HEADS, piece
from airflow_provider_lr.engine.site.conninfo import ConnInfo
from airflow_provider_lr.engine.site.topology import Topology, site_conninfo
from airflow_provider_lr.engine.source.log_reader import (
    BaseSplit,
    LogReader,
    commit_barrier,
    snapshot_trim_mark,
    trimmed_error,
)
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, SessionKey, SessionState, sink_form_at

log = logging.getLogger(__name__)

PARTITION_ENTRIES = 250_000  # default chunk size when the caller does not fix a count
MAX_DEMANDS = 63  # one bit per demand in the source-side bigint mask
# A row of the partition's read, binary: field count, then (length, value) of position, entry id
# and demand mask (int8 each), then the message's length (the message follows).
_ENTRY_ROW = struct.Struct(">hiqiqiqi")
_ENTRY_SIZE = _ENTRY_ROW.size
PACK_EVERY = 4096  # entries appended between two packing passes...
PACK_EVERY_BYTES = 4 << 20  # ...or bytes of large entries appended: bounded by bytes, whatever their size
LARGE_ENTRY = 1024  # smaller entries are not counted (PACK_EVERY of them hold <= 4 MiB): spares the hot loop


@dataclass(frozen=True)
class Demand:
    """One session in log-entry sync: what its sink still needs."""

    source: str
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
        return str(SessionKey(self.source, self.sink, self.client))


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
class ChunkResult:
    """What one chunk did (small: it is all a Spark task returns to the driver)."""

    index: int
    lo: int
    hi: int
    read: int = 0  # log entries read from the source
    delivered: dict[str, int] = field(default_factory=dict)  # session -> rows committed (0: already done)
    positions: dict[str, int] = field(default_factory=dict)  # session -> sink's last processed after it
    errors: dict[str, str] = field(default_factory=dict)  # session -> why it was refused
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
    partitions: int = 0  # chunks
    entries_read: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # plan, tee, finish
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
                 connect: Callable[[str], psycopg2.extensions.connection] | None = None,
                 sessions: Iterable[SessionKey] | None = None,
                 conninfo: Callable[[str], ConnInfo] | None = None) -> None:
        self.topology = topology
        self.source = source
        self.owner = owner or leases.new_owner_id()
        self.settings = settings or SessionSettings.from_topology(topology)
        mine = topology.sessions(source=source)  # all of the source's sessions, or the given ones of them
        wanted = None if sessions is None else set(sessions)
        self.sessions = [k for k in mine if wanted is None or k in wanted]
        if not self.sessions:
            raise ConfigurationError(f"site {source!r} is the source of no session in the topology")
        resolve = conninfo or (lambda site: site_conninfo(topology, site))  # how the tee reaches each site
        self._dsns = {site: resolve(site).dsn for site in {source, *(k.sink for k in self.sessions)}}
        self._connect = connect or (lambda site: psycopg2.connect(self._dsns[site]))
        self.src = self._connect(source)
        self.leases: dict[str, leases.Lease] = {}
        self._keeper: _LeaseKeeper | None = None

    def plan(self, max_entries: int | None = None, partitions: int | None = None) -> FanoutPlan:
        """Take the sessions' leases, negotiate, and cut the range to move into chunks."""
        demands, skipped = [], {}
        for key in self.sessions:
            try:
                demand = self._demand(key)
            except Exception as exc:  # one sink down must not stop the others
                skipped[str(key)] = f"{type(exc).__name__}: {exc}".strip()
                log.warning("fan-out of %s: session %s left out: %s", self.source, key, exc)
                continue
            if isinstance(demand, str):
                skipped[str(key)] = demand
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
        ranges, end = self._ranges(lo, barrier, max_entries, partitions)
        return FanoutPlan(lo=lo, end=end, barrier=barrier, ranges=ranges, **base)

    def _demand(self, key: SessionKey) -> Demand | str:
        """The session's demand, or why it is left out (lease held elsewhere, snapshot needed)."""
        sink_conn = self._connect(key.sink)
        try:
            runner = SessionRunner(key, self.src, sink_conn, self.owner, self.settings)
            report, meta, negotiation = runner.begin()
            if runner.lease is not None:
                self.leases[str(key)] = runner.lease
            if negotiation is None:
                return report.skipped or f"negotiation refused: {report.error}"
            if negotiation.decision is not Decision.LOG_ENTRY_SYNC:
                return f"needs {negotiation.decision.value} ({negotiation.reason}); left to the session cycle"
            assert meta is not None and runner.lease is not None
            reader = LogReader(self.src, key.sink, STREAM_LOG_ENTRIES, client_name=key.client)
            assert reader.client_id is not None
            leases.update_session(self.src, runner.lease, state=SessionState.IN_LOG_ENTRY_SYNC,
                                  acked_position=meta.last_log_entry_processed, last_error=None)
            return Demand(key.source, key.sink, key.client, reader.client_id, reader.tag_id, meta.last_log_entry_processed,
                          meta.snapshot_applied, meta.split, runner.lease.epoch)
        finally:
            sink_conn.close()

    def _ranges(self, lo: int, barrier: int, max_entries: int | None,
                partitions: int | None) -> tuple[tuple[PositionRange, ...], int]:
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
            parts = partitions or max(1, math.ceil(wanted / PARTITION_ENTRIES))
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
        if not bounds:  # nothing for anyone up to the barrier: one empty chunk advances the sinks
            return (PositionRange(0, lo, barrier, 0),), barrier
        capped = int(bounds[-1][2]) < int(total)
        ranges, prev_pos, prev_upto = [], lo, 0
        for i, (_, position, upto) in enumerate(bounds):
            hi = position if (capped or i < len(bounds) - 1) else barrier
            ranges.append(PositionRange(i, prev_pos, hi, int(upto) - prev_upto))
            prev_pos, prev_upto = hi, int(upto)
        return tuple(ranges), ranges[-1].hi

    # --- 3. finish (driver) -----------------------------------------------------------------
    def finish(self, plan: FanoutPlan, chunks: Iterable[ChunkResult]) -> FanoutResult:
        """Sum up what the chunks committed and record each session's progress on the source."""
        result = FanoutResult(plan.plan_id, plan.source, plan.lo, plan.end, skipped=dict(plan.skipped),
                              blocked_by=list(plan.blocked_by))
        parts = list(chunks)
        result.partitions = len(parts)
        result.entries_read = sum(p.read for p in parts)
        result.peak_rss_kb["executor_python"] = max((p.peak_rss_kb for p in parts), default=0)
        result.peak_rss_kb["executor_jvm"] = max((p.jvm_peak_kb for p in parts), default=0)
        if self._keeper is not None:
            self._keeper.stop()
        delivered: dict[str, int] = {}
        for part in parts:
            result.errors.update(part.errors)
            result.positions.update(part.positions)
            for session, rows in part.delivered.items():
                delivered[session] = delivered.get(session, 0) + rows
        for demand in plan.demands:
            lease, session = self.leases[demand.session], demand.session
            position = result.positions.get(session, demand.after)
            if session not in result.errors and position < plan.end:
                result.errors[session] = f"StaleBatchError: stopped at position {position} of {plan.end}"
            try:
                if session in result.errors:
                    log.error("fan-out %s: session %s stopped at %s: %s", plan.plan_id[:8], session, position,
                              result.errors[session])
                    leases.update_session(self.src, lease, acked_position=max(position, demand.after),
                                          last_error=f"fan-out: {result.errors[session]}"[:2000])
                    continue
                result.deliveries[session] = delivered.get(session, 0)
                leases.update_session(self.src, lease, acked_position=position, last_error=None,
                                      last_success_at=AsIs("now()"))
            except FencedError as exc:  # taken over since: the new holder records its own progress
                result.errors.setdefault(session, f"FencedError: {exc}")
                result.deliveries.pop(session, None)
                continue
            log.info("fan-out %s: %s delivered %d entries, sink at position %s",
                     plan.plan_id[:8], session, result.deliveries[session], position)
        return result

    def close(self) -> None:
        """Release the leases taken by ``plan`` and close connections."""
        if self._keeper is not None:
            self._keeper.stop()
        for lease in self.leases.values():
            leases.release_quietly(self.src, lease)
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


# --- 2. tee (one chunk, anywhere) -----------------------------------------------------------------
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


class _SessionTee:
    """One session's side of a chunk: its fenced sink transaction and the COPY into its queue."""

    def __init__(self, plan: FanoutPlan, demand: Demand, part: PositionRange) -> None:
        self.demand = demand
        self.writer: ReceiveQueueWriter | None = None
        self.conn = psycopg2.connect(plan.sink_dsns[demand.sink])
        self.transaction = writes.SinkTransaction(self.conn, plan.source, demand.client, demand.epoch)
        self.done = False  # the sink already processed the whole chunk: nothing to write
        try:
            meta = self.transaction.open()  # locks the session row (a duplicate attempt waits here)
            if not meta.data_consistent or meta.snapshot_applied != demand.base:
                raise StaleBatchError(
                    f"fan-out for base {demand.base} but the sink of {plan.source}/{demand.client} is at base "
                    f"{meta.snapshot_applied} (consistent: {meta.data_consistent}); renegotiate")
            last, start = meta.last_log_entry_processed, max(part.lo, demand.after)
            self.position = last
            if last >= part.hi:
                self.done = True
            elif last != start:
                raise StaleBatchError(f"fan-out chunk ({part.lo}, {part.hi}] of {demand.session} starts after "
                                      f"{start} but its sink has processed up to {last}; rerun")
            else:
                self.writer = ReceiveQueueWriter(self.conn, plan.source, demand.client)
        except BaseException:
            self.abandon()
            raise
        if self.done:
            self.abandon()

    def commit(self, end: int) -> None:
        """Wait for the last rows, check them, advance the sink's position, commit."""
        assert self.writer is not None
        try:
            self.writer.close()
            if self.writer.copied != self.writer.rows:
                raise StaleBatchError(f"{self.demand.session}: the sink took {self.writer.copied} of "
                                      f"{self.writer.rows} rows")
            self.transaction.update(last_log_entry_processed=end)
            if self.entries:
                self.transaction.announce()
        except BaseException:
            self.transaction.abort()
            self.conn.close()
            raise
        self.transaction.commit()
        self.conn.close()
        self.position = end

    @property
    def entries(self) -> int:
        """Entries routed to this session in the chunk (all in its rows once committed)."""
        return self.writer.entries if self.writer is not None else 0

    def abandon(self) -> None:
        """Drop the transaction (nothing of this chunk becomes visible) and the connection."""
        if self.writer is not None:
            self.writer.abandon()
        if not self.conn.closed:
            try:
                self.conn.rollback()
            except psycopg2.Error:
                pass
            self.conn.close()


def tee_chunk(plan: FanoutPlan, part: PositionRange, fault_tag: str = "",
              exclude: Iterable[str] = ()) -> ChunkResult:
    """Deliver one chunk ``(lo, hi]`` to every session that still needs it (see the module docstring).

    Sessions in ``exclude`` (failed in an earlier chunk of this run) are left out. One session
    refused (lease taken over, sink moved on, sink down) does not stop the others; an error of the
    source read fails the whole chunk and nothing of it becomes visible. ``fault_tag`` names this
    attempt for fault points (e.g. ``_p1_a0``: chunk 1, attempt 0): ``LR_FAULT=fanout_mid_write_p1_a0``
    kills the process once half of the chunk is in the sinks' open transactions,
    ``fanout_after_commit_p1_a0`` after every session committed the chunk."""
    started = time.monotonic()
    out = ChunkResult(part.index, part.lo, part.hi)
    skip = set(exclude)
    faults = _armed(plan.faults) or hooked()
    tees: list[tuple[int, _SessionTee]] = []
    try:
        for bit, d in enumerate(plan.demands):
            if d.after >= part.hi or d.session in skip:
                continue
            try:
                tee = _SessionTee(plan, d, part)
            except Exception as exc:  # this session only
                out.errors[d.session] = f"{type(exc).__name__}: {exc}".strip()
                log.warning("fan-out %s chunk %d: session %s refused: %s", plan.plan_id[:8], part.index, d.session, exc)
                continue
            out.positions[d.session] = tee.position
            if tee.done:
                out.delivered[d.session] = 0
            else:
                tees.append((bit, tee))
        if tees:
            tees, out.read = _read_and_route(plan, part, tees, out, fault_tag if faults else None)
        for _, tee in tees:
            try:
                tee.commit(part.hi)
            except Exception as exc:
                out.errors[tee.demand.session] = f"{type(exc).__name__}: {exc}".strip()
                log.warning("fan-out %s chunk %d: session %s not committed: %s", plan.plan_id[:8], part.index,
                            tee.demand.session, exc)
                continue
            out.delivered[tee.demand.session] = tee.entries
            out.positions[tee.demand.session] = tee.position
        if faults:
            fault_point(f"fanout_after_commit{fault_tag}")
    finally:
        for _, tee in tees:
            tee.abandon()  # no-op for the committed ones
    out.seconds, out.peak_rss_kb, out.pid = time.monotonic() - started, peak_rss_kb(), os.getpid()
    return out


class _Router(RowReader):
    """``write`` target of the chunk's source COPY: turns each entry into its packed receive-queue
    form (``queue_rows.piece``, destinations stripped) and appends it to the writer of every
    session whose bit is set in the entry's mask.

    The usual row (one CopyData message = one row, destinations of < 128 bytes, a one-byte type)
    is read in place (``vocabulary.sink_form_at``), with no other call per entry than that, this
    ``write`` and one list append per session (rows are formed every ``PACK_EVERY`` entries or
    ``PACK_EVERY_BYTES``): this loop is the fan-out's per-entry Python cost. Anything else goes through ``RowReader``'s general parser
    and ``vocabulary.strip_destinations``."""

    def __init__(self, tees: list[tuple[int, _SessionTee]], halfway: int, fault_tag: str | None) -> None:
        super().__init__(self._general_row)
        self.by_bit = dict(tees)
        self.routes: dict[int, list] = {}  # mask -> the append of each writer that wants it
        self.read = 0
        self.waiting = 0  # bytes of large entries appended since the last packing pass
        self.halfway, self.fault_tag = halfway, fault_tag
        self.stop = min(s for s in (PACK_EVERY, halfway) if s > 0)  # the next read that calls _stop

    def _route(self, mask: int) -> list:
        route = self.routes[mask] = [t.writer.append for bit, t in self.by_bit.items() if mask >> bit & 1]
        return route

    def write(self, chunk: bytes) -> int:
        size = len(chunk)
        if self._header_seen and not self._buf and size > _ENTRY_SIZE:
            count, _, position, _, entry_id, _, mask, length = _ENTRY_ROW.unpack_from(chunk)
            if count == 4 and _ENTRY_SIZE + length == size:
                try:
                    kind, pos = sink_form_at(chunk, _ENTRY_SIZE)
                except IndexError:
                    self._deliver(position, entry_id, mask, chunk[_ENTRY_SIZE:])
                    self.rows += 1
                    return size
                route = self.routes.get(mask) or self._route(mask)
                length = size - pos  # queue_rows.piece, inline for the usual size
                entry = (HEADS[length] + chunk[pos:] if length < len(HEADS) else piece(chunk[pos:]), kind,
                         position, entry_id)
                for append in route:
                    append(entry)
                self.read += 1
                if self.read == self.stop or (length > LARGE_ENTRY and self._large(length)):
                    self._stop()
                return size
        return super().write(chunk)

    def _general_row(self, fields: list[bytes | None]) -> None:  # unusual chunking
        position, entry_id, mask = (int.from_bytes(f or b"", "big", signed=True) for f in fields[:3])
        self._deliver(position, entry_id, mask, fields[3] or b"")

    def _deliver(self, position: int, entry_id: int, mask: int, message: bytes) -> None:
        route = self.routes.get(mask) or self._route(mask)
        kind, stripped = vocabulary.strip_destinations(message)
        entry = (piece(stripped), kind, position, entry_id)
        for append in route:
            append(entry)
        self.read += 1
        if self.read == self.stop or (len(entry[0]) > LARGE_ENTRY and self._large(len(entry[0]))):
            self._stop()

    def _large(self, size: int) -> bool:
        """Count a large entry's bytes; True when those waiting to be packed reach ``PACK_EVERY_BYTES``."""
        self.waiting += size
        return self.waiting >= PACK_EVERY_BYTES

    def _stop(self) -> None:
        """Every ``PACK_EVERY`` entries or ``PACK_EVERY_BYTES``: form the rows of what each session
        got so far (bounds what waits in memory by count and bytes; the rows go on to the sinks'
        COPY blocks, at most ``QUEUED_BLOCKS`` waiting); at ``halfway``, the fault point."""
        if self.read == self.halfway:
            self._fault()
        if self.read % PACK_EVERY == 0 or self.waiting >= PACK_EVERY_BYTES:
            for tee in self.by_bit.values():
                tee.writer.pack()  # type: ignore[union-attr]
            self.waiting = 0
        self.stop = min(s for s in (self.read + PACK_EVERY - self.read % PACK_EVERY, self.halfway) if s > self.read)

    def _fault(self) -> None:
        """Half the chunk read: make sure rows are in the sinks' open transactions, then die."""
        for tee in self.by_bit.values():
            tee.writer.sync()  # type: ignore[union-attr]
        fault_point(f"fanout_mid_write{self.fault_tag}")



def _read_and_route(plan: FanoutPlan, part: PositionRange, tees: list[tuple[int, _SessionTee]],
                    out: ChunkResult, fault_tag: str | None) -> tuple[list[tuple[int, _SessionTee]], int]:
    """Read the chunk ONCE from the source (binary COPY, in (position, entry id) order, demand mask
    computed by the source) and append each entry's receive-queue row to every demanding session's
    COPY. The read runs in one snapshot with the trim mark: a session whose sink stands below it
    is refused (``TrimmedError`` in ``out.errors``, nothing written) and left out of the read.
    Returns the sessions still in the chunk and the entries read."""
    src = psycopg2.connect(plan.source_dsn)
    try:
        mark = snapshot_trim_mark(src)
        kept = []
        for bit, tee in tees:
            if mark > tee.position:
                error = trimmed_error(f"fan-out of {plan.source} to {tee.demand.session}", tee.position, mark)
                out.errors[tee.demand.session] = f"TrimmedError: {error}"
                log.warning("fan-out %s chunk %d: %s", plan.plan_id[:8], part.index, error)
                tee.abandon()
            else:
                kept.append((bit, tee))
        if not kept:
            return kept, 0
        return kept, _copy_and_route(src, plan, part, kept, fault_tag)
    finally:
        src.close()


def _copy_and_route(src: psycopg2.extensions.connection, plan: FanoutPlan, part: PositionRange,
                    tees: list[tuple[int, _SessionTee]], fault_tag: str | None) -> int:
    router = _Router(tees, max(1, part.entries // 2) if fault_tag is not None else -1, fault_tag)
    query = sql.SQL(
        "COPY (SELECT position, entry_id, mask, message FROM ("
        " SELECT c.position, e.entry_id, ({mask}) AS mask, e.message FROM lr.log_commits c"
        " CROSS JOIN LATERAL (SELECT e.entry_id, e.client_id, e.tag_ids, e.message FROM lr.log_entries e"
        "  WHERE e.tx = c.tx AND e.stream = {stream} OFFSET 0) e"  # per-commit index lookups
        " WHERE c.position > {lo} AND c.position <= {hi}) r WHERE mask <> 0 ORDER BY position, entry_id)"
        " TO STDOUT (FORMAT binary)"
    ).format(mask=_demand_mask_sql(plan, [(bit, t.demand) for bit, t in tees]), lo=sql.Literal(part.lo),
             hi=sql.Literal(part.hi), stream=sql.Literal(STREAM_LOG_ENTRIES))
    with src.cursor() as cur:
        cur.copy_expert(query.as_string(src), router)
    src.rollback()
    return router.read


def tee_chunks(plan: FanoutPlan, attempt: int = 0) -> Iterator[ChunkResult]:
    """Every chunk of the plan in order (a session's chunks must commit in order); a session that
    fails in one chunk is left out of the following ones."""
    failed: set[str] = set()
    for part in plan.ranges:
        chunk = tee_chunk(plan, part, fault_tag=f"_p{part.index}_a{attempt}", exclude=failed)
        failed.update(chunk.errors)
        yield chunk


def _armed(faults: str | None) -> bool:
    """Fault points follow the driver's environment, in whatever process runs the partition (on
    a cluster the executors do not share it; a reused Python worker must not keep an old one)."""
    if faults:
        os.environ[FAULT_ENV] = faults
    else:
        os.environ.pop(FAULT_ENV, None)
    return bool(faults)


def staged_coverage(cur: psycopg2.extensions.cursor, source: str, client: str, plan_id: str,
                    lo: int, hi: int) -> int | None:
    """Rows staged in ``lr.spark_staging`` for ``(lo, hi]`` by a plan's partitions, or None unless
    they cover it all (the snapshot transfer's staging; the fan-out no longer stages)."""
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


# --- the whole run -----------------------------------------------------------------------------
MapChunks = Callable[[FanoutPlan], Iterable[ChunkResult]]


def run_fanout(driver: FanoutDriver, map_chunks: MapChunks, max_entries: int | None = None,
               partitions: int | None = None) -> FanoutResult:
    """Plan, tee every chunk in order with ``map_chunks`` (a Spark task, or this process), sum up."""
    t0 = time.monotonic()
    plan = driver.plan(max_entries, partitions)
    log.info("fan-out %s", plan.describe())
    t1 = time.monotonic()
    chunks: list[ChunkResult] = []
    if plan.ranges:
        with progress.track(f"catch-up of {plan.source} (read-once fan-out)", plan.entries) as tracker:
            for chunk in map_chunks(plan):
                chunks.append(chunk)
                tracker.advance(chunk.read)
    t2 = time.monotonic()
    result = driver.finish(plan, chunks)
    t3 = time.monotonic()
    result.seconds = {"plan": round(t1 - t0, 3), "tee": round(t2 - t1, 3), "finish": round(t3 - t2, 3),
                      "total": round(t3 - t0, 3)}
    result.peak_rss_kb["driver"] = peak_rss_kb()
    return result


def local_map(plan: FanoutPlan) -> Iterable[ChunkResult]:
    """Tee the chunks one after the other in this process (no Spark), as they are done."""
    return tee_chunks(plan)

