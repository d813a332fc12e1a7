"""Helpers for session scenarios: a topology over test sites, an application that keeps a table
and transmits every change, its full-sync provider, and what a sink's receive queue holds."""
from __future__ import annotations

from typing import Callable

import psycopg2

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.session.replicator import Replicator
from airflow_provider_lr.engine.session.runner import SessionSettings
from airflow_provider_lr.engine.sink.queue_rows import unpack
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.proto import lr_pb2

KIND = {
    lr_pb2.SNAPSHOT_SYNC_START: "start",
    lr_pb2.SNAPSHOT_SYNC: "snap",
    lr_pb2.LAST_FULL_SYNC_ENTRY: "end",
    lr_pb2.LOG_ENTRY_SYNC: "log",
}


def topology_doc(sites, replication: list[dict] | None = None, providers: dict | None = None,
                 settings: dict | None = None, conn_ids: Callable[[str], str] | None = None,
                 regions: dict[str, str] | None = None) -> dict:
    """The one topology document tests build: ``sites`` (their regions, or ``regions``; an Airflow
    connection id each with ``conn_ids``), by default the first site replicating client ``policy``
    to the others."""
    doc: dict = {
        "sites": [{"id": s.site_id, "region": (regions or {}).get(s.site_id, s.region),
                   **({"conn_id": conn_ids(s.site_id)} if conn_ids else {})} for s in sites],
        "replication": replication or [
            {"source": sites[0].site_id, "sinks": [s.site_id for s in sites[1:]], "clients": ["policy"]}],
        "settings": settings or {},
    }
    if providers:
        doc["providers"] = providers
    return doc


def apply(sites, replication: list[dict] | None = None, providers: dict | None = None, settings: dict | None = None,
          only=None) -> topology.Topology:
    """Apply a topology over ``sites`` (``topology_doc``) to all of them (or to the ``only`` ones)."""
    topo = topology.from_document(topology_doc(sites, replication, providers, settings))
    apply_to(only or sites, topo)
    return topo


def apply_to(sites, topo: topology.Topology) -> None:
    for site in sites:
        conn = site.connect()
        topology.apply_to_site(conn, topo, site.site_id)
        conn.close()


def replicator(topo, sites, providers: dict | None = None, owner: str | None = None, sessions=None,
               **settings) -> Replicator:
    dsns = {s.site_id: s.dsn for s in sites}
    options = {"data_timeout": 30.0, "barrier_timeout": 2.0, **settings}
    return Replicator(
        topo, lambda site_id: psycopg2.connect(dsns[site_id]), owner=owner,
        settings=SessionSettings(**options), providers=providers, sessions=sessions,
    )


class App:
    """A source application: a key/value table; every change is transmitted in the same transaction."""

    def __init__(self, site, client: str = "policy") -> None:
        self.site = site
        self.conn = site.connect()
        with self.conn.cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS app_state (k text PRIMARY KEY, v bigint NOT NULL)")
        self.conn.commit()
        self.client = RoutingQueueClient(self.conn, client)

    def put(self, key: str, value: int, destinations: list[str]) -> None:
        with self.conn.cursor() as cur:
            cur.execute(
                "INSERT INTO app_state VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (key, value)
            )
        self.client.transmit_log_entry_message(f"{key}={value}".encode(), destinations)
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


def table_provider(ctx) -> None:
    """Full-sync provider: every row of app_state, as of the supplying transaction's snapshot."""
    with ctx.conn.cursor() as cur:
        cur.execute("SELECT k, v FROM app_state ORDER BY k")
        for k, v in cur.fetchall():
            ctx.transmit(f"{k}={v}".encode())


def empty_provider(ctx) -> None:
    """A client with nothing to send in a full sync."""


def queue_entries(sink, client: str = "policy", source: str | None = None, visible_only: bool = True,
                  kind: int | None = None) -> list[tuple[int, bytes]]:
    """The one reader of a sink's receive queue: (kind, payload) of each undelivered entry, in sink
    order (rows are packed: ``queue_rows``). Checks that rows follow source order and that
    destinations were stripped."""
    rows = sink.query(
        "SELECT kind, source_site_id, source_position, source_entry_id, entry_count, delivered, message "
        "FROM lr.receive_queue WHERE client_name = %s AND (%s::text IS NULL OR source_site_id = %s)"
        " AND (%s::int IS NULL OR kind = %s)" + (" AND visible" if visible_only else "") + " ORDER BY seq",
        (client, source, source, kind, kind),
    )
    out, last = [], {}
    for row_kind, row_source, position, entry_id, count, delivered, message in rows:
        if row_kind == lr_pb2.LOG_ENTRY_SYNC:
            assert (position, entry_id) >= last.get(row_source, (position, entry_id)), "rows in source order"
            last[row_source] = (position, entry_id)
        for entry in unpack(count, bytes(message))[delivered:]:
            msg = lr_pb2.RoutingTableEntryMsg.FromString(entry)
            assert not msg.destinations, "destinations are stripped at the sink"
            out.append((row_kind, msg.opaque_payload))
    return out


def queue(sink, source: str | None = None, client: str = "policy", visible_only: bool = True) -> list[tuple[str, str]]:
    """(kind name, payload text) of every entry of the sink's receive queue, in sink order."""
    return [(KIND[k], p.decode()) for k, p in queue_entries(sink, client, source, visible_only)]


def sink_queue(sink, client: str, source: str = "site-a") -> list[bytes]:
    """The payloads of the sink's visible log entries from ``source`` for ``client``, in sink order."""
    return [p for _, p in queue_entries(sink, client, source, kind=lr_pb2.LOG_ENTRY_SYNC)]


def final_state(entries: list[tuple[str, str]]) -> dict[str, int]:
    """Apply a queue's payloads in order (full sync, then deltas) to get the sink's view of app_state."""
    state: dict[str, int] = {}
    for kind, payload in entries:
        if kind in ("snap", "log"):
            k, v = payload.split("=")
            state[k] = int(v)
    return state


def source_state(site) -> dict[str, int]:
    return dict(site.query("SELECT k, v FROM app_state"))


def many_rows_provider(ctx) -> None:
    """A full sync larger than one transfer chunk (engine.session.SNAPSHOT_CHUNK)."""
    for i in range(12_000):
        ctx.transmit(f"bulk{i}={i}".encode())


def run_crashing_replicator(topo, sites, fault: str, providers: dict[str, str] | None = None, cycles: int = 5,
                            settings: dict | None = None, timeout: float = 120):
    """Run a replicator in a child process that SIGKILLs itself at fault point ``fault``
    (``settings``: SessionSettings overrides, e.g. ``tee_min_backlog``)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    spec = {
        "topology": topo.document,
        "dsns": {s.site_id: s.dsn for s in sites},
        "providers": providers or {},
        "owner": f"crash-{fault}",
        "cycles": cycles,
        "settings": settings or {},
    }
    env = {**os.environ, "LR_FAULT": fault}
    return subprocess.run(
        [sys.executable, "-m", "tests.support.crash_runner", json.dumps(spec)],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=timeout,
    )


def drain(reader: LogReader, after: int = 0, **limits) -> tuple[list, int]:
    """Read everything available; returns (records, last end position)."""
    records = []
    while True:
        batch = reader.read(after, **limits)
        records += batch.records
        after = batch.end
        if not batch.has_more:
            return records, after
