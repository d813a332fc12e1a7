"""One reader per source: a source's streaming sessions share one read of its log (the routed
read, tests/engine/source/test_routed_read.py) and one connection per site, whatever their number;
each session still gets exactly its own entries, once, in commit order."""

from __future__ import annotations

import itertools
import os
import threading
import time

import psycopg2
import psycopg2.extensions
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.timeouts import Timeouts
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session import source_stream, stream_writes
from airflow_provider_lr.engine.session.handshake import Position
from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.session.stream_member import REASSIGNED, Member
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source.log_reader import LogBatch
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import Streaming, apply, empty_provider, replicator, sink_queue, wait_for
from tests.support.tables import federate

CLIENTS = ["policy", "billing", "audit"]
SIX_SESSIONS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": CLIENTS}]
ONE_SESSION = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
FAST = StreamSettings(check_interval=0.2, ack_interval=0.05)


def _backends(site) -> int:
    """Client connections to the test's database on ``site``, other than the one asking."""
    return site.query(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )[0][0]


def _transmit(conn, client: str, payload: str, destinations: list[str]) -> None:
    RoutingQueueClient(conn, client).transmit_log_entry_message(payload.encode(), destinations)
    conn.commit()


def test_six_sessions_of_one_source_stream_over_a_fixed_number_of_source_connections(lr_sites):
    """Three clients to two sinks (six sessions) stream from ONE source stream: the replicator holds
    three connections to the source (its cycles', the stream's read and its acks), not two per
    session; every entry reaches exactly the sessions it names, once, in commit order."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, SIX_SESSIONS, providers={c: "tests.support.session:empty_provider" for c in CLIENTS})
    before = _backends(source)
    repl = replicator(topo, lr_sites, providers={c: empty_provider for c in CLIENTS}, lease_seconds=2.0)
    writer = source.connect()
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        assert _backends(source) - before <= 3 + 1, "the replicator's source connections grow with its sessions"
        assert len(streaming.streamer.sources) == 1
        for i in range(30):
            client = CLIENTS[i % 3]
            where = {"policy": ["site-b"], "billing": ["site-c"], "audit": ["site-b", "site-c"]}[client]
            _transmit(writer, client, f"{client}-{i}", where)
        expected = {
            (sink, client): [f"{client}-{i}".encode() for i in range(30) if CLIENTS[i % 3] == client]
            for sink in ("site-b", "site-c")
            for client in CLIENTS
        }
        expected[("site-c", "policy")] = []  # policy's entries named site-b only
        expected[("site-b", "billing")] = []  # billing's named site-c only
        sinks = {"site-b": sink_b, "site-c": sink_c}
        wait_for(
            lambda: all(sink_queue(sinks[s], c) == want for (s, c), want in expected.items()),
            20,
            "every session's entries",
        )
        assert _backends(source) - before <= 3 + 1
    writer.close()


def test_a_session_whose_one_round_trip_write_is_lost_after_its_commit_comes_back_and_nothing_is_skipped(lr_sites):
    """The sink transaction of one session commits (in the one round trip of its sink site), then
    the stream does not learn it (a fault there): that session leaves, the cycles bring it back from
    its sink's position, the other streams on; both sinks end with every entry once, in order."""
    source, sink_b, sink_c = lr_sites
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}],
        providers={"policy": "tests.support.session:empty_provider"},
    )
    applies = itertools.count()

    def lose_one() -> None:
        if next(applies) == 30:
            raise RuntimeError("the sink transaction committed, then its answer was lost")

    writer = source.connect()
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=2.0)
    with Streaming(repl, FAST) as streaming, on_fault("stream_after_sink_apply", lose_one):
        streaming.streaming()
        for i in range(200):
            _transmit(writer, "policy", f"e{i}", ["site-b", "site-c"])
            time.sleep(0.003)
        want = [f"e{i}".encode() for i in range(200)]
        wait_for(
            lambda: sink_queue(sink_b, "policy") == want and sink_queue(sink_c, "policy") == want, 30, "both sinks"
        )
        assert [e.reason for e in streaming.streamer.ends].count("failed") == 1, streaming.streamer.ends
    writer.close()


