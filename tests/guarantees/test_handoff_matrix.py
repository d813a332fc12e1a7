"""The cells of the hand-off matrix (docs/crash-windows.md, "The hand-off matrix") that had no test:
one mover of data meeting one event. Each scenario runs on real servers, with the event injected at
a real fault point (``engine/faults.on_fault``: the callback runs right there, in the mover's own
thread), and ends with the same four checks: every sink replays to the source's state, no log-entry
payload is in a sink's receive queue twice (across full syncs too: every payload here is unique),
nothing is lost, and no full-sync request is left open.

(The stream × full sync and back-to-back requests cells are ``test_handoffs.py``; the stream ×
sink restart, lease takeover and topology change cells are ``test_streaming.py``.)"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import psycopg2
import psycopg2.errors
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.errors import SiteUnreachableError, TransmitError
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.site import failover
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from tests.support.session import (
    App,
    Streaming,
    apply,
    final_state,
    queue,
    replicator,
    source_state,
    table_provider,
    wait_for,
)
from tests.support.spark_env import lr_connections  # noqa: F401 (fixture: the tee resolves the sites by id)
from tests.support.tables import TableWriter, create_accounts, federate, rows

PROVIDERS = {"policy": "tests.support.session:table_provider"}
ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
B, C = "site-a->site-b/policy", "site-a->site-c/policy"


# --- what every scenario checks ----------------------------------------------------------------
def logs(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def starts(sink) -> int:
    return sum(1 for k, _ in queue(sink, "site-a") if k == "start")


def open_requests(source) -> int:
    return source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')")[0][0]


def assert_handed_off(source, sinks, tables: bool = False) -> None:
    """Every sink replays to the source; no log-entry payload twice in its queue (before and after a
    full sync alike); no request left open; with ``tables``, the federated table row for row."""
    for sink in sinks:
        assert final_state(queue(sink, "site-a")) == source_state(source), f"{sink.site_id} differs from the source"
        twice = sorted(p for p, n in Counter(logs(sink)).items() if n > 1)
        assert twice == [], f"{sink.site_id}: log entries delivered twice: {twice[:5]}"
        if tables:
            assert rows(sink) == rows(source), f"{sink.site_id}: the federated table differs"
    assert open_requests(source) == 0, source.query("SELECT status, note FROM lr.full_sync_requests")


# --- events ------------------------------------------------------------------------------------
def once(action: Callable[[], None]) -> Callable[[], None]:
    """A fault-point callback that acts the first time only (whoever recovers, inside ``action`` or
    after it, passes the point again); ``hook.fired`` says whether the action is done."""

    def hook() -> None:
        if not hook.started:
            hook.started = True
            action()
            hook.fired = True

    hook.started = hook.fired = False
    return hook


def trim_now(source, kind: str) -> trim.TrimResult | None:
    """A safe trim, or a retention trim keeping nothing, committed on a connection of its own."""
    conn = source.connect()
    try:
        return trim.safe_trim(conn) if kind == "safe" else trim.retention_trim(conn, keep_seconds=0.0)
    finally:
        conn.close()


def request_full_syncs(source, sinks: list[str], supply: bool) -> None:
    """Forced full syncs for ``sinks`` in this order (one after the other: each cancels the open one
    of its session), supplied at once by the client's own serve loop when ``supply``."""
    conn = source.connect()
    try:
        for sink in sinks:
            full_sync.request_full_sync(conn, sink, "policy", "operator asked", forced=True)
        if supply:
            RoutingQueueClient(conn, "policy").serve_full_sync_requests(table_provider)
    finally:
        conn.close()


def newest_forced_base(source) -> int:
    """The base the newest forced full sync was supplied at."""
    return source.query(
        "SELECT base_position FROM lr.full_sync_requests WHERE forced ORDER BY requested_at DESC LIMIT 1"
    )[0][0]


def supplied_again_past(source, first_base: int) -> list[str]:
    """The forced requests' statuses, in order; the one applied was supplied anew, past ``first_base``
    (``SessionRunner._behind_sink``: a request behind the sink goes back to pending, same id)."""
    ((applied_base,),) = source.query(
        "SELECT base_position FROM lr.full_sync_requests WHERE forced AND status = 'applied'"
    )
    assert applied_base > first_base, "the request applied was supplied again, at a base past the sink"
    return [r[0] for r in source.query("SELECT status FROM lr.full_sync_requests WHERE forced ORDER BY requested_at")]


def expire_lease(source, sink: str) -> None:
    """The holder of the session's lease stalls: its lease runs out."""
    source.query(
        "UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second' WHERE sink_site_id = %s", (sink,)
    )


class Takeover:
    """At a fault point (``hook``), the lease of site-b's session runs out under its holder and a
    successor replicator takes the session over: one cycle, whose reports are ``reports``."""

    def __init__(self, topo, lr_sites, **settings) -> None:
        self.source = lr_sites[0]
        self.successor = replicator(
            topo,
            lr_sites,
            owner="successor",
            providers={"policy": table_provider},
            sessions=[k for k in topo.sessions() if k.sink == "site-b"],
            **settings,
        )
        self.reports: list = []
        self.hook = once(self._take_over)

    def _take_over(self) -> None:
        expire_lease(self.source, "site-b")
        self.reports.extend(self.successor.run_cycle())


def seed_rows(app: App, n: int) -> None:
    """n application rows that only a full sync carries (no transmit): a transfer of several chunks."""
    with app.conn.cursor() as cur:
        cur.execute("INSERT INTO app_state SELECT 'row' || i, i FROM generate_series(1, %s) i", (n,))
    app.conn.commit()


