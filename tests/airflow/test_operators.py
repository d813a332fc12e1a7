"""Operators and sensors run directly (``execute``) against real sites through Airflow connections."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import time
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException, TaskDeferred

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.operators import (
    LRDiscoverSessionsOperator,
    LRLogEntrySyncOperator,
    LRNegotiateOperator,
    LRReceiveQueueReportOperator,
    LRSnapshotSyncOperator,
    LRTrimOperator,
)
from airflow_provider_lr.operators.common import FinalRefusal, TaskRefused
from airflow_provider_lr.operators.fanout import LRFanOutOperator
from airflow_provider_lr.operators.spark import (
    LRSparkApplyReceiveQueueOperator,
    LRSparkFanOutOperator,
    LRSparkSnapshotTransferOperator,
    LRSparkTableSnapshotOperator,
    plan_fanout,
    write_connections_file,
)
from airflow_provider_lr.sensors import LRDeliveredSensor, LRReadySensor
from airflow_provider_lr.triggers import LRDeliveredTrigger, LRReadyTrigger, LRSnapshotEndTrigger
from tests.support.airflow_env import airflow_sites, reconfigure  # noqa: F401
from tests.support.session import App, queue, replicator, table_provider, wait_for


def _sessions(**filters) -> list[dict]:
    return LRDiscoverSessionsOperator(task_id="discover", **filters).execute({})


def _step(cls, session: dict, **kwargs):
    return cls(task_id=cls.__name__, session=session, **kwargs).execute({})


def _app_with_sinks_in_log_entry_sync(source) -> App:
    app = App(source)
    for session in _sessions():
        _step(LRSnapshotSyncOperator, session)
    return app


def test_discover_returns_small_session_handles(airflow_sites):
    assert _sessions(sink="site-c") == [
        {
            "session": "site-a->site-c/policy",
            "source": "site-a",
            "sink": "site-c",
            "client": "policy",
            "source_conn_id": "lr_site_a",
            "sink_conn_id": "lr_site_c",
        }
    ]
    assert [s["sink"] for s in _sessions()] == ["site-b", "site-c"]


def test_negotiate_then_only_the_chosen_branch_runs(airflow_sites):
    source, sink_b, _ = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b"])
    session = _sessions(sink="site-b")[0]
    decision = _step(LRNegotiateOperator, session)
    assert decision["branch"] == "snapshot_sync" and decision["reason"] == "first contact: the sink has no snapshot"
    with pytest.raises(AirflowSkipException, match="negotiation chose 'snapshot_sync'"):
        _step(LRLogEntrySyncOperator, session, decision=decision)
    done = _step(LRSnapshotSyncOperator, session, decision=decision)
    assert done["snapshot_messages"] == 3 and done["state"] == "IN_LOG_ENTRY_SYNC"  # start, k=1, end
    assert [k for k, _ in queue(sink_b, "site-a")] == ["start", "snap", "end"]

    for i in range(25):
        app.put(f"n{i}", i, ["site-b"])
    decision = _step(LRNegotiateOperator, session)
    assert decision["branch"] == "log_entry_sync"
    with pytest.raises(AirflowSkipException):
        _step(LRSnapshotSyncOperator, session, decision=decision)
    batch = _step(LRLogEntrySyncOperator, session, decision=decision, max_batches=1, max_entries=10)
    assert batch["delivered"] == 10 and batch["remaining"] == 15
    assert _step(LRLogEntrySyncOperator, session)["delivered"] == 15
    app.close()


def test_snapshot_waits_deferred_for_the_clients_data_then_applies_it(airflow_sites):
    reconfigure(airflow_sites, provider=None)  # the client application serves its own full syncs
    source, sink_b, _ = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b"])
    session = _sessions(sink="site-b")[0]
    op = LRSnapshotSyncOperator(task_id="snapshot", session=session, wait_for_data=True, poll_interval=0.1)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, LRSnapshotEndTrigger) and deferred.value.method_name == "execute_complete"
    assert queue(sink_b, "site-a", visible_only=False) == []

    RoutingQueueClient(app.conn, "policy").serve_full_sync_requests(table_provider)
    event = {"status": "supplied", "request_id": trigger.request_id, "entries": 1}
    assert op.execute_complete({}, event)["state"] == "IN_LOG_ENTRY_SYNC"
    assert queue(sink_b, "site-a") == [("start", ""), ("snap", "k=1"), ("end", "")]
    app.close()


def test_a_snapshot_step_that_applies_a_full_sync_counts_it_in_its_report(airflow_sites):
    """The step's report (its XCom, what ``lr_replication``'s and ``lr_full_sync``'s
    ``snapshot_sync`` return) counts the full sync it applied, as a cycle of ``lr sync`` does;
    before, it said ``full_syncs: 0`` beside the messages it had just applied."""
    source, sink_b, _ = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b"])
    report = LRSnapshotSyncOperator(task_id="snapshot", session=_sessions(sink="site-b")[0]).execute({})
    assert queue(sink_b, "site-a") == [("start", ""), ("snap", "k=1"), ("end", "")]
    assert report["full_syncs"] == 1 and report["snapshot_messages"] == 3, report
    again = LRSnapshotSyncOperator(task_id="snapshot", session=_sessions(sink="site-b")[0]).execute({})
    assert again["full_syncs"] == 0, again  # log-entry sync now: nothing applied by this step
    app.close()


def test_snapshot_without_client_data_fails_with_the_fix(airflow_sites):
    reconfigure(airflow_sites, provider=None)
    session = _sessions(sink="site-b")[0]
    op = LRSnapshotSyncOperator(
        task_id="snapshot", session=session, wait_for_data=True, deferrable=False, poll_interval=0.05
    )
    request = None
    waiting = _step(LRSnapshotSyncOperator, session)  # lr_replication's mode: report and move on
    assert waiting["waiting"] is True and waiting["reason"].startswith("waiting for full-sync data")
    request = waiting["request_id"]
    source = airflow_sites.site("site-a")
    source.query("UPDATE lr.full_sync_requests SET data_deadline = now() WHERE request_id = %s", (request,))
    with pytest.raises(AirflowException, match=r"supplied no full-sync data .*client.serve_full_sync_requests"):
        op.execute({})
    assert source.query("SELECT status FROM lr.full_sync_requests WHERE request_id = %s", (request,)) == [
        ("timed_out",)
    ]


def test_a_wait_polled_in_the_worker_ends_at_its_timeout_not_a_pause_past_it(airflow_sites):
    """``deferrable=False``: the wait's pause doubles up to ``max_poll_interval``, and the last one
    is cut at the timeout (a 0.5 s wait with pauses of 0.4 then 0.8 s used to give up after 1.2 s)."""

    class NeverDone:  # a trigger's check that never sees its event, with no bound of its own
        def check(self, conn):  # type: ignore[no-untyped-def]
            return None

        def timed_out(self) -> bool:
            return False

        def why(self, conn) -> str:  # type: ignore[no-untyped-def]
            return ""

    op = LRSnapshotSyncOperator(
        task_id="snapshot",
        session=_sessions(sink="site-b")[0],
        deferrable=False,
        poll_interval=0.4,
        max_poll_interval=5,
    )
    started = time.monotonic()
    with pytest.raises(AirflowException, match="still waiting after"):
        op._wait({}, NeverDone(), timedelta(seconds=0.5), "execute_complete")
    assert time.monotonic() - started < 0.9


def test_refused_negotiation_fails_without_retry_and_is_recorded(airflow_sites):
    sink_c = airflow_sites.site("site-c")
    sink_c.query("UPDATE lr.topology SET topology_config_id = 'other'")
    session = _sessions(sink="site-c")[0]
    with pytest.raises(FinalRefusal, match="topology config id mismatch"):  # one ERROR line, no retry
        _step(LRNegotiateOperator, session)
    errors = airflow_sites.site("site-a").query(
        "SELECT last_error FROM lr.source_sessions WHERE sink_site_id = 'site-c'"
    )
    assert "topology config id mismatch" in errors[0][0]


def test_a_step_from_a_topology_file_the_source_does_not_run_fails_naming_the_file(airflow_sites, capfd):
    from airflow_provider_lr.engine.site import topology
    from airflow_provider_lr.engine.store import topology as topologies

    edited = topologies.from_document({**airflow_sites.topology.document, "settings": {"lease_seconds": 30}})
    conn = airflow_sites.site("site-a").connect()
    topology.apply_to_site(conn, edited, "site-a")  # the source runs another topology than the tasks' file
    conn.close()
    session = _sessions(sink="site-b")[0]
    capfd.readouterr()
    with pytest.raises(FinalRefusal) as failed:  # it logged a traceback (AirflowFailException): one ERROR line now
        _step(LRNegotiateOperator, session)
    errors = [line for line in "".join(capfd.readouterr()).splitlines() if "error" in line.split("]")[0]]
    assert len(errors) == 1 and str(failed.value) in errors[0], errors
    assert str(failed.value).startswith("session site-a->site-b/policy refused: ")
    # a SystemExit, which Airflow logs as "Task exited" without a traceback; its retry policy fails it, no retry
    decision = LRNegotiateOperator(task_id="t", session=session).retry_policy.evaluate(failed.value, 1, 4)
    assert decision.action.value == "fail"
    assert (
        f"topology file {airflow_sites.topology_path} has id {airflow_sites.topology.topology_config_id}; "
        f"sites hold {edited.topology_config_id} (site-a)"
    ) in str(failed.value)
    assert "lease" not in str(failed.value)


def test_a_connection_to_the_wrong_database_is_refused(airflow_sites, monkeypatch):
    monkeypatch.setenv(
        *[airflow_sites.env(airflow_sites.site("site-c"))[0], airflow_sites.env(airflow_sites.site("site-b"))[1]]
    )
    with pytest.raises(TaskRefused, match="refused: connection 'lr_site_c' points at site 'site-b'"):  # one line
        _step(LRNegotiateOperator, _sessions(sink="site-c")[0])


def test_safe_trim_removes_only_what_every_sink_has(airflow_sites):
    source = airflow_sites.site("site-a")
    app = _app_with_sinks_in_log_entry_sync(source)
    app.put("both", 1, ["site-b", "site-c"])
    _step(LRLogEntrySyncOperator, _sessions(sink="site-b")[0])
    site = {"site": "site-a", "conn_id": "lr_site_a", "region": "region-1"}
    LRTrimOperator(task_id="trim", site=site).execute({})
    assert source.query("SELECT count(*) FROM lr.log_entries WHERE stream = 1") == [(1,)]  # site-c lacks it
    _step(LRLogEntrySyncOperator, _sessions(sink="site-c")[0])
    result = LRTrimOperator(task_id="trim", site=site).execute({})
    assert result["trimmed"] and source.query("SELECT count(*) FROM lr.log_entries WHERE stream = 1") == [(0,)]
    app.close()


def test_queue_report_of_a_sink_whose_queue_is_locked_says_it_not_read_and_who_holds_it(airflow_sites, monkeypatch):
    """`lr.receive_queue` held ACCESS EXCLUSIVE at a sink (VACUUM FULL, an admin's LOCK): the report
    task failed after the whole lock_timeout (5 s) with a bare lock error. A report is a checkpoint
    that warns: it now waits the short status wait, warns that the queues were not read and which
    pid holds the lock, and returns the site as not read; unlocked, it reports the queues."""
    from airflow_provider_lr.engine.site import status_parts

    monkeypatch.setattr(status_parts, "STATUS_LOCK_WAIT", "200ms")
    site = {"site": "site-b", "conn_id": "lr_site_b", "region": "region-1"}
    report = LRReceiveQueueReportOperator(task_id="queues", site=site)
    admin = airflow_sites.site("site-b").connect()
    with admin.cursor() as cur:
        cur.execute("LOCK TABLE lr.receive_queue IN ACCESS EXCLUSIVE MODE")
    started = time.monotonic()
    said = report.execute({})
    took = time.monotonic() - started
    assert said["queues"] is None and said["site"] == "site-b", said
    expected = (
        f"receive queues not read: lr.receive_queue is locked by pid {admin.info.backend_pid} (AccessExclusiveLock)"
    )
    assert said["unread"] == [expected], said
    assert took < 4.0, took  # not the 5 s lock_timeout
    admin.rollback()
    admin.close()
    said = report.execute({})
    assert said["unread"] == [] and isinstance(said["queues"], list), said


def test_delivered_sensor_returns_at_once_when_delivered_and_defers_otherwise(airflow_sites):
    source = airflow_sites.site("site-a")
    app = _app_with_sinks_in_log_entry_sync(source)
    app.put("k", 1, ["site-b", "site-c"])
    position = source.query("SELECT max(position) FROM lr.log_commits")[0][0]
    sensor = LRDeliveredSensor(
        task_id="delivered", source="site-a", client="policy", position=position, destinations=["site-b"], min_regions=2
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert isinstance(deferred.value.trigger, LRDeliveredTrigger)
    _step(LRLogEntrySyncOperator, _sessions(sink="site-b")[0])
    assert sensor.execute({})["safe_on"] == ["site-b"]
    impossible = LRDeliveredSensor(
        task_id="delivered", source="site-a", client="policy", position=position, destinations=["site-b"], min_regions=3
    )
    with pytest.raises(ConfigurationError, match="can never be met"):
        impossible.execute({})
    with pytest.raises(AirflowException, match="error: boom"):
        sensor.execute_complete({}, {"status": "error", "message": "boom"})
    app.close()


def test_ready_sensor_waits_until_the_destination_holds_everything_committed(airflow_sites):
    source = airflow_sites.site("site-a")
    app = _app_with_sinks_in_log_entry_sync(source)
    app.put("k", 1, ["site-b"])
    app.put("j", 2, ["site-c"])
    sensor = LRReadySensor(task_id="ready", source="site-a", client="policy", destinations=["site-b"])
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})  # site-b lacks its entry: not ready
    assert isinstance(deferred.value.trigger, LRReadyTrigger)
    _step(LRLogEntrySyncOperator, _sessions(sink="site-b")[0])
    assert sensor.execute({})["ready"] == ["site-b"]  # site-c's backlog does not matter to it
    with pytest.raises(ConfigurationError, match="not sinks of 'site-a'"):
        LRReadySensor(task_id="ready", source="site-a", client="policy", destinations=["site-z"]).execute({})
    app.close()


def test_plan_chooses_spark_only_for_a_large_backlog_with_spark_available(airflow_sites, monkeypatch):
    source = airflow_sites.site("site-a")
    app = _app_with_sinks_in_log_entry_sync(source)
    for i in range(3):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    site = {"site": "site-a", "conn_id": "lr_site_a"}
    small = plan_fanout(site, "spark_test")
    assert (small["backlog"], small["path"], small["threshold"]) == (6, "in_process", small["threshold"])
    reconfigure(airflow_sites, settings={"spark_min_backlog": 5})
    for session in _sessions():  # the new topology id: sessions renegotiate and continue
        _step(LRNegotiateOperator, session)
    no_conn = plan_fanout(site, "spark_test")
    assert no_conn["path"] == "in_process" and "no Spark connection 'spark_test'" in no_conn["why"]
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_TEST", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    big = plan_fanout(site, "spark_test")
    job_installed = "not installed" not in big["why"]
    assert big["path"] == ("spark" if job_installed else "in_process"), big
    app.close()


def test_connections_file_for_spark_is_private_and_complete(airflow_sites, tmp_path):
    path = write_connections_file(["lr_site_a", "lr_site_b"], directory=str(tmp_path))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        conns = json.loads(open(path).read())
        assert set(conns) == {"lr_site_a", "lr_site_b"}
        assert conns["lr_site_b"]["extra"]["site_id"] == "site-b" and conns["lr_site_b"]["conn_type"] == "lr_site"
    finally:
        os.unlink(path)


@pytest.mark.slow
def test_spark_fan_out_operator_delivers_the_backlog_staged_by_two_tasks_and_cleans_up(
    airflow_sites, monkeypatch, tmp_path
):
    source, sink_b, sink_c = airflow_sites.sites
    app = _app_with_sinks_in_log_entry_sync(source)
    for i in range(10):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_LOCAL", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the connections file is written
    op = LRSparkFanOutOperator(
        task_id="fanout", source="site-a", conn_id="spark_local", tasks=2, conf={"spark.ui.enabled": "false"}
    )
    result = op.execute({})
    assert result["ok"] and result["total_deliveries"] == 20
    assert op.application_args[op.application_args.index("--tasks") + 1] == "2"  # staged, published in order
    for sink in (sink_b, sink_c):
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(10)]
    conns_file = op.env_vars["LR_CONNECTIONS_FILE"]  # handed to the job through the environment only
    assert os.path.dirname(conns_file) == str(tmp_path) and not os.path.exists(conns_file)  # removed after
    assert not any("password" in str(a) or "lr-connections" in str(a) for a in op.application_args)
    app.close()


@pytest.mark.slow
def test_bulk_apply_operator_applies_the_sinks_queue_in_source_order_once(airflow_sites, monkeypatch):
    """A user's DAG step: LRSparkApplyReceiveQueueOperator submits lr_apply_receive_queue.py with
    the user's function; every entry is applied once, in source order, and left the queue."""
    from airflow_provider_lr.operators.spark import LRSparkApplyReceiveQueueOperator

    source, sink_b, _ = airflow_sites.sites
    app = _app_with_sinks_in_log_entry_sync(source)
    for i in range(30):
        app.put(f"k{i}", i, ["site-b"])
    for session in _sessions(sink="site-b"):
        _step(LRLogEntrySyncOperator, session)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_LOCAL", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    op = LRSparkApplyReceiveQueueOperator(
        task_id="apply",
        sink="site-b",
        client="policy",
        function="tests.support.spark_env:record_applied",
        batch=7,
        conn_id="spark_local",
        conf={"spark.ui.enabled": "false"},
        env_vars={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    result = op.execute({})
    assert result["ok"], result
    applied = [p for (p,) in sink_b.query("SELECT payload FROM applied WHERE kind = 'log' ORDER BY n")]
    assert applied == [f"k{i}={i}" for i in range(30)]
    assert [k for k, _ in queue(sink_b, "site-a")] == []  # delivered: gone from the queue
    app.close()


@pytest.mark.parametrize(
    "operator, kwargs",
    [
        (LRSparkFanOutOperator, {"source": "site-a", "tasks": 0}),
        (LRSparkFanOutOperator, {"source": "site-a", "max_entries": -5}),
        (LRFanOutOperator, {"source": "site-a", "max_entries": 0}),
        (LRSparkTableSnapshotOperator, {"source": "site-a", "client": "policy", "parts": 0}),
        (LRSparkSnapshotTransferOperator, {"source": "site-a", "sink": "site-b", "client": "policy", "partitions": -1}),
        (LRSparkApplyReceiveQueueOperator, {"sink": "site-b", "client": "policy", "function": "m:f", "batch": 0}),
        (LRLogEntrySyncOperator, {"max_batches": 0}),
    ],
)
def test_an_operator_with_a_count_below_one_is_refused_when_the_dag_is_parsed(operator, kwargs):
    name = next(k for k in kwargs if k in ("tasks", "max_entries", "parts", "partitions", "batch", "max_batches"))
    with pytest.raises(ConfigurationError, match=f"{name} must be a whole number of at least 1"):
        operator(task_id="bad_count", **kwargs)


def test_every_module_the_provider_declares_imports():
    import importlib

    from airflow_provider_lr.get_provider_info import get_provider_info

    info = get_provider_info()
    modules = [
        m
        for kind in ("hooks", "operators", "sensors", "triggers")
        for entry in info[kind]
        for m in entry["python-modules"]
    ]
    assert len(modules) == 8
    for module in modules:
        importlib.import_module(module)


def _requested(airflow_sites, sink: str) -> dict:
    """The session to ``sink`` with a forced full-sync request, as lr_full_sync hands it on."""
    from airflow_provider_lr.engine.source import full_sync

    session = _sessions(sink=sink)[0]
    conn = airflow_sites.site("site-a").connect()
    request = full_sync.request_full_sync(conn, sink, "policy", "audit", forced=True)
    conn.close()
    return {**session, "request_id": request.request_id}


def test_a_full_sync_step_waits_for_its_request_while_another_replicator_holds_the_session(airflow_sites):
    """lr_full_sync's step does not fail on a lease held elsewhere: it defers until ITS request is
    applied, here by the replicator holding the lease (as ``lr sync`` or the stream would)."""
    from airflow_provider_lr.engine.session import lease
    from airflow_provider_lr.triggers import LRFullSyncOutcomeTrigger

    app = _app_with_sinks_in_log_entry_sync(airflow_sites.site("site-a"))
    session = _requested(airflow_sites, "site-b")
    conn = airflow_sites.site("site-a").connect()
    held = lease.acquire(conn, "site-b", "policy", "lr-sync-elsewhere", 60)
    assert held is not None
    assert (
        "another replicator holds this session's lease (lr-sync-elsewhere)"
        in _step(LRSnapshotSyncOperator, session)["skipped"]
    )  # lr_replication's mode: nothing to do now
    pushed = _step(LRLogEntrySyncOperator, session)
    assert "another replicator holds" in pushed["skipped"]
    assert pushed.get("acked_position", 0) >= 0, pushed  # it logged 'acked_position': -1, never learned
    op = LRSnapshotSyncOperator(task_id="snapshot", session=session, wait_for_data=True)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, LRFullSyncOutcomeTrigger) and deferred.value.method_name == "outcome_complete"
    assert trigger.request_id == session["request_id"]
    with closing(airflow_sites.site("site-a").connect()) as probe:
        assert trigger.check(probe) is None  # pending, and the lease is held: keep waiting

    elsewhere = replicator(
        airflow_sites.topology,
        airflow_sites.sites,
        providers={"policy": table_provider},
        owner="lr-sync-elsewhere",
        sessions=[SessionKey("site-a", "site-b", "policy")],
    )
    assert elsewhere.run_cycle()[0].snapshot_messages > 0  # the other replicator applies the request
    elsewhere.close()
    with closing(airflow_sites.site("site-a").connect()) as probe:
        event = trigger.check(probe)
    assert event["status"] == "applied" and "applied by lr-sync-elsewhere" in event["message"]
    done = op.outcome_complete({}, event)
    assert done["outcome"] == "applied" and done["applied_request"] == session["request_id"]
    assert [k for k, _ in queue(airflow_sites.site("site-b"), "site-a")].count("start") == 2
    conn.close()
    app.close()


def test_a_waiting_full_sync_step_carries_the_request_out_itself_once_the_lease_is_let_go(airflow_sites):
    from airflow_provider_lr.engine.session import lease

    app = _app_with_sinks_in_log_entry_sync(airflow_sites.site("site-a"))
    session = _requested(airflow_sites, "site-c")
    conn = airflow_sites.site("site-a").connect()
    held = lease.acquire(conn, "site-c", "policy", "lr-sync-elsewhere", 60)
    op = LRSnapshotSyncOperator(task_id="snapshot", session=session, wait_for_data=True)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    lease.release(conn, held)  # that replicator stopped without doing it
    with closing(airflow_sites.site("site-a").connect()) as probe:
        event = deferred.value.trigger.check(probe)
    assert event["status"] == "lease_free"
    done = op.outcome_complete({}, event)  # the step runs again, and this time it holds the lease
    assert done["outcome"] == "applied" and done["snapshot_messages"] > 0
    (note,) = airflow_sites.site("site-a").query(
        "SELECT note FROM lr.full_sync_requests WHERE request_id = %s", (session["request_id"],)
    )[0]
    assert note.startswith("applied by airflow:")
    conn.close()
    app.close()


def test_a_full_sync_step_fails_with_what_became_of_its_request(airflow_sites):
    session = _requested(airflow_sites, "site-b")
    airflow_sites.site("site-a").query(
        "UPDATE lr.full_sync_requests SET status = 'cancelled', note = 'session removed from the topology'"
    )
    with pytest.raises(AirflowFailException, match=r"site-a->site-b/policy: full sync .* cancelled: session removed"):
        _step(LRSnapshotSyncOperator, session, wait_for_data=True)


def test_a_full_sync_step_follows_its_request_to_the_site_a_switchover_asked_it_of(airflow_sites):
    """lr_full_sync asked site-a for a full sync of site-c; site-a was then switched over to site-b,
    which asks it of site-b instead: the step waits, deferred, for site-b's request, and succeeds
    once a replicator applied it there. Before, it failed on site-a's 'cancelled: failed over:
    asked of site-b as request ...'."""
    import psycopg2

    from airflow_provider_lr.engine.site import failover
    from airflow_provider_lr.triggers import LRFullSyncOutcomeTrigger

    app = _app_with_sinks_in_log_entry_sync(airflow_sites.site("site-a"))
    session = _requested(airflow_sites, "site-c")
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}
    switched = failover.promote(
        failover.FailoverRequest("site-a", "site-b", planned=True), lambda site: psycopg2.connect(dsns[site])
    )
    ((there,),) = airflow_sites.site("site-b").query("SELECT request_id::text FROM lr.full_sync_requests WHERE forced")
    op = LRSnapshotSyncOperator(task_id="snapshot", session=session, wait_for_data=True)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, LRFullSyncOutcomeTrigger) and (trigger.source_conn_id, trigger.request_id) == (
        "lr_site_b",
        there,
    )
    App(airflow_sites.site("site-b")).close()  # site-b's provider's table
    run = replicator(switched.topology, airflow_sites.sites, providers={"policy": table_provider})
    run.run(max_cycles=5, until_idle=True, interval=0.01)
    run.close()
    with closing(airflow_sites.site("site-b").connect()) as probe:
        event = trigger.check(probe)
    done = op.outcome_complete({}, event)
    assert done["outcome"] == "applied" and done["applied_request"] == there, done
    assert done["message"].startswith(f"full sync {there} applied by "), done
    app.close()


