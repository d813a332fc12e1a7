"""The fan-out's parallel form: the chunks of one run teed by several tasks at once, each chunk
staged on the sinks and published over the contiguous prefix (``spark_jobs/lr_fanout.py --tasks N``).

The ordered tee (``bulk/tee.py``) commits a session's chunks one after the other into its receive
queue, so a source's fan-out is one task however big the cluster. Here any number of tasks run
chunks at once, and the guarantees stay those of the ordered tee:

1. **stage** (a task per chunk ``(lo, hi]``): the chunk is read ONCE from the source
   (``router.copy_and_route``: binary COPY, demand mask computed by the source) and, for every
   session that still needs it, packed into receive-queue rows and COPYed into the sink's
   ``lr.spark_staging`` (invisible to subscribers) in ONE transaction per session, together with a
   record of the staged range (``lr.spark_staged_ranges``: the plan, ``(start, hi]``, its entries).
   A transaction-level advisory lock per (session, plan, chunk) makes a retry or a speculative
   duplicate wait, then find the range staged and stage nothing. Just before it commits, the
   stage re-reads the session row ``FOR SHARE``: a sink already past ``hi`` (another attempt
   published the chunk) or a lease taken over since the plan (epoch) rolls the stage back.
2. **publish** (after each stage, and once more by the driver): in the session's fenced sink
   transaction (``writes.SinkTransaction``, row locked), the plan's staged ranges that continue
   the sink's ``last_log_entry_processed`` with no gap are moved server-side into
   ``lr.receive_queue`` in (position, entry id) order, so ``seq`` follows the source; the moved
   entry count must equal what the range records say; the position advances to the end of the
   prefix and the subscribers are woken, all in that one commit. A range staged ahead of a gap
   waits invisible until the gap is filled; whoever fills it publishes both.

Why exactly once and in order: entries become visible only by a publish, which takes only ranges
starting exactly at the sink's position, under the session row lock, and advances the position in
the same commit; a stage that would land behind a publish never commits (the ``FOR SHARE`` check
serialises with the publish's ``FOR UPDATE``). A killed task leaves its open stage transactions
uncommitted; a retry stages again what is missing; staged ranges a run never publishes (a gap
that stayed, a task that never returned) are dropped by the next plan of the session
(``writes.discard_staged``) before it stages anything.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from airflow_provider_lr.engine.bulk import peak_memory
from airflow_provider_lr.engine.bulk.pgcopy import StagedQueueWriter
from airflow_provider_lr.engine.bulk.plan import ChunkResult, Demand, FanoutPlan, PositionRange
from airflow_provider_lr.engine.bulk.tee import SessionChunk, armed, check_base, read_and_route, refuse
from airflow_provider_lr.engine.errors import FencedError, StaleBatchError, error_line
from airflow_provider_lr.engine.faults import fault_point, hooked
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.store import receive_queue, sink_sessions
from airflow_provider_lr.engine.vocabulary import STAGING_LOCK_CLASS


class SessionStage(SessionChunk):
    """One session's side of a staged chunk: its stage transaction on the sink and the COPY."""

    def __init__(self, plan: FanoutPlan, demand: Demand, part: PositionRange) -> None:
        self.plan, self.demand, self.part = plan, demand, part
        self.position = max(part.lo, demand.position.after)  # where this session's part of the chunk starts
        self.writer: StagedQueueWriter | None = None
        self.done = False  # published already, or staged by another attempt: nothing to write
        self.conn = plan.connect(demand.sink)
        try:
            meta = writes.read_metadata(self.conn, plan.source, demand.client)
            check_base(meta, plan, demand)
            with self.conn.cursor() as cur:  # a duplicate attempt of this chunk waits here
                cur.execute(
                    "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                    (STAGING_LOCK_CLASS, f"{plan.source}/{demand.client}/{plan.plan_id}/{self.position}"),
                )
                last = sink_sessions.last_processed(cur, plan.source, demand.client)
                cur.execute(
                    "SELECT 1 FROM lr.spark_staged_ranges WHERE source_site_id = %s AND client_name = %s "
                    "AND plan_id = %s AND range_lo = %s",
                    (plan.source, demand.client, plan.plan_id, self.position),
                )
                self.done = last >= part.hi or cur.fetchone() is not None
                if not self.done:  # rows an attempt of an earlier plan left in the range
                    cur.execute(
                        "DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s "
                        "AND sync_id IS NULL AND source_position > %s AND source_position <= %s",
                        (plan.source, demand.client, self.position, part.hi),
                    )
                    self.writer = StagedQueueWriter(self.conn, plan.source, demand.client)
        except BaseException:
            self.abandon()
            raise
        if self.done:
            self.abandon()

    def commit(self) -> bool:
        """Record the staged range and commit; False (rolled back) when the sink moved past the
        chunk meanwhile. Raises ``FencedError`` when the session's lease was taken over."""
        assert self.writer is not None
        plan, demand = self.plan, self.demand
        try:
            self.writer.close()
            if self.writer.copied != self.writer.rows:
                raise StaleBatchError(
                    f"{demand.session}: the sink staged {self.writer.copied} of {self.writer.rows} rows"
                )
            with self.conn.cursor() as cur:  # a publish of the session waits from here to the commit
                last, epoch, failed_over_to = sink_sessions.share_position(cur, plan.source, demand.client)
                if failed_over_to is not None or epoch > demand.position.epoch:
                    raise FencedError(
                        f"session {demand.session}: lease epoch {demand.position.epoch} is stale at the sink "
                        f"(epoch {epoch}{', failed over' if failed_over_to else ''}); staged nothing"
                    )
                if last >= self.part.hi:
                    self.abandon()
                    return False
                cur.execute(
                    "INSERT INTO lr.spark_staged_ranges (source_site_id, client_name, plan_id, range_lo, range_hi, "
                    "staged_rows) VALUES (%s, %s, %s, %s, %s, %s)",
                    (plan.source, demand.client, plan.plan_id, self.position, self.part.hi, self.entries),
                )
        except BaseException:
            self.abandon()
            raise
        self.conn.commit()
        self.conn.close()
        return True