# --- the stream ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["safe", "retention"])
def test_a_trim_while_the_session_streams_loses_nothing_and_delivers_nothing_twice(lr_sites, kind):
    """Right after the stream writes a batch, more entries commit and the log is trimmed. A safe trim
    stops at what the sink acknowledged: the stream goes on untouched. A retention trim removes
    entries the stream has not read yet: its next read is refused (TrimmedError, the trim mark read
    in the same snapshot), it hands the session back, and a full sync brings the sink back; the
    entries before the trim are never delivered again as log entries."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app, meanwhile = App(source), App(source)
    options = StreamSettings(check_interval=0.2, ack_interval=0.05)
    trimmed: list = []

    def commit_then_trim() -> None:
        for i in range(11, 16):
            meanwhile.put(f"k{i % 7}", i, ["site-b"])
        trimmed.append(trim_now(source, kind))

    with Streaming(
        replicator(topo, lr_sites, providers={"policy": table_provider}, lease_seconds=5.0), options
    ) as streaming:
        streaming.streaming()
        for i in range(10):
            app.put(f"k{i % 7}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 10, 10, "streamed")
        hook = once(commit_then_trim)
        with on_fault("stream_after_sink_apply", hook):
            app.put("k3", 10, ["site-b"])
            wait_for(lambda: hook.fired, 10, "the stream to write the batch")
        for i in range(16, 30):
            app.put(f"k{i % 7}", i, ["site-b"])
        wait_for(lambda: final_state(queue(sink_b, "site-a")) == source_state(source), 30, "the sink to catch up")
        streaming.streaming()
    assert_handed_off(source, [sink_b])
    sink_at = sink_b.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
    if kind == "safe":
        assert starts(sink_b) == 1 and logs(sink_b) == [f"k{i % 7}={i}" for i in range(30)]
        assert [e.reason for e in streaming.streamer.ends] == ["stopped"], "a safe trim never stops the stream"
    else:
        assert trimmed[0] is not None and trimmed[0].trim_mark > 0
        assert any(e.reason.startswith("TrimmedError") for e in streaming.streamer.ends), streaming.streamer.ends
        assert starts(sink_b) == 2, "the trim past the stream sent the sink to a full sync"
        assert sink_at >= trimmed[0].trim_mark
    app.close()
    meanwhile.close()


def _switchover_scene(lr_sites):
    """site-a streams policy to site-b and site-c; site-b's table for its provider once promoted."""
    topo = apply(lr_sites, TWO_SINKS, providers=PROVIDERS)
    App(lr_sites[1]).close()
    dsns = {s.site_id: s.dsn for s in lr_sites}
    return topo, lambda site: psycopg2.connect(dsns[site])


def test_a_planned_switchover_while_the_sessions_stream_delivers_every_entry_once_to_both_sinks(lr_sites):
    """A writer commits at site-a while both sessions stream; it stops (failover.md: stop the old
    source's writers first) and site-b is promoted at once, the streams still running (a planned
    switchover drains site-a into its sinks meanwhile). Both sinks end with every entry of site-a
    once, in order, no full sync; a writer that starts now is refused; site-b's entries reach site-c."""
    source, sink_b, sink_c = lr_sites
    topo, connect = _switchover_scene(lr_sites)
    app = App(source)
    options = StreamSettings(check_interval=0.2, ack_interval=0.05)
    with Streaming(replicator(topo, lr_sites, providers={"policy": table_provider}, lease_seconds=5.0), options) as s:
        s.streaming()
        for i in range(200):
            app.put(f"k{i % 7}", i, ["site-b", "site-c"])
        result = failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
        assert result.planned and result.full_syncs == [], result.outcome
        late = source.connect()
        with pytest.raises(TransmitError, match="is not replicated from site 'site-a' any more"):
            RoutingQueueClient(late, "policy").transmit_log_entry_message(b"late", ["site-b"])
        late.close()
    assert logs(sink_b) == logs(sink_c) == [f"k{i % 7}={i}" for i in range(200)]
    assert starts(sink_b) == starts(sink_c) == 1
    App(sink_b).put("b0", 0, ["site-c", "site-a"])
    after = replicator(
        result.topology,
        lr_sites,
        providers={"policy": table_provider},
        sessions=[k for k in result.topology.sessions() if k.sink == "site-c"],
    )
    try:
        after.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        after.close()
    assert [p for k, p in queue(sink_c, "site-b") if k == "log"] == ["b0=0"]
    app.close()


def test_an_entry_committed_after_a_switchovers_barrier_is_not_streamed_to_the_promoted_site(lr_sites, monkeypatch):
    """Deterministic: the barrier is taken, then the writer (routes cached) tries to commit one more
    entry, which site-b's stream would deliver before the drain fences site-b. The old source refuses
    it (the client is replicated from site-b now: its writers' guard is set before the barrier), and
    the switchover leaves site-b level with site-c, replicating nothing committed after the switch."""
    source, sink_b, sink_c = lr_sites
    topo, connect = _switchover_scene(lr_sites)
    app = App(source)
    for i in range(10):
        app.put(f"k{i % 7}", i, ["site-b", "site-c"])
    catch_up = replicator(topo, lr_sites, providers={"policy": table_provider})
    catch_up.run(max_cycles=5, until_idle=True, interval=0.01)
    catch_up.close()
    barrier = failover.commit_barrier

    refused: list[str] = []

    def barrier_then_a_late_commit(conn, timeout):
        taken = barrier(conn, timeout)
        try:
            app.put("k3", 10, ["site-b", "site-c"])  # this client loaded its routes before the switch
        except psycopg2.errors.ReadOnlySqlTransaction as exc:
            app.conn.rollback()
            refused.append(str(exc))
        deadline = time.monotonic() + 1  # site-b's stream would deliver it unless site-b is fenced already
        while "k3=10" not in logs(sink_b) and time.monotonic() < deadline:
            time.sleep(0.01)
        return taken

    monkeypatch.setattr(failover, "commit_barrier", barrier_then_a_late_commit)
    options = StreamSettings(check_interval=3600, ack_interval=0.05)  # the stream does not look around
    only_b = replicator(
        topo,
        lr_sites,
        providers={"policy": table_provider},
        lease_seconds=5.0,
        sessions=[k for k in topo.sessions() if k.sink == "site-b"],
    )
    with Streaming(only_b, options) as streaming:
        streaming.streaming()
        result = failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
    assert refused and "replicated from site site-b now" in refused[0], refused
    assert result.full_syncs == [], result.outcome  # both sinks cut at the same place: nothing to repair
    assert queue(sink_b, "site-a") == queue(sink_c, "site-a")
    assert "k3=10" not in [p for _, p in queue(sink_b, "site-a")], "tried after the switch: never replicated"
    app.close()


