"""The delivery transaction on the subscriber's autocommit connection: its BEGIN rides with the lock
and the head read, its COMMIT with the consume, and what a listener does to the connection during
a callback never splits the listener's writes from the consume."""

from __future__ import annotations

import psycopg2
import psycopg2.extensions
import pytest

from airflow_provider_lr.engine.sink.receive import ReceiveQueueReader
from airflow_provider_lr.proto import lr_pb2
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
from tests.support.session import queue
from tests.support.subscriber import Recorder, insert_raw


def log_entries(site, payloads: list[str], source: str = "site-x") -> None:
    for text in payloads:
        msg = lr_pb2.RoutingTableEntryMsg(type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=text.encode())
        insert_raw(site, source, lr_pb2.LOG_ENTRY_SYNC, msg.SerializeToString())


class Wire(psycopg2.extensions.connection):
    """A connection that notes every statement sent and every commit()/rollback() asked of it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []
        self.cursor_factory = _NotingCursor

    def commit(self) -> None:
        self.sent.append("commit()")
        super().commit()

    def rollback(self) -> None:
        self.sent.append("rollback()")
        super().rollback()


class _NotingCursor(psycopg2.extensions.cursor):
    def execute(self, sql, params=None):  # type: ignore[override]
        self.connection.sent.append(sql)
        return super().execute(sql, params)


class Applies(Recorder):
    """Writes each payload to ``applied`` through the delivery connection, then acknowledges."""

    def __init__(self, conn) -> None:
        super().__init__()
        self.conn = conn

    def on_log_entry_messages(self, source, payloads):
        with self.conn().cursor() as cur:
            for p in payloads:
                cur.execute("INSERT INTO applied VALUES (%s)", (p.decode(),))
        return super().on_log_entry_messages(source, payloads)


def applied(site) -> list[str]:
    return [r[0] for r in site.query("SELECT payload FROM applied ORDER BY payload")]


def test_a_delivery_is_two_round_trips_and_the_listeners_write_commits_with_the_consume(lr_sites):
    _, sink, _ = lr_sites
    sink.query("CREATE TABLE applied (payload text)")
    log_entries(sink, ["x=1"])
    conn = psycopg2.connect(sink.dsn, connection_factory=Wire)
    conn.autocommit = True
    try:
        report = ReceiveQueueReader(conn).deliver(Applies(lambda: conn), "policy", ["site-x"])
        delivery = [s for s in conn.sent if "INSERT INTO applied" not in s]
        assert report.delivered == 1 and len(delivery) == 2, delivery
        assert delivery[0].startswith("BEGIN;") and delivery[1].endswith("COMMIT")
        assert conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    finally:
        conn.close()
    assert applied(sink) == ["x=1"] and queue(sink, "site-x") == []


def test_a_long_head_is_read_through_a_cursor_on_the_autocommit_connection(lr_sites):
    _, sink, _ = lr_sites
    log_entries(sink, [f"x={i:02}" for i in range(40)])
    recorder = Recorder()
    with RoutingQueueSubscriber(sink.dsn, client_name="policy", batch_size=40) as sub:
        assert sub.poll(recorder) == 40 and recorder.calls == 1
    assert recorder.of("site-x") == [("log", f"x={i:02}") for i in range(40)]


def test_a_listeners_commit_or_rollback_inside_a_callback_ends_nothing(lr_sites):
    """On the autocommit delivery connection commit() and rollback() are no-ops: the listener's
    write still rolls back when it then refuses the entries, and commits with the consume when it
    acknowledges them."""
    _, sink, _ = lr_sites
    sink.query("CREATE TABLE applied (payload text)")
    log_entries(sink, ["x=1"])
    sub = RoutingQueueSubscriber(sink.dsn, client_name="policy")

    class CommitsThenRefusesOnce(Applies):
        refusals = 1

        def on_log_entry_messages(self, source, payloads):
            super().on_log_entry_messages(source, payloads)
            sub.connection.commit()
            sub.connection.rollback()
            if self.refusals:
                self.refusals -= 1
                return False
            return True

    listener = CommitsThenRefusesOnce(lambda: sub.connection)
    assert sub.poll(listener) == 0 and sub.stats.refused == 1
    assert applied(sink) == [] and queue(sink, "site-x") == [("log", "x=1")]
    assert sub.poll(listener) == 1
    assert applied(sink) == ["x=1"] and queue(sink, "site-x") == []
    sub.close()


def test_a_listener_that_turns_autocommit_off_is_rolled_back_and_the_connection_set_back(lr_sites):
    _, sink, _ = lr_sites
    sink.query("CREATE TABLE applied (payload text)")
    log_entries(sink, ["x=1", "x=2"])
    sub = RoutingQueueSubscriber(sink.dsn, client_name="policy", batch_size=1)

    class TurnsAutocommitOff(Applies):
        def on_log_entry_messages(self, source, payloads):
            sub.connection.autocommit = False
            return super().on_log_entry_messages(source, payloads)

    assert sub.poll(TurnsAutocommitOff(lambda: sub.connection)) == 0
    assert sub.stats.failures == 1 and "autocommit" in sub.stats.errors[-1]
    assert applied(sink) == [] and queue(sink, "site-x") == [("log", "x=1"), ("log", "x=2")]
    assert sub.poll(Applies(lambda: sub.connection)) == 2
    assert applied(sink) == ["x=1", "x=2"] and queue(sink, "site-x") == []
    sub.close()


def test_a_connection_that_lost_the_prepared_head_read_goes_on_reading_it_as_text(lr_sites):
    _, sink, _ = lr_sites
    log_entries(sink, ["x=1", "x=2", "x=3"])
    sub = RoutingQueueSubscriber(sink.dsn, client_name="policy", batch_size=1)

    class Deallocates(Recorder):
        prepared: list[list[str]] = []

        def on_log_entry_messages(self, source, payloads):
            with sub.cursor() as cur:
                cur.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
                self.prepared.append([r[0] for r in cur.fetchall()])
                cur.execute("DEALLOCATE ALL")
            return super().on_log_entry_messages(source, payloads)

    listener = Deallocates()
    assert sub.poll(listener) == 3 and sub.stats.failures == 0
    assert listener.prepared == [["lr_receive_head_v2"], [], []]
    assert listener.of("site-x") == [("log", "x=1"), ("log", "x=2"), ("log", "x=3")]
    sub.close()


def test_the_writes_of_a_callback_interrupted_by_a_base_exception_never_commit_with_a_later_delivery(lr_sites):
    """A KeyboardInterrupt goes through the delivery to the caller, leaving its transaction open on
    the kept connection: the next delivery rolls it back instead of committing in it."""
    _, sink, _ = lr_sites
    sink.query("CREATE TABLE applied (payload text)")
    log_entries(sink, ["x=1"])
    sub = RoutingQueueSubscriber(sink.dsn, client_name="policy")

    class Interrupted(Applies):
        def on_log_entry_messages(self, source, payloads):
            super().on_log_entry_messages(source, payloads)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sub.poll(Interrupted(lambda: sub.connection))
    recorder = Recorder()
    assert sub.poll(recorder) == 1 and recorder.of("site-x") == [("log", "x=1")]
    assert applied(sink) == [] and queue(sink, "site-x") == []
    sub.close()
