"""One table federated from two sources into one sink, streamed by ``lr sync``'s default mode
(docs/tables.md, "Two sources, one table"): the sink's UNIQUE constraint holds over both sources'
rows, which neither source checked. A row of the second source that collides with the first's is
refused, naming the table and the constraint in ``lr status``, and nothing of its batch is applied;
once the values differ it arrives, once."""

from __future__ import annotations

import time

from tests.guarantees.test_table_fidelity_streaming import FAST
from tests.support.session import Streaming, replicator, wait_for
from tests.support.tables import federate, on_every_site, rows, status_text, two_sources_into_one_sink

PEOPLE = "CREATE TABLE public.members (id int PRIMARY KEY, email text NOT NULL UNIQUE)"


def test_rows_of_two_sources_colliding_on_a_unique_column_refuse_the_later_one_saying_so_until_they_differ(lr_sites):
    a, b, sink = lr_sites
    topo = two_sources_into_one_sink(lr_sites)
    on_every_site(lr_sites, PEOPLE)
    a.query("INSERT INTO public.members VALUES (1, 'ann@a')")
    b.query("INSERT INTO public.members VALUES (100, 'bob@b')")
    federate(a, "public.members")
    federate(b, "public.members")
    with Streaming(replicator(topo, lr_sites, lease_seconds=2.0), FAST) as streaming:
        streaming.streaming()
        both = lambda: sorted(rows(a, "public.members") + rows(b, "public.members"))  # noqa: E731
        wait_for(lambda: rows(sink, "public.members") == both(), 30, "both sources' rows")
        b.query("INSERT INTO public.members VALUES (101, 'ann@a')")  # a's email, under b's key
        b.query("INSERT INTO public.members VALUES (102, 'cy@b')")  # after it: held behind it
        said = "the sink refused table public.members"
        wait_for(lambda: said in status_text(b), 20, "lr status at site-b to name the refusal")
        shown = status_text(b)
        assert "members_email_key" in shown and "site-b->site-c/policy" in shown, shown
        watch = b.connect()
        watch.autocommit = True
        with watch.cursor() as cur:  # said as long as it holds: each cycle that retries the batch keeps saying it
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                cur.execute("SELECT last_error FROM lr.source_sessions WHERE sink_site_id = 'site-c'")
                assert said in (cur.fetchone()[0] or ""), "lr status stopped saying why the session is held"
        watch.close()
        assert "last error" not in status_text(a)  # only the colliding source is held back
        a.query("UPDATE public.members SET email = 'ann@elsewhere' WHERE id = 1")
        wait_for(lambda: rows(sink, "public.members") == both(), 30, "b's rows once the values differ")
        wait_for(lambda: said not in status_text(b), 20, "the refusal to clear")
    assert sink.query("SELECT count(*) FROM public.members") == [(4,)]
