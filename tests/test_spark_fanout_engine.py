"""The fan-out engine without Spark (partitions staged by a local map): plan, idempotent staging,
fenced commit in source order. The Spark runs of the same functions are in test_spark_fanout.py."""
from __future__ import annotations

import pytest

from airflow_provider_lr.engine import fanout
from airflow_provider_lr.engine.errors import FencedError
from airflow_provider_lr.engine.topology import SessionKey
from tests.session_helpers import replicator
from tests.spark_support import (  # noqa: F401 (lr_connections is a fixture)
    expected_queue,
    in_log_entry_sync,
    lr_connections,
    sink_queue,
    transmit_backlog,
)

CLIENTS = ("policy", "audit")
SINKS = ("site-b", "site-c")


@pytest.fixture
def scenario(lr_sites, lr_connections):
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


def test_session_whose_lease_was_taken_over_is_fenced(scenario):
    topo, lr_sites = scenario
    source = lr_sites[0]
    transmit_backlog(source, 1000, clients=CLIENTS, per_txn=100)
    driver = fanout.FanoutDriver(topo, "site-a", owner="spark-driver")
    try:
        plan = driver.plan(partitions=2)
        # the fan-out's lease on site-b/policy expires and an in-process replicator takes over
        source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second' "
                     "WHERE sink_site_id = 'site-b' AND client_name = 'policy'")
        other = replicator(topo, lr_sites, owner="other", sessions=[SessionKey("site-a", "site-b", "policy")])
        other.run(max_cycles=3, until_idle=True, interval=0.01)
        staged = list(fanout.local_map(plan))
        result = driver.commit(plan, staged)
        stale = next(d for d in plan.demands if d.session == "site-b/policy")
        with pytest.raises(FencedError):  # the sink itself refuses the old epoch too
            fanout.commit_session(lr_sites[1].connect(), plan, stale)
        other.close()
    finally:
        driver.close()
    assert set(result.errors) == {"site-b/policy"} and "FencedError" in result.errors["site-b/policy"]
    assert set(result.deliveries) == {"site-b/audit", "site-c/policy", "site-c/audit"}
    assert_delivered_exactly(lr_sites)  # site-b/policy delivered once, by the replicator that took over


def test_backlog_per_session_decides_spark_or_in_process(scenario):
    topo, lr_sites = scenario
    conn = lr_sites[0].connect()
    assert not fanout.use_spark(fanout.session_backlogs(conn), threshold=500)
    transmit_backlog(lr_sites[0], 800, clients=CLIENTS, per_txn=100)
    backlogs = fanout.session_backlogs(conn)
    expected = {(s.site_id, c): len(expected_queue(lr_sites[0], s.site_id, c)) for s in lr_sites[1:] for c in CLIENTS}
    assert {(b.sink, b.client): b.entries for b in backlogs} == expected
    assert fanout.use_spark(backlogs, threshold=500) and not fanout.use_spark(backlogs, threshold=10_000)
    assert topo.setting("spark_min_backlog", fanout.SPARK_MIN_BACKLOG) == fanout.SPARK_MIN_BACKLOG
    conn.close()
