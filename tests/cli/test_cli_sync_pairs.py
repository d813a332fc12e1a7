"""Pairs of events under `lr sync` (streaming, the default) that no other test puts together, each
on one source, two sinks and three clients (client c0 also carrying the federated table
``public.items``), writers transmitting numbered payloads all along:

* a full sync asked for one client while another client of the same source streams, and a sink's
  server restarted at once;
* a sink's server stopped while a full sync of the federated table is under way, then started;
* the same table's full sync asked twice at once, while two `lr sync` share the sessions;
* a client's sessions removed by a topology apply while its table snapshot is written, then added back;
* a client added to the running stream and a full sync asked for another at the same moment;
* the topology file edited (a client added) and applied a while later, `lr sync` running;
* `lr sync` SIGKILLed while a table's full sync is written, and started again;
* a full sync asked for all 18 sessions of nine clients at once, a sink restarting;
* a planned switchover while a table snapshot is written, its file written over the one `lr sync` follows.

Every one ends with the same checks, within a stated deadline: every sink's table equals the
source's, every payload at every sink once and in order (a session that took a full sync: its
entries before the base are replaced by it, the rest once and in order), no full-sync request
left open, every `lr sync` still running and none printed a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import psycopg2.errors
import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import TransmitError
from tests.cli.test_cli_sync_members import CLIENTS, SINKS, lr_sync, stop, streaming, topology_file
from tests.cli.test_cli_sync_members_tables import ITEMS, SwappingWriters
from tests.support.session import queue, wait_for
from tests.support.tables import federate, rows

DEADLINE = 60  # seconds: what each scenario allows lr to converge after its event


def items(source) -> None:
    source.query(
        "CREATE TABLE public.items (id int PRIMARY KEY, u int NOT NULL UNIQUE, n int NOT NULL DEFAULT 0, nonkey text)"
    )
    source.query("INSERT INTO public.items (id, u) SELECT g, g FROM generate_series(1, %s) g", (ITEMS,))
    federate(source, "public.items", client="c0")


class RefusedWriters(SwappingWriters):
    """The same writers, as an application whose transactions a site may refuse for a while (its
    client removed from the topology): a refused transaction is rolled back and tried again later."""

    def _write(self, client: str) -> None:
        conn = self.source.connect()
        transmit = RoutingQueueClient(conn, client)
        while not self.stop.is_set():
            n = self.sent[client] + 1
            try:
                with conn.cursor() as cur:
                    self.change(cur, client, n)
                transmit.transmit_log_entry_message(f"{client}:{n}".encode(), list(SINKS))
                conn.commit()
            except (psycopg2.errors.ReadOnlySqlTransaction, TransmitError):
                conn.rollback()
                self.refused += 1
            else:
                self.sent[client] = n
            self.stop.wait(self.pause)
        conn.close()

    refused = 0


def bulk(source, n: int = 100_000) -> None:
    """A second table of client c0, large enough that its snapshot takes a while."""
    source.query("CREATE TABLE public.bulk (id int PRIMARY KEY, pad text)")
    source.query("INSERT INTO public.bulk SELECT g, repeat('x', 200) FROM generate_series(1, %s) g", (n,))
    federate(source, "public.bulk", client="c0")


def copying(sink) -> None:
    """Wait until the snapshot of ``public.bulk`` is being written at ``sink``."""
    wait_for(
        lambda: sink.query(
            "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'COPY%%bulk%%' AND state = 'active'"
        )[0][0],
        20,
        f"the table's snapshot written at {sink.site_id}",
    )


def open_requests(source) -> list[tuple]:
    return source.query(
        "SELECT sink_site_id, client_name, status FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')"
    )


def converged(source, sinks, writers, clients=CLIENTS) -> bool:
    return all(rows(s, "public.items") == rows(source, "public.items") for s in sinks) and all(
        writers.logs(s, c)[-1:] == [writers.sent[c]] for s in sinks for c in clients
    )


def settle(source, sinks, writers, tmp_path, log: str, clients=CLIENTS, extra=lambda: True) -> None:
    """Wait (``DEADLINE``) until the sinks converged and no request is open; else fail saying
    where each session stands and what `lr sync` printed last."""
    try:
        wait_for(
            lambda: converged(source, sinks, writers, clients) and extra() and not open_requests(source),
            DEADLINE,
            "convergence",
        )
    except AssertionError as exc:
        where = {(s.site_id, c): (writers.logs(s, c)[-1:], writers.sent[c]) for s in sinks for c in clients}
        tables = {s.site_id: rows(s, "public.items") == rows(source, "public.items") for s in sinks}
        sessions = source.query(
            "SELECT sink_site_id, client_name, state, lease_owner IS NOT NULL, last_error FROM lr.source_sessions"
        )
        text = (tmp_path / log).read_text()[-4000:]
        raise AssertionError(
            f"{exc}: last/sent {where}; tables equal {tables}; open {open_requests(source)}; "
            f"sessions {sessions}\n{log}:\n{text}"
        ) from None


def check(source, sinks, writers, synced: set[tuple[str, str]], clients=CLIENTS) -> None:
    """Rows equal; every payload once and in order (all of them, but for the ``synced`` sessions,
    whose full sync replaced the entries before its base)."""
    for sink in sinks:
        assert rows(sink, "public.items") == rows(source, "public.items"), sink.site_id
        for client in clients:
            got = writers.logs(sink, client)
            if (sink.site_id, client) in synced:
                entries = queue(sink, "site-a", client=client)
                kinds = [k for k, _ in entries]
                assert "end" in kinds, (sink.site_id, client, "no full sync arrived")
                after = [
                    int(p.split(":")[1]) for k, p in entries[len(kinds) - kinds[::-1].index("end") :] if k == "log"
                ]
                assert got == sorted(set(got)), (sink.site_id, client, "once and in order")
                assert after and after == list(range(after[0], writers.sent[client] + 1)), (sink.site_id, client)
            else:
                assert got == list(range(1, writers.sent[client] + 1)), (sink.site_id, client)
    assert open_requests(source) == [], open_requests(source)


def full_sync(topo: str, sink: str, client: str) -> subprocess.CompletedProcess:
    """`lr full-sync` in a process of its own (as two operators would ask at once)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "airflow_provider_lr.cli",
            "full-sync",
            "--topology",
            topo,
            "--sink",
            sink,
            "--client",
            client,
            "--reason",
            "asked while streaming",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def alive(proc: subprocess.Popen, tmp_path, log: str = "sync.log") -> bool:
    """True while `lr sync` runs; when it has exited, fail at once saying what it printed last."""
    if proc.poll() is not None:
        raise AssertionError(f"lr sync exited ({proc.returncode}):\n{(tmp_path / log).read_text()[-3000:]}")
    return True


