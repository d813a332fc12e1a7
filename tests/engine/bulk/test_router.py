"""The read of one fan-out chunk (engine/bulk/router.py): the source server says per entry which
sessions want it, and every session gets exactly its entries, in source order, packed with their
commit positions — whether its rows are formed on its own or shared with sessions that got the
same entries."""

from __future__ import annotations

import struct

from airflow_provider_lr.engine.bulk import router
from airflow_provider_lr.engine.bulk.pgcopy import HEADER, PackedRows
from airflow_provider_lr.engine.bulk.plan import Demand, PositionRange
from airflow_provider_lr.engine.session.handshake import Position
from airflow_provider_lr.engine.sink import queue_rows
from airflow_provider_lr.engine.sink.queue_rows import Packer, QueueRow
from airflow_provider_lr.proto import lr_pb2
from tests.support.spark_env import expected_entries, in_log_entry_sync

CLIENTS = ("policy", "audit")


class CollectedRows(PackedRows):
    """A session's side of the read that keeps the rows it is given instead of copying them to a sink."""

    def __init__(self) -> None:  # no sink, no sender thread
        self.out: list[QueueRow] = []
        self.packer = Packer(self.out.append)
        self.append = self.packer.append

    def entries_got(self) -> list[tuple[int, bytes]]:
        """(commit position, payload) of every entry in the rows, in row order."""
        self.packer.flush()
        got = []
        for row in self.out:
            messages = queue_rows.unpack(row.entry_count, row.message)
            positions = queue_rows.positions(row.entry_count, row.message, row.position)
            assert positions is not None and len(positions) == len(messages)
            for position, message in zip(positions, messages):
                entry = lr_pb2.RoutingTableEntryMsg.FromString(message)
                assert not entry.destinations  # the sink form
                got.append((position, entry.opaque_payload))
        return got


def transmit(source, entries: int, per_txn: int) -> None:
    """``policy`` entries to a changing subset of the sinks; ``audit`` entries to both (~35 to a row)."""
    from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient

    conn = source.connect()
    try:
        policy, audit = (RoutingQueueClient(conn, c) for c in CLIENTS)
        for start in range(0, entries, per_txn):
            batch = range(start, min(start + per_txn, entries))
            subsets = (["site-b"], ["site-c"], ["site-b", "site-c"])
            policy.transmit_log_entry_messages(
                [
                    LRMessageWithDestinations(f"policy:{n}".encode().ljust(200, b"."), subsets[n % 3])
                    for n in batch
                    if n % 4
                ]
            )
            audit.transmit_log_entry_messages(
                [
                    LRMessageWithDestinations(f"audit:{n}".encode().ljust(200, b"."), ["site-b", "site-c"])
                    for n in batch
                    if not n % 4
                ]
            )
            conn.commit()
    finally:
        conn.close()


def test_each_session_gets_its_client_its_sink_and_what_follows_its_position(lr_sites, monkeypatch):
    monkeypatch.setattr(router, "PACK_EVERY", 64)  # many packing passes: shared and own rows alike
    source = lr_sites[0]
    in_log_entry_sync(lr_sites, clients=CLIENTS)
    transmit(source, 2000, per_txn=50)
    ((lo, hi),) = source.query("SELECT min(position) - 1, max(position) FROM lr.log_commits")
    mid = (lo + hi) // 2
    client_ids = dict(source.query("SELECT client_name, client_id FROM lr.clients"))
    tag_ids = dict(source.query("SELECT site_id, tag_id FROM lr.remote_sites"))
    wants = [("policy", "site-b", lo), ("policy", "site-c", mid), ("audit", "site-b", lo), ("audit", "site-c", lo)]
    targets = []
    for bit, (client, sink, after) in enumerate(wants):
        demand = Demand("site-a", sink, client, client_ids[client], tag_ids[sink], Position(after, 0, None, 1))
        targets.append((bit, demand, CollectedRows()))

    conn = source.connect()
    try:
        read = router.copy_and_route(conn, PositionRange(0, lo, hi, 2000), targets, None)
    finally:
        conn.close()

    assert read == 2000  # each entry once, also those no session wants any more (routed nowhere)
    audit_b, audit_c = targets[2][2], targets[3][2]
    formed = len(audit_b.out)  # by the packing passes (the last rows are formed per session, below)
    assert formed > 1 and all(b is c for b, c in zip(audit_b.out, audit_c.out[:formed]))  # formed once, for both
    for (client, sink, after), (_, _, rows) in zip(wants, targets):
        want = [(p, payload) for p, payload in expected_entries(source, sink, client) if p > after]
        assert want and rows.entries_got() == want, (client, sink)
    assert audit_b.out == audit_c.out


