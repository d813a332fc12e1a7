"""Sessions under real faults: processes killed between steps, a sink server restarted mid-apply,
the log trimmed under a lagging sink, a client that never supplies its full sync."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.store.topology import recorded_id
from tests.support.session import (
    App,
    apply,
    final_state,
    queue,
    replicator,
    run_crashing_replicator,
    source_state,
    table_provider,
    wait_for,
)

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
KILLED = -9


def _no_duplicates(entries: list[tuple[str, str]]) -> None:
    twice = [e for e, n in Counter(entries).items() if n > 1]
    assert not twice, f"delivered more than once: {twice[:5]}"


def _expire_leases(source) -> None:
    """The killed replicator's lease runs out (as it would after lease_seconds)."""
    source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")


def test_replicator_killed_between_sink_write_and_source_metadata_update(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    app = App(source)
    first = replicator(topo, lr_sites)
    first.run(max_cycles=3, until_idle=True, interval=0.01)
    first.close()
    for i in range(50):
        app.put(f"k{i % 7}", i, ["site-b"])
    crashed = run_crashing_replicator(topo, lr_sites, "after_sink_apply")
    assert crashed.returncode == KILLED, crashed.stderr
    # the sink has the batch; the source never heard it was acknowledged
    sink_last = sink_b.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
    acked = source.query("SELECT acked_position FROM lr.source_sessions")[0][0]
    assert sink_last > acked
    _expire_leases(source)
    for i in range(50, 60):
        app.put(f"k{i % 7}", i, ["site-b"])
    repl = replicator(topo, lr_sites)
    (report,) = repl.run_cycle()
    assert report.decision == "log_entry_sync" and report.delivered == 10, report
    entries = queue(sink_b, "site-a")
    _no_duplicates(entries)
    assert [p for k, p in entries if k == "log"] == [f"k{i % 7}={i}" for i in range(60)]
    assert source.query(
        "SELECT acked_position = %s, remaining_entries FROM lr.source_sessions", (report.acked_position,)
    ) == [(True, 0)]
    repl.close()
    app.close()


def test_replicator_killed_mid_snapshot_transfer_resumes_without_resending(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:many_rows_provider"})
    crashed = run_crashing_replicator(topo, lr_sites, "after_snapshot_chunk")
    assert crashed.returncode == KILLED, crashed.stderr
    partial = sink_b.query("SELECT sum(entry_count) FROM lr.receive_queue WHERE NOT visible")[0][0]
    assert 0 < partial < 12_002  # one chunk made it; nothing visible yet
    assert queue(sink_b, "site-a") == []
    requests_before = source.query("SELECT count(*) FROM lr.full_sync_requests")[0][0]
    _expire_leases(source)
    repl = replicator(topo, lr_sites)
    (report,) = repl.run_cycle()
    assert report.snapshot_messages == 12_002 - partial  # only what was missing crossed over
    assert source.query("SELECT count(*) FROM lr.full_sync_requests")[0][0] == requests_before  # same request
    entries = queue(sink_b, "site-a")
    _no_duplicates(entries)
    assert [k for k, _ in entries].count("snap") == 12_000
    assert entries[0] == ("start", "") and entries[-1] == ("end", "")
    repl.close()


def test_a_full_sync_longer_than_a_turn_pauses_between_chunks_so_the_other_sessions_cycle_and_it_arrives_once(
    lr_sites,
):
    """Each session's cycle has a turn (``cycle_slice``): a full sync's transfer past it pauses after
    its chunk and the next cycle resumes it from the sink's metadata. Before, one session's full sync
    of millions held every other session's cycle (and a stop) until it was applied."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, providers={"policy": "tests.support.session:many_rows_provider"})
    repl = replicator(topo, lr_sites)
    repl.cycle_slice = 0.0  # every turn is spent after one chunk
    ended: list[str] = []  # the last word of each piece of work (lr sync's log, an Airflow task's)
    with progress.listen(lambda p: ended.append(p.describe()) if p.finished and "transfer" in p.task else None):
        first = repl.run_cycle()
        assert [r.snapshot_messages for r in first] == [5_000, 5_000], first  # both sessions moved in one cycle
        assert all("the rest next cycle" in r.reason and not r.error for r in first), first
        assert queue(sink_b, "site-a") == queue(sink_c, "site-a") == []  # nothing visible until applied
        # a paused transfer says so (it said "done in 0.4s" at 5,000 of 12,002)
        assert len(ended) == 2 and all("5,000 of 12,002 messages (stopped after" in e for e in ended), ended
        repl.run(max_cycles=10, until_idle=True, interval=0.01)
    assert ended[-1].startswith("full sync") and "12,002 of 12,002 messages (done in" in ended[-1], ended
    for sink in (sink_b, sink_c):
        entries = queue(sink, "site-a")
        _no_duplicates(entries)
        assert [k for k, _ in entries].count("snap") == 12_000
        assert entries[0] == ("start", "") and entries[-1] == ("end", "")
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status <> 'applied'") == [(0,)]
    repl.close()


def test_sink_restarts_during_snapshot_apply_then_apply_resumes_without_retransfer(lr_sites, site_manager):
    source, sink_b, _ = lr_sites
    # The test servers run with synchronous_commit off; a crash may then lose recent commits, as
    # PostgreSQL documents. This sink database is made durable, as a production sink is.
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')
    topo = apply(lr_sites, ONE_SINK)
    app = App(source)
    for i in range(300):
        app.put(f"k{i}", i, ["site-b"])
    blocker = None
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    crashed = run_crashing_replicator(
        topo, lr_sites, "before_snapshot_apply", providers={"policy": "tests.support.session:table_provider"}
    )
    assert crashed.returncode == KILLED, crashed.stderr
    transferred = sink_b.query(
        "SELECT snapshot_transferred_seq, snapshot_started = snapshot_transferred FROM lr.sink_sessions"
    )[0]
    assert transferred[1], "the crash point is after a complete transfer"
    _expire_leases(source)
    # Hold one snapshot row so the apply blocks half way through its UPDATE, then stop the sink hard.
    blocker = sink_b.connect()
    with blocker.cursor() as cur:
        cur.execute("SELECT seq FROM lr.receive_queue WHERE NOT visible ORDER BY seq DESC LIMIT 1 FOR UPDATE")
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.extend(repl.run_cycle()))
    worker.start()
    deadline = time.monotonic() + 20
    while not sink_b.query(
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE 'UPDATE lr.receive_queue SET visible%%'"
    ):
        assert time.monotonic() < deadline, "the apply never started"
        time.sleep(0.05)
    site_manager.down([sink_b.site_id], mode="immediate")
    worker.join(30)
    assert not worker.is_alive()
    assert outcome and "OperationalError" in outcome[0].error  # the sink went away mid-apply
    site_manager.up(site_ids=[sink_b.site_id])
    assert queue(sink_b, "site-a") == []  # nothing half-applied became visible
    (report,) = repl.run_cycle()
    assert report.decision == "wait_snapshot_apply" and report.snapshot_messages == 0, report
    entries = queue(sink_b, "site-a")
    _no_duplicates(entries)
    assert final_state(entries) == source_state(source)
    assert sink_b.query("SELECT snapshot_transferred_seq, data_consistent FROM lr.sink_sessions") == [
        (transferred[0], True)
    ]
    repl.close()
    app.close()


def test_trim_while_a_sink_lags_sends_it_back_to_a_snapshot(lr_sites):
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}])
    app = App(source)
    both = replicator(topo, lr_sites, providers={"policy": table_provider})
    both.run(max_cycles=3, until_idle=True, interval=0.01)
    both.close()
    only_b = replicator(
        topo,
        lr_sites,
        providers={"policy": table_provider},
        sessions=[k for k in topo.sessions() if k.sink == "site-b"],
    )
    for i in range(40):
        app.put(f"k{i % 5}", i, ["site-b", "site-c"])
    only_b.run(max_cycles=3, until_idle=True, interval=0.01)
    only_b.close()
    c_acked = source.query("SELECT acked_position FROM lr.source_sessions WHERE sink_site_id = 'site-c'")[0][0]
    # Safe trim keeps what the lagging sink still needs.
    safe = trim.safe_trim(source.connect())
    assert safe is not None and safe.trim_mark == c_acked
    still_needed = source.query(
        "SELECT count(*) FROM lr.log_entries e JOIN lr.log_commits c ON c.tx = e.tx "
        "WHERE e.stream = 1 AND c.position > %s",
        (c_acked,),
    )[0][0]
    assert still_needed == 40
    # Retention trims past it anyway.
    time.sleep(0.05)
    forced = trim.retention_trim(source.connect(), keep_seconds=0.0)
    assert forced is not None and forced.trim_mark > c_acked and forced.entries_removed >= 40
    for i in range(40, 45):
        app.put(f"k{i % 5}", i, ["site-b", "site-c"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    reports = {r.session: r for r in repl.run(max_cycles=4, until_idle=True, interval=0.01)}
    assert all(not r.error and not r.skipped for r in reports.values()), reports
    entries_c = queue(sink_c, "site-a")
    assert [k for k, _ in entries_c].count("start") == 2  # first contact, then the recovery snapshot
    assert final_state(entries_c) == source_state(source)
    entries_b = queue(sink_b, "site-a")
    _no_duplicates(entries_b)
    assert [k for k, _ in entries_b].count("start") == 1  # the sink that kept up was not disturbed
    assert [p for k, p in entries_b if k == "log"] == [f"k{i % 5}={i}" for i in range(45)]
    repl.close()
    app.close()


def test_full_sync_without_client_data_restarts_with_backoff_not_livelock(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK)
    app = App(source)
    app.put("k", 1, ["site-b"])
    repl = replicator(topo, lr_sites, data_timeout=0.2)  # no provider: nobody supplies the data

    def requests() -> list[tuple[str, float]]:
        return source.query(
            "SELECT status, extract(epoch FROM data_deadline - requested_at)::float8 FROM lr.full_sync_requests "
            "ORDER BY requested_at"
        )

    deadline = time.monotonic() + 30
    while True:  # cycles until the third request is open (how many cycles that takes is the machine's)
        repl.run_cycle()
        rows = requests()
        if len(rows) >= 3 and rows[-1][0] == "pending" or time.monotonic() > deadline:
            break
        time.sleep(0.15)
    timeouts = [round(t, 1) for _, t in rows]
    assert [s for s, _ in rows][:-1] == ["timed_out"] * (len(rows) - 1) and rows[-1][0] == "pending"
    assert len(rows) >= 2  # restarted after the timeout ...
    assert timeouts == [round(0.2 * 2**i, 1) for i in range(len(rows))]  # ... each time waiting twice as long
    assert source.query("SELECT attempts FROM lr.source_sessions")[0][0] == len(rows) - 1
    assert source.query("SELECT DISTINCT note FROM lr.full_sync_requests WHERE status = 'timed_out'") == [
        ("no client data within the timeout",)
    ]
    # The client comes back, slowly: its own serve loop is supplying the open request, expired by
    # now, when a cycle looks at it. The cycle leaves it to the supply (before: it waited for the
    # supply's lock on the request and failed after lock_timeout, every cycle), and it arrives.
    wait_for(
        lambda: source.query("SELECT now() > data_deadline FROM lr.full_sync_requests WHERE status = 'pending'")[0][0],
        10,
        "the request to expire",
    )
    supplying, done = threading.Event(), threading.Event()

    def slow_provider(ctx) -> None:
        supplying.set()
        done.wait(10)
        table_provider(ctx)

    supply = threading.Thread(target=app.client.serve_full_sync_requests, args=(slow_provider,), daemon=True)
    supply.start()
    assert supplying.wait(10)
    (report,) = repl.run_cycle()
    assert not report.error and report.waiting, report
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status = 'pending'") == [(1,)]
    done.set()
    supply.join(10)
    (report,) = repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert not report.error and report.state == "IN_LOG_ENTRY_SYNC"
    assert final_state(queue(sink_b, "site-a")) == {"k": 1}
    repl.close()
    app.close()


def test_a_new_full_sync_request_cancels_the_pending_one_and_one_full_set_arrives(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK)
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    conn = source.connect()
    first = full_sync.request_full_sync(conn, "site-b", "policy", "operator asked", forced=True)
    app.client.serve_full_sync_requests(table_provider)  # supplied, not yet transferred
    second = full_sync.request_full_sync(conn, "site-b", "policy", "asked again", forced=True)
    statuses = dict(source.query("SELECT request_id::text, status FROM lr.full_sync_requests"))
    assert statuses[first.request_id] == "cancelled" and statuses[second.request_id] == "pending"
    repl.run(max_cycles=4, until_idle=True, interval=0.01)
    entries = queue(sink_b, "site-a")
    assert [k for k, _ in entries].count("start") == 2  # first contact + exactly one forced set
    last_set = entries[len(entries) - 1 - [k for k, _ in entries][::-1].index("start") :]
    assert sorted(p for k, p in last_set if k == "snap") == [f"k{i}={i}" for i in range(5)]
    assert (
        dict(source.query("SELECT request_id::text, status FROM lr.full_sync_requests"))[second.request_id] == "applied"
    )
    conn.close()
    repl.close()
    app.close()


def test_two_replicators_racing_on_every_session_deliver_each_entry_once(lr_sites):
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}])
    app = App(source)
    stop = threading.Event()
    racers = [replicator(topo, lr_sites, providers={"policy": table_provider}, owner=f"racer-{i}") for i in range(2)]
    threads = [threading.Thread(target=r.run, kwargs={"stop": stop, "interval": 0.01}) for r in racers]
    for t in threads:
        t.start()
    for i in range(300):
        app.put(f"k{i % 9}", i, ["site-b", "site-c"] if i % 3 else ["site-b"])
        if i % 25 == 0:  # the holder stalls: its lease runs out and the other racer takes over
            _expire_leases(source)
            time.sleep(0.05)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(30)
    epochs = source.query("SELECT max(lease_epoch) FROM lr.source_sessions")[0][0]
    for r in racers:
        r.close()
    final = replicator(topo, lr_sites, providers={"policy": table_provider})
    final.run(max_cycles=5, until_idle=True, interval=0.01)
    for sink, wanted in ((sink_b, range(300)), (sink_c, [i for i in range(300) if i % 3])):
        entries = queue(sink, "site-a")
        _no_duplicates(entries)
        assert [k for k, _ in entries].count("start") == 1
        logs = [p for k, p in entries if k == "log"]
        expected = [f"k{i % 9}={i}" for i in wanted]
        # after the full sync, every later entry exactly once and in order: a suffix with no gap
        assert logs and logs == expected[len(expected) - len(logs) :]
    assert final_state(queue(sink_b, "site-a")) == source_state(source)
    assert epochs > 2  # the lease really changed hands
    final.close()
    app.close()


def test_a_replicator_whose_lease_ran_out_mid_snapshot_cannot_write_once_the_successor_decided(lr_sites):
    """The successor fences the sink before it negotiates, so the stale replicator's remaining
    snapshot writes are refused and exactly one full set arrives (not one from each)."""
    from airflow_provider_lr.engine.errors import FencedError
    from airflow_provider_lr.engine.session.runner import SessionRunner
    from airflow_provider_lr.engine.session.settings import SessionSettings
    from airflow_provider_lr.engine.sink import writes
    from airflow_provider_lr.engine.vocabulary import SessionKey

    source, sink_b, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b"])
    key = SessionKey("site-a", "site-b", "policy")
    settings = SessionSettings(barrier_timeout=2.0)
    stale = SessionRunner(key, source.connect(), sink_b.connect(), "stale", settings, table_provider)
    _, hs = stale.begin()
    assert hs.decision.value == "snapshot_sync"
    request = stale._current_request(hs.meta)
    app.client.serve_full_sync_requests(table_provider)
    request = full_sync.get_request(source.connect(), request.request_id)
    _expire_leases(source)  # the stale replicator pauses here; its lease runs out
    successor = SessionRunner(key, source.connect(), sink_b.connect(), "successor", settings, table_provider)
    _, decided = successor.begin()
    assert decided.decision.value == "snapshot_sync" and successor.lease.epoch > stale.lease.epoch
    with pytest.raises(FencedError):
        writes.start_snapshot(
            stale.sink, "site-a", "policy", stale.lease.epoch, writes.SyncStart.of(request), recorded_id(stale.source)
        )
    with pytest.raises(FencedError):
        full_sync.request_full_sync(stale.source, "site-b", "policy", lease=stale.lease)
    report = successor.run_cycle()
    assert not report.error and report.state == "IN_LOG_ENTRY_SYNC"
    entries = queue(sink_b, "site-a")
    assert [k for k, _ in entries].count("start") == 1
    assert final_state(entries) == source_state(source)
    app.close()


def test_the_lease_keeper_rides_out_a_source_restart_and_renews_again(lr_sites, site_manager):
    """The source restarts while a long run's leases are kept alive: the keeper's renewals fail
    while it is down (its thread lives on) and the leases are renewed again once it is back."""
    from airflow_provider_lr.engine.session import lease as leases
    from airflow_provider_lr.engine.session.lease_keeper import LeaseKeeper

    source, _, _ = lr_sites
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')  # the lease survives the crash
    apply(lr_sites, ONE_SINK)
    conn = source.connect()
    held = leases.acquire(conn, "site-b", "policy", "fanout-test", seconds=3)
    conn.close()
    keeper = LeaseKeeper(source.dsn, [held], seconds=3)  # renews every second
    try:
        site_manager.down([source.site_id], mode="immediate")
        time.sleep(2.5)  # renewals fail meanwhile: the connection is gone, new ones are refused
        site_manager.up(site_ids=[source.site_id])
        renewed_after = source.query("SELECT now()")[0][0]
        deadline = time.monotonic() + 15
        while source.query(
            "SELECT lease_owner, lease_expires_at > %s + interval '2 seconds' FROM lr.source_sessions", (renewed_after,)
        ) != [("fanout-test", True)]:
            assert time.monotonic() < deadline, "the keeper renewed nothing after the restart"
            time.sleep(0.2)
        assert keeper._thread.is_alive() and keeper.error is None
    finally:
        keeper.stop()


def test_a_source_stream_whose_login_is_refused_hands_its_session_back_and_the_cycles_carry_it(lr_sites):
    """The source's stream cannot log in (its cycles' connection was made before the login broke):
    the session is handed back with the error naming the role instead of waiting for commits
    forever, and the cycles, backed off, still deliver what the application writes."""
    from airflow_provider_lr.engine.session.settings import StreamSettings
    from tests.support.session import Streaming, wait_for
    from tests.support.subscriber import refused_login

    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:table_provider"})
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, lease_seconds=2.0)
    repl.run_cycle()  # the cycles' connections, made while the login still works
    good = repl.connect
    repl.connect = lambda site: refused_login(source).connect() if site == "site-a" else good(site)
    app = App(source)
    with Streaming(repl, StreamSettings(retry_min=0.1, retry_max=0.2)) as streaming:
        wait_for(
            lambda: any("no_such_role" in e.error for e in streaming.streamer.ends), 15, "the refused stream's end"
        )
        app.put("k1", 1, ["site-b"])
        wait_for(lambda: ("log", "k1=1") in queue(sink_b, "site-a"), 15, "the cycles to deliver k1")
    app.close()
