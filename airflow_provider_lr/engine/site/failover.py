"""Failover: one of a source's sinks becomes the source of some of its clients (issue 15, seed 001).

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
   those clients captured on B (``tables/handover``), and the failover recorded in ``lr.failovers``;
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

Each step commits on one site and is repeated safely: a re-run of the same failover resumes from
``lr.failovers`` on B and each sink's ``failover_note`` (docs/crash-windows.md rows 16-18).
A planned switchover (A reachable) first applies the new topology on A, so A's writers of K are
refused, and drains A's log into every sink of K, so the cut loses nothing.
"""
from __future__ import annotations

import json
import logging
import uuid
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import ConfigurationError, LRError, SiteUnreachableError, listing, one_line
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.sink.queue_rows import positions, repack, unpack
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.site.topology import apply_to_site
from airflow_provider_lr.engine.store.topology import Replication, Topology, recorded_id
from airflow_provider_lr.engine.db.topology_schema import Origin
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL, commit_barrier
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.engine.tables import handover, registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import (
    RECONCILING_SETTING,
    STREAM_LOG_ENTRIES,
    STREAM_TABLE_CHANGES,
    FailoverStatus,
    SessionKey,
    SessionState,
)
from airflow_provider_lr.proto import lr_pb2

log = logging.getLogger(__name__)

Connect = Callable[[str], psycopg2.extensions.connection]


@dataclass
class FailoverResult:
    """What a failover did; ``outcome`` says, per sink, what reconciling it did (per client)."""

    failover_id: str
    from_site: str
    to_site: str
    clients: list[str]
    positions: dict[str, int]  # client -> pB, the cut of the old source's stream
    base: int  # the promoted site's commit position its new sessions start after
    topology: Topology
    reason: str = ""
    planned: bool = False
    resumed: bool = False
    outcome: dict[str, dict[str, str]] = field(default_factory=dict)
    full_syncs: list[str] = field(default_factory=list)  # sessions sent to a full sync from the new source
    applied: list[str] = field(default_factory=list)  # sites that now have the new topology
    pending: list[str] = field(default_factory=list)  # reachable later: `lr failover --rejoin SITE`
    tail: dict[str, int] = field(default_factory=dict)  # planned: what the old source committed after the cut
    tables: dict[str, list[str]] = field(default_factory=dict)  # client -> federated tables the new source captures
    diverged: list[str] = field(default_factory=list)  # tables whose replication stops (allow_table_divergence)

    @property
    def lost(self) -> str:
        if self.planned:
            return (f"nothing: {self.from_site} was drained into every sink before the cut"
                    + (f" (but it committed {listing(self.tail)} after the switch)" if any(self.tail.values()) else ""))
        return (f"whatever {self.from_site} committed for {', '.join(self.clients)} after position(s) "
                f"{listing(self.positions)} that {self.to_site} had not received; `lr failover --rejoin {self.from_site}` "
                "counts it when it returns")


@dataclass
class RejoinResult:
    site: str
    failover_id: str
    topology_config_id: str
    retired: list[str]  # the site's sessions of the failed-over clients, removed
    tail: dict[str, int]  # client -> entries it committed after the cut that nobody received
    table_tail: dict[str, int] = field(default_factory=dict)  # client -> table change entries likewise (replaced)
    guarded: list[str] = field(default_factory=list)  # its tables of the clients, now refused to its writers


# --- the new topology -----------------------------------------------------------------------------
def derive(topology: Topology, from_site: str, to_site: str, clients: list[str] | None = None) -> tuple[Topology, list[str]]:
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
    doc = {**topology.document,
           "replication": [{"source": r.source, "sinks": list(r.sinks), "clients": list(r.clients)} for r in kept + new]}
    return topologies.from_document(doc, Origin(f"the topology after failing {from_site} over to {to_site}")), wanted


def only_source(topology: Topology, sink: str) -> str:
    """The one source ``sink`` receives from (the old source of a failover that names none)."""
    sources = sorted({k.source for k in topology.sessions() if k.sink == sink})
    if len(sources) != 1:
        raise ConfigurationError(f"site {sink!r} receives from {sources or 'no source'}; name the old source "
                                 "(--from, from_site)")
    return sources[0]


