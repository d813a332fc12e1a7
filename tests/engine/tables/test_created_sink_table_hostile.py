"""The source's definition is text that lr runs at the sink: a name or a literal the source's users
chose cannot make it run a statement of its own, nor call a function of the sink's other than the
one the source's text names, whatever the sink's settings (its ``search_path``, its
``standard_conforming_strings``)."""

from __future__ import annotations

from tests.engine.tables.test_created_sink_table import DESCRIBE
from tests.support.session import apply, replicator
from tests.support.tables import cycle_errors, federate, rows, sync

VICTIM = "CREATE TABLE public.victim (id int PRIMARY KEY)"  # at the sinks: what an injection would drop
DROP = "DROP TABLE public.victim; --"
# a literal that, read with backslashes as escapes, would end the CHECK and run DROP
NOTES = f"""
CREATE TABLE public.notes (
    id int PRIMARY KEY,
    "x""; {DROP}" text DEFAULT E'\\\\'')); {DROP}',
    body text NOT NULL,
    CONSTRAINT "c$$; {DROP}" CHECK (body <> E'\\\\'')); {DROP}')
);
CREATE INDEX "i""; {DROP} $$" ON public.notes (body) WHERE body <> E'\\\\'')); {DROP}'"""


def described(site, table: str) -> list[tuple]:
    """``DESCRIBE`` as PostgreSQL prints it with ``search_path`` set to ``pg_catalog`` (every function
    outside it with its schema) and standard strings, whatever the site's own settings."""
    return site.query(f"SET search_path = pg_catalog; SET standard_conforming_strings = on; {DESCRIBE}", {"t": table})


def hostile_sinks(sinks, setting: str) -> None:
    """Each sink's database has ``setting`` for every new connection (lr's too), and a victim table."""
    for sink in sinks:
        sink.query(f"ALTER DATABASE {sink.dbname} SET {setting}; {VICTIM}")


def test_a_literal_with_a_backslash_cannot_end_the_statement_at_a_sink_without_standard_strings(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    hostile_sinks(sinks, "standard_conforming_strings = off")
    source.query(NOTES)
    source.query("INSERT INTO public.notes (id, body) VALUES (1, 'one')")
    federate(source, "public.notes")
    assert not cycle_errors(sync(replicator(topo, lr_sites)))
    for sink in sinks:
        assert sink.query("SELECT to_regclass('public.victim') IS NOT NULL") == [(True,)]
        assert described(sink, "public.notes") == described(source, "public.notes")
        assert rows(sink, "public.notes") == rows(source, "public.notes")


def test_a_function_planted_in_the_sinks_search_path_is_not_what_the_created_table_calls(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    hostile_sinks(sinks, "search_path = public, pg_catalog")
    for sink in sinks:  # runs as whoever writes the table, lr's replicator at the sink
        sink.query("CREATE FUNCTION public.lower(text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT 'planted' $$")
    source.query(
        "CREATE TABLE public.tags (id int PRIMARY KEY, name text NOT NULL DEFAULT lower('N'), "
        "CONSTRAINT lower_case CHECK (lower(name) = name)); CREATE UNIQUE INDEX tags_name ON public.tags (lower(name))"
    )
    source.query("INSERT INTO public.tags (id, name) VALUES (1, 'planted'), (2, 'x')")
    federate(source, "public.tags")
    assert not cycle_errors(sync(replicator(topo, lr_sites)))
    for sink in sinks:
        assert described(sink, "public.tags") == described(source, "public.tags")
        assert rows(sink, "public.tags") == rows(source, "public.tags")


def test_a_literal_whose_text_depends_on_the_sites_settings_means_the_same_in_the_table_created_at_a_sink(lr_sites):
    """The source's defaults, constraints and index predicates print some constants by the reading
    session's settings (an interval by ``IntervalStyle``; PostgreSQL prints dates and floats there
    in a form every session reads alike), and the sink read them by its own: before, a default of
    minus a day and two hours, printed ``'-1 2:00:00'`` by a source of the SQL standard's style, read
    minus a day plus two hours at the sink."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    source.query(
        f"ALTER DATABASE {source.dbname} SET DateStyle = 'SQL, DMY'; "
        f"ALTER DATABASE {source.dbname} SET IntervalStyle = 'sql_standard'; "
        f"ALTER DATABASE {source.dbname} SET extra_float_digits = -15"
    )
    hostile_sinks(sinks, "DateStyle = 'SQL, MDY'")
    source.query(
        "CREATE TABLE public.dated (id int PRIMARY KEY, d date NOT NULL DEFAULT '2026-01-02', "
        "i interval DEFAULT '-1 day -2 hours', f float8 DEFAULT 0.1234567890123, "
        "CONSTRAINT recent CHECK (d >= '2020-01-02')); CREATE INDEX dated_new ON public.dated (d) WHERE d > '2025-03-04'"
    )
    source.query("INSERT INTO public.dated (id) VALUES (1)")
    federate(source, "public.dated")
    assert not cycle_errors(sync(replicator(topo, lr_sites)))
    pinned = "SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'; SET extra_float_digits = 3; "
    for sink in sinks:
        assert sink.query(pinned + DESCRIBE, {"t": "public.dated"}) == source.query(
            pinned + DESCRIBE, {"t": "public.dated"}
        )
        read = pinned + "SELECT t::text FROM public.dated t"
        assert sink.query(read) == source.query(read) == [('(1,2026-01-02,"-1 days -02:00:00",0.1234567890123)',)]
