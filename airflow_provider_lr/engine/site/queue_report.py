"""What a sink's receive queues hold: ``lr status`` shows it, the maintenance checkpoint warns on it."""

from __future__ import annotations

import psycopg2.extensions

from airflow_provider_lr.engine.store import receive_queue
from airflow_provider_lr.engine.vocabulary import receive_queue_name


def receive_queues(conn: psycopg2.extensions.connection) -> list[dict]:
    """Per receive queue on this sink: entries waiting for subscribers, snapshot entries not yet
    applied, the age of the oldest waiting message, and dead letters."""
    with conn.cursor() as cur:
        rows = receive_queue.queue_report(cur)
    conn.commit()
    return [
        {
            "queue": receive_queue_name(client, source),
            "source": source,
            "client": client,
            "waiting": waiting,
            "unapplied_snapshot": unapplied,
            "oldest_waiting_s": round(age, 1),
            "dead_letters": dead,
        }
        for source, client, waiting, unapplied, age, dead in rows
    ]
