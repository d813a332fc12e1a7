"""Delivery states, readiness, the synchronous wait and durability by region (Qpid HA's states, DistributedLog's regions),
against real sites: site-a (region-1) replicates client ``policy`` to site-b (region-2) and
site-c (region-3)."""

from __future__ import annotations

import threading
import time

import pytest

from airflow_provider_lr.client import DeliveryState, DeliveryTimeout
from airflow_provider_lr.engine.errors import ConfigurationError, TransmitError
from airflow_provider_lr.engine.site import status, topology
from airflow_provider_lr.engine.source import delivery, trim
from airflow_provider_lr.engine.source.backlog import readiness, readiness_of
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import App, apply, replicator, topology_doc

PROVIDER = {"policy": "tests.support.session:empty_provider"}


def _in_log_entry_sync(sites, settings: dict | None = None):
    topo = apply(sites, providers=PROVIDER, settings=settings)
    repl = replicator(topo, sites)
    repl.run(max_cycles=4, until_idle=True, interval=0.01)
    repl.close()
    return topo


def _deliver(topo, sites, sink: str) -> None:
    repl = replicator(topo, sites, sessions=[SessionKey("site-a", sink, "policy")])
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    repl.close()


def _sink_position(site) -> dict[str, int]:
    return {site.site_id: site.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]}


def test_states_flip_new_sent_safe_per_destination_as_the_sink_writes_and_acknowledges(lr_sites):
    source, sink_b, sink_c = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    ticket = app.put("k", 1, ["site-b", "site-c"])
    assert ticket.destinations == ("site-b", "site-c")
    found = app.client.delivery(ticket)
    assert found.states == {"site-b": DeliveryState.NEW, "site-c": DeliveryState.NEW}

    _deliver(topo, lr_sites, "site-b")
    found = app.client.delivery(ticket)
    assert found.states == {"site-b": DeliveryState.SAFE, "site-c": DeliveryState.NEW}
    assert found.stored_regions == ["region-1", "region-2"]

    # the sink holds it but the source has not recorded the acknowledgement: sent
    _deliver(topo, lr_sites, "site-c")
    source.query(
        "UPDATE lr.source_sessions SET acked_position = %s WHERE sink_site_id = 'site-c'", (found.position - 1,)
    )
    sent = delivery.ticket_delivery(app.conn, ticket, sink_positions=_sink_position(sink_c))
    assert sent.states["site-c"] is DeliveryState.SENT
    app.close()


def test_a_waiting_producer_delays_its_entry_until_the_sink_acknowledges(lr_sites):
    source, sink_b, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    ticket = app.put("k", 1, ["site-b"])
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(d=App(source).client.wait_until_safe(ticket, timeout=30)))
    waiter.start()
    watcher = source.connect()
    deadline = time.monotonic() + 10
    while delivery.ticket_delivery(watcher, ticket).states["site-b"] is not DeliveryState.DELAYED:
        assert time.monotonic() < deadline, "the waiter's guard never showed"
        time.sleep(0.02)
    # guarded: site-b is not ready while the guarded entry is unacknowledged
    assert [r.ready for r in readiness_of(watcher, "policy", ["site-b"])] == [True]  # nothing before the guard
    assert result == {}
    _deliver(topo, lr_sites, "site-b")
    waiter.join(10)
    assert result["d"].safe_on == ["site-b"]
    assert delivery.ticket_delivery(watcher, ticket).states["site-b"] is DeliveryState.SAFE
    assert source.query("SELECT count(*) FROM lr.delivery_guards") == [(0,)]  # removed with the wait
    watcher.close()
    app.close()


def test_readiness_counts_only_what_precedes_the_first_guard(lr_sites):
    source, _, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    app.put("a", 1, ["site-b"])
    app.put("b", 2, ["site-b"])
    conn = source.connect()
    (before,) = readiness_of(conn, "policy", ["site-b"])
    assert not before.ready and before.unsafe == 2 and before.first_guarded is None
    # a producer guards a later position: the two before it must be safe for site-b to be ready
    last = app.put("c", 3, ["site-b"])
    guard = delivery.add_guard(conn, "policy", delivery.resolve(conn, last), ["site-b"], 30)
    (guarded,) = readiness_of(conn, "policy", ["site-b"])
    assert guarded.first_guarded == delivery.resolve(conn, last) and guarded.unsafe == 2
    sessions = status.site_status(conn).sessions
    (row,) = [s for s in sessions if s["sink_site_id"] == "site-b"]
    assert readiness(row) == f"catching up (2 before guard {guarded.first_guarded})"
    _deliver(topo, lr_sites, "site-b")
    (after,) = readiness_of(conn, "policy", ["site-b"])
    assert after.ready
    delivery.remove_guard(conn, guard)
    conn.close()
    app.close()


