"""The tee of one fan-out chunk ``(lo, hi]``, anywhere (a Spark task, the replicator's process, an
Airflow worker): every session that still needs the chunk opens ONE fenced sink transaction, the
chunk is read once from the source (``bulk/router.py``) into every demanding session's COPY, then
each session checks its rows, advances its sink's position and commits. Why this is exactly once
and in order: ``bulk/fanout.py``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

import psycopg2

from airflow_provider_lr.engine.bulk import peak_memory
from airflow_provider_lr.engine.bulk.pgcopy import PackedRows, ReceiveQueueWriter
from airflow_provider_lr.engine.bulk.plan import ChunkResult, Demand, FanoutPlan, PositionRange
from airflow_provider_lr.engine.bulk.router import Target, copy_and_route
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.errors import StaleBatchError, one_line
from airflow_provider_lr.engine.faults import FAULT_ENV, fault_point, hooked
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source.log_reader import snapshot_trim_mark, trimmed_error

log = logging.getLogger(__name__)


class SessionChunk:
    """One session's side of a chunk, in either tee: a sink connection with its open transaction
    and the COPY writer the chunk's router feeds (``writer``, None when there is nothing to write)."""

    conn: psycopg2.extensions.connection
    demand: Demand
    position: int  # where the session's part of the chunk starts (the sink's position for the ordered tee)
    writer: PackedRows | None = None

    def target(self, bit: int) -> Target:
        """This session as the router's ``bit``: only a session with rows to write is read for."""
        assert self.writer is not None, "a session with nothing to write is left out of the read"
        return bit, self.demand, self.writer

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


def check_base(meta: writes.SinkMetadata, plan: FanoutPlan, demand: Demand) -> None:
    """Refuse a sink that is not consistent at the snapshot base the plan was made for."""
    if not meta.data_consistent or meta.snapshot_applied != demand.position.base:
        raise StaleBatchError(
            f"fan-out for base {demand.position.base} but the sink of {plan.source}/{demand.client} is at base "
            f"{meta.snapshot_applied} (consistent: {meta.data_consistent}); renegotiate"
        )


class SessionTee(SessionChunk):
    """One session's side of a chunk: its fenced sink transaction (``writes.SinkTransaction``) and
    the COPY into its receive queue (``pgcopy.ReceiveQueueWriter``)."""

    def __init__(self, plan: FanoutPlan, demand: Demand, part: PositionRange) -> None:
        self.demand = demand
        self.writer: ReceiveQueueWriter | None = None
        self.conn = plan.connect(demand.sink)
        self.transaction = writes.SinkTransaction(self.conn, plan.source, demand.client, demand.position.epoch)
        self.done = False  # the sink already processed the whole chunk: nothing to write
        try:
            meta = self.transaction.open()  # locks the session row (a duplicate attempt waits here)
            check_base(meta, plan, demand)
            last, start = meta.last_log_entry_processed, max(part.lo, demand.position.after)
            self.position = last
            if last >= part.hi:
                self.done = True
            elif last != start:
                raise StaleBatchError(
                    f"fan-out chunk ({part.lo}, {part.hi}] of {demand.session} starts after "
                    f"{start} but its sink has processed up to {last}; rerun"
                )
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
                raise StaleBatchError(
                    f"{self.demand.session}: the sink took {self.writer.copied} of {self.writer.rows} rows"
                )
            self.transaction.advance(end, self.entries > 0)
        except BaseException:
            self.transaction.abort()
            self.conn.close()
            raise
        self.transaction.commit()
        self.conn.close()
        self.position = end