def test_sessions_of_a_sink_whose_connection_was_lost_mid_round_say_what_lost_it(lr_sites):
    """Two sessions' writes to one sink site by the general path (each session's first write), one
    after the other on the stream's connection, which the server has ended: both hand back with the
    server's reason, not the first with it and the second with "connection already closed" (what
    ``lr status`` then showed for every session after the first)."""
    _, sink_b, _ = lr_sites
    conn = sink_b.connect()
    sink_b.query(f"SELECT pg_terminate_backend({conn.info.backend_pid})")
    key = lambda client: SessionKey("site-a", "site-b", client)  # noqa: E731
    jobs = [
        (Member(key(c), None, Position(0, 0, None, 1), None, None, None), LogBatch(0, 1))  # type: ignore[arg-type]
        for c in ("policy", "billing")
    ]
    first, second = stream_writes.apply_site(conn, jobs, "site-a")
    assert isinstance(first, psycopg2.OperationalError), first
    assert second is first, second
    conn.close()


def _checks(sent: list[tuple[int, str]], port: int) -> int:
    """The stream's checks among the ``sent`` statements: each asks the source (at ``port``) for
    the open full-sync requests once."""
    return sum(
        p == port and "SELECT DISTINCT sink_site_id, client_name FROM lr.full_sync_requests" in q for p, q in sent
    )


class _TracedCursor(psycopg2.extensions.cursor):
    """Records each statement with the port of the server it went to."""

    sent: list[tuple[int, str]] = []

    def execute(self, query, vars=None):  # type: ignore[no-untyped-def]
        text = self.mogrify(query, vars).decode()
        _TracedCursor.sent.append((self.connection.info.port, text))
        return super().execute(query, vars)


def test_an_idle_stream_of_many_clients_checks_their_federated_tables_in_one_read_per_site(lr_sites, monkeypatch):
    """Twelve clients, each with a federated table, to two sinks (24 sessions) stream and nothing is
    written: each check of the stream looks for newly federated tables of every client in ONE
    statement on the source, and for what each sink lacks in one read per sink site: not a read per
    client on the source and one per session on the sinks every second (3 round trips each)."""
    source, sink_b, sink_c = lr_sites
    clients = [f"client-{i}" for i in range(12)]
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": clients}],
        providers={c: "tests.support.session:empty_provider" for c in clients},
    )
    for client in clients:
        table = f"public.{client.replace('-', '_')}"
        source.query(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
        federate(source, table, client)
    connect = psycopg2.connect
    monkeypatch.setattr(psycopg2, "connect", lambda dsn, **kw: connect(dsn, cursor_factory=_TracedCursor, **kw))
    # the default lease: one of 2 s ran out between a loaded machine's checks, the cycles took the
    # sessions back (a new epoch) and their handshakes' reads of the sinks' tables fell in the window
    repl = replicator(topo, lr_sites, providers={c: empty_provider for c in clients})
    port = source.server.port
    with Streaming(repl, FAST) as streaming:
        streaming.streaming(timeout=60)
        stream = streaming.streamer.sources["site-a"]
        for _ in range(5):  # a window in which every session streams, joined: no handshake, no cycle carries one
            wait_for(lambda: len(stream.members) == 2 * len(clients), 30, "every session's join (its handshake)")
            ends = len(streaming.streamer.ends)
            _TracedCursor.sent.clear()
            # three checks (FAST: every 0.2 s, however long a loaded machine makes them)
            wait_for(lambda: _checks(list(_TracedCursor.sent), port) >= 3, 30, "three checks of the stream")
            sent = list(_TracedCursor.sent)
            if len(streaming.streamer.ends) == ends:
                break
        else:
            raise AssertionError(f"no window without a hand-back: {streaming.cycles[-5:]}, {streaming.streamer.ends}")
    on = {site.site_id: [q for port, q in sent if port == site.server.port] for site in lr_sites}
    checks = _checks(sent, port)
    assert checks >= 3, checks
    reads = {site: sum("FROM lr.registry" in q or "FROM lr.sink_tables" in q for q in qs) for site, qs in on.items()}
    assert reads["site-a"] <= checks + 1, f"{reads['site-a']} reads of the source's registry in {checks} checks"
    for sink in ("site-b", "site-c"):  # the sink's tables and its registry: two statements, one round trip
        assert reads[sink] <= 2 * (checks + 1), f"{reads[sink]} reads of {sink}'s tables in {checks} checks"
    tables = [f"public.{c.replace('-', '_')}" for c in clients]
    for sink in (sink_b, sink_c):  # every session's table synced before the stream took it
        assert sink.query("SELECT count(to_regclass(t)) FROM unnest(%s::text[]) t", (tables,))[0][0] == 12


def test_commits_made_while_the_stream_checks_its_sessions_are_read_between_the_checks_steps(lr_sites, monkeypatch):
    """The stream's check (leases, topology, full-sync requests, backlog, tables: several round
    trips, ~5 ms) is taken a step at a time between rounds: an entry committed while the check
    counts the backlog is read before the check goes on to the full-sync requests, instead of
    waiting for the whole check (the stream's longest housekeeping stall)."""
    source, _, _ = lr_sites
    topo = apply(
        lr_sites,
        ONE_SESSION,
        providers={"policy": "tests.support.session:empty_provider"},
    )
    writer = source.connect()
    count_backlogs = source_stream.session_backlogs

    def backlogs_then_a_commit(conn):  # a commit lands while the check counts (on the stream's thread)
        counted = count_backlogs(conn)
        _transmit(writer, "policy", "during the check", ["site-b"])
        return counted

    monkeypatch.setattr(source_stream, "session_backlogs", backlogs_then_a_commit)
    connect = psycopg2.connect
    monkeypatch.setattr(psycopg2, "connect", lambda dsn, **kw: connect(dsn, cursor_factory=_TracedCursor, **kw))
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})  # the default lease: none runs out

    def between() -> list[int]:
        """For each check traced so far, the routed reads between its backlog count and its next step."""
        sent = [q for port, q in list(_TracedCursor.sent) if port == source.server.port]
        steps = [n for n, q in enumerate(sent) if "lr.session_backlogs(" in q]  # the backlog count
        reads = []
        for start in steps:
            end = next((n for n, q in enumerate(sent[start:], start) if "FROM lr.full_sync_requests" in q), None)
            if end is not None:
                reads.append(sum("lr_routed_read" in q for q in sent[start:end]))
        return reads

    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        _TracedCursor.sent.clear()
        # three checks (FAST: every 0.2 s, however long a loaded machine makes them)
        wait_for(lambda: len(between()) >= 3, 30, "three checks of the stream")
        found = between()
    writer.close()
    assert all(found), f"routed reads between each check's backlog count and its next step: {found}"


