"""A planned switchover drains the old source into every sink behind fences, up to the cut its
commit barrier took, while the old source's writers may still commit (a client object made before
the switch keeps its routes) and a replicator may still stream from it. Neither may carry a sink
past the cut: that sink would hold entries of the old source the promoted site never gets. A full
sync the operator asked of the old source for a sink is asked of the new one."""

from __future__ import annotations

import threading

import psycopg2
import pytest

from airflow_provider_lr.engine.errors import ConfigurationError, FencedError
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.site import failover
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.source import full_sync, moved
from tests.engine.site.test_failover import PROVIDERS, A, B, C, _connect, _setup, _tables_setup, replicator
from tests.support.session import App, apply, queue, sink_queue, wait_for
from tests.support.soak import expire_leases


def test_a_lease_taken_just_before_a_planned_switchover_cannot_write_past_the_drain(lr_sites, monkeypatch):
    """The fence is above every epoch the old source granted: a replicator that took its lease just
    before the switch (a takeover from a killed `lr sync` member) has not written to site-c yet, so
    site-c has not seen its epoch."""
    site_a, site_b, site_c = lr_sites
    _topo, app = _setup(lr_sites)
    expire_leases(site_a)
    conn_a, conn_c = site_a.connect(), site_c.connect()
    late = leases.acquire(conn_a, C, "policy", "late-streamer", 60)
    assert late is not None
    barrier, stale_writes = failover.commit_barrier, []

    def barrier_while_the_late_streamer_writes(conn, timeout):
        """The drain's barrier, with the late streamer's write to site-c coming after the fences."""
        try:
            writes.fence(conn_c, A, "policy", late.epoch)
            stale_writes.append("accepted")
        except FencedError:
            conn_c.rollback()
        return barrier(conn, timeout)

    monkeypatch.setattr(failover, "commit_barrier", barrier_while_the_late_streamer_writes)
    result = failover.promote(failover.FailoverRequest(A, B, planned=True), _connect(lr_sites))
    assert result.planned and stale_writes == [], "a write with an epoch the old source granted passed the fence"
    assert sink_queue(site_c, "policy") == sink_queue(site_b, "policy")
    for conn in (conn_a, conn_c):
        conn.close()
    app.close()


def test_what_the_old_source_commits_while_the_sinks_are_drained_stays_beyond_the_cut(lr_sites, monkeypatch):
    """site-b is drained first; the old source's writer, whose client loaded its routes before the
    switch, tries to commit an entry before site-c's drain: the new topology's guard refuses it,
    naming site-b. On a site without that guard (its lr schema older than V0028) it commits: site-c
    still stops at the cut with site-b, and the entry is A's reported tail. (Carried past the cut,
    it would be removed as an extra, or, once site-c's application consumed it, cost a full sync.)"""
    site_a, site_b, site_c = lr_sites
    _topo, app = _setup(lr_sites)
    for i in range(3, 6):
        app.put(f"k{i}", i, [B, C])  # not replicated yet: the drain carries them
    apply, late = writes.apply_log_stream, []

    def apply_then_the_writer_commits(*args, **kwargs):
        end = apply(*args, **kwargs)
        if not late:
            with pytest.raises(psycopg2.Error, match="replicated from site site-b now: transmit there"):
                app.put("refused", 98, [B, C])
            app.conn.rollback()
            site_a.query(f"DROP TRIGGER {moved.GUARD} ON lr.log_entries")  # as on a site before V0028
            late.append(app.put("late", 99, [B, C]))
        return end

    monkeypatch.setattr(writes, "apply_log_stream", apply_then_the_writer_commits)
    result = failover.promote(failover.FailoverRequest(A, B, planned=True), _connect(lr_sites))
    assert late and result.planned and "nothing moved" in result.outcome[C]["policy"], result.outcome
    assert not {"late=99", "refused=98"} & {p.decode() for p in sink_queue(site_c, "policy")}
    assert sink_queue(site_c, "policy") == sink_queue(site_b, "policy")
    assert result.tail == {"policy": 1}
    app.close()


