"""``lr_streaming`` maps one stream task per shard: how the topology is cut into shards, what a
stream task refuses, and shards streaming under ``dag.test`` and as task processes of their own
(real PostgreSQL sites, a real Airflow metadata DB)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.operators.common import FinalRefusal
from airflow_provider_lr.operators.stream import LRStreamOperator, shard_sessions, stream_shards
from tests.support.airflow_env import DAGS_DIR, airflow_sites, states, xcom  # noqa: F401
from tests.support.session import App, final_state, lr_sync_process, queue, replicator, table_provider

ROOT = Path(__file__).resolve().parents[2]


def fan_out_topology(**sinks_by_source: list[str]) -> topologies.Topology:
    """Sites a..f; each source replicates clients ``policy`` and ``audit`` to its sinks."""
    return topologies.from_document(
        {
            "sites": [{"id": f"site-{s}"} for s in "abcdef"],
            "replication": [
                {"source": f"site-{src}", "sinks": [f"site-{s}" for s in sinks], "clients": ["audit", "policy"]}
                for src, sinks in sinks_by_source.items()
            ],
        }
    )


def test_one_shard_per_source_and_a_busy_source_split_into_even_groups_in_topology_order():
    topo = fan_out_topology(a=["b", "c", "d"], e=["f"])  # site-a: 6 sessions, site-e: 2
    assert stream_shards(topo) == [
        {"shard": "site-a", "source": "site-a", "sessions": None},
        {"shard": "site-e", "source": "site-e", "sessions": None},
    ]
    split = stream_shards(topo, sessions_per_shard=4)
    assert [s["shard"] for s in split] == ["site-a 1/2", "site-a 2/2", "site-e"]
    assert split[0]["sessions"] == ["site-a->site-b/audit", "site-a->site-b/policy", "site-a->site-c/audit"]
    assert split[1]["sessions"] == ["site-a->site-c/policy", "site-a->site-d/audit", "site-a->site-d/policy"]
    assert [len(s["sessions"]) for s in stream_shards(topo, "site-a", sessions_per_shard=4 - 1)] == [3, 3]
    assert [len(s["sessions"]) for s in stream_shards(topo, "site-a", sessions_per_shard=5 - 1)] == [3, 3]
    assert [len(s["sessions"]) for s in stream_shards(topo, "site-a", sessions_per_shard=1)] == [1] * 6
    every = [name for s in stream_shards(topo, sessions_per_shard=5) for name in s["sessions"] or []]
    assert every == [str(k) for k in topo.sessions("site-a")]  # each session in exactly one shard
    assert stream_shards(topo, "site-e", sessions_per_shard=2) == [
        {"shard": "site-e", "source": "site-e", "sessions": None}
    ]


def test_shards_of_an_unknown_source_an_empty_topology_or_size_zero_are_refused():
    topo = fan_out_topology(a=["b"])
    with pytest.raises(ConfigurationError, match=r"no session replicates from 'site-b'.*site-a->site-b/audit"):
        stream_shards(topo, "site-b")
    with pytest.raises(ConfigurationError, match="no session replicates anything"):
        stream_shards(fan_out_topology())
    with pytest.raises(ConfigurationError, match="sessions per shard must be at least 1, not 0"):
        stream_shards(topo, sessions_per_shard=0)


def test_a_shard_is_its_listed_sessions_and_one_naming_no_session_is_refused():
    topo = fan_out_topology(a=["b", "c"], e=["f"])
    assert shard_sessions(topo, sessions=["site-e->site-f/audit", "site-a->site-c/policy"]) == sorted(
        [topo.sessions("site-e", "site-f", "audit")[0], topo.sessions("site-a", "site-c", "policy")[0]]
    )
    assert shard_sessions(topo, "site-e") == topo.sessions("site-e")
    assert shard_sessions(topo) == topo.sessions()
    refused = {
        "site-a->site-f/policy": "session site-a->site-f/policy is not a session in topology",
        "site-a": "not a session (source->sink/client): 'site-a'",
    }
    for name, message in refused.items():
        with pytest.raises(ConfigurationError, match=re.escape(message)):
            shard_sessions(topo, sessions=[name])
    with pytest.raises(ConfigurationError, match="is not a session of source 'site-a'"):
        shard_sessions(topo, "site-a", ["site-e->site-f/audit"])
    for empty in ([], "site-a->site-b/policy"):
        with pytest.raises(ConfigurationError, match="a shard is a non-empty list of sessions"):
            shard_sessions(topo, sessions=empty)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="no session replicates from 'site-z'"):
        shard_sessions(topo, "site-z")


def test_a_stream_task_given_a_shard_of_no_session_fails_at_once_without_retry(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(fan_out_topology(a=["b"]).document))
    op = LRStreamOperator(
        task_id="stream", shard="site-a 2/2", sessions=["site-a->site-c/policy"], topology_path=str(path)
    )
    started = time.monotonic()
    with pytest.raises(FinalRefusal, match=r"shard site-a 2/2 refused: session site-a->site-c/policy is not"):
        op.execute({})
    with pytest.raises(FinalRefusal, match="shard site-z refused: no session replicates from 'site-z'"):
        LRStreamOperator(task_id="stream", source="site-z", topology_path=str(path)).execute({})
    assert time.monotonic() - started < 5  # nothing streamed for run_for first


def test_a_retried_shard_streams_what_is_left_of_its_runs_time():
    """A first try streams ``run_for``; a retry only the rest of its run's ``run_for`` (the shards
    of a run end together); a retry after it fails at once, naming the shard."""
    op = LRStreamOperator(task_id="stream", run_for=600, sessions=["site-a->site-b/policy", "site-a->site-c/policy"])
    assert op.shard_name == "site-a->site-b/policy, site-a->site-c/policy"
    run = SimpleNamespace(start_date=datetime.now(timezone.utc) - timedelta(seconds=400))
    assert op.seconds_to_stream({}) == 600  # outside a DAG run
    assert op.seconds_to_stream({"ti": SimpleNamespace(try_number=1), "dag_run": run}) == 600
    assert 199 <= op.seconds_to_stream({"ti": SimpleNamespace(try_number=2), "dag_run": run}) <= 200
    late = SimpleNamespace(start_date=datetime.now(timezone.utc) - timedelta(seconds=601))
    with pytest.raises(FinalRefusal, match="try 3 started after its run's 600 s.*the next run streams it"):
        op.seconds_to_stream({"ti": SimpleNamespace(try_number=3), "dag_run": late})
    for years in (10**13, float("nan")):  # past ~292 years the end timer died: the task never ended
        with pytest.raises(FinalRefusal, match="run_for must be between 1 and 604800 seconds"):
            LRStreamOperator(task_id="stream", run_for=years, source="site-a").seconds_to_stream({})


def test_the_dag_maps_its_stream_task_over_the_shards_task(dagbag):
    dag = dagbag.dags["lr_streaming"]
    stream = dag.get_task("stream")
    assert stream.map_index_template == "{{ task.shard_name }}"
    assert {t.task_id for t in stream.upstream_list} == {"shards"}
    assert stream.partial_kwargs["retries"] == 3
    params = dag.params
    assert params.get_param("source").schema["enum"] == [None, "site-a"]  # the parse-time topology's sources
    assert params.get_param("sessions_per_shard").resolve(None) is None


def sessions_past_first_contact(airflow_sites) -> App:
    """Both sessions through their first contact (in process, leases let go): what the shards
    stream afterwards arrives as log entries, one by one. Returns the source application."""
    app = App(airflow_sites.sites[0])  # its table: the client's full-sync provider reads it
    first = replicator(airflow_sites.topology, airflow_sites.sites, providers={"policy": table_provider})
    run_until_idle(first)
    first.close()
    return app


def holders(source, sink: str) -> list:
    return [
        owner
        for (owner,) in source.query("SELECT lease_owner FROM lr.source_sessions WHERE sink_site_id = %s", (sink,))
    ]


class Writer(threading.Thread):
    """Once one sink's session is leased (the first shard streams), writes ``count`` entries for
    both sinks, noting meanwhile who holds the other sink's session (``others``)."""

    def __init__(self, app: App, count: int) -> None:
        super().__init__()
        self.app, self.count = app, count
        self.others: set = set()
        self.failure: BaseException | None = None

    def run(self) -> None:
        source = self.app.site
        try:
            deadline = time.monotonic() + 60
            while holders(source, "site-b") == holders(source, "site-c") == [None]:
                assert time.monotonic() < deadline, "no shard streamed"
                time.sleep(0.05)
            other = "site-c" if holders(source, "site-b") != [None] else "site-b"
            for i in range(self.count):
                self.app.put(f"k{i}", i, ["site-b", "site-c"])
                self.others.update(holders(source, other))
                time.sleep(0.01)
        except BaseException as exc:  # the test asserts it after join
            self.failure = exc


