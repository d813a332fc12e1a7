"""What a source still has to deliver, and whether its sinks are *ready* (Qpid HA's word): the
backlog the catch-up decision, the session cycles, the stream and the sensors count, and the
readiness the public client (``RoutingQueueClient.wait_until_ready``) and ``lr status`` report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.errors import SHOWN_VALUES, ConfigurationError, DeliveryTimeout, TransmitError, listing
from airflow_provider_lr.engine.source import delivery
from airflow_provider_lr.engine.source.log_reader import commit_barrier
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import Topology
from airflow_provider_lr.engine.vocabulary import SessionState


# --- work waiting on a source (Airflow's sensors and the replication plan) ---------------------
@dataclass(frozen=True)
class SessionBacklog:
    """What a session of this source still has to deliver."""

    sink: str
    client: str
    state: str
    acked: int  # the position its sink acknowledged
    entries: int  # log entries committed for the session after that position
    highest: int  # the highest commit position among them, -1 without any
    lag_seconds: float = 0.0  # age of the oldest of them (0 without any)
    first_guarded: int | None = None  # the lowest position a producer waits on for this sink
    before_guard: int = 0  # of ``entries``, those before it (all of them without a guard)


def session_backlogs(
    conn: psycopg2.extensions.connection, sink: str | None = None, client: str | None = None, at_most: int | None = None
) -> list[SessionBacklog]:
    """Per session of this source (optionally one sink and/or client): entries still to deliver.
    The one place that says what "remaining" means: committed, in LRQ_Send_LogEntries (or a
    federated table's change), tagged for the sink, of the session's client, after the sink's
    acknowledged position. ``at_most``: stop counting a session there (its oldest entries, so
    ``lag_seconds`` holds; ``highest`` is then the highest counted) — a decision against a threshold
    need not count a backlog of millions."""
    with conn.cursor() as cur:
        rows = [SessionBacklog(*row) for row in source_sessions.backlog_rows(cur, sink, client, at_most)]
    conn.commit()
    return rows


def log_entry_backlog(backlogs: list[SessionBacklog]) -> int:
    """Entries still to deliver, summed over the sessions in log-entry sync (what decides between
    an in-process batch and a Spark fan-out)."""
    return sum(b.entries for b in backlogs if b.state == SessionState.IN_LOG_ENTRY_SYNC)


def source_backlog(conn: psycopg2.extensions.connection, at_most: int | None = None) -> int:
    """The source's log-entry backlog (``at_most``: each session counted up to there; the sum is
    then at least ``at_most`` whenever one session's backlog is)."""
    return log_entry_backlog(session_backlogs(conn, at_most=at_most))


def pending_entries(conn: psycopg2.extensions.connection, sink: str, client: str) -> tuple[int, int]:
    """(count, highest position) of committed entries for the session after what its sink
    acknowledged; (0, -1) when there are none (or no such session)."""
    found = session_backlogs(conn, sink, client)
    return (found[0].entries, found[0].highest) if found else (0, -1)


# --- readiness (Qpid HA: a destination is *ready*; the guards are engine/source/delivery's) --------
@dataclass(frozen=True)
class Readiness:
    """A destination's readiness for one client: everything committed for it before
    ``first_guarded`` (or everything committed, without a guard) is safe when ``unsafe`` is 0."""

    sink: str
    client: str
    acked: int
    first_guarded: int | None
    unsafe: int  # committed entries for the sink after ``acked`` (and before the first guard)
    tables_unsettled: bool = False  # a table the client federates here whose snapshot the sink has yet to take

    @property
    def ready(self) -> bool:
        return self.unsafe == 0 and not self.tables_unsettled


def readiness_of(
    conn: psycopg2.extensions.connection, client: str, sinks: Sequence[str] | None = None
) -> list[Readiness]:
    """Each (named) sink's readiness for ``client``, counted live."""
    found = [b for b in session_backlogs(conn, client=client) if sinks is None or b.sink in sinks]
    with conn.cursor() as cur:  # a table opened while a stream ran: its rows are the sink's after its snapshot
        unsettled = source_sessions.tables_unsettled(cur, client)
    conn.commit()
    return [Readiness(b.sink, client, b.acked, b.first_guarded, b.before_guard, b.sink in unsettled) for b in found]


def wait_until_ready(
    conn: psycopg2.extensions.connection, client: str, destinations: Sequence[str], timeout: float = 30.0
) -> list[Readiness]:
    """Return once every destination holds, safe, everything committed for ``client`` before this
    call (a guard at the next position: Qpid's *ready*), or raise ``DeliveryTimeout``. Refused
    inside a transaction (it commits as it goes: it committed the caller's work, which the caller
    then could not roll back), as a ticket's wait is."""
    if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
        raise TransmitError(
            f"client {client!r}: commit (or roll back) the transaction before waiting until destinations are "
            "ready (lr never commits for you); nothing was done"
        )
    destinations = delivery.check_targets(destinations)
    delivery.check_timeout(timeout)
    if not destinations:
        raise ConfigurationError("name the destinations to wait for")
    known = {b.sink for b in session_backlogs(conn, client=client)}
    unknown = sorted(set(destinations) - known)
    if unknown:
        raise ConfigurationError(
            f"{listing(unknown, SHOWN_VALUES)}: not sinks of client {client!r} at this site; its sinks are {listing(sorted(known))}"
        )
    noted, holders = commit_barrier(conn, timeout=timeout)
    if noted is None:
        raise DeliveryTimeout(
            f"commits in flight outlasted {timeout:g}s: {listing(h.describe() for h in holders)}",
            position=None,
            missing=sorted(destinations),
            regions=[],
        )
    guard = delivery.add_guard(conn, client, noted + 1, destinations, timeout)
    try:
        last: list[list[Readiness]] = []

        def check() -> bool:
            last[:] = [readiness_of(conn, client, destinations)]
            return all(r.ready for r in last[0])

        if delivery.poll(check, timeout):
            return last[0]
        behind = {
            r.sink: f"{r.unsafe}{', a table snapshot' if r.tables_unsettled else ''}" for r in last[0] if not r.ready
        }
        raise DeliveryTimeout(
            f"client {client!r}: not ready after {timeout:g}s: entries before position {noted + 1} "
            f"not yet acknowledged (or a federated table's snapshot to take), per sink {listing(behind)}",
            position=noted,
            missing=sorted(behind),
            regions=[],
        )
    finally:
        delivery.remove_guard(conn, guard)


# --- what a delivery wait may ask for (the `delivered` sensor) ---------------------------------
@dataclass(frozen=True)
class DeliveryTarget:
    """What a caller of the topology may wait for (checked before any site is read); whether an
    entry meets it is ``engine.source.delivery``'s rule, against the sinks the entry named."""

    source: str
    client: str
    destinations: tuple[str, ...]  # must all have it (may be empty)
    min_regions: int = 0


def delivery_target(
    topology: Topology, source: str, client: str, destinations: list[str] | tuple[str, ...] = (), min_regions: int = 0
) -> DeliveryTarget:
    """Validate what a caller waits for. Refused (DistributedLog's minRegionsForDurability): a
    destination that is not a sink of the source for this client, and a ``min_regions`` that the
    sinks could never reach — or, with named destinations, one their acknowledgements could be
    complete without (all of them acking must prove durability in ``min_regions`` regions)."""
    destinations = delivery.check_targets(destinations, min_regions)
    sinks = {k.sink for k in topology.sessions(source=source) if k.client == client}
    if not sinks:
        raise ConfigurationError(f"site {source!r} replicates nothing for client {client!r} in the topology")
    unknown = sorted(set(destinations) - sinks)
    if unknown:
        raise ConfigurationError(
            f"{listing(unknown, SHOWN_VALUES)}: not sinks of {source!r} for client {client!r}; its sinks are {listing(sorted(sinks))}"
        )
    regions = {topology.site(source).region, *(topology.site(s).region for s in (destinations or sinks))}
    if min_regions > len(regions):
        named = (
            f"the named destinations {listing(sorted(destinations))}"
            if destinations
            else f"the sinks {listing(sorted(sinks))}"
        )
        raise ConfigurationError(
            f"min_regions={min_regions} can never be met: {source!r} and {named} span only {len(regions)} "
            f"region(s) {listing(sorted(regions))}; name destinations in more regions or lower min_regions"
        )
    return DeliveryTarget(source, client, tuple(sorted(destinations)), min_regions)


# --- a session row of `lr status` -----------------------------------------------------------------
def readiness(session: dict, trim_mark: int | None = None) -> str:
    """Whether a session's sink holds everything committed for it so far (Qpid HA's *ready*):
    ``ready`` / ``consistent``, ``catching up`` or ``not ready`` (why). What is compared:

    * source side: in log-entry sync, the sink's acknowledged position is not behind this site's
      trim mark, and no committed entry for the sink lies after it (``remaining``, counted live);
    * both sides: the sink synced every table the source federates for the client (``tables_lacking``,
      set by ``lr status``, which reads both);
    * sink side: the sink applied its full sync (``data_consistent``) *and* its last processed
      position is not behind the source's trim mark (``trim_mark``: the source's, None when the
      source was not reached — then "consistent" is not claimed). Behind the trim mark, entries it
      needs are gone: only a new full sync makes it consistent again.

    A session with a forced full sync open at its source (``full_sync_requested``: set by
    ``lr status`` on the source's row, and on the sink's when it read both) is not ready until it is
    applied: its sink takes no log entry meanwhile and its copy is replaced. Before, a sink was
    called ``consistent`` and its source ``ready`` while the request waited."""
    position = session["last_applied_position"]
    if session["role"] == "source" and session.get("sink_position") is not None:  # the sink's own, read
        position = max(-1 if position is None else position, session["sink_position"])  # with it: the ack trails
    behind = trim_mark is not None and position is not None and position < trim_mark
    synced = (
        session["data_consistent"] if session["role"] == "sink" else session["state"] == SessionState.IN_LOG_ENTRY_SYNC
    )
    if session.get("last_error") and not (behind and synced and not session.get("failed_over_to")):
        return "not ready (error)"  # behind the trim mark says more: a full sync is due, whatever failed
    if session.get("failed_over_to"):  # its data stops at the failover's cut: nothing more comes this way
        return f"failed over to {session['failed_over_to']}"
    if session.get("full_sync_requested") and synced:  # lr full-sync asked; its stream is (about to be) handed back
        return "not ready (full sync requested)"
    if session["role"] == "sink":
        if not session["data_consistent"]:
            return "not ready (snapshot)"
        if trim_mark is None:
            return "unchecked (source not reached)"
        if behind:
            return "not ready (behind trim)"
        # a federated table's snapshot still to come (``lr status`` reads both sites and notes it)
        return "not ready (table snapshot)" if session.get("tables_lacking") else "consistent"
    if session["state"] != SessionState.IN_LOG_ENTRY_SYNC:
        return "not ready (snapshot)" if session["sync_type"] == "SNAPSHOT" else "not ready (not started)"
    if behind:
        return "not ready (behind trim)"
    if session.get("tables_lacking"):
        return "not ready (table snapshot)"
    guard = session.get("first_guarded")
    if guard is not None:  # Qpid's ready: everything before the first guarded position is safe
        unsafe = session.get("unsafe_before_guard") or 0
        return "ready" if unsafe == 0 else f"catching up ({unsafe} before guard {guard})"
    remaining = session["remaining_entries_to_send"] or 0
    return "ready" if remaining == 0 else f"catching up ({remaining} to send)"
