"""What lr tasks tell the people who watch Airflow: progress lines in the task log and metrics
through Airflow's own metrics facility (StatsD, Datadog or OpenTelemetry, as ``[metrics]`` says).

Progress: the engine reports long work (a full sync's supply, transfer and apply; a catch-up of
more than one batch; a read-once fan-out) through ``engine.progress``; while an lr task runs, those
reports go to the task's own log at most every ``LR_PROGRESS_EVERY_S`` seconds (default 5) per
piece of work, with rate and ETA, plus one line at the end of work that took a second or more.

Metrics (every name also carries the session as tags ``source``, ``sink``, ``client``; with
``[metrics] legacy_names_on`` (Airflow's default) each is sent a second time with the session in
the name, ``lr.session.<source>.<sink>.<client>.<metric>``, for plain StatsD, which drops tags):

==============================  =======  ==========================================================
``lr.session.delivered``        counter  log entries a task made visible at the sink
``lr.session.snapshot_messages`` counter full-sync messages a task transferred to the sink
``lr.session.lag_entries``      gauge    entries committed for the sink and not yet acknowledged
``lr.session.lag_seconds``      gauge    age of the oldest of them (``report`` task)
``lr.session.errors``           counter  failed session steps (a sink down, fenced, refused)
``lr.run.failed_sessions``      gauge    sessions the last ``lr_replication`` run failed (``check``)
==============================  =======  ==========================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.vocabulary import SessionKey

PROGRESS_EVERY_ENV = "LR_PROGRESS_EVERY_S"
DEFAULT_PROGRESS_EVERY = 5.0


def progress_every() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_EVERY_ENV, DEFAULT_PROGRESS_EVERY)))
    except ValueError:
        return DEFAULT_PROGRESS_EVERY


@contextlib.contextmanager
def task_progress(log: logging.Logger | Any) -> Iterator[None]:
    """While in this block, the engine's progress reports go to ``log`` (the task's log), every
    ``LR_PROGRESS_EVERY_S`` seconds per piece of work."""
    with progress.listen(progress.LogEvery(log, progress_every(), prefix="progress: ")):
        yield


# --- metrics --------------------------------------------------------------------------------------
def _stats() -> Any:
    from airflow.sdk.observability.stats import Stats

    return Stats


def _legacy_names() -> bool:
    try:
        from airflow.sdk.configuration import conf

        return conf.getboolean("metrics", "legacy_names_on", fallback=True)
    except Exception:
        return True


def _emit(kind: str, metric: str, value: float, source: str, sink: str, client: str) -> None:
    """One metric of one session; never fails the task (metrics are best effort)."""
    try:
        stats = _stats()
        tags = {"source": source, "sink": sink, "client": client}
        names = [f"lr.session.{metric}"]
        if _legacy_names():
            names.append(f"lr.session.{source}.{sink}.{client}.{metric}")
        for name in names:
            if kind == "incr":
                stats.incr(name, count=int(value), tags=tags)
            else:
                stats.gauge(name, float(value), tags=tags)
    except Exception:  # pragma: no cover - a metrics backend problem must not fail replication
        logging.getLogger(__name__).debug("metric %s not sent", metric, exc_info=True)


def _parts(session: dict[str, Any] | str) -> tuple[str, str, str]:
    """(source, sink, client) of a session dict or of its one spelling ``source->sink/client``."""
    if isinstance(session, dict):
        return session["source"], session["sink"], session["client"]
    key = SessionKey.parse(session)
    return key.source, key.sink, key.client


def session_step(
    session: dict[str, Any] | str,
    delivered: int = 0,
    snapshot_messages: int = 0,
    lag_entries: int | None = None,
    lag_seconds: float | None = None,
) -> None:
    """What one step (or report) of a session did and left."""
    try:
        parts = _parts(session)
    except (KeyError, ValueError):
        logging.getLogger(__name__).debug("no metrics for %r", session)
        return
    if delivered:
        _emit("incr", "delivered", delivered, *parts)
    if snapshot_messages:
        _emit("incr", "snapshot_messages", snapshot_messages, *parts)
    if lag_entries is not None and lag_entries >= 0:
        _emit("gauge", "lag_entries", lag_entries, *parts)
    if lag_seconds is not None:
        _emit("gauge", "lag_seconds", lag_seconds, *parts)


def session_error(session: dict[str, Any] | str) -> None:
    try:
        parts = _parts(session)
    except (KeyError, ValueError):
        logging.getLogger(__name__).debug("no metrics for %r", session)
        return
    _emit("incr", "errors", 1, *parts)


def failed_sessions(dag_id: str, count: int) -> None:
    try:
        stats = _stats()
        stats.gauge("lr.run.failed_sessions", float(count), tags={"dag_id": dag_id})
        if _legacy_names():
            stats.gauge(f"lr.run.{dag_id}.failed_sessions", float(count), tags={"dag_id": dag_id})
    except Exception:  # pragma: no cover
        logging.getLogger(__name__).debug("metric failed_sessions not sent", exc_info=True)
