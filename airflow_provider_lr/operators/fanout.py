"""The read-once fan-out of one source's backlog in the Airflow worker itself (no Spark).

For backlogs between ``tee_min_backlog`` and ``spark_min_backlog`` (topology settings): the same
engine as the Spark job (``engine/bulk/fanout``: one source read for all the source's sinks, packed
receive-queue rows, one fenced sink transaction per session and chunk), run in this task's process,
so it pays no Spark start. Sites are reached through ``LRSiteHook`` (whatever connection backend
Airflow uses); nothing is written to disk. The small summary of ``FanoutResult`` is the XCom.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.errors import require_counts
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import (
    final_refusals,
    finals_refused,
    load_topology,
    refused_for_good,
)


class LRFanOutOperator(BaseOperator):
    """Deliver one source's log-entry backlog to all its sinks with the in-process tee.

    :param source: the source site id (templated)
    :param max_entries: cap on entries this run delivers
    :param topology_path: the topology file (default: ``$LR_TOPOLOGY`` or the shipped one)
    Fails when a session could not be delivered (its error is in the log and in the session's
    ``last_error``); the sessions' own steps run after it either way and pick up what is left.
    A failure no retry mends (a login without lr's grants, a topology the sites do not share) fails
    it for good (``FinalRefusal``), after the other sessions were delivered; a session another
    replicator holds, or that needs a snapshot, is skipped (``skipped``), not a failure.
    """

    template_fields: Sequence[str] = ("source", "topology_path")

    def __init__(
        self, *, source: str, topology_path: str | None = None, max_entries: int | None = None, **kwargs: Any
    ) -> None:
        require_counts(max_entries=max_entries)
        final_refusals(kwargs)  # a login without lr's grant: failed at once
        super().__init__(**kwargs)
        self.source, self.topology_path, self.max_entries = source, topology_path, max_entries

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow_provider_lr.engine.bulk import fanout

        step = f"fan-out of {self.source}"
        with finals_refused(self.log, step):  # a connection not defined, the login's grants (the driver's own)
            topo = load_topology(self.topology_path)

            def conninfo(site: str):
                return LRSiteHook(lr_conn_id=topo.conn_id(site), timeouts=topo.timeouts).get_conninfo()

            driver = fanout.FanoutDriver(
                topo, self.source, conninfo=conninfo, connect=lambda site: conninfo(site).connect(Purpose.BULK)
            )
            try:
                with telemetry.task_progress(self.log):  # the engine's progress lines, in this task's log
                    result = fanout.run_fanout(driver, fanout.local_map, self.max_entries)
            finally:
                driver.close()
        summary = {k: v for k, v in result.as_dict().items() if k not in ("peak_rss_kb",)}
        self.log.info("%s: %s", step, summary)
        for session, delivered in result.deliveries.items():
            telemetry.session_step(session, delivered=delivered)
        for session in result.errors:
            telemetry.session_error(session)
        for session, exc in driver.failures.items():  # the others delivered first; what no retry mends fails for good
            final = refused_for_good(self.log, step, exc, f"session {session}: ")
            if final is not None:
                raise final
        if not result.ok:
            said = f"{step}: sessions not delivered (tried again as the task's retries say): " + "; ".join(
                f"{session}: {error}" for session, error in sorted(result.errors.items())
            )
            self.log.error("%s", said)
            raise AirflowException(said)
        return summary
