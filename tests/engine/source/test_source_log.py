"""Source side: transmit inside the application's transaction, and a log reader that never skips
a late commit and delivers conflicting transactions in commit order (guarantees 1–4 in docs/architecture.md)."""

from __future__ import annotations

import threading

import pytest

from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient
from airflow_provider_lr.engine.errors import TransmitError
from airflow_provider_lr.engine.source import log_writer
from airflow_provider_lr.engine.source.commit_barrier import holdback
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.proto import lr_pb2
from tests.support.session import CounterWriters, apply, drain


@pytest.fixture
def source(lr_sites):
    apply(lr_sites)
    return lr_sites[0]


@pytest.fixture
def dests(lr_sites):
    return [s.site_id for s in lr_sites[1:]]


def app_conn(source):
    conn = source.connect()
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS app_rows (id int PRIMARY KEY, v int NOT NULL)")
    conn.commit()
    return conn


def payloads(records) -> list[bytes]:
    return [r.decode().opaque_payload for r in records]


def test_commit_makes_entries_visible_and_rollback_leaves_no_trace(source, dests):
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    client.transmit_log_entry_message(b"rolled back", dests)
    conn.rollback()
    client.transmit_log_entry_message(b"kept", dests)
    reader = LogReader(source.connect(), dests[0])
    assert drain(reader)[0] == []  # not committed yet
    conn.commit()
    assert payloads(drain(reader)[0]) == [b"kept"]
    assert source.query("SELECT count(*) FROM lr.log_entries") == [(1,)]
    assert source.query("SELECT count(*) FROM lr.log_commits") == [(1,)]


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared insert", "plain insert"])
def test_clients_sharing_a_connection_transmit_in_its_transaction(source, dests, prepared):
    """The prepared insert is made once per connection, survives rollbacks, and a second client on
    the same connection reuses it; without it (behind a pooler) transmit behaves the same."""
    conn = app_conn(source)
    first = RoutingQueueClient(conn, "policy", prepared=prepared)
    first.transmit_log_entry_message(b"gone", dests)
    conn.rollback()
    second = RoutingQueueClient(conn, "policy", prepared=prepared)
    first.transmit_log_entry_message(b"one", dests[:1])
    second.transmit_log_entry_message(b"two", dests)
    conn.commit()
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == [b"one", b"two"]
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = 'lr_transmit_v3'")
        assert cur.fetchone()[0] == (1 if prepared else 0)


def test_one_stored_entry_per_message_tagged_once_per_destination(source, dests):
    conn = app_conn(source)
    RoutingQueueClient(conn, "policy").transmit_log_entry_message(b"\x00payload\xff", dests)
    conn.commit()
    rows = source.query("SELECT stream, stream_tags FROM lr.shared_log")
    assert rows == [("LRQ_Send_LogEntries", [f"lrq_logentry_{d}" for d in sorted(dests)])]
    for dest in dests:
        (record,) = drain(LogReader(source.connect(), dest))[0]
        msg = record.decode()
        assert list(msg.destinations) == dests
        assert msg.type == lr_pb2.LOG_ENTRY_SYNC
        assert msg.opaque_payload == b"\x00payload\xff"
        assert (msg.source_site_id, msg.client_name) == (source.site_id, "policy")


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared insert", "plain insert"])
@pytest.mark.parametrize("conforming", ["on", "off"], ids=["standard strings", "backslash-escaped strings"])
def test_every_byte_arrives_as_sent_and_the_ticket_names_the_transaction(source, dests, prepared, conforming):
    """The prepared insert's text is built by lr, not the driver: payloads of every byte value (quotes,
    backslashes, NUL) arrive unchanged whether the application's session reads backslashes in plain
    string literals as escapes or not, one message or many, and the ticket names the transaction."""
    conn = app_conn(source)
    with conn.cursor() as cur:
        cur.execute(f"SET standard_conforming_strings = {conforming}")
    conn.commit()
    client = RoutingQueueClient(conn, "policy", prepared=prepared)
    every_byte, quoted = bytes(range(256)), b"'\\x41'\\\\E'\\'"
    ticket = client.transmit_log_entry_message(every_byte, dests)
    client.transmit_log_entry_messages(
        [LRMessageWithDestinations(quoted, dests), LRMessageWithDestinations(b"", dests)]
    )
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.pg_current_xact_id()::pg_catalog.text")
        assert ticket.tx == int(cur.fetchone()[0])
    conn.commit()
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == [every_byte, quoted, b""]


