"""The one catch-up path decision (engine/session/catchup.py): Spark, the read-once tee or the session
cycles, from the backlog, the two thresholds of SessionSettings and whether Spark can run here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from airflow_provider_lr.engine.session.catchup import CatchupPath, backlog_cap, backlog_matters, choose
from airflow_provider_lr.engine.session.settings import SPARK_MIN_BACKLOG, TEE_MIN_BACKLOG, SessionSettings
from airflow_provider_lr.engine.store import topology
from tests.support.session import topology_doc

RULES = SessionSettings(spark_min_backlog=1000, tee_min_backlog=100)


def spark_usable() -> None:
    return None


@pytest.mark.parametrize(
    "backlog, spark, path",
    [
        (0, spark_usable, CatchupPath.SESSION_CYCLES),
        (99, spark_usable, CatchupPath.SESSION_CYCLES),
        (100, spark_usable, CatchupPath.TEE),  # the thresholds are inclusive
        (999, spark_usable, CatchupPath.TEE),
        (1000, spark_usable, CatchupPath.SPARK),
        (10**9, None, CatchupPath.TEE),  # no Spark here (lr sync): the tee, however large
        (1000, lambda: "no Spark connection 'spark_default'", CatchupPath.TEE),
    ],
)
def test_the_path_follows_the_backlog_and_what_can_run(backlog, spark, path):
    assert choose(backlog, RULES, spark).path is path


def test_why_names_the_thresholds_and_what_kept_spark_out():
    assert (
        choose(50, RULES, spark_usable).why == "backlog 50 < spark_min_backlog 1000; backlog 50 < tee_min_backlog 100"
    )
    assert choose(1000, RULES, spark_usable).why == "backlog 1000 >= spark_min_backlog 1000"
    unusable = choose(5000, RULES, lambda: "the Spark job is not installed in /x")
    assert unusable.why == (
        "backlog 5000 but the Spark job is not installed in /x; backlog 5000 >= tee_min_backlog 100"
    )
    assert "this process runs no Spark" in choose(5000, RULES).why


def test_a_backlog_is_counted_only_as_far_as_the_decision_needs():
    assert backlog_cap(RULES) == 100 and backlog_cap(RULES, spark_usable) == 1000
    assert backlog_cap(SessionSettings(spark_min_backlog=1000, tee_min_backlog=0)) == 1
    capped = choose(100, RULES, counted_to=100)
    assert capped.path is CatchupPath.TEE
    assert capped.why == "this process runs no Spark; backlog of at least 100 >= tee_min_backlog 100"
    assert choose(1000, RULES, spark_usable, counted_to=1000).path is CatchupPath.SPARK


def test_a_tee_threshold_of_zero_turns_the_tee_off():
    off = SessionSettings(spark_min_backlog=1000, tee_min_backlog=0)
    assert choose(10**9, off).path is CatchupPath.SESSION_CYCLES
    assert "tee is off" in choose(10**9, off).why
    assert choose(10**9, off, spark_usable).path is CatchupPath.SPARK
    assert not backlog_matters(off) and backlog_matters(off, spark_usable) and backlog_matters(RULES)


def test_spark_is_asked_about_only_for_a_backlog_large_enough_for_it():
    asked = []
    choose(999, RULES, lambda: asked.append(1))
    assert asked == []
    choose(1000, RULES, lambda: asked.append(1))
    assert asked == [1]


def test_path_values_are_what_the_dag_branches_on():
    assert {p.value for p in CatchupPath} == {"spark", "tee", "in_process"}


def test_both_thresholds_come_from_the_topology_with_measured_defaults():
    sites = [SimpleNamespace(site_id=s, region="r") for s in ("site-a", "site-b")]
    default = SessionSettings.from_topology(topology.from_document(topology_doc(sites)))
    assert (
        (default.spark_min_backlog, default.tee_min_backlog)
        == (SPARK_MIN_BACKLOG, TEE_MIN_BACKLOG)
        == (800_000, 50_000)
    )
    tuned = SessionSettings.from_topology(
        topology.from_document(topology_doc(sites, settings={"spark_min_backlog": 20, "tee_min_backlog": 0}))
    )
    assert (tuned.spark_min_backlog, tuned.tee_min_backlog) == (20, 0)
