"""After `lr failover --promote site-b`, site-b's applications write the federated tables it took over
as they wrote them at site-a: an insert that relies on the id's default (a ``serial``, an identity)
draws a value past every replicated row, in a table lr created at site-b and in one the user created
there with ``serial`` alike, and replication from site-b carries it on."""

from __future__ import annotations

from airflow_provider_lr import cli
from airflow_provider_lr.engine.site import failover
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.cli.test_cli_sync import topology_file
from tests.engine.site.test_failover import PROVIDERS, _connect, replicator
from tests.support.session import App, apply, lr_sync_process, wait_for
from tests.support.tables import federate, rows

SYNC = ["--until-idle", "--cycles", "10", "--interval", "0.01"]
ORDERS = (  # created by lr at the sinks
    "CREATE TABLE public.orders (id serial PRIMARY KEY, ref bigint GENERATED ALWAYS AS IDENTITY, "
    "code text NOT NULL UNIQUE, qty int NOT NULL DEFAULT 1 CHECK (qty > 0)); "
    "CREATE INDEX orders_qty ON public.orders (qty)"
)
TICKETS = "CREATE TABLE public.tickets (id serial PRIMARY KEY, body text)"  # created by the user on every site


def write(site, first: int, last: int) -> None:
    """Application inserts that rely on the defaults (codes ``c<first>`` .. ``c<last>``)."""
    site.query(
        "INSERT INTO public.orders (code) SELECT 'c' || g FROM generate_series(%s, %s) g; "
        "INSERT INTO public.tickets (body) SELECT 't' || g FROM generate_series(%s, %s) g",
        (first, last, first, last),
    )


def tables_at(site) -> tuple:
    return rows(site, "public.orders"), rows(site, "public.tickets")


def setup(lr_sites) -> None:
    """site-a holds both tables (10 rows each, written by their defaults) and federates them;
    site-b and site-c hold the user's own ``tickets``."""
    site_a, site_b, site_c = lr_sites
    site_a.query(ORDERS)
    for site in lr_sites:
        site.query(TICKETS)
    write(site_a, 1, 10)
    federate(site_a, "public.orders")
    federate(site_a, "public.tickets")


def test_after_a_switchover_while_lr_sync_streams_site_bs_inserts_by_default_do_not_collide(
    lr_sites, tmp_path, monkeypatch, capsys
):
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    for site in lr_sites:
        App(site).close()  # the application's own table, which the client's full-sync provider reads
    setup(lr_sites)
    with lr_sync_process(topo, site_a):
        write(site_a, 11, 20)  # streamed as changes
        wait_for(lambda: tables_at(site_b) == tables_at(site_c) == tables_at(site_a), 30, "the streamed rows")
    assert site_b.query("SELECT count(*) FROM pg_indexes WHERE indexname = 'orders_qty'") == [(1,)]

    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(new)]) == 0
    assert "planned switchover" in capsys.readouterr().out
    assert site_b.query("INSERT INTO public.orders (code) VALUES ('at b') RETURNING id, ref") == [(21, 21)]
    assert site_b.query("INSERT INTO public.tickets (body) VALUES ('at b') RETURNING id") == [(21,)]
    write(site_b, 22, 25)
    assert cli.main(["sync", "--topology", str(new), *SYNC]) == 0
    assert tables_at(site_c) == tables_at(site_b)
    assert site_c.query("SELECT max(id) FROM public.orders") == [(25,)]


def test_an_unplanned_failover_moves_the_promoted_sites_sequences_past_the_replicated_rows(lr_sites):
    site_a, site_b, site_c = lr_sites
    topo = apply(lr_sites)
    App(site_a).close()
    App(site_b).close()
    setup(lr_sites)
    for site in lr_sites:  # a serial named like a column of pg_sequence, which the promotion reads beside
        site.query("ALTER TABLE public.tickets ADD COLUMN seqmax serial")  # the table: before, it failed
    site_a.query("DELETE FROM public.orders WHERE id > 7; DELETE FROM public.tickets WHERE id < 4")  # gaps
    run_until_idle(replicator(topo, lr_sites, providers=PROVIDERS))
    assert tables_at(site_b) == tables_at(site_a)
    assert site_b.query("SELECT nextval('public.tickets_id_seq')") == [(1,)]  # the user's, drawn at site-b before
    # site-a is lost
    result = failover.promote(failover.FailoverRequest("site-a", "site-b"), _connect(lr_sites, down=("site-a",)))
    assert result.tables == {"policy": ["public.orders", "public.tickets"]}
    assert site_b.query("INSERT INTO public.orders (code) VALUES ('at b') RETURNING id, ref") == [(8, 8)]
    assert site_b.query("INSERT INTO public.tickets (body) VALUES ('at b') RETURNING id, seqmax") == [(11, 11)]
    run_until_idle(
        replicator(result.topology, lr_sites, providers=PROVIDERS, sessions=[SessionKey("site-b", "site-c", "policy")])
    )
    assert tables_at(site_c) == tables_at(site_b)
