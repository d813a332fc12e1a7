"""Bulk application of a sink's receive queue by a user function (Spark job
``spark_jobs/lr_apply_receive_queue.py``), for workloads that apply many entries at once.

The function is named ``"package.module:function"`` and called with one ``ApplyBatch`` per run
of entries of one (source, client) queue, in source order: full-sync start and complete markers
(no payloads), full-sync messages, log entries. It writes through ``batch.conn``, which is the
delivery transaction: its writes commit together with the delete of the entries it was given,
or roll back with it if it raises — exactly once. Delivery is the subscriber's
(``receive.ReceiveQueueReader``): same order, same per-queue consumer lock (an apply job and a
subscriber never interleave one queue), same dead-lettering of malformed entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg2.extensions

from airflow_provider_lr.engine.errors import LRError, error_line
from airflow_provider_lr.engine.sink.receive import ReceiveQueueReader
from airflow_provider_lr.engine.source.loading import load_function

DEFAULT_APPLY_BATCH = 5_000


@dataclass(frozen=True)
class ApplyBatch:
    conn: psycopg2.extensions.connection  # in the delivery transaction: write through it
    source: str
    client: str
    kind: str  # "snapshot_start" | "snapshot" | "snapshot_complete" | "log"
    payloads: list[bytes] = field(default_factory=list)


ApplyFunction = Callable[[ApplyBatch], object]


def load_apply_function(target: str) -> ApplyFunction:
    """``package.module:function`` (the same loader as full-sync providers)."""
    return load_function(target, "apply function")


class _Applier:
    """A receive-queue listener that hands each run to the apply function."""

    def __init__(self, fn: ApplyFunction, reader: ReceiveQueueReader, client: str) -> None:
        self.fn, self.reader, self.client = fn, reader, client
        self.error: str | None = None

    def _call(self, source: str, kind: str, payloads: list[bytes]) -> bool:
        self.fn(ApplyBatch(self.reader.conn, source, self.client, kind, payloads))
        return True

    def on_snapshot_sync_start(self, source: str) -> bool:
        return self._call(source, "snapshot_start", [])

    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool:
        return self._call(source, "snapshot", payloads)

    def on_snapshot_sync_complete(self, source: str) -> bool:
        return self._call(source, "snapshot_complete", [])

    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool:
        return self._call(source, "log", payloads)

    def on_error(self, source: str, exc: Exception) -> None:
        self.error = error_line(exc)


def apply_queue(
    conn: psycopg2.extensions.connection,
    client: str,
    source: str,
    fn: ApplyFunction,
    batch_size: int = DEFAULT_APPLY_BATCH,
) -> int:
    """Apply ``source``'s queue for ``client`` until it is empty; returns the entries applied.
    Raises if the function fails (what it was given stays queued) or another consumer holds the queue."""
    reader = ReceiveQueueReader(conn, batch_size)
    applier = _Applier(fn, reader, client)
    applied = 0
    while True:
        report = reader.deliver(applier, client, sources=[source])
        applied += report.delivered
        if report.failures or report.refused:
            raise LRError(
                f"apply of {client}/{source} stopped after {applied} entries: {applier.error or report.errors}"
            )
        if report.busy:
            raise LRError(f"queue {client}/{source} is being consumed by another subscriber; try again later")
        if not report.delivered and not report.unfinished:
            return applied
