"""One session's replication cycle: the handshake (``handshake.py``: lease → fence → negotiate), then
snapshot sync or log-entry sync from the ``Position`` it returns.

Every step reads its starting point from the two sites' metadata and persists its outcome there,
so a cycle can be killed anywhere and the next one (in this process or another) resumes:

* snapshot sync: request (the server) → supply (the client's provider) → transfer to the sink's
  receive queue, invisible, resumable by source entry id → apply (one sink transaction makes it
  visible and sets applied = last processed = base) → request closed;
* log-entry sync: read the destination's entries after the sink's last processed position, in
  commit order, leaving out what the base snapshot covered, and apply each batch idempotently.

The Airflow operators and the Spark jobs call these same functions. Settings and thresholds:
``session/settings.py`` (measured in docs/spark.md "Thresholds"); when work goes to Spark:
``session/catchup.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.db.schema import site_identity
from airflow_provider_lr.engine.db.timeouts import lifted
from airflow_provider_lr.engine.errors import LRError, TrimmedError, one_line
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session import catchup, nearest_copy
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import (
    Handshake,
    Position,
    Verdict,
    handshake,
    negotiate_session,
    reconcile,
    record_applied,
)
from airflow_provider_lr.engine.session.negotiation import Decision, Negotiation
from airflow_provider_lr.engine.session.settings import (
    MAX_BACKOFF_FACTOR,
    SNAPSHOT_CHUNK,
    SNAPSHOT_CHUNK_BYTES,
    SessionSettings,
)
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.backlog import session_backlogs
from airflow_provider_lr.engine.source.full_sync import FullSyncRequest, Provider
from airflow_provider_lr.engine.source.log_reader import LogReader, TableSplits
from airflow_provider_lr.engine.source.transmit import RoutingQueueClient
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import Topology, recorded_id
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, RequestStatus, SessionKey, SessionState

log = logging.getLogger(__name__)


@dataclass
class CycleReport:
    """What one cycle did; small enough for an XCom."""

    session: str
    decision: str = ""
    reason: str = ""
    state: str = ""
    delivered: int = 0  # log entries written to the sink
    delivered_bytes: int = 0  # ... their messages' bytes
    full_syncs: int = 0  # full (snapshot) syncs applied at the sink by this cycle
    snapshot_messages: int = 0  # full-sync messages transferred
    acked_position: int = -1
    remaining: int = 0
    skipped: str = ""  # why the cycle did nothing (lease held elsewhere)
    error: str = ""
    blocked_by: list[str] = field(default_factory=list)
    request_id: str = ""  # snapshot sync: the full-sync request worked on
    waiting: bool = False  # snapshot sync: the client's data has not been supplied yet
    tables: list[str] = field(default_factory=list)  # federated tables snapshotted (table: state)
    table_rows: int = 0  # rows those snapshots wrote to the sink
    tables_for_spark: list[str] = field(default_factory=list)  # ... left to the Spark job (large)
    transfer_for_spark: str = ""  # snapshot sync: the supplied request whose transfer is left to Spark (large)

    @property
    def idle(self) -> bool:
        return not self.delivered and not self.snapshot_messages and not self.tables


@dataclass(eq=False)
class SessionRunner:
    """Runs cycles of one session between an open source and sink connection (``lease``: the one
    its last cycle took, which a stream carries on)."""

    key: SessionKey
    source: psycopg2.extensions.connection
    sink: psycopg2.extensions.connection
    owner: str
    settings: SessionSettings = field(default_factory=SessionSettings)
    provider: Provider | None = None
    spark_tables: bool = False  # large table snapshots are left to the Spark job (the DAG runs one)
    spark_transfer: bool = False  # ... and large full-sync transfers (lr_snapshot_transfer.py)
    peers: list[nearest_copy.Peer] = field(default_factory=list)  # nearest copies first (nearest_copy.py)
    topology: Topology | None = None  # the file this runner works from: refused where the source runs another
    lease: leases.Lease | None = field(default=None, init=False)
    tables: TableSplits = field(default_factory=TableSplits, init=False)  # synced tables, for the reader
    _reader: LogReader | None = field(default=None, init=False, repr=False)
    full_syncs_applied: int = field(default=0, init=False)  # by this runner, for the cycle reports

    def __post_init__(self) -> None:
        self.settings = self.settings or SessionSettings()  # callers may pass None for the defaults

    # --- the cycle ----------------------------------------------------------------------------
    def run_cycle(self) -> CycleReport:
        applied = self.full_syncs_applied
        report, hs = self.begin()
        if not hs.proceeds:
            return report
        meta: writes.SinkMetadata | None = hs.meta
        if hs.decision is Decision.SNAPSHOT_SYNC:
            meta = self.snapshot_sync(hs.meta, report)
        elif hs.decision is Decision.WAIT_SNAPSHOT_APPLY:
            meta = self.apply_snapshot(hs.meta)
        if meta is not None and meta.data_consistent and not self.log_entry_sync(self._position(meta), report):
            # the log was trimmed past the sink mid-cycle: renegotiate now (→ snapshot sync), so the
            # cycle never ends reporting log-entry sync for a session the log can no longer serve
            meta = writes.read_metadata(self.sink, self.key.source, self.key.client)
            negotiation = self.negotiate(meta)
            report.decision, report.reason = negotiation.decision.value, negotiation.reason
            if negotiation.decision is Decision.SNAPSHOT_SYNC:
                self.snapshot_sync(meta, report)
        report.full_syncs = self.full_syncs_applied - applied
        return self.finish(report)

    def begin(self) -> tuple[CycleReport, Handshake]:
        """The first step of every cycle (and of every Airflow step): the handshake (``handshake.py``),
        said in a report. Nothing to do unless it proceeds: the lease is held elsewhere
        (``report.skipped``) or it was refused (``report.error``; by negotiation: recorded on the source)."""
        report = CycleReport(str(self.key))
        hs = handshake(
            self.source, self.sink, self.key, self.owner, self.settings.lease_seconds, self.topology, on_lease=self.hold
        )
        if hs.negotiation is not None:
            report.decision, report.reason = hs.negotiation.decision.value, hs.negotiation.reason
        if hs.outcome is Verdict.SKIPPED:
            report.skipped = hs.reason
        elif hs.outcome is Verdict.REFUSED:
            report.decision, report.error = Decision.REFUSE.value, hs.reason
            if hs.negotiation is not None:
                report.state = SessionState.NEGOTIATING
        return report, hs

    def finish(self, report: CycleReport) -> CycleReport:
        report.state, report.acked_position, report.remaining = self._status(ok=not report.error)
        return report

    # --- single steps (what the Airflow operators run, one task each) --------------------------
    def negotiate_step(self) -> CycleReport:
        """Only negotiation: what the session needs next (``report.decision``), nothing moved."""
        report, hs = self.begin()
        return self.finish(report) if hs.proceeds else report

    def snapshot_step(self) -> CycleReport:
        """Only the snapshot part of a cycle: request → client data → transfer → apply → complete,
        as far as it can go now (``report.waiting`` while the client's data is not supplied).
        Does nothing when negotiation calls for log-entry sync."""
        report, hs = self.begin()
        if not hs.proceeds:
            return report
        assert hs.meta is not None
        if hs.decision is Decision.SNAPSHOT_SYNC:
            self.snapshot_sync(hs.meta, report)
        elif hs.decision is Decision.WAIT_SNAPSHOT_APPLY:
            self.apply_snapshot(hs.meta)
        return self.finish(report)

    def log_entry_step(self) -> CycleReport:
        """Only log-entry sync (up to ``settings.max_batches`` batches); does nothing unless
        negotiation calls for it (a session that needs a snapshot is left to the snapshot step)."""
        report, hs = self.begin()
        if not hs.proceeds:
            return report
        assert hs.position is not None
        if hs.decision is Decision.LOG_ENTRY_SYNC and not self.log_entry_sync(hs.position, report):
            report.decision = Decision.SNAPSHOT_SYNC.value  # left to the snapshot step of the next run
        return self.finish(report)

    def negotiate(self, meta: writes.SinkMetadata) -> Negotiation:
        """Negotiate again under the lease this cycle holds (``handshake.negotiate_session``)."""
        assert self.lease is not None
        return negotiate_session(self.source, self.key, self.lease, self.owner, meta)

    def reconcile(self, meta: writes.SinkMetadata, request: FullSyncRequest | None) -> bool:
        """``handshake.reconcile`` under this cycle's lease."""
        assert self.lease is not None
        return reconcile(self.source, self.key, self.lease, self.owner, meta, request)

    # --- snapshot sync ------------------------------------------------------------------------
    def snapshot_sync(self, meta: writes.SinkMetadata, report: CycleReport) -> writes.SinkMetadata | None:
        """Advance the session's full sync as far as it can go now; the sink metadata once applied,
        else None (waiting for the client's data)."""
        seeded = self.seed_from_peer(meta, report)
        if seeded is not None:
            return seeded
        request = self._current_request(meta)
        report.request_id = request.request_id
        provider = self.provider
        if provider is None and registry.federated_tables(self.source, self.key.client):
            provider = registry.no_queue_data  # a client of tables only: its tables follow the full sync
        if request.status == RequestStatus.PENDING and provider is not None:
            client = RoutingQueueClient(self.source, self.key.client)
            with lifted(self.source):  # the provider's queries take as long as its data
                full_sync.serve_full_sync_requests(client, provider, sink=self.key.sink)
            request = full_sync.get_request(self.source, request.request_id) or request
            if self._behind_sink(request, meta):
                raise LRError(
                    f"session {self.key}: full sync {request.request_id} was supplied just now at position "
                    f"{request.base_position}, behind the {meta.last_log_entry_processed} the sink has processed: "
                    "the source's positions went backwards (restored from a backup?); re-create the session's sink "
                    "state (`lr failover` or a new sink database)"
                )
        if request.status == RequestStatus.PENDING:
            if full_sync.expired(self.source, request):
                self._restart_after_timeout(request)
            report.reason = f"waiting for full-sync data of request {request.request_id}"
            report.waiting = True
            return None
        assert request.base_position is not None
        if catchup.transfer_to_spark(request.entries, self.settings, self.spark_transfer):
            report.transfer_for_spark = request.request_id
            report.reason = f"{report.reason}; the transfer of {request.entries} entries is left to Spark".lstrip("; ")
            return None
        meta = writes.start_snapshot(
            self.sink,
            self.key.source,
            self.key.client,
            self._epoch(),
            writes.SyncStart.of(request),
            recorded_id(self.source),
        )
        fault_point("after_snapshot_start")
        meta, sent = self.transfer_snapshot(request, meta)
        report.snapshot_messages += sent
        return self.apply_snapshot(meta)

    def seed_from_peer(self, meta: writes.SinkMetadata, report: CycleReport) -> writes.SinkMetadata | None:
        """A client of tables only takes its snapshot from a peer sink in its region when one
        qualifies (``nearest_copy``); the sink's metadata then, else None (the source's snapshot
        follows). A full sync forced on the source is always taken from the source."""
        if not (self.settings.nearest_copy and self.peers) or self.provider is not None:
            return None
        federated = registry.federated_tables(self.source, self.key.client)
        request = full_sync.open_request(self.source, self.key.sink, self.key.client)
        if not federated or (request is not None and request.forced):
            return None

        def close_request() -> None:  # before the sink's commit: an open request would hold trim forever
            if request is not None:
                full_sync.finish_request(
                    self.source,
                    request.request_id,
                    RequestStatus.CANCELLED,
                    "the sink is seeded from a peer sink instead",
                )

        seed = nearest_copy.seed_from_peers(
            self.source,
            self.sink,
            self.key,
            self._position(meta),
            federated,
            nearest_copy.Candidates(self.peers, self.settings.peer_probe_delay),
            before_write=close_request,
        )
        report.reason = f"{report.reason}; {seed.describe()}".lstrip("; ")
        if seed.peer is None:
            return None
        fault_point("after_peer_seed")
        meta = writes.read_metadata(self.sink, self.key.source, self.key.client)
        self._record_applied(meta)
        report.tables += [f"{name}: synced from {seed.peer}" for name in seed.tables]
        return meta

    def _current_request(self, meta: writes.SinkMetadata) -> FullSyncRequest:
        """The open request to work on, creating one (which cancels stale ones) when needed. A request
        supplied at a base the sink has since passed (supplied while the session still streamed, or
        by the client's own serve loop) is supplied again under its id: applied, it would set the
        sink back and deliver the entries after its base twice."""
        request = full_sync.open_request(self.source, self.key.sink, self.key.client)
        if self.reconcile(meta, request):
            request = None  # applied: never reused
        if request is not None and self._behind_sink(request, meta):
            note = (
                f"supplied at position {request.base_position}, behind the sink's "
                f"{meta.last_log_entry_processed}: supplied again"
            )
            log.info("session %s: full sync %s was %s", self.key, request.request_id, note)
            request = full_sync.supply_again(self.source, request.request_id, note, self.settings.data_timeout)
        if request is None:
            attempts = self._attempts()
            timeout = self.settings.data_timeout * min(2**attempts, MAX_BACKOFF_FACTOR)
            request = full_sync.request_full_sync(
                self.source,
                self.key.sink,
                self.key.client,
                reason="negotiation",
                data_timeout=timeout,
                lease=self.lease,
            )
            log.info("session %s: full sync requested (%s), data timeout %.0fs", self.key, request.request_id, timeout)
            fault_point("after_request")
        self._update(state=SessionState.IN_SNAPSHOT_SYNC, sync_id=request.request_id, last_error=None)
        return request

    @staticmethod
    def _behind_sink(request: FullSyncRequest, meta: writes.SinkMetadata) -> bool:
        return (
            request.base_position is not None
            and request.request_id != meta.snapshot_request_id
            and request.base_position < meta.last_log_entry_processed
        )

    def _restart_after_timeout(self, request: FullSyncRequest) -> None:
        """No client data within the timeout: close the request; the next cycle asks again with a
        longer timeout (backoff), so a slow provider is not restarted forever (CorfuDB #4119)."""
        assert self.lease is not None
        leases.update_session(
            self.source,
            self.lease,
            commit=False,
            attempts=AsIs("attempts + 1"),
            last_error=f"full-sync request {request.request_id} timed out without client data",
        )
        full_sync.finish_request(
            self.source, request.request_id, RequestStatus.TIMED_OUT, "no client data within the timeout"
        )
        fault_point("after_timeout")

    def transfer_snapshot(self, request: FullSyncRequest, meta: writes.SinkMetadata) -> tuple[writes.SinkMetadata, int]:
        """Copy the request's messages to the sink, resuming after what the sink already has."""
        sent = 0
        total = (request.entries or 0) + 2  # the provider's messages and the two markers
        tracker = progress.track(f"full sync {request.request_id[:8]} {self.key}: transfer", total, "messages")
        tracker.update(meta.snapshot_transferred_seq + 1)
        while meta.snapshot_transferred != meta.snapshot_started:
            chunk = full_sync.supplied_records(
                self.source, request, meta.snapshot_last_entry, SNAPSHOT_CHUNK, SNAPSHOT_CHUNK_BYTES
            )
            if not chunk:
                full_sync.finish_request(
                    self.source, request.request_id, RequestStatus.CANCELLED, "data missing from the log"
                )
                raise LRError(
                    f"session {self.key}: full-sync data of request {request.request_id} is missing from the log "
                    "(trimmed?); a new full sync will be requested"
                )
            meta = writes.write_snapshot_messages(
                self.sink, self.key.source, self.key.client, self._epoch(), request.request_id, chunk
            )
            sent += len(chunk)
            tracker.update(meta.snapshot_transferred_seq + 1)
            fault_point("after_snapshot_chunk")
        tracker.finish()
        return meta, sent

    def apply_snapshot(self, meta: writes.SinkMetadata) -> writes.SinkMetadata:
        fault_point("before_snapshot_apply")
        with progress.track(f"full sync {str(meta.snapshot_request_id)[:8]} {self.key}: apply", 1, "snapshots") as t:
            with lifted(self.sink):  # a full sync of millions of entries made visible at once
                meta = writes.apply_snapshot(self.sink, self.key.source, self.key.client, self._epoch())
            t.update(1)
        fault_point("after_snapshot_apply")
        self._record_applied(meta)
        self.full_syncs_applied += 1
        return meta

    def _record_applied(self, meta: writes.SinkMetadata, note: str = "") -> None:
        assert self.lease is not None
        record_applied(self.source, self.lease, self.owner, meta, note)

    # --- log-entry sync -----------------------------------------------------------------------
    def log_entry_sync(self, position: Position, report: CycleReport) -> bool:
        """Up to ``settings.max_batches`` batches from ``position``. False when the log was trimmed
        past the sink (every read checks the trim mark in the snapshot it reads from): nothing of
        the trimmed range was delivered, and the session needs a snapshot sync."""
        after, base, split = position.after, position.base, position.split
        self._update(state=SessionState.IN_LOG_ENTRY_SYNC, acked_position=after, last_error=None)
        self.sync_tables(report)
        reader = self.reader()
        tracker: progress.Tracker | None = None
        for _ in range(self.settings.max_batches):
            try:
                batch = reader.read_stream(
                    after, self.settings.max_entries, self.settings.max_bytes, split, tables=self.tables
                )
            except TrimmedError as exc:
                log.warning("session %s: %s", self.key, exc)
                report.reason = str(exc)
                self._update(state=SessionState.IN_SNAPSHOT_SYNC)
                return False
            with batch:  # read from the source while it is written to the sink: bytes in memory stay bounded
                report.blocked_by = [h.describe() for h in batch.blocked_by]
                if batch.end <= after:
                    break
                after = writes.apply_log_stream(self.sink, self.key.source, self.key.client, self._epoch(), batch, base)
            fault_point("after_sink_apply")
            report.delivered += batch.entries
            report.delivered_bytes += batch.bytes
            self._update(acked_position=after)
            if not batch.has_more:
                break
            tracker = self._catch_up_progress(tracker, report.delivered)
        if tracker is not None:
            tracker.finish()
        self.sync_tables(report)  # the set is re-read at the end too: a table federated meanwhile joins now
        return True

    def sync_tables(self, report: CycleReport) -> None:
        """Re-read the client's federated tables and snapshot those the sink lacks, at the session's
        position now (the cycle holds the lease: nothing advances until they are written); a large
        snapshot is left to the Spark job when ``spark_tables``. Then the reader's ``TableSplits``."""
        lacking = table_snapshot.needed(
            self.source, self.sink, self.key, registry.federated_tables(self.source, self.key.client)
        )
        if lacking:
            snap = table_snapshot.TableSnapshot(
                self.source, self.key.client, [table_snapshot.SinkSide(self.key, self.sink, self._epoch(), lacking)]
            )
            try:
                with lifted(self.source, self.sink):  # whole tables, one COPY each: as long as they take
                    snap.open()
                    if catchup.tables_to_spark(snap.estimated_rows(), self.settings, self.spark_tables):
                        report.tables_for_spark = [str(t.table) for t in lacking]
                    else:
                        snap.write()
                        report.tables += [f"{name}: {state}" for name, state in snap.report.tables.items()]
                        report.table_rows += snap.report.rows
            finally:
                snap.close()
        self.tables = table_snapshot.splits(self.sink, self.key)

    def _catch_up_progress(self, tracker: progress.Tracker | None, delivered: int) -> progress.Tracker:
        """A catch-up longer than one batch reports progress (rate, ETA against the backlog counted
        once, after its first batch); one batch says nothing."""
        if tracker is None:
            (backlog,) = session_backlogs(self.source, self.key.sink, self.key.client)
            tracker = progress.track(f"catch-up {self.key}", delivered + backlog.entries, "entries")
        tracker.update(delivered)
        return tracker

    def reader(self) -> LogReader:
        if self._reader is None:
            self._reader = LogReader(
                self.source,
                self.key.sink,
                STREAM_LOG_ENTRIES,
                self.settings.barrier_timeout,
                client_name=self.key.client,
            )
        return self._reader

    # --- metadata -----------------------------------------------------------------------------
    def hold(self, lease: leases.Lease | None) -> None:
        self.lease = lease  # as soon as taken: released by ``release`` even when a later step fails

    def _position(self, meta: writes.SinkMetadata) -> Position:
        return Position.of(meta, self._epoch())

    def _epoch(self) -> int:
        assert self.lease is not None, "run_cycle takes the lease first"
        return self.lease.epoch

    def _update(self, **values: object) -> None:
        assert self.lease is not None
        leases.update_session(self.source, self.lease, **values)

    def _attempts(self) -> int:
        with self.source.cursor() as cur:
            found = source_sessions.attempts(cur, self.key.sink, self.key.client)
        self.source.commit()
        return found

    def _status(self, ok: bool = True) -> tuple[str, int, int]:
        """State, acked position and entries still to send (committed, tagged for the sink);
        records them, and the time of this success (``ok``), on the source."""
        (backlog,) = session_backlogs(self.source, self.key.sink, self.key.client)
        if self.lease is not None:
            done = {"last_success_at": AsIs("now()")} if ok else {}
            leases.update_session(self.source, self.lease, remaining_entries=backlog.entries, **done)
        return backlog.state, backlog.acked, backlog.entries

    def release(self) -> None:
        if self.lease is not None:
            leases.release_quietly(self.source, self.lease)
            self.lease = None


def record_error(conn: psycopg2.extensions.connection, key: SessionKey, error: str) -> None:
    """Note a failed step in the session's ``last_error`` on its source (``lr status`` shows it;
    the next successful step clears it). Commits."""
    with conn.cursor() as cur:
        source_sessions.set_last_error(cur, key.sink, key.client, one_line(error)[:2000])
    conn.commit()


def clear_stale_leases(conn: psycopg2.extensions.connection) -> list[str]:
    """Release the leases whose holder stopped renewing them (expired), so status shows no owner.
    Safe: an expired lease is taken over anyway, and its epoch stays, so the old holder stays
    fenced. Returns the sessions released ("source->sink/client (owner)"). Commits."""
    source, _ = site_identity(conn)
    with conn.cursor() as cur:
        released = sorted(
            f"{SessionKey(source, sink, client)} ({owner})"
            for sink, client, owner in source_sessions.release_expired_leases(cur)
        )
    conn.commit()
    return released
