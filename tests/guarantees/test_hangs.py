"""Nothing stalls a replicator for good (docs/operations.md "Hung calls"): a lock held elsewhere and a
half-open link each fail the streaming session with its reason in ``lr status``, the session is
retried with backoff, and once the cause is gone every entry arrives exactly once, in order.

The replicators here connect as ``lr sync`` does (``conninfo`` with the topology's bounds), with
short bounds so the tests stay short: a call is cut after ``statement_timeout_s`` plus the link
check (``keepalives_idle_s + keepalives_interval_s * keepalives_count``), ``DEADLINE`` below."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2.errors
import psycopg2.sql
import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.cli import replication
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.lifting import lifted
from airflow_provider_lr.engine.db.timeouts import DEADLINES, Purpose, Timeouts, cap, failure
from airflow_provider_lr.engine.errors import ConfigurationError, SiteUnreachableError
from airflow_provider_lr.engine.session import snapshot_sync
from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store import topology
from airflow_provider_lr.engine.tables import copy as table_copy
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.link_proxy import LinkProxy
from tests.support.session import (
    App,
    Streaming,
    apply,
    empty_provider,
    queue,
    table_provider,
    topology_doc,
    wait_for,
)
from tests.support.tables import create_accounts, federate, rows, sync

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
BOUNDS = {
    "statement_timeout_s": 4,
    "lock_timeout_s": 1,
    "idle_in_transaction_timeout_s": 3,
    "keepalives_idle_s": 1,
    "keepalives_interval_s": 1,
    "keepalives_count": 2,
    "tcp_user_timeout_s": 3,
    "connect_timeout_s": 2,
}
# The bound on noticing a link that acknowledges and never answers: statement_timeout_s + the link
# check = 4 + 1 + 1 x 2 = 7 s, plus the deadline thread's tick (0.25 s).
DEADLINE = 7.0
SLACK = 8.0  # a shared 2-core machine: scheduling, not the bound
COPYING = "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'COPY%%'"
RETRY = StreamSettings(check_interval=0.2, ack_interval=0.05, retry_min=0.2, retry_max=2.0)


def bounded(topo, dsns: dict[str, str], membership: bool = False) -> Replicator:
    """A replicator connecting as ``lr sync`` does: through ``conninfo``, bounded by the topology."""
    return Replicator(
        topo,
        lambda site: conninfo.from_dsn(dsns[site]).with_timeouts(topo.timeouts).connect(),
        settings=SessionSettings(data_timeout=30.0, barrier_timeout=2.0, lease_seconds=30.0),
        providers={"policy": table_provider},
        membership=membership,
    )


def logs(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def _setting(conn, name: str) -> str:
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting(%s)", (name,))
        return str(cur.fetchone()[0])


def last_error(source) -> str:
    return source.query("SELECT coalesce(last_error, '') FROM lr.source_sessions WHERE sink_site_id = 'site-b'")[0][0]


@pytest.mark.parametrize(
    "setting, value, error",
    [
        ("keepalives_count", 0, "0 is less than the minimum of 1"),
        ("lock_timeout_s", -1, "-1 is less than the minimum of 0"),
        ("statement_timeout_s", "2m", "'2m' is not of type 'number'"),
        ("keepalives_idle_s", 1.5, "1.5 is not of type 'integer'"),
        ("lock_timeout", 5, "unknown key 'lock_timeout'"),
    ],
)
def test_the_bounds_are_strict_topology_settings(setting, value, error):
    doc = {"sites": [{"id": "site-a"}, {"id": "site-b"}], "replication": ONE_SINK, "settings": {setting: value}}
    with pytest.raises(ConfigurationError) as refused:
        topology.from_document(doc)
    assert f"settings.{setting}: {error}" in str(refused.value)
    doc["settings"] = BOUNDS
    assert topology.from_document(doc).timeouts.deadline_s(Purpose.SESSION) == DEADLINE


def test_the_topology_bounds_every_connection_lr_opens(lr_sites):
    """The settings reach the server (``-c`` options at connect) and the socket (keepalives); a DSN's
    own value wins; a bulk connection has no statement timeout; an application's gets none of lr's."""
    source = lr_sites[0]
    topo = apply(lr_sites, ONE_SINK, settings=BOUNDS)
    info = conninfo.from_dsn(source.dsn + " keepalives_idle=9").with_timeouts(topo.timeouts)

    def shown(purpose: Purpose) -> tuple:
        conn = info.connect(purpose)
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'), "
                    "current_setting('idle_in_transaction_session_timeout'), current_setting('tcp_keepalives_idle'), "
                    "current_setting('tcp_keepalives_count')"
                )
                row = cur.fetchone()
            return row, conn.get_dsn_parameters().get("keepalives_idle"), conn.deadline_s
        finally:
            conn.close()

    # the server probes a silent client as the client probes it (TCP over a socket on 127.0.0.1 here)
    assert shown(Purpose.SESSION) == (("4s", "1s", "3s", "1", "2"), "9", DEADLINE)
    conn = info.connect()
    try:  # long work lifts a session connection's bounds for its duration, even when it fails
        with pytest.raises(psycopg2.errors.DivisionByZero), lifted(conn):
            assert conn.deadline_s is None and _setting(conn, "statement_timeout") == "0"
            assert _setting(conn, "client_connection_check_interval") == "5s"  # a vanished client ends it
            conn.cursor().execute("SELECT 1/0")  # the work fails: its transaction is left aborted
        assert conn.deadline_s == DEADLINE and _setting(conn, "statement_timeout") == "4s"
        assert _setting(conn, "client_connection_check_interval") == "0"
        # a named cursor's rows are read a round trip at a time, each under the deadline
        with conn.cursor(name="many") as cur:
            cur.itersize = 1000
            cur.execute("SELECT generate_series(1, 2500)")
            assert [n for (n,) in cur] == list(range(1, 2501))
    finally:
        conn.close()
    assert shown(Purpose.BULK) == (("0", "1min", "0", "1", "2"), "9", None)
    assert shown(Purpose.APPLICATION)[0][:3] == ("0", "0", "0")


@pytest.mark.timeout(240)
def test_a_sink_lock_held_elsewhere_fails_the_stream_with_its_reason_then_every_entry_arrives_once(lr_sites):
    """Another session holds the sink's session row (the lock every sink write takes). The stream's
    write fails after lock_timeout instead of waiting for good; the reason is the session's
    ``last_error`` (one line); the cycles retry with backoff; once the lock goes, every entry is
    delivered exactly once, in order."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, settings=BOUNDS)
    app = App(source)
    with Streaming(bounded(topo, {s.site_id: s.dsn for s in lr_sites}), RETRY) as streaming:
        streaming.streaming()
        for i in range(10):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 10, 30, "the first entries to stream")
        holder = sink_b.connect()
        try:
            with holder.cursor() as cur:
                cur.execute("SELECT 1 FROM lr.sink_sessions FOR UPDATE")
            for i in range(10, 30):
                app.put(f"k{i}", i, ["site-b"])
            wait_for(
                lambda: any("lock_timeout" in e.error for e in streaming.streamer.ends),
                30,
                "the stream to fail on the lock",
            )
            wait_for(lambda: "lock_timeout" in last_error(source), 30, "the reason in the session's status")
            time.sleep(1.5)  # the cycles keep trying while the lock is held: still nothing written
            assert logs(sink_b) == [f"k{i}={i}" for i in range(10)]
            error = last_error(source)
            assert "\n" not in error and "LockNotAvailable" in error, error
            # backed off once a cycle failed on the lock too (a loaded machine runs that cycle late)
            wait_for(lambda: streaming.streamer.backoff, 10, "the failing session to be backed off")
        finally:
            holder.rollback()
            holder.close()
        wait_for(lambda: len(logs(sink_b)) >= 30, 60, "every entry once the lock is gone")
        streaming.streaming()
        wait_for(lambda: last_error(source) == "", 10, "the error cleared by the next success")
    assert logs(sink_b) == [f"k{i}={i}" for i in range(30)]
    app.close()


