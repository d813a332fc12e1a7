"""lr_replication: replicate every session of the topology, one mapped task group per session.

Each run: discover the sessions (from the topology: Variable ``lr_topology``, ``$LR_TOPOLOGY`` or
the shipped ``include/topology.yaml``), plan per source whether its backlog goes through Spark
(``spark_min_backlog``) or the read-once tee in the worker (``tee_min_backlog``), run those
fan-outs, then one task group per session:

    decide (negotiation) ─┬─ snapshot_sync   (skips itself unless chosen) ─┬─ report (all_done)
                          └─ log_entry_sync  (skips itself unless chosen) ─┘
    ... every session's group ──→ table_snapshots ──→ spark_table_snapshot (one per source/client)
                              ──→ snapshot_transfers ──→ spark_snapshot_transfer (one per session)
                              ──→ check (all_done: the run's verdict)

Full syncs: a session's ``snapshot_sync`` transfers the client's supplied data in the step, except
a transfer of at least ``snapshot_spark_min_entries`` entries when this worker can run Spark: it
is left to ``spark_snapshot_transfer`` (``spark_jobs/lr_snapshot_transfer.py``: ranges staged in
parallel, one server-side move, then the apply); the next run catches the session up.

Federated tables: a session's ``log_entry_sync`` snapshots the tables its sink lacks in the step,
except a snapshot the engine deems large (``table_spark_min_rows``), which it leaves to Spark when
this worker can run the job (``LR_SPARK_CONN_ID`` defined). ``table_snapshots`` (all_done) collects
the (source, client) pairs whose sessions left tables to Spark, and ``spark_table_snapshot`` runs
``spark_jobs/lr_table_snapshot.py`` once per pair for all its sinks (none: skipped).

``@task.branch`` inside a mapped task group runs both branches in Airflow 3.3.2 (#67265), hence
the skip-in-branch pattern; the branches are ``all_done`` too, so when ``decide`` fails they run,
skip and carry the session's label instead of ending ``upstream_failed`` as bare numbers. A
session's failure (a sink that is down, a fenced replicator, a refused negotiation) fails only its
own group and is recorded in its ``last_error`` (``lr status``); the other sessions deliver, then
``check`` fails the run naming the failed sessions, so the run and the DAG list show red; the
next run retries them. The join is ``all_done``, not ``none_failed_min_one_success``: with the latter, one
failed index marked the *unexpanded* join ``upstream_failed`` for every session in 3.3.2 (the
per-index trigger-rule regression, apache/airflow#68417), hiding the healthy sessions' reports. Scheduled on a short interval with one active
run rather than ``@continuous``: a run ends only when every session's group ends, so an idle
gate in a continuous run would hold busy sessions back, while a short interval bounds both the
idle cost and the latency (``LR_REPLICATION_INTERVAL_S``, default 30 s). A snapshot waiting for
its client's data does not hold the run: the next run picks it up.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import TriggerRule, dag, get_current_context, task, task_group

from airflow_provider_lr.operators import (
    LRDiscoverSessionsOperator,
    LRLogEntrySyncOperator,
    LRNegotiateOperator,
    LRRunCheckOperator,
    LRSnapshotSyncOperator,
)
from airflow_provider_lr.operators.fanout import LRFanOutOperator
from airflow_provider_lr.operators.session import SESSION_LABEL
from airflow_provider_lr.operators.spark import (
    LRSparkFanOutOperator,
    LRSparkSnapshotTransferOperator,
    LRSparkTableSnapshotOperator,
)

INTERVAL = timedelta(seconds=float(os.environ.get("LR_REPLICATION_INTERVAL_S", "30")))
SPARK_CONN_ID = os.environ.get("LR_SPARK_CONN_ID", "spark_default")
SOURCE_LABEL = "{{ task.source }}"  # tasks mapped over sources: listed by the source's site id
PAIR_LABEL = "{{ task.source }}/{{ task.client }}"  # tasks mapped over (source, client) pairs
TRANSFER_LABEL = "{{ task.source }}->{{ task.sink }}/{{ task.client }}"  # tasks mapped over sessions' transfers


@dag(
    dag_id="lr_replication",
    schedule=INTERVAL,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=1),
    default_args={"retries": 0},
    tags=["lr", "replication"],
    doc_md=__doc__,
)
def lr_replication() -> None:
    sessions = LRDiscoverSessionsOperator(task_id="discover_sessions")

    @task
    def sources(sessions: list[dict]) -> list[dict]:
        """The distinct sources of the sessions, as site dicts."""
        found = {s["source"]: {"site": s["source"], "conn_id": s["source_conn_id"]} for s in sessions}
        return [found[k] for k in sorted(found)]

    @task(map_index_template="{{ lr_source }}")
    def plan(site: dict) -> dict:
        """Per source: Spark for a large backlog, in-process otherwise."""
        from airflow_provider_lr.operators.spark import plan_fanout

        get_current_context()["lr_source"] = site["site"]  # type: ignore[typeddict-unknown-key]
        return plan_fanout(site, SPARK_CONN_ID)

    @task
    def spark_sources(plans: list[dict]) -> list[str]:
        from airflow_provider_lr.engine.session.catchup import CatchupPath

        return [p["source"] for p in plans if p["path"] == CatchupPath.SPARK.value]

    @task
    def tee_sources(plans: list[dict]) -> list[str]:
        from airflow_provider_lr.engine.session.catchup import CatchupPath

        return [p["source"] for p in plans if p["path"] == CatchupPath.TEE.value]

    plans = plan.expand(site=sources(sessions.output))
    fanout = LRSparkFanOutOperator.partial(
        task_id="spark_fanout",
        conn_id=SPARK_CONN_ID,
        conf={"spark.ui.enabled": "false"},
        execution_timeout=timedelta(minutes=30),  # a stuck job must not hold the one active run
        map_index_template=SOURCE_LABEL,
    ).expand(source=spark_sources(plans))
    tee = LRFanOutOperator.partial(
        task_id="inprocess_fanout", execution_timeout=timedelta(minutes=30), map_index_template=SOURCE_LABEL
    ).expand(source=tee_sources(plans))

    @task(trigger_rule=TriggerRule.ALL_DONE, map_index_template="{{ lr_session }}")
    def report(session: dict) -> dict:
        """The session's state as its source records it (state lives in PostgreSQL, not XCom)."""
        from airflow_provider_lr.engine.site import status
        from airflow_provider_lr.operators import telemetry
        from airflow_provider_lr.operators.common import site_connection

        get_current_context()["lr_session"] = session["session"]  # type: ignore[typeddict-unknown-key]
        with site_connection(session["source_conn_id"], session["source"]) as conn:
            rows = status.site_status(conn, session["source"]).sessions
        row = next(
            r
            for r in rows
            if r["role"] == "source" and r["sink_site_id"] == session["sink"] and r["client_name"] == session["client"]
        )
        telemetry.session_step(
            session, lag_entries=row["remaining_entries_to_send"], lag_seconds=row.get("lag_seconds")
        )
        return {
            "session": session["session"],
            "state": row["state"],
            "acked": row["last_applied_position"],
            "remaining": row["remaining_entries_to_send"],
            "lag_seconds": row.get("lag_seconds"),
            "last_error": row["last_error"],
        }

    @task_group(group_id="session")
    def replicate(session: dict) -> None:
        # all_done: a failed or skipped fan-out (Spark or in-process) must not stop the sessions (they catch up
        # here); the branches run (and skip themselves) even when decide failed, so no instance of the group
        # ends upstream_failed, the one state whose instances the grid cannot label (they never run)
        common = {"map_index_template": SESSION_LABEL, "trigger_rule": TriggerRule.ALL_DONE}
        decide = LRNegotiateOperator(task_id="decide", session=session, **common)
        snapshot = LRSnapshotSyncOperator(
            task_id="snapshot_sync", session=session, decision=decide.output, spark_conn_id=SPARK_CONN_ID, **common
        )
        log_entries = LRLogEntrySyncOperator(
            task_id="log_entry_sync", session=session, decision=decide.output, spark_conn_id=SPARK_CONN_ID, **common
        )
        decide >> [snapshot, log_entries] >> report(session)

    groups = replicate.expand(session=sessions.output)
    [fanout, tee] >> groups

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def table_snapshots(sessions: list[dict]) -> list[dict]:
        """The (source, client) pairs whose sessions left a large table snapshot to Spark."""
        from airflow_provider_lr.operators.spark import tables_left_to_spark

        return tables_left_to_spark(get_current_context()["ti"], sessions, "session.log_entry_sync")

    pairs = table_snapshots(sessions.output)
    tables = LRSparkTableSnapshotOperator.partial(
        task_id="spark_table_snapshot",
        conn_id=SPARK_CONN_ID,
        conf={"spark.ui.enabled": "false"},
        execution_timeout=timedelta(minutes=30),
        map_index_template=PAIR_LABEL,
    ).expand_kwargs(pairs)
    groups >> pairs

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def snapshot_transfers(sessions: list[dict]) -> list[dict]:
        """The sessions whose snapshot step left a large full-sync transfer to Spark."""
        from airflow_provider_lr.operators.spark import transfers_left_to_spark

        return transfers_left_to_spark(get_current_context()["ti"], sessions, "session.snapshot_sync")

    moves = snapshot_transfers(sessions.output)
    transfers = LRSparkSnapshotTransferOperator.partial(
        task_id="spark_snapshot_transfer",
        conn_id=SPARK_CONN_ID,
        conf={"spark.ui.enabled": "false"},
        execution_timeout=timedelta(minutes=30),
        map_index_template=TRANSFER_LABEL,
    ).expand_kwargs(moves)
    groups >> moves
    # the run's verdict: failed when any session failed, after every healthy session delivered
    [groups, tables, transfers] >> LRRunCheckOperator(
        task_id="check", sessions=sessions.output, report_task_id="session.report", retries=0
    )


lr_replication()
