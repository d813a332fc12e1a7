"""Helpers for session scenarios: a topology over test sites, an application that keeps a table
and transmits every change, its full-sync provider, and what a sink's receive queue holds."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg2
import psycopg2.errors

from airflow_provider_lr.client import RoutingQueueClient, Ticket
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.session.stream import Streamer
from airflow_provider_lr.engine.sink.queue_rows import unpack
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.proto import lr_pb2

KIND = {
    lr_pb2.SNAPSHOT_SYNC_START: "start",
    lr_pb2.SNAPSHOT_SYNC: "snap",
    lr_pb2.LAST_FULL_SYNC_ENTRY: "end",
    lr_pb2.LOG_ENTRY_SYNC: "log",
}


def topology_doc(
    sites,
    replication: list[dict] | None = None,
    providers: dict | None = None,
    settings: dict | None = None,
    conn_ids: Callable[[str], str] | None = None,
    regions: dict[str, str] | None = None,
) -> dict:
    """The one topology document tests build: ``sites`` (their regions, or ``regions``; an Airflow
    connection id each with ``conn_ids``), by default the first site replicating client ``policy``
    to the others."""
    doc: dict = {
        "sites": [
            {
                "id": s.site_id,
                "region": (regions or {}).get(s.site_id, s.region),
                **({"conn_id": conn_ids(s.site_id)} if conn_ids else {}),
            }
            for s in sites
        ],
        "replication": replication
        or [{"source": sites[0].site_id, "sinks": [s.site_id for s in sites[1:]], "clients": ["policy"]}],
        "settings": settings or {},
    }
    if providers:
        doc["providers"] = providers
    return doc


def apply(
    sites,
    replication: list[dict] | None = None,
    providers: dict | None = None,
    settings: dict | None = None,
    only=None,
    regions: dict[str, str] | None = None,
) -> topologies.Topology:
    """Apply a topology over ``sites`` (``topology_doc``) to all of them (or to the ``only`` ones)."""
    topo = topologies.from_document(topology_doc(sites, replication, providers, settings, regions=regions))
    apply_to(only or sites, topo)
    return topo


def apply_to(sites, topo: topologies.Topology) -> None:
    for site in sites:
        conn = site.connect()
        topology.apply_to_site(conn, topo, site.site_id)
        conn.close()


def replicator(
    topo, sites, providers: dict | None = None, owner: str | None = None, sessions=None, as_lr: bool = False, **settings
) -> Replicator:
    """A replicator over ``sites``; ``as_lr``: connecting as ``lr sync`` does (``conninfo``: its bounds,
    search_path pg_catalog alone), not by a plain connect."""
    dsns = {s.site_id: s.dsn for s in sites}
    infos = {s.site_id: conninfo.from_dsn(s.dsn) for s in sites}
    options = {"data_timeout": 30.0, "barrier_timeout": 2.0, **settings}
    return Replicator(
        topo,
        (lambda site_id: infos[site_id].connect()) if as_lr else (lambda site_id: psycopg2.connect(dsns[site_id])),
        owner=owner,
        settings=SessionSettings(**options),
        providers=providers,
        sessions=sessions,
    )


class App:
    """A source application: a key/value table; every change is transmitted in the same transaction."""

    def __init__(self, site, client: str = "policy") -> None:
        self.site = site
        self.conn = site.connect()
        with self.conn.cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS app_state (k text PRIMARY KEY, v bigint NOT NULL)")
        self.conn.commit()
        self.client = RoutingQueueClient(self.conn, client)

    def put(self, key: str, value: int, destinations: list[str]) -> Ticket:
        with self.conn.cursor() as cur:
            cur.execute(
                "INSERT INTO app_state VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (key, value)
            )
        ticket = self.client.transmit_log_entry_message(f"{key}={value}".encode(), destinations)
        self.conn.commit()
        return ticket

    def close(self) -> None:
        self.conn.close()


def table_provider(ctx) -> None:
    """Full-sync provider: every row of app_state, as of the supplying transaction's snapshot."""
    with ctx.conn.cursor() as cur:
        cur.execute("SELECT k, v FROM app_state ORDER BY k")
        for k, v in cur.fetchall():
            ctx.transmit(f"{k}={v}".encode())


def empty_provider(ctx) -> None:
    """A client with nothing to send in a full sync."""


