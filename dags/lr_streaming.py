"""lr_streaming: the streaming replicator under Airflow (milliseconds from commit to the sinks).

One task, ``stream`` (``LRStreamOperator``), runs ``lr sync``'s streaming mode in a worker for
``run_for_seconds`` and ends; the ``@continuous`` schedule then starts the next run at once, so
replication never stops for longer than a task start, and every run is a fresh, restartable task
(a failed one is retried; the sinks' own positions make the seams exact).

It holds one worker slot all the time. Use it *instead of* scheduled ``lr_replication`` runs when
lag matters (both at once are safe, the leases keep them apart, but ``lr_replication`` would then
mostly find its sessions leased). ``lr_replication`` stays for batch users: it holds no slot
between runs, and its lag is its schedule interval. Paused when created: unpause it to stream.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, dag

from airflow_provider_lr.operators.stream import LRStreamOperator


@dag(
    dag_id="lr_streaming",
    schedule="@continuous",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=True,
    render_template_as_native_obj=True,
    tags=["lr", "replication", "streaming"],
    doc_md=__doc__,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=10)},
    params={
        "run_for_seconds": Param(
            600,
            type="integer",
            minimum=1,
            title="Run for (seconds)",
            description="How long one run streams before it ends and the next run starts",
        ),
        "source": Param(
            None,
            type=["null", "string"],
            title="Source",
            description="Only this source's sessions (empty: every session of the topology)",
        ),
        "report_every_seconds": Param(
            30,
            type="integer",
            minimum=0,
            title="Progress line every (seconds)",
            description="A line in the task log with entries/s and the lag of the "
            "session most behind, this often (0: none)",
        ),
    },
)
def lr_streaming() -> None:
    LRStreamOperator(
        task_id="stream",
        run_for="{{ params.run_for_seconds }}",
        source="{{ params.source }}",
        report_every="{{ params.report_every_seconds }}",
    )


lr_streaming()
