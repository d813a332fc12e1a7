"""Whether a client is one of tables only at a source: it opened a federated table there (captured
now or closed since), so without a full-sync provider its full syncs carry no payloads
(``registry.no_queue_data``) and its tables follow by their own snapshots."""

from __future__ import annotations

import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.source import closed_tables
from airflow_provider_lr.engine.tables import closed_notes


def opened_here(conn: psycopg2.extensions.connection, client: str) -> bool:
    """Whether this source opened a table as federated for ``client``, captured now or closed since:
    such a client without a full-sync provider is one of tables only (``no_queue_data``). Before,
    only captured tables counted, so once its tables were closed every full sync of the client
    waited for a provider's data that never came. A sink's copy federated onward from here (its row
    names the copy's origin, and this site's ``table_id``), or closed since, counts too: before,
    its client's full syncs waited for a provider's data forever and the table's changes here never
    left."""
    idle = conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    with conn.cursor() as cur:
        cur.execute(
            "SELECT EXISTS (SELECT 1 FROM lr.registry WHERE kind = 'table' AND is_federated AND client_name = %s "
            "AND (source_site_id IS NULL OR table_id IS NOT NULL"
            + (
                " OR " + closed_notes.CLOSED_ONWARD
                if schema.at_least(conn, closed_tables.CLOSED_TABLE_ID_SCHEMA)
                else ""
            )
            + "))",
            (client,),
        )
        found = bool(cur.fetchone()[0])
    if idle:
        conn.rollback()
    return found
