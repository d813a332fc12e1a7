"""The source-side client API: hand payloads for remote sites to lr inside the caller's transaction.

Each message becomes exactly one row of the shared log (``LRQ_Send_LogEntries``) whatever the
number of destinations, carrying a compact tag per destination (``lrq_logentry_<site>``) and a
serialized ``RoutingTableEntryMsg``. The caller commits or rolls back: lr never commits here.
The client takes no lock and updates no shared row, so concurrent application transactions are
not serialized; the commit position is drawn at commit by a deferred trigger (see the migration).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import psycopg2.extensions
from psycopg2.extras import execute_values

from airflow_provider_lr.engine.errors import TransmitError
from airflow_provider_lr.engine.schema import site_identity
from airflow_provider_lr.proto import lr_pb2

DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
STREAM_LOG_ENTRIES = 1  # LRQ_Send_LogEntries
STREAM_SNAP_SYNC = 2  # LRQ_Send_SnapSync
STREAM_NAMES = {STREAM_LOG_ENTRIES: "LRQ_Send_LogEntries", STREAM_SNAP_SYNC: "LRQ_Send_SnapSync"}


@dataclass(frozen=True)
class LRMessageWithDestinations:
    """One opaque payload and the remote sites it is for."""

    payload: bytes
    destinations: Sequence[str]


class RoutingQueueClient:
    """Transmit opaque payloads to remote sites, inside the application's own transaction.

    ``conn`` is the application's open psycopg2 connection; nothing is committed here.
    """

    def __init__(
        self,
        conn: psycopg2.extensions.connection,
        client_name: str,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if not client_name or not client_name.replace("_", "").replace("-", "").isalnum():
            raise TransmitError(f"invalid client name {client_name!r}: use letters, digits, '-' or '_'")
        self.conn = conn
        self.client_name = client_name
        self.max_payload_bytes = max_payload_bytes
        self.source_site_id, _ = site_identity(conn)
        self._tag_ids: dict[str, int] = {}
        self._load_sites()

    def _load_sites(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT site_id, tag_id FROM lr.remote_sites")
            self._tag_ids = dict(cur.fetchall())

    def transmit_log_entry_message(self, payload: bytes, destinations: Sequence[str]) -> None:
        """Store one payload for ``destinations`` as one log entry (visible when the caller commits)."""
        self.transmit_log_entry_messages([LRMessageWithDestinations(payload, destinations)])

    def transmit_log_entry_messages(self, messages: Iterable[LRMessageWithDestinations]) -> None:
        """Store many payloads, in order, in the caller's transaction; all validated before any write."""
        rows = [self._row(STREAM_LOG_ENTRIES, m.payload, m.destinations, lr_pb2.LOG_ENTRY_SYNC) for m in messages]
        if rows:
            self._insert(rows)

    # --- internals shared with the full-sync transmitter -------------------------------------
    def _row(
        self, stream: int, payload: bytes, destinations: Sequence[str], kind: int, **fields: object
    ) -> tuple[int, list[int], bytes]:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TransmitError(f"payload must be bytes, not {type(payload).__name__}; nothing was written")
        if len(payload) > self.max_payload_bytes:
            raise TransmitError(
                f"payload of {len(payload)} bytes exceeds the maximum of {self.max_payload_bytes} bytes "
                f"(client {self.client_name!r}); nothing was written"
            )
        if isinstance(destinations, str) or not destinations:
            raise TransmitError("destinations must be a non-empty list of site ids; nothing was written")
        unique = list(dict.fromkeys(destinations))
        if self.source_site_id in unique:
            raise TransmitError(f"site {self.source_site_id!r} cannot transmit to itself; nothing was written")
        unknown = [d for d in unique if d not in self._tag_ids]
        if unknown:
            self._load_sites()  # the topology may have been applied since this client started
            unknown = [d for d in unique if d not in self._tag_ids]
        if unknown:
            raise TransmitError(
                f"unknown destination(s) {unknown} for source {self.source_site_id!r}: known sites are "
                f"{sorted(self._tag_ids)} (apply the topology with `lr topology apply`); nothing was written"
            )
        message = lr_pb2.RoutingTableEntryMsg(
            destinations=unique,
            type=kind,
            opaque_payload=bytes(payload),
            source_site_id=self.source_site_id,
            client_name=self.client_name,
            **fields,
        )
        return stream, [self._tag_ids[d] for d in unique], message.SerializeToString()

    def _insert(self, rows: list[tuple[int, list[int], bytes]]) -> None:
        with self.conn.cursor() as cur:
            if len(rows) == 1:
                stream, tags, message = rows[0]
                cur.execute(
                    "INSERT INTO lr.log_entries (stream, tag_ids, message) VALUES (%s, %s::int[], %s)",
                    (stream, tags, psycopg2.Binary(message)),
                )
            else:
                # entry ids follow the VALUES order: transmit order within the transaction is kept.
                execute_values(
                    cur,
                    "INSERT INTO lr.log_entries (stream, tag_ids, message) VALUES %s",
                    [(s, t, psycopg2.Binary(m)) for s, t, m in rows],
                    template="(%s, %s::int[], %s)",
                    page_size=1000,
                )
