"""lr_maintenance: keep the sites tidy (hourly).

* stale lease cleanup on every source (leases whose holder died; fencing is unchanged);
* safe trim of every source's shared log (what every session has acknowledged), then an optional
  retention trim (``retention_seconds``: older entries go even if a session lags; that session is
  sent back to a snapshot sync at its next negotiation);
* receive-queue checkpoints on every sink: depth, unapplied snapshot rows, oldest waiting message
  and dead letters per queue, with a warning past ``queue_warn_after_seconds``.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import Param, dag, task

from airflow_provider_lr.engine.source.trim import MAX_RETENTION
from airflow_provider_lr.operators import LRReceiveQueueReportOperator, LRStaleLeaseCleanupOperator, LRTrimOperator

SITE_LABEL = "{{ task.site['site'] }}"


@dag(
    dag_id="lr_maintenance",
    schedule="@hourly",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["lr", "maintenance"],
    doc_md=__doc__,
    params={
        "retention_seconds": Param(
            None,
            type=["null", "integer"],
            # bounds the form's number field does not know: it clamps to ``minimum``/``maximum`` as
            # it loses focus, so a typed -5 was sent as 0, a retention trim of everything (still 0
            # to MAX_RETENTION: the trigger is refused, its reason shown in the form)
            exclusiveMinimum=-1,
            exclusiveMaximum=int(MAX_RETENTION) + 1,
            title="Retention (seconds)",
            description=(
                "Also trim entries older than this, even if a session lags (empty: safe trim only; "
                f"0 to {int(MAX_RETENTION)})"
            ),
        ),
        "queue_warn_after_seconds": Param(
            3600,
            type="integer",
            minimum=1,
            title="Warn after (seconds)",
            description="Warn when a receive queue's oldest message waits longer",
        ),
    },
)
def lr_maintenance() -> None:
    @task
    def sites(role: str) -> list[dict]:
        from airflow_provider_lr.operators.common import load_topology, site_dicts

        return site_dicts(load_topology(), role)

    @task
    def retention(sources: list[dict], params: dict | None = None) -> list[dict]:
        """One retention trim per source when ``retention_seconds`` is set, none otherwise."""
        seconds = (params or {}).get("retention_seconds")
        return [] if seconds is None else [{"site": s, "retention_seconds": seconds} for s in sources]

    sources = sites.override(task_id="sources")("source")
    sinks = sites.override(task_id="sinks")("sink")
    label = {"map_index_template": SITE_LABEL}  # mapped instances listed by site id, not by number
    leases = LRStaleLeaseCleanupOperator.partial(task_id="stale_lease_cleanup", **label).expand(site=sources)
    safe = LRTrimOperator.partial(task_id="safe_trim", **label).expand(site=sources)
    retained = LRTrimOperator.partial(task_id="retention_trim", **label).expand_kwargs(retention(sources))
    LRReceiveQueueReportOperator.partial(
        task_id="receive_queue_checkpoint", warn_after_seconds="{{ params.queue_warn_after_seconds }}", **label
    ).expand(site=sinks)
    leases >> safe >> retained


lr_maintenance()
