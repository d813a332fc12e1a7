"""Memory is bounded by bytes wherever a backlog is read (issue 17): a backlog of large entries, one
huge source transaction or a full sync of large messages is moved by the session path (and the
read-once tee) and delivered by the subscriber in a process whose peak resident memory stays under
a fixed ceiling, whatever the backlog's size.

Each piece of work runs in a child process (``tests/support/memory_runner.py``) that reports its own peak
(``VmHWM``). The backlog is 256 MiB and the single transaction 96 MiB, both well over the
ceiling, so a process that held either fails it; ``LR_MEMORY_TEST_GIB=1`` runs the issue's 1 GiB
backlog and a 256 MiB transaction (a manual run: the peak is the same). Figures: docs/memory.md.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg2

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.sink.receive import ReceiveQueueReader
from airflow_provider_lr.engine.source.log_reader import LogReader
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES
from airflow_provider_lr.proto import lr_pb2
from tests.support.memory_runner import HEAD, Checker, payload
from tests.support.session import apply, replicator
from tests.support.spark_env import in_log_entry_sync, lr_connections  # noqa: F401 (lr_connections is a fixture)

MIB = 1 << 20
GIB_RUN = os.environ.get("LR_MEMORY_TEST_GIB") == "1"
BACKLOG_ENTRIES = 1024 if GIB_RUN else 256  # of 1 MiB: 1 GiB or 256 MiB
BIG_TX_ENTRIES = 131_072 if GIB_RUN else 49_152  # of 2 KiB, in ONE source transaction: 256 MiB or 96 MiB
# The ceiling of any one process's peak, whatever the backlog: an interpreter with psycopg2 and
# protobuf is ~45 MiB, a batch in flight a few times its byte budget (docs/memory.md). Holding the
# 256 MiB backlog, or the 96 MiB transaction a couple of times, fails it.
CEILING_MIB = 160
ROOT = Path(__file__).resolve().parents[2]


def run_child(spec: dict, env: dict | None = None, timeout: float = 1800) -> dict:
    """Run ``tests.support.memory_runner`` with ``spec``; its JSON report (``peak_rss_kib`` among it)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.memory_runner", json.dumps(spec)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    shown = {k: v for k, v in report.items() if k in ("delivered", "calls", "largest_call", "teed")}
    print(f"{spec['mode']}: peak {report['peak_rss_kib'] / 1024:.0f} MiB in {report['seconds']} s {shown}")
    return report


def fill_backlog(source, count: int, size: int, per_txn: int, sinks=("site-b",), seed: int = 17) -> None:
    """``count`` log entries of ``size``-byte payloads (``memory_runner.payload``: index, size,
    random filler) for ``sinks``, ``per_txn`` to a source transaction. One entry is made by the
    client's own serializer (``RoutingQueueClient._row``, what ``transmit`` stores); the server
    copies it with each index in place (``overlay``), so filling costs no 1 GiB round trip here.
    Transmit is not what these tests measure."""
    started = time.monotonic()
    first = payload(0, size, random.Random(seed).randbytes(size))
    conn = source.connect()
    try:
        client = RoutingQueueClient(conn, "policy")
        stream, tags, message = client._row(STREAM_LOG_ENTRIES, first, list(sinks), lr_pb2.LOG_ENTRY_SYNC)
        at = message.index(first) + 1  # where the payload's index is (1-based, for overlay)
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE lr_fill (m bytea)")
            cur.execute("INSERT INTO lr_fill VALUES (%s)", (psycopg2.Binary(message),))
            for lo in range(0, count, per_txn):
                cur.execute(
                    "INSERT INTO lr.log_entries (stream, tag_ids, client_id, message) "
                    "SELECT %s, %s::int[], %s, overlay(f.m PLACING int8send(g) FROM %s FOR 8) "
                    "FROM lr_fill f, generate_series(%s::bigint, %s) g ORDER BY g",
                    (stream, tags, client.client_id, at, lo, min(lo + per_txn, count) - 1),
                )
                conn.commit()
    finally:
        conn.close()
    print(f"filled {count} x {size} B in {time.monotonic() - started:.1f} s")