def stage_chunk(plan: FanoutPlan, part: PositionRange, fault_tag: str = "") -> ChunkResult:
    """Stage chunk ``(lo, hi]`` for every session that still needs it, then publish what each of
    them can (see the module doc). ``delivered`` is what this call's publishes made visible
    (chunks staged by other tasks included); ``staged`` what it staged. One session refused does
    not stop the others; an error of the source read fails the chunk (nothing of it committed).
    Fault points (``LR_FAULT``, ``fault_tag`` e.g. ``_p1_a0``): ``fanout_mid_write`` halfway
    through the read, ``fanout_after_stage`` once staged, ``fanout_after_commit`` once published."""
    started = time.monotonic()
    out = ChunkResult(part.index, part.lo, part.hi)
    faults = armed(plan.faults) or hooked()
    stages: list[tuple[int, SessionStage]] = []
    try:
        for bit, d in enumerate(plan.demands):
            if d.position.after >= part.hi:
                continue
            try:
                stage = SessionStage(plan, d, part)
            except Exception as exc:
                refuse(plan, part, out, d.session, exc)
                continue
            if not stage.done:
                stages.append((bit, stage))
        if stages:
            stages, out.read = read_and_route(plan, part, stages, out, fault_tag if faults else None)
        for _, stage in stages:
            try:
                if stage.commit():
                    out.staged[stage.demand.session] = stage.entries
            except Exception as exc:
                refuse(plan, part, out, stage.demand.session, exc, "not staged")
        if faults:
            fault_point(f"fanout_after_stage{fault_tag}")
        publish_all(plan, [d for d in plan.demands if d.position.after < part.hi and d.session not in out.errors], out)
        if faults:
            fault_point(f"fanout_after_commit{fault_tag}")
    finally:
        for _, stage in stages:
            stage.abandon()  # no-op for the committed ones
    out.seconds, out.peak_rss_kb, out.pid = time.monotonic() - started, peak_memory.peak_rss_kb(), os.getpid()
    return out


def publish_all(plan: FanoutPlan, demands: list[Demand], out: ChunkResult) -> None:
    """``publish`` every session at once (a thread each: the sinks move their rows concurrently, as
    they ingest them in the ordered tee); positions, entries published and errors into ``out``."""

    def one(demand: Demand) -> None:
        try:
            out.positions[demand.session], out.delivered[demand.session] = publish(plan, demand)
        except Exception as exc:
            out.errors[demand.session] = error_line(exc)

    if len(demands) == 1:
        one(demands[0])
    elif demands:
        with ThreadPoolExecutor(len(demands), thread_name_prefix="lr-publish") as pool:
            list(pool.map(one, demands))


def publish(plan: FanoutPlan, demand: Demand) -> tuple[int, int]:
    """Make the plan's staged ranges that continue the sink's position visible, in source order, in
    one fenced sink transaction; returns the sink's position after it and the entries published."""
    conn = plan.connect(demand.sink)
    try:
        write = writes.SinkTransaction(conn, plan.source, demand.client, demand.position.epoch)
        with write as (cur, meta):
            check_base(meta, plan, demand)
            last = meta.last_log_entry_processed
            cur.execute(
                "SELECT range_lo, range_hi, staged_rows FROM lr.spark_staged_ranges WHERE source_site_id = %s "
                "AND client_name = %s AND plan_id = %s AND range_hi > %s ORDER BY range_lo",
                (plan.source, demand.client, plan.plan_id, last),
            )
            reach, expected = last, 0
            for lo, hi, entries in cur.fetchall():
                if lo != reach:
                    break  # a gap: the chunk before this range is not staged yet
                reach, expected = hi, expected + entries
            if reach == last:
                return last, 0
            moved = receive_queue.move_staged_log(cur, plan.source, demand.client, last, reach)
            if moved != expected:
                raise StaleBatchError(
                    f"{demand.session}: staged ({last}, {reach}] holds {moved} entries, its "
                    f"ranges say {expected}; nothing published, rerun the fan-out"
                )
            receive_queue.drop_staged_log(cur, plan.source, demand.client, last, reach)
            write.advance(reach, moved > 0)
        return reach, int(moved)
    finally:
        conn.close()


def published_entries(plan: FanoutPlan, demand: Demand, position: int) -> int:
    """Entries the plan published for ``demand`` up to ``position`` (its range records); then, in
    the same fenced sink transaction, the records and what the run left staged (past a gap) are
    dropped. What the driver reports once all tasks are done (a task's own count
    is lost with an attempt Spark discarded)."""
    conn = plan.connect(demand.sink)
    try:
        with writes.SinkTransaction(conn, plan.source, demand.client, demand.position.epoch) as (cur, _):
            cur.execute(
                "SELECT coalesce(sum(staged_rows), 0) FROM lr.spark_staged_ranges WHERE source_site_id = %s "
                "AND client_name = %s AND plan_id = %s AND range_lo >= %s AND range_hi <= %s",
                (plan.source, demand.client, plan.plan_id, demand.position.after, position),
            )
            (entries,) = cur.fetchone()
            writes.discard_staged(cur, plan.source, demand.client)
        return int(entries)
    finally:
        conn.close()