def test_one_call_of_more_messages_than_one_statement_holds_keeps_transmit_order(source, dests):
    """2,500 messages in one call are written 1,000 to a statement: one transaction, in transmit order."""
    conn = app_conn(source)
    sent = [f"m{i}".encode() for i in range(2500)]
    ticket = RoutingQueueClient(conn, "policy").transmit_log_entry_messages(
        [LRMessageWithDestinations(p, dests[:1]) for p in sent]
    )
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.pg_current_xact_id()::pg_catalog.text")
        assert ticket is not None and ticket.tx == int(cur.fetchone()[0])
    conn.commit()
    records, _ = drain(LogReader(source.connect(), dests[0]))
    assert payloads(records) == sent
    assert source.query("SELECT count(*) FROM lr.log_commits") == [(1,)]


def test_reader_for_a_destination_follows_only_its_tag(source, dests):
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    client.transmit_log_entry_message(b"b only", [dests[0]])
    client.transmit_log_entry_message(b"c only", [dests[1]])
    client.transmit_log_entry_message(b"both", dests)
    conn.commit()
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == [b"b only", b"both"]
    assert payloads(drain(LogReader(source.connect(), dests[1]))[0]) == [b"c only", b"both"]


@pytest.mark.parametrize(
    "payload, destinations, error",
    [
        (b"x", [], "non-empty list"),
        (b"x", "site-b", "non-empty list"),
        (b"x", ["nowhere"], "unknown destination"),
        (b"x", ["SELF"], "cannot transmit to itself"),
        (b"x" * 1025, ["DEST"], "exceeds the maximum of 1024 bytes"),
        (memoryview(bytes(1032)).cast("q"), ["DEST"], "payload of 1032 bytes exceeds"),  # 129 items of 8 bytes
        ("text", ["DEST"], "must be bytes"),
        (b"x", None, "non-empty list of site ids, not NoneType"),  # were TypeErrors
        (b"x", 5, "non-empty list of site ids, not int"),
        (b"x", [["DEST"]], "must be site ids"),
    ],
)
def test_bad_input_is_refused_clearly_and_nothing_is_written(source, dests, payload, destinations, error):
    destinations = (
        [{"SELF": source.site_id, "DEST": dests[0]}.get(d, d) if isinstance(d, str) else d for d in destinations]
        if isinstance(destinations, list)
        else destinations
    )
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy", max_payload_bytes=1024)
    client.transmit_log_entry_message(b"good", dests)
    with pytest.raises(TransmitError, match=error):
        client.transmit_log_entry_messages(
            [LRMessageWithDestinations(b"also good", dests), LRMessageWithDestinations(payload, destinations)]
        )
    conn.commit()  # the application's transaction is still usable
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == [b"good"]


def test_a_client_name_no_topology_can_hold_is_refused_when_the_client_is_made_and_said_short(source):
    """The writer checked a client name with ``str.isalnum``: 'pólicy' (any Unicode letter), a
    leading '-' and any length passed, and a transmit then said the client was not in the topology,
    quoting a 100,000-character name whole. Now the topology's own rule, at construction."""
    conn = app_conn(source)
    for client in ("pólicy", "-policy", "p" * 100_000, "policy\n"):
        with pytest.raises(TransmitError, match="invalid client name") as refused:
            RoutingQueueClient(conn, client)
        assert len(str(refused.value)) < 300 and "\n" not in str(refused.value), client[:10]


