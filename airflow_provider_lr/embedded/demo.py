"""``lr demo``: embedded sites, a source application that transmits inside its own transactions,
replication cycles (the engine `lr sync` and the DAGs run), and what arrived at each sink.

Everything is real: separate PostgreSQL servers per site, the lr schema from its migrations, the
shared log, full sync through the client's provider, then log-entry sync. Re-running the demo
continues on the same sites (their data is kept until ``lr sites down --remove``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient
from airflow_provider_lr.embedded.sites import SiteManager
from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.errors import LRError, one_line
from airflow_provider_lr.engine.session.runner import CycleReport
from airflow_provider_lr.engine.site import status, topology
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.paths import write_replacing
from airflow_provider_lr.subscriber import RoutingQueueSubscriber

CLIENT = "policy"
TABLE = "demo_policy"


def policy_provider(ctx) -> None:
    """The demo client's full-sync provider: every row of its table, as of the sync's snapshot."""
    with ctx.conn.cursor() as cur:
        cur.execute(f"SELECT k, v FROM {TABLE} ORDER BY k")
        for k, v in cur:
            ctx.transmit(f"{k}={v}".encode())


class SinkApplication:
    """The demo's sink-side application: applies what arrived to its own copy of the table, in the
    subscriber's delivery transaction (so each payload is applied exactly once)."""

    def __init__(self, sub: RoutingQueueSubscriber) -> None:
        self.sub = sub
        self.snapshot_rows = self.log_entries = self.foreign = 0

    def _upsert(self, payloads: list[bytes]) -> None:
        cur = self.sub.cursor()
        for payload in payloads:
            k, _, v = payload.decode(errors="replace").partition("=")
            if not v.lstrip("-").isdigit():  # another application's payload for the client (README §3's)
                self.foreign += 1
                continue
            cur.execute(
                f"INSERT INTO {TABLE} VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (k, int(v))
            )

    def on_snapshot_sync_start(self, source: str) -> None:
        self.sub.cursor().execute(f"DELETE FROM {TABLE}")  # one source: its full sync replaces the copy

    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool:
        self._upsert(payloads)
        self.snapshot_rows += len(payloads)
        return True

    def on_snapshot_sync_complete(self, source: str) -> None:
        pass

    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool:
        self._upsert(payloads)
        self.log_entries += len(payloads)
        return True


def consume(site_id: str, dsn: str) -> None:
    """One subscriber pass at a sink, applying into the sink application's own table."""
    own = conninfo.connect_dsn(dsn, Purpose.APPLICATION)  # the sink application's own connection
    with own.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (k text PRIMARY KEY, v bigint NOT NULL)")
    own.commit()
    sub = RoutingQueueSubscriber(dsn, client_name=CLIENT)
    app = SinkApplication(sub)
    try:
        delivered = sub.poll(app)
        sources = sub.sources()
    finally:
        sub.close()
    with own.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {TABLE}")
        rows = cur.fetchone()[0]
    own.close()
    print(
        f"  {site_id}: the subscriber delivered {delivered} queue entries (a full sync: its start, "
        f"{app.snapshot_rows} rows, its end; {app.log_entries} log entries) from {', '.join(sources)}; "
        f"its {TABLE} has {rows} rows"
        + (f"; {app.foreign} payload(s) not of the demo's form key=value skipped" if app.foreign else "")
    )


def write_topology(manager: SiteManager, site_ids: list[str]) -> Path:
    sites = {s.site_id: s for s in manager.sites()}
    doc = {
        "sites": [{"id": i, "region": sites[i].region, "conn_id": sites[i].conn_id} for i in site_ids],
        "replication": [{"source": site_ids[0], "sinks": site_ids[1:], "clients": [CLIENT]}],
        "providers": {CLIENT: "airflow_provider_lr.embedded.demo:policy_provider"},
    }
    path = manager.home / "demo-topology.yaml"
    return write_replacing(path, yaml.safe_dump(doc, sort_keys=False))


class _Shown:
    """Prints each cycle's reports; a session's error once, not at every one of up to 20 cycles."""

    def __init__(self) -> None:
        self.said: dict[str, str] = {}

    def __call__(self, reports: list[CycleReport]) -> None:
        for r in reports:
            if r.error and self.said.get(r.session) != r.error:
                self.said[r.session] = r.error
                print(f"    {r.session}: ERROR {r.error}")
            elif not r.error:
                self.said.pop(r.session, None)
                _show_progress(r)


