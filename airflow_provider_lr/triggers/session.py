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
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import psycopg2
import psycopg2.extensions
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_lr.engine.db.explained import failure, refused_kind
from airflow_provider_lr.engine.errors import ConfigurationError, LRError, SiteUnreachableError, one_line
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.site.failover_record import moved_on
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
    TIMEOUT = "timeout"  # no data by the request's deadline; or a wait past its ``wait_until``
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
    ``deadline``; None while still pending. A request a switchover asked of the new source instead
    (``moved_on``, the rule ``lr full-sync --wait`` and the lr_full_sync DAG follow it by) is closed
    with ``moved_to`` and ``moved_request`` naming it there; None while the switchover has not asked
    it there yet."""
    request = full_sync.get_request(conn, request_id)
    if request is None:
        return status_event(TriggerStatus.CLOSED, request_id=request_id, message="no such full-sync request")
    if request.status in (RequestStatus.SUPPLIED, RequestStatus.APPLIED):
        return status_event(TriggerStatus.SUPPLIED, request_id=request_id, entries=request.entries)
    if request.status != RequestStatus.PENDING:
        said = f"request {request.status}" + (f": {request.note}" if request.note else "")
        went = moved_on(full_sync.outcome(conn, request_id))  # a switchover asked it of another site
        if went is not None and went[1] is None:  # the switchover's drain closed it: its request there comes next
            return None
        if went is not None:  # the waiting task follows it there (``moved_to``, ``moved_request``)
            return status_event(
                TriggerStatus.CLOSED, request_id=request_id, message=said, moved_to=went[0], moved_request=went[1]
            )
        return status_event(TriggerStatus.CLOSED, request_id=request_id, message=said)
    if deadline is not None and datetime.now(timezone.utc) > deadline:
        return status_event(TriggerStatus.TIMEOUT, request_id=request_id, message=f"no data by {deadline.isoformat()}")
    return None


def full_sync_outcome_status(
    conn: psycopg2.extensions.connection, request_id: str, lease_free: bool = False, follow: bool = False
) -> dict[str, Any] | None:
    """The event once a full-sync request is applied at its sink, by whichever replicator (or a
    newer request of its session is: ``full_sync.outcome``), or failed; with ``lease_free``, also
    as soon as nobody holds its session's lease (``lease_free``: the waiting step may do the work
    itself). None while it is pending and the lease is held. With ``follow`` (``LRFullSyncAppliedSensor``),
    a request a switchover asked of the new source instead (``moved_on``) ends with ``moved_to`` and
    ``moved_request`` naming it there, as ``snapshot_end_status`` does; None while not asked there yet."""
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
        went = moved_on(found) if follow else None
        if went is not None and went[1] is None:  # the switchover's drain closed it: its request there comes next
            return None
        if went is not None:  # the waiting sensor follows it there
            return {**event, "moved_to": went[0], "moved_request": went[1]}
        return event
    if lease_free and leases.holder(conn, found.request.sink_site_id, found.request.client_name) is None:
        return {**event, "status": TriggerStatus.LEASE_FREE.value}
    return None


def full_sync_waiting_for(conn: psycopg2.extensions.connection, request_id: str) -> str:
    """What became of a request not applied yet, and why: its session's holder and last error."""
    found = full_sync.outcome(conn, request_id)
    if found is None:
        return f"no full-sync request {request_id}"
    request = found.request
    return found.describe() + leases.works_on(conn, request.sink_site_id, request.client_name)


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


SAY_EVERY = 60.0  # seconds between a waiting trigger's "still waiting: why" lines in the task log