def tee_chunk(plan: FanoutPlan, part: PositionRange, fault_tag: str = "", exclude: Iterable[str] = ()) -> ChunkResult:
    """Deliver one chunk ``(lo, hi]`` to every session that still needs it (see ``bulk/fanout.py``).

    Sessions in ``exclude`` (failed in an earlier chunk of this run) are left out. One session
    refused (lease taken over, sink moved on, sink down) does not stop the others; an error of the
    source read fails the whole chunk and nothing of it becomes visible. ``fault_tag`` names this
    attempt for fault points (e.g. ``_p1_a0``: chunk 1, attempt 0): ``LR_FAULT=fanout_mid_write_p1_a0``
    kills the process once half of the chunk is in the sinks' open transactions,
    ``fanout_after_commit_p1_a0`` after every session committed the chunk."""
    started = time.monotonic()
    out = ChunkResult(part.index, part.lo, part.hi)
    skip = set(exclude)
    faults = armed(plan.faults) or hooked()
    tees: list[tuple[int, SessionTee]] = []
    try:
        for bit, d in enumerate(plan.demands):
            if d.position.after >= part.hi or d.session in skip:
                continue
            try:
                tee = SessionTee(plan, d, part)
            except Exception as exc:  # this session only
                refuse(plan, part, out, d.session, exc)
                continue
            out.positions[d.session] = tee.position
            if tee.done:
                out.delivered[d.session] = 0
            else:
                tees.append((bit, tee))
        if tees:
            tees, out.read = read_and_route(plan, part, tees, out, fault_tag if faults else None)
        for _, tee in tees:
            try:
                tee.commit(part.hi)
            except Exception as exc:
                refuse(plan, part, out, tee.demand.session, exc, "not committed")
                continue
            out.delivered[tee.demand.session] = tee.entries
            out.positions[tee.demand.session] = tee.position
        if faults:
            fault_point(f"fanout_after_commit{fault_tag}")
    finally:
        for _, tee in tees:
            tee.abandon()  # no-op for the committed ones
    out.seconds, out.peak_rss_kb, out.pid = time.monotonic() - started, peak_memory.peak_rss_kb(), os.getpid()
    return out


def refuse(
    plan: FanoutPlan, part: PositionRange, out: ChunkResult, session: str, exc: BaseException, what: str = "refused"
) -> None:
    """Leave ``session`` out of this chunk, saying why (``out.errors`` and the log, with what a
    bound that fired means: a sink cut by its heartbeat); the others go on."""
    out.errors[session] = failure(exc)
    log.warning("fan-out %s chunk %d: session %s %s: %s", plan.plan_id[:8], part.index, session, what, one_line(exc))


Chunk = TypeVar("Chunk", bound=SessionChunk)  # either tee's session: read_and_route returns what it was given


def read_and_route(
    plan: FanoutPlan, part: PositionRange, tees: list[tuple[int, Chunk]], out: ChunkResult, fault_tag: str | None
) -> tuple[list[tuple[int, Chunk]], int]:
    """Read the chunk ONCE from the source (binary COPY, in (position, entry id) order, demand mask
    computed by the source) and append each entry's receive-queue row to every demanding session's
    COPY. The read runs in one snapshot with the trim mark: a session whose sink stands below it
    is refused (``TrimmedError`` in ``out.errors``, nothing written) and left out of the read.
    Returns the sessions still in the chunk and the entries read."""
    src = plan.connect(plan.source)
    try:
        (mark,) = snapshot_trim_mark(src)
        kept: list[tuple[int, Chunk]] = []
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
        return kept, copy_and_route(src, part, [tee.target(bit) for bit, tee in kept], fault_tag)
    finally:
        src.close()


def tee_chunks(plan: FanoutPlan, attempt: int = 0) -> Iterator[ChunkResult]:
    """Every chunk of the plan in order (a session's chunks must commit in order); a session that
    fails in one chunk is left out of the following ones."""
    failed: set[str] = set()
    for part in plan.ranges:
        chunk = tee_chunk(plan, part, fault_tag=f"_p{part.index}_a{attempt}", exclude=failed)
        failed.update(chunk.errors)
        yield chunk


def armed(faults: str | None) -> bool:
    """Fault points follow the driver's environment, in whatever process runs the partition (on
    a cluster the executors do not share it; a reused Python worker must not keep an old one)."""
    if faults:
        os.environ[FAULT_ENV] = faults
    else:
        os.environ.pop(FAULT_ENV, None)
    return bool(faults)