def test_a_full_sync_step_waiting_for_the_clients_data_follows_its_request_across_a_switchover(airflow_sites):
    """lr_full_sync's step deferred waiting for the client's data at site-a (``LRSnapshotEndTrigger``);
    site-a is then switched over to site-b, which is asked the request instead: the step follows it
    there and waits, deferred, until a replicator applied it at site-b. Before, the wait ended on
    site-a's 'request cancelled', the step ran the old session's cycle with the stale topology and
    failed the run ('the client supplied no full-sync data')."""
    import psycopg2

    from airflow_provider_lr.engine.site import failover
    from airflow_provider_lr.triggers import LRFullSyncOutcomeTrigger

    app = _app_with_sinks_in_log_entry_sync(airflow_sites.site("site-a"))
    reconfigure(airflow_sites, provider=None)  # the client application serves its own full syncs
    session = _requested(airflow_sites, "site-c")
    op = LRSnapshotSyncOperator(task_id="snapshot", session=session, wait_for_data=True, poll_interval=0.1)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    waiting = deferred.value.trigger
    assert isinstance(waiting, LRSnapshotEndTrigger) and waiting.request_id == session["request_id"]
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}
    switched = failover.promote(
        failover.FailoverRequest("site-a", "site-b", planned=True), lambda site: psycopg2.connect(dsns[site])
    )
    ((there,),) = airflow_sites.site("site-b").query("SELECT request_id::text FROM lr.full_sync_requests WHERE forced")
    with closing(airflow_sites.site("site-a").connect()) as probe:
        ended = waiting.check(probe)
    assert ended is not None and ended["status"] == "closed", ended
    with pytest.raises(TaskDeferred) as deferred:
        op.execute_complete({}, ended)
    trigger = deferred.value.trigger
    assert isinstance(trigger, LRFullSyncOutcomeTrigger) and (trigger.source_conn_id, trigger.request_id) == (
        "lr_site_b",
        there,
    )
    App(airflow_sites.site("site-b")).close()  # site-b's provider's table
    run = replicator(switched.topology, airflow_sites.sites, providers={"policy": table_provider})
    run.run(max_cycles=5, until_idle=True, interval=0.01)
    run.close()
    with closing(airflow_sites.site("site-b").connect()) as probe:
        event = trigger.check(probe)
    done = op.outcome_complete({}, event)
    assert done["outcome"] == "applied" and done["applied_request"] == there, done
    app.close()


