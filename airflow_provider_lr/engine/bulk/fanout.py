"""Read-once fan-out of a source's shared log to every sink in log-entry sync (after Synnax's relay).

The Spark job ``spark_jobs/lr_fanout.py``, ``lr sync``'s catch-up and ``LRFanOutOperator`` run it
in two steps; the engine has every rule, a caller only decides where step 2 runs (``run_fanout``'s
``map_chunks``: a Spark task, or ``local_map`` in this process). Which of them catches a backlog up
at all is ``session/catchup.py``'s decision. This module is the run and its driver; the parts:
``bulk/plan.py`` (what moves, what comes back), ``bulk/tee.py`` (one chunk), ``bulk/router.py`` (its
source read), ``session/lease_keeper.py`` (the leases kept alive meanwhile).

1. **plan** (driver): every session of the source runs the handshake a session cycle runs
   (``session/handshake.py``: lease, fence, negotiation); the sessions in log-entry sync become
   *demands*: a sink, a client and the handshake's ``Position`` (the position the sink has
   processed, its base and the split of its base snapshot, the lease epoch, which travels with
   the plan). The range to move is ``(min demand, commit barrier]`` (capped by ``max_entries``
   at a transaction boundary), cut into position *chunks* of about equal entry counts.
2. **tee** (the chunks of one source in order, in one task): for a chunk ``(lo, hi]`` every
   session that still needs it opens ONE fenced sink transaction (``writes.SinkTransaction``:
   session row locked, lease epoch checked); it refuses unless the sink's
   ``last_log_entry_processed`` is where the chunk starts for it and skips the chunk when the sink
   is already at or past ``hi``. The chunk is then read ONCE from the source with a binary
   ``COPY TO STDOUT`` in (position, entry id) order, the source server computing per entry the bit
   mask of the sessions that want it (tag, client, after the sink's position, not covered by its
   base snapshot) and, in SQL, each entry's packed form with its destinations stripped (rows of
   256 entries of a commit: ``bulk/router.py``); each entry is appended to every demanding
   session's packer (``queue_rows``: ~28 entries of 256 B per receive-queue row) and the rows to its binary
   ``COPY lr.receive_queue FROM STDIN`` — a sender thread per session, so the source read, the
   routing and the sinks' ingest overlap. Then each session checks its row and entry counts, sets
   ``last_log_entry_processed = hi``, wakes subscribers and commits.

   Or, with ``tasks`` > 1, the chunks at once in that many tasks: each stages its chunk on the
   sinks and publishes what continues each sink's position (``bulk/staged_tee.py``, which says why
   that is still exactly once and in order).

Why the ordered tee is exactly once and in order with no staging: a chunk's rows become visible
only at its session's commit, together with the new position; rows are inserted in source order,
so ``seq`` follows it, and a session's chunks commit one after the other. A killed task leaves its sink transactions
uncommitted (nothing visible); a retry or rerun resumes from each sink's own processed position
(chunks already committed are skipped, per session); a speculative duplicate waits on the session
row lock and then finds the chunk done; a lease taken over since the plan fences the session at
the sink (epoch), and only that session stops.

Memory stays bounded whatever the backlog, by bytes as well as entries: rows stream through the
task (a row of at most ``router.GROUP_ENTRIES`` entries of ``GROUP_ENTRY_BYTES``, or one larger
entry, then at most ``router.PACK_EVERY`` entries or ``PACK_EVERY_BYTES`` wait to be packed, then
one block per session of at most ``pgcopy.DEFAULT_BLOCK_BYTES``, two queued); the
driver holds only the plan and small summaries.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

import psycopg2
import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.bulk import peak_memory, staged_tee
from airflow_provider_lr.engine.bulk.plan import (
    MAX_DEMANDS,
    ChunkResult,
    Demand,
    FanoutPlan,
    FanoutResult,
    PositionRange,
)
from airflow_provider_lr.engine.bulk.tee import tee_chunks
from airflow_provider_lr.engine.db.conninfo import ConnInfo, connect_dsn
from airflow_provider_lr.engine.db.explained import failure, refused_kind
from airflow_provider_lr.engine.db.lifting import lift
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    FencedError,
    TopologyMismatchError,
    error_line,
    one_line,
    require_counts,
)
from airflow_provider_lr.engine.faults import FAULT_ENV
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import Verdict, handshake
from airflow_provider_lr.engine.session.lease_keeper import LeaseKeeper
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source.commit_barrier import commit_barrier
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.engine.store.topology import Topology, site_conninfo
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, SessionKey, SessionState

log = logging.getLogger(__name__)

PARTITION_ENTRIES = 250_000  # default chunk size when the caller does not fix a count


class FanoutDriver:
    """The driver side of one fan-out run: leases, plan, commits. Close it to release leases."""

    def __init__(
        self,
        topology: Topology,
        source: str,
        owner: str | None = None,
        settings: SessionSettings | None = None,
        connect: Callable[[str], psycopg2.extensions.connection] | None = None,
        sessions: Iterable[SessionKey] | None = None,
        conninfo: Callable[[str], ConnInfo] | None = None,
    ) -> None:
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
        self._dsns = {site: resolve(site).dsn_for(Purpose.BULK) for site in {source, *(k.sink for k in self.sessions)}}
        self._connect = connect or (lambda site: connect_dsn(self._dsns[site], Purpose.BULK, topology.timeouts))
        self.src = self._connect(source)
        lift(self.src)  # its own: a session connection from ``connect`` too gets the bulk bounds
        self.leases: dict[str, leases.Lease] = {}
        # why ``plan`` could not take a session up (its ``errors``), as raised: an adapter's rule of
        # what no retry mends reads them (the operator's ``finals_refused``)
        self.failures: dict[str, BaseException] = {}
        self._keeper: LeaseKeeper | None = None

    def plan(self, max_entries: int | None = None, partitions: int | None = None, tasks: int = 1) -> FanoutPlan:
        """Take the sessions' leases, negotiate, and cut the range to move into chunks. ``tasks`` > 1:
        that many tasks will tee chunks at once, staged and published in order
        (``bulk/staged_tee.py``): at least one chunk each, and what earlier staged runs left on
        the sinks is dropped first."""
        require_counts(max_entries=max_entries, partitions=partitions, tasks=tasks)
        staged = tasks > 1
        demands, skipped, errors = [], {}, {}
        for key in self.sessions:
            try:
                demand = self._demand(key, staged)
            except Exception as exc:  # one sink down must not stop the others; the run is not ok
                errors[str(key)], self.failures[str(key)] = failure(exc), exc
                log.warning("fan-out of %s: session %s not delivered: %s", self.source, key, failure(exc))
                self._let_go(str(key))
                continue
            if isinstance(demand, str):
                skipped[str(key)] = demand
            else:
                demands.append(demand)
        if len(demands) > MAX_DEMANDS:
            raise ConfigurationError(f"{len(demands)} sessions in one fan-out of {self.source}; at most {MAX_DEMANDS}")
        self._keeper = LeaseKeeper(
            self._dsns[self.source], list(self.leases.values()), self.settings.lease_seconds, self.topology.timeouts
        )
        plan_id = str(uuid.uuid4())
        empty = FanoutPlan(
            plan_id=plan_id,
            source=self.source,
            lo=0,
            end=0,
            barrier=0,
            demands=tuple(demands),
            ranges=(),
            source_dsn=self._dsns[self.source],
            sink_dsns={d.sink: self._dsns[d.sink] for d in demands},
            skipped=skipped,
            errors=errors,
            faults=os.environ.get(FAULT_ENV),
            staged=staged,
            timeouts=self.topology.timeouts,
        )
        if not demands:
            return empty
        barrier, blocked = commit_barrier(self.src, self.settings.barrier_timeout)
        lo = min(d.position.after for d in demands)
        if barrier is None or barrier <= lo:
            return replace(empty, lo=lo, end=lo, barrier=barrier or lo, blocked_by=tuple(h.describe() for h in blocked))
        ranges, end = self._ranges(lo, barrier, max_entries, partitions, tasks)
        return replace(empty, lo=lo, end=end, barrier=barrier, ranges=ranges)

    def _demand(self, key: SessionKey, staged: bool = False) -> Demand | str:
        """The session's demand, or why it is left out (lease held elsewhere, snapshot needed: the
        session cycle's to do). Raises what is wrong: a refused negotiation (``TopologyMismatchError``: the topology the sites run), a
        grant missing, a schema too old, a site down."""
        sink_conn = self._connect(key.sink)
        try:
            hs = handshake(
                self.src, sink_conn, key, self.owner, self.settings.lease_seconds, on_lease=partial(self._held, key)
            )
            if hs.verdict is Verdict.REFUSED:  # recorded on the source; a mismatch heals by no retry
                raise TopologyMismatchError(hs.reason)
            why = hs.left_out(Decision.LOG_ENTRY_SYNC)
            if why is not None:
                return why
            if registry.federated_tables(self.src, key.client) or table_snapshot.splits(sink_conn, key):
                # the fan-out routes routing-queue entries only; a table's changes go with the session's
                # own reads (a table federated after this check is not synced on the sink yet: its
                # snapshot, taken later by a cycle, holds whatever this run passes over)
                return "carries federated tables; left to the session cycle"
            assert hs.position is not None and hs.lease is not None
            reader = LogReader(self.src, key.sink, STREAM_LOG_ENTRIES, client_name=key.client)
            assert reader.client_id is not None
            leases.update_session(
                self.src,
                hs.lease,
                state=SessionState.IN_LOG_ENTRY_SYNC,
                acked_position=hs.position.after,
                last_error=None,
            )
            if staged:
                with writes.SinkTransaction(sink_conn, key.source, key.client, hs.position.epoch) as (cur, _):
                    writes.discard_staged(cur, key.source, key.client)
            return Demand(key.source, key.sink, key.client, reader.client_id, reader.tag_id, hs.position)
        finally:
            sink_conn.close()

    def _held(self, key: SessionKey, lease: leases.Lease | None) -> None:
        """The handshake took (or moved) ``key``'s lease: released at ``close`` even if it then fails."""
        if lease is not None:
            self.leases[str(key)] = lease

    def _let_go(self, session: str) -> None:
        """Release at once the lease of a session ``plan`` could not take up: kept, it held every other
        replicator off the session for the whole run and ``lease_seconds`` more. What the failure
        left of a transaction on the source is rolled back first (aborted, it failed the next
        sessions' handshakes as well, and the release)."""
        if not self.src.closed:
            try:
                self.src.rollback()
            except psycopg2.Error:
                pass
        lease = self.leases.pop(session, None)
        if lease is None:
            return
        try:
            self._on_source(partial(leases.release, lease=lease))
        except Exception as exc:  # the source is down: the lease runs out on its own
            log.warning("fan-out of %s: lease of %s not released: %s", self.source, session, one_line(exc))
            if not self.src.closed:
                try:
                    self.src.rollback()
                except psycopg2.Error:
                    pass

    def _ranges(
        self, lo: int, barrier: int, max_entries: int | None, partitions: int | None, tasks: int = 1
    ) -> tuple[tuple[PositionRange, ...], int]:
        """Sub-ranges of ``(lo, barrier]`` with about equal entry counts (whole transactions),
        capped at ``max_entries``; computed by the source, only the boundaries come back."""
        cap = max_entries or 2**62
        with self.src.cursor() as cur:
            cur.execute(  # one pass over the log's entries (the chunks' count needs their total)
                """
                WITH per AS (
                    SELECT c.position, count(*) AS n FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx
                    WHERE c.position > %(lo)s AND c.position <= %(hi)s AND e.stream = %(stream)s GROUP BY c.position
                ), cum AS (
                    SELECT position, sum(n) OVER (ORDER BY position) AS upto FROM per
                ), kept AS (  -- whole transactions up to the cap, at least one
                    SELECT position, upto FROM cum WHERE upto <= %(cap)s OR upto = (SELECT min(upto) FROM cum)
                ), total AS (
                    SELECT coalesce(max(upto), 0) AS n FROM cum
                ), parts AS (
                    SELECT coalesce(%(parts)s, greatest(%(tasks)s, ceil(least(n, %(cap)s) / %(per_part)s::numeric)))
                        AS n FROM total
                )
                SELECT ceil(upto * (SELECT n FROM parts) / (SELECT max(upto) FROM kept))::int AS bucket,
                       max(position), max(upto), (SELECT n FROM total)
                FROM kept GROUP BY 1 ORDER BY 1
                """,
                {
                    "lo": lo,
                    "hi": barrier,
                    "stream": STREAM_LOG_ENTRIES,
                    "cap": cap,
                    "parts": partitions or None,
                    "tasks": tasks,
                    "per_part": PARTITION_ENTRIES,
                },
            )
            bounds = cur.fetchall()
        self.src.commit()
        if not bounds:  # nothing for anyone up to the barrier: one empty chunk advances the sinks
            return (PositionRange(0, lo, barrier, 0),), barrier
        capped = int(bounds[-1][2]) < int(bounds[-1][3])  # the total
        ranges, prev_pos, prev_upto = [], lo, 0
        for i, (_, position, upto, _) in enumerate(bounds):
            hi = position if (capped or i < len(bounds) - 1) else barrier
            ranges.append(PositionRange(i, prev_pos, hi, int(upto) - prev_upto))
            prev_pos, prev_upto = hi, int(upto)
        return tuple(ranges), ranges[-1].hi

    # --- finish (driver) --------------------------------------------------------------------------
    def finish(self, plan: FanoutPlan, chunks: Iterable[ChunkResult], paused: bool = False) -> FanoutResult:
        """Sum up what the chunks committed and record each session's progress on the source;
        ``paused``: the run stopped between chunks, a session short of the plan's end is no error."""
        result = FanoutResult(
            plan.plan_id,
            plan.source,
            plan.lo,
            plan.end,
            errors=dict(plan.errors),
            refused={s: kind for s, exc in self.failures.items() if (kind := refused_kind(exc))},
            skipped=dict(plan.skipped),
            blocked_by=list(plan.blocked_by),
            paused=paused,
        )
        parts = list(chunks)
        result.partitions = len(parts)
        result.retried = sum(1 for p in parts if p.attempt > 0)
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
        if plan.staged:
            self._settle_staged(plan, result, delivered)
        for demand in plan.demands:
            lease, session = self.leases[demand.session], demand.session
            position = result.positions.get(session, demand.position.after)
            if session not in result.errors and position < plan.end and not paused:
                result.errors[session] = f"StaleBatchError: stopped at position {position} of {plan.end}"
            try:
                if session in result.errors:
                    log.error(
                        "fan-out %s: session %s stopped at %s: %s",
                        plan.plan_id[:8],
                        session,
                        position,
                        result.errors[session],
                    )
                    error = f"fan-out: {result.errors[session]}"[:2000]
                    acked = max(position, demand.position.after)
                    self._on_source(partial(leases.update_session, lease=lease, acked_position=acked, last_error=error))
                    continue
                result.deliveries[session] = delivered.get(session, 0)
                self._on_source(
                    partial(
                        leases.update_session,
                        lease=lease,
                        acked_position=position,
                        last_error=None,
                        last_success_at=AsIs("now()"),
                    )
                )
            except FencedError as exc:  # taken over since: the new holder records its own progress
                result.errors.setdefault(session, error_line(exc))
                result.deliveries.pop(session, None)
                continue
            log.info(
                "fan-out %s: %s delivered %d entries, sink at position %s",
                plan.plan_id[:8],
                session,
                result.deliveries[session],
                position,
            )
        return result

    @staticmethod
    def _settle_staged(plan: FanoutPlan, result: FanoutResult, delivered: dict[str, int]) -> None:
        """A staged run's last publish per session (whatever its tasks left staged in order), its
        position and the entries the run made visible, counted from the sink's range records
        (a task attempt Spark discarded may have published some)."""
        for demand in plan.demands:
            session = demand.session
            try:
                position, _ = staged_tee.publish(plan, demand)
                delivered[session] = staged_tee.published_entries(plan, demand, position)
                result.positions[session] = position
            except Exception as exc:
                result.errors.setdefault(session, error_line(exc))
                result.positions.pop(session, None)

    def _on_source(self, work: Callable[[psycopg2.extensions.connection], None]) -> None:
        """``work`` on the driver's source connection, on a new one once when that was lost: the source
        restarted during the run (its tasks connect for themselves and carried on; the driver's own
        connection died with the server). Before, the run failed at its end with psycopg2's
        "connection already closed", the sinks' progress unrecorded, and ``close`` could not release
        the leases: every other replicator was kept off the sessions for ``lease_seconds``."""
        for last in (False, True):
            if self.src.closed:
                self.src = self._connect(self.source)
                lift(self.src)
            try:
                work(self.src)
                return
            except (psycopg2.OperationalError, psycopg2.InterfaceError):
                if last or not self.src.closed:  # not a lost connection (a lock timeout): the caller's
                    raise
                log.info("fan-out of %s: the connection to its source was lost; connecting again", self.source)

    def close(self) -> None:
        """Release the leases taken by ``plan`` (on a new connection to the source when the driver's
        was lost) and close connections."""
        if self._keeper is not None:
            self._keeper.stop()
        for lease in self.leases.values():
            try:
                self._on_source(partial(leases.release, lease=lease))
            except Exception as exc:  # the source is down: the lease runs out on its own (``lease_seconds``)
                log.warning("fan-out of %s: lease of %s not released: %s", self.source, lease.sink, one_line(exc))
                if not self.src.closed:
                    try:
                        self.src.rollback()
                    except psycopg2.Error:
                        pass
        if not self.src.closed:
            self.src.close()


