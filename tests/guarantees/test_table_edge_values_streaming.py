"""Federated tables with ordinary schemas in ``lr sync``'s streaming mode, beyond
``test_table_fidelity_streaming.py``: values whose text or JSON form is easy to get wrong inside
ranges, multiranges, composites and domains (a float ``-0`` in each, ``\\N`` and backslashes in a
text-format COPY snapshot), ``MERGE`` statements, unique indexes besides the key (partial, on an
expression, deferrable), and foreign keys that cascade a parent's key change (docs/tables.md)."""

from __future__ import annotations

from tests.guarantees.test_table_fidelity_streaming import forced_full_sync_of_site_b, streaming_over
from tests.support.session import apply, wait_for
from tests.support.tables import federate, in_one_transaction, on_every_site, status_text


def texts(site, table: str) -> list[str]:
    """Every row of ``table`` as its text, in order: what a sink must hold exactly as the source."""
    return [r[0] for r in site.query(f"SELECT x::text FROM {table} x ORDER BY 1")]


def arrived(source, sinks, table: str, what: str) -> None:
    wait_for(lambda: all(texts(s, table) == texts(source, table) for s in sinks), 30, what)


def errors(streaming) -> list[str]:
    """What the cycles and the stream's ends said went wrong."""
    return [r.error for r in streaming.cycles if r.error] + [e.error for e in streaming.streamer.ends if e.error]


EDGE_TYPES = [
    "CREATE TYPE public.floatrange AS RANGE (subtype = float8)",
    "CREATE TYPE public.bundle AS (a int[], j json, f float8, r int4range)",
    "CREATE DOMAIN public.checked_bundle AS public.bundle CHECK ((VALUE).f IS DISTINCT FROM 42)",
    "CREATE DOMAIN public.small AS float8 CHECK (VALUE < 1e10)",
    "CREATE DOMAIN public.floats AS float8[]",
]
EDGE_COLUMNS = (
    "id int PRIMARY KEY, f8 float8, f4 real, sm public.small, fs public.floats, af float8[], fr public.floatrange, "
    "afr public.floatrange[], mr nummultirange, amr int4multirange[], ir int4range[], b public.bundle, "
    "cb public.checked_bundle, t text, ttz timetz, iv interval, js json, ajs json[], bpc char(4), vb varbit(5), "
    "tsq tsquery, rc regclass"  # tsquery and regclass: the snapshot is a text-format COPY
)
EDGE_ROW = (
    "'-0', '-0', '-0', '{-0,NaN,-Infinity}', '{-0,NaN,Infinity}', '[-0,Infinity)', '{\"[-0,1)\",empty}', "
    "'{[-Infinity,0), [1,Infinity)}', '{\"{[1,2)}\",\"{}\"}', '{empty,\"[1,2)\"}', "
    "ROW('[0:1]={1,NULL}', '{\"a\" : 1,  \"a\":2}', '-0', 'empty')::public.bundle, "
    "ROW('{}', 'null', 'NaN', '(,)')::public.bundle, "
    "E'\\\\N\\t\\n\\r back\\\\slash \\\\. \\U0001F600 \\u0001', '00:00:00+15:59:59', "
    "'-178000000 years -2147483648 days', ' [ 1 , 2 ] ', ARRAY['{ \"b\":1, \"b\":2 }'::json, NULL], 'a', B'', "
    "'x:*', 'public.edges'"
)


