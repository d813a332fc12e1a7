"""What a replicator or a command writes on a source whose server commits asynchronously
(`synchronous_commit = off`, as the test servers do: tests/conftest.py) and then crashes before its
WAL writer flushed it: the writes a guarantee rests on are on the source's disk when they return.
The source's WAL writer is stalled, so its asynchronous commits stay in memory, and its server
crashes (every process killed) right after (docs/crash-windows.md)."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.errors import FencedError
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.sink import writes
from tests.guarantees.test_async_sink_commits import _crash, _wal_flushers_stalled
from tests.support.session import apply

# a database made in the background meanwhile (tests/conftest.py) would flush the WAL the test keeps unflushed
pytestmark = pytest.mark.quiet_servers

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]


def test_a_lease_taken_just_before_the_source_crashed_is_never_taken_again_with_the_same_epoch(lr_sites, site_manager):
    """Replicator A takes the session's lease and fences the sink with its epoch; the source crashes
    before its WAL writer flushed the lease. Before, the restarted source had forgotten it and gave
    replicator B the same epoch: the sink took both, and A, its lease lost, was not refused there
    when it woke up (guarantee 5: docs/architecture.md)."""
    source, sink, _ = lr_sites
    apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    source.query("CHECKPOINT")  # the topology on disk: what the crash may lose is the lease alone
    conn = source.connect()
    with _wal_flushers_stalled(source):
        first = leases.acquire(conn, "site-b", "policy", "replicator-a", 1.0)
        assert first is not None
        fenced = sink.connect()
        writes.fence(fenced, "site-a", "policy", first.epoch)
        _crash(site_manager, source)
    conn.close()
    site_manager.up(site_ids=[source.site_id])
    conn = source.connect()
    # A's lease runs out (A is stalled, say) and B takes the session
    second = None
    for _ in range(100):
        second = leases.acquire(conn, "site-b", "policy", "replicator-b", 60.0)
        if second is not None:
            break
        conn.cursor().execute("SELECT pg_sleep(0.1)")
        conn.commit()
    assert second is not None, "replicator B never got the lease"
    conn.close()
    assert second.epoch > first.epoch, "a second holder got the epoch the source forgot"
    writes.fence(fenced, "site-a", "policy", second.epoch)
    with pytest.raises(FencedError):
        writes.fence(fenced, "site-a", "policy", first.epoch)  # A wakes up: refused
    fenced.close()
