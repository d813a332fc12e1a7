"""Keys whose values PostgreSQL holds equal under another form, or that JSON cannot spell: a float
``-0`` (equal to ``0``), ``NaN`` and ``±Infinity`` of ``real``, ``double precision`` and ``numeric``,
streamed by ``lr sync``'s default mode (docs/tables.md, "Limits"). Each row keyed so is inserted,
updated and deleted at every sink, once: nothing is duplicated or lost, and the sink's rows print
as the source's, a -0 that is not a key too (it arrived as 0 before V0033). And a key of every built-in type that can be one, through the same changes."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.vocabulary import SessionKey
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


def test_a_both_ways_table_keyed_by_jsonb_keeps_the_sinks_own_unsent_rows_through_a_full_sync_asked_while_streaming(
    lr_sites,
):
    """public.kj is federated site-a -> site-b (policy) and back (client back), keyed by a jsonb and by
    a (numeric, timestamptz, float8) key; site-b inserts, updates and deletes rows that have not gone
    back to site-a when a full sync of site-a -> site-b is asked while it streams. site-b keeps its
    own rows: the snapshot reads the keys of its unsent changes as the sink applies them. Before,
    a jsonb key (carried as its text, as floats are) was read as a JSON string, matched no row, and
    site-b's own rows of it were cleared by the snapshot while its changes went on to site-a."""
    a, b, _ = lr_sites
    topo = apply(
        lr_sites,
        [
            {"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]},
            {"source": "site-b", "sinks": ["site-a"], "clients": ["back"]},
        ],
    )
    keys = {
        "public.kj": "k jsonb PRIMARY KEY",
        "public.kx": "n numeric, t timestamptz, f float8, PRIMARY KEY (n, t, f)",
    }
    old = {"public.kj": ['\'{"a": 1, "b": [1, 2.50]}\'', "'[2]'"], "public.kx": ["1.50, '2026-01-01 10:00+05', 1.5"]}
    old["public.kx"].append("2.0, 'infinity', '-0'")
    for table, columns in keys.items():
        a.query(f"CREATE TABLE {table} ({columns}, v text)")
        a.query(f"INSERT INTO {table} VALUES ({old[table][0]}, 'a0'), ({old[table][1]}, 'a1')")
        federate(a, table)
    where = {"public.kj": "k = {}::jsonb", "public.kx": "(n, t, f) = ({})"}
    with Streaming(replicator(topo, lr_sites, sessions=[SessionKey("site-a", "site-b", "policy")]), FAST) as streaming:
        streaming.streaming()
        wait_for(lambda: all(rows(b, t) == rows(a, t) for t in keys), 30, "the snapshots at site-b")
        for table in keys:
            federate(b, table, client="back")  # site-b's copy goes back to site-a (not run here)
        b.query("INSERT INTO public.kj VALUES ('{\"c\": {\"d\": null}}', 'b-new')")
        b.query("INSERT INTO public.kx VALUES (3.000, '2026-06-01 00:00:00.5+00', 1e300, 'b-new')")
        for table in keys:
            b.query(f"UPDATE {table} SET v = 'b-changed' WHERE {where[table].format(old[table][0])}")
            b.query(f"DELETE FROM {table} WHERE {where[table].format(old[table][1])}")
        at_b = {t: rows(b, t) for t in keys}
        conn = a.connect()
        try:
            request = full_sync.request_full_sync(conn, "site-b", "policy", forced=True)
        finally:
            conn.close()
        status = "SELECT status FROM lr.full_sync_requests WHERE request_id = %s"
        wait_for(lambda: a.query(status, (request.request_id,)) == [("applied",)], 30, "the full sync applied")
        streaming.streaming()
        assert not [r.error for r in streaming.cycles if r.error]
    assert {t: rows(b, t) for t in keys} == at_b


def test_a_both_ways_table_whose_unique_values_site_b_swapped_takes_site_bs_snapshot_at_site_a(lr_sites):
    """public.members (email UNIQUE) is federated site-a -> site-b (policy); site-b opens its copy back
    to site-a (client back), swaps two emails through a temporary one and moves a third to a new
    row before back's first snapshot, which site-a takes without the swap (the swap's entries follow the snapshot's split).
    site-a ends with site-b's rows and back streams. Before, the snapshot's upsert wrote row 1's new
    email while row 2 still held it: `duplicate key value violates unique constraint`, on every cycle,
    for good."""
    a, b, _ = lr_sites
    topo = apply(
        lr_sites,
        [
            {"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]},
            {"source": "site-b", "sinks": ["site-a"], "clients": ["back"]},
        ],
    )
    a.query("CREATE TABLE public.members (id int PRIMARY KEY, email text NOT NULL UNIQUE, v text)")
    a.query("INSERT INTO public.members VALUES (1, 'x', 'a'), (2, 'y', 'a'), (3, 'z', 'a')")
    federate(a, "public.members")
    policy = SessionKey("site-a", "site-b", "policy")
    with Streaming(replicator(topo, lr_sites, sessions=[policy]), FAST) as streaming:
        streaming.streaming()
        wait_for(lambda: rows(b, "public.members") == rows(a, "public.members"), 30, "the snapshot at site-b")
    federate(b, "public.members", client="back")
    # site-a's own rows refer to the swapped ones (a foreign key checked at once)
    a.query("CREATE TABLE public.member_notes (id int PRIMARY KEY, member int REFERENCES public.members (id))")
    a.query("INSERT INTO public.member_notes VALUES (1, 1), (2, 2)")
    b.query("UPDATE public.members SET email = 'tmp' WHERE id = 1")
    b.query("UPDATE public.members SET email = 'x' WHERE id = 2")
    b.query("UPDATE public.members SET email = 'y', v = 'b' WHERE id = 1")
    b.query("UPDATE public.members SET email = 'w' WHERE id = 3")  # and z moves to a new row
    b.query("INSERT INTO public.members VALUES (4, 'z', 'b')")
    with Streaming(replicator(topo, lr_sites), FAST) as streaming:
        wait_for(lambda: rows(a, "public.members") == rows(b, "public.members"), 30, "site-b's rows at site-a")
        streaming.streaming()
        assert not [r.error for r in streaming.cycles if r.error]
    assert a.query("SELECT id, email FROM public.members ORDER BY id") == [(1, "y"), (2, "x"), (3, "w"), (4, "z")]
    assert a.query("SELECT id, member FROM public.member_notes ORDER BY id") == [(1, 1), (2, 2)]
