"""``lr sync`` streaming as the replicator role (docs/security.md), with a writer role transmitting:
a federated table opened, key-changed and fully synced again while the stream runs (V0048's
row-level security on lr.source_sessions, V0049's composites and key moves), and the writer's
wait for delivery reading its session."""

from __future__ import annotations

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import DeliveryTimeout
from airflow_provider_lr.engine.site import status
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.source import delivery, full_sync
from tests.engine.site.test_roles import connect_as, made, sites_as  # noqa: F401
from tests.guarantees.test_table_fidelity_streaming import FAST
from tests.support.session import Streaming, apply, empty_provider, replicator, wait_for
from tests.support.tables import federate, on_every_site, rows, sync


def test_a_table_opened_key_changed_and_fully_synced_while_a_replicator_role_streams(lr_sites, made):
    source, sink = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    repl, writer = made.name("repl"), made.name("w_policy")
    for site in (source, sink):
        made.grant(site, "replicator", repl)
    made.grant(source, "writer", writer, ["policy"])
    on_every_site(
        [source, sink],
        "CREATE TYPE public.pair AS (a int, b text); "
        "CREATE TABLE public.items (id int PRIMARY KEY, p public.pair, note text); "
        "CREATE TABLE public.kids (id int PRIMARY KEY, up int REFERENCES public.items ON UPDATE CASCADE)",
    )
    source.query(f'GRANT SELECT ON public.items TO "{repl}"')
    sink.query(f'GRANT SELECT, INSERT, UPDATE, DELETE ON public.items TO "{repl}"')
    source.query(
        "INSERT INTO public.items SELECT g, ROW(g, 't' || g)::public.pair, 'n' || g FROM generate_series(1, 5) g"
    )
    with Streaming(
        replicator(
            topo, sites_as(lr_sites[:2], repl), providers={"policy": lambda ctx: None}, lease_seconds=2.0, as_lr=True
        ),
        FAST,
    ) as s:
        s.streaming()
        conn = connect_as(source, writer)
        client = RoutingQueueClient(conn, "policy")
        ticket = client.transmit_log_entry_message(b"hello", ["site-b"])
        conn.commit()
        assert delivery.wait_until_safe(conn, ticket, timeout=30).acked["site-b"] >= 0
        federate(source, "public.items")  # opened while streaming
        wait_for(lambda: rows(sink, "public.items") == rows(source, "public.items"), 30, "the snapshot")
        sink.query("INSERT INTO public.kids VALUES (1, 1), (2, 2)")  # the sink's own rows
        source.query("UPDATE public.items SET id = id + 100, p = ROW((p).a, 'moved')::public.pair WHERE id <= 2")
        wait_for(lambda: rows(sink, "public.items") == rows(source, "public.items"), 30, "the key change")
        assert sink.query("SELECT id, up FROM public.kids ORDER BY id") == [(1, 101), (2, 102)]
        # the composite altered at the sink, then at the source: the changes carry it, the sink compares
        sink.query("ALTER TYPE public.pair ADD ATTRIBUTE c int")
        source.query("ALTER TYPE public.pair ADD ATTRIBUTE c int")
        source.query("UPDATE public.items SET p = ROW((p).a, (p).b, 7)::public.pair WHERE id = 4")
        wait_for(lambda: rows(sink, "public.items") == rows(source, "public.items"), 30, "the altered composite")
        carried = "SELECT count(*) FROM lr.log_entries WHERE stream = 3 AND convert_from(message, 'UTF8')::jsonb ? 'composites'"
        assert source.query(carried) != [(0,)]
        sink.query("DELETE FROM public.kids")  # a snapshot clears items: the sink's own references would refuse it
        rconn = connect_as(source, repl)
        asked = full_sync.request_full_sync(rconn, "site-b", "policy", reason="asked while streaming", forced=True)
        source.query("UPDATE public.items SET note = 'after' WHERE id = 3")
        applied = "SELECT status FROM lr.full_sync_requests WHERE request_id = %s"
        wait_for(lambda: source.query(applied, (asked.request_id,)) == [("applied",)], 30, "the full sync")
        wait_for(lambda: rows(sink, "public.items") == rows(source, "public.items"), 30, "after the full sync")
        said = status.render(status.site_status(rconn))
        rconn.close()
        ticket = client.transmit_log_entry_message(b"again", ["site-b"])
        conn.commit()
        done = delivery.wait_until_safe(conn, ticket, timeout=30)
        assert done.acked["site-b"] >= done.position
        conn.close()
        assert not [e for e in s.streamer.ends if e.error], s.streamer.ends
    assert "REFUSED" not in said and "ERROR" not in said, said


