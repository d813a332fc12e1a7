"""The fan-out job on a real local[2] Spark: read once, deliver each sink exactly its entries in
source order, survive the task killed mid-write or between chunks, never show a later entry
before an earlier one; and beside ``lr sync``'s stream, a session caught up by the job, a full sync
asked of it meanwhile, then handed to the stream. One Spark session for the module (a start costs
seconds)."""

from __future__ import annotations

import threading

import psycopg2
import pytest

from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient
from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.bulk.plan import FanoutPlan
from airflow_provider_lr.engine.faults import FAULT_ENV
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import (
    App,
    Streaming,
    apply,
    final_state,
    queue,
    replicator,
    sink_queue,
    source_state,
    table_provider,
    wait_for,
)
from tests.support.spark_env import (  # noqa: F401 (local_spark, lr_connections are fixtures)
    expected_entries,
    expected_queue,
    in_log_entry_sync,
    local_spark,
    lr_connections,
    prefixes_only,
    transmit_backlog,
)

lr_fanout = pytest.importorskip("spark_jobs.lr_fanout")

CLIENTS = ("policy", "audit")


@pytest.fixture
def spark(local_spark):
    return local_spark


@pytest.fixture
def topo(lr_sites, lr_connections):
    return in_log_entry_sync(lr_sites, clients=CLIENTS)


def delivered_exactly(lr_sites) -> None:
    source = lr_sites[0]
    for sink in lr_sites[1:]:
        for client in CLIENTS:
            assert sink_queue(sink, client) == expected_queue(source, sink.site_id, client), (sink.site_id, client)
        assert sink.query("SELECT count(*) FROM lr.spark_staging")[0][0] == 0, "the fan-out stages nothing"


def test_read_once_to_random_subsets_in_source_order_never_ahead(spark, topo, lr_sites):
    """Three runs of at most 1,500 entries each; meanwhile a reader of each sink checks that what
    is visible is always a prefix of the source order (no later entry before an earlier one)."""
    transmit_backlog(lr_sites[0], 4000, clients=CLIENTS, per_txn=250)
    expected = {(s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS}
    with prefixes_only(lr_sites, expected, CLIENTS) as violations:
        results = [lr_fanout.fan_out(spark, topo, "site-a", max_entries=1500, partitions=3) for _ in range(3)]
    assert all(r.ok for r in results), [r.errors for r in results]
    assert [r.entries_read for r in results][:2] == [1500, 1500]  # each entry read once, whatever its sinks
    assert sum(r.entries_read for r in results) == 4000
    assert violations == []
    delivered_exactly(lr_sites)
    total = sum(len(v) for v in expected.values())
    assert sum(sum(r.deliveries.values()) for r in results) == total
    assert lr_fanout.fan_out(spark, topo, "site-a").deliveries == {
        str(SessionKey("site-a", s, c)): 0 for s in ("site-b", "site-c") for c in CLIENTS
    }


def test_task_killed_mid_write_or_after_a_chunk_then_rerun(spark, topo, lr_sites, monkeypatch):
    """Killed with chunk 1 half written: chunk 0 is visible, exactly, and nothing of chunk 1. Killed
    right after chunk 0 commits (on a fresh backlog position): the same. The rerun resumes from
    what each sink committed and delivers everything exactly once."""
    transmit_backlog(lr_sites[0], 3000, clients=CLIENTS, per_txn=100)
    expected = {(s.site_id, c): expected_queue(lr_sites[0], s.site_id, c) for s in lr_sites[1:] for c in CLIENTS}
    for fault in ("fanout_mid_write_p1_a0", "fanout_after_commit_p0_a0"):
        before = {k: len(sink_queue(s, k[1])) for s in lr_sites[1:] for k in expected if k[0] == s.site_id}
        monkeypatch.setenv(FAULT_ENV, fault)  # the Python worker running the task SIGKILLs itself
        with pytest.raises(Exception, match="Python worker exited unexpectedly|crashed|EOFError"):
            lr_fanout.fan_out(spark, topo, "site-a", partitions=3)
        monkeypatch.delenv(FAULT_ENV)
        positions = set()
        for sink in lr_sites[1:]:
            for client in CLIENTS:
                seen = sink_queue(sink, client)
                assert seen == expected[(sink.site_id, client)][: len(seen)], "a prefix in source order"
                assert len(seen) > before[(sink.site_id, client)], "chunk 0 committed"
                position = sink.query(
                    "SELECT last_log_entry_processed FROM lr.sink_sessions WHERE "
                    "source_site_id = 'site-a' AND client_name = %s",
                    (client,),
                )[0][0]
                newest = sink.query(
                    "SELECT max(source_position) FROM lr.receive_queue WHERE "
                    "source_site_id = 'site-a' AND client_name = %s",
                    (client,),
                )[0][0]
                assert newest <= position, "nothing past the committed position"
                committed = [p for p, _ in expected_entries(lr_sites[0], sink.site_id, client) if p <= position]
                assert len(seen) == len(committed)
                positions.add(position)
        assert len(positions) == 1, "every session stopped after the same chunk"
    visible = sum(len(sink_queue(s, c)) for s in lr_sites[1:] for c in CLIENTS)
    result = lr_fanout.fan_out(spark, topo, "site-a", partitions=3)
    assert result.ok, result.errors
    delivered_exactly(lr_sites)
    assert visible + sum(result.deliveries.values()) == sum(len(v) for v in expected.values())


# --- the fan-out job beside ``lr sync``'s stream (issue 21: exactly once through every hand-off) ------
B, C = SessionKey("site-a", "site-b", "policy"), SessionKey("site-a", "site-c", "policy")
TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]