def test_the_snapshot_end_sensor_follows_its_request_across_a_planned_switchover(airflow_sites):
    """LRSnapshotEndSensor waits, deferred, for the client's data of a full sync asked of site-a;
    site-a is switched over to site-b, which is asked the request instead: the sensor (deferred, and
    poking) follows it to site-b and succeeds once site-b's request has its data. Before, it failed
    on site-a's 'request cancelled: failed over: asked of site-b as request ...'."""
    import psycopg2

    from airflow_provider_lr.engine.site import failover
    from airflow_provider_lr.sensors import LRSnapshotEndSensor

    app = _app_with_sinks_in_log_entry_sync(airflow_sites.site("site-a"))
    reconfigure(airflow_sites, provider=None)  # the client application serves its own full syncs
    session = _requested(airflow_sites, "site-c")
    sensor = LRSnapshotEndSensor(task_id="data", source="site-a", request_id=session["request_id"], timeout=600)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    waiting = deferred.value.trigger
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}
    switched = failover.promote(
        failover.FailoverRequest("site-a", "site-b", planned=True), lambda site: psycopg2.connect(dsns[site])
    )
    ((there,),) = airflow_sites.site("site-b").query("SELECT request_id::text FROM lr.full_sync_requests WHERE forced")
    with closing(airflow_sites.site("site-a").connect()) as probe:
        ended = waiting.check(probe)
    assert ended is not None and (ended["moved_to"], ended["moved_request"]) == ("site-b", there), ended
    resumed = LRSnapshotEndSensor(task_id="data", source="site-a", request_id=session["request_id"], timeout=600)
    with pytest.raises(TaskDeferred) as deferred:
        resumed.execute_complete({}, ended)  # a fresh task instance, as the triggerer hands the event back
    trigger = deferred.value.trigger
    assert (trigger.source_conn_id, trigger.request_id) == ("lr_site_b", there)
    poking = LRSnapshotEndSensor(
        task_id="data", source="site-a", request_id=session["request_id"], deferrable=False, timeout=600
    )
    assert poking.poke({}).is_done is False  # followed to site-b, where the data has not come yet
    App(airflow_sites.site("site-b")).close()  # site-b's provider's table
    run = replicator(switched.topology, airflow_sites.sites, providers={"policy": table_provider})
    run.run(max_cycles=5, until_idle=True, interval=0.01)
    run.close()
    with closing(airflow_sites.site("site-b").connect()) as probe:
        event = trigger.check(probe)
    assert resumed.execute_complete({}, event)["status"] == "supplied"
    poked = poking.poke({})
    assert poked.is_done and poked.xcom_value["request_id"] == there, poked
    app.close()


