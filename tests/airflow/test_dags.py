"""The DAGs parse, have the shape users rely on, and replicate real sites end to end (dag.test)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from airflow_provider_lr.engine.site.replicator import run_until_idle
from tests.support.airflow_env import (  # noqa: F401
    DAGS_DIR,
    airflow_db,
    airflow_sites,
    metric,
    reconfigure,
    run_dag,
    states,
    statsd_packets,  # noqa: F401
    xcom,
)
from tests.support.session import App, final_state, lr_sync_process, queue, replicator, source_state, table_provider
from tests.support.tables import create_accounts, federate, rows


def test_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {
        "lr_replication",
        "lr_full_sync",
        "lr_maintenance",
        "lr_streaming",
        "lr_failover",
        "lr_rejoin",
        "example_lr_user_pipeline",
    } <= set(dagbag.dags)


def test_replication_maps_one_group_per_session_with_skip_branches(dagbag):
    from airflow.sdk import TriggerRule
    from airflow.sdk.definitions.taskgroup import MappedTaskGroup

    dag = dagbag.dags["lr_replication"]
    assert dag.max_active_runs == 1 and dag.schedule is not None
    groups = [g for g in dag.task_group.children.values() if isinstance(g, MappedTaskGroup)]
    assert [g.group_id for g in groups] == ["session"]
    assert set(groups[0].children) == {
        "session.decide",
        "session.snapshot_sync",
        "session.log_entry_sync",
        "session.report",
    }
    decide = dag.get_task("session.decide")
    assert {t.task_id for t in decide.downstream_list} == {"session.snapshot_sync", "session.log_entry_sync"}
    for task_id in groups[0].children:  # see the DAG's doc: nothing in the group ends upstream_failed
        assert dag.get_task(task_id).trigger_rule == TriggerRule.ALL_DONE
        assert dag.get_task(task_id).map_index_template  # listed by session name
    assert {"spark_fanout", "inprocess_fanout"} <= {t.task_id for t in decide.upstream_list}
    check = dag.get_task("check")  # the run's verdict, after every session
    assert check.trigger_rule == TriggerRule.ALL_DONE and "session.report" in check.upstream_task_ids
    assert not check.downstream_list
    for task_id in ("plan", "spark_fanout", "inprocess_fanout"):
        assert dag.get_task(task_id).map_index_template  # listed by source


def test_full_sync_form_offers_the_topologys_sinks(dagbag):
    params = dagbag.dags["lr_full_sync"].params
    assert params.get_param("sink").schema["enum"] == [None, "site-b", "site-c"]  # empty: every sink
    for optional in ("sink", "client", "source"):
        schema = params.get_param(optional).schema
        assert schema["enum"][0] is None and schema["type"] == ["null", "string"]
        assert schema["values_display"] == {"null": ""}  # the form shows an empty select box, not "null"
    assert params.get_param("client").schema["enum"] == [None, "policy"]
    assert params.get_param("client").resolve(None) is None
    dag = dagbag.dags["lr_full_sync"]
    assert dag.schedule is None
    for task_id in ("snapshot_sync", "log_entry_sync"):
        assert dag.get_task(task_id).map_index_template
    assert dag.get_task("check").trigger_rule == "all_done"


def test_failover_form_requires_the_site_to_promote_and_not_the_clients(dagbag):
    params = dagbag.dags["lr_failover"].params
    promote = params.get_param("promote").schema
    assert promote["type"] == "string" and promote["enum"] == ["site-b", "site-c"]  # required: no null
    for optional in ("from_site", "clients"):  # "empty: ..." in their help: null allowed
        assert "null" in params.get_param(optional).schema["type"]
    assert params.get_param("clients").resolve(None) is None
    assert "rejoin" not in params  # its own DAG, whose one field is required
    assert dagbag.dags["lr_rejoin"].params.get_param("site").schema["type"] == "string"


def test_a_mapped_shard_or_session_step_fails_a_refusal_at_once_as_an_unmapped_one_does(dagbag):
    """lr_streaming's ``stream`` shards (and the session steps mapped per session) fail a refusal no
    retry mends (a topology file from before a failover) at once. ``.partial()`` gave their operators
    ``retry_policy=None``, which ``setdefault`` kept: a stale file's shard was refused four times
    (its three retries), 10 s apart, run after run."""
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from airflow_provider_lr.operators.session import SessionStepOperator
    from airflow_provider_lr.operators.stream import LRStreamOperator

    refusing = (LRStreamOperator, SessionStepOperator)  # the operators whose refusals are final
    SESSION = {"source": "site-a", "sink": "site-b", "client": "policy"}
    mapped = {
        f"{dag_id}.{task.task_id}": task
        for dag_id, dag in sorted(dagbag.dags.items())
        for task in dag.tasks
        if isinstance(task, MappedOperator) and issubclass(task.operator_class, refusing)
    }
    assert "lr_streaming.stream" in mapped and "lr_full_sync.snapshot_sync" in mapped, sorted(mapped)

    def unmapped(task):  # as a worker builds one instance
        one = {"shard": "site-a"} if issubclass(task.operator_class, LRStreamOperator) else {"session": SESSION}
        return task.unmap(one)

    retrying = [name for name, task in mapped.items() if unmapped(task).retry_policy is None]
    assert not retrying, f"mapped tasks that retry a final refusal: {retrying}"


def test_every_field_of_every_form_has_a_title_and_says_what_it_does(dagbag):
    """The trigger form shows each param's title and description: lr_failover's Reason had none (the
    CLI's --reason says where it is recorded), so the operator could not tell what it is for."""
    lacking = [
        f"{dag_id}.{name}"
        for dag_id, dag in sorted(dagbag.dags.items())
        for name in dag.params
        if not (dag.params.get_param(name).schema.get("title") and dag.params.get_param(name).description)
    ]
    assert not lacking, f"form fields without a title or a description: {lacking}"


def test_full_sync_form_refuses_an_unknown_sink(dagbag):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="nowhere"):
        dagbag.dags["lr_full_sync"].test(run_conf={"sink": "nowhere", "reason": "test"})
    # no site can record a NUL; a run for years never ended (its end timer died); a retention of
    # 1e20 s failed the trim task deep in the engine: each refused by the form, naming its field
    for dag_id, conf, field in [
        ("lr_full_sync", {"sink": "site-b", "reason": "audit\x00"}, "reason"),
        ("lr_failover", {"promote": "site-b", "reason": "dc-1\x00"}, "reason"),
        ("lr_streaming", {"run_for_seconds": 10**13}, "run_for_seconds"),
        ("lr_maintenance", {"retention_seconds": 10**20}, "retention_seconds"),
    ]:
        with pytest.raises(ParamValidationError, match=f"param {field}"):
            dagbag.dags[dag_id].test(run_conf=conf)
    # what lr refuses in the run's first task (checked_reason: one line), refused by the form: it
    # took a newline or a tab, and the run failed after it started
    for dag_id, field, value in [
        ("lr_full_sync", "reason", "audit\n"),
        ("lr_full_sync", "reason", "a\tb"),
        ("lr_full_sync", "reason", "x" * 501),
        ("lr_full_sync", "reason", "audit\u2028site-c: ok"),  # a line separator, a C1 CSI, a bidi override
        ("lr_full_sync", "reason", "audit\x9b2J"),
        ("lr_failover", "reason", "dc-1 \u202edetsil"),
        ("lr_failover", "reason", "dc-1\nsite-c: promoted"),
        ("lr_failover", "clients", ["policy\n"]),
    ]:
        with pytest.raises(ParamValidationError):
            dagbag.dags[dag_id].params.get_param(field).resolve(value)
    assert (
        dagbag.dags["lr_failover"].params.get_param("reason").resolve("dc-1 lost: ü → site-b")
        == "dc-1 lost: ü → site-b"
    )
    from airflow_provider_lr.operators.spark import tables_left_to_spark, transfers_left_to_spark

    # the sessions' task failed (its XCom is None): the all_done collectors find nothing, not a TypeError
    assert transfers_left_to_spark(None, None, "snapshot_sync") == tables_left_to_spark(None, None, "x") == []


