"""Federated tables (seed 002): captured in the writer's transaction, snapshotted from one exported
snapshot, applied at every sink in commit order; the registry's rules and the seam."""
from __future__ import annotations

import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import TableError
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.session.replicator import run_until_idle
from tests.support.session import apply, queue, replicator
from tests.support.tables import TableWriter, create_accounts, federate, rows


def _sync(repl, cycles: int = 40) -> list:
    return run_until_idle(repl, max_cycles=cycles)


def test_rows_before_federation_and_changes_during_and_after_reach_both_sinks_row_for_row(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=500)
    federate(source)
    repl = replicator(topo, lr_sites)
    with TableWriter(source) as writer:
        for _ in range(6):
            repl.run_cycle()
    _sync(repl)
    expected = rows(source)
    assert writer.transactions > 50
    for sink in sinks:
        assert rows(sink) == expected


def test_a_transaction_that_changes_a_table_and_transmits_arrives_whole_in_one_order(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source)
    federate(source)
    repl = replicator(topo, lr_sites)
    _sync(repl)
    conn = source.connect()
    client = RoutingQueueClient(conn, "policy")
    for i in range(1, 6):
        with conn.cursor() as cur:
            cur.execute("INSERT INTO public.accounts (id, owner) VALUES (%s, 'x')", (i,))
        client.transmit_log_entry_message(f"row {i}".encode(), [sink.site_id])
        conn.commit()
    with conn.cursor() as cur:  # rolled back: neither the row nor the message
        cur.execute("INSERT INTO public.accounts (id, owner) VALUES (99, 'gone')")
    client.transmit_log_entry_message(b"gone", [sink.site_id])
    conn.rollback()
    conn.close()
    # one sink transaction per batch: row i and message i are applied together
    _sync(repl)
    assert [r[0] for r in sink.query("SELECT id FROM public.accounts ORDER BY id")] == [1, 2, 3, 4, 5]
    assert [p for k, p in queue(sink) if k == "log"] == [f"row {i}" for i in range(1, 6)]


def test_updates_key_changes_deletes_and_truncate_apply_exactly(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=50)
    federate(source)
    repl = replicator(topo, lr_sites)
    _sync(repl)
    source.query("UPDATE public.accounts SET id = id + 1000")  # every key changes
    source.query("UPDATE public.accounts SET id = id - 1000 WHERE id > 1040")  # ... and some back to old keys
    source.query("UPDATE public.accounts SET id = id - 1030 WHERE id BETWEEN 1031 AND 1035")  # 1..5 again
    source.query("UPDATE public.accounts SET balance = -1 WHERE id %% 7 = 0")
    source.query("DELETE FROM public.accounts WHERE id BETWEEN 10 AND 20")
    _sync(repl)
    assert rows(sink) == rows(source)
    source.query("BEGIN; TRUNCATE public.accounts; INSERT INTO public.accounts (id, owner) VALUES (1, 'after'); COMMIT")
    _sync(repl)
    assert rows(sink) == rows(source) == [(r[0],) for r in source.query("SELECT t::text FROM public.accounts t")]
    assert len(rows(sink)) == 1


def test_opening_a_table_without_primary_key_or_for_an_unknown_client_is_refused(lr_sites):
    source = lr_sites[0]
    apply(lr_sites)
    source.query("CREATE TABLE public.nokey (a int)")
    with pytest.raises(TableError, match="no primary key"):
        federate(source, "public.nokey")
    create_accounts(source)
    with pytest.raises(TableError, match="not in the topology"):
        federate(source, client="nobody")
    with pytest.raises(TableError, match="does not exist"):
        federate(source, "public.missing")
    assert registry.list_tables(source.connect()) == []
