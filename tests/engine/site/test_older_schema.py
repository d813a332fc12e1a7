"""A site whose lr schema is older than this lr (the package upgraded, `lr init` not run on every
site yet): lr's work that needs a newer schema refuses the site with an error that says to run
`lr init`, before it writes anything; what can run on the older schema does (the session cycles
down to ``schema.REPLICATION_SCHEMA``, the application's transmit); `lr status` says so."""

from __future__ import annotations

import logging
import time

import psycopg2
import pytest

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import ConfigurationError, SchemaError
from airflow_provider_lr.engine.session.membership import Membership
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.sink import wakeup
from airflow_provider_lr.engine.site import failover, status, topology
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.subscriber import RoutingQueueSubscriber, open_relay
from tests.support.session import App, apply, queue, replicator, table_provider, topology_doc
from tests.support.subscriber import Background, Recorder

A, B, C = "site-a", "site-b", "site-c"
TOO_OLD = schema.REPLICATION_SCHEMA - 1


def install(sites, older: dict[str, int]) -> None:
    """`lr init` on every site but those in ``older``, which an older lr installed: migrated only up
    to their version, with their site id recorded."""
    for site in sites:
        conn = site.connect()
        if site.site_id in older:
            schema.migrate(conn, target=older[site.site_id])
            with conn.cursor() as cur:
                cur.execute("INSERT INTO lr.site_info (site_id, region) VALUES (%s, %s)", (site.site_id, site.region))
            conn.commit()
        else:
            schema.init_site(conn, site.site_id, site.region)
        conn.close()


def lr_init(site) -> None:
    conn = site.connect()
    schema.init_site(conn, site.site_id, site.region)
    conn.close()


def connector(sites):
    dsns = {s.site_id: s.dsn for s in sites}
    return lambda site_id: psycopg2.connect(dsns[site_id])


def by_id(sites, site_id: str):
    return next(s for s in sites if s.site_id == site_id)


def test_a_database_without_lr_is_told_to_run_lr_init_not_that_its_version_is_0(sites):
    conn = sites[0].connect()
    with pytest.raises(SchemaError, match=r"has no lr schema; run `lr init` on it first"):
        schema.require_current(conn, "replicating from it", schema.REPLICATION_SCHEMA)
    assert conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    conn.close()


def test_the_version_is_read_once_per_connection_leaving_the_callers_transaction_open(lr_sites):
    site = lr_sites[0]
    conn = site.connect()
    with conn.cursor() as cur:  # the caller's transaction
        cur.execute("SELECT 1")
    schema.require_current(conn, "streaming from it")
    assert conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_INTRANS
    conn.rollback()
    site.query("DELETE FROM lr.schema_migrations WHERE version = %s", (schema.latest_version(),))
    schema.require_current(conn, "streaming from it")  # found current on this connection already
    fresh = site.connect()
    with pytest.raises(SchemaError, match=rf"version {schema.latest_version() - 1}, older than"):
        schema.require_current(fresh, "streaming from it")
    conn.close()
    fresh.close()


@pytest.mark.parametrize("old", [A, B])
def test_a_cycle_refuses_a_site_older_than_replication_needs_writes_nothing_and_delivers_after_lr_init(sites, old):
    """The application keeps transmitting at its source meanwhile (it needs only the log tables)."""
    install(sites, {old: TOO_OLD})
    topo = apply(sites, [{"source": A, "sinks": [B], "clients": ["policy"]}])
    App(sites[0]).put("k0", 0, [B])
    reports = replicator(topo, sites, providers={"policy": table_provider}).run_cycle()
    assert [r.session for r in reports] == ["site-a->site-b/policy"]
    assert "SchemaError" in reports[0].error and f"version {TOO_OLD}, older than" in reports[0].error
    assert "run `lr init` on the site" in reports[0].error
    assert sites[0].query("SELECT lease_epoch, lease_owner FROM lr.source_sessions") == [(0, None)]
    assert sites[1].query("SELECT count(*) FROM lr.sink_sessions") == [(0,)]
    lr_init(by_id(sites, old))
    run_until_idle(replicator(topo, sites, providers={"policy": table_provider}))
    assert ("snap", "k0=0") in queue(sites[1], A)


