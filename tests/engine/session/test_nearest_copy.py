"""Nearest-copy catch-up: a sink of a client of tables only is seeded from a consistent
peer sink in its region, falls back to the source when no peer answers in time, and a crash at
either step of the seed leaves it whole."""

from __future__ import annotations

import time

import psycopg2
import pytest

from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session import nearest_copy
from airflow_provider_lr.engine.session.handshake import Position
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.link_proxy import LinkProxy
from tests.support.session import apply, replicator, run_crashing_replicator, topology_doc
from tests.support.tables import TableWriter, create_accounts, federate, rows

REGIONS = {"site-a": "us-east", "site-b": "eu-west", "site-c": "eu-west"}
SETTINGS = {"data_timeout": 30.0, "barrier_timeout": 2.0, "peer_probe_delay": 0.5}


def _sync(repl, cycles: int = 40) -> list:
    seen: list = []
    repl.run(max_cycles=cycles, until_idle=True, interval=0.05, on_cycle=seen.extend)
    return seen


def _peer_synced(lr_sites, rows_: int = 3000):
    """site-b (eu-west) synced from site-a (us-east); site-c (eu-west) not started yet."""
    source, peer, new = lr_sites
    topo = apply(lr_sites, regions=REGIONS)
    create_accounts(source, rows=rows_)
    federate(source)
    only_b = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-b", "policy")], **SETTINGS)
    _sync(only_b)
    assert rows(peer) == rows(source)
    return topo, only_b


def _requests(source, sink: str) -> list[str]:
    return [
        r[0]
        for r in source.query(
            "SELECT status FROM lr.full_sync_requests WHERE sink_site_id = %s ORDER BY requested_at", (sink,)
        )
    ]


def test_a_new_sink_is_seeded_from_its_regions_peer_then_catches_up_from_the_peers_position(lr_sites):
    source, peer, new = lr_sites
    topo, only_b = _peer_synced(lr_sites)
    with TableWriter(source, truncate=False) as writer:
        time.sleep(0.3)
        _sync(only_b, cycles=2)  # the peer moves on while the source keeps changing

        def peer_moves_on() -> None:  # the peer advances after the seed's snapshot of it was taken
            time.sleep(0.2)
            only_b.run_cycle()

        only_c = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-c", "policy")], **SETTINGS)
        with on_fault("peer_seed_before_commit", peer_moves_on):
            reports = _sync(only_c, cycles=3)
    assert writer.transactions > 10
    _sync(only_b)
    reports += _sync(only_c)
    seeded = [r for r in reports if r.session == "site-a->site-c/policy" and "seeded from peer site-b" in r.reason]
    assert seeded and not any(r.error for r in reports), [(r.session, r.reason, r.error) for r in reports]
    assert rows(new) == rows(peer) == rows(source)
    assert _requests(source, "site-c") == [], "the source was not asked for a snapshot"
    (detail,) = new.query("SELECT detail FROM lr.sink_tables WHERE source_site_id = 'site-a'")[0]
    assert detail.startswith("copied from peer site-b at position ")
    acked = dict(source.query("SELECT sink_site_id, acked_position FROM lr.source_sessions"))
    assert acked["site-c"] == new.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]


def test_peers_that_do_not_answer_are_passed_over_with_a_doubling_delay_then_the_nearest_good_one_seeds(lr_sites):
    source, peer, new = lr_sites
    _peer_synced(lr_sites, rows_=200)
    key = SessionKey("site-a", "site-c", "policy")
    with LinkProxy(1, stalled=True) as hung_1, LinkProxy(1, stalled=True) as hung_2:
        peers = [
            nearest_copy.Peer("hung-1", lambda: psycopg2.connect(hung_1.dsn(peer.dsn))),
            nearest_copy.Peer("hung-2", lambda: psycopg2.connect(hung_2.dsn(peer.dsn))),
            nearest_copy.Peer("site-b", lambda: psycopg2.connect(peer.dsn)),
        ]
        src, sink = source.connect(), new.connect()
        try:
            started = time.monotonic()
            position = Position.of(writes.read_metadata(sink, key.source, key.client), epoch=1)
            seed = nearest_copy.seed_from_peers(
                src, sink, key, position, registry.federated_tables(src, "policy"), nearest_copy.Candidates(peers, 0.3)
            )
            elapsed = time.monotonic() - started
        finally:
            src.close()
            sink.close()
    assert seed.peer == "site-b" and seed.rows == 200, seed
    assert seed.passed == ["hung-1: did not answer within 0.3s", "hung-2: did not answer within 0.6s"]
    assert 0.9 <= elapsed < 5, elapsed
    assert rows(new) == rows(peer)


