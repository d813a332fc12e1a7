"""Triggers: serialize round-trips, and each wait fires on the real event, not before, without
blocking the event loop (checks run against real sites through Airflow connections)."""

from __future__ import annotations

import asyncio
import importlib
import json
from datetime import datetime, timedelta, timezone

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.backlog import delivery_target, pending_entries
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.triggers import (
    LRDeliveredTrigger,
    LRFullSyncOutcomeTrigger,
    LRNewLogEntriesTrigger,
    LRReadyTrigger,
    LRSnapshotEndTrigger,
)
from tests.engine.site.test_roles import made  # noqa: F401
from tests.support.airflow_env import airflow_sites, reconfigure  # noqa: F401
from tests.support.session import App, replicator, table_provider

TRIGGERS = [
    LRNewLogEntriesTrigger("lr_site_a", "site-b", "policy", min_entries=3, poll_interval=0.5, max_poll_interval=4),
    LRSnapshotEndTrigger("lr_site_a", "6f1c0e1e-0000-4000-8000-000000000000", "2026-11-23T12:00:00+00:00"),
    LRDeliveredTrigger("lr_site_a", "site-a", "policy", 42, ["site-b"], 2, poll_interval=0.2),
    LRReadyTrigger("lr_site_a", "policy", ["site-b", "site-c"], poll_interval=0.3),
    LRFullSyncOutcomeTrigger("lr_site_a", "6f1c0e1e-0000-4000-8000-000000000000", lease_free=True, poll_interval=0.2),
]


@pytest.mark.parametrize("trigger", TRIGGERS, ids=lambda t: type(t).__name__)
def test_serialize_round_trips_through_an_importable_class_path(trigger):
    path, kwargs = trigger.serialize()
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is type(trigger)
    again = cls(**kwargs)
    assert again.serialize() == (path, kwargs)


async def _first_event(trigger, act=None, quiet_for: float = 0.6, timeout: float = 20.0):
    """Run the trigger; assert it stays quiet for ``quiet_for`` s while the loop keeps ticking,
    then run ``act`` (blocking, in a thread) and return the event it fires."""
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    beat = asyncio.create_task(ticker())
    waiting = asyncio.create_task(anext(trigger.run()))
    await asyncio.sleep(quiet_for)
    assert not waiting.done(), f"fired before the event: {waiting.result().payload if waiting.done() else ''}"
    # a blocking trigger holds the loop for its whole wait (0 or 1 tick); a loaded machine only slows
    # the ticks, so a few are enough to tell the two apart
    assert ticks >= 3, f"the trigger blocked the event loop ({ticks} ticks in {quiet_for} s)"
    if act is not None:
        await asyncio.to_thread(act)
    event = await asyncio.wait_for(waiting, timeout)
    beat.cancel()
    return event.payload


def _synced(found):
    """First contact done (snapshot applied on both sinks), so new entries flow as log entries."""
    repl = replicator(found.topology, found.sites, providers={"policy": table_provider})
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    return repl


def test_new_log_entries_fires_once_enough_entries_wait_for_the_sink(airflow_sites):
    source = airflow_sites.site("site-a")
    repl = _synced(airflow_sites)
    app = App(source)
    app.put("x", 1, ["site-b"])
    trigger = LRNewLogEntriesTrigger("lr_site_a", "site-b", "policy", min_entries=2, poll_interval=0.1)

    event = asyncio.run(_first_event(trigger, act=lambda: app.put("y", 2, ["site-b", "site-c"])))
    assert event["status"] == "success" and event["pending"] == 2
    assert event["highest_position"] == pending_entries(source.connect(), "site-b", "policy")[1]
    repl.run(max_cycles=2, until_idle=True, interval=0.01)  # delivered: nothing pending any more
    quiet = LRNewLogEntriesTrigger("lr_site_a", "site-b", "policy", poll_interval=0.1)
    assert asyncio.run(_first_event(quiet, act=lambda: app.put("z", 3, ["site-b"])))["pending"] == 1
    repl.close()
    app.close()


def test_a_trigger_keeps_waiting_through_a_source_restart_and_fires_after_it(airflow_sites, site_manager):
    """The source's server stops while a trigger waits (its connection is lost, then refused): the
    trigger keeps waiting (retrying, no error event), and fires on the entries written once the
    server is back."""
    source = airflow_sites.site("site-a")
    repl = _synced(airflow_sites)
    repl.close()
    app = App(source)
    app.close()
    trigger = LRNewLogEntriesTrigger(
        "lr_site_a", "site-b", "policy", min_entries=1, poll_interval=0.1, max_poll_interval=0.5
    )

    def restart_then_write() -> None:
        site_manager.down([source.site_id], mode="immediate")
        import time

        time.sleep(1.5)  # several checks fail meanwhile: refused connections
        site_manager.up(site_ids=[source.site_id])
        again = App(source)
        again.put("after-restart", 1, ["site-b"])
        again.close()

    event = asyncio.run(_first_event(trigger, act=restart_then_write, timeout=60))
    assert event["status"] == "success" and event["pending"] == 1


