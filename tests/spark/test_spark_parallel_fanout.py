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
    standalone_cluster,
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


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with standalone_cluster(
        tmp_path_factory.mktemp("spark-2h"), cores=1, memory="1g", workers=2, hosts=True
    ) as cluster:
        yield cluster


SPECULATION = {
    "spark.cores.max": "2",
    "spark.speculation": "true",
    "spark.speculation.interval": "100ms",
    "spark.speculation.quantile": "0.5",
    "spark.speculation.multiplier": "1.5",
    # a copy only after 8 s: the original attempt, whose executor may still be starting its Python
    # worker, has staged its chunk by then even on a loaded machine (else the copy stages it, also
    # correct but not this test); the stall (20 s) outlasts it
    "spark.speculation.minTaskRuntime": "8s",
}


@pytest.mark.slow
def test_a_stalled_task_is_speculated_on_the_other_host_and_each_entry_is_published_once(
    two_hosts, lr_sites, lr_connections, monkeypatch
):
    """Chunk 1's first attempt stalls 20 s after staging, before it publishes; Spark starts a
    speculative copy on the other worker's host, which finds the chunk staged, publishes it (and
    the chunks after it) and wins; the stalled attempt is killed or wakes to find nothing to do."""
    topo = in_log_entry_sync(lr_sites, clients=CLIENTS)
    expected = backlog(lr_sites, 4000)
    monkeypatch.setenv(FAULT_ENV, "fanout_after_stage_p1_a0:stall=20")
    spark = cluster_spark_session(two_hosts.url, "lr-staged-speculation", **SPECULATION)
    attempts: list[tuple[int, int, bool, list]] = []
    try:

        def speculative_map(plan):
            def stage(indexes):
                from pyspark import TaskContext

                ctx = TaskContext.get()
                for index in indexes:
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