def test_entries_the_source_does_not_cut_and_large_ones_arrive_whole_and_in_order(lr_sites, monkeypatch):
    # The leads come from the first 20 entries only, so entries named in another order come whole
    # and are stripped here; groups of 8, and entries over the group bound interleaved with small
    # ones in one transaction, come in rows of their own after the group of their id range.
    monkeypatch.setattr(router, "SAMPLE_ENTRIES", 20)
    monkeypatch.setattr(router, "GROUP_ENTRIES", 8)
    from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient

    source = lr_sites[0]
    in_log_entry_sync(lr_sites)
    conn = source.connect()
    try:
        policy = RoutingQueueClient(conn, "policy")
        for txn in range(3):
            messages = []
            for n in range(100):
                size = router.GROUP_ENTRY_BYTES + 500 if n % 13 == 5 else 200
                named = ["site-c", "site-b"] if n % 7 == 3 and txn else ["site-b", "site-c"]
                messages.append(LRMessageWithDestinations(f"{txn}:{n}:".encode().ljust(size, b"."), named))
            policy.transmit_log_entry_messages(messages)
            conn.commit()
    finally:
        conn.close()
    ((lo, hi),) = source.query("SELECT min(position) - 1, max(position) FROM lr.log_commits")
    client_id, tag_ids = (
        source.query("SELECT client_id FROM lr.clients")[0][0],
        dict(source.query("SELECT site_id, tag_id FROM lr.remote_sites")),
    )
    targets = []
    for bit, sink in enumerate(("site-b", "site-c")):
        demand = Demand("site-a", sink, "policy", client_id, tag_ids[sink], Position(lo, 0, None, 1))
        targets.append((bit, demand, CollectedRows()))

    conn = source.connect()
    try:
        leads = router.leading_records(conn, PositionRange(0, lo, hi, 300), targets)
        read = router.copy_and_route(conn, PositionRange(0, lo, hi, 300), targets, None)
    finally:
        conn.close()

    assert len(leads) == 1 and read == 300  # the order of the first transaction only: the others come whole
    for _, demand, rows in targets:
        assert rows.entries_got() == expected_entries(source, demand.sink, "policy")


def group_row(position: int, entries: list[tuple[int, int, bytes]]) -> bytes:
    """A row of the chunk's binary COPY as the source sends it: a group's position, ids, masks and
    sizes, then its entries, here all whole (negative sizes)."""

    def array(values: list[int], width: int) -> bytes:
        body = b"".join(struct.pack(">i", width) + v.to_bytes(width, "big", signed=True) for v in values)
        head = struct.pack(">iiiii", 1, 0, 20 if width == 8 else 23, len(values), 1)
        return struct.pack(">i", len(head) + len(body)) + head + body

    messages = b"".join(m for _, _, m in entries)
    return (
        struct.pack(">hiq", 5, 8, position)
        + array([entry_id for entry_id, _, _ in entries], 8)
        + array([mask for _, mask, _ in entries], 8)
        + array([-len(m) for _, _, m in entries], 4)
        + struct.pack(">i", len(messages))
        + messages
    )


def message(destinations: list[str], payload: bytes) -> bytes:
    return lr_pb2.RoutingTableEntryMsg(
        destinations=destinations, type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=payload, client_name="policy"
    ).SerializeToString()


def test_an_entry_sent_whole_is_read_by_its_own_destinations():
    # Entries of one mask naming their sinks differently; one holds, where another's sink form
    # began, bytes that read like a type field. Each is stripped by what it names itself.
    lure = bytes(4) + b"\x10\x01" + bytes(42)
    rows = [
        HEADER
        + group_row(1, [(1, 0b1, message(["site-b"], b"zeroth")), (2, 0b1, message(["site-b", "site-x"], b"first"))]),
        group_row(1, [(3, 0b1, message(["site-b"], lure))]),
        group_row(2, [(4, 0b1, message(["site-b", "site-x"], b"third"))]),
        b"\xff\xff",
    ]
    session = CollectedRows()
    reader = router.CopyRouter({0: session}, -1, None)
    for row in rows:
        reader.write(row)
    reader.finish()
    assert session.entries_got() == [(1, b"zeroth"), (1, b"first"), (1, lure), (2, b"third")]
