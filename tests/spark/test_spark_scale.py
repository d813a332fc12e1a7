"""lr's full-sync transfer spread over a standalone cluster of 2 workers of 1 core each (the
session's, shared with the speculation test): both executors stage ranges at once, and the sink still gets every entry once, in order.
(The speed-up itself is measured by ``bench/snapshot_transfer_bench.py --master standalone:2``.)"""

from __future__ import annotations

import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.bulk import snapshot_transfer
from airflow_provider_lr.engine.source import full_sync
from tests.support.session import apply, queue
from tests.support.spark_env import cluster_spark_session, lr_connections  # noqa: F401

ROWS = 12_000


def rows_provider(ctx) -> None:
    for i in range(ROWS):
        ctx.transmit(f"row{i}={i}".encode())


@pytest.mark.slow
def test_a_full_sync_staged_by_two_executors_at_once_arrives_whole_and_in_order(
    two_host_cluster, lr_sites, lr_connections
):
    source, sink_b = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    conn = source.connect()
    request = full_sync.request_full_sync(conn, "site-b", "policy", reason="scale test")
    RoutingQueueClient(conn, "policy").serve_full_sync_requests(rows_provider)
    conn.close()
    assert len(two_host_cluster.status()["workers"]) == 2

    spark = cluster_spark_session(two_host_cluster.url, "lr-transfer-2w", **{"spark.cores.max": "2"})
    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy")
    staged: list[dict] = []
    try:

        def map_ranges(plan):
            def stage(parts):
                import time

                for part in parts:
                    started = time.time()
                    out = snapshot_transfer.stage_range(plan, part)
                    yield {**out, "started": started, "ended": time.time()}

            found = spark.sparkContext.parallelize(list(plan.ranges), len(plan.ranges)).mapPartitions(stage).collect()
            staged.extend(found)
            return found

        result = snapshot_transfer.run_transfer(job, map_ranges, request.request_id, partitions=4)
    finally:
        job.close()
        spark.stop()
    assert result.applied and result.transferred == ROWS + 2 and result.partitions == 4
    assert len({s["pid"] for s in staged}) == 2, "both workers' executors staged ranges"
    q = queue(sink_b, "site-a")
    assert q[0] == ("start", "") and q[-1] == ("end", "")
    assert [p for k, p in q if k == "snap"] == [f"row{i}={i}" for i in range(ROWS)]  # once each, in entry order