def _involved(topology: Topology, from_site: str, to_site: str, clients: list[str]) -> list[str]:
    """The other sinks of the failed-over clients: the new source's sinks, the old source aside."""
    return sorted({k.sink for k in topology.sessions(source=to_site) if k.client in clients and k.sink != from_site})


# --- promote ------------------------------------------------------------------------------------
def promote(from_site: str, to_site: str, connect: Connect, topology: Topology | None = None,
            clients: list[str] | None = None, reason: str = "", same_destinations: bool = False,
            planned: bool | None = None, allow_table_divergence: bool = False) -> FailoverResult:
    """Fail ``from_site``'s clients over to ``to_site`` (module docstring). ``topology``: the current
    one (default: the one applied to ``to_site``). ``planned``: drain ``from_site`` first (default:
    when it can be reached). Re-running the same failover finishes it. Refuses, with nothing done,
    when ``to_site`` or a sink involved cannot be reached, or when a federated table another sink
    takes from ``from_site`` is not synced at ``to_site`` (its replication would stop) unless
    ``allow_table_divergence``."""
    if topology is not None:
        topology.site(from_site), topology.site(to_site)  # an unknown site is refused before any connection
    conns: dict[str, psycopg2.extensions.connection] = {}
    try:
        new = _reach(connect, to_site, conns, "the site to promote")
        record = _record(new, from_site, FailoverStatus.PROMOTED) or _finished(new, from_site)
        if record is not None:
            target = topologies.from_document(record["topology"], Origin("the failover recorded on the promoted site"))
            wanted = list(record["clients"])
        else:
            current = topology or topologies.from_site(new)
            target, wanted = derive(current, from_site, to_site, clients)
        sinks = _involved(target, from_site, to_site, wanted)
        for sink in sinks:
            _reach(connect, sink, conns, f"a sink of {from_site!r} for {', '.join(wanted)}")
        old = _try(connect, from_site, conns)
        planned = (old is not None) if planned is None else planned
        if planned and old is None:
            raise SiteUnreachableError(f"site {from_site!r} cannot be reached: a planned switchover drains it first; "
                                       "nothing was done (leave out --planned for an unplanned failover)")
        tail: dict[str, int] = {}
        diverged = [] if record is not None else _untaken_tables(conns, from_site, to_site, sinks, wanted,
                                                                  allow_table_divergence)
        if record is None and planned:
            assert old is not None
            _drain(old, conns, from_site, [to_site, *sinks], wanted, target)
        if record is None:
            fid = str(uuid.uuid4())
            for site in [to_site, *sinks]:
                _fence(conns[site], from_site, to_site, fid, wanted)
            fault_point("failover_after_fence")
            record = _promote(new, from_site, to_site, fid, wanted, target, reason, planned, diverged)
            fault_point("failover_after_promote")
            resumed = False
        else:
            resumed = True
            planned = bool(record["outcome"].get("planned"))
        result = FailoverResult(record["failover_id"], from_site, to_site, wanted, dict(record["positions"]),
                                record["base_position"], target, record["reason"], planned, resumed,
                                tables=dict(record["outcome"].get("tables", {})),
                                diverged=diverged or list(record["outcome"].get("diverged", [])))
        result.outcome[to_site] = {c: "promoted: the new source" for c in wanted}
        for sink in sinks:
            result.outcome[sink] = _reconcile(conns[sink], new, sink, result, same_destinations)
            fault_point("failover_after_reconcile")
        result.full_syncs = [str(SessionKey(to_site, s, c)) for s, notes in result.outcome.items()
                             for c, note in notes.items() if "full sync" in note]
        for site in sorted(target.sites):
            conn = conns.get(site) or _try(connect, site, conns)
            if conn is None:
                result.pending.append(site)
            elif site == from_site:
                tail = rejoin_site(conn, site, record).tail
                result.applied.append(site)
            else:
                if recorded_id(conn) != target.topology_config_id:
                    apply_to_site(conn, target, site)
                result.applied.append(site)
        result.tail = tail
        _complete(new, result)
        return result
    finally:
        for conn in conns.values():
            if not conn.closed:
                conn.close()


