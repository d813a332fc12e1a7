"""lr sync's catch-up: a large log-entry backlog moves by the read-once tee in the replicator's own
process (engine/bulk/fanout.py), then session cycles carry on; exactly once, in order, whichever did it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

import pytest

from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.timeouts import DEADLINES
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.site.replicator import Replicator
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


# A heartbeat's bounds kept short: a call is watched after 0.1 + 1 + 1 x 1 = 2.1 s, and its probe's
# connect gives up after 2 s; no TCP bound fires first (a stopped server's kernel takes every byte).
SHORT = {
    "statement_timeout_s": 0.1,
    "keepalives_idle_s": 1,
    "keepalives_interval_s": 1,
    "keepalives_count": 1,
    "connect_timeout_s": 2,
    "tcp_user_timeout_s": 120,
}
SLACK = 8.0  # a shared 2-core machine: scheduling, not the bound


@contextmanager
def frozen(site_manager, site) -> Iterator[None]:
    """``site``'s server stopped (SIGSTOP of its postmaster, then of every process it started), as
    a host that hangs looks: connections and bytes are taken by the kernel, nothing answers."""
    postmaster = site_manager.postmaster_pid(site.server)
    os.kill(postmaster, signal.SIGSTOP)
    children = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent(int(pid)) == postmaster]
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in [postmaster, *children]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.quiet_servers  # no database made in the background on the server frozen
@pytest.mark.timeout(90)
def test_a_sink_that_freezes_mid_tee_is_cut_by_its_heartbeat_and_gets_everything_once_it_continues(
    lr_sites, lr_connections, site_manager
):
    """site-c's server stops (SIGSTOP) halfway through a chunk of lr sync's tee, its rows in the sink's
    open transaction. The tee's connections have no call deadline (a COPY takes as long as its data),
    and no TCP bound applies to a stopped server (nor any on a Unix socket): before, the tee waited
    for good, and every session of lr sync behind it. Now the sink's call is cut by its heartbeat (a
    second connection cannot reach the server): site-c's session is refused with that reason in its
    ``last_error``, site-b's commits the chunk. Once site-c continues, the cycles bring it every entry
    once, in order."""
    topo = in_log_entry_sync(lr_sites, settings=SHORT)
    transmit_backlog(lr_sites[0], 3000, per_txn=250)
    driver = fanout.FanoutDriver(topo, "site-a")
    results: list = []
    with ExitStack() as freeze:
        with on_fault("fanout_mid_write_p0_a0", lambda: freeze.enter_context(frozen(site_manager, lr_sites[2]))):
            tee = threading.Thread(
                target=lambda: results.append(fanout.run_fanout(driver, fanout.local_map)), daemon=True
            )
            tee.start()
            tee.join(4 + 2.1 + 2 + SLACK)  # the plan and half a chunk, the heartbeat's deadline, its probe
        assert not tee.is_alive(), "the tee still waits on the frozen sink"  # (continued on the way out)
        driver.close()
        (result,) = results
        assert set(result.deliveries) == {"site-a->site-b/policy"}, result
        assert "connection to site 'site-c'" in result.errors["site-a->site-c/policy"], result.errors
        assert "call deadline of 2 s" in result.errors["site-a->site-c/policy"], result.errors
        (error,) = lr_sites[0].query("SELECT last_error FROM lr.source_sessions WHERE sink_site_id = 'site-c'")[0]
        assert error.startswith("fan-out: ") and "a stopped server or a stalled link, cut by lr" in error, error
    tee.join()
    assert sink_queue(lr_sites[1], "policy") == expected_queue(lr_sites[0], "site-b", "policy")
    repl = replicator(topo, lr_sites)
    try:
        repl.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        repl.close()
    delivered_exactly(lr_sites)


def test_lr_sync_stopped_during_a_long_tee_stops_after_its_chunk_and_the_next_run_resumes_once(
    lr_sites, lr_connections, monkeypatch
):
    """lr sync's tee catches up a backlog of several chunks. Its turn spent (``cycle_slice``), it
    pauses after a chunk so the sessions cycle, and tees on in the next cycle; stopped (SIGTERM sets
    the stop), it ends after the chunk in progress instead of the whole backlog. Before, the tee
    moved every chunk first, whatever the stop and the other sessions. The next run resumes from each
    sink's position: every entry arrives once, in order, and no session is left with an error."""
    monkeypatch.setattr(fanout, "PARTITION_ENTRIES", 500)  # chunks of ~500 entries: 6 in the backlog
    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(lr_sites[0], 3000, per_txn=250)
    first = replicator(topo, lr_sites, tee_min_backlog=1000)
    teed: list[int] = []  # the chunk (of its run's plan) each commit was
    with ExitStack() as hooks:
        for index in range(8):
            hooks.enter_context(on_fault(f"fanout_after_commit_p{index}_a0", lambda index=index: teed.append(index)))
        try:
            first.cycle_slice = 0.0  # the turn is spent after one chunk: the sessions' turns come next
            reports = first.run_cycle()
            assert teed == [0] and len(reports) == 2 and not any(r.error for r in reports), (teed, reports)
            assert sum(first.teed.values()) < sum(r.delivered for r in reports)  # the cycles moved the rest
            delivered_exactly(lr_sites)
            transmit_backlog(lr_sites[0], 3000, per_txn=250, seed=7)
            first.cycle_slice = 60.0
            hooks.enter_context(on_fault("fanout_after_commit_p1_a0", first.stop.set))  # a SIGTERM then
            assert first.run_cycle() == []  # stopped: no session cycled after the tee's chunk
            assert teed == [0, 0], teed  # chunk 1 of this run's plan committed, then the tee stopped
        finally:
            first.close()
    source = lr_sites[0]
    assert source.query("SELECT count(*) FROM lr.source_sessions WHERE last_error IS NOT NULL") == [(0,)]
    assert all(sink_queue(s, "policy") != expected_queue(source, s.site_id, "policy") for s in lr_sites[1:])
    second = replicator(topo, lr_sites, tee_min_backlog=1000)  # the next lr sync
    try:
        second.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        second.close()
    delivered_exactly(lr_sites)


