"""Failover: one of a source's sinks becomes the source of some of its clients (after Qpid HA's failover).

Positions of the old source A's stream are A's commit positions. Every sink X of A for client K
holds A's entries for X up to its last processed position pX. The promoted sink B holds them up to
pB. A failover makes pB the cut of A's stream on every remaining sink (Qpid HA: "remove extras on
failover, and do not download what the backup already has"):

1. **fence**: every involved sink marks its session A->X/K failed over (``failed_over_to``); its
   sink transactions then refuse any writer of A, whatever its epoch (a partitioned A, not dead,
   stays harmless);
2. **promote** B, in one transaction on B: pB per client read under the lock of B's own A-session,
   B's last drawn commit position noted as the *base* of its new sessions, the new topology applied
   (B the source of K, A one of its sinks), the sessions B->X/K started in log-entry sync from that
   base (X already holds A's stream: no first-contact full sync), the federated tables B holds of
   those clients captured on B, their sequences moved past their rows so B's applications' inserts
   by default do not collide (``tables/handover``), and the failover recorded in ``lr.failovers``;
3. **reconcile** each other sink X, in one transaction on X: pX == pB: nothing moves; pX > pB:
   X's unconsumed entries beyond pB are removed (a packed row is cut at pB), or, when X's
   applications consumed some of them, a full sync from B is requested with the reason; pX < pB:
   the gap is copied from B's receive queue only when the operator says every entry of K was
   addressed to all its sinks (``same_destinations``; B's copy is stripped of destinations, so it
   cannot tell otherwise) and B still holds it unconsumed, else a full sync from B with the
   reason. Then X's session from B starts at the base, X's tables of those clients move to B (a
   table snapshot from B replaces A's rows at the next cycle: the cut of tables) and X gets the new
   topology;
4. the new topology is applied to every other reachable site. A, when it returns, refuses to
   negotiate (topology id mismatch) until ``rejoin``: the new topology there retires its sessions
   of K, what A committed for K after pB (received by nobody) is counted and reported, and A's
   tables of K stop being captured there (their writers are refused; B's snapshot replaces them).

A failover that would stop a federated table's replication (another sink takes it from A, B does
not hold it synced) is refused unless ``allow_table_divergence``; ``lr status`` marks such a table.

Each step commits on one site, durably (``db/durable_commits``), and is repeated safely: a re-run
resumes from ``lr.failovers`` on B and each sink's ``failover_note`` (crash-windows.md rows 16-18).
A planned switchover (A reachable) first applies the new topology on A, so A's writers of K are
refused, and drains A's log into every sink of K, so the cut loses nothing.

Here: the entry points (``promote``, ``rejoin``), the new topology, steps 1-2 and the drain. Step 3 is
``site/failover_reconcile``, step 4 on a returning site ``site/failover_rejoin``; the record in
``lr.failovers``, the results and the connections to the sites are ``site/failover_record``."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.db.durable_commits import durable
from airflow_provider_lr.engine.db.encoding import json_text, storable
from airflow_provider_lr.engine.db.topology_schema import Origin
from airflow_provider_lr.engine.errors import ConfigurationError, LRError, SiteUnreachableError, listing
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.site.failover_reconcile import reconcile
from airflow_provider_lr.engine.site.failover_record import (
    Connect,
    FailoverResult,
    asked_requests,
    complete,
    failovers,
    finished,
    keep_copy,
    moved_request,
    moving_requests,
    reach,
    read_record,
    refuse_unrejoined,
    try_connect,
)
from airflow_provider_lr.engine.site.failover_rejoin import RejoinResult, rejoin_site
from airflow_provider_lr.engine.site.topology import apply_to_site
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL, commit_barrier
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.engine.source.moved import refuse_moved_writers
from airflow_provider_lr.engine.store import sink_sessions, source_sessions
from airflow_provider_lr.engine.store import topology as topology_model
from airflow_provider_lr.engine.store.topology import Replication, Topology, recorded_id
from airflow_provider_lr.engine.tables import handover
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import (
    STREAM_LOG_ENTRIES,
    FailoverStatus,
    SessionKey,
    SessionState,
)

log = logging.getLogger(__name__)


# --- the new topology -----------------------------------------------------------------------------
def derive(
    topology: Topology, from_site: str, to_site: str, clients: list[str] | None = None
) -> tuple[Topology, list[str]]:
    """The topology after the failover: ``to_site`` becomes the source of ``from_site``'s clients
    (all those it is a sink of, by default); it leaves their sinks, ``from_site`` joins them.
    Refuses a site that is unknown or not a sink of ``from_site`` for those clients."""
    topology.site(from_site)
    topology.site(to_site)
    if from_site == to_site:
        raise ConfigurationError(f"cannot fail {from_site!r} over to itself")
    held = sorted({c for r in topology.replications if r.source == from_site and to_site in r.sinks for c in r.clients})
    wanted = sorted(set(clients)) if clients else held
    missing = [c for c in wanted if c not in held]
    if not wanted or missing:
        raise ConfigurationError(
            f"site {to_site!r} is not a sink of {from_site!r} for client(s) {missing or '(any)'}; it can take over "
            f"only clients it receives from {from_site!r}: {held or 'none'}"
        )
    kept: list[Replication] = []
    moved: dict[str, set[str]] = {}  # client -> the sinks of the new source
    for r in topology.replications:
        take = [c for c in r.clients if c in wanted] if r.source == from_site else []
        rest = [c for c in r.clients if c not in take]
        if rest:
            kept.append(Replication(r.source, r.sinks, tuple(rest)))
        for client in take:
            moved.setdefault(client, set()).update(set(r.sinks) - {to_site} | {from_site})
    groups: dict[tuple[str, ...], list[str]] = {}
    for client, sinks in sorted(moved.items()):
        groups.setdefault(tuple(sorted(sinks)), []).append(client)
    new = [Replication(to_site, sinks, tuple(cs)) for sinks, cs in groups.items()]
    doc = {
        **topology.document,
        "replication": [{"source": r.source, "sinks": list(r.sinks), "clients": list(r.clients)} for r in kept + new],
    }
    return topology_model.from_document(
        doc, Origin(f"the topology after failing {from_site} over to {to_site}")
    ), wanted


def only_source(topology: Topology, sink: str, clients: list[str] | None = None) -> str:
    """The one source sending ``sink`` ``clients`` (default: any): a failover's old source if unnamed."""
    topology.site(sink)
    sources = sorted({k.source for k in topology.sessions() if k.sink == sink and (not clients or k.client in clients)})
    if len(sources) == 1:
        return sources[0]
    of = f" {', '.join(clients)}" if clients else ""
    raise ConfigurationError(
        f"site {sink!r} receives{of} from {sources or 'no source'}; name the old source (--from, from_site)"
    )


