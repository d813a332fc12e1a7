"""What a failover leaves behind and what it reaches: its record on the promoted site
(``lr.failovers``: resumed from by a re-run, read by ``lr status`` and by a returning site), the
results it reports, and the connections to the sites involved (``site/failover`` promotes,
``site/failover_reconcile`` cuts the other sinks, ``site/failover_rejoin`` brings a site back).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.encoding import json_text
from airflow_provider_lr.engine.db.topology_schema import Origin
from airflow_provider_lr.engine.errors import LRError, SiteUnreachableError, listing, one_line
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store import sink_sessions, source_sessions
from airflow_provider_lr.engine.store import topology as topology_model
from airflow_provider_lr.engine.store.topology import Topology, recorded_id
from airflow_provider_lr.engine.vocabulary import OPEN_STATUSES_SQL, FailoverStatus, RequestStatus

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
    busy: dict[str, str] = field(default_factory=dict)  # pending site -> why it was reached but not rejoined
    tail: dict[str, int] = field(default_factory=dict)  # what the old source committed after the cut (rejoined)
    table_tail: dict[str, int] = field(default_factory=dict)  # its table change entries likewise
    tables: dict[str, list[str]] = field(default_factory=dict)  # client -> federated tables the new source captures
    diverged: list[str] = field(default_factory=list)  # tables whose replication stops (allow_table_divergence)

    @property
    def lost(self) -> str:
        if self.planned:
            return f"nothing: {self.from_site} was drained into every sink before the cut" + (
                f" (but it committed {listing(self.tail)} after the switch)" if any(self.tail.values()) else ""
            )
        said = (
            f"whatever {self.from_site} committed for {', '.join(self.clients)} after position(s) "
            f"{listing(self.positions)} that {self.to_site} had not received"
        )
        if self.from_site not in self.applied:
            return f"{said}; `lr failover --rejoin {self.from_site}` counts it when it returns"
        # reachable, it was rejoined by this failover: counted now (before, said to come from a rejoin with
        # nothing left to do)
        counted = ", ".join(
            f"{c} {self.tail.get(c, 0)} entries and {self.table_tail.get(c, 0)} table change entries"
            for c in self.clients
        )
        return (
            f"{said}: {self.from_site} committed after the cut {counted}, received by nobody (its table changes are "
            f"replaced by {self.to_site}'s snapshot); {self.from_site} was rejoined"
        )


# --- the sites --------------------------------------------------------------------------------------
def reach(connect: Connect, site: str, conns: dict, role: str) -> psycopg2.extensions.connection:
    conn = try_connect(connect, site, conns)
    if conn is None:
        raise SiteUnreachableError(
            f"site {site!r} ({role}) cannot be reached: a failover needs the promoted site "
            "and every sink involved; nothing was done on this run (run it again when it is up)"
        )
    return conn


def try_connect(connect: Connect, site: str, conns: dict) -> psycopg2.extensions.connection | None:
    """The site's connection (kept in ``conns``), None when it cannot be reached; a site whose lr
    schema is older than a failover needs is refused (``SchemaError``)."""
    if site in conns:
        return conns[site]
    try:
        conns[site] = connect(site)
    except (psycopg2.Error, SiteUnreachableError) as exc:
        log.info("site %s cannot be reached: %s", site, one_line(exc))
        return None
    schema.require_current(conns[site], "a failover", schema.REPLICATION_SCHEMA)
    return conns[site]


def refuse_unrejoined(conns: dict, new: str, sinks: list[str], clients: list[str], target: Topology) -> None:
    """Refuse, before anything changes, a failover one of whose sinks is still the source of its
    clients: an old source of an earlier failover, back and not rejoined (chained failovers). The
    failover would reconcile it as a sink and give it its topology, and the rejoin, finding that
    topology there, would do nothing: its federated tables stayed captured there, its writers'
    changes accepted and sent nowhere, its copies never replaced by the new source's."""
    for sink in sinks:
        with conns[sink].cursor() as cur:
            held = set(source_sessions.sessions_of(cur, clients))
        conns[sink].commit()
        stale = sorted(held - {(k.sink, k.client) for k in target.sessions(source=sink)})
        if not stale:
            continue
        with conns[new].cursor() as cur:
            went = sorted({to for (source, _), (to, _) in sink_sessions.failed_over(cur).items() if source == sink})
        conns[new].commit()
        raise LRError(
            f"site {sink!r} is still the source of {', '.join(sorted({c for _, c in stale}))}"
            + (f" (failed over to {listing(went)}, not rejoined since)" if went else "")
            + f": rejoin it first (lr failover --rejoin {sink}), then run this failover again; nothing was done"
        )