def queue_entries(
    sink, client: str = "policy", source: str | None = None, visible_only: bool = True, kind: int | None = None
) -> list[tuple[int, bytes]]:
    """The one reader of a sink's receive queue: (kind, payload) of each undelivered entry, in sink
    order (rows are packed: ``queue_rows``). Checks that rows follow source order and that
    destinations were stripped."""
    rows = sink.query(
        "SELECT kind, source_site_id, source_position, source_entry_id, entry_count, delivered, message "
        "FROM lr.receive_queue WHERE client_name = %s AND (%s::text IS NULL OR source_site_id = %s)"
        " AND (%s::int IS NULL OR kind = %s)" + (" AND visible" if visible_only else "") + " ORDER BY seq",
        (client, source, source, kind, kind),
    )
    out, last = [], {}
    for row_kind, row_source, position, entry_id, count, delivered, message in rows:
        if row_kind == lr_pb2.LOG_ENTRY_SYNC:
            assert (position, entry_id) >= last.get(row_source, (position, entry_id)), "rows in source order"
            last[row_source] = (position, entry_id)
        for entry in unpack(count, bytes(message))[delivered:]:
            msg = lr_pb2.RoutingTableEntryMsg.FromString(entry)
            assert not msg.destinations, "destinations are stripped at the sink"
            out.append((row_kind, msg.opaque_payload))
    return out


def queue(sink, source: str | None = None, client: str = "policy", visible_only: bool = True) -> list[tuple[str, str]]:
    """(kind name, payload text) of every entry of the sink's receive queue, in sink order."""
    return [(KIND[k], p.decode()) for k, p in queue_entries(sink, client, source, visible_only)]


def sink_queue(sink, client: str, source: str = "site-a") -> list[bytes]:
    """The payloads of the sink's visible log entries from ``source`` for ``client``, in sink order."""
    return [p for _, p in queue_entries(sink, client, source, kind=lr_pb2.LOG_ENTRY_SYNC)]


def final_state(entries: list[tuple[str, str]]) -> dict[str, int]:
    """Apply a queue's payloads in order (full sync, then deltas) to get the sink's view of app_state."""
    state: dict[str, int] = {}
    for kind, payload in entries:
        if kind in ("snap", "log"):
            k, v = payload.split("=")
            state[k] = int(v)
    return state


def source_state(site) -> dict[str, int]:
    return dict(site.query("SELECT k, v FROM app_state"))


def many_rows_provider(ctx) -> None:
    """A full sync larger than one transfer chunk (engine.session.SNAPSHOT_CHUNK)."""
    for i in range(12_000):
        ctx.transmit(f"bulk{i}={i}".encode())