def test_the_cycles_and_the_applications_run_on_the_oldest_schema_replication_needs(sites):
    """Transmit at the source, the cycles (a full sync, then log-entry sync), a subscriber at the sink."""
    install(sites, {A: schema.REPLICATION_SCHEMA, B: schema.REPLICATION_SCHEMA})
    topo = apply(sites, [{"source": A, "sinks": [B], "clients": ["policy"]}])
    app, repl = App(sites[0]), replicator(topo, sites, providers={"policy": table_provider})
    app.put("k0", 0, [B])
    run_until_idle(repl)
    app.put("k1", 1, [B])
    run_until_idle(repl)
    consumed = Recorder()
    with RoutingQueueSubscriber(sites[1].dsn, "policy") as subscriber:
        subscriber.poll(consumed)
    assert [p for k, p in consumed.events[A] if k in ("snap", "log")] == ["k0=0", "k1=1"]


def test_a_subscriber_started_before_lr_init_at_its_sink_waits_for_it_then_delivers(sites, monkeypatch):
    """An application deployed before `lr init` reached its sink: ``run()`` died at its first read
    with "relation lr.receive_queue does not exist". Now ``poll()`` says to run `lr init`; ``run()``
    waits for the schema (bounded, each try counted with that error) and delivers once lr is there;
    one whose site never gets it (a wrong database in the DSN) ends after the wait, saying so; so does
    a relay's subscription."""
    monkeypatch.setattr(wakeup, "SCHEMA_WAIT", 60.0, raising=False)  # lr init below may take seconds on a busy machine
    source, sink, never = sites
    with pytest.raises(SchemaError, match=r"has no lr schema; run `lr init`"):
        RoutingQueueSubscriber(sink.dsn, "policy").poll(Recorder())
    consumed = Recorder()
    waiting = Background(lambda stop: RoutingQueueSubscriber(sink.dsn, "policy", poll_interval=0.1).run(consumed, stop))
    lr_init(source)
    lr_init(sink)
    topo = apply([source, sink], [{"source": A, "sinks": [B], "clients": ["policy"]}])
    app = App(source)
    app.put("k0", 0, [B])
    run_until_idle(replicator(topo, [source, sink], providers={"policy": table_provider}))
    deadline = time.monotonic() + 10
    while ("snap", "k0=0") not in consumed.events.get(A, []):
        assert time.monotonic() < deadline and waiting.thread.is_alive(), (consumed.events, waiting.error)
        time.sleep(0.05)
    stats = waiting.stop()
    assert stats.failures >= 1 and "run `lr init`" in stats.errors[0], stats
    monkeypatch.setattr(wakeup, "SCHEMA_WAIT", 1.0, raising=False)  # the wait is read at each try
    wrong_db = Background(
        lambda stop: RoutingQueueSubscriber(never.dsn, "policy", poll_interval=0.1).run(Recorder(), stop)
    )
    wrong_db.thread.join(10)
    assert isinstance(wrong_db.error, SchemaError) and "has no lr schema" in str(wrong_db.error), wrong_db.error
    assert "waited 1 s" in str(wrong_db.error)
    relay = open_relay(never.dsn, poll_interval=0.1)  # a relay's subscription alike
    try:
        with pytest.raises(SchemaError, match=r"has no lr schema; run `lr init`.*\(waited 1 s"):
            relay.subscribe(Recorder(), "policy").join(10)
    finally:
        relay.close()
    app.close()