@pytest.mark.quiet_servers  # no database made in the background on the server frozen
@pytest.mark.timeout(90)
def test_a_source_that_freezes_mid_tee_fails_the_catch_up_within_its_bounds_and_the_cycles_finish_it(
    lr_sites, lr_connections, site_manager
):
    """The source's server stops (SIGSTOP) halfway through a chunk of lr sync's tee. The read is cut
    by its heartbeat, and so is the run's last word there (the leases released on the replicator's
    connection, freed of its call deadline for the run: before, nothing bounded that call). Nothing
    of the chunk becomes visible; once the source continues, the cycles bring every entry once."""
    topo = in_log_entry_sync(lr_sites, settings=SHORT)
    transmit_backlog(lr_sites[0], 3000, per_txn=250)
    dsns = {s.site_id: s.dsn for s in lr_sites}
    repl = Replicator(
        topo,
        lambda site: conninfo.from_dsn(dsns[site]).with_timeouts(topo.timeouts).connect(),
        settings=SessionSettings(data_timeout=30.0, barrier_timeout=2.0, lease_seconds=60.0, tee_min_backlog=1000),
    )
    cut_before = DEADLINES.cut
    try:
        with ExitStack() as freeze:
            with on_fault("fanout_mid_write_p0_a0", lambda: freeze.enter_context(frozen(site_manager, lr_sites[0]))):
                cycle = threading.Thread(target=repl.run_cycle, daemon=True)
                cycle.start()
                until = time.monotonic() + 4 + 2 * (2.1 + 2) + SLACK  # the plan and half a chunk, two cut calls
                while DEADLINES.cut < cut_before + 2 and time.monotonic() < until:
                    time.sleep(0.1)
            assert DEADLINES.cut == cut_before + 2, "the tee still waits on the frozen source"  # (continued)
            assert all(sink_queue(sink, "policy") == [] for sink in lr_sites[1:])  # nothing of the chunk
        cycle.join(30)
        assert not cycle.is_alive()
        repl.run(max_cycles=10, until_idle=True, interval=0.01)
    finally:
        repl.close()
    delivered_exactly(lr_sites)
