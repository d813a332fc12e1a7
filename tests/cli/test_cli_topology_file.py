"""A topology file the sites do not run (stale after a failover, edited and not applied) is named
as such by every command that reads one, never reported as a lease held elsewhere or a silent
no-op; and `lr full-sync` over any choice of sessions, waiting for whichever replicator applies it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.cli import full_sync as full_sync_cli
from airflow_provider_lr.cli.common import connector
from airflow_provider_lr.engine.errors import SiteUnreachableError
from airflow_provider_lr.engine.site import failover, stale_topology, topology
from airflow_provider_lr.engine.store import topology as topologies
from tests.cli.test_cli_sync import topology_file
from tests.engine.site.test_failover import _connect
from tests.support.session import App, lr_sync_process, queue, wait_for
from tests.support.subscriber import crash_and_restart

SYNC = ["--until-idle", "--cycles", "10", "--interval", "0.01"]


def _ids(*paths: str) -> list[str]:
    return [topologies.load(p).topology_config_id for p in paths]


def _replicating(lr_sites, tmp_path, monkeypatch) -> tuple[str, App]:
    """A topology file applied and replicated once (site-a's application put one key)."""
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(lr_sites[0])
    app.put("k0", 0, ["site-b", "site-c"])
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    return topo, app


def test_after_a_failover_the_old_file_is_named_by_every_command(lr_sites, tmp_path, monkeypatch, capsys):
    site_a, site_b = lr_sites[:2]
    old, app = _replicating(lr_sites, tmp_path, monkeypatch)
    App(site_b).close()  # the new source's application (its table supplies its full syncs)
    monkeypatch.setattr(stale_topology, "STALE_FOR", 1.0)  # (10 s: the suite's time)
    # an `lr sync` streams with the old file while the failover runs: it retried its refused
    # sessions every 5 s forever; now it stops as it refuses the file at its start
    running: list[int] = []
    streaming = threading.Thread(target=lambda: running.append(cli.main(["sync", "--topology", old])), daemon=True)
    streaming.start()
    wait_for(
        lambda: site_a.query(
            "SELECT count(*) FROM lr.source_sessions WHERE state = 'IN_LOG_ENTRY_SYNC' AND lease_owner IS NOT NULL"
        )
        == [(2,)],
        60,
        "lr sync streaming",
    )
    new = str(tmp_path / "after.yaml")
    assert cli.main(["failover", "--topology", old, "--promote", "site-b", "--out", new]) == 0
    streaming.join(60)
    assert running == [1], "the running lr sync went on with a file no site runs"
    old_id, new_id = _ids(old, new)

    def named(sites: str = "site-a, site-b, site-c") -> str:  # not "apply it" (refused) nor "rejoin with it"
        return (
            f"topology file {old} has id {old_id}; sites hold {new_id} ({sites}): it predates the failover of "
            "site-a to site-b: point --topology"
        )

    assert capsys.readouterr().err.splitlines()[-1].startswith(f"lr: {named()}")  # its last word, once
    assert cli.main(["sync", "--topology", old, "--until-idle", "--give-up-after", "1"]) == 1
    err = capsys.readouterr().err
    assert named() in err and "lease" not in err
    assert cli.main(["sync", "--topology", old, "--once"]) == 1  # never silent, never 0
    assert named() in capsys.readouterr().err
    assert cli.main(["full-sync", "--topology", old, "--sink", "site-c"]) == 1  # the sites it would touch
    assert named() in capsys.readouterr().err  # site-b read too: where the clients went
    assert cli.main(["failover", "--topology", old, "--promote", "site-c", "--from", "site-a"]) == 1
    assert named() in capsys.readouterr().err
    assert cli.main(["failover", "--topology", old, "--rejoin", "site-a"]) == 1  # the others' file is wanted
    assert named("site-b, site-c") in capsys.readouterr().err
    assert cli.main(["tables", "list", "--topology", old]) == 1
    assert named() in capsys.readouterr().err
    assert cli.main(["status", "--topology", old]) == 1
    out = capsys.readouterr().out
    # status reads which sources were failed over: no apply advice (it is refused), no rejoin with the old file
    assert out.startswith(f"WARNING: {named()}") and "health: degraded" in out
    assert "--rejoin" not in out and "lr topology apply" not in out, out

    assert cli.main(["metrics", "--topology", old]) == 0
    assert 'lr_site_topology_matches_file{site="site-c"} 0' in capsys.readouterr().out
    assert cli.main(["status", "--topology", new]) == 0  # the file in use: healthy, no warning
    assert "WARNING" not in capsys.readouterr().out
    assert cli.main(["sync", "--topology", new, "--once"]) == 0
    assert "site-b->site-c/policy" in capsys.readouterr().out  # --once lists every session it cycled
    app.close()


def test_after_a_failover_from_airflow_the_old_file_is_refused_naming_the_file_the_task_wrote(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """The lr_failover DAG's task wrote no file (only its XCom held the new document): every task
    then refused the old file saying to use the topology `lr failover` wrote, which did not exist,
    and a session step even said to apply the old file (refused). Now the task writes the file
    beside the one it read, and the refusals name it."""
    from airflow_provider_lr.engine.session.handshake import Verdict, handshake
    from airflow_provider_lr.engine.vocabulary import SessionKey
    from airflow_provider_lr.operators import LRFailoverOperator

    monkeypatch.setenv("LR_HOME", str(tmp_path))  # where the task writes too: named once
    site_a, site_b, site_c = lr_sites
    old, app = _replicating(lr_sites, tmp_path, monkeypatch)
    App(site_b).close()
    done = LRFailoverOperator(task_id="failover", promote="site-b", topology_path=old).execute({})
    new = tmp_path / f"topology-{done['topology_config_id']}.yaml"
    assert done["topology_file"] == str(new) and _ids(str(new)) == [done["topology_config_id"]]
    capsys.readouterr()
    assert cli.main(["status", "--topology", old]) == 1
    assert (
        "point --topology (Airflow: the Variable lr_topology or $LR_TOPOLOGY) at the topology the failover wrote"
        in (out := capsys.readouterr().out)
        and f"(the failover wrote {new})" in out  # not "{new}, {new}"
    ), out
    # a session step from the old file (a task of lr_replication, lr_streaming) reads its source only;
    # a worker's $LR_HOME is elsewhere: the file is found beside the old one
    monkeypatch.setenv("LR_HOME", str(tmp_path / "worker"))
    source, sink = site_a.connect(), site_c.connect()
    step = handshake(source, sink, SessionKey("site-a", "site-c", "policy"), "t", topology=topologies.load(old))
    source.close(), sink.close()
    assert step.verdict is Verdict.REFUSED and "lr topology apply" not in step.reason, step.reason
    # (told by its sink too: the file predates the failover)
    assert "predates the failover of site-a to site-b" in step.reason and f"the failover wrote {new}" in step.reason
    app.close()


def test_a_file_edited_and_not_applied_is_refused_and_one_site_behind_refuses_only_its_sessions(
    lr_sites, tmp_path, monkeypatch, capsys
):
    site_a, _, _ = lr_sites
    applied = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", applied]) == 0
    edited = tmp_path / "edited.yaml"
    doc = yaml.safe_load(Path(applied).read_text())
    edited.write_text(yaml.safe_dump({**doc, "settings": {"lease_seconds": 30}}))
    capsys.readouterr()
    assert cli.main(["sync", "--topology", str(edited), "--once"]) == 1
    err = capsys.readouterr().err
    assert (
        f"topology file {edited} has id {_ids(str(edited))[0]}; sites hold {_ids(applied)[0]} (site-a, site-b, site-c)"
        in err
    )

    # only the source runs the edited topology: the file is right for the sinks, the source's sessions are refused
    conn = site_a.connect()
    topology.apply_to_site(conn, topologies.load(edited), "site-a")
    conn.close()
    assert cli.main(["sync", "--topology", applied, "--once"]) == 1
    captured = capsys.readouterr()
    assert "their sessions are refused" in captured.err
    lines = [line for line in captured.out.splitlines() if " ERROR " in line]
    assert len(lines) == 2 and all(f"sites hold {_ids(str(edited))[0]} (site-a)" in line for line in lines), (
        captured.out
    )
    assert "lease" not in captured.out


def test_full_sync_of_every_session_or_a_source_is_listed_and_carried_out(lr_sites, tmp_path, monkeypatch, capsys):
    _, sink_b, sink_c = lr_sites
    topo, app = _replicating(lr_sites, tmp_path, monkeypatch)
    capsys.readouterr()
    assert cli.main(["full-sync", "--topology", topo, "--reason", "global"]) == 0  # no --sink: every session
    out = capsys.readouterr().out
    assert "full sync requested for 2 session(s):" in out
    assert "site-a->site-b/policy: request " in out and "site-a->site-c/policy: request " in out
    assert cli.main(["full-sync", "--topology", topo, "--source", "site-a", "--client", "policy"]) == 0
    assert "for 2 session(s)" in capsys.readouterr().out
    assert cli.main(["full-sync", "--topology", topo, "--source", "site-b"]) == 1
    assert "no session replicates from 'site-b'" in capsys.readouterr().err
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    for sink in (sink_b, sink_c):
        assert [k for k, _ in queue(sink, "site-a")].count("start") == 2
    app.close()


def test_full_sync_wait_succeeds_once_a_running_lr_sync_applied_the_request(lr_sites, tmp_path, monkeypatch, capsys):
    source, sink_b, _ = lr_sites
    topo, app = _replicating(lr_sites, tmp_path, monkeypatch)
    with lr_sync_process(topo, source) as streaming:
        capsys.readouterr()
        assert cli.main(["full-sync", "--topology", topo, "--sink", "site-b", "--wait", "60"]) == 0
        out = capsys.readouterr().out
        assert "site-a->site-b/policy: full sync" in out and " applied by " in out and "applied: applied" not in out
        (note,) = source.query("SELECT note FROM lr.full_sync_requests WHERE forced")[0]
        assert note.startswith("applied by ") and f":{streaming.pid}:" in note  # by that lr sync process
        assert [k for k, _ in queue(sink_b, "site-a")].count("start") == 2
    app.close()


def test_full_sync_wait_ends_at_its_bound_when_nobody_applies_the_request(lr_sites, tmp_path, monkeypatch, capsys):
    """No replicator runs (or the sink is down): `lr full-sync --wait 1.5` says the request is not
    applied yet, that no replicator holds the session and its last error (it said only "pending", leaving a new user
    to guess that `lr sync` must run), and exits 1 at its bound. Its polls used to double to 5 s and sleep past the bound:
    1.5 s asked, 3 s taken (60 s asked, up to 65)."""

    topo, app = _replicating(lr_sites, tmp_path, monkeypatch)
    capsys.readouterr()
    started = time.monotonic()
    assert cli.main(["full-sync", "--topology", topo, "--sink", "site-b", "--wait", "1.5"]) == 1
    took = time.monotonic() - started
    out = capsys.readouterr().out
    assert "site-a->site-b/policy: full sync" in out and "not applied yet (pending)" in out, out
    # and what to do about it: nobody holds the session, so nobody works on the request
    assert "no replicator holds the session: run `lr sync` (or unpause lr_streaming)" in out, out
    assert 1.5 <= took < 2.2, took
    # a sink that stopped answering (the replicator recorded why): the wait's end says so, naming it
    lr_sites[0].query(
        "UPDATE lr.source_sessions SET last_error = 'cannot connect to site ''site-b'': timeout expired' "
        "WHERE sink_site_id = 'site-b'"
    )
    assert cli.main(["full-sync", "--topology", topo, "--sink", "site-b", "--wait", "0.2"]) == 1
    out = capsys.readouterr().out
    assert "; its last error: cannot connect to site 'site-b': timeout expired" in out, out
    # neither the looks nor what it says of each session pending cost a connection of their own:
    # one per site, however many sessions wait and however long (it connected anew at every look,
    # and once per session pending at the end: slow with dozens)
    connects: list[str] = []
    monkeypatch.setattr(
        full_sync_cli, "connector", lambda topo: lambda site: connects.append(site) or connector(topo)(site)
    )
    per_run = []
    for chosen, wait in ((["--sink", "site-b"], "0"), ([], "0"), ([], "0.7")):  # one session pending, both, 4 looks
        connects.clear()
        assert cli.main(["full-sync", "--topology", topo, *chosen, "--wait", wait]) == 1
        out = capsys.readouterr().out
        assert out.count("no replicator holds the session") == (2 if not chosen else 1), out
        per_run.append(connects.count("site-a"))
    assert per_run[0] == per_run[1] == per_run[2], per_run
    app.close()


def test_full_sync_wait_rides_out_its_source_restarting_and_says_the_request_applied(
    lr_sites, site_manager, tmp_path, monkeypatch, capsys
):
    """The source restarted (stopped at once, then started) while `lr full-sync --wait` waited on
    it: the wait goes on and says the request applied once a replicator applied it. It ended at the
    first look that found the source down (its connection lost, connected again once at once),
    exit 1 and one line, saying nothing of the request, which was applied moments later."""
    source = lr_sites[0]
    # durable, as a production source (the test servers commit asynchronously: an immediate stop
    # would lose the request itself)
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')
    topo, app = _replicating(lr_sites, tmp_path, monkeypatch)
    app.close()
    capsys.readouterr()
    refused: list[str] = []

    def connect(topo):
        def to(site):
            try:
                return connector(topo)(site)
            except SiteUnreachableError:
                refused.append(site)
                raise

        return to

    monkeypatch.setattr(full_sync_cli, "connector", connect)
    codes: list[int] = []
    waiting = threading.Thread(
        target=lambda: codes.append(cli.main(["full-sync", "--topology", topo, "--sink", "site-b", "--wait", "60"]))
    )
    waiting.start()
    try:
        wait_for(
            lambda: source.query("SELECT count(*) FROM lr.full_sync_requests WHERE forced") == [(1,)], 30, "request"
        )
        # down until the wait looked at the source and found it so (certain, not a timer's luck)
        crash_and_restart(site_manager, source, lambda: refused or not waiting.is_alive())
        assert cli.main(["sync", "--topology", topo, *SYNC]) == 0  # a replicator applies it
    finally:
        waiting.join(60)
    out = capsys.readouterr().out
    assert codes == [0], out
    assert "site-a->site-b/policy: full sync" in out and " applied by " in out, out


def test_a_running_replicator_goes_on_when_its_own_file_is_edited_and_applied(lr_sites, tmp_path, monkeypatch):
    """Not stale: the file it read was edited and applied meanwhile (it reads the file again)."""
    from airflow_provider_lr.engine.site.replicator import Replicator

    path, app = _replicating(lr_sites, tmp_path, monkeypatch)
    running = topologies.load(path)
    repl = Replicator(running, connector(running))
    doc = yaml.safe_load(Path(path).read_text())
    Path(path).write_text(yaml.safe_dump({**doc, "settings": {"lease_seconds": 30}}))
    assert cli.main(["topology", "apply", "--topology", path]) == 0
    app.put("k1", 1, ["site-b"])
    reports = repl.run_cycle()
    repl.close()
    assert [r.error for r in reports] == ["", ""] and sum(r.delivered for r in reports) == 1
    app.close()


def test_an_old_source_back_after_an_unplanned_failover_is_named_to_rejoin_not_to_apply(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """site-a was down during the failover and is back with the old topology. `lr status` with the
    new file said to `lr topology apply` it, and the apply did, skipping the rejoin (its tail
    counted and recorded, its writers and tables refused): status names the rejoin, the apply
    refuses until it is done. It said to apply the file too, and a second rejoin called the first
    one a switchover."""
    old, app = _replicating(lr_sites, tmp_path, monkeypatch)
    result = failover.promote(failover.FailoverRequest("site-a", "site-b"), _connect(lr_sites, down=("site-a",)))
    new = tmp_path / "after.yaml"
    new.write_text(
        yaml.safe_dump(
            {**yaml.safe_load(Path(old).read_text()), **{"replication": result.topology.document["replication"]}}
        )
    )
    capsys.readouterr()
    assert cli.main(["status", "--topology", str(new)]) == 1
    out = capsys.readouterr().out
    assert (
        f"site site-a was failed over (its clients now come from site-b): rejoin it with `lr failover --topology "
        f"{new} --rejoin site-a`, not a topology apply"
    ) in out
    assert "apply the current file" not in out, out  # it said both: apply it, and not to apply it
    # site-a's own sessions: its sinks refuse them (before: called ready, or waiting for a table snapshot)
    mine = [line for line in out.splitlines() if line.startswith("  source site-a->")]
    assert len(mine) == 2 and all("failed over to site-b" in line for line in mine), out
    assert "its sink refuses it: 'policy' was failed over to site-b; rejoin this site" in out, out
    # and `lr sync` with the new file, which replicates the other sessions: it said to apply the file
    cli.main(["sync", "--topology", str(new), "--once"])
    said = capsys.readouterr().err
    assert "lr sync: " in said and "--rejoin site-a`, not a topology apply" in said, said
    assert "apply the current file" not in said, said
    refused = lr_sites[1].query("SELECT last_error FROM lr.source_sessions WHERE sink_site_id = 'site-a'")[0][0]
    assert "site-a was failed over to site-b" in refused and "--rejoin site-a" in refused, refused
    assert "apply the same topology" not in refused, refused  # (before: its negotiation said to apply it)
    assert cli.main(["topology", "apply", "--topology", str(new)]) == 1
    assert (
        "site 'site-a' is back with 'policy', which a failover moved to 'site-b': rejoin it with `lr failover "
        f"--topology {new} --rejoin site-a`"
    ) in capsys.readouterr().err
    assert lr_sites[0].query("SELECT count(*) FROM lr.source_sessions") == [(2,)]  # nothing applied
    capsys.readouterr()
    assert cli.main(["failover", "--topology", str(new), "--rejoin", "site-a"]) == 0
    assert "its sessions from the new source start with a full sync" in capsys.readouterr().out
    assert cli.main(["failover", "--topology", str(new), "--rejoin", "site-a"]) == 0  # again: said done
    again = capsys.readouterr().out
    assert "it ran this topology already (an earlier rejoin" in again and "(the switchover applied" not in again, again
    assert cli.main(["topology", "apply", "--topology", str(new)]) == 0  # rejoined: an apply as any other
    capsys.readouterr()
    cli.main(["status", "--topology", str(new)])
    assert "WARNING" not in capsys.readouterr().out
    app.close()


def test_a_running_lr_sync_is_stopped_as_stale_only_when_neither_its_topology_nor_its_file_has_run_for_a_while(
    lr_sites, tmp_path, monkeypatch
):
    """`lr sync`'s stale-file check (a refused cycle runs the start's check again) stopped the run
    (exit 1, "point --topology at the file the sites run") twice when it should not have:
    * while the operator's edit of its file waited for `lr topology apply`, a session refused for
      another reason (its source has no such session: here its row is gone) made it read the
      edited file, which no site runs yet; the run works the topology the sites run;
    * a planned switchover whose `--out` is the file `lr sync` follows applies the new topology to
      the sites first and writes the file last: a check in between stopped the run. It ran with
      every site's table complete, and no session streamed from the new source.
    Now the check is of the topology the run works, spared when the file as it is now runs, and a
    stale one stops the run once it has stayed stale ``STALE_FOR``."""
    from airflow_provider_lr.engine.site.replicator import Replicator

    monkeypatch.setattr(stale_topology, "STALE_CHECK_EVERY", 0.0)
    monkeypatch.setattr(stale_topology, "STALE_FOR", 0.0)
    path, app = _replicating(lr_sites, tmp_path, monkeypatch)
    running = topologies.load(path)
    stop = threading.Event()
    repl = Replicator(running, connector(running), follow_file=True, stop=stop)
    watch = stale_topology.StaleWatch(repl, stop, None, connector, print)
    doc = yaml.safe_load(Path(path).read_text())
    Path(path).write_text(yaml.safe_dump({**doc, "settings": {"lease_seconds": 30}}))  # edited, not applied
    lr_sites[0].query("DELETE FROM lr.source_sessions WHERE sink_site_id = 'site-b'")
    try:
        reports = repl.run_cycle()
    finally:
        repl.close()
    refused = [r for r in reports if r.decision == "refuse"]
    assert len(refused) == 1 and "no session to 'site-b'" in refused[0].error, [r.error for r in reports]
    negotiated = [r for r in reports if r.decision and r not in refused]  # site-c's: its source runs the topology
    assert len(negotiated) == 1, [r.error for r in reports]
    assert repl.topology.topology_config_id == running.topology_config_id  # the edit is not followed
    watch.seen(refused)
    assert watch.error is None and not stop.is_set(), watch.error

    # the edit applied, not followed yet (the replicator takes it at its next turn): not stale
    assert cli.main(["topology", "apply", "--topology", path]) == 0
    watch.seen(refused)
    assert watch.error is None and not stop.is_set(), watch.error

    # the sites move to a topology that is in no file yet (a switchover, before it writes its --out)
    Path(path).write_text(yaml.safe_dump(doc))  # (the run's own topology again)
    moved = tmp_path / "moved.yaml"
    moved.write_text(yaml.safe_dump({**doc, "settings": {"lease_seconds": 40}}))
    assert cli.main(["topology", "apply", "--topology", str(moved)]) == 0
    monkeypatch.setattr(stale_topology, "STALE_FOR", 0.5)
    watch.seen(refused)
    assert watch.error is None and not stop.is_set(), "stopped in the moment before the file is written"
    Path(path).write_text(moved.read_text())  # written: it runs
    time.sleep(0.6)  # (the clock past STALE_FOR: its stale check above was not in a row with the next)
    watch.seen(refused)
    assert watch.error is None and not stop.is_set(), watch.error

    # stale again later: counted from then (a session that negotiated meanwhile ended the last spell)
    Path(path).write_text(yaml.safe_dump(doc))
    watch.seen(refused)
    time.sleep(0.6)
    watch.seen(negotiated)
    watch.seen(refused)
    assert watch.error is None and not stop.is_set(), "a stale spell that ended counted in the next"

    # stale for real: neither the run's topology nor its file runs anywhere, and stays so
    time.sleep(0.6)
    watch.seen(refused)
    assert stop.is_set() and watch.error is not None
    assert f"topology file {path} has id {running.topology_config_id}" in str(watch.error), str(watch.error)
    app.close()
