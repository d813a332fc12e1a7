"""Streaming lag (issue 19): how long a committed payload takes to reach the sink application, lr
beside native logical replication, same servers, same writers, one run.

Servers: 3 embedded PostgreSQL servers (``SiteManager``, the project's PostgreSQL, PostgreSQL's
default durability, ``wal_level=logical``): site-a → site-b, site-c.

Writers: W threads in this process (``--writers``, default 4; ``--max-writers`` 8 for the unpaced
rate ``max``), each a loop of one transaction per payload of 256 bytes (writer id and sequence
number in front of random bytes), paced to the target total rate by a fixed schedule per writer
(one behind schedule commits back to back until it catches up, so a target out of reach measures
what W writers reach). The time just before ``commit()`` is recorded per (writer, seq):
``time.time_ns()``, the machine's real-time clock, which the other processes and the servers read.

Systems, one after the other for each rate, each on fresh databases:

* ``lr``     ``lr sync`` run as a separate process the way a user runs it (``--lr-cmd``, default
             ``lr sync``; the bench appends ``--topology FILE`` and sets ``LR_CONNECTIONS_FILE``),
             started before the writers; it makes the sessions' first contact itself (an empty
             full sync from the topology's provider ``streaming_common:empty_full_state``).
             One ``RoutingQueueSubscriber.run`` per sink, each in its own process; its listener
             records ``time.time_ns()`` at each ``on_log_entry_messages`` call for every
             (writer, seq) of the batch. Writers call ``transmit_log_entry_message(payload,
             ["site-b", "site-c"])`` and commit.
* ``native`` one publication per sink on the source's table ``stream_lag (writer int, seq bigint,
             payload bytea, PRIMARY KEY (writer, seq))`` and one subscription per sink
             (``copy_data = false``); writers insert one row per transaction. The sink's copy of the
             table has ``arrived_at``, set by a ``BEFORE INSERT`` trigger to ``clock_timestamp()``
             (``ENABLE ALWAYS TRIGGER``: the apply worker fires it).

lag = arrival at the sink application (listener call, or the apply's trigger) − the time just
before the writer's commit, for every transaction committed in the measured window (after
``--warmup`` seconds, for ``--seconds``), pooled over both sinks. After the writers stop, the
bench waits until every committed (writer, seq) arrived at each sink (or ``--drain-timeout``, or
``--stall`` seconds without progress), then counts, over every transaction the writers committed
(warm-up included): delivered (distinct (writer, seq) per sink), lost (committed, never arrived)
and duplicated (arrived more than once, or never committed). The native sink table's primary key
makes a duplicate an apply error (the subscription stalls: it shows as lost).

Both arrival moments are taken inside the delivering transaction, before it commits (the listener
runs in the subscriber's delivery transaction, the trigger in the apply worker's). This process
runs only the writers; ``lr sync``, the subscribers and the 3 servers share the machine with them.

``--lr-cmd`` is split like a shell line; a leading ``lr`` is this interpreter's console script
(e.g. ``--lr-cmd "lr sync --interval 0.05"``). The process gets its own process group and is
stopped with SIGINT (``lr sync`` releases its sessions and exits), then SIGTERM, then SIGKILL;
its output is ``lr-sync-<rate>.log`` in the bench's home (kept with ``--keep``).

Run: .venv/bin/python bench/streaming_bench.py [--rates 1000,5000,max] [--systems lr,native]
     [--seconds 30] [--warmup 3] [--writers 4] [--max-writers 8] [--lr-cmd "lr sync"] [--keep]
Writes bench/results/streaming_bench.json. Ctrl-C stops everything it started (servers included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import platform
import resource
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg2

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from fanout_anchors import BenchEnv, execute, settle  # noqa: E402
from fanout_lr import CLIENT, LrSites  # noqa: E402
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
    arrivals_of,
    cpu_s,
    die_with_parent,
    measure,
    stop_processes,
    versions,
)

from airflow_provider_lr.client import RoutingQueueClient  # noqa: E402
from airflow_provider_lr.subscriber import RoutingQueueSubscriber  # noqa: E402

try:  # being moved behind the [embedded] extra (issue 18)
    from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
except ImportError:
    from airflow_provider_lr.sites import SiteManager  # noqa: E402

SITES = ["site-a", "site-b", "site-c"]
SINKS = SITES[1:]
BENCH_DB = "streaming_bench"


# --- the sink application ---------------------------------------------------------------------
def _subscribe(dsn: str, out: str, ready: Any, stop: Any, count: Any) -> None:
    """A sink application in its own process: ``RoutingQueueSubscriber.run`` until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops it (Ctrl-C reaches the whole group)
    die_with_parent()
    recorder = Recorder(ready, count)
    stop_thread = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), stop_thread.set()), daemon=True).start()
    sub = RoutingQueueSubscriber(dsn, client_name=CLIENT)
    stats: Any = None
    error = None
    try:
        stats = sub.run(recorder, stop=stop_thread)
    except Exception as exc:
        error = repr(exc)
    finally:
        sub.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_bytes(
        pickle.dumps(
            {
                **recorder.arrivals(),
                "error": error,
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                "stats": {
                    k: getattr(stats, k, None) for k in ("delivered", "refused", "failures", "dead_letters", "busy")
                },
                "errors": [str(e) for e in getattr(stats, "errors", [])][-5:],
            }
        )
    )