def _involved(topology: Topology, from_site: str, to_site: str, clients: list[str]) -> list[str]:
    """The other sinks of the failed-over clients: the new source's sinks, the old source aside."""
    return sorted({k.sink for k in topology.sessions(source=to_site) if k.client in clients and k.sink != from_site})


# --- promote ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FailoverRequest:
    """What the operator asks of a failover (``lr failover --promote``, ``LRFailoverOperator``):
    ``to_site`` becomes the source of ``from_site``'s ``clients`` (default: all those it is a sink
    of). ``reason``: recorded with it. ``same_destinations``: every entry of those clients was
    addressed to all their sinks, so a sink behind the cut may be caught up from the promoted
    site's queue (``failover_reconcile``). ``planned``: drain ``from_site`` first (default: when it
    can be reached). ``allow_table_divergence``: go on though a federated table's replication stops."""

    from_site: str
    to_site: str
    clients: list[str] | None = None
    reason: str = ""
    same_destinations: bool = False
    planned: bool | None = None
    allow_table_divergence: bool = False


def promote(request: FailoverRequest, connect: Connect, topology: Topology | None = None) -> FailoverResult:
    """Carry out ``request`` (module docstring). ``topology``: the current one (default: the one
    applied to ``to_site``). Re-running the same failover finishes it. Refuses, with nothing done,
    when ``to_site`` or a sink involved cannot be reached, or when a federated table another sink
    takes from ``from_site`` is not synced at ``to_site`` (its replication would stop) unless
    ``allow_table_divergence``."""
    from_site, to_site = request.from_site, request.to_site
    vocabulary.checked_reason(request.reason)  # recorded with its full syncs, late: refused before anything
    if topology is not None:
        topology.site(from_site), topology.site(to_site)  # an unknown site is refused before any connection
    connect = durable(connect)  # a crash of a site right after it is told: it keeps what it was told
    conns: dict[str, psycopg2.extensions.connection] = {}
    try:
        new = reach(connect, to_site, conns, "the site to promote")
        record = read_record(new, from_site, FailoverStatus.PROMOTED) or finished(new, from_site)
        if record is not None:
            target = topology_model.from_document(
                record["topology"], Origin("the failover recorded on the promoted site")
            )
            wanted = list(record["clients"])
        else:
            current = topology or topology_model.from_site(new)
            target, wanted = derive(current, from_site, to_site, request.clients)
        sinks = _involved(target, from_site, to_site, wanted)
        for sink in sinks:
            reach(connect, sink, conns, f"a sink of {from_site!r} for {', '.join(wanted)}")
        old = try_connect(connect, from_site, conns)
        planned = (old is not None) if request.planned is None else request.planned
        if planned and old is None:
            raise SiteUnreachableError(
                f"site {from_site!r} cannot be reached: a planned switchover drains it first; "
                "nothing was done (leave out --planned for an unplanned failover)"
            )
        diverged = (
            []
            if record is not None
            else handover.untaken(conns, old, (from_site, to_site), sinks, wanted, request.allow_table_divergence)
        )
        if record is None:  # before anything changes: the drain and the fences cannot be undone
            _check_consistent(new, from_site, to_site, wanted)
            refuse_unrejoined(conns, to_site, sinks, wanted, target)
        # full syncs the operator asked of the old source for a sink: its new topology cancels them
        asked = asked_requests(old, sinks, wanted, None if record is None else to_site) if old is not None else {}
        if record is None and planned:
            assert old is not None
            _drain(old, conns, from_site, [to_site, *sinks], wanted, target, request.allow_table_divergence)
        if record is None:
            fid = str(uuid.uuid4())
            for site in [to_site, *sinks]:
                _fence(conns[site], from_site, to_site, fid, wanted)
            fault_point("failover_after_fence")
            record = _promote(new, request, _Plan(fid, wanted, target, planned, diverged))
            fault_point("failover_after_promote")
            resumed = False
        else:
            resumed = True
            planned = bool(record["outcome"].get("planned"))
        result = FailoverResult(
            record["failover_id"],
            from_site,
            to_site,
            wanted,
            dict(record["positions"]),
            record["base_position"],
            target,
            record["reason"],
            planned,
            resumed,
            tables=dict(record["outcome"].get("tables", {})),
            diverged=diverged or list(record["outcome"].get("diverged", [])),
        )
        result.outcome[to_site] = {c: "promoted: the new source" for c in wanted}
        for sink in sinks:
            result.outcome[sink] = reconcile(conns[sink], new, sink, result, request.same_destinations)
            keep_copy(conns[sink], new, result.failover_id)  # the old source's rejoin, should this site be lost
            for client, note in result.outcome[sink].items():
                if (sink, client) in asked and "full sync" not in note:
                    reason = f"asked of {from_site} before the failover: {asked[sink, client].reason or 'no reason'}"
                    full_sync.request_full_sync(new, sink, client, reason=reason, forced=True)
                    result.outcome[sink][client] = f"{note}; full sync from {to_site} requested ({reason})"
                if (sink, client) in asked and old is not None:  # who waits for it follows it there
                    moved_request(old, asked[sink, client].request_id, new, to_site, sink, client)
            fault_point("failover_after_reconcile")
        result.full_syncs = [
            str(SessionKey(to_site, s, c))
            for s, notes in result.outcome.items()
            for c, note in notes.items()
            if "full sync" in note
        ]
        for site in sorted(target.sites):
            conn = conns.get(site) or try_connect(connect, site, conns)
            if conn is None:
                result.pending.append(site)
            elif site == from_site:
                try:
                    back = rejoin_site(conn, site, record)
                    result.tail, result.table_tail = back.tail, back.table_tail
                except handover.TableBusyError as exc:  # the failover stands; the old source rejoins later
                    result.pending.append(site)
                    result.busy[site] = str(exc)
                    continue
                result.applied.append(site)
            else:
                if recorded_id(conn) != target.topology_config_id:
                    apply_to_site(conn, target, site)
                else:  # a re-run finishing a failover: the guard may not have been set
                    refuse_moved_writers(conn)
                result.applied.append(site)
        complete(new, result)
        return result
    finally:
        for conn in conns.values():
            if not conn.closed:
                conn.close()