@pytest.mark.timeout(240)
def test_a_half_open_link_to_the_sink_is_noticed_within_the_deadline_and_the_stream_resumes_once_it_heals(lr_sites):
    """The link to the sink goes half-open mid-stream: the proxy stops forwarding without closing,
    and keeps acknowledging (TCP sees nothing wrong). The stream's next sink write is cut at its
    deadline (``DEADLINE``) and hands back; the cycles fail (the cut connection, then connects
    that time out) and back off; the sink's server ends the transaction the stream left open
    (idle_in_transaction_timeout_s), releasing its lock; once the link heals the session
    renegotiates and streams again, and the sink has every entry exactly once, in order."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, settings=BOUNDS)
    app = App(source)
    link = LinkProxy(sink_b.conninfo.params["port"])
    dsns = {"site-a": source.dsn, "site-b": link.dsn(sink_b.dsn)}
    with Streaming(bounded(topo, dsns), RETRY) as streaming:
        with link:  # closed first on the way out: a call still stuck on it returns (a failure, not a hang)
            streaming.streaming()
            for i in range(20):
                app.put(f"k{i}", i, ["site-b"])
            wait_for(lambda: len(logs(sink_b)) == 20, 30, "the first entries to stream")
            cut_before = DEADLINES.cut
            link.stall()
            stalled = time.monotonic()
            for i in range(20, 40):
                app.put(f"k{i}", i, ["site-b"])
            wait_for(
                lambda: any(e.error for e in streaming.streamer.ends),
                DEADLINE + SLACK,
                "the stream to notice the stalled link",
            )
            noticed = time.monotonic() - stalled
            assert noticed <= DEADLINE + SLACK, noticed
            assert DEADLINES.cut > cut_before, "the stalled call was cut at its deadline"
            (end,) = [e for e in streaming.streamer.ends if e.error]
            assert end.session == "site-a->site-b/policy" and "OperationalError" in end.error, end
            wait_for(
                lambda: "OperationalError" in last_error(source) or "SiteUnreachable" in last_error(source),
                DEADLINE + SLACK,
                "the failure in the session's status",
            )
            assert logs(sink_b) == [f"k{i}={i}" for i in range(20)]
            link.heal()
            wait_for(lambda: len(logs(sink_b)) >= 40, 60, "every entry once the link heals")
            streaming.streaming()
            for i in range(40, 50):
                app.put(f"k{i}", i, ["site-b"])
            wait_for(lambda: len(logs(sink_b)) >= 50, 30, "streaming again")
    assert logs(sink_b) == [f"k{i}={i}" for i in range(50)]
    app.close()


@pytest.mark.timeout(240)
def test_a_sink_that_stops_answering_does_not_hold_the_sources_other_sink_and_nothing_is_lost(lr_sites, monkeypatch):
    """One source streams to two sinks; site-c's link goes half-open (as a stopped server looks from
    the client: nothing answers, nothing is closed) while its call deadline is 24 s. site-b goes
    on receiving within the stream's ``sink_deadline``, not after site-c's deadline: the stream's
    call to site-c is cut there and its session handed back (the cycles keep trying it with their
    own bounds). The cycle that takes it back connects anew, failing within the connect timeout:
    before, it called on the cycles' connection still open to site-c and waited its 24 s deadline,
    every other session's cycle and hand-back behind it. Once the link is back site-c gets every
    entry; both sinks hold each entry once."""
    monkeypatch.setattr(Replicator, "rest", lambda self, idle_for=0.0: None)  # the cycles' connections stay open
    source, sink_b, sink_c = lr_sites
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}],
        settings={**BOUNDS, "statement_timeout_s": 20},  # a call deadline of 24 s
    )
    app = App(source)
    link = LinkProxy(sink_c.conninfo.params["port"])
    dsns = {"site-a": source.dsn, "site-b": sink_b.dsn, "site-c": link.dsn(sink_c.dsn)}
    with Streaming(bounded(topo, dsns), StreamSettings(**{**RETRY.__dict__, "sink_deadline": 2.0})) as streaming:
        with link:
            streaming.streaming()
            for i in range(10):
                app.put(f"k{i}", i, ["site-b", "site-c"])
            wait_for(lambda: len(logs(sink_b)) == len(logs(sink_c)) == 10, 30, "the first entries to stream")
            link.stall()
            stalled = time.monotonic()
            for i in range(10, 20):
                app.put(f"k{i}", i, ["site-b", "site-c"])
            wait_for(lambda: len(logs(sink_b)) == 20, 2.0 + SLACK, "site-b's entries while site-c is silent")
            assert time.monotonic() - stalled < 2.0 + SLACK
            assert len(logs(sink_c)) == 10
            for i in range(20, 30):  # site-b streams on (its session never left the stream)
                app.put(f"k{i}", i, ["site-b"])
            wait_for(lambda: len(logs(sink_b)) == 30, 10, "site-b streaming on")
            wait_for(lambda: any(e.error for e in streaming.streamer.ends), 10, "site-c's session handed back")
            assert [e.session for e in streaming.streamer.ends if e.error] == ["site-a->site-c/policy"]
            wait_for(
                lambda: any(r.session == "site-a->site-c/policy" and r.error for r in streaming.cycles),
                2.0 + SLACK,  # its connect timeout, not the 24 s call deadline
                "site-c's cycle to fail at its connect",
            )
            link.reset()
            wait_for(lambda: len(logs(sink_c)) == 20, 60, "site-c's entries once its link is back")
    assert logs(sink_b) == [f"k{i}={i}" for i in range(30)]
    assert logs(sink_c) == [f"k{i}={i}" for i in range(20)]
    app.close()


def test_a_silent_sink_of_several_sessions_does_not_hold_the_healthy_sinks_stream(lr_sites):
    """site-c, sink of three sessions, stops answering (its open connections and every new one
    hang); site-b's entries go on streaming: the round waits ``sink_patience`` (0.2 s) for site-c's
    write, which stays in flight, its sessions out of the rounds, until its call is cut (here at a
    ``sink_deadline`` of 30 s: the call deadline of 24 s) or the link comes back. Before, every
    site-b entry of the round waited for that cut (and, two rounds before, also for a connect
    timeout per other session of site-c)."""
    source, sink_b, sink_c = lr_sites
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", "billing", "audit"]}],
        settings={**BOUNDS, "statement_timeout_s": 20, "connect_timeout_s": 6},
    )
    app = App(source)
    link = LinkProxy(sink_c.conninfo.params["port"])
    repl = bounded(topo, {"site-a": source.dsn, "site-b": sink_b.dsn, "site-c": link.dsn(sink_c.dsn)})
    repl.providers.update({"billing": empty_provider, "audit": empty_provider})
    with Streaming(repl, StreamSettings(**{**RETRY.__dict__, "sink_deadline": 30.0})) as streaming, link:
        streaming.streaming()
        members = streaming.streamer.sources["site-a"].members
        wait_for(lambda: len(members) == 6, 30, "every session to join the stream")
        link.stall()
        lags = []
        for i in range(4):
            put = time.monotonic()
            app.put(f"k{i}", i, ["site-b", "site-c"])
            wait_for(lambda: len(logs(sink_b)) == i + 1, 60, f"k{i} at site-b")
            lags.append(time.monotonic() - put)
        assert max(lags) < SLACK, f"site-b's entries waited {max(lags):.1f} s for the silent site-c"
        link.reset()
        wait_for(lambda: len(logs(sink_c)) == 4, 60, "site-c's entries once its link is back")
    assert logs(sink_b) == logs(sink_c) == [f"k{i}={i}" for i in range(4)]
    app.close()


def test_an_idle_stream_and_idle_cycles_outlast_their_own_bounds(lr_sites):
    """lr's own connections never sit idle in a transaction: a stream and cycles left idle for
    several times ``idle_in_transaction_timeout_s`` are not ended by their servers (a bound that
    fired on a healthy session would hand it back, or fail a cycle, for nothing)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, settings={**BOUNDS, "idle_in_transaction_timeout_s": 0.5})
    app = App(source)
    dsns = {s.site_id: s.dsn for s in lr_sites}
    with Streaming(bounded(topo, dsns), RETRY) as streaming:
        streaming.streaming()
        for round_ in range(2):  # the second entry streams after an idle spell; the stream outlasts another
            app.put(f"k{round_}", round_, ["site-b"])
            wait_for(lambda: len(logs(sink_b)) == round_ + 1, 30, "the entry to stream")
            time.sleep(2)  # idle: four times the bound
        assert not streaming.streamer.ends, streaming.streamer.ends
    cycles = bounded(topo, dsns)
    try:
        for round_ in range(2, 4):
            if round_ > 2:
                time.sleep(2)  # the cycles' connections idle: four times the bound, then used again
            app.put(f"k{round_}", round_, ["site-b"])
            reports = cycles.run_cycle()
            assert not [r.error for r in reports if r.error]
    finally:
        cycles.close()
    assert logs(sink_b) == [f"k{i}={i}" for i in range(4)] and last_error(source) == ""
    app.close()