def planned(driver: fanout.FanoutDriver) -> FanoutPlan:
    """The job's plan of site-c's backlog in three chunks, its lease taken before any stream starts
    (a stream's first cycle would take it otherwise)."""
    try:
        plan = driver.plan(partitions=3)
        assert [d.session for d in plan.demands] == [str(C)] and len(plan.ranges) == 3, plan.describe()
    except BaseException:
        driver.close()
        raise
    return plan


def test_a_spark_catch_up_of_one_sink_while_the_stream_carries_the_other_then_handed_to_the_stream(
    spark, lr_sites, lr_connections
):
    """The Spark fan-out job holds site-c's session (its plan took the lease) when ``lr sync``
    starts streaming: the stream carries site-b, its cycles find site-c held and leave it. Writers
    commit to both sinks while Spark tees site-c's backlog in three chunks; once the job ends the
    stream's cycle takes site-c and streams it. Each sink only ever shows a prefix of the source
    order, and ends with every entry once."""
    source = lr_sites[0]
    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(source, 1500, per_txn=100, seed=11)
    driver = fanout.FanoutDriver(topo, "site-a", sessions=[C])  # the DAG's job, for the session it was given
    plan = planned(driver)
    repl = replicator(topo, lr_sites)
    writing = threading.Thread(target=transmit_backlog, args=(source, 300), kwargs={"per_txn": 5, "seed": 12})
    with Streaming(repl, StreamSettings(), interval=0.05) as stream:
        try:
            wait_for(lambda: B in stream.streamer.streaming, 60, "site-b to stream")
            writing.start()
            result = driver.finish(plan, lr_fanout.spark_map(spark)(plan))
        finally:
            driver.close()
        assert not result.errors and result.positions[str(C)] == plan.end, result.errors
        assert C not in stream.streamer.streaming, "the job held site-c's session"
        writing.join(60)
        assert not writing.is_alive()
        expected = {(s.site_id, "policy"): expected_queue(source, s.site_id, "policy") for s in lr_sites[1:]}
        with prefixes_only(lr_sites, expected, ["policy"]) as violations:
            wait_for(lambda: C in stream.streamer.streaming, 60, "site-c handed to the stream")
            for sink in lr_sites[1:]:
                want = expected[(sink.site_id, "policy")]
                wait_for(lambda s=sink, w=want: len(sink_queue(s, "policy")) >= len(w), 60, f"{sink.site_id} caught up")
        assert violations == []
        more = len(expected_queue(source, "site-c", "policy"))
        transmit_backlog(source, 30, per_txn=1, seed=13)  # streamed now, to both
        for sink in lr_sites[1:]:
            want = expected_queue(source, sink.site_id, "policy")
            wait_for(lambda s=sink, w=want: len(sink_queue(s, "policy")) >= len(w), 60, f"{sink.site_id} streamed")
        assert len(expected_queue(source, "site-c", "policy")) > more
    for sink in lr_sites[1:]:
        assert sink_queue(sink, "policy") == expected_queue(source, sink.site_id, "policy"), sink.site_id
        assert sink.query("SELECT count(*) FROM lr.spark_staging") == [(0,)]
    assert not [e for e in stream.streamer.ends if e.error], stream.streamer.ends


