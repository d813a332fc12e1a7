"""The snapshot (full) sync step of one session as an Airflow task (``LRSnapshotSyncOperator``): the
engine's step (``SessionRunner.snapshot_step``) and, for a full sync a DAG asked for, the wait for
the client's data or for the request to be applied by whichever replicator holds the session
(deferred to the triggers in ``triggers/session.py``). The other steps: ``operators/session.py``.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_lr.engine.session.runner import CycleReport
from airflow_provider_lr.engine.site.failover_record import followed_outcome, moved_on
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.full_sync import Outcome
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import SNAPSHOT_TRANSFER_JOB, site_conn_id, site_connection, site_connector
from airflow_provider_lr.operators.session import SessionStepOperator

# a bounded wait's trigger ends it at its ``wait_until``, saying why; Airflow's deferral timeout,
# which fails the task without a word, comes this much later
GRACE = timedelta(minutes=2)


class LRSnapshotSyncOperator(SessionStepOperator):
    """Snapshot (full) sync of one session: request → wait for the client's data → transfer →
    apply → complete.

    :param wait_for_data: carry the full sync out (``lr_full_sync``) rather than do what can be
        done now (``lr_replication``: one slow client must not hold every session's next cycle).
        When the client has not supplied the data yet, wait for its end marker (deferring to
        ``LRSnapshotEndTrigger``). When the session's ``request_id`` (its dict's key, recorded by
        the DAG) is known, the task succeeds once THAT request is applied at the sink, by whichever
        replicator: while another one (``lr_streaming``, ``lr sync``, ``lr_replication``) holds
        the session's lease, it waits for the request (``LRFullSyncOutcomeTrigger``) instead of
        failing, and carries the sync out itself if the lease is let go first. It fails when the
        request was closed without being applied (``full_sync.outcome``: timed out, cancelled).
    :param deferrable: wait in the triggerer (default True; False polls from the worker)
    :param poll_interval: first poll interval of the wait, doubled up to ``max_poll_interval``
    :param wait_timeout: how long to wait for a request another replicator carries out
    """

    branch = "snapshot_sync"
    spark_jobs = (SNAPSHOT_TRANSFER_JOB,)  # a large full sync's transfer
    ui_color = "#fde2e2"

    def __init__(
        self,
        *,
        wait_for_data: bool = False,
        deferrable: bool = True,  # lr never holds a worker slot to wait
        poll_interval: float = 1.0,
        max_poll_interval: float = 30.0,
        wait_timeout: timedelta = timedelta(hours=6),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.wait_for_data, self.deferrable = wait_for_data, deferrable
        self.poll_interval, self.max_poll_interval = poll_interval, max_poll_interval
        self.wait_timeout = wait_timeout

    @property
    def request_id(self) -> str | None:
        """The full-sync request this task carries out (``lr_full_sync`` records one per session)."""
        return (self.session or {}).get("request_id") if self.wait_for_data else None

    def execute(self, context: Any) -> dict[str, Any]:
        self._complete_session()
        self._skip_unless_chosen()
        if self.request_id:
            done = self._outcome_now()
            if done is not None:  # already applied (e.g. by the stream) or failed
                return self.outcome_complete(context, done)
        with self.runner() as runner:
            report = runner.snapshot_step()
        return self._after_step(context, report)

    def _after_step(self, context: Any, report: CycleReport) -> dict[str, Any]:
        if report.skipped and self.wait_for_data:
            if not self.request_id:  # nothing to wait for but the lease: let the task's retries try again
                raise AirflowException(f"session {report.session}: {report.skipped}; retrying")
            self.log.info(
                "session %s: %s; waiting for full sync %s to be applied by it",
                report.session,
                report.skipped,
                self.request_id,
            )
            return self._wait(context, self._outcome_trigger(), self.wait_timeout + GRACE, "outcome_complete")
        if report.waiting and self.wait_for_data:
            deadline = self._deadline(report.request_id)
            self.log.info(
                "session %s: waiting for the client's data of request %s until %s",
                report.session,
                report.request_id,
                deadline.isoformat(),
            )
            from airflow_provider_lr.triggers.session import LRSnapshotEndTrigger

            trigger = LRSnapshotEndTrigger(
                source_conn_id=self.session["source_conn_id"],
                request_id=report.request_id,
                deadline=deadline.isoformat(),
                **self._polling(),
            )
            return self._wait(
                context, trigger, deadline - datetime.now(timezone.utc) + timedelta(minutes=5), "execute_complete"
            )
        result = self._result(report)
        if self.request_id and not report.transfer_for_spark:  # done here: say what became of the request
            done = self._outcome_now()
            if done is not None:
                return {**result, **self.outcome_complete(context, done)}
        return result

    def _polling(self, bound: timedelta | None = None) -> dict[str, Any]:
        """The triggers' polling; with ``bound``, the wait ends that long from now saying why
        (``wait_until``), before Airflow's deferral timeout (``GRACE`` later) ends it without a word."""
        polling: dict[str, Any] = {"poll_interval": self.poll_interval, "max_poll_interval": self.max_poll_interval}
        if bound is not None:
            polling["wait_until"] = (datetime.now(timezone.utc) + bound).isoformat()
        return polling

    def _outcome_trigger(self) -> Any:
        from airflow_provider_lr.triggers.session import LRFullSyncOutcomeTrigger

        return LRFullSyncOutcomeTrigger(
            self.session["source_conn_id"], str(self.request_id), lease_free=True, **self._polling(self.wait_timeout)
        )

    def _outcome_now(self) -> dict[str, Any] | None:
        from airflow_provider_lr.triggers.session import full_sync_outcome_status

        with site_connection(self.session["source_conn_id"], self.session["source"]) as conn:
            return full_sync_outcome_status(conn, str(self.request_id))

    def _wait(
        self, context: Any, trigger: Any, timeout: timedelta, method_name: str, at: tuple[str, str] | None = None
    ) -> dict[str, Any]:
        """Defer to ``trigger`` (no worker slot held), or with ``deferrable=False`` poll its check here,
        on the session's source or ``at`` (connection id, site): where a switchover asked its request."""
        if self.deferrable:
            self.defer(trigger=trigger, method_name=method_name, timeout=timeout)
        deadline = time.monotonic() + timeout.total_seconds()
        conn_id, site = at or (self.session["source_conn_id"], self.session["source"])
        with site_connection(conn_id, site) as conn:
            pause = self.poll_interval
            while (event := trigger.check(conn)) is None:
                if trigger.timed_out():  # its own bound, saying why (as the deferred wait does)
                    event = trigger.timeout_event(conn)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AirflowException(
                        f"session {self.session['session']}: still waiting after {timeout}{trigger.why(conn)}"
                    )
                time.sleep(min(pause, left))  # the last look at the deadline, not a pause past it
                pause = min(pause * 2, self.max_poll_interval)
        return getattr(self, method_name)(context, event)

    def _deadline(self, request_id: str) -> datetime:
        with site_connection(self.session["source_conn_id"], self.session["source"]) as conn:
            request = full_sync.get_request(conn, request_id)
        assert request is not None
        return request.data_deadline.astimezone(timezone.utc)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """The client's data came (or not): carry on from where the wait began."""
        self._complete_session()
        from airflow_provider_lr.triggers.session import TriggerStatus

        if event.get("status") == TriggerStatus.CLOSED and self._moved():
            return self.outcome_complete(context, event)  # followed where a switchover asked it
        with self.runner() as runner:
            report = runner.snapshot_step()  # transfers and applies; records a timeout if it passed
        if event.get("status") != TriggerStatus.SUPPLIED:
            raise AirflowException(
                f"session {report.session}: the client supplied no full-sync data for request "
                f"{event.get('request_id')} ({event.get('message', event.get('status'))}); run the client's "
                "provider (client.serve_full_sync_requests) or name one under `providers:` in the topology"
            )
        return self._after_step(context, report)

    def _moved(self) -> bool:
        """Whether a switchover closed this step's request at the old source and asked it of the
        new one (``moved_on``): the wait for the client's data then follows it there, as the wait
        for the request does. Before, it ended on 'request cancelled', ran the old session's step
        with the stale topology and failed the run ('the client supplied no full-sync data')."""
        if not self.request_id:
            return False
        with site_connection(self.session["source_conn_id"], self.session["source"]) as conn:
            return moved_on(full_sync.outcome(conn, str(self.request_id))) is not None

    def outcome_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """The request was applied (by anyone), failed, or its session's lease was let go (then
        this step carries it out itself)."""
        self._complete_session()
        from airflow_provider_lr.triggers.session import TriggerStatus

        name = self.session["session"]
        if event.get("status") == TriggerStatus.LEASE_FREE:
            return self.execute(context)
        if event.get("status") != Outcome.APPLIED.value:
            event = self._followed(context, event)
        self.log.info("session %s: %s", name, event.get("message"))
        return {
            "session": name,
            "request_id": self.request_id,
            "outcome": event["status"],
            "applied_request": event.get("applied_request"),
            "message": event.get("message"),
        }

    def _followed(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """The applied event of the request a switchover asked of the promoted site instead
        (``followed_outcome``), or a wait for it there; else the failure ``event`` says. Before, the
        step failed on the old source's 'cancelled: failed over: asked of site-b as request ...'."""
        from airflow_provider_lr.triggers.session import LRFullSyncOutcomeTrigger

        name, asked = self.session["session"], str(self.request_id)
        site, request_id, found = followed_outcome(site_connector([self.session]), self.session["source"], asked)
        went = moved_on(found)
        if went is not None and went[1] is None:  # the switchover has not asked it there yet
            raise AirflowException(f"session {name}: {found and found.describe()}; retrying")
        if request_id == asked or found is None:
            telemetry.session_error(self.session)
            raise AirflowFailException(f"session {name}: {event.get('message', event)}")
        said = f"failed over: asked of {site} as request {request_id}: {found.describe()}"
        if found.outcome is Outcome.APPLIED:
            return {"status": found.outcome.value, "applied_request": found.applied_request, "message": said}
        if found.final:
            telemetry.session_error(self.session)
            raise AirflowFailException(f"session {name}: {said}")
        self.log.info("session %s: %s; waiting for it there", name, said)
        trigger = LRFullSyncOutcomeTrigger(
            site_conn_id(site, [self.session]), request_id, lease_free=False, **self._polling(self.wait_timeout)
        )
        return self._wait(
            context, trigger, self.wait_timeout + GRACE, "outcome_complete", at=(trigger.source_conn_id, site)
        )