@pytest.mark.timeout(120)
def test_a_sink_that_stops_answering_mid_table_snapshot_fails_the_cycle_and_the_table_arrives_whole_later(lr_sites):
    """A federated table's snapshot is written in a cycle on connections freed of their bounds
    (a COPY of a whole table takes as long as it takes), and the sink's link goes half-open in
    the middle of its COPY: the proxy takes every byte and answers none. Once no byte of the copy
    has moved for the call deadline the connection had, lr cuts it: the cycle fails with that
    reason instead of waiting for good (the other sessions of ``lr sync`` wait behind it), and
    once the link is back the table arrives whole (before, the cycle waited until the link was cut).
    The stalled connection stays open at the sink's server, its COPY holding the session's row: lr
    ends that backend on its next connection there (before, the retries failed on lock_timeout
    until the server's own keepalives ended it, ~2 h by default)."""
    source, sink_b, _ = lr_sites
    bounds = {**BOUNDS, "statement_timeout_s": 2, "keepalives_count": 1}  # a call deadline of 2 + 1 + 1 = 4 s
    topo = apply(lr_sites, ONE_SINK, settings=bounds)
    App(source).close()
    create_accounts(source, rows=4000)
    federate(source)
    link = LinkProxy(sink_b.conninfo.params["port"], rate=200_000)  # the COPY takes a few seconds
    repl = bounded(topo, {"site-a": source.dsn, "site-b": link.dsn(sink_b.dsn)})
    reports: list = []
    with link:  # closed first on the way out: a call still stuck on it returns
        cycle = threading.Thread(target=lambda: reports.extend(repl.run_cycle()), daemon=True)
        cycle.start()
        wait_for(lambda: sink_b.query(COPYING), 30, "the table's COPY at the sink")
        link.stall()
        cycle.join(4 + SLACK)
        assert not cycle.is_alive(), "the cycle still waits on a sink that takes every byte and answers none"
        assert "call deadline of 4 s" in (reports[0].error or ""), reports
        link.heal()  # new connections go through; the COPY's backend lives on behind the stalled one
        sync(repl)
    repl.close()
    assert rows(sink_b) == rows(source)


