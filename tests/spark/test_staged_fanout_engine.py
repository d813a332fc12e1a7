"""The staged fan-out without Spark (chunks staged by threads and calls of this process, in any
order): nothing is visible until every earlier chunk of the session is in, then the contiguous
prefix is published in source order, once, whatever attempt stages or publishes it. The Spark runs
(tasks killed, speculation on) are in test_spark_parallel_fanout.py."""

from __future__ import annotations

import threading

import pytest

from airflow_provider_lr.engine.bulk import fanout, staged_tee
from airflow_provider_lr.engine.bulk.plan import ChunkResult
from airflow_provider_lr.engine.session import catchup
from airflow_provider_lr.engine.session.settings import STAGED_MIN_TASKS, SessionSettings
from tests.support.session import replicator, sink_queue
from tests.support.spark_env import (  # noqa: F401 (lr_connections is a fixture)
    expected_queue,
    in_log_entry_sync,
    lr_connections,
    prefixes_only,
    transmit_backlog,
)

CLIENTS = ("policy", "audit")


@pytest.fixture
def scenario(lr_sites, lr_connections):
    return in_log_entry_sync(lr_sites, clients=CLIENTS), lr_sites


def visible(lr_sites) -> dict[tuple[str, str], list[bytes]]:
    return {(s.site_id, c): sink_queue(s, c) for s in lr_sites[1:] for c in CLIENTS}


def positions(sink) -> set[int]:
    return {
        p
        for (p,) in sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions WHERE source_site_id = 'site-a'")
    }


def staged_left(lr_sites) -> int:
    return sum(
        s.query("SELECT count(*) FROM lr.spark_staging")[0][0]
        + s.query("SELECT count(*) FROM lr.spark_staged_ranges")[0][0]
        for s in lr_sites[1:]
    )


