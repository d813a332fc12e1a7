"""The source-side client API: hand payloads for remote sites to lr inside the caller's transaction.

Each message becomes exactly one row of the shared log (``LRQ_Send_LogEntries``) whatever the
number of destinations, written by the client's ``LogWriter`` (``log_writer``), which the
full-sync supply writes through too. The caller commits or rolls back: lr never commits here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.log_writer import LogWriter
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES
from airflow_provider_lr.proto import lr_pb2


@dataclass(frozen=True)
class LRMessageWithDestinations:
    """One opaque payload and the remote sites it is for."""

    payload: bytes
    destinations: Sequence[str]


class RoutingQueueClient(LogWriter):
    """Transmit opaque payloads to remote sites, inside the application's own transaction, and
    supply the client's full syncs.

    ``conn`` is the application's open psycopg2 connection; nothing is committed here.
    """

    def transmit_log_entry_message(self, payload: bytes, destinations: Sequence[str]) -> None:
        """Store one payload for ``destinations`` as one log entry (visible when the caller commits)."""
        self.transmit_log_entry_messages([LRMessageWithDestinations(payload, destinations)])

    def transmit_log_entry_messages(self, messages: Iterable[LRMessageWithDestinations]) -> None:
        """Store many payloads, in order, in the caller's transaction; all validated before any write."""
        rows = [self._row(STREAM_LOG_ENTRIES, m.payload, m.destinations, lr_pb2.LOG_ENTRY_SYNC) for m in messages]
        if rows:
            self._insert(rows)

    def serve_full_sync_requests(self, provider: full_sync.Provider, max_requests: int | None = None) -> list[str]:
        """Supply the pending full-sync requests of this client's sessions with ``provider(ctx)``,
        which calls ``ctx.transmit(payload)`` per message; lr writes the start marker (with the base
        snapshot) and the end marker. One transaction per request; returns the ids supplied."""
        return full_sync.serve_full_sync_requests(self, provider, max_requests)
