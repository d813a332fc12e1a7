"""A stream commits its sink transactions asynchronously and acknowledges on the source only what
the sink's WAL flush has passed: a sink crash after an asynchronous commit, before its flush, loses
that commit on the sink but never an entry (the source still holds it; the stream resends it from
the sink's durable position). An application's asynchronous commit on the source, which lr reads and
delivers at once, is made durable at commit: a crash of the source never forgets what a sink holds."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.session.durable_acks import WAL_POSITIONS_SQL
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source import trim
from tests.support.session import Streaming, apply, empty_provider, replicator, sink_queue, wait_for

# a database made in the background meanwhile (tests/conftest.py) would flush the WAL the test keeps unflushed
pytestmark = pytest.mark.quiet_servers

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
FAST = StreamSettings(check_interval=0.2, ack_interval=0.05)


def _acked(source) -> int:
    return source.query(
        "SELECT acked_position FROM lr.source_sessions WHERE sink_site_id = 'site-b' AND client_name = 'policy'"
    )[0][0]


def _processed(sink) -> int:
    rows = sink.query(
        "SELECT last_log_entry_processed FROM lr.sink_sessions WHERE source_site_id = 'site-a' AND client_name = 'policy'"
    )
    return rows[0][0] if rows else -1


def _transmit(conn, payload: str) -> None:
    RoutingQueueClient(conn, "policy").transmit_log_entry_message(payload.encode(), ["site-b"])
    conn.commit()


def _stall_wal_flushers(site) -> list[int]:
    """Stop (SIGSTOP) the processes that flush ``site``'s WAL on their own: its WAL writer, and its
    background writer and checkpointer (a dirty page is written only once the WAL up to it is
    flushed). Its asynchronous commits then stay unflushed until a backend flushes (a synchronous
    commit). Their pids, to continue."""
    pids = [
        pid
        for (pid,) in site.query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type IN ('walwriter', 'background writer', 'checkpointer')"
        )
    ]
    assert len(pids) == 3, pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _crash(site_manager, site) -> None:
    """``site``'s server dies at once, as in a power cut: every one of its processes is frozen
    (SIGSTOP: none writes or flushes from here), then killed (SIGKILL). What its WAL writer had not
    flushed is gone; the restart recovers from the disk."""
    pid = site_manager.postmaster_pid(site.server)
    assert pid is not None, f"{site.site_id}'s server is not running"
    postmaster = psutil.Process(pid)
    processes = [postmaster, *postmaster.children()]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.suspend()
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


@contextlib.contextmanager
def _wal_flushers_stalled(site) -> Iterator[None]:
    """``_stall_wal_flushers``, continued on the way out (those still running)."""
    pids = _stall_wal_flushers(site)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_streamed_entry_is_acknowledged_only_once_the_sinks_wal_flush_passed_its_commit(lr_sites):
    """Entries committed on the sink (visible to its applications) but not yet flushed are not
    acknowledged on the source, however many ack rounds pass; once the sink flushes, they are."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})
    writer = source.connect()
    # a checkpoint flushes the WAL the test keeps unflushed (a 1 s window: then the test failed, "flushed
    # early"); one now puts the next timed one (every checkpoint_timeout, 5 min) past the test
    sink.query("CHECKPOINT")
    with Streaming(repl, FAST) as streaming, _wal_flushers_stalled(sink):
        streaming.streaming()
        for i in range(20):
            _transmit(writer, f"entry {i}")
        wait_for(lambda: len(sink_queue(sink, "policy")) == 20, 10, "the entries committed on the sink")
        applied = _processed(sink)
        time.sleep(0.5)  # ten ack rounds
        flushed, inserted = sink.query(WAL_POSITIONS_SQL)[0]
        assert flushed < inserted, "the sink's WAL was flushed early: nothing left to look at"
        assert _acked(source) < applied, "a position was acknowledged before the sink's WAL flush passed its commit"
        epoch = sink.query("SELECT lease_epoch FROM lr.sink_sessions")[0][0]
        conn = sink.connect()
        writes.flush(conn, "site-a", "policy", epoch)  # what a stopping stream does: one synchronous fenced commit
        conn.close()
        assert sink.query(WAL_POSITIONS_SQL)[0][0] >= inserted, "the fenced synchronous commit flushed the WAL"
        wait_for(lambda: _acked(source) == applied, 5, "the acknowledgement once the sink flushed")
    writer.close()


