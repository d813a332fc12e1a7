"""Deferrable sensors over a source site's metadata. Deferred (the default), they wait in the
triggerer with no worker slot held; ``deferrable=False`` pokes the same check from a worker."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout

from airflow_provider_lr.engine.source.backlog import delivery_target
from airflow_provider_lr.engine.source.full_sync import Outcome
from airflow_provider_lr.operators.common import (
    final_refusals,
    finals_refused,
    load_topology,
    refused_in_result,
    site_conn_id,
    site_connection,
)
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

FOLLOW_HOPS = 8  # switchovers a wait follows its request across (``failover_record.followed_outcome``'s bound)
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

    def _moved(self) -> bool:
        """Whether the wait moved to another site since ``build_trigger`` (``LRSnapshotEndSensor``)."""
        return False

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

    def _check_now(self, trigger: _PollingTrigger, site: str | None = None) -> dict[str, Any] | None:
        """``trigger``'s check, once, at ``site`` (the source unless a switchover moved the wait)."""
        site = site or self.source
        # an undefined connection, a login without lr's grant: one ERROR line, no retry
        with (
            finals_refused(self.log, self.task_id, f"source {site}: "),
            site_connection(trigger.source_conn_id, site) as conn,
        ):
            return trigger.check(conn)

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
        if self._moved():  # the check followed a moved request: wait for it there
            trigger = self.build_trigger()
        self.defer(trigger=trigger, method_name="execute_complete", timeout=timedelta(seconds=self.timeout) + GRACE)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") == TriggerStatus.TIMEOUT:  # past the sensor's timeout: not retried, as Airflow's
            raise AirflowSensorTimeout(f"{self.task_id}: {event.get('message', event)}")
        if event.get("status") not in _SUCCESS:
            # what no retry mends (a grant revoked while it waited deferred): failed for good, as a poke's
            said = {"error": event.get("message"), "error_kind": event.get("error_kind")}
            final = refused_in_result(self.log, self.task_id, said)
            if final is not None:
                raise final
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


class _FollowingSensor(_LRSensor):
    """A wait on full-sync request ``request_id`` that follows it when a planned switchover asked it
    of the promoted site instead (``moved_on``, via the trigger's ``moved_to``/``moved_request``: the
    rule the lr_full_sync DAG's step and ``lr full-sync --wait`` follow it by), deferred and poking."""

    template_fields: Sequence[str] = ("source", "request_id", "topology_path")

    def __init__(self, *, request_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.request_id = request_id
        self._at: tuple[str, str] | None = None  # (site, request id) a switchover asked the request of instead

    def _trigger(self, conn_id: str, request_id: str) -> _PollingTrigger:
        raise NotImplementedError

    def build_trigger(self) -> _PollingTrigger:
        if self._at is None:
            return self._trigger(self._source_conn_id(), str(self.request_id))
        return self._trigger(self._conn_id(self._at[0]), self._at[1])

    def _moved(self) -> bool:
        return self._at is not None

    def _conn_id(self, site: str) -> str:
        try:
            return load_topology(self.topology_path).conn_id(site)
        except Exception:  # a topology without that site: as the lr_full_sync DAG's step names it
            return site_conn_id(site, [])

    def _follow(self, event: dict[str, Any] | None) -> bool:
        """Whether ``event`` says a switchover asked the request of another site: then the wait goes
        on there. Before, the sensor failed on the old source's 'cancelled: failed over: asked of
        site-b as request ...' while site-b supplied (and applied) it."""
        if event is None or not event.get("moved_request"):
            return False
        self._at = (str(event["moved_to"]), str(event["moved_request"]))
        self.log.info("%s: %s; waiting for request %s at %s", self.task_id, event.get("message"), *self._at[::-1])
        return True

    def _check_now(self, trigger: _PollingTrigger, site: str | None = None) -> dict[str, Any] | None:
        event = super()._check_now(trigger, site or (self._at[0] if self._at else None))
        for _ in range(FOLLOW_HOPS):  # chained switchovers (a->b, then b->c), bounded
            if not self._follow(event):
                break
            event = super()._check_now(self.build_trigger(), self._at[0] if self._at else None)
        return event

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        if self._follow(event):  # the trigger ended on the moved request: wait for it where it went
            return self.execute(context)
        return super().execute_complete(context, event)


class LRSnapshotEndSensor(_FollowingSensor):
    """Waits until the client has supplied the data of full-sync request ``request_id`` (its end
    marker is in the source's log); fails if the request is closed without data."""

    def _trigger(self, conn_id: str, request_id: str) -> LRSnapshotEndTrigger:
        return LRSnapshotEndTrigger(conn_id, request_id, None, **self._polling())


class LRFullSyncAppliedSensor(_FollowingSensor):
    """Waits until full-sync request ``request_id`` (``lr full-sync``, ``full_sync.request_full_sync``)
    is applied at its sink, by whichever replicator carries it out (``lr_streaming``, ``lr sync``,
    ``lr_replication``), or a newer request of the same session is; fails when it was closed
    without being applied (timed out, cancelled), with the reason recorded on the source."""

    def _trigger(self, conn_id: str, request_id: str) -> LRFullSyncOutcomeTrigger:
        return LRFullSyncOutcomeTrigger(conn_id, request_id, follow=True, **self._polling())


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
