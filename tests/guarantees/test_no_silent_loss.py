"""The two silent-loss defects an independent crash pass found, as scenarios: a retention trim that
commits in the middle of a catch-up (session cycles and the read-once fan-out), and a replicator
killed between a sink's snapshot apply and the source's record of it."""

from __future__ import annotations

from collections import Counter

import pytest

from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session.runner import SessionRunner
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.session.snapshot_sync import SnapshotSync
from airflow_provider_lr.engine.source import full_sync, trim
from tests.support.session import App, apply, final_state, queue, replicator, run_crashing_replicator, source_state

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
PROVIDERS = {"policy": "tests.support.session:table_provider"}
KILLED = -9


def _starts(entries: list[tuple[str, str]]) -> int:
    return [k for k, _ in entries].count("start")


def _log_entries_after_last_start(entries: list[tuple[str, str]]) -> list[str]:
    kinds = [k for k, _ in entries]
    last = len(kinds) - 1 - kinds[::-1].index("start")
    return [p for k, p in entries[last:] if k == "log"]


def _open_requests(source) -> int:
    return source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')")[0][0]


def _backlog(app: App, n: int) -> None:
    """n transactions, each changing one of 50 keys and transmitting the change."""
    for i in range(n):
        app.put(f"k{i % 50}", i, ["site-b"])


class _TrimOnce:
    """A retention trim (keep nothing) committed by another connection, the first time it is called."""

    def __init__(self, source) -> None:
        self.source, self.result = source, None

    def __call__(self) -> None:
        if self.result is None:
            conn = self.source.connect()
            try:
                self.result = trim.retention_trim(conn, keep_seconds=0.0)
            finally:
                conn.close()


def test_retention_trim_mid_catch_up_sends_the_session_to_a_snapshot_and_loses_nothing(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    app.put("k0", -1, ["site-b"])
    repl = replicator(topo, lr_sites, max_entries=200, tee_min_backlog=0)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)  # first contact: full sync, then log entries
    _backlog(app, 4000)
    trimmer = _TrimOnce(source)
    with on_fault("after_sink_apply", trimmer):  # after the first batch of the catch-up
        (report,) = repl.run_cycle()
    assert trimmer.result is not None and trimmer.result.entries_removed > 3000
    assert not report.error, report
    repl.run(max_cycles=5, until_idle=True, interval=0.01)
    entries = queue(sink_b, "site-a")
    assert _starts(entries) == 2, "the trim past the sink must send it to a new full sync"
    assert final_state(entries) == source_state(source)
    sink_at = sink_b.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
    assert sink_at >= trimmer.result.trim_mark
    repl.close()
    app.close()


