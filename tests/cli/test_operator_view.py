"""What an operator sees is true: `lr status` computed live (lag in entries and seconds, pending
requests, what a session waits for, queue depths), exit codes scripts can alert on, `--json`,
`lr sync --until-idle` that ends when sessions keep failing or waiting, `topology apply --prune`,
metrics, and no application data in the output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.store import members, receive_queue, source_sessions
from airflow_provider_lr.proto import lr_pb2
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
from tests.cli.test_cli_sync import topology_file
from tests.support.session import App, apply, queue, replicator
from tests.support.subscriber import insert_raw


def _status(topo: str, capsys, *extra: str) -> tuple[int, dict]:
    code = cli.main(["status", "--topology", topo, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def _session(report: dict, site: str, sink: str) -> dict:
    return next(s for s in report["sites"][site]["sessions"] if s["role"] == "source" and s["sink_site_id"] == sink)


def _synced(topo: str) -> None:
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0


def test_status_lag_moves_with_committed_but_undelivered_entries(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(lr_sites[0])
    app.put("k", 0, ["site-b", "site-c"])
    _synced(topo)
    capsys.readouterr()
    code, report = _status(topo, capsys)
    assert code == 0 and report["health"] == "healthy"
    assert _session(report, "site-a", "site-b")["remaining_entries_to_send"] == 0
    for i in range(500):  # committed, nobody replicates
        app.put(f"k{i % 10}", i, ["site-b"])
    time.sleep(1.1)
    code, report = _status(topo, capsys)
    b = _session(report, "site-a", "site-b")
    assert b["remaining_entries_to_send"] == 500 and b["lag_seconds"] >= 1.0
    assert b["readiness"] == "catching up (500 to send)"
    assert _session(report, "site-a", "site-c")["remaining_entries_to_send"] == 0
    assert code == 0  # catching up is not degraded ...
    code, report = _status(topo, capsys, "--max-lag", "0.5")
    assert code == 1 and any("lag" in r for r in report["reasons"])  # ... unless it lags more than asked
    assert cli.main(["metrics", "--topology", topo]) == 0
    metrics = capsys.readouterr().out
    assert 'lr_session_lag_entries{client="policy",sink="site-b",source="site-a"} 500.0' in metrics
    assert 'lr_site_up{site="site-c"} 1.0' in metrics
    _synced(topo)
    capsys.readouterr()
    code, report = _status(topo, capsys, "--max-lag", "0.5")
    assert code == 0 and _session(report, "site-a", "site-b")["remaining_entries_to_send"] == 0
    assert _session(report, "site-a", "site-b")["last_success_age_s"] < 30
    queues = {q["queue"]: q for q in report["sites"]["site-b"]["receive_queues"]}
    assert queues["LRQ_Recv_policy_site-a"]["waiting"] >= 500  # no subscriber consumed them yet
    app.close()


def test_status_exit_code_is_degraded_when_a_session_errs(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(lr_sites[0]).put("k", 0, ["site-b"])
    _synced(topo)
    lr_sites[0].query("UPDATE lr.source_sessions SET last_error = 'sink down' WHERE sink_site_id = 'site-c'")
    capsys.readouterr()
    code, report = _status(topo, capsys)
    assert code == 1 and report["health"] == "degraded"
    assert report["reasons"] == ["site-a->site-c/policy (source): not ready (error)"]
    assert cli.main(["status", "--topology", topo]) == 1
    assert "health: degraded" in capsys.readouterr().out


def test_status_shows_a_pending_full_sync_with_its_reason_and_what_the_session_waits_for(
    lr_sites, tmp_path, monkeypatch, capsys
):
    topo_path = topology_file(tmp_path, lr_sites, monkeypatch)
    doc = yaml.safe_load(open(topo_path))
    del doc["providers"]  # nobody supplies the client's data
    open(topo_path, "w").write(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", topo_path]) == 0
    App(lr_sites[0]).put("k", 0, ["site-b"])
    started = time.monotonic()
    code = cli.main(["sync", "--topology", topo_path, "--until-idle", "--give-up-after", "1", "--interval", "0.05"])
    assert code == 1 and time.monotonic() - started < 30  # it ends, non-zero ...
    err = capsys.readouterr().err
    assert "2 session(s) not settled" in err and "waiting for full-sync data" in err  # ... and says why
    assert cli.main(["full-sync", "--topology", topo_path, "--sink", "site-b", "--reason", "audit 2026-11"]) == 0
    capsys.readouterr()
    code, report = _status(topo_path, capsys)
    requests = report["sites"]["site-a"]["full_sync_requests"]
    assert [(r["sink"], r["reason"], r["forced"]) for r in requests] == [
        ("site-b", "audit 2026-11", True),
        ("site-c", "negotiation", False),
    ] or sorted((r["sink"], r["reason"]) for r in requests) == [("site-b", "audit 2026-11"), ("site-c", "negotiation")]
    c = _session(report, "site-a", "site-c")
    assert "the client's full-sync data" in c["waiting_for"] and "provider must be importable" in c["waiting_for"]
    cli.main(["status", "--topology", topo_path])
    out = capsys.readouterr().out
    assert "full sync pending" in out and "audit 2026-11" in out and "waiting for the client's full-sync data" in out
    # the client's own serve loop supplies one (its provider runs): status said it waited for the client's data
    started, release = threading.Event(), threading.Event()

    def provider(ctx) -> None:
        started.set()
        release.wait(30)

    conn = lr_sites[0].connect()
    serving = threading.Thread(target=lambda: RoutingQueueClient(conn, "policy").serve_full_sync_requests(provider))
    serving.start()
    try:
        assert started.wait(30), "the provider was not called"
        code, report = _status(topo_path, capsys)
        supplying = [r["sink"] for r in report["sites"]["site-a"]["full_sync_requests"] if r["supplying"]]
        assert len(supplying) == 1, report["sites"]["site-a"]["full_sync_requests"]
        waits = _session(report, "site-a", supplying[0])["waiting_for"]
        assert waits.startswith("its provider, which is supplying the client's full-sync data"), waits
        assert "provider must be importable" not in waits
    finally:
        release.set()
        serving.join(30)
        conn.close()


def test_until_idle_says_how_long_it_really_made_no_progress(lr_sites, tmp_path, monkeypatch, capsys):
    """`lr sync --until-idle` that ends by its cycle limit with sessions unsettled says for how long it
    measured no progress, not its --give-up-after."""
    import re

    topo_path = topology_file(tmp_path, lr_sites, monkeypatch)
    doc = yaml.safe_load(open(topo_path))
    del doc["providers"]  # nobody supplies the client's data: the sessions wait
    open(topo_path, "w").write(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", topo_path]) == 0
    started = time.monotonic()
    code = cli.main(
        [
            "sync",
            "--topology",
            topo_path,
            "--until-idle",
            "--cycles",
            "2",
            "--give-up-after",
            "600",
            "--interval",
            "0.05",
        ]
    )
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1 and "2 session(s) not settled" in err, err
    assert float(re.search(r"no progress for (\d+)s", err).group(1)) <= took + 1 < 600, err


def test_until_idle_ends_when_a_session_keeps_failing(lr_sites, tmp_path, monkeypatch, capsys):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(lr_sites[0]).put("k", 0, ["site-b", "site-c"])
    monkeypatch.setenv(
        "AIRFLOW_CONN_LR_TEST_SITE_C",
        json.dumps({"conn_type": "postgres", "host": "127.0.0.1", "port": 1, "login": "x", "schema": "x"}),
    )
    code = cli.main(["sync", "--topology", topo, "--until-idle", "--give-up-after", "1", "--interval", "0.05"])
    assert code == 1
    err = capsys.readouterr().err
    assert "site-a->site-c/policy: failing" in err and "site-a->site-b/policy" not in err.split("not settled")[1]


def test_topology_apply_prune_removes_sessions_no_longer_in_the_topology_once_consumed(
    lr_sites, tmp_path, monkeypatch, capsys
):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(lr_sites[0]).put("k", 0, ["site-b", "site-c"])
    _synced(topo)
    doc = yaml.safe_load(open(topo))
    doc["replication"][0]["sinks"] = ["site-b"]
    open(topo, "w").write(yaml.safe_dump(doc))
    capsys.readouterr()
    assert cli.main(["topology", "apply", "--topology", topo, "--prune"]) == 0
    out = capsys.readouterr().out
    assert "kept sink session site-a->site-c/policy" in out and "still wait for subscribers" in out
    RoutingQueueSubscriber(lr_sites[2].dsn, client_name="policy").poll(_Accept())
    assert cli.main(["topology", "apply", "--topology", topo, "--prune"]) == 0
    assert "pruned sink session site-a->site-c/policy" in capsys.readouterr().out
    code, report = _status(topo, capsys)
    assert report["sites"]["site-c"]["sessions"] == [] and report["sites"]["site-c"]["receive_queues"] == []
    assert lr_sites[2].query("SELECT count(*) FROM lr.registry WHERE kind = 'receive_queue'") == [(0,)]


class _Accept:
    def on_snapshot_sync_start(self, source):
        pass

    def on_snapshot_messages(self, source, payloads):
        return True

    def on_snapshot_sync_complete(self, source):
        pass

    def on_log_entry_messages(self, source, payloads):
        return True


def test_status_never_shows_application_data_and_survives_a_closed_pipe(lr_sites, tmp_path, monkeypatch, repo_root):
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    open_tx = lr_sites[0].connect()  # an application transaction with an uncommitted secret payload
    RoutingQueueClient(open_tx, "policy").transmit_log_entry_message(b"SECRET-card-4111", ["site-b"])
    try:
        done = subprocess.run(
            [sys.executable, "-m", "airflow_provider_lr.cli", "status", "--topology", topo],
            capture_output=True,
            text=True,
            cwd=repo_root,
        )
        assert "held back: pid" in done.stdout and "not committed yet" in done.stdout
        assert "SECRET" not in done.stdout and "534543524554" not in done.stdout.upper()  # nor its hex
        piped = subprocess.run(
            f"{sys.executable} -m airflow_provider_lr.cli status --topology {topo} | head -1",
            shell=True,
            capture_output=True,
            text=True,
            cwd=repo_root,
        )
        assert piped.stdout.startswith("site-a:") and "Traceback" not in piped.stderr
    finally:
        open_tx.rollback()
        open_tx.close()


class _Child:
    """An `lr` command in its own process, its output lines collected as they come."""

    def __init__(self, *args: str) -> None:
        import os
        import threading

        self.process = subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_lr.cli", *args],
            env={**os.environ},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        import re

        deadline = time.monotonic() + timeout
        while True:
            found = next((m for m in map(re.compile(pattern).search, list(self.lines)) if m), None)
            if found:
                return found
            assert time.monotonic() < deadline and self.process.poll() is None, f"no {pattern!r} in {self.lines}"
            time.sleep(0.05)

    def stop(self) -> int:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._reader.join(5)


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _sample(page: str, name: str) -> float:
    """The value of one sample of an exposition (``name`` with its labels)."""
    return float(next(line.rsplit(" ", 1)[1] for line in page.splitlines() if line.startswith(name + " ")))


def test_lr_metrics_listen_says_where_and_serves_the_status_with_the_topology_info(lr_sites, tmp_path, monkeypatch):
    """`lr metrics --listen` says where it serves on start; `/metrics` (and `/`, not a 404) give the
    live gauges and an info metric naming each site's topology and schema version."""
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    topology_id = lr_sites[0].query("SELECT topology_config_id FROM lr.topology")[0][0]
    version = lr_sites[0].query("SELECT max(version) FROM lr.schema_migrations")[0][0]
    child = _Child("metrics", "--topology", topo, "--listen", "127.0.0.1:0")
    try:
        url = child.wait_for(r"lr metrics: serving (http://127\.0\.0\.1:\d+/metrics)").group(1)
        code, page = _get(url)
        assert code == 200 and 'lr_site_up{site="site-b"} 1.0' in page
        assert f'lr_site_info{{schema_version="{version}",site="site-a",topology_id="{topology_id}"}} 1.0' in page, page
        assert 'lr_session_lag_entries{client="policy",sink="site-b",source="site-a"} 0.0' in page
        assert _get(url.removesuffix("metrics"))[0] == 200
    finally:
        child.stop()