def test_a_negative_retention_typed_in_the_form_is_refused_not_clamped_to_a_trim_of_everything(dagbag):
    """The UI's number field clamps to the schema's ``minimum``/``maximum`` as it loses focus: -5
    typed as lr_maintenance's retention was sent as 0, and the run retention-trimmed every source's
    whole log (seen in the browser). The bounds hold at the trigger without the clamp."""
    from airflow.sdk.exceptions import ParamValidationError

    from airflow_provider_lr.engine.source.trim import MAX_RETENTION

    param = dagbag.dags["lr_maintenance"].params.get_param("retention_seconds")
    assert "minimum" not in param.schema and "maximum" not in param.schema, param.schema
    for refused in (-5, -1, int(MAX_RETENTION) + 1):
        with pytest.raises(ParamValidationError):
            param.resolve(refused)
    assert [param.resolve(v) for v in (None, 0, 3600, int(MAX_RETENTION))] == [None, 0, 3600, int(MAX_RETENTION)]


def test_a_form_without_a_topology_refuses_a_name_with_a_trailing_newline():
    """Without a topology at parse time a name is a text field matched by pattern: ``^...$`` let
    ``'site-b\\n'`` through Airflow's check (Python's ``$`` matches before a final newline)."""
    from airflow.sdk.exceptions import ParamValidationError

    from airflow_provider_lr.engine.db.topology_schema import CLIENT_NAME_PATTERN, SITE_ID_PATTERN
    from airflow_provider_lr.operators.common import form_choice

    for pattern, good in ((SITE_ID_PATTERN, "site-b"), (CLIENT_NAME_PATTERN, "Policy_2")):
        for required in (False, True):
            field = form_choice([], pattern, required=required)
            assert field.resolve(good) == good
            for bad in (f"{good}\n", f"{good}\r\n", f"\n{good}", f"{good} x"):
                with pytest.raises(ParamValidationError):
                    field.resolve(bad)


