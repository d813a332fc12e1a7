"""Spark job: snapshot one client's federated tables from a source to the sinks that lack them.

    spark-submit spark_jobs/lr_table_snapshot.py --source SITE_ID --client NAME [--topology PATH]
                                                 [--parts N] [--result-file PATH]

A thin driver over ``airflow_provider_lr.engine.bulk.parallel_tables``: the driver takes the sessions'
leases, opens one exported snapshot of the tables on the source and cuts them into key ranges;
one Spark task per range joins that snapshot (``SET TRANSACTION SNAPSHOT``) and streams the range
by binary COPY into every sink that takes the table, each in one sink transaction that records the
range (a retried task skips what an earlier attempt wrote); the driver then records the tables
synced with the snapshot's split. Prints ``LR_RESULT {json}``; exits 1 on failure. Sites are
resolved from ``AIRFLOW_CONN_<ID>`` or ``$LR_CONNECTIONS_FILE``, never from argv.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lr_spark  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from airflow_provider_lr.engine.bulk import parallel_tables as parallel
from airflow_provider_lr.engine.store.topology import Topology  # noqa: E402
from airflow_provider_lr.engine.tables.range_copy import KeyRange, copy_range  # noqa: E402


def spark_map(spark: SparkSession) -> parallel.MapRanges:
    """One Spark task per key range (ranges of every table, written at every sink that takes it)."""

    def run(task: dict, ranges: Sequence[KeyRange]) -> list[int]:
        def write(parts: Iterable[KeyRange]) -> Iterator[int]:
            connect = parallel.connect_by_task(task)
            for part in parts:
                yield copy_range(task, part, connect)

        sc = spark.sparkContext
        sc.setJobDescription(f"lr table snapshot {task['run_id'][:8]} of {task['client']}: {len(ranges)} ranges")
        return sc.parallelize(list(ranges), max(1, len(ranges))).mapPartitions(write).collect()

    return run


def snapshot_tables(
    spark: SparkSession, topo: Topology, source: str, client: str, parts: int | None = None
) -> parallel.ParallelResult:
    warmup = lr_spark.warm_up(spark)
    result = parallel.run_table_snapshot(topo, source, client, spark_map(spark), parts=parts)
    result.seconds["warmup"] = warmup
    return result


def main(args: Any) -> dict[str, Any]:
    spark = lr_spark.spark_session(f"lr-table-snapshot-{args.source}-{args.client}")
    result = snapshot_tables(spark, lr_spark.load_topology(args.topology), args.source, args.client, args.parts)
    return {"ok": True, **result.as_dict()}  # a failure raises (lr_spark.run reports it, exit 1)


if __name__ == "__main__":
    p = lr_spark.parser(__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="site id of the source of the tables")
    p.add_argument("--client", required=True, help="the client whose federated tables are snapshotted")
    p.add_argument("--parts", type=lr_spark.count, default=None, help="key ranges per table (default: ~100k rows each)")
    sys.exit(lr_spark.run(main, p.parse_args()))
