"""Cells of the hand-off matrix (docs/crash-windows.md) for the Spark movers. A Spark job's tasks run
the engine's own functions (``snapshot_transfer.stage_range``, ``staged_tee.stage_chunk``); here they
run in this process, in the order the race needs, as ``test_spark_jobs.py`` and
``test_staged_fanout_engine.py`` do: no Spark start-up."""

from __future__ import annotations

from collections import Counter

import psycopg2
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.bulk import fanout, snapshot_transfer, staged_tee
from airflow_provider_lr.engine.bulk import parallel_tables as parallel
from airflow_provider_lr.engine.errors import ConfigurationError, FencedError, StaleBatchError
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.site import failover
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.tables.range_copy import copy_range
from tests.guarantees.test_handoff_matrix import (
    Takeover,
    assert_handed_off,
    backlog_to_both_sinks,
    full_sync_of_site_c_supplied,
    promote_site_b_up_to_date,
    request_full_syncs,
    site_c_follows_site_b,
    trim_now,
)
from tests.support.session import App, apply, final_state, queue, replicator, source_state, table_provider
from tests.support.spark_env import lr_connections  # noqa: F401 (fixture: the job resolves the sites by id)
from tests.support.tables import create_accounts, federate, rows

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
B, C = "site-a->site-b/policy", "site-a->site-c/policy"
PROVIDERS = {"policy": "tests.support.session:table_provider"}
ROWS = 7_000


def supplied_for_spark(lr_sites):
    """site-a -> site-b for policy, ROWS application rows only a full sync carries, and a full sync
    requested and supplied for the transfer job; (topology, the application, the request)."""
    topo = apply(lr_sites, ONE_SINK)
    app = App(lr_sites[0])
    with app.conn.cursor() as cur:
        cur.execute("INSERT INTO app_state SELECT 'row' || i, i FROM generate_series(1, %s) i", (ROWS,))
    app.conn.commit()
    conn = lr_sites[0].connect()
    request = full_sync.request_full_sync(conn, "site-b", "policy", reason="large: left to Spark")
    RoutingQueueClient(conn, "policy").serve_full_sync_requests(table_provider)
    conn.close()
    return topo, app, request


def test_a_spark_transfer_whose_lease_is_taken_over_between_its_tasks_is_fenced_and_applied_once(
    lr_sites, lr_connections
):
    """The transfer job has planned (lease, fence, SNAPSHOT_START) and one task has staged its range
    when the driver stalls and its lease runs out. A replicator takes the session over and moves the
    same request in process, and applies it. The job's last task stages, its commit is refused by
    the sink's fence; the sink holds one full set, once, nothing left staged, and log entries follow."""
    source, sink_b = lr_sites[0], lr_sites[1]
    topo, app, request = supplied_for_spark(lr_sites)

    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy", owner="spark-driver")
    successor = replicator(topo, lr_sites, owner="successor", providers={"policy": table_provider})
    try:
        plan = job.plan(request.request_id, partitions=2)
        snapshot_transfer.stage_range(plan, plan.ranges[0])
        source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")
        (took,) = successor.run_cycle()
        assert not took.error and took.state == "IN_LOG_ENTRY_SYNC" and took.snapshot_messages == ROWS + 2, took
        snapshot_transfer.stage_range(plan, plan.ranges[1])  # the stalled driver's last task
        with pytest.raises(FencedError):
            job.commit(plan)
        for i in range(20):
            app.put(f"k{i % 7}", i, ["site-b"])
        successor.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        job.close()
        successor.close()
    entries = queue(sink_b, "site-a")
    assert [k for k, _ in entries].count("start") == 1
    snaps = [p for k, p in entries if k == "snap"]
    assert len(snaps) == len(set(snaps)) == ROWS
    logs = [p for k, p in entries if k == "log"]
    assert logs == [f"k{i % 7}={i}" for i in range(20)] and not [p for p, n in Counter(logs).items() if n > 1]
    assert final_state(entries) == source_state(source)
    assert full_sync.get_request(source.connect(), request.request_id).status == "applied"
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    left = sink_b.query("SELECT (SELECT count(*) FROM lr.spark_staging), (SELECT count(*) FROM lr.spark_staged_ranges)")
    assert left == [(0, 0)], "what the fenced job staged does not outlive it"
    app.close()


