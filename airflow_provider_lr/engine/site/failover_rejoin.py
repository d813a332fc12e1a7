"""A site a failover could not reach comes back (``lr failover --rejoin``): it gets the failover's
topology; the old source first counts what it committed for the failed-over clients after the
cut (nobody received it: reported, not replicated) and its tables of those clients stop being
captured there (the new source's snapshot replaces them). A session from the new source that an
earlier failover closed on the site (a fail-back: the new source was its source before) is
reopened for a full sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg2.extensions

from airflow_provider_lr.engine.db.topology_schema import Origin
from airflow_provider_lr.engine.site.topology import apply_to_site
from airflow_provider_lr.engine.source.moved import record_unreplicated, refuse_moved_writers
from airflow_provider_lr.engine.store import sink_sessions, source_sessions
from airflow_provider_lr.engine.store import topology as topology_model
from airflow_provider_lr.engine.tables import handover
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES, SessionKey


@dataclass
class RejoinResult:
    site: str
    failover_id: str
    topology_config_id: str
    retired: list[str]  # the site's sessions of the failed-over clients, removed
    tail: dict[str, int]  # client -> entries it committed after the cut that nobody received
    table_tail: dict[str, int] = field(default_factory=dict)  # client -> table change entries likewise (replaced)
    guarded: list[str] = field(default_factory=list)  # its tables of the clients, now refused to its writers
    reopened: list[str] = field(default_factory=list)  # its sessions from the new source an earlier failover closed
    # the site ran the failover's topology already (a planned switchover applied it there): its
    # sessions from the new source had their first contact and go on as they are
    already: bool = False


def rejoin_site(conn: psycopg2.extensions.connection, site: str, record: dict) -> RejoinResult:
    """Apply a failover's topology on ``site`` (one transaction); on its old source, first count what
    it committed for the clients after the cut (nobody received it: reported, not replicated)."""
    target = topology_model.from_document(record["topology"], Origin("the failover recorded on the promoted site"))
    tail: dict[str, int] = {}
    table_tail: dict[str, int] = {}
    retired: list[str] = []
    guarded: list[str] = []
    reopened: list[str] = []
    try:
        with conn.cursor() as cur:
            already = topology_model.config_id(cur) == target.topology_config_id
            if record["from_site_id"] == site:
                for client in record["clients"]:
                    cut = record["positions"][client]
                    cur.execute(
                        "SELECT count(*) FILTER (WHERE e.stream = %s), count(*) FILTER (WHERE e.stream = %s) "
                        "FROM lr.log_entries e JOIN lr.log_commits c ON c.tx = e.tx "
                        "JOIN lr.clients k ON k.client_id = e.client_id WHERE k.client_name = %s AND c.position > %s",
                        (STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES, client, cut),
                    )
                    tail[client], table_tail[client] = cur.fetchone()
                    note = (
                        f"committed at site {site} after the cut (position {cut}) of its failover to site "
                        f"{record['to_site_id']}: received by nobody, and never will be"
                    )
                    record_unreplicated(cur, client, cut, note)
                # the old source's sessions of the clients, retired by the topology below
                retired = [str(SessionKey(site, s, c)) for s, c in source_sessions.sessions_of(cur, record["clients"])]
            apply_to_site(conn, target, site, commit=False)
            # a fail-back: the new source was this site's source before an earlier failover closed its
            # sessions here; they start again with a full sync, as a first contact would
            new_source = record["to_site_id"]
            reopened = [
                str(SessionKey(new_source, site, c))
                for c in sink_sessions.reopen_closed(cur, new_source, record["clients"])
            ]
            if record["from_site_id"] == site:  # a sink of its tables now: the new source's snapshot replaces them
                taken = record["outcome"].get("tables", {})
                for client in record["clients"]:
                    guarded += handover.retire(cur, client, record["to_site_id"], taken.get(client, []))
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    refuse_moved_writers(conn)
    return RejoinResult(
        site, record["failover_id"], target.topology_config_id, retired, tail, table_tail, guarded, reopened, already
    )