def test_the_full_sync_applied_sensor_follows_its_request_across_a_planned_switchover(airflow_sites):
    """LRFullSyncAppliedSensor waits, deferred, for a full sync asked of site-a to be applied; site-a
    is switched over to site-b, which is asked the request instead: the sensor (deferred, and poking)
    follows it to site-b and succeeds once site-b's request is applied. Before, it failed on site-a's
    'cancelled: failed over: asked of site-b as request ...' (the snapshot-end sensor's sibling)."""
    import psycopg2

    from airflow_provider_lr.engine.site import failover
    from airflow_provider_lr.sensors import LRFullSyncAppliedSensor

    app = _app_with_sinks_in_log_entry_sync(airflow_sites.site("site-a"))
    session = _requested(airflow_sites, "site-c")
    sensor = LRFullSyncAppliedSensor(task_id="applied", source="site-a", request_id=session["request_id"], timeout=600)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    waiting = deferred.value.trigger
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}
    switched = failover.promote(
        failover.FailoverRequest("site-a", "site-b", planned=True), lambda site: psycopg2.connect(dsns[site])
    )
    ((there,),) = airflow_sites.site("site-b").query("SELECT request_id::text FROM lr.full_sync_requests WHERE forced")
    with closing(airflow_sites.site("site-a").connect()) as probe:
        ended = waiting.check(probe)
    assert ended is not None and (ended.get("moved_to"), ended.get("moved_request")) == ("site-b", there), ended
    resumed = LRFullSyncAppliedSensor(task_id="applied", source="site-a", request_id=session["request_id"], timeout=600)
    with pytest.raises(TaskDeferred) as deferred:
        resumed.execute_complete({}, ended)  # a fresh task instance, as the triggerer hands the event back
    trigger = deferred.value.trigger
    assert (trigger.source_conn_id, trigger.request_id) == ("lr_site_b", there)
    poking = LRFullSyncAppliedSensor(
        task_id="applied", source="site-a", request_id=session["request_id"], deferrable=False, timeout=600
    )
    assert poking.poke({}).is_done is False  # followed to site-b, where it is not applied yet
    App(airflow_sites.site("site-b")).close()  # site-b's provider's table
    run = replicator(switched.topology, airflow_sites.sites, providers={"policy": table_provider})
    run.run(max_cycles=8, until_idle=True, interval=0.01)
    run.close()
    with closing(airflow_sites.site("site-b").connect()) as probe:
        event = trigger.check(probe)
    assert resumed.execute_complete({}, event)["status"] == "applied"
    poked = poking.poke({})
    assert poked.is_done and poked.xcom_value["request_id"] == there, poked
    app.close()