def run_crashing_replicator(
    topo,
    sites,
    fault: str,
    providers: dict[str, str] | None = None,
    cycles: int = 5,
    settings: dict | None = None,
    timeout: float = 120,
    stream: float | None = None,
    during: Callable[[Callable[[], bool]], None] | None = None,
):
    """Run a replicator in a child process that SIGKILLs itself at fault point ``fault``
    (``settings``: SessionSettings overrides, e.g. ``tee_min_backlog``; ``stream``: seconds of
    streaming mode instead of cycles; ``during``: what the application does while it runs, given
    a function that says whether the child still runs)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    spec = {
        "topology": topo.document,
        "dsns": {s.site_id: s.dsn for s in sites},
        "providers": providers or {},
        "owner": f"crash-{fault}",
        "cycles": cycles,
        "settings": settings or {},
        "stream": stream,
    }
    env = {**os.environ, "LR_FAULT": fault}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.crash_runner", json.dumps(spec)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if during is not None:
            during(lambda: child.poll() is None)
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def drain(reader: LogReader, after: int = 0, **limits) -> tuple[list, int]:
    """Read everything available; returns (records, last end position)."""
    records = []
    while True:
        batch = reader.read_stream(after, **limits).collect()
        records += batch.records
        after = batch.end
        if not batch.has_more:
            return records, after


class CounterWriters:
    """Guarantee 2's workload: ``writers`` threads each commit ``per_writer`` transactions
    that increment one of five shared counters and transmit ``counter:value`` (commits interleave
    late); with ``rollback_every``, every so many transactions of a writer first draw a commit
    position and roll back (a permanent gap in positions)."""

    def __init__(
        self,
        source,
        destinations: list[str],
        writers: int = 6,
        per_writer: int = 150,
        rollback_every: int | None = None,
    ) -> None:
        self.source, self.destinations = source, destinations
        self.writers, self.per_writer, self.rollback_every = writers, per_writer, rollback_every
        self.errors: list[BaseException] = []
        conn = source.connect()
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE counters (id int PRIMARY KEY, v int NOT NULL)")
            cur.execute("INSERT INTO counters SELECT g, 0 FROM generate_series(1, 5) g")
        conn.commit()
        conn.close()

    @property
    def total(self) -> int:
        return self.writers * self.per_writer

    def run(self) -> None:
        threads = [threading.Thread(target=self._write, args=(i,)) for i in range(self.writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert self.errors == []

    def _write(self, seed: int) -> None:
        rng, conn = random.Random(seed), self.source.connect()
        client = RoutingQueueClient(conn, "policy")
        try:
            for n in range(self.per_writer):
                if self.rollback_every and n % self.rollback_every == 7:
                    with conn.cursor() as cur:
                        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the position is drawn now
                    client.transmit_log_entry_message(b"rolled back", self.destinations)
                    conn.rollback()
                counter = rng.randint(1, 5)
                with conn.cursor() as cur:
                    cur.execute("UPDATE counters SET v = v + 1 WHERE id = %s RETURNING v", (counter,))
                    value = cur.fetchone()[0]
                client.transmit_log_entry_message(f"{counter}:{value}".encode(), self.destinations)
                if rng.random() < 0.3:
                    time.sleep(rng.random() / 500)  # widen the commit interleavings
                conn.commit()
        except BaseException as exc:  # pragma: no cover - reported by run
            self.errors.append(exc)
        finally:
            conn.close()

    def check(self, payloads: list[bytes], where: str = "") -> None:
        """Every transaction's entry once, each counter's values in commit order."""
        assert len(payloads) == self.total and b"rolled back" not in payloads, where
        values: dict[int, list[int]] = {}
        for payload in payloads:
            counter, value = map(int, payload.split(b":"))
            values.setdefault(counter, []).append(value)
        for counter, seen in values.items():
            assert seen == list(range(1, len(seen) + 1)), f"{where}: counter {counter} out of order"


class Streaming:
    """``repl`` in streaming mode (``lr sync``'s default) on a thread of this process, as a context
    manager: on exit the streamer is stopped and joined and the replicator closed."""

    def __init__(self, repl: Replicator, options: StreamSettings | None = None, interval: float = 0.05) -> None:
        self.repl = repl
        self.streamer = Streamer(repl, options)
        self.cycles: list = []  # every cycle report, in order
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.streamer.run, args=(self.stop,), kwargs={"interval": interval, "on_cycle": self.cycles.extend}
        )

    def __enter__(self) -> Streaming:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.repl.close()
        assert not self.thread.is_alive(), "the streamer stops when asked"

    def streaming(self, timeout: float = 30) -> None:
        """Wait until every session streams (a cycle left it in log-entry sync, under our lease)."""
        wait_for(
            lambda: not set(self.repl.sessions) - self.streamer.streaming,
            timeout,
            f"every session to stream (last cycles: {self.cycles[-len(self.repl.sessions) :]}, "
            f"ends: {self.streamer.ends})",
        )


def wait_for(predicate: Callable[[], object], timeout: float = 30, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds. A table the
    predicate reads that is not there yet (lr creates a sink's table with its first snapshot) is
    "not yet", not a failure: the timeout says so if it never comes."""
    deadline = time.monotonic() + timeout
    while True:
        missing = None
        try:
            if predicate():
                return
        except psycopg2.errors.UndefinedTable as exc:
            missing = exc
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (
            f" (last: {str(missing).splitlines()[0]})" if missing else ""
        )
        time.sleep(0.005)


@contextlib.contextmanager
def lr_sync_process(topology_path: str | Path, source) -> Iterator[subprocess.Popen]:
    """``lr sync`` (streaming, the default) in a process of its own, as an operator would run it
    beside Airflow, once both sessions of ``source`` stream under its leases; stopped (SIGTERM,
    its service-manager stop) on the way out."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", str(topology_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while source.query(
            "SELECT count(*) FROM lr.source_sessions WHERE state = 'IN_LOG_ENTRY_SYNC' AND lease_owner IS NOT NULL"
        ) != [(2,)]:  # first contact made; it streams now
            assert time.monotonic() < deadline and process.poll() is None, "lr sync did not start streaming"
            time.sleep(0.1)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