def no_traceback(tmp_path, *logs: str) -> None:
    for log in logs:
        text = (tmp_path / log).read_text()
        assert "Traceback" not in text, f"{log}:\n{text[-3000:]}"


@pytest.mark.slow
def test_a_sink_stopped_while_a_table_full_sync_is_under_way_then_started_gets_the_table_whole(
    lr_sites, site_manager, tmp_path, monkeypatch
):
    source, *sinks = lr_sites
    sink_c = sinks[1]
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    items(source)
    bulk(source)
    proc = lr_sync(topo, tmp_path / "sync.log")
    try:
        wait_for(lambda: streaming(source) == 6, DEADLINE, "every session streaming")
        with SwappingWriters(source) as writers:
            time.sleep(0.3)
            assert cli.main(["full-sync", "--topology", topo, "--sink", "site-c", "--client", "c0"]) == 0
            copying(sink_c)
            site_manager.down([sink_c.site_id], mode="immediate")
            time.sleep(1.0)
            site_manager.up(site_ids=[sink_c.site_id])
            time.sleep(1.0)
            wait_for(lambda: not open_requests(source), DEADLINE, "the full sync carried out, writers writing")
            time.sleep(0.5)
        settle(
            source,
            sinks,
            writers,
            tmp_path,
            "sync.log",
            extra=lambda: rows(sink_c, "public.bulk") == rows(source, "public.bulk"),
        )
        assert proc.poll() is None, "lr sync still streams"
    finally:
        stop(proc)
    check(source, sinks, writers, {("site-c", "c0")})
    no_traceback(tmp_path, "sync.log")


