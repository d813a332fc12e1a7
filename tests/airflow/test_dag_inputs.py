"""What lr's DAGs and tasks do with bad input and with sites that stop answering: a connection
that is not defined fails the task at once, naming it and where to define it; a wait on a session
that cannot progress ends by its deadline, saying why (real sites, a real Airflow metadata DB)."""

from __future__ import annotations

import logging
import re
import time

import pytest

from airflow_provider_lr.operators.common import FinalRefusal, check_topology, session_dicts
from airflow_provider_lr.operators.session import LRNegotiateOperator, LRRunCheckOperator
from airflow_provider_lr.operators.stream import LRStreamOperator
from airflow_provider_lr.sensors import LRDeliveredSensor
from tests.support.airflow_env import airflow_sites  # noqa: F401


class _RunWhoseFirstTaskFailed:
    """The run's task instance as the verdict reads it: the task listing the sessions failed."""

    dag_id, run_id = "lr_full_sync", "manual__test"

    def get_task_breadcrumbs(self, dag_id: str, run_id: str) -> list[dict]:
        return [{"task_id": "request_full_sync", "map_index": -1, "state": "failed"}]


def test_a_connection_that_is_not_defined_fails_the_full_sync_and_the_shard_at_once_naming_it(
    airflow_sites, monkeypatch
):
    """site-c's Airflow connection is missing: ``lr_full_sync``'s first task and a stream shard fail
    at once, for good, naming the site, the connection and where to define it. Before, the check
    of the sites skipped site-c as unreachable; the task then failed on Airflow's bare
    ``The conn_id `lr_site_c` isn't defined`` under a traceback, and was retried three times,
    20 s apart; the verdict said "the other sessions ran to completion" of a run that worked none."""
    monkeypatch.delenv("AIRFLOW_CONN_LR_SITE_C")
    topo = airflow_sites.topology
    said = (
        "site site-c: Airflow connection 'lr_site_c' is not defined: create it (Admin > Connections, "
        "type 'lr site', or AIRFLOW_CONN_LR_SITE_C"
    )
    with pytest.raises(FinalRefusal, match=re.escape(f"lr full sync refused: {said}")):
        check_topology(topo, logging.getLogger("test"), "lr full sync", {"site-a", "site-c"})
    started = time.monotonic()
    with pytest.raises(FinalRefusal, match=re.escape(f"shard site-a refused: {said}")):
        LRStreamOperator(task_id="stream", source="site-a", run_for=60).execute({})
    assert time.monotonic() - started < 10  # not a run_for of failing sessions
    check = LRRunCheckOperator(task_id="check", sessions=[], session_tasks=("snapshot_sync",))
    with pytest.raises(FinalRefusal, match=r"failed task\(s\): request_full_sync failed \(no session was worked"):
        check.execute({"ti": _RunWhoseFirstTaskFailed()})


def test_a_session_step_or_a_sensor_without_its_connection_is_refused_for_good(airflow_sites, monkeypatch):
    """A session step whose sink's connection is missing, and a sensor whose source's is, each
    fail with ``FinalRefusal`` (no retry) naming the connection: a retry defines nothing."""
    monkeypatch.delenv("AIRFLOW_CONN_LR_SITE_C")
    session = session_dicts(airflow_sites.topology, sink="site-c")[0]
    with pytest.raises(FinalRefusal, match="session site-a->site-c/policy refused: Airflow connection 'lr_site_c'"):
        LRNegotiateOperator(task_id="decide", session=session).execute({})
    error = airflow_sites.sites[0].query("SELECT last_error FROM lr.source_sessions WHERE sink_site_id = 'site-c'")
    assert "Airflow connection 'lr_site_c' is not defined" in error[0][0]  # `lr status` shows it too
    monkeypatch.delenv("AIRFLOW_CONN_LR_SITE_A")
    sensor = LRDeliveredSensor(task_id="delivered", source="site-a", client="policy", position=1)
    with pytest.raises(FinalRefusal, match="delivered refused: source site-a: Airflow connection 'lr_site_a'"):
        sensor.execute({})