def test_wait_until_ready_returns_once_everything_before_it_is_safe(lr_sites):
    source, _, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    with pytest.raises(DeliveryTimeout, match="site-b"):
        app.client.wait_until_ready(["site-b"], timeout=0.5)
    # destinations as a generator were read by the check, then found empty: "ready" at once, for nothing
    with pytest.raises(DeliveryTimeout, match="site-b"):
        app.client.wait_until_ready((d for d in ["site-b"]), timeout=0.3)
    threading.Timer(0.3, _deliver, (topo, lr_sites, "site-b")).start()
    (ready,) = app.client.wait_until_ready(["site-b"], timeout=30)
    assert ready.ready and ready.sink == "site-b"
    with pytest.raises(ConfigurationError, match="not sinks of client 'policy'"):
        app.client.wait_until_ready(["site-z"], timeout=1)
    app.close()


def test_wait_until_safe_times_out_cleanly_naming_the_sink_that_is_down(lr_sites, site_manager):
    source, sink_b, sink_c = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    ticket = app.put("k", 1, ["site-b", "site-c"])
    sink_c.query("CHECKPOINT")  # the tests' servers run without synchronous commit: keep what it has
    site_manager.down([sink_c.site_id], mode="immediate")
    try:
        _deliver(topo, lr_sites, "site-b")
        try:
            _deliver(topo, lr_sites, "site-c")  # fails: the sink is down
        except Exception:
            pass
        started = time.monotonic()
        with pytest.raises(DeliveryTimeout) as timeout:
            app.client.wait_until_safe(ticket, timeout=1.0)
        assert time.monotonic() - started < 5
        assert timeout.value.missing == ["site-c"]
        assert "not acknowledged by ['site-c']" in str(timeout.value) and "safe on ['site-b']" in str(timeout.value)
        # only what was asked: site-b alone is met at once
        assert app.client.wait_until_safe(ticket, destinations=["site-b"], timeout=1.0).safe_on == ["site-b"]
        assert source.query("SELECT count(*) FROM lr.delivery_guards") == [(0,)]
    finally:
        site_manager.up(site_ids=[sink_c.site_id])
    _deliver(topo, lr_sites, "site-c")  # nothing lost: the sink back, the wait succeeds
    assert app.client.wait_until_safe(ticket, timeout=10).safe_on == ["site-b", "site-c"]
    app.close()


def test_regions_count_only_sinks_the_entry_was_sent_to(lr_sites):
    source, _, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    only_b = app.put("k", 1, ["site-b"])
    app.put("other", 2, ["site-c"])  # site-c's acknowledged position will pass only_b's
    _deliver(topo, lr_sites, "site-c")
    position = delivery.resolve(app.conn, only_b)
    assert source.query("SELECT acked_position FROM lr.source_sessions WHERE sink_site_id = 'site-c'")[0][0] > position
    found = app.client.delivery(only_b)
    assert found.states == {"site-b": DeliveryState.NEW}  # site-c is not counted, not even listed
    assert found.stored_regions == ["region-1"]
    conn = source.connect()
    assert delivery.delivered(conn, "policy", position, min_regions=2) is None  # site-c's ack does not count
    with pytest.raises(ConfigurationError, match="can never be met"):
        app.client.wait_until_safe(only_b, min_regions=3, timeout=1)
    with pytest.raises(ConfigurationError, match=r"not sent to \['site-c'\]"):
        app.client.wait_until_safe(only_b, destinations=["site-c"], timeout=1)
    for asked, said in [  # what a wait could not mean is refused before it guards anything
        (
            {"destinations": "site-b"},
            "destinations is a list of site ids, not one string",
        ),  # was: not sent to [-, b, e…]
        ({"destinations": [None]}, "destinations must be site ids"),
        ({"timeout": "5"}, "timeout must be a finite number of seconds"),  # was: a TypeError
        ({"timeout": float("nan")}, "timeout must be a finite number of seconds"),  # was: the server's interval error
        ({"timeout": float("inf")}, "timeout must be a finite number of seconds"),
        ({"timeout": -1}, "timeout must be a finite number of seconds, at least 0"),
        ({"min_regions": "2"}, "min_regions must be a whole number >= 0"),
    ]:
        with pytest.raises(ConfigurationError, match=said):
            app.client.wait_until_safe(only_b, **asked)
        if "min_regions" not in asked:
            with pytest.raises(ConfigurationError, match=said):
                app.client.wait_until_ready(**{"destinations": ["site-b"], "timeout": 1, **asked})
    _deliver(topo, lr_sites, "site-b")
    assert delivery.delivered(conn, "policy", position, min_regions=2).stored_regions == ["region-1", "region-2"]
    conn.close()
    app.close()


