"""The streaming replicator as a long-running, restartable Airflow task.

``LRStreamOperator`` runs ``lr sync``'s streaming mode (``engine/session/stream``: sessions in
log-entry sync woken by commits, milliseconds from commit to the sink) in the worker for
``run_for`` and then returns, so the ``lr_streaming`` DAG (``@continuous``, one run at a time)
starts the next run at once: a worker slot is held all along, and every ``run_for`` the task
ends, logs its summary and lets Airflow restart it fresh (new code, new connections, retries on
failure). Nothing is lost at the seams: the sinks hold their own positions, the next run's first
cycle negotiates from them, and a run killed outright leaves leases that expire
(``lease_seconds``) and sink writes fenced by epoch.

Sites are reached through ``LRSiteHook`` (whatever connection backend Airflow uses).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import load_topology

DEFAULT_REPORT_EVERY = 30.0


class LRStreamOperator(BaseOperator):
    """Stream every session of the topology (or of one ``source``) for ``run_for``, then return.

    :param run_for: how long this task streams before it ends and its DAG starts the next run
        (seconds or a timedelta; templated)
    :param source: only this source's sessions (default: all)
    :param interval: seconds between cycles of the sessions not streaming (snapshot syncs, errors)
    :param topology_path: the topology file (default: ``$LR_TOPOLOGY`` or the shipped one)
    :param report_every: seconds between the progress lines in the task log (entries/s, lag of the
        session most behind); 0 for none (templated)
    Returns a small summary: the seconds it really streamed (a kill ends it early), deliveries per
    session and the streams' hand-backs. Fails when every session ended the run in error (one bad
    session does not stop the others).
    """

    template_fields: Sequence[str] = ("run_for", "source", "topology_path", "report_every")
    ui_color = "#d9f2e6"

    def __init__(
        self,
        *,
        run_for: float | timedelta = timedelta(minutes=10),
        source: str | None = None,
        interval: float = 1.0,
        topology_path: str | None = None,
        report_every: float | str = DEFAULT_REPORT_EVERY,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.run_for, self.source, self.interval, self.topology_path = run_for, source, interval, topology_path
        self.report_every = report_every
        self._stop = threading.Event()  # a new one per run (an operator object may run again)
        self._stopped_by = ""  # what set it: "run_for" or "on_kill"

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow_provider_lr.engine.session.stream import Streamer
        from airflow_provider_lr.engine.site.replicator import Replicator

        self._stop, self._stopped_by = threading.Event(), ""
        topo = load_topology(self.topology_path)
        sessions = topo.sessions(source=self.source)
        seconds = self.run_for.total_seconds() if isinstance(self.run_for, timedelta) else float(self.run_for)
        repl = Replicator(
            topo,
            lambda site: LRSiteHook(lr_conn_id=topo.conn_id(site), timeouts=topo.timeouts).get_conninfo().connect(),
            sessions=sessions,
        )
        streamer = Streamer(repl)
        delivered: Counter[str] = Counter()
        last: dict[str, Any] = {}

        def on_cycle(reports: list) -> None:
            for r in reports:
                delivered[r.session] += r.delivered
                last[r.session] = r
                if r.error:
                    telemetry.session_error(r.session)

        timer = threading.Timer(seconds, self._halt, args=("run_for",))
        timer.start()
        self.log.info("streaming %d sessions for up to %.0f s", len(sessions), seconds)
        started = time.monotonic()
        try:
            with telemetry.task_progress(self.log):
                streamer.run(
                    self._stop,
                    interval=self.interval,
                    on_cycle=on_cycle,
                    on_pulse=self.log.info,
                    pulse_every=float(self.report_every),
                )
        finally:
            timer.cancel()
            repl.close()
        streamed = time.monotonic() - started  # measured: a kill or a failure ends it before ``run_for``
        for end in streamer.ends:
            delivered[end.session] += end.delivered
        for session, n in delivered.items():
            telemetry.session_step(session, delivered=n)
        failing = sorted(s for s, r in last.items() if r.error)
        summary = {
            "seconds": round(streamed, 1),
            "planned_seconds": seconds,
            "delivered": dict(delivered),
            "failing": failing,
            "hand_backs": [f"{e.session}: {e.reason}" for e in streamer.ends if e.handed_back],
        }
        self.log.info(
            "streamed for %.0f s%s: %s",
            streamed,
            "" if self._stopped_by == "run_for" else f" of {seconds:.0f} s planned (stopped by {self._stopped_by})",
            summary,
        )
        if sessions and len(failing) == len(sessions):
            raise AirflowException(f"every session failed: {', '.join(f'{s}: {last[s].error}' for s in failing)}")
        return summary

    def _halt(self, by: str) -> None:
        self._stopped_by = self._stopped_by or by
        self._stop.set()

    def on_kill(self) -> None:
        """Stop streaming (the sessions hand their leases back on the way out)."""
        self._halt("on_kill")