def _fence(conn: psycopg2.extensions.connection, from_site: str, to_site: str, fid: str, clients: list[str]) -> None:
    """Close the sink's sessions from the old source to every writer (a raised epoch alone would not
    do: a replicator that holds its source's lease moves its epoch past a sink's). Idempotent; a
    session already reconciled keeps its note."""
    with conn.cursor() as cur:
        sink_sessions.fence_failed_over(cur, from_site, to_site, fid, clients)
    conn.commit()


@dataclass(frozen=True)
class _Plan:
    """What a first run of a failover settled before promoting: its id, the clients it moves, the
    topology after it, whether the old source was drained, the tables whose replication stops."""

    failover_id: str
    clients: list[str]
    target: Topology
    planned: bool
    diverged: list[str]


def _promote(conn: psycopg2.extensions.connection, request: FailoverRequest, plan: _Plan) -> dict:
    """One transaction on the new source: the cut (pB per client, under the lock of its own session
    from the old source), the base, the new topology, its sessions in log-entry sync, the clients'
    federated tables it holds captured here with their sequences past their rows (``handover.take_over``),
    the record."""
    from_site, to_site = request.from_site, request.to_site
    fid, clients, target = plan.failover_id, plan.clients, plan.target
    try:
        with conn.cursor() as cur:
            cuts = {}
            for client in clients:
                cuts[client] = _consistent_cut(cur, from_site, to_site, client)
                writes.discard_unapplied(cur, from_site, client)  # the old session applies and publishes no more
            cur.execute(LAST_DRAWN_POSITION_SQL)
            base = cur.fetchone()[0]
            apply_to_site(conn, target, to_site, commit=False)
            # the new source's sessions in log-entry sync from the base
            source_sessions.start_unstarted(cur, clients, from_site, SessionState.IN_LOG_ENTRY_SYNC, base)
            # its federated tables of the clients: captured here from now on (the topology gave them sinks)
            tables = {c: [str(t.table) for t in handover.take_over(cur, from_site, c)] for c in clients}
            note = f"promoted: {to_site} is the new source (cut of {from_site}'s stream)"
            sink_sessions.close_promoted(cur, from_site, to_site, fid, note, clients)
            cur.execute(
                "INSERT INTO lr.failovers (failover_id, from_site_id, to_site_id, clients, positions, base_position, "
                "topology_config_id, topology, reason, outcome) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    fid,
                    from_site,
                    to_site,
                    clients,
                    json.dumps(cuts),
                    base,
                    target.topology_config_id,
                    json.dumps(target.document),
                    storable(conn, request.reason),
                    json_text({"planned": plan.planned, "tables": tables, "diverged": plan.diverged}),
                ),
            )
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    refuse_moved_writers(conn)  # a fail-back: the clients are this site's again
    record = read_record(conn, from_site, FailoverStatus.PROMOTED)
    assert record is not None
    return record