def test_a_planned_switchover_between_a_spark_transfers_tasks_gives_the_sink_a_full_sync_from_the_new_source(
    lr_sites, lr_connections
):
    """The transfer job of site-c's forced full sync has planned (SNAPSHOT_START at site-c) and staged
    its first range when site-b, up to date, is promoted (planned). site-c had not applied the sync:
    the failover requests a full sync from site-b for it and drops what was staged. The job's last
    task then stages nothing (the sink no longer transfers that sync: it is failed over), and its
    commit is refused. The promoted topology's cycles bring site-c site-b's full sync; nothing of
    site-a's sync is left at site-c, staged or in its queue."""
    source, _, sink_c = lr_sites
    topo, app, connect = full_sync_of_site_c_supplied(lr_sites, ROWS)
    ((request_id,),) = source.query("SELECT request_id FROM lr.full_sync_requests WHERE status = 'supplied'")
    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-c", "policy", owner="spark-driver")
    promoted: list = []
    try:
        plan = job.plan(str(request_id), partitions=2)
        snapshot_transfer.stage_range(plan, plan.ranges[0])
        promote_site_b_up_to_date(lr_sites, connect, promoted)
        assert snapshot_transfer.stage_range(plan, plan.ranges[1])["staged"] == 0  # the stalled driver's last task
        with pytest.raises(FencedError, match="failed over"):
            job.commit(plan)
    finally:
        job.close()
    result = promoted[0]
    assert result.full_syncs == ["site-b->site-c/policy"], result.outcome
    assert [k for k, _ in queue(sink_c, "site-a")].count("start") == 1, "site-a's sync never became visible"
    site_c_follows_site_b(lr_sites, result)
    app.close()


@pytest.mark.parametrize("event", ["topology", "sink_restart"])
def test_a_topology_change_or_a_sink_restart_between_a_spark_transfers_tasks_leaves_it_whole(
    lr_sites, lr_connections, site_manager, event
):
    """Between the transfer job's two tasks a new topology is applied to every site (the staged range
    stays, the commit moves and applies the whole sync), or the sink's server stops and starts
    again (staging is UNLOGGED: the crash empties it, the commit refuses, the job is rerun and
    applies it). Then the cycles negotiate and deliver every entry once."""
    source, sink_b = lr_sites[0], lr_sites[1]
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')  # a durable sink
    topo, app, request = supplied_for_spark(lr_sites)
    job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy")
    try:
        plan = job.plan(request.request_id, partitions=2)
        snapshot_transfer.stage_range(plan, plan.ranges[0])
        if event == "topology":
            topo = apply(lr_sites, ONE_SINK, settings={"max_payload_bytes": 4096})
        else:
            site_manager.down([sink_b.site_id], mode="immediate")
            site_manager.up(site_ids=[sink_b.site_id])
            job.sink.close()
            job.sink = job.runner.sink = sink_b.connect()  # the driver's own sink connection died with it
        snapshot_transfer.stage_range(plan, plan.ranges[1])
        if event == "sink_restart":
            with pytest.raises(StaleBatchError, match="not all staged"):
                job.commit(plan)
            job.close()
            job = snapshot_transfer.SnapshotTransfer(topo, "site-a", "site-b", "policy")  # the rerun
            plan = job.plan(request.request_id, partitions=2)
            for part in plan.ranges:
                snapshot_transfer.stage_range(plan, part)
        result = job.commit(plan)
    finally:
        job.close()
    assert result.applied and result.transferred == ROWS + 2
    for i in range(20):
        app.put(f"k{i % 7}", i, ["site-b"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    entries = queue(sink_b, "site-a")
    assert [k for k, _ in entries].count("start") == 1
    assert [p for k, p in entries if k == "log"] == [f"k{i % 7}={i}" for i in range(20)]
    assert final_state(entries) == source_state(source)
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    app.close()


def test_a_retention_trim_between_two_staged_chunks_stops_the_session_there_and_a_full_sync_follows(
    lr_sites, lr_connections
):
    """The staged fan-out (two tasks) stages and publishes its first chunk; then a retention trim
    removes the rest of the range. The next chunk's read finds the trim mark in its own snapshot
    and leaves the session out (TrimmedError): nothing of the trimmed range is taken as delivered,
    nothing stays staged, and the session's cycles bring the sink back with a full sync."""
    source, sink_b = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, ONE_SINK, providers=PROVIDERS)
    app = App(source)
    first = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=0)
    first.run(max_cycles=3, until_idle=True, interval=0.01)
    first.close()
    for i in range(400):
        app.put(f"k{i % 7}", i, ["site-b"])
    trimmed: list = []

    def trim_once() -> None:
        if not trimmed:
            conn = source.connect()
            trimmed.append(trim.retention_trim(conn, keep_seconds=0.0))
            conn.close()

    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        with on_fault("fanout_after_commit_p0_a0", trim_once):  # chunk 0 staged and published
            result = fanout.run_fanout(
                driver,
                lambda p: [staged_tee.stage_chunk(p, r, f"_p{r.index}_a0") for r in p.ranges],
                partitions=4,
                tasks=2,
            )
    finally:
        driver.close()
    session = "site-a->site-b/policy"
    assert trimmed and trimmed[0].trim_mark >= result.end
    assert "TrimmedError" in result.errors[session], result.errors
    assert result.positions[session] < result.end, "the chunks after the trim were not taken as delivered"
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=0)
    try:
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        repl.close()
    entries = queue(sink_b, "site-a")
    assert [k for k, _ in entries].count("start") == 2
    logs = [p for k, p in entries if k == "log"]
    assert not [p for p, n in Counter(logs).items() if n > 1]
    assert final_state(entries) == source_state(source)
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    left = sink_b.query("SELECT (SELECT count(*) FROM lr.spark_staging), (SELECT count(*) FROM lr.spark_staged_ranges)")
    assert left == [(0, 0)]
    app.close()