def test_float_minus_zero_in_ranges_composites_and_domains_and_copy_escapes_arrive_by_snapshot_stream_and_full_sync(
    lr_sites,
):
    """Each sink's rows read as text are the source's after the snapshot (text-format COPY), inserts,
    a key change, an update to ``-0`` and a full sync asked while it streams."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for ddl in EDGE_TYPES:
        on_every_site(lr_sites, ddl)
    source.query(f"CREATE TABLE public.edges ({EDGE_COLUMNS})")
    source.query(f"INSERT INTO public.edges VALUES (1, {EDGE_ROW})")
    source.query("INSERT INTO public.edges (id) VALUES (2)")
    federate(source, "public.edges")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        arrived(source, sinks, "public.edges", "the snapshot")
        source.query(f"INSERT INTO public.edges VALUES (3, {EDGE_ROW}), (4, {EDGE_ROW})")
        arrived(source, sinks, "public.edges", "the inserts")
        source.query("UPDATE public.edges SET id = id + 10 WHERE id IN (1, 3)")
        source.query("UPDATE public.edges SET f8 = '-0', sm = '-0', f4 = '-0' WHERE id = 2")
        arrived(source, sinks, "public.edges", "a key change and an update to -0")
        forced_full_sync_of_site_b(source, streaming)
        source.query("DELETE FROM public.edges WHERE id = 11")
        arrived(source, sinks, "public.edges", "the full sync and a delete")
    assert source.query("SELECT x::text FROM public.edges x WHERE id = 2")[0][0].startswith("(2,-0,-0,-0,")
    assert errors(streaming) == []


def test_merge_statements_and_unique_indexes_besides_the_key_stream_in_the_sources_order_without_violation(lr_sites):
    """Sinks with the source's constraints: ``MERGE`` deleting, updating and inserting in one
    statement (a unique value freed and taken in it), a unique value swapped in one statement
    (deferrable, checked at its end), shifted, moved through a partial unique index, held twice
    while deferred, and a key moved away and taken again; generated and identity columns beside."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TABLE public.m (id int PRIMARY KEY, u text NOT NULL UNIQUE, v int)")
    on_every_site(
        lr_sites,
        "CREATE TABLE public.q (id int PRIMARY KEY, a int, b text, c int, g int GENERATED ALWAYS AS (a * 2) STORED, "
        "n int GENERATED BY DEFAULT AS IDENTITY, d text DEFAULT 'dflt' CHECK (d <> 'bad'), "
        "CONSTRAINT qa UNIQUE (a) DEFERRABLE INITIALLY IMMEDIATE); "
        "CREATE UNIQUE INDEX qb ON public.q (b) WHERE c > 0; CREATE UNIQUE INDEX qbc ON public.q (lower(b), c)",
    )
    source.query("INSERT INTO public.m SELECT g, 'u' || g, g FROM generate_series(1, 6) g")
    source.query("INSERT INTO public.q (id, a, b, c) SELECT g, g, 'b' || g, 1 FROM generate_series(1, 6) g")
    federate(source, "public.m")
    federate(source, "public.q")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        source.query(
            "MERGE INTO public.m t USING (VALUES (1, 'x', 0), (2, 'u1', 0), (7, 'u2', 7), (3, 'u3', 30)) s(id, u, v) "
            "ON t.id = s.id WHEN MATCHED AND s.id = 1 THEN DELETE WHEN MATCHED THEN UPDATE SET u = s.u, v = s.v "
            "WHEN NOT MATCHED THEN INSERT VALUES (s.id, s.u, s.v)"
        )
        source.query(
            "MERGE INTO public.m t USING (VALUES (4, 'u4'), (8, 'u4'), (5, 'z')) s(id, u) "
            "ON t.id = s.id WHEN MATCHED AND s.id = 5 THEN UPDATE SET id = 50, u = 'z' "
            "WHEN MATCHED THEN DELETE WHEN NOT MATCHED THEN INSERT VALUES (s.id, s.u, 0)"
        )
        source.query("UPDATE public.q SET a = CASE id WHEN 1 THEN 2 WHEN 2 THEN 1 END WHERE id IN (1, 2)")
        source.query("UPDATE public.q SET a = a + 1")
        in_one_transaction(
            source,
            "UPDATE public.q SET c = 0 WHERE id = 3",
            "UPDATE public.q SET b = 'b3', c = 5 WHERE id = 4",  # b3 is free in the partial index
            "UPDATE public.q SET b = 'b4' WHERE id = 3",
        )
        in_one_transaction(
            source,
            "SET CONSTRAINTS ALL DEFERRED",
            "UPDATE public.q SET a = 100 WHERE id = 5",
            "INSERT INTO public.q (id, a, b, c) VALUES (7, 100, 'b7', 1)",
            "DELETE FROM public.q WHERE id = 5",
        )
        in_one_transaction(
            source,
            "UPDATE public.q SET id = -id WHERE id = 6",
            "INSERT INTO public.q (id, a, b, c) VALUES (6, 1000, 'B6', 2)",
        )
        arrived(source, sinks, "public.m", "the MERGEs")
        arrived(source, sinks, "public.q", "the unique values' moves")
    assert [r[0] for r in source.query("SELECT id FROM public.m ORDER BY id")] == [2, 3, 6, 7, 8, 50]
    assert errors(streaming) == []


