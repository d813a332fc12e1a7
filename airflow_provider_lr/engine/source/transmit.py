"""The source-side client API: hand payloads for remote sites to lr inside the caller's transaction.

Each message becomes exactly one row of the shared log (``LRQ_Send_LogEntries``) whatever the
number of destinations, written by the client's ``LogWriter`` (``log_writer``), which the
full-sync supply writes through too. The caller commits or rolls back: lr never commits here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from airflow_provider_lr.engine.db.local_settings import catalog_path
from airflow_provider_lr.engine.errors import ConfigurationError, TransmitError, require_counts, shown
from airflow_provider_lr.engine.source import delivery, full_sync
from airflow_provider_lr.engine.source.backlog import Readiness, wait_until_ready
from airflow_provider_lr.engine.source.delivery import Ticket
from airflow_provider_lr.engine.source.log_writer import LogWriter


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

    def transmit_log_entry_message(self, payload: bytes, destinations: Sequence[str]) -> Ticket:
        """Store one payload for ``destinations`` as one log entry (visible when the caller commits).
        Returns a ticket to wait on after commit (``wait_until_safe``)."""
        row, route = self.log_entry(payload, destinations)
        return Ticket(self.source_site_id, self.client_name, self._insert([row]), route.named)

    def transmit_log_entry_messages(self, messages: Iterable[LRMessageWithDestinations]) -> Ticket | None:
        """Store many payloads, in order, in the caller's transaction; all validated before any write.
        Returns a ticket naming the transaction and every destination named (None for no message)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
            raise TransmitError(
                f"messages must be LRMessageWithDestinations, not {type(messages).__name__}; nothing was written"
            )
        rows: list[tuple[int, list[int], bytes]] = []
        named: set[str] = set()
        for m in messages:
            if not isinstance(m, LRMessageWithDestinations):
                raise TransmitError(
                    f"messages must be LRMessageWithDestinations, not {type(m).__name__}; nothing was written"
                )
            row, route = self.log_entry(m.payload, m.destinations)  # destinations read once, as checked
            rows.append(row)
            named.update(route.named)
        if not rows:
            return None
        tx = self._insert(rows)
        return Ticket(self.source_site_id, self.client_name, tx, tuple(sorted(named)))

    def wait_until_safe(
        self, ticket: Ticket, destinations: Sequence[str] = (), min_regions: int | None = None, timeout: float = 30.0
    ) -> delivery.Delivery:
        """After commit: return once the ticket's entries are *safe* (acknowledged after the sink's
        durable apply) on every one of ``destinations``, and stored in at least ``min_regions``
        distinct regions (the source's counts; only sinks the entries named count). Neither given:
        the topology's ``durability`` rule if it has one, else every destination the entries named.
        Raises ``DeliveryTimeout`` naming the destinations that have not acknowledged, and
        ``ConfigurationError`` for a destination the entries did not name or a ``min_regions`` they
        can never reach. The entries are *delayed* (guarded) while it waits. See docs/delivery.md."""
        with catalog_path(self.conn, "wait_until_safe"):
            return delivery.wait_until_safe(self.conn, ticket, destinations, min_regions, timeout)

    def wait_until_ready(self, destinations: Sequence[str], timeout: float = 30.0) -> list[Readiness]:
        """Return once every one of ``destinations`` holds, safe, everything this client committed
        before the call (the destination is *ready*), or raise ``DeliveryTimeout``."""
        with catalog_path(self.conn, "wait_until_ready"):
            return wait_until_ready(self.conn, self.client_name, destinations, timeout)

    def delivery(self, ticket: Ticket) -> delivery.Delivery:
        """The ticket's state on each destination it named (new, delayed, safe), read now."""
        with catalog_path(self.conn, "delivery"):
            return delivery.ticket_delivery(self.conn, ticket)

    def serve_full_sync_requests(self, provider: full_sync.Provider, max_requests: int | None = None) -> list[str]:
        """Supply the pending full-sync requests of this client's sessions with ``provider(ctx)``,
        which calls ``ctx.transmit(payload)`` per message; lr writes the start marker (with the base
        snapshot) and the end marker. One transaction per request; returns the ids supplied. A
        ``provider`` that is not a function, or a ``max_requests`` not a whole number of at least 1,
        is refused at once (the first was found out only once a request came, noted as its failure;
        0 or -1 supplied nothing, silently)."""
        require_counts(max_requests=max_requests)
        if not callable(provider):
            raise ConfigurationError(
                f"the full-sync provider must be a function of the request's context (ctx), not {shown(provider)}"
            )
        return full_sync.serve_full_sync_requests(self, provider, max_requests)
