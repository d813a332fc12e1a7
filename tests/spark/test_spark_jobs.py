"""The snapshot-transfer and receive-queue apply jobs on a real local[2] Spark (one session)."""

from __future__ import annotations

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.bulk import snapshot_transfer
from airflow_provider_lr.engine.errors import LRError
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import apply, queue, replicator, sink_queue, table_provider
from tests.support.spark_env import (  # noqa: F401 (local_spark, lr_connections are fixtures)
    in_log_entry_sync,
    local_spark,
    lr_connections,
    transmit_backlog,
)

lr_snapshot_transfer = pytest.importorskip("spark_jobs.lr_snapshot_transfer")
lr_apply = pytest.importorskip("spark_jobs.lr_apply_receive_queue")

ROWS = 7_000


def rows_provider(ctx) -> None:
    for i in range(ROWS):
        ctx.transmit(f"row{i}={i}".encode())


def test_snapshot_transfer_in_parallel_resumes_and_hands_off(local_spark, lr_sites, lr_connections):
    source, sink_b = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    conn = source.connect()
    request = full_sync.request_full_sync(conn, "site-b", "policy", reason="test")
    RoutingQueueClient(conn, "policy").serve_full_sync_requests(rows_provider)
    conn.close()

    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy")
    try:
        plan = job.plan(request.request_id, partitions=3)
        assert plan.entries == ROWS + 2 and len(plan.ranges) == 3  # start and end markers included
        staged = snapshot_transfer.stage_range  # each range once in Spark, then range 1 again: a retried task
        results = local_spark.sparkContext.parallelize(list(plan.ranges), 3).map(lambda p: staged(plan, p)).collect()
        assert sum(r["staged"] for r in results) == ROWS + 2
        assert staged(plan, plan.ranges[1])["staged"] == results[1]["staged"]
        # nothing twice, and packed: far fewer rows than entries
        assert sink_b.query("SELECT sum(entry_count), count(*) < %s FROM lr.spark_staging", (ROWS // 10,))[0] == (
            ROWS + 2,
            True,
        )
        result = job.commit(plan)
    finally:
        job.close()
    assert result.applied and result.transferred == ROWS + 2
    q = queue(sink_b, "site-a")
    assert q[0] == ("start", "") and q[-1] == ("end", "")
    assert [p for k, p in q if k == "snap"] == [f"row{i}={i}" for i in range(ROWS)]  # entry order
    assert sink_b.query("SELECT count(*) FROM lr.spark_staging")[0][0] == 0
    assert full_sync.get_request(source.connect(), request.request_id).status == "applied"

    transmit_backlog(source, 50, sinks=("site-b",))  # the hand-off: deltas follow in-process
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    repl.close()
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == [f"policy:{n}" for n in range(50)]

    with pytest.raises(LRError, match="no supplied full-sync request"):  # nothing left to transfer
        lr_snapshot_transfer.transfer(local_spark, topo, SessionKey("site-a", "site-b", "policy"))


def test_apply_receive_queue_in_source_order_with_delete_in_the_same_transaction(local_spark, lr_sites, lr_connections):
    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(lr_sites[0], 1200, per_txn=100)
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=5, until_idle=True, interval=0.01)
    repl.close()
    sink_b = lr_sites[1]
    expected = [p.decode() for p in sink_queue(sink_b, "policy")]
    assert len(expected) > 300

    with lr_sites[0].connect() as conn:  # a poisoned entry, after everything else
        RoutingQueueClient(conn, "policy").transmit_log_entry_message(b"policy:poison", ["site-b"])
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    repl.close()

    result = lr_apply.apply_queues(
        local_spark, topo, "site-b", "policy", "tests.support.spark_env:record_applied", batch=100
    )
    assert not result["ok"] and "poison" in result["errors"]["site-a"]
    applied = [p for (p,) in sink_b.query("SELECT payload FROM applied WHERE kind = 'log' ORDER BY n")]
    kept = [p.decode() for p in sink_queue(sink_b, "policy")]
    # applied in source order, each once; the failed run (the poison and the entries batched with
    # it) rolled back with its delete: still queued, none of it applied
    assert applied + kept == expected + ["policy:poison"]
    assert len(applied) >= len(expected) - 100 and kept[-1] == "policy:poison"
    kinds = [k for (k,) in sink_b.query("SELECT kind FROM applied ORDER BY n")]
    assert kinds[:2] == ["snapshot_start", "snapshot_complete"]  # the empty full sync came first


