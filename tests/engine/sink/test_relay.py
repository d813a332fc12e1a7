"""The relay: many subscriptions in one process over one LISTEN connection, with demands
that change while data flows, slow members that hold nobody back, and shutdowns that never hang."""

from __future__ import annotations

import random
import threading
import time

import pytest

from airflow_provider_lr.engine.errors import LRError
from airflow_provider_lr.subscriber import open_relay
from tests.support.session import App, apply, empty_provider, queue, replicator, table_provider
from tests.support.subscriber import (
    Background,
    Recorder,
    crash_and_restart,
    expected,
    insert_log,
    listen_sessions,
    refused_login,
    settle,
    wait_until,
)

TWO_SOURCES_TWO_CLIENTS = [
    {"source": "site-a", "sinks": ["site-b"], "clients": ["policy", "inventory"]},
    {"source": "site-c", "sinks": ["site-b"], "clients": ["policy"]},
]
PROVIDERS = {"policy": table_provider, "inventory": empty_provider}


class Scene:
    """site-a (clients policy and inventory) and site-c (policy) replicating to site-b, first
    full syncs done; ``put`` transmits, ``expected`` is what each queue must deliver."""

    def __init__(self, lr_sites) -> None:
        self.site_a, self.sink, self.site_c = lr_sites
        topo = apply(lr_sites, TWO_SOURCES_TWO_CLIENTS)
        self.apps = {
            ("policy", "site-a"): App(self.site_a, "policy"),
            ("inventory", "site-a"): App(self.site_a, "inventory"),
            ("policy", "site-c"): App(self.site_c, "policy"),
        }
        self.apps[("policy", "site-a")].put("a0", 0, ["site-b"])
        self.apps[("policy", "site-c")].put("c0", 0, ["site-b"])
        self.repl = replicator(topo, lr_sites, providers=PROVIDERS)
        settle(self.repl)
        self.snapshots = {("policy", "site-a"): {"a0": 0}, ("inventory", "site-a"): {}, ("policy", "site-c"): {"c0": 0}}
        self.deltas: dict[tuple[str, str], list[str]] = {key: [] for key in self.apps}

    def put(self, client: str, source: str, value: int) -> None:
        key = f"{client[0]}{source[-1]}"
        self.apps[(client, source)].put(key, value, ["site-b"])
        self.deltas[(client, source)].append(f"{key}={value}")

    def expected(self, client: str, source: str):
        return expected(self.snapshots[(client, source)], self.deltas[(client, source)])

    def close(self) -> None:
        self.repl.close()
        for app in self.apps.values():
            app.close()


@pytest.fixture
def scene(lr_sites):
    s = Scene(lr_sites)
    yield s
    s.close()


def test_subscriptions_with_different_demands_share_one_listen_connection(scene):
    relay = open_relay(scene.sink.dsn, poll_interval=60.0, retry_interval=0.05)
    assert listen_sessions(scene.sink) == 0 and not relay.listening, "no tap while nothing is demanded"
    policy_a, policy_c, inventory = Recorder(0.2, seed=1), Recorder(0.2, seed=2), Recorder(0.2, seed=3)
    subs = [
        relay.subscribe(policy_a, "policy", sources=["site-a"]),
        relay.subscribe(policy_c, "policy", sources=["site-c"]),
        relay.subscribe(inventory, "inventory"),
    ]
    wait_until(lambda: listen_sessions(scene.sink) == 1, 10, "the relay's tap")
    for i in range(1, 9):
        scene.put("policy", "site-a", i)
        scene.put("inventory", "site-a", i)
        if i % 2:
            scene.put("policy", "site-c", i)
        scene.repl.run_cycle()
    settle(scene.repl)
    wait_until(
        lambda: policy_a.of("site-a") == scene.expected("policy", "site-a")
        and policy_c.of("site-c") == scene.expected("policy", "site-c")
        and inventory.of("site-a") == scene.expected("inventory", "site-a"),
        20,
        "every demand served",
    )
    assert list(policy_a.events) == ["site-a"] and list(policy_c.events) == ["site-c"]
    assert listen_sessions(scene.sink) == 1, "three subscriptions, one LISTEN connection"
    assert relay.notified[("inventory", "site-a")] >= 1 and relay.notified[("policy", "site-c")] >= 1
    assert all(s.stats.failures + s.stats.refused > 0 for s in subs), "random failures happened"
    assert relay.close(timeout=10)
    assert not any(s.running for s in subs)
    wait_until(lambda: listen_sessions(scene.sink) == 0, 5, "the tap to close")


