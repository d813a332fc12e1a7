"""Several `lr sync` processes on one source share its sessions: started together they split them
(`lr status --json` names both holders), a SIGKILLed one's sessions are taken over within seconds
(not a full lease) with every entry at every sink exactly once and in order, and a third one
joining gets its share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from tests.support.session import queue, topology_doc, wait_for

CLIENTS = ("c0", "c1", "c2")
SINKS = ("site-b", "site-c")
ROOT = Path(__file__).resolve().parents[2]


def topology_file(tmp_path, sites, monkeypatch) -> str:
    """One source, two sinks, three clients (six sessions), reached through Airflow-style
    connections; the default lease (60 s), so a takeover in seconds is not an expiry."""
    for site in sites:
        conn_id = f"lr_test_{site.site_id.replace('-', '_')}"
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(site.server.airflow_conn(site.dbname)))
    doc = topology_doc(
        sites,
        [{"source": "site-a", "sinks": list(SINKS), "clients": list(CLIENTS)}],
        providers={c: "tests.support.session:empty_provider" for c in CLIENTS},
        conn_ids=lambda site_id: f"lr_test_{site_id.replace('-', '_')}",
    )
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", str(path)]) == 0
    return str(path)


def lr_sync(topo: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", topo],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def leases(topo: str, capsys) -> dict[str, dict]:
    """Session → its source row of `lr status --json` (holder, since when, held for how long)."""
    capsys.readouterr()
    cli.main(["status", "--topology", topo, "--json"])
    found = json.loads(capsys.readouterr().out)["sites"]["site-a"]["sessions"]
    return {f"{s['sink_site_id']}/{s['client_name']}": s for s in found if s["role"] == "source"}


def holders(topo: str, capsys) -> dict[str, str | None]:
    """Session → the pid in its lease holder's owner id (host:pid:uuid)."""
    return {
        session: s["lease_owner"].split(":")[1] if s["lease_owner"] else None
        for session, s in leases(topo, capsys).items()
    }


def split(held: dict[str, str | None], pids: set[str]) -> list[int]:
    """Sessions held by each of ``pids`` (sorted), or [] while some session has no holder."""
    return sorted(list(held.values()).count(pid) for pid in pids) if all(held.values()) else []


def streaming(source) -> int:
    """Sessions in log-entry sync under a lease."""
    return source.query(
        "SELECT count(*) FROM lr.source_sessions WHERE state = 'IN_LOG_ENTRY_SYNC' AND lease_owner IS NOT NULL"
    )[0][0]


class Writers:
    """A writer per client, each transmitting numbered payloads to both sinks until stopped (every
    ``pause`` seconds; ``change`` says what each transaction also does)."""

    pause = 0.01

    def __init__(self, source) -> None:
        self.source, self.stop = source, threading.Event()
        self.sent: dict[str, int] = dict.fromkeys(CLIENTS, 0)
        self.threads = [threading.Thread(target=self._write, args=(c,)) for c in CLIENTS]

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _write(self, client: str) -> None:
        conn = self.source.connect()
        transmit = RoutingQueueClient(conn, client)
        while not self.stop.is_set():
            n = self.sent[client] + 1
            with conn.cursor() as cur:
                self.change(cur, client, n)
            transmit.transmit_log_entry_message(f"{client}:{n}".encode(), list(SINKS))
            conn.commit()
            self.sent[client] = n
            self.stop.wait(self.pause)
        conn.close()

    def change(self, cur, client: str, n: int) -> None:
        """What transaction ``n`` of ``client`` does besides its transmit: nothing here."""

    def delivered(self, sinks) -> bool:
        """Every sink holds as many log entries of each client as were sent (the full sync's start
        and end markers are not entries: counted, they made this true two entries early)."""
        return all(
            sum(kind == "log" for kind, _ in queue(s, "site-a", client=c)) >= self.sent[c]
            for s in sinks
            for c in CLIENTS
        )

    def check(self, sinks) -> None:
        """Every payload at every sink once, in the order it was sent."""
        for sink in sinks:
            for client in CLIENTS:
                got = [p for kind, p in queue(sink, "site-a", client=client) if kind == "log"]
                assert got == [f"{client}:{i}" for i in range(1, self.sent[client] + 1)], (sink.site_id, client)


def stop(*processes: subprocess.Popen) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_two_lr_sync_split_the_sessions_and_the_survivor_of_a_sigkill_takes_all_within_seconds(
    lr_sites, tmp_path, monkeypatch, capsys
):
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    first, second = lr_sync(topo, tmp_path / "first.log"), lr_sync(topo, tmp_path / "second.log")
    pids = {str(first.pid), str(second.pid)}
    try:
        wait_for(lambda: streaming(source) == 6 and split(holders(topo, capsys), pids) == [3, 3], 60, "a split")
        with Writers(source) as writers:
            time.sleep(1.5)
            theirs = {session for session, pid in holders(topo, capsys).items() if pid == str(first.pid)}
            assert len(theirs) == 3
            first.send_signal(signal.SIGKILL)
            first.wait()
            killed = time.monotonic()
            wait_for(lambda: set(holders(topo, capsys).values()) == {str(second.pid)}, 10, "the survivor to hold all")
            took = time.monotonic() - killed
            held = {session: s["lease_held_s"] for session, s in leases(topo, capsys).items()}
            since_kill = time.monotonic() - killed
            time.sleep(1.5)
        assert took < 5.0, f"takeover took {took:.1f}s"
        # status says since when: the sessions taken over were taken after the kill, the others long before
        assert all(held[session] <= since_kill + 0.5 for session in theirs), (held, since_kill)
        assert all(held[session] > since_kill + 1.0 for session in set(held) - theirs), (held, since_kill)
        wait_for(lambda: writers.delivered(sinks), 30, "every entry at every sink")
        writers.check(sinks)
        assert second.poll() is None, "the survivor still streams"
    finally:
        stop(first, second)


