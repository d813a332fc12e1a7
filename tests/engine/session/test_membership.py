"""Replicator members at a real source (``session/membership``, ``store/members``): they share the
sessions, a member whose backend is gone is dead at once and its leases are taken without waiting
for them to expire, a hung one is dead once its heartbeat is old, and an owner that never
registered keeps the expiry rule."""

from __future__ import annotations

import logging
import time

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.session import lease, runner
from airflow_provider_lr.engine.session.membership import Membership
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.site import metrics, status
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.store import topology
from airflow_provider_lr.engine.vocabulary import MEMBER_LOCK_CLASS
from tests.support.session import apply, empty_provider, topology_doc
from tests.support.spark_env import lr_connections  # noqa: F401 (a fixture)

CLIENTS = ["c0", "c1", "c2"]
FAST = SessionSettings(member_heartbeat=0.05, member_dead_after=1.0, lease_seconds=60.0)


@pytest.fixture
def topo(lr_sites):
    """One source, two sinks, three clients: six sessions."""
    return apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": CLIENTS}])


def connector(sites, down: set[str] | None = None):
    dsns = {s.site_id: s.dsn for s in sites}

    def connect(site_id: str) -> psycopg2.extensions.connection:
        if down is not None and site_id in down:
            raise psycopg2.OperationalError(f"{site_id} is down")
        return psycopg2.connect(dsns[site_id])

    return connect


def member(topo, sites, owner: str, settings: SessionSettings = FAST, down: set[str] | None = None) -> Membership:
    return Membership(connector(sites, down), topo.sessions(), owner, settings)


def beat_until(members: list[Membership], settled, timeout: float = 10.0) -> None:
    """Heartbeats of every member until ``settled()`` holds."""
    deadline = time.monotonic() + timeout
    while not settled():
        assert time.monotonic() < deadline, "the members did not settle"
        for m in members:
            m.beat()
        time.sleep(0.02)


def kill_backend(source, owner: str) -> None:
    """What a SIGKILL of the member's process does at the source: its backend exits (waited for: a
    status read while it was still exiting found it alive in one statement and gone in the next)."""
    (killed,) = source.query(
        "SELECT pg_terminate_backend(l.pid, 5000) FROM pg_locks l JOIN lr.replicator_members m "
        "ON l.objid = m.lock_key::oid AND l.classid = %s::oid AND l.locktype = 'advisory' WHERE m.owner = %s",
        (MEMBER_LOCK_CLASS, owner),
    )[0]
    assert killed


def test_two_members_split_the_sessions_and_one_leaving_hands_all_to_the_other(lr_sites, topo):
    a, b = member(topo, lr_sites, "host:1:aaaa"), member(topo, lr_sites, "host:2:bbbb")
    try:
        beat_until([a, b], lambda: len(a.view()["site-a"]) == 2 and len(b.view()["site-a"]) == 2)
        beat_until([a, b], lambda: a.assigned() and b.assigned())
        assert sorted(a.assigned() + b.assigned()) == topo.sessions()
        assert len(a.assigned()) == len(b.assigned()) == 3
        a.leave()
        beat_until([b], lambda: b.assigned() == topo.sessions(), timeout=2.0)
        assert lr_sites[0].query("SELECT owner FROM lr.replicator_members") == [("host:2:bbbb",)]
    finally:
        a.leave()
        b.leave()


def test_a_killed_members_lease_is_taken_at_once_with_a_new_epoch(lr_sites, topo):
    source = lr_sites[0]
    a, b = member(topo, lr_sites, "host:1:aaaa"), member(topo, lr_sites, "host:2:bbbb")
    conn = source.connect()
    try:
        beat_until([a, b], lambda: len(b.view()["site-a"]) == 2)
        held = lease.acquire(conn, "site-b", "c0", a.owner)
        assert held is not None
        assert lease.acquire(conn, "site-b", "c0", b.owner) is None, "a live member's lease is not taken"
        kill_backend(source, a.owner)
        started = time.monotonic()
        beat_until([b], lambda: b.assigned() == topo.sessions())
        assert runner.clear_stale_leases(conn) == [f"site-a->site-b/c0 ({a.owner})"], "status shows no dead holder"
        taken = lease.acquire(conn, "site-b", "c0", b.owner)
        assert taken is not None and taken.epoch == held.epoch + 1
        assert time.monotonic() - started < 2.0, "taken over in heartbeats, not after the 60 s lease"
    finally:
        conn.close()
        a.leave()
        b.leave()


