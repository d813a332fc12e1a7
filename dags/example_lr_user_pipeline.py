"""example_lr_user_pipeline: a user's own pipeline that transmits and waits for delivery.

1. ``record_orders`` writes orders into the application's table on the source site and, in the
   same transaction, transmits one payload per order to the client's sinks (all or nothing);
   it returns the transaction's commit position (small XCom).
2. ``push_now`` reuses lr's operators to deliver the source's sessions right away instead of
   waiting for the next ``lr_replication`` run (harmless if that runs too: sessions are leased).
3. ``delivered`` (deferrable: no worker slot while it waits) holds the pipeline until the orders
   are safe on the destinations *and* durable in ``min_regions`` distinct regions.
4. ``announce`` runs only then.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from airflow.sdk import Param, dag, get_current_context, task

from airflow_provider_lr.operators import LRDiscoverSessionsOperator, LRLogEntrySyncOperator
from airflow_provider_lr.operators.common import parse_time_topology
from airflow_provider_lr.operators.session import SESSION_LABEL
from airflow_provider_lr.sensors import LRDeliveredSensor

SOURCE = os.environ.get("LR_EXAMPLE_SOURCE", "site-a")
CLIENT = os.environ.get("LR_EXAMPLE_CLIENT", "policy")
_topology = parse_time_topology()
SINKS = sorted({k.sink for k in _topology.sessions(source=SOURCE) if k.client == CLIENT}) if _topology else []


@dag(
    dag_id="example_lr_user_pipeline",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    render_template_as_native_obj=True,
    tags=["lr", "example"],
    doc_md=__doc__,
    params={
        "orders": Param(
            3,
            type="integer",
            minimum=1,
            maximum=10_000,
            title="Orders to record",
            description=f"Rows written to example_orders at {SOURCE}, one payload each, in one transaction",
        ),
        "destinations": Param(
            SINKS,
            type="array",
            items={"type": "string"},
            title="Destinations",
            description=f"Sinks of {SOURCE} for client {CLIENT} that must have the orders",
        ),
        "min_regions": Param(
            2,
            type="integer",
            minimum=1,
            title="Durable in at least this many regions",
            description="The announce waits until the orders are stored in this many distinct regions, the source's too",
        ),
    },
)
def example_lr_user_pipeline() -> None:
    @task
    def record_orders() -> dict:
        from contextlib import closing

        from airflow_provider_lr.client import RoutingQueueClient
        from airflow_provider_lr.hooks.site import LRSiteHook
        from airflow_provider_lr.operators.common import load_topology

        params = get_current_context()["params"]
        # the application's own connection (its search_path, no lr timeouts), checked to be SOURCE
        with closing(LRSiteHook(lr_conn_id=load_topology().conn_id(SOURCE)).connect_site(SOURCE)) as conn:
            with conn.cursor() as cur:
                cur.execute(
                    "CREATE TABLE IF NOT EXISTS example_orders "
                    "(id bigserial PRIMARY KEY, amount_cents bigint NOT NULL, at timestamptz DEFAULT now())"
                )
            conn.commit()
            client = RoutingQueueClient(conn, CLIENT)
            with conn.cursor() as cur:
                for i in range(params["orders"]):
                    cur.execute("INSERT INTO example_orders (amount_cents) VALUES (%s) RETURNING id", (100 * (i + 1),))
                    order_id = cur.fetchone()[0]
                    ticket = client.transmit_log_entry_message(
                        f"order {order_id} {100 * (i + 1)}".encode(), params["destinations"]
                    )
            conn.commit()  # the orders and their payloads, together
            position = client.delivery(ticket).position  # drawn at commit: after it, not before
        return {"orders": params["orders"], "position": position}

    @task
    def announce(recorded: dict) -> str:
        return f"{recorded['orders']} order(s) at position {recorded['position']} are replicated"

    recorded = record_orders()
    sessions = LRDiscoverSessionsOperator(task_id="sessions", source=SOURCE, client=CLIENT)
    # listed by session in the grid (site-a->site-b/policy), not by number
    push = LRLogEntrySyncOperator.partial(task_id="push_now", map_index_template=SESSION_LABEL).expand(
        session=sessions.output
    )
    delivered = LRDeliveredSensor(
        task_id="delivered",
        source=SOURCE,
        client=CLIENT,
        position=recorded["position"],
        destinations="{{ params.destinations }}",
        min_regions="{{ params.min_regions }}",
        timeout=3600,
        poll_interval=1.0,
    )
    recorded >> sessions
    push >> delivered >> announce(recorded)


example_lr_user_pipeline()
