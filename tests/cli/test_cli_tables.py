"""`lr tables open/list` and what `lr status` says of tables, through the CLI as a user runs it."""
from __future__ import annotations

from airflow_provider_lr import cli
from tests.cli.test_cli_sync import topology_file
from tests.support.tables import create_accounts, rows


def test_lr_tables_open_replicates_a_table_and_status_and_list_show_it(lr_sites, tmp_path, monkeypatch, capsys):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(source, rows=25)
    create_accounts(sink_c)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--no-federated",
                     "--site", "site-c", "--topology", topo]) == 0
    assert cli.main(["tables", "open", "accounts", "--client", "policy", "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert "site-c: public.accounts not federated client=policy" in out
    assert "site-a: public.accounts federated client=policy" in out
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert rows(sink_b) == rows(source)
    assert rows(sink_c) == []
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert "public.accounts" in out and "synced from site-a->site-b/policy, 25 rows in its snapshot" in out
    assert "conflict from site-a->site-c/policy" in out
    assert cli.main(["tables", "list", "--topology", topo]) == 0
    listed = capsys.readouterr().out
    assert "site-b:\n  public.accounts federated client=policy (from site-a)" in listed


def test_lr_tables_open_names_what_is_wrong(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    assert cli.main(["tables", "open", "public.nothing", "--client", "policy", "--topology", topo]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["tables", "open", "Bad Name", "--client", "policy", "--topology", topo]) == 1
    assert "schema.table" in capsys.readouterr().err
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--no-federated",
                     "--topology", topo]) == 1
    assert "--site" in capsys.readouterr().err


def test_lr_sync_counts_the_rows_of_table_snapshots_it_wrote(lr_sites, tmp_path, monkeypatch, capsys):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(source, rows=1000)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    capsys.readouterr()
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert rows(sink_b) == rows(source) == rows(sink_c)
    for sink in ("site-b", "site-c"):
        line = next(line for line in out.splitlines()
                    if line.startswith(f"site-a->{sink}/policy") and "table rows=" in line)
        assert "table rows=1000 (public.accounts: synced)" in line, out
