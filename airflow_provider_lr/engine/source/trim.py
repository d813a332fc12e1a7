"""Trimming the shared log (guarantee 7 in docs/architecture.md).

* Safe trim removes entries every session that needs them has acknowledged: the mark is the lowest
  acknowledged position of the sessions that are replicating (a session still in its first full
  sync, with nothing acknowledged, needs nothing older than the base it will get), never above the
  commit barrier, and the data of full syncs still being transferred is kept.
* Retention trim removes entries older than a limit whatever the sessions say; a session left
  behind the trim mark is sent back to a full sync by negotiation (``trim_mark > last processed``).

On a caller's connection, each runs under ``on_callers_connection``'s rule: a schema of lookalike
operators before pg_catalog on its path (a ``<=`` of bigints that says true) decided what was removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.db.lifting import lifted
from airflow_provider_lr.engine.db.local_settings import on_callers_connection
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.source.commit_barrier import commit_barrier
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.vocabulary import RequestStatus

MAX_RETENTION = 100 * 365 * 86_400.0  # seconds; beyond this a retention trim is a typo


@dataclass(frozen=True)
class TrimResult:
    trim_mark: int
    entries_removed: int
    commits_removed: int


@on_callers_connection
def trim_mark(conn: psycopg2.extensions.connection) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT trim_mark FROM lr.log_trim")
        mark = cur.fetchone()[0]
    conn.commit()
    return mark


@on_callers_connection
def safe_trim_mark(conn: psycopg2.extensions.connection) -> int | None:
    """The highest position every session has acknowledged (None when the barrier is held)."""
    barrier, _ = commit_barrier(conn)
    if barrier is None:
        return None
    with conn.cursor() as cur:
        held = source_sessions.lowest_hold(cur)
    conn.commit()
    return barrier if held is None else min(held, barrier)


@on_callers_connection
def trim(conn: psycopg2.extensions.connection, upto: int) -> TrimResult:
    """Remove every entry with a commit position <= ``upto`` (except data of full syncs still
    being transferred) and raise the trim mark; never lowers it. Commits. Runs as long as it takes
    (millions of rows at once): no statement timeout for its duration."""
    try:
        with lifted(conn), conn.cursor() as cur:
            cur.execute("SELECT trim_mark FROM lr.log_trim FOR UPDATE")
            mark = max(cur.fetchone()[0], upto)
            cur.execute(
                f"""
                CREATE TEMP TABLE lr_trimmed ON COMMIT DROP AS
                SELECT c.tx FROM lr.log_commits c
                WHERE c.position <= %s
                  AND c.tx NOT IN (SELECT supplied_tx FROM lr.full_sync_requests
                                   WHERE status = '{RequestStatus.SUPPLIED}' AND supplied_tx IS NOT NULL)
                """,
                (mark,),
            )
            cur.execute("DELETE FROM lr.log_entries WHERE tx IN (SELECT tx FROM lr_trimmed)")
            entries = cur.rowcount
            cur.execute("DELETE FROM lr.log_commits WHERE tx IN (SELECT tx FROM lr_trimmed)")
            commits = cur.rowcount
            cur.execute("UPDATE lr.log_trim SET trim_mark = %s, trimmed_at = now()", (mark,))
        conn.commit()
        return TrimResult(mark, entries, commits)
    except BaseException:
        conn.rollback()
        raise


@on_callers_connection
def safe_trim(conn: psycopg2.extensions.connection) -> TrimResult | None:
    mark = safe_trim_mark(conn)
    return None if mark is None else trim(conn, mark)


def check_retention(keep_seconds: object) -> float:
    """A retention is a finite number of seconds between 0 and ``MAX_RETENTION`` (a negative one
    would trim what no sink has; nan, inf or 1e308 are typos); ConfigurationError otherwise."""
    if (
        not isinstance(keep_seconds, (int, float))
        or not math.isfinite(keep_seconds)
        or not 0 <= keep_seconds <= MAX_RETENTION
    ):
        raise ConfigurationError(
            f"retention must be a number of seconds between 0 and {MAX_RETENTION:.0f}, not {keep_seconds!r}"
        )
    return float(keep_seconds)


@on_callers_connection
def retention_trim(conn: psycopg2.extensions.connection, keep_seconds: float) -> TrimResult | None:
    """Trim everything committed more than ``keep_seconds`` ago, lagging sessions or not. None only
    when a commit in flight holds the barrier; nothing that old: the trim mark as it is, 0 removed."""
    check_retention(keep_seconds)
    barrier, _ = commit_barrier(conn)
    if barrier is None:
        return None
    with conn.cursor() as cur:
        cur.execute(
            "SELECT max(position) FROM lr.log_commits WHERE position <= %s "
            "AND committed_at < now() - make_interval(secs => %s)",
            (barrier, keep_seconds),
        )
        upto = cur.fetchone()[0]
    conn.commit()
    return TrimResult(trim_mark(conn), 0, 0) if upto is None else trim(conn, upto)
