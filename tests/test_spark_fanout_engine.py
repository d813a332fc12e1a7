"""The fan-out engine without Spark (partitions staged by a local map): plan, idempotent staging,
fenced commit in source order. The Spark runs of the same functions are in test_spark_fanout.py."""
from __future__ import annotations

import pytest

from airflow_provider_lr.engine import fanout
from tests.spark_support import expected_queue, in_log_entry_sync, sink_queue, transmit_backlog, write_connections_file

CLIENTS = ("policy", "audit")
SINKS = ("site-b", "site-c")


@pytest.fixture
def scenario(lr_sites, tmp_path, monkeypatch):
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(write_connections_file(tmp_path / "conns.json", lr_sites)))
    topo = in_log_entry_sync(lr_sites, clients=CLIENTS)
    return topo, lr_sites


def assert_delivered_exactly(lr_sites):
    source = lr_sites[0]
    for sink in lr_sites[1:]:
        for client in CLIENTS:
            assert sink_queue(sink, client) == expected_queue(source, sink.site_id, client), (sink.site_id, client)


def test_fanout_delivers_each_sink_its_subset_in_source_order(scenario):
    topo, lr_sites = scenario
    transmit_backlog(lr_sites[0], 3000, clients=CLIENTS, per_txn=300)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        result = fanout.run_fanout(driver, fanout.local_map, partitions=3)
    finally:
        driver.close()
    assert result.ok, result.errors
    assert result.partitions == 3 and result.entries_read == 3000
    assert_delivered_exactly(lr_sites)
    assert sum(result.deliveries.values()) == sum(len(sink_queue(s, c)) for s in lr_sites[1:] for c in CLIENTS)
