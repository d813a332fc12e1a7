"""A session's full-sync data (``LRQ_Send_SnapSync``) moved to its sink in parallel (Spark job
``spark_jobs/lr_snapshot_transfer.py``), with the transfer semantics of a session cycle.

1. **plan** (driver): the session's handshake (``session/handshake.py``: lease, fence, negotiation;
   refused or held elsewhere: an error), find the supplied full-sync request, record
   SNAPSHOT_START on the sink (``writes.start_snapshot``: a no-op when this sync already started,
   so an interrupted transfer resumes), and cut the request's entries still to transfer (source
   entry ids after the sink's ``snapshot_last_entry``) into entry-id ranges.
2. **stage** (one call per range, in parallel): read the range once from the source, pack it into
   receive-queue rows (``sink/queue_rows``; a pack never spans two ranges) and stage them on the
   sink (``lr.spark_staging`` with the request's ``sync_id``), replacing whatever an
   earlier attempt staged for it, with a record of the range: retries write nothing twice.
3. **commit** (driver): only when the staged ranges cover everything still to transfer, move the
   staged messages into the receive queue in entry-id order, server-side, in one fenced sink
   transaction with the transfer's metadata (no message passes through the driver); then apply
   the snapshot the way a session cycle does (``SessionRunner.apply_snapshot``).

Federated tables have their own parallel snapshot (``engine/bulk/parallel_tables.py``: one exported
snapshot, key ranges read by tasks that join it).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.bulk.peak_memory import peak_rss_kb
from airflow_provider_lr.engine.bulk.pgcopy import RowReader, StagingWriter, staging_head, staging_prefix
from airflow_provider_lr.engine.db.conninfo import connect_dsn
from airflow_provider_lr.engine.db.timeouts import DEFAULT, Purpose, Timeouts
from airflow_provider_lr.engine.errors import ConfigurationError, LRError, StaleBatchError, one_line, require_counts
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import handshake
from airflow_provider_lr.engine.session.runner import SessionRunner
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.sink.queue_rows import Packer
from airflow_provider_lr.engine.source import closed_tables, full_sync
from airflow_provider_lr.engine.source.log_writer import CLIENT_ID_OF
from airflow_provider_lr.engine.store import receive_queue, sink_sessions
from airflow_provider_lr.engine.store.topology import Topology, recorded_id, site_conninfo
from airflow_provider_lr.engine.vocabulary import (
    STAGING_LOCK_CLASS,
    STREAM_SNAP_SYNC,
    RequestStatus,
    SessionKey,
    SessionState,
)
from airflow_provider_lr.proto import lr_pb2

log = logging.getLogger(__name__)

PACK_PENDING = 4096  # entries waiting to be packed in a staging task (memory bounded, as the fan-out's tee)


@dataclass(frozen=True)
class EntryRange:
    """One partition: the request's source entry ids ``(lo, hi]``."""

    index: int
    lo: int
    hi: int


@dataclass(frozen=True)
class SnapshotPlan:
    plan_id: str
    source: str
    sink: str
    client: str
    request_id: str
    supplied_tx: str
    entries: int  # still to transfer
    ranges: tuple[EntryRange, ...]
    source_dsn: str = field(repr=False)
    sink_dsn: str = field(repr=False)
    timeouts: Timeouts = field(default=DEFAULT, repr=False)  # the topology's: the tasks' heartbeats (tee.py)

    def describe(self) -> str:
        return (
            f"snapshot {self.request_id} of {SessionKey(self.source, self.sink, self.client)}: {self.entries} entries "
            f"to transfer in {len(self.ranges)} partitions (plan {self.plan_id[:8]})"
        )


@dataclass
class SnapshotResult:
    request_id: str
    session: str
    staged: int = 0
    transferred: int = 0
    applied: bool = False
    partitions: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_kb: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": True}


