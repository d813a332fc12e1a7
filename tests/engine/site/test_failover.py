"""Failover (after Qpid HA's failover): a sink becomes the source of its clients; every other sink is cut at
the promoted site's position of the old source's stream (extras removed, gaps copied or a full
sync with its reason), the old source is fenced and rejoins as a sink. Real servers, no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import ConfigurationError, LRError, SiteUnreachableError, TransmitError
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.site import failover, status
from airflow_provider_lr.engine.site import topology as topologies
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.tables import closed_notes, registry
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
from tests.support.session import App, apply, queue, sink_queue, table_provider
from tests.support.session import replicator as _replicator
from tests.support.subscriber import Recorder
from tests.support.tables import create_accounts, cycle_errors, federate, rows, site_status

A, B, C = "site-a", "site-b", "site-c"
PROVIDERS = {"policy": table_provider}


def replicator(topo, sites, **options):
    """One owner for every replicator of a test: a cycle takes over the leases the last one left."""
    return _replicator(topo, sites, owner="failover-test", **options)


def _connect(sites, down: tuple[str, ...] = ()):
    dsns = {s.site_id: s.dsn for s in sites}

    def connect(site_id: str):
        if site_id in down:
            raise SiteUnreachableError(f"site {site_id!r} is down (test)")
        return psycopg2.connect(dsns[site_id])

    return connect


def _setup(lr_sites, first: int = 3):
    """site-a replicates client policy to site-b and site-c; ``first`` entries reach both."""
    topo = apply(lr_sites)
    app = App(lr_sites[0])
    for i in range(first):
        app.put(f"k{i}", i, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS))
    return topo, app


def _ahead(lr_sites, sink: str, extra: int):
    """``_setup``, then ``extra`` more entries for both sinks that only ``sink`` receives."""
    topo, app = _setup(lr_sites)
    for i in range(3, 3 + extra):
        app.put(f"k{i}", i, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, sink, "policy")]))
    return topo, app


def _consume(site, count: int | None = None) -> list[str]:
    """What site's applications consume from site-a's queue (all, or the first ``count`` log entries)."""
    rec = Recorder()
    sub = RoutingQueueSubscriber(site.dsn, "policy", sources=[A])
    try:
        sub.poll(rec, max_messages=count)
    finally:
        sub.close()
    return [p for k, p in rec.events.get(A, []) if k == "log"]


def _session_row(site, source: str = A):
    return site.query(
        "SELECT last_log_entry_processed, failed_over_to, failover_note FROM lr.sink_sessions "
        "WHERE source_site_id = %s AND client_name = 'policy'",
        (source,),
    )[0]


def test_a_sink_ahead_of_the_promoted_one_loses_its_unconsumed_extras_and_nothing_is_resent(lr_sites):
    topo, app = _ahead(lr_sites, C, 7)  # site-c is 7 entries ahead of site-b
    site_b, site_c = lr_sites[1], lr_sites[2]
    assert len(sink_queue(site_c, "policy")) == len(sink_queue(site_b, "policy")) + 7

    result = failover.promote(failover.FailoverRequest(A, B, reason="site-a lost"), _connect(lr_sites, down=(A,)))
    assert not result.planned and result.pending == [A]
    assert sink_queue(site_c, "policy") == sink_queue(site_b, "policy")  # the extras are gone, nothing re-sent
    cut = result.positions["policy"]
    assert _session_row(site_c)[:2] == (cut, B)
    assert "7 extra entries" in _session_row(site_c)[2]
    assert result.full_syncs == []

    # the new source's writers address site-c and site-a; site-c gets them once, in order, from the base
    new_app = App(site_b)
    for i in range(5):
        new_app.put(f"b{i}", i, [C, A])
    run_until_idle(replicator(result.topology, lr_sites, sessions=[SessionKey(B, C, "policy")]))
    assert sink_queue(site_c, "policy", source=B) == [f"b{i}={i}".encode() for i in range(5)]
    assert site_c.query("SELECT count(*) FROM lr.receive_queue WHERE source_site_id = %s AND kind <> 1", (B,)) == [(0,)]
    app.close()
    new_app.close()


def test_a_sink_ahead_whose_extras_were_consumed_gets_a_full_sync_with_the_reason(lr_sites):
    topo, app = _ahead(lr_sites, C, 5)
    site_c = lr_sites[2]
    _consume(site_c)  # the application at site-c applied everything, extras included

    result = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    assert result.full_syncs == [f"{B}->{C}/policy"]
    rows = lr_sites[1].query(
        "SELECT reason, forced FROM lr.full_sync_requests WHERE sink_site_id = %s AND status = 'pending'", (C,)
    )
    assert len(rows) == 1 and rows[0][1]
    assert rows[0][0].startswith(f"failover: {C} had consumed entries of {A} beyond {B}'s position")

    App(lr_sites[1]).close()  # the new source's application table, which its provider reads
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")]))
    kinds = [k for k, _ in site_c.query("SELECT kind, 1 FROM lr.receive_queue WHERE source_site_id = %s", (B,))]
    assert kinds and kinds[0] == 4  # the snapshot from site-b starts with its start marker
    app.close()


def test_a_sink_behind_gets_exactly_the_gap_from_the_promoted_sinks_queue(lr_sites):
    topo, app = _ahead(lr_sites, B, 6)  # site-b is 6 entries ahead of site-c
    site_b, site_c = lr_sites[1], lr_sites[2]
    before = sink_queue(site_c, "policy")

    result = failover.promote(failover.FailoverRequest(A, B, same_destinations=True), _connect(lr_sites, down=(A,)))
    after = sink_queue(site_c, "policy")
    assert after == sink_queue(site_b, "policy")
    assert after[: len(before)] == before and len(after) - len(before) == 6  # exactly the gap, once
    assert "6 entries" in _session_row(site_c)[2] and result.full_syncs == []
    assert _consume(site_c) == [p.decode() for p in after]
    app.close()


def test_a_sink_behind_without_same_destinations_gets_a_full_sync_not_a_guess(lr_sites):
    _, app = _ahead(lr_sites, B, 1)
    result = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    assert result.full_syncs == [f"{B}->{C}/policy"]
    reason = lr_sites[1].query("SELECT reason FROM lr.full_sync_requests WHERE sink_site_id = %s", (C,))[0][0]
    assert "cannot tell which of its own were addressed to site-c" in reason
    app.close()


def test_a_stale_old_source_replicator_is_fenced_at_every_sink_after_failover(lr_sites):
    topo, app = _setup(lr_sites)
    site_c = lr_sites[2]
    failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))  # site-a partitioned, not dead
    held = sink_queue(site_c, "policy")
    app.put("late", 99, [B, C])
    stale = replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, C, "policy")])
    reports = stale.run_cycle()
    stale.close()
    assert "failed over" in reports[0].error or "topology config id mismatch" in reports[0].error
    # even with the old topology re-applied on the sink (so negotiation passes), the sink refuses it
    topologies.apply_to_site(site_c.connect(), topo, C)
    stale = replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, C, "policy")])
    reports = stale.run_cycle()
    stale.close()
    assert "was failed over" in reports[0].error, reports[0]
    assert sink_queue(site_c, "policy") == held
    app.close()


def test_a_replicator_reading_the_file_from_before_a_failover_says_why_in_its_log_once(lr_sites, caplog, tmp_path):
    """A failover while `lr_streaming` streamed: the task's file predates it, every cycle is refused
    (no exception: the handshake's verdict), and its log said only "session ... failed N time(s) in
    a row; retried in 5.0s" until run_for ended. The refusal is said as a raised failure is: once."""
    from airflow_provider_lr.engine.store import topology as stored

    topo, app = _setup(lr_sites)
    old = stored.load(stored.write_document(topo, tmp_path / "topology.yaml"))
    failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites), topology=topo)
    stale = replicator(old, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, C, "policy")])
    reports = stale.run_cycle() + stale.run_cycle()
    stale.close()
    assert "predates the failover" in reports[0].error and reports[1].error == reports[0].error
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "predates" in r.getMessage()]
    assert said == [f"session {A}->{C}/policy failed: {reports[0].error}"], said
    app.close()