def test_a_slow_subscription_holds_nobody_back_and_gets_one_wake_up_per_queue(scene):
    gate = threading.Event()
    slow, fast = Recorder(gate=gate), Recorder()
    relay = open_relay(scene.sink.dsn, poll_interval=60.0)
    slow_sub = relay.subscribe(slow, "inventory")
    fast_sub = relay.subscribe(fast, "policy", sources=["site-a"])
    wait_until(lambda: relay.listening, 10, "the tap")
    for i in range(1, 11):
        scene.put("inventory", "site-a", i)
        scene.put("policy", "site-a", i)
        scene.repl.run_cycle()
    settle(scene.repl)
    wait_until(lambda: fast.of("site-a") == scene.expected("policy", "site-a"), 20, "the fast subscription")
    assert slow.count() == 0, "the slow one is still in its first callback"
    assert relay.notified[("inventory", "site-a")] >= 5
    assert slow_sub.wakeups <= 3, "notifications while busy coalesce into one pending wake-up per queue"
    gate.set()
    wait_until(lambda: slow.of("site-a") == scene.expected("inventory", "site-a"), 20, "the slow subscription")
    assert fast_sub.stats.delivered == len(scene.expected("policy", "site-a"))
    assert relay.close(timeout=10)


def test_concurrent_joins_demand_changes_and_leaves_under_load_deliver_everything_once(scene):
    """Writers and the replicator keep going while four threads subscribe, change demands and
    leave over and over; every entry is delivered once, per source in order, and nothing hangs."""
    relay = open_relay(scene.sink.dsn, poll_interval=0.5, retry_interval=0.02, batch_size=3)
    shared = Recorder(fail_rate=0.15, seed=5)  # every subscription hands its entries to one application
    replicating = Background(lambda stop: scene.repl.run(stop=stop, interval=0.02), name="replicator")

    def writer(source: str, count: int) -> None:
        for i in range(1, count + 1):
            scene.put("policy", source, i)
            time.sleep(0.01)

    writers = [threading.Thread(target=writer, args=(s, 60), daemon=True) for s in ("site-a", "site-c")]
    for w in writers:
        w.start()
    churn_errors: list[BaseException] = []
    closes = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        demands = [None, ["site-a"], ["site-c"], ["site-a", "site-c"]]
        try:
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                sub = relay.subscribe(shared, "policy", sources=rng.choice(demands))
                time.sleep(rng.uniform(0, 0.15))
                if rng.random() < 0.5:
                    sub.update(sources=rng.choice(demands))
                    time.sleep(rng.uniform(0, 0.1))
                closes.append(sub.close(timeout=10))
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            churn_errors.append(exc)

    churners = [threading.Thread(target=churn, args=(seed,), daemon=True) for seed in range(4)]
    for t in churners:
        t.start()
    for t in churners + writers:
        t.join(30)
        assert not t.is_alive(), f"{t.name} hung (deadlock?)"
    assert not churn_errors, churn_errors
    assert closes and all(closes), "every close finished in time"
    final = relay.subscribe(shared, "policy")  # drains whatever the churn left
    wait_until(
        lambda: shared.of("site-a") == scene.expected("policy", "site-a")
        and shared.of("site-c") == scene.expected("policy", "site-c"),
        30,
        "every entry, once, in order",
    )
    replicating.stop()
    assert shared.refused + shared.raised > 0
    assert final.running and relay.close(timeout=10)
    assert queue(scene.sink) == []
    wait_until(lambda: listen_sessions(scene.sink) == 0, 5, "the tap to close")