def _reach(connect: Connect, site: str, conns: dict, role: str) -> psycopg2.extensions.connection:
    conn = _try(connect, site, conns)
    if conn is None:
        raise SiteUnreachableError(f"site {site!r} ({role}) cannot be reached: a failover needs the promoted site "
                                   "and every sink involved; nothing was done on this run (run it again when it is up)")
    return conn


def _untaken_tables(conns: dict, from_site: str, to_site: str, sinks: list[str], clients: list[str],
                    allowed: bool) -> list[str]:
    """The federated tables whose replication the failover would stop: taken from ``from_site`` by
    another sink but not synced at ``to_site``, which therefore cannot become their source. Refused
    (nothing done) unless ``allowed``; then returned, and ``lr status`` marks them diverged."""
    found = []
    for client in clients:
        held = {}
        for site in [to_site, *sinks]:
            with conns[site].cursor() as cur:
                held[site] = handover.held_from(cur, from_site, client)
            conns[site].commit()
        found += [f"{client}: {t}" for t in handover.missing(held.pop(to_site), held)]
    if found and not allowed:
        raise ConfigurationError(
            f"site {to_site!r} holds no synced copy of federated table(s) that other sinks take from {from_site!r}: "
            f"{'; '.join(found)}; promoting it would stop their replication; promote a site that holds them, or "
            "allow it (--allow-table-divergence: lr status then marks them DIVERGED); nothing was done")
    return found


def _try(connect: Connect, site: str, conns: dict) -> psycopg2.extensions.connection | None:
    if site in conns:
        return conns[site]
    try:
        conns[site] = connect(site)
    except (psycopg2.Error, SiteUnreachableError) as exc:
        log.info("site %s cannot be reached: %s", site, one_line(exc))
        return None
    return conns[site]


_RECORD_COLUMNS = ("failover_id", "from_site_id", "to_site_id", "clients", "positions", "base_position",
                   "topology", "reason", "status", "outcome")


def _record(conn: psycopg2.extensions.connection, from_site: str, status: str | None = None) -> dict | None:
    """The newest failover of ``from_site`` recorded on this site (with that ``status``)."""
    with conn.cursor() as cur:
        cur.execute(
            f"SELECT {', '.join(_RECORD_COLUMNS)} FROM lr.failovers WHERE from_site_id = %s "
            "AND (%s::text IS NULL OR status = %s) ORDER BY started_at DESC LIMIT 1",
            (from_site, status, status),
        )
        row = cur.fetchone()
    conn.commit()
    if row is None:
        return None
    record = dict(zip(_RECORD_COLUMNS, row))
    record["failover_id"] = str(record["failover_id"])
    return record


def _finished(conn: psycopg2.extensions.connection, from_site: str) -> dict | None:
    """The completed failover whose topology this site still runs: a re-run replays it (no-op)."""
    record = _record(conn, from_site, FailoverStatus.COMPLETED)
    if record is None:
        return None
    applied = topologies.from_document(record["topology"], Origin("the failover recorded on the promoted site"))
    return record if applied.topology_config_id == recorded_id(conn) else None


def failovers(conn: psycopg2.extensions.connection) -> list[dict]:
    """Every failover recorded on this site, newest first (``lr status``, the docs' history)."""
    with conn.cursor() as cur:
        cur.execute(f"SELECT {', '.join(_RECORD_COLUMNS)}, started_at, completed_at FROM lr.failovers "
                    "ORDER BY started_at DESC")
        rows = [dict(zip((*_RECORD_COLUMNS, "started_at", "completed_at"), r)) for r in cur.fetchall()]
    conn.commit()
    return rows


def _fence(conn: psycopg2.extensions.connection, from_site: str, to_site: str, fid: str, clients: list[str]) -> None:
    """Close the sink's sessions from the old source to every writer (a raised epoch alone would not
    do: a replicator that holds its source's lease moves its epoch past a sink's). Idempotent; a
    session already reconciled keeps its note."""
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE lr.sink_sessions SET failed_over_to = %s, failover_id = %s, lease_epoch = lease_epoch + 1, "
            "updated_at = now() WHERE source_site_id = %s AND client_name = ANY (%s) AND failover_note IS NULL",
            (to_site, fid, from_site, clients),
        )
    conn.commit()