def test_the_source_lost_while_its_sessions_stream_then_failed_over_leaves_both_sinks_with_the_same_entries_once(
    lr_sites, site_manager
):
    """A writer commits at site-a and both sessions stream when site-a's server stops (immediate):
    the streams end, and site-b is promoted without site-a (an unplanned failover, same
    destinations). site-c is cut at site-b's position of site-a's stream (extras removed or the gap
    copied): both hold the same gap-free prefix of site-a's entries, each once."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, TWO_SINKS, providers=PROVIDERS)
    App(source).close()
    App(sink_b).close()
    dsns = {s.site_id: s.dsn for s in lr_sites}

    def connect(site: str):
        if site == "site-a":
            raise SiteUnreachableError("site 'site-a' is down (test)")
        return psycopg2.connect(dsns[site])

    stop, written = threading.Event(), []

    def write() -> None:
        app = App(source)
        try:
            while not stop.is_set():
                n = len(written)
                app.put(f"k{n % 7}", n, ["site-b", "site-c"])
                written.append(n)
        except psycopg2.Error:  # site-a went away
            pass
        finally:
            app.close()

    writer = threading.Thread(target=write)
    options = StreamSettings(check_interval=0.2, ack_interval=0.05)
    try:
        with Streaming(
            replicator(topo, lr_sites, providers={"policy": table_provider}, lease_seconds=5.0), options
        ) as streaming:
            streaming.streaming()
            writer.start()
            wait_for(lambda: len(logs(sink_b)) >= 50 and len(logs(sink_c)) >= 50, 30, "entries streamed")
            site_manager.down([source.site_id], mode="immediate")
            stop.set()
            writer.join(30)
            wait_for(lambda: len(streaming.streamer.ends) >= 2, 30, "both streams to end")
        result = failover.promote(
            failover.FailoverRequest("site-a", "site-b", same_destinations=True, reason="site-a lost"), connect
        )
        assert not result.planned and result.pending == ["site-a"]
        got = logs(sink_b)
        assert got == logs(sink_c) == [f"k{i % 7}={i}" for i in range(len(got))] and len(got) >= 50
    finally:
        site_manager.up(site_ids=[source.site_id])


# --- the in-process tee --------------------------------------------------------------------------
def backlog_to_both_sinks(lr_sites, n: int = 300):
    """Both sessions of TWO_SINKS through first contact, then ``n`` transactions to both sinks (a
    backlog of 2n deliveries, for the tee and the staged fan-out alike)."""
    topo = apply(lr_sites, TWO_SINKS, providers=PROVIDERS)
    app = App(lr_sites[0])
    first = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=0)
    first.run(max_cycles=3, until_idle=True, interval=0.01)
    first.close()
    for i in range(n):
        app.put(f"k{i % 7}", i, ["site-b", "site-c"])
    return topo, app


def test_a_full_sync_requested_before_a_tee_leaves_its_session_to_the_cycle_and_tees_the_other(
    lr_sites, lr_connections
):
    """The tee's plan negotiates as a cycle does: the session with a forced full sync pending is left
    out of the tee and gets its full sync from its own cycle; the other session is teed."""
    source, sink_b, sink_c = lr_sites
    topo, app = backlog_to_both_sinks(lr_sites)
    request_full_syncs(source, ["site-b"], supply=False)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=100)
    try:
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert set(repl.teed) == {C}, repl.teed
    assert (starts(sink_b), starts(sink_c)) == (2, 1)
    assert logs(sink_c) == [f"k{i % 7}={i}" for i in range(300)]
    assert_handed_off(source, [sink_b, sink_c])
    app.close()


def test_full_syncs_requested_back_to_back_and_supplied_while_the_tee_writes_deliver_every_entry_once(
    lr_sites, lr_connections, monkeypatch
):
    """While the tee's first chunk is half written into both sinks' open transactions, forced full
    syncs are requested back to back (site-b twice, then site-c) and the client supplies them at
    once. The tee finishes its chunks (its plan's range ends below the supplied bases), then each
    session's cycle applies its newest request; nothing arrives twice."""
    monkeypatch.setattr(fanout, "PARTITION_ENTRIES", 100)  # several chunks
    source, sink_b, sink_c = lr_sites
    topo, app = backlog_to_both_sinks(lr_sites)
    hook = once(lambda: request_full_syncs(source, ["site-b", "site-b", "site-c"], supply=True))
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=100)
    try:
        with on_fault("fanout_mid_write_p0_a0", hook):
            repl.run_cycle()
        assert hook.fired
        for i in range(300, 320):
            app.put(f"k{i % 7}", i, ["site-b", "site-c"])
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert set(repl.teed) == {B, C}
    assert (starts(sink_b), starts(sink_c)) == (2, 2)
    statuses = Counter(r[0] for r in source.query("SELECT status FROM lr.full_sync_requests WHERE forced"))
    assert statuses == {"applied": 2, "cancelled": 1}, statuses
    assert_handed_off(source, [sink_b, sink_c])
    app.close()


def test_a_session_taken_over_in_the_middle_of_a_tee_is_fenced_there_and_delivered_once_by_its_new_holder(
    lr_sites, lr_connections, monkeypatch
):
    """After the tee's first chunk commits, its lease on site-b's session runs out and another
    replicator takes the session over and catches it up by its cycles. The tee's later chunks are
    refused at site-b (the epoch), site-c's go on, and site-b gets every entry once."""
    monkeypatch.setattr(fanout, "PARTITION_ENTRIES", 100)
    source, sink_b, sink_c = lr_sites
    topo, app = backlog_to_both_sinks(lr_sites)
    takeover = Takeover(topo, lr_sites, tee_min_backlog=0)
    repl = replicator(topo, lr_sites, owner="teeing", providers={"policy": table_provider}, tee_min_backlog=100)
    try:
        with on_fault("fanout_after_commit_p0_a0", takeover.hook):
            (report_b, _) = repl.run_cycle()
        (took,) = takeover.reports
        assert not took.skipped and not took.error, took
        assert 0 < took.delivered < 300, "the tee had delivered the first chunk, the successor the rest"
        assert report_b.skipped, "the session stays with its new holder"
        assert B not in repl.teed and repl.teed[C] == 300
        takeover.successor.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        takeover.successor.close()
        repl.close()
    assert logs(sink_b) == logs(sink_c) == [f"k{i % 7}={i}" for i in range(300)]
    assert_handed_off(source, [sink_b, sink_c])
    app.close()


