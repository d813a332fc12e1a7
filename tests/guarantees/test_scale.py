"""One source fanned out to many sessions (issue 30): 6 sink sites × 4 clients = 24 sessions, streamed
by `lr sync` the way users run it, while an application transmits at a modest rate.

Each transaction belongs to one client (in turn) and goes to every sink. Each sink's application is
a relay with one subscription per client, recording when each entry reached it. Then: every entry
reached each of its client's sessions exactly once and in the order it was written, no session went
through a second full sync, the lag stayed bounded (a bound generous enough for a loaded machine that
still fails when streaming stalls), and the replicator held connections per site, not per session.

The sites are databases on the session's three servers (the source alone on site-a's, the sinks
spread over all three): more sites than servers, as a machine with few cores allows.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.embedded.sites import EmbeddedSite, SiteManager
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.site.replicator import REST_AFTER
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.subscriber import open_relay
from tests.conftest import on_each
from tests.support.session import apply_to, topology_doc

SINKS, CLIENTS = 6, 4  # 24 sessions
RATE = 40.0  # transactions/s, each to every sink: 240 deliveries/s
WRITE_SECONDS = 10.0
LAG_P50_S, LAG_MAX_S = 0.5, 10.0  # here ~30 ms and ~0.3 s: generous for a loaded machine; a stall fails
APP_NAME = "lr-test-scale"  # the replicator's application_name, by which its connections are counted
READY_TIMEOUT, DRAIN_TIMEOUT = 180.0, 120.0
_runs = itertools.count(1)


@dataclass
class SharedSite:
    """A site that is one database of a test server other sites share."""

    server: EmbeddedSite
    dbname: str
    site_id: str

    @property
    def region(self) -> str:
        return self.server.region

    @property
    def dsn(self) -> str:
        return self.server.dsn(self.dbname)

    def connect(self) -> psycopg2.extensions.connection:
        return psycopg2.connect(self.dsn)


class Arrivals:
    """A sink application's listener for one client: each log entry's number and arrival time."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, float]] = []
        self.full_syncs = 0
        self.synced = threading.Event()
        self.errors: list[str] = []

    def on_snapshot_sync_start(self, source: str) -> bool:
        self.full_syncs += 1
        return True

    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool:
        return True

    def on_snapshot_sync_complete(self, source: str) -> bool:
        self.synced.set()
        return True

    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool:
        now = time.time()
        self.entries += [(int(p), now) for p in payloads]
        return True

    def on_error(self, source: str, error: Exception) -> None:
        self.errors.append(f"{source}: {error}")


@dataclass
class ScaleRun:
    sites: list[SharedSite]
    sent: dict[int, float] = field(default_factory=dict)  # entry number -> time just before its commit
    arrivals: dict[tuple[str, str], Arrivals] = field(default_factory=dict)  # (sink, client) -> its listener
    connections: int = 0  # the replicator's, at once over every site, once every session streams
    on_source: int = 0  # the replicator's on the source, at once, once every session streams
    steady_from: float = float("inf")  # monotonic time from which the sampler counts
    log: str = ""


def _admin(server: EmbeddedSite) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(server.dsn())
    conn.autocommit = True
    return conn


@pytest.fixture(scope="module")
def scale_sites(site_manager: SiteManager, lr_template: str) -> Iterator[list[SharedSite]]:
    """The source on the first server, sink i on server (i + 1) mod 3: fresh databases, lr installed
    (copies of the migrated ``lr_template``)."""
    servers = site_manager.sites()
    run = f"lrscale_{os.getpid()}_{next(_runs)}"
    sites = [SharedSite(servers[0], f"{run}_src", "scale-src")]
    sites += [SharedSite(servers[(i + 1) % len(servers)], f"{run}_{i}", f"scale-sink-{i}") for i in range(SINKS)]

    def make(site: SharedSite) -> None:
        admin = _admin(site.server)
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{site.dbname}" TEMPLATE "{lr_template}"')
        admin.close()
        conn = site.connect()
        schema.init_site(conn, site.site_id, site.region)
        conn.close()

    on_each(make, sites)  # the seven at once (a copy each: the servers do them side by side)
    yield sites
    for site in sites:
        if site_manager.is_running(site.server):
            admin = _admin(site.server)
            with admin.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{site.dbname}" WITH (FORCE)')
            admin.close()


def _conn_id(site_id: str) -> str:
    return f"lr_scale_{site_id.replace('-', '_')}"


def _sample_connections(run: ScaleRun, stop: threading.Event) -> None:
    """The most connections the replicator held at once, in all and on the source, once every
    session streams and the cycles' connections rested (``Replicator.rest``)."""
    servers = {site.server.site_id: site.server for site in run.sites}
    conns = [_admin(server) for server in servers.values()]
    databases = {site.dbname for site in run.sites}
    try:
        while not stop.wait(0.25):
            by_db: dict[str, int] = {}
            for conn in conns:
                with conn.cursor() as cur:
                    cur.execute(
                        "SELECT datname, count(*) FROM pg_catalog.pg_stat_activity WHERE application_name = %s "
                        "GROUP BY datname",
                        (APP_NAME,),
                    )
                    by_db.update({db: n for db, n in cur.fetchall() if db in databases})
            if time.monotonic() >= run.steady_from:
                run.connections = max(run.connections, sum(by_db.values()))
                run.on_source = max(run.on_source, by_db.get(run.sites[0].dbname, 0))
    finally:
        for conn in conns:
            conn.close()


