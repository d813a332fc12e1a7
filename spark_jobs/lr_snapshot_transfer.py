"""Spark job: move one session's full-sync data (LRQ_Send_SnapSync) to its sink, in parallel.

    spark-submit spark_jobs/lr_snapshot_transfer.py --source SITE --sink SITE --client NAME
        [--request-id UUID] [--partitions N] [--no-apply] [--topology PATH]

A thin driver over ``airflow_provider_lr.engine.bulk.snapshot_transfer``: the driver records the
snapshot start on the sink and cuts the supplied request's entries into entry-id ranges; one
Spark task per range packs it into receive-queue rows and stages them on the sink; the driver then
moves the staged rows into the receive queue in entry order, server-side, in one fenced sink
transaction, and applies the snapshot. Rerunning after any failure resumes. Prints
``LR_RESULT {json}``; exits 1 on failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lr_spark  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from airflow_provider_lr.engine.bulk import snapshot_transfer as transfers  # noqa: E402
from airflow_provider_lr.engine.store.topology import Topology  # noqa: E402
from airflow_provider_lr.engine.vocabulary import SessionKey  # noqa: E402


def transfer(
    spark: SparkSession,
    topo: Topology,
    key: SessionKey,
    request_id: str | None = None,
    partitions: int | None = None,
    apply: bool = True,
) -> transfers.SnapshotResult:
    def map_ranges(plan: transfers.SnapshotPlan) -> list[dict]:
        def stage(parts: Iterable[transfers.EntryRange]) -> Iterator[dict]:
            for part in parts:
                yield transfers.stage_range(plan, part)

        return spark.sparkContext.parallelize(list(plan.ranges), len(plan.ranges)).mapPartitions(stage).collect()

    job = transfers.SnapshotTransfer(topo, key.source, key.sink, key.client)
    try:
        return transfers.run_transfer(
            job, map_ranges, request_id, partitions or spark.sparkContext.defaultParallelism, apply
        )
    finally:
        job.close()


def main(args: Any) -> dict[str, Any]:
    spark = lr_spark.spark_session(f"lr-snapshot-{args.source}-{args.sink}")
    result = transfer(
        spark,
        lr_spark.load_topology(args.topology),
        SessionKey(args.source, args.sink, args.client),
        args.request_id,
        args.partitions,
        not args.no_apply,
    )
    return result.as_dict()


if __name__ == "__main__":
    p = lr_spark.parser(__doc__.splitlines()[0])
    p.add_argument("--source", required=True)
    p.add_argument("--sink", required=True)
    p.add_argument("--client", required=True)
    p.add_argument("--request-id", default=None, help="the supplied full-sync request (default: the open one)")
    p.add_argument("--partitions", type=lr_spark.count, default=None)
    p.add_argument("--no-apply", action="store_true", help="transfer only; the session cycle applies it")
    sys.exit(lr_spark.run(main, p.parse_args()))