@pytest.mark.slow
def test_one_tables_full_sync_asked_twice_at_once_beside_two_lr_sync_is_applied_once(lr_sites, tmp_path, monkeypatch):
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    items(source)
    first, second = lr_sync(topo, tmp_path / "first.log"), lr_sync(topo, tmp_path / "second.log")
    try:
        wait_for(lambda: streaming(source) == 6, DEADLINE, "every session streaming")
        with SwappingWriters(source) as writers:
            time.sleep(0.5)
            asked: list = [None, None]
            threads = [
                threading.Thread(target=lambda i=i: asked.__setitem__(i, full_sync(topo, "site-b", "c0")))
                for i in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [a.returncode for a in asked] == [0, 0], [a.stderr for a in asked]
            time.sleep(1.5)
            wait_for(lambda: not open_requests(source), DEADLINE, "the full syncs carried out, writers writing")
            time.sleep(0.5)
        settle(source, sinks, writers, tmp_path, "sync.log")
        assert first.poll() is None and second.poll() is None, "both lr sync still stream"
    finally:
        stop(first, second)
    check(source, sinks, writers, {("site-b", "c0")})
    no_traceback(tmp_path, "first.log", "second.log")


def _apply(topo: str, clients: list[str]) -> None:
    doc = yaml.safe_load(open(topo))
    doc["replication"][0]["clients"] = clients
    open(topo, "w").write(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", topo]) == 0


def _edit(topo: str, clients: list[str]) -> None:
    doc = yaml.safe_load(open(topo))
    doc["replication"][0]["clients"] = clients
    open(topo, "w").write(yaml.safe_dump(doc))


@pytest.mark.slow
def test_lr_sync_keeps_streaming_while_its_file_is_edited_and_follows_it_once_applied(lr_sites, tmp_path, monkeypatch):
    """The operator adds a client to the topology file and applies it a while later (the documented
    way: edit, then `lr topology apply`). `lr sync` followed the file at once, its every session was
    then refused (the sites still ran the old id), and its stale-file check stopped it: exit 1,
    replication down until someone restarted it. Now it keeps the topology the sites run until the
    edit is applied, then takes the new client up."""
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    items(source)
    _apply(topo, ["c0", "c1"])
    proc = lr_sync(topo, tmp_path / "sync.log")
    try:
        wait_for(lambda: streaming(source) == 4, DEADLINE, "every session streaming")
        with RefusedWriters(source) as writers:
            _edit(topo, list(CLIENTS))  # not applied yet
            time.sleep(3.0)  # (its stale-file check ran a second after the first refusal)
            assert proc.poll() is None, (tmp_path / "sync.log").read_text()[-3000:]
            assert cli.main(["topology", "apply", "--topology", topo]) == 0
            wait_for(lambda: streaming(source) == 6, DEADLINE, "the new client's sessions streaming")
            time.sleep(0.5)
        settle(source, sinks, writers, tmp_path, "sync.log")
        assert proc.poll() is None, "lr sync still streams"
    finally:
        stop(proc)
    check(source, sinks, writers, {("site-b", "c2"), ("site-c", "c2")})
    no_traceback(tmp_path, "sync.log")


@pytest.mark.slow
def test_lr_sync_killed_while_a_table_full_sync_is_written_and_started_again_writes_it_once(
    lr_sites, tmp_path, monkeypatch
):
    """SIGKILL of `lr sync` while a forced full sync's table snapshot is in the sink's open
    transaction; a new `lr sync` (the service manager's restart) takes the sessions at once (its
    member found dead) and writes the table whole, every payload once."""
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    items(source)
    bulk(source)
    first = lr_sync(topo, tmp_path / "first.log")
    try:
        wait_for(lambda: streaming(source) == 6, DEADLINE, "every session streaming")
        with SwappingWriters(source) as writers:
            time.sleep(0.3)
            assert cli.main(["full-sync", "--topology", topo, "--sink", "site-b", "--client", "c0"]) == 0
            copying(sinks[0])
            first.send_signal(signal.SIGKILL)
            first.wait()
            second = lr_sync(topo, tmp_path / "second.log")
            wait_for(lambda: not open_requests(source), DEADLINE, "the full sync carried out, writers writing")
            time.sleep(0.5)
        settle(
            source,
            sinks,
            writers,
            tmp_path,
            "second.log",
            extra=lambda: rows(sinks[0], "public.bulk") == rows(source, "public.bulk"),
        )
        assert second.poll() is None, "lr sync still streams"
    finally:
        stop(first, *([second] if "second" in locals() else []))
    check(source, sinks, writers, {("site-b", "c0")})
    no_traceback(tmp_path, "second.log")


@pytest.mark.slow
def test_a_switchover_while_a_table_snapshot_is_written_under_lr_sync_leaves_every_site_with_the_table(
    lr_sites, tmp_path, monkeypatch
):
    """`lr failover --promote site-b` (planned: site-a up) while a forced full sync's table snapshot
    is in site-c's open transaction, the failover's topology written over the file `lr sync`
    follows: `lr sync` goes on from site-b without a restart, and every site ends with the table.
    (It exited 1 about once in six runs under load, the tables whole and no session streaming from
    site-b: its stale-file check ran between the failover applying the new topology to the sites
    and writing it to the file; `test_cli_topology_file.py::test_a_running_lr_sync_is_stopped_as_stale_only_when…`.)"""
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    items(source)
    bulk(source)
    proc = lr_sync(topo, tmp_path / "sync.log")
    try:
        wait_for(lambda: streaming(source) == 6, DEADLINE, "every session streaming")
        with SwappingWriters(source):
            time.sleep(1.0)
        assert cli.main(["full-sync", "--topology", topo, "--client", "c0", "--sink", "site-c"]) == 0
        copying(sink_c)
        assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", topo]) == 0
        for table in ("public.items", "public.bulk"):
            wait_for(
                lambda t=table: alive(proc, tmp_path) and rows(sink_c, t) == rows(sink_b, t) == rows(source, t),
                DEADLINE,
                f"{table} at every site",
            )
        try:
            wait_for(lambda: alive(proc, tmp_path) and streaming(sink_b) == 6, DEADLINE, "site-b's sessions streaming")
        except AssertionError as exc:
            sessions = sink_b.query(
                "SELECT sink_site_id, client_name, state, lease_owner IS NOT NULL, last_error FROM lr.source_sessions"
            )
            raise AssertionError(f"{exc}: {sessions}\n{(tmp_path / 'sync.log').read_text()[-5000:]}") from None
        assert proc.poll() is None, "lr sync still streams"
        assert open_requests(source) == open_requests(sink_b) == []
    finally:
        stop(proc)
    no_traceback(tmp_path, "sync.log")
