"""Streaming mode (issue 19): sessions in log-entry sync stay in a loop woken by commits, and keep
every correctness property of the cycles: late commits and commit order, exactly once through a
sink restart and a lease handover mid-stream, a forced full sync handed back to negotiation.
(The kill of the streaming process is a row of tests/guarantees/test_crash_windows.py.)"""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from airflow_provider_lr.engine.session.runner import CycleReport
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.session.stream import Streamer
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import (
    App,
    CounterWriters,
    Streaming,
    apply,
    empty_provider,
    final_state,
    queue,
    replicator,
    sink_queue,
    source_state,
    table_provider,
    wait_for,
)

TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
FAST = StreamSettings(check_interval=0.2, ack_interval=0.05)


def streaming_over(topo, sites, options: StreamSettings = FAST, provider=table_provider, **settings) -> Streaming:
    """A replicator of ``topo`` over ``sites`` (short leases) streaming on a thread of this process."""
    return Streaming(replicator(topo, sites, providers={"policy": provider}, lease_seconds=2.0, **settings), options)


def logs(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def test_streaming_delivers_each_commit_at_once_without_renegotiating(lr_sites):
    """Once streaming, an entry reaches both sinks' queues in milliseconds, one commit after the
    other, with no further cycle (no lease, fence or negotiation) and the lease epoch unchanged."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, TWO_SINKS, providers={"policy": "tests.support.session:table_provider"})
    app = App(source)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        cycles, epochs = len(streaming.cycles), source.query("SELECT lease_epoch FROM lr.source_sessions")
        lags = []
        for i in range(40):
            started = time.monotonic()
            app.put(f"k{i}", i, ["site-b", "site-c"])
            wait_for(lambda: len(logs(sink_b)) == i + 1 and len(logs(sink_c)) == i + 1, 10, f"entry {i}")
            lags.append(time.monotonic() - started)
        assert len(streaming.cycles) == cycles, "no cycle ran while the sessions streamed"
        assert source.query("SELECT lease_epoch FROM lr.source_sessions") == epochs
        assert logs(sink_b) == logs(sink_c) == [f"k{i}={i}" for i in range(40)]
        lags.sort()
        assert lags[len(lags) // 2] < 0.25, f"median arrival {lags[len(lags) // 2] * 1000:.0f} ms"
        # the lazy ack catches up with the sinks' positions
        wait_for(
            lambda: sorted(source.query("SELECT acked_position FROM lr.source_sessions"))
            == sorted(s.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0] for s in (sink_b, sink_c)),
            5,
            "acks",
        )
    app.close()


def test_streaming_keeps_commit_order_with_late_commits_gaps_and_an_open_transaction(lr_sites):
    """Six writers increment shared counters (late commits interleave), a transaction holds an xid
    open all along, and some transactions draw a commit position and then roll back (a permanent gap
    in positions, passed by the barrier): each sink gets every entry once, each counter in order."""
    source = lr_sites[0]
    topo = apply(lr_sites, TWO_SINKS)
    idle = source.connect()
    with idle.cursor() as cur:
        cur.execute("SELECT pg_current_xact_id()")  # an open transaction holding an xid, all along
    writers = CounterWriters(source, ["site-b", "site-c"], per_writer=120, rollback_every=40)
    with streaming_over(topo, lr_sites, provider=empty_provider) as streaming:
        streaming.streaming()
        writers.run()
        for sink in lr_sites[1:]:
            wait_for(lambda: len(sink_queue(sink, "policy")) >= writers.total, 60, f"{sink.site_id} complete")
    idle.rollback()
    for sink in lr_sites[1:]:
        writers.check(sink_queue(sink, "policy"), sink.site_id)


def test_sink_restarts_mid_stream_then_every_entry_arrives_once(lr_sites, site_manager):
    """The sink's server stops while entries stream: its stream hands back (the other sink keeps
    streaming), cycles report the sink down and retry, and once it is back every entry arrives
    exactly once, in order."""
    source, sink_b, sink_c = lr_sites
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')  # a durable sink
    topo = apply(lr_sites, TWO_SINKS)
    app = App(source)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        for i in range(50):
            app.put(f"k{i}", i, ["site-b", "site-c"])
        site_manager.down([sink_b.site_id], mode="immediate")
        try:
            for i in range(50, 120):
                app.put(f"k{i}", i, ["site-b", "site-c"])
            wait_for(lambda: len(logs(sink_c)) == 120, 30, "site-c streams on while site-b is down")
            wait_for(
                lambda: any("site-b" in e.session and e.error for e in streaming.streamer.ends),
                30,
                "site-b's stream to hand back",
            )
        finally:
            site_manager.up(site_ids=[sink_b.site_id])
        for i in range(120, 150):
            app.put(f"k{i}", i, ["site-b", "site-c"])
        wait_for(lambda: len(logs(sink_b)) >= 150, 60, "site-b to catch up")
        streaming.streaming()
    for sink in (sink_b, sink_c):
        assert logs(sink) == [f"k{i}={i}" for i in range(150)], sink.site_id
    app.close()


def test_lease_handover_mid_stream_fences_the_old_holder_and_delivers_once(lr_sites):
    """Replicator A streams; its lease runs out (it stopped renewing: a long pause) and B takes the
    session over at a higher epoch. A's next write is refused by the sink's fence, A hands back and
    leaves the session to B; every entry arrives once, in order."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(source)
    slow_renewal = StreamSettings(check_interval=3600, ack_interval=0.05)
    with streaming_over(topo, lr_sites, options=slow_renewal) as a:
        a.streaming()
        for i in range(20):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 20, 10, "A streams")
        source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")
        with streaming_over(topo, lr_sites) as b:
            b.streaming()
            for i in range(20, 60):
                app.put(f"k{i}", i, ["site-b"])
            wait_for(lambda: len(logs(sink_b)) >= 60, 20, "B streams")
            wait_for(
                lambda: any(e.reason.startswith("FencedError") for e in a.streamer.ends), 10, "A's stream to be fenced"
            )
            # A's next cycle (however late a loaded machine runs it) finds B's lease and leaves it the session
            wait_for(lambda: a.cycles[-1].skipped, 10, "A to leave the session to B")
    assert logs(sink_b) == [f"k{i}={i}" for i in range(60)]
    app.close()