def _promote(conn: psycopg2.extensions.connection, from_site: str, to_site: str, fid: str, clients: list[str],
             target: Topology, reason: str, planned: bool, diverged: list[str]) -> dict:
    """One transaction on the new source: the cut (pB per client, under the lock of its own session
    from the old source), the base, the new topology, its sessions in log-entry sync, the clients'
    federated tables it holds captured here (``handover.take_over``), the record."""
    try:
        with conn.cursor() as cur:
            cuts = {}
            for client in clients:
                cur.execute(
                    "SELECT last_log_entry_processed, data_consistent FROM lr.sink_sessions "
                    "WHERE source_site_id = %s AND client_name = %s FOR UPDATE", (from_site, client))
                row = cur.fetchone()
                if row is None or not row[1]:
                    raise ConfigurationError(
                        f"site {to_site!r} holds no consistent copy of {from_site!r}'s client {client!r} (no session, "
                        "or a full sync not applied); promote a sink that has one; nothing was promoted")
                cuts[client] = row[0]
                writes.discard_unapplied(cur, from_site, client)  # the old session applies and publishes no more
            cur.execute(LAST_DRAWN_POSITION_SQL)
            base = cur.fetchone()[0]
            apply_to_site(conn, target, to_site, commit=False)
            cur.execute(
                "UPDATE lr.source_sessions SET state = %s, base_position = %s, acked_position = %s, updated_at = now() "
                "WHERE client_name = ANY (%s) AND sink_site_id <> %s AND acked_position = -1",
                (SessionState.IN_LOG_ENTRY_SYNC, base, base, clients, from_site),
            )
            # its federated tables of the clients: captured here from now on (the topology gave them sinks)
            tables = {c: [str(t.table) for t in handover.take_over(cur, from_site, c)] for c in clients}
            cur.execute(
                "UPDATE lr.sink_sessions SET failed_over_to = %s, failover_id = %s, failover_note = %s, "
                "lease_epoch = lease_epoch + 1, updated_at = now() WHERE source_site_id = %s AND client_name = ANY (%s)",
                (to_site, fid, f"promoted: {to_site} is the new source (cut of {from_site}'s stream)", from_site, clients),
            )
            cur.execute(
                "INSERT INTO lr.failovers (failover_id, from_site_id, to_site_id, clients, positions, base_position, "
                "topology_config_id, topology, reason, outcome) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (fid, from_site, to_site, clients, json.dumps(cuts), base, target.topology_config_id,
                 json.dumps(target.document), reason, json.dumps({"planned": planned, "tables": tables, "diverged": diverged})),
            )
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    record = _record(conn, from_site, FailoverStatus.PROMOTED)
    assert record is not None
    return record


def _complete(conn: psycopg2.extensions.connection, result: FailoverResult) -> None:
    outcome = {"planned": result.planned, "sinks": result.outcome, "pending": result.pending, "tail": result.tail,
               "tables": result.tables, "diverged": result.diverged}
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE lr.failovers SET status = %s, outcome = %s, completed_at = coalesce(completed_at, now()) "
            "WHERE failover_id = %s",
            (FailoverStatus.COMPLETED, json.dumps(outcome), result.failover_id),
        )
    conn.commit()


# --- reconcile a sink -----------------------------------------------------------------------------
class _FullSync(Exception):
    """Reconciling a session by entries is impossible: why (the full sync request's reason)."""


