"""Operators for the steps of one replication session: discover, negotiate, snapshot sync,
log-entry sync (the snapshot sync step: ``operators/snapshot_sync.py``). Each is a thin shell: resolve the sites through ``LRSiteHook``, run one engine
step (``SessionRunner``), return a small report. The engine's lease and fencing make a task
retry, a crashed worker or a concurrent ``lr sync`` safe.

Inside a mapped task group, ``@task.branch`` runs both branches in Airflow 3.3.2 (apache/airflow
#67265), so the branch operators take the negotiation's output as ``decision`` and skip
themselves when it did not choose them, or when negotiation did not complete (a branch given
``trigger_rule="all_done"`` then runs, skips and is labelled by its session instead of ending
``upstream_failed`` with only a number in the grid). ``LRRunCheckOperator`` is the run's verdict:
the last task, failing the run when any session failed while the healthy ones still delivered.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg2
from airflow.sdk import BaseOperator, TriggerRule
from airflow.sdk.exceptions import AirflowSkipException

from airflow_provider_lr.engine.errors import ConfigurationError, error_line, one_line, require_counts
from airflow_provider_lr.engine.session import nearest_copy
from airflow_provider_lr.engine.session.lease import new_owner_id
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.session.runner import CycleReport, SessionRunner, record_error
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.site.failover_record import followed_outcome
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.full_sync import Outcome
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import (
    SNAPSHOT_TRANSFER_JOB,
    TABLE_SNAPSHOT_JOB,
    final_refusals,
    load_topology,
    refusals_said,
    refuse,
    session_dict,
    session_dicts,
    session_key,
    site_connection,
    site_connector,
    spark_unavailable,
)

# negotiation decision -> the branch task that carries it out
BRANCH_OF = {
    Decision.SNAPSHOT_SYNC.value: "snapshot_sync",
    Decision.WAIT_SNAPSHOT_APPLY.value: "snapshot_sync",
    Decision.LOG_ENTRY_SYNC.value: "log_entry_sync",
}
NO_BRANCH = "none"
# the map_index_template of a task mapped over sessions (its ``session`` argument): the grid lists
# each map index by the session's name, e.g. ``site-a->site-b/policy``
SESSION_LABEL = "{{ task.session['session'] }}"


def report_dict(report: CycleReport) -> dict[str, Any]:
    """The report as a small XCom: empty text, empty lists and false flags left out (counts stay),
    and an acknowledged position the step never learned (skipped before negotiating: another
    replicator holds the lease), which the task log showed as ``'acked_position': -1``."""
    return {
        k: v
        for k, v in dataclasses.asdict(report).items()
        if v != "" and v != [] and v is not False and not (k == "acked_position" and v < 0)
    }


class LRDiscoverSessionsOperator(BaseOperator):
    """The topology's sessions as a list of small dicts, to map one task group per session.

    :param source, sink, client: only the sessions matching these (all by default)
    :param topology_path: topology file (default: Variable ``lr_topology``, ``$LR_TOPOLOGY``, shipped)
    """

    template_fields: Sequence[str] = ("source", "sink", "client", "topology_path")
    ui_color = "#e8f4fd"

    def __init__(
        self,
        *,
        source: str | None = None,
        sink: str | None = None,
        client: str | None = None,
        topology_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.source, self.sink, self.client, self.topology_path = source, sink, client, topology_path

    def execute(self, context: Any) -> list[dict[str, str]]:
        topo = load_topology(self.topology_path)
        sessions = session_dicts(topo, self.source or None, self.sink or None, self.client or None)
        self.log.info(
            "topology %s: %d session(s): %s",
            topo.topology_config_id,
            len(sessions),
            ", ".join(s["session"] for s in sessions) or "none",
        )
        return sessions


class SessionStepOperator(BaseOperator):
    """One engine step of one session. ``decision`` (the negotiation task's output) makes the
    step skip itself unless negotiation chose ``branch``; without it the step always runs (the
    engine still negotiates first and does nothing the session is not ready for).

    ``spark_conn_id``: when given and this worker can run lr's Spark jobs through it, the engine
    leaves what it deems large to Spark: a snapshot of federated tables (``table_spark_min_rows``;
    the report's ``tables_for_spark``, for ``LRSparkTableSnapshotOperator``) and a full-sync
    transfer (``snapshot_spark_min_entries``; the report's ``transfer_for_spark``, for
    ``LRSparkSnapshotTransferOperator``). Otherwise everything is written in the step."""

    template_fields: Sequence[str] = ("session", "decision", "topology_path")
    branch = ""
    # the Spark jobs this step may leave work to: only those are checked (and said unavailable
    # when the step did such work itself: ``_say_spark_missing``)
    spark_jobs: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        session: dict[str, Any],
        decision: dict[str, Any] | None = None,
        topology_path: str | None = None,
        spark_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        final_refusals(kwargs)
        super().__init__(**kwargs)
        self.session, self.decision, self.topology_path = session, decision, topology_path
        self.spark_conn_id = spark_conn_id
        # given an upstream's output: it resolves to None when that upstream failed (all_done branch)
        self.decision_expected = decision is not None

    def _complete_session(self) -> None:
        """The session as a task may be handed it: a dict of ``LRDiscoverSessionsOperator`` (or of
        ``lr_full_sync``, with its ``request_id``), a dict naming only ``source``, ``sink`` and
        ``client``, or its name ``source->sink/client`` (as ``lr status`` shows it), completed from
        the topology with its sites' connection ids. Anything else, or a session the topology lacks,
        is refused for good, named. Before, a name failed the task on ``AttributeError: 'str' object
        has no attribute 'get'`` and a dict without connection ids on ``KeyError``, under tracebacks,
        retried. Called at every entry point (a deferred step resumes in ``*_complete``)."""
        given = self.session
        if isinstance(given, dict) and {"session", "source_conn_id", "sink_conn_id"} <= set(given):
            return
        topo = load_topology(self.topology_path)
        try:
            if isinstance(given, str):
                try:
                    key = SessionKey.parse(given)
                except ValueError as exc:
                    raise ConfigurationError(str(exc)) from None
                given = {"source": key.source, "sink": key.sink, "client": key.client}
            key = session_key(topo, given)
        except ConfigurationError as exc:
            raise refuse(self.log, f"session {self.session!r}", one_line(exc)) from None
        self.session = {**session_dict(topo, key), **given}

    def _skip_unless_chosen(self) -> None:
        if self.decision is None and self.decision_expected:
            raise AirflowSkipException("negotiation did not complete (see this session's decide task)")
        if self.decision is not None and self.decision.get("branch") != self.branch:
            why = self.decision.get("reason") or self.decision.get("skipped") or "nothing to do"
            raise AirflowSkipException(f"negotiation chose {self.decision.get('branch')!r} ({why})")

    def _settings(self, topo: Any) -> SessionSettings:
        return SessionSettings.from_topology(topo)

    @contextlib.contextmanager
    def runner(self) -> Iterator[SessionRunner]:
        """A SessionRunner on fresh connections to both sites; its lease is released afterwards.
        Meanwhile the engine's progress reports (long transfers, applies, catch-ups) go to the task
        log; a failed step counts in ``lr.session.errors``."""
        # lr's refusals (a site down, a provider's error) on one ERROR line, retried as retries say
        with refusals_said(self.log, f"session {self.session.get('session')}"):
            try:
                with telemetry.task_progress(self.log), self._runner() as runner:
                    yield runner
            except Exception:
                telemetry.session_error(self.session)
                raise

    @contextlib.contextmanager
    def _runner(self) -> Iterator[SessionRunner]:
        topo = load_topology(self.topology_path)
        key = session_key(topo, self.session)
        self._step_settings = self._settings(topo)
        self._spark_missing: dict[str, str] = {}  # a Spark job this step may not leave work to -> why
        target = topo.providers.get(key.client)
        provider = full_sync.load_provider(target) if target else None
        with site_connection(self.session["source_conn_id"], key.source, topo.timeouts) as source:
            try:
                with site_connection(self.session["sink_conn_id"], key.sink, topo.timeouts) as sink:
                    peers = nearest_copy.peers_in_region(
                        topo,
                        key,
                        lambda site: LRSiteHook(
                            lr_conn_id=topo.conn_id(site), timeouts=topo.timeouts
                        ).connect_replication(site),
                    )
                    runner = SessionRunner(
                        key,
                        source,
                        sink,
                        f"airflow:{new_owner_id()}",
                        self._step_settings,
                        provider,
                        spark_tables=self._spark_can_run(TABLE_SNAPSHOT_JOB),
                        spark_transfer=self._spark_can_run(SNAPSHOT_TRANSFER_JOB),
                        peers=peers,
                        topology=topo,
                    )
                    try:
                        yield runner
                    finally:
                        runner.release()
            except Exception as exc:  # a sink that is down, a provider error: `lr status` shows it
                self._record_error(source, key, error_line(exc), exc)
                raise

    def _spark_can_run(self, job: str) -> bool:
        """Whether large work of Spark job ``job`` may be left to the Spark task (see the class)."""
        if not self.spark_conn_id or job not in self.spark_jobs:
            return False
        why = spark_unavailable(self.spark_conn_id, job)
        if why:
            self._spark_missing[job] = why
        return why is None

    def _say_spark_missing(self, report: CycleReport) -> None:
        """Name the Spark job that was missing only when this step did, in-process, work of the size
        the job takes when it can: said in every log-entry step of every session ("what
        lr_table_snapshot.py would do is done in this step: no Spark connection 'spark_default'"),
        with no federated table at all, it was noise in every run of lr_replication and lr_full_sync."""
        missing: dict[str, str] = getattr(self, "_spark_missing", {})
        if not missing:
            return
        settings = self._step_settings
        done = {
            TABLE_SNAPSHOT_JOB: (report.table_rows, settings.table_spark_min_rows, "table rows"),
            SNAPSHOT_TRANSFER_JOB: (
                report.snapshot_messages,
                settings.snapshot_spark_min_entries,
                "full-sync messages",
            ),
        }
        for job, why in missing.items():
            count, threshold, what = done[job]
            if count and count >= threshold:
                self.log.info("%d %s written in this step, not by %s: %s", count, what, job, why)

    def _record_error(self, source: Any, key: Any, error: str, exc: BaseException) -> None:
        try:
            source.rollback()
            record_error(source, key, error, exc)
        except psycopg2.Error:
            self.log.warning("could not record the error of session %s on its source", key)

    def _result(self, report: CycleReport) -> dict[str, Any]:
        if report.error:
            telemetry.session_error(self.session)
            # a refused negotiation or a stale topology file needs a human: one ERROR line, no retry
            # (it was an AirflowFailException, logged under a traceback)
            raise refuse(self.log, f"session {report.session}", report.error)
        telemetry.session_step(
            self.session,
            delivered=report.delivered,
            snapshot_messages=report.snapshot_messages,
            lag_entries=None if report.skipped else report.remaining,
        )
        self._say_spark_missing(report)
        result = report_dict(report)
        self.log.info("session %s: %s", report.session, result)
        return result


class LRNegotiateOperator(SessionStepOperator):
    """Negotiation only: returns ``{"branch": "snapshot_sync" | "log_entry_sync" | "none", ...}``
    for the branch tasks (``none``: another replicator holds the session's lease right now)."""

    ui_color = "#fff4d6"

    def execute(self, context: Any) -> dict[str, Any]:
        self._complete_session()
        with self.runner() as runner:
            report = runner.negotiate_step()
        result = self._result(report)
        result["branch"] = BRANCH_OF.get(report.decision, NO_BRANCH)
        return result


class LRLogEntrySyncOperator(SessionStepOperator):
    """Log-entry sync of one session: up to ``max_batches`` batches of ``max_entries`` entries,
    read in commit order and applied idempotently at the sink."""

    branch = "log_entry_sync"
    spark_jobs = (TABLE_SNAPSHOT_JOB,)  # a large snapshot of federated tables
    ui_color = "#e3f6e3"

    def __init__(self, *, max_batches: int | None = None, max_entries: int | None = None, **kwargs: Any) -> None:
        require_counts(max_batches=max_batches, max_entries=max_entries)
        super().__init__(**kwargs)
        self.max_batches, self.max_entries = max_batches, max_entries

    def _settings(self, topo: Any) -> SessionSettings:
        return SessionSettings.from_topology(topo, max_batches=self.max_batches, max_entries=self.max_entries)

    def execute(self, context: Any) -> dict[str, Any]:
        self._complete_session()
        self._skip_unless_chosen()
        with self.runner() as runner:
            report = runner.log_entry_step()
        return self._result(report)


class LRRunCheckOperator(BaseOperator):
    """The run's verdict, as its last task: fails when any task of the run failed or ended
    ``upstream_failed``, naming the sessions concerned, so a run in which a session failed is
    red in the UI while the healthy sessions still delivered first (``trigger_rule="all_done"``).
    Reads the run's task states through the Task SDK (no database access from the task).

    :param sessions: the run's sessions in map-index order (``LRDiscoverSessionsOperator``'s
        output), to name failed session tasks by session instead of by number
    :param session_tasks: ids (or prefixes, e.g. a task group ``"session."``) of the tasks mapped
        one index per session
    :param report_task_id: a task returning ``{"last_error": ...}`` per session (shown in the message)
    :param full_sync_requests: the sessions carry the ``request_id`` of a full sync the run asked
        for (``lr_full_sync``): a session whose request was not applied at its sink (by whichever
        replicator: ``full_sync.outcome``) failed, with what became of the request
    Returns ``{"sessions": n, "failed_sessions": [...], "failed_tasks": [...]}`` when nothing failed.
    """

    template_fields: Sequence[str] = ("sessions",)
    ui_color = "#ececec"

    def __init__(
        self,
        *,
        sessions: list[dict[str, Any]] | None = None,
        session_tasks: Sequence[str] = ("session.",),
        report_task_id: str | None = None,
        full_sync_requests: bool = False,
        trigger_rule: str = TriggerRule.ALL_DONE,
        **kwargs: Any,
    ) -> None:
        final_refusals(kwargs)  # the verdict: a retry changes nothing
        super().__init__(trigger_rule=trigger_rule, **kwargs)
        self.sessions, self.session_tasks, self.report_task_id = sessions, tuple(session_tasks), report_task_id
        self.full_sync_requests = full_sync_requests

    def _is_session_task(self, task_id: str) -> bool:
        return any(task_id == t or (t.endswith(".") and task_id.startswith(t)) for t in self.session_tasks)

    def execute(self, context: Any) -> dict[str, Any]:
        ti = context["ti"]
        sessions = list(self.sessions or [])
        crumbs = [c for c in ti.get_task_breadcrumbs(ti.dag_id, ti.run_id) if c["task_id"] != self.task_id]
        bad = [c for c in crumbs if str(getattr(c["state"], "value", c["state"])) in ("failed", "upstream_failed")]
        per_session: dict[str, list[str]] = {}
        others: list[str] = []
        for c in sorted(bad, key=lambda c: (c["map_index"], c["task_id"])):
            state = str(getattr(c["state"], "value", c["state"]))
            index = c["map_index"]
            if self._is_session_task(c["task_id"]) and 0 <= index < len(sessions):
                per_session.setdefault(sessions[index]["session"], []).append(f"{c['task_id']} {state}")
            else:
                others.append(f"{c['task_id']}{f'[{index}]' if index >= 0 else ''} {state}")
        for session in sessions if self.full_sync_requests else []:
            outcome = self._request_outcome(session)
            if outcome is not None:
                per_session.setdefault(session["session"], []).append(outcome)
        telemetry.failed_sessions(ti.dag_id, len(per_session))
        for name, tasks in per_session.items():
            why = self._last_error(ti, sessions, name)
            self.log.error("session %s failed: %s%s", name, ", ".join(tasks), f" ({why})" if why else "")
        for task in others:
            self.log.error("task %s", task)
        if per_session or others:
            what = []
            if per_session:
                what.append(f"{len(per_session)} of {len(sessions)} session(s) failed: {', '.join(per_session)}")
            if others:
                what.append(f"failed task(s): {', '.join(others)}")
            # the run's verdict, said above task by task: one ERROR line more, not a traceback
            # no session to speak of (the task listing them failed): said so, not "the other sessions ran"
            after = (
                " (the other sessions ran to completion; `lr status` shows each session's last_error)"
                if sessions
                else " (no session was worked: see the failed task's log)"
            )
            raise refuse(self.log, "the run", "; ".join(what) + after)
        self.log.info("all %d session(s) ran without failure", len(sessions))
        return {"sessions": len(sessions), "failed_sessions": [], "failed_tasks": []}

    def _request_outcome(self, session: dict[str, Any]) -> str | None:
        """Why the session's full-sync request failed, or None when it was applied; a request a
        switchover asked of the new source instead is followed there (``followed_outcome``): before,
        the run failed on 'cancelled: failed over: asked of site-b as request ...'."""
        asked = session["request_id"]
        try:
            site, request_id, found = followed_outcome(
                site_connector(list(self.sessions or [])), session["source"], asked
            )
        except Exception as exc:  # the source is down: the request's fate is unknown, not a success
            return f"full sync {asked}: outcome unknown ({type(exc).__name__}: {exc})".strip()
        moved = f"failed over: asked of {site} as request {request_id}: " if request_id != asked else ""
        if found is None:
            return f"full sync {request_id}: no such request on {site}"
        if found.outcome is Outcome.APPLIED:
            self.log.info("session %s: %s%s", session["session"], moved, found.describe())
            return None
        return moved + found.describe()

    def _last_error(self, ti: Any, sessions: list[dict[str, Any]], name: str) -> str:
        if not self.report_task_id:
            return ""
        index = next(i for i, s in enumerate(sessions) if s["session"] == name)
        try:
            report = ti.xcom_pull(task_ids=self.report_task_id, map_indexes=index)
        except Exception:
            return ""
        return str((report or {}).get("last_error") or "")