def test_a_replicator_whose_copy_backend_was_ended_while_it_was_stopped_fails_on_one_line_then_the_table_arrives(
    lr_sites, monkeypatch, capfd
):
    """``lr sync`` stopped (SIGSTOP) in the middle of a table snapshot's COPY, its sink's backend
    ended meanwhile (by the next lease holder, which ends a stopped holder's fenced transaction, or
    an operator's pg_terminate_backend), then continued: psycopg2 met the server's error twice and
    printed the pair as a chained traceback among lr sync's lines ("AdminShutdown ... direct cause
    of ... SystemError: <function decode> returned a result with an exception set"), and the cycle
    failed with a bare "OperationalError: invalid socket". Now nothing is printed, the cycle's error
    (one line) names the connection and the server's reason, and the next cycle writes the table
    whole. (A source's COPY ended so printed the same; its error was "DatabaseError: error with
    status PGRES_COPY_OUT and no message from the libpq": the same guard, every COPY of lr's.)"""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK)
    App(source).close()
    create_accounts(source, rows=200)
    federate(source)
    read = table_copy._QueueReader.read
    ended: list[int] = []

    def stopped_here(self, size=-1):  # the process stops with its COPY begun; meanwhile its backend is ended
        if not ended:
            ended.append(
                sink_b.query(f"SELECT count(pg_catalog.pg_terminate_backend(pid)) FROM ({FENCED_WRITERS}) w")[0][0]
            )
            wait_for(lambda: not sink_b.query(FENCED_WRITERS), 10, "the sink's backend to end")
        return read(self, size)

    monkeypatch.setattr(table_copy._QueueReader, "read", stopped_here)
    repl = bounded(topo, {"site-a": source.dsn, "site-b": sink_b.dsn})
    errors = [r.error for r in repl.run_cycle() if r.error]
    monkeypatch.setattr(table_copy._QueueReader, "read", read)
    printed = capfd.readouterr()
    assert ended == [1] and len(errors) == 1, errors
    assert "SystemError" not in printed.err + printed.out and "direct cause" not in printed.err + printed.out
    assert errors[0].startswith(f"OperationalError: connection to 127.0.0.1:{sink_b.conninfo.params['port']} ")
    assert "was ended in the middle of a COPY by its server (AdminShutdown: terminating connection" in errors[0]
    sync(repl)
    repl.close()
    assert rows(sink_b) == rows(source)


def test_a_copy_whose_link_breaks_in_the_middle_fails_naming_the_connection_lost(lr_sites):
    """A COPY whose server stopped at once (an immediate shutdown) or whose link broke in the middle
    sends no error: psycopg2 raised "DatabaseError: error with status PGRES_COPY_OUT and no message
    from the libpq", which said nothing of what happened nor where; now one line names the
    connection and that it was lost mid-COPY."""
    source = lr_sites[0]
    link = LinkProxy(source.conninfo.params["port"])
    chunks = []

    def broken_after_a_while(chunk: bytes) -> int:
        chunks.append(len(chunk))
        if len(chunks) == 200:
            link.reset()
        return len(chunk)

    sink = type("Sink", (), {"write": staticmethod(broken_after_a_while)})()
    with link:
        conn = conninfo.from_dsn(link.dsn(source.dsn)).connect()
        with pytest.raises(psycopg2.OperationalError) as lost, conn.cursor() as cur:
            cur.copy_expert("COPY (SELECT g, repeat('x', 100) FROM generate_series(1, 1000000) g) TO STDOUT", sink)
    assert str(lost.value).startswith(f"connection to 127.0.0.1:{link.port} was lost in the middle of a COPY"), lost
    assert "libpq" not in str(lost.value)


FENCED_WRITERS = (
    "SELECT pid FROM pg_catalog.pg_stat_activity WHERE application_name LIKE 'lr fenced writer%%' "
    "AND datname = pg_catalog.current_database()"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["source: the provider's query", "sink: the full sync's apply"])