def _reconcile(conn: psycopg2.extensions.connection, new: psycopg2.extensions.connection, sink: str,
               result: FailoverResult, same_destinations: bool) -> dict[str, str]:
    """One transaction on the sink: every failed-over client's session from the old source cut at
    pB (extras removed, or the gap copied), its session from the new source set at the base, the
    new topology. Where cutting is impossible a full sync from the new source is requested (on the
    new source, first) with the reason. What the old session holds unapplied (a full sync's rows,
    what Spark jobs staged) is dropped.
    Idempotent: a session reconciled before keeps its note."""
    old, to = result.from_site, result.to_site
    notes: dict[str, str] = {}
    federated = {client: registry.federated_tables(new, client) for client in result.clients}
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT set_config(%s, 'on', true)", (RECONCILING_SETTING,))
            for client in result.clients:
                cut = result.positions[client]
                cur.execute(
                    "SELECT last_log_entry_processed, data_consistent, snapshot_applied, failover_note, failover_id "
                    "FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s FOR UPDATE", (old, client))
                row = cur.fetchone()
                writes.discard_unapplied(cur, old, client)  # fenced: its unapplied sync and staged data never apply
                if row is None:
                    notes[client] = f"nothing of {old} held: first contact with {to} (full sync)"
                    continue
                last, consistent, applied, note, fid = row
                if note is not None and str(fid) == result.failover_id:
                    notes[client] = note
                    continue
                try:
                    if not consistent or applied > cut:
                        raise _FullSync(f"{sink} {'had not applied its full sync' if not consistent else f'applied a full sync at {applied}'} "
                                        f"from {old}, beyond {to}'s position {cut}")
                    if last > cut:
                        note = _remove_extras(cur, sink, result, client, cut)
                    elif last < cut:
                        note = _copy_gap(cur, new, sink, result, client, last, cut, same_destinations)
                    else:
                        note = f"at {to}'s position {cut}: nothing moved"
                    _start_at_base(cur, result, client)
                    position = cut
                except _FullSync as why:
                    reason = f"failover: {why}"
                    full_sync.request_full_sync(new, sink, client, reason=reason, forced=True)
                    note, position = f"full sync from {to} requested ({reason})", last
                tables = handover.follow(cur, old, to, client, federated[client])
                note += "".join(f"; table {name}: {what}" for name, what in tables.items())
                cur.execute(
                    "UPDATE lr.sink_sessions SET failed_over_to = %s, failover_id = %s, failover_note = %s, "
                    "last_log_entry_processed = %s, lease_epoch = lease_epoch + 1, updated_at = now() "
                    "WHERE source_site_id = %s AND client_name = %s",
                    (to, result.failover_id, note, position, old, client),
                )
                notes[client] = note
            apply_to_site(conn, result.topology, sink, commit=False)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return notes


def _consumed(cur: psycopg2.extensions.cursor, source: str, client: str) -> int:
    """The highest position of ``source``'s entries this site's applications consumed whole."""
    cur.execute("SELECT position FROM lr.receive_consumed WHERE source_site_id = %s AND client_name = %s",
                (source, client))
    row = cur.fetchone()
    return row[0] if row else -1


def _rows_after(cur: psycopg2.extensions.cursor, source: str, client: str, after: int) -> list[tuple]:
    """The visible rows of a session's queue that hold entries after ``after``: (seq, kind, count,
    delivered, entry id, each entry's position or None, entries)."""
    cur.execute(
        "SELECT seq, kind, entry_count, delivered, source_position, source_entry_id, message FROM lr.receive_queue "
        "WHERE source_site_id = %s AND client_name = %s AND visible AND source_position > %s ORDER BY seq",
        (source, client, after),
    )
    rows = []
    for seq, kind, count, delivered, position, entry_id, message in cur.fetchall():
        message = bytes(message)
        rows.append((seq, kind, count, delivered, entry_id, positions(count, message, position), unpack(count, message)))
    return rows


def _remove_extras(cur: psycopg2.extensions.cursor, sink: str, result: FailoverResult, client: str, cut: int) -> str:
    old, to = result.from_site, result.to_site
    consumed = _consumed(cur, old, client)
    if consumed > cut:
        raise _FullSync(f"{sink} had consumed entries of {old} beyond {to}'s position {cut} (up to {consumed})")
    rows, removed = _rows_after(cur, old, client, cut), 0
    plan = []
    for seq, kind, count, delivered, _, where, entries in rows:
        if kind != lr_pb2.LOG_ENTRY_SYNC:
            raise _FullSync(f"{sink} holds full-sync data of {old} beyond {to}'s position {cut}")
        if where is None:
            raise _FullSync(f"a receive-queue row of {sink} written before V0010 holds entries on both sides of "
                            f"{to}'s position {cut}")
        keep = bisect_right(where, cut)
        if delivered > keep:
            raise _FullSync(f"{sink} had consumed entries of {old} beyond {to}'s position {cut}")
        plan.append((seq, keep, where, entries))
    for seq, keep, where, entries in plan:
        removed += len(entries) - keep
        if keep == 0:
            cur.execute("DELETE FROM lr.receive_queue WHERE seq = %s", (seq,))
        else:
            cur.execute("UPDATE lr.receive_queue SET entry_count = %s, source_position = %s, message = %s WHERE seq = %s",
                        (keep, where[keep - 1], psycopg2.Binary(repack(entries[:keep], where[:keep])), seq))
    return f"{removed} extra entries of {old} beyond {to}'s position {cut} removed, unconsumed"