@pytest.mark.slow
def test_users_path_first_sync_deltas_own_pipeline_forced_full_sync_maintenance(dagbag, airflow_sites):
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])

    first = run_dag(dagbag, "lr_replication")
    assert str(first.state) == "success"
    got = states(first)
    assert {k: v for k, v in got.items() if k[0].startswith("session.")} == {
        ("session.decide", 0): "success",
        ("session.decide", 1): "success",
        ("session.snapshot_sync", 0): "success",
        ("session.snapshot_sync", 1): "success",
        ("session.log_entry_sync", 0): "skipped",
        ("session.log_entry_sync", 1): "skipped",
        ("session.report", 0): "success",
        ("session.report", 1): "success",
    }
    assert got[("spark_fanout", -1)] == "skipped"  # a small backlog stays in-process
    names = {0: "site-a->site-b/policy", 1: "site-a->site-c/policy"}
    for task_id in ("session.decide", "session.snapshot_sync", "session.log_entry_sync", "session.report"):
        labels = {ti.map_index: ti.rendered_map_index for ti in first.get_task_instances() if ti.task_id == task_id}
        assert labels == names, task_id  # how the UI lists the groups, skipped instances too
    assert {ti.rendered_map_index for ti in first.get_task_instances() if ti.task_id == "plan"} == {"site-a"}
    assert got[("check", -1)] == "success"
    for sink in (sink_b, sink_c):
        q = queue(sink, "site-a")
        assert q[0] == ("start", "") and q[-1] == ("end", "") and final_state(q) == source_state(source)

    app.put("k1", 100, ["site-b"])
    app.put("k9", 9, ["site-b", "site-c"])
    second = run_dag(dagbag, "lr_replication")
    assert str(second.state) == "success"
    assert states(second)[("session.snapshot_sync", 0)] == "skipped"
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == ["k1=100", "k9=9"]
    assert [p for k, p in queue(sink_c, "site-a") if k == "log"] == ["k9=9"]
    assert xcom(second, "session.report", 0)["remaining"] == 0

    own = run_dag(
        dagbag, "example_lr_user_pipeline", {"orders": 2, "destinations": ["site-b", "site-c"], "min_regions": 3}
    )
    assert str(own.state) == "success", states(own)
    pushed = {ti.rendered_map_index for ti in own.get_task_instances() if ti.task_id == "push_now"}
    assert pushed == {"site-a->site-b/policy", "site-a->site-c/policy"}  # it showed 0 and 1 in the grid
    delivered = xcom(own, "delivered")
    assert delivered["safe_on"] == ["site-b", "site-c"] and len(delivered["regions"]) == 3
    for sink in (sink_b, sink_c):
        assert [p for k, p in queue(sink, "site-a") if p.startswith("order ")] == ["order 1 100", "order 2 200"]

    forced = run_dag(dagbag, "lr_full_sync", {"sink": "site-b", "reason": "audit asked for it", "client": None})
    assert str(forced.state) == "success", states(forced)
    assert {(ti.task_id, ti.rendered_map_index) for ti in forced.get_task_instances() if ti.map_index >= 0} == {
        ("snapshot_sync", "site-a->site-b/policy"),
        ("log_entry_sync", "site-a->site-b/policy"),
    }
    assert [k for k, _ in queue(sink_b, "site-a")].count("start") == 2  # a second full sync, visible
    assert [k for k, _ in queue(sink_c, "site-a")].count("start") == 1  # the other sink untouched
    assert source.query("SELECT reason, status FROM lr.full_sync_requests WHERE forced") == [
        ("audit asked for it", "applied")
    ]

    source.query(
        "UPDATE lr.source_sessions SET lease_owner = 'worker-that-died', "
        "lease_expires_at = now() - interval '1 hour' WHERE sink_site_id = 'site-c'"
    )
    entries_before = source.query("SELECT count(*) FROM lr.log_entries")[0][0]
    upkeep = run_dag(dagbag, "lr_maintenance")
    assert str(upkeep.state) == "success", states(upkeep)
    assert xcom(upkeep, "stale_lease_cleanup", 0)["released"] == ["site-a->site-c/policy (worker-that-died)"]
    assert xcom(upkeep, "safe_trim", 0)["trimmed"] is True
    assert source.query("SELECT count(*) FROM lr.log_entries")[0][0] < entries_before
    assert states(upkeep)[("retention_trim", -1)] == "skipped"  # no retention asked
    checkpoint = {q["queue"]: q for q in xcom(upkeep, "receive_queue_checkpoint", 0)["queues"]}
    assert checkpoint["LRQ_Recv_policy_site-a"]["waiting"] == len(queue(sink_b, "site-a"))
    app.close()