def _puts(source, txns: int, per_txn: int, prefix: str = "k") -> None:
    """``txns`` transactions of ``per_txn`` app_state changes each, every change transmitted to both sinks."""
    App(source).close()
    conn = source.connect()
    client = RoutingQueueClient(conn, "policy")
    n = 0
    for _ in range(txns):
        msgs = []
        with conn.cursor() as cur:
            for _ in range(per_txn):
                key, n = f"{prefix}{n % 37}", n + 1
                cur.execute(
                    "INSERT INTO app_state VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (key, n)
                )
                msgs.append(LRMessageWithDestinations(f"{key}={n}".encode(), ["site-b", "site-c"]))
        client.transmit_log_entry_messages(msgs)
        conn.commit()
    conn.close()


def test_a_full_sync_asked_while_spark_catches_the_session_up_is_applied_after_it_and_the_stream_follows(
    spark, lr_sites, lr_connections, monkeypatch
):
    """``lr full-sync`` of site-c is asked while the Spark fan-out's task stalls after its first
    chunk (``lr sync`` streams site-b meanwhile). The job finishes its chunks; the stream's cycle
    then applies the full sync and streams site-c. site-c: what came before the full sync is a
    prefix in source order, after it nothing twice, its state the source's; site-b every entry once."""
    source = lr_sites[0]
    topo = apply(lr_sites, TWO_SINKS, providers={"policy": "tests.support.session:table_provider"})
    App(source).close()
    first = replicator(topo, lr_sites, providers={"policy": table_provider})
    run_until_idle(first)
    first.close()
    _puts(source, 15, 100)
    monkeypatch.setenv(FAULT_ENV, "fanout_after_commit_p0_a0:stall=3")
    driver = fanout.FanoutDriver(topo, "site-a", sessions=[C])
    plan = planned(driver)
    monkeypatch.delenv(FAULT_ENV)
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    with Streaming(repl, StreamSettings(), interval=0.05) as stream:
        try:
            wait_for(lambda: B in stream.streamer.streaming, 60, "site-b to stream")
            chunks: list = []
            job = threading.Thread(target=lambda: chunks.extend(lr_fanout.spark_map(spark)(plan)))
            job.start()
            sink_c = lr_sites[2]
            wait_for(
                lambda: sink_c.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
                >= plan.ranges[0].hi,
                60,
                "chunk 0 committed at site-c",
            )
            dsns = {s.site_id: s.dsn for s in lr_sites}
            (request,) = full_sync.request_for_sessions(
                [C], lambda s: psycopg2.connect(dsns[s]), "asked mid-job"
            ).values()
            _puts(source, 5, 20, prefix="w")
            job.join(120)
            result = driver.finish(plan, chunks)
        finally:
            driver.close()
        assert not result.errors, result.errors
        wait_for(lambda: C in stream.streamer.streaming, 60, "site-c handed to the stream")
        wait_for(
            lambda: source.query(
                "SELECT status FROM lr.full_sync_requests WHERE request_id = %s", (request.request_id,)
            )
            == [("applied",)],
            60,
            "the full sync applied",
        )
        _puts(source, 3, 10, prefix="z")
        for sink in lr_sites[1:]:
            wait_for(
                lambda s=sink: final_state(queue(s, "site-a")) == source_state(source), 60, f"{sink.site_id} state"
            )
    entries_c = queue(lr_sites[2], "site-a")
    starts = [i for i, (k, _) in enumerate(entries_c) if k == "start"]
    assert len(starts) == 2, [k for k, _ in entries_c].count("start")
    before = [p for k, p in entries_c[: starts[1]] if k == "log"]
    after = [p for k, p in entries_c[starts[1] :] if k == "log"]
    expected_logs = [p for k, p in queue(lr_sites[1], "site-a") if k == "log"]
    assert before == expected_logs[: len(before)], "before the full sync: a prefix in source order"
    assert after == expected_logs[len(expected_logs) - len(after) :], "after it: the source's tail, once"
    assert final_state(entries_c) == source_state(source)
    assert [k for k, _ in queue(lr_sites[1], "site-a")].count("start") == 1
