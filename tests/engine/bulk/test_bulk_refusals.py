"""The bulk movers say a session they could not take up is not done: the read-once fan-out (what
``lr sync``'s catch-up, the Spark job and ``LRFanOutOperator`` run) and the parallel table snapshot.
A session legitimately not theirs now is a skip; a refusal is an error, and the run is not ok."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.bulk import parallel_tables as parallel
from airflow_provider_lr.engine.errors import TopologyMismatchError
from tests.engine.site.test_roles import Roles, info_as
from tests.support.session import sink_queue
from tests.support.spark_env import (  # noqa: F401 (lr_connections is a fixture)
    expected_queue,
    in_log_entry_sync,
    lr_connections,
    transmit_backlog,
)


def _sink_c_runs_another_topology(lr_sites):
    topo = in_log_entry_sync(lr_sites)
    lr_sites[2].query("UPDATE lr.topology SET topology_config_id = 'other'")  # a sink set up elsewhere
    return topo


def test_fan_out_with_one_sink_refused_delivers_the_other_and_is_not_ok(lr_sites, lr_connections):
    topo = _sink_c_runs_another_topology(lr_sites)
    transmit_backlog(lr_sites[0], 40, per_txn=10)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        plan = driver.plan()
        # the refused session's lease is let go at once (kept, it held every mover off for the run)
        held = lr_sites[0].query("SELECT sink_site_id, lease_owner FROM lr.source_sessions ORDER BY 1")
        assert [(sink, owner == driver.owner) for sink, owner in held] == [("site-b", True), ("site-c", False)]
        result = driver.finish(plan, list(fanout.local_map(plan)))
    finally:
        driver.close()
    assert not result.ok and "site-a->site-c/policy" not in result.skipped  # before: skipped, ok True
    assert "topology config id mismatch" in result.errors["site-a->site-c/policy"], result.errors
    assert isinstance(driver.failures["site-a->site-c/policy"], TopologyMismatchError)
    assert result.deliveries["site-a->site-b/policy"] > 0 and "site-a->site-b/policy" not in result.errors
    assert sink_queue(lr_sites[1], "policy") == expected_queue(lr_sites[0], "site-b", "policy")
    assert sink_queue(lr_sites[2], "policy") == []


def test_table_snapshot_with_a_sink_refused_fails_naming_the_session(lr_sites, lr_connections):
    topo = _sink_c_runs_another_topology(lr_sites)
    with pytest.raises(TopologyMismatchError, match="session site-a->site-c/policy: topology config id mismatch"):
        parallel.run_table_snapshot(topo, "site-a", "policy", parallel.local_ranges)  # before: skipped, ok True


def test_fan_out_whose_source_read_fails_after_the_lease_releases_it_and_tries_the_next_session(
    lr_sites, lr_connections
):
    """A replicator login missing one grant the plan reads after the lease (the table registry):
    each session is an error naming it, and its lease is released (before, the failed read left
    the source's transaction aborted, the release failed on it and the lease stayed held)."""
    topo = in_log_entry_sync(lr_sites)
    made = Roles(lr_sites)
    try:
        role = made.name("repl")
        for site in lr_sites:
            made.grant(site, "replicator", role)
        lr_sites[0].query(f'REVOKE SELECT ON lr.registry FROM "{role}"')
        driver = fanout.FanoutDriver(topo, "site-a", conninfo=lambda site: info_as(_site(lr_sites, site), role))
        try:
            plan = driver.plan()
            held = lr_sites[0].query("SELECT sink_site_id, lease_owner FROM lr.source_sessions ORDER BY 1")
        finally:
            driver.close()
    finally:
        made.drop()
    assert not plan.demands and set(plan.errors) == {"site-a->site-b/policy", "site-a->site-c/policy"}
    assert all("permission denied for table registry" in e for e in plan.errors.values()), plan.errors
    assert held == [("site-b", None), ("site-c", None)], held


def _site(lr_sites, site_id: str):
    return next(s for s in lr_sites if s.site_id == site_id)