def test_a_sink_that_is_down_fails_the_run_after_the_other_session_delivered(
    dagbag, airflow_sites, monkeypatch, statsd_packets
):
    """One sink down: the other session delivers, every instance is listed by its session, and the
    run ends failed (the DAG list shows red), its ``check`` naming the failed session."""
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b", "site-c"])
    down = dict(sink_c.server.airflow_conn(sink_c.dbname), port=1)  # nothing listens there
    monkeypatch.setenv("AIRFLOW_CONN_LR_SITE_C", json.dumps(down))
    run = run_dag(dagbag, "lr_replication")
    got = states(run)
    assert str(run.state) == "failed", got
    assert got[("check", -1)] == "failed"
    assert got[("session.decide", 1)] == "failed"
    # the branches ran after the failed negotiation and skipped themselves: labelled, not upstream_failed
    assert got[("session.snapshot_sync", 1)] == "skipped" and got[("session.log_entry_sync", 1)] == "skipped"
    assert got[("session.decide", 0)] == "success" and got[("session.snapshot_sync", 0)] == "success"
    assert "upstream_failed" not in got.values()
    labels = {(ti.task_id, ti.map_index): ti.rendered_map_index for ti in run.get_task_instances() if ti.map_index >= 0}
    assert {v for k, v in labels.items() if k[1] == 1 and k[0].startswith("session.")} == {"site-a->site-c/policy"}
    assert final_state(queue(sink_b, "site-a")) == {"k": 1}
    assert xcom(run, "session.report", 0)["state"] == "IN_LOG_ENTRY_SYNC"
    failed = xcom(run, "session.report", 1)
    assert failed["session"] == "site-a->site-c/policy" and "cannot connect to site 'site-c'" in failed["last_error"]
    # the metrics, through Airflow's own StatsD client: per session, tagged names and session-named ones
    statsd_packets.settled()
    assert metric(statsd_packets, "lr.session.site-a.site-c.policy.errors") == [1.0]
    assert metric(statsd_packets, "lr.session.site-a.site-b.policy.snapshot_messages")[0] > 0
    assert metric(statsd_packets, "lr.session.site-a.site-b.policy.lag_entries")[-1] == 0.0
    assert metric(statsd_packets, "lr.session.site-a.site-c.policy.lag_entries")[-1] == 1.0
    assert metric(statsd_packets, "lr.run.lr_replication.failed_sessions") == [1.0]
    assert metric(statsd_packets, "lr.session.errors") == [1.0]
    app.close()


@pytest.mark.slow
def test_a_forms_full_sync_succeeds_when_a_running_lr_sync_applied_it(dagbag, airflow_sites):
    """The issue's case: a replicator streams (here ``lr sync``, a process of its own, holding every
    session's lease all along), and the form asks for a full sync of every sink. The run does not
    fail on the lease: each ``snapshot_sync`` waits, deferred, for its own request, which the
    stream applies; ``check`` reports each session from its request's outcome."""
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    app.put("k", 1, ["site-b", "site-c"])
    with lr_sync_process(airflow_sites.topology_path, source) as streaming:
        run = run_dag(dagbag, "lr_full_sync", {"sink": None, "client": None, "source": None, "reason": "audit"})
        got = states(run)
        assert str(run.state) == "success", got
        assert got[("snapshot_sync", 0)] == got[("snapshot_sync", 1)] == "success" and got[("check", -1)] == "success"
        notes = source.query(
            "SELECT request_id::text, note FROM lr.full_sync_requests WHERE forced ORDER BY sink_site_id"
        )
        assert len(notes) == 2
        for index, (request_id, note) in enumerate(notes):
            assert xcom(run, "snapshot_sync", index)["applied_request"] == request_id
            assert f":{streaming.pid}:" in note, note  # applied by the lr sync process, not by the DAG's step
        for sink in (sink_b, sink_c):
            assert [k for k, _ in queue(sink, "site-a")].count("start") == 2
    app.close()


class _RunWithoutFailures:
    """The run's task instance as the verdict reads it: no task of the run failed."""

    dag_id, run_id = "lr_full_sync", "manual__test"

    def get_task_breadcrumbs(self, dag_id: str, run_id: str) -> list[dict]:
        return []