def sync_in_child(topo, lr_sites, env: dict | None = None, **settings) -> dict:
    return run_child(
        {"mode": "sync", "topology": topo.document, "dsns": {s.site_id: s.dsn for s in lr_sites}, "settings": settings},
        env,
    )


def subscribe_in_child(sink, **subscriber) -> dict:
    return run_child({"mode": "subscribe", "dsn": sink.dsn, "subscriber": subscriber})


def queued(sink, kind: int = lr_pb2.LOG_ENTRY_SYNC) -> tuple[int, int]:
    """(visible entries of ``kind``, their rows' bytes) in the sink's receive queue."""
    entries, size = sink.query(
        "SELECT coalesce(sum(entry_count - delivered), 0), coalesce(sum(octet_length(message)), 0) "
        "FROM lr.receive_queue WHERE visible AND kind = %s",
        (kind,),
    )[0]
    return int(entries), int(size)


def assert_under_ceiling(report: dict) -> None:
    assert report["peak_rss_kib"] < CEILING_MIB * 1024, f"peak {report['peak_rss_kib'] // 1024} MiB"


def test_a_backlog_of_one_mib_entries_is_synced_and_delivered_under_a_fixed_memory_ceiling(lr_sites):
    topo = in_log_entry_sync(lr_sites, sinks=("site-b",))
    fill_backlog(lr_sites[0], BACKLOG_ENTRIES, MIB, per_txn=4)

    synced = sync_in_child(topo, lr_sites, tee_min_backlog=0)  # the session path only
    assert not synced["errors"] and synced["states"] == ["IN_LOG_ENTRY_SYNC"]
    entries, size = queued(lr_sites[1])
    assert entries == BACKLOG_ENTRIES and size > BACKLOG_ENTRIES * MIB

    delivered = subscribe_in_child(lr_sites[1])
    # every entry once, in order, whole (+ the two markers of the empty full sync before them)
    assert delivered["delivered"] == BACKLOG_ENTRIES + 2 and delivered["next"] == {"site-a": BACKLOG_ENTRIES}
    assert delivered["bytes"] == BACKLOG_ENTRIES * MIB
    assert delivered["largest_call"] <= 8 * MIB  # receive.DEFAULT_BATCH_BYTES
    assert queued(lr_sites[1]) == (0, 0)

    assert_under_ceiling(synced)
    assert_under_ceiling(delivered)


def test_one_large_source_transaction_arrives_whole_under_a_fixed_memory_ceiling(lr_sites):
    """Guarantee 2 (docs/architecture.md): the entries of one source transaction become visible on the sink
    together, though the session path streams it in pieces: a sink observer polling the queue
    while it streams in sees none of it or all of it."""
    topo = in_log_entry_sync(lr_sites, sinks=("site-b",))
    fill_backlog(lr_sites[0], BIG_TX_ENTRIES, 2048, per_txn=BIG_TX_ENTRIES)

    seen: set[int] = set()
    stop = threading.Event()

    def observe() -> None:
        conn = lr_sites[1].connect()
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                while not stop.is_set():
                    cur.execute(
                        "SELECT coalesce(sum(entry_count), 0) FROM lr.receive_queue WHERE visible AND kind = %s",
                        (lr_pb2.LOG_ENTRY_SYNC,),
                    )
                    seen.add(int(cur.fetchone()[0]))
                    stop.wait(0.05)
        finally:
            conn.close()

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    try:
        synced = sync_in_child(topo, lr_sites, tee_min_backlog=0)
    finally:
        stop.set()
        observer.join(10)
    assert not synced["errors"] and synced["states"] == ["IN_LOG_ENTRY_SYNC"]
    assert queued(lr_sites[1])[0] == BIG_TX_ENTRIES
    assert seen <= {0, BIG_TX_ENTRIES} and 0 in seen, sorted(seen)[:10]

    delivered = subscribe_in_child(lr_sites[1])
    assert delivered["delivered"] == BIG_TX_ENTRIES + 2 and delivered["next"] == {"site-a": BIG_TX_ENTRIES}

    assert_under_ceiling(synced)
    assert_under_ceiling(delivered)