def test_a_queue_entry_that_arrived_after_the_status_read_began_is_not_a_negative_age(lr_sites):
    sink = lr_sites[1]
    conn = sink.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT now()")  # the status read's transaction began: its now() is fixed from here
        time.sleep(0.05)
        insert_raw(sink, "site-a", lr_pb2.LOG_ENTRY_SYNC, b"k=1")  # a sink transaction that began later
        ((_, _, waiting, _, oldest, _),) = receive_queue.queue_report(cur)
    conn.close()
    assert waiting == 1 and oldest == 0.0, oldest


def test_an_entry_a_success_a_lease_or_a_heartbeat_recorded_after_the_status_read_began_is_never_negative(
    lr_sites,
):
    """A lag, or an age: `lr status` read beside two busy `lr sync` also said "last success -0s
    ago" (the read's now(), its transaction's start, less a time a replicator recorded later)."""
    source = lr_sites[0]
    topo = apply(lr_sites)
    app = App(source)
    conn = source.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT now()")  # the status read's transaction began: its now() is fixed from here
        time.sleep(0.05)
        app.put("k", 1, ["site-b"])  # a writer's transaction that began later
        rows = source_sessions.backlog_rows(cur, "site-b", "policy", None)
        repl = replicator(topo, lr_sites)  # a replicator's cycle that began later: a lease, a success
        repl.run_cycle()
        member = source.connect()  # and a member joining (its heartbeat; alive while it is connected)
        with member.cursor() as mine:
            members.join(mine, "vm:1:later", 30.0)
        member.commit()
        ages = list(source_sessions.last_success_ages(cur).values())
        held = [row[4] for row in source_sessions.held_leases(cur, True)]
        beats = [m.heartbeat_age_s for m in members.live(cur)]
    conn.close()
    member.close()
    repl.close()
    app.close()
    assert [(entries, lag) for _, _, _, _, entries, _, lag, _, _ in rows] == [(1, 0.0)]
    assert len(ages) == len(held) == 2 and len(beats) == 1, (ages, held, beats)
    assert min(ages + held + beats) >= 0, (ages, held, beats)