def test_a_forms_full_sync_verdict_follows_its_request_across_a_planned_switchover(airflow_sites):
    """lr_full_sync asked site-a for a full sync of site-c; site-a was then switched over to site-b,
    which asks it of site-b instead, and a replicator applied it there: the run's verdict (``check``)
    follows the request to site-b and passes, saying so. Before, it said
    'cancelled: failed over: asked of site-b as request ...' and failed the run."""
    import psycopg2
    from structlog.testing import capture_logs

    from airflow_provider_lr.engine.site import failover
    from airflow_provider_lr.engine.source import full_sync
    from airflow_provider_lr.engine.vocabulary import SessionKey
    from airflow_provider_lr.operators import LRRunCheckOperator
    from airflow_provider_lr.operators.common import session_dict

    site_a, site_b, _ = airflow_sites.sites
    providers = {"policy": table_provider}
    app = App(site_a)
    app.put("k", 1, ["site-b", "site-c"])
    run_until_idle(replicator(airflow_sites.topology, airflow_sites.sites, providers=providers))
    with site_a.connect() as conn:  # as lr_full_sync's first task hands it on
        request = full_sync.request_full_sync(conn, "site-c", "policy", "audit", forced=True)
    conn.close()
    session = {**session_dict(airflow_sites.topology, SessionKey("site-a", "site-c", "policy"))}
    session["request_id"] = request.request_id
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}
    result = failover.promote(
        failover.FailoverRequest("site-a", "site-b", planned=True), lambda s: psycopg2.connect(dsns[s])
    )
    App(site_b).close()  # site-b's provider's table
    run_until_idle(replicator(result.topology, airflow_sites.sites, providers=providers))
    ((there,),) = site_b.query("SELECT request_id::text FROM lr.full_sync_requests WHERE forced AND status = 'applied'")

    # the verdict task as the run calls it (no other task of the run failed); ``dag.test`` runs only
    # the DAGs of dags/, and a whole lr_full_sync run cannot outlive its session a->c switched over
    check = LRRunCheckOperator(task_id="check", sessions=[session], full_sync_requests=True)
    with capture_logs() as events:
        assert check.execute({"ti": _RunWithoutFailures()})["failed_sessions"] == []
    said = [e["event"] % e.get("positional_args", ()) for e in events]
    assert any(f"failed over: asked of site-b as request {there}: full sync {there} applied by " in e for e in said), (
        said
    )
    assert there != request.request_id
    app.close()


def backlog_of_30_after_first_contact(airflow_sites, settings: dict) -> App:
    """Sessions through their first contact (in-process), the topology's ``settings`` applied, then
    15 entries for both sinks: 30 deliveries waiting. Returns the source application."""
    reconfigure(airflow_sites, settings=settings)
    app = App(airflow_sites.sites[0])
    first = replicator(airflow_sites.topology, airflow_sites.sites, providers={"policy": table_provider})
    first.run(max_cycles=3, until_idle=True, interval=0.01)
    first.close()
    for i in range(15):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    return app


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, task_id, settings",
    [("spark", "spark_fanout", {"spark_min_backlog": 20}), ("tee", "inprocess_fanout", {"tee_min_backlog": 20})],
)
def test_a_large_backlog_goes_through_a_fan_out_and_the_sessions_find_nothing_left(
    dagbag, airflow_sites, monkeypatch, path, task_id, settings, statsd_packets
):
    """Catch-up through Spark (spark-submit of spark_jobs/lr_fanout.py on local[2]) or the read-once
    tee in the worker (no Spark); the sessions' groups then find nothing left: every entry arrives
    once, in order."""
    app = backlog_of_30_after_first_contact(airflow_sites, settings)
    if path == "spark":
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
        monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # spark-submit

    run = run_dag(dagbag, "lr_replication")
    got = states(run)
    assert got[(task_id, 0)] == "success", got
    assert xcom(run, "plan", 0)["path"] == path
    fanned = xcom(run, task_id, 0)
    assert fanned["ok"] and fanned["total_deliveries"] == 30
    assert xcom(run, "session.log_entry_sync", 0)["delivered"] == 0  # the fan-out left nothing behind
    for sink in airflow_sites.sites[1:]:
        assert [p for k, p in queue(sink, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(15)]
    statsd_packets.settled()
    for sink in ("site-b", "site-c"):  # what the fan-out delivered, per session
        assert metric(statsd_packets, f"lr.session.site-a.{sink}.policy.delivered") == [15.0]
    assert got[("check", -1)] == "success" and str(run.state) == "success"
    assert {ti.rendered_map_index for ti in run.get_task_instances() if ti.task_id == task_id} == {"site-a"}
    app.close()


@pytest.mark.slow
def test_streaming_dag_streams_for_its_run_then_ends_for_the_next_run(dagbag, airflow_sites):
    """``lr_streaming`` (``@continuous``, one run at a time, paused when created): one shard (the
    one source), whose stream task makes first contact, streams what the application commits
    meanwhile within the run, and ends by itself after ``run_for_seconds`` with a summary; the next
    run goes on from the sinks."""
    import threading

    dag = dagbag.dags["lr_streaming"]
    assert (
        dag.max_active_runs == 1
        and dag.is_paused_upon_creation
        and type(dag.timetable).__name__ == "ContinuousTimetable"
    )
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)

    def write_while_it_runs() -> None:
        deadline = time.monotonic() + 60
        while source.query(
            "SELECT count(*) FROM lr.source_sessions WHERE acked_position >= 0 AND lease_owner IS NOT NULL"
        ) != [(2,)]:  # first contact made: streaming
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for i in range(20):
            app.put(f"k{i}", i, ["site-b", "site-c"])
            time.sleep(0.02)

    writer = threading.Thread(target=write_while_it_runs)
    writer.start()
    started = time.monotonic()
    run = run_dag(dagbag, "lr_streaming", {"run_for_seconds": 6})
    writer.join()
    assert str(run.state) == "success", states(run)
    assert time.monotonic() - started >= 6
    assert states(run) == {("shards", -1): "success", ("stream", 0): "success"}
    assert [ti.rendered_map_index for ti in run.get_task_instances() if ti.task_id == "stream"] == ["site-a"]
    summary = xcom(run, "stream", 0)
    assert summary["failing"] == [] and sum(summary["delivered"].values()) > 0, summary
    assert summary["sessions"] == ["site-a->site-b/policy", "site-a->site-c/policy"]
    assert summary["full_syncs"] == {"site-a->site-b/policy": 1, "site-a->site-c/policy": 1}, summary  # first contact
    for sink in (sink_b, sink_c):  # what the full sync did not cover arrived as log entries, in order
        entries = queue(sink, "site-a")
        logs = [p for k, p in entries if k == "log"]
        assert final_state(entries) == source_state(source) and logs == [f"k{i}={i}" for i in range(20 - len(logs), 20)]
    app.put("k99", 99, ["site-b"])
    again = run_dag(dagbag, "lr_streaming", {"run_for_seconds": 2})
    assert str(again.state) == "success"
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"][-1] == "k99=99"
    app.close()


