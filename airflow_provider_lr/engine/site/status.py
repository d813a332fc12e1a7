"""ReplicationStatus of a site, readable at a glance: its sessions on both ends, lag, and what
holds its shared log back (guarantee 1 in docs/architecture.md: whatever can stall replication is named)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import TypeVar

import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.local_settings import catalog_path
from airflow_provider_lr.engine.errors import one_line
from airflow_provider_lr.engine.site import queue_report
from airflow_provider_lr.engine.site.status_parts import (
    DIVERGED,
    HELD_BACK,
    MEMBERS,
    SESSIONS,
    TOPOLOGY,
    Refused,
    members_of,
    open_requests,
    read_part,
    refuses_writes,
    sessions_of,
    short_lock_waits,
    trim_mark,
    was_read,
)
from airflow_provider_lr.engine.site.status_sites import (
    closed_tables,
    cross_check,
    session_key,
    trim_marks,
)
from airflow_provider_lr.engine.source import delivery
from airflow_provider_lr.engine.source.backlog import readiness, session_backlogs
from airflow_provider_lr.engine.source.closed_tables import CLOSED_TABLE_ID_SCHEMA
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL, holdback
from airflow_provider_lr.engine.store.topology import Topology, TopologyDrift, config_id, drift
from airflow_provider_lr.engine.tables import closed_notes, handover
from airflow_provider_lr.engine.tables.targets import TableState
from airflow_provider_lr.engine.vocabulary import (
    RequestStatus,
    SessionKey,
    SessionState,
)

# exit codes of `lr status` (scripts alert on them)
HEALTHY, DEGRADED, UNREACHABLE = 0, 1, 2
REFUSED = 1  # a site's login may not read it: a refusal, as every lr command's (exit 1), health "refused"
T = TypeVar("T")
REQUESTS, DURABLE, QUEUES, TABLES = "full-sync requests", "durable position", "receive queues", "tables"
# the parts each field of ``SiteStatus`` is read from (with the sessions, whether the site is a
# source or a sink is known, and so whether the parts of one apply)
_READ_FROM = {
    "sessions": (SESSIONS,),
    "full_sync_requests": (REQUESTS,),
    "members": (MEMBERS,),
    "held_back_by": (SESSIONS, HELD_BACK),
    "durable": (SESSIONS, DURABLE),
    "receive_queues": (SESSIONS, QUEUES),
    "tables": (TABLES,),
    "diverged": (DIVERGED,),
}


@dataclass
class SiteStatus:
    """One site's status, computed from the site when asked (``as_of``); the one remembered figure,
    a session's last success, is shown as its age (``last_success_age_s``)."""

    site_id: str
    schema_version: int
    as_of: str = ""
    # the schema is older than this lr's migrations: what lr does not do with the site until ``lr init``
    schema_behind: str | None = None
    topology_config_id: str | None = None
    trim_mark: int | None = 0  # None: not read (``unread`` says why)
    sessions: list[dict] = field(default_factory=list)
    full_sync_requests: list[dict] = field(default_factory=list)  # open ones, this site as the source
    receive_queues: list[dict] = field(default_factory=list)  # this site as a sink
    held_back_by: list[dict] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)  # registered tables, and each sink session's
    diverged: list[str] = field(default_factory=list)  # federated tables not replicating, one line each
    # this site as a source: the highest position up to which every entry is durable
    # (``delivery.durable_position``), the rule it was judged by, and the last position drawn
    durable: dict = field(default_factory=dict)
    # this site as a source: the replicator processes working its sessions (live members, V0020)
    members: list[dict] = field(default_factory=list)
    # parts not read, each with why (an lr table another session holds locked: ``status_parts``)
    unread: list[str] = field(default_factory=list)
    refuses_writes: str | None = None  # why every write lr makes here fails (``status_parts.refuses_writes``)

    def as_dict(self) -> dict:
        """``lr status --json``'s site: a part not read is null (an empty list would say "none")."""
        return {k: _jsonable(v) if self.read(*_READ_FROM.get(k, ())) else None for k, v in asdict(self).items()}

    def read(self, *parts: str) -> bool:
        """Whether every one of ``parts`` (``status_parts``' names) was read: an empty list of a part
        not read is no "none"."""
        return all(was_read(self.unread, what) for what in parts)