def test_failover_refuses_unknown_sites_non_sinks_and_an_unreachable_promoted_site(lr_sites):
    topo = apply(
        lr_sites,
        [{"source": A, "sinks": [B], "clients": ["policy"]}, {"source": A, "sinks": [C], "clients": ["other"]}],
    )
    connect = _connect(lr_sites, down=(A,))
    with pytest.raises(ConfigurationError, match="unknown site 'site-x'"):
        failover.promote(failover.FailoverRequest(A, "site-x"), connect, topology=topo)
    with pytest.raises(
        ConfigurationError, match=r"site 'site-c' is not a sink of 'site-a' for client\(s\) \['policy'\]"
    ):
        failover.promote(failover.FailoverRequest(A, C, clients=["policy"]), connect, topology=topo)
    with pytest.raises(SiteUnreachableError, match="site 'site-b' .the site to promote. cannot be reached"):
        failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A, B)), topology=topo)
    with pytest.raises(ConfigurationError, match="holds no consistent copy"):
        failover.promote(
            failover.FailoverRequest(A, B), connect, topology=topo
        )  # site-b never received anything from site-a
    assert lr_sites[1].query("SELECT count(*) FROM lr.failovers") == [(0,)]


def test_the_old_source_returns_refuses_to_negotiate_then_rejoins_as_a_sink_with_its_tail_reported(lr_sites):
    topo, app = _setup(lr_sites)
    app.put("after-cut", 1, [B, C])  # committed at site-a, received by nobody before it went down
    # a writer moved to site-b before the failover: told where to transmit and how site-b becomes the
    # source (before: to add the client to a replication and apply it, a source beside site-a's)
    conn = lr_sites[1].connect()
    with pytest.raises(TransmitError, match="replicated from site site-a, not from 'site-b' .one of its sinks.: "):
        RoutingQueueClient(conn, "policy").transmit_log_entry_message(b"early", [C])
    conn.close()
    result = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    old = replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, B, "policy")])
    assert "was failed over" in old.run_cycle()[0].error  # site-a, back with its old topology, is refused
    old.close()

    # the record is on site-b and its copy on site-c, both down: said so, not "no failover ... lr
    # topology apply", which refuses to demote a failed-over site
    with pytest.raises(SiteUnreachableError, match="site-b, site-c cannot be reached: nothing was done; run the rej"):
        failover.rejoin(A, _connect(lr_sites, down=(B, C)), topo)
    back = failover.rejoin(A, _connect(lr_sites), topo)
    assert back.tail == {"policy": 1} and back.retired == [f"{A}->{B}/policy", f"{A}->{C}/policy"]
    with pytest.raises(Exception, match="not in the topology|not replicated from site 'site-a' any more"):
        RoutingQueueClient(lr_sites[0].connect(), "policy").transmit_log_entry_message(b"x", [B])
    new_app = App(lr_sites[1])
    new_app.put("k0", 100, [A, C])
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS))
    entries = queue(lr_sites[0], source=B)
    assert entries[0] == ("start", "") and ("end", "") in entries  # first contact: a full sync from site-b
    app.close()
    new_app.close()