def test_durable_position_follows_acknowledgements_in_enough_regions(lr_sites):
    source, _, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    first = app.put("a", 1, ["site-b", "site-c"])
    app.put("b", 2, ["site-b", "site-c"])
    conn = source.connect()
    p1 = delivery.resolve(conn, first)
    assert delivery.durable_position(conn, 2) == p1 - 1
    _deliver(topo, lr_sites, "site-b")  # region-1 + region-2: durable in 2, not 3
    drawn = source.query("SELECT last_value FROM lr.commit_position_seq")[0][0]
    assert delivery.durable_position(conn, 2) == drawn
    assert delivery.durable_position(conn, 3) == p1 - 1
    _deliver(topo, lr_sites, "site-c")
    assert delivery.durable_position(conn, 3) == drawn
    rendered = status.render(status.site_status(conn))
    assert f"durable up to position {drawn} of {drawn} (every entry acknowledged by every sink it named)" in rendered
    conn.close()
    app.close()


def test_entries_a_retention_trim_took_from_a_lagging_sink_are_not_durable(lr_sites):
    """site-c is behind when a retention trim removes what it lacks: those entries were never
    acknowledged there, whatever the log (which no longer holds them) can say."""
    source, _, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    before = source.query("SELECT acked_position FROM lr.source_sessions WHERE sink_site_id = 'site-c'")[0][0]
    for i in range(3):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    _deliver(topo, lr_sites, "site-b")
    conn = source.connect()
    assert trim.retention_trim(conn, 0.0).trim_mark > before  # past site-c
    assert delivery.durable_position(conn, 3) == before
    assert delivery.durable_position(conn, delivery.EVERY_NAMED_SINK) == before
    conn.close()
    app.close()


def test_the_topology_rule_is_the_default_wait(lr_sites):
    source, _, _ = lr_sites
    doc = topology_doc(lr_sites, providers=PROVIDER)
    doc["durability"] = {"min_regions_for_durability": 2, "ack_quorum": 2}
    topo = topologies.from_document(doc)
    for site in lr_sites:
        conn = site.connect()
        topology.apply_to_site(conn, topo, site.site_id)
        conn.close()
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=4, until_idle=True, interval=0.01)
    repl.close()
    app = App(source)
    ticket = app.put("k", 1, ["site-b", "site-c"])
    with pytest.raises(DeliveryTimeout, match=r"stored in >= 2 regions"):
        app.client.wait_until_safe(ticket, timeout=0.3)
    _deliver(topo, lr_sites, "site-c")
    assert app.client.wait_until_safe(ticket, timeout=5).stored_regions == ["region-1", "region-3"]
    lonely = app.put("x", 1, ["site-b"])  # 2 regions reachable: fine
    _deliver(topo, lr_sites, "site-b")
    assert app.client.wait_until_safe(lonely, timeout=5).safe_on == ["site-b"]
    conn = source.connect()
    assert "every entry stored in >= 2 regions" in status.render(status.site_status(conn))
    conn.close()
    app.close()


def test_a_ticket_is_waited_on_only_after_its_commit(lr_sites):
    source, _, _ = lr_sites
    _in_log_entry_sync(lr_sites)
    app = App(source)
    ticket = app.client.transmit_log_entry_message(b"x", ["site-b"])
    with pytest.raises(TransmitError, match="commit the transaction before waiting"):
        app.client.wait_until_safe(ticket, timeout=1)
    app.conn.rollback()
    with pytest.raises(TransmitError, match="rolled back"):
        app.client.wait_until_safe(ticket, timeout=1)
    app.close()


def test_waiting_until_ready_inside_the_applications_transaction_is_refused_and_commits_nothing(lr_sites):
    """``wait_until_ready`` commits as it goes: called before the application's commit, it committed
    the application's row and its transmit, which the application's rollback then could not undo."""
    source, _, _ = lr_sites
    _in_log_entry_sync(lr_sites)
    app = App(source)
    with app.conn.cursor() as cur:
        cur.execute("INSERT INTO app_state VALUES ('uncommitted', 1)")
    app.client.transmit_log_entry_message(b"uncommitted", ["site-b"])
    with pytest.raises(TransmitError, match="commit .* before waiting until destinations are ready"):
        app.client.wait_until_ready(["site-b"], timeout=1)
    app.conn.rollback()
    assert source.query("SELECT count(*) FROM app_state WHERE k = 'uncommitted'") == [(0,)]
    assert source.query("SELECT count(*) FROM lr.log_entries WHERE message LIKE '%%uncommitted%%'") == [(0,)]
    app.close()