def test_a_session_fenced_by_the_replicator_it_moved_to_before_its_leave_is_seen_ends_as_reassigned(
    lr_sites, monkeypatch
):
    """The Streamer asks a stream to let a session go (another replicator's share now) and the new
    holder fences the sink before the stream's thread sees the request: the stream's next write is
    refused (``FencedError``). That is the move it was asked for: the session ends as reassigned,
    not as a failure (no error printed by ``lr sync``, no hand-back counted)."""
    source, sink_b, _ = lr_sites
    topo = apply(
        lr_sites,
        ONE_SESSION,
        providers={"policy": "tests.support.session:empty_provider"},
    )
    writer = source.connect()
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=30.0)
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        _transmit(writer, "policy", "before", ["site-b"])
        wait_for(lambda: sink_queue(sink_b, "policy") == [b"before"], 10, "the first entry")
        (stream,) = streaming.streamer.sources.values()
        (key,) = list(stream.members)
        admit = stream._admit
        monkeypatch.setattr(stream, "_admit", lambda: None)  # the request waits in the queue
        stream.leave(key)
        sink_b.query("UPDATE lr.sink_sessions SET lease_epoch = lease_epoch + 1")  # the new holder's fence
        _transmit(writer, "policy", "after", ["site-b"])
        wait_for(lambda: any(e.session == str(key) for e in streaming.streamer.ends), 10, "the session to end")
        monkeypatch.setattr(stream, "_admit", admit)
        (end,) = [e for e in streaming.streamer.ends if e.session == str(key)]
        assert end.reason == REASSIGNED and not end.error, end
    writer.close()