def test_a_full_sync_asked_of_the_old_source_is_asked_of_the_new_one(lr_sites):
    """The new topology cancels the old source's requests of the failed-over sessions: the sink the
    operator wanted synced again (restored from a backup, its application's data lost) gets its
    full sync from the promoted site instead, with the operator's reason; also when the switchover
    was killed after its drain and run again."""
    site_a, site_b, site_c = lr_sites
    _topo, app = _setup(lr_sites)
    conn_a = site_a.connect()
    full_sync.request_full_sync(conn_a, C, "policy", reason="site-c restored from a backup", forced=True)
    conn_a.close()

    def killed() -> None:
        raise RuntimeError("killed after promoting (test)")

    with on_fault("failover_after_promote", killed), pytest.raises(RuntimeError, match="killed"):
        failover.promote(failover.FailoverRequest(A, B, planned=True), _connect(lr_sites))
    # the run again asks it (before: the drain had closed it, and the re-run asked nothing)
    result = failover.promote(failover.FailoverRequest(A, B, planned=True), _connect(lr_sites))
    assert result.resumed and result.full_syncs == ["site-b->site-c/policy"], result.outcome
    assert "site-c restored from a backup" in result.outcome[C]["policy"]
    ((there,),) = site_b.query("SELECT request_id::text FROM lr.full_sync_requests WHERE sink_site_id = 'site-c'")
    assert site_a.query("SELECT note FROM lr.full_sync_requests WHERE forced") == [
        (f"failed over: asked of site-b as request {there}",)
    ]  # who waits for it follows it there
    App(site_b).close()  # the application's table at site-b (empty), which its provider reads
    run_until_idle(replicator(result.topology, lr_sites, providers=PROVIDERS))
    assert [kind for kind, _ in queue(site_c, "site-b")] == ["start", "end"]  # a full sync from site-b
    app.close()


def test_a_switchover_beside_a_writer_holding_its_table_then_transmitting_does_not_deadlock(lr_sites):
    """The writer has locked a row of the federated table (to change it) and written nothing to the
    log yet; the switchover waits for that table to put its guard there, then the writer changes the
    row (captured into the log) and transmits. Had the switchover locked the log first in that
    transaction (the guard against the client's writers, whose DDL excludes every writer of the
    log), each would wait for the other: PostgreSQL aborts one, perhaps the switchover. That guard
    is set in a transaction of its own: the writer commits before the cut, and is drained."""
    site_a, site_b, _site_c = lr_sites
    _topo, app = _tables_setup(lr_sites)
    with app.conn.cursor() as cur:
        cur.execute("SELECT balance FROM public.accounts WHERE id = 1 FOR UPDATE")
    outcome: list[object] = []

    def switch() -> None:
        try:
            outcome.append(failover.promote(failover.FailoverRequest(A, B, planned=True), _connect(lr_sites)))
        except Exception as exc:  # said by the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=switch)
    thread.start()
    wait_for(
        lambda: site_a.query(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'public.accounts'::regclass"
        )[0][0],
        30,
        "the switchover to wait for the writer's table",
    )
    with app.conn.cursor() as cur:
        cur.execute("UPDATE public.accounts SET balance = balance + 1 WHERE id = 1")
    app.put("k9", 9, [B, C])
    thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], failover.FailoverResult), outcome
    assert b"k9=9" in sink_queue(site_b, "policy")  # committed before the cut: drained
    app.close()


def test_a_reason_with_a_nul_is_refused_before_any_full_sync_request_or_failover_step(lr_sites):
    """The Airflow forms take any JSON string: a reason holding NUL, which no site can record, is
    refused naming the reason; before, psycopg2 failed deep in the engine (after the sessions
    before it had their request recorded, for ``lr_full_sync``), retried three times."""
    site_a, site_b, _ = lr_sites
    topo = apply(lr_sites)
    for ask in (
        lambda: full_sync.request_for_sessions(topo.sessions(), _connect(lr_sites), "audit\x00"),
        lambda: failover.promote(failover.FailoverRequest(A, B, reason="dc-1\x00down"), _connect(lr_sites)),
    ):
        with pytest.raises(
            ConfigurationError,
            match=r"reason is one line of text .*no newline or other control character\), not '(audit|dc-1)",
        ):
            ask()
    assert site_a.query("SELECT count(*) FROM lr.full_sync_requests WHERE forced") == [(0,)]
    assert site_b.query("SELECT count(*) FROM lr.failovers") == [(0,)]
    assert site_b.query("SELECT count(*) FROM lr.sink_sessions WHERE failover_id IS NOT NULL") == [(0,)]