# --- the staged fan-out × a sink restart, a failover --------------------------------------------------
def staged_fanout(topo, event: str, action) -> fanout.FanoutResult:
    """The staged fan-out of site-a (two tasks, three chunks run in order), ``action`` run once at
    the first chunk's fault point ``event`` (``fanout_mid_write``, ``fanout_after_commit``)."""
    done: list = []

    def once() -> None:
        if not done:
            done.append(action())

    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        with on_fault(f"{event}_p0_a0", once):
            result = fanout.run_fanout(
                driver,
                lambda p: [staged_tee.stage_chunk(p, r, f"_p{r.index}_a0") for r in p.ranges],
                partitions=3,
                tasks=2,
            )
    finally:
        driver.close()
    assert done, f"{event} was reached"
    return result


def logs_of(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def nothing_staged(sink) -> bool:
    return sink.query(
        "SELECT (SELECT count(*) FROM lr.spark_staging), (SELECT count(*) FROM lr.spark_staged_ranges)"
    ) == [(0, 0)]


def test_a_sink_restarted_while_the_staged_fanout_stages_its_first_chunk_gets_every_entry_once(
    lr_sites, lr_connections, site_manager
):
    """site-b's server stops (immediate) and starts again while the first chunk is being read and
    staged into both sinks. site-b's stage dies with its connection (staging is UNLOGGED: nothing
    of it survives), so site-b's later chunks have a gap before them and are not published;
    site-c's chunks are staged and published. site-b's cycles then catch it up from its own
    position: both sinks hold every entry once, in order, nothing staged is left behind."""
    source, sink_b, sink_c = lr_sites
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')  # a durable sink
    topo, app = backlog_to_both_sinks(lr_sites)

    def restart() -> None:
        site_manager.down([sink_b.site_id], mode="immediate")
        site_manager.up(site_ids=[sink_b.site_id])

    result = staged_fanout(topo, "fanout_mid_write", restart)
    assert result.positions[C] == result.end and result.positions[B] < result.end, result.positions
    assert B in result.errors, result.errors
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, tee_min_backlog=0)
    try:
        reports = repl.run(max_cycles=10, until_idle=True, interval=0.05)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    for sink in (sink_b, sink_c):
        assert [k for k, _ in queue(sink, "site-a")].count("start") == 1
        assert logs_of(sink) == [f"k{i % 7}={i}" for i in range(300)], sink.site_id
        assert final_state(queue(sink, "site-a")) == source_state(source)
        assert nothing_staged(sink), f"{sink.site_id}: staged rows left behind"
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    app.close()


