"""Bad input through the `lr` CLI, as a user types it: each refused with one line that says why,
exit 1, no traceback, and nothing half-written on any site."""

from __future__ import annotations

from airflow_provider_lr import cli
from tests.cli.test_cli_sync import topology_file

# Tables the statement-level capture triggers cannot follow whole (a write to a partition or an
# inheritance child fires only the triggers of the table it names), or that are not an application's.
NOT_CAPTURABLE = {
    "public.measures": "partitioned or a partition",
    "public.measures_2026": "partitioned or a partition",
    "public.animals": "inheritance parents or children",
    "public.cats": "inheritance parents or children",
    "public.animal_names": "not an ordinary table",
    "lr.log_entries": "lr's own tables",
    "lr.source_sessions": "lr's own tables",
    "pg_catalog.pg_class": "the system's own tables",
    "information_schema.tables": "the system's own tables",
}


def test_a_table_whose_changes_capture_would_miss_or_that_is_lrs_own_is_refused(lr_sites, tmp_path, monkeypatch, capsys):
    """Federating a partitioned table used to be accepted and lose every write made straight to a
    partition while `lr status` called the sinks consistent; lr's own log was accepted too (each
    entry then captured into the log again)."""
    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    source.query(
        "CREATE TABLE public.measures (id int, d date, PRIMARY KEY (id, d)) PARTITION BY RANGE (d); "
        "CREATE TABLE public.measures_2026 PARTITION OF public.measures FOR VALUES FROM ('2026-01-01') TO ('2027-01-01'); "
        "CREATE TABLE public.animals (id int PRIMARY KEY, name text); "
        "CREATE TABLE public.cats (PRIMARY KEY (id)) INHERITS (public.animals); "
        "CREATE VIEW public.animal_names AS SELECT id, name FROM public.animals"
    )
    for table, why in NOT_CAPTURABLE.items():
        capsys.readouterr()
        assert cli.main(["tables", "open", table, "--client", "policy", "--topology", topo]) == 1, table
        err = capsys.readouterr().err
        assert f"lr: site-a: table {table} cannot be federated: " in err and why in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert source.query("SELECT count(*) FROM lr.registry WHERE kind = 'table'") == [(0,)]
    assert source.query("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lr\\_capture\\_%%'") == [(0,)]
