"""Scale (issue 30): one source streaming to many sessions, lr beside native logical replication on
the same servers, the same writers, one run; and a takeover after SIGKILL of one of two replicators.

Sessions = sinks × clients. ``--sessions`` lists the configurations: a number N is
min(N, ``--max-sinks``) sinks × the rest in clients (64 with 8 sinks: 8 × 8), or ``SxC`` names both.

Servers: 1 + ``--sink-servers`` embedded PostgreSQL servers (PostgreSQL's default durability,
``wal_level=logical``, connection and replication limits raised so that no configuration meets
them). Each site is a database: the source alone on the first server, sink i on sink server
i mod ``--sink-servers``. Every configuration gets fresh databases.

Writers: ``--writers`` threads in this process, ``--rate`` transactions/s in all (``streaming_common``
paces them and records the time just before each commit). A transaction of writer w, sequence s,
belongs to client (w + s) mod C and goes to every sink of its client (every sink): one delivery per
sink, whatever the number of clients.

* ``lr``     ``lr sync`` as a separate process the way a user runs it (``--lr-cmd``); it makes the
             sessions' first contact itself (an empty full sync). One sink application process per
             sink: a ``Relay`` (``open_relay``) with one subscription per client, whose listener
             records the arrival of each entry; writers call ``transmit_log_entry_message(payload,
             sinks)`` with their client's ``RoutingQueueClient``.
* ``native`` a publication and a subscription per sink (``copy_data = false``) of a table the
             writers insert one row per transaction into; a trigger on each sink stamps arrival
             (``streaming_common.NativeSystem``). Native has no clients: it runs once per number of
             sinks, and its figures stand beside every configuration with that many sinks.

Per configuration:

* lag p50 / p99: arrival at the sink application (lr: the listener; native: the apply worker's
  trigger) − the time just before the writer's commit, transactions committed in the measured
  window (after ``--warmup``, for ``--seconds``), pooled over sessions;
* writers: transactions/s they reached in the window (the target is ``--rate``);
* lost / duplicated: over every committed transaction each session owes (must be 0 / 0);
* CPU s / 10k: CPU seconds per 10,000 deliveries, from the writers' start until every session
  holds what it owes (``usage_probe``). lr: ``lr sync`` (its process group) + its backends +
  the sink applications + their backends; native: walsenders + apply workers. Writers' backends are
  in the JSON, billed to neither;
* connections: most at once, by database: ``lr sync``'s on the source, the most on one sink, its
  total over every site, and that total at the end of the run (once streaming: the cycles'
  connections rest after 5 s unused); the sink applications' in all; native's walsenders on the
  source and apply workers per sink;
* threads / RSS: the most threads and resident memory of the ``lr sync`` process.

Takeover (``--takeover-sessions``, "" to skip): two ``lr sync`` processes on one topology with the
default lease, started together; writers at ``--rate``; ``--takeover-kill-after`` seconds in, the
one that used more CPU over the last 2 s (the one holding sessions) gets SIGKILL (its process
group); writers go on ``--takeover-write-after`` seconds more. Figures: per session, the time from
the kill to its first arrival after it (``takeover_s`` is the longest: how long the survivor took to
deliver again what the dead one held), waited for at most ``--takeover-wait`` seconds; lost and
duplicated over the whole run.

Idle (``--idle S``, off by default): once every session streams, before the writers start, the
replicators' CPU (their process groups) and the transactions run on the source (its
``pg_stat_database``: only ``lr sync`` connects there before writing) over S seconds, and how long
every session took to stream (``ready_s``): what many sessions cost while nothing happens.

Run: .venv/bin/python bench/scale_bench.py [--sessions 1,2,4,8,16,32,64] [--rate 500] [--seconds 20]
     [--warmup 3] [--systems lr,native] [--max-sinks 8] [--sink-servers 2] [--lr-cmd "lr sync"]
     [--takeover-sessions 8] [--takeover-wait 90] [--idle 0] [--keep] [--out bench/results/scale_bench.json]
Writes the JSON and a markdown table beside it (same name, ``.md``). Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2
import psycopg2.extensions

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from fanout_anchors import BenchEnv, execute, settle  # noqa: E402
from fanout_lr import LrSites  # noqa: E402
from scale_report import SOURCE, markdown  # noqa: E402
from streaming_common import (  # noqa: E402
    POLL_S,
    PROVIDER,
    Arrivals,
    LrProcess,
    NativeSystem,
    Plan,
    Recorder,
    Result,
    Send,
    System,
    Writers,
    arrivals_of,
    die_with_parent,
    figures,
    measure,
    stop_processes,
    versions,
    wait_drained,
)
from usage_probe import Probe, Usage, group_cpu_s  # noqa: E402

from airflow_provider_lr.client import RoutingQueueClient  # noqa: E402
from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
from airflow_provider_lr.subscriber import open_relay  # noqa: E402

APP_SYNC, APP_SUB, APP_WRITER = "lr-bench-sync", "lr-bench-sub", "lr-bench-writer"  # application_name
SERVER_SETTINGS = {  # room for 64 sessions today (3 connections each) and a subscription per sink
    "max_connections": "800",
    "max_wal_senders": "80",
    "max_replication_slots": "80",
    "max_logical_replication_workers": "70",
    "max_worker_processes": "80",
}
BACKENDS = {  # usage_probe roles by (application_name, backend_type)
    "lr_backends": lambda app, kind: app.startswith(APP_SYNC),
    "subscriber_backends": lambda app, kind: app == APP_SUB,
    "writer_backends": lambda app, kind: app == APP_WRITER,
    "walsenders": lambda app, kind: kind == "walsender",
    "apply_workers": lambda app, kind: kind.startswith("logical replication") and not kind.endswith("launcher"),
}


@dataclass(frozen=True)
class Layout:
    sinks: int
    clients: int

    @property
    def sessions(self) -> int:
        return self.sinks * self.clients

    @property
    def label(self) -> str:
        return f"{self.sinks}×{self.clients}"

    @property
    def sink_ids(self) -> list[str]:
        return [f"sink-{i:02d}" for i in range(self.sinks)]

    @property
    def client_names(self) -> list[str]:
        return [f"c{j}" for j in range(self.clients)]


def layouts(text: str, max_sinks: int) -> list[Layout]:
    """``1,2,8x4``: a number N is min(N, max_sinks) sinks × N / sinks clients; ``SxC`` is explicit."""
    out = []
    for part in filter(None, text.replace(" ", "").split(",")):
        sinks, _, clients = part.lower().replace("×", "x").partition("x")
        if not sinks.isdigit() or (clients and not clients.isdigit()):
            raise argparse.ArgumentTypeError(f"{part!r}: a number of sessions, or SINKSxCLIENTS")
        if clients:
            layout = Layout(int(sinks), int(clients))
        else:
            n = int(sinks)
            layout = Layout(min(n, max_sinks), n // min(n, max_sinks) if n else 0)
            if layout.sessions != n:
                raise argparse.ArgumentTypeError(f"{part!r}: not a multiple of --max-sinks {max_sinks}")
        if layout.sessions < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: at least one session")
        out.append(layout)
    return out


@dataclass
class Servers:
    """The bench's servers: the source's, then the sinks' (sink i on sink server i mod their number)."""

    manager: SiteManager
    source: str  # admin DSN of the source's server
    sinks: list[str]  # admin DSN of each sink server

    def env(self, sinks: int, dbname: str | None = None) -> BenchEnv:
        """Sink i's server (``dbname`` given: that database on it, suffixed by the sink's index)."""

        def on(dsn: str, suffix: str) -> str:
            return psycopg2.extensions.make_dsn(dsn, dbname=f"{dbname}{suffix}") if dbname else dsn

        return BenchEnv(
            on(self.source, "_src"), [on(self.sinks[i % len(self.sinks)], f"_{i}") for i in range(sinks)], self.manager
        )

    @property
    def all(self) -> list[str]:
        return [self.source, *self.sinks]