def test_a_site_that_stops_answering_in_a_full_syncs_long_work_fails_the_cycle_and_the_sync_lands_whole_later(
    lr_sites, monkeypatch, where
):
    """A full sync's long steps run on connections freed of their call deadline (``lifted``): the
    provider's queries at the source, the apply that makes it visible at the sink. The site's link
    goes half-open just before one of them: the proxy takes every byte and answers none. A heartbeat
    on a second connection finds the site unreachable and cuts the call: the cycle fails with that
    reason within the deadline instead of waiting for good (before: for good). The link then heals
    for new connections only (the backend behind the stalled one lives on, holding its locks: lr ends
    it on its next connection there) and the full sync lands whole."""
    source, sink_b, _ = lr_sites
    bounds = {**BOUNDS, "statement_timeout_s": 2, "keepalives_count": 1}  # a call deadline of 2 + 1 + 1 = 4 s
    topo = apply(lr_sites, ONE_SINK, settings=bounds)
    app = App(source)
    for i in range(3):
        app.put(f"k{i}", i, ["site-b"])
    stalled_site = source if where.startswith("source") else sink_b
    link = LinkProxy(stalled_site.conninfo.params["port"])
    dsns = {s.site_id: s.dsn for s in lr_sites}
    dsns[stalled_site.site_id] = link.dsn(stalled_site.dsn)
    stalls = [True]

    def stall_first() -> None:
        if stalls:
            link.stall()
            stalls.clear()

    def provider(ctx) -> None:
        if where.startswith("source"):
            stall_first()
        table_provider(ctx)

    apply_snapshot = snapshot_sync.writes.apply_snapshot

    def stalled_apply(*args, **kwargs):
        stall_first()
        return apply_snapshot(*args, **kwargs)

    if where.startswith("sink"):
        monkeypatch.setattr(snapshot_sync.writes, "apply_snapshot", stalled_apply)
    repl = bounded(topo, dsns)
    repl.providers["policy"] = provider
    reports: list = []
    with link:
        cycle = threading.Thread(target=lambda: reports.extend(repl.run_cycle()), daemon=True)
        cycle.start()
        cycle.join(4 + 2 + SLACK)  # the deadline, then the heartbeat's connect (connect_timeout_s) fails
        assert not cycle.is_alive(), f"the cycle still waits on the {where}, stalled"
        assert "call deadline of 4 s" in (reports[0].error or ""), reports
        link.heal()  # new connections go through; the stalled one stays silent, its backend alive
        sync(repl)
    repl.close()
    assert sorted(p for k, p in queue(sink_b) if k == "snap") == [f"k{i}={i}" for i in range(3)]
    app.close()


@pytest.mark.timeout(60)
def test_a_lifted_call_runs_past_its_deadline_while_it_works_and_is_cut_once_its_answer_is_lost(lr_sites, caplog):
    """A call on a lifted connection has no deadline: the heartbeat lets it run while its backend
    works (a long statement is not cut), and cuts it once the server shows the call finished and
    no answer came (the link stalled on the way back; the heartbeat reaches the server by another path)."""
    source = lr_sites[0]
    bounds = Timeouts(statement_timeout_s=0.5, keepalives_idle_s=1, keepalives_interval_s=1, keepalives_count=1)
    with LinkProxy(source.conninfo.params["port"]) as link:
        conn = conninfo.from_dsn(link.dsn(source.dsn)).with_timeouts(bounds).connect()
        assert conn.deadline_s == 2.5
        with lifted(conn):
            # past the deadline, working: the heartbeat lets it be, even when the server refuses it a
            # connection (no slot free, say: here a database that does not exist): it is up and answering
            conn.reopen = conninfo.from_dsn(source.dsn + " dbname=nowhere").with_timeouts(bounds).connect
            conn.cursor().execute("SELECT pg_sleep(3)")
            conn.reopen = conninfo.from_dsn(source.dsn).with_timeouts(bounds).connect  # another path there
            link.stall_answers()  # the next call reaches the server; its answer is lost
            started = time.monotonic()
            with pytest.raises(psycopg2.OperationalError):
                conn.cursor().execute("SELECT pg_sleep(1)")
        assert time.monotonic() - started < 2.5 + 2 + SLACK
        assert "shows no work on the call (backend idle" in caplog.text
        conn.close()


@pytest.mark.timeout(60)
def test_a_bulk_copy_whose_source_works_long_before_its_first_byte_is_not_cut(lr_sites):
    """A bulk connection's calls are watched like a lifted one's (the heartbeat) and its COPYs by
    their progress. A COPY whose source works longer than the call deadline before its first row (a
    scan that finds its range late, a sort) has moved no byte: that is no stall (its backend works),
    and it is not cut; a COPY that stops moving once it has started still is (the tests above)."""
    source, sink_b, _ = lr_sites
    bounds = Timeouts(statement_timeout_s=0.5, keepalives_idle_s=1, keepalives_interval_s=1, keepalives_count=1)
    sink_b.query("CREATE TABLE late_rows (n int)")
    src = conninfo.from_dsn(source.dsn).with_timeouts(bounds).connect(Purpose.BULK)
    dst = conninfo.from_dsn(sink_b.dsn).with_timeouts(bounds).connect(Purpose.BULK)
    try:
        assert src.deadline_s is None and src.stall_deadline_s == 2.5  # no deadline; watched as lifted
        select = psycopg2.sql.SQL(
            "COPY (SELECT n FROM generate_series(1, 3) n WHERE pg_sleep(CASE WHEN n = 1 THEN 3.5 ELSE 0 END) "
            "IS NOT NULL) TO STDOUT (FORMAT binary)"
        )
        insert = psycopg2.sql.SQL("COPY public.late_rows (n) FROM STDIN (FORMAT binary)")
        table_copy.copy_rows(src.cursor(), select, [(dst.cursor(), insert)])
        dst.commit()
    finally:
        src.close()
        dst.close()
    assert sink_b.query("SELECT n FROM late_rows ORDER BY n") == [(1,), (2,), (3,)]


@pytest.mark.timeout(60)  # (before: 145 s)
def test_a_stopping_lr_sync_waits_on_a_silent_site_its_stop_bound_not_a_call_deadline(lr_sites, monkeypatch):
    """SIGTERM of ``lr sync`` while a site stopped answering: its calls there (a stream's wait at
    the source, each lease released, the membership left) each waited for their call deadline,
    145 s by default, one after another (a stopped source held a stop for minutes). From the
    SIGTERM on, a call in progress and every later one ends within ``STOPPING_CALLS_S``."""
    monkeypatch.setattr(replication, "STOPPING_CALLS_S", 1.0, raising=False)  # 10 s: shorter here
    source = lr_sites[0]
    with LinkProxy(source.conninfo.params["port"]) as link:
        conn = conninfo.from_dsn(link.dsn(source.dsn)).with_timeouts(Timeouts()).connect()
        assert conn.deadline_s == 145
        link.stall()
        stopped, stop = [], threading.Event()
        threading.Timer(0.5, replication._stop_asked, (stop,)).start()  # the SIGTERM handler
        try:
            started = time.monotonic()
            with pytest.raises(psycopg2.OperationalError):
                conn.cursor().execute("SELECT 1")  # a stream's wait at a stopped source, say
            stopped.append(time.monotonic() - started)
            with pytest.raises(psycopg2.Error):  # the next call (a lease released): no deadline's wait
                conn.cursor().execute("SELECT 1")
        finally:
            DEADLINES.hurry(None)
            conn.close()
    assert stop.is_set() and stopped[0] < 0.5 + replication.STOPPING_CALLS_S + SLACK / 4


