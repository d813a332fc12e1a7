"""Keys whose values PostgreSQL holds equal under another form, or that JSON cannot spell: a float
``-0`` (equal to ``0``), ``NaN`` and ``±Infinity`` of ``real``, ``double precision`` and ``numeric``,
streamed by ``lr sync``'s default mode (docs/tables.md, "Limits"). Each row keyed so is inserted,
updated and deleted at every sink, once: nothing is duplicated or lost, and the sink's rows print
as the source's, a -0 that is not a key too (it arrived as 0 before V0033). And a key of every built-in type that can be one, through the same changes."""

from __future__ import annotations

import pytest

from tests.guarantees.test_table_fidelity_streaming import FAST
from tests.support.session import Streaming, apply, replicator, wait_for
from tests.support.tables import TYPES, TYPES_DDL, federate, rows

# types without a btree order (no key can have them), and values too large for an index entry
UNORDERED = {"pt", "ln", "ls", "bx", "pa", "pg", "ci", "js", "big", "bigb"}


@pytest.mark.parametrize("key_type", ["float8", "float4", "numeric"])
def test_rows_keyed_minus_zero_nan_and_infinity_stream_once_through_insert_update_and_delete(lr_sites, key_type):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    source.query(f"CREATE TABLE public.odd (k {key_type} PRIMARY KEY, v text, f float8, r real)")
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
        source.query("INSERT INTO public.odd VALUES ('-0', 'streamed', '-Infinity', '-0')")  # a -0 not a key too
        source.query("UPDATE public.odd SET v = 'updated' WHERE k = '0'")  # the row keyed -0
        source.query("UPDATE public.odd SET v = 'updated' WHERE k = 'NaN' OR k = '-Infinity'")
        source.query("UPDATE public.odd SET f = '-0', r = '-0' WHERE k = '1.5'")
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


def test_a_key_of_every_built_in_type_with_an_order_streams_through_insert_update_key_change_and_delete(lr_sites):
    """Every type a primary key can have (a btree order: arrays, ranges, multiranges, enums,
    composites, domains, jsonb, tsvector, money, bit, inet, macaddr8, pg_lsn, ±infinity, text with
    quotes and backslashes), each with its two odd values, as the columns of two composite keys
    (at most 32 columns a key)."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for site in lr_sites:
        for ddl in TYPES_DDL:
            site.query(ddl)
    keyed = [t for t in TYPES if t[0] not in UNORDERED]
    parts = {"public.k0": keyed[:30], "public.k1": keyed[30:]}

    def values(part, which: int) -> str:
        return ", ".join(f"({t[which]})::{t[1]}" for t in part).replace("%", "%%")

    for table, part in parts.items():
        source.query(
            f"CREATE TABLE {table} ("
            + ", ".join(f"{c} {k}" for c, k, _, _ in part)
            + f", note text, PRIMARY KEY ({', '.join(c for c, _, _, _ in part)}))"
        )
        source.query(f"INSERT INTO {table} VALUES ({values(part, 2)}, 'a')")
        federate(source, table)

    def same(what: str) -> None:
        for table in parts:
            wait_for(lambda: all(rows(s, table) == rows(source, table) for s in sinks), 30, f"{what} of {table}")

    with Streaming(replicator(topo, lr_sites, lease_seconds=2.0), FAST) as streaming:
        streaming.streaming()
        for table, part in parts.items():
            source.query(f"INSERT INTO {table} VALUES ({values(part, 3)}, 'b')")
            source.query(f"UPDATE {table} SET note = note || '+'")
        same("inserts and updates")
        for table, part in parts.items():
            source.query(f"DELETE FROM {table} WHERE note = 'b+'")
            moved = ", ".join(f"{t[0]} = ({t[3]})::{t[1]}" for t in part).replace("%", "%%")
            source.query(f"UPDATE {table} SET {moved}, note = 'moved'")  # every key column changes
        same("key changes")
        assert all(len(rows(s, table)) == 1 for s in sinks for table in parts)
        for table in parts:
            source.query(f"DELETE FROM {table}")
        same("deletes")
        assert not [r.error for r in streaming.cycles if r.error]
