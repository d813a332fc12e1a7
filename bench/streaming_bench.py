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
             full sync from the topology's provider ``streaming_bench:empty_full_state``).
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
import array
import contextlib
import ctypes
import importlib.metadata
import json
import multiprocessing as mp
import os
import pickle
import platform
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from fanout_anchors import (  # noqa: E402
    BenchEnv,
    _names,
    _poll,
    _ready_query,
    create_subscriptions,
    drop_replication,
    execute,
    settle,
)
from fanout_lr import CLIENT, LrSites  # noqa: E402

from airflow_provider_lr.client import RoutingQueueClient  # noqa: E402
from airflow_provider_lr.subscriber import RoutingQueueSubscriber  # noqa: E402

try:  # being moved behind the [embedded] extra (issue 18)
    from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
except ImportError:
    from airflow_provider_lr.sites import SiteManager  # noqa: E402

SITES = ["site-a", "site-b", "site-c"]
SINKS = SITES[1:]
BENCH_DB = "streaming_bench"
TABLE = "stream_lag"
PAYLOAD_BYTES = 256
HEADER = struct.Struct("<IQ")  # writer, seq: the front of every payload
PROVIDER = "streaming_bench:empty_full_state"  # importable by `lr sync`: the bench dir is on its PYTHONPATH
LR_STOP_S = 20.0  # SIGINT, then SIGTERM, then SIGKILL
POLL_S = 0.2


def empty_full_state(ctx: Any) -> None:
    """The bench client's full-sync provider: no state to supply (first contact is an empty full sync)."""


# --- writers ------------------------------------------------------------------------------------
Send = Callable[[int, int, bytes], None]  # (writer, seq, payload) inside the open transaction


@dataclass
class Plan:
    rate: int | None  # total target transactions/s; None = unpaced
    writers: int
    warmup: float
    seconds: float

    @property
    def label(self) -> str:
        return f"{self.rate}/s" if self.rate else "max"


class Writers:
    """W threads, one connection each; records the time just before each commit per (writer, seq)."""

    def __init__(self, plan: Plan, dsn: str, make_send: Callable[[Any], Send]) -> None:
        self.plan, self.dsn, self.make_send = plan, dsn, make_send
        self.precommit = [array.array("q") for _ in range(plan.writers)]  # index = seq
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.start_mono = self.start_ns = 0.0
        self._barrier = threading.Barrier(plan.writers + 1, action=self._mark_start)
        self._threads = [
            threading.Thread(target=self._run, args=(w,), name=f"writer-{w}", daemon=True) for w in range(plan.writers)
        ]

    def _mark_start(self) -> None:
        self.start_mono, self.start_ns = time.monotonic(), time.time_ns()

    def run(self) -> None:
        for t in self._threads:
            t.start()
        try:
            self._barrier.wait(timeout=60)  # every writer connected
            while any(t.is_alive() for t in self._threads):
                for t in self._threads:
                    t.join(timeout=0.2)
        except threading.BrokenBarrierError:
            self.errors.append("writers did not all connect")
        finally:
            self.stop.set()
            self._barrier.abort()
            for t in self._threads:
                t.join(timeout=30)
        if self.errors:
            raise RuntimeError(f"writer failed: {self.errors[0]}")

    def _run(self, w: int) -> None:
        try:
            conn = psycopg2.connect(self.dsn)
        except Exception as exc:
            self.errors.append(f"writer {w}: {exc!r}")
            self._barrier.abort()
            return
        try:
            send = self.make_send(conn)
            self._barrier.wait()
            times = self.precommit[w]
            plan = self.plan
            period = plan.writers / plan.rate if plan.rate else 0.0
            offset = period * w / plan.writers  # writers interleave instead of committing together
            end = self.start_mono + plan.warmup + plan.seconds
            seq = 0
            while not self.stop.is_set():
                now = time.monotonic()
                if period:
                    due = self.start_mono + offset + seq * period
                    if due > now:  # behind schedule: no pause, back to back until it catches up
                        time.sleep(due - now)
                        now = due
                if now >= end:
                    break
                send(w, seq, HEADER.pack(w, seq) + os.urandom(PAYLOAD_BYTES - HEADER.size))
                before_commit = time.time_ns()
                conn.commit()
                times.append(before_commit)  # only what committed is owed to the sinks
                seq += 1
        except threading.BrokenBarrierError:
            pass
        except Exception as exc:
            self.errors.append(f"writer {w}: {exc!r}")
            self.stop.set()
        finally:
            conn.close()

    @property
    def committed(self) -> int:
        return sum(len(t) for t in self.precommit)

    def window_ns(self) -> tuple[int, int]:
        start = int(self.start_ns + self.plan.warmup * 1e9)
        return start, int(start + self.plan.seconds * 1e9)


