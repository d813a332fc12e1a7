"""Opt-in chaos over `lr sync` (streaming, its default) and this round's table changes, seeded.

Skipped unless ``LR_CHAOS_SECONDS`` is set (it runs that long plus ~25 s; not in the suite's 20
minutes): ``LR_CHAOS_SECONDS=40 LR_CHAOS_SEED=3 pytest tests/guarantees/test_chaos_lr_sync.py -s``.

Site-a replicates client ``policy`` (federated tables) and six payload clients ``p0``..``p5`` to
site-b and site-c: 14 sessions. The application, in each transaction, transmits 1-3 payloads (unique,
to one sink or both) and makes one table change: a key chain of ``parents`` (``SET id = id + 1``;
``kids`` reference it ON UPDATE CASCADE, so the sinks move it link by link: ``runs.layers``), a swap
of ``items``' UNIQUE ``u`` (three statements), a composite column set, a kid added or removed, or a
chain or a key swap of ``plain`` (no foreign key references it anywhere: applied as one run; its key
is deferrable at the source). Meanwhile, chosen by the seed: ``lr sync`` processes are SIGKILLed,
a second (or third) is started, one is stopped with SIGTERM, a sink's server is stopped with
``pg_ctl -m immediate`` and started again, ``lr full-sync --client policy`` runs, and a table is
closed and opened again (``lr tables close``/``open``).

Then, once every session is caught up: each payload reached each sink named once and in commit
order, each table is equal at every site, and ``lr status`` exits 0. ``LR_CHAOS_ASYNC=1``: the sites
keep the test servers' ``synchronous_commit = off`` (the sinks' immediate stops then lose their last
commits, which lr must make good: docs/crash-windows.md rows 9 and 22). ``LR_CHAOS_LOGDIR`` (default
a temporary directory) keeps each ``lr sync``'s output and the run's summary (its faults, in order).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg2
import psycopg2.errors
import pytest
import yaml

from airflow_provider_lr.client import RoutingQueueClient
from tests.support.session import sink_queue, topology_doc
from tests.support.tables import federate, on_every_site, swap_unique

ROOT = Path(__file__).resolve().parents[2]
PCLIENTS = [f"p{i}" for i in range(6)]
SECONDS = float(os.environ.get("LR_CHAOS_SECONDS", "0"))
SEED = int(os.environ.get("LR_CHAOS_SEED", "1"))
ASYNC = bool(os.environ.get("LR_CHAOS_ASYNC"))  # the sites keep synchronous_commit = off
TABLES = ("public.parents", "public.kids", "public.items", "public.plain")
FAULTS = {"kill9": 20, "second": 20, "term": 15, "restart_sink": 12, "full_sync": 15, "quiet": 18, "close_open": 10}


def texts(site, table: str) -> list[tuple] | None:
    try:
        return site.query(f"SELECT t::text FROM {table} t ORDER BY 1")
    except psycopg2.errors.UndefinedTable:
        return None


class App:
    def __init__(self, source, seed):
        self.source, self.rng = source, random.Random(seed)
        self.stop = threading.Event()
        self.committed: dict[tuple[str, str], list[str]] = {}
        self.unknown = 0
        self.errors: list[str] = []
        self.chains = self.swaps = self.txns = self.plain_chains = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        conn = self.source.connect()
        clients = {c: RoutingQueueClient(conn, c) for c in PCLIENTS}
        n = 0
        rng = self.rng
        while not self.stop.is_set():
            n += 1
            work = []
            try:
                with conn.cursor() as cur:
                    for _ in range(rng.randint(1, 3)):
                        c = rng.choice(PCLIENTS)
                        sinks = rng.choice([["site-b"], ["site-c"], ["site-b", "site-c"]])
                        p = f"{c}:{n}:{len(work)}"
                        clients[c].transmit_log_entry_message(p.encode(), sinks)
                        work.append((c, sinks, p))
                    r = rng.random()
                    if r < 0.3:
                        cur.execute("UPDATE public.parents SET id = id + 1")
                        self.chains += 1
                    elif r < 0.55:
                        a, b = rng.sample(range(1, 31), 2)
                        swap_unique(cur, "public.items", a, b, f"s{n}")
                        self.swaps += 1
                    elif r < 0.7:
                        cur.execute(
                            "UPDATE public.items SET c = ROW(%s, %s)::public.pair WHERE id = %s",
                            (n, f"t{n}", rng.randint(1, 30)),
                        )
                    elif r < 0.8:
                        cur.execute(
                            "INSERT INTO public.kids (id, parent) SELECT %s, min(id) FROM public.parents "
                            "ON CONFLICT (id) DO UPDATE SET parent = excluded.parent",
                            (rng.randint(1, 40),),
                        )
                    elif r < 0.85:
                        cur.execute("DELETE FROM public.kids WHERE id = %s", (rng.randint(1, 40),))
                    elif r < 0.95:
                        if rng.random() < 0.5:
                            cur.execute("UPDATE public.plain SET id = id + 1")
                        else:
                            cur.execute(
                                "UPDATE public.plain p SET id = CASE WHEN p.id = m.lo THEN m.lo + %s ELSE m.lo END "
                                "FROM (SELECT min(id) AS lo FROM public.plain) m WHERE p.id IN (m.lo, m.lo + %s)",
                                (d := rng.randint(1, 19), d),
                            )
                        self.plain_chains += 1
                    if rng.random() < 0.1:
                        cur.execute(
                            "UPDATE public.plain SET v = v + 1 WHERE id = (SELECT min(id) FROM public.plain) + %s",
                            (rng.randint(0, 19),),
                        )
                conn.commit()
                self.txns += 1
                for c, sinks, p in work:
                    for s in sinks:
                        self.committed.setdefault((c, s), []).append(p)
            except psycopg2.Error as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                conn.rollback()
            self.stop.wait(rng.uniform(0.002, 0.02))
        conn.close()


class Syncs:
    def __init__(self, topo_path: str, env: dict, rng: random.Random, logdir: Path) -> None:
        self.topo_path, self.env, self.rng, self.logdir = topo_path, env, rng, logdir
        self.procs: list[subprocess.Popen] = []
        self.n = 0
        self.faults: dict[str, int] = {}

    def spawn(self) -> subprocess.Popen:
        self.n += 1
        log = open(self.logdir / f"sync-{SEED}-{self.n}.log", "ab")
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "airflow_provider_lr.cli",
                "sync",
                "--topology",
                self.topo_path,
                "--report-every",
                "0",
            ],
            env={**self.env, "PGAPPNAME": f"chaos-{self.n}"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def count(self, k):
        self.faults[k] = self.faults.get(k, 0) + 1

    def kill9(self):
        if not self.procs:
            return
        p = self.procs.pop(self.rng.randrange(len(self.procs)))
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        self.count("kill9")
        if not self.procs:
            self.spawn()

    def term(self):
        if len(self.procs) < 2:
            return
        p = self.procs.pop(self.rng.randrange(len(self.procs)))
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(30)
            self.count("term_hung")
        self.count("term")

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(30)
        self.procs.clear()


def cli(env, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "airflow_provider_lr.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.soak
@pytest.mark.skipif(not SECONDS, reason="opt-in: LR_CHAOS_SECONDS (and LR_CHAOS_SEED) set it going")
@pytest.mark.timeout(int(SECONDS) + 600)
def test_lr_sync_chaos_with_key_chains_keeps_every_payload_once_in_order_and_the_tables_equal(
    lr_sites, site_manager, tmp_path
):
    logdir = Path(os.environ.get("LR_CHAOS_LOGDIR") or tmp_path)
    logdir.mkdir(exist_ok=True)
    rng = random.Random(SEED)
    source, *sinks = lr_sites
    if not ASYNC:  # else the test servers' own: off (lr raises it where it must, docs/crash-windows.md)
        for s in lr_sites:
            s.query(f'ALTER DATABASE "{s.dbname}" SET synchronous_commit = on')
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for s in lr_sites:
        cid = f"lr_test_{s.site_id.replace('-', '_')}"
        env[f"AIRFLOW_CONN_{cid.upper()}"] = json.dumps(s.server.airflow_conn(s.dbname))
    doc = topology_doc(
        lr_sites,
        replication=[{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", *PCLIENTS]}],
        providers={c: "tests.support.session:empty_provider" for c in ["policy", *PCLIENTS]},
        conn_ids=lambda sid: f"lr_test_{sid.replace('-', '_')}",
        settings={"lease_seconds": 3},
    )
    topo_path = str(tmp_path / "topology.yaml")
    Path(topo_path).write_text(yaml.safe_dump(doc))
    out = cli(env, "topology", "apply", "--topology", topo_path)
    assert out.returncode == 0, out.stdout + out.stderr
    on_every_site(lr_sites, "CREATE TYPE public.pair AS (a int, b text)")
    on_every_site(
        lr_sites,
        "CREATE TABLE public.parents (id int PRIMARY KEY, name text); "
        "CREATE TABLE public.kids (id int PRIMARY KEY, parent int REFERENCES public.parents ON UPDATE CASCADE)",
    )
    source.query(
        "INSERT INTO public.parents SELECT g, 'p' || g FROM generate_series(12, 1, -1) g; "
        "INSERT INTO public.kids SELECT g, g FROM generate_series(1, 12, 2) g; "
        "CREATE TABLE public.items (id int PRIMARY KEY, u int NOT NULL UNIQUE, n int NOT NULL DEFAULT 0, "
        "nonkey text, c public.pair); "
        "INSERT INTO public.items (id, u, c) SELECT g, g, ROW(g, 'x')::public.pair FROM generate_series(1, 30) g; "
        "CREATE TABLE public.plain (id int PRIMARY KEY DEFERRABLE INITIALLY IMMEDIATE, v bigint); "
        "INSERT INTO public.plain SELECT g, 0 FROM generate_series(20, 1, -1) g"
    )
    for t in TABLES:
        federate(source, t)
    syncs = Syncs(topo_path, env, rng, logdir)
    app = App(source, SEED * 7 + 1)
    steps: list[str] = []
    try:
        syncs.spawn()
        deadline = time.monotonic() + 90
        while source.query("SELECT count(*) FROM lr.source_sessions WHERE state = 'IN_LOG_ENTRY_SYNC'")[0][0] < 2 * (
            1 + len(PCLIENTS)
        ) or not all(texts(s, "public.items") == texts(source, "public.items") for s in sinks):
            assert time.monotonic() < deadline, "never streaming"
            time.sleep(0.2)
        app.thread.start()
        start = time.monotonic()
        while time.monotonic() < start + SECONDS:
            kind = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
            steps.append(kind)
            if kind == "kill9":
                syncs.kill9()
            elif kind == "second":
                if len(syncs.procs) < 3:
                    syncs.spawn()
                    syncs.count("second")
            elif kind == "term":
                syncs.term()
            elif kind == "restart_sink":
                sid = rng.choice(["site-b", "site-c"])
                site_manager.down([sid], mode="immediate")
                time.sleep(rng.uniform(0.0, 1.5))
                site_manager.up(site_ids=[sid])
                syncs.count("restart_sink")
            elif kind == "full_sync":
                sink = rng.choice(["site-b", "site-c", None])
                out = cli(
                    env, "full-sync", "--topology", topo_path, "--client", "policy", *(["--sink", sink] if sink else [])
                )
                if out.returncode != 0:
                    steps.append(f"full-sync exit {out.returncode}: {out.stdout[-300:]} {out.stderr[-300:]}")
                syncs.count("full_sync")
            elif kind == "close_open":
                t = rng.choice(["public.plain", "public.items"])
                out = cli(env, "tables", "close", t, "--topology", topo_path)
                steps.append(f"close {t}: {out.returncode} {out.stdout[-200:]} {out.stderr[-200:]}")
                time.sleep(rng.uniform(0.0, 2.0))
                out = cli(env, "tables", "open", t, "--client", "policy", "--topology", topo_path)
                steps.append(f"open {t}: {out.returncode} {out.stdout[-200:]} {out.stderr[-200:]}")
                syncs.count("close_open")
            else:
                time.sleep(rng.uniform(0.2, 1.5))
            time.sleep(rng.uniform(0.1, 1.0))
        app.stop.set()
        app.thread.join(30)
        if not syncs.procs:
            syncs.spawn()
        # settle: every session acked up to the last commit, the tables equal
        deadline = time.monotonic() + 150
        top = source.query("SELECT coalesce(max(position), 0) FROM lr.log_commits")[0][0]
        failures = []
        while True:
            behind = source.query(
                "SELECT count(*) FROM lr.source_sessions WHERE acked_position < %s OR state <> 'IN_LOG_ENTRY_SYNC'",
                (top,),
            )[0][0]
            tables_equal = all(texts(s, t) == texts(source, t) for s in sinks for t in TABLES)
            if not behind and tables_equal:
                break
            if time.monotonic() > deadline:
                failures.append(f"not settled: behind={behind} tables_equal={tables_equal}")
                break
            time.sleep(0.5)
        time.sleep(2)
        st = cli(env, "status", "--topology", topo_path)
        if st.returncode != 0:
            failures.append(f"lr status exit {st.returncode}:\n{st.stdout}\n{st.stderr}")
        for (c, s), want in sorted(app.committed.items()):
            sink = next(x for x in sinks if x.site_id == s)
            got = [p.decode() for p in sink_queue(sink, c)]
            if got != want:
                dup = len(got) - len(set(got))
                missing = len(set(want) - set(got))
                failures.append(
                    f"{c}->{s}: got {len(got)} want {len(want)} dup {dup} missing {missing} first missing {[w for w in want if w not in set(got)][:3]} first got {got[:2]}"
                )
        for s in sinks:
            for t in TABLES:
                if texts(s, t) != texts(source, t):
                    failures.append(f"{t} differs at {s.site_id}")
        summary = {
            "seed": SEED,
            "async": ASYNC,
            "faults": syncs.faults,
            "txns": app.txns,
            "chains": app.chains,
            "swaps": app.swaps,
            "plain_chains": app.plain_chains,
            "app_errors": app.errors[:5],
            "failures": failures,
        }
        print("CHAOS", json.dumps(summary))
        (logdir / f"summary-{SEED}.json").write_text(json.dumps({**summary, "steps": steps}, indent=1))
        assert not failures, failures
    finally:
        app.stop.set()
        syncs.stop_all()
        down = [s.site_id for s in lr_sites if not site_manager.is_running(s.server)]
        if down:
            site_manager.up(site_ids=down)