def test_new_log_entries_sensor_pokes_and_defers(airflow_sites):
    from airflow_provider_lr.sensors import LRNewLogEntriesSensor
    from airflow_provider_lr.triggers import LRNewLogEntriesTrigger

    source = airflow_sites.site("site-a")
    app = _app_with_sinks_in_log_entry_sync(source)
    sensor = LRNewLogEntriesSensor(task_id="entries", source="site-a", sink="site-c", client="policy")
    assert sensor.poke({}).is_done is False
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert isinstance(deferred.value.trigger, LRNewLogEntriesTrigger) and deferred.value.trigger.sink == "site-c"
    app.put("k", 1, ["site-c"])
    poked = sensor.poke({})
    assert poked.is_done and poked.xcom_value["pending"] == 1
    assert sensor.execute({})["pending"] == 1  # already true: no deferral
    idle = _step(LRLogEntrySyncOperator, _sessions(sink="site-b")[0])
    assert idle["delivered"] == 0 and idle["remaining"] == 0  # counts stay in the XCom even when zero
    app.close()


def _task_log_lines(op, **context) -> tuple[object, list[str]]:
    """Run ``op`` and return its result and the lines it logged (the task log's events)."""
    from structlog.testing import capture_logs

    with capture_logs() as events:
        result = op.execute(context)
    return result, [e["event"] for e in events]