# --- arrivals and figures -----------------------------------------------------------------------
def _keys(writer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    return writer.astype(np.int64) << 40 | seq.astype(np.int64)


def figures(writers: Writers, arrivals: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """Per sink and pooled: delivered, lost, duplicated; lag percentiles of the measured window."""
    lo, hi = writers.window_ns()
    pre_keys = np.concatenate([_keys(np.full(len(t), w), np.arange(len(t))) for w, t in enumerate(writers.precommit)])
    pre_times = np.concatenate([np.frombuffer(t, dtype=np.int64) for t in writers.precommit])
    order = np.argsort(pre_keys)
    pre_keys, pre_times = pre_keys[order], pre_times[order]
    in_window = int(((pre_times >= lo) & (pre_times < hi)).sum())
    out: dict[str, Any] = {
        "committed": int(len(pre_keys)),
        "committed_in_window": in_window,
        "achieved_per_s": round(in_window / writers.plan.seconds, 1),
        "sinks": {},
    }
    lags = []
    for sink, (w, s, t) in arrivals.items():
        keys = _keys(w, s)
        uniq, first = np.unique(keys, return_index=True)
        pos = np.searchsorted(pre_keys, uniq)
        known = (pos < len(pre_keys)) & (pre_keys[np.minimum(pos, len(pre_keys) - 1)] == uniq)
        delivered = int(known.sum())
        committed_at = pre_times[pos[known]]
        arrived_at = t[first][known]
        chosen = (committed_at >= lo) & (committed_at < hi)
        lag = (arrived_at[chosen] - committed_at[chosen]) / 1e6
        lags.append(lag)
        out["sinks"][sink] = {
            "delivered": delivered,
            "lost": int(len(pre_keys) - delivered),
            "duplicated": int(len(keys) - len(uniq) + (~known).sum()),
            "lag_ms": _percentiles(lag),
        }
    pooled = np.concatenate(lags) if lags else np.empty(0)
    out["lag_ms"] = _percentiles(pooled)
    for k in ("delivered", "lost", "duplicated"):
        out[k] = sum(v[k] for v in out["sinks"].values())
    return out


def _percentiles(lag: np.ndarray) -> dict[str, float | int | None]:
    if not len(lag):
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None, "min": None}
    p50, p95, p99 = np.percentile(lag, [50, 95, 99])
    return {
        "n": int(len(lag)),
        "p50": round(float(p50), 2),
        "p95": round(float(p95), 2),
        "p99": round(float(p99), 2),
        "max": round(float(lag.max()), 2),
        "mean": round(float(lag.mean()), 2),
        "min": round(float(lag.min()), 2),
    }


# --- processes ----------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the bench dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _lr_preexec() -> None:
    """In the lr process before exec: SIGINT back to default (a bench started in the background
    ignores it, and its children would inherit that: `lr sync` would not stop on SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with_parent()


class _Recorder:
    """The sink application's listener: arrival time per (writer, seq) of every log entry."""

    def __init__(self, ready: Any, count: Any) -> None:
        self.ready, self.count = ready, count
        self.writer, self.seq, self.at = array.array("q"), array.array("q"), array.array("q")
        self.full_syncs = 0  # 1 expected: first contact (a later one would carry no payload: lost)

    def on_snapshot_sync_start(self, source: str) -> bool:
        self.full_syncs += 1
        return True

    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool:
        return True

    def on_snapshot_sync_complete(self, source: str) -> bool:
        self.ready.set()  # first contact done: log entries follow
        return True

    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool:
        now = time.time_ns()
        for p in payloads:
            w, s = HEADER.unpack_from(p)
            self.writer.append(w)
            self.seq.append(s)
            self.at.append(now)
        self.count.value += len(payloads)
        return True

    def on_error(self, source: str, error: Any) -> None:
        print(f"subscriber: {source}: {error}", file=sys.stderr, flush=True)


def _subscribe(dsn: str, out: str, ready: Any, stop: Any, count: Any) -> None:
    """A sink application in its own process: ``RoutingQueueSubscriber.run`` until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops it (Ctrl-C reaches the whole group)
    _die_with_parent()
    recorder = _Recorder(ready, count)
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
                "writer": recorder.writer.tobytes(),
                "seq": recorder.seq.tobytes(),
                "at": recorder.at.tobytes(),
                "error": error,
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                "full_syncs": recorder.full_syncs,
                "stats": {
                    k: getattr(stats, k, None) for k in ("delivered", "refused", "failures", "dead_letters", "busy")
                },
                "errors": [str(e) for e in getattr(stats, "errors", [])][-5:],
            }
        )
    )


def _cpu_s(pid: int) -> float | None:
    """utime + stime of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return None


def lr_command(line: str) -> list[str]:
    """``--lr-cmd`` as argv; a leading ``lr`` is the console script beside this interpreter."""
    argv = shlex.split(line)
    script = Path(sys.executable).parent / "lr"
    if argv[:1] == ["lr"] and script.exists():
        argv[0] = str(script)
    return argv


# --- the systems --------------------------------------------------------------------------------
class System:
    name = ""

    def setup(self) -> None: ...
    def source_dsn(self) -> str: ...
    def make_send(self, conn: Any) -> Send: ...
    def delivered_counts(self) -> list[int]: ...
    def check_alive(self) -> None: ...
    def collect(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]: ...
    def details(self) -> dict[str, Any]:
        return {}

    def teardown(self) -> None: ...


class LrSystem(System):
    """``lr sync`` in its own process group + one subscriber process per sink, on fresh databases."""

    name = "lr"

    def __init__(self, env: BenchEnv, home: Path, lr_cmd: str, tag: str, ready_timeout: float = 180.0) -> None:
        self.env, self.home, self.lr_cmd, self.ready_timeout = env, home, lr_cmd, ready_timeout
        self.sites: LrSites | None = None
        self.proc: subprocess.Popen | None = None
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
        cmd = [*lr_command(self.lr_cmd), "--topology", str(self.sites.topology_file)]
        env = {
            **os.environ,
            "LR_CONNECTIONS_FILE": str(self.sites.connections),
            "LR_HOME": str(self.home / "lr-home"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        self._details["lr_cmd"] = shlex.join(cmd)
        with open(self.log, "wb") as log:
            log.write(f"=== {shlex.join(cmd)}\n".encode())
            log.flush()
            # Its own session: a Ctrl-C on the bench's terminal does not reach it; the bench stops it
            # (SIGINT: `lr sync` closes its sessions and exits), and PDEATHSIG if the bench is killed.
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.home,
                start_new_session=True,
                preexec_fn=_lr_preexec,
            )
        deadline = time.monotonic() + self.ready_timeout
        while not all(ready.is_set() for _, _, ready, _, _ in self.subs):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sessions not in log-entry sync after {self.ready_timeout:.0f} s\n{self.log_tail()}"
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
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the lr process exited ({self.proc.returncode}):\n{self.log_tail()}")
        for sink, proc, *_ in self.subs:
            if not proc.is_alive():
                raise RuntimeError(f"the subscriber of {sink} exited ({proc.exitcode})")

    def collect(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        self._details["lr_cpu_s"] = _cpu_s(self.proc.pid) if self.proc else None  # before it exits
        self._stop_subscribers()
        self._stop_lr()
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
            out[sink] = tuple(np.frombuffer(got[k], dtype=np.int64) for k in ("writer", "seq", "at"))
        return out

    def details(self) -> dict[str, Any]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        self._details["lr_log_error_lines"] = sum(
            1 for line in text.splitlines() if "ERROR" in line or " failed" in line
        )
        self._details["lr_exit"] = self.proc.returncode if self.proc else None
        return self._details

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _stop_subscribers(self) -> None:
        self.stop_subs.set()
        for _, proc, *_ in self.subs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def _stop_lr(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, LR_STOP_S), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # its own process group, created for it
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def teardown(self) -> None:
        try:
            self._stop_subscribers()
        finally:
            try:
                self._stop_lr()
            finally:
                if self.sites is not None:
                    with contextlib.suppress(psycopg2.Error):
                        self.sites.drop()
                    self.sites = None


class NativeSystem(System):
    """Publication + one subscription per sink; the sinks' trigger stamps each row's arrival."""

    name = "native"

    def __init__(self, env: BenchEnv) -> None:
        self.env = env

    def setup(self) -> None:
        self.teardown()
        execute(
            self.env.source_dsn,
            f"CREATE TABLE {TABLE} (writer int, seq bigint, payload bytea NOT NULL, PRIMARY KEY (writer, seq))",
        )
        for i, dsn in enumerate(self.env.sink_dsns):
            execute(
                dsn,
                f"CREATE TABLE {TABLE} (writer int, seq bigint, payload bytea NOT NULL, arrived_at timestamptz, "
                "PRIMARY KEY (writer, seq))",
                f"CREATE FUNCTION {TABLE}_arrival() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN NEW.arrived_at := clock_timestamp(); RETURN NEW; END $$",
                f"CREATE TRIGGER {TABLE}_arrival BEFORE INSERT ON {TABLE} FOR EACH ROW EXECUTE FUNCTION {TABLE}_arrival()",
                f"ALTER TABLE {TABLE} ENABLE ALWAYS TRIGGER {TABLE}_arrival",
            )  # apply workers fire ALWAYS triggers
            pub, _ = _names(TABLE, i)
            execute(self.env.source_dsn, f"CREATE PUBLICATION {pub} FOR TABLE {TABLE} WITH (publish = 'insert')")
        create_subscriptions(self.env, TABLE, copy_data=False)
        _poll(
            self.env.sink_dsns,
            _ready_query(TABLE),
            lambda rows: bool(rows) and all(state == "r" and running for state, running in rows),
            timeout_s=120,
        )

    def source_dsn(self) -> str:
        return self.env.source_dsn

    def make_send(self, conn: Any) -> Send:
        cur = conn.cursor()
        return lambda w, seq, payload: cur.execute(f"INSERT INTO {TABLE} VALUES (%s, %s, %s)", (w, seq, payload))

    def delivered_counts(self) -> list[int]:
        return [execute(dsn, f"SELECT count(*) FROM {TABLE}")[0][0] for dsn in self.env.sink_dsns]

    def check_alive(self) -> None:
        pass

    def collect(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        out = {}
        for sink, dsn in zip(SINKS, self.env.sink_dsns):
            rows = execute(dsn, f"SELECT writer, seq, (extract(epoch FROM arrived_at) * 1000000)::bigint FROM {TABLE}")
            a = np.array(rows, dtype=np.int64).reshape(-1, 3)
            out[sink] = (a[:, 0], a[:, 1], a[:, 2] * 1000)
        return out

    def teardown(self) -> None:
        drop_replication(self.env)
        for dsn in (self.env.source_dsn, *self.env.sink_dsns):
            with contextlib.suppress(psycopg2.Error):
                execute(dsn, f"DROP TABLE IF EXISTS {TABLE}", f"DROP FUNCTION IF EXISTS {TABLE}_arrival()")


# --- one measurement ----------------------------------------------------------------------------
@dataclass
class Result:
    rate: str
    system: str
    writers: int
    figures: dict[str, Any]
    drain_s: float
    drained: bool
    details: dict[str, Any] = field(default_factory=dict)


def measure(system: System, plan: Plan, drain_timeout: float, stall: float) -> Result:
    t0 = time.perf_counter()
    system.setup()
    print(
        f"[{plan.label} {system.name}] ready in {time.perf_counter() - t0:.1f} s; "
        f"writing {plan.warmup:g} + {plan.seconds:g} s with {plan.writers} writers …",
        end=" ",
        flush=True,
    )
    writers = Writers(plan, system.source_dsn(), system.make_send)
    watch = threading.Event()

    def watchdog() -> None:  # a replicator that dies mid-run stops the writers early
        while not watch.wait(0.5):
            try:
                system.check_alive()
            except RuntimeError as exc:
                writers.errors.append(str(exc))
                writers.stop.set()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        writers.run()
    finally:
        watch.set()
    committed = writers.committed
    drain_from = time.monotonic()
    last, last_change, drained = None, drain_from, False
    while True:
        system.check_alive()
        counts = system.delivered_counts()
        if all(c >= committed for c in counts):
            drained = True
            break
        now = time.monotonic()
        if counts != last:
            last, last_change = counts, now
        if now - last_change > stall or now - drain_from > drain_timeout:
            break
        time.sleep(POLL_S)
    drain_s = time.monotonic() - drain_from
    fig = figures(writers, system.collect())
    lag = fig["lag_ms"]
    print(
        f"{fig['achieved_per_s']:,.0f}/s, p50 {lag['p50']} ms, p99 {lag['p99']} ms, "
        f"lost {fig['lost']}, duplicated {fig['duplicated']} (drained in {drain_s:.1f} s)",
        flush=True,
    )
    return Result(plan.label, system.name, plan.writers, fig, round(drain_s, 2), drained, system.details())


# --- the run ------------------------------------------------------------------------------------
def start_servers(manager: SiteManager) -> BenchEnv:
    """3 embedded servers (site-a, site-b, site-c) with PostgreSQL's default durability."""
    servers = manager.up(count=len(SITES))
    for server in servers:
        execute(server.dsn(), f"CREATE DATABASE {BENCH_DB}")
    return BenchEnv(servers[0].dsn(BENCH_DB), [s.dsn(BENCH_DB) for s in servers[1:]], manager)


def versions(env: BenchEnv, lr_cmd: str) -> dict[str, Any]:
    keys = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_level", "shared_buffers")
    out: dict[str, Any] = {
        "server": dict(execute(env.source_dsn, f"SELECT name, setting FROM pg_settings WHERE name IN {keys!r}"))
    }
    for dist in ("airflow-provider-lr", "psycopg2-binary", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    out["git"] = git.stdout.strip() or None
    out["lr_cmd"] = lr_cmd
    return out


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
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="longest wait for the last arrivals (s)")
    parser.add_argument("--stall", type=float, default=60.0, help="stop waiting after this long without an arrival (s)")
    parser.add_argument("--keep", action="store_true", help="leave the servers' data directory (and logs) in place")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "streaming_bench.json")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - {"lr", "native"}:
        parser.error(f"--systems: a comma list of lr, native (got {args.systems!r})")
    if args.seconds <= 0 or args.warmup < 0 or args.writers < 1 or args.max_writers < 1:
        parser.error("--seconds must be > 0, --warmup >= 0, --writers and --max-writers >= 1")

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
        info = versions(env, args.lr_cmd)
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
                    LrSystem(env, home, args.lr_cmd, str(rate or "max")) if name == "lr" else NativeSystem(env)
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
