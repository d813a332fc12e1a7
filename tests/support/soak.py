"""Helpers of the random-fault soak (``tests/guarantees/test_soak.py``, issue "No silent loss").

The application keeps one counter per (sink, key) on the source, ``soak_counters``; each of its
transactions increments the counters of a key for a random non-empty subset of the sinks and
transmits the payload ``k`` to exactly those sinks, in the same transaction. Its full-sync provider
sends ``k=v`` for every counter of the destination sink. A sink's view is the replay of its receive
queue: a full sync's start resets it, a snapshot entry ``k=v`` sets a key, a log entry ``k`` adds
one. The source table is the truth: after any faults, each sink's replay must equal it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2

from airflow_provider_lr.client import RoutingQueueClient
from tests.support.session import queue, replicator

SOURCE = "site-a"
SINKS = ("site-b", "site-c")
CLIENT = "policy"
PROVIDER = "tests.support.soak:counters_provider"
KEYS = tuple(f"k{i:02d}" for i in range(20))
SUBSETS = (("site-b",), ("site-c",), ("site-b", "site-c"))
REPO_ROOT = Path(__file__).resolve().parents[2]

TABLE_DDL = "CREATE TABLE IF NOT EXISTS soak_counters (sink text, k text, v bigint NOT NULL, PRIMARY KEY (sink, k))"
INCREMENT = (
    "INSERT INTO soak_counters (sink, k, v) VALUES (%s, %s, 1) "
    "ON CONFLICT (sink, k) DO UPDATE SET v = soak_counters.v + 1"
)


# --- the application -------------------------------------------------------------------------
def counters_provider(ctx) -> None:
    """Full-sync provider: ``k=v`` for every counter of the destination sink, as of the supplying
    transaction's snapshot (``ctx.conn``)."""
    with ctx.conn.cursor() as cur:
        cur.execute("SELECT k, v FROM soak_counters WHERE sink = %s ORDER BY k", (ctx.destination,))
        for k, v in cur.fetchall():
            ctx.transmit(f"{k}={v}".encode())


def large_counters_provider(ctx) -> None:
    """``counters_provider`` as a large client's would be: the same ``k=v`` set 200 times over (its
    replay is the same), so a supply takes long enough for requests to be asked meanwhile."""
    with ctx.conn.cursor() as cur:
        cur.execute("SELECT k, v FROM soak_counters WHERE sink = %s ORDER BY k", (ctx.destination,))
        rows = cur.fetchall()
    for _ in range(200):
        for k, v in rows:
            ctx.transmit(f"{k}={v}".encode())


def prepare_sites(sites) -> None:
    """The counters table on the source; every test database made durable across an immediate stop.

    The test servers run with ``synchronous_commit = off`` (conftest.FAST_SETTINGS): an immediate
    stop then loses the last commits, as PostgreSQL documents, which a restart fault would report
    as loss (a sink commit gone) or duplication (a source commit gone after it was shipped) that no
    replication engine could prevent. Production sites commit durably, so the soak's do too."""
    for site in sites:
        site.query(f'ALTER DATABASE "{site.dbname}" SET synchronous_commit = on')
    sites[0].query(TABLE_DDL)


def write_connections_file(path: Path, sites) -> Path:
    """``$LR_CONNECTIONS_FILE`` content naming each site by its id: the in-process tee (and the
    crash runner's) reaches the sites through it."""
    path.write_text(json.dumps({s.site_id: s.server.airflow_conn(s.dbname) for s in sites}))
    path.chmod(0o600)
    return path


@dataclass
class WriterStats:
    committed: int = 0  # transactions whose commit returned
    unknown: int = 0  # commit sent, connection lost before the answer (the source table says)
    failed: int = 0  # rolled back (connection lost before the commit)
    messages: int = 0  # messages of committed transactions
    reconnects: int = 0