FAILOVER_FAULTS = ["failover_after_fence", "failover_after_promote", "failover_after_reconcile"]


def _killed_failover(lr_sites, fault: str) -> None:
    """``failover.promote(A, B)`` (site-a down) in a child process that is killed at ``fault``."""
    spec = {"dsns": {s.site_id: s.dsn for s in lr_sites}, "down": [A], "from": A, "to": B}
    code = (
        "import json, sys, psycopg2\n"
        "from airflow_provider_lr.engine.errors import SiteUnreachableError\n"
        "from airflow_provider_lr.engine.site import failover\n"
        "spec = json.loads(sys.argv[1])\n"
        "def connect(s):\n"
        "    if s in spec['down']: raise SiteUnreachableError(s)\n"
        "    return psycopg2.connect(spec['dsns'][s])\n"
        "failover.promote(failover.FailoverRequest(spec['from'], spec['to']), connect)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)],
        env={**os.environ, "LR_FAULT": fault},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr


def test_chained_failovers_the_first_old_source_rejoins_from_a_sinks_copy_while_the_promoted_site_is_down(lr_sites):
    """site-a failed over to site-b, then site-b lost before site-a is back. The failover's record
    was on site-b only: site-a's rejoin found none, and the failover of site-b to site-c refused
    site-a (back, not rejoined), so nothing could move until site-b returned. Now site-c keeps a copy
    of the record it was reconciled by: site-a rejoins, then site-c is promoted in site-b's place.
    Before site-a's rejoin that failover is refused, nothing done: it reconciled site-a as a sink and
    gave it its topology, so the rejoin found nothing to do and site-a's table stayed captured there,
    its writes accepted and sent nowhere. Its table then follows site-c, its guard naming site-c."""
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    first = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    new_app = App(site_b)
    _write(new_app, "UPDATE public.accounts SET owner = 'site-b' WHERE id <= 3", "b0", 0, [A, C])
    run_until_idle(replicator(first.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")]))

    with pytest.raises(
        LRError,
        match=r"site 'site-a' is still the source of policy \(failed over to site-b, not "
        r"rejoined since\): rejoin it first \(lr failover --rejoin site-a\)",
    ):
        failover.promote(failover.FailoverRequest(B, C), _connect(lr_sites, down=(B,)))
    assert site_c.query("SELECT count(*) FROM lr.source_sessions") == [(0,)]  # nothing promoted
    back = failover.rejoin(A, _connect(lr_sites, down=(B,)), topo)
    assert back.failover_id == first.failover_id and back.retired == [f"{A}->{B}/policy", f"{A}->{C}/policy"]
    assert back.guarded == ["public.accounts"]
    second = failover.promote(failover.FailoverRequest(B, C), _connect(lr_sites, down=(B,)))
    assert second.pending == [B] and "full sync" in second.outcome[A]["policy"], second.outcome
    assert "table public.accounts: a snapshot from site-c" in second.outcome[A]["policy"]
    with pytest.raises(psycopg2.Error, match="replicated from site site-c since a failover"):
        site_a.query("UPDATE public.accounts SET owner = 'local' WHERE id = 1")
    App(site_c).close()  # site-c's application state: its provider's
    run_until_idle(replicator(second.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(C, A, "policy")]))
    assert site_a.query("SELECT data_consistent FROM lr.sink_sessions WHERE source_site_id = %s", (C,)) == [(True,)]
    assert rows(site_a) == rows(site_c) and site_a.query(
        "SELECT source_site_id FROM lr.registry WHERE stream_name = 'public.accounts'"
    ) == [(C,)]
    # site-a's clients went to site-b, then on to site-c: a site-a restored from a backup (its first
    # topology) is told they come from site-c now. Before: from site-b (site-c's row of site-a)
    restored = topologies.drift(second.topology, {A: topo.topology_config_id})
    said = topologies.explained(restored, _connect(lr_sites, down=(B,))).message()
    assert "site site-a was failed over (its clients now come from site-c)" in said, said
    app.close()
    new_app.close()


def test_an_unplanned_failover_that_rejoins_a_reachable_old_source_says_what_it_committed_after_the_cut(lr_sites):
    """site-a is reachable but the failover is unplanned (--no-planned): it rejoins site-a at once.
    What site-a committed after the cut (a table change and a message, sent to nobody) is counted and
    said in what is lost. Before, the count was dropped (the table changes not even counted) and the
    failover said `lr failover --rejoin site-a` would count it when it returns, though it was back
    and rejoined: a later rejoin had nothing to do."""
    site_a, site_b, site_c = lr_sites
    _, app = _tables_setup(lr_sites)
    _write(app, "UPDATE public.accounts SET owner = 'after the cut' WHERE id <= 3", "late", 1, [B, C])
    result = failover.promote(failover.FailoverRequest(A, B, planned=False), _connect(lr_sites))
    assert A in result.applied and result.tail == {"policy": 1} and result.table_tail == {"policy": 1}
    assert "site-a committed after the cut" in result.lost and "--rejoin" not in result.lost, result.lost
    assert "policy 1 entries and 1 table change entries" in result.lost, result.lost
    app.close()


def test_a_rejoin_applies_the_failover_the_other_sites_run_whatever_the_promoting_sites_clocks_say(lr_sites):
    """site-a failed over to site-b, rejoined; site-b then failed over to site-c while down, and comes
    back. site-b's clock ran a day ahead when it recorded the first failover (its record, and the copy
    site-c keeps, say so). Its rejoin applies the failover whose topology site-a and site-c run, the
    second: site-b becomes a sink of site-c. Before, the newest record by the sites' clocks won: the
    first one, whose topology made site-b the source of policy again beside site-c."""
    site_a, site_b, site_c = lr_sites
    _setup(lr_sites)
    first = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    failover.rejoin(A, _connect(lr_sites), first.topology)
    for site in (site_b, site_c):  # site-b's clock a day ahead when it recorded the failover
        site.query(
            "UPDATE lr.failovers SET started_at = started_at + interval '1 day' WHERE failover_id = %s",
            (first.failover_id,),
        )
    second = failover.promote(failover.FailoverRequest(B, C), _connect(lr_sites, down=(B,)))
    assert second.pending == [B], second
    back = failover.rejoin(B, _connect(lr_sites), second.topology)
    assert back.failover_id == second.failover_id and back.retired == [f"{B}->{A}/policy", f"{B}->{C}/policy"]
    assert site_b.query("SELECT topology_config_id FROM lr.topology") == [(second.topology.topology_config_id,)]
    assert site_b.query("SELECT count(*) FROM lr.source_sessions") == [(0,)]


def test_where_a_clients_failovers_took_it_last_is_told_by_when_each_was_recorded():
    """Rows of sink_sessions (old source, client, to, when) at various sites; a site's older row
    outlives a rejoin. Chained a->b->c: site-c; b's own failover from before it was promoted does not
    count; failed over twice: the newer; failed back: no longer failed over."""
    t = [datetime(2026, 1, 1, hour, tzinfo=timezone.utc) for hour in range(5)]
    chained = [(A, "k", B, t[1]), (B, "k", C, t[2]), (B, "j", C, t[0])]
    assert topologies.newest_moves(chained) == {(A, "k"): C, (B, "k"): C, (B, "j"): C}
    assert topologies.newest_moves([(B, "k", C, t[0]), (A, "k", B, t[1])]) == {(A, "k"): B, (B, "k"): C}
    assert topologies.newest_moves([(A, "k", C, t[3]), (A, "k", B, t[1])]) == {(A, "k"): C}
    assert topologies.newest_moves([(A, "k", B, t[1]), (B, "k", A, t[2])]) == {(B, "k"): A}


@pytest.mark.parametrize("fault", FAILOVER_FAULTS)
def test_a_failover_killed_after_promoting_finishes_when_run_again(lr_sites, fault):
    _, app = _ahead(lr_sites, C, 6)  # site-c ahead: extras to remove
    site_b, site_c = lr_sites[1], lr_sites[2]
    _killed_failover(lr_sites, fault)
    assert _session_row(site_c)[1] == B  # fenced whatever the window
    if fault == "failover_after_promote":
        assert site_b.query("SELECT status FROM lr.failovers") == [("promoted",)]
        assert _session_row(site_c)[2] is None  # not reconciled

    result = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    assert result.resumed == (fault != "failover_after_fence")
    assert "6 extra entries" in result.outcome[C]["policy"]
    assert site_b.query("SELECT status FROM lr.failovers") == [("completed",)]
    assert sink_queue(site_c, "policy") == sink_queue(site_b, "policy")
    again = failover.promote(
        failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,))
    )  # a third run changes nothing
    assert again.outcome == result.outcome and sink_queue(site_c, "policy") == sink_queue(site_b, "policy")
    app.close()


