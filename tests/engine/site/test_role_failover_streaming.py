"""A writer role (least privilege, docs/security.md) after a planned switchover: granted at the site
that becomes the source, it transmits there while `lr sync` streams from it, and its waits read its
sessions there (V0048's row-level security, V0051's lr.session_backlogs)."""

from __future__ import annotations

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.site import failover
from tests.engine.site.test_failover import _connect
from tests.engine.site.test_roles import connect_as, made  # noqa: F401
from tests.guarantees.test_table_fidelity_streaming import FAST
from tests.support.session import Streaming, apply, empty_provider, queue, replicator

PROVIDERS = {"policy": empty_provider}


def test_a_writer_granted_at_the_promoted_site_transmits_there_and_its_waits_see_the_new_sessions(lr_sites, made):
    site_a, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    writer = made.name("w_policy")
    made.grant(site_a, "writer", writer, ["policy"])
    conn = connect_as(site_a, writer)
    client = RoutingQueueClient(conn, "policy")
    with Streaming(replicator(topo, lr_sites, providers=PROVIDERS, lease_seconds=2.0), FAST) as streaming:
        streaming.streaming()  # first contact made: what the writer sends now travels as log entries
        client.transmit_log_entry_message(b"before", ["site-b", "site-c"])
        conn.commit()
        assert [r.ready for r in client.wait_until_ready(["site-b", "site-c"], timeout=20)] == [True, True]
    conn.close()
    result = failover.promote(failover.FailoverRequest("site-a", "site-b", planned=True), _connect(lr_sites))
    made.grant(site_b, "writer", writer, ["policy"])
    conn = connect_as(site_b, writer)
    client = RoutingQueueClient(conn, "policy")
    ticket = client.transmit_log_entry_message(b"after", ["site-c"])
    conn.commit()
    with Streaming(replicator(result.topology, lr_sites, providers=PROVIDERS, lease_seconds=2.0), FAST):
        client.wait_until_safe(ticket, destinations=["site-c"], timeout=30)
        assert [r.ready for r in client.wait_until_ready(["site-c"], timeout=20)] == [True]
    conn.close()
    logs = [p for k, p in queue(site_c, None) if k == "log"]
    assert logs.count("before") == 1 and logs.count("after") == 1, logs