@pytest.mark.parametrize("event", ["fanout_after_stage", "fanout_after_commit"], ids=["staged", "published"])
def test_a_planned_switchover_between_two_staged_chunks_leaves_both_sinks_with_the_same_entries_once(
    lr_sites, lr_connections, event
):
    """site-b is promoted (a planned switchover: site-a drained into both sinks) right after the
    staged fan-out staged its first chunk at both sinks, or once it published it. What is staged
    then is never published (the sessions from site-a are failed over: the failover drops it), the
    later chunks are refused at both sinks, the fan-out takes nothing as delivered past the
    failover, and both sinks end with every entry of site-a once, nothing staged left behind."""
    source, sink_b, sink_c = lr_sites
    topo, app = backlog_to_both_sinks(lr_sites)
    App(sink_b).close()  # the new source's table, for its provider
    dsns = {s.site_id: s.dsn for s in lr_sites}
    promoted: list = []

    def promote() -> None:
        promoted.append(
            failover.promote(
                failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"),
                lambda site: psycopg2.connect(dsns[site]),
            )
        )

    result = staged_fanout(topo, event, promote)
    assert promoted[0].planned and promoted[0].full_syncs == [], promoted[0].outcome
    assert set(result.errors) == {B, C} and all("FencedError" in e for e in result.errors.values()), result.errors
    expected = [f"k{i % 7}={i}" for i in range(300)]
    for sink in (sink_b, sink_c):
        assert [k for k, _ in queue(sink, "site-a")].count("start") == 1
        assert logs_of(sink) == expected, sink.site_id
        assert final_state(queue(sink, "site-a")) == source_state(source)
        assert nothing_staged(sink), f"{sink.site_id}: staged rows left behind"
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    app.close()


# --- the table snapshot on Spark (tables/parallel + tables/snapshot range tasks) -------------------------
TABLE_ROWS = 2_000


def tables_lacking_at_both_sinks(lr_sites):
    """site-a -> site-b, site-c for policy past first contact (its queue: ``table_provider``), then
    public.accounts (TABLE_ROWS rows) federated at site-a: both sinks lack it, no cycle has run since."""
    topo = apply(lr_sites, TWO_SINKS, providers=PROVIDERS)
    app = App(lr_sites[0])
    first = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        first.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        first.close()
    create_accounts(lr_sites[0], rows=TABLE_ROWS)
    federate(lr_sites[0])
    return topo, app


def table_job(topo, between) -> tuple[parallel.ParallelResult | None, Exception | None]:
    """The table snapshot job of site-a's policy, four key ranges as four tasks run one after the
    other in this process; ``between`` runs once the first task committed its range at both sinks.
    Returns the job's result, or what it raised."""

    def map_ranges(task, ranges):
        written = []
        for r in ranges:
            written.append(copy_range(task, r, parallel.connect_by_task(task)))
            if r is ranges[0]:
                between()
        return written

    try:
        return parallel.run_table_snapshot(topo, "site-a", "policy", map_ranges, parts=4), None
    except Exception as exc:  # noqa: BLE001 (the scenario says which)
        return None, exc


def cycles_until_idle(topo, lr_sites, app, **settings) -> None:
    """Entries committed after the job, then cycles until idle: none fails."""
    for i in range(20):
        app.put(f"k{i % 7}", i, ["site-b", "site-c"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider}, **settings)
    try:
        reports = repl.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports


def starts_of(sink) -> int:
    return [k for k, _ in queue(sink, "site-a")].count("start")