def _jsonable(value: object) -> object:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    return value


def site_status(conn: psycopg2.extensions.connection, site_id: str | None = None) -> SiteStatus:
    """The site's status, each part read on its own (``status_parts``): a part whose lr table another
    session holds locked is said not read (``unread``), the rest shown. On an engine API caller's
    connection its reads search pg_catalog alone (``catalog_path``), as on lr's own: a schema of
    lookalike operators before pg_catalog on its path stood in for the built-ins they name."""
    with catalog_path(conn, "site_status"), short_lock_waits(conn):
        return _site_status(conn, site_id)


def _site_status(conn: psycopg2.extensions.connection, site_id: str | None) -> SiteStatus:
    version = schema.current_version(conn)
    site_id = site_id or schema.site_identity(conn)[0]
    result = SiteStatus(site_id, version, schema_behind=schema.behind(version))
    with conn.cursor() as cur:
        cur.execute("SELECT now()")
        result.as_of = cur.fetchone()[0].isoformat()
    conn.commit()
    if version < 3:
        return result

    def part(what: str, read: Callable[[psycopg2.extensions.cursor], T]) -> T | None:
        def in_transaction() -> T:
            with conn.cursor() as cur:
                found = read(cur)
            conn.commit()
            return found

        return read_part(conn, result.unread, what, in_transaction)

    result.refuses_writes = part("writability", refuses_writes)
    result.topology_config_id = part(TOPOLOGY, config_id)
    result.trim_mark = part("trim mark", trim_mark)
    found = part(SESSIONS, lambda cur: sessions_of(cur, version))
    result.sessions, last_ok = found if found is not None else ([], None)
    result.full_sync_requests = part(REQUESTS, open_requests) or []
    result.members, registered = (part(MEMBERS, members_of) if version >= 20 else None) or ([], {})
    if last_ok is not None and any(s["role"] == "source" for s in result.sessions):
        live = read_part(conn, result.unread, "backlogs", lambda: session_backlogs(conn))  # not the last cycle's
        backlogs = {(b.sink, b.client): b for b in live or ()}
        requests = {(r["sink"], r["client"]): r for r in result.full_sync_requests}
        for s in result.sessions:
            if s["role"] == "source":
                key = (s["sink_site_id"], s["client_name"])
                backlog = backlogs.get(key)
                if live is not None:
                    s["remaining_entries_to_send"] = backlog.entries if backlog else 0
                    s["unsafe_before_guard"] = backlog.before_guard if backlog else 0
                s["first_guarded"] = backlog.first_guarded if backlog else None
                s["lag_seconds"] = (backlog.lag_seconds if backlog else 0.0) if live is not None else None
                s["last_success_age_s"] = last_ok.get(key)
                # the holder as a replicator member: live, dead (its lease is taken at once), None: not one
                s["lease_owner_alive"] = registered.get(s["lease_owner"])
                request = requests.get(key)
                s["waiting_for"] = waiting_for(s, request)
                # a forced request: the session's sink takes a new full sync, whatever its state now
                s["full_sync_requested"] = request["request_id"] if request and request["forced"] else None
        result.durable = read_part(conn, result.unread, DURABLE, lambda: durability(conn)) or {}
        held = read_part(conn, result.unread, HELD_BACK, lambda: holdback(conn)) or []
        result.held_back_by = [
            {"kind": h.kind, "pid": h.pid, "age_s": round(h.age_seconds, 1), "state": h.state, "gid": h.gid}
            | {"describe": h.describe()}
            for h in held
        ]
    if any(s["role"] == "sink" for s in result.sessions):
        queues = lambda: queue_report.receive_queues(conn)  # noqa: E731
        result.receive_queues = read_part(conn, result.unread, QUEUES, queues) or []
    if version >= 8:
        result.tables = read_part(conn, result.unread, TABLES, lambda: tables(conn)) or []
    if version >= 10:
        diverged = read_part(conn, result.unread, DIVERGED, lambda: handover.diverged(conn)) or []
        result.diverged = [d.describe() for d in diverged]
    return result