# --- a full sync asked of the old source -----------------------------------------------------------
_MOVED = re.compile(r"failed over: asked of (?P<site>[^\s;,]+)(?: as request (?P<request>[0-9a-f-]{36}))?")


def moved_request(
    old: psycopg2.extensions.connection,
    request_id: str,
    new: psycopg2.extensions.connection,
    to_site: str,
    sink: str,
    client: str,
) -> None:
    """The old source's request, which the failover asked of ``to_site`` instead, names the request
    there: ``lr full-sync --wait`` follows it (``moved_to``). Before, its topology's apply cancelled it
    as 'session removed from the topology', and a wait said that, or that no replicator held it."""
    there = full_sync.open_request(new, sink, client)
    if there is None:
        return
    with old.cursor() as cur:
        cur.execute(
            "UPDATE lr.full_sync_requests SET status = %s, finished_at = coalesce(finished_at, now()), note = %s "
            "WHERE request_id = %s AND status <> %s",
            (
                RequestStatus.CANCELLED,
                f"failed over: asked of {to_site} as request {there.request_id}",
                request_id,
                RequestStatus.APPLIED,
            ),
        )
    old.commit()


def asked_requests(
    old: psycopg2.extensions.connection, sinks: list[str], clients: list[str], resumed_to: str | None = None
) -> dict[tuple[str, str], full_sync.FullSyncRequest]:
    """(sink, client) -> each full sync forced at the old source (``lr full-sync``, the lr_full_sync
    DAG) and not applied yet: the failover asks it of the new source instead. A re-run
    (``resumed_to``: the new source) finds those a killed run's drain closed and did not ask there
    (``moving_requests``): before, the re-run asked none, and the sink's full sync was lost."""
    found = {}
    for sink in sinks:
        for client in clients:
            if resumed_to is None:
                request = full_sync.open_request(old, sink, client)
            else:
                with old.cursor() as cur:
                    cur.execute(
                        "SELECT request_id::text FROM lr.full_sync_requests WHERE forced AND sink_site_id = %s "
                        "AND client_name = %s AND note = %s ORDER BY requested_at DESC LIMIT 1",
                        (sink, client, f"failed over: asked of {resumed_to}"),
                    )
                    row = cur.fetchone()
                old.commit()
                request = full_sync.get_request(old, row[0]) if row else None
            if request is not None and request.forced:
                found[sink, client] = request
    return found


def moving_requests(cur: psycopg2.extensions.cursor, to_site: str, sinks: list[str], clients: list[str]) -> None:
    """A switchover's drain, in the transaction that applies the new topology on the old source: the
    full syncs forced there are closed as asked of ``to_site`` (``moved_request`` names the request
    once made), not cancelled as 'session removed from the topology', which a wait read as final
    before the request there was made. One a supply holds is left to the topology's apply."""
    cur.execute(
        "UPDATE lr.full_sync_requests SET status = %s, finished_at = now(), note = %s WHERE request_id IN ("
        "SELECT request_id FROM lr.full_sync_requests WHERE forced AND sink_site_id = ANY (%s) "
        f"AND client_name = ANY (%s) AND status IN {OPEN_STATUSES_SQL} FOR UPDATE SKIP LOCKED)",
        (RequestStatus.CANCELLED, f"failed over: asked of {to_site}", sinks, clients),
    )


def moved_to(note: str) -> tuple[str, str | None] | None:
    """(site, request id) a request's note names when a failover asked it there (``moved_request``);
    (site, None) while the failover has not asked it yet (``moving_requests``)."""
    found = _MOVED.search(note or "")
    return (found["site"], found["request"]) if found else None


def moved_on(found: full_sync.RequestOutcome | None) -> tuple[str, str | None] | None:
    """Where a request went that a failover asked of another site instead: (site, request id there),
    (site, None) while the switchover has not asked it there yet; None when it was not moved (applied,
    still open, closed for another reason). The one rule ``lr full-sync --wait`` and the lr_full_sync
    DAG's verdict follow a moved request by (``followed_outcome``)."""
    if found is None or not found.final or found.outcome is full_sync.Outcome.APPLIED:
        return None
    return moved_to(found.note)