def test_destinations_given_as_a_generator_or_a_set_reach_those_sinks_and_later_lists_too(source, dests):
    """The writer read a generator of destinations twice: once for its cache key, once to check it,
    which found it exhausted. The entry was stored addressed to nobody (a ticket returned, the payload
    lost), and the empty route was cached under the key: every later transmit to the same sinks as a
    list went nowhere too. A message that is not an LRMessageWithDestinations was an AttributeError."""
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    sent = [
        (b"a generator", (d for d in dests)),
        (b"a list after it", list(dests)),
        (b"an iterator", iter(reversed(dests))),
        (b"a set", set(dests)),
        (b"a sink named twice", [dests[0], dests[1], dests[0]]),  # once per sink: one tag, one delivery
    ]
    tickets = [client.transmit_log_entry_message(p, d) for p, d in sent]
    assert all(t.destinations == tuple(sorted(dests)) for t in tickets), tickets
    ticket = client.transmit_log_entry_messages([LRMessageWithDestinations(b"many", (d for d in dests))])
    assert ticket is not None and ticket.destinations == tuple(sorted(dests))
    for junk in (None, [b"bytes"]):
        with pytest.raises(TransmitError, match="LRMessageWithDestinations"):
            client.transmit_log_entry_messages(junk)  # type: ignore[arg-type]
    conn.commit()
    for sink in dests:
        records, _ = drain(LogReader(source.connect(), sink))
        assert payloads(records) == [p for p, _ in sent] + [b"many"]


def test_a_stored_entry_is_what_protobuf_serializes_for_every_payload_size_and_destination_list(source, dests):
    """The writer assembles an entry around its payload from fields it serialized once per list of
    destinations: the stored bytes are protobuf's own, which the sinks read byte by byte."""
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    lists = [dests, list(reversed(dests)), [dests[0], dests[0]], [dests[1]]]
    sizes = [0, 1, 127, 128, 16_383, 16_384, 1 << 20]
    sent = [(bytes([n % 251]) * size, lists[n % len(lists)]) for n, size in enumerate(sizes * 2)]
    for payload, destinations in sent:
        client.transmit_log_entry_message(payload, destinations)
    conn.commit()
    stored = [bytes(m) for (m,) in source.query("SELECT message FROM lr.log_entries ORDER BY entry_id")]
    assert stored == [
        lr_pb2.RoutingTableEntryMsg(
            destinations=list(dict.fromkeys(d)),
            type=lr_pb2.LOG_ENTRY_SYNC,
            opaque_payload=p,
            source_site_id=source.site_id,
            client_name="policy",
        ).SerializeToString()
        for p, d in sent
    ]


def test_a_list_of_destinations_checked_once_still_has_every_payload_checked(source, dests):
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy", max_payload_bytes=1024)
    client.transmit_log_entry_message(b"good", dests)
    with pytest.raises(TransmitError, match="exceeds the maximum"):
        client.transmit_log_entry_message(b"x" * 1025, dests)
    with pytest.raises(TransmitError, match="must be bytes"):
        client.transmit_log_entry_message("text", dests)  # type: ignore[arg-type]
    client.transmit_log_entry_message(bytearray(b"a bytearray"), dests)
    client.transmit_log_entry_message(memoryview(b"a memoryview"), tuple(dests))
    conn.commit()
    expected = [b"good", b"a bytearray", b"a memoryview"]
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == expected


def test_a_writer_keeps_a_bounded_number_of_checked_destination_lists(source, dests, monkeypatch):
    monkeypatch.setattr(log_writer, "MAX_ROUTES", 2)
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    lists = [dests, [dests[0]], [dests[1]], list(reversed(dests))]
    for n, destinations in enumerate(lists):
        client.transmit_log_entry_message(b"%d" % n, destinations)
        assert len(client._routes) <= 2
    conn.commit()
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == [b"0", b"1", b"3"]


BARRIER_OR_FINAL_PREFIX = pytest.mark.parametrize("final", [False, True], ids=["barrier", "final_prefix"])


