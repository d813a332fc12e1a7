"""``python bench/many_tables_probe.py N`` while lr sync runs the 200-session topology
(many_sessions_probe.py): N tables of 50 rows at site-a, opened for client c01 one after the other,
then the time until every sink (site-b..e) holds all N synced, and each table's rows checked there."""

import json
import os
import sys
import time

import psycopg2

from airflow_provider_lr.engine.tables import registry

conns = json.load(open(os.environ["LR_HOME"] + "/connections.json"))
dsn = {
    v["extra"]["site_id"]: f"host={v['host']} port={v['port']} user=postgres dbname=postgres" for v in conns.values()
}
N = int(sys.argv[1])
c = psycopg2.connect(dsn["site-a"])
with c.cursor() as cur:
    for i in range(N):
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS public.ft{i} (id serial PRIMARY KEY, v int NOT NULL DEFAULT {i}, u text UNIQUE)"
        )
        cur.execute(
            f"INSERT INTO public.ft{i} (v, u) SELECT g, 'u'||g FROM generate_series(1, 50) g ON CONFLICT DO NOTHING"
        )
c.commit()
t0 = time.monotonic()
for i in range(N):
    registry.open_table(c, f"public.ft{i}", "c01")
print(f"opened {N} tables in {time.monotonic() - t0:.1f}s", flush=True)
t1 = time.monotonic()
sinks = {s: psycopg2.connect(dsn[s]) for s in ["site-b", "site-c", "site-d", "site-e"]}
while True:
    done = {}
    for s, sc in sinks.items():
        with sc.cursor() as cur:
            cur.execute("SELECT count(*) FROM lr.sink_tables WHERE client_name = 'c01' AND state = 'synced'")
            done[s] = cur.fetchone()[0]
        sc.rollback()
    if all(v >= N for v in done.values()):
        print(f"all {N} tables synced at the 4 sinks {time.monotonic() - t1:.1f}s after the last open", flush=True)
        break
    if time.monotonic() - t1 > 400:
        print("timeout", done)
        break
    time.sleep(0.5)
bad = 0
for sc in sinks.values():
    with sc.cursor() as cur:
        for i in range(N):
            cur.execute(f"SELECT count(*), sum(v) FROM public.ft{i}")
            if cur.fetchone() != (50, 50 * 51 // 2):
                bad += 1
    sc.rollback()
print("tables wrong", bad)