def test_large_table_snapshots_have_a_spark_task_after_the_sessions_in_both_dags(dagbag):
    from airflow.sdk import TriggerRule

    replication = dagbag.dags["lr_replication"]
    assert replication.get_task("session.log_entry_sync").spark_conn_id == "spark_default"
    collect = replication.get_task("table_snapshots")
    assert collect.trigger_rule == TriggerRule.ALL_DONE and "session.report" in collect.upstream_task_ids
    assert {t.task_id for t in collect.downstream_list} == {"spark_table_snapshot"}
    assert "spark_table_snapshot" in replication.get_task("check").upstream_task_ids
    full = dagbag.dags["lr_full_sync"]
    assert full.get_task("log_entry_sync").partial_kwargs["spark_conn_id"] == "spark_default"
    assert "log_entry_sync" in full.get_task("table_snapshots").upstream_task_ids
    assert "spark_table_snapshot" in full.get_task("check").upstream_task_ids
    for dag in (replication, full):
        assert dag.get_task("spark_table_snapshot").map_index_template  # listed as source/client


def large_federated_table(airflow_sites, monkeypatch, rows_: int = 3000) -> None:
    """``table_spark_min_rows`` 1000 in the topology, the sessions in log-entry sync (first contact
    in process), then ``public.accounts`` of ``rows_`` rows (analyzed: the estimate is the
    planner's) federated at the source; Spark on local[2] as ``spark_default``."""
    source = airflow_sites.sites[0]
    reconfigure(airflow_sites, settings={"table_spark_min_rows": 1000})
    App(source).close()  # the topology's full-sync provider reads its table
    first = replicator(airflow_sites.topology, airflow_sites.sites, providers={"policy": table_provider})
    first.run(max_cycles=3, until_idle=True, interval=0.01)
    first.close()
    create_accounts(source, rows=rows_)
    source.query("ANALYZE public.accounts")
    federate(source)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # spark-submit


@pytest.mark.slow
def test_a_large_table_snapshot_goes_through_the_spark_task_of_lr_replication_and_again_through_the_forms_full_sync(
    dagbag, airflow_sites, monkeypatch
):
    """The sessions' log-entry steps leave the 3,000-row table (over ``table_spark_min_rows``) to
    Spark; one spark-submit of lr_table_snapshot.py writes it at both sinks. Then lr_full_sync (the
    UI form's run, forced) forgets site-b's tables; its catch-up leaves the large table to Spark,
    which snapshots it again for site-b only: rows removed at the sink meanwhile are back, site-c is
    left alone."""
    large_federated_table(airflow_sites, monkeypatch)
    source, sink_b, sink_c = airflow_sites.sites
    run = run_dag(dagbag, "lr_replication")
    got = states(run)
    assert str(run.state) == "success" and got[("spark_table_snapshot", 0)] == "success", got
    for index in (0, 1):
        assert xcom(run, "session.log_entry_sync", index)["tables_for_spark"] == ["public.accounts"]
    assert xcom(run, "table_snapshots") == [{"source": "site-a", "client": "policy"}]
    result = xcom(run, "spark_table_snapshot", 0)
    sessions = ["site-a->site-b/policy", "site-a->site-c/policy"]
    assert result["ok"] and result["sessions"] == sessions and result["rows"] == 6000, result
    assert result["tables"] == {f"{s}:public.accounts": "synced" for s in sessions}
    assert {ti.rendered_map_index for ti in run.get_task_instances() if ti.task_id == "spark_table_snapshot"} == {
        "site-a/policy"
    }
    for sink in (sink_b, sink_c):
        assert rows(sink) == rows(source)

    sink_b.query("DELETE FROM public.accounts WHERE id <= 100")  # drifted: only a new snapshot restores it
    run = run_dag(dagbag, "lr_full_sync", {"sink": "site-b", "reason": "tables too", "client": None})
    got = states(run)
    assert str(run.state) == "success" and got[("spark_table_snapshot", 0)] == "success", got
    assert xcom(run, "log_entry_sync", 0)["tables_for_spark"] == ["public.accounts"]
    result = xcom(run, "spark_table_snapshot", 0)
    assert result["sessions"] == ["site-a->site-b/policy"] and result["rows"] == 3000, result
    assert result["skipped"] == {"site-a->site-c/policy": "has every table"}
    assert rows(sink_b) == rows(sink_c) == rows(source)
    assert sink_b.query("SELECT state, rows_copied FROM lr.sink_tables") == [("synced", 3000)]


