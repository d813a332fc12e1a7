"""Pairs of this round's behaviour with the rest, in lr's default mode (streaming): key chains moved
in place (runs.layers, V0049) while forced full syncs of their tables are applied."""

from __future__ import annotations

import threading

from airflow_provider_lr.engine.source import full_sync
from tests.guarantees.test_table_edge_values_streaming import errors, texts
from tests.guarantees.test_table_fidelity_streaming import streaming_over
from tests.support.session import apply, queue, wait_for
from tests.support.tables import federate, on_every_site


def starts(sink) -> int:
    return [k for k, _ in queue(sink, "site-a")].count("start")


def test_key_chains_committed_while_forced_full_syncs_apply_arrive_whole_at_sinks_whose_children_follow(lr_sites):
    """The source shifts every parent's key by one (a chain, moved link by link at each sink, whose
    children follow ON UPDATE CASCADE under a NOT DEFERRABLE foreign key) over and over, while a
    full sync of the client (its tables' snapshots) is forced at every sink, twice, as the stream
    runs: each full sync is applied, the chains before and after it arrive, nothing refused, and
    every sink ends with the source's parents and children."""
    source, *sinks = lr_sites
    topo = apply(lr_sites, providers={"policy": "tests.support.session:empty_provider"})
    on_every_site(
        lr_sites,
        "CREATE TABLE public.parents (id int PRIMARY KEY, name text); "
        "CREATE TABLE public.kids (id int PRIMARY KEY, parent int REFERENCES public.parents ON UPDATE CASCADE)",
    )
    source.query(  # stored from the highest key down: the source's immediate key takes SET id = id + 1
        "INSERT INTO public.parents SELECT g, 'p' || g FROM generate_series(8, 1, -1) g; "
        "INSERT INTO public.kids SELECT g, g FROM generate_series(1, 8, 3) g; "
        "CREATE TABLE public.filler (id int PRIMARY KEY, pad text); "
        "INSERT INTO public.filler SELECT g, repeat('x', 100) FROM generate_series(1, 5000) g"
    )
    for table in ("public.filler", "public.parents", "public.kids"):
        federate(source, table)
    stop = threading.Event()
    chains = [0]

    def shift() -> None:
        conn = source.connect()
        conn.autocommit = True
        with conn.cursor() as cur:
            while not stop.wait(0.01):
                cur.execute("UPDATE public.parents SET id = id + 1")
                chains[0] += 1
        conn.close()

    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        wait_for(lambda: all(texts(s, "public.kids") == texts(source, "public.kids") for s in sinks), 30, "snapshot")
        writer = threading.Thread(target=shift)
        writer.start()
        try:
            for _ in range(2):
                before = [starts(s) for s in sinks]
                conn = source.connect()
                for s in sinks:
                    full_sync.request_full_sync(conn, s.site_id, "policy", reason="pairs18", forced=True)
                conn.commit()
                conn.close()
                wait_for(lambda: all(starts(s) > n for s, n in zip(sinks, before)), 60, "the forced full syncs")
        finally:
            stop.set()
            writer.join(30)
        for table in ("public.parents", "public.kids"):
            wait_for(
                lambda: errors(streaming) or all(texts(s, table) == texts(source, table) for s in sinks),
                60,
                f"{table} at every sink, or a refusal",
            )
        assert errors(streaming) == [], errors(streaming)
    assert chains[0] > 5, chains