def test_a_sink_whose_composite_type_orders_its_attributes_otherwise_is_refused_naming_it_then_takes_the_rows_in_place(
    lr_sites,
):
    """A composite's value travels by position (text and binary alike): a sink whose ``public.pair``
    is ``(b int, a int)`` where the source's is ``(a int, b int)`` took every value with its fields
    swapped, silently, by snapshot and stream. Its snapshot is refused now, naming the type and both
    attribute lists, nothing applied; with the source's type the rows arrive with their fields in place."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    source.query("CREATE TYPE public.pair AS (a int, b int)")
    source.query("CREATE TABLE public.pairs (id int PRIMARY KEY, p public.pair[], r int4range)")  # in an array
    on_every_site(sinks, "CREATE TYPE public.pair AS (b int, a int)")
    source.query("INSERT INTO public.pairs VALUES (1, ARRAY[ROW(1, 2)::public.pair], '[1,2)')")
    federate(source, "public.pairs")
    with streaming_over(topo, lr_sites) as streaming:
        told = "type public.pair is (a integer, b integer) on the source but (b integer, a integer) on the sink"
        wait_for(lambda: sum(told in e for e in errors(streaming)) >= len(sinks), 30, "the sinks' refusal")
        assert all(s.query("SELECT to_regclass('public.pairs')") == [(None,)] for s in sinks)  # nothing applied
        on_every_site(sinks, "DROP TYPE public.pair; CREATE TYPE public.pair AS (a int, b int)")
        streaming.streaming()
        source.query("INSERT INTO public.pairs VALUES (2, ARRAY[ROW(3, 4)::public.pair], NULL)")
        arrived(source, sinks, "public.pairs", "the rows, once the sinks' type is the source's")
    assert all(s.query("SELECT (p[1]).a FROM public.pairs ORDER BY id") == [(1,), (3,)] for s in sinks)


def test_a_sink_whose_domain_base_enum_labels_or_range_subtype_differ_is_refused_naming_them_then_takes_the_rows(
    lr_sites,
):
    """A sink whose domain ``public.money4`` is over numeric(12,2) where the source's is over
    numeric(12,4) took every value rounded, silently; one whose enum ``public.mood`` lacks a label
    refused the whole batch in the server's words; one whose range's subtype is timestamptz read the
    source's timestamp bounds in its zone. Each is refused now, naming the type and both definitions,
    nothing applied; an enum with the source's labels in another order and one more is fine."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    source.query(
        "CREATE DOMAIN public.money4 AS numeric(12,4); CREATE TYPE public.mood AS ENUM ('sad', 'ok', 'happy'); "
        "CREATE TYPE public.span AS RANGE (subtype = timestamp)"
    )
    source.query("CREATE TABLE public.moods (id int PRIMARY KEY, m public.money4[], f public.mood, s public.span)")
    on_every_site(
        sinks,
        "CREATE DOMAIN public.money4 AS numeric(12,2); CREATE TYPE public.mood AS ENUM ('happy', 'ok'); "
        "CREATE TYPE public.span AS RANGE (subtype = timestamptz)",
    )
    source.query("INSERT INTO public.moods VALUES (1, '{1.2345}', 'sad', '[2026-01-01 00:00,)')")
    federate(source, "public.moods")
    with streaming_over(topo, lr_sites) as streaming:
        told = [
            "type public.money4 is a domain over numeric(12,4) on the source but a domain over numeric(12,2) on the sink",
            "type public.mood is an enum ('sad', 'ok', 'happy') on the source but an enum ('happy', 'ok') on the sink, "
            "which lacks ('sad')",
            "type public.span is a range of timestamp without time zone on the source but a range of timestamp with "
            "time zone on the sink",
        ]
        wait_for(lambda: sum(all(t in e for t in told) for e in errors(streaming)) >= len(sinks), 30, "the refusal")
        assert all(s.query("SELECT to_regclass('public.moods')") == [(None,)] for s in sinks)  # nothing applied
        on_every_site(
            sinks,
            "DROP DOMAIN public.money4; CREATE DOMAIN public.money4 AS numeric(12,4); "
            "ALTER TYPE public.mood ADD VALUE 'meh'; ALTER TYPE public.mood ADD VALUE 'sad'; "
            "DROP TYPE public.span; CREATE TYPE public.span AS RANGE (subtype = timestamp)",
        )
        streaming.streaming()
        source.query("INSERT INTO public.moods VALUES (2, '{9.8765}', 'happy', NULL)")
        arrived(source, sinks, "public.moods", "the rows, once the sinks' types take the source's values")
    assert all(s.query("SELECT m[1]::text FROM public.moods ORDER BY id") == [("1.2345",), ("9.8765",)] for s in sinks)


