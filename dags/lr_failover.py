"""lr_failover: make a sink the source of its source's clients (docs/failover.md), by hand.

Trigger it from the UI form: the site to promote (required: one of the topology's sinks),
optionally the old source (empty: the one it receives from), the clients (empty: every client it
receives from there) and a reason. One task, ``failover``, calls the engine
(``LRFailoverOperator``): the old source's sinks are fenced, the promoted site takes over at its
position of the old stream, every other sink is reconciled to that position, and the new topology
is applied to every reachable site. The new topology is written beside the topology file the task
read, as ``topology-<id>.yaml`` (the log says where): point the Variable ``lr_topology`` at it, or
every other lr task refuses the old file from then on. Its XCom holds the new topology (and
``topology_file``) and what each sink's reconcile did. A planned switchover happens when the old
source can be reached (it is drained first). Running the DAG again with the same form finishes an
interrupted failover.

The old source, when it is back: trigger ``lr_rejoin`` with it.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import Param, dag

from airflow_provider_lr.engine.db.topology_schema import CLIENT_NAME_PATTERN, SITE_ID_PATTERN, form_pattern
from airflow_provider_lr.operators import LRFailoverOperator
from airflow_provider_lr.operators.common import form_choice, parse_time_topology, reason_param

_topology = parse_time_topology()
_sessions = _topology.sessions() if _topology else []
SINKS = sorted({k.sink for k in _sessions})
SITES = sorted(_topology.sites) if _topology else []


@dag(
    dag_id="lr_failover",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    render_template_as_native_obj=True,  # the form's values reach the operator as they are (lists, null)
    tags=["lr", "failover"],
    doc_md=__doc__,
    params={
        "promote": form_choice(
            SINKS,
            SITE_ID_PATTERN,
            required=True,
            title="Site to promote",
            description="The sink that becomes the source",
        ),
        "from_site": form_choice(
            SITES,
            SITE_ID_PATTERN,
            title="Old source",
            description="Empty: the one source the promoted site receives from",
        ),
        "clients": Param(
            None,
            type=["null", "array"],
            items={"type": "string", "pattern": form_pattern(CLIENT_NAME_PATTERN)},
            title="Clients",
            description="Empty: every client the promoted site receives from the old source",
        ),
        "reason": reason_param(
            "failover from the Airflow UI",
            description="Recorded with the full-sync requests it makes (lr status shows it)",
        ),
        "same_destinations": Param(
            False,
            type="boolean",
            title="Entries went to all sinks alike",
            description="A sink behind the promoted one gets the gap copied from it, not a full sync",
        ),
        "allow_table_divergence": Param(
            False,
            type="boolean",
            title="Allow federated tables to diverge",
            description="Promote even if the site lacks a federated table another sink "
            "takes: its replication stops (lr status marks it DIVERGED)",
        ),
    },
)
def lr_failover() -> None:
    LRFailoverOperator(
        task_id="failover",
        retries=0,
        promote="{{ params.promote }}",
        from_site="{{ params.from_site }}",
        clients="{{ params.clients }}",
        reason="{{ params.reason }}",
        same_destinations="{{ params.same_destinations }}",
        allow_table_divergence="{{ params.allow_table_divergence }}",
    )


lr_failover()