def test_a_replicator_role_with_create_on_the_schema_only_creates_a_table_the_sink_never_had(lr_sites, made):
    """docs/tables.md: at a sink the replicator needs CREATE on the schema for a table the sink never
    had. lr ran CREATE SCHEMA IF NOT EXISTS first, which PostgreSQL checks against CREATE on the
    DATABASE before it looks whether the schema exists: 'permission denied for database', at every
    cycle, for good. The schema is created only when the sink lacks it now."""
    source, sink = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    repl = made.name("repl")
    for site in (source, sink):
        made.grant(site, "replicator", repl)
    sink.query(f'GRANT USAGE, CREATE ON SCHEMA public TO "{repl}"')
    source.query("CREATE TABLE public.fresh (id int PRIMARY KEY, v text)")
    source.query("INSERT INTO public.fresh SELECT g, 'v' || g FROM generate_series(1, 3) g")
    source.query(f'GRANT SELECT ON public.fresh TO "{repl}"')
    federate(source, "public.fresh")
    run = replicator(topo, sites_as(lr_sites[:2], repl), providers={"policy": lambda ctx: None})
    try:
        reports = sync(run, cycles=6)
    finally:
        run.close()
    assert not [r.error for r in reports if r.error], [r.error for r in reports if r.error][:1]
    assert rows(sink, "public.fresh") == rows(source, "public.fresh")


def test_a_writer_role_waits_until_its_sink_is_ready(lr_sites, made):
    """A writer's ``client.wait_until_ready`` (docs/security.md: one of the application's waits) reads
    its sessions' backlog through ``lr.session_backlogs`` (V0051): not ready while nothing replicates,
    said so; a writer of another client is refused them. Before, it failed with "permission denied for
    table source_sessions": it read the sessions and the log itself."""
    source = lr_sites[0]
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy", "audit"]}])
    writer, other = made.name("w_policy"), made.name("w_audit")
    made.grant(source, "writer", writer, ["policy"])
    made.grant(source, "writer", other, ["audit"])
    conn = connect_as(source, writer)
    client = RoutingQueueClient(conn, "policy")
    client.transmit_log_entry_message(b"x", ["site-b"])
    conn.commit()
    try:
        with pytest.raises(DeliveryTimeout, match="site-b"):  # nothing replicates yet: not ready, said so
            client.wait_until_ready(["site-b"], timeout=1)
        repl = replicator(topo, lr_sites[:2], providers={"policy": empty_provider, "audit": empty_provider})
        run_until_idle(repl)
        repl.close()
        assert [r.ready for r in client.wait_until_ready(["site-b"], timeout=10)] == [True]
    finally:
        conn.close()
    stranger = connect_as(source, other)
    try:
        with stranger.cursor() as cur:  # another client's writer: its sessions are not for it to read
            cur.execute("SELECT sink, client FROM lr.session_backlogs(NULL, NULL, NULL)")
            assert cur.fetchall() == [("site-b", "audit")]
            with pytest.raises(
                psycopg2.errors.InsufficientPrivilege, match="may not read the sessions of client policy"
            ):
                cur.execute("SELECT count(*) FROM lr.session_backlogs(NULL, 'policy', NULL)")
    finally:
        stranger.close()
