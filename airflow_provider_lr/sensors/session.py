"""Deferrable sensors over a source site's metadata. Deferred (the default), they wait in the
triggerer with no worker slot held; ``deferrable=False`` pokes the same check from a worker."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg2.errors
from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout

from airflow_provider_lr.engine.db.explained import failure
from airflow_provider_lr.engine.source.backlog import delivery_target
from airflow_provider_lr.engine.source.full_sync import Outcome
from airflow_provider_lr.hooks.site import ConnectionMissing
from airflow_provider_lr.operators.common import final_refusals, load_topology, refuse, site_connection
from airflow_provider_lr.operators.snapshot_sync import GRACE
from airflow_provider_lr.triggers.session import (
    LRDeliveredTrigger,
    LRFullSyncOutcomeTrigger,
    LRNewLogEntriesTrigger,
    LRReadyTrigger,
    LRSnapshotEndTrigger,
    TriggerStatus,
    _PollingTrigger,
)

_SUCCESS = (TriggerStatus.SUCCESS, TriggerStatus.SUPPLIED, Outcome.APPLIED)


class _LRSensor(BaseSensorOperator):
    template_fields: Sequence[str] = ("source", "topology_path")

    def __init__(
        self,
        *,
        source: str,
        topology_path: str | None = None,
        deferrable: bool = True,  # lr never holds a worker slot to wait
        poll_interval: float = 1.0,
        max_poll_interval: float = 30.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("poke_interval", poll_interval)
        final_refusals(kwargs)  # a connection not defined: failed at once
        super().__init__(**kwargs)
        self.source, self.topology_path, self.deferrable = source, topology_path, deferrable
        self.poll_interval, self.max_poll_interval = poll_interval, max_poll_interval

    def build_trigger(self) -> _PollingTrigger:
        raise NotImplementedError

    def _source_conn_id(self) -> str:
        return load_topology(self.topology_path).conn_id(self.source)

    def _polling(self) -> dict[str, Any]:
        """The triggers' polling, bounded by the sensor's ``timeout``: past it the trigger ends the
        wait saying what is still missing and why (``wait_until``); Airflow's own deferral timeout,
        ``GRACE`` later, fails the task without a word."""
        until = datetime.now(timezone.utc) + timedelta(seconds=self.timeout)
        return {
            "poll_interval": self.poll_interval,
            "max_poll_interval": self.max_poll_interval,
            "wait_until": until.isoformat(),
        }

    def _check_now(self, trigger: _PollingTrigger) -> dict[str, Any] | None:
        try:
            with site_connection(trigger.source_conn_id, self.source) as conn:
                return trigger.check(conn)
        except ConnectionMissing as exc:  # waiting would not define it: one ERROR line, no retry
            raise refuse(self.log, self.task_id, f"source {self.source}: {exc}") from None
        except psycopg2.errors.InsufficientPrivilege as exc:  # a login without lr's grant: a retry changes nothing
            raise refuse(self.log, self.task_id, f"source {self.source}: {failure(exc)}") from None

    def poke(self, context: Any) -> PokeReturnValue:
        event = self._check_now(self.build_trigger())
        return PokeReturnValue(is_done=event is not None, xcom_value=event)

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        trigger = self.build_trigger()
        event = self._check_now(trigger)  # already true: no deferral round trip
        if event is not None:
            return self.execute_complete(context, event)
        self.defer(trigger=trigger, method_name="execute_complete", timeout=timedelta(seconds=self.timeout) + GRACE)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") == TriggerStatus.TIMEOUT:  # past the sensor's timeout: not retried, as Airflow's
            raise AirflowSensorTimeout(f"{self.task_id}: {event.get('message', event)}")
        if event.get("status") not in _SUCCESS:
            raise AirflowException(f"{self.task_id}: {event.get('status')}: {event.get('message', event)}")
        self.log.info("%s: %s", self.task_id, event)
        return event


class LRNewLogEntriesSensor(_LRSensor):
    """Waits until the session ``source`` → ``sink`` for ``client`` has at least ``min_entries``
    committed entries its sink has not acknowledged yet."""

    template_fields: Sequence[str] = ("source", "sink", "client", "topology_path")

    def __init__(self, *, sink: str, client: str, min_entries: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sink, self.client, self.min_entries = sink, client, min_entries

    def build_trigger(self) -> LRNewLogEntriesTrigger:
        return LRNewLogEntriesTrigger(
            self._source_conn_id(), self.sink, self.client, int(self.min_entries), **self._polling()
        )


class LRSnapshotEndSensor(_LRSensor):
    """Waits until the client has supplied the data of full-sync request ``request_id`` (its end
    marker is in the source's log); fails if the request is closed without data."""

    template_fields: Sequence[str] = ("source", "request_id", "topology_path")

    def __init__(self, *, request_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.request_id = request_id

    def build_trigger(self) -> LRSnapshotEndTrigger:
        return LRSnapshotEndTrigger(self._source_conn_id(), str(self.request_id), None, **self._polling())


class LRFullSyncAppliedSensor(_LRSensor):
    """Waits until full-sync request ``request_id`` (``lr full-sync``, ``full_sync.request_full_sync``)
    is applied at its sink, by whichever replicator carries it out (``lr_streaming``, ``lr sync``,
    ``lr_replication``), or a newer request of the same session is; fails when it was closed
    without being applied (timed out, cancelled), with the reason recorded on the source."""

    template_fields: Sequence[str] = ("source", "request_id", "topology_path")

    def __init__(self, *, request_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.request_id = request_id

    def build_trigger(self) -> LRFullSyncOutcomeTrigger:
        return LRFullSyncOutcomeTrigger(self._source_conn_id(), str(self.request_id), **self._polling())


class LRDeliveredSensor(_LRSensor):
    """Waits until the entry transmitted at commit ``position`` on ``source`` for ``client`` is
    safe on every named destination and/or durable in ``min_regions`` distinct regions.

    Only sinks the entry named count, for destinations and regions; neither given, the topology's
    ``durability`` rule, else every sink the entry named (the rule of
    ``RoutingQueueClient.wait_until_safe``, docs/delivery.md). Refuses (fails at once, no wait) a
    destination that is not a sink of that client, or that the entry did not name, and a
    ``min_regions`` the destinations can never reach (DistributedLog's minRegionsForDurability).
    Get ``position`` after the transmitting transaction commits: ``ticket = client.transmit_...``
    then ``client.delivery(ticket).position``.
    """

    template_fields: Sequence[str] = ("source", "client", "position", "destinations", "min_regions", "topology_path")

    def __init__(
        self,
        *,
        client: str,
        position: int | str,
        destinations: list[str] | None = None,
        min_regions: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.client, self.position = client, position
        self.destinations, self.min_regions = destinations, min_regions

    def build_trigger(self) -> LRDeliveredTrigger:
        topo = load_topology(self.topology_path)
        target = delivery_target(
            topo, self.source, self.client, list(self.destinations or []), int(self.min_regions or 0)
        )
        return LRDeliveredTrigger.for_target(topo.conn_id(self.source), target, int(self.position), **self._polling())


class LRReadySensor(_LRSensor):
    """Waits until every one of ``destinations`` is *ready* for ``client`` (Qpid HA's word): everything
    committed for it before its first guarded position — without a producer waiting, everything
    committed — is safe. Counted live on the source (docs/delivery.md); e.g. gate a step that
    reads the sinks after a bulk load at the source."""

    template_fields: Sequence[str] = ("source", "client", "destinations", "topology_path")

    def __init__(self, *, client: str, destinations: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client, self.destinations = client, destinations

    def build_trigger(self) -> LRReadyTrigger:
        delivery_target(load_topology(self.topology_path), self.source, self.client, list(self.destinations))
        return LRReadyTrigger(self._source_conn_id(), self.client, list(self.destinations), **self._polling())