def test_the_failover_dag_promotes_a_sink_from_its_form_and_rejoins_the_old_source(dagbag, airflow_sites, capfd):
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    for i in range(3):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    form = {
        "promote": "site-b",
        "from_site": None,
        "clients": None,
        "reason": "dc-1 maintenance",
        "same_destinations": False,
    }
    # site-b holds no consistent copy yet: refused, nothing done, said in one line (before: under a
    # traceback through the engine)
    capfd.readouterr()
    refused = run_dag(dagbag, "lr_failover", form)
    logged = "".join(capfd.readouterr())
    assert str(refused.state) == "failed", states(refused)
    said = [line for line in logged.splitlines() if "refused" in line]
    assert any("lr failover refused: site 'site-b' holds no consistent copy" in line for line in said), logged
    assert "Traceback" not in logged, logged
    run_until_idle(replicator(airflow_sites.topology, airflow_sites.sites, providers={"policy": table_provider}))
    app.put("k9", 9, ["site-b", "site-c"])  # not replicated yet: the planned switchover drains it
    App(sink_b).close()
    run = run_dag(dagbag, "lr_failover", form)
    assert str(run.state) == "success", states(run)
    done = xcom(run, "failover")
    assert (done["from"], done["to"], done["clients"], done["planned"]) == ("site-a", "site-b", ["policy"], True)
    assert sink_b.query("SELECT reason, status FROM lr.failovers") == [("dc-1 maintenance", "completed")]
    for sink in (sink_b, sink_c):
        assert [p for k, p in queue(sink, "site-a") if k == "log"][-1] == "k9=9"
    again = run_dag(dagbag, "lr_rejoin", {"site": "site-a"})
    assert str(again.state) == "success", states(again)
    assert xcom(again, "rejoin")["tail"] == {"policy": 0}
    # the other DAGs, still on the file the failover made stale: refused on one ERROR line, failed at
    # once (lr_full_sync retries 3 times 20 s apart otherwise); before, under a traceback, and retried
    capfd.readouterr()
    stale = run_dag(dagbag, "lr_full_sync", {"sink": None, "reason": "stale", "client": None, "source": None})
    logged = "".join(capfd.readouterr())
    assert states(stale)[("request_full_sync", -1)] == "failed", states(stale)
    said = [line for line in logged.splitlines() if "lr full sync refused: topology file" in line]
    assert len(said) == 1 and "predates the failover of site-a to site-b" in said[0], logged
    assert "Traceback" not in logged, logged
    app.close()


def test_large_full_sync_transfers_have_a_spark_task_in_both_dags(dagbag):
    from airflow.sdk import TriggerRule

    replication = dagbag.dags["lr_replication"]
    assert replication.get_task("session.snapshot_sync").spark_conn_id == "spark_default"
    collect = replication.get_task("snapshot_transfers")
    assert collect.trigger_rule == TriggerRule.ALL_DONE and "session.report" in collect.upstream_task_ids
    assert {t.task_id for t in collect.downstream_list} == {"spark_snapshot_transfer"}
    assert "spark_snapshot_transfer" in replication.get_task("check").upstream_task_ids
    full = dagbag.dags["lr_full_sync"]
    assert full.get_task("snapshot_sync").partial_kwargs["spark_conn_id"] == "spark_default"
    assert "spark_snapshot_transfer" in full.get_task("log_entry_sync").upstream_task_ids  # catch-up after it
    for dag in (replication, full):
        assert dag.get_task("spark_snapshot_transfer").map_index_template  # listed as source->sink/client


