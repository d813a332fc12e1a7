"""DDL done by hand at every site while ``lr sync`` streams a federated table (docs/tables.md,
"Limits": DDL is not replicated): a column added at the sinks first, as PostgreSQL's logical
replication wants it, then at the source; a key column renamed everywhere. The changes made in
between apply, and every sink ends with the source's rows."""

from __future__ import annotations

from tests.guarantees.test_table_fidelity_streaming import streaming_over
from tests.support.session import Streaming, apply, wait_for
from tests.support.tables import federate, on_every_site, rows


def same_rows(source, sinks, what: str) -> None:
    wait_for(lambda: all(rows(s, "public.items") == rows(source, "public.items") for s in sinks), 30, what)


def streaming_items(lr_sites) -> Streaming:
    """``public.items`` (6 rows) federated from site-a to the other sites, to be streamed."""
    source = lr_sites[0]
    topo = apply(lr_sites)
    source.query("CREATE TABLE public.items (id int PRIMARY KEY, note text)")
    source.query("INSERT INTO public.items SELECT g, 'n' || g FROM generate_series(1, 6) g")
    federate(source, "public.items")
    return streaming_over(topo, lr_sites)


def test_a_column_added_at_the_sinks_first_takes_the_changes_made_before_the_source_has_it(lr_sites):
    source, *sinks = lr_sites
    with streaming_items(lr_sites) as streaming:
        streaming.streaming()
        on_every_site(sinks, "ALTER TABLE public.items ADD COLUMN extra int DEFAULT 7")
        # captured without the column: an insert takes the sink's default, an update keeps it
        source.query("UPDATE public.items SET note = 'between' WHERE id = 1")
        source.query("INSERT INTO public.items VALUES (10, 'inserted')")
        source.query("ALTER TABLE public.items ADD COLUMN extra int DEFAULT 7")
        source.query("UPDATE public.items SET extra = 8, id = 20 WHERE id = 2")
        source.query("DELETE FROM public.items WHERE id = 3")
        same_rows(source, sinks, "the changes before and after the source added the column")
    assert ("(10,inserted,7)",) in rows(source, "public.items")


def test_a_key_column_renamed_at_every_site_keeps_key_changes_and_deletes_by_its_new_name(lr_sites):
    source, *sinks = lr_sites
    with streaming_items(lr_sites) as streaming:
        streaming.streaming()
        source.query("UPDATE public.items SET note = 'before' WHERE id = 5")
        same_rows(source, sinks, "a change before the rename")
        on_every_site(lr_sites, "ALTER TABLE public.items RENAME COLUMN id TO item_id")
        source.query("UPDATE public.items SET item_id = item_id + 100 WHERE item_id <= 2")  # key changes
        source.query("DELETE FROM public.items WHERE item_id = 3")
        source.query("UPDATE public.items SET note = 'kept' WHERE item_id = 4")
        same_rows(source, sinks, "the changes after the rename")
    assert len(rows(source, "public.items")) == 5
