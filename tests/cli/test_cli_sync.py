"""`lr` without Airflow: apply a topology, replicate with `lr sync`, read `lr status`, force a
full sync, trim — the same engine the DAGs run, through Airflow-style connections."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.source import full_sync
from tests.support.session import App, final_state, queue, source_state, topology_doc, wait_for


def topology_file(tmp_path, sites, monkeypatch, providers: dict | None = None) -> str:
    """A topology YAML over ``sites`` reached through Airflow-style connections (default provider:
    the App's table)."""
    for site in sites:
        conn_id = f"lr_test_{site.site_id.replace('-', '_')}"
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(site.server.airflow_conn(site.dbname)))
    doc = topology_doc(
        sites,
        providers={"policy": "tests.support.session:table_provider"} if providers is None else providers,
        conn_ids=lambda site_id: f"lr_test_{site_id.replace('-', '_')}",
    )
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_lr_sync_replicates_every_session_and_status_shows_them(lr_sites, tmp_path, monkeypatch, capsys):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    app.put("k0", 100, ["site-b"])
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert final_state(queue(sink_b, "site-a")) == source_state(source)
    assert final_state(queue(sink_c, "site-a")) == {f"k{i}": i for i in range(5)}
    capsys.readouterr()

    assert cli.main(["status", "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert "source site-a->site-b/policy" in out and "sink   site-a->site-c/policy" in out
    assert "IN_LOG_ENTRY_SYNC" in out and "lag 0 entries" in out and "data consistent True" in out
    assert "health: healthy" in out
    assert out.count(" ready ") == 2 and out.count("consistent ") >= 2

    assert cli.main(["full-sync", "--topology", topo, "--sink", "site-c", "--reason", "audit"]) == 0
    assert "full sync requested" in capsys.readouterr().out
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert [k for k, _ in queue(sink_c, "site-a")].count("start") == 2
    assert [k for k, _ in queue(sink_b, "site-a")].count("start") == 1

    assert cli.main(["trim", "--topology", topo]) == 0
    assert "site-a: trimmed to" in capsys.readouterr().out
    assert cli.main(["trim", "--topology", topo, "--retention", "3600"]) == 0
    out = capsys.readouterr().out  # nothing that old is not a commit in flight holding the barrier
    assert "site-a: trimmed to" in out and "(0 entries removed)" in out, out
    app.close()


def test_lr_commands_name_what_is_wrong(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    capsys.readouterr()
    assert cli.main(["full-sync", "--topology", topo, "--sink", "site-x"]) == 2  # a usage error
    assert "unknown site 'site-x'; the topology knows site-a, site-b, site-c" in capsys.readouterr().err
    assert cli.main(["sync", "--topology", str(tmp_path / "missing.yaml"), "--once"]) == 2  # the user's input
    assert "not found" in capsys.readouterr().err
    monkeypatch.delenv("AIRFLOW_CONN_LR_TEST_SITE_C")
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(tmp_path / "none.json"))
    assert cli.main(["status", "--topology", topo]) == 2  # a site that cannot be reached
    assert "site-c: UNREACHABLE" in capsys.readouterr().out


def test_demo_replicates_on_its_own_embedded_sites(tmp_path, capsys, monkeypatch):
    from airflow_provider_lr.embedded import demo
    from airflow_provider_lr.embedded.sites import SiteManager
    from airflow_provider_lr.engine.db import conninfo
    from airflow_provider_lr.engine.errors import LRError

    monkeypatch.setenv("LR_HOME", str(tmp_path / "demo-home"))  # `lr failover` finds the demo's sites
    manager = SiteManager(tmp_path / "demo-home")
    try:
        assert demo.run(manager, sink_count=2) == 0
        out = capsys.readouterr().out
        assert "snapshot_sync" in out and "log_entry_sync" in out and "ERROR" not in out
        assert out.count("data consistent True") == 2
        assert out.count("lag 0 entries / 0.0s, IN_LOG_ENTRY_SYNC") == 2
        assert out.count("the subscriber delivered") == 2 and "0 log entries)" not in out
        # the figures a new user reads add up: the full sync's start and end markers are entries too
        for n, rows, entries in re.findall(
            r"delivered (\d+) queue entries \(a full sync: its start, (\d+) rows, its end; (\d+) log entries\)", out
        ):
            assert int(n) == 2 + int(rows) + int(entries), out
        assert out.count("queue entries (a full sync: its start") == 2, out

        # a user tries README §3 on the demo's sites: a payload of the same client, not the demo's
        # form, reached its sink application (a ValueError traceback in the demo's output)
        site_a = conninfo.resolve("lr_site_a").connect()
        RoutingQueueClient(site_a, "policy").transmit_log_entry_message(b"hello", ["site-b"])
        site_a.commit()
        site_a.close()
        assert demo.run(manager, sink_count=2) == 0  # re-run: continues on the same sites
        out = capsys.readouterr().out
        assert "1 payload(s) not of the demo's form key=value skipped" in out and "Traceback" not in out, out

        # then a switchover moved the client to site-b: the demo wrote its topology over the sites'
        # unchecked, printed the same fencing error 40 times and exited 0
        topo = str(manager.home / "demo-topology.yaml")
        assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--reason", "trying it"]) == 0
        capsys.readouterr()
        with pytest.raises(LRError, match=r"the demo cannot continue on these sites: .*failed over.*; start afresh "):
            demo.run(manager, sink_count=2)
        assert "ERROR" not in capsys.readouterr().out
    finally:
        manager.down(mode="immediate", remove=True)


def test_status_says_whether_each_session_is_ready():
    from airflow_provider_lr.engine.source.backlog import readiness

    source = {
        "role": "source",
        "state": "IN_LOG_ENTRY_SYNC",
        "sync_type": "LOG_ENTRY",
        "remaining_entries_to_send": 0,
        "last_error": None,
        "data_consistent": None,
        "last_applied_position": 7,
    }
    assert readiness(source) == "ready"
    assert readiness({**source, "remaining_entries_to_send": 12}) == "catching up (12 to send)"
    assert readiness({**source, "state": "IN_SNAPSHOT_SYNC", "sync_type": "SNAPSHOT"}) == "not ready (snapshot)"
    assert readiness({**source, "state": "INITIALIZED", "sync_type": None}) == "not ready (not started)"
    assert readiness({**source, "last_error": "sink down"}) == "not ready (error)"
    assert readiness({**source, "role": "sink", "data_consistent": False}) == "not ready (snapshot)"


def test_consistent_and_ready_are_checked_against_the_trim_mark():
    """A sink whose position is behind its source's trim mark lost entries it needs: never
    "consistent" or "ready" until a full sync; and "consistent" is not claimed unchecked."""
    from airflow_provider_lr.engine.source.backlog import readiness

    sink = {
        "role": "sink",
        "state": None,
        "sync_type": "LOG_ENTRY",
        "remaining_entries_to_send": None,
        "last_error": None,
        "data_consistent": True,
        "last_applied_position": 40,
    }
    assert readiness(sink, trim_mark=40) == "consistent"
    assert readiness(sink, trim_mark=41) == "not ready (behind trim)"
    assert readiness(sink, trim_mark=None) == "unchecked (source not reached)"
    source = {
        **sink,
        "role": "source",
        "state": "IN_LOG_ENTRY_SYNC",
        "remaining_entries_to_send": 0,
        "data_consistent": None,
    }
    assert readiness(source, trim_mark=40) == "ready"
    assert readiness(source, trim_mark=41) == "not ready (behind trim)"
    # a sink down (its error recorded) when a retention trim passed it: what it faces is a full sync
    assert readiness({**source, "last_error": "sink down"}, trim_mark=41) == "not ready (behind trim)"
    assert readiness({**source, "last_error": "sink down"}, trim_mark=40) == "not ready (error)"


def test_lr_sync_streams_by_default_until_sigterm_then_releases_its_leases(lr_sites, tmp_path, monkeypatch):
    """`lr sync` with no --once/--cycles/--until-idle streams: entries committed while it runs reach
    the sinks, no cycle is printed for a streaming session, and SIGTERM (a service manager's stop)
    ends it with exit 0, its leases released and its acks recorded."""
    import os
    import signal
    import subprocess
    import sys
    import time

    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(source)
    child = subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", topo],
        env={**os.environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while source.query("SELECT count(*) FROM lr.source_sessions WHERE acked_position >= 0") != [(2,)]:
            assert time.monotonic() < deadline and child.poll() is None, "first contact"
            time.sleep(0.05)
        for i in range(30):
            app.put(f"k{i}", i, ["site-b", "site-c"])
        while [p for k, p in queue(sink_c, "site-a") if k == "log"][-1:] != ["k29=29"]:
            assert time.monotonic() < deadline and child.poll() is None, "streamed"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out
    assert "stream handed back after" in out and ": stopped" in out
    assert out.count("handed back after") == 2, out  # once per session: printed, not logged beside it
    for sink in (sink_b, sink_c):
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(30)]
        position = sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
        assert source.query(
            "SELECT acked_position, lease_owner FROM lr.source_sessions WHERE sink_site_id = %s", (sink.site_id,)
        ) == [(position, None)]
    app.close()


def stalling_provider(ctx) -> None:
    """A provider whose supply takes a while (a minute: a large table's), $LR_TEST_SUPPLY_S seconds."""
    import os

    ctx.transmit(b"k0=0")
    time.sleep(float(os.environ.get("LR_TEST_SUPPLY_S", "60")))


def stalling_sync(topo: str, log, supply_s: float):
    """`lr sync` in a process of its own, its provider stalling ``supply_s`` seconds per supply."""
    import os
    import subprocess
    import sys

    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", topo],
            env={**os.environ, "LR_TEST_SUPPLY_S": str(supply_s)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_sigterm_during_the_first_of_two_supplies_leaves_once_that_session_is_done(lr_sites, tmp_path, monkeypatch):
    """Two sessions in their first full sync, supplied one after the other in one cycle: SIGTERM
    during the first ends `lr sync` after it; before, it went on to supply the next one too (a stop
    waited for every session's provider in turn)."""
    import signal

    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={"policy": f"{__name__}:stalling_provider"})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    child = stalling_sync(topo, tmp_path / "sync.log", 1.5)
    try:
        wait_for(lambda: source.query("SELECT count(*) FROM lr.full_sync_requests") != [(0,)], 30, "a request")
        child.send_signal(signal.SIGTERM)
        assert child.wait(20) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert source.query("SELECT count(*) FROM lr.full_sync_requests") == [(1,)]


def test_sigterm_during_a_long_supply_says_what_it_waits_for_and_a_second_one_stops_at_once(
    lr_sites, tmp_path, monkeypatch
):
    """SIGTERM while `lr sync` supplies a full sync whose provider takes minutes: before, it waited
    for the whole supply saying nothing, and a second SIGTERM changed nothing. Now it says it
    finishes the step first, and a second SIGTERM leaves at once: the supply rolled back, the
    request still pending for whoever runs next, the leases released."""
    import signal

    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={"policy": f"{__name__}:stalling_provider"})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    log = tmp_path / "sync.log"
    child = stalling_sync(topo, log, 60)
    try:
        wait_for(lambda: source.query("SELECT count(*) FROM lr.full_sync_requests") != [(0,)], 30, "a request")
        time.sleep(1.0)  # the cycle that asked it supplies it now
        child.send_signal(signal.SIGTERM)
        wait_for(lambda: "lr sync: stopping (SIGTERM)" in log.read_text(), 5, "the stop said")
        time.sleep(0.5)
        assert child.poll() is None, "the supply in progress ends first"
        child.send_signal(signal.SIGTERM)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    assert source.query("SELECT DISTINCT status FROM lr.full_sync_requests") == [("pending",)]
    assert source.query("SELECT DISTINCT lease_owner FROM lr.source_sessions") == [(None,)]


def test_lr_sync_says_a_down_sink_once_on_one_line_without_made_up_figures(lr_sites, tmp_path, monkeypatch, capsys):
    """A sink that cannot be reached: its session's line names the error (psycopg's multi-line
    message on one line) and none of the figures a failed cycle never learnt (state, ack, backlog);
    the failure repeated every cycle is said once, not once a cycle, and once only (no log copy)."""
    source, _, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(source)
    app.put("k0", 1, ["site-b", "site-c"])
    down = {
        "conn_type": "lr_site",
        "host": "127.0.0.1",
        "port": 1,
        "login": "postgres",
        "schema": "postgres",
        "extra": {"site_id": "site-c"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_LR_TEST_SITE_C", json.dumps(down))
    capsys.readouterr()
    rc = cli.main(["sync", "--topology", topo, "--until-idle", "--give-up-after", "2", "--interval", "0.01"])
    out, err = capsys.readouterr()
    assert rc == 1
    failed = [line for line in out.splitlines() if line.startswith("site-a->site-c/policy")]
    assert len(failed) == 1, out  # dozens of failed cycles in 2 s, said once
    assert "ERROR" in failed[0] and "Connection refused | Is the server running" in failed[0]  # psycopg's 2 lines
    assert "state=-" not in failed[0] and "acked=-1" not in failed[0] and "remaining=0" not in failed[0]
    assert all(line.startswith(("site-a->", "lr sync:", "  site-a->")) for line in out.splitlines() if line), out
    assert "site-a->site-c/policy failed" not in err  # printed above, not logged a second time
    cli.main(["status", "--topology", topo])
    out = capsys.readouterr().out
    stored = next(line for line in out.splitlines() if "last error:" in line)  # as the source stored it
    assert "Connection refused | Is the server running" in stored, out
    assert (
        "site-c: UNREACHABLE (" in out
        and "Connection refused | Is the server running" in out.split("site-c: UNREACHABLE")[1].splitlines()[0]
    )
    app.close()


def test_repeated_errors_are_said_once_then_as_still_failing_at_a_slower_cadence():
    from airflow_provider_lr.engine.errors import RepeatedErrors

    now = [0.0]
    repeats = RepeatedErrors(every=30.0, clock=lambda: now[0])
    assert repeats.due("s", "sink down\nDETAIL: refused") == 1
    said = []
    for _ in range(40):  # a cycle a second for 40 s
        now[0] += 1.0
        said.append(repeats.due("s", "sink down\nDETAIL: refused"))
    assert [t for t in said if t] == [31]  # said again once, 30 s later, with the count
    assert repeats.due("s", "another error") == 1  # a new error is said at once
    assert repeats.cleared("s") and not repeats.cleared("s")
    assert repeats.due("s", "another error") == 1  # after a success, in full again


def test_topology_validate_and_apply_warn_of_a_provider_that_cannot_be_imported(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """Sessions of a client whose provider cannot be imported (or that has none) wait for client
    data forever: validate and apply still accept the file, and say so, naming client and provider."""
    broken = topology_file(tmp_path, lr_sites, monkeypatch, providers={"policy": "myapp.lr:policy_full_state"})
    for command in ("validate", "apply"):
        assert cli.main(["topology", command, "--topology", broken]) == 0
        err = capsys.readouterr().err
        assert "warning: client 'policy': cannot load full-sync provider 'myapp.lr:policy_full_state'" in err
        assert len(err.strip().splitlines()) == 1
    assert cli.main(["topology", "validate"]) == 0  # the shipped topology names none
    assert "warning: client 'policy' has no full-sync provider" in capsys.readouterr().err
    fine = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "validate", "--topology", fine]) == 0
    assert "warning" not in capsys.readouterr().err


def test_topology_validate_warns_of_a_site_whose_connection_cannot_be_resolved(tmp_path, monkeypatch, capsys):
    """A mistyped `conn_id` (no AIRFLOW_CONN_*, not in the connections file) or a connection that
    does not parse was called valid by `lr topology validate`: it came out only at `apply` or `lr
    sync`. Validate now says which site, which connection and where it looked (still exit 0: the
    Airflow workers may hold connections this shell lacks). No server needed: it is offline."""
    monkeypatch.setenv("LR_HOME", str(tmp_path))  # no connections file
    monkeypatch.setenv("AIRFLOW_CONN_LR_EAST", json.dumps({"conn_type": "lr_site", "host": "db.east", "login": "lr"}))
    monkeypatch.setenv("AIRFLOW_CONN_LR_WEST", "{not json")
    # and one libpq never takes (it was called fine: ConnInfo.check ran only as lr connected)
    monkeypatch.setenv("AIRFLOW_CONN_LR_SOUTH", "postgresql://lr@db.south/app?sslmode=requier")
    doc = {
        "sites": [
            {"id": "east", "conn_id": "lr_east"},
            {"id": "west", "conn_id": "lr_west"},
            {"id": "north", "conn_id": "lr_nroth"},
            {"id": "south", "conn_id": "lr_south"},
        ],
        "replication": [{"source": "east", "sinks": ["west", "north"], "clients": ["policy"]}],
        "providers": {"policy": "tests.support.session:table_provider"},
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli.main(["topology", "validate", "--topology", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "valid; topology" in out
    lines = err.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("lr: warning: site 'north': unknown site or connection 'lr_nroth'")
    assert "set AIRFLOW_CONN_LR_NROTH, add it to" in lines[0] and "cannot reach it" in lines[0]
    assert lines[1].startswith("lr: warning: site 'south': connection 'lr_south'") and "sslmode 'requier'" in lines[1]
    assert lines[2].startswith("lr: warning: site 'west': AIRFLOW_CONN_LR_WEST"), lines


def test_a_site_whose_connection_was_made_in_airflow_is_found_by_lr(airflow_db, tmp_path, monkeypatch, capsys):
    """docs/airflow.md has the sites' connections made in the Airflow UI (its metadata database);
    lr run on the same machine did not look there: `lr topology validate` said it could not reach
    the site, and apply, status and sync failed on it. lr now asks Airflow for an id found nowhere
    else."""
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session

    from airflow_provider_lr.engine.db import conninfo

    monkeypatch.setenv("AIRFLOW_CONN_LR_EAST", "postgresql://lr@db.east:5432/app")
    extra = json.dumps({"site_id": "west", "region": "eu"})
    with create_session() as session:
        session.add(
            Connection(conn_id="lr_made_in_ui", conn_type="lr_site", host="db.west", port=5433, login="lr", extra=extra)
        )
    doc = {
        "sites": [{"id": "east", "conn_id": "lr_east"}, {"id": "west", "conn_id": "lr_made_in_ui"}],
        "replication": [{"source": "east", "sinks": ["west"], "clients": ["policy"]}],
        "providers": {"policy": "tests.support.session:table_provider"},
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        assert cli.main(["topology", "validate", "--topology", str(path)]) == 0
        out, err = capsys.readouterr()
        # lr's own output; a log line of Airflow's can come with it here only (this process configured
        # Airflow's logging in earlier tests: a fresh `lr` has it log errors alone)
        assert out.startswith(f"{path}: valid") and "lr: warning" not in out + err, (out, err)
        found = conninfo.resolve("lr_made_in_ui")
        assert (found.params["host"], found.params["port"], found.site_id) == ("db.west", 5433, "west")
    finally:
        with create_session() as session:
            session.query(Connection).filter(Connection.conn_id == "lr_made_in_ui").delete()


def test_lr_sync_and_trim_refuse_a_topology_that_replicates_nothing(tmp_path, capsys):
    path = tmp_path / "sites-only.yaml"
    path.write_text(yaml.safe_dump({"sites": [{"id": "site-a"}, {"id": "site-b"}]}))
    for command in (["sync"], ["sync", "--once"], ["trim"]):
        assert cli.main([*command, "--topology", str(path)]) == 1  # streaming would wait for nothing, forever
        assert "the topology replicates nothing (no replication: entry)" in capsys.readouterr().err


@contextlib.contextmanager
def supplying(source, sink: str) -> Iterator[None]:
    """A full sync of site-a->``sink``/policy being supplied (as a replicator's cycle supplies it)
    for as long as the block runs: a provider that takes minutes, its transaction open."""
    full_sync.request_full_sync(psycopg2.connect(source.dsn), sink, "policy", "first")
    entered, release = threading.Event(), threading.Event()

    def slow_provider(ctx) -> None:
        entered.set()
        release.wait(30)

    conn = psycopg2.connect(source.dsn)
    supply = threading.Thread(
        target=full_sync.serve_full_sync_requests, args=(RoutingQueueClient(conn, "policy"), slow_provider, 1)
    )
    supply.start()
    try:
        assert entered.wait(10)
        yield
    finally:
        release.set()
        supply.join()
        conn.close()


def test_full_sync_asked_while_a_long_supply_of_the_same_session_runs_is_recorded_at_once_and_supersedes_it(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """`lr full-sync` of a session whose full sync a replicator is supplying now (a provider that
    takes minutes): before, the request waited for the supply's lock on the old request and failed
    with a lock timeout after 5 s, asking nothing. Now it is recorded at once; the supply in
    progress ends superseded and the new request is the session's one open request."""
    source, sink_b, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(source).close()
    with supplying(source, "site-b"):
        started = time.monotonic()
        assert cli.main(["full-sync", "--topology", topo, "--sink", "site-b", "--reason", "asked meanwhile"]) == 0
        assert time.monotonic() - started < 3.0
    requests = source.query(
        "SELECT reason, status, note FROM lr.full_sync_requests WHERE sink_site_id = 'site-b' ORDER BY requested_at"
    )
    assert requests == [("first", "supplied", None), ("asked meanwhile", "pending", None)]
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert source.query(
        "SELECT status, split_part(note, ' by ', 1) FROM lr.full_sync_requests WHERE sink_site_id = 'site-b' "
        "ORDER BY requested_at"
    ) == [("cancelled", "superseded"), ("applied", "applied")]
    assert queue(sink_b, "site-a")[0] == ("start", "")


def test_topology_apply_removing_a_session_whose_full_sync_is_being_supplied_does_not_wait_for_the_supply(
    lr_sites, tmp_path, monkeypatch
):
    """A topology that drops site-c while a long supply of site-a->site-c/policy runs: before, the
    apply waited for the supply's lock on its request and failed (all or nothing) after 5 s. Now it
    applies at once; the supply, as it ends, closes its request: nothing left open holds trim."""
    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(source).close()
    with supplying(source, "site-c"):
        doc = yaml.safe_load(open(topo).read())
        doc["replication"][0]["sinks"] = ["site-b"]
        open(topo, "w").write(yaml.safe_dump(doc))
        started = time.monotonic()
        assert cli.main(["topology", "apply", "--topology", topo]) == 0
        assert time.monotonic() - started < 3.0
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert source.query("SELECT status, note FROM lr.full_sync_requests WHERE sink_site_id = 'site-c'") == [
        ("cancelled", "session removed from the topology")
    ]


def test_a_topology_apply_beside_another_apply_still_open_on_a_site_says_a_lock_is_held_not_a_privilege(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """Two applies at once, the first slow to commit on site-a: the second's wait is bounded
    (lock_timeout_s) and says a lock is held elsewhere; before, it told the operator to apply as
    the owner of the lr schema, which they were."""
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    text = Path(topo).read_text().replace("settings: {}", "settings: {lock_timeout_s: 1}")
    Path(topo).write_text(text)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    first = psycopg2.connect(lr_sites[0].dsn)
    with first.cursor() as cur:
        cur.execute("SELECT 1 FROM lr.topology FOR UPDATE")
    capsys.readouterr()
    try:
        assert cli.main(["topology", "apply", "--topology", topo]) == 1
    finally:
        first.close()
    err = capsys.readouterr().err
    assert "site 'site-a': a lock lr needs is held by another transaction (lock_timeout)" in err, err
    assert "nothing was applied on any site" in err and "owner" not in err, err