# --- the whole run -------------------------------------------------------------------------------
MapChunks = Callable[[FanoutPlan], Iterable[ChunkResult]]


def run_fanout(
    driver: FanoutDriver,
    map_chunks: MapChunks,
    max_entries: int | None = None,
    partitions: int | None = None,
    tasks: int = 1,
    pause: Callable[[], bool] | None = None,
) -> FanoutResult:
    """Plan, tee every chunk with ``map_chunks`` (in order in one task or this process; ``tasks`` > 1:
    at once, staged, in that many tasks), sum up. ``pause`` (``lr sync``: a stop, or its turn spent)
    is asked after each chunk of a lazy ``map_chunks`` (``local_map``): once true, no further chunk
    is teed and the run finishes with what committed (each sink's position, recorded), so a stop
    waits for one chunk at most, not the whole backlog; the next run goes on from there."""
    t0 = time.monotonic()
    plan = driver.plan(max_entries, partitions, tasks)
    log.info("fan-out %s", plan.describe())
    t1 = time.monotonic()
    chunks: list[ChunkResult] = []
    paused = False
    if plan.ranges:
        with progress.track(f"catch-up of {plan.source} (read-once fan-out)", plan.entries) as tracker:
            for chunk in map_chunks(plan):
                chunks.append(chunk)
                tracker.advance(chunk.read)
                if pause is not None and len(chunks) < len(plan.ranges) and pause():
                    paused = True
                    tracker.finish(stopped=True)
                    log.info("fan-out %s paused after %d of %d chunks", plan.plan_id[:8], len(chunks), len(plan.ranges))
                    break
    t2 = time.monotonic()
    result = driver.finish(plan, chunks, paused)
    t3 = time.monotonic()
    result.seconds = {
        "plan": round(t1 - t0, 3),
        "tee": round(t2 - t1, 3),
        "finish": round(t3 - t2, 3),
        "total": round(t3 - t0, 3),
    }
    result.peak_rss_kb["driver"] = peak_memory.peak_rss_kb()
    return result


def local_map(plan: FanoutPlan) -> Iterable[ChunkResult]:
    """Tee the chunks one after the other in this process (no Spark), as they are done."""
    return tee_chunks(plan)
