"""What the streaming benches share (``streaming_bench.py``, ``scale_bench.py``, ``table_bench.py``):
paced writers that record the time just before each commit, the lag and loss figures from what the
sink applications recorded, ``lr sync`` as a separate process, native logical replication with one
subscription per sink, and the measurement of one system (set up, write, drain, collect).

Writers: W threads (one connection each), each a loop of one transaction per payload of 256 bytes
(writer id and sequence number in front of random bytes), paced to the target total rate by a fixed
schedule per writer (one behind schedule commits back to back until it catches up, so a target out
of reach measures what W writers reach). The time just before ``commit()`` is recorded per
(writer, seq): ``time.time_ns()``, the machine's real-time clock, which the other processes and the
servers read.

lag = arrival at the sink application − the time just before the writer's commit, for every
transaction committed in the measured window (after the warm-up). Delivered, lost and duplicated
count every transaction the writers committed (warm-up included) that a session owes its sink.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import importlib.metadata
import os
import resource
import shlex
import signal
import struct
import subprocess
import sys
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
    create_subscriptions,
    drop_replication,
    execute,
    server_cpu_s,
    subscriptions_ready,
)

TABLE = "stream_lag"
PAYLOAD_BYTES = 256
HEADER = struct.Struct("<IQ")  # writer, seq: the front of every payload
PROVIDER = "streaming_common:empty_full_state"  # importable by `lr sync`: the bench dir is on its PYTHONPATH
LR_STOP_S = 20.0  # SIGINT, then SIGTERM, then SIGKILL
POLL_S = 0.2


def empty_full_state(ctx: Any) -> None:
    """The bench clients' full-sync provider: no state to supply (first contact is an empty full sync)."""


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
Arrivals = tuple[np.ndarray, np.ndarray, np.ndarray]  # writer, seq, arrival time (ns) of each delivery
Owed = Callable[[str, np.ndarray, np.ndarray], np.ndarray]  # (session, writer, seq) -> which it owes