def test_a_catch_up_longer_than_a_batch_reports_progress_in_the_task_log(airflow_sites, monkeypatch):
    """A log-entry step that takes several batches logs ``N of M entries`` with rate and ETA into
    the task's own log (here every report: LR_PROGRESS_EVERY_S=0); one batch logs nothing."""
    monkeypatch.setenv("LR_PROGRESS_EVERY_S", "0")
    source = airflow_sites.sites[0]
    app = _app_with_sinks_in_log_entry_sync(source)
    for i in range(25):
        app.put(f"k{i}", i, ["site-b"])
    session = _sessions(sink="site-b")[0]
    op = LRLogEntrySyncOperator(task_id="catch_up", session=session, max_entries=10)
    result, lines = _task_log_lines(op)
    assert result["delivered"] == 25
    progress = [line for line in lines if line.startswith("progress: ")]
    assert progress and all("catch-up site-a->site-b/policy" in line for line in progress)
    assert any("10 of 25 entries (" in line and "entries/s, ETA" in line for line in progress), progress
    app.put("k", 1, ["site-b"])
    _, lines = _task_log_lines(op)
    assert not [line for line in lines if line.startswith("progress: ")]  # one batch: quiet
    app.close()


def test_a_branch_whose_negotiation_failed_skips_itself(airflow_sites):
    """Given the negotiation's output, a branch step whose negotiation failed (the output resolved
    to None) skips, so it is listed by session in the grid instead of ending upstream_failed."""
    session = _sessions(sink="site-b")[0]
    op = LRLogEntrySyncOperator(task_id="log_entry_sync", session=session, decision={"branch": "log_entry_sync"})
    op.decision = None  # what templating leaves when decide failed
    with pytest.raises(AirflowSkipException, match="negotiation did not complete"):
        op.execute({})