@pytest.mark.parametrize("change", ["full_sync", "topology"])
def test_a_full_sync_request_or_a_topology_change_hands_the_stream_back(lr_sites, change, caplog):
    """While streaming, a forced full sync (or a new topology) is seen within ``check_interval``:
    the stream hands back, the cycles negotiate (a snapshot sync for the request) and the session
    streams again; the entries before and after arrive once. The stream left with no session waits
    for the next one: it does not fail (a traceback for every full sync of a lone session)."""
    source, sink_b, _ = lr_sites
    one = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
    topo = apply(lr_sites, one, providers={"policy": "tests.support.session:table_provider"})
    app = App(source)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        for i in range(10):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 10, 10, "streamed")
        if change == "full_sync":
            conn = source.connect()
            full_sync.request_full_sync(conn, "site-b", "policy", "operator asked", forced=True)
            conn.close()
        else:
            apply(
                lr_sites,
                one,
                providers={"policy": "tests.support.session:table_provider"},
                settings={"max_payload_bytes": 4096},
            )
        wait_for(lambda: streaming.streamer.ends, 10, "the stream to hand back")
        end = streaming.streamer.ends[0]
        assert end.session == str(SessionKey("site-a", "site-b", "policy")) and not end.error
        assert ("full sync" if change == "full_sync" else "topology") in end.reason
        for i in range(10, 20):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: final_state(queue(sink_b, "site-a")) == source_state(source), 20, "the sink to catch up")
        streaming.streaming()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    entries = queue(sink_b, "site-a")
    starts = [n for n, (k, _) in enumerate(entries) if k == "start"]
    after_last_start = [p for k, p in entries[starts[-1] :] if k == "log"]
    assert not [p for p, n in Counter(after_last_start).items() if n > 1], "nothing twice"
    if change == "full_sync":
        assert len(starts) == 2, "the forced full sync ran"
        snap = [p for k, p in entries[starts[-1] :] if k == "snap"]
        assert not set(snap) & set(after_last_start), "the base snapshot splits the log: nothing in both"
    else:
        assert len(starts) == 1 and logs(sink_b) == [f"k{i}={i}" for i in range(20)]
    app.close()


@pytest.mark.parametrize("site", ["source", "sink"])
def test_a_site_whose_schema_is_older_than_this_lr_is_not_streamed_the_cycles_carry_it_and_say_why(lr_sites, site):
    """A replicator upgraded before its sites (`lr init` not run yet): a session with such a site is
    not streamed, its stream's start backs off instead of retrying every turn, the cycles deliver
    every entry, and the error says what to do."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    old = source if site == "source" else sink_b
    newest = old.query("SELECT max(version) FROM lr.schema_migrations")[0][0]
    old.query("DELETE FROM lr.schema_migrations WHERE version = %s", (newest,))  # as before its last migration
    app = App(source)
    with streaming_over(topo, lr_sites, FAST) as streaming:
        wait_for(lambda: streaming.streamer.ends, 20, "the stream to refuse the site")
        for i in range(5):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: logs(sink_b) == [f"k{i}={i}" for i in range(5)], 20, "the cycles to deliver")
        time.sleep(1.5)
        ends = list(streaming.streamer.ends)
    assert ends and all("run `lr init`" in e.error and f"version {newest - 1}" in e.error for e in ends), ends
    assert len(ends) <= 3, f"the stream's start backs off: {len(ends)} attempts"
    assert not streaming.streamer.streaming
    app.close()


def test_a_session_refused_at_once_is_retried_within_seconds_and_one_that_made_its_turn_wait_backs_off_further():
    """Through a sink's restart its sessions fail again and again, each refused at once: backed off
    to ``retry_max`` (30 s) they found the sink back up to 30 s late; they back off to
    ``retry_max_quick`` (5 s) now. A turn that waited on a site (a silent one) still backs off to
    ``retry_max``: its retries would hold the other sessions' cycles each time."""
    options = StreamSettings()
    streamer = Streamer(cycles=None, options=options)  # type: ignore[arg-type]  # (no cycle is run)
    refused, silent = SessionKey.parse("site-a->site-b/policy"), SessionKey.parse("site-a->site-c/policy")
    for _ in range(10):  # ten failures in a row: the pause has long reached its bound
        streamer._note(refused, CycleReport(str(refused), error="connection refused"), quick=True)
        streamer._note(silent, CycleReport(str(silent), error="timeout expired"), quick=False)
    now = time.monotonic()
    assert streamer.backoff[refused][1] - now <= options.retry_max_quick
    assert streamer.backoff[silent][1] - now > options.retry_max - 1