def test_closing_from_inside_callbacks_never_deadlocks(scene):
    relay = open_relay(scene.sink.dsn, poll_interval=60.0)
    closed_itself: list[bool] = []

    class ClosesItself(Recorder):
        def on_log_entry_messages(self, source, payloads):
            closed_itself.append(self.sub.close(timeout=5))
            return super().on_log_entry_messages(source, payloads)

    class ClosesTheRelay(Recorder):
        def on_log_entry_messages(self, source, payloads):
            started = time.monotonic()
            self.closed = relay.close(timeout=1)
            self.took = time.monotonic() - started
            return super().on_log_entry_messages(source, payloads)

    self_closer, relay_closer, bystander = ClosesItself(), ClosesTheRelay(), Recorder(gate=threading.Event())
    self_closer.sub = relay.subscribe(self_closer, "policy", sources=["site-a"])
    wait_until(lambda: relay.listening, 10, "the tap")
    scene.put("policy", "site-a", 1)
    settle(scene.repl)
    wait_until(lambda: not self_closer.sub.running, 10, "the self-closing subscription to end")
    assert closed_itself == [False], "close() from its own callback returns at once"
    assert self_closer.of("site-a")[-1] == ("log", "pa=1"), "the callback in progress still commits"
    others = [relay.subscribe(relay_closer, "policy", sources=["site-c"]), relay.subscribe(bystander, "inventory")]
    scene.put("policy", "site-c", 1)
    scene.put("inventory", "site-a", 1)
    settle(scene.repl)
    # the bystander is stuck in a callback that never returns: close gives up on it after its timeout
    wait_until(lambda: not others[0].running, 15, "the relay-closing subscription to end")
    assert relay_closer.closed is False and relay_closer.took < 3, "close gave up on the blocked one in time"
    assert relay_closer.of("site-c")[-1] == ("log", "pc=1")
    wait_until(lambda: not relay.listening, 5, "the tap to close")
    bystander.gate.set()
    wait_until(lambda: not others[1].running, 10, "the blocked subscription to end once released")
    with pytest.raises(LRError, match="relay is closed"):
        relay.subscribe(Recorder(), "policy")


def test_a_subscription_whose_login_is_refused_ends_with_the_error_on_one_line(lr_sites, caplog):
    """A subscription whose own connection is refused ends at once with the ConfigurationError
    (``join`` raises it), logged on one line without a traceback; the relay goes on for others."""
    from airflow_provider_lr.engine.db.conninfo import from_dsn
    from airflow_provider_lr.engine.errors import ConfigurationError

    _, sink, _ = lr_sites
    relay = open_relay(sink.dsn)
    refused = relay.subscribe(Recorder(), "policy", connect=refused_login(sink).connect)
    with pytest.raises(ConfigurationError, match="no_such_role.*check the connection"):
        refused.join(10)
    assert not refused.running and refused not in relay.subscriptions
    stopped = [r for r in caplog.records if "stopped" in r.getMessage() and r.name.startswith("airflow_provider_lr")]
    assert stopped and all(r.exc_info is None and "\n" not in r.getMessage() for r in stopped)
    recorder = Recorder()
    relay.subscribe(recorder, "policy", connect=from_dsn(sink.dsn).connect)  # the relay itself is fine
    insert_log(sink, "site-x", "x=1")
    wait_until(lambda: recorder.of("site-x") == [("log", "x=1")], 15, "delivery to the good subscription")
    assert relay.close()