@BARRIER_OR_FINAL_PREFIX
def test_late_commit_is_never_skipped(source, dests, final):
    """T1 transmits first (smaller entry id) but commits after T2: a reader that persisted its
    position after T2 still gets T1. The naive `entry_id > last seen` reader loses it."""
    t1, t2 = app_conn(source), app_conn(source)
    RoutingQueueClient(t1, "policy").transmit_log_entry_message(b"T1 (late)", dests)
    RoutingQueueClient(t2, "policy").transmit_log_entry_message(b"T2", dests)
    t2.commit()

    reader = LogReader(source.connect(), dests[0])
    first, position = drain(reader, final=final)
    assert payloads(first) == [b"T2"]
    naive_last_seen = source.query("SELECT max(entry_id) FROM lr.log_entries")[0][0]

    t1.commit()
    later, _ = drain(reader, after=position, final=final)
    assert payloads(later) == [b"T1 (late)"]
    # The naive reader would never see T1 again: its id is below what it already saw.
    assert source.query("SELECT count(*) FROM lr.log_entries WHERE entry_id > %s", (naive_last_seen,)) == [(0,)]


def test_conflicting_transactions_arrive_in_commit_order_not_xid_order(source, dests):
    """The transaction with the smaller xid updates the shared row last and commits last."""
    conn = app_conn(source)
    with conn.cursor() as cur:
        cur.execute("INSERT INTO app_rows VALUES (1, 0)")
    conn.commit()
    small, big = app_conn(source), app_conn(source)
    with small.cursor() as cur:
        cur.execute("SELECT pg_current_xact_id()")  # takes the smaller xid now
        small_xid = int(cur.fetchone()[0])
    with big.cursor() as cur:
        cur.execute("UPDATE app_rows SET v = 1 WHERE id = 1 RETURNING pg_current_xact_id()")
        assert int(cur.fetchone()[0]) > small_xid
    RoutingQueueClient(big, "policy").transmit_log_entry_message(b"v=1", dests)
    big.commit()
    with small.cursor() as cur:
        cur.execute("UPDATE app_rows SET v = 2 WHERE id = 1")
    RoutingQueueClient(small, "policy").transmit_log_entry_message(b"v=2", dests)
    small.commit()
    assert payloads(drain(LogReader(source.connect(), dests[0]))[0]) == [b"v=1", b"v=2"]


@BARRIER_OR_FINAL_PREFIX
def test_six_writers_on_shared_counters_with_an_open_transaction(source, dests, final):
    """Guarantee 2's scenario: concurrent increments of shared counters, one unrelated
    transaction holding an xid open. Every entry arrives once, each counter's values in order."""
    idle = source.connect()
    with idle.cursor() as cur:
        cur.execute("SELECT pg_current_xact_id()")  # an open transaction holding an xid, all along
    writers = CounterWriters(source, dests)
    stop_reading = threading.Event()
    received: list = []

    def reader_loop() -> None:
        reader, position = LogReader(source.connect(), dests[0]), 0
        while True:
            done = stop_reading.is_set()
            batch = reader.read_stream(position, max_entries=50, final=final).collect()
            received.extend(batch.records)
            position = batch.end
            if done and not batch.has_more:
                return

    consumer = threading.Thread(target=reader_loop)
    consumer.start()
    writers.run()
    stop_reading.set()
    consumer.join()
    idle.rollback()
    writers.check(payloads(received))