@pytest.mark.slow
def test_a_source_split_in_two_shards_streams_each_in_its_own_task_every_entry_once(dagbag, airflow_sites):
    """``sessions_per_shard`` 1: two stream task instances, listed ``site-a 1/2`` and ``site-a 2/2``,
    each streaming its one session only (``dag.test`` runs them one after the other: while the
    first streams, nobody holds the other session; the second then catches it up); every entry
    reaches each sink once, in order."""
    source, sink_b, sink_c = airflow_sites.sites
    app = sessions_past_first_contact(airflow_sites)
    writer = Writer(app, 20)
    writer.start()
    run = dagbag.dags["lr_streaming"].test(run_conf={"run_for_seconds": 5, "sessions_per_shard": 1})
    writer.join()
    assert writer.failure is None and writer.others == {None}, (writer.failure, writer.others)
    got = states(run)
    assert str(run.state) == "success", got
    assert got == {("shards", -1): "success", ("stream", 0): "success", ("stream", 1): "success"}
    labels = {ti.map_index: ti.rendered_map_index for ti in run.get_task_instances() if ti.task_id == "stream"}
    assert labels == {0: "site-a 1/2", 1: "site-a 2/2"}
    for index, session in enumerate(["site-a->site-b/policy", "site-a->site-c/policy"]):
        summary = xcom(run, "stream", index)
        assert summary["sessions"] == [session] and summary["delivered"] == {session: 20}, summary
        assert summary["failing"] == [] and summary["shard"] == labels[index], summary
    for sink in (sink_b, sink_c):
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(20)]
    app.close()