def _consistent_cut(cur: psycopg2.extensions.cursor, from_site: str, to_site: str, client: str) -> int:
    """The promoted site's position in ``from_site``'s stream of ``client``, its row locked; refused
    when it holds no consistent copy (no session, or its full sync not applied)."""
    row = sink_sessions.lock_cut(cur, from_site, client)
    if row is None or not row[1]:
        raise ConfigurationError(
            f"site {to_site!r} holds no consistent copy of {from_site!r}'s client {client!r} (no session, "
            "or a full sync not applied); promote a sink that has one; nothing was promoted"
        )
    return row[0]


def _check_consistent(conn: psycopg2.extensions.connection, from_site: str, to_site: str, clients: list[str]) -> None:
    """``_consistent_cut`` for every client, first: a refusal after a switchover's drain (the old
    source's writers refused, its sessions gone) or after the fences (every sink refusing the old
    source) said "nothing was promoted" and left nothing replicating. ``_promote`` checks again."""
    try:
        with conn.cursor() as cur:
            for client in clients:
                _consistent_cut(cur, from_site, to_site, client)
    finally:
        conn.rollback()


# --- planned: drain the old source first -----------------------------------------------------------
def _drain(
    old: psycopg2.extensions.connection,
    conns: dict,
    from_site: str,
    sinks: list[str],
    clients: list[str],
    target: Topology,
    allowed: bool,
) -> None:
    """A planned switchover: the new topology on the old source first (its writers of the clients
    are refused from then on, its federated tables' writers too), then everything it committed for
    each sink (``sinks``, the site to promote first) copied into that sink (fenced sink
    transactions, as a session cycle writes them; table changes applied), so the cut loses nothing.
    ``allowed``: a table the new source cannot carry may diverge."""
    try:
        with old.cursor() as cur:  # locked until the commit, which removes them: no lease is taken above these
            granted = source_sessions.lock_epochs(cur, clients)
            # a table being opened at the old source (lr tables open) commits before this, or is refused after
            cur.execute("SELECT 1 FROM lr.clients WHERE client_name = ANY(%s) FOR NO KEY UPDATE", (clients,))
            moving_requests(cur, sinks[0], sinks[1:], clients)  # with the topology that cancels them
        if recorded_id(old) != target.topology_config_id:
            apply_to_site(old, target, from_site, commit=False)
        with old.cursor() as cur:  # its tables' writers are refused from now on, as its routing-queue writers
            for client in clients:
                guarded = handover.retire(cur, client, sinks[0], None)
                handover.carried(conns[sinks[0]], from_site, client, guarded, allowed)
        old.commit()
    except BaseException:
        old.rollback()
        raise
    refuse_moved_writers(old)  # its routing-queue writers of the clients with routes loaded before, too
    # Every sink is fenced before the barrier: a replicator still streaming from the old source could
    # otherwise deliver an entry committed after the barrier (by a writer whose client loaded its
    # routes before the switch) to a sink the drain had not fenced yet, leaving that sink ahead of
    # the others at the cut. The fence is above every epoch the old source granted, not only above
    # the sink's: a replicator that took its lease just before the switch and has not written to this
    # sink yet holds an epoch the sink has not seen. (It cannot move past the fence: its source sessions
    # are gone with the new topology, so it holds no lease to raise its epoch with.)
    fenced: list[tuple[str, str, writes.SinkMetadata]] = []
    for sink in sinks:
        conn = conns[sink]
        for client in clients:
            meta = writes.read_metadata(conn, from_site, client)
            if not meta.data_consistent or meta.failed_over_to is not None:
                continue  # reconciled by the failover itself (a full sync, or done before)
            epoch = max(meta.lease_epoch, granted.get((sink, client), 0)) + 1
            fenced.append((sink, client, writes.fence(conn, from_site, client, epoch)))
    upto, holders = commit_barrier(old, 30.0)
    if upto is None:
        raise LRError(
            f"site {from_site!r}: commits in flight for 30 s ({', '.join(h.describe() for h in holders)}); "
            "nothing was promoted; run the switchover again"
        )
    for sink, client, meta in fenced:
        conn = conns[sink]
        reader, after = LogReader(old, sink, STREAM_LOG_ENTRIES, client_name=client), meta.last_log_entry_processed
        tables = table_snapshot.splits(conn, SessionKey(from_site, sink, client))  # their changes too
        while after < upto:
            with reader.read_stream(after, split=meta.split, tables=tables, until=upto) as batch:
                if batch.end <= after:
                    break
                after = writes.apply_log_stream(conn, from_site, client, meta.lease_epoch, batch, meta.snapshot_applied)