def test_a_hung_member_is_dead_once_its_heartbeat_is_old(lr_sites, topo):
    """Its lock is still held (the process hangs with its connection open): the heartbeat's age
    says it is dead."""
    source = lr_sites[0]
    a, b = member(topo, lr_sites, "host:1:aaaa"), member(topo, lr_sites, "host:2:bbbb")
    conn = source.connect()
    try:
        beat_until([a, b], lambda: len(b.view()["site-a"]) == 2)
        assert lease.acquire(conn, "site-c", "c1", a.owner) is not None
        beat_until([b], lambda: b.assigned() == topo.sessions(), timeout=FAST.member_dead_after + 2.0)  # a: no beats
        assert lease.acquire(conn, "site-c", "c1", b.owner) is not None
        a.beat()  # it wakes up: alive again, its share back, and its lease gone
        beat_until([a, b], lambda: len(b.assigned()) == 3)
        assert lease.holder(conn, "site-c", "c1") == b.owner
    finally:
        conn.close()
        a.leave()
        b.leave()


def test_an_owner_that_never_registered_keeps_the_expiry_rule(lr_sites, topo):
    """An Airflow task or older code takes leases without joining: its lease is not taken before
    it expires, whatever the members think."""
    source = lr_sites[0]
    b = member(topo, lr_sites, "host:2:bbbb")
    conn = source.connect()
    try:
        b.beat()
        assert b.assigned() == topo.sessions()
        assert lease.acquire(conn, "site-b", "c2", "airflow-task", seconds=1.5) is not None
        assert lease.acquire(conn, "site-b", "c2", b.owner) is None
        time.sleep(1.6)
        assert lease.acquire(conn, "site-b", "c2", b.owner) is not None
    finally:
        conn.close()
        b.leave()


def test_a_dead_member_is_forgotten_once_its_leases_would_have_expired(lr_sites, topo):
    source = lr_sites[0]
    quick = SessionSettings(member_heartbeat=0.05, member_dead_after=0.5, lease_seconds=1.0)
    a, b = member(topo, lr_sites, "host:1:aaaa", quick), member(topo, lr_sites, "host:2:bbbb", quick)
    try:
        beat_until([a, b], lambda: len(b.view()["site-a"]) == 2)
        kill_backend(source, a.owner)
        beat_until([b], lambda: len(b.view()["site-a"]) == 1)
        assert len(source.query("SELECT 1 FROM lr.replicator_members")) == 2, "kept while its leases may live"
        beat_until([b], lambda: len(source.query("SELECT 1 FROM lr.replicator_members")) == 1, timeout=5.0)
    finally:
        a.leave()
        b.leave()


def test_a_source_lost_keeps_the_last_share_and_says_so_once(lr_sites, topo, caplog):
    source = lr_sites[0]
    down: set[str] = set()
    a = member(topo, lr_sites, "host:1:aaaa", down=down)
    b = member(topo, lr_sites, "host:2:bbbb")
    try:
        beat_until([a, b], lambda: len(a.assigned()) == 3)
        share = a.assigned()
        down.add("site-a")
        kill_backend(source, a.owner)  # its connection breaks; reconnecting fails
        with caplog.at_level(logging.WARNING, logger="airflow_provider_lr.engine.session.membership"):
            for _ in range(5):
                time.sleep(FAST.member_heartbeat)
                a.beat()
        assert a.assigned() == share
        assert sum("no heartbeat at site-a" in r.getMessage() for r in caplog.records) == 1
    finally:
        a.leave()
        b.leave()


def test_a_source_never_reached_leaves_its_sessions_with_this_member(lr_sites, topo):
    """So that a single replicator reports their errors, as it would without members."""
    a = member(topo, lr_sites, "host:1:aaaa", down={"site-a"})
    a.beat()
    assert a.assigned() == topo.sessions()
    a.leave()


