"""The staged fan-out on real Spark: chunks teed by several tasks at once stay exactly once and in
source order per session while tasks are killed and retried (local[2] with retries) or speculated
(a standalone cluster of 2 workers on 2 loopback hosts, ``spark.speculation`` on with aggressive
settings, one task stalled). A reader checks all along that each sink only ever shows a prefix of
the source order."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.bulk.staged_tee import stage_chunk
from airflow_provider_lr.engine.faults import FAULT_ENV
from tests.support.session import sink_queue
from tests.support.spark_env import (  # noqa: F401 (lr_connections is a fixture)
    cluster_spark_session,
    expected_queue,
    in_log_entry_sync,
    local_spark_session,
    lr_connections,
    prefixes_only,
    transmit_backlog,
)

lr_fanout = pytest.importorskip("spark_jobs.lr_fanout")

CLIENTS = ("policy", "audit")


def delivered_once_in_order(lr_sites, expected, result) -> None:
    assert result.ok, result.errors
    for sink in lr_sites[1:]:
        for client in CLIENTS:
            assert sink_queue(sink, client) == expected[(sink.site_id, client)], (sink.site_id, client)
        assert sink.query("SELECT count(*) FROM lr.spark_staging")[0][0] == 0
        assert sink.query("SELECT count(*) FROM lr.spark_staged_ranges")[0][0] == 0
    assert sum(result.deliveries.values()) == sum(len(v) for v in expected.values())


def backlog(lr_sites, entries: int) -> dict:
    transmit_backlog(lr_sites[0], entries, clients=CLIENTS, per_txn=100)
    return {(s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS}


@pytest.fixture(scope="module")
def retrying_spark():
    """local[2] that retries a failed task up to 3 times (plain local[N] fails the job at once)."""
    session = local_spark_session("lr-staged-fanout", master="local[2,3]")
    yield session
    session.stop()


@pytest.mark.parametrize("fault", ["fanout_mid_write_p1_a0", "fanout_after_stage_p0_a0", "fanout_after_commit_p2_a0"])
def test_tasks_killed_and_retried_deliver_once_in_source_order(
    retrying_spark, lr_sites, lr_connections, monkeypatch, fault
):
    """The Python worker of one task attempt SIGKILLs itself: mid-read with its stages open, after
    its stage committed but before it published, or after it published; Spark retries the task and
    the run ends with every entry visible once, in order, and nothing left staged."""
    topo = in_log_entry_sync(lr_sites, clients=CLIENTS)
    expected = backlog(lr_sites, 3000)
    monkeypatch.setenv(FAULT_ENV, fault)
    with prefixes_only(lr_sites, expected, CLIENTS) as violations:
        result = lr_fanout.fan_out(retrying_spark, topo, "site-a", partitions=4, tasks=2)
    assert violations == []
    assert result.retried == 1, "the attempt was killed at the fault point and its task retried"
    assert result.partitions == 4 and result.entries_read <= 3000  # a retry reads only what is not staged
    delivered_once_in_order(lr_sites, expected, result)


SPECULATION = {
    "spark.cores.max": "2",
    "spark.speculation": "true",
    "spark.speculation.interval": "100ms",
    "spark.speculation.quantile": "0.5",
    "spark.speculation.multiplier": "1.5",
    # a copy after 2 s; it waits until the original attempt has staged its chunk (``until_staged``:
    # that executor may still be starting its Python worker on a loaded machine), then finds nothing
    # to stage; the stall (20 s from the staging) outlasts it
    "spark.speculation.minTaskRuntime": "2s",
}


def until_staged(plan, part, timeout: float = 90.0) -> None:
    """Wait until every session that needs chunk ``part`` has it staged (or published): what a
    task's own staging finds done (``staged_tee.SessionStage``), polled without its lock."""
    import time

    import psycopg2

    from airflow_provider_lr.engine.store import sink_sessions

    deadline = time.monotonic() + timeout
    for demand in plan.demands:
        if demand.position.after >= part.hi:
            continue
        conn = psycopg2.connect(plan.sink_dsns[demand.sink])
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                while time.monotonic() < deadline:
                    if sink_sessions.last_processed(cur, plan.source, demand.client) >= part.hi:
                        break
                    cur.execute(
                        "SELECT 1 FROM lr.spark_staged_ranges WHERE source_site_id = %s AND client_name = %s "
                        "AND plan_id = %s AND range_lo = %s",
                        (plan.source, demand.client, plan.plan_id, max(part.lo, demand.position.after)),
                    )
                    if cur.fetchone():
                        break
                    time.sleep(0.1)
        finally:
            conn.close()


@pytest.mark.slow
def test_a_stalled_task_is_speculated_on_the_other_host_and_each_entry_is_published_once(
    two_host_cluster, lr_sites, lr_connections, monkeypatch
):
    """Chunk 1's first attempt stalls 20 s after staging, before it publishes; Spark starts a
    speculative copy on the other worker's host, which (once the first attempt staged) finds the
    chunk staged, publishes it (and the chunks after it) and wins; the stalled attempt is killed
    or wakes to find nothing to do."""
    topo = in_log_entry_sync(lr_sites, clients=CLIENTS)
    expected = backlog(lr_sites, 4000)
    monkeypatch.setenv(FAULT_ENV, "fanout_after_stage_p1_a0:stall=20")
    spark = cluster_spark_session(two_host_cluster.url, "lr-staged-speculation", **SPECULATION)
    attempts: list[tuple[int, int, bool, list]] = []
    try:

        def speculative_map(plan):
            def stage(indexes):
                from pyspark import TaskContext

                ctx = TaskContext.get()
                for index in indexes:
                    if ctx.attemptNumber() > 0:  # a speculative copy: once the original staged
                        until_staged(plan, plan.ranges[index])
                    chunk = stage_chunk(plan, plan.ranges[index], f"_p{index}_a{ctx.attemptNumber()}")
                    yield ctx.attemptNumber(), chunk

            ran = (
                spark.sparkContext.parallelize(range(len(plan.ranges)), len(plan.ranges)).mapPartitions(stage).collect()
            )
            attempts.extend((a, c.index, bool(c.staged), sorted(c.staged)) for a, c in ran)
            return [c for _, c in ran]

        driver = fanout.FanoutDriver(topo, "site-a")
        try:
            with prefixes_only(lr_sites, expected, CLIENTS) as violations:
                result = fanout.run_fanout(driver, speculative_map, partitions=4, tasks=2)
        finally:
            driver.close()
    finally:
        spark.stop()
    assert violations == []
    winner = {index: (attempt, staged) for attempt, index, staged, _ in attempts}
    assert winner[1] == (1, False), f"chunk 1 done by a speculative attempt that staged nothing: {attempts}"
    delivered_once_in_order(lr_sites, expected, result)
