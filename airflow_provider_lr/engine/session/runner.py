"""One session's replication cycle: lease → negotiate → snapshot sync or log-entry sync.

Every step reads its starting point from the two sites' metadata and persists its outcome there,
so a cycle can be killed anywhere and the next one (in this process or another) resumes:

* snapshot sync: request (the server) → supply (the client's provider) → transfer to the sink's
  receive queue, invisible, resumable by source entry id → apply (one sink transaction makes it
  visible and sets applied = last processed = base) → request closed;
* log-entry sync: read the destination's entries after the sink's last processed position, in
  commit order, leaving out what the base snapshot covered, and apply each batch idempotently.

The Airflow operators and the Spark jobs call these same functions.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.errors import ConfigurationError, FencedError, LRError, TrimmedError, one_line, require_counts
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session import nearest_copy
from airflow_provider_lr.engine.session.nearest_copy import PROBE_DELAY
from airflow_provider_lr.engine.session.negotiation import Decision, Negotiation, SinkView, SourceView, negotiate
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source.backlog import session_backlogs, source_backlog
from airflow_provider_lr.engine.db.schema import site_identity
from airflow_provider_lr.engine.db.timeouts import lifted
from airflow_provider_lr.engine.site.topology import drift
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import Topology, config_id, recorded_id, reread
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.full_sync import FullSyncRequest, Provider
from airflow_provider_lr.engine.source.log_reader import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    LogReader,
    LogRecord,
    TableSplits,
)
from airflow_provider_lr.engine.source.transmit import RoutingQueueClient
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import (
    STREAM_LOG_ENTRIES,
    STREAM_SNAP_SYNC,
    RequestStatus,
    SessionKey,
    SessionState,
)

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 5_000  # snapshot messages per sink transaction during transfer
SNAPSHOT_CHUNK_BYTES = 8 << 20  # ... and their bytes (at least one message): memory bounded by bytes
MAX_BACKOFF_FACTOR = 16  # data timeout grows x2 per consecutive timeout, up to this factor
# The catch-up thresholds (``engine/bulk/catchup.py`` compares them; topology settings of the same
# names override them), in deliveries: entries still to deliver summed over a source's sessions in
# log-entry sync, as ``backlog.source_backlog`` counts them.
# From TEE_MIN_BACKLOG a catch-up first moves the backlog with the read-once tee in its own process
# (engine/bulk/fanout.py: ~470k deliveries/s against ~55k for session cycles, docs/spark.md), then
# carries on with session cycles. The tee's plan costs ~0.1-0.5 s (leases, negotiation, chunk
# bounds): worth it from ~10k deliveries.
TEE_MIN_BACKLOG = 50_000
# From SPARK_MIN_BACKLOG it goes through Spark where Spark can run (the lr_replication DAG).
# Measured on the 2-core machine (docs/spark.md "Choosing in-process or Spark", 2026-11-23, packed
# receive-queue rows): spark-submit costs 11-15 s before the first row moves (JVM, context, Python
# workers, warm-up job), in-process session cycles deliver ~55k deliveries/s, the warm Spark fan-out
# ~300-490k/s; break-even 11.3-14.7 s / (1/55k - 1/400k) ≈ 720k-940k deliveries.
SPARK_MIN_BACKLOG = 800_000
# A federated tables' snapshot of at least this many rows (the planner's estimate) is left to the
# Spark job where Spark can run; smaller ones are written in process by the session's cycle.
# Measured on the 2-core machine (docs/tables-bench.md, 2026-11-24): both paths cost ~2.6 s per 1M
# rows to 2 sinks (the sinks' COPY is the bound, and local Spark has no spare cores), and
# spark-submit costs ~8 s before the first row: in process is never slower below ~10M rows. Lower
# it (topology setting) where Spark executors have cores of their own.
TABLE_SPARK_MIN_ROWS = 10_000_000
SNAPSHOT_SPARK_MIN_ENTRIES = 1_000_000  # measured: docs/spark.md "Full sync on Spark"
# The Spark fan-out tees chunks at once (staged, bulk/staged_tee.py) from this many concurrent tasks;
# below, one task tees them in order (bulk/tee.py). The staged path costs the sinks 2.1x the CPU
# per delivery (stage, then move) and gains a task per executor core: measured on the 2-core
# machine, where Spark and the sites share the cores, the ordered tee is 1.6x faster (docs/spark.md
# "The fan-out spread over tasks"); the model there puts the crossover at 2-3 tasks whose cores the
# sites do not share, so a cluster of 4 or more cores is taken to be one.
STAGED_MIN_TASKS = 4


@dataclass
class SessionSettings:
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES
    max_batches: int = 100  # log-entry batches per cycle (fairness between sessions)
    lease_seconds: float = leases.DEFAULT_LEASE_SECONDS
    data_timeout: float = full_sync.DEFAULT_DATA_TIMEOUT
    barrier_timeout: float = 5.0
    tee_min_backlog: int = TEE_MIN_BACKLOG  # 0: never tee, session cycles only
    spark_min_backlog: int = SPARK_MIN_BACKLOG  # where Spark can run (the DAG); lr sync runs none
    table_spark_min_rows: int = TABLE_SPARK_MIN_ROWS  # a table snapshot this large goes to Spark (the DAG)
    snapshot_spark_min_entries: int = SNAPSHOT_SPARK_MIN_ENTRIES  # a full-sync transfer this large goes to Spark (the DAGs)
    fanout_tasks: int = 0  # chunks the Spark fan-out tees at once (1: in order; 0: by the cluster's cores)
    nearest_copy: bool = True  # a client of tables only may be seeded from a peer sink in its region
    peer_probe_delay: float = PROBE_DELAY  # seconds the first peer has to answer (x2 each next)

    def __post_init__(self) -> None:  # a batch of 0 would make every cycle a silent no-op
        require_counts(max_entries=self.max_entries, max_bytes=self.max_bytes, max_batches=self.max_batches)

    @classmethod
    def from_topology(cls, topology: Topology, **overrides: object) -> "SessionSettings":
        """The settings a topology asks for (``settings:`` in its YAML), with explicit overrides."""
        values: dict[str, object] = {
            "data_timeout": topology.setting("full_sync_data_timeout_s", full_sync.DEFAULT_DATA_TIMEOUT),
            "lease_seconds": topology.setting("lease_seconds", leases.DEFAULT_LEASE_SECONDS),
            "tee_min_backlog": topology.setting("tee_min_backlog", TEE_MIN_BACKLOG),
            "spark_min_backlog": topology.setting("spark_min_backlog", SPARK_MIN_BACKLOG),
            "table_spark_min_rows": topology.setting("table_spark_min_rows", TABLE_SPARK_MIN_ROWS),
            "snapshot_spark_min_entries": topology.setting("snapshot_spark_min_entries", SNAPSHOT_SPARK_MIN_ENTRIES),
            "fanout_tasks": topology.setting("fanout_tasks", 0),
            "nearest_copy": topology.setting("nearest_copy", True),
            "peer_probe_delay": topology.setting("peer_probe_delay_s", PROBE_DELAY),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


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
        report, meta, negotiation = self.begin()
        if negotiation is None:
            return report
        if negotiation.decision is Decision.SNAPSHOT_SYNC:
            meta = self.snapshot_sync(meta, report)
        elif negotiation.decision is Decision.WAIT_SNAPSHOT_APPLY:
            meta = self.apply_snapshot(meta)
        if meta is not None and meta.data_consistent and not self.log_entry_sync(meta, report):
            # the log was trimmed past the sink mid-cycle: renegotiate now (→ snapshot sync), so the
            # cycle never ends reporting log-entry sync for a session the log can no longer serve
            meta = writes.read_metadata(self.sink, self.key.source, self.key.client)
            negotiation = self.negotiate(meta)
            report.decision, report.reason = negotiation.decision.value, negotiation.reason
            if negotiation.decision is Decision.SNAPSHOT_SYNC:
                self.snapshot_sync(meta, report)
        report.full_syncs = self.full_syncs_applied - applied
        return self.finish(report)

    def begin(self) -> tuple[CycleReport, writes.SinkMetadata | None, Negotiation | None]:
        """The first step of every cycle (and of every Airflow step): take the lease, then negotiate.
        The negotiation is None when there is nothing to do: the lease is held elsewhere
        (``report.skipped``) or negotiation refused (``report.error``, recorded on the source)."""
        report = CycleReport(str(self.key))
        if self.topology is not None and self.topology.path:  # a stale file: said so, not as a lease or a refusal
            held = {self.key.source: recorded_id(self.source)}
            # the file may have been edited and applied since this process read it: then it is not stale
            found = drift(self.topology, held) and drift(reread(self.topology), held)
            if found is not None:
                report.decision, report.error = Decision.REFUSE.value, found.message()
                return report, None, None
        self.lease = leases.acquire(self.source, self.key.sink, self.key.client, self.owner, self.settings.lease_seconds)
        if self.lease is None:
            try:
                owner = leases.holder(self.source, self.key.sink, self.key.client)
            except ConfigurationError as exc:  # no such session here: nobody holds anything
                report.decision, report.error = Decision.REFUSE.value, f"site {self.key.source!r}: {exc}"
                return report, None, None
            report.skipped = f"another replicator holds this session's lease ({owner or 'just released'})"
            return report, None, None
        fault_point("after_lease")
        try:
            meta = writes.fence(self.sink, self.key.source, self.key.client, self.lease.epoch)
        except FencedError as exc:
            if exc.sink_epoch is None:
                raise
            # we hold the source's lease, yet the sink has seen a higher epoch: the source forgot
            # it (session re-added); move past it rather than stay fenced until the epochs catch up
            log.info("session %s: the sink has seen epoch %s, above the source's %s; moving past it",
                     self.key, exc.sink_epoch, self.lease.epoch)
            self.lease = leases.advance_epoch(self.source, self.lease, exc.sink_epoch)
            meta = writes.fence(self.sink, self.key.source, self.key.client, self.lease.epoch)
        fault_point("after_fence")
        negotiation = self.negotiate(meta)
        report.decision, report.reason = negotiation.decision.value, negotiation.reason
        if negotiation.decision is Decision.REFUSE:
            self._update(state=SessionState.NEGOTIATING, last_error=f"negotiation refused: {negotiation.reason}")
            report.state, report.error = SessionState.NEGOTIATING, negotiation.reason
            return report, meta, None
        return report, meta, negotiation

    def finish(self, report: CycleReport) -> CycleReport:
        report.state, report.acked_position, report.remaining = self._status(ok=not report.error)
        return report

    # --- single steps (what the Airflow operators run, one task each) --------------------------
    def negotiate_step(self) -> CycleReport:
        """Only negotiation: what the session needs next (``report.decision``), nothing moved."""
        report, _, negotiation = self.begin()
        return report if negotiation is None else self.finish(report)

    def snapshot_step(self) -> CycleReport:
        """Only the snapshot part of a cycle: request → client data → transfer → apply → complete,
        as far as it can go now (``report.waiting`` while the client's data is not supplied).
        Does nothing when negotiation calls for log-entry sync."""
        report, meta, negotiation = self.begin()
        if negotiation is None:
            return report
        assert meta is not None
        if negotiation.decision is Decision.SNAPSHOT_SYNC:
            self.snapshot_sync(meta, report)
        elif negotiation.decision is Decision.WAIT_SNAPSHOT_APPLY:
            self.apply_snapshot(meta)
        return self.finish(report)

    def log_entry_step(self) -> CycleReport:
        """Only log-entry sync (up to ``settings.max_batches`` batches); does nothing unless
        negotiation calls for it (a session that needs a snapshot is left to the snapshot step)."""
        report, meta, negotiation = self.begin()
        if negotiation is None:
            return report
        assert meta is not None
        if negotiation.decision is Decision.LOG_ENTRY_SYNC and not self.log_entry_sync(meta, report):
            report.decision = Decision.SNAPSHOT_SYNC.value  # left to the snapshot step of the next run
        return self.finish(report)

    def negotiate(self, meta: writes.SinkMetadata) -> Negotiation:
        with self.source.cursor() as cur:
            topology_id = config_id(cur)
            cur.execute("SELECT trim_mark FROM lr.log_trim")
            trim_mark = cur.fetchone()[0]
        self.source.commit()
        request = full_sync.open_request(self.source, self.key.sink, self.key.client)
        if request is not None and self.reconcile(meta, request):
            request = None
        forced = bool(request and request.forced and request.request_id != meta.snapshot_request_id)
        return negotiate(
            SourceView(topology_id, trim_mark, forced),
            SinkView(
                meta.site_topology_config_id,
                meta.snapshot_started,
                meta.snapshot_transferred,
                meta.snapshot_applied,
                meta.last_log_entry_processed,
                meta.data_consistent,
            ),
        )

    def reconcile(self, meta: writes.SinkMetadata, request: FullSyncRequest | None) -> bool:
        """Close the source's open request when the sink's own metadata says it was applied: the
        crash window between the sink's apply and the source's record (docs/crash-windows.md).
        Left open, it would hold safe trim at its base forever and be taken for a resume later.
        Idempotent; True when it closed ``request``."""
        if request is None or request.request_id != meta.snapshot_request_id or not _applied(meta):
            return False
        log.info("session %s: full sync %s was applied on the sink; closing it on the source", self.key,
                 request.request_id)
        self._record_applied(meta, note="closed from the sink's metadata (applied before a crash)")
        return True

    # --- snapshot sync ------------------------------------------------------------------------
    def snapshot_sync(self, meta: writes.SinkMetadata, report: CycleReport) -> writes.SinkMetadata | None:
        """Advance the session's full sync as far as it can go now; the sink metadata once applied,
        else None (waiting for the client's data)."""
        seeded = self.seed_from_peer(report)
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
        if self.spark_transfer and (request.entries or 0) >= self.settings.snapshot_spark_min_entries:
            report.transfer_for_spark = request.request_id
            report.reason = f"{report.reason}; the transfer of {request.entries} entries is left to Spark".lstrip("; ")
            return None
        meta = writes.start_snapshot(
            self.sink, self.key.source, self.key.client, self._epoch(), request.request_id,
            request.base_position, request.split, recorded_id(self.source),
        )
        fault_point("after_snapshot_start")
        meta, sent = self.transfer_snapshot(request, meta)
        report.snapshot_messages += sent
        return self.apply_snapshot(meta)

    def seed_from_peer(self, report: CycleReport) -> writes.SinkMetadata | None:
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
                full_sync.finish_request(self.source, request.request_id, RequestStatus.CANCELLED,
                                         "the sink is seeded from a peer sink instead")

        seed = nearest_copy.seed_from_peers(self.source, self.sink, self.key, self._epoch(), federated, self.peers,
                                            self.settings.peer_probe_delay, before_write=close_request)
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
            note = (f"supplied at position {request.base_position}, behind the sink's "
                    f"{meta.last_log_entry_processed}: supplied again")
            log.info("session %s: full sync %s was %s", self.key, request.request_id, note)
            request = full_sync.supply_again(self.source, request.request_id, note, self.settings.data_timeout)
        if request is None:
            attempts = self._attempts()
            timeout = self.settings.data_timeout * min(2**attempts, MAX_BACKOFF_FACTOR)
            request = full_sync.request_full_sync(
                self.source, self.key.sink, self.key.client, reason="negotiation", data_timeout=timeout,
                lease=self.lease,
            )
            log.info("session %s: full sync requested (%s), data timeout %.0fs", self.key, request.request_id, timeout)
            fault_point("after_request")
        self._update(state=SessionState.IN_SNAPSHOT_SYNC, sync_id=request.request_id, last_error=None)
        return request

    @staticmethod
    def _behind_sink(request: FullSyncRequest, meta: writes.SinkMetadata) -> bool:
        return (request.base_position is not None and request.request_id != meta.snapshot_request_id
                and request.base_position < meta.last_log_entry_processed)

    def _restart_after_timeout(self, request: FullSyncRequest) -> None:
        """No client data within the timeout: close the request; the next cycle asks again with a
        longer timeout (backoff), so a slow provider is not restarted forever (CorfuDB #4119)."""
        assert self.lease is not None
        leases.update_session(self.source, self.lease, commit=False, attempts=AsIs("attempts + 1"),
                              last_error=f"full-sync request {request.request_id} timed out without client data")
        full_sync.finish_request(self.source, request.request_id, RequestStatus.TIMED_OUT, "no client data within the timeout")
        fault_point("after_timeout")

    def transfer_snapshot(self, request: FullSyncRequest, meta: writes.SinkMetadata) -> tuple[writes.SinkMetadata, int]:
        """Copy the request's messages to the sink, resuming after what the sink already has."""
        sent = 0
        total = (request.entries or 0) + 2  # the provider's messages and the two markers
        tracker = progress.track(f"full sync {request.request_id[:8]} {self.key}: transfer", total, "messages")
        tracker.update(meta.snapshot_transferred_seq + 1)
        while meta.snapshot_transferred != meta.snapshot_started:
            chunk = self._snapshot_records(request, meta.snapshot_last_entry)
            if not chunk:
                full_sync.finish_request(self.source, request.request_id, RequestStatus.CANCELLED, "data missing from the log")
                raise LRError(
                    f"session {self.key}: full-sync data of request {request.request_id} is missing from the log "
                    "(trimmed?); a new full sync will be requested"
                )
            meta = writes.write_snapshot_messages(self.sink, self.key.source, self.key.client, self._epoch(),
                                                request.request_id, chunk)
            sent += len(chunk)
            tracker.update(meta.snapshot_transferred_seq + 1)
            fault_point("after_snapshot_chunk")
        tracker.finish()
        return meta, sent

    def _snapshot_records(self, request: FullSyncRequest, after_entry: int) -> list[LogRecord]:
        with self.source.cursor() as cur:
            # Messages are sent only while the bytes before them stay under the chunk's budget (sizes
            # are read from the tuples without fetching the messages).
            # One transaction, so one commit position: read apart. The entries in primary-key order
            # (tx, entry_id), never sorted: right after the supplying transaction the table's
            # statistics are stale (a handful of rows expected), and the planner sorted every remaining
            # entry for each chunk: a full sync of 1M entries took 75 s in process, quadratic.
            cur.execute("SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off")
            cur.execute(
                "SELECT (SELECT position FROM lr.log_commits WHERE tx = %s::xid8), entry_id, message FROM ("
                " SELECT e.entry_id, e.message,"
                "  sum(octet_length(e.message)) OVER (ORDER BY e.entry_id) - octet_length(e.message) AS before"
                " FROM lr.log_entries e"
                " WHERE e.tx = %s::xid8 AND e.stream = %s AND e.entry_id > %s ORDER BY e.entry_id LIMIT %s) chunk "
                "WHERE before < %s ORDER BY entry_id",
                (request.supplied_tx, request.supplied_tx, STREAM_SNAP_SYNC, after_entry, SNAPSHOT_CHUNK,
                 SNAPSHOT_CHUNK_BYTES),
            )
            rows = [LogRecord(p, e, bytes(m)) for p, e, m in cur.fetchall()]
        self.source.commit()
        return rows

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
        """One source transaction: the session's new base and ack, and its request closed. (Two
        commits would open a window where the request is closed and the ack not yet recorded, and
        safe trim, held by neither, could remove what the sink needs next.)"""
        assert self.lease is not None
        leases.update_session(self.source, self.lease, commit=False, state=SessionState.IN_LOG_ENTRY_SYNC,
                              base_position=meta.snapshot_applied, acked_position=meta.last_log_entry_processed,
                              attempts=0, last_error=None)
        if meta.snapshot_request_id:  # who applied it: a DAG's step, a stream, `lr sync` (RequestOutcome)
            full_sync.finish_request(self.source, meta.snapshot_request_id, RequestStatus.APPLIED,
                                     note or f"applied by {self.owner}")
        else:
            self.source.commit()

    # --- log-entry sync -----------------------------------------------------------------------
    def log_entry_sync(self, meta: writes.SinkMetadata, report: CycleReport) -> bool:
        """Up to ``settings.max_batches`` batches. False when the log was trimmed past the sink
        (every read checks the trim mark in the snapshot it reads from): nothing of the trimmed
        range was delivered, and the session needs a snapshot sync."""
        after, base, split = meta.last_log_entry_processed, meta.snapshot_applied, meta.split
        self._update(state=SessionState.IN_LOG_ENTRY_SYNC, acked_position=after, last_error=None)
        self.sync_tables(report)
        reader = self.reader()
        tracker: progress.Tracker | None = None
        for _ in range(self.settings.max_batches):
            try:
                batch = reader.read_stream(after, self.settings.max_entries, self.settings.max_bytes, split,
                                           tables=self.tables)
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
        lacking = table_snapshot.needed(self.source, self.sink, self.key,
                                        registry.federated_tables(self.source, self.key.client))
        if lacking:
            snap = table_snapshot.TableSnapshot(self.source, self.key.client,
                                                [table_snapshot.SinkSide(self.key, self.sink, self._epoch(), lacking)])
            try:
                with lifted(self.source, self.sink):  # whole tables, one COPY each: as long as they take
                    snap.open()
                    if self.spark_tables and snap.estimated_rows() >= self.settings.table_spark_min_rows:
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
            self._reader = LogReader(self.source, self.key.sink, STREAM_LOG_ENTRIES,
                                     self.settings.barrier_timeout, client_name=self.key.client)
        return self._reader

    # --- metadata -----------------------------------------------------------------------------
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


def _applied(meta: writes.SinkMetadata) -> bool:
    """The sink has applied its current full sync (and is consistent on it)."""
    return meta.snapshot_started >= 0 and meta.snapshot_applied == meta.snapshot_started and meta.data_consistent


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
        released = sorted(f"{SessionKey(source, sink, client)} ({owner})"
                          for sink, client, owner in source_sessions.release_expired_leases(cur))
    conn.commit()
    return released
