"""A stream's sink transactions in one round trip (``stream_batch.stream_batches``): each writes only when the
sink's session is exactly where the stream left it, and otherwise leaves no trace, so the general
path (``apply_log_stream``) decides."""

from __future__ import annotations

import select
import threading

import psycopg2
import psycopg2.extensions
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.db import prepared
from airflow_provider_lr.engine.errors import FencedError
from airflow_provider_lr.engine.sink import stream_batch, writes
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogReader, LogRecord
from airflow_provider_lr.engine.store.receive_queue import STREAM_ROW
from airflow_provider_lr.engine.store.sink_sessions import STREAM_ADVANCE
from airflow_provider_lr.engine.vocabulary import NOTIFY_CHANNEL
from tests.support.session import App, apply, empty_provider, queue, replicator, sink_queue


class CountingCursor(psycopg2.extensions.cursor):
    """Counts the statements (round trips) sent through it."""

    sent = 0

    def execute(self, query, vars=None):  # noqa: A002 - psycopg2's own name
        CountingCursor.sent += 1
        return super().execute(query, vars)


@pytest.fixture
def session(lr_sites):
    """site-a → site-b for ``policy`` in log-entry sync, then 4 entries committed and not sent:
    (source, sink, epoch, base, the batch of them as a stream reads it)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(source)
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})
    repl.run(max_cycles=3, until_idle=True, interval=0.01)  # consistent, in log-entry sync
    for i in range(1, 5):
        app.put(f"k{i}", i, ["site-b"])
    last, epoch, base = sink_b.query(
        "SELECT last_log_entry_processed, lease_epoch, snapshot_applied FROM lr.sink_sessions"
    )[0]
    src = source.connect()
    batch = LogReader(src, "site-b", client_name="policy").read_stream(last).collect()
    assert len(batch.records) == 4 and batch.after == last
    yield source, sink_b, epoch, base, LogBatch(batch.after, batch.end, list(batch.records))
    src.close()
    repl.close()
    app.close()


def _one(conn, epoch: int, batch: LogBatch, base: int) -> int | None:
    """One session's batch by ``stream_batches``."""
    (end,) = stream_batch.stream_batches(conn, "site-a", [stream_batch.StreamWrite("policy", epoch, batch, base)])
    return end


def _autocommit(sink) -> psycopg2.extensions.connection:
    conn = sink.connect()
    conn.autocommit = True
    return conn


