"""Helpers for subscriber and relay scenarios: listeners that record what they acknowledge (and fail
at random), the sequence a source's transmits must arrive as, and waiting with a deadline."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.conninfo import ConnInfo
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.proto import lr_pb2
from tests.support.session import App, apply, replicator, source_state, table_provider

Event = tuple[str, str]  # (kind, payload): kind in start / snap / end / log


class Flaky(RuntimeError):
    """What a randomly failing listener raises."""


class Recorder:
    """A listener that records, per source, each entry it acknowledged, in delivery order.

    ``fail_rate``: the share of callbacks that fail, half by returning False, half by raising;
    ``delay``: seconds each callback takes; ``gate``: an event every callback waits for."""

    def __init__(
        self, fail_rate: float = 0.0, seed: int = 0, delay: float = 0.0, gate: threading.Event | None = None
    ) -> None:
        self.fail_rate, self.delay, self.gate = fail_rate, delay, gate
        self.rng = random.Random(seed)
        self.events: dict[str, list[Event]] = {}
        self.lock = threading.Lock()
        self.refused = self.raised = self.calls = 0
        self.errors: list[tuple[str, Exception]] = []

    def _accept(self, source: str, items: list[Event]) -> bool:
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.calls += 1
            roll = self.rng.random()
            if roll < self.fail_rate / 2:
                self.raised += 1
                raise Flaky(f"listener failed on {len(items)} entries of {source}")
            if roll < self.fail_rate:
                self.refused += 1
                return False
            self.events.setdefault(source, []).extend(items)
            return True

    def on_snapshot_sync_start(self, source: str) -> bool:
        return self._accept(source, [("start", "")])

    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool:
        return self._accept(source, [("snap", p.decode()) for p in payloads])

    def on_snapshot_sync_complete(self, source: str) -> bool:
        return self._accept(source, [("end", "")])

    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool:
        return self._accept(source, [("log", p.decode()) for p in payloads])

    def on_error(self, source: str, error: Exception) -> None:
        with self.lock:
            self.errors.append((source, error))

    def of(self, source: str) -> list[Event]:
        with self.lock:
            return list(self.events.get(source, []))

    def count(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.events.values())


def expected(snapshot: dict[str, int] | None, deltas: list[str]) -> list[Event]:
    """What one source's queue must deliver: the full sync of ``snapshot`` (table_provider sends it
    ordered by key), then each delta in transmit order."""
    out: list[Event] = []
    if snapshot is not None:
        out = [("start", "")] + [("snap", f"{k}={v}") for k, v in sorted(snapshot.items())] + [("end", "")]
    return out + [("log", d) for d in deltas]


def wait_until(check: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def session_replicator(topo, sites, source: str, sink: str, client: str = "policy", **kwargs):
    """A Replicator for the one session (source → sink, client) only."""
    return replicator(topo, sites, sessions=[SessionKey(source, sink, client)], **kwargs)


class Background:
    """Run a callable on a thread until stopped; re-raises its error on ``stop``."""

    def __init__(self, target: Callable[[threading.Event], object], name: str = "background") -> None:
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.result: object = None
        self.thread = threading.Thread(target=self._main, args=(target,), name=name, daemon=True)
        self.thread.start()

    def _main(self, target: Callable[[threading.Event], object]) -> None:
        try:
            self.result = target(self.stop_event)
        except BaseException as exc:
            self.error = exc

    def stop(self, timeout: float = 15.0) -> object:
        self.stop_event.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.thread.name} did not stop within {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


SUBSCRIBER_APP = "lr-test-subscriber"  # the application_name of the subscribers made by subscriber_dsn


def subscriber_dsn(site) -> str:
    """``site``'s DSN for a subscriber whose backends ``subscriber_backends`` counts."""
    return f"{site.dsn} application_name={SUBSCRIBER_APP}"


def subscriber_backends(site) -> int:
    """Backends on ``site``'s database of subscribers made with ``subscriber_dsn``."""
    return site.query("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (SUBSCRIBER_APP,))[0][0]


def listen_sessions(site) -> int:
    """Backends on ``site``'s database whose last statement was LISTEN lr_recv (open taps)."""
    return site.query(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'LISTEN lr_recv'"
    )[0][0]


def insert_raw(
    site, source: str, kind: int, message: bytes, client: str = "policy", register: bool = True, entry_count: int = 1
) -> None:
    """Put a row straight into a receive queue (visible), as a damaged or foreign writer would."""
    conn = site.connect()
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, source_entry_id, "
            "visible, entry_count, message) VALUES (%s, %s, %s, 0, 0, true, %s, %s)",
            (source, client, kind, entry_count, psycopg2.Binary(message)),
        )
        if register:
            cur.execute(
                "INSERT INTO lr.registry (stream_name, kind, source_site_id, client_name) "
                "VALUES (%s, 'receive_queue', %s, %s) ON CONFLICT DO NOTHING",
                (f"LRQ_Recv_{client}_{source}", source, client),
            )
    conn.commit()
    conn.close()


def settle(*repls) -> None:
    """Run each replicator until it has nothing left to move."""
    for repl in repls:
        repl.run(max_cycles=3, until_idle=True, interval=0.01)


def started_session(lr_sites, keys: int = 0):
    """Session site-a → site-b for client ``policy`` whose first full sync has run, with ``keys``
    rows put before it. Returns (source app, replicator, the snapshot the sink received)."""
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(lr_sites[0])
    for i in range(keys):
        app.put(f"k{i}", i, ["site-b"])
    repl = session_replicator(topo, lr_sites, "site-a", "site-b", providers={"policy": table_provider})
    settle(repl)
    return app, repl, source_state(lr_sites[0])


def insert_log(site, source: str, payload: str) -> None:
    """One log entry straight into ``site``'s receive queue from ``source`` (visible, registered)."""
    msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=payload.encode())
    insert_raw(site, source, lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())


def crash_and_restart(site_manager, site, noticed: Callable[[], bool]) -> None:
    """Stop ``site``'s server as a crash would, wait until ``noticed()``, start it again."""
    site_manager.down([site.site_id], mode="immediate")
    try:
        wait_until(noticed, 15, "the crash to be noticed")
    finally:
        site_manager.up(site_ids=[site.site_id])


def refused_login(site) -> ConnInfo:
    """``site``'s connection with a login its server refuses: a role it does not know, the same
    ``ConfigurationError`` as a wrong password (which these trust-auth test servers never check)."""
    return ConnInfo({**psycopg2.extensions.parse_dsn(site.dsn), "user": "no_such_role"})