@pytest.mark.timeout(60)  # (before: ~30 s by default, 3 calls of STOPPING_CALLS_S each, the streams joined unbounded)
def test_lr_sync_stopped_while_its_source_is_frozen_stops_within_its_bound_and_the_next_run_delivers_every_entry_once(
    lr_sites, monkeypatch
):
    """``lr sync`` streams from a source that then stops answering (SIGSTOP: every call hangs) and is
    stopped (SIGTERM). The stream's call there is cut at ``STOPPING_CALLS_S``; every later call to
    that server (the stream's last ack, its leases released, the membership left) fails at once,
    the server known unreachable (``reach``), and the Streamer waits for its streams at most
    ``stop_within``: the stop ends within the bound once, not once per call. Once the server answers
    again, the next run delivers every entry once."""
    monkeypatch.setattr(replication, "STOPPING_CALLS_S", 1.5, raising=False)
    source, sink_b = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, ONE_SINK, settings=BOUNDS)
    app = App(source)
    link = LinkProxy(source.conninfo.params["port"])
    dsns = {"site-a": link.dsn(source.dsn), "site-b": sink_b.dsn, "site-c": lr_sites[2].dsn}
    with link:
        repl = bounded(topo, dsns, membership=True)  # as lr sync: a member at its sources
        streaming = Streaming(repl, StreamSettings(**{**RETRY.__dict__, "stop_within": 2.5}))
        with streaming:
            streaming.streaming()
            for i in range(5):
                app.put(f"k{i}", i, ["site-b"])
            wait_for(lambda: len(logs(sink_b)) == 5, 30, "the first entries to stream")
            link.stall()
            time.sleep(0.3)  # the stream is in a call to the frozen source
            try:
                started = time.monotonic()
                replication._stop_asked(streaming.stop)  # the SIGTERM handler
                streaming.thread.join(30)
                repl.close()
                took = time.monotonic() - started
            finally:
                DEADLINES.hurry(None)
            for i in range(5, 10):  # written while the source's replicator link is down
                app.put(f"k{i}", i, ["site-b"])
        assert took < replication.STOPPING_CALLS_S + SLACK / 4, f"the stop took {took:.1f} s"
        link.reset()  # the server answers again (SIGCONT): the stopped process's connections are closed
        bounded(topo, dsns).run(max_cycles=20, until_idle=True, interval=0.05)
    assert logs(sink_b) == [f"k{i}={i}" for i in range(10)]
    app.close()


@pytest.mark.timeout(90)  # (before: tables list connected twice, the wait waited for nothing)
def test_cli_commands_wait_for_a_frozen_sink_once_and_full_sync_wait_names_it_at_once(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """A sink that stopped answering (SIGSTOP: connects accepted, never answered) costs a command one
    connect timeout, not one per connect: ``lr tables list`` checked it, then read it; ``lr full-sync``
    checked it, then ``--wait`` waited out its whole bound for a request the sink cannot apply
    (71 s with --wait 60), naming nobody. Now the wait is not made for it: one line names the sink."""
    source, sink_b, sink_c = lr_sites
    link = LinkProxy(sink_b.conninfo.params["port"])
    for site in lr_sites:
        conn = site.server.airflow_conn(site.dbname)
        conn["port"] = link.port if site is sink_b else conn["port"]
        monkeypatch.setenv(f"AIRFLOW_CONN_LR_HUNG_{site.site_id[-1].upper()}", json.dumps(conn))
    doc = topology_doc(lr_sites, ONE_SINK, settings=BOUNDS, conn_ids=lambda s: f"lr_hung_{s[-1]}")
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(doc))
    topo = str(tmp_path / "topo.yaml")
    with link:
        assert cli.main(["topology", "apply", "--topology", topo]) == 0
        link.stall()
        for command, code in ((["tables", "list"], 2), (["full-sync", "--wait", "20"], 1)):
            capsys.readouterr()
            tried, started = link.accepted, time.monotonic()
            assert cli.main([*command, "--topology", topo]) == code, capsys.readouterr()
            took = time.monotonic() - started
            assert link.accepted - tried == 1, (
                f"lr {command[0]} connected to the frozen sink {link.accepted - tried} times"
            )
            assert took < BOUNDS["connect_timeout_s"] + SLACK / 2, f"lr {command[0]} took {took:.1f} s"
        out = capsys.readouterr().out
        assert "site-a->site-b/policy: not applied: its sink site-b does not answer (connect: " in out, out


@pytest.mark.timeout(60)
def test_a_step_cut_at_its_deadline_fails_with_that_reason_not_with_its_rollbacks_closed_connection(lr_sites):
    """``lr tables open`` whose backend was stopped (SIGSTOP of that one backend) was cut at its call
    deadline, then said "InterfaceError: connection already closed": its ``except: rollback();
    raise`` met the cut connection and raised that instead. A cut connection has nothing to roll
    back (its server ends the transaction with the backend): the step's own error is raised."""
    with LinkProxy(lr_sites[0].conninfo.params["port"]) as link:
        conn = cap(conninfo.from_dsn(link.dsn(lr_sites[0].dsn)).connect(), 1.0)
        link.stall()
        with pytest.raises(psycopg2.OperationalError) as raised:
            try:
                conn.cursor().execute("SELECT 1")
            except BaseException:
                conn.rollback()
                raise
        conn.close()
    assert failure(raised.value).startswith(f"{conn.describe()} gave no answer within its call deadline of 1 s")
    assert "127.0.0.1" in conn.describe()