def holder(session: dict) -> str:
    """A source session's lease holder as ``lr status`` says it."""
    if not session.get("lease_owner"):
        return "no holder"
    since = session.get("lease_acquired_at")
    when = f" since {since.isoformat(timespec='seconds')} ({_age(session['lease_held_s'])})" if since else ""
    alive = session.get("lease_owner_alive")
    member = "" if alive is None else " (a live member)" if alive else " (a dead member: taken over at the next cycle)"
    return f"held by {session['lease_owner']}{member}{when}, expires in {session['lease_expires_in_s']:.0f}s"


def tables(conn: psycopg2.extensions.connection) -> list[dict]:
    """Federated tables: each registered on this site (``role`` registry) and each a sink
    session takes here (``role`` sink: its state, rows of its snapshot, a conflict's reason).
    ``closed_here``: a close this site's own rows say, read even when the other site is not: a
    registry row of a copy federated onward from here and closed since (its row names the copy's
    origin, so ``is_closed`` cannot tell it), or a sink's copy whose source told it of the close
    (``closed_notes``). Before, both were shown as live: ``synced``, and no line at the closing site."""
    noted = "closed_at_source" if schema.at_least(conn, closed_notes.CLOSED_MARKS_SCHEMA) else "false"
    onward = closed_notes.CLOSED_ONWARD if schema.at_least(conn, CLOSED_TABLE_ID_SCHEMA) else "false"
    with conn.cursor() as cur:
        cur.execute(
            "SELECT 'registry', stream_name, client_name, source_site_id, is_federated, table_id, NULL, NULL, NULL, "
            f"{onward} FROM lr.registry WHERE kind = 'table' "
            "UNION ALL SELECT 'sink', table_name, client_name, source_site_id, NULL, source_table_id, state, "
            f"rows_copied, detail, {noted} FROM lr.sink_tables ORDER BY 1, 2, 4"
        )
        keys = ("role", "table", "client", "source", "federated", "table_id", "state", "rows", "detail", "closed_here")
        found = [dict(zip(keys, r)) for r in cur.fetchall()]
    conn.commit()
    return found


def durability(conn: psycopg2.extensions.connection) -> dict:
    """The durable position of this source: by the topology's ``min_regions_for_durability``, or
    without a rule, delivered to every sink each entry named."""
    rule = delivery.durability_rule(conn)
    regions = rule.min_regions_for_durability if rule else None
    position = delivery.durable_position(conn, regions if regions is not None else delivery.EVERY_NAMED_SINK)
    with conn.cursor() as cur:
        cur.execute(LAST_DRAWN_POSITION_SQL)
        drawn = cur.fetchone()[0]
    conn.commit()
    rule_text = f"stored in >= {regions} regions" if regions else "acknowledged by every sink it named"
    return {"position": position, "min_regions": regions, "rule": rule_text, "last_position": drawn}


def waiting_for(session: dict, request: dict | None) -> str | None:
    """What a source session waits for before it can move on, or None."""
    if session["state"] == SessionState.IN_SNAPSHOT_SYNC and request is not None:
        if request["status"] == RequestStatus.PENDING and request.get("supplying"):  # not waiting for a client
            return (
                f"its provider, which is supplying the client's full-sync data for request {request['request_id']} "
                f"now (asked {request['age_s']:.0f}s ago)"
            )
        if request["status"] == RequestStatus.PENDING:
            return (
                f"the client's full-sync data for request {request['request_id']} "
                f"({'forced: ' if request['forced'] else ''}{request['reason'] or 'negotiation'}; asked "
                f"{request['age_s']:.0f}s ago, restarts in {max(request['data_deadline_in_s'], 0):.0f}s): its "
                "provider must be importable by the replicator, or the client must serve the request"
            )
        return f"the transfer and apply of full sync {request['request_id']}"
    if session["state"] == SessionState.NEGOTIATING and session.get("last_error"):
        return "negotiation to succeed (see last error)"
    if session["state"] == SessionState.INITIALIZED:
        return "its first replication cycle (lr sync or the lr_replication DAG)"
    return None


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    return f"{seconds / 60:.0f}m ago" if seconds < 7200 else f"{seconds / 3600:.1f}h ago"