class LrSystem(System):
    """``lr sync`` in its own process group + one subscriber process per sink, on fresh databases."""

    name = "lr"

    def __init__(
        self, env: BenchEnv, home: Path, lr_cmd: str, tag: str, replicators: int = 1, ready_timeout: float = 180.0
    ) -> None:
        self.env, self.home, self.lr_cmd, self.ready_timeout = env, home, lr_cmd, ready_timeout
        self.replicators = replicators
        self.sites: LrSites | None = None
        self.lrs: list[LrProcess] = []  # ``replicators`` of them: they share the sessions (members)
        self.subs: list[tuple[str, Any, Any, Any, Path]] = []  # sink, process, ready, count, out
        self.ctx = mp.get_context("spawn")
        self.stop_subs = self.ctx.Event()
        self.log = home / f"lr-sync-{tag}.log"
        self._details: dict[str, Any] = {}

    def setup(self) -> None:
        self.sites = LrSites(self.env, "lr_stream", SITES, providers={CLIENT: PROVIDER}, initial_sync=False)
        for sink in SINKS:  # consumers first: the full sync's markers are their cue that the sessions are up
            ready, count = self.ctx.Event(), self.ctx.Value("q", 0)
            out = self.home / f"arrivals-{sink}.pickle"
            out.unlink(missing_ok=True)
            proc = self.ctx.Process(
                target=_subscribe,
                args=(self.sites.dsns[sink], str(out), ready, self.stop_subs, count),
                name=f"subscriber-{sink}",
                daemon=True,
            )
            proc.start()
            self.subs.append((sink, proc, ready, count, out))
        self.log.unlink(missing_ok=True)
        for n in range(self.replicators):
            log = self.log if n == 0 else self.log.with_name(f"{self.log.stem}-{n + 1}.log")
            log.unlink(missing_ok=True)
            self.lrs.append(LrProcess(self.lr_cmd, self.sites.topology_file, self.sites.connections, self.home, log))
            self.lrs[-1].start()
        self._details["lr_cmd"] = shlex.join(self.lrs[0].cmd)
        self._details["replicators"] = self.replicators
        deadline = time.monotonic() + self.ready_timeout
        while not all(ready.is_set() for _, _, ready, _, _ in self.subs):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sessions not in log-entry sync after {self.ready_timeout:.0f} s\n{self.lrs[0].log_tail()}"
                )
            time.sleep(POLL_S)

    def source_dsn(self) -> str:
        assert self.sites is not None
        return self.sites.dsns[SITES[0]]

    def make_send(self, conn: Any) -> Send:
        client = RoutingQueueClient(conn, CLIENT)
        return lambda w, seq, payload: client.transmit_log_entry_message(payload, SINKS)

    def delivered_counts(self) -> list[int]:
        return [count.value for _, _, _, count, _ in self.subs]

    def check_alive(self) -> None:
        for lr in self.lrs:
            lr.check_alive()
        for sink, proc, *_ in self.subs:
            if not proc.is_alive():
                raise RuntimeError(f"the subscriber of {sink} exited ({proc.exitcode})")

    def collect(self) -> dict[str, Arrivals]:
        self._details["lr_cpu_s"] = sum(cpu_s(lr.pid) for lr in self.lrs) if self.lrs else None  # before they exit
        stop_processes([proc for _, proc, *_ in self.subs], self.stop_subs)
        for lr in self.lrs:
            lr.stop()
        out = {}
        for sink, proc, _, _, path in self.subs:
            if not path.exists():
                raise RuntimeError(f"the subscriber of {sink} left no arrivals (exit {proc.exitcode})")
            got = pickle.loads(path.read_bytes())
            if got["error"]:
                raise RuntimeError(f"the subscriber of {sink} failed: {got['error']}")
            self._details.setdefault("subscribers", {})[sink] = {
                k: got[k] for k in ("cpu_s", "full_syncs", "stats", "errors")
            }
            out[sink] = arrivals_of(got)
        return out

    def processes(self) -> dict[str, list[int]]:
        return {
            "lr_sync": [lr.pid for lr in self.lrs],
            "subscribers": [proc.pid for _, proc, *_ in self.subs if proc.pid is not None],
        }

    def details(self) -> dict[str, Any]:
        if self.lrs:
            self._details["lr_log_error_lines"] = sum(lr.error_lines() for lr in self.lrs)
            exits = [lr.returncode for lr in self.lrs]
            self._details["lr_exit"] = exits[0] if len(exits) == 1 else exits
        return self._details

    def teardown(self) -> None:
        try:
            stop_processes([proc for _, proc, *_ in self.subs], self.stop_subs)
        finally:
            try:
                for lr in self.lrs:
                    lr.stop()
            finally:
                if self.sites is not None:
                    with contextlib.suppress(psycopg2.Error):
                        self.sites.drop()
                    self.sites = None