def test_a_planned_switchover_between_two_chunks_of_a_tee_leaves_both_sinks_with_the_same_entries_once(
    lr_sites, lr_connections, monkeypatch
):
    """site-b is promoted (a planned switchover: site-a drained into both sinks) right after the
    tee's first chunk committed. The tee's later chunks are refused at both sinks (their sessions
    from site-a are failed over), and both sinks end with every entry of site-a once, in order."""
    monkeypatch.setattr(fanout, "PARTITION_ENTRIES", 100)
    source, sink_b, sink_c = lr_sites
    topo, app = backlog_to_both_sinks(lr_sites)
    App(sink_b).close()  # the new source's table, for its provider
    dsns = {s.site_id: s.dsn for s in lr_sites}
    promoted: list = []
    hook = once(
        lambda: promoted.append(
            failover.promote(
                failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"),
                lambda site: psycopg2.connect(dsns[site]),
            )
        )
    )
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=100)
    try:
        with on_fault("fanout_after_commit_p0_a0", hook):
            reports = repl.run_cycle()
    finally:
        repl.close()
    assert hook.fired and promoted[0].planned
    assert not set(repl.teed) & {B, C}, "no session counted as teed past the failover"
    assert all(r.error or r.skipped for r in reports), reports
    expected = [f"k{i % 7}={i}" for i in range(300)]
    assert logs(sink_b) == logs(sink_c) == expected
    assert starts(sink_b) == starts(sink_c) == 1
    app.close()


def test_a_topology_applied_between_two_chunks_of_a_tee_is_negotiated_by_the_next_cycles(
    lr_sites, lr_connections, monkeypatch
):
    """A new topology (a setting changed) is applied to every site after the tee's first chunk: the
    tee's later chunks go on (the entries were tagged for these sinks when written), the cycles
    that follow negotiate the new topology; no full sync is needed and every entry arrives once."""
    monkeypatch.setattr(fanout, "PARTITION_ENTRIES", 100)
    source, sink_b, sink_c = lr_sites
    topo, app = backlog_to_both_sinks(lr_sites)
    hook = once(lambda: apply(lr_sites, TWO_SINKS, providers=PROVIDERS, settings={"max_payload_bytes": 4096}))
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=100)
    try:
        with on_fault("fanout_after_commit_p0_a0", hook):
            repl.run_cycle()
        assert hook.fired and repl.teed == {B: 300, C: 300}
        for i in range(300, 320):
            app.put(f"k{i % 7}", i, ["site-b", "site-c"])
        reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    new_id = source.query("SELECT topology_config_id FROM lr.topology")[0][0]
    for sink in (sink_b, sink_c):
        assert sink.query("SELECT topology_config_id FROM lr.topology") == [(new_id,)]
        assert starts(sink) == 1 and logs(sink) == [f"k{i % 7}={i}" for i in range(320)]
    assert_handed_off(source, [sink_b, sink_c])
    app.close()


@pytest.mark.parametrize("mover", ["cycles", "tee"])
def test_a_sink_restarted_between_two_batches_of_a_catch_up_gets_every_entry_once(
    lr_sites, lr_connections, site_manager, monkeypatch, mover
):
    """site-b's server stops (immediate) and starts again in the middle of a catch-up: right after a
    session cycle's batch committed there, or while the tee's first chunk is half written into its
    open transaction. The mover's write to it fails, site-c's go on, and the next cycles reconnect
    and resume from site-b's own position."""
    monkeypatch.setattr(fanout, "PARTITION_ENTRIES", 100)
    source, sink_b, sink_c = lr_sites
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')  # a durable sink
    topo, app = backlog_to_both_sinks(lr_sites)

    def restart() -> None:
        site_manager.down([sink_b.site_id], mode="immediate")
        site_manager.up(site_ids=[sink_b.site_id])

    hook = once(restart)
    settings = {"tee_min_backlog": 100} if mover == "tee" else {"tee_min_backlog": 0, "max_entries": 50}
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, **settings)
    try:
        with on_fault("fanout_mid_write_p0_a0" if mover == "tee" else "after_sink_apply", hook):
            first = repl.run_cycle()
        assert hook.fired
        if mover == "tee":
            assert B not in repl.teed and repl.teed[C] == 300, repl.teed
        else:
            assert "site-b" in first[0].session and "OperationalError" in first[0].error, first
        reports = repl.run(max_cycles=10, until_idle=True, interval=0.05)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    for sink in (sink_b, sink_c):
        assert starts(sink) == 1 and logs(sink) == [f"k{i % 7}={i}" for i in range(300)], sink.site_id
    assert_handed_off(source, [sink_b, sink_c])
    app.close()


# --- the snapshot transfer in process --------------------------------------------------------------
def test_a_full_sync_taken_over_mid_transfer_is_finished_once_by_the_new_holder(lr_sites):
    """The replicator transferring a full sync of three chunks stalls after the first: its lease runs
    out, a successor fences the sink, resumes the same request after what the sink has and applies
    it. The stalled one's next chunk is refused by the fence; one full set arrives, once."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    seed_rows(app, 12_000)
    takeover = Takeover(topo, lr_sites)
    stalled = replicator(topo, lr_sites, owner="stalled", providers={"policy": table_provider})
    try:
        with on_fault("after_snapshot_chunk", takeover.hook):
            (report,) = stalled.run_cycle()
        assert "FencedError" in report.error, report
        (took,) = takeover.reports
        assert not took.error and took.state == "IN_LOG_ENTRY_SYNC", took
        assert 0 < took.snapshot_messages < 12_002, "resumed after the chunk the stalled one wrote"
        for i in range(20):
            app.put(f"k{i % 7}", i, ["site-b"])
        (again,) = stalled.run_cycle()
        assert again.skipped and not again.delivered
        takeover.successor.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        stalled.close()
        takeover.successor.close()
    entries = queue(sink_b, "site-a")
    snaps = [p for k, p in entries if k == "snap"]
    assert starts(sink_b) == 1 and len(snaps) == len(set(snaps)) == 12_000
    assert logs(sink_b) == [f"k{i % 7}={i}" for i in range(20)]
    assert [r[0] for r in source.query("SELECT status FROM lr.full_sync_requests")] == ["applied"]
    assert_handed_off(source, [sink_b])
    app.close()


@pytest.mark.parametrize("requests", [["site-b"], ["site-b", "site-b"]], ids=["one", "back_to_back"])
def test_a_full_sync_requested_in_the_middle_of_a_transfer_is_applied_after_it_and_nothing_arrives_twice(
    lr_sites, requests
):
    """Between two chunks of a transfer, an operator forces a full sync (or two, back to back) and the
    client supplies it at once. The transfer under way finishes and is applied, and the same cycle's
    log-entry sync then takes the sink past the new request's base: that request is supplied again
    (never applied behind the sink) and applied next; every entry once."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app, meanwhile = App(source), App(source)
    seed_rows(app, 12_000)

    def commit_then_request() -> None:
        for i in range(10):
            meanwhile.put(f"k{i % 7}", i, ["site-b"])
        request_full_syncs(source, requests, supply=True)
        first_base.append(newest_forced_base(source))

    first_base: list[int] = []
    hook = once(commit_then_request)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        with on_fault("after_snapshot_chunk", hook):
            repl.run_cycle()
        assert hook.fired
        for i in range(10, 20):
            app.put(f"k{i % 7}", i, ["site-b"])
        reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    assert supplied_again_past(source, first_base[0]) == ["cancelled"] * (len(requests) - 1) + ["applied"]
    assert starts(sink_b) == 2
    assert_handed_off(source, [sink_b])
    app.close()
    meanwhile.close()