@pytest.mark.timeout(60)  # (before: its connect timeout, 10 s by default)
def test_a_stopping_lr_sync_connecting_to_a_silent_site_waits_its_stop_bound_not_the_connect_timeout(
    lr_sites, monkeypatch
):
    """A stop's connects (a lease released at a source no call was waiting on when the SIGTERM came,
    so not yet known silent) waited the full ``connect_timeout_s``: from the SIGTERM on, a connect
    waits no longer than a call, ``STOPPING_CALLS_S`` (libpq's least: 2 s)."""
    monkeypatch.setattr(replication, "STOPPING_CALLS_S", 2.0, raising=False)
    with LinkProxy(lr_sites[0].conninfo.params["port"], stalled=True) as link:
        replication._stop_asked(threading.Event())
        try:
            started = time.monotonic()
            with pytest.raises(SiteUnreachableError, match="timeout expired"):
                conninfo.from_dsn(link.dsn(lr_sites[0].dsn)).with_timeouts(Timeouts()).connect()
            took = time.monotonic() - started
        finally:
            DEADLINES.hurry(None)
    assert took < replication.STOPPING_CALLS_S + SLACK / 4, f"the connect took {took:.1f} s"


@pytest.mark.timeout(120)
def test_a_silent_sink_of_several_sessions_holds_a_cycle_once_not_once_per_session(lr_sites):
    """site-c stops answering (every connect hangs) while it is the sink of three sessions and site-b
    of one: a cycle of all four waits for site-c's connect timeout once, its other sessions fail at
    once saying so, and site-b's session, cycled after them, is not held behind one wait per
    session (before: 3 x the connect timeout, and a call deadline each on an open connection)."""
    source, sink_b, sink_c = lr_sites
    clients = ["policy", "billing", "audit"]
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": clients}],
        settings=BOUNDS,  # connect_timeout_s 2
    )
    with LinkProxy(sink_c.conninfo.params["port"], stalled=True) as link:
        repl = bounded(topo, {"site-a": source.dsn, "site-b": sink_b.dsn, "site-c": link.dsn(sink_c.dsn)})
        repl.providers["policy"] = empty_provider
        keys = [k for k in repl.sessions if k.sink == "site-c"] + [
            k for k in repl.sessions if str(k) == "site-a->site-b/policy"
        ]
        try:
            started = time.monotonic()
            reports = repl.run_cycle(keys)
            took = time.monotonic() - started
        finally:
            repl.close()
    errors = {r.session: r.error for r in reports}
    assert all("timeout expired" in errors[str(k)] or "did not answer earlier" in errors[str(k)] for k in keys[:3])
    assert sum("did not answer earlier in this cycle" in errors[str(k)] for k in keys[:3]) == 2, errors
    assert not errors["site-a->site-b/policy"], errors
    assert link.accepted == 1, f"site-c was waited for {link.accepted} times in a cycle of {took:.1f} s"


# a call on a bounded connection (call deadline 4 s) in a process of its own, its backend's pid said
# as it starts: a second and a half of the server's time (a sleep: a loaded machine does not stretch
# it towards the deadline, as it did a CPU-bound query), with no statement timeout of the server's
_CALL_IN_A_PROCESS = """
import sys
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.timeouts import DEADLINES, Timeouts
bounds = Timeouts(statement_timeout_s=2, keepalives_idle_s=1, keepalives_interval_s=1, keepalives_count=1)
conn = conninfo.from_dsn(sys.argv[1]).with_timeouts(bounds).connect()
assert conn.deadline_s == 4.0, conn.deadline_s
with conn.cursor() as cur:
    cur.execute("SET statement_timeout = 0")
    print(conn.info.backend_pid, flush=True)
    cur.execute("SELECT pg_catalog.pg_sleep(1.5)")
    cur.execute("SELECT 1")
print("cut", DEADLINES.cut, flush=True)
"""


