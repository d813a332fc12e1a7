"""Many federated tables of one client, each with writers, under `lr sync` (round 18), on the
embedded sites of $LR_HOME whose 200-session topology is applied (docs/scale-bench.md).
``python bench/many_tables_writers.py [N] [SECONDS]`` (50 tables, 20 s):

1. starts `lr sync` (PGAPPNAME lr-tables-0) and waits until every session streams;
2. creates N tables at site-a (100 rows each) and opens them for client c03: the time until the 4
   sinks hold all N synced (the snapshots while every session streams);
3. 4 writers insert and update rows in random tables for SECONDS; every 0.5 s a probe row goes into
   a random table and the time until site-b and site-e show it is the streaming lag; halfway, a
   full sync of c03 (`lr full-sync --client c03 --wait 180`) runs while they write;
4. once the writers stop: the time until every sink's tables equal the source's (count, sum, max).

Stops what it started; the sites are left running."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import psycopg2

from airflow_provider_lr.engine.tables import registry

home = os.environ["LR_HOME"]
conns = json.load(open(f"{home}/connections.json"))
dsn = {
    v["extra"]["site_id"]: f"host={v['host']} port={v['port']} user=postgres dbname=postgres" for v in conns.values()
}
SINKS = ["site-b", "site-c", "site-d", "site-e"]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 50
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
CLIENT = "c03"


def connect(site):
    c = psycopg2.connect(dsn[site])
    c.autocommit = True
    return c


src = connect("site-a")


def one(conn, q, p=None):
    with conn.cursor() as cur:
        cur.execute(q, p)
        return cur.fetchone()


def state(conn):
    return [
        one(conn, f"SELECT count(*), coalesce(sum(v), 0), coalesce(max(id), 0) FROM public.wt{i}") for i in range(N)
    ]


sync = subprocess.Popen(
    [sys.executable, "-m", "airflow_provider_lr.cli", "sync"],
    env={**os.environ, "PGAPPNAME": "lr-tables-0"},
    stdout=open(f"{home}/tables-0.log", "wb"),
    stderr=subprocess.STDOUT,
    start_new_session=True,
)
try:
    t0 = time.monotonic()
    while True:
        held, total = one(
            src,
            "SELECT count(*) FILTER (WHERE s.state = 'IN_LOG_ENTRY_SYNC' AND s.lease_expires_at > now() AND"
            " EXISTS (SELECT 1 FROM lr.replicator_members m WHERE m.owner = s.lease_owner)), count(*)"
            " FROM lr.source_sessions s",
        )
        if held == total:
            break
        if time.monotonic() - t0 > 300:
            raise SystemExit("not every session streams after 300 s")
        time.sleep(0.25)
    print(f"every session streaming after {time.monotonic() - t0:.1f}s", flush=True)
    with src.cursor() as cur:
        for i in range(N):
            cur.execute(f"CREATE TABLE IF NOT EXISTS public.wt{i} (id serial PRIMARY KEY, v int NOT NULL)")
            cur.execute(
                f"INSERT INTO public.wt{i} (v) SELECT g FROM generate_series(1, 100) g WHERE NOT EXISTS (SELECT 1 FROM public.wt{i})"
            )
    t0 = time.monotonic()
    for i in range(N):
        registry.open_table(src, f"public.wt{i}", CLIENT)
    opened = time.monotonic() - t0
    sinks = {s: connect(s) for s in SINKS}
    while True:
        done = {
            s: one(c, "SELECT count(*) FROM lr.sink_tables WHERE client_name = %s AND state = 'synced'", (CLIENT,))[0]
            for s, c in sinks.items()
        }
        if all(v >= N for v in done.values()):
            break
        if time.monotonic() - t0 > 400:
            raise SystemExit(f"tables not synced after 400 s: {done}")
        time.sleep(0.5)
    print(
        f"opened {N} tables in {opened:.1f}s; all synced at the 4 sinks {time.monotonic() - t0:.1f}s after the first open",
        flush=True,
    )

    stop = threading.Event()
    commits = [0]

    def writer(seed):
        rnd = random.Random(seed)
        c = psycopg2.connect(dsn["site-a"])
        while not stop.is_set():
            with c.cursor() as cur:
                for _ in range(3):
                    i = rnd.randrange(N)
                    if rnd.random() < 0.5:
                        cur.execute(f"INSERT INTO public.wt{i} (v) VALUES (%s)", (rnd.randrange(1000),))
                    else:
                        cur.execute(f"UPDATE public.wt{i} SET v = v + 1 WHERE id = %s", (rnd.randrange(1, 100),))
            c.commit()
            commits[0] += 1
            time.sleep(0.005)
        c.close()

    lags = []

    def prober():
        rnd = random.Random(7)
        probe = [sinks["site-b"], sinks["site-e"]]
        while not stop.is_set():
            i = rnd.randrange(N)
            rid = one(src, f"INSERT INTO public.wt{i} (v) VALUES (-1) RETURNING id")[0]
            t = time.monotonic()
            for c in probe:
                while one(c, f"SELECT count(*) FROM public.wt{i} WHERE id = %s", (rid,))[0] == 0:
                    if time.monotonic() - t > 60:
                        break
                    time.sleep(0.01)
            lags.append(time.monotonic() - t)
            time.sleep(0.5)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)] + [threading.Thread(target=prober)]
    for t in threads:
        t.start()
    w0 = time.monotonic()
    time.sleep(SECONDS / 2)
    t = time.monotonic()
    fs = subprocess.run(
        [sys.executable, "-m", "airflow_provider_lr.cli", "full-sync", "--client", CLIENT, "--wait", "180"],
        capture_output=True,
        text=True,
    )
    print(
        f"full sync of {CLIENT} while writing: exit {fs.returncode} after {time.monotonic() - t:.1f}s: "
        f"{(fs.stdout.strip().splitlines() or [''])[-1][:160]}",
        flush=True,
    )
    time.sleep(max(0.0, w0 + SECONDS - time.monotonic()))
    stop.set()
    for t in threads:
        t.join()
    lags.sort()
    print(
        f"writers: {commits[0]} transactions ({commits[0] / (time.monotonic() - w0):.0f}/s, 3 changes each); "
        f"lag to site-b and site-e over {len(lags)} probes: p50 {1000 * lags[len(lags) // 2]:.0f} ms, "
        f"max {1000 * lags[-1]:.0f} ms",
        flush=True,
    )
    want = state(src)
    t = time.monotonic()
    while True:
        wrong = {s: sum(a != b for a, b in zip(state(c), want)) for s, c in sinks.items()}
        if not any(wrong.values()) or time.monotonic() - t > 120:
            break
        time.sleep(0.5)
    print(
        f"after the last commit: {time.monotonic() - t:.1f}s until every sink equals the source; tables differing {wrong}",
        flush=True,
    )
finally:
    os.killpg(sync.pid, signal.SIGINT)
    sync.wait(60)
