"""The routed read: the final prefix of a source's log read once for several sessions, each
getting exactly its own entries after its own frontier, less what its base snapshot covered, in
whole transactions; what does not fit a small batch is left to the general read."""

from __future__ import annotations

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import TrimmedError
from airflow_provider_lr.engine.source import routed_read
from airflow_provider_lr.engine.source.log_reader import FETCH_ROWS, BaseSplit, LogReader, TableSplits
from airflow_provider_lr.engine.source.routed_read import ROUTED, Reader
from tests.support.session import apply

read_routed = routed_read.read_routed  # rebound per test: as text, or prepared as a stream runs it


def _transmit(conn, client: str, payload: str, destinations: list[str]) -> None:
    RoutingQueueClient(conn, client).transmit_log_entry_message(payload.encode(), destinations)
    conn.commit()


@pytest.fixture(params=["as text", "prepared"], autouse=True)
def statement(request, monkeypatch):
    """Each test twice: the routed read sent as text, and prepared on the connection (a stream's way)."""
    if request.param == "prepared":
        prepared: set[int] = set()

        def read_prepared(conn, *args, **kwargs):
            if id(conn) not in prepared:
                ROUTED.prepare(conn)
                prepared.add(id(conn))
            return routed_read.read_routed(conn, *args, **kwargs, prepared=True)

        monkeypatch.setitem(globals(), "read_routed", read_prepared)


@pytest.fixture
def log_of_two_clients(lr_sites):
    """site-a's log with entries of two clients to two sinks; readers for (policy, site-b) and
    (billing, site-c) from position 0."""
    source, _, _ = lr_sites
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", "billing"]}])
    conn = source.connect()
    readers = [
        _reader(conn, "site-b", "policy"),
        _reader(conn, "site-c", "billing"),
    ]
    yield source, conn, readers
    conn.close()


def _reader(conn, sink: str, client: str, after: int = 0, split: BaseSplit | None = None) -> Reader:
    general = LogReader(conn, sink, client_name=client)
    assert general.client_id is not None
    return Reader(general.client_id, general.tag_id, after, split, TableSplits())


def _payloads(records) -> list[bytes]:
    return [r.decode().opaque_payload for r in records]


def test_the_routed_read_gives_each_reader_its_own_entries_after_its_own_frontier(log_of_two_clients):
    source, conn, (policy_b, billing_c) = log_of_two_clients
    writer = source.connect()
    _transmit(writer, "policy", "p1", ["site-b", "site-c"])  # position 1
    _transmit(writer, "billing", "b1", ["site-c"])  # 2
    _transmit(writer, "billing", "b2", ["site-b"])  # 3: not billing's sink
    _transmit(writer, "policy", "p2", ["site-c"])  # 4: not policy's sink
    _transmit(writer, "policy", "p3", ["site-b"])  # 5
    writer.close()
    batch = read_routed(conn, [policy_b, billing_c], 16 << 20)
    assert batch is not None and batch.end == 5
    assert [_payloads(r) for r in batch.records] == [[b"p1", b"p3"], [b"b1"]]
    ahead = Reader(policy_b.client_id, policy_b.tag_id, 1, None, TableSplits())  # policy's sink has position 1
    batch = read_routed(conn, [ahead, billing_c], 16 << 20)
    assert batch is not None and [_payloads(r) for r in batch.records] == [[b"p3"], [b"b1"]]


def test_the_routed_read_leaves_out_what_a_readers_base_snapshot_covered(log_of_two_clients):
    source, conn, (policy_b, _) = log_of_two_clients
    writer = source.connect()
    _transmit(writer, "policy", "p1", ["site-b"])
    covered = source.query("SELECT pg_current_snapshot()::text")[0][0]  # p1 committed, visible
    _transmit(writer, "policy", "p2", ["site-b"])
    writer.close()
    split = BaseSplit(covered, 2)
    reader = Reader(policy_b.client_id, policy_b.tag_id, 0, split, TableSplits())
    batch = read_routed(conn, [reader], 16 << 20)
    assert batch is not None and _payloads(batch.records[0]) == [b"p2"]


def test_the_routed_read_cuts_a_large_prefix_at_a_commit_and_leaves_a_huge_transaction_to_the_general_read(
    log_of_two_clients,
):
    source, conn, (policy_b, _) = log_of_two_clients
    writer = source.connect()
    client = RoutingQueueClient(writer, "policy")
    for i in range(FETCH_ROWS + 10):  # one transaction larger than a routed batch
        client.transmit_log_entry_message(f"big-{i}".encode(), ["site-b"])
    writer.commit()
    assert read_routed(conn, [policy_b], 16 << 20) is None
    after_big = Reader(policy_b.client_id, policy_b.tag_id, 1, None, TableSplits())
    for i in range(FETCH_ROWS // 100 + 5):  # transactions of 100 entries, more than a batch in all
        for j in range(100):
            client.transmit_log_entry_message(f"t{i}-{j}".encode(), ["site-b"])
        writer.commit()
    batch = read_routed(conn, [after_big], 16 << 20)
    assert batch is not None and batch.end < batch.highest, "cut before the end of the prefix"
    assert len(batch.records[0]) == (batch.end - 1) * 100, "whole transactions only"
    rest = read_routed(conn, [Reader(policy_b.client_id, policy_b.tag_id, batch.end, None, TableSplits())], 16 << 20)
    assert rest is not None and _payloads(rest.records[0])[0] == f"t{batch.end - 1}-0".encode()
    writer.close()


def test_the_routed_read_brings_messages_too_large_to_come_inline(log_of_two_clients, monkeypatch):
    source, conn, (policy_b, _) = log_of_two_clients
    writer = source.connect()
    large = b"x" * 20_000
    RoutingQueueClient(writer, "policy").transmit_log_entry_message(large, ["site-b"])
    _transmit(writer, "policy", "small", ["site-b"])
    writer.close()
    batch = read_routed(conn, [policy_b], 16 << 20)
    assert batch is not None and _payloads(batch.records[0]) == [large, b"small"]
    monkeypatch.setattr(routed_read, "_OUT_OF_LINE_SQL", routed_read._OUT_OF_LINE_SQL + " AND false")
    assert read_routed(conn, [policy_b], 16 << 20) is None, "a message gone since the read: read again per session"


def test_the_routed_read_refuses_a_reader_behind_the_trim_mark(log_of_two_clients):
    source, conn, (policy_b, _) = log_of_two_clients
    source.query("UPDATE lr.log_trim SET trim_mark = 3")
    with pytest.raises(TrimmedError):
        read_routed(conn, [policy_b], 16 << 20)
    assert not conn.closed and conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