@pytest.mark.parametrize("event", ["back_to_back", "trim", "topology"])
def test_a_request_a_trim_or_a_topology_change_between_a_spark_table_snapshots_tasks_lets_it_finish_then_the_cycles_follow(
    lr_sites, lr_connections, event
):
    """Between the table snapshot job's tasks: two forced full syncs of site-b are requested back to
    back and supplied, or entries commit and a retention trim removes them, or a new topology is
    applied to every site. The job holds the sessions' leases and the exported snapshot, so none of
    them moves it: its later tasks write, its finish records the table synced at both sinks. Then
    the cycles: site-b's newest request is applied (the older one cancelled) and the table taken
    again after it; the trim sends both sinks to a full sync with their tables; the new topology is
    negotiated without one. Tables row for row, every entry once, no request open."""
    source, sink_b, sink_c = lr_sites
    topo, app = tables_lacking_at_both_sinks(lr_sites)
    meanwhile = App(source)

    def commit_then_trim() -> None:
        for i in range(5):
            meanwhile.put(f"t{i}", i, ["site-b", "site-c"])
        assert trim_now(source, "retention").entries_removed >= 5

    between = {
        "back_to_back": lambda: request_full_syncs(source, ["site-b", "site-b"], supply=True),
        "trim": commit_then_trim,
        "topology": lambda: apply(lr_sites, TWO_SINKS, providers=PROVIDERS, settings={"max_payload_bytes": 4096}),
    }[event]
    result, raised = table_job(topo, between)
    assert raised is None and result.tables == {f"{k}:public.accounts": "synced" for k in (B, C)}, raised or result
    assert result.rows == 2 * TABLE_ROWS
    cycles_until_idle(topo, lr_sites, app)
    expected_starts = {"back_to_back": (2, 1), "trim": (2, 2), "topology": (1, 1)}[event]
    assert (starts_of(sink_b), starts_of(sink_c)) == expected_starts
    if event == "back_to_back":
        assert [
            r[0] for r in source.query("SELECT status FROM lr.full_sync_requests WHERE forced ORDER BY requested_at")
        ] == ["cancelled", "applied"]
    if event == "topology":
        assert sink_b.query("SELECT topology_config_id FROM lr.topology") == source.query(
            "SELECT topology_config_id FROM lr.topology"
        )
    assert_handed_off(source, [sink_b, sink_c], tables=True)
    app.close()
    meanwhile.close()


def test_a_lease_taken_over_between_a_spark_table_snapshots_tasks_fences_the_rest_and_the_cycles_write_the_table(
    lr_sites, lr_connections
):
    """Between the job's tasks its lease on site-b's session runs out and a successor takes the
    session over (one cycle: it snapshots site-b's table itself, in process). The job's next task
    is refused at site-b (the epoch, under a share lock) and commits at neither sink; the job
    fails, site-c's table stays syncing, and the cycles that follow snapshot it again from the
    start, dropping the failed run's range records. Tables row for row, every entry once."""
    source, sink_b, sink_c = lr_sites
    topo, app = tables_lacking_at_both_sinks(lr_sites)
    takeover = Takeover(topo, lr_sites)
    try:
        result, raised = table_job(topo, takeover.hook)
        assert isinstance(raised, FencedError), raised or result
        (took,) = takeover.reports
        assert not took.error and took.tables == [f"{B}:public.accounts: synced"], took
        assert sink_c.query("SELECT state FROM lr.sink_tables") == [("syncing",)]
    finally:
        takeover.successor.close()
    cycles_until_idle(topo, lr_sites, app)
    assert (
        sink_b.query("SELECT state FROM lr.sink_tables")
        == sink_c.query("SELECT state FROM lr.sink_tables")
        == [("synced",)]
    )
    assert sink_c.query("SELECT count(*) FROM lr.sink_table_ranges") == [(0,)], "the fenced run's ranges are gone"
    assert starts_of(sink_b) == starts_of(sink_c) == 1
    assert_handed_off(source, [sink_b, sink_c], tables=True)
    app.close()


def test_a_sink_restarted_between_a_spark_table_snapshots_tasks_leaves_its_table_to_be_taken_again(
    lr_sites, lr_connections, site_manager
):
    """site-b's server stops (immediate) and starts again between the job's tasks. The ranges already
    committed there survive; the later tasks write site-b again (each connects anew), but the
    driver's own connection to site-b died with it, so the finish fails there and site-b's table
    stays syncing (site-c's is recorded synced, or left syncing if the finish stops first). The
    cycles then snapshot what is not synced again. Tables row for row, every entry once."""
    source, sink_b, sink_c = lr_sites
    sink_b.query(f'ALTER DATABASE "{sink_b.dbname}" SET synchronous_commit = on')  # a durable sink
    topo, app = tables_lacking_at_both_sinks(lr_sites)

    def restart() -> None:
        site_manager.down([sink_b.site_id], mode="immediate")
        site_manager.up(site_ids=[sink_b.site_id])

    result, raised = table_job(topo, restart)
    assert isinstance(raised, psycopg2.Error), raised or result
    assert sink_b.query("SELECT state FROM lr.sink_tables") == [("syncing",)]
    cycles_until_idle(topo, lr_sites, app)
    assert starts_of(sink_b) == starts_of(sink_c) == 1
    assert sink_b.query("SELECT count(*) FROM lr.sink_table_ranges") == [(0,)], "the unfinished run's ranges are gone"
    assert_handed_off(source, [sink_b, sink_c], tables=True)
    app.close()