def _keys(writer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    return writer.astype(np.int64) << 40 | seq.astype(np.int64)


def owes_everything(session: str, writer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Every sink is owed every committed transaction (one client, every message to every sink)."""
    return np.ones(len(writer), dtype=bool)


def figures(writers: Writers, arrivals: dict[str, Arrivals], owed: Owed = owes_everything) -> dict[str, Any]:
    """Per session (a sink, or a sink's client) and pooled: delivered, lost, duplicated; lag
    percentiles of the measured window. ``owed``: the transactions each session must deliver (an
    arrival of one it does not owe counts as duplicated)."""
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
    for session, (w, s, t) in arrivals.items():
        owes = owed(session, pre_keys >> 40, pre_keys & ((1 << 40) - 1))
        keys = _keys(w, s)
        uniq, first = np.unique(keys, return_index=True)
        pos = np.minimum(np.searchsorted(pre_keys, uniq), len(pre_keys) - 1)
        known = (pre_keys[pos] == uniq) & owes[pos] if len(pre_keys) else np.zeros(len(uniq), dtype=bool)
        delivered = int(known.sum())
        committed_at = pre_times[pos[known]]
        arrived_at = t[first][known]
        chosen = (committed_at >= lo) & (committed_at < hi)
        lag = (arrived_at[chosen] - committed_at[chosen]) / 1e6
        lags.append(lag)
        out["sinks"][session] = {
            "delivered": delivered,
            "lost": int(owes.sum()) - delivered,
            "duplicated": int(len(keys) - len(uniq) + (~known).sum()),
            "lag_ms": percentiles(lag),
        }
    pooled = np.concatenate(lags) if lags else np.empty(0)
    out["lag_ms"] = percentiles(pooled)
    for k in ("delivered", "lost", "duplicated"):
        out[k] = sum(v[k] for v in out["sinks"].values())
    return out


def percentiles(lag: np.ndarray) -> dict[str, float | int | None]:
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


class Recorder:
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

    def arrivals(self) -> dict[str, Any]:
        """What the bench reads back (pickled by the subscriber process)."""
        return {
            "writer": self.writer.tobytes(),
            "seq": self.seq.tobytes(),
            "at": self.at.tobytes(),
            "full_syncs": self.full_syncs,
        }


def arrivals_of(got: dict[str, Any]) -> Arrivals:
    w, s, t = (np.frombuffer(got[k], dtype=np.int64) for k in ("writer", "seq", "at"))
    return w, s, t


# --- processes ----------------------------------------------------------------------------------
def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the bench dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def lr_preexec() -> None:
    """In the lr process before exec: SIGINT back to default (a bench started in the background
    ignores it, and its children would inherit that: `lr sync` would not stop on SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


def cpu_s(pid: int) -> float | None:
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


def stop_processes(procs: list[Any], stop: Any) -> None:
    """Set ``stop`` (the multiprocessing event the bench's child processes wait on), then join each,
    terminating and killing the ones that do not end."""
    stop.set()
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


class LrProcess:
    """``lr sync`` (``--lr-cmd``) the way a user runs it, with ``--topology FILE`` appended and
    ``LR_CONNECTIONS_FILE`` set. Its own process group: a Ctrl-C on the bench's terminal does not
    reach it; ``stop`` sends SIGINT (``lr sync`` releases its sessions and exits), then SIGTERM, then
    SIGKILL, and PDEATHSIG stops it if the bench is killed. ``app_name``: its connections'
    ``application_name`` (``PGAPPNAME``), by which ``pg_stat_activity`` tells its backends apart."""

    def __init__(
        self, lr_cmd: str, topology: Path, connections: Path, home: Path, log: Path, app_name: str | None = None
    ) -> None:
        self.cmd = [*lr_command(lr_cmd), "--topology", str(topology)]
        self.env = {
            **os.environ,
            "LR_CONNECTIONS_FILE": str(connections),
            "LR_HOME": str(home / "lr-home"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            **({"PGAPPNAME": app_name} if app_name else {}),
        }
        self.home, self.log = home, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"=== {shlex.join(self.cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.home,
                start_new_session=True,
                preexec_fn=lr_preexec,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the lr process exited ({self.proc.returncode}):\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to its whole process group (a catch-up's child processes too)."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(timeout=30)

    def stop(self) -> None:
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

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def error_lines(self) -> int:
        return sum(1 for line in self.log_text().splitlines() if "ERROR" in line or " failed" in line)


# --- the systems --------------------------------------------------------------------------------
class System:
    """One replication system under measurement, on fresh databases: ``setup``, writers on
    ``source_dsn`` through ``make_send``, ``delivered_counts`` while draining, ``collect`` the
    arrivals per session, ``teardown``. ``writing`` and ``drained`` bracket the work it is billed for."""

    name = ""

    def setup(self) -> None: ...
    def source_dsn(self) -> str: ...
    def make_send(self, conn: Any) -> Send: ...
    def delivered_counts(self) -> list[int]: ...
    def owed_counts(self, writers: Writers) -> list[int]:
        """What each session of ``delivered_counts`` must reach (default: every committed transaction)."""
        return [writers.committed] * len(self.delivered_counts())

    def check_alive(self) -> None: ...
    def writing(self) -> None:
        """Just before the writers start."""

    def drained(self) -> None:
        """After the drain, before ``collect`` stops anything."""

    def collect(self) -> dict[str, Arrivals]: ...
    def owed(self, session: str, writer: np.ndarray, seq: np.ndarray) -> np.ndarray:
        return owes_everything(session, writer, seq)

    def details(self) -> dict[str, Any]:
        return {}

    def processes(self) -> dict[str, list[int]]:
        """The system's own processes outside the servers, by group (``lr sync``, subscribers)."""
        return {}

    def servers(self) -> dict[str, list[str]]:
        """A DSN of each server the system uses, by group (source, sinks)."""
        env = getattr(self, "env", None)
        return {"source": [env.source_dsn], "sinks": list(env.sink_dsns)} if isinstance(env, BenchEnv) else {}

    def teardown(self) -> None: ...


class NativeSystem(System):
    """Publication + one subscription per sink; the sinks' trigger stamps each row's arrival.

    One publication per sink on the source's table ``stream_lag (writer int, seq bigint, payload
    bytea, PRIMARY KEY (writer, seq))`` and one subscription per sink (``copy_data = false``);
    writers insert one row per transaction. The sink's copy of the table has ``arrived_at``, set by a
    ``BEFORE INSERT`` trigger to ``clock_timestamp()`` (``ENABLE ALWAYS TRIGGER``: the apply worker
    fires it). The sink table's primary key makes a duplicate an apply error (the subscription
    stalls: it shows as lost)."""

    name = "native"

    def __init__(self, env: BenchEnv, sinks: list[str], writer_dsn: str | None = None) -> None:
        self.env, self.sinks = env, sinks
        self.writer_dsn = writer_dsn or env.source_dsn

    def setup(self) -> None:
        self.clear()
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
        subscriptions_ready(self.env.sink_dsns, TABLE, timeout_s=120, running=True)

    def source_dsn(self) -> str:
        return self.writer_dsn

    def make_send(self, conn: Any) -> Send:
        cur = conn.cursor()
        return lambda w, seq, payload: cur.execute(f"INSERT INTO {TABLE} VALUES (%s, %s, %s)", (w, seq, payload))

    def delivered_counts(self) -> list[int]:
        return [execute(dsn, f"SELECT count(*) FROM {TABLE}")[0][0] for dsn in self.env.sink_dsns]

    def check_alive(self) -> None:
        pass

    def collect(self) -> dict[str, Arrivals]:
        out = {}
        for sink, dsn in zip(self.sinks, self.env.sink_dsns):
            rows = execute(dsn, f"SELECT writer, seq, (extract(epoch FROM arrived_at) * 1000000)::bigint FROM {TABLE}")
            a = np.array(rows, dtype=np.int64).reshape(-1, 3)
            out[sink] = (a[:, 0], a[:, 1], a[:, 2] * 1000)
        return out

    def teardown(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Subscriptions (their slots), publications, tables and the trigger's function."""
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


def wait_drained(system: System, owed: list[int], give_up: Callable[[float, float], bool]) -> bool:
    """Poll until every session holds what it owes (True), or ``give_up(now, last_change)`` says
    to stop waiting (False); ``last_change``: when the delivered counts last moved."""
    last: list[int] | None = None
    last_change = time.monotonic()
    while True:
        system.check_alive()
        counts = system.delivered_counts()
        if all(c >= o for c, o in zip(counts, owed)):
            return True
        now = time.monotonic()
        if counts != last:
            last, last_change = counts, now
        if give_up(now, last_change):
            return False
        time.sleep(POLL_S)


def cpu_snapshot(system: System) -> dict[str, float]:
    """CPU seconds so far: each group of the system's servers (every process of a server, exited
    backends included) and of its processes, and this process (the writers). Per process, from
    /proc/PID/stat: the machine's own counters (/proc/stat) sample at the tick and miss most of
    the short bursts a lightly loaded replication runs in."""
    snap = {group: sum(server_cpu_s(dsn) for dsn in dsns) for group, dsns in system.servers().items()}
    for group, pids in system.processes().items():
        snap[group] = sum(cpu_s(pid) or 0.0 for pid in pids)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    snap["writers"] = usage.ru_utime + usage.ru_stime
    return snap


def cpu_figures(before: dict[str, float], after: dict[str, float], seconds: float, transactions: int) -> dict[str, Any]:
    """What each group spent over the measured window, and all of them: CPU per committed transaction
    (ms) and cores."""
    spent = {group: after[group] - before[group] for group in after if group in before}
    spent["total"] = sum(spent.values())
    return {
        "window_s": round(seconds, 2),
        "ms_per_tx": {g: round(1000 * v / transactions, 3) for g, v in spent.items()} if transactions else {},
        "cores": {g: round(v / seconds, 3) for g, v in spent.items()} if seconds > 0 else {},
        "cores_available": os.cpu_count(),
    }


def measure(system: System, plan: Plan, drain_timeout: float, stall: float, label: str = "") -> Result:
    """Set up, write ``plan`` (a replicator that dies mid-run stops the writers early), wait until every
    session holds what it owes (or ``drain_timeout``, or ``stall`` seconds without progress), collect."""
    t0 = time.perf_counter()
    system.setup()
    tag = f"[{label or plan.label} {system.name}]"
    print(
        f"{tag} ready in {time.perf_counter() - t0:.1f} s; writing {plan.warmup:g} + {plan.seconds:g} s "
        f"with {plan.writers} writers …",
        end=" ",
        flush=True,
    )
    writers = Writers(plan, system.source_dsn(), system.make_send)
    watch = threading.Event()

    def watchdog() -> None:
        while not watch.wait(0.5):
            try:
                system.check_alive()
            except RuntimeError as exc:
                writers.errors.append(str(exc))
                writers.stop.set()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    system.writing()
    cpu: list[tuple[float, dict[str, float]]] = []  # (monotonic, snapshot) at the window's start and end
    mark = threading.Timer(plan.warmup, lambda: cpu.append((time.monotonic(), cpu_snapshot(system))))
    mark.start()
    try:
        writers.run()
    finally:
        watch.set()
        mark.cancel()
    if len(cpu) == 1:
        cpu.append((time.monotonic(), cpu_snapshot(system)))
    drain_from = time.monotonic()
    drained = wait_drained(
        system,
        system.owed_counts(writers),
        lambda now, last_change: now - last_change > stall or now - drain_from > drain_timeout,
    )
    drain_s = time.monotonic() - drain_from
    system.drained()
    fig = figures(writers, system.collect(), system.owed)
    lag = fig["lag_ms"]
    print(
        f"{fig['achieved_per_s']:,.0f}/s, p50 {lag['p50']} ms, p99 {lag['p99']} ms, "
        f"lost {fig['lost']}, duplicated {fig['duplicated']} (drained in {drain_s:.1f} s)",
        flush=True,
    )
    details = system.details()
    if len(cpu) == 2:
        (t0, before), (t1, after) = cpu
        details["cpu"] = cpu_figures(before, after, t1 - t0, fig["committed_in_window"])
        per_tx = details["cpu"]["ms_per_tx"]
        print(
            f"{tag} CPU per transaction over the window: "
            + ", ".join(f"{g} {v:.3f} ms" for g, v in per_tx.items())
            + f"; {details['cpu']['cores']['total']:.2f} of {os.cpu_count()} cores",
            flush=True,
        )
    return Result(plan.label, system.name, plan.writers, fig, round(drain_s, 2), drained, details)


def versions(source_dsn: str, lr_cmd: str) -> dict[str, Any]:
    keys = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_level", "shared_buffers")
    out: dict[str, Any] = {
        "server": dict(execute(source_dsn, f"SELECT name, setting FROM pg_settings WHERE name IN {keys!r}"))
    }
    for dist in ("airflow-provider-lr", "psycopg2-binary", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    out["git"] = git.stdout.strip() or None
    out["lr_cmd"] = lr_cmd
    return out