class _PollingTrigger(BaseTrigger):
    """Connects to the source through its Airflow connection and runs ``check`` until it returns
    an event, sleeping ``poll_interval`` doubled after each miss up to ``max_poll_interval``.
    A lost connection is retried (the site may be restarting); any other error ends the wait
    with an ``error`` event that the task turns into a failure. Every ``SAY_EVERY`` seconds it logs
    why it still waits (``waiting_for``: the session's holder and last error, say), and past
    ``wait_until`` (ISO time; the waiting task's timeout) it ends with a ``timeout`` event saying
    the same: before, a wait on a session whose sink stopped answering was silent until Airflow's
    deferral timeout (6 h for a full sync; under ``dag.test``, which ignores it, for ever)."""

    def __init__(
        self,
        source_conn_id: str,
        poll_interval: float = 1.0,
        max_poll_interval: float = 30.0,
        wait_until: str | None = None,
    ) -> None:
        super().__init__()
        self.source_conn_id = source_conn_id
        self.poll_interval = float(poll_interval)
        self.max_poll_interval = float(max_poll_interval)
        self.wait_until = wait_until  # ISO time: past it, a ``timeout`` event saying why (``waiting_for``)

    def _kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "source_conn_id": self.source_conn_id,
            "poll_interval": self.poll_interval,
            "max_poll_interval": self.max_poll_interval,
        }
        if self.wait_until:
            kwargs["wait_until"] = self.wait_until
        return kwargs

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{_MODULE}.{type(self).__name__}", self._kwargs()

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        raise NotImplementedError

    def waiting_for(self, conn: psycopg2.extensions.connection) -> str:
        """What the wait still lacks and why, one line ("": nothing to add): said in the log every
        ``SAY_EVERY`` seconds while waiting and in the ``timeout`` event at ``wait_until``."""
        return ""

    def why(self, conn: psycopg2.extensions.connection | None, unreachable: str = "") -> str:
        """``waiting_for`` as a phrase to append (``: ...``); a source that does not answer, said so."""
        if conn is None or conn.closed:
            return f": source {self.source_conn_id} unreachable ({unreachable})" if unreachable else ""
        try:
            said = self.waiting_for(conn)
        except psycopg2.Error as exc:
            if not conn.closed:
                conn.rollback()
            said = f"(not read: {one_line(exc)})"
        except LRError as exc:
            said = f"(not read: {one_line(exc)})"
        return f": {said}" if said else ""

    def timeout_event(self, conn: psycopg2.extensions.connection | None, unreachable: str = "") -> dict[str, Any]:
        """The event of a wait past ``wait_until``: what it still lacks and why."""
        return status_event(
            TriggerStatus.TIMEOUT, message=f"still waiting at {self.wait_until}{self.why(conn, unreachable)}"
        )

    def timed_out(self) -> bool:
        return self.wait_until is not None and datetime.now(timezone.utc) >= datetime.fromisoformat(self.wait_until)

    def _pause(self, pause: float) -> float:
        """The next pause, cut at ``wait_until`` (the last look at the deadline, not a pause past it)."""
        if self.wait_until is None:
            return pause
        left = (datetime.fromisoformat(self.wait_until) - datetime.now(timezone.utc)).total_seconds()
        return max(0.0, min(pause, left))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        pause = self.poll_interval
        conn: psycopg2.extensions.connection | None = None
        unreachable, said_at = "", time.monotonic()
        try:
            info = await LRSiteHook(lr_conn_id=self.source_conn_id).aget_conninfo()
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await asyncio.to_thread(info.connect)
                    event = await asyncio.to_thread(self.check, conn)
                    unreachable = ""
                except (psycopg2.OperationalError, psycopg2.InterfaceError, SiteUnreachableError) as exc:
                    unreachable = one_line(exc)
                    log.warning(
                        "%s: source %s unreachable, retrying: %s", type(self).__name__, self.source_conn_id, unreachable
                    )
                    if conn is not None:
                        conn.close()
                    conn, event = None, None
                if event is not None:
                    yield TriggerEvent(event)
                    return
                if self.timed_out():  # bounded: a session that cannot progress ends the wait, saying why
                    yield TriggerEvent(await asyncio.to_thread(self.timeout_event, conn, unreachable))
                    return
                if time.monotonic() - said_at >= SAY_EVERY:
                    why = await asyncio.to_thread(self.why, conn, unreachable)
                    log.info("%s: still waiting%s", type(self).__name__, why)
                    said_at = time.monotonic()
                await asyncio.sleep(self._pause(pause))
                pause = min(pause * 2, self.max_poll_interval)
        except Exception as exc:  # a configuration or schema problem: end the wait, the task reports it
            # ``failure``: a login lacking lr's grant (a consumer's, a writer's) is named with the grant
            # to give; it said only "permission denied for table source_sessions". ``error_kind``: whether
            # a retry mends it, for the sensor's one rule (``operators/common.refused_in_result``)
            yield TriggerEvent(status_event(TriggerStatus.ERROR, message=failure(exc), error_kind=refused_kind(exc)))
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
    holds its session's lease; with ``follow``, also when a switchover asked it of another site
    (``full_sync_outcome_status``)."""

    def __init__(
        self, source_conn_id: str, request_id: str, lease_free: bool = False, follow: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(source_conn_id, **kwargs)
        self.request_id, self.lease_free, self.follow = request_id, bool(lease_free), bool(follow)

    def _kwargs(self) -> dict[str, Any]:
        return {
            **super()._kwargs(),
            "request_id": self.request_id,
            "lease_free": self.lease_free,
            "follow": self.follow,
        }

    def check(self, conn: psycopg2.extensions.connection) -> dict[str, Any] | None:
        return full_sync_outcome_status(conn, self.request_id, self.lease_free, self.follow)

    def waiting_for(self, conn: psycopg2.extensions.connection) -> str:
        return full_sync_waiting_for(conn, self.request_id)


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

    def waiting_for(self, conn: psycopg2.extensions.connection) -> str:
        said, missing = delivery.shortfall(
            conn, self.client, self.position, self.destinations, self.min_regions or None
        )
        return said + "".join(f"; {sink}{leases.works_on(conn, sink, self.client)}" for sink in missing)


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

    def waiting_for(self, conn: psycopg2.extensions.connection) -> str:
        behind = [r.sink for r in readiness_of(conn, self.client, self.destinations) if not r.ready]
        return f"not ready: {behind}" + "".join(
            f"; {sink}{leases.works_on(conn, sink, self.client)}" for sink in behind
        )