# --- the run ------------------------------------------------------------------------------------
def start_servers(manager: SiteManager) -> BenchEnv:
    """3 embedded servers (site-a, site-b, site-c) with PostgreSQL's default durability."""
    servers = manager.up(count=len(SITES))
    for server in servers:
        execute(server.dsn(), f"CREATE DATABASE {BENCH_DB}")
    return BenchEnv(servers[0].dsn(BENCH_DB), [s.dsn(BENCH_DB) for s in servers[1:]], manager)


def print_table(results: list[Result]) -> None:
    print(
        f"\n{'rate':<8} {'system':<7} {'writers':>7} {'achieved/s':>10} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'delivered':>10} {'lost':>6} {'dup':>5}"
    )
    for r in results:
        f, lag = r.figures, r.figures["lag_ms"]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:,.1f}"

        print(
            f"{r.rate:<8} {r.system:<7} {r.writers:>7} {f['achieved_per_s']:>10,.0f} {ms(lag['p50']):>8} "
            f"{ms(lag['p95']):>8} {ms(lag['p99']):>8} {ms(lag['max']):>8} {f['delivered']:>10,} {f['lost']:>6,} "
            f"{f['duplicated']:>5,}" + ("" if r.drained else "  (not drained)")
        )
    print(
        "delivered, lost, duplicated: summed over both sinks, every committed transaction (warm-up included); "
        "lag: transactions committed in the measured window"
    )


