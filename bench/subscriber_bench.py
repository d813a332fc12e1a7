"""Subscriber delivery rate: a sink's receive queue drained by ``RoutingQueueSubscriber.poll``.

The queue is filled the way the replicator fills it (``writes.SinkTransaction.insert``: entries packed into
rows, ``engine/sink/queue_rows.py``) and, for comparison, with one entry per row (the form before schema
V0005, still valid). The listener does nothing but acknowledge, so the figure is lr's own cost of
reading, unpacking, calling back and consuming (delete / ``delivered``), one transaction per batch.

Run: PYTHONPATH=. .venv/bin/python bench/subscriber_bench.py [--entries 200000] [--batch 500,2000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.sink import writes  # noqa: E402
from airflow_provider_lr.proto import lr_pb2  # noqa: E402
from airflow_provider_lr.subscriber import RoutingQueueSubscriber  # noqa: E402

SOURCE, CLIENT = "bench-src", "bench"


class Ack:
    """Acknowledges everything; counts payloads."""

    def __init__(self) -> None:
        self.n = 0

    def on_snapshot_sync_start(self, source):
        return True

    def on_snapshot_messages(self, source, payloads):
        self.n += len(payloads)
        return True

    def on_snapshot_sync_complete(self, source):
        return True

    def on_log_entry_messages(self, source, payloads):
        self.n += len(payloads)
        return True


def fill(dsn: str, entries: int, packed: bool) -> int:
    """Queue ``entries`` log entries of 256 random bytes; returns the rows it took."""
    conn = psycopg2.connect(dsn)
    messages = [
        lr_pb2.RoutingTableEntryMsg(
            type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=os.urandom(256), source_site_id=SOURCE, client_name=CLIENT
        ).SerializeToString()
        for _ in range(min(entries, 10_000))
    ]
    write = writes.SinkTransaction(conn, SOURCE, CLIENT, epoch=1)
    with write as (cur, _):
        for start in range(0, entries, 10_000):
            batch = [
                (lr_pb2.LOG_ENTRY_SYNC, start + i, start + i, m)
                for i, m in enumerate(messages[: min(10_000, entries - start)])
            ]
            if packed:
                write.insert(batch)
            else:
                cur.executemany(
                    "INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, "
                    "source_entry_id, visible, message) VALUES (%s, %s, %s, %s, %s, true, %s)",
                    [(SOURCE, CLIENT, k, p, e, m) for k, p, e, m in batch],
                )
        write.register()
        cur.execute("SELECT count(*) FROM lr.receive_queue")
        rows = cur.fetchone()[0]
    conn.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--batch", default="500,2000", help="comma list of subscriber batch sizes")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lr-subscriber-bench-"))
    manager = SiteManager(home)
    try:
        server = manager.up(site_ids=["bench-sink"])[0]
        print(f"{'rows':>12} {'batch':>6} {'entries':>9} {'seconds':>8} {'entries/s':>10}")
        for packed in (True, False):
            for batch in (int(b) for b in args.batch.split(",")):
                db = f"sub_{'packed' if packed else 'single'}_{batch}"
                admin = psycopg2.connect(server.dsn())
                admin.autocommit = True
                admin.cursor().execute(f"CREATE DATABASE {db}")
                admin.close()
                dsn = server.dsn(db)
                conn = psycopg2.connect(dsn)
                schema.init_site(conn, "bench-sink")
                conn.close()
                rows = fill(dsn, args.entries, packed)
                listener = Ack()
                sub = RoutingQueueSubscriber(dsn, client_name=CLIENT, batch_size=batch)
                started = time.perf_counter()
                while sub.poll(listener):
                    pass
                seconds = time.perf_counter() - started
                sub.close()
                assert listener.n == args.entries, (listener.n, args.entries)
                print(
                    f"{('packed ' if packed else 'single ') + str(rows):>12} {batch:>6} {listener.n:>9,} "
                    f"{seconds:>8.2f} {listener.n / seconds:>10,.0f}",
                    flush=True,
                )
    finally:
        manager.down(remove=True)
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
