"""One session's replication cycle: the handshake (``handshake.py``: lease → fence → negotiate), then
snapshot sync or log-entry sync from the ``Position`` it returns.

Every step reads its starting point from the two sites' metadata and persists its outcome there,
so a cycle can be killed anywhere and the next one (in this process or another) resumes:

* snapshot sync: request (the server) → supply (the client's provider) → transfer to the sink's
  receive queue, invisible, resumable by source entry id → apply (one sink transaction makes it
  visible and sets applied = last processed = base) → request closed;
* log-entry sync: read the destination's entries after the sink's last processed position, in
  commit order, leaving out what the base snapshot covered, and apply each batch idempotently.

The snapshot sync is ``snapshot_sync.py``'s (``SnapshotSync``, which ``SessionRunner`` extends); the
Airflow operators and the Spark jobs call these same functions. Settings and thresholds:
``session/settings.py`` (measured in docs/spark.md "Thresholds"); when work goes to Spark:
``session/catchup.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.lifting import lifted
from airflow_provider_lr.engine.db.schema import site_identity
from airflow_provider_lr.engine.errors import FencedError, TrimmedError, one_line
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session import catchup
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import (
    Handshake,
    Position,
    Verdict,
    handshake,
    negotiate_session,
)
from airflow_provider_lr.engine.session.negotiation import Decision, Negotiation
from airflow_provider_lr.engine.session.snapshot_sync import CycleReport, SnapshotSync
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source.backlog import SessionBacklog, session_backlogs
from airflow_provider_lr.engine.source.log_reader import LogReader, TableSplits
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.tables.targets import TableState
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, SessionKey, SessionState

TABLES_SETTLED_SCHEMA = 27  # lr.source_sessions.tables_settled_upto
log = logging.getLogger(__name__)


@dataclass(eq=False)
class SessionRunner(SnapshotSync):
    """Runs cycles of one session between an open source and sink connection (``lease``: the one
    its last cycle took, which a stream carries on); the snapshot sync is ``SnapshotSync``'s."""

    tables: TableSplits = field(default_factory=TableSplits, init=False)  # synced tables, for the reader
    _reader: LogReader | None = field(default=None, init=False, repr=False)

    # --- the cycle ----------------------------------------------------------------------------
    def run_cycle(self) -> CycleReport:
        applied = self.full_syncs_applied
        report, hs = self.begin()
        if not hs.proceeds:  # held by another replicator: its state as that one left it (caught up or not)
            return self.finish(report) if report.skipped else report
        assert hs.meta is not None, "a handshake that proceeds has fenced the sink"
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
        if hs.verdict is Verdict.SKIPPED:
            report.skipped = hs.reason
        elif hs.verdict is Verdict.REFUSED:
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
        applied = self.full_syncs_applied
        report, hs = self.begin()
        if not hs.proceeds:  # held by another replicator: its state as that one left it (caught up or not)
            return self.finish(report) if report.skipped else report
        assert hs.meta is not None
        if hs.decision is Decision.SNAPSHOT_SYNC:
            self.snapshot_sync(hs.meta, report)
        elif hs.decision is Decision.WAIT_SNAPSHOT_APPLY:
            self.apply_snapshot(hs.meta)
        report.full_syncs = self.full_syncs_applied - applied  # as a cycle counts it (before: 0 after one applied)
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

    # --- log-entry sync -----------------------------------------------------------------------
    def log_entry_sync(self, position: Position, report: CycleReport) -> bool:
        """Up to ``settings.max_batches`` batches from ``position``. False when the log was trimmed
        past the sink (every read checks the trim mark in the snapshot it reads from): nothing of
        the trimmed range was delivered, and the session needs a snapshot sync."""
        after, base, split = position.after, position.base, position.split
        # the last error stays until this cycle gets past it (``lr status`` never shows a refused
        # session, retried cycle after cycle, without it): cleared with the first batch, or at the end
        self._update(state=SessionState.IN_LOG_ENTRY_SYNC, acked_position=after)
        self.sync_tables(report)
        reader = self.reader()
        tracker: progress.Tracker | None = None
        stopped = False
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
                    stopped = False
                    break
                after = writes.apply_log_stream(self.sink, self.key.source, self.key.client, self._epoch(), batch, base)
            fault_point("after_sink_apply")
            report.delivered += batch.entries
            report.delivered_bytes += batch.bytes
            self._update(acked_position=after, last_error=None)
            stopped = batch.has_more  # paused (or out of batches) with more to read: the next cycle goes on
            if not batch.has_more or self.paused():
                break
            tracker = self._catch_up_progress(tracker, report.delivered)
        if tracker is not None:
            tracker.finish(stopped)
        self.sync_tables(report)  # the set is re-read at the end too: a table federated meanwhile joins now
        if not report.delivered:  # nothing to deliver, nothing refused: an earlier error is past
            with self.source.cursor() as cur:
                source_sessions.clear_last_error(cur, self.key.sink, self.key.client)
            self.source.commit()
        return True

    def sync_tables(self, report: CycleReport) -> None:
        """Re-read the client's federated tables and snapshot those the sink lacks, at the session's
        position now (the cycle holds the lease: nothing advances until they are written); a large
        snapshot is left to the Spark job when ``spark_tables``. Then the reader's ``TableSplits``."""
        federated = registry.federated_tables(self.source, self.key.client)
        lacking = table_snapshot.needed(self.source, self.sink, self.key, federated)
        settled = not lacking
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
                        settled = set(snap.report.tables.values()) <= {TableState.SYNCED, TableState.CONFLICT}
                        report.tables += [f"{name}: {state}" for name, state in snap.report.tables.items()]
                        report.table_rows += snap.report.rows
            finally:
                snap.close()
        # a writer's wait on a change of these tables may count this sink's ack (V0027)
        if settled and federated and schema.at_least(self.source, TABLES_SETTLED_SCHEMA):
            with self.source.cursor() as cur:
                source_sessions.settle_tables(cur, self.key.sink, self.key.client, max(t.table_id for t in federated))
            self.source.commit()
        self.tables = table_snapshot.splits(self.sink, self.key)

    def _catch_up_progress(self, tracker: progress.Tracker | None, delivered: int) -> progress.Tracker:
        """A catch-up longer than one batch reports progress (rate, ETA against the backlog counted
        once, after its first batch); one batch says nothing."""
        if tracker is None:
            backlog = self._backlog()
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

    def _backlog(self) -> SessionBacklog:
        """The session's backlog on its source. A session removed from the topology while its cycle
        ran (``lr topology apply`` elsewhere) is the ConfigurationError its next cycle's refusal is,
        naming the topology applied (not a ValueError from inside lr)."""
        found = session_backlogs(self.source, self.key.sink, self.key.client)
        if not found:
            leases.holder(self.source, self.key.sink, self.key.client)  # raises: no such session here
            return self._backlog()  # added back meanwhile
        return found[0]

    def _status(self, ok: bool = True) -> tuple[str, int, int]:
        """State, acked position and entries still to send (committed, tagged for the sink);
        records them, and the time of this success (``ok``), on the source."""
        backlog = self._backlog()
        if self.lease is not None:
            done = {"last_success_at": AsIs("now()")} if ok else {}
            leases.update_session(self.source, self.lease, remaining_entries=backlog.entries, **done)
        return backlog.state, backlog.acked, backlog.entries