def test_retention_trim_mid_fanout_refuses_the_trimmed_chunk_and_the_session_recovers(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    app.put("k0", -1, ["site-b"])
    repl = replicator(topo, lr_sites, tee_min_backlog=0)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    repl.close()  # releases the session's lease for the fan-out
    _backlog(app, 2000)
    settings = SessionSettings(barrier_timeout=2.0)
    driver = fanout.FanoutDriver(
        topo,
        "site-a",
        settings=settings,
        connect=lambda s: next(x for x in lr_sites if x.site_id == s).connect(),
        conninfo=lambda s: next(x for x in lr_sites if x.site_id == s).conninfo,
    )
    trimmer = _TrimOnce(source)
    try:
        with on_fault("fanout_after_commit_p0_a0", trimmer):  # chunk 0 committed, then the trim
            result = fanout.run_fanout(driver, fanout.local_map, partitions=4)
    finally:
        driver.close()
    assert trimmer.result is not None and trimmer.result.trim_mark >= result.end
    assert "TrimmedError" in result.errors["site-a->site-b/policy"], result.errors
    moved_by_tee = result.positions["site-a->site-b/policy"]
    assert moved_by_tee < result.end  # the chunks after the trim were not taken as delivered
    repl = replicator(topo, lr_sites, tee_min_backlog=0)
    repl.run(max_cycles=5, until_idle=True, interval=0.01)
    entries = queue(sink_b, "site-a")
    assert _starts(entries) == 2
    assert final_state(entries) == source_state(source)
    repl.close()
    app.close()


def test_crash_after_snapshot_apply_closes_the_request_from_the_sink_and_never_reuses_it(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    for i in range(20):
        app.put(f"k{i % 5}", i, ["site-b"])
    crashed = run_crashing_replicator(topo, lr_sites, "after_snapshot_apply", providers=PROVIDERS)
    assert crashed.returncode == KILLED, crashed.stderr
    assert _open_requests(source) == 1  # applied on the sink, still 'supplied' on the source
    source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")
    # The next cycle closes it from the sink's own metadata: safe trim is no longer held at its base.
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert _open_requests(source) == 0
    (status,) = source.query("SELECT status FROM lr.full_sync_requests")[0]
    assert status == "applied"
    for i in range(20, 40):
        app.put(f"k{i % 5}", i, ["site-b"])
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    acked = source.query("SELECT acked_position FROM lr.source_sessions")[0][0]
    safe = trim.safe_trim(source.connect())
    assert safe is not None and safe.trim_mark == acked
    repl.close()
    app.close()


def test_crash_after_snapshot_apply_then_retention_trim_gets_a_new_full_sync_not_a_stale_resume(lr_sites):
    """The issue's reproduction: without the fix the stale request was taken for a resume, nothing
    was applied, and log-entry sync went on from below the trim mark (values jumping)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    for i in range(20):
        app.put(f"k{i % 5}", i, ["site-b"])
    crashed = run_crashing_replicator(topo, lr_sites, "after_snapshot_apply", providers=PROVIDERS)
    assert crashed.returncode == KILLED, crashed.stderr
    for i in range(20, 300):
        app.put(f"k{i % 5}", i, ["site-b"])
    forced = trim.retention_trim(source.connect(), keep_seconds=0.0)
    assert forced is not None and forced.entries_removed >= 280
    for i in range(300, 322):
        app.put(f"k{i % 5}", i, ["site-b"])
    source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")
    repl = replicator(topo, lr_sites)
    reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
    assert not any(r.error for r in reports), reports
    entries = queue(sink_b, "site-a")
    assert _starts(entries) == 2
    assert final_state(entries) == source_state(source)
    logs = _log_entries_after_last_start(entries)
    assert not [p for p, n in Counter(logs).items() if n > 1]
    assert _open_requests(source) == 0
    statuses = sorted(r[0] for r in source.query("SELECT status FROM lr.full_sync_requests"))
    assert statuses == ["applied", "applied"]
    repl.close()
    app.close()


def _status_lines(sites) -> list[str]:
    from airflow_provider_lr.engine.site import status

    found = {}
    for site in sites[:2]:
        conn = site.connect()
        found[site.site_id] = status.site_status(conn, site.site_id)
        conn.close()
    return status.render_sites(found).splitlines()


def test_status_never_calls_a_sink_behind_the_trim_mark_consistent(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    app.put("k0", 0, ["site-b"])
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    session = [line for line in _status_lines(lr_sites) if "site-a->site-b/policy" in line]
    assert "consistent" in session[1] and "source trim mark 0" in session[1] and " ready " in session[0]
    _backlog(app, 30)  # the sink lags ...
    trim.retention_trim(source.connect(), keep_seconds=0.0)  # ... and the log is trimmed past it
    session = [line for line in _status_lines(lr_sites) if "site-a->site-b/policy" in line]
    assert all("not ready (behind trim)" in line for line in session), session
    # the source's row says the lag is unknown, not what is left of the log (it said "lag 0 entries")
    assert "lag unknown (entries to" in session[0] and "lag 0 entries" not in session[0], session
    repl.run(max_cycles=5, until_idle=True, interval=0.01)  # a full sync brings it back
    session = [line for line in _status_lines(lr_sites) if "site-a->site-b/policy" in line]
    assert " ready " in session[0] and "consistent" in session[1] and "behind" not in session[1]
    assert final_state(queue(sink_b, "site-a")) == source_state(source)
    repl.close()
    app.close()


def test_status_does_not_call_a_streamed_sink_holding_everything_behind_trim_while_its_ack_trails(lr_sites):
    """``lr sync`` acknowledges what a sink holds durably, lazily (docs/streaming.md): the ack
    trails the sink. A retention trim in that window passed the acknowledged position while the
    sink held every entry, and ``lr status`` called the session "not ready (behind trim)" on the
    source's line, the site DEGRADED. The sink's own position, read in the same run, decides."""
    from airflow_provider_lr.engine.session.settings import StreamSettings
    from airflow_provider_lr.engine.site import status
    from tests.support.session import Streaming, wait_for

    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    slow_acks = StreamSettings(check_interval=0.2, ack_interval=60.0, retry_min=0.1, retry_max=0.5)
    with Streaming(replicator(topo, lr_sites, lease_seconds=2.0), slow_acks) as streaming:
        streaming.streaming()
        _backlog(app, 5)
        wait_for(lambda: final_state(queue(sink_b, "site-a")) == source_state(source), 10, "the entries streamed")
        trim.retention_trim(source.connect(), keep_seconds=0.0)
        (acked,) = source.query("SELECT acked_position FROM lr.source_sessions")[0]
        assert trim.trim_mark(source.connect()) > acked  # the window: the ack trails the sink
        session = [line for line in _status_lines(lr_sites) if "site-a->site-b/policy" in line]
        assert " ready " in session[0] and "consistent" in session[1] and "behind" not in " ".join(session), session
        found = {}
        for site in lr_sites[:2]:
            conn = site.connect()
            found[site.site_id] = status.site_status(conn, site.site_id)
            conn.close()
        assert status.health(found) == (status.HEALTHY, [])
    app.close()


def test_a_session_removed_from_the_topology_releases_its_open_full_sync_for_safe_trim(lr_sites):
    source = lr_sites[0]
    two = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
    topo = apply(lr_sites, two, providers=PROVIDERS)
    app = App(source)
    app.put("k0", 0, ["site-b", "site-c"])
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    repl.close()
    conn = source.connect()
    full_sync.request_full_sync(conn, "site-c", "policy", "audit", forced=True)
    app.client.serve_full_sync_requests(lambda ctx: None)  # supplied: its base holds safe trim
    for i in range(1, 20):
        app.put(f"k{i}", i, ["site-b"])
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)  # site-c's session is removed
    assert _open_requests(source) == 0
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    acked = source.query("SELECT acked_position FROM lr.source_sessions")[0][0]
    assert trim.safe_trim(conn).trim_mark == acked
    conn.close()
    repl.close()
    app.close()
    # site-c's row of the removed session (kept until pruned) stands behind the trim mark: lr status
    # stays healthy (it said degraded, "not ready (behind trim)", until the row was pruned)
    from airflow_provider_lr.engine.site import status

    found = {}
    for site in lr_sites:
        conn = site.connect()
        found[site.site_id] = status.site_status(conn, site.site_id)
        conn.close()
    (removed,) = [s for s in found["site-c"].sessions if s["sink_site_id"] == "site-c"]
    assert status.readiness(removed, found["site-a"].trim_mark) == "not ready (behind trim)"
    assert status.health(found, topology=topo) == (status.HEALTHY, [])


def test_a_session_removed_from_the_topology_as_its_cycle_ends_fails_that_cycle_saying_so(lr_sites, monkeypatch):
    """The topology is applied without site-c as site-c's cycle ends (its batch committed and
    acked, its status not yet read): the cycle fails saying the session is gone from the topology,
    as the next one is refused. Before, it failed with a ValueError from inside lr ("not enough
    values to unpack"): its status read the session's row as if it were still there."""
    source = lr_sites[0]
    two = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
    topo = apply(lr_sites, two, providers=PROVIDERS)
    app = App(source)
    app.put("k0", 0, ["site-b", "site-c"])
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    app.put("k1", 1, ["site-b", "site-c"])
    finish = SessionRunner.finish

    def removed_first(runner, report):  # the topology applied elsewhere at this very moment
        if runner.key.sink == "site-c":
            apply(lr_sites, ONE_SINK, providers=PROVIDERS)
        return finish(runner, report)

    monkeypatch.setattr(SessionRunner, "finish", removed_first)
    errors = {r.session: r.error for r in repl.run_cycle() if r.error}
    repl.close()
    assert list(errors) == ["site-a->site-c/policy"], errors
    assert "no session to 'site-c' for client 'policy'" in errors["site-a->site-c/policy"], errors
    for sink in lr_sites[1:]:
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == ["k1=1"]
    app.close()


@pytest.mark.parametrize(
    "fault", ["before_request", "after_snapshot_start", "before_snapshot_apply", "after_snapshot_apply"]
)
def test_a_session_removed_from_the_topology_during_its_snapshot_sync_fails_saying_so_not_taken_over(
    lr_sites, fault, monkeypatch
):
    """The topology is applied without site-c while site-c's first full sync runs (as it asks for
    the full sync, or later): the cycle fails saying the session is no longer in the topology
    applied at the source, as the next cycle's refusal does. Before, it said its "lease epoch 1 ...
    was taken over", as if another replicator had taken the session (or, as it asked, failed with a
    TypeError from inside lr)."""
    source = lr_sites[0]
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-c"], "clients": ["policy"]}], providers=PROVIDERS)
    app = App(source)
    app.put("k0", 0, ["site-c"])
    repl = replicator(topo, lr_sites)

    def removed() -> None:
        apply(lr_sites, ONE_SINK, providers=PROVIDERS)

    if fault == "before_request":  # no fault point there: as the cycle reads the session's attempts
        attempts = SnapshotSync._attempts
        monkeypatch.setattr(SnapshotSync, "_attempts", lambda sync: removed() or attempts(sync))
    try:
        with on_fault(fault, removed):
            errors = {r.session: r.error for r in repl.run_cycle() if r.error}
    finally:
        repl.close()
        app.close()
    assert list(errors) == ["site-a->site-c/policy"], errors
    error = errors["site-a->site-c/policy"]
    assert "no session to 'site-c' for client 'policy'" in error and "taken over" not in error, error
    assert "removed from the topology" in error, error