@pytest.mark.slow
def test_a_third_lr_sync_joining_gets_its_share(lr_sites, tmp_path, monkeypatch, capsys):
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    processes = [lr_sync(topo, tmp_path / "first.log"), lr_sync(topo, tmp_path / "second.log")]
    try:
        pids = {str(p.pid) for p in processes}
        wait_for(lambda: streaming(source) == 6 and split(holders(topo, capsys), pids) == [3, 3], 60, "a split")
        with Writers(source) as writers:
            time.sleep(0.5)
            processes.append(lr_sync(topo, tmp_path / "third.log"))
            pids.add(str(processes[-1].pid))
            wait_for(
                lambda: streaming(source) == 6 and split(holders(topo, capsys), pids) == [2, 2, 2],
                30,
                "two sessions each",
            )
            time.sleep(1.0)
        wait_for(lambda: writers.delivered(sinks), 30, "every entry at every sink")
        writers.check(sinks)
        stop(processes[0])  # a clean stop: the others take its sessions at their next heartbeat
        wait_for(
            lambda: streaming(source) == 6 and set(holders(topo, capsys).values()) == pids - {str(processes[0].pid)},
            15,
            "a hand-over",
        )
    finally:
        stop(*processes)


def _synced(sinks, client: str) -> bool:
    """Every sink holds the client's full sync (its end marker)."""
    return all(("end", "") in queue(s, "site-a", client=client) for s in sinks)


@pytest.mark.slow
def test_lr_sync_follows_a_topology_apply_that_adds_and_removes_a_client(lr_sites, tmp_path, monkeypatch):
    """A running `lr sync` whose topology file is edited and applied (client c3 added, c2 removed)
    takes the new client's sessions up within seconds and lets the removed one's go, without a
    restart: before, c3's sessions waited for one and c2's failed at every retry."""
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    log = tmp_path / "sync.log"
    lr = lr_sync(topo, log)
    try:
        wait_for(lambda: streaming(source) == 6, 60, "six sessions streaming")
        doc = yaml.safe_load(Path(topo).read_text())
        doc["replication"][0]["clients"] = ["c0", "c1", "c3"]
        doc["providers"] = {c: "tests.support.session:empty_provider" for c in ("c0", "c1", "c3")}
        Path(topo).write_text(yaml.safe_dump(doc))
        assert cli.main(["topology", "apply", "--topology", topo]) == 0
        changed = log.read_text().count("\n")
        wait_for(lambda: streaming(source) == 6 and _synced(sinks, "c3"), 15, "c3's sessions synced and streaming")
        conn = source.connect()
        RoutingQueueClient(conn, "c3").transmit_log_entry_message(b"c3:1", list(SINKS))
        conn.commit()
        conn.close()
        wait_for(lambda: all(queue(s, "site-a", client="c3")[-1:] == [("log", "c3:1")] for s in sinks), 10, "c3")
        time.sleep(2.5)  # a removed session's retries (1 s, then 2 s) would show by now
        after = log.read_text().splitlines()[changed:]
        assert not [line for line in after if "/c2" in line and ("ERROR" in line or "failing" in line)], after
        assert lr.poll() is None
    finally:
        stop(lr)


@pytest.mark.slow
def test_lr_sync_stopped_while_it_joins_the_members_leaves_cleanly(lr_sites, tmp_path, monkeypatch):
    """SIGTERM (a service manager's stop or restart) arriving while `lr sync` is still starting (it
    has joined the source's members and waits for their heartbeats) stops it like any other
    SIGTERM: exit 0, it says so, and it leaves the members. Before, the handler was installed only
    after that start: the process died of the signal (exit -15) and stayed listed as a dead member."""
    source, *_ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    log = tmp_path / "sync.log"
    lr = lr_sync(topo, log)
    try:
        joined = "SELECT count(*) FROM lr.replicator_members WHERE owner LIKE %s"
        wait_for(lambda: source.query(joined, (f"%:{lr.pid}:%",))[0][0], 30, "lr sync to join the members")
        lr.send_signal(signal.SIGTERM)
        assert lr.wait(20) == 0, log.read_text()
    finally:
        stop(lr)
    assert "stopping (SIGTERM)" in log.read_text()
    assert source.query("SELECT owner FROM lr.replicator_members") == []