def test_an_enum_label_added_at_the_source_while_streaming_is_refused_naming_the_type_then_arrives_once_the_sink_has_it(
    lr_sites,
):
    """A label added to the source's enum after the snapshot, and a row using it: the sinks refuse the
    batch, nothing applied, saying a type of the table differs (before: that the sink's table had a
    constraint, trigger or privilege the source's has not, where none is to blame); once the sinks'
    enum has the label the row arrives."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TYPE public.mood AS ENUM ('sad', 'ok')")
    source.query("CREATE TABLE public.feelings (id int PRIMARY KEY, m public.mood)")
    source.query("INSERT INTO public.feelings VALUES (1, 'ok')")
    federate(source, "public.feelings")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        arrived(source, sinks, "public.feelings", "the snapshot")
        source.query("ALTER TYPE public.mood ADD VALUE 'angry'")
        source.query("INSERT INTO public.feelings VALUES (2, 'angry')")
        told = 'invalid input value for enum mood: "angry". Nothing of the batch was applied; a value of the source'
        wait_for(lambda: sum(told in e and "an enum lacking a label" in e for e in errors(streaming)) >= 1, 30, "it")
        on_every_site(sinks, "ALTER TYPE public.mood ADD VALUE 'angry'")
        arrived(source, sinks, "public.feelings", "the row, once the sinks' enum has the label")


def test_a_composite_the_source_reorders_while_streaming_is_refused_naming_it_then_arrives_once_the_sinks_reorder_it(
    lr_sites,
):
    """The source reorders public.pair's attributes while public.pairs streams (a column of it, and an
    array of it): the changes made since are refused, naming the type and both definitions, with
    nothing applied; once the sinks reorder theirs alike, they arrive as they are. Before, (b, a)
    values arrived by position into the sinks' (a, b): a = 20 where the source has 10, silently."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TYPE public.pair AS (a int, b int)")
    source.query("CREATE TABLE public.pairs (id int PRIMARY KEY, p public.pair, ps public.pair[])")
    source.query("INSERT INTO public.pairs VALUES (1, ROW(1, 2), ARRAY[ROW(1, 2)::public.pair])")
    federate(source, "public.pairs")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        arrived(source, sinks, "public.pairs", "the snapshot")
        source.query("UPDATE public.pairs SET p = ROW(3, 4)")  # a change the stream takes before the reorder
        arrived(source, sinks, "public.pairs", "a change before the reorder")
        source.query("ALTER TYPE public.pair DROP ATTRIBUTE a, ADD ATTRIBUTE a int")  # now (b, a)
        source.query("INSERT INTO public.pairs VALUES (2, ROW(20, 10), ARRAY[ROW(40, 30)::public.pair])")
        refused = "type public.pair is (b integer, a integer) on the source but (a integer, b integer) on the sink"
        wait_for(lambda: status_text(source).count(refused) == 2, 30, "each sink's refusal in lr status")
        assert all(s.query("SELECT count(*) FROM public.pairs") == [(1,)] for s in sinks)  # nothing of it applied
        on_every_site(sinks, "ALTER TYPE public.pair DROP ATTRIBUTE a, ADD ATTRIBUTE a int")
        source.query("INSERT INTO public.pairs VALUES (3, NULL, NULL)")
        arrived(source, sinks, "public.pairs", "the changes, once the sinks reordered the type")
    assert all(s.query("SELECT (p).a, (ps[1]).a FROM public.pairs WHERE id = 2") == [(10, 30)] for s in sinks)