def test_an_address_lr_cannot_listen_on_is_said_on_one_line(lr_sites, tmp_path, monkeypatch, capsys):
    """An address not of this machine, one in use: one line naming it, exit 1, no traceback; `lr
    sync` says so before it replicates anything (a port out of range or none is a usage error:
    test_cli_bad_input)."""
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    in_use = str(lr_sites[0].server.port)
    for listen, why in (
        ("192.0.2.1:9187", "cannot listen on '192.0.2.1:9187': "),
        (f"127.0.0.1:{in_use}", "Address already in use"),
    ):
        capsys.readouterr()
        assert cli.main(["metrics", "--topology", topo, "--listen", listen]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"lr: cannot listen on {listen!r}") and why in err and err.count("\n") == 1, err
    assert cli.main(["sync", "--topology", topo, "--once", "--metrics-listen", f"127.0.0.1:{in_use}"]) == 1
    assert "cannot listen on" in capsys.readouterr().err
    assert lr_sites[0].query("SELECT count(*) FROM lr.source_sessions WHERE lease_owner IS NOT NULL") == [(0,)]


def test_an_ipv6_address_in_brackets_is_listened_on_and_named_so():
    """`--metrics-listen [::1]:9187` (HOST:PORT as a URL writes an IPv6 host) was refused with 'Name
    or service not known': the brackets went to the resolver."""
    import socket
    import urllib.request

    from prometheus_client import CollectorRegistry

    from airflow_provider_lr.engine.site import metrics

    try:
        socket.socket(socket.AF_INET6).close()
        socket.getaddrinfo("::1", 0, socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 on this machine")
    server, thread, url = metrics.start(CollectorRegistry(), "[::1]:0")
    try:
        assert re.fullmatch(r"http://\[::1\]:\d+/metrics", url), url
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
    finally:
        metrics.stop_serving(server, thread)


def test_lr_sync_counts_what_it_delivers_and_prints_a_progress_line(lr_sites, tmp_path, monkeypatch):
    """A streaming `lr sync --metrics-listen` serves counters of what it did (entries and bytes
    delivered, full syncs applied, per session; a lag histogram) and prints a progress line every
    `--report-every` seconds with entries/s and the lag."""
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(source)
    child = _Child("sync", "--topology", topo, "--metrics-listen", "127.0.0.1:0", "--report-every", "0.5")
    try:
        url = child.wait_for(r"lr sync: counters at (http://127\.0\.0\.1:\d+/metrics)").group(1)
        deadline = time.monotonic() + 60
        while source.query("SELECT count(*) FROM lr.source_sessions WHERE acked_position >= 0") != [(2,)]:
            assert time.monotonic() < deadline, "first contact"
            time.sleep(0.05)
        for i in range(30):
            app.put(f"k{i}", i, ["site-b"] if i % 3 else ["site-b", "site-c"])
        while [p for k, p in queue(sink_b, "site-a") if k == "log"][-1:] != ["k29=29"]:
            assert time.monotonic() < deadline, "streamed"
            time.sleep(0.05)
        b, c = 'client="policy",sink="site-b",source="site-a"', 'client="policy",sink="site-c",source="site-a"'
        page = ""
        while not (
            f"lr_entries_delivered_total{{{b}}} 30.0" in page  # the streams count as they write
            and f"lr_entries_delivered_total{{{c}}} 10.0" in page
            and f"lr_delivery_lag_seconds_count{{{b}}} " in page  # observed at the stream's acks: once the
        ):  # sink's WAL flush has passed what it wrote (its asynchronous commits), within a second
            assert time.monotonic() < deadline, page
            time.sleep(0.1)
            page = _get(url)[1]
        assert 0 < _sample(page, f"lr_bytes_delivered_total{{{c}}}") < _sample(page, f"lr_bytes_delivered_total{{{b}}}")
        assert f"lr_full_syncs_total{{{b}}} 1.0" in page and f"lr_full_syncs_total{{{c}}} 1.0" in page
        assert _sample(page, f"lr_delivery_lag_seconds_count{{{b}}}") >= 1
        child.wait_for(r"streaming 2 of 2 sessions: \d+ entries in \d+s \([\d.]+ entries/s, 40 in all\), lag ")
    finally:
        code = child.stop()
    assert code == 0, child.lines
    app.close()


def test_status_names_who_holds_each_session_and_since_when(lr_sites, tmp_path, monkeypatch, capsys):
    """`lr status` (and `--json`) name the replicator holding each session's lease and when it took
    it: a renewal by the holder keeps that time, a takeover after the lease ran out sets a new one;
    a session nobody holds says so."""
    from airflow_provider_lr.engine.session import lease as leases

    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    source = lr_sites[0]
    conn = source.connect()
    try:
        assert leases.acquire(conn, "site-b", "policy", "host-1:4242:replicator", 60) is not None
        taken = source.query("SELECT lease_acquired_at FROM lr.source_sessions WHERE sink_site_id = 'site-b'")[0][0]
        time.sleep(1.1)
        assert leases.acquire(conn, "site-b", "policy", "host-1:4242:replicator", 60) is not None  # a renewal
        capsys.readouterr()
        _, report = _status(topo, capsys)
        b, c = _session(report, "site-a", "site-b"), _session(report, "site-a", "site-c")
        assert b["lease_owner"] == "host-1:4242:replicator" and b["lease_acquired_at"] == taken.isoformat()
        assert b["lease_held_s"] >= 1.0 and 0 < b["lease_expires_in_s"] <= 60
        assert c["lease_owner"] is None and c["lease_acquired_at"] is None
        cli.main(["status", "--topology", topo])
        text = capsys.readouterr().out
        assert f"lease held by host-1:4242:replicator since {taken.isoformat(timespec='seconds')} (" in text, text
        assert "lease no holder" in text
        source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")  # ran out
        assert leases.acquire(conn, "site-b", "policy", "host-2:7:replicator", 60) is not None  # taken over
        _, report = _status(topo, capsys)
        b = _session(report, "site-a", "site-b")
        assert b["lease_owner"] == "host-2:7:replicator" and b["lease_acquired_at"] > taken.isoformat()
    finally:
        conn.close()
