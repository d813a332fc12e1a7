"""Receive-queue rows hold several entries (engine/sink/queue_rows.py, schema V0005): writers pack,
subscribers take a row in pieces, each entry exactly once and in order; a malformed entry inside a
row is moved aside alone; rows written before V0005 are still delivered."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.sink.queue_rows import PACK_BYTES, Packer, QueueRow, piece, positions, unpack
from airflow_provider_lr.proto import lr_pb2
from airflow_provider_lr.subscriber import MalformedEntryError, RoutingQueueSubscriber
from tests.support.subscriber import Flaky, Recorder, expected, insert_raw, settle, started_session

START, SNAP, END, LOG = (
    lr_pb2.SNAPSHOT_SYNC_START,
    lr_pb2.SNAPSHOT_SYNC,
    lr_pb2.LAST_FULL_SYNC_ENTRY,
    lr_pb2.LOG_ENTRY_SYNC,
)


def _entry(kind: int, payload: str = "") -> bytes:
    return lr_pb2.RoutingTableEntryMsg(type=kind, opaque_payload=payload.encode()).SerializeToString()


def queue_rows(site) -> list[tuple[int, int, int]]:
    return site.query("SELECT kind, entry_count, delivered FROM lr.receive_queue ORDER BY seq")


def test_packer_fills_rows_up_to_the_limit_keeps_markers_alone_and_stores_a_single_entry_plain():
    rows: list[QueueRow] = []
    packer = Packer(rows.append, limit=100)
    packer.add(START, 1, 1, b"start")
    for i in range(7):
        packer.add(SNAP, 1, 2 + i, bytes([i]) * 30)  # 32 bytes packed: three fit in 100
    packer.add(END, 1, 9, b"end")
    packer.add(LOG, 2, 10, b"x" * 200)  # larger than a pack: a row of its own, stored plain
    packer.add(LOG, 3, 11, b"y")
    packer.flush()

    assert [(r.kind, r.entry_count) for r in rows] == [
        (START, 1),
        (SNAP, 3),
        (SNAP, 3),
        (SNAP, 1),
        (END, 1),
        (LOG, 1),
        (LOG, 1),
    ]
    assert [unpack(r.entry_count, r.message) for r in rows[1:4]] == [
        [bytes([i]) * 30 for i in range(3)],
        [bytes([i]) * 30 for i in range(3, 6)],
        [bytes([6]) * 30],
    ]
    assert (rows[0].message, rows[4].message, rows[5].message) == (b"start", b"end", b"x" * 200)
    assert (rows[2].position, rows[2].entry_id) == (1, 7)  # a row carries its last entry's place
    assert packer.rows == 7 and packer.entries == 11
    assert piece(b"z" * 300)[:3] == bytes((0x0A, 300 & 0x7F | 0x80, 300 >> 7))  # a two-byte length
    assert unpack(2, piece(b"a") + piece(b"z" * 300)) == [b"a", b"z" * 300]


def test_a_packed_row_says_each_entry_s_commit_position_however_large():
    rows: list[QueueRow] = []
    packer = Packer(rows.append)
    at = [1, 1, 127, 128, 128, 128, 300, 2**40, 2**40, 2**62]  # one- to nine-byte varints, runs of 1 to 3
    for n, position in enumerate(at):
        packer.add(LOG, position, n + 1, b"e%d" % n)
    packer.add(LOG, 2**62, 99, b"last")
    packer.flush()

    ((row),) = rows
    assert positions(row.entry_count, row.message, row.position) == [*at, 2**62]
    assert lr_pb2.ReceiveQueueBatch.FromString(row.message).run_counts == [2, 1, 3, 1, 2, 2]


def test_unpack_refuses_a_row_whose_count_or_container_is_wrong():
    with pytest.raises(ValueError, match="holds 2"):
        unpack(3, piece(b"a") + piece(b"b"))
    with pytest.raises(ValueError, match="malformed ReceiveQueueBatch"):
        unpack(2, b"\x0a\x7f\x00")


def test_a_batch_of_log_entries_lands_in_one_row_and_is_delivered_in_pieces_exactly_once(lr_sites):
    _, sink_site, _ = lr_sites
    app, repl, snapshot = started_session(lr_sites)
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy", batch_size=3)
    first = Recorder()
    sub.poll(first)  # the (empty) full sync's markers
    deltas = [f"k{i}={i}" for i in range(40)]
    for i in range(40):
        app.put(f"k{i}", i, ["site-b"])
    settle(repl)
    assert queue_rows(sink_site) == [(LOG, 40, 0)]  # one cycle's batch: one packed row

    recorder = Recorder()
    assert sub.poll(recorder, max_messages=5) == 5  # two callbacks: 3 + 2 entries, the row advanced
    assert queue_rows(sink_site) == [(LOG, 40, 5)]

    class Refuses(Recorder):
        def on_log_entry_messages(self, source, payloads):
            raise Flaky("the application is down")

    assert sub.poll(Refuses(), max_messages=3) == 0
    assert queue_rows(sink_site) == [(LOG, 40, 5)]  # nothing consumed by a failed delivery

    assert sub.poll(recorder) == 35
    assert recorder.of("site-a") == expected(None, deltas)  # each entry once, in transmit order
    assert queue_rows(sink_site) == []
    sub.close()
    repl.close()
    app.close()


def test_large_batches_are_cut_into_rows_of_at_most_a_pack(lr_sites):
    _, sink_site, _ = lr_sites
    app, repl, _ = started_session(lr_sites)
    sent = [f"{i}:" + "v" * 1000 for i in range(30)]
    for payload in sent:  # one application transaction of 30 kB
        app.client.transmit_log_entry_message(payload.encode(), ["site-b"])
    app.conn.commit()
    settle(repl)
    sizes = sink_site.query(
        "SELECT entry_count, octet_length(message) FROM lr.receive_queue WHERE kind = %s ORDER BY seq", (LOG,)
    )
    assert sum(n for n, _ in sizes) == 30
    assert len(sizes) == 5 and all(size <= PACK_BYTES for _, size in sizes)  # 7 of ~1 kB per row
    recorder = Recorder()
    RoutingQueueSubscriber(sink_site.dsn, client_name="policy").poll(recorder)
    assert [p for k, p in recorder.of("site-a") if k == "log"] == sent
    repl.close()
    app.close()


def test_a_malformed_entry_inside_a_packed_row_is_moved_aside_alone(lr_sites):
    _, sink_site, _ = lr_sites
    packed = b"".join(piece(m) for m in (_entry(LOG, "a"), b"\xff\xff\xff", _entry(LOG, "b"), _entry(SNAP, "c")))
    insert_raw(sink_site, "site-a", LOG, packed, entry_count=4)
    insert_raw(sink_site, "site-a", LOG, b"\x0a\x7f\x00", entry_count=2)  # the container itself is broken
    insert_raw(sink_site, "site-a", LOG, _entry(LOG, "d"))

    recorder = Recorder()
    sub = RoutingQueueSubscriber(sink_site.dsn, client_name="policy")
    assert sub.poll(recorder) == 3
    assert recorder.of("site-a") == [("log", "a"), ("log", "b"), ("log", "d")]
    dead = sink_site.query("SELECT entry_index, error FROM lr.receive_dead_letters ORDER BY seq, entry_index")
    assert [i for i, _ in dead] == [1, 3, -1]
    assert "malformed RoutingTableEntryMsg" in dead[0][1]
    assert "entry kind 1 but its message says type 2" in dead[1][1]
    assert "malformed ReceiveQueueBatch" in dead[2][1]
    assert [type(e) for _, e in recorder.errors] == [MalformedEntryError] * 3
    assert queue_rows(sink_site) == []
    sub.close()


def test_rows_queued_before_the_v0005_upgrade_are_delivered_after_it(sites):
    site = sites[0]
    conn = site.connect()
    schema.migrate(conn, target=4)
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO lr.registry (stream_name, kind, source_site_id, client_name) "
            "VALUES ('LRQ_Recv_policy_site-a', 'receive_queue', 'site-a', 'policy')"
        )
        for payload in ("old-1", "old-2"):
            cur.execute(
                "INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, "
                "source_entry_id, visible, message) VALUES ('site-a', 'policy', %s, 1, 1, true, %s)",
                (LOG, _entry(LOG, payload)),
            )
    conn.commit()
    assert 5 in schema.migrate(conn).applied
    conn.close()

    recorder = Recorder()
    assert RoutingQueueSubscriber(site.dsn, client_name="policy").poll(recorder) == 2
    assert recorder.of("site-a") == [("log", "old-1"), ("log", "old-2")]