def test_a_stream_killed_early_says_how_long_it_streamed_and_logs_its_progress(airflow_sites):
    """``LRStreamOperator`` planned for 600 s and killed after a few: its summary and its last line
    give the seconds it really streamed, not the 600 planned, and name what stopped it; meanwhile a
    line every ``report_every`` seconds gives entries/s and the lag, counting what it delivered."""
    import re
    import threading
    import time

    from structlog.testing import capture_logs

    from airflow_provider_lr.operators.stream import LRStreamOperator

    source, sink_b, sink_c = airflow_sites.sites
    app = _app_with_sinks_in_log_entry_sync(source)
    op = LRStreamOperator(task_id="stream", run_for=600, report_every=0.3)
    done: dict = {}

    def run() -> None:
        with capture_logs() as events:
            done["events"] = events  # the task log's events, read while it streams
            done["summary"] = op.execute({})

    runner = threading.Thread(target=run)
    started = time.monotonic()
    runner.start()
    for i in range(10):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    deadline = time.monotonic() + 60
    for sink in (sink_b, sink_c):
        while [p for k, p in queue(sink, "site-a") if k == "log"][-1:] != ["k9=9"]:
            assert time.monotonic() < deadline, f"the stream delivered nothing to {sink.site_id}"
            time.sleep(0.05)
    # a progress line after the last delivery (one every 0.3 s) counts all 20 (nothing more comes)
    counted = re.compile(r", (\d+) in all\)")
    wait_for(
        lambda: any(
            int(m.group(1)) >= 20 for e in list(done.get("events", [])) if (m := counted.search(str(e.get("event"))))
        ),
        60,
        "a progress line counting the 20 deliveries",
    )
    op.on_kill()
    runner.join(60)
    killed_after = time.monotonic() - started
    summary, lines = done["summary"], [e["event"] for e in done["events"]]
    assert 0 < summary["seconds"] <= killed_after + 0.05 < 600 and summary["planned_seconds"] == 600, (
        summary
    )  # to 0.1 s
    delivered = sum(summary["delivered"].values())
    assert delivered >= 20, summary  # 10 entries to each of two sinks
    ended = [line for line in lines if line.startswith("streamed for ")]
    assert ended and re.match(r"streamed for \d+ s of 600 s planned \(stopped by on_kill\)", ended[0]), ended
    pulses = [
        line
        for line in lines
        if re.match(
            r"streaming \d of 2 sessions: \d+ entries in \d+s "
            r"\([\d.]+ entries/s, \d+ in all\), lag ",
            line,
        )
    ]
    assert pulses, lines
    assert any(f", {delivered} in all)" in line for line in pulses), pulses  # counted where delivered
    app.close()