def test_final_prefix_stops_at_a_position_in_flight_and_the_barrier_passes_a_rolled_back_one(source, dests):
    """The final prefix never reads past a drawn position that is not committed: T1 draws position
    1 and stays open (the commit-position trigger made immediate), T2 commits position 2: nothing
    is final yet, though 2 is committed. T1 commits: both, in position order. A position drawn by
    a transaction that rolls back never shows up: the final prefix stops before it, the barrier
    read passes it."""
    t1, t2 = app_conn(source), app_conn(source)
    with t1.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the position is drawn at the statement
    RoutingQueueClient(t1, "policy").transmit_log_entry_message(b"T1", dests)
    RoutingQueueClient(t2, "policy").transmit_log_entry_message(b"T2", dests)
    t2.commit()
    reader = LogReader(source.connect(), dests[0])
    batch = reader.read_stream(0, final=True).collect()
    assert (batch.records, batch.end, batch.has_more) == ([], 0, True)  # 2 committed, 1 in flight
    t1.commit()
    batch = reader.read_stream(0, final=True).collect()
    assert payloads(batch.records) == [b"T1", b"T2"] and batch.end == 2

    with t1.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
    RoutingQueueClient(t1, "policy").transmit_log_entry_message(b"rolled back", dests)  # draws 3
    t1.rollback()
    RoutingQueueClient(t2, "policy").transmit_log_entry_message(b"T4", dests)
    t2.commit()
    stuck = reader.read_stream(2, final=True).collect()
    assert (stuck.records, stuck.end, stuck.has_more) == ([], 2, True)
    passed = reader.read_stream(2).collect()  # behind the barrier: 3 is final (rolled back), so 4 is read
    assert payloads(passed.records) == [b"T4"] and passed.end == 4


def test_set_constraints_all_immediate_does_not_put_a_transaction_before_one_it_wrote_after(source, dests):
    """An application checks its deferred constraints before commit (SET CONSTRAINTS ALL IMMEDIATE):
    lr's deferred trigger fires at once and draws T1's commit position before T1 is done. T2 commits
    (a later position); T1 then writes after T2 (a federated table's change is one such entry) and
    commits. T1 was delivered first, so a sink applied T1's later change to a row and then T2's
    earlier one: the sink's table kept T2's value, the source T1's. Now an entry written after the
    draw draws the position again: T1 comes after T2, whole; the first position is passed like a
    rolled-back one. A transaction that writes nothing after the draw keeps it. Needs V0035."""
    t1, t2 = app_conn(source), app_conn(source)
    with t1.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
    RoutingQueueClient(t1, "policy").transmit_log_entry_message(b"T1 early", dests)  # draws its position now
    RoutingQueueClient(t2, "policy").transmit_log_entry_message(b"T2", dests)
    t2.commit()
    RoutingQueueClient(t1, "policy").transmit_log_entry_messages(
        [LRMessageWithDestinations(b"T1 late", dests), LRMessageWithDestinations(b"T1 last", dests)]
    )
    t1.commit()
    reader = LogReader(source.connect(), dests[0])
    assert payloads(drain(reader)[0]) == [b"T2", b"T1 early", b"T1 late", b"T1 last"]
    assert source.query("SELECT count(*) FROM lr.log_commits") == [(2,)]  # one position each


def test_final_batch_in_one_statement_reads_what_the_general_read_does(source, dests):
    """``read_final_batch`` (a stream's small read) gives the records, end and barrier of the
    general final-prefix read, with a base snapshot's split left out too; a prefix of more than
    FETCH_ROWS entries is left to the general read (None), never cut inside a transaction."""
    from airflow_provider_lr.engine.source.log_reader import FETCH_ROWS, BaseSplit

    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    for i in range(30):
        client.transmit_log_entry_message(f"e{i}".encode(), dests if i % 3 else dests[1:])
        if i % 4 == 3:
            conn.commit()
    conn.commit()
    reader = LogReader(source.connect(), dests[0], client_name="policy")
    with source.connect() as snap_conn, snap_conn.cursor() as cur:  # a split that covers positions 1-4
        cur.execute("SELECT pg_current_snapshot()::text, 4")
        split = BaseSplit(*cur.fetchone())
    for after, cut in [(0, None), (2, None), (0, split), (3, split)]:
        fast = reader.read_final_batch(after, split=cut)
        general = reader.read_stream(after, split=cut, final=True).collect()
        assert fast is not None
        assert (fast.records, fast.end, fast.barrier) == (general.records, general.end, general.barrier), (after, cut)
    end = reader.read_stream(0, final=True).collect().end
    client.transmit_log_entry_messages(
        [LRMessageWithDestinations(b"big", dests) for _ in range(FETCH_ROWS + 1)]
    )  # one transaction
    conn.commit()
    assert reader.read_final_batch(end) is None
    whole = reader.read_stream(end, final=True).collect()
    assert len(whole.records) == FETCH_ROWS + 1
    conn.close()