def test_snapshot_end_fires_when_the_client_supplies_the_data(airflow_sites):
    source = airflow_sites.site("site-a")
    App(source).close()  # the app's table exists
    conn = source.connect()
    request = full_sync.request_full_sync(conn, "site-b", "policy", "test", forced=True)
    deadline = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
    trigger = LRSnapshotEndTrigger("lr_site_a", request.request_id, deadline, poll_interval=0.1)

    def client_serves() -> None:
        client_conn = source.connect()
        RoutingQueueClient(client_conn, "policy").serve_full_sync_requests(table_provider)
        client_conn.close()

    event = asyncio.run(_first_event(trigger, act=client_serves))
    assert event == {"status": "supplied", "request_id": request.request_id, "entries": 0}

    late = full_sync.request_full_sync(conn, "site-c", "policy", "test", forced=True)
    past = (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()
    event = asyncio.run(anext(LRSnapshotEndTrigger("lr_site_a", late.request_id, past).run())).payload
    assert event["status"] == "timeout"
    conn.close()


def test_delivered_waits_for_the_named_sink_then_for_enough_regions(airflow_sites):
    source = airflow_sites.site("site-a")
    _synced(airflow_sites).close()
    app = App(source)
    app.put("k", 7, ["site-b", "site-c"])
    position = source.query("SELECT max(position) FROM lr.log_commits")[0][0]
    topo = airflow_sites.topology
    on_b = LRDeliveredTrigger.for_target(
        "lr_site_a", delivery_target(topo, "site-a", "policy", ["site-b"], min_regions=2), position, poll_interval=0.1
    )
    three_regions = LRDeliveredTrigger.for_target(
        "lr_site_a", delivery_target(topo, "site-a", "policy", [], min_regions=3), position, poll_interval=0.1
    )
    dsns = {s.site_id: s.dsn for s in airflow_sites.sites}

    def deliver(sink: str) -> None:
        repl = Replicator(
            topo,
            lambda site: psycopg2.connect(dsns[site]),
            settings=SessionSettings(barrier_timeout=2),
            sessions=[SessionKey("site-a", sink, "policy")],
        )
        repl.run(max_cycles=2, until_idle=True, interval=0.01)
        repl.close()

    event = asyncio.run(_first_event(on_b, act=lambda: deliver("site-b")))
    assert event == {
        "status": "success",
        "position": position,
        "safe_on": ["site-b"],
        "regions": ["region-1", "region-2"],
    }
    event = asyncio.run(_first_event(three_regions, act=lambda: deliver("site-c")))
    assert event["safe_on"] == ["site-b", "site-c"] and event["regions"] == ["region-1", "region-2", "region-3"]
    app.close()


def test_an_unknown_connection_ends_the_wait_with_an_error_event():
    event = asyncio.run(anext(LRNewLogEntriesTrigger("lr_no_such_site", "site-b", "policy").run())).payload
    assert event["status"] == "error" and "lr_no_such_site" in event["message"]


def test_delivered_refuses_what_can_never_be_met(airflow_sites):
    topo = airflow_sites.topology
    with pytest.raises(ConfigurationError, match="min_regions=3 can never be met"):
        delivery_target(topo, "site-a", "policy", ["site-b"], min_regions=3)
    with pytest.raises(ConfigurationError, match="min_regions=4 can never be met"):
        delivery_target(topo, "site-a", "policy", [], min_regions=4)
    with pytest.raises(ConfigurationError, match=r"site-z: not sinks of 'site-a'"):
        delivery_target(topo, "site-a", "policy", ["site-z"], min_regions=0)
    same_region = reconfigure(airflow_sites, regions={"site-b": "region-1", "site-c": "region-1"})
    with pytest.raises(ConfigurationError, match=r"span only 1 region\(s\)"):
        delivery_target(same_region, "site-a", "policy", [], min_regions=2)


def test_full_sync_outcome_fires_when_a_newer_request_of_the_session_is_applied(airflow_sites):
    """A request superseded by a newer one of its session is satisfied once that one is applied
    (the sink then holds a full sync requested after it); until then the wait goes on."""
    conn = airflow_sites.site("site-a").connect()
    first = full_sync.request_full_sync(conn, "site-b", "policy", "first", forced=True)
    second = full_sync.request_full_sync(conn, "site-b", "policy", "second", forced=True)  # cancels the first
    conn.close()
    assert airflow_sites.site("site-a").query(
        "SELECT status FROM lr.full_sync_requests WHERE request_id = %s", (first.request_id,)
    ) == [("cancelled",)]
    repl = replicator(
        airflow_sites.topology,
        airflow_sites.sites,
        providers={"policy": table_provider},
        sessions=[SessionKey("site-a", "site-b", "policy")],
    )
    App(airflow_sites.site("site-a")).close()
    trigger = LRFullSyncOutcomeTrigger("lr_site_a", first.request_id, poll_interval=0.1, max_poll_interval=0.2)
    event = asyncio.run(_first_event(trigger, act=lambda: repl.run_cycle()))
    repl.close()
    assert event["status"] == "applied" and event["applied_request"] == second.request_id


def test_a_wait_whose_connection_login_lacks_the_replicator_grant_ends_at_once_naming_the_role_and_grant(
    airflow_sites, made, monkeypatch
):
    """A login without lr's grants given as the source connection (an application's own): the
    trigger's error event said only "permission denied for table source_sessions", and the sensor's
    poke raised it raw (retried as the task's retries, each the same). Both name the role and the
    grant now; the sensor does not retry. (A writer of the client reads its readiness since V0051,
    as its ``wait_until_ready`` does.)"""
    from airflow_provider_lr.operators.common import FinalRefusal
    from airflow_provider_lr.sensors import LRReadySensor

    source = airflow_sites.site("site-a")
    writer = made.name("t_app")
    source.query(f'CREATE ROLE "{writer}" LOGIN; GRANT USAGE ON SCHEMA lr TO "{writer}"')
    name, value = airflow_sites.env(source)
    monkeypatch.setenv(name, json.dumps({**json.loads(value), "login": writer}))
    said = f"role '{writer}' lacks a privilege this step needs on "
    trigger = LRReadyTrigger("lr_site_a", "policy", ["site-b"], poll_interval=0.2)
    event = asyncio.run(asyncio.wait_for(anext(trigger.run()), 30)).payload
    assert event["status"] == "error" and said in event["message"], event
    assert "lr roles grant replicator" in event["message"], event
    # the event says its error's kind: the deferred sensor resumed on it fails for good too (before:
    # an AirflowException, retried as often as the task's retries, each retry refused the same)
    assert event["error_kind"] == "insufficient_privilege", event
    deferred = LRReadySensor(task_id="ready", source="site-a", client="policy", destinations=["site-b"])
    with pytest.raises(FinalRefusal, match=f"ready refused: {said}"):
        deferred.execute_complete({}, event)
    with pytest.raises(FinalRefusal, match=f"role '{writer}' may not read the lr schema version"):
        # (the sensor checks the site first: a login without any of lr's grants may not read its version)
        LRReadySensor(task_id="ready", source="site-a", client="policy", destinations=["site-b"]).execute({})


def test_an_operator_step_whose_login_lacks_lr_grants_fails_for_good_as_the_sensors_do(
    airflow_sites, made, monkeypatch
):
    """A writer's login given as a site's Airflow connection: the session step, the trim and the
    failover refuse at once (``FinalRefusal``, failed without retry: ``refusals_final``), naming the
    role and the grant to give, as the sensors do. Before, they failed on a bare 'permission denied'
    (a ``TaskRefused`` or psycopg2's error), which Airflow retried as if transient."""
    from airflow_provider_lr.operators import LRNegotiateOperator, LRTrimOperator
    from airflow_provider_lr.operators.common import FinalRefusal
    from airflow_provider_lr.operators.failover import LRFailoverOperator
    from airflow_provider_lr.operators.session import LRDiscoverSessionsOperator

    source = airflow_sites.site("site-a")
    writer = made.name("t_writer")
    made.grant(source, "writer", writer, ["policy"])
    session = LRDiscoverSessionsOperator(task_id="discover", sink="site-b").execute({})[0]
    name, value = airflow_sites.env(source)
    monkeypatch.setenv(name, json.dumps({**json.loads(value), "login": writer}))
    said = f"role '{writer}' lacks a privilege this step needs on "
    with pytest.raises(FinalRefusal, match=said):
        LRNegotiateOperator(task_id="decide", session=session).execute({})
    with pytest.raises(FinalRefusal, match=f"site site-a: {said}"):
        LRTrimOperator(task_id="trim", site={"site": "site-a", "conn_id": "lr_site_a"}).execute({})
    with pytest.raises(FinalRefusal, match=said):
        LRFailoverOperator(task_id="failover", promote="site-b", from_site="site-a", planned=True).execute({})
    for step in (LRNegotiateOperator(task_id="d", session=session), LRTrimOperator(task_id="t", site={})):
        assert any(r.exception is FinalRefusal for r in step.retry_policy.rules), step  # failed, not retried