def test_a_topology_applied_in_the_middle_of_a_transfer_lets_it_finish_and_the_next_cycles_negotiate_it(lr_sites):
    """A new topology (a setting changed) is applied to every site between two chunks of a transfer:
    the transfer goes on and is applied, and the next cycles negotiate the new topology without
    another full sync; the sink ends on the new topology with every entry once."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    seed_rows(app, 12_000)
    hook = once(lambda: apply(lr_sites, ONE_SINK, providers=PROVIDERS, settings={"max_payload_bytes": 4096}))
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        with on_fault("after_snapshot_chunk", hook):
            (report,) = repl.run_cycle()
        assert hook.fired and not report.error and report.snapshot_messages == 12_002, report
        for i in range(20):
            app.put(f"k{i % 7}", i, ["site-b"])
        reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    assert sink_b.query("SELECT topology_config_id FROM lr.topology") == source.query(
        "SELECT topology_config_id FROM lr.topology"
    )
    assert starts(sink_b) == 1 and logs(sink_b) == [f"k{i % 7}={i}" for i in range(20)]
    assert_handed_off(source, [sink_b])
    app.close()


@pytest.mark.parametrize("kind", ["safe", "retention"])
def test_a_trim_in_the_middle_of_a_full_sync_transfer_keeps_its_data_and_loses_nothing(lr_sites, kind):
    """Entries commit and the log is trimmed between two chunks of a transfer. Neither trim removes
    the data of a supplied full sync, so the transfer completes and is applied. A safe trim is held
    at its base: log-entry sync goes on from there. A retention trim passed the base: the sink is
    then behind the trim mark and gets a second full sync at once, not a gap."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app, meanwhile = App(source), App(source)
    seed_rows(app, 12_000)
    trimmed: list = []

    def commit_then_trim() -> None:
        for i in range(10):
            meanwhile.put(f"k{i % 7}", i, ["site-b"])
        trimmed.append(trim_now(source, kind))

    hook = once(commit_then_trim)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        with on_fault("after_snapshot_chunk", hook):
            (report,) = repl.run_cycle()
        assert hook.fired and not report.error, report
        for i in range(10, 20):
            app.put(f"k{i % 7}", i, ["site-b"])
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    statuses = [r[0] for r in source.query("SELECT status FROM lr.full_sync_requests ORDER BY requested_at")]
    if kind == "safe":
        assert statuses == ["applied"] and starts(sink_b) == 1
        assert logs(sink_b) == [f"k{i % 7}={i}" for i in range(20)]
    else:
        assert trimmed[0] is not None and trimmed[0].entries_removed >= 10
        assert statuses == ["applied", "applied"], "transferred whole, then a new full sync for the trimmed range"
        assert starts(sink_b) == 2
    assert_handed_off(source, [sink_b])
    app.close()
    meanwhile.close()


def full_sync_of_site_c_supplied(lr_sites, rows_: int):
    """Both sinks past first contact with 20 entries of site-a; then ``rows_`` application rows only
    a full sync carries, and a forced full sync of site-c, supplied: its transfer is several chunks.
    Returns the topology, the writer and ``connect``."""
    source = lr_sites[0]
    topo, connect = _switchover_scene(lr_sites)
    app = App(source)
    first = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        first.run(max_cycles=3, until_idle=True, interval=0.01)
        for i in range(20):
            app.put(f"k{i % 7}", i, ["site-b", "site-c"])
        first.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        first.close()
    seed_rows(app, rows_)
    request_full_syncs(source, ["site-c"], supply=True)
    return topo, app, connect


def promote_site_b_up_to_date(lr_sites, connect, promoted: list) -> None:
    """site-b's application holds site-a's state (it consumed what it replicated); site-b is promoted
    in a planned switchover."""
    source, sink_b, _ = lr_sites
    with sink_b.connect() as conn, conn.cursor() as cur:
        cur.executemany("INSERT INTO app_state (k, v) VALUES (%s, %s)", sorted(source_state(source).items()))
    promoted.append(
        failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
    )