def test_a_session_without_spark_says_so_only_when_a_step_did_sparks_work_itself(airflow_sites, monkeypatch):
    """Without the Spark connection, every log-entry step of every session said "what
    lr_table_snapshot.py would do is done in this step: no Spark connection 'spark_default'", in
    every run, with no federated table at all. Now negotiation and an ordinary step say nothing,
    and a step names the missing job only when it wrote, in-process, what that job takes when it
    can (here a full sync over ``snapshot_spark_min_entries``)."""
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)
    source = airflow_sites.sites[0]
    reconfigure(airflow_sites, settings={"snapshot_spark_min_entries": 2})
    app = App(source)
    app.put("k", 1, ["site-b"])
    session = _sessions(sink="site-b")[0]
    spark = {"spark_conn_id": "spark_default"}
    _, first_lines = _task_log_lines(LRSnapshotSyncOperator(task_id="snapshot_sync", session=session, **spark))
    app.put("k", 2, ["site-b"])
    decided, decide_lines = _task_log_lines(LRNegotiateOperator(task_id="decide", session=session, **spark))
    assert decided["branch"] == "log_entry_sync"
    _, step_lines = _task_log_lines(
        LRLogEntrySyncOperator(task_id="log_entry_sync", session=session, decision=decided, **spark)
    )
    assert not [line for line in decide_lines + step_lines if "Spark" in line], decide_lines + step_lines
    said = [line for line in first_lines if "Spark" in line]
    assert len(said) == 1 and said[0].endswith(
        " full-sync messages written in this step, not by lr_snapshot_transfer.py: no Spark connection 'spark_default'"
    ), first_lines
    app.close()
