"""Key changes of federated tables the way applications make them (docs/tables.md, "Capture"): keys
shifted over each other in one statement, keys swapped. The sink, with the source's UNIQUE
constraints (lr copies them), takes every such history, and holds the source's rows."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.source import full_sync
from tests.guarantees.test_table_fidelity_streaming import FAST
from tests.support.session import Streaming, apply, replicator, wait_for
from tests.support.tables import (
    cycle_errors,
    federate,
    in_one_transaction,
    on_every_site,
    rows,
    sync,
    two_sources_into_one_sink,
)

ITEMS = "CREATE TABLE public.items (id int PRIMARY KEY{deferrable}, u text NOT NULL UNIQUE, note {note})"


@pytest.mark.parametrize("note", ["text", "jsonb"])  # jsonb: the capture's row images with text columns
def test_keys_shifted_over_each_other_and_swapped_keep_the_unique_values_with_their_rows(lr_sites, note):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    # the source's key may be swapped within a statement; the sink's (lr creates it) is checked at once
    source.query(ITEMS.format(deferrable=" DEFERRABLE INITIALLY DEFERRED", note=note))
    # stored from the highest key down: SET id = id + 1 moves 3 to 4 first, then 2 onto 3's old key
    source.query("INSERT INTO public.items SELECT g, 'u' || g, to_json('n' || g) FROM generate_series(3, 1, -1) g")
    federate(source, "public.items")
    repl = replicator(topo, lr_sites)
    assert cycle_errors(sync(repl)) == []
    source.query("UPDATE public.items SET id = id + 1")  # 3->4, 2->3, 1->2: each row keeps its u
    source.query("UPDATE public.items SET id = 6 - id WHERE id IN (2, 4)")  # a swap of two keys
    source.query("UPDATE public.items SET id = id * 10, note = NULL WHERE id = 3")  # and a plain move
    assert cycle_errors(sync(repl)) == []
    expected = rows(source, "public.items")
    assert sorted(source.query("SELECT id, u FROM public.items")) == [(2, "u3"), (4, "u1"), (30, "u2")]
    for sink in sinks:
        assert rows(sink, "public.items") == expected
    # the deferred key held by two rows between statements: a swap made one row at a time, then a
    # row moved onto another's key and that other deleted. Before, the statement that left the key
    # to the other row wrote it as gone: every sink deleted that row, for good, silently
    in_one_transaction(
        source,
        "UPDATE public.items SET id = 4 WHERE u = 'u3'",  # 4 held twice
        "UPDATE public.items SET id = 2 WHERE u = 'u1'",  # 4 left to u3
        "UPDATE public.items SET id = 30 WHERE u = 'u3'",  # 30 held twice
        "DELETE FROM public.items WHERE u = 'u2'",  # 30 left to u3
    )
    assert cycle_errors(sync(repl)) == []
    assert sorted(source.query("SELECT id, u FROM public.items")) == [(2, "u1"), (30, "u3")]
    for sink in sinks:
        assert rows(sink, "public.items") == rows(source, "public.items")


def test_a_sink_table_whose_primary_key_is_deferrable_takes_streamed_upserts_key_shifts_and_swaps(lr_sites):
    """A sink table made as the source's, its key DEFERRABLE (or an old source rejoined as a sink
    after a failover): PostgreSQL has no ON CONFLICT for such a key; each row is updated, or
    inserted when new, in the source's order."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, ITEMS.format(deferrable=" DEFERRABLE INITIALLY DEFERRED", note="jsonb"))
    source.query("INSERT INTO public.items SELECT g, 'u' || g, to_json(g) FROM generate_series(1, 5) g")
    federate(source, "public.items")
    with Streaming(replicator(topo, lr_sites, lease_seconds=2.0), FAST) as streaming:
        streaming.streaming()
        source.query("UPDATE public.items SET note = '\"x\"' WHERE id = 1")
        source.query("INSERT INTO public.items VALUES (6, 'u6', NULL), (7, 'u7', '[1]')")
        source.query("UPDATE public.items SET id = id + 1")  # keys over each other, checked at commit
        in_one_transaction(  # a swap of unique values through a temporary one
            source,
            "UPDATE public.items SET u = 'tmp' WHERE id = 2",
            "UPDATE public.items SET u = 'u1' WHERE id = 3",
            "UPDATE public.items SET u = 'u2' WHERE id = 2",
        )
        source.query("DELETE FROM public.items WHERE id = 4")
        wait_for(
            lambda: all(rows(sink, "public.items") == rows(source, "public.items") for sink in sinks), 30, "the sinks"
        )
        assert not [r.error for r in streaming.cycles if r.error]
    assert len(rows(source, "public.items")) == 6


@pytest.mark.parametrize("initially", ["DEFERRED", "IMMEDIATE"])
def test_a_shared_sink_table_whose_primary_key_is_deferrable_takes_each_sources_snapshot_and_full_sync(
    lr_sites, initially
):
    """Two sources into one sink table whose key is DEFERRABLE: the second source's snapshot (and a
    full sync of either) goes through a staging table and an upsert, which has no ON CONFLICT arbiter
    here: rows are updated, or inserted when new, and nothing of the other source's is cleared."""
    a, b, sink = lr_sites
    topo = two_sources_into_one_sink(lr_sites)
    on_every_site(lr_sites, ITEMS.format(deferrable="", note="text"))
    sink.query("DROP TABLE public.items")
    sink.query(ITEMS.format(deferrable=f" DEFERRABLE INITIALLY {initially}", note="text"))
    a.query("INSERT INTO public.items SELECT g, 'a' || g, 'a' FROM generate_series(1, 5) g")
    b.query("INSERT INTO public.items SELECT g, 'b' || g, 'b' FROM generate_series(5, 9) g")  # 5: both hold it
    federate(a, "public.items")
    repl = replicator(topo, lr_sites)
    assert cycle_errors(sync(repl)) == []
    federate(b, "public.items")
    assert cycle_errors(sync(repl)) == []  # b's snapshot: upserted beside a's rows, key 5 to the last writer
    assert rows(sink, "public.items") == sorted(rows(a, "public.items")[:4] + rows(b, "public.items"))
    b.query("UPDATE public.items SET note = 'b again'")
    conn = b.connect()
    full_sync.request_full_sync(conn, "site-c", "policy", "operator asked", forced=True)
    conn.close()
    assert cycle_errors(sync(repl)) == []
    assert rows(sink, "public.items") == sorted(rows(a, "public.items")[:4] + rows(b, "public.items"))