def site_c_follows_site_b(lr_sites, result) -> None:
    """The cycles of the promoted topology bring site-c its full sync from site-b; site-c's queue
    from site-b replays to site-b's state, and nothing of site-a's unapplied sync is left there."""
    source, sink_b, sink_c = lr_sites
    after = replicator(
        result.topology,
        lr_sites,
        providers={"policy": table_provider},
        sessions=[k for k in result.topology.sessions() if k.sink == "site-c"],
    )
    try:
        reports = after.run(max_cycles=5, until_idle=True, interval=0.01)
        App(sink_b).put("b0", 0, ["site-c", "site-a"])
        reports += after.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        after.close()
    assert not any(r.error for r in reports), reports
    from_b = queue(sink_c, "site-b")
    assert [k for k, _ in from_b].count("start") == 1 and [p for k, p in from_b if k == "log"] == ["b0=0"]
    assert final_state(from_b) == source_state(sink_b)
    assert sink_b.query("SELECT status FROM lr.full_sync_requests WHERE sink_site_id = 'site-c'") == [("applied",)]
    assert logs(sink_c) == logs(sink_b) == [f"k{i % 7}={i}" for i in range(20)], "site-a's stream cut at site-b's"
    assert open_requests(source) == open_requests(sink_b) == 0
    left = sink_c.query(
        "SELECT (SELECT count(*) FROM lr.receive_queue WHERE NOT visible), "
        "(SELECT count(*) FROM lr.spark_staging), (SELECT count(*) FROM lr.spark_staged_ranges)"
    )
    assert left == [(0, 0, 0)], "nothing of site-a's unapplied sync left behind, staged or in the queue"


def test_a_planned_switchover_in_the_middle_of_a_full_sync_transfer_gives_the_sink_a_full_sync_from_the_new_source(
    lr_sites,
):
    """site-c's forced full sync is being transferred (several chunks) when site-b, up to date, is
    promoted (planned). site-c had not applied that sync, so it cannot be cut at site-b's position:
    the failover requests a full sync from site-b for it, and the transfer's next chunk is refused
    (the session from site-a is failed over). The promoted topology's cycles bring site-c site-b's
    full sync: site-c ends equal to site-b, site-a's entries once, no request left open."""
    _, _, sink_c = lr_sites
    topo, app, connect = full_sync_of_site_c_supplied(lr_sites, 12_000)
    promoted: list = []
    hook = once(lambda: promote_site_b_up_to_date(lr_sites, connect, promoted))
    repl = replicator(
        topo,
        lr_sites,
        providers={"policy": table_provider},
        sessions=[k for k in topo.sessions() if k.sink == "site-c"],
    )
    try:
        with on_fault("after_snapshot_chunk", hook):
            (report,) = repl.run_cycle()
    finally:
        repl.close()
    assert hook.fired and "FencedError" in report.error and "failed over" in report.error, report
    result = promoted[0]
    assert result.full_syncs == ["site-b->site-c/policy"], result.outcome
    assert "had not applied its full sync" in result.outcome["site-c"]["policy"], result.outcome
    assert starts(sink_c) == 1, "site-a's sync never became visible"
    site_c_follows_site_b(lr_sites, result)
    app.close()


# --- the table snapshot in process -------------------------------------------------------------
def _tables_and_queue(lr_sites):
    """Client policy both transmits (its full sync: ``table_provider``) and federates public.accounts."""
    source = lr_sites[0]
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    create_accounts(source, rows=500)
    federate(source)
    return topo, App(source), App(source)


def test_a_full_sync_supplied_while_a_table_snapshot_is_written_is_applied_once_and_the_table_follows(lr_sites):
    """A forced full sync is requested and supplied by the client while the cycle's table snapshot
    is in the sink's open transaction, with entries committed before and after it; the cycle then
    streams on past its base. The request is supplied again (never applied behind the sink), the
    tables are snapshotted again after it, and nothing is lost or doubled."""
    source, sink_b, _ = lr_sites
    topo, app, meanwhile = _tables_and_queue(lr_sites)
    first_base: list[int] = []

    def request_amid_entries() -> None:
        meanwhile.put("k1", 1, ["site-b"])
        request_full_syncs(source, ["site-b"], supply=True)
        first_base.append(newest_forced_base(source))
        meanwhile.put("k2", 2, ["site-b"])

    hook = once(request_amid_entries)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        with TableWriter(source, truncate=False) as writer:
            with on_fault("table_snapshot_before_commit", hook):
                repl.run(max_cycles=3, interval=0.01)
            for i in range(3, 20):
                app.put(f"k{i % 7}", i, ["site-b"])
            repl.run(max_cycles=5, interval=0.01)
        repl.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert hook.fired and writer.transactions > 0
    assert supplied_again_past(source, first_base[0]) == ["applied"]
    assert_handed_off(source, [sink_b], tables=True)
    app.close()
    meanwhile.close()


def test_a_table_snapshot_whose_lease_is_taken_over_before_it_writes_is_fenced_and_written_once(lr_sites, monkeypatch):
    """The cycle has opened the source's snapshot of the tables its sink lacks when its lease runs out;
    a successor takes the session over and writes the tables. The first one's write is refused at
    the sink (the epoch), so the table is written once, by the successor, at its own split."""
    source, sink_b, _ = lr_sites
    topo, app, _ = _tables_and_queue(lr_sites)
    takeover = Takeover(topo, lr_sites)
    opened = table_snapshot.TableSnapshot.open

    def open_then_stall(self):
        split = opened(self)
        takeover.hook()
        return split

    monkeypatch.setattr(table_snapshot.TableSnapshot, "open", open_then_stall)
    stalled = replicator(topo, lr_sites, owner="stalled", providers={"policy": table_provider})
    try:
        with TableWriter(source, truncate=False):
            (report,) = stalled.run_cycle()
            assert "FencedError" in report.error, report
            (took,) = takeover.reports
            assert not took.error and took.tables == [f"{B}:public.accounts: synced"], took
            for i in range(20):
                app.put(f"k{i % 7}", i, ["site-b"])
            assert stalled.run_cycle()[0].skipped
            takeover.successor.run(max_cycles=3, interval=0.01)
        takeover.successor.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        stalled.close()
        takeover.successor.close()
    assert sink_b.query("SELECT count(*) FROM lr.sink_tables WHERE state = 'synced'") == [(1,)]
    assert logs(sink_b) == [f"k{i % 7}={i}" for i in range(20)]
    assert_handed_off(source, [sink_b], tables=True)
    app.close()


