"""lr's Spark path on a real standalone cluster: executor Python partitions COPY into PostgreSQL.

There is no JDBC driver (no Maven), so all PostgreSQL I/O from Spark happens in Python partitions
with psycopg2. This proves that path end to end on a ``spark://`` master: separate executor
processes, running the venv's Python, write rows with COPY into a real embedded server.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from collections.abc import Callable, Iterator

import psycopg2
import pyarrow as pa
from pyspark.sql import functions as F

from tests.support.spark_env import (
    StandaloneCluster,
    cluster_spark_session,
    local_spark_session,
)

ROWS = 20_000
RESULT_SCHEMA = "rows long, pid int, python string"


def copy_into_postgres(dsn: str, table: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: COPY each partition's (id, payload) into ``table`` in one transaction."""

    def copy(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        conn = psycopg2.connect(dsn)
        rows = 0
        try:
            with conn, conn.cursor() as cur:
                for batch in batches:
                    buf = io.StringIO()
                    for id_, payload in zip(batch.column("id").to_pylist(), batch.column("payload").to_pylist()):
                        buf.write(f"{id_}\t\\\\x{payload.hex()}\n")  # text COPY: bytea as \x hex
                    buf.seek(0)
                    cur.copy_expert(f"COPY {table} (id, payload) FROM STDIN", buf)
                    rows += batch.num_rows
        finally:
            conn.close()
        yield pa.RecordBatch.from_pydict(
            {"rows": [rows], "pid": [os.getpid()], "python": [sys.executable]},
            schema=pa.schema([("rows", pa.int64()), ("pid", pa.int32()), ("python", pa.string())]),
        )

    return copy


def test_cluster_executors_copy_into_postgres(spark_cluster: StandaloneCluster, sites) -> None:
    site = sites[0]
    site.query("CREATE TABLE spark_copy (id bigint PRIMARY KEY, payload bytea NOT NULL)")

    spark = cluster_spark_session(spark_cluster.url)
    try:
        assert spark.sparkContext.master == spark_cluster.url
        apps = [app["name"] for app in spark_cluster.status()["activeapps"]]
        assert "lr-tests-cluster" in apps, apps

        frame = spark.range(0, ROWS, numPartitions=4).select(
            F.col("id"), F.unhex(F.sha2(F.col("id").cast("string"), 256)).alias("payload")
        )
        results = frame.mapInArrow(copy_into_postgres(site.dsn, "spark_copy"), RESULT_SCHEMA).collect()
    finally:
        spark.stop()

    assert len(results) == 4  # one summary per partition
    assert sum(r.rows for r in results) == ROWS
    assert {r.python for r in results} == {sys.executable}  # executors run the venv's Python
    assert os.getpid() not in {r.pid for r in results}  # ... in executor processes, not the driver

    count, distinct, total_bytes = site.query(
        "SELECT count(*), count(DISTINCT payload), sum(length(payload)) FROM spark_copy"
    )[0]
    assert (count, distinct, total_bytes) == (ROWS, ROWS, 32 * ROWS)
    (payload,) = site.query("SELECT payload FROM spark_copy WHERE id = 12345")[0]
    assert bytes(payload) == hashlib.sha256(b"12345").digest()


def test_local_session_is_small_and_replaced_by_a_cluster_session(spark_cluster: StandaloneCluster) -> None:
    local = local_spark_session()
    assert local.sparkContext.master == "local[2]"
    assert local.conf.get("spark.sql.shuffle.partitions") == "2"
    assert local.conf.get("spark.ui.enabled") == "false"
    assert local.range(1000).selectExpr("sum(id)").first()[0] == 499500
    spark = cluster_spark_session(spark_cluster.url)  # a different master: the local context is stopped
    try:
        assert spark.sparkContext.master == spark_cluster.url
    finally:
        spark.stop()
