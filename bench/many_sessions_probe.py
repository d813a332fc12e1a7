"""Many sessions in lr's default mode, on the embedded sites of $LR_HOME whose topology is applied
($LR_TOPOLOGY; docs/scale-bench.md has the 200-session one): start N `lr sync` processes
(``python bench/many_sessions_probe.py N``, PGAPPNAME lr-probe-sync-i, logs $LR_HOME/sync-i.log),
sample their connections per site and memory until every session of site-a is IN_LOG_ENTRY_SYNC,
then 10 s more, and print the figures. The processes are left running (their pids in
$LR_HOME/probe.pids: stop them with SIGINT to their process groups)."""

import json
import os
import subprocess
import sys
import time

import psycopg2

home = os.environ["LR_HOME"]
conns = json.load(open(f"{home}/connections.json"))
sites = {
    v["extra"]["site_id"]: psycopg2.connect(host=v["host"], port=v["port"], user="postgres", dbname="postgres")
    for v in conns.values()
}
for c in sites.values():
    c.autocommit = True
nproc = int(sys.argv[1]) if len(sys.argv) > 1 else 1
procs = []
t0 = time.monotonic()
for i in range(nproc):
    env = {**os.environ, "PGAPPNAME": f"lr-probe-sync-{i}"}
    log = open(f"{home}/sync-{i}.log", "wb")
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_lr.cli", "sync"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
open(f"{home}/probe.pids", "w").write(" ".join(str(p.pid) for p in procs))
peak = {}
peak_total = 0
peak_rss = 0


def sample():
    global peak_total, peak_rss
    total = 0
    for s, c in sites.items():
        cur = c.cursor()
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'lr-probe-sync-%'")
        n = cur.fetchone()[0]
        peak[s] = max(peak.get(s, 0), n)
        total += n
    peak_total = max(peak_total, total)
    for p in procs:
        try:
            rss = int(open(f"/proc/{p.pid}/status").read().split("VmRSS:")[1].split()[0]) // 1024
            peak_rss = max(peak_rss, rss)
        except Exception:
            pass
    return total


deadline = t0 + float(os.environ.get("PROBE_WAIT", "300"))
while True:
    total = sample()
    cur = sites["site-a"].cursor()
    cur.execute("SELECT state, count(*) FROM lr.source_sessions GROUP BY 1")
    states = dict(cur.fetchall())
    if any(p.poll() is not None for p in procs):
        print("an lr sync exited:", [p.returncode for p in procs])
        break
    n = sum(states.values())
    if states.get("IN_LOG_ENTRY_SYNC", 0) == n and n:
        print(f"all {n} sessions in LOG_ENTRY_SYNC after {time.monotonic() - t0:.1f}s")
        break
    if time.monotonic() > deadline:
        print("timeout", states)
        break
    time.sleep(0.5)
for _ in range(20):
    sample()
    time.sleep(0.5)
now = {}
for s, c in sites.items():
    cur = c.cursor()
    cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'lr-probe-sync-%'")
    now[s] = cur.fetchone()[0]
print("peak conns per site", peak, "peak total", peak_total, "now", now, "peak RSS MB", peak_rss)
for p in procs:
    st = open(f"/proc/{p.pid}/status").read()
    print(
        "pid",
        p.pid,
        "threads",
        st.split("Threads:")[1].split()[0],
        "RSS MB",
        int(st.split("VmRSS:")[1].split()[0]) // 1024,
    )