def _write(run: ScaleRun, clients: list[str], sinks: list[str], errors: list[str]) -> None:
    """RATE transactions/s for WRITE_SECONDS: entry n belongs to client n mod CLIENTS, to every sink."""
    conn = run.sites[0].connect()
    senders = [RoutingQueueClient(conn, c) for c in clients]
    start = time.monotonic()
    try:
        for n in itertools.count():
            due = start + n / RATE
            if due > start + WRITE_SECONDS:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            senders[n % len(senders)].transmit_log_entry_message(str(n).encode(), sinks)
            before_commit = time.time()
            conn.commit()
            run.sent[n] = before_commit
    except psycopg2.Error as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _wait(check, timeout: float, what: str, lr: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if lr.poll() is not None:
            raise AssertionError(
                f"lr sync exited ({lr.returncode}) while waiting for {what}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def scale_run(scale_sites: list[SharedSite], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaleRun]:
    """The whole run once; the tests below read what it recorded."""
    source, sinks = scale_sites[0], scale_sites[1:]
    clients = [f"client-{j}" for j in range(CLIENTS)]
    doc = topology_doc(
        scale_sites,
        [{"source": source.site_id, "sinks": [s.site_id for s in sinks], "clients": clients}],
        providers={c: "tests.support.session:empty_provider" for c in clients},
        conn_ids=_conn_id,
    )
    apply_to(scale_sites, topologies.from_document(doc))
    home = tmp_path_factory.mktemp("scale")
    topology_file = home / "topology.yaml"
    topology_file.write_text(json.dumps(doc))  # JSON is YAML
    run = ScaleRun(scale_sites)
    relays = [open_relay(sink.dsn) for sink in sinks]
    for sink, relay in zip(sinks, relays):
        for client in clients:
            run.arrivals[sink.site_id, client] = listener = Arrivals()
            relay.subscribe(listener, client)
    env = {
        **os.environ,
        **{
            f"AIRFLOW_CONN_{_conn_id(s.site_id).upper()}": json.dumps(s.server.airflow_conn(s.dbname))
            for s in scale_sites
        },
        "PGAPPNAME": APP_NAME,
    }
    log_path = home / "lr-sync.log"
    stop_sampling = threading.Event()
    sampler = threading.Thread(target=_sample_connections, args=(run, stop_sampling), daemon=True)
    with open(log_path, "wb") as log:
        lr = subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", str(topology_file)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        sampler.start()
        sessions = list(run.arrivals.values())
        _wait(lambda: all(a.synced.is_set() for a in sessions), READY_TIMEOUT, "every first contact", lr, log_path)
        run.steady_from = time.monotonic() + REST_AFTER + 1.0
        errors: list[str] = []
        _write(run, clients, [s.site_id for s in sinks], errors)
        assert not errors, f"the application's transactions failed: {errors[:3]}"
        owed = {c: sum(1 for n in run.sent if n % CLIENTS == j) for j, c in enumerate(clients)}
        _wait(
            lambda: all(len(a.entries) >= owed[client] for (_, client), a in run.arrivals.items()),
            DRAIN_TIMEOUT,
            "every entry at every session",
            lr,
            log_path,
        )
    finally:
        stop_sampling.set()
        sampler.join(10)
        if lr.poll() is None:
            os.killpg(lr.pid, signal.SIGINT)  # `lr sync` releases its sessions and exits
            try:
                lr.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(lr.pid, signal.SIGKILL)
                lr.wait()
        for relay in relays:
            relay.close()
        run.log = log_path.read_text(errors="replace")
    yield run


@pytest.mark.slow
def test_every_entry_reaches_each_of_24_sessions_once_in_order_with_bounded_lag(scale_run: ScaleRun):
    assert len(scale_run.arrivals) == 24
    wrong = {}
    lags = []
    for (sink, client), listener in sorted(scale_run.arrivals.items()):
        j = int(client.rsplit("-", 1)[1])
        want = [n for n in sorted(scale_run.sent) if n % CLIENTS == j]
        got = [n for n, _ in listener.entries]
        if got != want or listener.full_syncs != 1 or listener.errors:
            wrong[sink, client] = (
                f"{len(got)} entries for {len(want)} ({len(got) - len(set(got))} twice, "
                f"{len(set(want) - set(got))} missing, in order: {got == sorted(got)}), "
                f"{listener.full_syncs} full syncs, errors {listener.errors[:2]}"
            )
        lags += [at - scale_run.sent[n] for n, at in listener.entries if n in scale_run.sent]
    assert not wrong, f"sessions that did not get their entries once, in order: {wrong}\n{scale_run.log[-3000:]}"
    p50, worst = float(np.percentile(lags, 50)), max(lags)
    print(
        f"\n24 sessions: {len(lags)} deliveries, lag p50 {p50 * 1000:.0f} ms, max {worst * 1000:.0f} ms; the "
        f"replicator held {scale_run.connections} connections at most ({scale_run.on_source} on the source)"
    )
    assert p50 <= LAG_P50_S and worst <= LAG_MAX_S, (
        f"lag p50 {p50:.3f}s (bound {LAG_P50_S}s), max {worst:.2f}s (bound {LAG_MAX_S}s)"
    )


@pytest.mark.slow
def test_the_replicator_holds_connections_per_site_not_per_session(scale_run: ScaleRun):
    sites = len(scale_run.sites)
    assert scale_run.connections <= sites + 4, (
        f"the replicator held {scale_run.connections} connections ({scale_run.on_source} on the source) "
        f"for {sites} sites and 24 sessions (bound: sites + 4 = {sites + 4})"
    )