def render(
    status: SiteStatus, source_marks: dict[str, int] | None = None, closed: set[tuple[str, str]] | None = None
) -> str:
    """``source_marks``: the trim mark of each source site reached in the same status run
    (``trim_marks``; a sink's sessions are checked against their source's); ``closed``: the
    (source, table) closed at sources reached in it (``closed_tables``)."""
    closed = {*(closed or set()), *closed_tables({status.site_id: status})}
    marks = {**(source_marks or {}), **({status.site_id: status.trim_mark} if status.trim_mark is not None else {})}
    lines = [
        f"{status.site_id}: schema v{status.schema_version}, topology {status.topology_config_id or '(none applied)'}, "
        f"trim mark {'not read' if status.trim_mark is None else status.trim_mark}"
    ]
    if status.schema_behind:
        lines.append(f"  upgrade: {status.schema_behind}")
    for m in status.members:
        lines.append(
            f"  member {m['owner']} since {m['joined_at'].isoformat(timespec='seconds')}, "
            f"heartbeat {m['heartbeat_age_s']:.1f}s ago"
        )
    for s in status.sessions:
        session = str(session_key(s))
        mark = marks.get(s["source_site_id"])
        state = readiness(s, mark)
        if s["role"] == "source":  # behind the trim mark, what the log still holds is not the lag
            lag = f"lag {s['remaining_entries_to_send']} entries / {s.get('lag_seconds') or 0.0:.1f}s"
            if s.get("lag_seconds", 0.0) is None:
                lag = "lag unknown (its backlog not read)"
            if state == "not ready (behind trim)":
                lag = f"lag unknown (entries to {mark} trimmed: a full sync is due)"
            detail = f"{lag}, {s['state']}, last success {_age(s.get('last_success_age_s'))}"
        else:
            against = f"source trim mark {mark}" if mark is not None else "source trim mark unknown"
            detail = f"data consistent {s['data_consistent']}, {against}"
        lines.append(
            f"  {s['role']:<6} {session:<32} {state:<24} {s['sync_type'] or '-':<9} {s['status']:<11} "
            f"base {s['base_snapshot']}, applied {s['last_applied_position']}, {detail}"
        )
        if s["role"] == "source":
            lines.append(f"         lease {holder(s)}")
        if s.get("waiting_for"):
            progress = f" ({s['full_sync_progress']})" if s.get("full_sync_progress") else ""
            lines.append(f"         waiting for {s['waiting_for']}{progress}")
        if s.get("tables_lacking") and not s.get("failed_over_to"):
            lines.append(f"         tables not synced at the sink yet: {', '.join(s['tables_lacking'])}")
        if s.get("last_error"):
            lines.append(f"         last error: {one_line(s['last_error'])}")
        if s.get("failed_over_to") and s["role"] == "source":  # (its sink says so: ``mark_sources_failed_over``)
            lines.append(
                f"         its sink refuses it: {s['client_name']!r} was failed over to {s['failed_over_to']}; "
                f"rejoin this site (lr failover --rejoin {status.site_id}) with the failover's topology"
            )
        elif s.get("failed_over_to"):
            note = f"reconciled: {one_line(s['failover_note'])}" if s.get("failover_note") else "not reconciled yet"
            lines.append(f"         its clients failed over to {s['failed_over_to']}: this session is closed; {note}")
    for r in status.full_sync_requests:
        lines.append(
            f"  full sync {r['status']:<9} {SessionKey(status.site_id, r['sink'], r['client'])} request {r['request_id']}"
            f" ({'forced' if r['forced'] else 'by negotiation'}: {r['reason'] or '-'}), asked {_age(r['age_s'])}"
            + ("; its provider is supplying it now" if r.get("supplying") else "")
        )
    for q in status.receive_queues:
        lines.append(
            f"  queue  {q['queue']:<32} {q['waiting']} waiting for subscribers"
            + (f" (oldest {q['oldest_waiting_s']:.0f}s)" if q["waiting"] else "")
            + (f", {q['unapplied_snapshot']} of a full sync not applied yet" if q["unapplied_snapshot"] else "")
            + (f", {q['dead_letters']} dead letters" if q["dead_letters"] else "")
        )
    received = {(t["source"], t["table"]) for t in status.tables if t["role"] == "sink"}
    renewing = {  # (source, client) of this sink's sessions whose copies a full sync replaces
        (s["source_site_id"], s["client_name"]): "under way" if not s["data_consistent"] else "requested"
        for s in status.sessions
        if s["role"] == "sink" and (s.get("full_sync_requested") or not s["data_consistent"])
    }
    for t in status.tables:
        if t["role"] == "registry":
            taken = t["federated"] and t["table_id"] is None and not t["closed_here"]  # not federated onward from here
            if t["source"] and (t["source"], t["table"]) in received and taken:
                continue  # a table this sink takes: its session's line says it all (one it keeps out of: not)
            if (status.site_id, t["table"]) in closed:
                flag = "closed (captured no more; its sinks keep their copy, no longer updated)"
            elif t["federated"] and (t["source"], t["table"]) in closed:  # no synced row: a full sync passed it
                flag = f"closed at {t['source']} before this copy had every change made before the close: kept as it is"
            elif t["source"] and t["federated"] and t["table_id"] is None:  # a sink's registration, no copy now
                full = renewing.get((t["source"], t["client"]))
                coming = f" (its snapshot comes with the full sync {full})" if full else ""
                lines.append(
                    f"  table  {t['table']:<32} registered by {t['source']}, client {t['client']}: no copy held now{coming}"
                )
                continue
            else:
                flag = "federated" if t["federated"] else "not federated (its data from sources is dropped here)"
            origin = f", registered by {t['source']}" if t["source"] else ""
            lines.append(f"  table  {t['table']:<32} {flag}, client {t['client'] or '-'}{origin}")
        else:
            sink_session = SessionKey(t["source"], status.site_id, t["client"])
            rows = f", {t['rows']} rows in its snapshot" if t["rows"] is not None else ""
            detail = f": {one_line(t['detail'])}" if t["detail"] else ""
            shut = (
                f" (closed at {t['source']}: this copy is kept, no longer updated)"
                if t["closed_here"] or (t["source"], t["table"]) in closed
                else ""
            )
            renewed = renewing.get((t["source"], t["client"])) if t["state"] == TableState.SYNCED and not shut else None
            shut += f" (a new snapshot comes with the full sync {renewed})" if renewed else ""
            lines.append(f"  table  {t['table']:<32} {t['state']} from {sink_session}{rows}{detail}{shut}")
    for d in status.diverged:
        lines.append(f"  table  {d}")
    if status.durable:
        durable = status.durable
        lines.append(
            f"  durable up to position {durable['position']} of {durable['last_position']} (every entry {durable['rule']})"
        )
    for h in status.held_back_by:
        lines.append(f"  held back: {h['describe']}")
    lines += [f"  {part}" for part in status.unread + ([status.refuses_writes] if status.refuses_writes else [])]
    return "\n".join(lines)


