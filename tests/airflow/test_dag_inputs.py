"""What lr's DAGs and tasks do with bad input and with sites that stop answering: a connection
that is not defined fails the task at once, naming it and where to define it; a wait on a session
that cannot progress ends by its deadline, saying why (real sites, a real Airflow metadata DB)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from contextlib import closing
from datetime import datetime, timedelta, timezone

import psycopg2
import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_lr.engine.session import lease
from airflow_provider_lr.engine.site.replicator import Replicator, run_until_idle
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.operators.common import FinalRefusal, check_topology, session_dicts
from airflow_provider_lr.operators.session import LRNegotiateOperator, LRRunCheckOperator
from airflow_provider_lr.operators.snapshot_sync import LRSnapshotSyncOperator
from airflow_provider_lr.operators.stream import LRStreamOperator
from airflow_provider_lr.sensors import LRDeliveredSensor
from airflow_provider_lr.triggers.session import LRDeliveredTrigger
from tests.support.airflow_env import airflow_sites  # noqa: F401
from tests.support.session import App, replicator, table_provider


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


def _sink_c_not_answering(airflow_sites) -> App:
    """Both sessions past first contact; then a replicator cycle (as ``lr sync``'s) whose
    connections to site-c are refused: that session fails, its last error recorded on the source."""
    app = App(airflow_sites.site("site-a"))
    app.put("k", 1, ["site-b", "site-c"])
    first = replicator(airflow_sites.topology, airflow_sites.sites, providers={"policy": table_provider})
    run_until_idle(first)
    first.close()
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}
    down = dsns["site-c"].replace(f"port={airflow_sites.site('site-c').server.port}", "port=1")
    assert down != dsns["site-c"]
    app.put("k", 2, ["site-b", "site-c"])
    failing = Replicator(
        airflow_sites.topology,
        lambda site_id: psycopg2.connect(down if site_id == "site-c" else dsns[site_id]),
        providers={"policy": table_provider},
    )
    failing.run_cycle()
    failing.close()
    return app


def test_a_wait_on_a_session_whose_sink_stopped_answering_ends_at_its_bound_saying_why(airflow_sites):
    """The replicator holding site-c's session cannot reach site-c. lr_full_sync's step waiting for
    its request, and a delivered sensor's trigger, end at their bound, each saying what is missing
    and why: who holds the session and its last error. Before, they waited silently until Airflow's
    deferral timeout (6 h for the step; ``dag.test`` ignores it: for ever) or failed saying only
    'still waiting after ...'."""
    app = _sink_c_not_answering(airflow_sites)
    source = airflow_sites.site("site-a")
    error = "its last error: OperationalError: connection to server at .* port 1 failed"
    ticket = app.put("k", 3, ["site-b", "site-c"])
    position = app.client.delivery(ticket).position
    until = (datetime.now(timezone.utc) + timedelta(seconds=2)).isoformat()
    trigger = LRDeliveredTrigger(
        "lr_site_a", "site-a", "policy", position, ["site-c"], poll_interval=0.2, wait_until=until
    )
    event = asyncio.run(asyncio.wait_for(anext(trigger.run()), 30)).payload
    assert event["status"] == "timeout", event
    assert re.search(
        rf"still waiting at {re.escape(until)}: position {position} not safe on \['site-c'\]: not acknowledged by "
        rf"\['site-c'\].*; site-c; no replicator holds the session: run `lr sync` .*; {error}",
        event["message"],
    ), event

    # a replicator holds site-c's session (its call to site-c hanging, say): the full sync's step waits for it
    with closing(source.connect()) as conn:
        held = lease.acquire(conn, "site-c", "policy", "lr-sync-elsewhere", 60)
        assert held is not None
    session = {**session_dicts(airflow_sites.topology, sink="site-c")[0]}
    with closing(source.connect()) as conn:
        session["request_id"] = full_sync.request_full_sync(conn, "site-c", "policy", "audit", forced=True).request_id
    why = rf"the session is held by replicator lr-sync-elsewhere; {error}"
    started = time.monotonic()
    step = LRSnapshotSyncOperator(
        task_id="snapshot_sync",
        session=session,
        wait_for_data=True,
        deferrable=False,
        poll_interval=0.2,
        wait_timeout=timedelta(seconds=2),
    )
    with pytest.raises(AirflowFailException, match=rf"still waiting at .*: full sync .* not applied yet.*{why}"):
        step.execute({})
    assert time.monotonic() - started < 15

    app.close()


def test_a_session_step_takes_a_session_by_name_or_ids_and_refuses_anything_else_for_good(airflow_sites):
    """A step handed its session as ``lr status`` names it, or as a dict of its three ids (a user's
    own DAG), runs on it; a name that is no session, a number or a session the topology lacks is
    refused at once, named. Before: ``AttributeError: 'str' object has no attribute 'get'`` or
    ``KeyError: 'source_conn_id'`` under a traceback, retried."""
    app = App(airflow_sites.site("site-a"))
    app.put("k", 1, ["site-b"])
    decided = LRNegotiateOperator(task_id="decide", session="site-a->site-b/policy").execute({})
    assert decided["branch"] == "snapshot_sync", decided
    done = LRSnapshotSyncOperator(
        task_id="snapshot_sync", session={"source": "site-a", "sink": "site-b", "client": "policy"}
    ).execute({})
    assert done["snapshot_messages"] > 0, done
    refused = {
        "site-a": "not a session (source->sink/client): 'site-a'",
        42: "a session is a dict with source, sink and client, not 42",
        "site-b->site-a/policy": "session site-b->site-a/policy is not in the topology",
    }
    for given, why in refused.items():
        with pytest.raises(FinalRefusal, match=re.escape(f"session {given!r} refused: {why}")):
            LRNegotiateOperator(task_id="decide", session=given).execute({})  # type: ignore[arg-type]
    app.close()
