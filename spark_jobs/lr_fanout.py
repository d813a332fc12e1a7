"""Spark job: read-once fan-out of one source's shared log to every sink in log-entry sync.

    spark-submit spark_jobs/lr_fanout.py --source SITE_ID [--topology PATH] [--max-entries N]
                                         [--partitions N] [--tasks N] [--result-file PATH]

A thin driver over ``airflow_provider_lr.engine.bulk.fanout``: plan (leases, demands, position
chunks) on the driver, then either one Spark task tees the source's chunks in order (``bulk.tee``,
``--tasks 1``): each chunk is read once (binary COPY) and streamed straight into every demanding
session's receive queue inside one fenced sink transaction per session; or ``--tasks N`` tasks tee
chunks at once (``bulk.staged_tee``): each stages its chunk on the sinks and publishes whatever
continues each sink's position, so entries still become visible in source order, once. A retried
or speculative task resumes from what the sinks committed. Prints ``LR_RESULT {json}`` (deliveries per session, timings, peak memory; also written
to ``--result-file`` when given); exits 1 if any session failed. Sites are resolved from
``AIRFLOW_CONN_<ID>`` or ``$LR_CONNECTIONS_FILE``, never from argv.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lr_spark  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from airflow_provider_lr.engine.bulk import fanout  # noqa: E402
from airflow_provider_lr.engine.bulk.peak_memory import ancestor_peak_kb  # noqa: E402
from airflow_provider_lr.engine.bulk.plan import ChunkResult, FanoutPlan, FanoutResult  # noqa: E402
from airflow_provider_lr.engine.bulk.staged_tee import stage_chunk  # noqa: E402
from airflow_provider_lr.engine.bulk.tee import tee_chunks  # noqa: E402
from airflow_provider_lr.engine.session import catchup  # noqa: E402
from airflow_provider_lr.engine.session.settings import SessionSettings  # noqa: E402
from airflow_provider_lr.engine.store.topology import Topology  # noqa: E402


def spark_map(spark: SparkSession) -> fanout.MapChunks:
    """One Spark task per source tees its chunks in order; only small summaries come back.

    A source's chunks must commit in order on each sink, so they are not spread over tasks: the
    parallelism is the sinks' concurrent ingest (a sender thread per session) next to the source's
    read. Fan-outs of different sources are different jobs and run side by side."""

    def run(plan: FanoutPlan) -> list[ChunkResult]:
        def tee(_: Iterable[int]) -> Iterator[ChunkResult]:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            attempt = ctx.attemptNumber() if ctx is not None else 0
            for chunk in tee_chunks(plan, attempt):
                chunk.jvm_peak_kb, chunk.attempt = ancestor_peak_kb("java"), attempt
                yield chunk

        sc = spark.sparkContext
        sc.setJobDescription(f"lr fan-out {plan.plan_id[:8]} of {plan.source}: {len(plan.ranges)} chunks")
        return sc.parallelize([0], 1).mapPartitions(tee).collect()

    return run


def staged_map(spark: SparkSession) -> fanout.MapChunks:
    """A Spark task per chunk, run at once (as many as the cluster has cores): each stages its
    chunk and publishes what continues each sink's position (``bulk/staged_tee.py``)."""

    def run(plan: FanoutPlan) -> list[ChunkResult]:
        def stage(indexes: Iterable[int]) -> Iterator[ChunkResult]:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            attempt = ctx.attemptNumber() if ctx is not None else 0
            for index in indexes:
                chunk = stage_chunk(plan, plan.ranges[index], f"_p{index}_a{attempt}")
                chunk.jvm_peak_kb, chunk.attempt = ancestor_peak_kb("java"), attempt
                yield chunk

        sc = spark.sparkContext
        sc.setJobDescription(f"lr staged fan-out {plan.plan_id[:8]} of {plan.source}: {len(plan.ranges)} chunks")
        return sc.parallelize(range(len(plan.ranges)), len(plan.ranges)).mapPartitions(stage).collect()

    return run


def fan_out(
    spark: SparkSession,
    topo: Topology,
    source: str,
    max_entries: int | None = None,
    partitions: int | None = None,
    tasks: int = 1,
) -> FanoutResult:
    """One fan-out run of ``source`` on ``spark`` (``tasks`` > 1: that many chunks teed at once,
    staged); the sessions' leases are released at the end."""
    warmup = lr_spark.warm_up(spark)
    driver = fanout.FanoutDriver(topo, source)
    try:
        mapper = staged_map(spark) if tasks > 1 else spark_map(spark)
        result = fanout.run_fanout(driver, mapper, max_entries, partitions, tasks)
    finally:
        driver.close()
    result.peak_rss_kb["driver_jvm"] = lr_spark.jvm_peak_kb(spark)
    result.seconds["warmup"] = warmup
    return result


def main(args: Any) -> dict[str, Any]:
    spark = lr_spark.spark_session(f"lr-fanout-{args.source}")
    topo = lr_spark.load_topology(args.topology)
    settings = SessionSettings.from_topology(topo)
    tasks = args.tasks or catchup.fanout_tasks(settings, spark.sparkContext.defaultParallelism)
    result = fan_out(spark, topo, args.source, args.max_entries, args.partitions, tasks)
    return result.as_dict()


if __name__ == "__main__":
    p = lr_spark.parser(__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="site id of the source whose log is fanned out")
    p.add_argument("--max-entries", type=lr_spark.count, default=None, help="move at most about this many log entries")
    p.add_argument("--partitions", type=lr_spark.count, default=None, help="position chunks (default: by size)")
    p.add_argument(
        "--tasks",
        type=lr_spark.count,
        default=None,
        help="chunks teed at once (1: in order, unstaged; default: the topology's fanout_tasks, "
        "else the cluster's cores from 4 of them, else 1)",
    )
    sys.exit(lr_spark.run(main, p.parse_args()))