def render_sites(found: dict[str, SiteStatus | str]) -> str:
    """Every site's status (or why it could not be read), each sink's sessions checked against
    the trim mark of its source read in the same run, and its tables against their sources'."""
    cross_check(found)
    marks, closed = trim_marks(found), closed_tables(found)
    return "\n".join(st if isinstance(st, str) else render(st, marks, closed) for st in found.values())


def topology_drift(found: dict[str, SiteStatus | str], topology: Topology | None) -> TopologyDrift | None:
    """The sites read that run another topology than ``topology`` (the file status was given)."""
    if topology is None:
        return None
    read = [st for st in found.values() if isinstance(st, SiteStatus)]
    moved = {s["source_site_id"]: s["failed_over_to"] for st in read for s in st.sessions if s.get("failed_over_to")}
    return drift(topology, {st.site_id: st.topology_config_id for st in read}, failed_over=moved)


def health(
    found: dict[str, SiteStatus | str], max_lag_seconds: float | None = None, topology: Topology | None = None
) -> tuple[int, list[str]]:
    """(exit code, reasons): UNREACHABLE when a site could not be reached or read, REFUSED (exit 1,
    health "refused") when a site's login may not read it, DEGRADED when a part of a site could not be
    read (a lock held on its table), a session errs, stands behind its source's trim mark, or lags more
    than ``max_lag_seconds``, or a federated table does not replicate (diverged), or when sites run
    another topology than ``topology`` (the file in hand) or an lr schema older than this lr's, else HEALTHY."""
    stale = topology_drift(found, topology)
    reasons = [stale.message()] if stale is not None else []
    unreachable = [  # reached but not read (a lock held elsewhere) is said as such
        f"{site}: {'unreadable' if 'UNREADABLE' in st else 'unreachable'}"
        for site, st in found.items()
        if isinstance(st, str) and not isinstance(st, Refused)
    ]
    refused = [f"{site}: refused" for site, st in found.items() if isinstance(st, Refused)]
    if unreachable:
        return UNREACHABLE, unreachable + refused + reasons
    marks = trim_marks(found)
    cross_check(found)
    # a sink's row of a session the topology removed stays until pruned; behind trim it is no fault
    kept = set(topology.sessions()) if topology is not None else None
    for st in found.values():
        if isinstance(st, str):  # refused
            continue
        reasons += [f"{st.site_id}: {part}" for part in st.unread + ([st.refuses_writes] if st.refuses_writes else [])]
        for s in st.sessions:
            name = f"{session_key(s)} ({s['role']})"
            state = readiness(s, marks.get(s["source_site_id"]))
            if state == "not ready (behind trim)" and kept is not None and session_key(s) not in kept:
                continue
            if state in ("not ready (error)", "not ready (behind trim)"):
                reasons.append(f"{name}: {state}")
            elif max_lag_seconds is not None and (s.get("lag_seconds") or 0.0) > max_lag_seconds:
                reasons.append(f"{name}: lag {s['lag_seconds']:.0f}s over {max_lag_seconds:.0f}s")
        reasons += [f"{st.site_id}: table {d}" for d in st.diverged]
        reasons += [f"{st.site_id}: {st.schema_behind}"] if st.schema_behind else []
    return (REFUSED if refused else DEGRADED if reasons else HEALTHY), refused + reasons