def test_the_stream_waits_under_load_from_a_rate_that_grows_with_the_cores_it_may_run_on(monkeypatch):
    """The wait at ``busy_rate`` leaves a busy machine's cores to the writers: a machine with more
    cores is that busy at a higher rate (1,000 deliveries/s per core)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert StreamSettings().busy_rate == 2000.0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert StreamSettings().busy_rate == 8000.0
    assert StreamSettings(busy_rate=500.0).busy_rate == 500.0  # as configured


def test_a_stream_whose_source_connection_was_cut_while_it_had_no_session_is_replaced_at_the_next_join(lr_sites):
    """The stream's connection to its source is cut (``pg_terminate_backend``, a restart) while the
    stream has no session (each handed back, reassigned): nothing of it notices until a session
    joins, whose handshake finds it cut. That stream must end, so that the next join starts a new
    one that connects anew. Before, it lived on with the dead connection: every later join of every
    session of that source was refused with `InterfaceError: connection already closed`, and they
    were carried by cycles for as long as the process ran (seen in a chaos run of `lr sync`)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SESSION, providers={"policy": "tests.support.session:empty_provider"})
    writer = source.connect()
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=30.0)
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        (stream,) = streaming.streamer.sources.values()
        key = SessionKey("site-a", "site-b", "policy")
        wait_for(lambda: key in stream.members, 10, "the session in the stream")
        gate, join = threading.Event(), stream._join

        def gated(k: SessionKey, lease) -> None:
            gate.wait(30)  # the rejoin waits here, on the stream's thread, until the connection is cut
            join(k, lease)

        stream._join = gated  # type: ignore[method-assign]
        stream.leave(key)  # the session leaves: the stream has none
        wait_for(lambda: not stream.members, 10, "the session to leave the stream")
        pid = stream.src.info.backend_pid
        source.query("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: not source.query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)), 10, "the cut")
        gate.set()

        def closed() -> int:
            return sum("connection already closed" in e.error for e in streaming.streamer.ends if e.session == str(key))

        wait_for(lambda: stream.finished or closed() >= 3, 20, "the stream to end, or its joins to be refused")
        assert stream.finished, [e for e in streaming.streamer.ends if e.session == str(key)]
        wait_for(
            lambda: streaming.streamer.sources.get("site-a") not in (None, stream)
            and key in streaming.streamer.sources["site-a"].members,
            20,
            "the session streaming in a new stream",
        )
        _transmit(writer, "policy", "after the cut", ["site-b"])
        wait_for(lambda: sink_queue(sink_b, "policy") == [b"after the cut"], 10, "the entry after the cut")
    writer.close()


def test_a_lease_renewal_refused_at_the_source_leaves_the_sinks_connections_alone(lr_sites):
    """The stream renews its sessions' leases in one statement at the source; a lock held there on
    their rows makes it fail (lock_timeout): the sessions go back to the cycles and come back. The
    sinks' connections stay: the error was the source's. Before, each failed session's sink
    connection was closed as if its sink were lost (its write in flight, if any, waited for on the
    stream's thread first)."""
    source, *_ = lr_sites
    two_sinks = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
    topo = apply(lr_sites, two_sinks, providers={"policy": "tests.support.session:empty_provider"})
    infos = {s.site_id: conninfo.from_dsn(s.dsn).with_timeouts(Timeouts(lock_timeout_s=0.5)) for s in lr_sites}
    settings = SessionSettings(data_timeout=30.0, barrier_timeout=2.0, lease_seconds=2.0)
    repl = Replicator(topo, lambda site: infos[site].connect(), settings=settings, providers={"policy": empty_provider})
    with Streaming(
        repl, StreamSettings(check_interval=0.2, ack_interval=0.05, retry_min=0.2, retry_max=1.0)
    ) as streaming:
        streaming.streaming()
        stream = streaming.streamer.sources["site-a"]
        wait_for(lambda: len(stream.members) == 2, 30, "both sessions in the stream")
        kept = dict(stream.sinks._conns)
        assert set(kept) == {"site-b", "site-c"}
        holder = source.connect()
        try:
            with holder.cursor() as cur:
                cur.execute("SELECT 1 FROM lr.source_sessions FOR UPDATE")
            wait_for(lambda: len(streaming.streamer.ends) >= 2, 30, "the renewal refused for both sessions")
        finally:
            holder.rollback()
            holder.close()
        assert all("lock" in end.error for end in streaming.streamer.ends), streaming.streamer.ends
        streaming.streaming()
        wait_for(lambda: len(stream.members) == 2, 30, "both sessions back in the stream")
        assert streaming.streamer.sources["site-a"] is stream
        assert {site: stream.sinks._conns.get(site) for site in kept} == kept, "a sink's connection was dropped"


@pytest.mark.parametrize("write", ["idle", "in flight"])
def test_a_sink_removed_from_the_topology_while_streaming_keeps_no_connection_of_the_stream(lr_sites, write):
    """policy streams to site-b and site-c; the topology is applied again without site-c (while the
    stream's write to site-c waits on a lock there, or not): its session leaves the stream (site-b's
    rejoins), and the stream's connection to site-c is closed once unused for ``idle_for`` (and its
    write landed; a session handed back that joins again meanwhile finds it). Before, it stayed
    open until the stream ended (for as long as ``lr sync`` ran)."""
    source, sink_b, sink_c = lr_sites
    two_sinks = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
    topo = apply(lr_sites, two_sinks, providers={"policy": "tests.support.session:empty_provider"})
    writer, holder = source.connect(), sink_c.connect()
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=30.0)
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        (stream,) = streaming.streamer.sources.values()
        stream.sinks.idle_for = 0.5
        wait_for(lambda: len(stream.members) == 2, 20, "both sessions streaming")
        _transmit(writer, "policy", "before", ["site-b", "site-c"])
        wait_for(lambda: sink_queue(sink_c, "policy") == [b"before"], 10, "the entry at site-c")
        pid = stream.sinks._conns["site-c"].get_backend_pid()
        if write == "in flight":
            with holder.cursor() as cur:
                cur.execute("SELECT 1 FROM lr.sink_sessions WHERE client_name = 'policy' FOR UPDATE")
            _transmit(writer, "policy", "during", ["site-b", "site-c"])
            wait_for(lambda: "site-c" in stream.sinks.busy, 10, "site-c's write waiting on the lock")
        apply(lr_sites, ONE_SESSION, providers={"policy": "tests.support.session:empty_provider"})
        wait_for(lambda: list(stream.members) == [SessionKey("site-a", "site-b", "policy")], 20, "site-c to leave")
        _transmit(writer, "policy", "after", ["site-b"])
        wait_for(lambda: sink_queue(sink_b, "policy")[-1:] == [b"after"], 10, "site-b streaming on")
        holder.rollback()  # the write in flight lands

        def backend(site, pid) -> bool:
            return bool(site.query("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))[0][0])

        wait_for(lambda: not backend(sink_c, pid), 10, "the stream's connection to site-c to close")
        assert "site-c" not in stream.sinks._conns
    writer.close()
    holder.close()


def test_a_session_fenced_by_its_new_holder_while_its_member_lets_go_of_the_share_ends_as_reassigned(
    lr_sites, monkeypatch
):
    """A member reading its new share releases the leases of the sessions that left it, one round
    trip each, before the Streamer asks their streams to leave: the member they went to fences their
    sinks meanwhile, and a stream writing then is refused (``FencedError``) before any leave reached
    it. Its end is the move all the same: reassigned, not a hand-back (at a join of 200 sessions,
    about half the moved ones were printed as handed back with the FencedError)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SESSION, providers={"policy": "tests.support.session:empty_provider"})
    writer = source.connect()
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=30.0)
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        _transmit(writer, "policy", "before", ["site-b"])
        wait_for(lambda: sink_queue(sink_b, "policy") == [b"before"], 10, "the first entry")
        (stream,) = streaming.streamer.sources.values()
        (key,) = list(stream.members)
        moved: list = []

        def share_without_it(self):  # the read of the share, as it releases the lease ...
            if not moved:
                sink_b.query("UPDATE lr.sink_sessions SET lease_epoch = lease_epoch + 1")  # ... the new holder's fence
                _transmit(writer, "policy", "after", ["site-b"])
                wait_for(lambda: key not in stream.members, 10, "the stream to meet the fence")
                moved.append(key)
            return []

        monkeypatch.setattr(type(repl), "sessions", property(share_without_it))
        wait_for(lambda: any(e.session == str(key) for e in streaming.streamer.ends), 10, "the session to end")
        (end,) = [e for e in streaming.streamer.ends if e.session == str(key)]
        assert end.reason == REASSIGNED and not end.error, end
    writer.close()
