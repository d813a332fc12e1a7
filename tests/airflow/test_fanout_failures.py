"""Failures of the Airflow fan-out are failures: a session the fan-out could not take up because of
something that will not heal by itself (a login without lr's grants) fails the task for good, one
ERROR line naming what, where and what to do; a session legitimately not the fan-out's to do now
(another replicator holds it, it needs a snapshot) stays a skip."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile

import pytest
from airflow.sdk.exceptions import AirflowException

from airflow_provider_lr.operators.common import FinalRefusal
from airflow_provider_lr.operators.fanout import LRFanOutOperator
from airflow_provider_lr.operators.spark import LRSparkFanOutOperator
from tests.airflow.test_operators import _app_with_sinks_in_log_entry_sync
from tests.engine.site.test_roles import Roles
from tests.support.airflow_env import airflow_sites  # noqa: F401
from tests.support.session import queue


@pytest.fixture
def made(airflow_sites):  # noqa: F811
    found = Roles(airflow_sites.sites)
    yield found
    found.drop()


def test_fan_out_as_a_login_without_lrs_grants_fails_for_good_and_delivers_nothing_silently(
    airflow_sites,
    made,
    monkeypatch,
    capfd,  # noqa: F811
):
    source, sink_b, _ = airflow_sites.sites
    app = _app_with_sinks_in_log_entry_sync(source)
    app.put("x", 1, ["site-b"])
    writer = made.name("writer")
    made.grant(source, "writer", writer, ["policy"])
    conn = {**source.server.airflow_conn(source.dbname), "login": writer}
    monkeypatch.setenv("AIRFLOW_CONN_LR_SITE_A", json.dumps(conn))  # the task's login: a writer, not a replicator
    op = LRFanOutOperator(task_id="f", source="site-a")
    capfd.readouterr()
    with pytest.raises(FinalRefusal) as failed:  # before: ok True, the sessions under "skipped"
        op.execute({})
    said = str(failed.value)
    assert said.startswith("fan-out of site-a refused: "), said
    assert "site-a->site-b/policy" in said and "permission denied" in said, said
    assert writer in said and "lr roles grant replicator" in said, said  # the role, and the grant to give it
    errors = [line for line in "".join(capfd.readouterr()).splitlines() if "ERROR" in line or "error" in line[:80]]
    assert any(said in line for line in errors), errors
    decision = op.retry_policy.evaluate(failed.value, 1, 4) if op.retry_policy else None
    assert decision is not None and decision.action.value == "fail"
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == []
    app.close()


def test_fan_out_with_a_sink_down_delivers_the_other_and_fails_to_be_retried(airflow_sites, monkeypatch):  # noqa: F811
    source, sink_b, sink_c = airflow_sites.sites
    app = _app_with_sinks_in_log_entry_sync(source)
    app.put("x", 1, ["site-b", "site-c"])
    with socket.socket() as probe:  # a port nothing listens on: site-c's server is down
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conn = {**sink_c.server.airflow_conn(sink_c.dbname), "port": port}
    monkeypatch.setenv("AIRFLOW_CONN_LR_SITE_C", json.dumps(conn))
    op = LRFanOutOperator(task_id="f", source="site-a")
    # retried (an AirflowException, not a FinalRefusal): the sink may be back by then
    with pytest.raises(AirflowException) as failed:  # before: ok True, site-c "skipped"
        op.execute({})
    said = str(failed.value)
    assert said.startswith("fan-out of site-a: sessions not delivered (tried again as the task's retries say): "), said
    assert "site-a->site-c/policy: " in said and "cannot connect to site 'site-c'" in said, said
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == ["x=1"]  # the other sink delivered
    app.close()


@pytest.mark.slow
def test_spark_fan_out_refused_for_good_by_its_sessions_errors_kinds_named_not_spark_submit(
    airflow_sites,
    made,
    monkeypatch,
    tmp_path,  # noqa: F811
):
    """A sink on another topology, a sink login without lr's grants: the job's result carries each
    session's error's kind, so the operator fails for good (not retried), naming both sessions."""
    source, sink_b, sink_c = airflow_sites.sites
    app = _app_with_sinks_in_log_entry_sync(source)
    app.put("x", 1, ["site-b", "site-c"])
    sink_c.query("UPDATE lr.topology SET topology_config_id = 'other'")  # site-c set up elsewhere
    consumer = made.name("consumer")
    made.grant(sink_b, "consumer", consumer, ["policy"])
    conn = {**sink_b.server.airflow_conn(sink_b.dbname), "login": consumer}
    monkeypatch.setenv("AIRFLOW_CONN_LR_SITE_B", json.dumps(conn))  # its login at site-b: a consumer, not a replicator
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_LOCAL", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    op = LRSparkFanOutOperator(
        task_id="fanout", source="site-a", conn_id="spark_local", tasks=1, conf={"spark.ui.enabled": "false"}
    )
    # before: an AirflowException (the job's errors were words only), retried as often as the task's
    # retries say; before that, the job said ok, the sessions "skipped", or only spark-submit's
    # "Cannot execute: spark-submit ... Error code is: 1"
    with pytest.raises(FinalRefusal) as failed:
        op.execute({})
    said = str(failed.value)
    assert said.startswith("Spark job lr_fanout.py refused: session site-a->site-b/policy: "), said
    assert "permission denied" in said and consumer in said and "lr roles grant replicator" in said, said
    assert "session site-a->site-c/policy: " in said and "topology config id mismatch" in said, said
    assert "Cannot execute" not in said, said
    decision = op.retry_policy.evaluate(failed.value, 1, 4) if op.retry_policy else None
    assert decision is not None and decision.action.value == "fail"
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == []
    assert [p for k, p in queue(sink_c, "site-a") if k == "log"] == []
    app.close()


def test_a_spark_jobs_own_failure_on_a_missing_grant_carries_its_kind_and_fails_the_task_for_good(
    airflow_sites, made, tmp_path, monkeypatch
):
    """A job that fails as a whole (``lr_spark.run``: its body raised, e.g. the table snapshot's
    source read refused to a login without lr's grants): its result says the error's kind
    (``error_kind``) and words naming the role and the grant, and the Spark operators' rule fails
    the task for good. Before, the result held ``{type}: {message}`` only, and the task was retried."""
    import argparse

    from airflow_provider_lr.operators.common import refused_in_result
    from airflow_provider_lr.paths import spark_jobs_dir
    from tests.engine.site.test_roles import connect_as

    monkeypatch.syspath_prepend(str(spark_jobs_dir()))
    import lr_spark

    source = airflow_sites.site("site-a")
    login = made.name("t_app")
    source.query(f'CREATE ROLE "{login}" LOGIN; GRANT USAGE ON SCHEMA lr TO "{login}"')

    def body(_: argparse.Namespace) -> dict:
        conn = connect_as(source, login)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM lr.source_sessions")
        finally:
            conn.close()
        return {"ok": True}

    result_file = tmp_path / "result.json"
    assert lr_spark.run(body, argparse.Namespace(result_file=str(result_file))) == 1
    result = json.loads(result_file.read_text())
    assert result["error_kind"] == "insufficient_privilege", result
    said = str(refused_in_result(logging.getLogger(__name__), "Spark job lr_table_snapshot.py", result))
    assert said.startswith("Spark job lr_table_snapshot.py refused: role "), said
    assert login in said and "lr roles grant replicator" in said and "permission denied" in said, said