class Writer:
    """The application at a steady rate, in a thread; survives its server being restarted."""

    def __init__(
        self,
        site,
        seed: int,
        rate: float = 150.0,
        multi: float = 0.25,
        tag: str = "",
        subsets: tuple[tuple[str, ...], ...] = SUBSETS,
        extra: Callable[[Any, random.Random], None] | None = None,
        client: str = CLIENT,
    ) -> None:
        self.site, self.rate, self.multi, self.subsets, self.extra = site, rate, multi, subsets, extra
        self.client = client
        self.tag = tag  # set: every payload is unique (``k#<tag><n>``), so a log entry delivered twice shows
        self.serial = 0
        self.rng = random.Random(seed)
        self.stats = WriterStats()
        self.errors: list[str] = []  # unexpected (non-connection) errors, for the report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-writer", daemon=True)

    def start(self) -> Writer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the soak writer did not stop"

    def _connect(self):
        conn = psycopg2.connect(self.site.dsn, connect_timeout=3)
        try:
            return conn, RoutingQueueClient(conn, self.client)
        except BaseException:
            conn.close()
            raise

    def _run(self) -> None:
        conn = client = None
        pace = 1.0 / self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            if conn is None:
                try:
                    conn, client = self._connect()
                except psycopg2.Error:
                    self.stats.reconnects += 1
                    self._stop.wait(0.1)
                    continue
            n = 1 if self.rng.random() >= self.multi else self.rng.randint(2, 3)
            work = [(self.rng.choice(KEYS), self.rng.choice(self.subsets)) for _ in range(n)]
            committing = False
            try:
                with conn.cursor() as cur:
                    for k, sinks in work:
                        for s in sinks:
                            cur.execute(INCREMENT, (s, k))
                        self.serial += 1
                        payload = f"{k}#{self.tag}{self.serial}" if self.tag else k
                        client.transmit_log_entry_message(payload.encode(), list(sinks))
                    if self.extra is not None:  # more of the application's work, in the same transaction
                        self.extra(cur, self.rng)
                committing = True
                conn.commit()
                self.stats.committed += 1
                self.stats.messages += n
            except psycopg2.Error as exc:
                if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
                    if committing:
                        self.stats.unknown += 1
                    else:
                        self.stats.failed += 1
                else:  # not a lost server: worth reporting, but the source table stays the truth
                    self.stats.failed += 1
                    self.errors.append(f"{type(exc).__name__}: {exc}".strip()[:300])
                try:
                    conn.close()
                except psycopg2.Error:
                    pass
                conn = client = None
                self.stats.reconnects += 1
                continue
            next_at += pace
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            elif delay < -1.0:
                next_at = time.monotonic()  # fell behind (a restart): do not burst to catch up
        if conn is not None:
            conn.close()


# --- what the sinks hold ---------------------------------------------------------------------
@dataclass
class Replay:
    state: dict[str, int] = field(default_factory=dict)
    log_entries: int = 0
    snapshot_entries: int = 0
    full_syncs: int = 0
    seen: dict[str, int] = field(default_factory=dict)  # log payload -> times in the queue (whole queue)

    @property
    def twice(self) -> list[str]:
        """Unique payloads that reach the queue as a log entry more than once, across full syncs too."""
        return sorted(p for p, n in self.seen.items() if n > 1 and "#" in p)

    @property
    def checked(self) -> int:
        return self.log_entries + self.snapshot_entries


def replay(entries: list[tuple[str, str]]) -> Replay:
    """A sink's view of the counters from its receive queue (visible rows, in sink order)."""
    out = Replay()
    for kind, payload in entries:
        if kind == "start":
            out.state = {}
            out.full_syncs += 1
        elif kind == "snap":
            k, v = payload.split("=")
            out.state[k] = int(v)
            out.snapshot_entries += 1
        elif kind == "log":
            k = payload.split("#", 1)[0]  # a unique payload names its key first
            out.state[k] = out.state.get(k, 0) + 1
            out.log_entries += 1
            out.seen[payload] = out.seen.get(payload, 0) + 1
    return out


def replay_sink(sink) -> Replay:
    return replay(queue(sink, SOURCE, CLIENT))


def source_counters(source, sink_id: str) -> dict[str, int]:
    return dict(source.query("SELECT k, v FROM soak_counters WHERE sink = %s", (sink_id,)))


