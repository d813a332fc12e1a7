"""The fan-out engine without Spark (chunks teed by a local loop): plan, one fenced sink
transaction per session and chunk straight into the receive queue in source order, resume from
the sinks' positions, duplicates that write nothing twice. The Spark runs of the same functions are
in test_spark_fanout.py."""

from __future__ import annotations

import threading

import pytest

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.bulk.plan import ChunkResult
from airflow_provider_lr.engine.bulk.tee import tee_chunk
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session import catchup
from airflow_provider_lr.engine.session.settings import SPARK_MIN_BACKLOG, SessionSettings
from airflow_provider_lr.engine.source.backlog import (
    SessionBacklog,
    log_entry_backlog,
    session_backlogs,
    source_backlog,
)
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.proto import lr_pb2
from tests.support.session import replicator, sink_queue
from tests.support.spark_env import (  # noqa: F401 (lr_connections is a fixture)
    expected_queue,
    in_log_entry_sync,
    lr_connections,
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
        source.query(
            "UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second' "
            "WHERE sink_site_id = 'site-b' AND client_name = 'policy'"
        )
        other = replicator(topo, lr_sites, owner="other", sessions=[SessionKey("site-a", "site-b", "policy")])
        other.run(max_cycles=3, until_idle=True, interval=0.01)
        chunks = list(fanout.local_map(plan))
        result = driver.finish(plan, chunks)
        # a retry of chunk 0: the sink itself refuses the old epoch, the others already have it
        again = tee_chunk(plan, plan.ranges[0])
        other.close()
    finally:
        driver.close()
    assert (
        "FencedError" in chunks[0].errors["site-a->site-b/policy"]
        and "site-a->site-b/policy" not in chunks[1].delivered
    )
    assert set(again.errors) == {"site-a->site-b/policy"} and "FencedError" in again.errors["site-a->site-b/policy"]
    assert again.read == 0 and set(again.delivered.values()) == {0}
    assert set(result.errors) == {"site-a->site-b/policy"} and "FencedError" in result.errors["site-a->site-b/policy"]
    assert set(result.deliveries) == {"site-a->site-b/audit", "site-a->site-c/policy", "site-a->site-c/audit"}
    assert_delivered_exactly(lr_sites)  # site-b/policy delivered once, by the replicator that took over


def test_a_source_restarted_between_two_chunks_leaves_the_run_recorded_and_its_leases_released(scenario, site_manager):
    """The source's server stops (immediate) and starts again once the first chunk committed. The
    later chunks connect for themselves and deliver; the driver's own connection died with the
    server, and its end records every session's progress and releases the leases on a new one.
    Before, the run failed at its end ("connection already closed"), nothing recorded, and the
    leases stayed held: every other replicator kept off the sessions for ``lease_seconds``."""
    topo, lr_sites = scenario
    source = lr_sites[0]
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')  # the backlog survives
    transmit_backlog(source, 1500, clients=CLIENTS, per_txn=100)
    restarted: list[int] = []

    def restart() -> None:
        if not restarted:
            restarted.append(1)
            site_manager.down([source.site_id], mode="immediate")
            site_manager.up(site_ids=[source.site_id])

    driver = fanout.FanoutDriver(topo, "site-a", owner="spark-driver")
    try:
        with on_fault("fanout_after_commit_p0_a0", restart):
            result = fanout.run_fanout(driver, fanout.local_map, partitions=3)
    finally:
        driver.close()
    assert restarted and result.ok and result.partitions == 3, result.errors
    assert_delivered_exactly(lr_sites)
    held = source.query("SELECT sink_site_id, client_name, lease_owner, acked_position FROM lr.source_sessions")
    assert {(sink, client, owner) for sink, client, owner, _ in held} == {(s, c, None) for s in SINKS for c in CLIENTS}
    assert {acked for *_, acked in held} == {result.end}, held


def test_chunk_rerun_after_partial_commit_and_concurrent_duplicates_deliver_once(scenario):
    """A chunk committed on some sessions only (its task died between two commits) is rerun: the
    committed sessions are skipped, the others get it. Three concurrent attempts of the next chunk
    (speculative duplicates) wait on the session rows and deliver it once."""
    topo, lr_sites = scenario
    transmit_backlog(lr_sites[0], 2000, clients=CLIENTS, per_txn=100)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        plan = driver.plan(partitions=2)
        first, second = plan.ranges
        done_early = [d for d in plan.demands if d.sink == "site-b"]
        partial = tee_chunk(plan, first, exclude=[d.session for d in plan.demands if d.sink != "site-b"])
        assert set(partial.delivered) == {d.session for d in done_early}
        rerun = tee_chunk(plan, first)
        assert {s for s, n in rerun.delivered.items() if n} == {d.session for d in plan.demands if d.sink == "site-c"}
        assert all(rerun.delivered[d.session] == 0 for d in done_early)
        outcomes: list[ChunkResult] = []
        attempts = [threading.Thread(target=lambda: outcomes.append(tee_chunk(plan, second))) for _ in range(3)]
        for t in attempts:
            t.start()
        for t in attempts:
            t.join()
        result = driver.finish(plan, [partial, rerun, *outcomes])
    finally:
        driver.close()
    assert all(not o.errors for o in outcomes), [o.errors for o in outcomes]
    assert result.ok, result.errors
    assert_delivered_exactly(lr_sites)
    assert sum(result.deliveries.values()) == sum(len(sink_queue(s, c)) for s in lr_sites[1:] for c in CLIENTS)
    for sink in lr_sites[1:]:
        positions = sink.query(
            "SELECT DISTINCT last_log_entry_processed FROM lr.sink_sessions WHERE source_site_id = 'site-a'"
        )
        assert positions == [(plan.end,)], (sink.site_id, positions)


def test_a_chunk_that_cannot_start_where_its_sink_is_is_refused(scenario):
    """A session whose sink has not processed up to the chunk's start (an earlier chunk missing)
    is refused: nothing visible, no gap."""
    topo, lr_sites = scenario
    transmit_backlog(lr_sites[0], 600, clients=CLIENTS, per_txn=100)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        plan = driver.plan(partitions=3)
        out = tee_chunk(plan, plan.ranges[1])
    finally:
        driver.close()
    assert set(out.errors) == {d.session for d in plan.demands}
    assert all("StaleBatchError" in e for e in out.errors.values()) and out.read == 0
    assert all(sink_queue(s, c) == [] for s in lr_sites[1:] for c in CLIENTS)


@pytest.mark.parametrize(
    "fields",
    [
        dict(destinations=["site-b", "site-c"], type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"\n\x10x", client_name="p"),
        dict(destinations=["s" * 200], type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"long destination"),
        dict(destinations=["site-b"], opaque_payload=b"type 0 is not encoded"),
        dict(destinations=["site-b"], type=lr_pb2.LOG_ENTRY_SYNC),
        dict(destinations=["site-b"]),
        dict(),
    ],
)
def test_byte_level_strip_is_parse_and_serialize(fields):
    message = lr_pb2.RoutingTableEntryMsg(**fields).SerializeToString()
    assert vocabulary.strip_destinations(message) == vocabulary.rewrite_for_sink(message)


def test_backlog_per_session_decides_spark_or_in_process(scenario):
    topo, lr_sites = scenario
    conn = lr_sites[0].connect()
    settings = SessionSettings(spark_min_backlog=500, tee_min_backlog=0)

    def path(backlogs: list[SessionBacklog], rules: SessionSettings = settings) -> catchup.CatchupPath:
        return catchup.choose(log_entry_backlog(backlogs), rules, spark=lambda: None).path

    assert path(session_backlogs(conn)) is catchup.CatchupPath.SESSION_CYCLES
    transmit_backlog(lr_sites[0], 800, clients=CLIENTS, per_txn=100)
    backlogs = session_backlogs(conn)
    expected = {(s.site_id, c): len(expected_queue(lr_sites[0], s.site_id, c)) for s in lr_sites[1:] for c in CLIENTS}
    assert {(b.sink, b.client): b.entries for b in backlogs} == expected
    higher = SessionSettings(spark_min_backlog=10_000, tee_min_backlog=0)
    assert path(backlogs) is catchup.CatchupPath.SPARK
    assert path(backlogs, higher) is catchup.CatchupPath.SESSION_CYCLES
    assert SessionSettings.from_topology(topo).spark_min_backlog == SPARK_MIN_BACKLOG
    # counted only as far as a decision needs: each session stops at the cap, its oldest entries first
    capped = session_backlogs(conn, at_most=50)
    assert {(b.sink, b.client): b.entries for b in capped} == {k: min(n, 50) for k, n in expected.items()}
    assert all(c.highest <= b.highest for c, b in zip(capped, backlogs))
    assert source_backlog(conn, at_most=50) == sum(min(n, 50) for n in expected.values())
    conn.close()
