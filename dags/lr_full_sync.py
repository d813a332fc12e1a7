"""lr_full_sync: force a snapshot (full) sync of the sessions to one sink, and carry it out.

Trigger it from the UI form: pick the sink (the topology's sinks), optionally a client and a
source, and give a reason. The form is validated server-side (the enums come from the topology
this file was parsed with: ``$LR_TOPOLOGY`` or the shipped one), and the first task checks the
choice again against the topology the run uses. Then for every matching session: a forced
full-sync request on its source, the snapshot sync (waiting, deferred, for the client's data when
its provider is not in the topology), and a log-entry catch-up after it; every mapped instance is
listed by its session's name. ``check`` is the run's verdict: the run fails when any session's
full sync or catch-up failed (the catch-up runs anyway and does nothing while its session still
needs the full sync, so it too is listed by name rather than left ``upstream_failed``).

A transfer of at least ``snapshot_spark_min_entries`` entries goes through
``spark_snapshot_transfer`` (``spark_jobs/lr_snapshot_transfer.py``) when this worker can run
Spark, before the catch-up.

Federated tables are part of the full sync: it forgets the session's tables on the sink, and the
catch-up snapshots them again, in the step, or, for a snapshot the engine deems large
(``table_spark_min_rows``) when this worker can run Spark (``LR_SPARK_CONN_ID``), through
``spark_table_snapshot`` (``spark_jobs/lr_table_snapshot.py``), once per source and client.

Empty optional fields (client, source) mean "all": they are ``null`` in the run's conf and show as
an empty select box in the form (``values_display`` maps ``null`` to an empty label; without it
Airflow's form shows the word ``null``).
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, TriggerRule, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_lr.engine.site.topology_schema import CLIENT_NAME_PATTERN, SITE_ID_PATTERN
from airflow_provider_lr.operators import LRLogEntrySyncOperator, LRRunCheckOperator, LRSnapshotSyncOperator
from airflow_provider_lr.operators.common import parse_time_topology
from airflow_provider_lr.operators.session import SESSION_LABEL
from airflow_provider_lr.operators.spark import LRSparkSnapshotTransferOperator, LRSparkTableSnapshotOperator

SPARK_CONN_ID = os.environ.get("LR_SPARK_CONN_ID", "spark_default")

_topology = parse_time_topology()
_sessions = _topology.sessions() if _topology else []
SINKS = sorted({k.sink for k in _sessions})
SOURCES = sorted({k.source for k in _sessions})
CLIENTS = sorted({k.client for k in _sessions})


def _choice(values: list[str], pattern: str, **schema: object) -> Param:
    """A required pick from ``values`` (a select box), or a validated text field without a topology."""
    if values:
        return Param(type="string", enum=values, **schema)
    return Param(type="string", pattern=pattern, **schema)


def _optional_choice(values: list[str], pattern: str, **schema: object) -> Param:
    """An optional pick: empty (``null``: every one) or one of ``values``. The form's select box
    labels ``null`` from ``values_display``; an empty label keeps it empty, not the word "null"."""
    if values:
        return Param(None, type=["null", "string"], enum=[None, *values], values_display={"null": ""}, **schema)
    return Param(None, type=["null", "string"], pattern=pattern, **schema)


@dag(
    dag_id="lr_full_sync",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=20)},  # e.g. lr_replication holds the lease
    tags=["lr", "replication"],
    doc_md=__doc__,
    params={
        "sink": _choice(SINKS, f"^{SITE_ID_PATTERN.pattern}$", title="Sink site",
                        description="The destination that gets everything again"),
        "client": _optional_choice(CLIENTS, f"^{CLIENT_NAME_PATTERN.pattern}$", title="Client",
                                   description="Only this client's session (empty: every client replicating to the sink)"),
        "source": _optional_choice(SOURCES, f"^{SITE_ID_PATTERN.pattern}$", title="Source site",
                                   description="Only from this source (empty: every source replicating to the sink)"),
        "reason": Param("requested from the Airflow UI", type="string", minLength=1, maxLength=500, title="Reason",
                        description="Recorded with the request on the source (lr status shows it)"),
    },
)
def lr_full_sync() -> None:
    @task
    def request_full_sync() -> list[dict]:
        """Check the form against the run's topology, then record a forced request per session."""
        from airflow_provider_lr.engine.source import full_sync
        from airflow_provider_lr.operators.common import load_topology, session_dicts, site_connection

        params = get_current_context()["params"]
        topo = load_topology()
        sessions = session_dicts(topo, params.get("source") or None, params["sink"], params.get("client") or None)
        if not sessions:
            known = [str(k) for k in topo.sessions()]
            raise AirflowFailException(
                f"no session replicates to {params['sink']!r}"
                + (f" for client {params['client']!r}" if params.get("client") else "")
                + (f" from {params['source']!r}" if params.get("source") else "")
                + f"; the topology's sessions are {known}"
            )
        for session in sessions:
            with site_connection(session["source_conn_id"], session["source"]) as conn:
                request = full_sync.request_full_sync(
                    conn, session["sink"], session["client"], params["reason"], forced=True
                )
            session["request_id"] = request.request_id
        return sessions

    sessions = request_full_sync()
    snapshot = LRSnapshotSyncOperator.partial(
        task_id="snapshot_sync", wait_for_data=True, map_index_template=SESSION_LABEL, spark_conn_id=SPARK_CONN_ID,
    ).expand(session=sessions)

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def snapshot_transfers(sessions: list[dict]) -> list[dict]:
        """The sessions whose snapshot step left a large full-sync transfer to Spark."""
        from airflow_provider_lr.operators.spark import transfers_left_to_spark

        return transfers_left_to_spark(get_current_context()["ti"], sessions, "snapshot_sync")

    moves = snapshot_transfers(sessions)
    transfers = LRSparkSnapshotTransferOperator.partial(
        task_id="spark_snapshot_transfer", conn_id=SPARK_CONN_ID, conf={"spark.ui.enabled": "false"},
        map_index_template="{{ task.source }}->{{ task.sink }}/{{ task.client }}",
    ).expand_kwargs(moves)
    # all_done: runs (negotiates, does nothing while the session still needs its full sync) and is
    # labelled by its session even when that session's full sync failed
    catch_up = LRLogEntrySyncOperator.partial(
        task_id="log_entry_sync", map_index_template=SESSION_LABEL, trigger_rule=TriggerRule.ALL_DONE,
        spark_conn_id=SPARK_CONN_ID,
    ).expand(session=sessions)

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def table_snapshots(sessions: list[dict]) -> list[dict]:
        """The (source, client) pairs whose catch-up left a large table snapshot to Spark."""
        from airflow_provider_lr.operators.spark import tables_left_to_spark

        return tables_left_to_spark(get_current_context()["ti"], sessions, "log_entry_sync")

    pairs = table_snapshots(sessions)
    tables = LRSparkTableSnapshotOperator.partial(
        task_id="spark_table_snapshot", conn_id=SPARK_CONN_ID, conf={"spark.ui.enabled": "false"},
        map_index_template="{{ task.source }}/{{ task.client }}",
    ).expand_kwargs(pairs)
    snapshot >> moves >> transfers >> catch_up >> pairs
    [catch_up, tables, transfers] >> LRRunCheckOperator(
        task_id="check", sessions=sessions, session_tasks=("snapshot_sync", "log_entry_sync"), retries=0,
    )


lr_full_sync()
