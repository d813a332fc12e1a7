"""What one ``lr status`` run learns by reading several sites at once: each sink's sessions checked
against its source's trim mark, each source's against its sink's own position, each session's
tables against what its source federates, each copy against a close at its source."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from airflow_provider_lr.engine.tables.registry import is_closed
from airflow_provider_lr.engine.tables.targets import TableState
from airflow_provider_lr.engine.vocabulary import RequestStatus, SessionKey


class SiteRead(Protocol):
    """What these checks read of a site's status (``status.SiteStatus``)."""

    trim_mark: int | None
    sessions: list[dict]
    tables: list[dict]
    full_sync_requests: list[dict]
    receive_queues: list[dict]
    diverged: list[str]


def session_key(session: dict) -> SessionKey:
    """The key of a session row of ``site_status`` (either role)."""
    return SessionKey(session["source_site_id"], session["sink_site_id"], session["client_name"])


def sites_read(found: Mapping[str, SiteRead | str]) -> dict[str, SiteRead]:
    """The sites a status run read (a site it could not read is its error's line)."""
    return {site: st for site, st in found.items() if not isinstance(st, str)}


def trim_marks(found: Mapping[str, SiteRead | str]) -> dict[str, int]:
    """The trim mark of every site read in one status run: a sink's sessions are checked against
    their source's."""
    return {site: st.trim_mark for site, st in sites_read(found).items() if st.trim_mark is not None}


def closed_tables(found: Mapping[str, SiteRead | str]) -> set[tuple[str, str]]:
    """(site, table) of every table closed at a site read in one status run (``lr tables close``):
    opened there as federated, or a copy federated onward from there (both ways), captured no more.
    Its sinks' copies are marked with it."""
    return {
        (site, t["table"])
        for site, st in sites_read(found).items()
        for t in st.tables
        if t["role"] == "registry" and (is_closed(t["federated"], t["table_id"], t["source"]) or t.get("closed_here"))
    }


def mark_tables_lacking(found: Mapping[str, SiteRead | str]) -> None:
    """Note on each session whose source and sink were read the tables its source federates for
    the client that its sink has not synced (``tables_lacking``): the snapshot after a full sync, or
    of a table just opened, still to come or under way. Until then it is not called ready."""
    captured: dict[tuple[str, str], dict[str, int]] = {}  # (source, client) -> table -> its table_id
    synced: dict[tuple[str, str, str], dict[str, int]] = {}  # (source, sink, client) -> table -> table_id
    kept_out: dict[str, set[str]] = {}  # sink -> tables it opened --no-federated
    read = sites_read(found)
    for site, st in read.items():
        for t in st.tables:
            if t["role"] == "sink" and t["state"] == TableState.SYNCED:
                synced.setdefault((t["source"], site, t["client"]), {})[t["table"]] = t["table_id"]
            elif t["role"] == "registry" and not t["federated"]:
                kept_out.setdefault(site, set()).add(t["table"])
            elif t["role"] == "registry" and t["table_id"] is not None:
                captured.setdefault((site, t["client"]), {})[t["table"]] = t["table_id"]
    for st in read.values():
        for s in st.sessions:
            key = session_key(s)
            if key.source in read and key.sink in read:
                have = synced.get((key.source, key.sink, key.client), {})
                wanted = captured.get((key.source, key.client), {})
                s["tables_lacking"] = sorted(
                    t
                    for t, table_id in wanted.items()
                    if have.get(t) != table_id and t not in kept_out.get(key.sink, ())
                )


def mark_sink_positions(found: Mapping[str, SiteRead | str]) -> None:
    """Note on each source session whose sink was read in the same run the sink's own position
    (``sink_position``): the acknowledged one trails it (a stream acknowledges what the sink holds
    durably, lazily), and a retention trim in that window made ``lr status`` call a sink that held
    every entry "behind trim", its site DEGRADED. The sink's own position is the truth."""
    read = sites_read(found)
    own = {
        session_key(s): s["last_applied_position"]
        for st in read.values()
        for s in st.sessions
        if s["role"] == "sink" and s["data_consistent"] and not s.get("failed_over_to")
    }
    for st in read.values():
        for s in st.sessions:
            if s["role"] == "source" and (position := own.get(session_key(s))) is not None:
                s["sink_position"] = position