def _show_progress(r: CycleReport) -> None:
    if not r.idle:
        print(
            f"    {r.session}: {r.decision}: {r.snapshot_messages} full-sync messages, "
            f"{r.delivered} log entries -> {r.state}, remaining {r.remaining}"
        )


def _fresh_start(manager: SiteManager) -> str:
    return f"start afresh with `lr sites down --remove`, then `lr demo` (the sites under {manager.home} are deleted)"


def _apply(manager: SiteManager, topo: topologies.Topology, connect: Callable[[str], Any]) -> None:
    """The demo's topology on every site, checked as `lr topology apply` checks it: re-run on sites
    a failover moved the client from, the demo wrote its topology over theirs unchecked, then
    printed the same fencing error 40 times and exited 0."""
    try:
        topology.apply_everywhere(topo, connect)
    except LRError as exc:
        raise LRError(f"the demo cannot continue on these sites: {one_line(exc)}; {_fresh_start(manager)}") from None


def _replicate(manager: SiteManager, repl: Replicator) -> None:
    """Until every session is caught up; one that still fails stops the demo (exit 1), saying why."""
    reports = repl.run(max_cycles=20, until_idle=True, interval=0.05, on_cycle=_Shown())
    failing = [r for r in reports if r.error]
    if failing:
        raise LRError(
            f"the demo could not replicate {', '.join(r.session for r in failing)}: {one_line(failing[0].error)}; "
            + _fresh_start(manager)
        )


def run(manager: SiteManager, sink_count: int = 2) -> int:
    print(f"lr demo: starting {sink_count + 1} embedded PostgreSQL sites under {manager.home}")
    sites = manager.up(count=sink_count + 1)
    for site in sites:
        conn = site.conninfo().connect()
        try:
            result = schema.init_site(conn, site.site_id, site.region)
        finally:
            conn.close()
        print(f"  {site.site_id} ({site.region}) port {site.port}: lr schema v{result.version}")

    ids = [s.site_id for s in sites]
    source, sinks = ids[0], ids[1:]
    topo = topologies.load(write_topology(manager, ids))
    by_id = {s.site_id: s for s in sites}
    connect = lambda site_id: by_id[site_id].conninfo().connect()  # noqa: E731
    _apply(manager, topo, connect)
    print(f"\ntopology {topo.topology_config_id}: {source} -> {', '.join(sinks)} for client {CLIENT!r}")

    app = by_id[source].conninfo().connect(Purpose.APPLICATION)  # the source application's own connection
    with app.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (k text PRIMARY KEY, v bigint NOT NULL)")
    app.commit()
    client = RoutingQueueClient(app, CLIENT)
    rng = random.Random(7)

    def change(n: int) -> None:
        """n application transactions: update a row and transmit it, atomically."""
        for _ in range(n):
            key, value = f"policy-{rng.randrange(20)}", rng.randrange(10**6)
            dests = rng.sample(sinks, rng.randint(1, len(sinks)))
            with app.cursor() as cur:
                cur.execute(
                    f"INSERT INTO {TABLE} VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (key, value)
                )
            client.transmit_log_entry_messages([LRMessageWithDestinations(f"{key}={value}".encode(), dests)])
            app.commit()

    change(20)
    print(f"\n{source}: 20 application transactions, each transmitting to a random subset of the sinks")
    repl = Replicator(topo, connect)
    try:
        started = time.monotonic()
        print("replicating (first contact: full sync from the client's provider, then log entries):")
        _replicate(manager, repl)
        change(30)
        print(f"{source}: 30 more transactions; replicating the deltas:")
        _replicate(manager, repl)
        print(f"caught up in {time.monotonic() - started:.1f}s\n")
    finally:
        repl.close()
        app.close()

    print("sink applications consume their receive queues:")
    for site_id in sinks:
        consume(site_id, by_id[site_id].dsn())
    print()
    found: dict[str, status.SiteStatus | str] = {}
    for site_id in ids:
        conn = connect(site_id)
        try:
            found[site_id] = status.site_status(conn, site_id)
        finally:
            conn.close()
    print(status.render_sites(found))
    print(
        "\nsites are left running; try `lr status --topology "
        f"{manager.home / 'demo-topology.yaml'}`, stop them with `lr sites down`"
    )
    return 0