def _sites(regions: int, per_region: int) -> dict:
    sites = [{"id": f"s{r}-{i}", "region": f"region-{r}"} for r in range(regions) for i in range(per_region)]
    return {
        "sites": sites,
        "replication": [{"source": "s0-0", "sinks": [s["id"] for s in sites[1:]], "clients": ["policy"]}],
    }


def test_seed_004_example_ack_quorum_8_of_15_over_3_regions_of_20_is_refused_9_accepted():
    doc = _sites(3, 20)
    doc["durability"] = {"min_regions_for_durability": 2, "write_quorum": 15, "ack_quorum": 8}
    with pytest.raises(ConfigurationError) as refused:
        topologies.from_document(doc)
    message = str(refused.value)
    assert "durability.ack_quorum" in message
    assert "ack_quorum 8 could be met in fewer than 2 regions" in message and "puts 8 copies in 1 region" in message
    doc["durability"]["ack_quorum"] = 9
    assert topologies.from_document(doc).durability["ack_quorum"] == 9


def test_durability_the_sites_cannot_reach_is_refused_with_the_numbers():
    doc = _sites(2, 3)
    doc["durability"] = {"min_regions_for_durability": 3}
    with pytest.raises(ConfigurationError, match=r"3 regions can never be reached: the sites span only 2"):
        topologies.from_document(doc)
    doc["durability"] = {"min_regions_for_durability": 2, "write_quorum": 7}
    with pytest.raises(ConfigurationError, match="write_quorum 7 exceeds the 6 sites"):
        topologies.from_document(doc)
    doc["durability"] = {"min_regions_for_durability": 2, "write_quorum": 4, "ack_quorum": 5}
    with pytest.raises(ConfigurationError, match="ack_quorum 5 exceeds write_quorum 4"):
        topologies.from_document(doc)
    doc["durability"] = {"min_regions_for_durability": 2, "ack_quorum": 2}  # write all 6: 3 in one region
    with pytest.raises(ConfigurationError, match="ack_quorum 2 could be met"):
        topologies.from_document(doc)
    doc["durability"] = {"min_regions_for_durability": 2, "ack_quorum": 4}
    assert topologies.from_document(doc).durability == {"min_regions_for_durability": 2, "ack_quorum": 4}
    doc["durability"] = {"min_regions_for_durability": 2, "ack_quorm": 4}
    with pytest.raises(ConfigurationError, match="unknown key 'ack_quorm'"):
        topologies.from_document(doc)


def test_the_delivered_sensor_sees_an_entry_a_safe_trim_removed_as_safe_and_names_a_sink_a_retention_trim_left(
    lr_sites,
):
    """`example_lr_user_pipeline` triggered from the UI beside `lr_maintenance`: the safe trim removed
    the orders' entry once both sinks acknowledged it, and the `delivered` sensor failed with "no log
    entry of client 'policy' at commit position N (... or trimmed)" for an entry safe everywhere."""
    source, _, _ = lr_sites
    topo = _in_log_entry_sync(lr_sites)
    app = App(source)
    position = delivery.resolve(app.conn, app.put("k", 1, ["site-b", "site-c"]))
    _deliver(topo, lr_sites, "site-b")
    _deliver(topo, lr_sites, "site-c")
    conn = source.connect()
    assert trim.safe_trim(conn).trim_mark >= position
    found = delivery.delivered(conn, "policy", position, ["site-b", "site-c"], 2)
    assert found is not None and found.safe_on == ["site-b", "site-c"] and len(found.stored_regions) == 3
    assert delivery.delivered(conn, "policy", position) is not None  # every sink acknowledged it
    with pytest.raises(ConfigurationError, match=r"name the destinations"):
        delivery.delivered(conn, "policy", position, (), 2)  # which regions it reached is gone with it

    later = delivery.resolve(app.conn, app.put("k", 2, ["site-b", "site-c"]))
    _deliver(topo, lr_sites, "site-b")
    assert trim.retention_trim(conn, 0.0).trim_mark >= later
    with pytest.raises(ConfigurationError, match=r"trimmed .* before \['site-c'\] acknowledged them"):
        delivery.delivered(conn, "policy", later, ["site-b", "site-c"])
    assert delivery.delivered(conn, "policy", later, ["site-b"]) is not None
    conn.close()
    app.close()