def _log(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def test_where_the_stream_left_it_the_batch_commits_in_one_round_trip_and_wakes_subscribers(session):
    _, sink, epoch, base, batch = session
    conn = psycopg2.connect(sink.dsn, cursor_factory=CountingCursor)
    conn.autocommit = True
    listener = _autocommit(sink)
    listener.cursor().execute(f"LISTEN {NOTIFY_CHANNEL}")
    first, *rest = batch.records
    # the connection's first batch prepares its statements; every later one is one round trip
    assert _one(conn, epoch, LogBatch(batch.after, first.position, [first]), base) == first.position
    CountingCursor.sent = 0
    assert _one(conn, epoch, LogBatch(first.position, batch.end, rest), base) == batch.end
    assert CountingCursor.sent == 1
    assert conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    assert _log(sink) == [f"k{i}={i}" for i in range(1, 5)]
    assert sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions") == [(batch.end,)]
    assert select.select([listener], [], [], 5)[0], "the subscribers were woken"
    listener.poll()
    assert listener.notifies
    for c in (conn, listener):
        c.close()


@pytest.mark.parametrize(
    "change, refusal",
    [
        ("lease_epoch = lease_epoch + 1", "stale"),  # a new lease holder fenced the session
        ("failed_over_to = 'site-c'", "failed over"),  # `lr failover` closed it
    ],
)
def test_a_fenced_or_failed_over_session_writes_nothing_and_the_general_path_refuses(session, change, refusal):
    _, sink, epoch, base, batch = session
    sink.query(f"UPDATE lr.sink_sessions SET {change}")
    conn = _autocommit(sink)
    assert _one(conn, epoch, batch, base) is None
    assert _log(sink) == []
    with pytest.raises(FencedError, match=refusal):
        writes.apply_log_stream(conn, "site-a", "policy", epoch, batch, base, False, False)
    conn.close()


def test_a_sink_another_writer_moved_on_writes_nothing_and_the_general_path_adds_only_what_is_new(session):
    _, sink, epoch, base, batch = session
    conn = _autocommit(sink)
    first = LogBatch(batch.after, batch.records[1].position, batch.records[:2])
    assert _one(conn, epoch, first, base) == first.end
    # the stream believes the sink is still at batch.after: the whole batch again
    assert _one(conn, epoch, batch, base) is None
    assert _log(sink) == ["k1=1", "k2=2"]
    assert writes.apply_log_stream(conn, "site-a", "policy", epoch, batch, base, False, False) == batch.end
    assert _log(sink) == [f"k{i}={i}" for i in range(1, 5)]  # no duplicates
    conn.close()


def test_another_base_or_an_inconsistent_sink_writes_nothing(session):
    _, sink, epoch, base, batch = session
    conn = _autocommit(sink)
    assert _one(conn, epoch, batch, base + 1) is None
    sink.query("UPDATE lr.sink_sessions SET data_consistent = false")
    assert _one(conn, epoch, batch, base) is None
    assert _log(sink) == []
    conn.close()


def test_a_batch_changing_a_table_whose_target_the_connection_never_read_is_left_to_the_general_path(session):
    _, sink, epoch, base, batch = session
    change = LogRecord(batch.records[0].position, batch.records[0].entry_id, batch.records[0].message, 7)
    conn = _autocommit(sink)
    assert _one(conn, epoch, LogBatch(batch.after, batch.end, [change]), base) is None
    assert sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions") == [(batch.after,)]
    conn.close()


def test_a_lock_wait_that_times_out_raises_and_leaves_the_connection_out_of_any_transaction(session):
    _, sink, epoch, base, batch = session
    holder = sink.connect()
    holder.cursor().execute("SELECT 1 FROM lr.sink_sessions FOR UPDATE")  # a cycle holds the session's row
    conn = _autocommit(sink)
    conn.cursor().execute("SET lock_timeout = '200ms'")
    with pytest.raises(psycopg2.errors.LockNotAvailable):
        _one(conn, epoch, batch, base)
    assert conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    holder.rollback()
    assert _log(sink) == []
    assert _one(conn, epoch, batch, base) == batch.end
    assert _log(sink) == [f"k{i}={i}" for i in range(1, 5)]
    holder.close()
    conn.close()


def test_a_concurrent_fence_while_waiting_for_the_row_is_seen_after_the_wait(session):
    _, sink, epoch, base, batch = session
    holder = sink.connect()
    holder.cursor().execute("UPDATE lr.sink_sessions SET lease_epoch = lease_epoch + 1")  # not committed yet
    conn = _autocommit(sink)
    outcome: list[object] = []
    writer = threading.Thread(target=lambda: outcome.append(_one(conn, epoch, batch, base)))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive(), "the stream waits for the row's lock"
    holder.commit()
    writer.join(10)
    assert outcome == [None]  # the row re-read after the wait: fenced, nothing written
    assert _log(sink) == []
    holder.close()
    conn.close()


@pytest.fixture
def two_sessions(lr_sites):
    """site-a → site-b for ``policy`` and ``billing`` in log-entry sync, then 3 entries each, not sent:
    (sink, {client: StreamWrite})."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy", "billing"]}])
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider, "billing": empty_provider})
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    writer = source.connect()
    for client in ("policy", "billing"):
        for i in range(3):
            RoutingQueueClient(writer, client).transmit_log_entry_message(f"{client}{i}".encode(), ["site-b"])
            writer.commit()
    src = source.connect()
    pending = {}
    for client in ("policy", "billing"):
        last, epoch, base = sink_b.query(
            "SELECT last_log_entry_processed, lease_epoch, snapshot_applied FROM lr.sink_sessions "
            "WHERE client_name = %s",
            (client,),
        )[0]
        batch = LogReader(src, "site-b", client_name=client).read_stream(last).collect()
        pending[client] = stream_batch.StreamWrite(
            client, epoch, LogBatch(batch.after, batch.end, list(batch.records)), base
        )
    yield sink_b, pending
    for conn in (src, writer):
        conn.close()
    repl.close()


def test_the_sessions_of_one_sink_site_commit_each_in_its_own_transaction_in_one_round_trip(two_sessions):
    sink, pending = two_sessions
    conn = psycopg2.connect(sink.dsn, cursor_factory=CountingCursor)
    conn.autocommit = True
    prepared.ensure(conn, STREAM_ADVANCE, STREAM_ROW)  # as the connection's first write does
    CountingCursor.sent = 0
    ends = stream_batch.stream_batches(conn, "site-a", [pending["policy"], pending["billing"]])
    assert ends == [pending["policy"].batch.end, pending["billing"].batch.end]
    assert CountingCursor.sent == 1
    for client in ("policy", "billing"):
        assert sink_queue(sink, client) == [f"{client}{i}".encode() for i in range(3)]
    conn.close()


def test_one_session_not_where_it_was_left_sends_every_session_of_the_round_trip_to_the_general_path(two_sessions):
    """The transactions before the one refused committed, those after it did not: all are
    answered None, and the general path adds only what each sink does not have."""
    sink, pending = two_sessions
    sink.query("UPDATE lr.sink_sessions SET lease_epoch = lease_epoch + 1 WHERE client_name = 'billing'")
    conn = _autocommit(sink)
    assert stream_batch.stream_batches(conn, "site-a", [pending["policy"], pending["billing"]]) == [None, None]
    assert sink_queue(sink, "policy") == [b"policy0", b"policy1", b"policy2"]  # committed before the refusal
    assert sink_queue(sink, "billing") == []
    policy = pending["policy"]
    end = writes.apply_log_stream(conn, "site-a", "policy", policy.epoch, policy.batch, policy.base, False, False)
    assert end == policy.batch.end and sink_queue(sink, "policy") == [b"policy0", b"policy1", b"policy2"]
    billing = pending["billing"]
    with pytest.raises(FencedError, match="stale"):
        writes.apply_log_stream(conn, "site-a", "billing", billing.epoch, billing.batch, billing.base, False, False)
    conn.close()


def test_statements_discarded_from_the_connection_send_one_batch_to_the_general_path_then_are_prepared_again(session):
    """A pooler in transaction mode runs DISCARD ALL between transactions: the stream's prepared
    guard and row are gone, so that round trip fails whole and leaves nothing; the next prepares them again."""
    _, sink, epoch, base, batch = session
    conn = psycopg2.connect(sink.dsn, cursor_factory=CountingCursor)
    conn.autocommit = True
    first, second, *rest = batch.records
    assert _one(conn, epoch, LogBatch(batch.after, first.position, [first]), base) == first.position
    conn.cursor().execute("DISCARD ALL")
    assert _one(conn, epoch, LogBatch(first.position, second.position, [second]), base) is None
    assert _log(sink) == ["k1=1"]
    assert _one(conn, epoch, LogBatch(first.position, batch.end, [second, *rest]), base) == batch.end
    CountingCursor.sent = 0
    assert _one(conn, epoch, LogBatch(batch.end, batch.end + 1, []), base) == batch.end + 1  # prepared: one trip
    assert CountingCursor.sent == 1
    assert _log(sink) == [f"k{i}={i}" for i in range(1, 5)]
    conn.close()