def test_a_retention_trim_while_a_table_snapshot_is_written_sends_the_session_to_a_full_sync_with_its_tables(lr_sites):
    """While the table snapshot is in the sink's open transaction, the table changes, entries commit
    and a retention trim removes them: once the snapshot commits, the session's next read is
    refused (the sink is behind the trim mark), a full sync follows and the tables are taken again;
    the sink ends equal to the source, table and queue, nothing twice."""
    source, sink_b, _ = lr_sites
    topo, app, meanwhile = _tables_and_queue(lr_sites)
    trimmed: list = []

    def change_then_trim() -> None:
        source.query("UPDATE public.accounts SET balance = balance + 1 WHERE id <= 50")
        for i in range(5):
            meanwhile.put(f"k{i % 7}", i, ["site-b"])
        trimmed.append(trim_now(source, "retention"))

    hook = once(change_then_trim)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        with on_fault("table_snapshot_before_commit", hook):
            repl.run(max_cycles=3, interval=0.01)
        assert hook.fired and trimmed[0] is not None and trimmed[0].entries_removed >= 5
        for i in range(5, 20):
            app.put(f"k{i % 7}", i, ["site-b"])
        repl.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert starts(sink_b) == 2, "the trim past the sink sent it to a new full sync"
    assert_handed_off(source, [sink_b], tables=True)
    app.close()
    meanwhile.close()


@pytest.mark.parametrize("event", ["topology", "sink_restart"])
def test_a_topology_change_or_a_sink_restart_while_a_table_snapshot_is_written_leaves_the_table_whole(
    lr_sites, site_manager, event
):
    """While the cycle's table snapshot is in the sink's open transaction, a new topology is applied
    to every site (the snapshot commits, the next cycles negotiate the new topology), or the sink's
    server stops and starts again (the transaction dies with it; the next cycle takes a new
    snapshot). Either way the table ends row for row, the queue with every entry once."""
    source, sink_b, _ = lr_sites
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')  # a durable sink
    topo, app, _ = _tables_and_queue(lr_sites)

    def restart() -> None:
        site_manager.down([sink_b.site_id], mode="immediate")
        site_manager.up(site_ids=[sink_b.site_id])

    hook = once(
        restart
        if event == "sink_restart"
        else lambda: apply(lr_sites, ONE_SINK, providers=PROVIDERS, settings={"max_payload_bytes": 4096})
    )
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        with TableWriter(source, truncate=False):
            with on_fault("table_snapshot_before_commit", hook):
                first = repl.run_cycle()
            for i in range(20):
                app.put(f"k{i % 7}", i, ["site-b"])
            repl.run(max_cycles=3, interval=0.01)
        reports = repl.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert hook.fired
    if event == "sink_restart":
        assert "OperationalError" in first[0].error or "InterfaceError" in first[0].error, first
    else:
        assert not first[0].error and first[0].tables == [f"{B}:public.accounts: synced"], first
    assert not any(r.error for r in reports), reports
    assert sink_b.query("SELECT topology_config_id FROM lr.topology") == source.query(
        "SELECT topology_config_id FROM lr.topology"
    )
    assert starts(sink_b) == 1 and logs(sink_b) == [f"k{i % 7}={i}" for i in range(20)]
    assert_handed_off(source, [sink_b], tables=True)
    app.close()


# --- the nearest-copy seed ---------------------------------------------------------------------------
def test_a_retention_trim_while_a_sink_is_seeded_from_its_peer_sends_it_to_the_sources_snapshot(lr_sites):
    """site-c (a client of tables only) is seeded from site-b, its peer in its region, at site-b's
    position. While the seed is in site-c's open transaction the table changes and a retention trim
    passes that position: once the seed commits, site-c's next read is refused (TrimmedError), no
    peer qualifies any more (behind the trim mark), and the source's snapshot brings it back."""
    from airflow_provider_lr.engine.vocabulary import SessionKey

    source, peer, new = lr_sites
    topo = apply(lr_sites, regions={"site-a": "us-east", "site-b": "eu-west", "site-c": "eu-west"})
    create_accounts(source, rows=500)
    federate(source)
    settings = {"peer_probe_delay": 0.5}
    only_b = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-b", "policy")], **settings)
    only_c = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-c", "policy")], **settings)
    trimmed: list = []

    def change_then_trim() -> None:
        source.query("UPDATE public.accounts SET balance = balance + 1 WHERE id <= 50")
        trimmed.append(trim_now(source, "retention"))

    hook = once(change_then_trim)
    seen: list = []
    try:
        only_b.run(max_cycles=10, until_idle=True, interval=0.01)
        assert rows(peer) == rows(source)
        with on_fault("peer_seed_before_commit", hook):
            only_c.run(max_cycles=10, until_idle=True, interval=0.01, on_cycle=seen.extend)
        only_b.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        only_b.close()
        only_c.close()
    assert hook.fired and trimmed[0] is not None and trimmed[0].entries_removed > 0
    # the seed committed (its fault point is on the way to that commit), then the same cycle's read
    # found the log trimmed past it and renegotiated: to the source, the peer being behind too
    assert "past the sink's position" in seen[0].reason and "passed over site-b" in seen[0].reason, seen[0]
    assert [r[0] for r in source.query("SELECT status FROM lr.full_sync_requests WHERE sink_site_id = 'site-c'")] == [
        "applied"
    ], "the source's snapshot brought site-c back"
    assert rows(new) == rows(peer) == rows(source)
    assert open_requests(source) == 0


# --- the failover reconcile --------------------------------------------------------------------------
def _switchover_with_a_tail(lr_sites, durable: str | None = None):
    """site-a -> site-b, site-c for policy past first contact, 100 entries delivered by the cycles, then 50 more the
    sinks have not got yet (a planned switchover drains them); ``durable``: that sink commits
    synchronously (it is restarted). Returns the topology, the writer and ``connect``."""
    if durable:
        site = next(s for s in lr_sites if s.site_id == durable)
        site.query(f'ALTER DATABASE "{site.dbname}" SET synchronous_commit = on')
    topo, connect = _switchover_scene(lr_sites)
    app = App(lr_sites[0])
    catch_up = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        catch_up.run(max_cycles=3, until_idle=True, interval=0.01)  # first contact
        for i in range(100):
            app.put(f"k{i % 7}", i, ["site-b", "site-c"])
        catch_up.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        catch_up.close()
    for i in range(100, 150):
        app.put(f"k{i % 7}", i, ["site-b", "site-c"])
    return topo, app, connect


