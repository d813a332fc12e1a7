"""What a writer role writes with its own SQL is bounded by the database, whatever it writes: the
replicator that serves every client of the source reads it (docs/security.md, V0034 for messages).

Before V0046 a writer of one client stored an entry of 20 million tags in 1 MB (an array of one value
compresses); each read of it by a session it did not tag took 1.4 s of the source's server, and the
stream's routed read is one statement for every client of the source. It wrote a request's base
snapshot and note, which the replicator reads whole at every cycle, and a guard's destinations, of
any size up to 1 GB."""

from __future__ import annotations

import psycopg2.errors
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.db.topology_schema import MAX_SITES
from airflow_provider_lr.engine.errors import DeliveryTimeout
from airflow_provider_lr.engine.source import full_sync
from tests.engine.site.test_roles import connect_as, made  # noqa: F401 (fixture)
from tests.support.session import apply

BOUNDED = psycopg2.errors.CheckViolation


def test_a_writer_cannot_store_what_every_reader_of_its_source_would_carry(lr_sites, made):
    source = lr_sites[0]
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["alpha"]}])
    writer = made.name("w_alpha")
    made.grant(source, "writer", writer, ["alpha"])
    admin = source.connect()
    full_sync.request_full_sync(admin, "site-b", "alpha", "test", forced=True)
    admin.close()
    conn = connect_as(source, writer)
    refused = {
        "log_entries_tags_bounded": (
            "INSERT INTO lr.log_entries (stream, tag_ids, client_id, message) SELECT 1, "
            f"array_fill(1, ARRAY[{MAX_SITES + 1}]), client_id, '\\x00' FROM lr.clients WHERE client_name = 'alpha'"
        ),
        "full_sync_requests_bounded": (
            "UPDATE lr.full_sync_requests SET status = 'supplied', base_position = 0, base_upto = 0, "
            "base_snapshot = '1:1:' || repeat(' ', 16777216) WHERE client_name = 'alpha' AND status = 'pending'",
            "UPDATE lr.full_sync_requests SET note = repeat('x', 65537) WHERE client_name = 'alpha'",
        ),
        "delivery_guards_bounded": (
            "INSERT INTO lr.delivery_guards (guard_id, client_name, position, destinations, expires_at) "
            f"VALUES (gen_random_uuid(), 'alpha', 1, array_fill('site-b'::text, ARRAY[{MAX_SITES + 1}]), now())"
        ),
    }
    for constraint, statements in refused.items():
        for statement in (statements,) if isinstance(statements, str) else statements:
            try:
                with conn.cursor() as cur, pytest.raises(BOUNDED, match=constraint):
                    cur.execute(statement)
            finally:
                conn.rollback()
    # what lr writes for the writer stays well inside: a transmit, a supply, a wait on a guard
    client = RoutingQueueClient(conn, "alpha")
    ticket = client.transmit_log_entry_message(b"x", ["site-b", "site-c"])
    conn.commit()
    assert len(client.serve_full_sync_requests(lambda ctx: ctx.transmit(b"state"))) == 1
    with pytest.raises(DeliveryTimeout):  # its guard is written and removed
        client.wait_until_safe(ticket, timeout=0.2)
    conn.close()
    assert source.query("SELECT count(*) FROM lr.log_entries WHERE stream = 1") == [(1,)]
