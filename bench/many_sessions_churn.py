"""Many sessions in lr's default mode, a second `lr sync` coming and going (round 18), on the
embedded sites of $LR_HOME whose 200-session topology is applied ($LR_TOPOLOGY: docs/scale-bench.md;
PYTHONPATH at the checkout, for tests/support). ``python bench/many_sessions_churn.py [ROUNDS]``:

1. starts `lr sync` A (PGAPPNAME lr-churn-0) and waits until every session of site-a streams;
2. idle, nothing written, 10 s: A's CPU, and per site the transactions/s (pg_stat_database) and the
   statements/s of A's backends (log_statement = all for the window, counted in each server's log);
3. `lr status` and `--json`: time and size;
4. an application transmits (entry n to client n % 50, every sink, ~100/s) while `lr sync` B is
   started, left 4 s, stopped with SIGTERM, and left away 3 s, ROUNDS (5) times. Every 0.2 s the
   source's sessions are read: a session is *unheld* while its lease has no owner, has expired, or
   belongs to no live member; the longest unheld time of any session is printed, with the split;
5. every session's receive queue: its log entries once each, in order, all of them.

Everything it starts it stops; the sites are left running."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psycopg2

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.proto import lr_pb2
from tests.support.session import queue_entries

home = os.environ["LR_HOME"]
conns = json.load(open(f"{home}/connections.json"))
sinks = ["site-b", "site-c", "site-d", "site-e"]
CL = 50


class Site:
    def __init__(self, v):
        self.dsn = f"host={v['host']} port={v['port']} user=postgres dbname=postgres"
        self.log = f"{home}/sites/{v['extra']['site_id']}/postgres.log"
        self.conn = psycopg2.connect(self.dsn)
        self.conn.autocommit = True

    def query(self, q, p=None):
        cur = self.conn.cursor()
        cur.execute(q, p)
        return cur.fetchall() if cur.description else []


sites = {v["extra"]["site_id"]: Site(v) for v in conns.values()}
src = sites["site-a"]


def start(i):
    env = {**os.environ, "PGAPPNAME": f"lr-churn-{i}"}
    log = open(f"{home}/churn-{i}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_lr.cli", "sync"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid):
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0]) // 1024


def states():
    return dict(src.query("SELECT state, count(*) FROM lr.source_sessions GROUP BY 1"))


def wait_streaming(t0, limit=300):
    while time.monotonic() - t0 < limit:
        held = src.query(
            "SELECT count(*) FILTER (WHERE s.state = 'IN_LOG_ENTRY_SYNC' AND s.lease_expires_at > now() AND"
            " EXISTS (SELECT 1 FROM lr.replicator_members m WHERE m.owner = s.lease_owner)), count(*)"
            " FROM lr.source_sessions s"
        )[0]
        if held[0] == held[1] and held[1]:
            return time.monotonic() - t0
        time.sleep(0.25)
    raise SystemExit(f"not every session streams after {limit}s: {states()}")


def conns_per_site():
    return {
        s: x.query("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'lr-churn-%'")[0][0]
        for s, x in sites.items()
    }


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
up = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0  # seconds B runs each round
a = start(0)
procs = [a]
try:
    t0 = time.monotonic()
    print(f"A: every session streaming after {wait_streaming(t0):.1f}s", flush=True)
    time.sleep(3)
    print("A: connections per site", conns_per_site(), "RSS MB", rss(a.pid), flush=True)

    # idle: CPU, transactions and statements per second at each site
    for x in sites.values():
        x.query("ALTER SYSTEM SET log_statement = 'all'")
        x.query("ALTER SYSTEM SET log_line_prefix = '%m [%p] app=%a '")
        x.query("SELECT pg_reload_conf()")
    time.sleep(1)
    sizes = {s: os.path.getsize(x.log) for s, x in sites.items()}
    xacts = {
        s: x.query("SELECT sum(xact_commit + xact_rollback)::float FROM pg_stat_database")[0][0]
        for s, x in sites.items()
    }
    c0, w0 = cpu(a.pid), time.monotonic()
    time.sleep(10)
    c1, w1 = cpu(a.pid), time.monotonic()
    for x in sites.values():
        x.query("ALTER SYSTEM RESET log_statement")
        x.query("ALTER SYSTEM RESET log_line_prefix")
        x.query("SELECT pg_reload_conf()")
    span = w1 - w0
    print(f"idle {span:.1f}s, 200 sessions: A's CPU {100 * (c1 - c0) / span:.1f}% of a core", flush=True)
    for s, x in sites.items():
        xa = x.query("SELECT sum(xact_commit + xact_rollback)::float FROM pg_stat_database")[0][0]
        with open(x.log, "rb") as f:
            f.seek(sizes[s])
            text = f.read().decode(errors="replace")
        stmts = re.findall(r"app=lr-churn-0 LOG:  statement: (.{0,60})", text)
        kinds = {}
        for st in stmts:
            k = st.split()[0].upper() if st.split() else "?"
            kinds[k] = kinds.get(k, 0) + 1
        top = sorted(kinds.items(), key=lambda kv: -kv[1])[:5]
        print(
            f"  {s}: {(xa - xacts[s]) / span:.1f} transactions/s (all), lr sync statements/s {len(stmts) / span:.1f} {top}"
        )

    for args in (["status"], ["status", "--json"]):
        t = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "airflow_provider_lr.cli", *args], capture_output=True)
        print(
            f"lr {' '.join(args)}: {time.monotonic() - t:.1f}s, exit {out.returncode}, "
            f"{len(out.stdout.splitlines())} lines, {len(out.stdout) // 1024} KiB",
            flush=True,
        )

    # churn: B comes and goes while an application writes
    for s in sinks:
        sites[s].query("DELETE FROM lr.receive_queue")
    stop_writing = threading.Event()
    written = [0]

    def writer():
        conn = psycopg2.connect(src.dsn)
        senders = [RoutingQueueClient(conn, f"c{j:02d}") for j in range(CL)]
        n = 0
        while not stop_writing.is_set():
            senders[n % CL].transmit_log_entry_message(str(n).encode(), sinks)
            conn.commit()
            n += 1
            written[0] = n
            time.sleep(0.01)
        conn.close()

    unheld_since = {}
    timeline = open(f"{home}/churn-timeline.log", "w", buffering=1)
    t_start = time.monotonic()
    worst = [0.0, None]
    split_seen = []
    stop_watch = threading.Event()

    def watch():
        w = Site([v for v in conns.values() if v["extra"]["site_id"] == "site-a"][0])
        while not stop_watch.is_set():
            rows = w.query(
                "SELECT s.sink_site_id || '/' || s.client_name, s.lease_owner,"
                " s.lease_owner IS NULL OR s.lease_expires_at < now()"
                " OR NOT EXISTS (SELECT 1 FROM lr.replicator_members m WHERE m.owner = s.lease_owner)"
                " FROM lr.source_sessions s"
            )
            now = time.monotonic()
            owners = {}
            for key, owner, unheld in rows:
                owners[owner] = owners.get(owner, 0) + 1
                if unheld:
                    unheld_since.setdefault(key, now)
                    if now - unheld_since[key] > worst[0]:
                        worst[:] = [now - unheld_since[key], key]
                else:
                    unheld_since.pop(key, None)
            split_seen.append(sorted(owners.values()))
            beats = w.query(
                "SELECT owner, round(extract(epoch FROM now() - heartbeat_at)::numeric, 1) FROM lr.replicator_members"
            )
            timeline.write(f"{now - t_start:7.2f} owners {owners} unheld {len(unheld_since)} beats {beats}\n")
            time.sleep(0.2)

    wt = threading.Thread(target=writer)
    wa = threading.Thread(target=watch)
    wt.start()
    wa.start()
    time.sleep(1)
    for r in range(rounds):
        b = start(1)
        procs.append(b)
        t = time.monotonic()
        time.sleep(up)
        split = split_seen[-1]
        b.send_signal(signal.SIGTERM)
        code = b.wait(60)
        print(
            f"round {r + 1}: B up {up:.0f}s, split at the end {split}; SIGTERM: B exited {code} after "
            f"{time.monotonic() - t - up:.1f}s; longest unheld so far {worst[0]:.1f}s ({worst[1]})",
            flush=True,
        )
        procs.remove(b)
        time.sleep(3)
    stop_writing.set()
    wt.join()
    n = written[0]
    top = src.query("SELECT max(position) FROM lr.log_commits")[0][0]
    t = time.monotonic()
    while time.monotonic() - t < 120:
        behind = src.query("SELECT count(*) FROM lr.source_sessions WHERE acked_position < %s", (top,))[0][0]
        if not behind:
            break
        time.sleep(0.5)
    stop_watch.set()
    wa.join()
    print(
        f"wrote {n}; drained {time.monotonic() - t:.1f}s after the last, behind {behind}; "
        f"longest unheld {worst[0]:.1f}s ({worst[1]})",
        flush=True,
    )
    bad = 0
    for s in sinks:
        for j in range(CL):
            c = f"c{j:02d}"
            got = [int(p) for k, p in queue_entries(sites[s], c, kind=lr_pb2.LOG_ENTRY_SYNC)]
            if got != list(range(j, n, CL)):
                bad += 1
                print("WRONG", s, c, len(got), len(set(got)), "of", len(range(j, n, CL)))
    print("sessions wrong:", bad, flush=True)
finally:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
            p.wait(60)
