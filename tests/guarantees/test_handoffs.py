"""Hand-offs between the ways lr moves data (issue "Exactly once through every hand-off"): the
stream, the cycles and full syncs meeting on one session. A payload reaches a sink's queue as a log
entry once, whatever is requested while the session streams: a full sync never moves a sink's
position backwards (its base is never behind what the sink already processed)."""

from __future__ import annotations

import threading
from collections import Counter

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import StaleBatchError
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source import full_sync
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

PROVIDERS = {"policy": "tests.support.session:table_provider"}
TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]


def streaming_over(topo, sites, check_interval: float) -> Streaming:
    options = StreamSettings(check_interval=check_interval, ack_interval=0.05)
    return Streaming(replicator(topo, sites, providers={"policy": table_provider}, lease_seconds=5.0), options)


def logs(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def twice(sink) -> list[str]:
    """Log-entry payloads in the sink's queue more than once (each payload here is unique)."""
    return sorted(p for p, n in Counter(logs(sink)).items() if n > 1)


def starts(sink) -> int:
    return sum(1 for k, _ in queue(sink, "site-a") if k == "start")


def test_full_sync_supplied_while_the_session_streams_on_is_never_applied_behind_the_sink(lr_sites):
    """The client supplies a forced full sync at once (its own serve loop), while the stream goes on
    delivering until its next check: the supplied base is then behind the sink. Applying it would
    set the sink back to that base and deliver every entry after it a second time; lr asks for the
    data again instead, at a base the sink has not passed, and no log entry arrives twice."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    with streaming_over(topo, lr_sites, check_interval=3.0) as streaming:
        streaming.streaming()
        for i in range(10):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 10, 10, "streamed")
        conn = source.connect()
        stale = full_sync.request_full_sync(conn, "site-b", "policy", "operator asked", forced=True)
        assert RoutingQueueClient(conn, "policy").serve_full_sync_requests(table_provider) == [stale.request_id]
        first_base = full_sync.get_request(conn, stale.request_id).base_position
        conn.close()
        for i in range(10, 20):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) >= 20, 10, "streamed past the supplied base")
        wait_for(
            lambda: starts(sink_b) == 2 and final_state(queue(sink_b, "site-a")) == source_state(source),
            30,
            "the forced full sync to be applied and the sink to catch up",
        )
    assert twice(sink_b) == [], "no log entry delivered twice"
    outcome = source.query(
        "SELECT status, base_position FROM lr.full_sync_requests WHERE request_id = %s", (stale.request_id,)
    )
    assert outcome[0][0] == "applied" and outcome[0][1] > first_base, "the same request, supplied anew past the sink"
    app.close()


def test_the_sink_refuses_a_full_sync_whose_base_is_behind_its_position(lr_sites):
    """The rule holds at the sink for every mover (cycles, the Spark transfer): SNAPSHOT_START with
    a base below the position the sink has processed is refused, and nothing changes there."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        repl.run_cycle()
        for i in range(5):
            app.put(f"k{i}", i, ["site-b"])
        repl.run_cycle()
    finally:
        repl.close()
    sink = sink_b.connect()
    meta = writes.read_metadata(sink, "site-a", "policy")
    assert meta.last_log_entry_processed > meta.snapshot_applied >= 0
    try:
        writes.start_snapshot(
            sink,
            "site-a",
            "policy",
            meta.lease_epoch,
            writes.SyncStart(writes.new_sync_id(), meta.snapshot_applied, meta.split),
            meta.topology_config_id,
        )
    except StaleBatchError as exc:
        assert "behind" in str(exc)
    else:
        raise AssertionError("a base behind the sink's position was accepted")
    finally:
        sink.close()
    assert writes.read_metadata(sink_b.connect(), "site-a", "policy") == meta
    app.close()


def test_back_to_back_full_syncs_for_both_sinks_while_writers_write_deliver_every_entry_once(lr_sites):
    """The issue's scenario, in process: writers transmit to both sinks while forced full syncs are
    requested back to back (one session's cycle supplies the other session's pending request while
    that one still streams). Every sink ends equal to the source with no log entry twice."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, TWO_SINKS, providers=PROVIDERS)
    stop = threading.Event()
    written = []

    def write() -> None:
        app = App(source)
        i = 0
        while not stop.is_set():
            app.put(f"w{i}", i, ["site-b", "site-c"])
            written.append(i)
            i += 1
            stop.wait(0.002)
        app.close()

    App(source).close()  # the application's table, before the first full sync
    with streaming_over(topo, lr_sites, check_interval=0.5) as streaming:
        streaming.streaming()
        writer = threading.Thread(target=write)
        writer.start()
        try:
            conn = source.connect()
            for sink in ("site-b", "site-b", "site-c", "site-b", "site-c", "site-c"):
                full_sync.request_full_sync(conn, sink, "policy", "back to back", forced=True)
                stop.wait(0.05 if sink == "site-b" else 0.7)
            conn.close()
        finally:
            stop.set()
            writer.join()
        for sink in (sink_b, sink_c):
            wait_for(
                lambda: final_state(queue(sink, "site-a")) == source_state(source), 60, f"{sink.site_id} caught up"
            )
        wait_for(
            lambda: not source.query("SELECT 1 FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')"),
            30,
            "every request closed",
        )
    for sink in (sink_b, sink_c):
        assert twice(sink) == [], f"{sink.site_id}: no log entry delivered twice"
    assert written, "the writers wrote"
