"""Failover with tables, the way users run lr: `lr sync` streams (its default) while writers swap
the values of a UNIQUE column of a federated table and transmit messages in the same
transactions, full syncs are asked back to back, `lr failover --promote site-b` moves the source,
the writers carry on at site-b and the old source rejoins. At the end every site holds the same
table, and each message reached each sink it named as a log entry at most once, with every sink's
replay equal to its source's state (issue "Exactly once through every hand-off", soak part)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import psycopg2
import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from tests.cli.test_cli_sync import topology_file
from tests.support.session import App, final_state, queue, source_state, wait_for
from tests.support.tables import federate, rows, swap_unique

ITEMS = 40
TABLE = (
    "CREATE TABLE public.items (id int PRIMARY KEY, u int NOT NULL UNIQUE, n int NOT NULL DEFAULT 0, "
    'nonkey text, "Mixed Case" jsonb)'
)
SYNC = ["--until-idle", "--cycles", "400", "--interval", "0.05", "--give-up-after", "30"]  # a killed streamer's
# leases lapse first


class SwapWriter:
    """Transactions that swap ``u`` between two rows (three statements, so the UNIQUE constraint
    holds after each), bump ``n`` and transmit a unique message to ``sinks``, all in one transaction."""

    def __init__(self, site, sinks: list[str], tag: str, seed: int) -> None:
        self.site, self.sinks, self.tag, self.rng = site, sinks, tag, random.Random(seed)
        self.stop = threading.Event()
        self.count = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SwapWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        conn = psycopg2.connect(self.site.dsn)
        client = RoutingQueueClient(conn, "policy")
        while not self.stop.is_set():
            a, b = self.rng.sample(range(1, ITEMS + 1), 2)
            try:
                with conn.cursor() as cur:
                    swap_unique(cur, "public.items", a, b, self.tag)
                    n = self.count + 1
                    cur.execute(
                        "INSERT INTO app_state VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v",
                        (f"k{a}", n),
                    )
                    client.transmit_log_entry_message(f"k{a}={n}#{self.tag}{n}".encode(), self.sinks)
                conn.commit()
                self.count = n
            except psycopg2.Error as exc:  # counted: the writers assert their transactions commit
                conn.rollback()
                self.errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            self.stop.wait(0.005)
        conn.close()


def payloads(sink, source: str) -> list[str]:
    return [p for k, p in queue(sink, source) if k == "log"]


def replay(sink, source: str) -> dict[str, int]:
    return final_state([(k, p.split("#", 1)[0]) for k, p in queue(sink, source)])


def streamer(topo: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", topo],
        env=dict(os.environ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_failover_with_a_federated_table_while_lr_sync_streams_and_writers_swap_unique_values(
    lr_sites, tmp_path, monkeypatch
):
    site_a, site_b, site_c = lr_sites
    t1 = topology_file(tmp_path, lr_sites, monkeypatch)
    text = open(t1).read().replace("settings: {}", "settings: {lease_seconds: 2}")
    open(t1, "w").write(text)
    assert cli.main(["topology", "apply", "--topology", t1]) == 0
    for site in lr_sites:
        App(site).close()  # the application's own table at every site (not replicated)
    site_a.query(TABLE)
    site_a.query("INSERT INTO public.items (id, u) SELECT g, g FROM generate_series(1, %s) g", (ITEMS,))
    federate(site_a, "public.items")
    log = open(tmp_path / "lr-sync.log", "ab")

    proc = streamer(t1, log)
    try:
        with (
            SwapWriter(site_a, ["site-b", "site-c"], "a", 1) as w1,
            SwapWriter(site_a, ["site-b", "site-c"], "A", 2) as w2,
        ):
            time.sleep(3)
            for sink in ("site-b", "site-b", "site-c"):
                assert cli.main(["full-sync", "--topology", t1, "--sink", sink, "--reason", "soak"]) == 0
            time.sleep(3)
        assert w1.count > 50 and w2.count > 50, f"the writers' transactions commit (errors: {Counter(w1.errors)})"
        wait_for(
            lambda: rows(site_b, "public.items") == rows(site_c, "public.items") == rows(site_a, "public.items"),
            60,
            "the table at both sinks",
        )
    finally:
        stop(proc)

    t2 = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", t1, "--promote", "site-b", "--out", str(t2)]) == 0
    proc = streamer(str(t2), log)
    try:
        with SwapWriter(site_b, ["site-c"], "b", 3) as w3:
            time.sleep(2)
            assert cli.main(["failover", "--topology", str(t2), "--rejoin", "site-a"]) == 0
            time.sleep(2)
            assert cli.main(["full-sync", "--topology", str(t2), "--sink", "site-c", "--reason", "after"]) == 0
            time.sleep(2)
        assert w3.count > 50, f"site-b's writer commits (errors: {Counter(w3.errors)})"
        wait_for(
            lambda: rows(site_a, "public.items") == rows(site_c, "public.items") == rows(site_b, "public.items"),
            90,
            "the table at every site after the failover",
        )
    finally:
        stop(proc)
        log.close()
    assert cli.main(["sync", "--topology", str(t2), *SYNC]) == 0

    truth = rows(site_b, "public.items")
    assert rows(site_a, "public.items") == rows(site_c, "public.items") == truth
    assert sorted(u for (u,) in site_b.query("SELECT u FROM public.items")) == list(range(1, ITEMS + 1))
    for sink in (site_b, site_c):
        twice = [p for p, n in Counter(payloads(sink, "site-a")).items() if n > 1]
        assert not twice, f"{sink.site_id}: {len(twice)} of site-a's messages twice, e.g. {twice[:3]}"
    for sink in (site_b, site_c):
        assert replay(sink, "site-a") == source_state(site_a), f"{sink.site_id} holds what site-a transmitted"
    twice = [p for p, n in Counter(payloads(site_c, "site-b")).items() if n > 1]
    assert not twice, f"site-c: {len(twice)} of site-b's messages twice"
    assert replay(site_c, "site-b") == source_state(site_b), "site-c holds what site-b transmitted to it"
