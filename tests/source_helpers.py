"""Helpers for source-side tests: a topology over the test sites and a way to drain a reader."""
from __future__ import annotations

from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.source.log_reader import LogReader


def make_topology(sites) -> topology.Topology:
    return topology.from_document(
        {
            "sites": [{"id": s.site_id, "region": s.region} for s in sites],
            "replication": [{"source": sites[0].site_id, "sinks": [s.site_id for s in sites[1:]], "clients": ["policy"]}],
        }
    )


def apply_topology(sites) -> topology.Topology:
    topo = make_topology(sites)
    for site in sites:
        conn = site.connect()
        topology.apply_to_site(conn, topo, site.site_id)
        conn.close()
    return topo


def drain(reader: LogReader, after: int = 0, **limits) -> tuple[list, int]:
    """Read everything available; returns (records, last end position)."""
    records = []
    while True:
        batch = reader.read(after, **limits)
        records += batch.records
        after = batch.end
        if not batch.has_more:
            return records, after
