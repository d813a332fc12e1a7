"""lr sync's catch-up: a large log-entry backlog moves by the read-once tee in the replicator's own
process (engine/bulk/fanout.py), then session cycles carry on; exactly once, in order, whichever did it."""

from __future__ import annotations

from tests.support.session import replicator, sink_queue
from tests.support.spark_env import (  # noqa: F401 (lr_connections is a fixture)
    expected_queue,
    in_log_entry_sync,
    lr_connections,
    transmit_backlog,
)

SINKS = ("site-b", "site-c")


def delivered_exactly(lr_sites) -> int:
    total = 0
    for sink in lr_sites[1:]:
        got = sink_queue(sink, "policy")
        assert got == expected_queue(lr_sites[0], sink.site_id, "policy"), sink.site_id
        total += len(got)
    return total


def test_a_backlog_over_the_threshold_is_teed_then_cycles_carry_on(lr_sites, lr_connections):
    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(lr_sites[0], 3000, per_txn=250)
    repl = replicator(topo, lr_sites, tee_min_backlog=1000)
    try:
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
        teed = dict(repl.teed)
        total = delivered_exactly(lr_sites)
        assert sum(teed.values()) == total > 1000  # all of it by the tee, in one cycle
        assert set(teed) == {f"site-a->{s}/policy" for s in SINKS}
        rows = sum(s.query("SELECT count(*) FROM lr.receive_queue WHERE kind = 1")[0][0] for s in lr_sites[1:])
        assert rows * 10 < total  # packed rows

        transmit_backlog(lr_sites[0], 200, per_txn=50, seed=9)  # below the threshold: session cycles
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
        assert repl.teed == teed
        assert delivered_exactly(lr_sites) > total
    finally:
        repl.close()
    states = lr_sites[0].query("SELECT state, last_error FROM lr.source_sessions ORDER BY sink_site_id")
    assert states == [("IN_LOG_ENTRY_SYNC", None)] * 2


def test_without_resolvable_site_connections_the_session_cycles_do_it_all(lr_sites):
    topo = in_log_entry_sync(lr_sites)  # no $LR_CONNECTIONS_FILE: the topology's conn ids do not resolve
    transmit_backlog(lr_sites[0], 1500, per_txn=250)
    repl = replicator(topo, lr_sites, tee_min_backlog=100)
    try:
        reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert repl.teed == {} and not any(r.error for r in reports)
    assert delivered_exactly(lr_sites) > 1500 // 2


def test_a_replicator_of_some_sessions_tees_only_those(lr_sites, lr_connections):
    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(lr_sites[0], 2000, per_txn=250)
    mine = [k for k in topo.sessions() if k.sink == "site-b"]
    repl = replicator(topo, lr_sites, tee_min_backlog=500, sessions=mine)
    try:
        repl.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert set(repl.teed) == {"site-a->site-b/policy"}
    sink_b, sink_c = lr_sites[1:]
    assert sink_queue(sink_b, "policy") == expected_queue(lr_sites[0], "site-b", "policy")
    assert sink_queue(sink_c, "policy") == []  # not this replicator's session


def test_the_source_lost_in_the_middle_of_a_tee_is_reported_and_the_next_cycles_finish(lr_sites, lr_connections):
    from airflow_provider_lr.engine.faults import on_fault

    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(lr_sites[0], 1500, per_txn=250)
    repl = replicator(topo, lr_sites, tee_min_backlog=100)

    def cut_source() -> None:  # the source's server drops every other backend, as a restart would
        lr_sites[0].query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )

    try:
        with on_fault("fanout_after_commit_p0_a0", cut_source):
            repl.run_cycle()  # must not raise: one source's trouble is reported, not thrown
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    delivered_exactly(lr_sites)
