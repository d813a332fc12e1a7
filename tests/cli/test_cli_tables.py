"""`lr tables open/list` and what `lr status` says of tables, through the CLI as a user runs it."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.engine import faults
from airflow_provider_lr.engine.session import lease
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store.topology import load
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.cli.test_cli_sync import topology_file
from tests.support.session import replicator, topology_doc, wait_for
from tests.support.subscriber import crash_and_restart
from tests.support.tables import create_accounts, rows


def test_lr_tables_open_replicates_a_table_and_status_and_list_show_it(lr_sites, tmp_path, monkeypatch, capsys):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(source, rows=25)
    create_accounts(sink_c)
    assert (
        cli.main(
            [
                "tables",
                "open",
                "public.accounts",
                "--client",
                "policy",
                "--no-federated",
                "--site",
                "site-c",
                "--topology",
                topo,
            ]
        )
        == 0
    )
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
    # what site-b holds: the copy, where from, its state (before: "federated", as if it were captured there)
    assert "site-b:\n  public.accounts copy from site-a client=policy: synced, 25 rows in its snapshot\n" in listed
    assert "site-c:\n  public.accounts not federated client=policy\n" in listed, listed


def test_lr_tables_open_names_what_is_wrong(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    assert cli.main(["tables", "open", "public.nothing", "--client", "policy", "--topology", topo]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["tables", "open", "Bad Name", "--client", "policy", "--topology", topo]) == 2  # usage
    assert "schema.table" in capsys.readouterr().err
    assert cli.main(["tables", "close", "Bad Name", "--topology", topo]) == 2
    assert "schema.table" in capsys.readouterr().err
    # quoted names (mixed case, spaces) are refused up front, saying what to do; a plain one of another schema opens
    source = lr_sites[0]
    source.query('CREATE SCHEMA sales; CREATE TABLE public."Orders" (id int PRIMARY KEY)')
    source.query(
        'CREATE TABLE sales."Line Items" (id int PRIMARY KEY); CREATE TABLE sales.line_items (id int PRIMARY KEY)'
    )
    for name in ('"Orders"', "public.Orders", 'sales."Line Items"', "public.x'; DROP TABLE y; --"):
        assert cli.main(["tables", "open", name, "--client", "policy", "--topology", topo]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lr: table name") and "a quoted name" in err and "RENAME TO" in err, err
    # an unlogged table: crash recovery empties it, firing no trigger (before: opened, and after a crash of the
    # source every sink kept the rows it lost, said synced)
    source.query("CREATE UNLOGGED TABLE public.scratch (id int PRIMARY KEY)")
    assert cli.main(["tables", "open", "public.scratch", "--client", "policy", "--topology", topo]) == 1
    assert "it is unlogged: a crash of this server empties it" in capsys.readouterr().err
    # a plain table of a quoted schema: the schema is what to rename (before: told to rename the table)
    assert cli.main(["tables", "open", '"Sales Dept".items', "--client", "policy", "--topology", topo]) == 2
    assert 'rename its schema to such a name first (ALTER SCHEMA "Sales Dept" RENAME TO' in capsys.readouterr().err
    assert source.query("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lr_capture%%'") == [(0,)]
    assert cli.main(["tables", "open", "sales.line_items", "--client", "policy", "--topology", topo]) == 0
    assert "site-a: sales.line_items federated" in capsys.readouterr().out
    assert (
        cli.main(["tables", "open", "public.accounts", "--client", "policy", "--no-federated", "--topology", topo]) == 2
    )
    assert "--site" in capsys.readouterr().err
    # no primary key: the unique index that can be it is named, with the statement (a NOT NULL one first)
    source.query("CREATE TABLE public.keyless (a int UNIQUE, b int NOT NULL, c int, UNIQUE (b, c))")
    source.query("CREATE UNIQUE INDEX keyless_b ON public.keyless (b)")
    source.query("CREATE TABLE public.bare (a int)")
    assert cli.main(["tables", "open", "public.keyless", "--client", "policy", "--topology", topo]) == 1
    err = capsys.readouterr().err
    assert "public.keyless has no primary key" in err and "ADD PRIMARY KEY USING INDEX keyless_b)" in err, err
    assert cli.main(["tables", "open", "public.bare", "--client", "policy", "--topology", topo]) == 1
    assert "public.bare has no primary key; lr applies changes by key, so it needs one" in capsys.readouterr().err


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
        line = next(
            line for line in out.splitlines() if line.startswith(f"site-a->{sink}/policy") and "table rows=" in line
        )
        assert "table rows=1000 (public.accounts: synced)" in line, out


def sync(topo: str) -> None:
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0


def test_lr_tables_close_stops_replicating_a_table_sinks_keep_their_copy_and_reopen_resumes(
    lr_sites, tmp_path, monkeypatch, capsys
):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(source, rows=10)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    sync(topo)
    assert rows(sink_b) == rows(source) == rows(sink_c)
    copy = rows(sink_b)
    capsys.readouterr()

    assert cli.main(["tables", "close", "public.accounts", "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert "site-a: public.accounts closed" in out and "site-b, site-c keep their copy" in out
    for sink in (sink_b, sink_c):  # each sink told: a failover promoting it leaves the table closed
        assert sink.query("SELECT source_site_id FROM lr.sink_tables WHERE closed_at_source") == [("site-a",)]
    assert source.query(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.accounts'::regclass AND tgname LIKE 'lr_capture%%'"
    ) == [(0,)]
    source.query("UPDATE public.accounts SET balance = balance + 1; DELETE FROM public.accounts WHERE id <= 3")
    before = source.query("SELECT count(*) FROM lr.log_entries")
    sync(topo)
    assert source.query("SELECT count(*) FROM lr.log_entries") == before  # nothing captured
    assert rows(sink_b) == copy == rows(sink_c)  # kept, no longer updated
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0
    status_out = capsys.readouterr().out
    assert "closed (captured no more; its sinks keep their copy" in status_out
    assert status_out.count("(closed at site-a: this copy is kept, no longer updated)") == 2
    assert status_out.count("public.accounts") == 3  # the source's registration and one line per sink
    assert cli.main(["status", "--json", "--topology", topo]) == 0
    found = json.loads(capsys.readouterr().out)["sites"]
    assert [
        t["closed"]
        for site in ("site-a", "site-b", "site-c")
        for t in found[site]["tables"]
        if t["role"] == "sink" or site == "site-a"
    ] == [True, True, True]
    assert cli.main(["tables", "list", "--topology", topo]) == 0
    listed = capsys.readouterr().out
    assert "site-a:\n  public.accounts closed" in listed
    for sink in ("site-b", "site-c"):  # each sink's copy, where from, its state, closed at its source
        assert (
            f"{sink}:\n  public.accounts copy from site-a client=policy: synced, 10 rows in its snapshot "
            "(closed at site-a: this copy is kept, no longer updated)\n"
        ) in listed, listed
    assert cli.main(["tables", "close", "public.accounts", "--topology", topo]) == 1  # captured nowhere now
    assert "captured on no site" in capsys.readouterr().err

    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    sync(topo)
    assert rows(sink_b) == rows(source) == rows(sink_c)
    source.query("UPDATE public.accounts SET owner = 'again' WHERE id = 5")
    sync(topo)
    assert rows(sink_b) == rows(source) == rows(sink_c)
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0
    assert "closed" not in capsys.readouterr().out


def test_lr_tables_list_reads_the_sites_it_reaches_and_names_the_one_it_cannot(lr_sites, tmp_path, monkeypatch, capsys):
    source, _, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(source)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    monkeypatch.setenv(
        "AIRFLOW_CONN_LR_TEST_SITE_B",
        '{"conn_type": "lr_site", "host": "127.0.0.1", "port": 1, '
        '"login": "postgres", "schema": "postgres", "extra": {"site_id": "site-b"}}',
    )
    capsys.readouterr()
    assert cli.main(["tables", "list", "--topology", topo]) == 2
    out = capsys.readouterr().out
    assert "site-a:\n  public.accounts federated client=policy" in out
    assert "site-b: UNREACHABLE (cannot connect to site 'site-b'" in out and "site-c: no tables registered" in out
    assert len(out.splitlines()) == 4  # the error on one line


def test_lr_tables_open_refuses_an_unknown_client_and_names_the_site_of_an_error(
    lr_sites, tmp_path, monkeypatch, capsys
):
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    capsys.readouterr()
    assert (
        cli.main(
            [
                "tables",
                "open",
                "public.accounts",
                "--no-federated",
                "--site",
                "site-c",
                "--client",
                "typo",
                "--topology",
                topo,
            ]
        )
        == 2  # a usage error
    )
    assert "unknown client 'typo'; the topology replicates policy" in capsys.readouterr().err
    assert lr_sites[2].query("SELECT count(*) FROM lr.registry WHERE kind = 'table'") == [(0,)]
    assert cli.main(["tables", "open", "public.missing", "--client", "policy", "--topology", topo]) == 1
    assert capsys.readouterr().err.startswith("lr: site-a: table public.missing does not exist on this site")


def test_status_calls_no_session_ready_until_its_sink_holds_every_table_its_source_federates(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """A table opened while the sessions run (or the snapshot of one after a full sync, which a
    large table makes last): until the sink has it, `lr status` says so on both ends instead of
    "ready" / "consistent" (it used to, while the sink's table was missing)."""
    source, sink_b, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={"policy": "tests.support.session:empty_provider"})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    create_accounts(source, rows=5)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0  # not degraded: a snapshot is under way
    out = capsys.readouterr().out
    assert out.count("not ready (table snapshot)") == 4, out  # both sinks, at the source and at the sink
    assert out.count("tables not synced at the sink yet: public.accounts") == 4, out
    assert not re.search(r"/policy +(ready|consistent) ", out), out
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo, "--json"]) == 0
    sessions = [s for site in json.loads(capsys.readouterr().out)["sites"].values() for s in site["sessions"]]
    assert sorted(s["readiness"] for s in sessions) == ["consistent"] * 2 + ["ready"] * 2
    assert rows(sink_b) == rows(source)

    # a full sync forced on site-b: until it is applied, neither end is called ready, its copy's
    # line says a new snapshot comes, and the transfer shows how far it is (before: "ready" and
    # "consistent" while the request waited; mid-transfer, the copy read "federated ... registered
    # by site-a", as if site-b captured the table)
    assert cli.main(["full-sync", "--topology", topo, "--sink", "site-b"]) == 0
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert (
        re.findall(r"site-b/policy +(not ready \(full sync requested\)) ", out)
        == ["not ready (full sync requested)"] * 2
    ), out
    assert re.findall(r"site-c/policy +(ready|consistent) ", out) == ["ready", "consistent"], out
    assert (
        "synced from site-a->site-b/policy, 5 rows in its snapshot (a new snapshot comes with the full sync requested)"
        in out
    ), out
    assert cli.main(["tables", "list", "--topology", topo]) == 0  # and lr tables list, alike
    out = capsys.readouterr().out
    assert out.count("(a new snapshot comes with the full sync requested at site-a)") == 1, out
    assert "copy from site-a client=policy: synced, 5 rows in its snapshot (a new snapshot comes" in out, out
    seen: list[str] = []

    def look() -> None:
        assert cli.main(["status", "--topology", topo]) == 0
        assert cli.main(["tables", "list", "--topology", topo]) == 0
        seen.append(capsys.readouterr().out)

    with faults.on_fault("before_snapshot_apply", look):
        assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert (
        len(seen) == 1
        and "not ready (snapshot)" in seen[0]
        and not re.search(r"site-b/policy +(ready|consistent) ", seen[0])
    ), seen
    assert re.search(
        r"waiting for the transfer and apply of full sync \S+ \(2 of its 2 entries at the sink\)", seen[0]
    ), seen
    assert (
        "registered by site-a, client policy: no copy held now (its snapshot comes with the full sync under way)"
        in seen[0]
    ), seen
    assert "no copy held now (a new snapshot comes with the full sync requested at site-a)" in seen[0], seen
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo, "--json"]) == 0
    sessions = [s for site in json.loads(capsys.readouterr().out)["sites"].values() for s in site["sessions"]]
    assert sorted(s["readiness"] for s in sessions) == ["consistent"] * 2 + ["ready"] * 2