def test_sink_server_killed_after_async_commits_before_their_flush_loses_nothing(lr_sites, site_manager):
    """The sink's server stops immediately (a crash: what its WAL writer had not written is gone)
    while entries stream at 400/s; the source is trimmed of everything acknowledged meanwhile. The
    source never acknowledged more than the restarted sink holds, and every entry arrives once, in
    order, resent from the sink's durable position."""
    source, sink, _ = lr_sites
    for site in (source, sink):  # production durability, but for the stream's own asynchronous commits
        site.query(f'ALTER DATABASE "{site.dbname}" SET synchronous_commit = on')
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=2.0)
    payloads = [f"entry {i}".encode() for i in range(1200)]
    writer = source.connect()

    def write() -> None:
        for i, payload in enumerate(payloads):
            _transmit(writer, payload.decode())
            if i % 4 == 0:
                time.sleep(0.01)

    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        writing = threading.Thread(target=write)
        writing.start()
        wait_for(lambda: len(sink_queue(sink, "policy")) > 200, 15, "entries streaming")
        _stall_wal_flushers(sink)  # from here the stream's commits on the sink stay in its WAL buffers
        wait_for(lambda: len(sink_queue(sink, "policy")) > 400, 15, "entries committed, not flushed")
        time.sleep(0.3)  # ack rounds pass
        applied = _processed(sink)  # read last: any synchronous commit on the sink before it flushed the WAL
        _crash(site_manager, sink)
        try:
            acked = _acked(source)
            trim.safe_trim(source.connect())  # whatever the source believes delivered is gone from it
        finally:
            site_manager.up(site_ids=[sink.site_id])
        recovered = _processed(sink)
        assert recovered < applied, "the crash lost none of the unflushed commits: the window was not exercised"
        assert acked <= recovered, f"acknowledged position {acked} beyond the {recovered} the sink held after its crash"
        writing.join()
        wait_for(lambda: len(sink_queue(sink, "policy")) >= len(payloads), 60, "every entry after the restart")
        assert sink_queue(sink, "policy") == payloads, "an entry lost, repeated or out of order"
    writer.close()


def test_an_asynchronous_commit_the_stream_delivered_survives_the_sources_crash(lr_sites, site_manager):
    """The application commits asynchronously (its own ``synchronous_commit = off``: the server's
    default is on, as in production) and the stream delivers at once; the source's server then stops immediately with
    those commits still in its WAL buffers (its WAL writer stalled). A source that forgot entries a
    sink holds diverges for good (the sink replays what the source says never happened, and the
    table changes after it are refused), so lr makes the transactions that write its log durable at
    commit: after the restart the source holds every entry the sink has, and they agree."""
    source, sink, _ = lr_sites
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, lease_seconds=2.0)

    def application():
        conn = source.connect()
        conn.cursor().execute("SET synchronous_commit = off")  # its choice: a crash may lose its last commits
        return conn

    writer = application()
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        for i in range(5):
            _transmit(writer, f"entry {i}")
        wait_for(lambda: len(sink_queue(sink, "policy")) == 5, 10, "the first entries at the sink")
        _stall_wal_flushers(source)  # from here the source's asynchronous commits stay in its WAL buffers
        for i in range(5, 10):
            _transmit(writer, f"entry {i}")
        wait_for(lambda: len(sink_queue(sink, "policy")) == 10, 10, "the entries committed after the stall")
        _crash(site_manager, source)
        site_manager.up(site_ids=[source.site_id])
        writer = application()
        for i in range(10, 15):
            _transmit(writer, f"entry {i}")
        kept = source.query("SELECT count(*) FROM lr.log_entries WHERE stream = 1")[0][0]
        assert kept == 15, f"the source forgot {15 - kept} of the entries its sink received"
        wait_for(lambda: len(sink_queue(sink, "policy")) >= 15, 30, "the entries after the restart")
        time.sleep(0.3)
        assert sink_queue(sink, "policy") == [f"entry {i}".encode() for i in range(15)]
    writer.close()


def test_a_cycles_batch_is_acknowledged_only_once_durable_on_a_sink_that_commits_asynchronously(lr_sites, site_manager):
    """The sink's server runs with ``synchronous_commit = off`` (its operator's choice). A cycle
    acknowledges its batch on the source right after the sink's commit, so that commit must be on
    the sink's disk first: otherwise a crash of the sink loses a batch the source already counts as
    delivered, and a safe trim removes it from the source for good (the session then needs a full
    sync, and the entries never arrive as entries)."""
    source, sink, _ = lr_sites
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')
    sink.query(f'ALTER DATABASE "{sink.dbname}" SET synchronous_commit = off')
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})
    repl.run(max_cycles=20, until_idle=True, interval=0.05)  # first contact
    writer = source.connect()
    sink.query("CHECKPOINT")  # everything so far on the sink's disk
    with _wal_flushers_stalled(sink):
        for i in range(5):
            _transmit(writer, f"entry {i}")
        repl.run(max_cycles=20, until_idle=True, interval=0.05)
        assert len(sink_queue(sink, "policy")) == 5
        acked = _acked(source)
        repl.close()
        _crash(site_manager, sink)
    site_manager.up(site_ids=[sink.site_id])
    assert acked <= _processed(sink), f"acknowledged {acked}, beyond the {_processed(sink)} the sink kept"
    assert len(sink_queue(sink, "policy")) == 5, "the sink kept what it acknowledged"
    writer.close()
