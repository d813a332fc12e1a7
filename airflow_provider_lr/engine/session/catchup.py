"""When work leaves the session cycles for the tee or Spark: the three "go to Spark" rules, side by
side, as pure functions over numbers and ``SessionSettings`` (no I/O; the callers measure).

* a source's log-entry backlog (catch-up): ``choose``, below;
* a full-sync transfer: ``transfer_to_spark`` (``snapshot_spark_min_entries``);
* a federated tables' snapshot: ``tables_to_spark`` (``table_spark_min_rows``).

The last two apply only where Spark can run (the DAGs): the caller says so (``spark``). Which path
catches a source's log-entry backlog up, and why:

* **session cycles** (``session/runner``): each session reads and writes its own batches; no plan,
  no start-up cost, ~55k deliveries/s. Always right for a small backlog.
* **the read-once tee** in this process (``bulk/fanout.run_fanout`` with ``local_map``): one source
  read for every sink, ~470k deliveries/s, after a plan of ~0.1-0.5 s.
* **Spark** (``spark_jobs/lr_fanout.py``): the same tee on Spark, after a spark-submit of 11-15 s;
  on a cluster of ``STAGED_MIN_TASKS`` cores or more, chunks teed at once (``fanout_tasks``).

The inputs: the backlog, counted as ``backlog.source_backlog`` counts it (entries still to deliver
summed over the source's sessions in log-entry sync); the two thresholds of ``SessionSettings``
(``spark_min_backlog``; ``tee_min_backlog``, 0 turning the tee off), whose measured defaults and
topology settings live in ``session/settings.py``; and whether Spark can run here, which only the
caller knows (``lr sync`` never; the DAG when the job is installed and its connection defined). That last is asked
only of a backlog large enough for Spark, so a small one costs no look-up.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from airflow_provider_lr.engine.session.settings import STAGED_MIN_TASKS, SessionSettings

# Why Spark cannot run here ("no Spark connection 'spark_default'"), or None when it can.
SparkCheck = Callable[[], "str | None"]


class CatchupPath(enum.Enum):
    """The three paths. The values are what the ``lr_replication`` DAG branches on (its plan
    task's XCom ``path``): session cycles are its ``in_process`` log-entry steps."""

    SPARK = "spark"
    TEE = "tee"
    SESSION_CYCLES = "in_process"


@dataclass(frozen=True)
class Catchup:
    """The path chosen for one backlog and, for a log or a task's XCom, why."""

    path: CatchupPath
    why: str


def backlog_matters(settings: SessionSettings, spark: SparkCheck | None = None) -> bool:
    """False when no backlog could leave the session cycles (no Spark here and the tee off): the
    caller need not measure it."""
    return spark is not None or settings.tee_min_backlog > 0


def backlog_cap(settings: SessionSettings, spark: SparkCheck | None = None) -> int:
    """How far a backlog must be counted for ``choose`` to decide: its highest threshold that can
    matter (a larger backlog takes the same path), so a caller counts at most that much."""
    return max(settings.tee_min_backlog, settings.spark_min_backlog if spark is not None else 0, 1)


def choose(
    backlog: int, settings: SessionSettings, spark: SparkCheck | None = None, counted_to: int | None = None
) -> Catchup:
    """Spark from ``spark_min_backlog`` when ``spark`` says it can run (``None``: this process runs
    no Spark); else the tee from ``tee_min_backlog`` (unless 0); else the session cycles.
    ``counted_to``: the backlog was counted only up to there (``backlog_cap``)."""
    spark_min, tee_min = settings.spark_min_backlog, settings.tee_min_backlog
    size = (
        f"backlog of at least {backlog}" if counted_to is not None and backlog >= counted_to else f"backlog {backlog}"
    )
    if spark is None:
        why = "this process runs no Spark"
    elif backlog < spark_min:
        why = f"{size} < spark_min_backlog {spark_min}"
    else:
        unusable = spark()
        if unusable is None:
            return Catchup(CatchupPath.SPARK, f"{size} >= spark_min_backlog {spark_min}")
        why = f"{size} but {unusable}"
    if tee_min <= 0:
        return Catchup(CatchupPath.SESSION_CYCLES, f"{why}; the tee is off (tee_min_backlog 0)")
    if backlog < tee_min:
        return Catchup(CatchupPath.SESSION_CYCLES, f"{why}; {size} < tee_min_backlog {tee_min}")
    return Catchup(CatchupPath.TEE, f"{why}; {size} >= tee_min_backlog {tee_min}")


def transfer_to_spark(entries: int | None, settings: SessionSettings, spark: bool) -> bool:
    """A supplied full sync of ``entries`` is transferred by the Spark job (``spark``: one runs
    here, the DAGs), from ``snapshot_spark_min_entries``; else by the session's own cycle."""
    return spark and (entries or 0) >= settings.snapshot_spark_min_entries


def tables_to_spark(estimated_rows: int, settings: SessionSettings, spark: bool) -> bool:
    """A federated tables' snapshot of ``estimated_rows`` (the planner's estimate) is written by the
    Spark job (``spark``: one runs here, the DAG), from ``table_spark_min_rows``; else in process."""
    return spark and estimated_rows >= settings.table_spark_min_rows


def fanout_tasks(settings: SessionSettings, cores: int) -> int:
    """How many chunks the Spark fan-out tees at once on a cluster of ``cores`` task slots: the
    ``fanout_tasks`` setting when given; else all the cores from ``STAGED_MIN_TASKS`` of them (the
    staged fan-out, ``bulk/staged_tee.py``), below that 1 (the ordered tee, ``bulk/tee.py``)."""
    if settings.fanout_tasks > 0:
        return settings.fanout_tasks
    return cores if cores >= STAGED_MIN_TASKS else 1