def test_a_copy_federated_onward_from_its_sink_replicates_both_ways_with_no_provider_and_shows_as_federated(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """site-a federates public.accounts to site-b and site-c (client policy); site-b opens its copy for
    client back, which it replicates to site-a and site-c: the table is federated both ways, each
    client of tables only (no provider). Before, site-b's registry row still named site-a (the copy's
    origin), so back was taken for a client with queue data: its full syncs waited for a provider's
    data forever and site-b's changes never left; `lr status` and `lr tables list` showed site-b's
    table only as a copy, and `lr tables close` skipped it."""
    a, b, c = lr_sites
    topology_file(tmp_path, lr_sites, monkeypatch, providers={})  # the sites' connections
    doc = topology_doc(
        lr_sites,
        [
            {"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]},
            {"source": "site-b", "sinks": ["site-a", "site-c"], "clients": ["back"]},
        ],
        conn_ids=lambda site_id: f"lr_test_{site_id.replace('-', '_')}",
    )
    topo = str(tmp_path / "both-ways.yaml")
    Path(topo).write_text(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(a, rows=5)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    # back has nothing to carry yet: its sessions wait (exit 1) while policy's deliver the copies
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 1
    assert rows(b) == rows(a)
    assert cli.main(["tables", "open", "public.accounts", "--client", "back", "--topology", topo]) == 0
    b.query("UPDATE public.accounts SET owner = 'from-b' WHERE id = 1")
    a.query("UPDATE public.accounts SET owner = 'from-a' WHERE id = 2")
    sync(topo)
    assert rows(a) == rows(b) == rows(c)
    assert [r[0] for r in b.query("SELECT owner FROM public.accounts WHERE id IN (1, 2) ORDER BY id")] == [
        "from-b",
        "from-a",
    ]
    # site-b's own changes not sent back yet survive a full sync of site-a->site-b (its snapshot, read
    # before site-a had them, replaces site-b's copy; the sessions run in order, site-a's first): they
    # stay at site-b, the row it deleted stays deleted, and they reach site-a and site-c. Before, its
    # new rows vanished at site-b (and its deleted one came back) while site-a and site-c took them.
    b.query("INSERT INTO public.accounts (id, owner) VALUES (1000, 'b-new'), (1001, 'b-new')")
    b.query("UPDATE public.accounts SET owner = 'b-changed' WHERE id IN (3, 1001)")
    b.query("DELETE FROM public.accounts WHERE id = 4")
    own = "SELECT id, owner FROM public.accounts WHERE id = 4 OR owner LIKE 'b-%%' ORDER BY id"
    at_b = b.query(own)
    assert cli.main(["full-sync", "--sink", "site-b", "--client", "policy", "--topology", topo]) == 0
    sync(topo)
    assert b.query(own) == at_b == a.query(own)
    assert rows(a) == rows(b) == rows(c)
    # and the other way: site-a's own changes not at site-b yet survive a full sync of site-b->site-a
    # run before site-a->site-b delivers them (its upsert brought site-b's old rows back at site-a)
    a.query("INSERT INTO public.accounts (id, owner) VALUES (2000, 'a-new')")
    a.query("UPDATE public.accounts SET owner = 'a-changed' WHERE id = 5")
    a.query("DELETE FROM public.accounts WHERE id = 1")
    own = "SELECT id, owner FROM public.accounts WHERE id = 1 OR owner LIKE 'a-%%' ORDER BY id"
    at_a = a.query(own)
    assert cli.main(["full-sync", "--sink", "site-a", "--client", "back", "--topology", topo]) == 0
    back = replicator(load(topo), lr_sites, sessions=[SessionKey("site-b", "site-a", "back")])
    try:
        back.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        back.close()
    assert a.query(own) == at_a
    sync(topo)
    assert b.query(own) == at_a
    assert rows(a) == rows(b) == rows(c)
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0
    status_out = capsys.readouterr().out
    site_b = status_out[status_out.index("site-b:") : status_out.index("site-c:")]
    assert re.search(r"table  public\.accounts +federated, client back", site_b), site_b
    assert cli.main(["tables", "list", "--topology", topo]) == 0
    listed = capsys.readouterr().out
    assert "site-b:\n  public.accounts federated client=back (from site-a)\n" in listed, listed
    assert cli.main(["tables", "close", "public.accounts", "--topology", topo]) == 0
    closed = capsys.readouterr().out
    assert "site-a: public.accounts closed" in closed and "site-b: public.accounts closed" in closed, closed
    # closed everywhere, back is still a client of tables only: a full sync of it settles
    assert cli.main(["full-sync", "--sink", "site-c", "--client", "back", "--topology", topo]) == 0
    sync(topo)


def test_lr_tables_close_waits_for_a_sink_whose_full_sync_would_forget_its_copy_so_no_copy_lacks_changes(
    lr_sites, site_manager, tmp_path, monkeypatch, capsys
):
    """A full sync forced on site-c forgets its tables, which take a new snapshot after it; a table
    closed before that snapshot takes none, and site-c's copy lacked, for good, the changes made
    before the close that site-b's holds. The close is refused until site-c has taken it."""
    a, b, c = lr_sites
    c.query(f'ALTER DATABASE "{c.dbname}" SET synchronous_commit = on')  # durable across its restart below
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(a, rows=10)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    sync(topo)
    a.query("UPDATE public.accounts SET owner = 'before the close' WHERE id <= 5")
    assert cli.main(["full-sync", "--sink", "site-c", "--topology", topo]) == 0
    capsys.readouterr()
    assert cli.main(["tables", "close", "public.accounts", "--topology", topo]) == 1
    err = capsys.readouterr().err
    assert "public.accounts not closed at site-a: site-c has not taken its snapshot of it yet" in err, err
    assert "a full sync of it is still open; no replicator holds the session: run `lr sync`" in err, err
    keep_out = ["tables", "open", "public.accounts", "--client", "policy", "--no-federated", "--site", "site-a"]
    assert cli.main([*keep_out, "--topology", topo]) == 1  # stops the capture as a close does: the same rule
    assert "site-c has not taken its snapshot of it yet" in capsys.readouterr().err
    # a replicator holds site-c's session: the close waits for its snapshot. site-c restarting
    # meanwhile (stopped at once, then started) ended the close with one line at its next look (its
    # connection lost), though the replicator took the snapshot moments later; now it waits on
    holder = conn = a.connect()
    lease.acquire(conn, "site-c", "policy", "vm:1:holder")
    conn.close()
    looks: list[set] = []  # each look of the close's wait begins with the requests open
    requested = full_sync.sessions_requested
    monkeypatch.setattr(full_sync, "sessions_requested", lambda *a, **k: looks.append(requested(*a, **k)) or looks[-1])
    codes: list[int] = []
    closer = threading.Thread(
        target=lambda: codes.append(cli.main(["tables", "close", "public.accounts", "--topology", topo]))
    )
    closer.start()
    try:
        wait_for(lambda: any(("site-c", "policy") in look for look in looks), 30, "the close waiting for site-c")
        crash_and_restart(site_manager, c, lambda: True)  # its connection to site-c is gone for certain
        holder = replicator(load(topo), lr_sites, owner="vm:1:holder")
        holder.run_cycle()  # the full sync, then the table's snapshot, under the lease the close saw
    finally:
        closer.join(60)
        if holder is not conn:
            holder.close()
    assert codes == [0], capsys.readouterr()
    at_close = rows(a)
    a.query("UPDATE public.accounts SET owner = 'after the close' WHERE id = 10")
    sync(topo)
    assert rows(b) == rows(c) == at_close
    # a table dropped at the source before its sinks took it: no snapshot can, and closing frees them
    a.query("CREATE TABLE public.gone (id int PRIMARY KEY)")
    assert cli.main(["tables", "open", "public.gone", "--client", "policy", "--topology", topo]) == 0
    a.query("DROP TABLE public.gone")
    assert cli.main(["tables", "close", "public.gone", "--topology", topo]) == 0
    # an unforced request (a session's own, made in snapshot sync) forgets the tables too: the stream
    # leaves it to the cycles, and the close does not pass it
    a.query("CREATE TABLE public.more (id int PRIMARY KEY)")
    assert cli.main(["tables", "open", "public.more", "--client", "policy", "--topology", topo]) == 0
    sync(topo)
    conn = a.connect()
    try:
        full_sync.request_full_sync(conn, "site-b", "policy", "its own")
    finally:
        conn.close()
    capsys.readouterr()
    assert cli.main(["tables", "close", "public.more", "--topology", topo]) == 1
    assert "site-b has not taken its snapshot of it yet (a full sync of it is still open" in capsys.readouterr().err