def test_the_read_once_tee_moves_one_mib_entries_under_a_fixed_memory_ceiling(lr_sites, lr_connections):
    topo = in_log_entry_sync(lr_sites)
    fill_backlog(lr_sites[0], 256, MIB, per_txn=4, sinks=("site-b", "site-c"))

    synced = sync_in_child(topo, lr_sites, tee_min_backlog=1)  # the whole backlog by the tee
    assert not synced["errors"]
    assert synced["teed"] == {"site-a->site-b/policy": 256, "site-a->site-c/policy": 256}
    for sink in lr_sites[1:]:
        assert queued(sink)[0] == 256

    assert_under_ceiling(synced)


def test_a_full_sync_of_one_mib_messages_is_supplied_transferred_and_delivered_under_a_fixed_memory_ceiling(lr_sites):
    count = 96
    topo = apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}],
        providers={"policy": "tests.support.memory_runner:large_provider"},
    )

    synced = sync_in_child(topo, lr_sites, env={"LR_MEMORY_PROVIDER": f"{count}:{MIB}"}, tee_min_backlog=0)
    assert not synced["errors"] and synced["states"] == ["IN_LOG_ENTRY_SYNC"]
    assert queued(lr_sites[1], lr_pb2.SNAPSHOT_SYNC)[0] == count

    delivered = subscribe_in_child(lr_sites[1])
    assert delivered["delivered"] == count + 2 and delivered["next"] == {"site-a": count}
    assert delivered["largest_call"] <= 8 * MIB

    assert_under_ceiling(synced)  # the provider, the transfer and the apply, in one process
    assert_under_ceiling(delivered)


def test_a_read_fetches_large_entries_out_of_line_and_still_returns_whole_transactions_in_order(lr_sites):
    """The log reader's round trips are bounded by bytes: entries over ``fetch_bytes / FETCH_ROWS``
    come out of line, in groups of at most ``fetch_bytes`` (1 MiB here); the result is the same."""
    in_log_entry_sync(lr_sites, sinks=("site-b",))
    rng = random.Random(3)
    sizes = [[rng.choice((40, 600, 5_000, 300_000, 1_500_000)) for _ in range(rng.randint(1, 6))] for _ in range(30)]
    conn = lr_sites[0].connect()
    client = RoutingQueueClient(conn, "policy")
    filler = rng.randbytes(1_500_000)
    n = 0
    for tx in sizes:
        for size in tx:
            client.transmit_log_entry_message(payload(n, size, filler), ["site-b"])
            n += 1
        conn.commit()
    reader = LogReader(conn, "site-b", client_name="policy")
    got, after, ends = [], 0, []
    while True:
        batch = reader.read_stream(after, max_entries=1000, max_bytes=2 * MIB).collect()  # fetch_bytes: 1 MiB
        if batch.end <= after:
            break
        got += [lr_pb2.RoutingTableEntryMsg.FromString(r.message).opaque_payload for r in batch.records]
        ends.append((len(batch.records), batch.bytes))
        after = batch.end
    conn.close()
    assert [HEAD.unpack_from(p) for p in got] == [(i, len(p)) for i, p in enumerate(got)]
    assert [len(p) for p in got] == [size for tx in sizes for size in tx]
    assert len(ends) > 3  # cut by bytes, at transaction boundaries (each transaction whole: same order)


def test_a_callback_gets_at_most_batch_bytes_of_entries_and_a_pass_at_most_max_bytes(lr_sites):
    topo = in_log_entry_sync(lr_sites, sinks=("site-b",))
    fill_backlog(lr_sites[0], 40, 300_000, per_txn=5)
    repl = replicator(topo, lr_sites, tee_min_backlog=0)
    try:
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    checker = Checker()
    conn = lr_sites[1].connect()
    try:
        reader = ReceiveQueueReader(conn, batch_size=500, batch_bytes=1_000_000)
        first = reader.deliver(checker, "policy", max_bytes=2_000_000)
        assert checker.largest_call <= 1_000_000 and 0 < first.delivered < 40 and first.unfinished == {"site-a"}
        while reader.deliver(checker, "policy").delivered:
            pass
    finally:
        conn.close()
    assert checker.next == {"site-a": 40} and not checker.errors and checker.largest_call <= 1_000_000
