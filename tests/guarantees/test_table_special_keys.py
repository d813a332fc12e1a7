"""Keys whose values PostgreSQL holds equal under another form, or that JSON cannot spell: a float
``-0`` (equal to ``0``), ``NaN`` and ``±Infinity`` of ``real``, ``double precision`` and ``numeric``,
streamed by ``lr sync``'s default mode (docs/tables.md, "Limits"). Each row keyed so is inserted,
updated and deleted at every sink, once: nothing is duplicated or lost, and the sink's rows print
as the source's."""

from __future__ import annotations

import pytest

from tests.guarantees.test_table_fidelity_streaming import FAST
from tests.support.session import Streaming, apply, replicator, wait_for
from tests.support.tables import federate, rows


@pytest.mark.parametrize("key_type", ["float8", "float4", "numeric"])
def test_rows_keyed_minus_zero_nan_and_infinity_stream_once_through_insert_update_and_delete(lr_sites, key_type):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    source.query(f"CREATE TABLE public.odd (k {key_type} PRIMARY KEY, v text, f float8)")
    source.query("INSERT INTO public.odd VALUES ('-0', 'before'), ('NaN', 'before')")
    federate(source, "public.odd")

    def same() -> bool:
        return all(rows(sink, "public.odd") == rows(source, "public.odd") for sink in sinks)

    with Streaming(replicator(topo, lr_sites, lease_seconds=2.0), FAST) as streaming:
        streaming.streaming()
        wait_for(same, 30, "the snapshot")
        source.query(
            "INSERT INTO public.odd VALUES ('Infinity', 'i', '-Infinity'), ('-Infinity', 'i', 'NaN'), ('1.5', 'i', 1e-300)"
        )
        source.query("DELETE FROM public.odd WHERE k = '0'")  # the snapshot's -0, then a streamed one
        source.query("INSERT INTO public.odd VALUES ('-0', 'streamed', '-Infinity')")
        source.query("UPDATE public.odd SET v = 'updated' WHERE k = '0'")  # the row keyed -0
        source.query("UPDATE public.odd SET v = 'updated' WHERE k = 'NaN' OR k = '-Infinity'")
        wait_for(same, 30, "the updates")
        source.query("DELETE FROM public.odd WHERE k = '0'")  # -0's row, named by 0
        source.query("INSERT INTO public.odd VALUES ('0', 'zero')")  # now 0 itself
        source.query("UPDATE public.odd SET k = '-0' WHERE k = '0'")  # an equal key of another form
        source.query("DELETE FROM public.odd WHERE k = 'NaN'")
        source.query("UPDATE public.odd SET k = 'NaN', v = 'moved' WHERE k = 'Infinity'")  # onto NaN's old key
        wait_for(same, 30, "the key changes")
        source.query("DELETE FROM public.odd WHERE k IN ('NaN', '-Infinity', '0')")
        wait_for(same, 30, "the deletes")
        assert not [r.error for r in streaming.cycles if r.error]
    assert source.query("SELECT count(*) FROM public.odd") == [(1,)]
    for sink in sinks:
        assert sink.query("SELECT count(*) FROM public.odd") == [(1,)]