class _Writer(threading.Thread):
    """Transmits ``<prefix><n>`` for n = 0, 1, ... to ``destinations``, one transaction each, until
    stopped or its server goes away; ``committed`` counts the commits that returned."""

    def __init__(self, site, prefix: str, destinations: list[str]) -> None:
        super().__init__(daemon=True)
        self.site, self.prefix, self.destinations = site, prefix, destinations
        self.stop, self.committed = threading.Event(), 0

    def run(self) -> None:
        conn = self.site.connect()
        client = RoutingQueueClient(conn, "policy")
        try:
            while not self.stop.is_set():
                client.transmit_log_entry_message(f"{self.prefix}{self.committed}".encode(), self.destinations)
                conn.commit()
                self.committed += 1
        except psycopg2.Error:
            pass  # the server was stopped under it


def _consumed_log(site, source: str) -> list[str]:
    rec = Recorder()
    sub = RoutingQueueSubscriber(site.dsn, "policy", sources=[source])
    try:
        sub.poll(rec)
    finally:
        sub.close()
    return [p for k, p in rec.events.get(source, []) if k == "log"]


def test_role_switch_under_load_loses_and_duplicates_nothing_at_any_remaining_sink(lr_sites, site_manager):
    site_a, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    App(site_a).close(), App(site_b).close()  # the sources' tables, read by their full-sync providers
    repl = replicator(topo, lr_sites, providers=PROVIDERS)
    run_until_idle(repl)  # first contact (empty full syncs): every entry below arrives as a log entry
    writer = _Writer(site_a, "a", [B, C])
    writer.start()
    stop = threading.Event()
    cycles = threading.Thread(target=repl.run, kwargs={"stop": stop, "interval": 0.01}, daemon=True)
    cycles.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        writer.committed < 300
        or any(
            s.query("SELECT count(*) FROM lr.sink_sessions WHERE data_consistent AND last_log_entry_processed > 100")
            == [(0,)]
            for s in (site_b, site_c)
        )
    ):
        time.sleep(0.05)
    site_manager.down([A], mode="immediate")  # mid-flight: the writer and the replicator lose site-a
    stop.set()
    cycles.join(60)
    writer.join(30)
    repl.close()
    try:
        result = failover.promote(
            failover.FailoverRequest(A, B, same_destinations=True, reason="site-a lost"), _connect(lr_sites)
        )
        assert not result.planned and result.pending == [A] and result.full_syncs == []

        new_writer = _Writer(site_b, "b", [C, A])
        new_writer.start()
        time.sleep(1.0)
        new_writer.stop.set()
        new_writer.join(30)
        run_until_idle(
            replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")])
        )

        at_b, at_c = _consumed_log(site_b, A), _consumed_log(site_c, A)
        assert at_b == [f"a{n}" for n in range(len(at_b))] and len(at_b) > 0  # in order, no gap, no duplicate
        assert at_c == at_b
        assert _consumed_log(site_c, B) == [f"b{n}" for n in range(new_writer.committed)]
    finally:
        site_manager.up(site_ids=[A])
    back = failover.rejoin(A, _connect(lr_sites), result.topology)
    assert back.tail["policy"] >= 0 and back.topology_config_id == result.topology.topology_config_id
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, A, "policy")]))
    entries = queue(site_a, source=B)
    assert entries[0] == ("start", "") and ("end", "") in entries  # a full sync from site-b: consistent with it


