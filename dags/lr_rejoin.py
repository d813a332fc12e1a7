"""lr_rejoin: a site a failover could not reach (the old source, when it is back) takes the
failover's topology (docs/failover.md, ``lr failover --rejoin``).

Trigger it from the UI form with the site to rejoin (required). One task, ``rejoin``
(``LRFailoverOperator(rejoin=...)``): the newest failover recorded on a reachable site gives the
topology; on the old source, its sessions of the failed-over clients are retired and what it
committed after the cut (received by nobody) is counted in the task's XCom.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import dag

from airflow_provider_lr.engine.db.topology_schema import SITE_ID_PATTERN
from airflow_provider_lr.operators import LRFailoverOperator
from airflow_provider_lr.operators.common import form_choice, parse_time_topology

_topology = parse_time_topology()
SITES = sorted(_topology.sites) if _topology else []


@dag(
    dag_id="lr_rejoin",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["lr", "failover"],
    doc_md=__doc__,
    params={
        "site": form_choice(
            SITES,
            SITE_ID_PATTERN,
            required=True,
            title="Site to rejoin",
            description="The old source (or another site the failover could not reach)",
        )
    },
)
def lr_rejoin() -> None:
    LRFailoverOperator(task_id="rejoin", retries=0, rejoin="{{ params.site }}")


lr_rejoin()