def test_transactions_stay_whole_and_in_transmit_order_across_small_batches(source, dests):
    conn = app_conn(source)
    client = RoutingQueueClient(conn, "policy")
    for tx in range(4):
        client.transmit_log_entry_message(f"{tx}.0".encode(), dests)
        client.transmit_log_entry_messages([LRMessageWithDestinations(f"{tx}.{i}".encode(), dests) for i in (1, 2)])
        conn.commit()
    reader = LogReader(source.connect(), dests[0])
    position, batches = 0, []
    while True:
        batch = reader.read_stream(position, max_entries=2).collect()  # smaller than a transaction
        if not batch.records:
            break
        batches.append(payloads(batch.records))
        position = batch.end
    assert batches == [[f"{tx}.{i}".encode() for i in range(3)] for tx in range(4)]

    by_bytes = reader.read_stream(0, max_bytes=1).collect()
    assert len(by_bytes.records) == 3 and by_bytes.has_more


def test_transmit_does_not_serialize_concurrent_transactions(source, dests):
    """Two application transactions transmit concurrently: the second commits while the first is
    still open, with no wait on any lock the first holds."""
    t1, t2 = app_conn(source), app_conn(source)
    RoutingQueueClient(t1, "policy").transmit_log_entry_message(b"t1", dests)
    RoutingQueueClient(t2, "policy").transmit_log_entry_message(b"t2", dests)
    with t2.cursor() as cur:
        cur.execute("SET LOCAL lock_timeout = '500ms'")
    t2.commit()  # would raise on a lock held by t1
    with t1.cursor() as cur:
        cur.execute("SELECT 1")
    t1.commit()
    assert sorted(payloads(drain(LogReader(source.connect(), dests[0]))[0])) == [b"t1", b"t2"]


def test_reader_names_what_holds_it_back(source, dests):
    open_tx = app_conn(source)
    RoutingQueueClient(open_tx, "policy").transmit_log_entry_message(b"pending", dests)
    with open_tx.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
    held = holdback(source.connect())
    assert [(h.kind, h.pid) for h in held] == [("open_transaction", pid)]
    assert "not committed yet" in held[0].describe()
    open_tx.rollback()
    assert holdback(source.connect()) == []


def test_prepared_transaction_holds_the_barrier_and_is_reported(source, dests):
    """A prepared transaction has drawn its commit position but is not visible: the reader must not
    move past it, must say why, and must deliver it after COMMIT PREPARED, before later entries."""
    prepared = app_conn(source)
    RoutingQueueClient(prepared, "policy").transmit_log_entry_message(b"prepared", dests)
    with prepared.cursor() as cur:
        cur.execute("PREPARE TRANSACTION 'lr-test-gid'")
    prepared.close()
    later = app_conn(source)
    RoutingQueueClient(later, "policy").transmit_log_entry_message(b"later", dests)
    later.commit()

    admin = source.connect()
    admin.autocommit = True
    try:
        reader = LogReader(source.connect(), dests[0], barrier_timeout=0.3)
        batch = reader.read_stream(0).collect()
        assert batch.records == [] and batch.end == 0
        assert [(h.kind, h.gid) for h in batch.blocked_by] == [("prepared_transaction", "lr-test-gid")]
        assert "COMMIT/ROLLBACK PREPARED" in batch.blocked_by[0].describe()
        with admin.cursor() as cur:
            cur.execute("COMMIT PREPARED 'lr-test-gid'")
        assert payloads(drain(reader)[0]) == [b"prepared", b"later"]
    finally:
        with admin.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
            for (gid,) in cur.fetchall():
                cur.execute(f"ROLLBACK PREPARED '{gid}'")