# --- federated tables --------------------------------------------------------------------------------
def _tables_setup(lr_sites):
    """site-a replicates client policy, a federated table (public.accounts, 40 rows) and
    routing-queue messages, to site-b and site-c; both hold everything."""
    topo = apply(lr_sites)
    create_accounts(lr_sites[0], rows=40)
    federate(lr_sites[0])
    app = App(lr_sites[0])
    for i in range(3):
        app.put(f"k{i}", i, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS))
    return topo, app


def _write(app: App, statement: str, key: str, value: int, destinations: list[str]) -> None:
    """One application transaction: a change of the table and a message."""
    with app.conn.cursor() as cur:
        cur.execute(statement)
    app.put(key, value, destinations)


def test_after_failover_the_promoted_site_captures_the_table_and_every_other_sink_follows_it(lr_sites):
    """public.notes was closed at site-a (its sinks told, as lr tables close does) before the
    failover: the promotion leaves it closed and every copy its sink's own. Before, site-b federated
    it again and site-c's copy, its own since the close, was replaced by site-b's."""
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    site_a.query("CREATE TABLE public.notes (id int PRIMARY KEY, note text); INSERT INTO public.notes VALUES (1, 'a')")
    federate(site_a, "public.notes")
    for i in range(3, 6):
        _write(app, f"UPDATE public.accounts SET balance = balance + {i} WHERE id <= 10", f"k{i}", i, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS))
    assert rows(site_b) == rows(site_a) == rows(site_c)
    conn = site_a.connect()
    registry.close_table(conn, "public.notes")
    conn.close()
    for sink in (site_b, site_c):
        conn = sink.connect()
        assert closed_notes.note_closed_copy(conn, "public.notes", A, "policy")
        conn.close()
    site_c.query("INSERT INTO public.notes VALUES (2, 'own')")  # site-c's own since the close

    result = failover.promote(failover.FailoverRequest(A, B, reason="site-a lost"), _connect(lr_sites, down=(A,)))
    assert result.tables == {"policy": ["public.accounts"]} and result.diverged == []
    assert site_b.query(
        "SELECT table_id IS NOT NULL, source_site_id FROM lr.registry WHERE stream_name = 'public.accounts'"
    ) == [(True, None)]  # site-b's own, captured there

    new_app = App(site_b)  # site-b's writers change the table and transmit, in one transaction each
    for i in range(4):
        _write(new_app, f"UPDATE public.accounts SET owner = 'b{i}' WHERE id = {i + 1}", f"b{i}", i, [C, A])
    _write(new_app, "DELETE FROM public.accounts WHERE id > 35", "b4", 4, [C, A])
    _write(new_app, "INSERT INTO public.accounts (id, owner, balance) VALUES (1000, 'site-b', 1)", "b5", 5, [C, A])
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")]))

    assert rows(site_c) == rows(site_b)
    assert site_c.query("SELECT owner FROM public.accounts WHERE id IN (1, 1000) ORDER BY id") == [("b0",), ("site-b",)]
    assert sink_queue(site_c, "policy", source=B) == [f"b{i}={i}".encode() for i in range(6)]  # once each
    assert sink_queue(site_c, "policy") == [f"k{i}={i}".encode() for i in range(3, 6)]  # site-a's, once each
    assert queue(site_c, source=A) == queue(site_b, source=A)
    assert site_status(site_c).diverged == [] and site_status(site_b).diverged == []
    assert rows(site_c, "public.notes") == [("(1,a)",), ("(2,own)",)]  # kept, its own row too
    assert site_b.query(
        "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lr_capture%%' AND tgrelid = 'public.notes'::regclass"
    ) == [(0,)]
    app.close()
    new_app.close()