def _site_b_reaches_site_c(lr_sites, result) -> None:
    """After the failover, an entry written at the promoted site-b reaches site-c, once."""
    _, sink_b, sink_c = lr_sites
    App(sink_b).put("b0", 0, ["site-c", "site-a"])
    after = replicator(
        result.topology,
        lr_sites,
        providers={"policy": table_provider},
        sessions=[k for k in result.topology.sessions() if k.sink == "site-c"],
    )
    try:
        reports = after.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        after.close()
    assert not any(r.error for r in reports), reports
    assert [p for k, p in queue(sink_c, "site-b") if k == "log"] == ["b0=0"]


def test_a_sink_down_while_a_switchover_reconciles_it_is_reconciled_by_the_rerun_and_gets_every_entry_once(
    lr_sites, site_manager
):
    """A planned switchover to site-b has drained site-a into both sinks, fenced them and promoted
    site-b when site-c's server stops (immediate): its reconcile fails and the failover stops there.
    Once site-c is up the same failover is run again: it resumes from site-b's record, reconciles
    site-c and completes. Both sinks hold site-a's 150 entries once, no full sync, and site-b's own
    entries reach site-c."""
    source, sink_b, sink_c = lr_sites
    topo, app, connect = _switchover_with_a_tail(lr_sites, durable="site-c")

    def stop_site_c() -> None:
        site_manager.down([sink_c.site_id], mode="immediate")

    hook = once(stop_site_c)
    try:
        with on_fault("failover_after_promote", hook), pytest.raises(psycopg2.Error):
            failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
        assert hook.fired
    finally:
        site_manager.up(site_ids=[sink_c.site_id])
    assert sink_c.query(
        "SELECT failed_over_to, failover_note FROM lr.sink_sessions WHERE source_site_id = 'site-a'"
    ) == [("site-b", None)], "fenced, not reconciled"
    result = failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
    assert result.resumed and result.planned and result.full_syncs == [], result.outcome
    assert "nothing moved" in result.outcome["site-c"]["policy"], result.outcome
    assert logs(sink_b) == logs(sink_c) == [f"k{i % 7}={i}" for i in range(150)]
    assert starts(sink_b) == starts(sink_c) == 1
    assert_handed_off(source, [sink_b, sink_c])
    _site_b_reaches_site_c(lr_sites, result)
    app.close()


@pytest.mark.parametrize("kind", ["safe", "retention"])
def test_a_trim_on_the_old_source_while_a_switchover_reconciles_loses_nothing(lr_sites, kind):
    """A planned switchover to site-b has drained site-a into both sinks and fenced them when site-a's
    log is trimmed (a safe trim, or a retention trim keeping nothing). The drain has already taken
    everything up to the barrier, and the reconcile cuts the sinks at site-b's position, which
    reads no log of site-a: the failover completes without a full sync, both sinks hold the 150
    entries once, and site-b's own entries reach site-c."""
    source, sink_b, sink_c = lr_sites
    topo, app, connect = _switchover_with_a_tail(lr_sites)
    trimmed: list = []
    hook = once(lambda: trimmed.append(trim_now(source, kind)))
    with on_fault("failover_after_fence", hook):
        result = failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
    assert hook.fired and result.planned and result.full_syncs == [], result.outcome
    if kind == "retention":
        assert trimmed[0] is not None and trimmed[0].entries_removed >= 150, trimmed
    assert logs(sink_b) == logs(sink_c) == [f"k{i % 7}={i}" for i in range(150)]
    assert starts(sink_b) == starts(sink_c) == 1
    assert_handed_off(source, [sink_b, sink_c])
    _site_b_reaches_site_c(lr_sites, result)
    app.close()


# --- the nearest-copy seed × a failover ---------------------------------------------------------------
def test_a_switchover_while_a_sink_is_seeded_from_its_peer_waits_for_the_seed_and_the_sink_follows_the_peer(lr_sites):
    """site-c (a client of tables only) is being seeded from site-b, its peer, when site-b is promoted
    (planned): the seed's fenced sink transaction holds site-c's session row, so the failover waits
    for it at site-c (the hook returns once it waits). The seed commits at site-b's position; the
    failover drains site-a into site-c from there under a higher epoch (the seeding cycle's next
    write is refused: FencedError) and fences it; the reconcile finds site-c at site-b's position
    (nothing moved), its table following site-b. A change made at site-b then reaches site-c."""
    from airflow_provider_lr.engine.vocabulary import SessionKey

    source, peer, new = lr_sites
    topo = apply(lr_sites, regions={"site-a": "us-east", "site-b": "eu-west", "site-c": "eu-west"})
    create_accounts(source, rows=500)
    federate(source)
    dsns = {s.site_id: s.dsn for s in lr_sites}
    settings = {"peer_probe_delay": 0.5}
    only_b = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-b", "policy")], **settings)
    only_c = replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-c", "policy")], **settings)
    promoted: list = []
    thread = threading.Thread(
        target=lambda: promoted.append(
            failover.promote(
                failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"),
                lambda site: psycopg2.connect(dsns[site]),
            )
        )
    )

    def promote_waiting_on_the_seed() -> None:
        thread.start()
        wait_for(
            lambda: new.query(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%lr.sink_sessions%%'"
            )[0][0]
            == 1,
            30,
            "the failover to wait for the seed at site-c",
        )

    hook = once(promote_waiting_on_the_seed)
    try:
        only_b.run(max_cycles=10, until_idle=True, interval=0.01)
        with on_fault("peer_seed_before_commit", hook):
            (report,) = only_c.run_cycle()
        thread.join(60)
    finally:
        only_b.close()
        only_c.close()
    assert hook.fired and promoted, "the failover completed once the seed committed"
    assert "FencedError" in report.error, report
    result = promoted[0]
    assert result.planned and result.full_syncs == [], result.outcome
    assert "nothing moved" in result.outcome["site-c"]["policy"], result.outcome
    assert rows(new) == rows(peer) == rows(source)
    peer.query("UPDATE public.accounts SET owner = 'site-b' WHERE id <= 10")
    after = replicator(
        result.topology, lr_sites, sessions=[k for k in result.topology.sessions() if k.sink == "site-c"]
    )
    try:
        reports = after.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        after.close()
    assert not any(r.error for r in reports), reports
    assert rows(new) == rows(peer)
    assert new.query("SELECT count(*) FROM public.accounts WHERE owner = 'site-b'") == [(10,)]
    assert open_requests(source) == open_requests(peer) == 0
