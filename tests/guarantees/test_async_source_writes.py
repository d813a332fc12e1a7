"""What a replicator or a command writes on a site whose server commits asynchronously
(`synchronous_commit = off`, as the test servers do: tests/conftest.py) and then crashes before its
WAL writer flushed it: the writes a guarantee rests on are on the site's disk when they return (a
lease's new epoch on its source, the note `lr tables close` leaves on each sink). The site's WAL
writer is stalled, so its asynchronous commits stay in memory, and its server crashes (every process
killed) right after (docs/crash-windows.md)."""

from __future__ import annotations

import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.engine.errors import FencedError
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.sink import writes
from tests.cli.test_cli_sync import topology_file
from tests.guarantees.test_async_sink_commits import _crash, _wal_flushers_stalled
from tests.support.session import apply
from tests.support.tables import create_accounts, rows

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


def test_a_sink_crashing_right_after_lr_tables_close_told_it_keeps_the_note(
    lr_sites, site_manager, tmp_path, monkeypatch
):
    """`lr tables close` said each sink keeps its copy, told of the close (a failover promoting it
    leaves the table closed), and a sink that crashed then came back without the note: a failover
    promoting it would capture the table again, and nothing said so (it says only of a sink not
    reached)."""
    source, _, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(source, rows=10)
    assert cli.main(["tables", "open", "public.accounts", "--client", "policy", "--topology", topo]) == 0
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    assert rows(sink_c) == rows(source)
    sink_c.query("CHECKPOINT")  # the copy on disk: what the crash may lose is the close's note alone
    with _wal_flushers_stalled(sink_c):
        assert cli.main(["tables", "close", "public.accounts", "--topology", topo]) == 0
        _crash(site_manager, sink_c)
    site_manager.up(site_ids=[sink_c.site_id])
    assert sink_c.query("SELECT source_site_id FROM lr.sink_tables WHERE closed_at_source") == [("site-a",)]