def health_word(found: dict[str, SiteStatus | str], code: int) -> str:
    """What ``lr status`` says of an exit code: refused (1) when a site's login may not read it."""
    if code == DEGRADED and any(isinstance(st, Refused) for st in found.values()):
        return "refused"
    return {HEALTHY: "healthy", DEGRADED: "degraded", UNREACHABLE: "unreachable"}[code]


def sites_as_dict(
    found: dict[str, SiteStatus | str], max_lag_seconds: float | None = None, topology: Topology | None = None
) -> dict:
    """``lr status --json``: every site, with readiness computed across sites, and the health verdict."""
    cross_check(found)
    marks, closed = trim_marks(found), closed_tables(found)
    sites = {}
    for site, st in found.items():
        if isinstance(st, str):
            sites[site] = {"site_id": site, "reachable": isinstance(st, Refused), "refused": isinstance(st, Refused)}
            sites[site]["error"] = st
            continue
        data = st.as_dict()
        for s in data["sessions"] or ():
            s["readiness"] = readiness(s, marks.get(s["source_site_id"]))
        for t in data["tables"] or ():  # closed at its source (the registry row there, or a sink's copy)
            t["closed"] = (
                t["closed_here"] or (t["source"] if t["role"] == "sink" else t["source"] or site, t["table"]) in closed
            )
        sites[site] = {"reachable": True, **data}
    code, reasons = health(found, max_lag_seconds, topology)
    stale = topology_drift(found, topology)
    file = (
        {}
        if topology is None
        else {
            "topology_file": {
                "path": topology.path,
                "topology_config_id": topology.topology_config_id,
                "sites_holding_another": stale.held if stale is not None else {},
            }
        }
    )
    return {
        "health": health_word(found, code),
        "exit_code": code,
        "reasons": reasons,
        **file,
        "sites": sites,
    }
