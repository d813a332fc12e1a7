"""What a measured run costs, by role: CPU seconds, connections per database, threads and memory.

A role is either processes (a replicator and the processes of its group, the sink applications: by
pid) or PostgreSQL backends (``pg_stat_activity``: by ``application_name``, which the bench sets for
each process it starts with ``PGAPPNAME``, or by ``backend_type`` for native replication's
walsenders and apply workers). Every ``every`` seconds the probe lists each server's backends and
reads ``/proc/<pid>/stat`` of every process of a role: a backend that ends between two samples is
billed up to the last one (connections here are long-lived; a sample every 0.5 s misses little).

CPU of a process = utime + stime, plus cutime + cstime of its children it waited for; billed from
``start`` (what a process had used before is left out) to ``stop``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions

TICK = os.sysconf("SC_CLK_TCK")
APP_NAME = "lr-bench-probe"

Backend = Callable[[str, str], bool]  # (application_name, backend_type) -> of this role


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(process group, CPU ticks: utime + stime + cutime + cstime) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[2]), sum(int(f) for f in fields[11:15])
    except (OSError, IndexError, ValueError):
        return None


def proc_status(pid: int) -> tuple[int, float] | None:
    """(threads, resident memory in MB) of a live process."""
    try:
        lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return int(lines["Threads"]), int(lines["VmRSS"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


def group_cpu_s(leader: int) -> float:
    """CPU seconds of a process group now (a replicator and the processes it started)."""
    total = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat and (stat[0] == leader or int(entry.name) == leader):
                total += stat[1]
    return total / TICK


@dataclass
class Usage:
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds between start and stop
    connections: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> database -> most at once
    connections_total: dict[str, int] = field(default_factory=dict)  # role -> most at once, all databases
    connections_end: dict[str, int] = field(default_factory=dict)  # role -> all databases, at the last sample
    threads: int = 0  # most threads of a watched process
    rss_mb: float = 0.0  # most resident memory of a watched process
    samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "cpu_s": {k: round(v, 2) for k, v in sorted(self.cpu_s.items())},
            "connections": self.connections,
            "connections_total": self.connections_total,
            "connections_end": self.connections_end,
            "threads": self.threads,
            "rss_mb": round(self.rss_mb, 1),
            "samples": self.samples,
        }


class Probe:
    """Samples the roles' CPU and connections on a thread between ``start`` and ``stop``.

    ``servers``: one DSN per PostgreSQL server (any database: ``pg_stat_activity`` shows them all);
    ``backends``: role -> which backends; ``processes``: role -> the pids of its processes (a pid
    that leads a process group brings the group); ``watch``: the pids whose threads and memory count."""

    def __init__(
        self,
        servers: list[str],
        backends: dict[str, Backend],
        processes: dict[str, Callable[[], Iterable[int]]],
        watch: Callable[[], Iterable[int]] = lambda: (),
        every: float = 0.5,
    ) -> None:
        self.servers, self.backends, self.processes, self.watch, self.every = servers, backends, processes, watch, every
        self.usage = Usage()
        self._base: dict[int, int] = {}  # pid -> ticks at start
        self._last: dict[int, int] = {}  # pid -> ticks at its last sample
        self._role: dict[int, str] = {}
        self._conns: list[psycopg2.extensions.connection] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="usage-probe", daemon=True)

    def start(self) -> None:
        for dsn in self.servers:
            conn = psycopg2.connect(dsn, application_name=APP_NAME)
            conn.autocommit = True
            self._conns.append(conn)
        self._sample(baseline=True)
        self._thread.start()

    def stop(self) -> Usage:
        self._stop.set()
        self._thread.join(timeout=30)
        self._sample()
        for conn in self._conns:
            conn.close()
        cpu: Counter[str] = Counter({role: 0 for role in [*self.backends, *self.processes]})
        for pid, role in self._role.items():
            cpu[role] += self._last[pid] - self._base.get(pid, 0)
        self.usage.cpu_s = {role: ticks / TICK for role, ticks in cpu.items()}
        return self.usage

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def _sample(self, baseline: bool = False) -> None:
        roles: dict[int, str] = {}
        per_db: Counter[tuple[str, str]] = Counter()
        for conn in self._conns:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT pid, coalesce(datname, ''), coalesce(application_name, ''), coalesce(backend_type, '') "
                    "FROM pg_catalog.pg_stat_activity WHERE pid <> pg_catalog.pg_backend_pid()"
                )
                for pid, db, app, kind in cur.fetchall():
                    role = next((r for r, test in self.backends.items() if test(app, kind)), None)
                    if role is not None:
                        roles[pid] = role
                        per_db[role, db] += 1
        leaders = {pid: role for role, pids in self.processes.items() for pid in pids()}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            stat = proc_stat(pid)  # its process group tells a replicator's children
            if stat is None:
                continue
            role = roles.get(pid) or leaders.get(pid) or leaders.get(stat[0])
            if role is None:
                continue
            self._role[pid] = role
            self._last[pid] = stat[1]
            if baseline:
                self._base[pid] = stat[1]
        for (role, db), n in per_db.items():
            held = self.usage.connections.setdefault(role, {})
            held[db] = max(held.get(db, 0), n)
        for role in self.backends:
            total = sum(n for (r, _), n in per_db.items() if r == role)
            self.usage.connections_total[role] = max(self.usage.connections_total.get(role, 0), total)
            self.usage.connections_end[role] = total
        for pid in self.watch():
            status = proc_status(pid)
            if status:
                self.usage.threads = max(self.usage.threads, status[0])
                self.usage.rss_mb = max(self.usage.rss_mb, status[1])
        self.usage.samples += 1
