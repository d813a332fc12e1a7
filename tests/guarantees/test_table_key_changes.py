"""Key changes of federated tables the way applications make them (docs/tables.md, "Capture"): keys
shifted over each other in one statement, keys swapped. The sink, with the source's UNIQUE
constraints (lr copies them), takes every such history, and holds the source's rows."""

from __future__ import annotations

import pytest

from tests.support.session import apply, replicator
from tests.support.tables import cycle_errors, federate, rows, sync

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