def test_a_composite_a_sink_reorders_while_streaming_is_refused_naming_it_then_arrives_once_reordered_back(lr_sites):
    """A sink reorders public.pair while public.pairs streams (the source's is unchanged): its changes
    are refused, naming the type and both definitions, nothing applied; once the sink's type is the
    source's again they arrive as they are. Before, (10, 20) arrived as a = 20, silently: the sink's
    composites were compared at the snapshot only (V0052 records them then)."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TYPE public.pair AS (a int, b int)")
    source.query("CREATE TABLE public.pairs (id int PRIMARY KEY, p public.pair)")
    source.query("INSERT INTO public.pairs VALUES (1, ROW(1, 2))")
    federate(source, "public.pairs")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        arrived(source, sinks, "public.pairs", "the snapshot")
        source.query("INSERT INTO public.pairs VALUES (4, ROW(5, 6))")  # the stream's own path, read once
        arrived(source, sinks, "public.pairs", "a change before the sinks' reorder")
        on_every_site(sinks, "ALTER TYPE public.pair DROP ATTRIBUTE a, ADD ATTRIBUTE a int")  # now (b, a) there
        source.query("INSERT INTO public.pairs VALUES (2, ROW(10, 20))")
        refused = "type public.pair is (a integer, b integer) on the source but (b integer, a integer) on the sink"
        wait_for(lambda: status_text(source).count(refused) == len(sinks), 30, "each sink's refusal in lr status")
        assert all(s.query("SELECT count(*) FROM public.pairs WHERE id = 2") == [(0,)] for s in sinks)
        on_every_site(sinks, "ALTER TYPE public.pair DROP ATTRIBUTE b, ADD ATTRIBUTE b int")  # (a, b) again
        source.query("INSERT INTO public.pairs VALUES (3, NULL)")
        later = "SELECT x::text FROM public.pairs x WHERE id IN (2, 3) ORDER BY id"  # (the ALTERs emptied 1 and 4's)
        wait_for(lambda: all(s.query(later) == source.query(later) for s in sinks), 30, "the changes, in place")
    assert all(s.query("SELECT (p).a FROM public.pairs WHERE id = 2") == [(10,)] for s in sinks)  # never 20


def test_a_parent_key_change_the_source_cascades_on_update_to_a_federated_child_arrives_at_sinks_with_its_foreign_key(
    lr_sites,
):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(
        lr_sites,
        "CREATE TABLE public.parents (id int PRIMARY KEY, name text); "
        "CREATE TABLE public.kids (id int PRIMARY KEY, parent int REFERENCES public.parents ON UPDATE CASCADE)",
    )
    source.query(
        "INSERT INTO public.parents VALUES (1, 'p1'), (2, 'p2'); INSERT INTO public.kids VALUES (10, 1), (20, 2)"
    )
    federate(source, "public.parents")
    federate(source, "public.kids")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        arrived(source, sinks, "public.kids", "the snapshot")
        source.query("UPDATE public.parents SET id = 100 WHERE id = 1")
        wait_for(
            lambda: errors(streaming) or all(texts(s, "public.kids") == texts(source, "public.kids") for s in sinks),
            30,
            "the cascade or a refusal",
        )
        assert errors(streaming) == []
        assert all(texts(s, "public.parents") == texts(source, "public.parents") for s in sinks)


def test_a_parent_key_change_cascaded_on_update_arrives_at_sinks_whose_foreign_key_is_deferrable_or_cascades_deletes(
    lr_sites,
):
    """The known limit's two ways round it (docs/tables.md): site-b's foreign key is DEFERRABLE (checked
    at the apply's commit), site-c's cascades deletes too (the child's change brings its rows back)."""
    source, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TABLE public.parents (id int PRIMARY KEY, name text)")
    for site, rule in ((source, ""), (site_b, " DEFERRABLE"), (site_c, " ON DELETE CASCADE")):
        site.query(
            "CREATE TABLE public.kids (id int PRIMARY KEY, parent int REFERENCES public.parents "
            f"ON UPDATE CASCADE{rule})"
        )
    source.query(
        "INSERT INTO public.parents VALUES (1, 'p1'), (2, 'p2'); INSERT INTO public.kids VALUES (10, 1), (20, 2)"
    )
    federate(source, "public.parents")
    federate(source, "public.kids")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        source.query("UPDATE public.parents SET id = id + 100")
        arrived(source, [site_b, site_c], "public.parents", "the parents' new keys")
        arrived(source, [site_b, site_c], "public.kids", "the children's cascaded references")
    assert errors(streaming) == []


def test_a_sink_table_with_inheritance_children_is_refused_naming_them_and_its_children_s_rows_are_kept(lr_sites):
    """site-b's table has an inheritance child holding rows of its own before the snapshot; site-c's is
    given one while the table streams. A DELETE of a table reaches its children's rows: the snapshot's
    clearing deleted site-b's own rows, silently, and a source's delete of key 2 deleted site-c's. Each
    is refused now, naming the children and the ALTER that takes them out, nothing applied, the
    children's rows kept; once out of the hierarchy, the rows arrive. (A partitioned sink table is fine.)"""
    source, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TABLE public.acc (id int PRIMARY KEY, v text)")
    site_b.query(
        "CREATE TABLE public.acc_b (note text) INHERITS (public.acc); INSERT INTO public.acc_b VALUES (2, 'b')"
    )
    source.query("INSERT INTO public.acc SELECT g, 'v' || g FROM generate_series(1, 3) g")
    federate(source, "public.acc")
    children = "SELECT id, v FROM ONLY public.{} ORDER BY id"
    with streaming_over(topo, lr_sites) as streaming:
        told = "the sink's table public.acc has inheritance children (public.acc_{0}): "
        fix = "(ALTER TABLE public.acc_{0} NO INHERIT public.acc)"
        refused = lambda s: any(told.format(s) in e and fix.format(s) in e for e in errors(streaming))  # noqa: E731
        wait_for(lambda: refused("b"), 30, "site-b's refusal of the snapshot")
        arrived(source, [site_c], "public.acc", "site-c's snapshot")
        site_c.query("CREATE TABLE public.acc_c () INHERITS (public.acc); INSERT INTO public.acc_c VALUES (2, 'c')")
        source.query("DELETE FROM public.acc WHERE id = 2")
        wait_for(lambda: refused("c"), 30, "site-c's refusal of the delete")
        assert site_b.query(children.format("acc_b")) == [(2, "b")] and site_c.query(children.format("acc_c")) == [
            (2, "c")
        ]
        assert site_b.query("SELECT count(*) FROM ONLY public.acc") == [(0,)]  # nothing of the snapshot applied
        site_b.query("ALTER TABLE public.acc_b NO INHERIT public.acc")
        site_c.query("ALTER TABLE public.acc_c NO INHERIT public.acc")
        arrived(source, [site_b, site_c], "public.acc", "the rows, once the children are out of the hierarchy")
    assert site_b.query(children.format("acc_b")) == [(2, "b")] and site_c.query(children.format("acc_c")) == [(2, "c")]


def test_a_column_generated_at_one_site_only_is_refused_saying_so_not_missing_then_arrives_once_alike(lr_sites):
    """site-b's g is generated where the source's is an ordinary column; site-c's h is ordinary where
    the source's is generated. Each refusal says which is generated where and what to do (before: g
    "is missing on the sink", h "exists only on the sink", where both sites have both)."""
    source, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    source.query("CREATE TABLE public.g (id int PRIMARY KEY, a int, g int, h int GENERATED ALWAYS AS (a * 3) STORED)")
    site_b.query(
        "CREATE TABLE public.g (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a * 2) STORED, "
        "h int GENERATED ALWAYS AS (a * 3) STORED)"
    )
    site_c.query("CREATE TABLE public.g (id int PRIMARY KEY, a int, g int, h int)")
    source.query("INSERT INTO public.g (id, a, g) VALUES (1, 1, 7)")
    federate(source, "public.g")
    told = (
        "column g is generated on the sink but not on the source (its rows carry the source's values, which no "
        "write may give a generated column: ALTER TABLE public.g ALTER COLUMN g DROP EXPRESSION",
        "column h is generated on the source but not on the sink (each site computes a generated column",
    )
    with streaming_over(topo, lr_sites) as streaming:
        wait_for(lambda: all(any(t in e for e in errors(streaming)) for t in told), 30, "both refusals")
        site_b.query("ALTER TABLE public.g ALTER COLUMN g DROP EXPRESSION")
        site_c.query("ALTER TABLE public.g DROP COLUMN h, ADD COLUMN h int GENERATED ALWAYS AS (a * 3) STORED")
        arrived(source, [site_b, site_c], "public.g", "the rows, once the sinks' columns are the source's")