def mark_full_syncs(found: Mapping[str, SiteRead | str]) -> None:
    """Note on each sink session whose source was read the forced full sync open there
    (``full_sync_requested``: its copy is about to be replaced, so it is not called consistent), and
    on each source session whose transfer is under way how much of it its sink holds: before, a
    sink was ``consistent`` while its source waited for a full sync, and a transfer of minutes
    showed no progress."""
    read = sites_read(found)
    requested = {
        session_key(s): s["full_sync_requested"]
        for st in read.values()
        for s in st.sessions
        if s["role"] == "source" and s.get("full_sync_requested")
    }
    for site, st in read.items():
        for s in st.sessions:
            if s["role"] == "sink" and (request := requested.get(session_key(s))):
                s["full_sync_requested"] = request
        supplied = {(r["sink"], r["client"]): r for r in st.full_sync_requests if r["status"] == RequestStatus.SUPPLIED}
        for s in st.sessions:
            request = supplied.get((s["sink_site_id"], s["client_name"])) if s["role"] == "source" else None
            sink = read.get(s["sink_site_id"])
            if request is None or sink is None or not s.get("waiting_for") or request.get("entries") is None:
                continue
            held = sum(
                q["unapplied_snapshot"]
                for q in sink.receive_queues
                if (q["source"], q["client"]) == (site, s["client_name"])
            )
            # the provider's messages, with the start and end markers (as the queue counts them)
            whole = request["entries"] + 2
            s["full_sync_progress"] = f"{min(held, whole)} of its {whole} entries at the sink"


def mark_copies_captured_for_another_client(found: Mapping[str, SiteRead | str]) -> None:
    """Note as diverged on each sink read a copy (synced or syncing) whose source, read in the
    same run, captures the table for another client than the copy's, and did not close it: that
    client's sessions carry it no more, so the copy is not updated. A failover let through with
    ``--allow-table-divergence`` does that to a copy federated both ways (the promoted site captured
    it for ``back``, and takes it over for the failed-over client). Before, those copies read
    ``synced`` and ``lr status`` said healthy."""
    read = sites_read(found)
    closed = closed_tables(found)
    captured = {
        (site, t["table"]): t["client"]
        for site, st in read.items()
        for t in st.tables
        if t["role"] == "registry" and t["federated"] and t["table_id"] is not None
    }
    for st in read.values():
        for t in st.tables:
            source, table, client = t["source"], t["table"], t["client"]
            now = captured.get((source, table))
            if (
                t["role"] != "sink"
                or t["state"] not in (TableState.SYNCED, TableState.SYNCING)
                or t.get("closed_here")
                or (source, table) in closed
                or now is None
                or now == client
            ):
                continue
            line = (
                f"{table} DIVERGED (client {client}): its source {source} captures it for client {now!r} now, "
                f"not for {client!r}: this copy is no longer updated; its rows stay as {source} left them"
            )
            if line not in st.diverged:
                st.diverged.append(line)


def mark_sources_failed_over(found: Mapping[str, SiteRead | str]) -> None:
    """Note on each source session whose sink, read in the same run, records its client failed
    over (the fence of ``lr failover``) where it went (``failed_over_to``): an old source back
    after an unplanned failover, not rejoined yet, still has its sessions, which every sink refuses.
    Before, they were called ready, or waiting for a table snapshot that never comes."""
    read = sites_read(found)
    moved = {
        (session_key(s), site): s["failed_over_to"]
        for site, st in read.items()
        for s in st.sessions
        if s["role"] == "sink" and s.get("failed_over_to")
    }
    for st in read.values():
        for s in st.sessions:
            key = session_key(s)
            to = moved.get((key, key.sink))
            if s["role"] == "source" and to:
                s["failed_over_to"] = to


def cross_check(found: Mapping[str, SiteRead | str]) -> None:
    """Every note a status run makes across the sites it read (before readiness is judged)."""
    mark_sources_failed_over(found)
    mark_sink_positions(found)
    mark_tables_lacking(found)
    mark_full_syncs(found)
    mark_copies_captured_for_another_client(found)