def _copy_gap(cur: psycopg2.extensions.cursor, new: psycopg2.extensions.connection, sink: str,
              result: FailoverResult, client: str, last: int, cut: int, same_destinations: bool) -> str:
    old, to = result.from_site, result.to_site
    if not same_destinations:
        raise _FullSync(f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to} cannot tell which of its own were "
                        f"addressed to {sink} (a sink's copy carries no destinations)")
    with new.cursor() as src:
        if _consumed(src, old, client) > last:
            new.commit()
            raise _FullSync(f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to}'s applications consumed some")
        rows = _rows_after(src, old, client, last)
    new.commit()
    gap = []
    for _, kind, count, delivered, entry_id, where, entries in rows:
        if kind != lr_pb2.LOG_ENTRY_SYNC or where is None:
            raise _FullSync(f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to} holds them only as a full sync "
                            "or in a row written before V0010")
        first = bisect_right(where, last)
        if delivered > first:
            raise _FullSync(f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to}'s applications consumed some")
        gap += [(kind, p, entry_id, e) for p, e in zip(where[first:], entries[first:]) if p <= cut]
    copy = writes.SinkTransaction(cur.connection, old, client, 0)
    copy.cur = cur  # this reconciling transaction: the session row is locked already
    copy.insert(gap)
    if gap:
        copy.announce()
    return f"{len(gap)} entries of {old} in ({last}, {cut}] copied from {to} (nothing it already held)"


def _start_at_base(cur: psycopg2.extensions.cursor, result: FailoverResult, client: str) -> None:
    """The sink's session from the new source, consistent at the base: log-entry sync from there."""
    base = result.base
    cur.execute(
        "INSERT INTO lr.sink_sessions (source_site_id, client_name, topology_config_id, snapshot_started, "
        "snapshot_transferred, snapshot_applied, last_log_entry_processed, data_consistent) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, true) ON CONFLICT (source_site_id, client_name) DO UPDATE SET "
        "topology_config_id = EXCLUDED.topology_config_id, snapshot_started = EXCLUDED.snapshot_started, "
        "snapshot_transferred = EXCLUDED.snapshot_transferred, snapshot_applied = EXCLUDED.snapshot_applied, "
        "last_log_entry_processed = EXCLUDED.last_log_entry_processed, data_consistent = true, "
        "snapshot_request_id = NULL, base_snapshot = NULL, base_upto = NULL, failed_over_to = NULL, "
        "failover_id = NULL, failover_note = NULL, updated_at = now()",
        (result.to_site, client, result.topology.topology_config_id, base, base, base, base),
    )


# --- planned: drain the old source first -----------------------------------------------------------
def _drain(old: psycopg2.extensions.connection, conns: dict, from_site: str, sinks: list[str], clients: list[str],
           target: Topology) -> None:
    """A planned switchover: the new topology on the old source first (its writers of the clients
    are refused from then on, its federated tables' writers too), then everything it committed for
    each sink (``sinks``, the site to promote first) copied into that sink (fenced sink
    transactions, as a session cycle writes them; table changes applied), so the cut loses nothing."""
    try:
        if recorded_id(old) != target.topology_config_id:
            apply_to_site(old, target, from_site, commit=False)
        with old.cursor() as cur:  # its tables' writers are refused from now on, as its routing-queue writers
            for client in clients:
                handover.retire(cur, client, sinks[0], None)
        old.commit()
    except BaseException:
        old.rollback()
        raise
    # Every sink is fenced before the barrier: a replicator still streaming from the old source could
    # otherwise deliver an entry committed after the barrier (by a writer whose client loaded its
    # routes before the switch) to a sink the drain had not fenced yet, leaving that sink ahead of
    # the others at the cut. (It cannot move past the fence: its source sessions are gone with the
    # new topology, so it holds no lease to raise its epoch with.)
    fenced: list[tuple[str, str, writes.SinkMetadata]] = []
    for sink in sinks:
        conn = conns[sink]
        for client in clients:
            meta = writes.read_metadata(conn, from_site, client)
            if not meta.data_consistent or meta.failed_over_to is not None:
                continue  # reconciled by the failover itself (a full sync, or done before)
            fenced.append((sink, client, writes.fence(conn, from_site, client, meta.lease_epoch + 1)))
    upto, holders = commit_barrier(old, 30.0)
    if upto is None:
        raise LRError(f"site {from_site!r}: commits in flight for 30 s ({', '.join(h.describe() for h in holders)}); "
                      "nothing was promoted; run the switchover again")
    for sink, client, meta in fenced:
        conn = conns[sink]
        reader, after = LogReader(old, sink, STREAM_LOG_ENTRIES, client_name=client), meta.last_log_entry_processed
        tables = table_snapshot.splits(conn, SessionKey(from_site, sink, client))  # their changes too
        while after < upto:
            with reader.read_stream(after, split=meta.split, tables=tables) as batch:
                if batch.end <= after:
                    break
                after = writes.apply_log_stream(conn, from_site, client, meta.lease_epoch, batch, meta.snapshot_applied)


