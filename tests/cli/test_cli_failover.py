"""`lr failover`: a planned switchover from the command line (the old source drained first, then
refused as a source), the new topology written for the operator, and `--rejoin`."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg2
import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import TransmitError
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables.definition import TableName
from tests.cli.test_cli_sync import topology_file
from tests.support.session import App, replicator, sink_queue, topology_doc, wait_for
from tests.support.tables import create_accounts, federate, rows

SYNC = ["--until-idle", "--cycles", "10", "--interval", "0.01"]


def test_a_planned_switchover_drains_the_old_source_then_refuses_its_writers(lr_sites, tmp_path, monkeypatch, capsys):
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(site_a)
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    for i in range(6):
        app.put(f"k{i}", i, ["site-b", "site-c"])  # committed at site-a, not replicated yet
    App(site_b).close()
    capsys.readouterr()
    running = replicator(topologies.load(topo), lr_sites)  # an `lr sync` started before the switch, with its file
    # its cycle in the middle of the switch: site-a drained (it runs the new topology), the sinks
    # fenced, site-b not promoted yet (it runs the old one): it was told to rejoin site-a, with its
    # own older file, though site-a was switched over, not failed over behind the others' back
    midway: list[str] = []

    def a_cycle() -> None:
        midway.extend(r.error or "" for r in running.run_cycle())

    new = tmp_path / "after.yaml"
    with on_fault("failover_after_fence", a_cycle):
        assert (
            cli.main(
                [
                    "failover",
                    "--topology",
                    topo,
                    "--promote",
                    "site-b",
                    "--reason",
                    "maintenance of site-a",
                    "--out",
                    str(new),
                ]
            )
            == 0
        )
    out = capsys.readouterr().out
    assert "planned switchover" in out and "site-b is the source of policy (was site-a)" in out
    assert len(midway) == 2 and all("predates the failover of site-a to site-b" in e for e in midway), midway
    assert not any("--rejoin" in e for e in midway), midway
    assert "lost: nothing" in out and str(new) in out
    # `lr status` with the old file: every site runs the new one, so the file is stale; it said to
    # rejoin site-a with that very file (which `lr failover --rejoin` refuses, exit 1)
    assert cli.main(["status", "--topology", topo]) == 1
    warned = capsys.readouterr().out
    assert f"topology file {topo} has id" in warned and "rejoin" not in warned and "apply" not in warned, warned
    assert "predates the failover of site-a to site-b: point --topology" in warned, warned
    expected = [f"k{i}={i}".encode() for i in range(6)]
    assert sink_queue(site_b, "policy") == expected and sink_queue(site_c, "policy") == expected  # drained
    with pytest.raises(  # a client made after the switch: told where its client went, not to edit the topology
        TransmitError,
        match="client 'policy' is not replicated from site 'site-a' any more: it is replicated from "
        "site site-b now: transmit there",
    ):
        RoutingQueueClient(site_a.connect(), "policy").transmit_log_entry_message(b"late", ["site-b"])
    with pytest.raises(
        psycopg2.Error, match="client policy is not replicated from this site any more: it is replicated"
    ):
        app.put("stale", 1, ["site-b", "site-c"])  # its client object loaded its routes before the switch
    app.conn.rollback()
    with app.conn.cursor() as cur:  # in the replica role as well (it skipped the guard: written, read by nobody)
        cur.execute("SET session_replication_role = replica")
    with pytest.raises(psycopg2.Error, match="client policy is not replicated from this site any more"):
        app.put("stale", 1, ["site-b", "site-c"])
    app.conn.rollback()
    # the old file, now that every site runs the new one: said to predate the failover, pointing at
    # the file it wrote; before, status said to rejoin site-a with it and the commands to apply it,
    # which both refuse
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 1
    said = capsys.readouterr().out
    assert "predates the failover of site-a to site-b" in said and "--rejoin" not in said, said
    assert cli.main(["sync", "--topology", topo, "--once"]) == 1
    said = capsys.readouterr().err
    assert "predates the failover of site-a to site-b" in said and "lr topology apply" not in said, said
    # and so does each session of the `lr sync` that was running (before: `apply the current file with
    # lr topology apply --topology <that file>`, cycle after cycle)
    errors = [r.error or "" for r in running.run_cycle()]
    running.close()
    assert len(errors) == 2 and all("predates the failover of site-a to site-b" in e for e in errors), errors
    assert not any("lr topology apply" in e or "--rejoin" in e for e in errors), errors

    App(site_b).put("b0", 0, ["site-c", "site-a"])
    assert cli.main(["sync", "--topology", str(new), *SYNC]) == 0
    assert sink_queue(site_c, "policy", source="site-b") == [b"b0=0"]
    assert cli.main(["failover", "--topology", str(new), "--rejoin", "site-a"]) == 0
    said = capsys.readouterr().out
    assert "0 entries committed here after the cut" in said
    # the switchover applied the topology there and site-b→site-a already delivered b0: no full sync
    # comes of the rejoin (it said one would)
    assert "it ran this topology already" in said and "full sync" not in said, said
    app.close()


def test_full_sync_wait_across_a_planned_switchover_follows_the_request_to_the_new_source(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """`lr full-sync --wait` asked of site-a, then site-a switched over to site-b: the switchover asks
    the full sync of site-b instead, and the wait follows it there until it is applied. Before, the
    wait said the request was cancelled ('session removed from the topology'), exit 1."""
    site_a, site_b, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(site_a)
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    App(site_b).close()  # site-b's provider's state
    command = ["full-sync", "--topology", topo, "--sink", "site-c", "--reason", "audit", "--wait", "90"]
    waited: list[int] = []
    waiting = threading.Thread(target=lambda: waited.append(cli.main(command)), daemon=True)
    waiting.start()
    asked = "SELECT count(*) FROM lr.full_sync_requests WHERE sink_site_id = 'site-c' AND reason = 'audit'"
    wait_for(lambda: site_a.query(asked) == [(1,)], 60, "the wait's request at site-a")
    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(new)]) == 0
    assert cli.main(["sync", "--topology", str(new), *SYNC]) == 0
    waiting.join(90)
    out = capsys.readouterr().out
    assert waited == [0], out
    assert "site-a->site-c/policy: failed over: asked of site-b as site-b->site-c/policy: full sync " in out, out
    assert " applied by " in out, out
    app.close()


def test_lr_failover_names_what_is_wrong(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    capsys.readouterr()
    assert cli.main(["failover", "--topology", topo, "--promote", "site-a"]) == 1
    assert "receives from no source; name the old source (--from" in capsys.readouterr().err
    assert cli.main(["failover", "--topology", topo, "--promote", "site-q"]) == 2
    assert "unknown site 'site-q'; the topology knows site-a, site-b, site-c" in capsys.readouterr().err
    assert cli.main(["failover", "--topology", topo, "--promote", "site-c", "--from", "site-b"]) == 1
    assert "is not a sink of 'site-b'" in capsys.readouterr().err
    # an --out that cannot be written: refused before anything is done (the failover ran, then the
    # write failed with a traceback, and the summary was never printed)
    applied = site_ids(lr_sites)
    (tmp_path / "a-file").write_text("")
    for out, why in ((tmp_path, "is a directory"), (tmp_path / "a-file" / "new.yaml", "is not a directory")):
        assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}" in err and why in err and "Traceback" not in err, err
    assert site_ids(lr_sites) == applied


def site_ids(sites) -> list:
    return [s.query("SELECT topology_config_id FROM lr.topology") for s in sites]


def test_a_failover_topology_written_over_a_planted_link_replaces_the_link_not_its_target(tmp_path):
    """The file a failover writes has a name known in advance (``topology-<id>.yaml``, beside the file
    an lr_failover task read): a symlink planted there made lr write through it, over any file the
    link named. It is written to a new file and moved into place: the link is replaced, its target
    untouched, and a reader never sees half a file."""
    topo = topologies.from_document(
        {
            "sites": [{"id": "site-a"}, {"id": "site-b"}],
            "replication": [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}],
        }
    )
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / f"topology-{topo.topology_config_id}.yaml"
    link.symlink_to(victim)
    assert topologies.write_document(topo, link) == link
    assert victim.read_text() == "precious\n" and not link.is_symlink()
    assert topologies.load(str(link)).topology_config_id == topo.topology_config_id
    assert oct(link.stat().st_mode & 0o777) == oct(0o644)  # readable by the Airflow components, as before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.parametrize("planned", ["--planned", "--no-planned"])
def test_a_failover_to_a_sink_without_a_consistent_copy_is_refused_with_nothing_done(
    lr_sites, tmp_path, monkeypatch, capsys, planned
):
    """Promoting a sink still in its first full sync (lr sync had not reached it yet): refused,
    "nothing was promoted". Before, the refusal came after a switchover had applied the new topology
    on the old source (its writers refused, its sessions gone) and after every sink was fenced
    against the old source: nothing replicated any more, and running it again was refused the same."""
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    applied = site_a.query("SELECT topology_config_id FROM lr.topology")
    app = App(site_a)
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    site_c.query("UPDATE lr.sink_sessions SET data_consistent = false")  # its first full sync not applied yet
    capsys.readouterr()
    assert cli.main(["failover", "--topology", topo, "--promote", "site-c", planned]) == 1
    assert "site 'site-c' holds no consistent copy of 'site-a''s client 'policy'" in capsys.readouterr().err
    assert site_a.query("SELECT topology_config_id FROM lr.topology") == applied
    for sink in (site_b, site_c):
        assert sink.query("SELECT failed_over_to FROM lr.sink_sessions") == [(None,)], sink.site_id
    app.put("k0", 0, ["site-b", "site-c"])  # the source's writers carry on
    app.close()
    assert cli.main(["sync", "--topology", topo, "--once"]) == 0
    assert sink_queue(site_b, "policy") == [b"k0=0"]


def test_a_planned_switchover_carries_federated_tables_and_refuses_the_old_sources_table_writers(
    lr_sites, tmp_path, monkeypatch, capsys
):
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(site_a, rows=20)
    federate(site_a)
    app = App(site_a)
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    site_a.query("UPDATE public.accounts SET owner = 'late' WHERE id <= 4")  # not replicated yet: drained
    site_a.query("DELETE FROM public.accounts WHERE id = 20")
    App(site_b).close()
    capsys.readouterr()

    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(new)]) == 0
    out = capsys.readouterr().out
    assert "planned switchover" in out and "lost: nothing" in out
    assert "policy: site-b captures its federated table(s) public.accounts" in out
    assert rows(site_b) == rows(site_a)  # the drain carried the table's last changes
    with pytest.raises(psycopg2.Error, match="replicated from site site-b since a failover"):
        site_a.query("UPDATE public.accounts SET owner = 'too late' WHERE id = 1")
    with pytest.raises(psycopg2.Error, match="replicated from site site-b since a failover"):  # a restore's role too
        site_a.query("SET session_replication_role = replica; UPDATE public.accounts SET owner = 'too late'")

    site_b.query("UPDATE public.accounts SET balance = 99 WHERE id <= 2")
    assert cli.main(["sync", "--topology", str(new), *SYNC]) == 0
    assert rows(site_c) == rows(site_b) == rows(site_a)
    assert cli.main(["status", "--topology", str(new)]) in (0, 1)
    assert "DIVERGED" not in capsys.readouterr().out
    app.close()


def sink_site(sites, site_id: str):
    return next(s for s in sites if s.site_id == site_id)


def both_ways(lr_sites, tmp_path, monkeypatch) -> str:
    """public.accounts federated both ways (site-a: client policy to site-b and site-c; site-b: its
    copy, client back, to site-a and site-c), every site holding every row; the topology file."""
    a, b, c = lr_sites
    topology_file(tmp_path, lr_sites, monkeypatch, providers={})  # the sites' connections
    both = tmp_path / "both-ways.yaml"
    both.write_text(
        yaml.safe_dump(
            topology_doc(
                lr_sites,
                [
                    {"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]},
                    {"source": "site-b", "sinks": ["site-a", "site-c"], "clients": ["back"]},
                ],
                conn_ids=lambda site_id: f"lr_test_{site_id.replace('-', '_')}",
            )
        )
    )
    topo = str(both)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(a, rows=3)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    # back has no table yet: its sessions wait (exit 1) while policy's deliver the copies
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "3", "--interval", "0.01"]) == 1
    assert cli.main(["tables", "open", "public.accounts", "--client", "back", "--topology", topo]) == 0
    b.query("INSERT INTO public.accounts (id, owner) VALUES (1001, 'b')")
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    assert rows(a) == rows(b) == rows(c)
    return topo


def test_a_switchover_to_a_site_federating_its_copy_back_leaves_every_site_with_its_rows(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """public.accounts federated both ways, then closed for back at site-b and site-b promoted for
    policy. site-a and site-c held every
    row listed under site-b (back's snapshot upserts site-b's whole copy, each row listed under its
    source); once site-b was their table's origin those rows were its own AND listed, and its snapshot
    clears only the unlisted ones: a row site-b deleted stayed at site-a and site-c for good, while lr
    status said healthy. The close for back is shown where it was made and on back's copies, whether
    or not their site captures the table itself (before: at site-b no line, and both copies `synced`)."""
    a, b, c = lr_sites
    topo = both_ways(lr_sites, tmp_path, monkeypatch)

    # promoting site-b for policy would capture its table for policy instead of back: back's sinks
    # would stop receiving it (before: silently, their copies called synced, back's full syncs waiting
    # for data forever); refused, saying to close it for back there first
    after = str(tmp_path / "after.yaml")
    failover = ["failover", "--topology", topo, "--promote", "site-b", "--client", "policy", "--out", after]
    capsys.readouterr()
    assert cli.main(failover) == 1
    err = capsys.readouterr().err
    assert "captures its copy of public.accounts for client 'back'" in err, err
    assert "lr tables close public.accounts --site site-b" in err and "nothing was done" in err, err
    assert cli.main(["tables", "close", "public.accounts", "--site", "site-b", "--topology", topo]) == 0
    capsys.readouterr()
    assert cli.main(["status", "--topology", topo]) == 0
    out = capsys.readouterr().out
    for sink in ("site-a", "site-c"):
        shut = f"synced from site-b->{sink}/back, 4 rows in its snapshot (closed at site-b: this copy is kept"
        assert shut in out, out
        noted = sink_site(lr_sites, sink).query(
            "SELECT closed_at_source FROM lr.sink_tables WHERE source_site_id = 'site-b'"
        )
        assert noted == [(True,)], f"{sink} was told of the close (its own note: read when site-b is not)"
    assert "table  public.accounts                  closed (captured no more" in out, out
    assert cli.main(["tables", "list", "--topology", topo]) == 0
    listed = capsys.readouterr().out
    assert "public.accounts closed (not captured; its sinks keep their copy) client=back" in listed, listed
    assert listed.count("client=back: synced, 4 rows in its snapshot (closed at site-b") == 2, listed
    assert cli.main(failover) == 0
    b.query("DELETE FROM public.accounts WHERE id IN (1, 1001)")  # one of site-a's rows, one of its own
    b.query("UPDATE public.accounts SET owner = 'b' WHERE id = 2")
    assert cli.main(["sync", "--topology", after, *SYNC]) == 0
    assert [r[0] for r in b.query("SELECT id FROM public.accounts ORDER BY id")] == [2, 3]
    assert rows(a) == rows(b) == rows(c)


def test_a_switchover_allowed_to_take_a_both_ways_copy_marks_the_other_clients_copies_diverged(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """site-b federates its copy back (client back) and is promoted for policy with
    --allow-table-divergence: it captures the table for policy now, so back's copies at site-a and
    site-c are no longer updated. Before, lr status called them synced and the sites healthy."""
    a, b, c = lr_sites
    topo = both_ways(lr_sites, tmp_path, monkeypatch)
    after = str(tmp_path / "after.yaml")
    failover = ["failover", "--topology", topo, "--promote", "site-b", "--client", "policy", "--out", after]
    assert cli.main([*failover, "--allow-table-divergence"]) == 0
    assert "DIVERGED table policy: public.accounts (captured at site-b for client 'back'" in capsys.readouterr().out
    assert cli.main(["status", "--topology", after]) == 1  # degraded
    shown = [line.strip() for line in capsys.readouterr().out.splitlines() if "DIVERGED" in line]
    for site in ("site-a", "site-c"):
        assert (
            f"{site}: table public.accounts DIVERGED (client back): its source site-b captures it for client "
            "'policy' now, not for 'back': this copy is no longer updated" in " | ".join(shown)
        ), shown


def test_a_switchover_to_a_site_federating_back_a_copy_closed_at_the_old_source_is_not_refused(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """public.accounts federated both ways, then closed for policy at site-a: the failover of policy
    to site-b does not take the closed table over, so site-b's capture for back stays. It was refused
    as if site-b's capture would move to policy (site-b, which captures the table itself, was not
    even told of the close)."""
    a, b, c = lr_sites
    topo = both_ways(lr_sites, tmp_path, monkeypatch)
    assert cli.main(["tables", "close", "public.accounts", "--site", "site-a", "--topology", topo]) == 0
    after = str(tmp_path / "after.yaml")
    capsys.readouterr()
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--client", "policy", "--out", after]) == 0
    out = capsys.readouterr().out
    assert "public.accounts: closed at site-a: this copy is kept, no longer updated" in out, out
    # site-b captures it for back still (its capture triggers for back's sessions)
    assert b.query("SELECT client_name, table_id IS NOT NULL FROM lr.registry WHERE kind = 'table'") == [("back", True)]


def test_lr_failover_refuses_to_stop_a_tables_replication_and_lr_status_shows_the_divergence(
    lr_sites, tmp_path, monkeypatch, capsys
):
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(site_a, rows=5)
    create_accounts(site_b)
    federate(site_b, federated=False)  # site-b keeps out of the table
    federate(site_a)
    App(site_a).close()
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    capsys.readouterr()

    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--no-planned"]) == 1
    err = capsys.readouterr().err
    assert (
        "policy: public.accounts (conflict there; held by site-c; captured at site-a)" in err
        and "--allow-table-divergence" in err
    )
    assert len(err.strip().splitlines()) == 1

    new = tmp_path / "after.yaml"
    assert (
        cli.main(
            [
                "failover",
                "--topology",
                topo,
                "--promote",
                "site-b",
                "--no-planned",
                "--allow-table-divergence",
                "--out",
                str(new),
            ]
        )
        == 0
    )
    assert "DIVERGED table policy: public.accounts" in capsys.readouterr().out
    assert cli.main(["status", "--topology", str(new)]) == 1  # degraded
    shown = [line for line in capsys.readouterr().out.splitlines() if "DIVERGED" in line]
    assert any(
        line.strip().startswith(
            "table  public.accounts DIVERGED (client policy): its session "
            "site-a->site-c/policy was failed over to site-b"
        )
        for line in shown
    ), shown
    # site-a no longer sources policy: told to open the table at site-b (or close it), not that its client has no sink
    assert any(
        line.strip().startswith(
            "site-a: table public.accounts DIVERGED (client policy): captured here, but client "
            "'policy' is replicated from site-b now and the failover did not carry this table"
        )
        and "lr tables open public.accounts --client policy there" in line
        for line in shown
    ), shown


def test_status_marks_the_sink_sessions_of_a_failed_over_source(lr_sites, tmp_path, monkeypatch, capsys):
    """After a failover the sinks' sessions from the old source are closed for good: `lr status`
    says so, instead of calling them consistent with nothing to tell them apart."""
    site_a = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(site_a)
    app.put("k0", 0, ["site-b", "site-c"])
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(new)]) == 0
    capsys.readouterr()
    cli.main(["status", "--topology", str(new)])
    out = capsys.readouterr().out
    old = next(line for line in out.splitlines() if "sink   site-a->site-c/policy" in line)
    assert f"{'site-a->site-c/policy':<32} failed over to site-b" in old  # its readiness, not "consistent"
    assert "its clients failed over to site-b: this session is closed" in out
    app.close()


def test_a_table_opened_at_a_promoted_site_is_carried_by_the_fail_back_or_it_is_refused(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """site-a closes its table, fails over to site-b, rejoins and syncs; site-b opens the table itself; a
    switchover back to site-a before any sync: refused, naming the table (site-a holds no synced copy
    of it from site-b). Before, it went through: site-b's capture became a guard, site-a kept its old
    closed registration, the table was replicated nowhere and lr status told site-b to reopen it.
    After a sync the switchover carries it, and lr status finds nothing diverged."""
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(site_a, rows=5)
    federate(site_a)
    App(site_a).close()
    App(site_b).close()  # its full-sync provider's table, for the fail-back
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    assert cli.main(["tables", "close", "public.accounts", "--topology", topo]) == 0
    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--no-planned", "--out", str(new)]) == 0
    assert cli.main(["sync", "--topology", str(new), *SYNC]) == 0  # site-a's full sync from site-b
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", str(new)]) == 0
    capsys.readouterr()

    back = tmp_path / "back.yaml"
    assert cli.main(["failover", "--topology", str(new), "--promote", "site-a", "--out", str(back)]) == 1
    err = capsys.readouterr().err
    assert "public.accounts" in err and "captured at site-b" in err and "nothing was done" in err, err
    assert site_b.query("SELECT count(*) FROM lr.failovers WHERE to_site_id = 'site-a'") == [(0,)]

    site_b.query("UPDATE public.accounts SET owner = 'b' WHERE id = 1")
    assert cli.main(["sync", "--topology", str(new), *SYNC]) == 0
    capsys.readouterr()
    assert cli.main(["failover", "--topology", str(new), "--promote", "site-a", "--out", str(back)]) == 0
    out = capsys.readouterr().out
    assert "site-a captures its federated table(s) public.accounts" in out, out
    site_a.query("UPDATE public.accounts SET owner = 'a' WHERE id = 2")
    assert cli.main(["sync", "--topology", str(back), *SYNC]) == 0
    assert rows(site_c) == rows(site_b) == rows(site_a)
    cli.main(["status", "--topology", str(back)])
    assert "DIVERGED" not in capsys.readouterr().out


def test_a_failover_beside_an_old_source_writer_holding_its_table_names_the_table_and_rejoins_it_later(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """An application's open transaction at site-a holds its federated table. A planned switchover
    is refused naming the table and the holder, nothing done; an unplanned failover stands, site-a
    is left to rejoin (the new topology file written), and `--rejoin` once the writer is gone guards
    the table. Before, both stopped on a bare lock_timeout after site-b was promoted, no file written."""
    site_a, site_b, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    Path(topo).write_text(Path(topo).read_text().replace("settings: {}", "settings: {lock_timeout_s: 0.3}"))
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(site_a, rows=3)
    federate(site_a)
    App(site_a).close()
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    writer = psycopg2.connect(site_a.dsn)
    writer.cursor().execute("UPDATE public.accounts SET owner = 'w' WHERE id = 1")  # left open
    capsys.readouterr()
    busy = f"table public.accounts of client policy is held by open transaction(s) at site-a (pid {writer.get_backend_pid()})"

    assert cli.main(["failover", "--topology", topo, "--promote", "site-b"]) == 1
    err = capsys.readouterr().err
    assert busy in err and "nothing was changed on this site" in err, err
    assert site_b.query("SELECT count(*) FROM lr.failovers") == [(0,)]

    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--no-planned", "--out", str(new)]) == 0
    out = capsys.readouterr().out
    assert f"site-a was not rejoined: {busy}" in out and "`lr failover --rejoin site-a`" in out, out
    writer.commit()  # its change reached nobody: counted by the rejoin
    writer.close()
    assert cli.main(["failover", "--topology", str(new), "--rejoin", "site-a"]) == 0
    with pytest.raises(psycopg2.Error, match="replicated from site site-b since a failover"):
        site_a.query("UPDATE public.accounts SET owner = 'x' WHERE id = 2")


def test_a_table_opened_at_the_old_source_while_a_switchover_runs_is_refused_not_left_replicated_nowhere(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """`lr tables open public.accounts` at site-a commits while `lr failover --promote site-b` runs
    (after its check of site-a's tables, before its drain guards them): the drain waits for the open,
    sees the table site-b holds no copy of and refuses, nothing done. Before, the switchover went
    through, site-a's new table was guarded and replicated nowhere."""
    site_a, site_b, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(site_a, rows=3)
    App(site_a).close()
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    opening = psycopg2.connect(site_a.dsn)  # lr tables open's transaction, up to its commit
    with opening.cursor() as cur:
        cur.execute("SELECT 1 FROM lr.clients WHERE client_name = 'policy' FOR SHARE")
        registry.federate(cur, TableName.parse("public.accounts"), "policy", None)
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"

    def commit_once_the_drain_waits() -> None:
        """The open commits while the switchover's drain waits for it: a timer of 0.5 s fired before
        a loaded machine's switchover had checked site-a's tables (the check, not the drain, refused)."""
        wait_for(lambda: site_a.query(waiting)[0][0] > 0, 30, "the switchover's drain to wait for the open")
        opening.commit()

    committer = threading.Thread(target=commit_once_the_drain_waits)
    committer.start()
    capsys.readouterr()
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b"]) == 1
    committer.join()
    opening.close()
    err = capsys.readouterr().err
    assert "policy: public.accounts (never synced there; captured at site-a)" in err and "nothing was done" in err, err
    assert site_b.query("SELECT count(*) FROM lr.failovers") == [(0,)]
    site_a.query("UPDATE public.accounts SET owner = 'still captured' WHERE id = 1")  # site-a is still its source


def test_a_running_lr_sync_with_a_file_older_than_a_failover_of_another_client_is_not_told_to_apply_it(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """policy comes from site-a, audit from site-c. `lr failover --promote site-b --client policy
    --out after.yaml`; an `lr sync` still running with the older file is refused for audit's sessions
    too (every site runs the new topology). Each is told that its file predates the failover and to
    use the file it wrote; audit's were told to apply that older file (`lr topology apply` refuses it)."""
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    doc = yaml.safe_load(Path(topo).read_text())
    doc["replication"] = [
        {"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]},
        {"source": "site-c", "sinks": ["site-a", "site-b"], "clients": ["audit"]},
    ]
    doc["providers"]["audit"] = doc["providers"]["policy"]
    Path(topo).write_text(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(site_a).close()
    App(site_c, "audit").close()
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    running = replicator(topologies.load(topo), lr_sites)  # an `lr sync` started before the failover
    new = tmp_path / "after.yaml"
    assert (
        cli.main(["failover", "--topology", topo, "--promote", "site-b", "--client", "policy", "--out", str(new)]) == 0
    )
    errors = {r.session: r.error or "" for r in running.run_cycle()}
    running.close()
    audit = {k: e for k, e in errors.items() if k.endswith("/audit")}
    assert len(audit) == 2, errors
    for key, error in audit.items():
        assert "predates the failover of site-a to site-b" in error and "lr topology apply" not in error, (key, error)