def large_full_sync(airflow_sites, monkeypatch, rows_: int = 1500) -> App:
    """``snapshot_spark_min_entries`` 1000 in the topology, the test app's table of ``rows_`` rows
    (its full sync: ``rows_`` + 2 entries with the markers); Spark on local[2] as ``spark_default``."""
    reconfigure(airflow_sites, settings={"snapshot_spark_min_entries": 1000})
    app = App(airflow_sites.sites[0])
    with app.conn.cursor() as cur:
        cur.execute("INSERT INTO app_state SELECT 'k' || i, i FROM generate_series(1, %s) i", (rows_,))
    app.conn.commit()
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # spark-submit
    return app


@pytest.mark.slow
def test_a_large_full_sync_transfer_goes_through_the_spark_task_of_lr_replication_and_of_the_forms_full_sync(
    dagbag, airflow_sites, monkeypatch
):
    """First contact: each session's snapshot step has its client's data supplied (1,502 entries,
    over ``snapshot_spark_min_entries``) and leaves the transfer to Spark; one spark-submit of
    lr_snapshot_transfer.py per session moves and applies it; the next run catches up in process.
    Then lr_full_sync (the UI form, forced) for site-b: the supplied data goes through Spark again,
    then the catch-up in the same run delivers what was written after the full sync's base."""
    app = large_full_sync(airflow_sites, monkeypatch)
    source, sink_b, sink_c = airflow_sites.sites
    run = run_dag(dagbag, "lr_replication")
    got = states(run)
    assert str(run.state) == "success", got
    for index in (0, 1):
        assert got[("spark_snapshot_transfer", index)] == "success", got
        request_id = xcom(run, "session.snapshot_sync", index)["transfer_for_spark"]
        result = xcom(run, "spark_snapshot_transfer", index)
        assert (
            result["ok"] and result["applied"] and result["transferred"] == 1502 and result["request_id"] == request_id
        )
    assert {ti.rendered_map_index for ti in run.get_task_instances() if ti.task_id == "spark_snapshot_transfer"} == {
        "site-a->site-b/policy",
        "site-a->site-c/policy",
    }
    app.put("after", 1, ["site-b", "site-c"])
    again = run_dag(dagbag, "lr_replication")
    assert str(again.state) == "success" and not xcom(again, "snapshot_transfers")
    for sink in (sink_b, sink_c):
        entries = queue(sink, "site-a")
        assert final_state(entries) == source_state(source)
        assert [p for k, p in entries if k == "log"] == ["after=1"]

    run = run_dag(dagbag, "lr_full_sync", {"sink": "site-b", "reason": "rebuild", "client": None})
    got = states(run)
    assert str(run.state) == "success" and got[("spark_snapshot_transfer", 0)] == "success", got
    assert xcom(run, "snapshot_transfers") == [
        {
            "source": "site-a",
            "sink": "site-b",
            "client": "policy",
            "request_id": xcom(run, "snapshot_sync", 0)["transfer_for_spark"],
        }
    ]
    assert xcom(run, "spark_snapshot_transfer", 0)["applied"]
    assert final_state(queue(sink_b, "site-a")) == source_state(source)
    assert [k for k, _ in queue(sink_b, "site-a")].count("start") == 2  # a second full sync, site-b's only
    assert [k for k, _ in queue(sink_c, "site-a")].count("start") == 1
    app.close()


def test_a_topology_change_shows_in_the_forms_at_the_next_parse_and_a_stale_choice_is_refused_by_name(
    airflow_db, tmp_path, monkeypatch
):
    """The forms' choices are read when the DAG file is parsed: Airflow's parse after a topology
    edit offers the new sink without a restart, and a choice a form parsed before the edit still
    offers (a sink the topology no longer has) is refused by the run's first task, naming it."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import ParamValidationError

    from airflow_provider_lr.engine.errors import ConfigurationError
    from airflow_provider_lr.operators.common import load_topology

    path = tmp_path / "topology.yaml"
    sites = "".join(f"  - {{id: site-{s}, region: region-{s}, conn_id: lr_site_{s}}}\n" for s in "abcd")

    def topology(sinks: str) -> None:
        path.write_text(f"sites:\n{sites}replication:\n  - {{source: site-a, sinks: [{sinks}], clients: [policy]}}\n")

    monkeypatch.setenv("LR_TOPOLOGY", str(path))
    topology("site-b, site-c")
    before = DagBag(dag_folder=str(DAGS_DIR / "lr_full_sync.py")).dags["lr_full_sync"]
    assert before.params.get_param("sink").schema["enum"] == [None, "site-b", "site-c"]
    topology("site-b, site-d")  # site-c out, site-d in
    after = DagBag(dag_folder=str(DAGS_DIR / "lr_full_sync.py")).dags["lr_full_sync"]
    assert after.params.get_param("sink").schema["enum"] == [None, "site-b", "site-d"]
    with pytest.raises(ParamValidationError):
        after.params.get_param("sink").resolve("site-c")
    assert before.params.get_param("sink").resolve("site-c") == "site-c"  # the stale form takes it: the task refuses
    with pytest.raises(ConfigurationError, match="no session replicates to 'site-c'.*site-a->site-d/policy"):
        load_topology().select(None, "site-c", None)
