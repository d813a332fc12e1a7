"""Spark job: apply a sink's receive queues for one client with a user function, in bulk.

    spark-submit spark_jobs/lr_apply_receive_queue.py --sink SITE --client NAME
        --function package.module:function [--batch N] [--topology PATH]

One Spark task per source queue (``LRQ_Recv_<client>_<source>``): sessions are independent, and
within one the entries are applied in source order, each run in one sink transaction with the
delete of what it applied (``airflow_provider_lr.engine.sink.bulk_apply``). Prints ``LR_RESULT {json}``
with the entries applied per source; exits 1 if any queue failed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lr_spark  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from airflow_provider_lr.engine.db.conninfo import connect_dsn  # noqa: E402
from airflow_provider_lr.engine.db.timeouts import Purpose  # noqa: E402
from airflow_provider_lr.engine.sink import (
    bulk_apply,
    receive,  # noqa: E402
)
from airflow_provider_lr.engine.store.topology import Topology, site_conninfo  # noqa: E402


def apply_queues(
    spark: SparkSession,
    topo: Topology,
    sink: str,
    client: str,
    function: str,
    batch: int = bulk_apply.DEFAULT_APPLY_BATCH,
) -> dict[str, Any]:
    bulk_apply.load_apply_function(function)  # fail early, on the driver, if it cannot be loaded
    info = site_conninfo(topo, sink)
    dsn = info.dsn_for(Purpose.APPLICATION)  # the user's function writes in the queue's transaction
    conn = info.connect()
    try:
        sources = receive.discover(conn, client)
    finally:
        conn.close()
    if not sources:
        return {"ok": True, "sink": sink, "client": client, "applied": {}}

    def apply(names: Iterable[str]) -> Iterator[tuple[str, int, str]]:
        fn = bulk_apply.load_apply_function(function)
        for source in names:
            queue_conn = connect_dsn(dsn, Purpose.APPLICATION)
            try:
                yield source, bulk_apply.apply_queue(queue_conn, client, source, fn, batch), ""
            except Exception as exc:  # reported per queue; the others go on
                yield source, -1, f"{type(exc).__name__}: {exc}"
            finally:
                queue_conn.close()

    outcomes = spark.sparkContext.parallelize(sources, len(sources)).mapPartitions(apply).collect()
    errors = {s: e for s, _, e in outcomes if e}
    return {
        "ok": not errors,
        "sink": sink,
        "client": client,
        "errors": errors,
        "applied": {s: n for s, n, e in outcomes if not e},
    }


def main(args: Any) -> dict[str, Any]:
    spark = lr_spark.spark_session(f"lr-apply-{args.sink}-{args.client}")
    return apply_queues(spark, lr_spark.load_topology(args.topology), args.sink, args.client, args.function, args.batch)


if __name__ == "__main__":
    p = lr_spark.parser(__doc__.splitlines()[0])
    p.add_argument("--sink", required=True)
    p.add_argument("--client", required=True)
    p.add_argument("--function", required=True, help="apply function as package.module:function")
    p.add_argument("--batch", type=lr_spark.count, default=bulk_apply.DEFAULT_APPLY_BATCH)
    sys.exit(lr_spark.run(main, p.parse_args()))
