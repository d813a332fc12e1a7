"""A writer's waits at the sinks (``wait_until_safe``, ``wait_until_ready``: docs/delivery.md) on a transaction
that changes a federated table, with ``lr sync``'s default streaming mode carrying it: when it returns,
every sink it named holds the change, the table's too, even for a table opened a moment before,
whose sinks take its snapshot first; and it never waits past its timeout."""

from __future__ import annotations

import time

import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.source.delivery import DeliveryTimeout
from tests.support.session import Streaming, apply, replicator
from tests.support.tables import create_accounts, federate


def test_the_waits_on_a_change_of_a_table_opened_while_streaming_return_once_every_sink_holds_it(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=3)
    federate(source)
    # lr sync's own checks (a table federated is noticed within check_interval)
    with Streaming(replicator(topo, lr_sites, lease_seconds=4.0), StreamSettings(retry_min=0.1)) as streaming:
        streaming.streaming()
        conn = source.connect()
        client = RoutingQueueClient(conn, "policy")
        for n in range(2):  # opened while streaming, each changed at once, the wait on the change
            table = f"public.t{n}"
            source.query(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
            federate(source, table)
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {table} VALUES (1, 'new')")
            ticket = client.transmit_log_entry_message(b"with the table", [s.site_id for s in sinks])
            conn.commit()
            if n == 1:  # or the wait for readiness: everything committed before it, the table's rows too
                assert all(r.ready for r in client.wait_until_ready([s.site_id for s in sinks], timeout=20))
            else:
                assert client.wait_until_safe(ticket, timeout=20).safe_on == [s.site_id for s in sinks]
            for sink in sinks:
                held = (
                    f"SELECT v FROM {table} WHERE id = 1" if sink.query(f"SELECT to_regclass('{table}')")[0][0] else ""
                )
                assert held and sink.query(held) == [("new",)], f"{sink.site_id} lacks {table}'s change"
        # a table site-b cannot take (its own of another shape): the wait ends at its timeout, naming it
        sinks[0].query("CREATE TABLE public.odd (id int PRIMARY KEY)")
        source.query("CREATE TABLE public.odd (id int PRIMARY KEY, v text)")
        federate(source, "public.odd")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO public.odd VALUES (1, 'new')")
        ticket = client.transmit_log_entry_message(b"with odd", [s.site_id for s in sinks])
        conn.commit()
        started = time.monotonic()
        with pytest.raises(DeliveryTimeout) as refused:
            client.wait_until_safe(ticket, timeout=2)
        assert refused.value.missing == ["site-b"] and time.monotonic() - started < 4
        conn.close()
