"""Failover with tables at a modest scale, as users run lr: 4 sites, 2 clients, 3 federated tables
per client (a foreign key, a UNIQUE column, a composite column), writers on every table that also
transmit messages, two `lr sync` streaming. A switchover of policy to a sink, writers moving there,
the old source rejoined, a switchover back; an unplanned failover of audit with its source gone for
good, then back and rejoined. After each step every site of the client holds the same rows and
every message once, in order, and `lr status` is healthy (unreachable while site-d is down).

Not in the suite (about 45 s): `.venv/bin/python -m pytest bench/failover_two_clients_tables_probe.py
-p tests.conftest -q`; each step's CLI output goes to the test's tmp_path/steps.log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psycopg2
import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from tests.cli.test_cli_sync import topology_file
from tests.engine.session.test_sessions import ExtraSite
from tests.support.session import queue, wait_for
from tests.support.tables import federate, rows

N = 20
SYNC = ["--until-idle", "--cycles", "400", "--interval", "0.05", "--give-up-after", "40"]


def tables(c: str) -> list[str]:
    return [f"public.{c}_parent", f"public.{c}_child", f"public.{c}_pair"]


def make_tables(site, c: str, seed: bool) -> None:
    site.query(f"CREATE TABLE public.{c}_parent (id int PRIMARY KEY, u int NOT NULL UNIQUE, n int NOT NULL DEFAULT 0)")
    site.query(
        f"CREATE TABLE public.{c}_child (id int PRIMARY KEY, "
        f"parent_id int NOT NULL REFERENCES public.{c}_parent (id), n int NOT NULL DEFAULT 0)"
    )
    site.query(f"CREATE TABLE public.{c}_pair (id int PRIMARY KEY, p public.pair, n int NOT NULL DEFAULT 0)")
    if seed:
        site.query(f"INSERT INTO public.{c}_parent SELECT g, g FROM generate_series(1, {N}) g")
        site.query(f"INSERT INTO public.{c}_child SELECT g, g FROM generate_series(1, {N}) g")
        site.query(
            f"INSERT INTO public.{c}_pair SELECT g, ROW(g, 'p' || g)::public.pair FROM generate_series(1, {N}) g"
        )
        for t in tables(c):
            federate(site, t, c)


class Writer:
    """One transaction after another: swap u between two parents, repoint a child, change a pair,
    transmit ``<tag>:<n>`` to ``sinks``."""

    def __init__(self, site, client: str, sinks: list[str], tag: str, start: int = 0) -> None:
        self.site, self.client, self.sinks, self.tag = site, client, sinks, tag
        self.count, self.errors, self.stop = start, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        conn = psycopg2.connect(self.site.dsn)
        q = RoutingQueueClient(conn, self.client)
        c, i = self.client, 0
        while not self.stop.is_set():
            i += 1
            a, b = sorted({1 + (i * 7) % N, 1 + (i * 13 + 3) % N})
            if a == b:
                continue
            try:
                with conn.cursor() as cur:
                    cur.execute(
                        f"SELECT id, u FROM public.{c}_parent WHERE id IN (%s, %s) ORDER BY id FOR UPDATE", (a, b)
                    )
                    u = dict(cur.fetchall())
                    cur.execute(f"UPDATE public.{c}_parent SET u = -u WHERE id = %s", (a,))
                    cur.execute(f"UPDATE public.{c}_parent SET u = %s, n = n + 1 WHERE id = %s", (u[a], b))
                    cur.execute(f"UPDATE public.{c}_parent SET u = %s WHERE id = %s", (u[b], a))
                    cur.execute(f"UPDATE public.{c}_child SET parent_id = %s, n = n + 1 WHERE id = %s", (b, a))
                    cur.execute(
                        f"UPDATE public.{c}_pair SET p = ROW(%s, %s)::public.pair, n = n + 1 WHERE id = %s",
                        (i, f"{self.tag}{i}", a),
                    )
                    n = self.count + 1
                    q.transmit_log_entry_message(f"{self.tag}:{n}".encode(), self.sinks)
                conn.commit()
                self.count = n
            except psycopg2.Error as exc:
                conn.rollback()
                self.errors.append(str(exc).splitlines()[0])
                if len(self.errors) > 50:
                    break
            self.stop.wait(0.01)
        conn.close()


def streamer(topo, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", str(topo)],
        env=dict(os.environ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(procs) -> None:
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def same_rows(sites, c: str) -> bool:
    truth = [rows(sites[0], t) for t in tables(c)]
    return all([rows(s, t) for t in tables(c)] == truth for s in sites[1:])


def messages(sink, client: str) -> list[str]:
    return [p for k, p in queue(sink, None, client) if k == "log"]


def check_messages(sink, client: str, tags: dict[str, int], lossy: bool = False, first: int | None = 1) -> list[int]:
    """Each writer's messages reached ``sink`` once and in order: all of them from ``first`` (None:
    from the first one after the sink's first full sync), or (``lossy``, an unplanned failover's
    tail) a prefix."""
    got = messages(sink, client)
    for tag, count in tags.items():
        mine = [int(p.split(":")[1]) for p in got if p.split(":")[0] == tag]
        if first is None and not mine:
            continue  # every one of them before the sink's full sync: its snapshot holds them
        start = first or mine[0]
        want = list(range(start, (start + len(mine) if lossy else count + 1)))
        assert mine == want, (sink.site_id, client, tag, count, mine[:3], mine[-3:], len(mine))
    return mine


@pytest.mark.slow
def test_two_clients_with_tables_switch_over_and_back_and_fail_over_while_lr_sync_streams(
    lr_sites, tmp_path, monkeypatch, capsys
):
    a, b, c = lr_sites
    d = ExtraSite(a, "site-d")
    sites = [a, b, c, d]
    try:
        topo = topology_file(tmp_path, sites, monkeypatch)
        doc = yaml.safe_load(open(topo))
        doc["replication"] = [
            {"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]},
            {"source": "site-d", "sinks": ["site-a", "site-b", "site-c"], "clients": ["audit"]},
        ]
        doc["providers"]["audit"] = doc["providers"]["policy"]
        doc["settings"] = {"lease_seconds": 2}
        open(topo, "w").write(yaml.safe_dump(doc))
        assert cli.main(["topology", "apply", "--topology", topo]) == 0
        for s in sites:
            s.query("CREATE TABLE IF NOT EXISTS app_state (k text PRIMARY KEY, v bigint NOT NULL)")
            s.query("CREATE TYPE public.pair AS (x int, y text)")  # lr creates tables, not types
        make_tables(a, "policy", True)
        make_tables(d, "audit", True)
        log = open(tmp_path / "lr-sync.log", "ab")
        diag = open(tmp_path / "steps.log", "w")

        def say(*parts):
            print(*parts, file=diag, flush=True)

        def lr(*args) -> int:
            capsys.readouterr()
            rc = cli.main(list(args))
            out = capsys.readouterr()
            say(" ".join(args[:2]), "->", rc, out.out[-2500:], out.err[-1500:])
            return rc

        def settle(step, policy_sites, audit_sites):
            def same():
                return same_rows(policy_sites, "policy") and same_rows(audit_sites, "audit")

            try:
                wait_for(same, 60, step)
            except AssertionError:
                for cl, ss in (("policy", policy_sites), ("audit", audit_sites)):
                    for t in tables(cl):
                        counts = [(x.site_id, len(rows(x, t))) for x in ss]
                        diff = [x.site_id for x in ss[1:] if rows(x, t) != rows(ss[0], t)]
                        say(step, t, counts, "differs at", diff)
                lr("status", "--topology", topo)
                raise

        procs = [streamer(topo, log), streamer(topo, log)]
        try:
            with (
                Writer(a, "policy", ["site-b", "site-c"], "pa") as wpa,
                Writer(d, "audit", ["site-a", "site-b", "site-c"], "ad") as wad,
            ):
                time.sleep(3)
            assert wpa.count > 20 and wad.count > 20, (wpa.errors[:3], wad.errors[:3])
            settle("step 0", [a, b, c], [d, a, b, c])
            for s in (b, c):
                check_messages(s, "policy", {"pa": wpa.count}, first=None)
            for s in (a, b, c):
                check_messages(s, "audit", {"ad": wad.count}, first=None)
            assert lr("status", "--topology", topo) == 0

            # planned switchover of policy to site-b while lr sync streams and the writers run
            with (
                Writer(a, "policy", ["site-b", "site-c"], "pa", wpa.count) as wpa2,
                Writer(d, "audit", ["site-a", "site-b", "site-c"], "ad", wad.count) as wad2,
            ):
                time.sleep(1)
                assert (
                    lr(
                        "failover",
                        "--topology",
                        topo,
                        "--promote",
                        "site-b",
                        "--client",
                        "policy",
                        "--reason",
                        "planned",
                        "--out",
                        topo,
                    )
                    == 0
                )
                time.sleep(1)
            say("writer errors after switch", wpa2.errors[:2], len(wpa2.errors), wad2.errors[:2])
            assert any(
                "replicated from site site-b" in e or "not replicated from this site" in e for e in wpa2.errors
            ), wpa2.errors[:3]
            with (
                Writer(b, "policy", ["site-a", "site-c"], "pb") as wpb,
                Writer(d, "audit", ["site-a", "site-b", "site-c"], "ad", wad2.count) as wad3,
            ):
                time.sleep(2)
                lr("failover", "--topology", topo, "--rejoin", "site-a")
                time.sleep(2)
            assert wpb.count > 20, wpb.errors[:3]
            settle("step 1", [b, a, c], [d, a, b, c])
            check_messages(c, "policy", {"pb": wpb.count})
            check_messages(a, "policy", {"pb": wpb.count}, first=None)  # its first contact from site-b: a full sync
            for s in (b, c):
                check_messages(s, "policy", {"pa": wpa2.count}, first=None)  # drained: every message before the switch
            for s in (a, b, c):
                check_messages(s, "audit", {"ad": wad3.count}, first=None)
            assert lr("status", "--topology", topo) == 0

            # switchover back to site-a
            with Writer(b, "policy", ["site-a", "site-c"], "pb", wpb.count) as wpb2:
                time.sleep(1)
                assert (
                    lr(
                        "failover",
                        "--topology",
                        topo,
                        "--promote",
                        "site-a",
                        "--from",
                        "site-b",
                        "--client",
                        "policy",
                        "--reason",
                        "back",
                        "--out",
                        topo,
                    )
                    == 0
                )
                time.sleep(1)
            say("writer errors after back", wpb2.errors[:2], len(wpb2.errors))
            with Writer(a, "policy", ["site-b", "site-c"], "pa2") as wpa3:
                time.sleep(2)
            settle("step 2", [a, b, c], [d, a, b, c])
            for s in (b, c):
                check_messages(s, "policy", {"pa2": wpa3.count})
            for s in (a, c):
                check_messages(s, "policy", {"pb": wpb2.count})
            assert lr("status", "--topology", topo) == 0

            # unplanned failover of audit: site-d gone for good
            with (
                Writer(d, "audit", ["site-a", "site-b", "site-c"], "ad2") as wad4,
                Writer(a, "policy", ["site-b", "site-c"], "pa3") as wpa4,
            ):
                time.sleep(1.5)
                wad4.stop.set()
                wad4.thread.join(30)
                admin = psycopg2.connect(d.server.dsn())
                admin.autocommit = True
                with admin.cursor() as cur:
                    cur.execute(f'ALTER DATABASE "{d.dbname}" ALLOW_CONNECTIONS false')
                    cur.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (d.dbname,)
                    )
                admin.close()
                time.sleep(1)
                assert (
                    lr(
                        "failover",
                        "--topology",
                        topo,
                        "--promote",
                        "site-c",
                        "--from",
                        "site-d",
                        "--client",
                        "audit",
                        "--reason",
                        "lost",
                        "--out",
                        topo,
                    )
                    == 0
                )
                time.sleep(1)
            with Writer(c, "audit", ["site-a", "site-b"], "ac") as wac:
                time.sleep(2)
            assert wac.count > 20, wac.errors[:3]
            settle("step 3", [a, b, c], [c, a, b])
            for s in (a, b):
                check_messages(s, "audit", {"ac": wac.count})
            for s in (b, c):
                check_messages(s, "policy", {"pa3": wpa4.count})  # policy streams on through audit's failover
            kept = [check_messages(s, "audit", {"ad2": wad4.count}, lossy=True) for s in (a, b, c)]
            say("ad2", wad4.count, [len(k) for k in kept])
            assert kept[0] == kept[1] == kept[2], "every remaining sink holds the same prefix of site-d's messages"
            assert lr("status", "--topology", topo) == 2  # site-d unreachable until it rejoins
            admin = psycopg2.connect(d.server.dsn())
            admin.autocommit = True
            with admin.cursor() as cur:
                cur.execute(f'ALTER DATABASE "{d.dbname}" ALLOW_CONNECTIONS true')
            admin.close()
            say(
                "d before",
                d.query("SELECT max(position) FROM lr.log_commits"),
                d.query("SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = 'public.audit_pair'::regclass"),
            )
            d.query("UPDATE public.audit_pair SET n = n + 1000 WHERE id = 1")  # before the rejoin: reaches nobody
            say(
                "d after",
                d.query("SELECT max(position) FROM lr.log_commits"),
                d.query(
                    "SELECT e.stream, count(*) FROM lr.log_entries e JOIN lr.log_commits c ON c.tx = e.tx WHERE c.position > 500 GROUP BY 1"
                ),
            )
            assert lr("failover", "--topology", topo, "--rejoin", "site-d") == 0
            with pytest.raises(psycopg2.Error, match="replicated from site site-c since a failover"):
                d.query("UPDATE public.audit_pair SET n = n + 1 WHERE id = 2")
            with pytest.raises(Exception, match="replicated from"):
                conn = psycopg2.connect(d.dsn)
                RoutingQueueClient(conn, "audit").transmit_log_entry_message(b"late", ["site-a"])
            with Writer(c, "audit", ["site-a", "site-b", "site-d"], "ac2") as wac2:
                time.sleep(2)
            settle("step 4", [a, b, c], [c, a, b, d])
            for s in (a, b):
                check_messages(s, "audit", {"ac2": wac2.count})
            check_messages(d, "audit", {"ac2": wac2.count}, first=None)  # its first contact is a full sync
            say("d ac2", len(messages(d, "audit")), wac2.count)
            assert lr("status", "--topology", topo) == 0
        finally:
            stop(procs)
    finally:
        log.close()
        admin = psycopg2.connect(d.server.dsn())
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'ALTER DATABASE "{d.dbname}" ALLOW_CONNECTIONS true')
        admin.close()
        d.drop()
