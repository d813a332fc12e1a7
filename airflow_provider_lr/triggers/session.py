"""Triggers that wait on a source site's metadata: new log entries for a session, a full sync's
end marker, a full sync applied, an entry delivered to destinations or regions.

They poll with backoff rather than LISTEN: a NOTIFY sent by ``transmit`` would take PostgreSQL's
global notify lock at every application commit and serialize the writers (guarantee 3 in docs/architecture.md).
Every database call runs in a worker thread (``asyncio.to_thread``): psycopg2 blocks, the
triggerer's event loop must not. The checks themselves are engine functions, shared with the
sensors' non-deferrable mode.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import psycopg2
import psycopg2.extensions
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_lr.engine.errors import ConfigurationError, SiteUnreachableError, error_line, one_line
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.source import delivery, full_sync
from airflow_provider_lr.engine.source.backlog import DeliveryTarget, pending_entries, readiness_of
from airflow_provider_lr.engine.source.full_sync import Outcome
from airflow_provider_lr.engine.vocabulary import RequestStatus
from airflow_provider_lr.hooks.site import LRSiteHook

log = logging.getLogger(__name__)
_MODULE = __name__


class TriggerStatus(str, enum.Enum):
    """An event's ``status``, beside a full sync's ``Outcome`` (``applied``, ``pending``, ``failed``)
    that ``full_sync_outcome_status`` passes on. Events carry the plain value (they are serialized)."""

    SUCCESS = "success"  # what the sensor waited for happened
    SUPPLIED = "supplied"  # the client supplied a full sync's data
    CLOSED = "closed"  # the full-sync request was closed (or is gone) without data
    TIMEOUT = "timeout"  # no data by the request's deadline
    LEASE_FREE = "lease_free"  # nobody holds the session's lease: the waiting step may do the work
    ERROR = "error"  # the wait ended on an error that is not a lost connection


def status_event(status: TriggerStatus, **fields: Any) -> dict[str, Any]:
    """A trigger event: its status as the plain word, then what the waiting task reads."""
    return {"status": status.value, **fields}


def snapshot_end_status(
    conn: psycopg2.extensions.connection, request_id: str, deadline: datetime | None
) -> dict[str, Any] | None:
    """The event once a full-sync request's data is complete (its end marker is in the log: the
    request turns 'supplied' in the transaction that writes the marker), closed, or past
    ``deadline``; None while still pending."""
    request = full_sync.get_request(conn, request_id)
    if request is None:
        return status_event(TriggerStatus.CLOSED, request_id=request_id, message="no such full-sync request")
    if request.status in (RequestStatus.SUPPLIED, RequestStatus.APPLIED):
        return status_event(TriggerStatus.SUPPLIED, request_id=request_id, entries=request.entries)
    if request.status != RequestStatus.PENDING:
        said = f"request {request.status}" + (f": {request.note}" if request.note else "")
        return status_event(TriggerStatus.CLOSED, request_id=request_id, message=said)
    if deadline is not None and datetime.now(timezone.utc) > deadline:
        return status_event(TriggerStatus.TIMEOUT, request_id=request_id, message=f"no data by {deadline.isoformat()}")
    return None


def full_sync_outcome_status(
    conn: psycopg2.extensions.connection, request_id: str, lease_free: bool = False
) -> dict[str, Any] | None:
    """The event once a full-sync request is applied at its sink, by whichever replicator (or a
    newer request of its session is: ``full_sync.outcome``), or failed; with ``lease_free``, also
    as soon as nobody holds its session's lease (``lease_free``: the waiting step may do the work
    itself). None while it is pending and the lease is held."""
    found = full_sync.outcome(conn, request_id)
    if found is None:
        return {"status": Outcome.FAILED.value, "request_id": request_id, "message": "no such full-sync request"}
    event = {
        "status": found.outcome.value,
        "request_id": request_id,
        "applied_request": found.applied_request,
        "message": found.describe(),
    }
    if found.final:
        return event
    if lease_free and leases.holder(conn, found.request.sink_site_id, found.request.client_name) is None:
        return {**event, "status": TriggerStatus.LEASE_FREE.value}
    return None


def new_entries_status(
    conn: psycopg2.extensions.connection, sink: str, client: str, min_entries: int = 1
) -> dict[str, Any] | None:
    count, highest = pending_entries(conn, sink, client)
    if count >= min_entries:
        return status_event(TriggerStatus.SUCCESS, sink=sink, client=client, pending=count, highest_position=highest)
    return None


def delivered_status(
    conn: psycopg2.extensions.connection, client: str, position: int, destinations: list[str], min_regions: int
) -> dict[str, Any] | None:
    """The event once the entry at ``position`` is safe where asked (``engine.source.delivery``:
    only sinks the entry named count, for destinations and regions)."""
    found = delivery.delivered(conn, client, position, destinations, min_regions or None)
    if found is None:
        return None
    return status_event(TriggerStatus.SUCCESS, position=position, safe_on=found.safe_on, regions=found.stored_regions)


class _PollingTrigger(BaseTrigger):
    """Connects to the source through its Airflow connection and runs ``check`` until it returns
    an event, sleeping ``poll_interval`` doubled after each miss up to ``max_poll_interval``.
    A lost connection is retried (the site may be restarting); any other error ends the wait
    with an ``error`` event that the task turns into a failure."""

    def __init__(self, source_conn_id: str, poll_interval: float = 1.0, max_poll_interval: float = 30.0) -> None:
        super().__init__()
        self.source_conn_id = source_conn_id
        self.poll_interval = float(poll_interval)
        self.max_poll_interval = float(max_poll_interval)

    def _kwargs(self) -> dict[str, Any]:
        return {
            "source_conn_id": self.source_conn_id,
            "poll_interval": self.poll_interval,
            "max_poll_interval": self.max_poll_interval,
        }

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{_MODULE}.{type(self).__name__}", self._kwargs()

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        raise NotImplementedError

    async def run(self) -> AsyncIterator[TriggerEvent]:
        pause = self.poll_interval
        conn: psycopg2.extensions.connection | None = None
        try:
            info = await LRSiteHook(lr_conn_id=self.source_conn_id).aget_conninfo()
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await asyncio.to_thread(info.connect)
                    event = await asyncio.to_thread(self.check, conn)
                except (psycopg2.OperationalError, psycopg2.InterfaceError, SiteUnreachableError) as exc:
                    log.warning(
                        "%s: source %s unreachable, retrying: %s",
                        type(self).__name__,
                        self.source_conn_id,
                        one_line(exc),
                    )
                    if conn is not None:
                        conn.close()
                    conn, event = None, None
                if event is not None:
                    yield TriggerEvent(event)
                    return
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.max_poll_interval)
        except Exception as exc:  # a configuration or schema problem: end the wait, the task reports it
            yield TriggerEvent(status_event(TriggerStatus.ERROR, message=error_line(exc)))
        finally:
            if conn is not None and not conn.closed:
                conn.close()


class LRNewLogEntriesTrigger(_PollingTrigger):
    """Fires when the session (source → ``sink`` for ``client``) has at least ``min_entries``
    committed entries its sink has not acknowledged."""

    def __init__(self, source_conn_id: str, sink: str, client: str, min_entries: int = 1, **kwargs: Any) -> None:
        super().__init__(source_conn_id, **kwargs)
        self.sink, self.client, self.min_entries = sink, client, int(min_entries)

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "sink": self.sink, "client": self.client, "min_entries": self.min_entries}

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        return new_entries_status(conn, self.sink, self.client, self.min_entries)


class LRSnapshotEndTrigger(_PollingTrigger):
    """Fires when the client has supplied a full sync's data (end marker written), when the request
    is closed, or at ``deadline`` (ISO time; the request's data deadline)."""

    def __init__(self, source_conn_id: str, request_id: str, deadline: str | None = None, **kwargs: Any) -> None:
        super().__init__(source_conn_id, **kwargs)
        self.request_id, self.deadline = request_id, deadline

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "request_id": self.request_id, "deadline": self.deadline}

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        deadline = datetime.fromisoformat(self.deadline) if self.deadline else None
        return snapshot_end_status(conn, self.request_id, deadline)


