"""Operations on the topology across sites: recording it on every site at once, checking which
sites run the file in hand (drift), and pruning the sessions it no longer has.

The model itself (``Topology``, its document, ``load``) and every read of ``lr.topology`` are
``engine/store/topology.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from datetime import datetime

import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine.db.local_settings import catalog_path
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.errors import ConfigurationError, InputError, LRError, TopologyMismatchError, one_line
from airflow_provider_lr.engine.source.moved import refuse_moved_writers
from airflow_provider_lr.engine.store import receive_queue, sink_sessions, source_sessions
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.store.topology import Topology, TopologyDrift, drift, recorded_id
from airflow_provider_lr.engine.vocabulary import OPEN_STATUSES_SQL, RequestStatus, SessionKey, receive_queue_name


def provider_warnings(topology: Topology) -> list[str]:
    """What makes a client's sessions wait for full-sync data forever, said where a topology is
    checked (``lr topology validate`` and ``apply``): a provider that cannot be imported here, or
    none at all (then only an application serving the requests lets a full sync finish; a client
    with a federated table gets full syncs of its tables alone, payloads left out)."""
    from airflow_provider_lr.engine.source.full_sync import load_provider

    found = []
    for client in sorted({key.client for key in topology.sessions()}):
        target = topology.providers.get(client)
        if target is None:
            found.append(
                f"client {client!r} has no full-sync provider: unless its application serves the "
                "requests (RoutingQueueClient.serve_full_sync_requests), its sessions wait for client "
                "data forever; once it has a federated table, lr supplies each full sync itself with "
                "the tables and no payload (a sink's state built from its payloads is not sent again); "
                "name one under providers:"
            )
            continue
        try:
            load_provider(target)
        except LRError as exc:
            found.append(f"client {client!r}: {one_line(exc)}; until it can, its sessions wait for client data")
    return found


def connection_warnings(topology: Topology) -> list[str]:
    """The sites whose connection cannot be resolved here (no ``AIRFLOW_CONN_<ID>``, not in the
    connections file, or one that does not parse or libpq never takes), said by ``lr topology validate``: it called a file
    with a mistyped ``conn_id`` valid, and the mistake came out only at ``apply`` or ``lr sync``. A
    warning, not a refusal: Airflow workers may hold the connection where this shell does not."""
    found = []
    for site_id in sorted(topology.sites):
        try:
            topologies.site_conninfo(topology, site_id).check()
        except ConfigurationError as exc:
            found.append(f"site {site_id!r}: {one_line(exc)}; lr commands run here cannot reach it")
    return found


def recorded_ids(
    topology: Topology, connect: Callable[[str], psycopg2.extensions.connection], sites: Collection[str] | None = None
) -> dict[str, str | None]:
    """The topology id each of ``sites`` (default: all of the topology's) holds, for those that can
    be reached and read (the command itself reports the others)."""
    found: dict[str, str | None] = {}
    for site_id in sorted(topology.sites if sites is None else sites):
        try:
            conn = connect(site_id)
        except (psycopg2.Error, LRError):
            continue
        try:
            found[site_id] = recorded_id(conn)
        except psycopg2.Error:
            pass
        finally:
            conn.close()
    return found


def runs_somewhere(topology: Topology, connect: Callable[[str], psycopg2.extensions.connection]) -> bool:
    """Whether some reachable site of ``topology`` runs it (or none can be read): the start's rule
    (``topologies.unheld``), which a running ``lr sync`` waits for before it follows an edit of its
    file. It followed at once: between the edit and ``lr topology apply`` every session was refused
    and the stale-file check stopped the run."""
    return topologies.unheld(topology, recorded_ids(topology, connect)) is None


def failed_over_sources(topology: Topology, connect: Callable[[str], psycopg2.extensions.connection]) -> dict[str, str]:
    """Old source -> the site its clients now come from, as the reachable sites of ``topology`` say
    (``newest_moves``): what a drift's message needs to name a failover (read only once a drift was
    found). Before, one pair per old source, whichever site was read last: after chained failovers
    a message named the intermediate site (its clients 'now come from' site-b, gone on to site-c)."""
    seen: list[tuple[str, str, str, datetime]] = []
    for site_id in sorted(topology.sites):
        try:
            conn = connect(site_id)
        except (psycopg2.Error, LRError):
            continue
        try:
            with conn.cursor() as cur:
                seen += sink_sessions.failovers_seen(cur)
            conn.commit()
        except psycopg2.Error:
            pass  # an lr schema without failovers, a site that refuses: nothing to name
        finally:
            conn.close()
    return {source: to for (source, _), to in sorted(newest_moves(seen).items())}


def newest_moves(seen: Iterable[tuple[str, str, str, datetime]]) -> dict[tuple[str, str], str]:
    """(old source, client) -> the site the client now comes from, of the failovers sites record
    (``sink_sessions.failovers_seen``): each one's newest, followed through later failovers of the
    site it went to (a->b, then b->c: site-c; not through an older one of that site, from before
    it was promoted; none once failed back to it). Sites' clocks order failovers recorded at
    different sites."""
    newest: dict[tuple[str, str], tuple[str, datetime]] = {}
    for source, client, to, when in seen:
        if (source, client) not in newest or when > newest[source, client][1]:
            newest[source, client] = (to, when)
    found: dict[tuple[str, str], str] = {}
    for (source, client), (to, when) in newest.items():
        passed = {source}
        while (to, client) in newest and to not in passed and newest[to, client][1] > when:
            passed.add(to)
            to, when = newest[to, client]
        if to != source:  # failed back to it since: it is the client's source again
            found[source, client] = to
    return found


def explained(
    found: TopologyDrift | None, connect: Callable[[str], psycopg2.extensions.connection]
) -> TopologyDrift | None:
    """``found`` with the failovers the sites record, so its message tells a file older than a
    failover from one not applied yet (the advice differs: use the failover's file, not apply it)."""
    if found is None:
        return None
    moved = failed_over_sources(found.topology, connect)
    # where the clients went, when the command did not read it: whether it runs this file tells a
    # file older than the failover from a site left behind by it
    unread = {to for to in moved.values() if to not in found.held and to in found.topology.sites}
    mine = found.topology.topology_config_id
    held = {site: held for site, held in recorded_ids(found.topology, connect, unread).items() if held != mine}
    return replace(found, held={**found.held, **held}, failed_over=moved)


def check_sites(
    topology: Topology,
    connect: Callable[[str], psycopg2.extensions.connection],
    sites: Collection[str] | None = None,
    also: Collection[str] = (),
) -> None:
    """Refuse (``TopologyMismatchError``, naming the file and the sites) when a reachable site of
    ``sites`` runs another topology than ``topology``."""
    found = explained(drift(topology, recorded_ids(topology, connect, sites), also), connect)
    if found is not None:
        raise TopologyMismatchError(found.message())


def apply_to_site(conn: psycopg2.extensions.connection, topology: Topology, site_id: str, commit: bool = True) -> None:
    """Record the topology on one site: every other site becomes addressable from it, its clients
    are registered, and the sessions it is the source of are created (sessions it no longer is
    the source of are removed; their sinks keep their data); then the writers of a client it
    sourced and does not now are refused (``source/moved``, in a transaction of its own). Commits
    unless ``commit`` is False (``apply_everywhere`` commits every site together): the caller then
    commits and calls ``refuse_moved_writers``. Committing, on a caller's connection, under
    ``catalog_path``'s rule (the caller's transaction goes on otherwise: lr's own connections only)."""
    if commit:
        with catalog_path(conn, "apply_to_site"):
            return _apply_to_site(conn, topology, site_id, commit)
    return _apply_to_site(conn, topology, site_id, commit)


def _apply_to_site(conn: psycopg2.extensions.connection, topology: Topology, site_id: str, commit: bool) -> None:
    topology.site(site_id)
    mine = topology.sessions(source=site_id)
    try:
        with conn.cursor() as cur:
            for client in sorted({k.client for k in mine}):
                cur.execute(
                    "INSERT INTO lr.clients (client_name) VALUES (%s) ON CONFLICT (client_name) DO NOTHING", (client,)
                )
            for spec in topology.sites.values():
                if spec.site_id == site_id:
                    continue
                cur.execute(
                    "INSERT INTO lr.remote_sites (site_id, region) VALUES (%s, %s) "
                    "ON CONFLICT (site_id) DO UPDATE SET region = EXCLUDED.region",
                    (spec.site_id, spec.region),
                )
            source_sessions.keep_only(cur, [(k.sink, k.client) for k in mine])
            # a removed session's open full sync would hold safe trim at its base forever; one under
            # supply now is not waited for (the next look at an open request closes it: full_sync.close_superseded)
            cur.execute(
                f"UPDATE lr.full_sync_requests SET status = '{RequestStatus.CANCELLED}', finished_at = now(), "
                "note = 'session removed from the topology' WHERE request_id IN (SELECT request_id "
                f"FROM lr.full_sync_requests WHERE status IN {OPEN_STATUSES_SQL} "
                "AND NOT (sink_site_id || '/' || client_name = ANY (%s::text[])) FOR UPDATE SKIP LOCKED)",
                ([f"{k.sink}/{k.client}" for k in mine],),
            )
            topologies.record(cur, topology)
        if commit:
            conn.commit()
    except BaseException:
        conn.rollback()
        raise
    if commit:
        refuse_moved_writers(conn)


def _brought_back(conns: dict[str, psycopg2.extensions.connection], topology: Topology) -> list[str]:
    """The sessions ``topology`` would bring back that a failover closed at their sink (it refuses
    every writer of its session from the old source for good), each as a line saying so. A session
    its source has now (the sites run a topology with it, as after a fail-back) is not brought back."""
    closed: dict[tuple[str, str, str], str] = {}
    for site_id, conn in conns.items():
        with conn.cursor() as cur:
            for (source, client), (promoted, _) in sink_sessions.failed_over(cur).items():
                closed[(source, site_id, client)] = promoted
        conn.rollback()
    found = []
    for key in topology.sessions():
        to = closed.get((key.source, key.sink, key.client))
        if to is None or key.source not in conns:
            continue
        with conns[key.source].cursor() as cur:
            has_it = source_sessions.exists(cur, key.sink, key.client)
        conns[key.source].rollback()
        if not has_it:
            found.append(f"session {key} was failed over to {to}")
    return found


def _not_rejoined(conns: dict[str, psycopg2.extensions.connection], topology: Topology) -> dict[str, list[str]]:
    """The old sources of a failover (their sinks closed their sessions) that still source the
    clients and that ``topology`` would demote: they come back by ``lr failover --rejoin``, which
    counts and records what they committed after the cut and hands their tables over; a topology
    apply would skip that. Site -> a line per client."""
    seen: list[tuple[str, str, str, datetime]] = []
    for conn in conns.values():
        with conn.cursor() as cur:
            seen += sink_sessions.failovers_seen(cur)
        conn.rollback()
    moved = newest_moves(seen)  # after chained failovers, the site the client went to last
    found: dict[str, list[str]] = {}
    for (source, client), promoted in sorted(moved.items()):
        if source not in conns or topology.sessions(source=source, client=client):
            continue
        with conns[source].cursor() as cur:
            sourced = bool(source_sessions.sessions_of(cur, [client]))
        conns[source].rollback()
        if sourced:
            found.setdefault(source, []).append(
                f"site {source!r} is back with {client!r}, which a failover moved to {promoted!r}"
            )
    return found


def prune_sink_sessions(
    conn: psycopg2.extensions.connection, topology: Topology, site_id: str
) -> tuple[list[str], list[str]]:
    """Remove this site's sink sessions that the topology no longer has (their metadata, leftover
    unapplied full-sync rows and queue registration), so status stops listing them. A session
    whose receive queue still holds entries for subscribers is kept (nothing is deleted that an
    application has not consumed). Returns (pruned, kept with why). Does not commit."""
    wanted = {(k.source, k.client) for k in topology.sessions() if k.sink == site_id}
    pruned, kept = [], []
    with conn.cursor() as cur:
        for source, client in sink_sessions.keys(cur):
            if (source, client) in wanted:
                continue
            name = str(SessionKey(source, site_id, client))
            waiting = receive_queue.waiting(cur, source, client)
            if waiting:
                queue = receive_queue_name(client, source)
                kept.append(f"{name}: {waiting} entries still wait for subscribers in {queue}")
                continue
            receive_queue.drop(cur, source, client)
            sink_sessions.delete(cur, source, client)
            pruned.append(name)
    return pruned, kept


def apply_everywhere(
    topology: Topology, connect: Callable[[str], psycopg2.extensions.connection], prune: bool = False
) -> dict[str, tuple[list[str], list[str]]]:
    """Apply the topology to every one of its sites, all or nothing: each site is first reached
    and checked (lr schema installed and not older than lr's work needs, and the site id recorded
    there is the one the topology gives it), then the topology is written on all of them in open
    transactions that commit together once every write succeeded. One site unreachable or wrong:
    nothing changes anywhere. ``prune``: also remove the sink sessions the topology no longer has
    (``prune_sink_sessions``). Returns, per site id, the sink sessions pruned and kept."""
    from airflow_provider_lr.engine.db import schema
    from airflow_provider_lr.engine.db.durable_commits import durable

    connect = durable(connect)  # on every site's disk once it says so (a server committing asynchronously)
    conns: dict[str, psycopg2.extensions.connection] = {}
    try:
        for site_id in sorted(topology.sites):
            try:
                conns[site_id] = conn = connect(site_id)
                recorded, _ = schema.site_identity(conn)
                conn.rollback()
                schema.require_current(conn, "applying a topology", schema.REPLICATION_SCHEMA)
            except (psycopg2.Error, LRError) as exc:  # (a malformed connections file stays the user's input)
                raise (InputError if isinstance(exc, InputError) else ConfigurationError)(
                    f"site {site_id!r} ({topology.conn_id(site_id)}): {one_line(exc)}"
                    + "; nothing was applied on any site"
                ) from exc
            if recorded != site_id:
                raise ConfigurationError(
                    f"connection {topology.conn_id(site_id)!r} of site {site_id!r} reaches site "
                    f"{recorded!r}; nothing was applied on any site"
                )
        closed = _brought_back(conns, topology)
        if closed:
            raise ConfigurationError(
                f"{'; '.join(closed)}: a topology that makes a failed-over source the source of its clients "
                "again would replicate into sessions its sinks closed for good. Use the topology `lr failover` "
                "wrote (to move a source back: `lr failover --rejoin` it, then `lr failover --promote` it); "
                "nothing was applied on any site"
            )
        back = _not_rejoined(conns, topology)
        if back:
            raise ConfigurationError(
                f"{'; '.join(line for lines in back.values() for line in lines)}: rejoin it with `lr failover "
                f"--topology {topology.path or 'FILE'} --rejoin {' / --rejoin '.join(sorted(back))}` (it counts what it committed after the cut, refuses its writers and "
                "hands its federated tables over; a topology apply would not); nothing was applied on any site"
            )
        outcome: dict[str, tuple[list[str], list[str]]] = {}
        for site_id, conn in conns.items():
            try:
                apply_to_site(conn, topology, site_id, commit=False)
                outcome[site_id] = prune_sink_sessions(conn, topology, site_id) if prune else ([], [])
            except psycopg2.Error as exc:  # a role that may not change lr's tables; a lock held elsewhere
                owner = isinstance(exc, psycopg2.errors.InsufficientPrivilege)
                raise ConfigurationError(
                    f"site {site_id!r}: {failure(exc)}; nothing was applied on any site"
                    + (" (apply the topology as the owner of the lr schema)" if owner else "")
                ) from exc
        for conn in conns.values():
            conn.commit()
        for conn in conns.values():
            refuse_moved_writers(conn)
        return outcome
    finally:
        for conn in conns.values():
            if not conn.closed:
                conn.rollback()
                conn.close()