def record_error(
    conn: psycopg2.extensions.connection, key: SessionKey, error: str, exc: BaseException | None = None
) -> None:
    """Note a failed step in the session's ``last_error`` on its source (``lr status`` shows it;
    the next successful step clears it). Commits. A step fenced (``exc`` a FencedError: another
    replicator took the session over) records nothing: the row is the new holder's now, and a
    stalled replicator woken up must not put its own refusal on a session that streams fine."""
    if isinstance(exc, FencedError):
        return
    with conn.cursor() as cur:
        source_sessions.set_last_error(cur, key.sink, key.client, one_line(error)[:2000])
    conn.commit()


def clear_stale_leases(conn: psycopg2.extensions.connection) -> list[str]:
    """Release the leases whose holder stopped renewing them (expired) or is a dead replicator member,
    so status shows no owner.
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


def settled(report: CycleReport) -> bool:
    """Nothing more will happen without new input: in log-entry sync with nothing remaining."""
    return report.state == SessionState.IN_LOG_ENTRY_SYNC and report.remaining == 0 and not report.error


def unsettled(reports: list[CycleReport]) -> list[str]:
    """Why each session of a cycle is not settled ("session: why"), for a summary."""
    out = []
    for r in reports:
        if settled(r):
            continue
        if r.error:
            why = f"failing: {r.error}"
        elif r.skipped:
            why = r.skipped
        elif r.waiting:
            why = r.reason
        elif r.remaining:
            why = f"{r.remaining} entries still to send ({r.state})"
        else:
            why = f"{r.state or 'not started'}: {r.reason or 'no progress'}"
        out.append(f"{r.session}: {why}")
    return out