def compare(truth: dict[str, int], seen: dict[str, int]) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(lost, duplicated, {key: (source, replay)} where they differ)."""
    lost = duplicated = 0
    diffs = {}
    for k in sorted(set(truth) | set(seen)):
        a, b = truth.get(k, 0), seen.get(k, 0)
        if a != b:
            diffs[k] = (a, b)
        lost += max(0, a - b)
        duplicated += max(0, b - a)
    return lost, duplicated, diffs


# --- replicators -----------------------------------------------------------------------------
def expire_leases(source) -> None:
    """A killed replicator's leases run out now (rather than after lease_seconds)."""
    source.query(
        "UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second' WHERE lease_owner IS NOT NULL"
    )


def spawn_runner(
    topo,
    sites,
    owner: str,
    settings: dict,
    cycles: int,
    log_path: Path,
    fault: str | None = None,
    stream: float = 0.0,
    check_interval: float = 0.2,
) -> subprocess.Popen:
    """``tests.support.crash_runner`` in a child process (to be killed from outside); its output goes to
    ``log_path`` (a pipe nobody reads would block it). ``stream``: it streams (``lr sync``'s default
    mode) for that many seconds instead of running ``cycles``."""
    spec = {
        "stream": stream,
        "check_interval": check_interval,
        "topology": topo.document,
        "dsns": {s.site_id: s.dsn for s in sites},
        "providers": {},  # the topology names the provider
        "owner": owner,
        "cycles": cycles,
        "settings": settings,
    }
    env = {k: v for k, v in os.environ.items() if k != "LR_FAULT"}
    if fault:
        env["LR_FAULT"] = fault
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.support.crash_runner", json.dumps(spec)],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill(proc: subprocess.Popen) -> bool:
    """SIGKILL the child if it still runs; True if it was still running."""
    alive = proc.poll() is None
    if alive:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            alive = False
    proc.wait(30)
    return alive


class BackgroundReplicator:
    """An in-process replicator cycling in a thread while a fault is injected around it."""

    def __init__(self, topo, sites, settings: dict, owner: str) -> None:
        self.repl = replicator(topo, sites, owner=owner, **settings)
        self.stop_event = threading.Event()
        self.cycles = 0
        self.errors = 0
        self.crashed: str = ""
        self._thread = threading.Thread(target=self._run, name=f"soak-{owner}", daemon=True)

    def _count(self, reports) -> None:
        self.cycles += 1
        self.errors += sum(1 for r in reports if r.error)

    def _run(self) -> None:
        try:
            self.repl.run(stop=self.stop_event, interval=0.05, on_cycle=self._count)
        except Exception as exc:  # run_cycle must not raise: report it, with where it came from
            import traceback

            frames = traceback.extract_tb(exc.__traceback__)
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
            self.crashed = f"{type(exc).__name__}: {str(exc).strip()} at {where}"

    def __enter__(self) -> BackgroundReplicator:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(60.0)

    def stop(self, timeout: float) -> None:
        self.stop_event.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.crashed = self.crashed or f"did not stop within {timeout:.0f}s"
            return  # leave it (daemon); closing its connections under it would only add noise
        close_quietly(self.repl)


def close_quietly(repl) -> str:
    """Close a replicator; a server that went away meanwhile may make releasing a lease fail."""
    try:
        repl.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def settled(report) -> bool:
    return report.state == "IN_LOG_ENTRY_SYNC" and report.remaining == 0 and not report.error and not report.skipped


def drain(topo, sites, settings: dict, timeout: float = 60.0) -> tuple[bool, list, int]:
    """Clean replicators until every session is in log-entry sync with nothing left to send.
    Returns (settled, last reports, rounds)."""
    deadline = time.monotonic() + timeout
    rounds, reports = 0, []
    while True:
        rounds += 1
        repl = replicator(topo, sites, owner=f"soak-drain-{rounds}", **settings)
        try:
            reports = repl.run(max_cycles=30, until_idle=True, interval=0.05)
        finally:
            close_quietly(repl)
        if reports and all(settled(r) for r in reports):
            return True, reports, rounds
        if time.monotonic() > deadline:
            return False, reports, rounds
        time.sleep(0.2)
