"""One scenario per row of docs/crash-windows.md: a replicator (in its own process) is SIGKILLed
at the fault point between a commit on one site and the next commit on another, then a fresh
replicator runs. Every row must end with the sinks equal to the source, nothing delivered twice,
no full-sync request left open, each source's ack equal to its sink's position, and safe trim
able to reach it. Rows add what is particular to their window (no re-transfer, one request...)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from airflow_provider_lr.engine.faults import FAULT_POINTS
from airflow_provider_lr.engine.source import trim
from tests.support.session import (
    App,
    apply,
    final_state,
    queue,
    replicator,
    run_crashing_replicator,
    source_state,
    table_provider,
)
from tests.support.spark_env import lr_connections  # noqa: F401 (fixture: the tee resolves the sites by id)

TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
PROVIDERS = {"policy": "tests.support.session:table_provider"}
KILLED = -9


@dataclass
class Window:
    fault: str
    phase: str  # where the fault is reached: first_contact | log_entries | fanout | timeout | stream
    rows: int = 20  # application rows before the crash
    settings: dict = field(default_factory=dict)  # of the crashing replicator
    check: Callable[[list, list], None] | None = None  # (sites, recovery reports) -> assertions


def _requests(source) -> list[str]:
    return [r[0] for r in source.query("SELECT status FROM lr.full_sync_requests ORDER BY requested_at")]


def _one_applied_request(sites, reports) -> None:
    assert _requests(sites[0]) == ["applied", "applied"]  # one per sink, none made twice


def _nothing_retransferred(sites, reports) -> None:
    """The crash hit site-b's session (the first); site-c's had not started."""
    resent = sum(r.snapshot_messages for r in reports if r.session.endswith("site-b/policy"))
    assert resent == 0, "the sink had the whole transfer: apply it, do not resend"
    _one_applied_request(sites, reports)


def _resumed_transfer(sites, reports) -> None:
    _one_applied_request(sites, reports)
    for sink in sites[1:]:
        snap = [p for k, p in queue(sink, "site-a") if k == "snap"]
        assert len(snap) == len(set(snap)) > 5000, "resumed after what the sink had, nothing twice"


def _timed_out_then_applied(sites, reports) -> None:
    statuses = _requests(sites[0])
    assert statuses.count("applied") == 2 and set(statuses) <= {"applied", "timed_out"}, statuses
    assert "timed_out" in statuses


WINDOWS = [
    Window("after_lease", "first_contact"),
    Window("after_fence", "first_contact"),
    Window("after_request", "first_contact", check=_one_applied_request),
    Window("during_supply", "first_contact", check=_one_applied_request),
    Window("after_snapshot_start", "first_contact", check=_one_applied_request),
    Window("after_snapshot_chunk", "first_contact", rows=6000, check=_resumed_transfer),
    Window("before_snapshot_apply", "first_contact", check=_nothing_retransferred),
    Window("after_snapshot_apply", "first_contact", check=_one_applied_request),
    Window("after_sink_apply", "log_entries"),
    Window("stream_after_sink_apply", "stream"),
    Window("after_timeout", "timeout", settings={"data_timeout": 0.2}, check=_timed_out_then_applied),
    Window("fanout_mid_write_p0_a0", "fanout", settings={"tee_min_backlog": 100}),
    Window("fanout_after_commit_p0_a0", "fanout", settings={"tee_min_backlog": 100}),
]


# the federated tables' windows, with their own scenarios (rows 14 and 15 of docs/crash-windows.md)
TABLE_WINDOWS = {
    "table_snapshot_before_commit": "tests/engine/tables/test_tables.py::test_a_replicator_killed_while_writing_a_table_snapshot_leaves_nothing_half_done",
    "table_range_before_commit": "tests/spark/test_table_snapshot.py",
}


# a failover's windows (rows 16-18), killed and re-run in their own scenario
FAILOVER_WINDOWS = {
    name: "tests/engine/site/test_failover.py::test_a_failover_killed_after_promoting_finishes_when_run_again"
    for name in ("failover_after_fence", "failover_after_promote", "failover_after_reconcile")
}


# a seed from a peer sink's copy (rows 19 and 20)
NEAREST_COPY_WINDOWS = {
    name: "tests/engine/session/test_nearest_copy.py::test_a_replicator_killed_while_seeding_from_a_peer_leaves_the_sink_whole"
    for name in ("peer_seed_before_commit", "after_peer_seed")
}


# the staged fan-out's window (row 21): its tasks killed under Spark, retried
STAGED_FANOUT_WINDOWS = {
    "fanout_after_stage": "tests/spark/test_spark_parallel_fanout.py::test_tasks_killed_and_retried_deliver_once_in_source_order"
}


def test_every_fault_point_has_a_crash_window_scenario():
    covered = (
        {w.fault.split("_p0")[0] for w in WINDOWS}
        | set(TABLE_WINDOWS)
        | set(FAILOVER_WINDOWS)
        | set(NEAREST_COPY_WINDOWS)
        | set(STAGED_FANOUT_WINDOWS)
    )
    assert covered == set(FAULT_POINTS), set(FAULT_POINTS) ^ covered


def _seed_rows(app: App, n: int) -> None:
    """n application rows that only a full sync carries (no transmit)."""
    with app.conn.cursor() as cur:
        cur.execute("INSERT INTO app_state SELECT 'row' || i, i FROM generate_series(1, %s) i", (n,))
    app.conn.commit()


def _assert_repaired(sites, reports) -> None:
    source = sites[0]
    assert not any(r.error for r in reports), [r for r in reports if r.error]
    for sink in sites[1:]:
        entries = queue(sink, "site-a")
        assert final_state(entries) == source_state(source), f"{sink.site_id} differs from the source"
        kinds = [k for k, _ in entries]
        after_last_start = entries[len(kinds) - 1 - kinds[::-1].index("start") :]
        logs = [p for k, p in after_last_start if k == "log"]
        assert not [p for p, n in Counter(logs).items() if n > 1], f"{sink.site_id}: delivered twice"
    assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')") == [(0,)]
    acked = dict(source.query("SELECT sink_site_id, acked_position FROM lr.source_sessions"))
    for sink in sites[1:]:
        assert acked[sink.site_id] == sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions")[0][0]
    safe = trim.safe_trim(source.connect())
    assert safe is not None and safe.trim_mark == min(acked.values())


@pytest.mark.parametrize("window", WINDOWS, ids=[w.fault for w in WINDOWS])
def test_crash_in_window_is_repaired_by_the_next_cycle(lr_sites, lr_connections, window: Window):
    source = lr_sites[0]
    providers = None if window.phase == "timeout" else PROVIDERS
    topo = apply(lr_sites, TWO_SINKS, providers=providers)
    app = App(source)
    _seed_rows(app, window.rows)
    app.put("k0", 0, ["site-b", "site-c"])
    if window.phase in ("log_entries", "fanout", "stream"):  # first contact done cleanly, the fault comes later
        first = replicator(topo, lr_sites)
        first.run(max_cycles=3, until_idle=True, interval=0.01)
        first.close()
        for i in range(1, 300 if window.phase == "fanout" else 50 if window.phase == "log_entries" else 1):
            app.put(f"k{i % 7}", i, ["site-b", "site-c"] if i % 3 else ["site-b"])
    cycles = 400 if window.phase == "timeout" else 5

    def stream_entries(running: Callable[[], bool]) -> None:
        """Written while the sessions stream (the fault is in the stream's write): one every 0.1 s
        until the replicator is killed, however long its first cycles take on a loaded machine."""
        for i in range(1, 200):
            if not running():
                break
            app.put(f"k{i % 7}", i, ["site-b", "site-c"] if i % 3 else ["site-b"])
            time.sleep(0.1)

    crashed = run_crashing_replicator(
        topo,
        lr_sites,
        window.fault,
        providers=None,
        cycles=cycles,
        settings=window.settings,
        stream=30.0 if window.phase == "stream" else None,
        during=stream_entries if window.phase == "stream" else None,
    )
    assert crashed.returncode == KILLED, f"fault point {window.fault} not reached: {crashed.stdout[-2000:]}"
    for i in range(300, 310):  # the application goes on while nobody replicates
        app.put(f"k{i % 7}", i, ["site-b", "site-c"])
    source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")
    recovery = replicator(topo, lr_sites, providers={"policy": table_provider})
    reports = []
    for _ in range(8):
        cycle = recovery.run_cycle()
        reports.extend(cycle)
        if all(r.state == "IN_LOG_ENTRY_SYNC" and r.remaining == 0 and r.idle and not r.error for r in cycle):
            break
    recovery.close()
    _assert_repaired(lr_sites, reports)
    if window.check:
        window.check(lr_sites, reports)
    app.close()