@pytest.mark.parametrize("ahead", [C, B], ids=["sink-ahead", "sink-behind"])
def test_a_sink_ahead_of_or_behind_the_promoted_one_at_the_cut_gets_its_table_from_it(lr_sites, ahead):
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    _write(app, "UPDATE public.accounts SET owner = 'late' WHERE id <= 5", "k3", 3, [B, C])
    _write(app, "DELETE FROM public.accounts WHERE id BETWEEN 30 AND 33", "k4", 4, [B, C])
    _write(app, "INSERT INTO public.accounts (id, owner) VALUES (500, 'late')", "k5", 5, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, ahead, "policy")]))
    assert rows(site_c) != rows(site_b)  # only one of them has site-a's last changes

    result = failover.promote(failover.FailoverRequest(A, B, same_destinations=True), _connect(lr_sites, down=(A,)))
    assert "table public.accounts: a snapshot from site-b replaces site-a's rows" in result.outcome[C]["policy"]
    waiting = [t for t in site_status(site_c).tables if t["role"] == "sink" and t["source"] == B]
    assert [(t["table"], t["state"]) for t in waiting] == [("public.accounts", "syncing")]  # shown, not silent

    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")]))
    assert rows(site_c) == rows(site_b)
    assert sink_queue(site_c, "policy") == sink_queue(site_b, "policy")
    app.close()


class _Lost(Exception):
    """site-a lost at a fault point (the cycle stops there, as the process would)."""


def _lost() -> None:
    raise _Lost


def test_a_sink_whose_full_sync_from_the_old_source_was_under_way_gets_its_table_from_the_new_one(lr_sites):
    """site-a is lost while a full sync of site-c is under way: the sync's start made site-c forget
    its copy's record from site-a (a new snapshot comes after the sync), so the failover found no
    copy to hand over there and left site-a as the table's origin. site-b's snapshot then came as a
    second source's, upserting its rows beside site-a's: rows site-a deleted (which site-b applied
    and site-c had not) stayed at site-c for good, while lr status called the copy synced."""
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    _write(app, "DELETE FROM public.accounts WHERE id > 30", "k3", 3, [B, C])
    _write(app, "UPDATE public.accounts SET owner = 'late' WHERE id <= 2", "k4", 4, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, B, "policy")]))
    conn = site_a.connect()
    full_sync.request_full_sync(conn, C, "policy", "operator asked", forced=True)
    conn.close()
    with on_fault("after_snapshot_start", _lost):  # the cycle fails there, the sync started at site-c
        replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, C, "policy")]).run_cycle()
    assert len(rows(site_c)) == 40  # site-a's rows before its last changes, its record forgotten

    App(site_b).close()  # site-b's application state: its provider's, for site-c's full sync
    result = failover.promote(failover.FailoverRequest(A, B, reason="site-a lost"), _connect(lr_sites, down=(A,)))
    assert site_c.query("SELECT source_site_id FROM lr.registry WHERE stream_name = 'public.accounts'") == [(B,)]
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")]))
    assert rows(site_c) == rows(site_b) and len(rows(site_c)) == 30
    assert site_status(site_c).diverged == []
    app.close()