class SnapshotTransfer:
    """Driver side of one session's parallel snapshot transfer."""

    def __init__(
        self,
        topology: Topology,
        source: str,
        sink_id: str,
        client: str,
        owner: str | None = None,
        settings: SessionSettings | None = None,
    ) -> None:
        self.key = SessionKey(source, sink_id, client)
        if self.key not in topology.sessions(source=source):
            raise ConfigurationError(f"session {self.key} is not in the topology")
        self.settings = settings or SessionSettings.from_topology(topology)
        self.source_dsn = site_conninfo(topology, source).dsn_for(Purpose.BULK)
        self.sink_dsn = site_conninfo(topology, sink_id).dsn_for(Purpose.BULK)
        self.timeouts = topology.timeouts
        self.src = connect_dsn(self.source_dsn, Purpose.BULK, self.timeouts)
        self.sink = connect_dsn(self.sink_dsn, Purpose.BULK, self.timeouts)
        self.runner = SessionRunner(self.key, self.src, self.sink, owner or leases.new_owner_id(), self.settings)

    def plan(self, request_id: str | None = None, partitions: int = 2) -> SnapshotPlan:
        require_counts(partitions=partitions)
        runner = self.runner
        hs = handshake(self.src, self.sink, self.key, runner.owner, self.settings.lease_seconds, on_lease=runner.hold)
        if not hs.proceeds:
            what = "another replicator holds its lease; try again later" if hs.lease is None else hs.reason
            raise LRError(f"session {self.key}: {what}")
        assert hs.meta is not None and hs.position is not None
        request = (
            full_sync.get_request(self.src, request_id)
            if request_id
            else full_sync.open_request(self.src, self.key.sink, self.key.client)
        )
        if request is not None and runner.reconcile(hs.meta, request):  # applied before a crash: closed, not reused
            request = full_sync.get_request(self.src, request.request_id)
        if request is None or request.status != RequestStatus.SUPPLIED or request.base_position is None:
            raise LRError(
                f"session {self.key}: no supplied full-sync request "
                f"({request.status if request else 'none'}); the client's provider must supply it first"
            )
        meta = writes.start_snapshot(
            self.sink,
            self.key.source,
            self.key.client,
            hs.position.epoch,
            writes.SyncStart.of(
                request,
                closed_tables.whole_copies(
                    self.src, self.key.sink, self.key.client, hs.meta.last_log_entry_processed, request.base_position
                ),
            ),
            recorded_id(self.src),
        )
        assert runner.lease is not None, "a handshake that proceeds holds the lease"
        leases.update_session(
            self.src, runner.lease, state=SessionState.IN_SNAPSHOT_SYNC, sync_id=request.request_id, last_error=None
        )
        with self.src.cursor() as cur:
            cur.execute(
                "SELECT count(*), coalesce(min(entry_id), 0), coalesce(max(entry_id), 0) FROM lr.log_entries "
                f"WHERE tx = %s::xid8 AND stream = %s AND entry_id > %s AND client_id = {CLIENT_ID_OF}",
                (request.supplied_tx, STREAM_SNAP_SYNC, meta.snapshot_last_entry, self.key.client),
            )
            count, first, last = cur.fetchone()
        self.src.commit()
        ranges: list[EntryRange] = []
        if count:
            lo, width = max(meta.snapshot_last_entry, first - 1), -(-(last - first + 1) // max(1, partitions))
            while lo < last:
                ranges.append(EntryRange(len(ranges), lo, min(lo + width, last)))
                lo += width
        return SnapshotPlan(
            str(uuid.uuid4()),
            self.key.source,
            self.key.sink,
            self.key.client,
            request.request_id,
            str(request.supplied_tx),
            int(count),
            tuple(ranges),
            self.source_dsn,
            self.sink_dsn,
            self.timeouts,
        )

    def commit(self, plan: SnapshotPlan, apply: bool = True) -> SnapshotResult:
        """Move the staged messages into the sink's receive queue, then apply.

        One fenced sink transaction, server-side: the messages after what the sink already holds go
        from ``lr.spark_staging`` into ``lr.receive_queue`` in entry order (invisible, this sync; the
        rows the staging tasks packed), with the transfer's metadata; no message passes through this
        process. Refused unless the staged ranges cover everything still to transfer. All or
        nothing: a failed move leaves the sink as it was, and a rerun moves it whole."""
        result = SnapshotResult(plan.request_id, str(self.key))
        started = time.monotonic()
        write = writes.SinkTransaction(self.sink, plan.source, plan.client, self.runner._epoch())
        with write as (cur, meta):
            if meta.snapshot_request_id != plan.request_id:
                raise StaleBatchError(
                    f"sink of {self.key} is on sync {meta.snapshot_request_id}, not {plan.request_id}"
                )
            if plan.ranges and meta.snapshot_transferred != meta.snapshot_started:
                if meta.snapshot_last_entry > plan.ranges[0].lo:  # a staged pack could straddle it
                    raise StaleBatchError(
                        f"snapshot {plan.request_id}: the sink received entries up to "
                        f"{meta.snapshot_last_entry} since the plan began at {plan.ranges[0].lo}; rerun"
                    )
                if (
                    staged_coverage(
                        cur,
                        plan.source,
                        plan.client,
                        plan.plan_id,
                        max(meta.snapshot_last_entry, plan.ranges[0].lo),
                        plan.ranges[-1].hi,
                    )
                    is None
                ):
                    raise StaleBatchError(
                        f"snapshot {plan.request_id}: entries after {meta.snapshot_last_entry} are "
                        f"not all staged on {plan.sink} (a partition failed); rerun"
                    )
                moved, last, ended = receive_queue.move_staged_snapshot(
                    cur,
                    plan.source,
                    plan.client,
                    plan.request_id,
                    meta.snapshot_last_entry,
                    lr_pb2.LAST_FULL_SYNC_ENTRY,
                )
                if not ended:
                    raise LRError(
                        f"snapshot {plan.request_id}: staged data ends at entry {last} before the end "
                        "marker; rerun the transfer"
                    )
                write.update(
                    snapshot_transferred_seq=meta.snapshot_transferred_seq + moved,
                    snapshot_last_entry=last,
                    snapshot_transferred=meta.snapshot_started,
                )
                result.transferred = moved
            cur.execute(
                "DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s AND sync_id = %s",
                (plan.source, plan.client, plan.request_id),
            )
            cur.execute(
                "DELETE FROM lr.spark_staged_ranges WHERE source_site_id = %s AND client_name = %s AND plan_id = %s",
                (plan.source, plan.client, plan.plan_id),
            )
        log.info("snapshot %s: moved %d staged entries into the receive queue", plan.request_id, result.transferred)
        result.seconds["move"] = round(time.monotonic() - started, 3)
        if apply:
            self.runner.apply_snapshot(writes.read_metadata(self.sink, plan.source, plan.client))
            result.applied = True
            result.seconds["apply"] = round(time.monotonic() - started - result.seconds["move"], 3)
        return result

    def close(self) -> None:
        """Release the session's lease (on a new connection when the job's own to the source was lost:
        a source restarted during the job; before, the lease stayed held and kept every replicator off
        the session for ``lease_seconds``) and close the connections."""
        lease = self.runner.lease
        self.runner.release()
        if lease is not None and self.src.closed:
            try:
                conn = connect_dsn(self.source_dsn, Purpose.BULK, self.timeouts)
                try:
                    leases.release(conn, lease)
                finally:
                    conn.close()
            except Exception as exc:  # the source is down: the lease runs out on its own
                log.warning("snapshot transfer of %s: lease not released: %s", self.key, one_line(exc))
        for conn in (self.src, self.sink):
            if not conn.closed:
                conn.close()


def stage_range(plan: SnapshotPlan, part: EntryRange) -> dict:
    """Stage the request's entries ``(lo, hi]`` on the sink (idempotent); returns a small summary."""
    started = time.monotonic()
    src = connect_dsn(plan.source_dsn, Purpose.BULK, plan.timeouts)
    dst = connect_dsn(plan.sink_dsn, Purpose.BULK, plan.timeouts)
    writer: StagingWriter | None = None
    try:
        with dst.cursor() as cur:
            cur.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                (STAGING_LOCK_CLASS, f"{plan.source}/{plan.request_id}/{part.lo}"),
            )
            cur.execute(
                "DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s AND sync_id = %s "
                "AND source_entry_id > %s AND source_entry_id <= %s",
                (plan.source, plan.client, plan.request_id, part.lo, part.hi),
            )
        writer = StagingWriter(dst)
        prefix = staging_prefix(plan.source, plan.client, plan.request_id)
        packer = Packer(
            lambda r: writer.add(
                staging_head(prefix, r.position, r.entry_id, r.kind, r.entry_count, r.message), r.message
            )
        )

        def on_row(fields: list[bytes | None]) -> None:
            kind, message = vocabulary.strip_destinations(fields[2] or b"")
            packer.add(
                kind,
                int.from_bytes(fields[0] or b"", "big", signed=True),
                int.from_bytes(fields[1] or b"", "big", signed=True),
                message,
            )
            if len(packer.pending) >= PACK_PENDING:
                packer.flush(final=False)  # memory bounded: the unfinished last pack waits

        with src.cursor() as cur:
            cur.copy_expert(
                cur.mogrify(
                    "COPY (SELECT c.position, e.entry_id, e.message FROM lr.log_entries e JOIN lr.log_commits c "
                    "ON c.tx = e.tx WHERE e.tx = %s::xid8 AND e.stream = %s AND e.entry_id > %s AND e.entry_id <= %s "
                    f"AND e.client_id = {CLIENT_ID_OF} "
                    "ORDER BY e.entry_id) "  # packed here: a pack's entries must be in entry order
                    "TO STDOUT (FORMAT binary)",
                    (plan.supplied_tx, STREAM_SNAP_SYNC, part.lo, part.hi, plan.client),
                ).decode(),
                RowReader(on_row),
            )
        src.rollback()
        packer.flush()
        writer.close()
        with dst.cursor() as cur:
            cur.execute(
                "INSERT INTO lr.spark_staged_ranges (source_site_id, client_name, plan_id, range_lo, range_hi, "
                "staged_rows) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (source_site_id, client_name, plan_id, "
                "range_lo) DO UPDATE SET staged_rows = EXCLUDED.staged_rows, staged_at = now()",
                (plan.source, plan.client, plan.plan_id, part.lo, part.hi, packer.entries),
            )
            if not _still_transferring(cur, plan):
                dst.rollback()
                log.info(
                    "snapshot %s: the sink of %s/%s moved on from this sync; range (%d, %d] not staged",
                    plan.request_id,
                    plan.source,
                    plan.client,
                    part.lo,
                    part.hi,
                )
                return {
                    "index": part.index,
                    "staged": 0,
                    "seconds": round(time.monotonic() - started, 3),
                    "peak_rss_kb": peak_rss_kb(),
                    "pid": os.getpid(),
                }
        dst.commit()
        log.info(
            "snapshot %s: staged %d entries in %d rows (%d, %d]",
            plan.request_id,
            packer.entries,
            packer.rows,
            part.lo,
            part.hi,
        )
        return {
            "index": part.index,
            "staged": packer.entries,
            "seconds": round(time.monotonic() - started, 3),
            "peak_rss_kb": peak_rss_kb(),
            "pid": os.getpid(),
        }
    finally:
        if writer is not None:
            writer.abandon()
        src.close()
        dst.close()


