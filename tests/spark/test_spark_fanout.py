"""The fan-out job on a real local[2] Spark: read once, deliver each sink exactly its entries in
source order, survive the task killed mid-write or between chunks, never show a later entry
before an earlier one. One Spark session for the module (a start costs seconds)."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.faults import FAULT_ENV
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import sink_queue
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