def _rates(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in filter(None, text.split(",")):
        if part == "max":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{part!r}: a rate is a positive integer or 'max'")
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # SIGTERM: the same clean stop as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rates",
        type=_rates,
        default=_rates("1000,5000,max"),
        help="comma list of total transactions/s, or max (unpaced, --max-writers threads)",
    )
    parser.add_argument("--systems", default="lr,native", help="comma list of: lr, native")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds written before the measured window")
    parser.add_argument("--writers", type=int, default=4, help="writer threads of the paced rates")
    parser.add_argument("--max-writers", type=int, default=8, help="writer threads of the rate 'max'")
    parser.add_argument(
        "--lr-cmd",
        default="lr sync",
        help="the replicator's command line (default: %(default)s; a leading 'lr' is the venv's); "
        "the bench appends --topology FILE and sets LR_CONNECTIONS_FILE",
    )
    parser.add_argument(
        "--replicators",
        type=int,
        default=1,
        help="`lr sync` processes started side by side; they share the sessions (one per sink with 2)",
    )
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="longest wait for the last arrivals (s)")
    parser.add_argument("--stall", type=float, default=60.0, help="stop waiting after this long without an arrival (s)")
    parser.add_argument("--keep", action="store_true", help="leave the servers' data directory (and logs) in place")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "streaming_bench.json")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - {"lr", "native"}:
        parser.error(f"--systems: a comma list of lr, native (got {args.systems!r})")
    if args.seconds <= 0 or args.warmup < 0 or min(args.writers, args.max_writers, args.replicators) < 1:
        parser.error("--seconds must be > 0, --warmup >= 0, --writers, --max-writers and --replicators >= 1")

    signal.signal(signal.SIGTERM, _interrupt)
    load_before = os.getloadavg()
    home = Path(tempfile.mkdtemp(prefix="lr-streaming-bench-"))
    print(
        f"machine: {os.cpu_count()} cores, load {load_before[0]:.2f}; {platform.platform()}; "
        f"python {platform.python_version()}",
        flush=True,
    )
    print(f"starting {len(SITES)} PostgreSQL servers under {home} (default durability)", flush=True)
    manager = SiteManager(home)  # PostgreSQL's defaults beside the sites' own (wal_level=logical)
    results: list[Result] = []
    info: dict[str, Any] = {}
    interrupted = False
    try:
        env = start_servers(manager)
        info = versions(env.source_dsn, args.lr_cmd)
        print(
            f"PostgreSQL {info['server'].get('server_version')}, lr {info.get('airflow-provider-lr')} "
            f"({info['git']}), replicator: {args.lr_cmd}",
            flush=True,
        )
        for rate in args.rates:
            plan = Plan(rate, args.writers if rate else args.max_writers, args.warmup, args.seconds)
            for name in systems:
                settle(env)
                system: System = (
                    LrSystem(env, home, args.lr_cmd, str(rate or "max"), args.replicators)
                    if name == "lr"
                    else NativeSystem(env, SINKS)
                )
                try:
                    results.append(measure(system, plan, args.drain_timeout, args.stall))
                finally:
                    system.teardown()
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping everything", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            manager.down(mode="fast", remove=not args.keep)  # whatever started, even if start-up failed
        finally:
            if not args.keep:
                shutil.rmtree(home, ignore_errors=True)
            else:
                print(f"kept {home} (servers stopped; lr-sync-<rate>.log there)", file=sys.stderr)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    if results:
        print_table(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "args": {
                        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                        "rates": [r or "max" for r in args.rates],
                    },
                    "machine": {
                        "cpus": os.cpu_count(),
                        "platform": platform.platform(),
                        "python": platform.python_version(),
                        "loadavg_before": load_before,
                        "loadavg_after": os.getloadavg(),
                    },
                    "versions": info,
                    "results": [
                        {
                            "rate": r.rate,
                            "system": r.system,
                            "writers": r.writers,
                            **r.figures,
                            "drain_s": r.drain_s,
                            "drained": r.drained,
                            "details": r.details,
                        }
                        for r in results
                    ],
                },
                indent=2,
            )
        )
        print(f"\nwrote {args.out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