# --- the old source's return ------------------------------------------------------------------------
def rejoin(site: str, connect: Connect, topology: Topology) -> RejoinResult:
    """The old source (or any site a failover could not reach) comes back: the newest failover
    recorded on a reachable site of ``topology`` gives the topology to apply; for the old source,
    its sessions of the failed-over clients are retired and its unreplicated tail is counted."""
    conns: dict[str, psycopg2.extensions.connection] = {}
    try:
        conn = _reach(connect, site, conns, "the site to rejoin")
        found: list[dict] = []
        for other in sorted(set(topology.sites) - {site}):
            peer = _try(connect, other, conns)
            if peer is not None:
                found += [r for r in failovers(peer) if r["to_site_id"] == other]
        if not found:
            raise ConfigurationError(f"no failover is recorded on any reachable site of the topology; nothing to rejoin "
                                     f"{site!r} to (apply a topology with `lr topology apply`)")
        newest = max(found, key=lambda r: r["started_at"])
        record = dict(newest, failover_id=str(newest["failover_id"]))
        return rejoin_site(conn, site, record)
    finally:
        for conn in conns.values():
            if not conn.closed:
                conn.close()


def rejoin_site(conn: psycopg2.extensions.connection, site: str, record: dict) -> RejoinResult:
    """Apply a failover's topology on ``site`` (one transaction); on its old source, first count what
    it committed for the clients after the cut (nobody received it: reported, not replicated)."""
    target = topologies.from_document(record["topology"], Origin("the failover recorded on the promoted site"))
    tail: dict[str, int] = {}
    table_tail: dict[str, int] = {}
    retired: list[str] = []
    guarded: list[str] = []
    try:
        with conn.cursor() as cur:
            if record["from_site_id"] == site:
                for client in record["clients"]:
                    cut = record["positions"][client]
                    cur.execute(
                        "SELECT count(*) FILTER (WHERE e.stream = %s), count(*) FILTER (WHERE e.stream = %s) "
                        "FROM lr.log_entries e JOIN lr.log_commits c ON c.tx = e.tx "
                        "JOIN lr.clients k ON k.client_id = e.client_id WHERE k.client_name = %s AND c.position > %s",
                        (STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES, client, cut))
                    tail[client], table_tail[client] = cur.fetchone()
                cur.execute("SELECT sink_site_id, client_name FROM lr.source_sessions WHERE client_name = ANY (%s) "
                            "ORDER BY 1, 2", (list(record["clients"]),))
                retired = [str(SessionKey(site, s, c)) for s, c in cur.fetchall()]
            apply_to_site(conn, target, site, commit=False)
            if record["from_site_id"] == site:  # a sink of its tables now: the new source's snapshot replaces them
                taken = record["outcome"].get("tables", {})
                for client in record["clients"]:
                    guarded += handover.retire(cur, client, record["to_site_id"], taken.get(client, []))
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return RejoinResult(site, record["failover_id"], target.topology_config_id, retired, tail, table_tail, guarded)