def test_a_failover_between_a_spark_table_snapshots_tasks_to_a_sink_it_writes_is_refused_then_done_after_it(
    lr_sites, lr_connections
):
    """Between the job's tasks site-b is to be promoted (planned). The job is writing site-b's copy of
    the federated table, so site-b holds no synced copy of a table site-c takes from site-a: the
    failover is refused with nothing done. The job finishes; the failover run again then promotes
    site-b, site-c follows it (site-a's entries cut once at site-b's position) and site-b's own
    entries reach site-c; the table row for row at every site."""
    source, sink_b, sink_c = lr_sites
    topo, app = tables_lacking_at_both_sinks(lr_sites)
    App(sink_b).close()  # the new source's table, for its provider
    dsns = {s.site_id: s.dsn for s in lr_sites}

    def connect(site):
        return psycopg2.connect(dsns[site])

    refused: list = []

    def promote_refused() -> None:
        with pytest.raises(ConfigurationError, match="holds no synced copy") as why:
            failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
        refused.append(why.value)

    result, raised = table_job(topo, promote_refused)
    assert raised is None and refused and result.rows == 2 * TABLE_ROWS, raised or result
    assert (
        source.query("SELECT count(*) FROM lr.failovers") == sink_b.query("SELECT count(*) FROM lr.failovers") == [(0,)]
    ), "nothing was done"
    cycles_until_idle(topo, lr_sites, app)
    assert_handed_off(source, [sink_b, sink_c], tables=True)
    promoted = failover.promote(failover.FailoverRequest("site-a", "site-b", reason="maintenance of site-a"), connect)
    assert promoted.planned and promoted.full_syncs == [], promoted.outcome
    assert logs_of(sink_b) == logs_of(sink_c) == [f"k{i % 7}={i}" for i in range(20)]
    App(sink_b).put("b0", 0, ["site-c", "site-a"])
    sink_b.query("UPDATE public.accounts SET owner = 'site-b' WHERE id <= 10")
    after = replicator(
        promoted.topology,
        lr_sites,
        providers={"policy": table_provider},
        sessions=[k for k in promoted.topology.sessions() if k.sink == "site-c"],
    )
    try:
        reports = after.run(max_cycles=5, until_idle=True, interval=0.01)
    finally:
        after.close()
    assert not any(r.error for r in reports), reports
    assert [p for k, p in queue(sink_c, "site-b") if k == "log"] == ["b0=0"]
    assert rows(sink_c) == rows(sink_b)
    app.close()


def test_a_source_restarted_between_a_spark_table_snapshots_tasks_leaves_its_leases_released(
    lr_sites, lr_connections, site_manager
):
    """The source's server stops (immediate) and starts again between the job's tasks: the exported
    snapshot died with it, the job fails, and its end releases the sessions' leases on a new
    connection, so the cycles take them at once and snapshot the table again. Before, the leases
    stayed held and kept every replicator off the sessions for ``lease_seconds``."""
    source = lr_sites[0]
    source.query(f'ALTER DATABASE "{source.dbname}" SET synchronous_commit = on')  # the table survives
    topo, app = tables_lacking_at_both_sinks(lr_sites)

    def restart() -> None:
        site_manager.down([source.site_id], mode="immediate")
        site_manager.up(site_ids=[source.site_id])

    result, raised = table_job(topo, restart)
    assert isinstance(raised, psycopg2.Error), raised or result
    assert source.query("SELECT DISTINCT lease_owner FROM lr.source_sessions") == [(None,)]
    app.close()
    app = App(source)  # its connection died with the server
    cycles_until_idle(topo, lr_sites, app)
    assert_handed_off(source, lr_sites[1:], tables=True)
    app.close()