def followed_outcome(
    connect: Connect, source: str, request_id: str, hops: int = 8
) -> tuple[str, str, full_sync.RequestOutcome | None]:
    """What became of a request, followed across the failovers that asked it elsewhere (``moved_on``;
    chained: a->b, then b->c): the site and request id looked at last, and the outcome there. Before,
    the lr_full_sync DAG's verdict read only the old source's request ('cancelled: failed over: asked
    of site-b as request ...') and failed the run though site-b applied it. ``hops`` bounds the chain."""
    site, rid = source, request_id
    while True:
        conn = connect(site)
        try:
            found = full_sync.outcome(conn, rid)
        finally:
            conn.close()
        went, hops = moved_on(found), hops - 1
        if went is None or went[1] is None or hops <= 0:
            return site, rid, found
        site, rid = went[0], went[1]


# --- the record -------------------------------------------------------------------------------------
_RECORD_COLUMNS = (
    "failover_id",
    "from_site_id",
    "to_site_id",
    "clients",
    "positions",
    "base_position",
    "topology",
    "reason",
    "status",
    "outcome",
)


def read_record(conn: psycopg2.extensions.connection, from_site: str, status: str | None = None) -> dict | None:
    """The newest failover of ``from_site`` that promoted this site (with that ``status``); not a
    copy of another site's record (``keep_copy``)."""
    with conn.cursor() as cur:
        cur.execute(
            f"SELECT {', '.join(_RECORD_COLUMNS)} FROM lr.failovers WHERE from_site_id = %s "
            "AND (%s::text IS NULL OR status = %s) AND to_site_id = (SELECT site_id FROM lr.site_info) "
            "ORDER BY started_at DESC LIMIT 1",
            (from_site, status, status),
        )
        row = cur.fetchone()
    conn.commit()
    if row is None:
        return None
    record = dict(zip(_RECORD_COLUMNS, row))
    record["failover_id"] = str(record["failover_id"])
    return record


def finished(conn: psycopg2.extensions.connection, from_site: str) -> dict | None:
    """The completed failover whose topology this site still runs: a re-run replays it (no-op)."""
    record = read_record(conn, from_site, FailoverStatus.COMPLETED)
    if record is None:
        return None
    applied = topology_model.from_document(record["topology"], Origin("the failover recorded on the promoted site"))
    return record if applied.topology_config_id == recorded_id(conn) else None


def keep_copy(sink: psycopg2.extensions.connection, new: psycopg2.extensions.connection, failover_id: str) -> None:
    """A copy of the promoted site's record on a sink it reconciled (as recorded at the promotion;
    its status stays there): the old source's rejoin reads it there while the promoted site is down
    in turn (chained failovers), where it found no record and the next failover refused the
    returned old source until it rejoined: nothing could be failed over until that site was back."""
    columns = (*_RECORD_COLUMNS, "topology_config_id", "started_at")
    with new.cursor() as cur:
        cur.execute(f"SELECT {', '.join(columns)} FROM lr.failovers WHERE failover_id = %s", (failover_id,))
        row = cur.fetchone()
    new.commit()
    if row is None:
        return
    values = [json_text(v) if isinstance(v, (dict, list)) and name != "clients" else v for name, v in zip(columns, row)]
    with sink.cursor() as cur:
        cur.execute(
            f"INSERT INTO lr.failovers ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))}) "
            "ON CONFLICT (failover_id) DO NOTHING",
            [str(v) if name == "failover_id" else v for name, v in zip(columns, values)],
        )
    sink.commit()


def failovers(conn: psycopg2.extensions.connection) -> list[dict]:
    """Every failover recorded on this site, newest first (``lr status``, the docs' history)."""
    columns = (*_RECORD_COLUMNS, "topology_config_id", "started_at", "completed_at")
    with conn.cursor() as cur:
        cur.execute(f"SELECT {', '.join(columns)} FROM lr.failovers ORDER BY started_at DESC")
        rows = [dict(zip(columns, r)) for r in cur.fetchall()]
    conn.commit()
    return rows


def complete(conn: psycopg2.extensions.connection, result: FailoverResult) -> None:
    outcome = {
        "planned": result.planned,
        "sinks": result.outcome,
        "pending": result.pending,
        "tail": result.tail,
        "table_tail": result.table_tail,
        "tables": result.tables,
        "diverged": result.diverged,
    }
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE lr.failovers SET status = %s, outcome = %s, completed_at = coalesce(completed_at, now()) "
            "WHERE failover_id = %s",
            (FailoverStatus.COMPLETED, json_text(outcome), result.failover_id),
        )
    conn.commit()