def _still_transferring(cur: psycopg2.extensions.cursor, plan: SnapshotPlan) -> bool:
    """Whether the sink still transfers the plan's sync, read under a share lock of the session row
    held until the stage commits (an apply or a newer sync, which drops what is staged, waits for
    it). A stage that lands after the sync moved on (its job fenced out by a successor that moved
    it in process) would otherwise stay staged until the session's next full sync or fan-out, and
    one that lands after a failover (which dropped what was staged before it) for good."""
    return sink_sessions.still_transferring(cur, plan.source, plan.client, plan.request_id)


def staged_coverage(
    cur: psycopg2.extensions.cursor, source: str, client: str, plan_id: str, lo: int, hi: int
) -> int | None:
    """Rows staged in ``lr.spark_staging`` for ``(lo, hi]`` by a plan's partitions, or None unless
    they cover it all (a partition that failed leaves a gap: nothing is transferred then)."""
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


def run_transfer(
    transfer: SnapshotTransfer,
    map_ranges: Callable[[SnapshotPlan], Iterable[dict]],
    request_id: str | None = None,
    partitions: int = 2,
    apply: bool = True,
) -> SnapshotResult:
    t0 = time.monotonic()
    plan = transfer.plan(request_id, partitions)
    log.info("%s", plan.describe())
    t1 = time.monotonic()
    staged = list(map_ranges(plan)) if plan.ranges else []
    t2 = time.monotonic()

    result = transfer.commit(plan, apply)
    result.staged, result.partitions = sum(s["staged"] for s in staged), len(staged)
    result.seconds = {"plan": round(t1 - t0, 3), "stage": round(t2 - t1, 3), **result.seconds}
    result.peak_rss_kb = {
        "driver": peak_rss_kb(),
        "executor_python": max((s["peak_rss_kb"] for s in staged), default=0),
    }
    return result