def _writer_dsn(dsn: str) -> str:
    return psycopg2.extensions.make_dsn(dsn, application_name=APP_WRITER)


def _owed_per_client(writers: Writers, clients: int) -> list[int]:
    """Transactions of each client: writer w's seq s belongs to client (w + s) mod ``clients``."""
    out = [0] * clients
    for w, times in enumerate(writers.precommit):
        n = len(times)
        for c in range(clients):
            first = (c - w) % clients  # the first seq of client c
            out[c] += max(0, (n - first + clients - 1) // clients)
    return out


# --- the sink applications ----------------------------------------------------------------------
def _sink_application(dsn: str, clients: list[str], out: str, readies: list[Any], counts: list[Any], stop: Any) -> None:
    """One sink's application in its own process: a relay, one subscription per client, until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops it (Ctrl-C reaches the whole group)
    die_with_parent()
    os.environ["PGAPPNAME"] = APP_SUB  # its backends, for the probe
    recorders = {c: Recorder(r, n) for c, r, n in zip(clients, readies, counts)}
    relay = open_relay(dsn)
    error = None
    try:
        subs = {c: relay.subscribe(rec, c) for c, rec in recorders.items()}
        while not stop.wait(0.5):
            failed = [f"{c}: {s.error!r}" for c, s in subs.items() if s.error is not None]
            if failed or relay.error is not None:
                error = "; ".join(failed) or repr(relay.error)
                break
    except Exception as exc:
        error = repr(exc)
    finally:
        relay.close()
    Path(out).write_bytes(pickle.dumps({"error": error, "clients": {c: r.arrivals() for c, r in recorders.items()}}))


# --- the systems --------------------------------------------------------------------------------
class ScaleLr(System):
    """``lr sync`` (``replicators`` of them, started together) and one sink application per sink."""

    name = "lr"

    def __init__(
        self,
        servers: Servers,
        home: Path,
        lr_cmd: str,
        layout: Layout,
        tag: str,
        replicators: int = 1,
        ready_timeout: float = 600.0,
        probe_every: float = 0.5,
        idle: float = 0.0,
    ) -> None:
        self.servers, self.home, self.lr_cmd, self.layout, self.tag = servers, home, lr_cmd, layout, tag
        self.replicators, self.ready_timeout, self.probe_every = replicators, ready_timeout, probe_every
        self.idle = idle
        self.sites: LrSites | None = None
        self.lrs: list[LrProcess] = []
        self.ctx = mp.get_context("spawn")
        self.stop_subs = self.ctx.Event()
        self.apps: list[tuple[str, Any, Path]] = []  # sink, process, arrivals file
        self.sessions: list[tuple[str, str, Any, Any]] = []  # sink, client, ready, count
        self.probe: Probe | None = None
        self.usage: Usage | None = None
        self._details: dict[str, Any] = {}

    def setup(self) -> None:
        layout = self.layout
        self.sites = LrSites(
            self.servers.env(layout.sinks),
            "scale_lr",
            [SOURCE, *layout.sink_ids],
            providers={c: PROVIDER for c in layout.client_names},
            initial_sync=False,
            clients=layout.client_names,
            settings={},  # the default lease: what a takeover waits for
        )
        for sink in layout.sink_ids:  # consumers first: the full sync's markers tell the sessions are up
            readies = [self.ctx.Event() for _ in layout.client_names]
            counts = [self.ctx.Value("q", 0) for _ in layout.client_names]
            out = self.home / f"arrivals-{sink}.pickle"
            out.unlink(missing_ok=True)
            proc = self.ctx.Process(
                target=_sink_application,
                args=(self.sites.dsns[sink], layout.client_names, str(out), readies, counts, self.stop_subs),
                name=f"sink-application-{sink}",
                daemon=True,
            )
            proc.start()
            self.apps.append((sink, proc, out))
            self.sessions += [(sink, c, r, n) for c, r, n in zip(layout.client_names, readies, counts)]
        for i in range(self.replicators):
            log = self.home / f"lr-sync-{self.tag}-{i + 1}.log"
            log.unlink(missing_ok=True)
            lr = LrProcess(
                self.lr_cmd, self.sites.topology_file, self.sites.connections, self.home, log, f"{APP_SYNC}-{i + 1}"
            )
            self.lrs.append(lr)
        for lr in self.lrs:
            lr.start()
        self._details["lr_cmd"] = " ".join(self.lrs[0].cmd)
        started = time.monotonic()
        while not all(ready.is_set() for *_, ready, _ in self.sessions):
            self.check_alive()
            if time.monotonic() > started + self.ready_timeout:
                waiting = sum(not ready.is_set() for *_, ready, _ in self.sessions)
                raise TimeoutError(
                    f"{waiting} sessions not in log-entry sync after {self.ready_timeout:.0f} s\n"
                    + self.lrs[0].log_tail()
                )
            time.sleep(POLL_S)
        self._details["ready_s"] = round(time.monotonic() - started, 1)
        if self.idle > 0:
            self._measure_idle()

    def _measure_idle(self) -> None:
        """Every session streaming and nothing written for ``idle`` seconds (after the cycles'
        connections rested): the replicators' CPU and the transactions they run on the source."""
        assert self.sites is not None
        time.sleep(6.0)  # lr sync closes a cycle connection unused for 5 s
        source = psycopg2.connect(self.sites.dsns[SOURCE])
        source.autocommit = True

        def transactions() -> int:
            with source.cursor() as cur:
                cur.execute(
                    "SELECT xact_commit + xact_rollback FROM pg_catalog.pg_stat_database WHERE datname = "
                    "current_database()"
                )
                return int(cur.fetchone()[0])

        try:
            cpu, xacts, started = [group_cpu_s(lr.pid) for lr in self.lrs], transactions(), time.monotonic()
            time.sleep(self.idle)
            spent = sum(group_cpu_s(lr.pid) for lr in self.lrs) - sum(cpu)
            elapsed = time.monotonic() - started
            self._details["idle_cpu_pct"] = round(100 * spent / elapsed, 2)
            self._details["idle_source_xacts_per_s"] = round((transactions() - xacts - 2) / elapsed, 1)
        finally:
            source.close()
        print(
            f"  {self.layout.label}: every session streaming after {self._details['ready_s']} s; idle: lr sync "
            f"{self._details['idle_cpu_pct']}% CPU, {self._details['idle_source_xacts_per_s']} transactions/s "
            "on the source",
            flush=True,
        )

    def source_dsn(self) -> str:
        assert self.sites is not None
        return _writer_dsn(self.sites.dsns[SOURCE])

    def make_send(self, conn: Any) -> Send:
        clients = [RoutingQueueClient(conn, c) for c in self.layout.client_names]
        sinks, n = self.layout.sink_ids, len(clients)
        return lambda w, seq, payload: clients[(w + seq) % n].transmit_log_entry_message(payload, sinks)

    def owed(self, session: str, writer: np.ndarray, seq: np.ndarray) -> np.ndarray:
        client = self.layout.client_names.index(session.split("/", 1)[1])
        return (writer + seq) % self.layout.clients == client

    def owed_counts(self, writers: Writers) -> list[int]:
        per_client = _owed_per_client(writers, self.layout.clients)
        return [per_client[self.layout.client_names.index(c)] for _, c, _, _ in self.sessions]

    def delivered_counts(self) -> list[int]:
        return [count.value for *_, count in self.sessions]

    def live(self) -> list[LrProcess]:
        return [lr for lr in self.lrs if lr.running()]

    def check_alive(self) -> None:
        if not self.live():
            self.lrs[0].check_alive()
        for sink, proc, _ in self.apps:
            if not proc.is_alive():
                raise RuntimeError(f"the application of {sink} exited ({proc.exitcode})")

    def writing(self) -> None:
        self.probe = Probe(
            self.servers.all,
            BACKENDS,
            {
                "lr_sync": lambda: [lr.pid for lr in self.live()],
                "subscribers": lambda: [p.pid for _, p, _ in self.apps],
            },
            watch=lambda: [lr.pid for lr in self.live()],
            every=self.probe_every,
        )
        self.probe.start()

    def drained(self) -> None:
        if self.probe is not None:
            self.usage = self.probe.stop()

    def collect(self) -> dict[str, Arrivals]:
        stop_processes([proc for _, proc, _ in self.apps], self.stop_subs)
        for lr in self.lrs:
            lr.stop()
        out = {}
        for sink, proc, path in self.apps:
            if not path.exists():
                raise RuntimeError(f"the application of {sink} left no arrivals (exit {proc.exitcode})")
            got = pickle.loads(path.read_bytes())
            if got["error"]:
                raise RuntimeError(f"the application of {sink} failed: {got['error']}")
            for client, arrivals in got["clients"].items():
                out[f"{sink}/{client}"] = arrivals_of(arrivals)
                if arrivals["full_syncs"] != 1:
                    self._details.setdefault("full_syncs", {})[f"{sink}/{client}"] = arrivals["full_syncs"]
        return out

    def details(self) -> dict[str, Any]:
        self._details["lr_log_error_lines"] = [lr.error_lines() for lr in self.lrs]
        self._details["lr_exit"] = [lr.returncode for lr in self.lrs]
        if self.usage is not None and self.sites is not None:
            self._details["usage"] = self.usage.as_dict()
            self._details["sites_by_database"] = {
                psycopg2.extensions.parse_dsn(dsn)["dbname"]: site for site, dsn in self.sites.dsns.items()
            }
        return self._details

    def teardown(self) -> None:
        try:
            stop_processes([proc for _, proc, _ in self.apps], self.stop_subs)
        finally:
            try:
                for lr in self.lrs:
                    lr.stop()
            finally:
                if self.sites is not None:
                    with contextlib.suppress(psycopg2.Error):
                        self.sites.drop()
                    self.sites = None


class ScaleNative(NativeSystem):
    """Native logical replication to ``sinks`` sink databases, its walsenders and apply workers probed."""

    def __init__(self, servers: Servers, sinks: int, probe_every: float = 0.5) -> None:
        env = servers.env(sinks, "scale_native")
        super().__init__(env, [f"sink-{i:02d}" for i in range(sinks)], _writer_dsn(env.source_dsn))
        self.servers, self.probe_every = servers, probe_every
        self.probe: Probe | None = None
        self.usage: Usage | None = None

    def setup(self) -> None:
        for admin, dsn in self._databases():
            db = psycopg2.extensions.parse_dsn(dsn)["dbname"]
            execute(admin, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)", f"CREATE DATABASE {db}")
        super().setup()

    def _databases(self) -> list[tuple[str, str]]:
        """(admin DSN of its server, DSN) of the source's database and of each sink's."""
        admin = self.servers.env(len(self.sinks))
        return list(zip([admin.source_dsn, *admin.sink_dsns], [self.env.source_dsn, *self.env.sink_dsns]))

    def writing(self) -> None:
        self.probe = Probe(self.servers.all, BACKENDS, {}, every=self.probe_every)
        self.probe.start()

    def drained(self) -> None:
        if self.probe is not None:
            self.usage = self.probe.stop()

    def details(self) -> dict[str, Any]:
        return {"usage": self.usage.as_dict()} if self.usage is not None else {}

    def teardown(self) -> None:
        self.clear()
        for admin, dsn in self._databases():
            with contextlib.suppress(psycopg2.Error):
                execute(admin, f"DROP DATABASE IF EXISTS {psycopg2.extensions.parse_dsn(dsn)['dbname']} WITH (FORCE)")


# --- takeover -----------------------------------------------------------------------------------
def _committed_at(writers: Writers, writer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """The time just before the commit of each (writer, seq); -1 for one never committed."""
    out = np.full(len(writer), -1, dtype=np.int64)
    for w, times in enumerate(writers.precommit):
        at = np.frombuffer(times, dtype=np.int64)
        mine = (writer == w) & (seq < len(at))
        out[mine] = at[seq[mine]]
    return out


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def takeover(servers: Servers, home: Path, args: argparse.Namespace, layout: Layout) -> dict[str, Any]:
    """Two replicators, SIGKILL of the busier one while writers run; how long until every session
    delivers again, and whether anything was lost or doubled."""
    system = ScaleLr(servers, home, args.lr_cmd, layout, "takeover", replicators=2, probe_every=args.probe_every)
    try:
        t0 = time.perf_counter()
        system.setup()
        kill_after = args.takeover_kill_after
        plan = Plan(args.rate, args.writers, 0.0, kill_after + args.takeover_write_after)
        print(
            f"[takeover {layout.label}] 2 replicators ready in {time.perf_counter() - t0:.1f} s; writing "
            f"{plan.seconds:g} s, SIGKILL of the busier replicator after {kill_after:g} s …",
            end=" ",
            flush=True,
        )
        writers = Writers(plan, system.source_dsn(), system.make_send)
        failed: list[BaseException] = []

        def write() -> None:
            try:
                writers.run()
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=write, name="takeover-writers", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not writers.start_mono and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        _sleep_until(writers.start_mono + kill_after - 2.0)
        before = {lr.pid: group_cpu_s(lr.pid) for lr in system.lrs}
        _sleep_until(writers.start_mono + kill_after)
        used = {lr.pid: group_cpu_s(lr.pid) - before[lr.pid] for lr in system.lrs}
        victim = max(system.lrs, key=lambda lr: used[lr.pid])
        kill_ns, kill_mono = time.time_ns(), time.monotonic()
        victim.kill()
        thread.join()
        if failed:
            raise failed[0]

        def give_up(now: float, last_change: float) -> bool:
            waited = now - kill_mono
            return waited > args.takeover_wait and (now - last_change > 5.0 or waited > args.takeover_wait + args.stall)

        drained = wait_drained(system, system.owed_counts(writers), give_up)
        waited_s = time.monotonic() - kill_mono
        arrivals = system.collect()
        fig = figures(writers, arrivals, system.owed)
        resume: dict[str, float | None] = {}
        for session, (w, s, t) in arrivals.items():
            after = t[_committed_at(writers, w, s) >= kill_ns]
            resume[session] = round(float(after.min() - kill_ns) / 1e9, 3) if len(after) else None
        known = [v for v in resume.values() if v is not None]
        out = {
            "layout": layout.label,
            "sessions": layout.sessions,
            "rate": args.rate,
            "kill_after_s": kill_after,
            "write_after_kill_s": args.takeover_write_after,
            "wait_bound_s": args.takeover_wait,
            "victim": system.lrs.index(victim) + 1,
            "cpu_s_before_kill": {i + 1: round(used[lr.pid], 2) for i, lr in enumerate(system.lrs)},
            "takeover_s": max(known) if len(known) == len(resume) else None,
            "sessions_resumed": len(known),
            "sessions_stalled_over_1s": sum(v > 1.0 for v in known),
            "resume_s": resume,
            "waited_s": round(waited_s, 1),
            "drained": drained,
            "committed": fig["committed"],
            "achieved_per_s": fig["achieved_per_s"],
            "delivered": fig["delivered"],
            "lost": fig["lost"],
            "duplicated": fig["duplicated"],
            "details": system.details(),
        }
        taken = "not within the bound" if out["takeover_s"] is None else f"{out['takeover_s']:.1f} s"
        print(
            f"replicator {out['victim']} killed; every session delivering again after {taken}; "
            f"lost {out['lost']}, duplicated {out['duplicated']}",
            flush=True,
        )
        return out
    finally:
        system.teardown()


# --- the run ------------------------------------------------------------------------------------
def _result(r: Result) -> dict[str, Any]:
    return {
        "rate": r.rate,
        "system": r.system,
        "writers": r.writers,
        **r.figures,
        "drain_s": r.drain_s,
        "drained": r.drained,
        "details": r.details,
    }


def start_servers(manager: SiteManager, sink_servers: int) -> Servers:
    servers = manager.up(count=1 + sink_servers)
    return Servers(manager, servers[0].dsn(), [s.dsn() for s in servers[1:]])


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # SIGTERM: the same clean stop as Ctrl-C


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,2,4,8,16,32,64", help="comma list of N or SINKSxCLIENTS")
    parser.add_argument(
        "--max-sinks", type=int, default=8, help="sinks of a configuration given as N (the rest: clients)"
    )
    parser.add_argument("--sink-servers", type=int, default=2, help="PostgreSQL servers the sink sites share")
    parser.add_argument("--rate", type=int, default=500, help="transactions/s of all writers together")
    parser.add_argument("--writers", type=int, default=4, help="writer threads")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per configuration")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds written before the measured window")
    parser.add_argument("--systems", default="lr,native", help="comma list of: lr, native")
    parser.add_argument(
        "--lr-cmd",
        default="lr sync",
        help="the replicator's command line (default: %(default)s; a leading 'lr' is the venv's); "
        "the bench appends --topology FILE and sets LR_CONNECTIONS_FILE",
    )
    parser.add_argument("--takeover-sessions", default="8", help="the takeover run's sessions (N or SxC; '' skips it)")
    parser.add_argument("--takeover-kill-after", type=float, default=8.0, help="seconds of writing before the SIGKILL")
    parser.add_argument("--takeover-write-after", type=float, default=5.0, help="seconds of writing after it")
    parser.add_argument("--takeover-wait", type=float, default=90.0, help="longest wait for the survivor (s)")
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="before writing, measure lr sync idle this long (its CPU, its transactions on the source)",
    )
    parser.add_argument("--probe-every", type=float, default=0.5, help="seconds between usage samples")
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="longest wait for the last arrivals (s)")
    parser.add_argument("--stall", type=float, default=60.0, help="stop waiting after this long without an arrival (s)")
    parser.add_argument("--keep", action="store_true", help="leave the servers' data directory (and logs) in place")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "scale_bench.json")
    args = parser.parse_args(argv)
    try:
        args.layouts = layouts(args.sessions, args.max_sinks)
        args.takeover = layouts(args.takeover_sessions, args.max_sinks)[:1]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.system_list = [s for s in args.systems.split(",") if s]
    if set(args.system_list) - {"lr", "native"}:
        parser.error(f"--systems: a comma list of lr, native (got {args.systems!r})")
    if args.seconds <= 0 or args.warmup < 0 or args.writers < 1 or args.rate < 1 or args.sink_servers < 1:
        parser.error("--seconds and --rate must be > 0, --warmup >= 0, --writers and --sink-servers >= 1")
    if args.takeover_kill_after < 2.5:
        parser.error("--takeover-kill-after: at least 2.5 s (the last 2 s tell which replicator is busy)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    load_before = os.getloadavg()
    home = Path(tempfile.mkdtemp(prefix="lr-scale-bench-"))
    print(
        f"machine: {os.cpu_count()} cores, load {load_before[0]:.2f}; {platform.platform()}; "
        f"python {platform.python_version()}; servers under {home}",
        flush=True,
    )
    manager = SiteManager(home, settings=SERVER_SETTINGS)
    configurations: list[dict[str, Any]] = []
    native: dict[int, dict[str, Any]] = {}  # sinks -> its run
    takeovers: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    interrupted = False
    plan = Plan(args.rate, args.writers, args.warmup, args.seconds)
    try:
        servers = start_servers(manager, args.sink_servers)
        info = versions(servers.source, args.lr_cmd)
        print(f"PostgreSQL {info['server'].get('server_version')}, lr ({info['git']}), {args.lr_cmd}", flush=True)
        everything = BenchEnv(servers.source, servers.sinks)
        for layout in args.layouts:
            row: dict[str, Any] = {"layout": layout.label, "sinks": layout.sinks, "clients": layout.clients}
            row["sessions"] = layout.sessions
            systems: list[tuple[str, System]] = []
            if "lr" in args.system_list:
                lr = ScaleLr(
                    servers, home, args.lr_cmd, layout, layout.label, probe_every=args.probe_every, idle=args.idle
                )
                systems.append(("lr", lr))
            if "native" in args.system_list and layout.sinks not in native:
                systems.append(("native", ScaleNative(servers, layout.sinks, args.probe_every)))
            for name, system in systems:
                settle(everything)
                try:
                    result = _result(
                        measure(system, plan, args.drain_timeout, args.stall, f"{layout.label} {plan.label}")
                    )
                finally:
                    system.teardown()
                if name == "lr":
                    row["lr"] = result
                else:
                    native[layout.sinks] = result
            configurations.append(row)
        for layout in args.takeover:
            settle(everything)
            takeovers.append(takeover(servers, home, args, layout))
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping everything", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            manager.down(mode="fast", remove=not args.keep)
        finally:
            if not args.keep:
                shutil.rmtree(home, ignore_errors=True)
            else:
                print(f"kept {home} (servers stopped; lr-sync-*.log there)", file=sys.stderr)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    if configurations or takeovers:
        doc = {
            "args": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k not in ("layouts", "takeover")
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
            },
            "versions": info,
            "configurations": configurations,
            "native": {str(k): v for k, v in sorted(native.items())},
            "takeover": takeovers,
        }
        table = markdown(doc)
        print("\n" + table)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2, default=str))
        args.out.with_suffix(".md").write_text(table)
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