def test_the_old_source_rejoins_as_a_sink_of_its_tables_with_its_late_changes_reported_and_replaced(lr_sites):
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    _write(app, "UPDATE public.accounts SET owner = 'after the cut' WHERE id <= 3", "late", 1, [B, C])  # nobody got it
    result = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    new_app = App(site_b)  # its app_state: the provider of site-a's first-contact full sync
    _write(new_app, "UPDATE public.accounts SET owner = 'site-b' WHERE id BETWEEN 10 AND 12", "b0", 0, [C, A])
    site_b.query("DELETE FROM public.accounts WHERE id > 38")

    back = failover.rejoin(A, _connect(lr_sites), topo)
    assert back.tail == {"policy": 1} and back.table_tail == {"policy": 1}
    assert back.guarded == ["public.accounts"]
    assert site_a.query(
        "SELECT is_federated, table_id, source_site_id FROM lr.registry WHERE stream_name = 'public.accounts'"
    ) == [(True, None, B)]  # a sink of site-b now
    assert site_a.query(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.accounts'::regclass "
        "AND tgname LIKE 'lr\\_capture\\_%%'"
    ) == [(0,)]
    with pytest.raises(psycopg2.Error, match="replicated from site site-b since a failover: write it there"):
        site_a.query("UPDATE public.accounts SET owner = 'local' WHERE id = 1")  # would diverge: refused

    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, A, "policy")]))
    assert rows(site_a) == rows(site_b)
    site_b.query("UPDATE public.accounts SET balance = 7 WHERE id <= 2")
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS))
    assert rows(site_a) == rows(site_b) == rows(site_c)
    assert all(site_status(s).diverged == [] for s in lr_sites)
    app.close()
    new_app.close()


def test_failover_refuses_to_stop_a_tables_replication_unless_allowed_and_status_marks_it_diverged(lr_sites):
    site_a, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    create_accounts(site_a, rows=10)
    create_accounts(site_b)
    federate(site_b, federated=False)  # site-b keeps out of the table: it cannot become its source
    federate(site_a)
    app = App(site_a)
    app.put("k0", 0, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS))
    assert rows(site_c) == rows(site_a)

    with pytest.raises(
        ConfigurationError,
        match=r"site 'site-b' holds no synced copy of federated table\(s\) of "
        r"'site-a': policy: public.accounts \(conflict there; held by site-c\)",
    ):
        failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    assert site_b.query("SELECT count(*) FROM lr.failovers") == [(0,)] and _session_row(site_c)[1] is None

    result = failover.promote(
        failover.FailoverRequest(A, B, allow_table_divergence=True), _connect(lr_sites, down=(A,))
    )
    assert result.diverged == ["policy: public.accounts (conflict there; held by site-c)"]
    assert "diverged: site-b does not replicate it" in result.outcome[C]["policy"]
    at_c = site_status(site_c)
    line = f"public.accounts DIVERGED (client policy): its session {A}->{C}/policy was failed over to {B}"
    assert [d for d in at_c.diverged if d.startswith(line)] == at_c.diverged and len(at_c.diverged) == 1
    shown = [x for x in status.render(at_c).splitlines() if "DIVERGED" in x]
    assert len(shown) == 1 and line in shown[0]  # one line
    code, reasons = status.health({C: at_c})
    assert code == status.DEGRADED and any("public.accounts DIVERGED" in r for r in reasons)
    app.close()


def test_a_failover_to_a_site_whose_table_snapshot_is_half_applied_is_refused_old_source_down(lr_sites):
    """site-b is the only sink holding the table and its snapshot is still being applied (a range
    snapshot commits its ranges one by one, state syncing): promoting it would make half a table
    the source. Refused, naming it; before, with site-a down and no other sink holding the table,
    the failover went through and left site-b's half copy uncaptured."""
    site_a, site_b, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(site_a, rows=5)
    federate(site_a)
    App(site_a).close()
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, B, "policy")]))
    site_b.query("UPDATE lr.sink_tables SET state = 'syncing'")  # its ranges not all written yet
    with pytest.raises(ConfigurationError, match=r"policy: public.accounts \(syncing there\); promoting it would"):
        failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    assert site_b.query("SELECT count(*) FROM lr.failovers") == [(0,)]


def test_a_failover_killed_between_promoting_and_reconciling_hands_the_tables_over_when_run_again(lr_sites):
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    _write(app, "DELETE FROM public.accounts WHERE id <= 5", "k3", 3, [B, C])
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS, sessions=[SessionKey(A, C, "policy")]))
    _killed_failover(lr_sites, "failover_after_promote")
    assert site_b.query(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.accounts'::regclass "
        "AND tgname LIKE 'lr\\_capture\\_%%'"
    ) == [(4,)]  # captured at site-b already
    assert site_c.query("SELECT source_site_id FROM lr.sink_tables") == [(A,)]  # site-c not reconciled yet

    result = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    assert result.resumed and result.tables == {"policy": ["public.accounts"]}
    assert "table public.accounts: a snapshot from site-b" in result.outcome[C]["policy"]
    site_b.query("UPDATE public.accounts SET owner = 'site-b' WHERE id = 6")
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey(B, C, "policy")]))
    assert rows(site_c) == rows(site_b) and len(rows(site_c)) == 40  # site-a's delete beyond the cut is undone
    app.close()