# --- the old source's return ------------------------------------------------------------------------
def named_by(found: list[dict], running: set[str]) -> dict:
    """The failover a rejoin applies: the one whose topology the other reachable sites run (the
    failover applied it there), whatever the sites' clocks say; else the newest by when it was
    recorded, each record stamped by the clock of the site it promoted. Before, always the latter:
    a promoted site whose clock ran ahead made its older failover look newer, and the rejoin applied
    that older topology, making the returning site a source again beside the new one."""
    named = [r for r in found if r.get("topology_config_id") in running]
    return max(named or found, key=lambda r: r["started_at"])


def rejoin(site: str, connect: Connect, topology: Topology) -> RejoinResult:
    """The old source (or any site a failover could not reach) comes back: the newest failover
    recorded on a reachable site of ``topology`` gives the topology to apply; for the old source,
    its sessions of the failed-over clients are retired and its unreplicated tail is counted."""
    connect = durable(connect)
    conns: dict[str, psycopg2.extensions.connection] = {}
    try:
        conn = reach(connect, site, conns, "the site to rejoin")
        found: list[dict] = []
        unreached, promoted, running = [], set(), set()  # running: the topologies the other sites run
        for other in sorted(set(topology.sites) - {site}):
            peer = try_connect(connect, other, conns)
            if peer is None:
                unreached.append(other)
                continue
            found += failovers(peer)  # its own, or copies of the failovers that reconciled it
            running.add(recorded_id(peer) or "")
            with peer.cursor() as cur:  # a sink of the site records where its clients went
                promoted |= {to for (source, _), (to, _) in sink_sessions.failed_over(cur).items() if source == site}
            peer.commit()
        if not found and unreached:  # the record is on the site the failover promoted
            went = (
                f"; its clients were failed over to {listing(sorted(promoted))}, which keeps the record"
                if promoted
                else ""
            )
            raise SiteUnreachableError(
                f"no failover is recorded on a reachable site of the topology, and {listing(unreached)} cannot be "
                f"reached{went}: nothing was done; run the rejoin of {site!r} again once it is up"
            )
        if not found:
            raise ConfigurationError(
                f"no failover is recorded on any reachable site of the topology; nothing to rejoin "
                f"{site!r} to (apply a topology with `lr topology apply`)"
            )
        newest = named_by(found, running)
        record = dict(newest, failover_id=str(newest["failover_id"]))
        return rejoin_site(conn, site, record)
    finally:
        for conn in conns.values():
            if not conn.closed:
                conn.close()
