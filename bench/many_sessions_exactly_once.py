"""``python bench/many_sessions_exactly_once.py N`` with PYTHONPATH at the checkout (it reads queues with
tests/support): 200 sessions streaming (lr sync running: many_sessions_probe.py): an application transmits N entries (entry n to client
n % 50, every sink) while full syncs of 5 clients are asked at once; then every session's receive
queue: its log entries once each, in order; all of them for the sessions not full-synced."""

import json
import os
import subprocess
import sys
import threading
import time

import psycopg2

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.proto import lr_pb2
from tests.support.session import queue_entries

conns = json.load(open(os.environ["LR_HOME"] + "/connections.json"))


class S:
    def __init__(s, v):
        s.dsn = f"host={v['host']} port={v['port']} user=postgres dbname=postgres"

    def query(s, q, p=()):
        c = psycopg2.connect(s.dsn)
        try:
            cur = c.cursor()
            cur.execute(q, p)
            r = cur.fetchall() if cur.description else []
            c.commit()
            return r
        finally:
            c.close()


sites = {v["extra"]["site_id"]: S(v) for v in conns.values()}
sinks = ["site-b", "site-c", "site-d", "site-e"]
N = int(sys.argv[1])
CL = 50
synced = [f"c{j:02d}" for j in range(0, 50, 10)]
# clear the queues first (what earlier probes left)
for s in sinks:
    sites[s].query("DELETE FROM lr.receive_queue")
conn = psycopg2.connect(sites["site-a"].dsn)
senders = [RoutingQueueClient(conn, f"c{j:02d}") for j in range(CL)]
fs_out = {}


def full_syncs():
    time.sleep(1.0)
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            ["lr", "full-sync", "--client", c, "--wait", "180"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for c in synced
    ]
    for c, p in zip(synced, procs):
        out = p.communicate()[0].decode()
        fs_out[c] = (p.returncode, time.monotonic() - t0, out.strip().splitlines()[-1])


th = threading.Thread(target=full_syncs)
th.start()
t0 = time.monotonic()
for n in range(N):
    senders[n % CL].transmit_log_entry_message(str(n).encode(), sinks)
    conn.commit()
    time.sleep(0.002)
print(f"wrote {N} in {time.monotonic() - t0:.1f}s", flush=True)
th.join()
for c, v in fs_out.items():
    print("full-sync", c, v)
cur = conn.cursor()
cur.execute("SELECT max(position) FROM lr.log_commits")
top = cur.fetchone()[0]
conn.commit()
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    cur.execute("SELECT count(*) FROM lr.source_sessions WHERE acked_position < %s", (top,))
    behind = cur.fetchone()[0]
    conn.commit()
    if not behind:
        break
    time.sleep(1)
print(f"drained after {time.monotonic() - t0:.1f}s, behind {behind}", flush=True)
bad = 0
for s in sinks:
    for j in range(CL):
        c = f"c{j:02d}"
        got = [int(p) for k, p in queue_entries(sites[s], c, kind=lr_pb2.LOG_ENTRY_SYNC)]
        want = list(range(j, N, CL))
        ok = got == sorted(set(got)) and (c in synced and set(got) <= set(want) or got == want)
        if not ok:
            bad += 1
            print("WRONG", s, c, len(got), len(want), len(got) - len(set(got)), "dups; order", got == sorted(got))
        elif c in synced and s == "site-b":
            print(
                f"  {s}/{c}: {len(got)} of {len(want)} as log entries after its full sync (from {got[0] if got else None})"
            )
print("sessions wrong:", bad)
