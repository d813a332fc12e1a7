"""A session's snapshot (full) sync, the part of its cycle (``runner.py``) that moves a whole copy:

request (the server) → supply (the client's provider) → transfer to the sink's receive queue,
invisible, resumable by source entry id → apply (one sink transaction makes it visible and sets
applied = last processed = base) → request closed on the source. A client of tables only may
instead be seeded from a peer sink in its region (``nearest_copy.py``). Each step reads its
starting point from the two sites' metadata and persists its outcome there, so it can be killed
anywhere and the next cycle resumes. Also here: what the cycle reports (``CycleReport``) and the
lease the cycle holds (its epoch fences every sink write).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.db.lifting import lifted
from airflow_provider_lr.engine.errors import LRError
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session import catchup, nearest_copy
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import (
    Position,
    reconcile,
    record_applied,
)
from airflow_provider_lr.engine.session.settings import (
    MAX_BACKOFF_FACTOR,
    SNAPSHOT_CHUNK,
    SNAPSHOT_CHUNK_BYTES,
    SessionSettings,
)
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source import closed_tables, full_sync
from airflow_provider_lr.engine.source.full_sync import FullSyncRequest, Provider
from airflow_provider_lr.engine.source.transmit import RoutingQueueClient
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import Topology, recorded_id
from airflow_provider_lr.engine.tables import clients, registry
from airflow_provider_lr.engine.vocabulary import RequestStatus, SessionKey, SessionState

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
    refused: str = ""  # ``explained.refused_kind`` of the error: one no retry mends (a missing grant)
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
class SnapshotSync:
    """The snapshot-sync part of a session's cycle (``SessionRunner`` is the whole cycle), between
    an open source and sink connection, under the lease the cycle took (``lease``: the one its last
    cycle took, which a stream carries on)."""

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
    # asked between chunks: True ends the cycle's transfer (and log-entry batches) there, resumed by the
    # next cycle; a replicator stopping, or one session's turn spent, so the others' cycles are not held
    pause: Callable[[], bool] | None = None
    lease: leases.Lease | None = field(default=None, init=False)
    full_syncs_applied: int = field(default=0, init=False)  # by this runner, for the cycle reports

    def __post_init__(self) -> None:
        self.settings = self.settings or SessionSettings()  # callers may pass None for the defaults

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
        if provider is None and clients.opened_here(self.source, self.key.client):
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
            supplying = False
            if full_sync.expired(self.source, request):
                supplying = not self._restart_after_timeout(request)
            report.reason = f"waiting for full-sync data of request {request.request_id}" + (
                " (its client is supplying it now)" if supplying else ""
            )
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
            writes.SyncStart.of(
                request,
                closed_tables.whole_copies(
                    self.source, self.key.sink, self.key.client, meta.last_log_entry_processed, request.base_position
                ),
            ),
            recorded_id(self.source),
        )
        fault_point("after_snapshot_start")
        meta, sent = self.transfer_snapshot(request, meta)
        report.snapshot_messages += sent
        if meta.snapshot_transferred != meta.snapshot_started:  # paused: the next cycle resumes it
            report.reason = (
                f"full sync {request.request_id}: {meta.snapshot_transferred_seq + 1} of "
                f"{(request.entries or 0) + 2} messages transferred, the rest next cycle"
            )
            return None
        return self.apply_snapshot(meta)

    def paused(self) -> bool:
        """The cycle's turn is over (``pause``): what it moved so far stays, the next cycle goes on."""
        return self.pause is not None and self.pause()

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

    def _restart_after_timeout(self, request: FullSyncRequest) -> bool:
        """No client data within the timeout: close the request; the next cycle asks again with a
        longer timeout (backoff), so a slow provider is not restarted forever (CorfuDB #4119).
        False, nothing done, while a client's own serve loop is supplying it (late, but coming):
        waiting for its lock failed the cycle after lock_timeout and then discarded the supply."""
        assert self.lease is not None
        leases.update_session(
            self.source,
            self.lease,
            commit=False,
            attempts=AsIs("attempts + 1"),
            last_error=f"full-sync request {request.request_id} timed out without client data",
        )
        if not full_sync.finish_request(
            self.source,
            request.request_id,
            RequestStatus.TIMED_OUT,
            "no client data within the timeout",
            unless_supplying=True,
        ):
            return False  # the attempt counted above is rolled back with it
        fault_point("after_timeout")
        return True

    def transfer_snapshot(self, request: FullSyncRequest, meta: writes.SinkMetadata) -> tuple[writes.SinkMetadata, int]:
        """Copy the request's messages to the sink, resuming after what the sink already has, until
        done or ``paused`` (between chunks: each one is a sink transaction of its own)."""
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
            if meta.snapshot_transferred != meta.snapshot_started and self.paused():
                break
        tracker.finish(stopped=meta.snapshot_transferred != meta.snapshot_started)
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
        leases.update_session(self.source, self.lease, True, **values)

    def _attempts(self) -> int:
        with self.source.cursor() as cur:
            found = source_sessions.attempts(cur, self.key.sink, self.key.client)
        self.source.commit()
        return found

    def release(self) -> None:
        if self.lease is not None:
            leases.release_quietly(self.source, self.lease)
            self.lease = None