def test_later_chunks_staged_first_stay_invisible_until_the_gap_is_filled(scenario):
    topo, lr_sites = scenario
    transmit_backlog(lr_sites[0], 3000, clients=CLIENTS, per_txn=100)
    expected = {(s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS}
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        plan = driver.plan(partitions=3, tasks=3)
        assert plan.staged and len(plan.ranges) == 3
        last = staged_tee.stage_chunk(plan, plan.ranges[2])
        assert sum(last.staged.values()) > 0 and set(last.delivered.values()) == {0}
        assert all(v == [] for v in visible(lr_sites).values()), "a chunk after a gap is not visible"
        middle = staged_tee.stage_chunk(plan, plan.ranges[1])
        assert all(v == [] for v in visible(lr_sites).values())
        first = staged_tee.stage_chunk(plan, plan.ranges[0])  # fills the gap: the whole prefix goes out
        assert visible(lr_sites) == expected
        assert sum(first.delivered.values()) == sum(len(v) for v in expected.values())
        result = driver.finish(plan, [last, middle, first])
    finally:
        driver.close()
    assert result.ok, result.errors
    assert sum(result.deliveries.values()) == sum(len(v) for v in expected.values())
    assert all(positions(s) == {plan.end} for s in lr_sites[1:])
    assert staged_left(lr_sites) == 0


def test_concurrent_duplicate_attempts_of_every_chunk_publish_each_entry_once(scenario):
    """Three attempts of each chunk at once (speculative duplicates), chunks in reverse order:
    while they run a reader sees only prefixes of the source order; at the end everything once."""
    topo, lr_sites = scenario
    transmit_backlog(lr_sites[0], 4000, clients=CLIENTS, per_txn=50)
    expected = {(s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS}
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        with prefixes_only(lr_sites, expected, CLIENTS) as violations:
            plan = driver.plan(partitions=4, tasks=4)
            outcomes: list[ChunkResult] = []
            attempts = [
                threading.Thread(target=lambda p=part: outcomes.append(staged_tee.stage_chunk(plan, p)))
                for part in reversed(plan.ranges)
                for _ in range(3)
            ]
            for t in attempts:
                t.start()
            for t in attempts:
                t.join()
            result = driver.finish(plan, outcomes)
    finally:
        driver.close()
    assert not [o.errors for o in outcomes if o.errors]
    assert violations == []
    assert result.ok, result.errors
    assert visible(lr_sites) == expected
    assert sum(result.deliveries.values()) == sum(len(v) for v in expected.values())
    staged = [o.staged.get(d.session, 0) for o in outcomes for d in plan.demands]
    assert sum(staged) == sum(len(v) for v in expected.values()), "each chunk staged by one attempt only"
    assert staged_left(lr_sites) == 0


def test_a_stage_that_lands_after_its_chunk_was_published_is_rolled_back(scenario):
    """An attempt that began staging before another attempt published the chunk does not commit
    its rows (they would sit behind the sink's position)."""
    topo, lr_sites = scenario
    transmit_backlog(lr_sites[0], 800, clients=CLIENTS, per_txn=100)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        plan = driver.plan(partitions=1, tasks=2)
        part, demand = plan.ranges[0], plan.demands[0]
        late = staged_tee.SessionStage(plan, demand, part)  # holds the chunk's stage lock...
        late.writer.sync()
        late.conn.commit()  # ...released here, as if its rows were still on their way
        done = staged_tee.stage_chunk(plan, part)  # another attempt stages and publishes the chunk
        assert done.positions[demand.session] == plan.end
        late.conn.cursor().execute("SELECT 1")  # the late attempt goes on in a new transaction
        assert late.commit() is False
        result = driver.finish(plan, [done])
    finally:
        driver.close()
    assert result.ok, result.errors
    assert visible(lr_sites) == {
        (s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS
    }


def test_a_session_taken_over_since_the_plan_stages_nothing_and_the_others_go_on(scenario):
    topo, lr_sites = scenario
    source = lr_sites[0]
    transmit_backlog(source, 1000, clients=CLIENTS, per_txn=100)
    driver = fanout.FanoutDriver(topo, "site-a", owner="spark-driver")
    taken = "site-a->site-b/policy"
    try:
        plan = driver.plan(partitions=2, tasks=2)
        source.query(
            "UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second' "
            "WHERE sink_site_id = 'site-b' AND client_name = 'policy'"
        )
        from airflow_provider_lr.engine.vocabulary import SessionKey

        other = replicator(topo, lr_sites, owner="other", sessions=[SessionKey("site-a", "site-b", "policy")])
        other.run(max_cycles=3, until_idle=True, interval=0.01)
        chunks = [staged_tee.stage_chunk(plan, part) for part in plan.ranges]
        result = driver.finish(plan, chunks)
        other.close()
    finally:
        driver.close()
    assert all("FencedError" in c.errors[taken] for c in chunks)
    assert set(result.errors) == {taken}
    assert visible(lr_sites) == {
        (s.site_id, c): expected_queue(source, s.site_id, c) for s in lr_sites[1:] for c in CLIENTS
    }  # site-b/policy once, by the other


def failed_staged_run(topo, lr_sites, chunks: tuple[int, ...]) -> None:
    """1,500 entries planned in 3 chunks over 3 tasks, of which only ``chunks`` ever stage."""
    transmit_backlog(lr_sites[0], 1500, clients=CLIENTS, per_txn=100)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        plan = driver.plan(partitions=3, tasks=3)
        for index in chunks:
            staged_tee.stage_chunk(plan, plan.ranges[index])
    finally:
        driver.close()


def test_what_a_failed_staged_run_left_is_dropped_by_the_next_plan(scenario):
    """A run whose first chunk never staged leaves the later chunks staged on the sinks; the next
    plan drops them before its own tasks stage, and delivers everything once."""
    topo, lr_sites = scenario
    failed_staged_run(topo, lr_sites, chunks=(1, 2))
    assert staged_left(lr_sites) > 0 and all(v == [] for v in visible(lr_sites).values())
    again = fanout.FanoutDriver(topo, "site-a")
    try:
        result = fanout.run_fanout(
            again, lambda p: [staged_tee.stage_chunk(p, r) for r in p.ranges], partitions=2, tasks=2
        )
    finally:
        again.close()
    assert result.ok, result.errors
    assert visible(lr_sites) == {
        (s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS
    }
    assert staged_left(lr_sites) == 0


def test_what_a_failed_staged_run_left_is_dropped_by_the_session_cycles_that_take_its_sessions(scenario):
    """The same failed run (its driver gone, its leases released), then the session cycles take the
    sessions over and deliver the backlog themselves, passing over the staged chunks (behind the
    sinks' positions now, never to be published): the new holder's fence drops them. Before, they
    stayed on the sinks until the next Spark plan of the session; with ``lr sync`` alone after a
    failed job, for good. The sinks hold every entry once; a plan after it has nothing to do."""
    topo, lr_sites = scenario
    failed_staged_run(topo, lr_sites, chunks=(2,))
    assert staged_left(lr_sites) > 0
    repl = replicator(topo, lr_sites)
    repl.run(max_cycles=10, until_idle=True, interval=0.01)
    repl.close()
    expected = {(s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS}
    assert visible(lr_sites) == expected
    assert staged_left(lr_sites) == 0, "the cycles' fence dropped what the fenced job staged"
    again = fanout.FanoutDriver(topo, "site-a")
    try:
        result = fanout.run_fanout(again, lambda p: [staged_tee.stage_chunk(p, r) for r in p.ranges], tasks=2)
    finally:
        again.close()
    assert result.ok and sum(result.deliveries.values()) == 0, result
    assert visible(lr_sites) == expected and staged_left(lr_sites) == 0


def test_the_fanout_is_staged_over_the_cores_of_a_cluster_of_four_or_more_unless_the_topology_says():
    auto = SessionSettings()
    assert [catchup.fanout_tasks(auto, c) for c in (1, 2, STAGED_MIN_TASKS - 1)] == [1, 1, 1]
    assert catchup.fanout_tasks(auto, STAGED_MIN_TASKS) == STAGED_MIN_TASKS and catchup.fanout_tasks(auto, 16) == 16
    assert catchup.fanout_tasks(SessionSettings(fanout_tasks=1), 16) == 1
    assert catchup.fanout_tasks(SessionSettings(fanout_tasks=6), 2) == 6