def test_a_range_read_by_a_parallel_plan_on_the_source_is_still_packed_in_entry_order(lr_sites, lr_connections):
    """The source's planner may split a range's read over parallel workers (a big request, or as
    here every cost set to favour it): the staged packs must still hold the entries in entry order."""
    source, sink_b = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    conn = source.connect()
    request = full_sync.request_full_sync(conn, "site-b", "policy", reason="parallel plan")
    RoutingQueueClient(conn, "policy").serve_full_sync_requests(rows_provider)
    conn.close()
    settings = {
        "max_parallel_workers_per_gather": 4,
        "parallel_setup_cost": 0,
        "parallel_tuple_cost": 0,
        "min_parallel_table_scan_size": 0,
        "enable_indexscan": "off",
        "enable_bitmapscan": "off",
        "enable_nestloop": "off",
        "parallel_leader_participation": "off",
    }
    for name, value in settings.items():
        source.query(f"ALTER DATABASE {source.dbname} SET {name} = {value}")
    # the range's entries all have one tx, so the join to its commit has no join clause left: a nested
    # loop, whose inner side would start a parallel scan of log_commits per entry (minutes, not ms)
    source.query("ALTER TABLE lr.log_commits SET (parallel_workers = 0)")
    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy")
    try:
        plan = job.plan(request.request_id, partitions=1)
        snapshot_transfer.stage_range(plan, plan.ranges[0])
        result = job.commit(plan)
    finally:
        job.close()
        source.query(f"ALTER DATABASE {source.dbname} RESET ALL")
    assert result.applied
    assert [p for k, p in queue(sink_b, "site-a") if k == "snap"] == [f"row{i}={i}" for i in range(ROWS)]


@pytest.mark.parametrize("then", ["a newer sync starts", "the same sync is applied in process"])
def test_an_abandoned_spark_transfer_leaves_nothing_staged_once_the_session_moves_on(lr_sites, lr_connections, then):
    """A transfer job that died after staging part of its sync (never committed): its staged rows
    are dropped when the session moves on, whichever way, and the sink gets every row once."""
    source, sink_b = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    conn = source.connect()
    client = RoutingQueueClient(conn, "policy")
    request = full_sync.request_full_sync(conn, "site-b", "policy", reason="to be abandoned on Spark")
    client.serve_full_sync_requests(rows_provider)
    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy")
    try:
        plan = job.plan(request.request_id, partitions=2)
        snapshot_transfer.stage_range(plan, plan.ranges[0])  # one task done, then the job is gone
    finally:
        job.close()
    assert sink_b.query("SELECT count(*) > 0 FROM lr.spark_staging")[0][0]
    if then == "a newer sync starts":
        full_sync.request_full_sync(conn, "site-b", "policy", reason="a newer sync")
        client.serve_full_sync_requests(rows_provider)
    conn.close()

    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=5, until_idle=True, interval=0.01)
    repl.close()
    assert [p for k, p in queue(sink_b, "site-a") if k == "snap"] == [f"row{i}={i}" for i in range(ROWS)]
    assert sink_b.query(
        "SELECT (SELECT count(*) FROM lr.spark_staging), (SELECT count(*) FROM lr.spark_staged_ranges)"
    )[0] == (0, 0)


def test_a_source_restarted_before_a_spark_transfers_commit_leaves_its_lease_released(
    lr_sites, lr_connections, site_manager
):
    """The transfer job staged every range when the source's server stops (immediate) and starts
    again: its commit fails on the connection that died with the server, and its end releases the
    session's lease on a new one, so the next cycle takes the session at once and applies the
    sync. Before, the lease stayed held and kept every replicator off it for ``lease_seconds``."""
    from tests.spark.test_handoff_matrix_spark import ROWS, supplied_for_spark

    source, sink_b = lr_sites[0], lr_sites[1]
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')  # the supplied sync survives
    topo, app, request = supplied_for_spark(lr_sites)
    app.close()
    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy", owner="spark-driver")
    try:
        plan = job.plan(request.request_id, partitions=2)
        for part in plan.ranges:
            snapshot_transfer.stage_range(plan, part)
        site_manager.down([source.site_id], mode="immediate")
        site_manager.up(site_ids=[source.site_id])
        with pytest.raises(psycopg2.Error):
            job.commit(plan)
    finally:
        job.close()
    assert source.query("SELECT lease_owner FROM lr.source_sessions") == [(None,)]
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        (report,) = repl.run_cycle()
    finally:
        repl.close()
    assert not report.error and not report.skipped and report.state == "IN_LOG_ENTRY_SYNC", report
    assert [k for k, _ in queue(sink_b, "site-a")].count("snap") == ROWS
    assert full_sync.get_request(source.connect(), request.request_id).status == "applied"
