"""A sink's apply of a federated table's changes on a connection that keeps the site's search_path
(an engine API caller's own connection handed to the ``Replicator``, docs/security.md): the
statements name every function with its schema and compare keys with ``OPERATOR(pg_catalog.=)``,
so a lookalike a role with CREATE on ``public`` planted there is never run as the replicator."""

from __future__ import annotations

from tests.engine.site.test_roles import made, sites_as  # noqa: F401
from tests.support.session import apply, replicator
from tests.support.tables import federate, on_every_site, rows, sync

# a better match than pg_catalog's jsonb_populate_record(anyelement, jsonb) for lr's
# jsonb_populate_record(NULL::public.items, ...): exact types win over a polymorphic built-in, so
# it ran, as the replicator, wherever public was on the path
_LOOKALIKE = """CREATE FUNCTION public.jsonb_populate_record(public.items, jsonb) RETURNS public.items
LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'lookalike called as %%', current_user; END $$;
CREATE FUNCTION public.mood_eq(public.mood, public.mood) RETURNS boolean
LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'lookalike = called as %%', current_user; END $$;
CREATE OPERATOR public.= (LEFTARG = public.mood, RIGHTARG = public.mood, FUNCTION = public.mood_eq);
CREATE OPERATOR public.<> (LEFTARG = public.mood, RIGHTARG = public.mood, FUNCTION = public.mood_eq)"""
# and operators on a key of the application's enum: exact types beat pg_catalog's =(anyenum, anyenum)


def test_a_sinks_apply_on_a_connection_keeping_the_sites_path_runs_no_lookalike_of_public(lr_sites, made):
    source, sink = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    repl, planter = made.name("repl"), made.name("planter")
    for site in (source, sink):
        made.grant(site, "replicator", repl)
    on_every_site(
        [source, sink],
        "CREATE TABLE public.items (id int PRIMARY KEY, v text); CREATE TYPE public.mood AS ENUM ('calm', 'glad', 'sad'); "
        "CREATE TABLE public.moods (k public.mood PRIMARY KEY, v text)",
    )
    source.query(f'GRANT SELECT ON public.items, public.moods TO "{repl}"')
    sink.query(f'GRANT SELECT, INSERT, UPDATE, DELETE ON public.items, public.moods TO "{repl}"')
    sink.query(f'CREATE ROLE "{planter}"; GRANT CREATE ON SCHEMA public TO "{planter}"')
    sink.query(f'SET ROLE "{planter}"; {_LOOKALIKE}')
    source.query("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 3) g")
    source.query("INSERT INTO public.moods VALUES ('calm', 'c'), ('glad', 'g')")
    federate(source, "public.items")
    federate(source, "public.moods")
    run = replicator(topo, sites_as(lr_sites[:2], repl), providers={"policy": lambda ctx: None})  # plain connects
    try:
        sync(run)
        source.query("UPDATE public.items SET v = 'changed' WHERE id = 2; DELETE FROM public.items WHERE id = 3")
        source.query("UPDATE public.moods SET k = 'sad' WHERE k = 'glad'; DELETE FROM public.moods WHERE k = 'calm'")
        errors = [r.error for r in sync(run) if r.error]
    finally:
        run.close()
    assert not errors, errors[0]
    assert rows(sink, "public.items") == rows(source, "public.items") == [("(1,v1)",), ("(2,changed)",)]
    assert rows(sink, "public.moods") == rows(source, "public.moods") == [("(sad,g)",)]