@pytest.mark.timeout(60)
def test_a_process_stopped_past_its_calls_deadline_and_continued_cuts_none_of_them(lr_sites):
    """A replicator and its server's backend stopped (SIGSTOP, a suspended VM) mid-call for longer
    than the call's deadline, then continued: the call goes on and answers; it ran for less than
    its deadline. Its deadline counts the time the process ran: nothing is cut. Before, the
    continued process cut every call it had in flight, its servers blamed ("a stopped server or a
    stalled link")."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CALL_IN_A_PROCESS, lr_sites[0].dsn], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        backend = int(proc.stdout.readline())
        time.sleep(0.2)  # the call under way
        for pid in (proc.pid, backend):
            os.kill(pid, signal.SIGSTOP)
        time.sleep(5.0)  # past the 4 s deadline
        for pid in (backend, proc.pid):
            os.kill(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "cut 0", out


def test_a_session_of_a_silent_sink_moving_to_another_replicator_does_not_hold_the_healthy_sinks_stream(lr_sites):
    """site-c stops answering while the stream writes it (its write in flight, its sessions out of
    the rounds); then its session moves to another ``lr sync`` (membership: the Streamer's
    ``leave``). site-b's entries go on streaming meanwhile: the leave does not wait for the silent
    site's write (cut only at ``sink_deadline``, here 30 s) on the stream's thread, as the rounds do
    not. The sink's position is the truth: the next holder fences the sink, so the write in flight
    commits before it or is refused. Once site-c answers again every entry is there once."""
    source, sink_b, sink_c = lr_sites
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}],
        # a transaction the stall caught open is not ended by site-c's server (which the link would pass
        # on as a closed connection): the write in flight stays in flight until its call deadline (23 s)
        settings={**BOUNDS, "statement_timeout_s": 20, "idle_in_transaction_timeout_s": 60},
    )
    app = App(source)
    link = LinkProxy(sink_c.conninfo.params["port"])
    repl = bounded(topo, {"site-a": source.dsn, "site-b": sink_b.dsn, "site-c": link.dsn(sink_c.dsn)})
    with Streaming(repl, StreamSettings(**{**RETRY.__dict__, "sink_deadline": 30.0})) as streaming, link:
        streaming.streaming()
        stream = streaming.streamer.sources["site-a"]
        app.put("k0", 0, ["site-b", "site-c"])
        wait_for(lambda: logs(sink_b) == logs(sink_c) == ["k0=0"], 30, "k0 at both sinks")
        link.stall()
        app.put("k1", 1, ["site-b", "site-c"])
        wait_for(lambda: "site-c" in stream.sinks.busy, 30, "site-c's write in flight")
        key_c = next(k for k in stream.members if k.sink == "site-c")
        stream.leave(key_c)  # another replicator's share now
        put = time.monotonic()
        app.put("k2", 2, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 3, 60, "k2 at site-b")
        lag = time.monotonic() - put
        assert lag < SLACK, f"site-b's entry waited {lag:.1f} s for the silent site-c's session to leave"
        link.reset()
        wait_for(lambda: len(logs(sink_c)) == 2, 60, "site-c's entries once its link is back")
    assert logs(sink_b) == ["k0=0", "k1=1", "k2=2"]
    assert logs(sink_c) == ["k0=0", "k1=1"]
    app.close()


@contextmanager
def two_clients_streaming(lr_sites, lock_timeout_s: int, statement_timeout_s: int, sink_deadline: float):
    """policy and billing streaming from site-a to site-b and site-c (billing's provider empty):
    (the application, the ``Streaming``, site-a's stream), every session in the stream."""
    source = lr_sites[0]
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", "billing"]}],
        settings={**BOUNDS, "statement_timeout_s": statement_timeout_s, "lock_timeout_s": lock_timeout_s},
    )
    app = App(source)
    repl = bounded(topo, {s.site_id: s.dsn for s in lr_sites})
    repl.providers["billing"] = empty_provider
    with Streaming(repl, StreamSettings(**{**RETRY.__dict__, "sink_deadline": sink_deadline})) as streaming:
        streaming.streaming()
        stream = streaming.streamer.sources["site-a"]
        wait_for(lambda: len(stream.members) == 4, 30, "every session to join the stream")
        yield app, streaming, stream
    app.close()


@contextmanager
def policy_row_locked(sink) -> Iterator[None]:
    """policy's session row at ``sink`` locked by another transaction: its writes there wait."""
    holder = sink.connect()
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT 1 FROM lr.sink_sessions WHERE client_name = 'policy' FOR UPDATE")
        yield
    finally:
        holder.rollback()
        holder.close()


def test_a_session_rejoining_while_its_sinks_write_waits_on_a_lock_does_not_hold_the_healthy_sinks_stream(lr_sites):
    """site-c's write for policy waits on its session row, locked elsewhere (its lock_timeout is
    16 s here); meanwhile a full sync of billing at site-c hands billing back, its cycle syncs it
    and it joins the stream again. site-b's entries go on streaming: the join waits for site-c's
    write to land, not the stream's thread. Before, the join's use of site-c's connection waited
    for that write in flight, every site-b entry behind it."""
    source, sink_b, sink_c = lr_sites
    billing = SessionKey("site-a", "site-c", "billing")
    with two_clients_streaming(lr_sites, 16, 30, 30.0) as (app, streaming, stream):
        with policy_row_locked(sink_c):
            app.put("k0", 0, ["site-b", "site-c"])
            wait_for(lambda: len(logs(sink_b)) == 1, 30, "k0 at site-b")
            wait_for(lambda: "site-c" in stream.sinks.busy, 10, "site-c's write waiting on the lock")
            request = source.connect()
            full_sync.request_full_sync(request, "site-c", "billing", "test", forced=True)
            request.close()
            wait_for(lambda: any(e.session == str(billing) for e in streaming.streamer.ends), 10, "billing handed back")
            wait_for(lambda: billing in streaming.streamer.streaming, 10, "billing's cycle to hand it to the stream")
            for i in (1, 2):  # k1 may be read before the join is taken up; k2 comes after it
                put = time.monotonic()
                app.put(f"k{i}", i, ["site-b"])
                wait_for(lambda: len(logs(sink_b)) == i + 1, 60, f"k{i} at site-b")
            lag = time.monotonic() - put
            assert lag < SLACK, f"site-b's entry waited {lag:.1f} s behind billing's join"
        wait_for(lambda: len(logs(sink_c)) == 1, 30, "k0 at site-c once the lock is gone")
        wait_for(lambda: billing in stream.members, 10, "billing streaming again")
    assert logs(sink_b) == ["k0=0", "k1=1", "k2=2"] and logs(sink_c) == ["k0=0"]


def test_a_join_held_for_a_busy_sink_does_not_hold_a_join_to_a_healthy_sink(lr_sites):
    """site-c's write for policy waits on its session row, locked elsewhere (lock_timeout 30 s);
    billing's join to site-c is held until that write lands. billing's join to site-b, asked after
    it (a full sync of billing at site-b), is taken at once: requests of other sinks are not queued
    behind a held join. Before, it waited for site-c's lock with the held join (30 s here)."""
    source, sink_b, sink_c = lr_sites
    billing_b, billing_c = SessionKey("site-a", "site-b", "billing"), SessionKey("site-a", "site-c", "billing")
    with two_clients_streaming(lr_sites, 30, 40, 45.0) as (app, streaming, stream):
        with policy_row_locked(sink_c):
            app.put("k0", 0, ["site-b", "site-c"])
            wait_for(lambda: "site-c" in stream.sinks.busy, 10, "site-c's write waiting on the lock")
            request = source.connect()
            full_sync.request_full_sync(request, "site-c", "billing", "test", forced=True)
            wait_for(
                lambda: billing_c not in stream.members and billing_c in streaming.streamer.streaming,
                20,
                "billing's join to site-c held",
            )
            full_sync.request_full_sync(request, "site-b", "billing", "test", forced=True)
            request.close()
            wait_for(lambda: billing_b not in stream.members, 10, "billing handed back at site-b")
            wait_for(
                lambda: billing_b in stream.members, 15, "billing streaming into site-b again, site-c still locked"
            )
            assert "site-c" in stream.sinks.busy and billing_c not in stream.members
        wait_for(lambda: billing_c in stream.members, 10, "billing streaming into site-c once the lock is gone")
        wait_for(lambda: len(logs(sink_c)) == 1, 30, "k0 at site-c")
    assert logs(sink_b) == ["k0=0"] and logs(sink_c) == ["k0=0"]