class LRFullSyncOutcomeTrigger(_PollingTrigger):
    """Fires when full-sync request ``request_id`` is applied at its sink by whichever replicator
    (a DAG's step, ``lr_streaming``, ``lr sync``) or failed; with ``lease_free``, also when nobody
    holds its session's lease (``full_sync_outcome_status``)."""

    def __init__(self, source_conn_id: str, request_id: str, lease_free: bool = False, **kwargs: Any) -> None:
        super().__init__(source_conn_id, **kwargs)
        self.request_id, self.lease_free = request_id, bool(lease_free)

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "request_id": self.request_id, "lease_free": self.lease_free}

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        return full_sync_outcome_status(conn, self.request_id, self.lease_free)


class LRDeliveredTrigger(_PollingTrigger):
    """Fires when the entry at commit ``position`` is safe on every one of ``destinations`` and
    stored in at least ``min_regions`` distinct regions (the source's counts; only sinks the entry
    named count). Neither given: the topology's durability rule, else every sink it named. The
    rule is ``engine.source.delivery``'s, shared with ``RoutingQueueClient.wait_until_safe``."""

    def __init__(
        self,
        source_conn_id: str,
        source: str,
        client: str,
        position: int,
        destinations: list[str] | None = None,
        min_regions: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(source_conn_id, **kwargs)
        self.source, self.client, self.position = source, client, int(position)
        self.destinations, self.min_regions = list(destinations or []), int(min_regions)

    @classmethod
    def for_target(
        cls, source_conn_id: str, target: DeliveryTarget, position: int, **kwargs: Any
    ) -> LRDeliveredTrigger:
        return cls(
            source_conn_id,
            target.source,
            target.client,
            position,
            list(target.destinations),
            target.min_regions,
            **kwargs,
        )

    def _kwargs(self) -> dict[str, Any]:
        return {
            **super()._kwargs(),
            "source": self.source,
            "client": self.client,
            "position": self.position,
            "destinations": self.destinations,
            "min_regions": self.min_regions,
        }

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        return delivered_status(conn, self.client, self.position, self.destinations, self.min_regions)


def ready_status(conn: psycopg2.extensions.connection, client: str, destinations: list[str]) -> dict[str, Any] | None:
    """The event once every destination is *ready* for ``client`` (``engine.source.backlog``:
    everything committed for it before its first guarded position, or everything committed, is
    safe), counted live; None while one is behind."""
    found = {r.sink: r for r in readiness_of(conn, client, destinations)}
    unknown = sorted(set(destinations) - set(found))
    if unknown:
        raise ConfigurationError(f"{unknown} are not sinks of client {client!r} at this site")
    if all(r.ready for r in found.values()):
        return status_event(
            TriggerStatus.SUCCESS,
            client=client,
            ready=sorted(found),
            acked={s: r.acked for s, r in sorted(found.items())},
        )
    return None


class LRReadyTrigger(_PollingTrigger):
    """Fires when every one of ``destinations`` is ready for ``client`` (``ready_status``)."""

    def __init__(self, source_conn_id: str, client: str, destinations: list[str], **kwargs: Any) -> None:
        super().__init__(source_conn_id, **kwargs)
        self.client, self.destinations = client, list(destinations)

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "client": self.client, "destinations": self.destinations}

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        return ready_status(conn, self.client, self.destinations)