def test_a_relay_whose_listen_login_is_refused_stops_every_subscription_with_the_error(lr_sites):
    """The relay's tap (its one LISTEN connection) is refused: the relay ends with the
    ConfigurationError (``join`` raises it), every subscription ends with it rather than running
    on without wake-ups, and a new subscription is refused naming it."""
    from airflow_provider_lr.engine.db.conninfo import from_dsn
    from airflow_provider_lr.engine.errors import ConfigurationError
    from airflow_provider_lr.engine.sink.relay import Relay

    _, sink, _ = lr_sites
    relay = Relay(refused_login(sink).connect)
    sub = relay.subscribe(Recorder(), "policy", connect=from_dsn(sink.dsn).connect)
    with pytest.raises(ConfigurationError, match="no_such_role"):
        relay.join(10)
    with pytest.raises(ConfigurationError, match="no_such_role"):
        sub.join(10)
    assert not sub.running and relay.subscriptions == []
    with pytest.raises(LRError, match="the relay stopped: .*no_such_role"):
        relay.subscribe(Recorder(), "policy")
    relay.close()


def test_a_relay_rides_out_a_sink_restart_and_delivers_what_came_meanwhile(lr_sites, site_manager):
    """The sink's server restarts under a relay: its tap reopens its LISTEN and the subscription's
    follow loop reconnects (a server that is down heals); nothing ends, delivery resumes."""
    _, sink, _ = lr_sites
    sink.query(f'ALTER DATABASE "{sink.dbname}" SET synchronous_commit = on')  # acks survive the crash
    relay = open_relay(sink.dsn, poll_interval=0.3, retry_interval=0.1)
    recorder = Recorder()
    sub = relay.subscribe(recorder, "policy")
    insert_log(sink, "site-x", "x=0")
    wait_until(lambda: recorder.of("site-x") == [("log", "x=0")], 15, "the first entry")
    crash_and_restart(site_manager, sink, lambda: sub.stats.failures >= 1)
    insert_log(sink, "site-x", "x=1")
    wait_until(lambda: recorder.of("site-x") == [("log", "x=0"), ("log", "x=1")], 30, "delivery after the restart")
    wait_until(lambda: relay.listening and listen_sessions(sink) == 1, 15, "the tap to LISTEN again")
    assert sub.running and sub.error is None and relay.error is None
    assert relay.close()


def test_a_subscription_short_of_a_connection_slot_says_so_once_retries_and_delivers_once_one_frees(lr_sites, caplog):
    """Many subscriptions on one sink (one connection each) can fill its connection slots; one left
    without a slot retried every retry_interval and logged the same warning each time (twice a second
    per subscription). Now: said once (naming the full server), retried, and said when it is back.
    The slot is refused by a role's CONNECTION LIMIT (the same refusal as max_connections', which a
    test cannot fill on a shared server); a slot frees: the subscription connects as the sink's owner."""
    import os

    import psycopg2.extensions

    from airflow_provider_lr.engine.db.conninfo import from_dsn

    _, sink, _ = lr_sites
    role = f"lr_no_slot_{os.getpid()}"
    sink.query(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 0')
    full, owner = from_dsn(psycopg2.extensions.make_dsn(sink.dsn, user=role)), from_dsn(sink.dsn)
    freed = threading.Event()
    relay = open_relay(sink.dsn, poll_interval=0.3, retry_interval=0.05)
    try:
        recorder = Recorder()
        sub = relay.subscribe(recorder, "policy", connect=lambda: (owner if freed.is_set() else full).connect())
        wait_until(lambda: sub.stats.failures >= 10, 15, "ten refused connects")
        lost = [r.getMessage() for r in caplog.records if "sink connection lost" in r.getMessage()]
        assert len(lost) == 1 and "connections are all taken" in lost[0], lost
        freed.set()
        insert_log(sink, "site-x", "x=1")
        wait_until(lambda: recorder.of("site-x") == [("log", "x=1")], 15, "delivery once a slot is free")
        wait_until(lambda: any("sink connection back" in r.getMessage() for r in caplog.records), 15, "said back")
    finally:
        relay.close()
        sink.query(f'DROP ROLE "{role}"')