@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
def test_a_fail_back_to_the_first_source_reaches_every_sink_again(lr_sites, planned):
    """site-a → site-b → back to site-a (each failover unplanned with its old source down and then
    rejoined, or planned): site-b's session from site-a, closed by the first failover, is not left
    closed by the second; site-a's entries after the fail-back reach site-b and site-c once.
    Meanwhile site-a's writer, whose client object loaded its routes before the switch, is refused
    in the database once site-a runs the new topology (naming site-b), and accepted again after the
    fail-back. What it committed before site-a rejoined reached nobody: its ticket is never called
    safe, not even when site-a's new sessions are past its position. A ticket from before a
    switchover is refused at once at site-a, which tracks the client no more (a wait timed out,
    saying site-b and site-c had not acknowledged what the drain gave them)."""
    topo, app = _setup(lr_sites)
    before = app.put("before-switch", 8, [B, C])  # drained by the switchover; beyond the cut of the failover
    away = failover.promote(
        failover.FailoverRequest(A, B, planned=planned), _connect(lr_sites, () if planned else (A,))
    )
    if not planned:
        lost = app.put("before-rejoin", 9, [B, C])  # site-a is back and knows nothing of the failover yet
        assert failover.rejoin(A, _connect(lr_sites), topo).reopened == []  # site-a never had a session from site-b
    with pytest.raises(TransmitError, match="has no session from this site any more" if planned else "after the cut"):
        app.client.wait_until_safe(before, timeout=0.5)
    with pytest.raises(
        psycopg2.Error,
        match="client policy is not replicated from this site any more: it is "
        "replicated from site site-b now: transmit there; nothing was written",
    ):
        app.put("stale-writer", 1, [B, C])
    app.conn.rollback()
    at_b = App(lr_sites[1])
    at_b.put("at-b", 1, [A, C])
    assert not [r.error for r in run_until_idle(replicator(away.topology, lr_sites, providers=PROVIDERS)) if r.error]

    back = failover.promote(
        failover.FailoverRequest(B, A, planned=planned), _connect(lr_sites, () if planned else (B,))
    )
    if not planned:
        assert failover.rejoin(B, _connect(lr_sites), away.topology).reopened == [f"{A}->{B}/policy"]
    for n in range(2):  # the first to set the sessions up (site-b's with a full sync), the second to stream
        reports = run_until_idle(replicator(back.topology, lr_sites, providers=PROVIDERS))
        assert not [r.error for r in reports if r.error]
        if n == 0:
            app.put("after-fail-back", 2, [B, C])
    for sink in (lr_sites[1], lr_sites[2]):
        assert sink_queue(sink, "policy", source=A).count(b"after-fail-back=2") == 1, sink.site_id
        assert b"stale-writer=1" not in sink_queue(sink, "policy", source=A)
    if not planned:
        with pytest.raises(TransmitError, match="after the cut .* received by nobody"):
            app.client.wait_until_safe(lost, timeout=0.5)
    app.close()
    at_b.close()


def test_a_fail_back_hands_the_federated_table_back_and_every_site_follows_site_a_again(lr_sites):
    site_a, site_b, site_c = lr_sites
    topo, app = _tables_setup(lr_sites)
    away = failover.promote(failover.FailoverRequest(A, B), _connect(lr_sites, down=(A,)))
    failover.rejoin(A, _connect(lr_sites), topo)
    at_b = App(site_b)
    _write(at_b, "UPDATE public.accounts SET owner = 'site-b' WHERE id <= 4", "b0", 0, [A, C])
    assert cycle_errors(run_until_idle(replicator(away.topology, lr_sites, providers=PROVIDERS))) == []
    assert rows(site_a) == rows(site_b) == rows(site_c)

    back = failover.promote(failover.FailoverRequest(B, A), _connect(lr_sites, down=(B,)))
    assert failover.rejoin(B, _connect(lr_sites), away.topology).guarded == ["public.accounts"]
    with pytest.raises(psycopg2.Error, match="replicated from site site-a since a failover: write it there"):
        site_b.query("UPDATE public.accounts SET owner = 'local' WHERE id = 1")
    app.close()
    app = App(site_a)
    for n in range(2):  # the first sets site-b's session up again (a full sync), the second streams
        assert cycle_errors(run_until_idle(replicator(back.topology, lr_sites, providers=PROVIDERS))) == []
        _write(app, f"UPDATE public.accounts SET balance = {n + 100} WHERE id > 30", f"a{n}", n, [B, C])
    assert cycle_errors(run_until_idle(replicator(back.topology, lr_sites, providers=PROVIDERS))) == []
    assert rows(site_a) == rows(site_b) == rows(site_c)
    assert all(site_status(s).diverged == [] for s in lr_sites)
    app.close()
    at_b.close()


def test_a_failover_naming_its_client_finds_the_old_source_of_a_sink_of_two_sources():
    """site-b receives policy from site-a and audit from site-d: `lr failover --promote site-b
    --client policy` names the old source of policy (site-a) without --from; it was refused, told to
    name it. Without --client it stays ambiguous, and so is a client neither source sends site-b."""
    from airflow_provider_lr.engine.store.topology import from_document

    topo = from_document(
        {
            "sites": [{"id": s} for s in ("site-a", "site-b", "site-c", "site-d")],
            "replication": [
                {"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]},
                {"source": "site-d", "sinks": ["site-a", "site-b", "site-c"], "clients": ["audit"]},
            ],
        }
    )
    assert failover.only_source(topo, "site-b", ["policy"]) == "site-a"
    assert failover.only_source(topo, "site-c", ["audit"]) == "site-d"
    with pytest.raises(ConfigurationError, match=r"receives from \['site-a', 'site-d'\]; name the old source"):
        failover.only_source(topo, "site-b")
    with pytest.raises(ConfigurationError, match="receives other from no source"):
        failover.only_source(topo, "site-b", ["other"])
