"""N tables' definitions (shape and extras) read at a source one by one, four statements a table (as a
snapshot's start did before round 16), and in one read (``read_definitions``, now): on one embedded
server, in a REPEATABLE READ transaction as the snapshot's. ``python bench/table_definitions_bench.py [N]``
(default 200); docs/scale-bench.md has the figures."""

import sys
import tempfile
import time
from pathlib import Path

import psycopg2

from airflow_provider_lr.embedded.sites import SiteManager
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.tables import extras as table_extras
from airflow_provider_lr.engine.tables.definition import (
    SHAPE_COLUMNS,
    TableDefinition,
    TableName,
    read_definitions,
    shape,
)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
m = SiteManager(Path(tempfile.mkdtemp(prefix="lr-defs-bench-")))
m.up(count=1)
try:
    site = m.sites()[0]
    conn = psycopg2.connect(site.dsn())
    conn.autocommit = True
    conn.cursor().execute("DROP DATABASE IF EXISTS defs WITH (FORCE)")
    conn.cursor().execute("CREATE DATABASE defs")
    conn.close()
    conn = psycopg2.connect(site.dsn("defs"))
    schema.init_site(conn, "site-a", "r1")
    with conn.cursor() as cur:
        for i in range(N):
            cur.execute(
                f"CREATE TABLE public.t{i} (id serial PRIMARY KEY, v int NOT NULL DEFAULT {i}, u text UNIQUE, w numeric(10,2))"
            )
            cur.execute(f"CREATE INDEX t{i}_v ON public.t{i} (v)")
    conn.commit()
    names = [TableName("public", f"t{i}") for i in range(N)]

    def one_by_one(cur):  # the code before: a shape read and the extras' savepoint, read, rollback per table
        out = {}
        for t in names:
            cur.execute(
                f"WITH t AS (SELECT pg_catalog.to_regclass(%s) AS oid) SELECT t.oid, {SHAPE_COLUMNS} FROM t",
                (t.ident.as_string(cur),),
            )
            oid, cols, key = cur.fetchone()
            d = shape(t, cols, key)
            out[t] = TableDefinition(
                d.table, d.columns, d.key, table_extras.read_many(cur, [t.ident.as_string(cur)])[t.ident.as_string(cur)]
            )
        return out

    for label, f in [
        ("one by one", one_by_one),
        ("batched", lambda cur: read_definitions(cur, names, extras=True)),
    ] * 3:
        with conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            t0 = time.perf_counter()
            got = f(cur)
            dt = time.perf_counter() - t0
        conn.rollback()
        assert len(got) == N and all(v is not None and v.extras is not None for v in got.values())
        print(f"{N} tables, {label}: {dt * 1000:.0f} ms", flush=True)
    conn.close()
finally:
    m.down(mode="immediate", remove=True)
