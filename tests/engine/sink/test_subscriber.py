"""RoutingQueueSubscriber end to end: transmit at a source → replicate → deliver at the sink."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source.log_reader import BaseSplit, LogBatch, LogRecord
from airflow_provider_lr.engine.vocabulary import wakeup_payload
from airflow_provider_lr.proto import lr_pb2
from airflow_provider_lr.subscriber import DeliveryStats, MalformedEntryError, RoutingQueueSubscriber
from tests.support.session import App, apply, queue, table_provider
from tests.support.subscriber import (
    Background,
    Flaky,
    Recorder,
    crash_and_restart,
    expected,
    insert_log,
    insert_raw,
    refused_login,
    session_replicator,
    settle,
    started_session,
    subscriber_backends,
    subscriber_dsn,
    wait_until,
)

TWO_SOURCES = [
    {"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]},
    {"source": "site-c", "sinks": ["site-b"], "clients": ["policy"]},
]


class ApplyingListener:
    """An application that applies what it receives to its own sink table in the subscriber's
    delivery transaction, then fails at random (after writing: the write must roll back too)."""

    def __init__(self, sub: RoutingQueueSubscriber, fail_rate: float, seed: int) -> None:
        self.sub, self.fail_rate, self.rng = sub, fail_rate, random.Random(seed)
        self.refused = self.raised = 0

    def _apply(self, source: str, kind: str, payloads: list[bytes]) -> bool:
        with self.sub.cursor() as cur:
            for p in payloads:
                cur.execute(
                    "INSERT INTO applied (source, kind, payload) VALUES (%s, %s, %s)", (source, kind, p.decode())
                )
        roll = self.rng.random()
        if roll < self.fail_rate / 2:
            self.raised += 1
            raise Flaky("crashed after applying")
        if roll < self.fail_rate:
            self.refused += 1
            return False
        return True

    def on_snapshot_sync_start(self, source):
        return self._apply(source, "start", [b""])

    def on_snapshot_messages(self, source, payloads):
        return self._apply(source, "snap", payloads)

    def on_snapshot_sync_complete(self, source):
        return self._apply(source, "end", [b""])

    def on_log_entry_messages(self, source, payloads):
        return self._apply(source, "log", payloads)


def test_exactly_once_in_the_listeners_transaction_while_callbacks_fail_at_random(lr_sites):
    _, sink_site, _ = lr_sites
    app, repl, snapshot = started_session(lr_sites, keys=5)
    conn = sink_site.connect()
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE applied (n bigserial PRIMARY KEY, source text, kind text, payload text)")
    conn.commit()
    conn.close()

    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy", batch_size=7)
    listener = ApplyingListener(sub, fail_rate=0.4, seed=11)
    deltas, delivered = [], 0
    for rnd in range(5):
        for j in range(12):
            app.put(f"k{j % 7}", rnd * 100 + j, ["site-b"])
            deltas.append(f"k{j % 7}={rnd * 100 + j}")
        settle(repl)
        delivered += sub.poll(listener, max_messages=20)
    for _ in range(200):
        if not queue(sink_site, "site-a"):
            break
        delivered += sub.poll(listener)
    want = expected(snapshot, deltas)
    assert sink_site.query("SELECT kind, payload FROM applied ORDER BY n") == want
    assert delivered == len(want) == sub.stats.delivered
    assert listener.refused > 0 and listener.raised > 0, "the random failures must have happened"
    assert sub.stats.failures == listener.raised and sub.stats.refused > 0
    assert any("Flaky: crashed after applying" in e for e in sub.stats.errors)
    sub.close()
    repl.close()
    app.close()


def test_run_finds_a_source_that_appears_mid_run_and_keeps_two_sources_apart(lr_sites):
    site_a, sink_site, site_c = lr_sites
    topo = apply(lr_sites, TWO_SOURCES)
    app_a, app_c = App(site_a), App(site_c)
    app_a.put("a0", 0, ["site-b"])
    repl_a = session_replicator(topo, lr_sites, "site-a", "site-b", providers={"policy": table_provider})
    repl_c = session_replicator(topo, lr_sites, "site-c", "site-b", providers={"policy": table_provider})
    recorder = Recorder(fail_rate=0.25, seed=3)
    # Polling every 60 s: within this test only NOTIFY can bring news after the first passes.
    sub = RoutingQueueSubscriber(
        subscriber_dsn(sink_site), client_name="policy", batch_size=4, poll_interval=60.0, retry_interval=0.05
    )
    running = Background(lambda stop: sub.run(recorder, stop=stop), name="subscriber-run")
    wait_until(lambda: sub.listening, 10, "the subscriber to LISTEN")

    settle(repl_a)
    deltas_a = []
    for i in range(1, 8):
        app_a.put("a", i, ["site-b"])
        deltas_a.append(f"a={i}")
    settle(repl_a)
    want_a = expected({"a0": 0}, deltas_a)
    wait_until(lambda: recorder.of("site-a") == want_a, 20, "site-a's entries")
    assert recorder.of("site-c") == []

    # site-c's session starts only now; the running subscriber finds its queue without a restart.
    app_c.put("c0", 0, ["site-b"])
    settle(repl_c)
    deltas_c = []
    for i in range(1, 6):  # both sources interleaved
        app_a.put("a", 10 + i, ["site-b"])
        deltas_a.append(f"a={10 + i}")
        app_c.put("c", i, ["site-b"])
        deltas_c.append(f"c={i}")
        repl_a.run_cycle()
        repl_c.run_cycle()
    settle(repl_a, repl_c)
    want_a, want_c = expected({"a0": 0}, deltas_a), expected({"c0": 0}, deltas_c)
    wait_until(lambda: recorder.of("site-a") == want_a and recorder.of("site-c") == want_c, 20, "both sources")
    assert recorder.refused + recorder.raised > 0

    started = time.monotonic()
    stats = running.stop(timeout=5)
    assert time.monotonic() - started < 2.0, "run() stops promptly"
    assert isinstance(stats, DeliveryStats) and stats.delivered == len(want_a) + len(want_c)
    assert stats.failures == recorder.raised
    assert not sub.listening and not subscriber_backends(sink_site), "run() closed its connection"
    assert queue(sink_site) == []
    for r in (repl_a, repl_c):
        r.close()
    app_a.close()
    app_c.close()


def test_a_running_subscriber_hears_wake_ups_on_its_one_delivery_connection(lr_sites):
    """``run`` listens on the connection it delivers on: one connection to the sink (it held a
    second, a tap, whose backend was one more process woken for every delivery) and a notified
    entry is delivered at once, long before its poll interval."""
    _, sink_site, _ = lr_sites
    recorder = Recorder()
    sub = RoutingQueueSubscriber(subscriber_dsn(sink_site), client_name="policy", poll_interval=60.0)
    running = Background(lambda stop: sub.run(recorder, stop=stop))
    wait_until(lambda: sub.listening, 10, "the subscriber to LISTEN")
    time.sleep(0.3)  # its first passes done: from here only a wake-up brings news
    for i in range(3):
        insert_log(sink_site, "site-x", f"x={i}")
        sink_site.query("SELECT pg_notify('lr_recv', %s)", (wakeup_payload("policy", "site-x"),))
        wait_until(lambda: len(recorder.of("site-x")) == i + 1, 5, f"entry {i}, notified")
    assert recorder.of("site-x") == [("log", f"x={i}") for i in range(3)]
    assert subscriber_backends(sink_site) == 1, "one connection: its deliveries hear the wake-ups"
    running.stop()
    assert subscriber_backends(sink_site) == 0


def test_polling_fallback_delivers_what_was_never_notified(lr_sites):
    _, sink_site, _ = lr_sites
    recorder = Recorder()
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy", poll_interval=0.3)
    running = Background(lambda stop: sub.run(recorder, stop=stop))
    wait_until(lambda: sub.listening, 10, "the subscriber to LISTEN")
    for i in range(3):  # written without pg_notify: only the periodic full pass can find them
        msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=f"x={i}".encode())
        insert_raw(sink_site, "site-x", lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())
    wait_until(lambda: recorder.of("site-x") == [("log", f"x={i}") for i in range(3)], 10, "the polled entries")
    running.stop()


def test_malformed_entries_are_moved_aside_and_delivery_goes_on(lr_sites):
    _, sink_site, _ = lr_sites
    app, repl, _ = started_session(lr_sites)
    for i in range(3):
        app.put("k", i, ["site-b"])
    settle(repl)
    insert_raw(sink_site, "site-a", lr_pb2.LOG_ENTRY_SYNC, b"\xff\xff\xff")  # not a protobuf message
    good = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"?").SerializeToString()
    insert_raw(sink_site, "site-a", 9, good)  # a kind no ReplicationType has
    for i in range(3, 6):
        app.put("k", i, ["site-b"])
    settle(repl)

    recorder = Recorder()
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy")
    assert sub.poll(recorder) == 2 + 6
    assert recorder.of("site-a") == expected({}, [f"k={i}" for i in range(6)])
    dead = sink_site.query("SELECT kind, error FROM lr.receive_dead_letters ORDER BY seq")
    assert [k for k, _ in dead] == [lr_pb2.LOG_ENTRY_SYNC, 9]
    assert "malformed RoutingTableEntryMsg" in dead[0][1] and "unknown entry kind 9" in dead[1][1]
    assert sub.stats.dead_letters == 2
    assert [type(e) for _, e in recorder.errors] == [MalformedEntryError, MalformedEntryError]
    assert queue(sink_site, visible_only=False) == []
    sub.close()
    repl.close()
    app.close()


def _entry(kind: int, payload: str = "") -> bytes:
    return lr_pb2.RoutingTableEntryMsg(
        destinations=["site-b"], type=kind, opaque_payload=payload.encode()
    ).SerializeToString()


def test_rows_the_replicator_has_not_made_visible_are_never_delivered(lr_sites):
    """A snapshot being transferred (not yet applied) stays invisible; its apply makes it whole."""
    _, sink_site, _ = lr_sites
    conn = sink_site.connect()
    sync = writes.new_sync_id()
    writes.start_snapshot(conn, "site-a", "policy", 1, writes.SyncStart(sync, 5, BaseSplit("5:5:", 5)), "topo-1")
    writes.write_snapshot_messages(
        conn,
        "site-a",
        "policy",
        1,
        sync,
        [
            LogRecord(5, 1, _entry(lr_pb2.SNAPSHOT_SYNC_START)),
            LogRecord(5, 2, _entry(lr_pb2.SNAPSHOT_SYNC, "s=1")),
            LogRecord(5, 3, _entry(lr_pb2.SNAPSHOT_SYNC, "s=2")),
        ],
    )
    recorder = Recorder()
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy")
    assert sub.sources() == ["site-a"], "the queue is registered at the snapshot's first write"
    assert sub.poll(recorder) == 0 and recorder.calls == 0
    writes.write_snapshot_messages(
        conn, "site-a", "policy", 1, sync, [LogRecord(5, 4, _entry(lr_pb2.LAST_FULL_SYNC_ENTRY))]
    )
    assert sub.poll(recorder) == 0 and recorder.calls == 0, "transferred but not applied"
    writes.apply_snapshot(conn, "site-a", "policy", 1)
    batch = LogBatch(
        5,
        7,
        [
            LogRecord(6, 10, _entry(lr_pb2.LOG_ENTRY_SYNC, "d=1")),
            LogRecord(7, 11, _entry(lr_pb2.LOG_ENTRY_SYNC, "d=2")),
        ],
    )
    writes.apply_log_stream(conn, "site-a", "policy", 1, batch, 5)
    assert sub.poll(recorder) == 6
    assert recorder.of("site-a") == [
        ("start", ""),
        ("snap", "s=1"),
        ("snap", "s=2"),
        ("end", ""),
        ("log", "d=1"),
        ("log", "d=2"),
    ]
    conn.close()
    sub.close()


def test_full_sync_stays_ahead_of_deltas_while_its_batches_are_refused(lr_sites):
    _, sink_site, _ = lr_sites
    app, repl, snapshot = started_session(lr_sites, keys=6)
    app.put("k0", 99, ["site-b"])
    settle(repl)

    class RefusesSnapshots(Recorder):
        def on_snapshot_messages(self, source, payloads):
            return False

    stubborn = RefusesSnapshots()
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy", batch_size=4)
    assert sub.poll(stubborn) == 1  # the start marker only: nothing passes the refused batch
    assert sub.poll(stubborn) == 0
    assert stubborn.of("site-a") == [("start", "")] and sub.stats.refused == 8
    recorder = Recorder()
    assert sub.poll(recorder) == 6 + 1 + 1
    assert recorder.of("site-a") == expected(snapshot, ["k0=99"])[1:]
    sub.close()
    repl.close()
    app.close()


def test_one_consumer_per_queue_at_a_time(lr_sites):
    """Two subscribers of one client never interleave a source's entries: while one delivers a
    queue, the other skips it (and reports it busy) instead of reading past it."""
    _, sink_site, _ = lr_sites
    for i in range(4):
        msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=f"x={i}".encode())
        insert_raw(sink_site, "site-x", lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())
    first = RoutingQueueSubscriber(sink_site.dsn, client_name="policy", batch_size=2)
    second = RoutingQueueSubscriber(sink_site.dsn, client_name="policy", batch_size=2)
    inner = Recorder()
    seen_by_second: list[int] = []

    class Nested(Recorder):
        def on_log_entry_messages(self, source, payloads):
            seen_by_second.append(second.poll(inner))
            return super().on_log_entry_messages(source, payloads)

    outer = Nested()
    assert first.poll(outer) == 4
    assert seen_by_second == [0, 0] and inner.calls == 0 and second.stats.busy == 2
    assert outer.of("site-x") == [("log", f"x={i}") for i in range(4)]
    first.close()
    second.close()


def test_subscriber_resolves_connection_ids_and_refuses_an_empty_client(lr_sites, monkeypatch):
    _, sink_site, _ = lr_sites
    monkeypatch.setenv("AIRFLOW_CONN_LR_SINK", json.dumps(sink_site.server.airflow_conn(sink_site.dbname)))
    sub = RoutingQueueSubscriber("lr_sink", client_name="policy")
    assert sub.poll(Recorder()) == 0 and sub.sources() == []
    sub.close()
    with pytest.raises(Exception, match="client_name is required"):
        RoutingQueueSubscriber(sink_site.dsn, client_name="")


def test_a_poll_budget_not_a_whole_number_of_at_least_one_is_refused_before_anything_is_delivered(lr_sites):
    """``poll(max_messages=1.5)`` failed mid-pass (IndexError), ``'5'`` as a TypeError, ``0`` or
    ``-1`` delivered nothing and said nothing, ``True`` delivered one entry; ``run(stop=True)``
    failed with an AttributeError from inside lr."""
    _, sink_site, _ = lr_sites
    for n in range(3):
        msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"x=%d" % n)
        insert_raw(sink_site, "site-x", lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy")
    listener = Recorder()
    for budget in (
        {"max_messages": 1.5},
        {"max_messages": "5"},
        {"max_messages": 0},
        {"max_bytes": -1},
        {"max_messages": True},
    ):
        ((name, value),) = budget.items()
        with pytest.raises(ConfigurationError, match=f"{name} must be a whole number of at least 1, not {value!r}"):
            sub.poll(listener, **budget)
    assert listener.of("site-x") == [] and len(queue(sink_site, "site-x")) == 3
    assert sub.poll(listener, max_messages=2) == 2 and sub.poll(listener, max_bytes=1) == 1
    assert listener.of("site-x") == [("log", "x=0"), ("log", "x=1"), ("log", "x=2")]
    for stop in (True, "stop"):  # an AttributeError ('bool' object has no attribute 'is_set') from inside lr
        with pytest.raises(ConfigurationError, match=f"stop must be a threading.Event .*, not {stop!r}"):
            sub.run(listener, stop=stop)
    sub.close()


def test_listener_may_stop_run_from_its_callback(lr_sites):
    _, sink_site, _ = lr_sites
    msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"x=1")
    insert_raw(sink_site, "site-x", lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())
    stop = threading.Event()

    class StopsAfterOne(Recorder):
        def on_log_entry_messages(self, source, payloads):
            stop.set()
            return super().on_log_entry_messages(source, payloads)

    listener = StopsAfterOne()
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy")
    done = threading.Thread(target=sub.run, args=(listener,), kwargs={"stop": stop}, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive() and listener.of("site-x") == [("log", "x=1")]
    assert queue(sink_site, "site-x") == []


def test_a_listener_that_breaks_the_delivery_transaction_loses_nothing(lr_sites):
    _, sink_site, _ = lr_sites
    msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"x=1")
    insert_raw(sink_site, "site-x", lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy")

    class SwallowsItsError(Recorder):
        def on_log_entry_messages(self, source, payloads):
            try:
                with sub.cursor() as cur:
                    cur.execute("SELECT * FROM no_such_table")
            except Exception:
                pass  # the transaction is aborted now, yet it says "done"
            return True

    assert sub.poll(SwallowsItsError()) == 0
    assert sub.stats.failures == 1 and "delivery transaction failed" in sub.stats.errors[-1]
    recorder = Recorder()
    assert sub.poll(recorder) == 1 and recorder.of("site-x") == [("log", "x=1")]
    with pytest.raises(RuntimeError, match="only available inside a listener callback"):
        _ = sub.connection
    sub.close()


def test_run_against_a_sink_that_is_down_reports_and_stops_cleanly():
    sub = RoutingQueueSubscriber(
        "host=127.0.0.1 port=1 dbname=lr user=postgres connect_timeout=2", client_name="policy", retry_interval=0.05
    )
    running = Background(lambda stop: sub.run(Recorder(), stop=stop))
    wait_until(lambda: sub.run_stats is not None and sub.run_stats.failures >= 2, 10, "failed attempts")
    stats = running.stop(timeout=5)
    assert stats.failures >= 2 and stats.delivered == 0
    assert "cannot connect" in stats.errors[-1] and "port=1" in stats.errors[-1]


def test_a_subscriber_whose_login_is_refused_stops_at_once_with_the_fix(lr_sites):
    """A login the sink refuses cannot heal by retrying: ``run()`` raises a ConfigurationError on
    one line naming what to check, promptly, instead of running on without delivering."""
    from airflow_provider_lr.engine.errors import ConfigurationError

    _, sink_site, _ = lr_sites
    sub = RoutingQueueSubscriber(refused_login(sink_site), client_name="policy", retry_interval=0.05)
    running = Background(lambda stop: sub.run(Recorder(), stop=stop))
    running.thread.join(10)
    assert not running.thread.is_alive(), "run() went on with a refused login"
    assert isinstance(running.error, ConfigurationError)
    message = str(running.error)
    assert "no_such_role" in message and "check the connection's host, database, user, password and options" in message
    assert not sub.listening


def test_a_subscriber_rides_out_a_sink_restart_and_delivers_what_came_meanwhile(lr_sites, site_manager):
    """The sink's server restarts under a running subscriber: its delivery and its LISTEN reconnect
    (a server that is down heals), and what was queued before and after is delivered."""
    _, sink_site, _ = lr_sites
    sink_site.query(f'ALTER DATABASE "{sink_site.dbname}" SET synchronous_commit = on')  # acks survive the crash
    recorder = Recorder()
    sub = RoutingQueueSubscriber(subscriber_dsn(sink_site), client_name="policy", poll_interval=0.3, retry_interval=0.1)
    running = Background(lambda stop: sub.run(recorder, stop=stop))
    insert_log(sink_site, "site-x", "x=0")
    wait_until(lambda: recorder.of("site-x") == [("log", "x=0")], 15, "the first entry")
    crash_and_restart(site_manager, sink_site, lambda: sub.run_stats.failures >= 1)
    insert_log(sink_site, "site-x", "x=1")
    wait_until(lambda: recorder.of("site-x") == [("log", "x=0"), ("log", "x=1")], 30, "delivery after the restart")
    wait_until(lambda: sub.listening and subscriber_backends(sink_site) == 1, 15, "the LISTEN to be back")
    assert running.thread.is_alive()
    running.stop()
