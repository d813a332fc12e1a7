"""The handshake every mover of a session runs before it moves anything, and the one value it returns.

Cycles and their single steps, the stream, the read-once tee and its staged form (the fan-out
driver hands each chunk the position), the snapshot transfer, the parallel table snapshots and the
nearest copy all start the same way: refuse a site whose lr schema is older than they need (read
once per connection), check the topology file is not stale, take the session's lease on the
source (held elsewhere: skipped), fence the sink at the lease's epoch (moving the epoch past a
higher one the sink has seen), negotiate. ``handshake`` does it once; what comes back is a
``Handshake``: the verdict (proceed, skipped or refused, with why), the lease, the sink's metadata,
the negotiation, and a frozen ``Position`` (after, base, split, epoch).

Why one value: Debezium's ``ChangeEventSourceCoordinator`` restores one offset context, runs the
snapshot source with it and starts the streaming source from the offset the snapshot returns; no
source re-derives where it starts. Here the ``Position`` plays that part: the movers read it from
the handshake (or the fan-out plan's demand, made from it) instead of each re-reading the sink and
re-deciding "skipped, refused, or which decision" its own way. The fault points ``after_lease`` and
``after_fence`` stay where crash tests kill (docs/crash-windows.md).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import ConfigurationError, FencedError
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.negotiation import (
    APPLY_BOTH,
    MISMATCH,
    Decision,
    Negotiation,
    SinkView,
    SourceView,
    negotiate,
)
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source import closed_tables, full_sync
from airflow_provider_lr.engine.source.full_sync import FullSyncRequest
from airflow_provider_lr.engine.source.log_reader import BaseSplit
from airflow_provider_lr.engine.store import sink_sessions, source_sessions
from airflow_provider_lr.engine.store.topology import Topology, TopologyDrift, config_id, drift, recorded_id, reread
from airflow_provider_lr.engine.tables import closed_notes
from airflow_provider_lr.engine.vocabulary import OPEN_STATUSES, RequestStatus, SessionKey, SessionState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Position:
    """Where a session's sink stands and under which lease epoch its writes go: what every mover
    starts from. Picklable (it travels in a fan-out plan to Spark tasks)."""

    after: int  # the sink's last processed commit position
    base: int  # the snapshot base the sink is at (a writer refuses a sink that moved to another)
    split: BaseSplit | None  # what the base snapshot covered
    epoch: int  # the lease epoch, checked by every sink write

    @classmethod
    def of(cls, meta: writes.SinkMetadata, epoch: int) -> Position:
        return cls(meta.last_log_entry_processed, meta.snapshot_applied, meta.split, epoch)

    def advanced(self, after: int) -> Position:
        return replace(self, after=after)


class Verdict(enum.Enum):
    PROCEED = "proceed"  # lease held, sink fenced, negotiation decided what to do
    SKIPPED = "skipped"  # another replicator holds the lease: nothing to do, nothing wrong
    REFUSED = "refused"  # a stale topology file, no such session here, or negotiation refused


@dataclass(frozen=True)
class Handshake:
    """What ``handshake`` found (see the module docstring)."""

    key: SessionKey
    verdict: Verdict
    reason: str = ""  # skipped or refused: why (refused by negotiation: its reason)
    lease: leases.Lease | None = None
    meta: writes.SinkMetadata | None = None
    negotiation: Negotiation | None = None
    position: Position | None = None

    @property
    def proceeds(self) -> bool:
        return self.verdict is Verdict.PROCEED

    @property
    def decision(self) -> Decision | None:
        return self.negotiation.decision if self.negotiation is not None else None

    def left_out(self, wanted: Decision, why: str = "left to the session cycle") -> str | None:
        """Why a mover that only does ``wanted`` (the fan-out, table snapshots: log-entry sync)
        leaves this session out, or None when it may go on."""
        if self.verdict is Verdict.SKIPPED:
            return self.reason
        if self.verdict is Verdict.REFUSED:
            return f"negotiation refused: {self.reason}"
        assert self.negotiation is not None
        if self.negotiation.decision is not wanted:
            return f"needs {self.negotiation.decision.value} ({self.negotiation.reason}); {why}"
        return None


def handshake(
    source: psycopg2.extensions.connection,
    sink: psycopg2.extensions.connection,
    key: SessionKey,
    owner: str,
    lease_seconds: float = leases.DEFAULT_LEASE_SECONDS,
    topology: Topology | None = None,
    on_lease: Callable[[leases.Lease | None], None] = lambda lease: None,
) -> Handshake:
    """Drift check → lease → fence → negotiate (see the module docstring). A negotiation refused is
    recorded on the source (state NEGOTIATING, ``last_error``); everything else is the caller's.
    ``on_lease`` hears of the lease as soon as it is asked for (None: not taken) and again when its
    epoch moves, so a caller releases it even when the fence or the negotiation fails. A site whose
    lr schema is older than the movers need is refused first (``SchemaError``), nothing written."""
    schema.require_current(source, "replicating from it", schema.REPLICATION_SCHEMA)  # once per connection
    schema.require_current(sink, "replicating into it", schema.REPLICATION_SCHEMA)
    if topology is not None and topology.path:  # a stale file: said so, not as a lease or a refusal
        held = {key.source: recorded_id(source)}
        # the file may have been edited and applied since this process read it: then it is not stale
        found = drift(topology, held) and drift(reread(topology), held)
        if found is not None:
            return Handshake(key, Verdict.REFUSED, told_by_sink(found, sink, key, source).message())
    lease = leases.acquire(source, key.sink, key.client, owner, lease_seconds)
    on_lease(lease)
    if lease is None:
        try:
            holder = leases.holder(source, key.sink, key.client)
        except ConfigurationError as exc:  # no such session here: nobody holds anything
            return Handshake(key, Verdict.REFUSED, f"site {key.source!r}: {exc}")
        return Handshake(
            key, Verdict.SKIPPED, f"another replicator holds this session's lease ({holder or 'just released'})"
        )
    fault_point("after_lease")
    try:
        meta = writes.fence(sink, key.source, key.client, lease.epoch)
    except FencedError as exc:
        if exc.sink_epoch is None:
            raise
        # we hold the source's lease, yet the sink has seen a higher epoch: the source forgot
        # it (session re-added); move past it rather than stay fenced until the epochs catch up
        log.info(
            "session %s: the sink has seen epoch %s, above the source's %s; moving past it",
            key,
            exc.sink_epoch,
            lease.epoch,
        )
        lease = leases.advance_epoch(source, lease, exc.sink_epoch)
        on_lease(lease)
        meta = writes.fence(sink, key.source, key.client, lease.epoch)
    fault_point("after_fence")
    negotiation, acked = _negotiate(source, key, lease, owner, meta)
    if negotiation.decision is Decision.LOG_ENTRY_SYNC and acked < 0:
        resnapshot_tables(sink, source, key, lease, meta)
    position = Position.of(meta, lease.epoch)
    if negotiation.decision is Decision.REFUSE:
        negotiation = _back_unrejoined(source, key, meta, negotiation)
        leases.update_session(
            source, lease, state=SessionState.NEGOTIATING, last_error=f"negotiation refused: {negotiation.reason}"
        )
        return Handshake(key, Verdict.REFUSED, negotiation.reason, lease, meta, negotiation, position)
    return Handshake(key, Verdict.PROCEED, "", lease, meta, negotiation, position)


def _back_unrejoined(
    source: psycopg2.extensions.connection, key: SessionKey, meta: writes.SinkMetadata, refused: Negotiation
) -> Negotiation:
    """A refusal across topology ids whose sink is the old source of a failover this source
    records (it was promoted, or reconciled, from it), back with the topology it had: said so, with
    the rejoin to run. Before, it said to apply the same topology on both sites, which ``lr topology
    apply`` refuses there until the rejoin."""
    if not refused.reason.startswith(MISMATCH):
        return refused
    with source.cursor() as cur:
        moved = {to for (old, _), (to, _) in sink_sessions.failed_over(cur).items() if old == key.sink}
    source.commit()
    if not moved:
        return refused
    return replace(
        refused,
        reason=refused.reason.removesuffix(APPLY_BOTH)
        + f": {key.sink} was failed over to {', '.join(sorted(moved))} and is back with the topology it had: rejoin "
        f"it with `lr failover --topology <the failover's file> --rejoin {key.sink}` (not a topology apply)",
    )


def negotiate_session(
    source: psycopg2.extensions.connection, key: SessionKey, lease: leases.Lease, owner: str, meta: writes.SinkMetadata
) -> Negotiation:
    """Both ends' views, read now, negotiated (``negotiation.negotiate``); an open request the sink
    already applied is closed first (``reconcile``)."""
    return _negotiate(source, key, lease, owner, meta)[0]


def _negotiate(
    source: psycopg2.extensions.connection, key: SessionKey, lease: leases.Lease, owner: str, meta: writes.SinkMetadata
) -> tuple[Negotiation, int]:
    """``negotiate_session``, and the position the source recorded for the session (-1: none), read
    in the same transaction (a cycle's handshake pays no round trip of its own for it)."""
    with source.cursor() as cur:
        topology_id = config_id(cur)
        cur.execute("SELECT trim_mark FROM lr.log_trim")
        trim_mark = cur.fetchone()[0]
        acked = source_sessions.acked_position(cur, key.sink, key.client)
    source.commit()
    request = full_sync.open_request(source, key.sink, key.client)
    if request is not None and reconcile(source, key, lease, owner, meta, request):
        request, acked = None, meta.last_log_entry_processed  # recorded with the request's close
    forced = bool(request and request.forced and request.request_id != meta.snapshot_request_id)
    negotiation = negotiate(
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
    return negotiation, acked


def resnapshot_tables(
    sink: psycopg2.extensions.connection,
    source: psycopg2.extensions.connection,
    key: SessionKey,
    lease: leases.Lease,
    meta: writes.SinkMetadata,
) -> None:
    """A session the source never recorded a position for, whose sink resumes from its own: the
    source lost it and has it again (a topology dropped it, a later one added it back). While it
    had no such session, its federated tables' changes were captured for the other sinks only, so
    the sink's tables take new snapshots (their rows from this source replaced) before its
    log-entry sync carries them on. The source then records the sink's position: this runs once."""
    log.info(
        "session %s: new on the source, its sink at position %s: its tables take new snapshots",
        key,
        meta.last_log_entry_processed,
    )
    writes.forget_tables(sink, key.source, key.client, lease.epoch, _closed_whole(sink, source, key, meta))
    leases.update_session(source, lease, acked_position=meta.last_log_entry_processed)


def told_by_sink(
    found: TopologyDrift,
    sink: psycopg2.extensions.connection,
    key: SessionKey,
    source: psycopg2.extensions.connection | None = None,
) -> TopologyDrift:
    """A stale file's drift at the source, with what the sink knows: the topology it runs and
    whether the source's clients were failed over (its fence's note). An ``lr sync`` started before a
    failover, its file now older than the one every site runs, was told cycle after cycle to apply
    that file (``lr topology apply`` refuses it); now that the file predates the failover, and to
    use the file the failover wrote. The site the clients went to runs what the sink runs (the
    failover applied it to both) unless it is the sink itself. A sink running another topology
    than the file tells of every failover it or ``source`` knows (either may be a fenced sink of
    another client's): the sessions of a client not failed over were told to apply the file."""
    try:
        moved = _failed_over(sink)
        here = recorded_id(sink)
        others = _failed_over(source) if source is not None and here != found.topology.topology_config_id else {}
    except psycopg2.Error:  # told without it
        sink.rollback()
        if source is not None:
            source.rollback()
        return found
    if here == found.topology.topology_config_id:
        return replace(found, failed_over={site: to for site, to in moved.items() if site == key.source})
    moved = {**others, **moved}
    held = {**found.held, key.sink: here}
    for to in moved.values():
        held.setdefault(to, here)
    return replace(found, held=held, failed_over=moved)


def _failed_over(conn: psycopg2.extensions.connection) -> dict[str, str]:
    """The old sources of the failovers ``conn``'s site fenced as a sink -> where they went."""
    with conn.cursor() as cur:
        moved = {site: to for (site, _), (to, _) in sink_sessions.failed_over(cur).items()}
    conn.commit()
    return moved


def _closed_whole(
    sink: psycopg2.extensions.connection,
    source: psycopg2.extensions.connection,
    key: SessionKey,
    meta: writes.SinkMetadata,
) -> dict[str, int]:
    """The copies of tables the source closed that stay recorded at the sink through
    ``resnapshot_tables`` (a closed table takes no snapshot): those the close was noted on
    (``lr tables close`` told the sink while it was one) whose every change tagged for it the sink
    processed. Before, they were forgotten: ``lr status`` said the copy was closed before it had
    every change, and ``lr tables list`` that the sink held none."""
    whole = closed_tables.whole_copies(source, key.sink, key.client, meta.last_log_entry_processed, _EVERY)
    if not whole:
        return {}
    try:
        with sink.cursor() as cur:
            noted = closed_notes.closed_copies(cur, key.source, key.client)
    finally:
        sink.rollback()
    return {name: table_id for name, table_id in whole.items() if name in noted}


_EVERY = 2**63 - 1  # past every commit position (``whole_copies``' base: the whole log after the sink's)


def reconcile(
    source: psycopg2.extensions.connection,
    key: SessionKey,
    lease: leases.Lease,
    owner: str,
    meta: writes.SinkMetadata,
    request: FullSyncRequest | None,
) -> bool:
    """Close the source's open request when the sink's own metadata says it was applied: the
    crash window between the sink's apply and the source's record (docs/crash-windows.md).
    Left open, it would hold safe trim at its base forever and be taken for a resume later.
    Idempotent; True when it closed ``request``."""
    if request is None or request.status not in OPEN_STATUSES:  # closed already: its outcome stands
        return False
    if request.request_id != meta.snapshot_request_id or not applied(meta):
        return False
    log.info("session %s: full sync %s was applied on the sink; closing it on the source", key, request.request_id)
    record_applied(source, lease, owner, meta, note="closed from the sink's metadata (applied before a crash)")
    return True


def record_applied(
    source: psycopg2.extensions.connection, lease: leases.Lease, owner: str, meta: writes.SinkMetadata, note: str = ""
) -> None:
    """One source transaction: the session's new base and ack, and its request closed. (Two
    commits would open a window where the request is closed and the ack not yet recorded, and
    safe trim, held by neither, could remove what the sink needs next.)"""
    leases.update_session(
        source,
        lease,
        commit=False,
        state=SessionState.IN_LOG_ENTRY_SYNC,
        base_position=meta.snapshot_applied,
        acked_position=meta.last_log_entry_processed,
        attempts=0,
        last_error=None,
    )
    if meta.snapshot_request_id:  # who applied it: a DAG's step, a stream, `lr sync` (RequestOutcome)
        full_sync.finish_request(source, meta.snapshot_request_id, RequestStatus.APPLIED, note or f"applied by {owner}")
    else:
        source.commit()


def applied(meta: writes.SinkMetadata) -> bool:
    """The sink has applied its current full sync (and is consistent on it)."""
    return meta.snapshot_started >= 0 and meta.snapshot_applied == meta.snapshot_started and meta.data_consistent