def test_a_replicator_member_says_its_source_needs_lr_init(sites, caplog):
    install(sites, {A: TOO_OLD})
    topo = apply(sites, [{"source": A, "sinks": [B], "clients": ["policy"]}])
    member = Membership(connector(sites), topo.sessions(), "host:1:aaaa", SessionSettings(member_heartbeat=0.05))
    try:
        with caplog.at_level(logging.WARNING, logger="airflow_provider_lr.engine.session.membership"):
            member.beat()
    finally:
        member.leave()
    said = [r.getMessage() for r in caplog.records if "no heartbeat at site-a" in r.getMessage()]
    assert len(said) == 1 and "run `lr init`" in said[0], said


def test_a_topology_apply_refuses_a_site_older_than_replication_needs_and_applies_nowhere(sites):
    install(sites, {C: TOO_OLD})
    topo = topologies.from_document(topology_doc(sites))
    with pytest.raises(ConfigurationError, match=r"site 'site-c'.*run `lr init`.*nothing was applied on any site"):
        topology.apply_everywhere(topo, connector(sites))
    assert [s.query("SELECT count(*) FROM lr.topology")[0][0] for s in sites] == [0, 0, 0]
    lr_init(sites[2])
    topology.apply_everywhere(topo, connector(sites))
    assert [s.query("SELECT count(*) FROM lr.topology")[0][0] for s in sites] == [1, 1, 1]


@pytest.mark.parametrize("old", [B, C])
def test_a_failover_refuses_a_site_older_than_it_needs_with_nothing_done(sites, old):
    """The promoted site (site-b) or another sink involved (site-c)."""
    install(sites, {old: TOO_OLD})
    apply(sites)
    request = failover.FailoverRequest(A, B, reason="site-a lost", planned=False)
    with pytest.raises(SchemaError, match=rf"version {TOO_OLD}, older than .*a failover needs.*run `lr init`"):
        failover.promote(request, connector(sites))
    assert [s.query("SELECT count(*) FROM lr.failovers")[0][0] for s in sites] == [0, 0, 0]
    assert sites[1].query("SELECT count(*) FROM lr.source_sessions") == [(0,)]


@pytest.mark.parametrize("version, says", [(TOO_OLD, "lr replicates nothing with it"), (None, "not streamed")])
def test_status_says_a_site_needs_lr_init_and_is_degraded(sites, version, says):
    version = schema.latest_version() - 1 if version is None else version
    install(sites, {B: version})
    apply(sites)
    found = {}
    for site in sites:
        conn = site.connect()
        found[site.site_id] = status.site_status(conn, site.site_id)
        conn.close()
    assert [found[s].schema_behind is None for s in (A, B, C)] == [True, False, True]
    shown = status.render_sites(found)
    assert f"site-b: schema v{version}," in shown and "  upgrade: " in shown and says in shown
    assert "run `lr init` on the site" in shown
    code, reasons = status.health(found)
    assert code == status.DEGRADED and any(r.startswith("site-b: lr schema v") for r in reasons), reasons
    assert status.sites_as_dict(found)["sites"][B]["schema_behind"] == found[B].schema_behind


def test_status_says_a_site_newer_than_this_lr_needs_the_package_upgraded_and_is_degraded(lr_sites):
    """A site `lr init`ed by a newer lr: `lr init` here refuses it, but `lr status` called it healthy."""
    newer = schema.latest_version() + 1
    lr_sites[1].query(
        "INSERT INTO lr.schema_migrations (version, name, checksum) VALUES (%s, 'from_a_newer_lr', 'x')", (newer,)
    )
    found = {}
    for site in lr_sites:
        conn = site.connect()
        found[site.site_id] = status.site_status(conn, site.site_id)
        conn.close()
    assert [found[s].schema_behind is None for s in (A, B, C)] == [True, False, True]
    shown = status.render_sites(found)
    assert f"site-b: schema v{newer}," in shown and "upgrade airflow-provider-lr" in shown, shown
    code, reasons = status.health(found)
    assert code == status.DEGRADED and any(r.startswith(f"site-b: lr schema v{newer} is newer") for r in reasons)