def test_status_shows_the_live_members_and_whether_a_holder_is_one(lr_sites, topo):
    source = lr_sites[0]
    a, b = member(topo, lr_sites, "host:1:aaaa"), member(topo, lr_sites, "host:2:bbbb")
    conn = source.connect()
    try:
        beat_until([a, b], lambda: len(b.view()["site-a"]) == 2)
        assert lease.acquire(conn, "site-b", "c0", a.owner) is not None
        assert lease.acquire(conn, "site-b", "c1", "airflow-task") is not None
        found = status.site_status(conn)
        assert [m["owner"] for m in found.members] == [a.owner, b.owner]
        assert all(m["heartbeat_age_s"] < 1.0 for m in found.members)
        holders = {
            s["client_name"]: s for s in found.sessions if s["role"] == "source" and s["sink_site_id"] == "site-b"
        }
        assert holders["c0"]["lease_owner_alive"] is True and holders["c1"]["lease_owner_alive"] is None
        text = status.render(found)
        assert f"member {a.owner} since" in text and "(a live member)" in text
        page = metrics.exposition(metrics.status_registry(lambda: {"site-a": found}))
        assert 'lr_replicator_members{site="site-a"} 2.0' in page
        kill_backend(source, a.owner)
        found = status.site_status(conn)
        assert [m["owner"] for m in found.members] == [b.owner]
        assert "(a dead member: taken over at the next cycle)" in status.render(found)
    finally:
        conn.close()
        a.leave()
        b.leave()


def test_two_replicators_cycling_split_the_sessions_and_one_closing_hands_its_leases_over(lr_sites, topo):
    """`lr sync --no-stream` twice: each cycles its share only (the other's sessions are neither
    cycled nor skipped), and a clean close releases leases and membership, so the other takes all
    at its next heartbeat, not after the lease."""
    source = lr_sites[0]
    providers = dict.fromkeys(CLIENTS, empty_provider)
    first, second = (
        Replicator(topo, connector(lr_sites), owner=owner, settings=FAST, providers=providers, membership=True)
        for owner in ("host:1:aaaa", "host:2:bbbb")
    )
    try:
        beat_until([], lambda: len(first.sessions) == len(second.sessions) == 3)
        assert sorted(first.sessions + second.sessions) == topo.sessions()
        for repl in (first, second):
            reports = repl.run_cycle()
            assert [r.session for r in reports] == [str(k) for k in repl.sessions]
            assert not any(r.skipped or r.error for r in reports), reports
        held = dict(source.query("SELECT sink_site_id || '/' || client_name, lease_owner FROM lr.source_sessions"))
        assert sorted(held.values()) == ["host:1:aaaa"] * 3 + ["host:2:bbbb"] * 3
        first.close()
        beat_until([], lambda: second.sessions == topo.sessions(), timeout=2.0)
        reports = second.run_cycle()
        assert len(reports) == 6 and not any(r.skipped or r.error for r in reports), reports
        assert {owner for (owner,) in source.query("SELECT lease_owner FROM lr.source_sessions")} == {"host:2:bbbb"}
    finally:
        first.close()
        second.close()


def test_a_session_handed_over_after_its_runner_was_forgotten_is_released_at_once(lr_sites, topo):
    """A replicator works every session alone, then rests (``lr sync`` does while its sessions
    stream: the cycle connections close, their runners are forgotten, their leases stay held). A
    second joins: the sessions handed to it are released by the first at once, so it works them at
    its first cycle, not after the lease (60 s here). Before, they stayed leased until expiry."""
    source = lr_sites[0]
    providers = dict.fromkeys(CLIENTS, empty_provider)
    first = Replicator(
        topo, connector(lr_sites), owner="host:1:aaaa", settings=FAST, providers=providers, membership=True
    )
    second = None
    try:
        assert not any(r.skipped or r.error for r in first.run_cycle())
        first.rest(idle_for=0)  # every runner forgotten with its connection, holding its lease
        second = Replicator(
            topo, connector(lr_sites), owner="host:2:bbbb", settings=FAST, providers=providers, membership=True
        )
        beat_until([], lambda: len(first.sessions) == len(second.sessions) == 3)
        reports = second.run_cycle()
        assert [r.session for r in reports] == [str(k) for k in second.sessions]
        assert not any(r.skipped or r.error for r in reports), reports
        held = source.query("SELECT lease_owner, count(*) FROM lr.source_sessions GROUP BY 1 ORDER BY 1")
        assert held == [("host:1:aaaa", 3), ("host:2:bbbb", 3)]
    finally:
        first.close()
        if second is not None:
            second.close()