@pytest.mark.slow
def test_a_shard_whose_sink_is_down_fails_alone_after_the_other_shard_delivered(dagbag, airflow_sites, monkeypatch):
    """site-c down: shard ``site-a 2/2`` (its one session failing all along) fails, named and
    listed by its name, without a retry (its run's time is over: the next run streams it); shard
    ``site-a 1/2`` delivered; the run is red."""
    import json

    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b", "site-c"])
    down = dict(sink_c.server.airflow_conn(sink_c.dbname), port=1)  # nothing listens there
    monkeypatch.setenv("AIRFLOW_CONN_LR_SITE_C", json.dumps(down))
    run = dagbag.dags["lr_streaming"].test(run_conf={"run_for_seconds": 3, "sessions_per_shard": 1})
    got = states(run)
    assert str(run.state) == "failed", got
    assert got == {("shards", -1): "success", ("stream", 0): "success", ("stream", 1): "failed"}
    tis = {ti.map_index: ti for ti in run.get_task_instances() if ti.task_id == "stream"}
    assert tis[1].rendered_map_index == "site-a 2/2" and tis[1].try_number == 1  # not retried
    assert xcom(run, "stream", 0)["failing"] == []
    assert final_state(queue(sink_b, "site-a")) == {"k": 1}
    error = source.query("SELECT last_error FROM lr.source_sessions WHERE sink_site_id = 'site-c'")[0][0]
    assert "cannot connect to site 'site-c'" in error
    app.close()


@pytest.mark.slow
def test_a_retried_shard_streams_the_rest_of_its_runs_time_and_delivers(airflow_sites):
    """The second try of a shard whose run started ``run_for`` - 5 s ago streams at most 5 s, not
    ``run_for``, and delivers what was written meanwhile."""
    source, sink_b, _ = airflow_sites.sites
    app = sessions_past_first_contact(airflow_sites)
    stale = airflow_sites.topology_path.with_name("stale.yaml")  # what the file was before a failover
    stale.write_text(yaml.safe_dump({**airflow_sites.topology.document, "settings": {"lease_seconds": 7}}))
    started = time.monotonic()
    with pytest.raises(FinalRefusal, match=r"topology file .*stale.yaml has id \w+; sites hold"):
        LRStreamOperator(task_id="stream", source="site-a", run_for=60, topology_path=str(stale)).execute({})
    assert time.monotonic() - started < 10  # at once: it streamed its run_for of failing sessions first
    op = LRStreamOperator(task_id="stream", shard="site-a 1/2", sessions=["site-a->site-b/policy"], run_for=60)
    run = SimpleNamespace(start_date=datetime.now(timezone.utc) - timedelta(seconds=55))
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    started = time.monotonic()
    summary = op.execute({"ti": SimpleNamespace(try_number=2), "dag_run": run})
    assert 1 <= summary["planned_seconds"] <= 5 and time.monotonic() - started < 15, summary
    assert summary["delivered"] == {"site-a->site-b/policy": 5}, summary
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(5)]
    app.close()


