"""The federated tables' snapshot job (spark_jobs/lr_table_snapshot.py) on a real local Spark with
task retries (``local[2,4]``): one exported snapshot read by parallel key-range tasks into two sinks
while writers change the table, then session cycles carry the changes from exactly that snapshot;
a task killed mid-range (and one killed after its range committed) is retried and nothing is
written twice. One Spark session for the module (a start costs seconds)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psycopg2
import pytest

from airflow_provider_lr.engine.faults import FAULT_ENV
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.tables.range_copy import copy_range
from tests.support.session import replicator
from tests.support.spark_env import (  # noqa: F401 (lr_connections is a fixture)
    in_log_entry_sync,
    local_spark_session,
    lr_connections,
)
from tests.support.tables import TableWriter, create_accounts, federate, rows

lr_table_snapshot = pytest.importorskip("spark_jobs.lr_table_snapshot")

ROWS = 3000
PARTS = 4
SESSIONS = ["site-a->site-b/policy", "site-a->site-c/policy"]


@pytest.fixture(scope="module")
def spark():
    """local[2,4]: two task slots, and a failed task tried up to four times (a killed Python worker
    fails its task; local mode's default of one try would fail the job)."""
    session = local_spark_session("lr-table-snapshot-tests", master="local[2,4]")
    yield session
    session.stop()


@pytest.fixture
def federated(lr_sites, lr_connections):
    """site-a -> site-b, site-c for client ``policy``, both sessions in log-entry sync (an empty
    full sync, the replicator closed: its leases are free for the job), then ``public.accounts``
    with ``ROWS`` rows federated at the source. Returns the topology."""
    topo = in_log_entry_sync(lr_sites)
    create_accounts(lr_sites[0], rows=ROWS)
    federate(lr_sites[0])
    return topo


def catch_up_and_compare(topo, lr_sites) -> None:
    """Session cycles from the snapshot's split: every sink equals the source row for row."""
    repl = replicator(topo, lr_sites)
    try:
        reports = run_until_idle(repl)
    finally:
        repl.close()
    assert not [r for r in reports if r.error], [r.error for r in reports if r.error]
    assert not any(r.tables for r in reports), "the job synced the tables: no cycle snapshots them again"
    expected = rows(lr_sites[0])
    for sink in lr_sites[1:]:
        assert rows(sink) == expected, sink.site_id


def synced_rows(sink) -> int:
    """The snapshot rows the job recorded for the table at ``sink`` (it is ``synced``, no range left)."""
    assert sink.query("SELECT count(*) FROM lr.sink_table_ranges") == [(0,)]
    ((state, copied),) = sink.query(
        "SELECT state, rows_copied FROM lr.sink_tables WHERE table_name = 'public.accounts'"
    )
    assert state == "synced"
    return copied


def tasks_with_faults(
    monkeypatch,
    attempts: Path,
    kill_mid_range: int | None = None,
    kill_after_commit: int | None = None,
    truncate_before: tuple[int, str] | None = None,
) -> None:
    """Make the job's Spark tasks (``spark_map`` calls ``copy_range``) misbehave on the FIRST attempt
    of one range each: ``kill_mid_range`` dies with its rows in the sinks' open transactions (fault
    point ``table_range_before_commit``), ``kill_after_commit`` dies right after the sinks committed
    it (before Spark hears of it), ``truncate_before`` = (range, source dsn) TRUNCATEs the source's
    table (and inserts 101 new rows) before reading. Each attempt appends
    ``<range> <attempt> start|wrote <rows>|truncated`` to ``attempts``."""

    def copy_range_with_faults(task, key_range, connect):  # runs in Spark's Python workers
        from pyspark import TaskContext

        attempt = TaskContext.get().attemptNumber()
        first = attempt == 0

        def note(what: str) -> None:
            with open(attempts, "a") as log:
                log.write(f"{key_range.range_no} {attempt} {what}\n")

        if first and key_range.range_no == kill_mid_range:
            os.environ[FAULT_ENV] = "table_range_before_commit"
        else:  # a reused worker must not keep an earlier task's fault
            os.environ.pop(FAULT_ENV, None)
        note("start")
        if first and truncate_before and key_range.range_no == truncate_before[0]:
            conn = psycopg2.connect(truncate_before[1])
            with conn.cursor() as cur:  # a lock the job held would time this out, not hang it
                cur.execute("SET lock_timeout = '20s'")
                cur.execute("TRUNCATE public.accounts")
                cur.execute(
                    "INSERT INTO public.accounts (id, owner) SELECT g, 'after' FROM generate_series(5000, 5100) g"
                )
            conn.commit()
            conn.close()
            note("truncated")
        written = copy_range(task, key_range, connect)
        note(f"wrote {written}")
        if first and key_range.range_no == kill_after_commit:
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    monkeypatch.setattr(lr_table_snapshot, "copy_range", copy_range_with_faults)


def attempt_log(attempts: Path) -> list[str]:
    return attempts.read_text().splitlines()


def wrote(log: list[str], range_no: int, attempt: int) -> list[int]:
    return [int(line.split()[-1]) for line in log if line.startswith(f"{range_no} {attempt} wrote ")]


def test_spark_snapshot_to_two_sinks_with_concurrent_writers_and_a_truncate_then_cycles_match_row_for_row(
    spark, federated, lr_sites, tmp_path, monkeypatch
):
    """Writers insert, update, change keys and delete while the job runs; the table is TRUNCATEd
    (and refilled) mid-job, after ranges 0 and 1 were read: the job neither hangs on the TRUNCATE's
    lock nor keeps the rows it cleared (the TRUNCATE comes after the split and is applied from the log)."""
    source = lr_sites[0]
    attempts = tmp_path / "attempts"
    tasks_with_faults(monkeypatch, attempts, truncate_before=(2, source.dsn))
    with TableWriter(source, truncate=False) as writer:
        before = writer.transactions
        result = lr_table_snapshot.snapshot_tables(spark, federated, "site-a", "policy", parts=PARTS)
        during = writer.transactions - before
    assert during > 0, "the writers changed the table while the job ran"
    assert result.sessions == SESSIONS and result.skipped == {}
    assert result.ranges == PARTS
    assert result.tables == {f"{s}:public.accounts": "synced" for s in SESSIONS}
    log = attempt_log(attempts)
    assert "2 0 truncated" in log and sum(wrote(log, 0, 0) + wrote(log, 1, 0)) > 0, log  # rows read before it
    copied = [synced_rows(sink) for sink in lr_sites[1:]]
    assert copied[0] == copied[1] > 0 and result.rows == sum(copied)  # the same snapshot at both sinks
    catch_up_and_compare(federated, lr_sites)
    assert len(rows(source)) > 101


def test_a_task_killed_mid_range_and_one_killed_after_its_commit_are_retried_without_duplicates(
    spark, federated, lr_sites, tmp_path, monkeypatch
):
    """Range 1's first attempt dies with its rows in both sinks' open transactions (fault point
    ``table_range_before_commit``): its retry writes the range. Range 2's first attempt dies right
    after both sinks committed it: its retry finds the range recorded and writes nothing. The
    tables end complete, each row once."""
    attempts = tmp_path / "attempts"
    tasks_with_faults(monkeypatch, attempts, kill_mid_range=1, kill_after_commit=2)
    with TableWriter(lr_sites[0], truncate=False) as writer:
        result = lr_table_snapshot.snapshot_tables(spark, federated, "site-a", "policy", parts=PARTS)
    assert writer.transactions > 0
    assert result.sessions == SESSIONS and result.ranges == PARTS
    assert result.tables == {f"{s}:public.accounts": "synced" for s in SESSIONS}

    log = attempt_log(attempts)
    assert "1 0 start" in log and not wrote(log, 1, 0), log  # killed mid-range
    assert wrote(log, 1, 1) and wrote(log, 1, 1)[0] > 0, log  # its retry wrote the range
    assert wrote(log, 2, 0) and wrote(log, 2, 0)[0] > 0 and wrote(log, 2, 1) == [0], log  # committed, then nothing
    for sink in lr_sites[1:]:
        assert sink.query("SELECT count(*) = count(DISTINCT id) FROM public.accounts") == [(True,)]
    copied = [synced_rows(sink) for sink in lr_sites[1:]]
    assert copied[0] == copied[1] > 0
    # the sinks recorded each range once; the driver's sum counts what the tasks returned, and range
    # 2's rows came back only from its killed attempt
    assert result.rows == sum(copied) - wrote(log, 2, 0)[0]
    catch_up_and_compare(federated, lr_sites)