def test_with_its_peer_hung_the_sink_takes_the_sources_snapshot_after_the_delay(lr_sites):
    source, peer, new = lr_sites
    topo, _ = _peer_synced(lr_sites, rows_=500)
    source.query("UPDATE public.accounts SET owner = 'after' WHERE id <= 100")
    dsns = {s.site_id: s.dsn for s in lr_sites}
    with LinkProxy(1, stalled=True) as hung:
        route = {**dsns, "site-b": hung.dsn(peer.dsn)}
        repl = Replicator(
            topo,
            lambda site: psycopg2.connect(route[site]),
            settings=SessionSettings(**SETTINGS),
            sessions=[SessionKey("site-a", "site-c", "policy")],
        )
        reports = _sync(repl)
    reasons = " ".join(r.reason for r in reports)
    assert "site-b: did not answer within 0.5s" in reasons and "snapshot from the source" in reasons, reasons
    assert _requests(source, "site-c") == ["applied"]
    assert rows(new) == rows(source)


def test_a_peer_that_is_not_consistent_is_not_used_and_a_client_with_queue_data_never_asks_peers(lr_sites):
    source, peer, new = lr_sites
    topo = apply(lr_sites, regions=REGIONS)
    create_accounts(source, rows=50)
    federate(source)
    # site-b has never synced: no session there to copy
    repl = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-c", "policy")], **SETTINGS)
    reports = _sync(repl)
    assert any("site-b: has no session with site-a for policy" in r.reason for r in reports), [
        r.reason for r in reports
    ]
    assert rows(new) == rows(source)
    # a client whose full sync carries the application's data: only the source has it
    repl = replicator(
        topo,
        lr_sites,
        providers={"policy": lambda ctx: None},
        sessions=[SessionKey("site-a", "site-b", "policy")],
        **SETTINGS,
    )
    reports = _sync(repl)
    assert not any("peer" in r.reason for r in reports)
    assert rows(peer) == rows(source)


def test_nearest_copy_off_in_the_topology_takes_the_source(lr_sites):
    source, peer, new = lr_sites
    _peer_synced(lr_sites, rows_=50)
    topo = topologies.from_document(topology_doc(lr_sites, regions=REGIONS, settings={"nearest_copy": False}))
    assert SessionSettings.from_topology(topo).nearest_copy is False
    for site in lr_sites:
        conn = site.connect()
        topology.apply_to_site(conn, topo, site.site_id)
        conn.close()
    repl = replicator(
        topo, lr_sites, sessions=[SessionKey("site-a", "site-c", "policy")], **SETTINGS, nearest_copy=False
    )
    reports = _sync(repl)
    assert not any("peer" in r.reason for r in reports)
    assert _requests(source, "site-c") == ["applied"] and rows(new) == rows(source)


@pytest.mark.parametrize("fault", ["peer_seed_before_commit", "after_peer_seed"])
def test_a_replicator_killed_while_seeding_from_a_peer_leaves_the_sink_whole(lr_sites, fault):
    source, peer, new = lr_sites
    topo, only_b = _peer_synced(lr_sites, rows_=1000)
    only_b.close()  # its lease on site-b's session is free for the replicator that crashes
    with TableWriter(source, truncate=False) as writer:
        crashed = run_crashing_replicator(topo, lr_sites, fault, settings=SETTINGS)
        assert crashed.returncode == -9, crashed.stderr[-2000:]
        if fault == "peer_seed_before_commit":  # the rows were in the sink's open transaction
            assert new.query("SELECT count(*) FROM lr.sink_tables WHERE state = 'synced'") == [(0,)]
        else:
            assert new.query("SELECT data_consistent FROM lr.sink_sessions") == [(True,)]
        repl = replicator(topo, lr_sites, **SETTINGS)
        _sync(repl, cycles=3)
    assert writer.transactions > 0
    _sync(repl)
    assert rows(new) == rows(peer) == rows(source)
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    acked = dict(source.query("SELECT sink_site_id, acked_position FROM lr.source_sessions"))
    assert acked["site-c"] == new.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