def stream_task_process(run_id: str, map_index: int, log: Path) -> subprocess.Popen:
    """``airflow tasks test lr_streaming stream RUN --map-index N``: one shard's stream task in a
    process of its own, as a worker runs it (this tree's DAGs and provider; the test's Airflow
    home, connections and topology through the environment)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_DIR),
    }
    command = [sys.executable, "-m", "airflow", "tasks", "test", "lr_streaming", "stream", run_id]
    with log.open("w") as out:
        return subprocess.Popen([*command, "--map-index", str(map_index)], env=env, stdout=out, stderr=out)


@pytest.mark.slow
def test_two_shards_stream_at_the_same_time_in_two_task_processes(dagbag, airflow_sites, tmp_path):
    """A run's two shard tasks (``sessions_per_shard`` 1), each in an ``airflow tasks test``
    process: both hold their own session at the same time, under different owners, neither
    refused by the other; each sink gets every entry once, in order."""
    source, sink_b, sink_c = airflow_sites.sites
    app = sessions_past_first_contact(airflow_sites)
    run = dagbag.dags["lr_streaming"].test(
        run_conf={"run_for_seconds": 15, "sessions_per_shard": 1}, mark_success_pattern="stream"
    )  # the shards computed, the stream tasks left to the processes
    logs = [tmp_path / f"stream-{index}.log" for index in (0, 1)]
    processes = [stream_task_process(run.run_id, index, logs[index]) for index in (0, 1)]
    try:
        deadline = time.monotonic() + 120  # two Airflow task processes starting on a loaded machine
        while None in holders(source, "site-b") + holders(source, "site-c"):
            assert time.monotonic() < deadline, [log.read_text()[-3000:] for log in logs]
            assert all(p.poll() is None for p in processes), [log.read_text()[-3000:] for log in logs]
            time.sleep(0.1)
        owners = {*holders(source, "site-b"), *holders(source, "site-c")}
        assert len(owners) == 2  # streaming at once, each its own session
        for i in range(20):
            app.put(f"k{i}", i, ["site-b", "site-c"])
            time.sleep(0.02)
        for process in processes:
            assert process.wait(90) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for index, session in enumerate(["site-a->site-b/policy", "site-a->site-c/policy"]):
        summary = xcom(run, "stream", index)
        assert summary["delivered"] == {session: 20} and summary["failing"] == [], summary
        assert summary["seconds"] >= 12, summary  # it streamed its run_for, not stopped by the other
    for sink in (sink_b, sink_c):
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(20)]
    app.close()


def test_a_shard_streaming_when_a_failover_makes_its_file_stale_stops_and_fails_for_good(airflow_sites, monkeypatch):
    """The sites take another topology while a shard streams (a failover applied it, or an apply of
    another file): its sessions are refused from then on. The shard stops once its topology has
    stayed stale ``STALE_FOR`` and fails without a retry, naming the file, as ``lr sync`` stops.
    Before, it retried its refused sessions every few seconds until its ``run_for`` ended (600 s by
    default), run after run."""
    from airflow_provider_lr import cli
    from airflow_provider_lr.engine.site import stale_topology

    monkeypatch.setattr(stale_topology, "STALE_FOR", 1.0)  # (10 s: the suite's time)
    app = sessions_past_first_contact(airflow_sites)
    op = LRStreamOperator(task_id="stream", source="site-a", run_for=120)
    ended: dict = {}

    def run() -> None:
        try:
            ended["summary"] = op.execute({})
        except BaseException as exc:  # (FinalRefusal is a SystemExit)
            ended["error"] = exc

    streaming = threading.Thread(target=run, daemon=True)
    streaming.start()
    app.put("before", 1, ["site-b", "site-c"])
    source = airflow_sites.sites[0]
    deadline = time.monotonic() + 30
    while source.query("SELECT count(*) FROM lr.source_sessions WHERE lease_owner IS NOT NULL") != [(2,)]:
        assert time.monotonic() < deadline, "the shard never leased its sessions"
        time.sleep(0.1)
    other = airflow_sites.topology_path.parent / "moved.yaml"
    doc = yaml.safe_load(airflow_sites.topology_path.read_text())
    other.write_text(yaml.safe_dump({**doc, "settings": {**doc.get("settings", {}), "lease_seconds": 45}}))
    started = time.monotonic()
    assert cli.main(["topology", "apply", "--topology", str(other)]) == 0
    streaming.join(60)
    took = time.monotonic() - started
    app.close()
    assert not streaming.is_alive(), "the shard kept retrying its refused sessions"
    error = ended.get("error")
    assert isinstance(error, FinalRefusal), ended
    assert re.search(r"shard site-a refused: stopped: .*topology", str(error)), str(error)
    assert took < 40, took


def test_a_shard_whose_login_lacks_lrs_grants_fails_for_good_at_once_not_after_its_run_for(airflow_sites, monkeypatch):
    """The shard's connection logs in as the client's writer, not a replicator: every session's
    cycle is refused for the missing grant. The shard stops at once and fails for good naming the
    role and the grant to give, as the other operators do; before, it streamed its whole ``run_for``
    of failing cycles (600 s by default), then failed to be retried."""
    import json

    from tests.engine.site.test_roles import Roles

    source = airflow_sites.sites[0]
    made = Roles(airflow_sites.sites)
    try:
        writer = made.name("writer")
        made.grant(source, "writer", writer, ["policy"])
        conn = {**source.server.airflow_conn(source.dbname), "login": writer}
        monkeypatch.setenv("AIRFLOW_CONN_LR_SITE_A", json.dumps(conn))
        op = LRStreamOperator(task_id="stream", source="site-a", run_for=120)
        started = time.monotonic()
        with pytest.raises(FinalRefusal) as refused:
            op.execute({})
        said = str(refused.value)
        assert said.startswith("shard site-a refused: session site-a->site-b/policy: "), said
        assert "permission denied" in said and writer in said and "lr roles grant replicator" in said, said
        assert time.monotonic() - started < 60, said  # not its run_for
    finally:
        made.drop()


@pytest.mark.slow
def test_a_shard_beside_a_streaming_lr_sync_says_its_sessions_were_held_by_it_and_nothing_is_doubled(airflow_sites):
    """``lr sync`` streams both sessions (their leases all along) and a shard of the same source
    streams beside it: the shard takes nothing, delivers nothing twice, and its summary says its
    sessions were held by that ``lr sync`` (``held_elsewhere``, naming the holder), not that it
    streamed them; ``lr sync`` delivers every entry once and stops cleanly. Before, the summary
    listed both sessions as streamed for ``run_for`` with 0 delivered, and said nothing else."""
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b", "site-c"])
    with lr_sync_process(airflow_sites.topology_path, source) as streaming:
        holder = f":{streaming.pid}:"
        op = LRStreamOperator(task_id="stream", source="site-a", run_for=3)
        ended: dict = {}
        shard = threading.Thread(target=lambda: ended.update(summary=op.execute({})), daemon=True)
        shard.start()
        for i in range(10):
            app.put(f"k{i}", i, ["site-b", "site-c"])
        shard.join(60)
        assert not shard.is_alive(), "the shard did not end after its run_for"
        summary = ended["summary"]
        assert summary["delivered"] == {"site-a->site-b/policy": 0, "site-a->site-c/policy": 0}, summary
        assert summary["failing"] == [] and sorted(summary["held_elsewhere"]) == summary["sessions"], summary
        assert all(holder in why for why in summary["held_elsewhere"].values()), summary
        deadline = time.monotonic() + 60
        while any(queue(sink, "site-a")[-1:] != [("log", "k9=9")] for sink in (sink_b, sink_c)):
            assert time.monotonic() < deadline, "lr sync did not deliver"
            time.sleep(0.1)
        assert all(owner and holder in owner for owner in holders(source, "site-b") + holders(source, "site-c"))
    assert streaming.returncode == 0
    for sink in (sink_b, sink_c):  # the full sync, then every entry once, in order
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(10)]
    app.close()