def test_member_bounds_come_from_the_topology_and_a_dead_after_within_a_heartbeat_is_refused(lr_sites):
    doc = topology_doc(lr_sites, settings={"member_heartbeat_s": 0.2, "member_dead_after_s": 2})
    tuned = SessionSettings.from_topology(topology.from_document(doc))
    assert (tuned.member_heartbeat, tuned.member_dead_after) == (0.2, 2)
    with pytest.raises(ConfigurationError, match="member_dead_after_s"):
        SessionSettings(member_heartbeat=1.0, member_dead_after=1.0)


def test_a_member_tees_only_a_backlog_of_its_own_sessions(lr_sites, topo, lr_connections, caplog):
    """The other member's backlog is not this one's to catch up: no fan-out planned for it (before,
    every process counted the source's whole backlog and logged a catch-up it then found empty)."""
    settings = SessionSettings(
        member_heartbeat=0.05, member_dead_after=1.0, tee_min_backlog=10, data_timeout=30.0, barrier_timeout=2.0
    )
    providers = dict.fromkeys(CLIENTS, empty_provider)
    first, second = (
        Replicator(topo, connector(lr_sites), owner=owner, settings=settings, providers=providers, membership=True)
        for owner in ("host:1:aaaa", "host:2:bbbb")
    )
    try:
        beat_until([], lambda: len(first.sessions) == len(second.sessions) == 3)
        for repl in (first, second):
            repl.run_cycle()
        theirs = second.sessions[0]
        conn = lr_sites[0].connect()
        transmit = RoutingQueueClient(conn, theirs.client)
        for i in range(20):
            transmit.transmit_log_entry_message(f"m{i}".encode(), [theirs.sink])
        conn.commit()
        conn.close()
        catching_up = "catching up site-a by the in-process fan-out"
        with caplog.at_level(logging.INFO, logger="airflow_provider_lr.engine.site.replicator"):
            first.run_cycle()
            assert catching_up not in caplog.text
            second.run_cycle()
            assert catching_up in caplog.text
        assert first.teed == {} and second.teed[str(theirs)] == 20
    finally:
        first.close()
        second.close()


def test_a_member_following_a_new_topology_joins_its_new_source_and_leaves_the_one_it_no_longer_has(lr_sites, topo):
    """`lr sync` follows its topology file (``Replicator.follow``): a member given sessions of a new
    source joins it (a heartbeat of its own there) and works them; the source it has no session of
    any more is left (its lock released: the others do not count it)."""
    source, sink_b, _ = lr_sites
    moved = apply(lr_sites, [{"source": "site-b", "sinks": ["site-c"], "clients": CLIENTS}])
    a = member(topo, lr_sites, "host:1:aaaa")
    try:
        a.start()
        assert a.assigned() == topo.sessions()
        a.follow(moved.sessions())
        assert a.assigned() == moved.sessions()
        owners = (  # the members holding their lock here
            "SELECT m.owner FROM lr.replicator_members m JOIN pg_locks l ON l.locktype = 'advisory' AND "
            f"l.classid = {MEMBER_LOCK_CLASS}::oid AND l.objid = m.lock_key::oid AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        assert sink_b.query(owners) == [("host:1:aaaa",)], "a member at its new source"
        deadline = time.monotonic() + 2.0
        while source.query(owners):
            assert time.monotonic() < deadline, "the source it has no session of any more is left"
            time.sleep(0.02)
    finally:
        a.leave()
