"""lr_full_sync: force a snapshot (full) sync of chosen sessions, and see it applied.

Trigger it from the UI form: optionally a sink, a client and a source (each empty: every one; all
empty: every session of the topology, CorfuDB's global forced snapshot sync), and a reason. The
form is validated server-side (the enums come from the topology this file was parsed with:
``$LR_TOPOLOGY`` or the shipped one), and the first task checks the choice again against the
topology the run uses, and that file against the topology the sites run (a stale file fails the
run, named). It records a forced full-sync request per session (its log lists them) and hands the
request ids on.

Then, per session (every mapped instance is listed by its session's name), ``snapshot_sync`` sees
ITS request applied at the sink, by whichever replicator: when nobody holds the session's lease
it carries the sync out itself (waiting, deferred, for the client's data when its provider is not
in the topology); while another replicator holds it (``lr_streaming``, ``lr sync``, an
``lr_replication`` run) it waits, deferred, for that replicator to apply the request (and takes
over if the lease is let go first), instead of failing. A log-entry catch-up follows. ``check`` is
the run's verdict, per session, from each request's outcome on its source (applied; or timed out,
cancelled, with the reason) and the session tasks' states (the catch-up runs anyway and does
nothing while its session still needs the full sync, so it too is listed by name rather than left
``upstream_failed``).

A transfer of at least ``snapshot_spark_min_entries`` entries goes through
``spark_snapshot_transfer`` (``spark_jobs/lr_snapshot_transfer.py``) when this worker can run
Spark, before the catch-up.

Federated tables are part of the full sync: it forgets the session's tables on the sink, and the
catch-up snapshots them again, in the step, or, for a snapshot the engine deems large
(``table_spark_min_rows``) when this worker can run Spark (``LR_SPARK_CONN_ID``), through
``spark_table_snapshot`` (``spark_jobs/lr_table_snapshot.py``), once per source and client.

Empty optional fields mean "all": they are ``null`` in the run's conf and show as an empty select
box in the form (``values_display`` maps ``null`` to an empty label; without it Airflow's form
shows the word ``null``).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import TriggerRule, dag, get_current_context, task

from airflow_provider_lr.engine.db.topology_schema import CLIENT_NAME_PATTERN, SITE_ID_PATTERN
from airflow_provider_lr.operators import LRLogEntrySyncOperator, LRRunCheckOperator, LRSnapshotSyncOperator
from airflow_provider_lr.operators.common import form_choice, parse_time_topology, reason_param, refusals_final
from airflow_provider_lr.operators.session import SESSION_LABEL
from airflow_provider_lr.operators.spark import LRSparkSnapshotTransferOperator, LRSparkTableSnapshotOperator

SPARK_CONN_ID = os.environ.get("LR_SPARK_CONN_ID", "spark_default")

_topology = parse_time_topology()
_sessions = _topology.sessions() if _topology else []
SINKS = sorted({k.sink for k in _sessions})
SOURCES = sorted({k.source for k in _sessions})
CLIENTS = sorted({k.client for k in _sessions})


@dag(
    dag_id="lr_full_sync",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=20)},  # a site restarting (a held lease is waited for)
    tags=["lr", "replication"],
    doc_md=__doc__,
    params={
        "sink": form_choice(
            SINKS,
            SITE_ID_PATTERN,
            title="Sink site",
            description="The destination that gets everything again (empty: every sink)",
        ),
        "client": form_choice(
            CLIENTS,
            CLIENT_NAME_PATTERN,
            title="Client",
            description="Only this client's sessions (empty: every client)",
        ),
        "source": form_choice(
            SOURCES,
            SITE_ID_PATTERN,
            title="Source site",
            description="Only from this source (empty: every source)",
        ),
        "reason": reason_param(
            "requested from the Airflow UI",
            description="Recorded with the request on the source (lr status shows it)",
        ),
    },
)
def lr_full_sync() -> None:
    @task(retry_policy=refusals_final())  # a choice or a file the sites do not run: one ERROR line, no retry
    def request_full_sync() -> list[dict]:
        """Check the form against the run's topology and that topology against the sites, then
        record a forced request per session; the sessions, each with its ``request_id``."""
        from airflow_provider_lr.engine.errors import ConfigurationError, one_line
        from airflow_provider_lr.engine.source import full_sync
        from airflow_provider_lr.operators.common import (
            check_topology,
            connect_site,
            load_topology,
            refuse,
            session_dict,
        )

        context = get_current_context()
        log, params = context["ti"].task.log, context["params"]  # the task's own log, as an operator's
        topo = load_topology()
        try:
            keys = topo.select(params.get("source") or None, params.get("sink") or None, params.get("client") or None)
        except ConfigurationError as exc:
            raise refuse(log, "lr full sync", one_line(exc)) from None
        check_topology(topo, log, "lr full sync", {site for k in keys for site in (k.source, k.sink)})
        requests = full_sync.request_for_sessions(keys, lambda site: connect_site(topo, site), params["reason"])
        for key, request in requests.items():
            print(f"{key}: full sync requested ({request.request_id})")
        return [{**session_dict(topo, key), "request_id": request.request_id} for key, request in requests.items()]

    sessions = request_full_sync()
    snapshot = LRSnapshotSyncOperator.partial(
        task_id="snapshot_sync", wait_for_data=True, map_index_template=SESSION_LABEL, spark_conn_id=SPARK_CONN_ID
    ).expand(session=sessions)

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def snapshot_transfers(sessions: list[dict]) -> list[dict]:
        """The sessions whose snapshot step left a large full-sync transfer to Spark."""
        from airflow_provider_lr.operators.spark import transfers_left_to_spark

        return transfers_left_to_spark(get_current_context()["ti"], sessions, "snapshot_sync")

    moves = snapshot_transfers(sessions)
    transfers = LRSparkSnapshotTransferOperator.partial(
        task_id="spark_snapshot_transfer",
        conn_id=SPARK_CONN_ID,
        conf={"spark.ui.enabled": "false"},
        map_index_template="{{ task.source }}->{{ task.sink }}/{{ task.client }}",
    ).expand_kwargs(moves)
    # all_done: runs (negotiates, does nothing while the session still needs its full sync) and is
    # labelled by its session even when that session's full sync failed
    catch_up = LRLogEntrySyncOperator.partial(
        task_id="log_entry_sync",
        map_index_template=SESSION_LABEL,
        trigger_rule=TriggerRule.ALL_DONE,
        spark_conn_id=SPARK_CONN_ID,
    ).expand(session=sessions)

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def table_snapshots(sessions: list[dict]) -> list[dict]:
        """The (source, client) pairs whose catch-up left a large table snapshot to Spark."""
        from airflow_provider_lr.operators.spark import tables_left_to_spark

        return tables_left_to_spark(get_current_context()["ti"], sessions, "log_entry_sync")

    pairs = table_snapshots(sessions)
    tables = LRSparkTableSnapshotOperator.partial(
        task_id="spark_table_snapshot",
        conn_id=SPARK_CONN_ID,
        conf={"spark.ui.enabled": "false"},
        map_index_template="{{ task.source }}/{{ task.client }}",
    ).expand_kwargs(pairs)
    snapshot >> moves >> transfers >> catch_up >> pairs
    [catch_up, tables, transfers] >> LRRunCheckOperator(
        task_id="check",
        sessions=sessions,
        session_tasks=("snapshot_sync", "log_entry_sync"),
        retries=0,
        full_sync_requests=True,
    )


lr_full_sync()
