"""The streaming replicator as long-running, restartable Airflow tasks, one per shard.

``LRStreamOperator`` runs ``lr sync``'s streaming mode (``engine/session/stream``: sessions in
log-entry sync woken by commits, milliseconds from commit to the sink) in the worker for
``run_for`` and then returns, so the ``lr_streaming`` DAG (``@continuous``, one run at a time)
starts the next run at once: a worker slot is held all along, and every ``run_for`` the task
ends, logs its summary and lets Airflow restart it fresh (new code, new connections, retries on
failure). Nothing is lost at the seams: the sinks hold their own positions, the next run's first
cycle negotiates from them, and a run killed outright leaves leases that expire
(``lease_seconds``) and sink writes fenced by epoch.

What one task streams is its **shard**: a source's sessions, or an explicit list of sessions.
``stream_shards`` cuts the topology into shards (one per source, a source with many sessions in
groups), so that ``lr_streaming`` maps one task per shard and an executor with several workers
spreads them; the leases keep any two tasks (or an ``lr sync``) off each other's sessions.

Sites are reached through ``LRSiteHook`` (whatever connection backend Airflow uses).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_lr.engine.db.explained import PRIVILEGE
from airflow_provider_lr.engine.errors import ConfigurationError, one_line, without_statement
from airflow_provider_lr.engine.store.topology import Topology
from airflow_provider_lr.engine.vocabulary import SessionKey
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import check_topology, final_refusals, load_topology, refuse

DEFAULT_REPORT_EVERY = 30.0
MAX_RUN_FOR = 7 * 86_400  # seconds; more is a typo (past ~292 years the end timer died and the task never ended)
SHARD_LABEL = "{{ task.shard_name }}"  # stream tasks mapped over shards: listed by the shard's name
_ALL_REFUSED = "every session refused for good"  # why a shard stopped before its run_for (``_halt``)


def stream_shards(topo: Topology, source: str | None = None, sessions_per_shard: int | None = None) -> list[dict]:
    """The shards of the topology's sessions (of ``source`` only, when given), as
    ``LRStreamOperator`` keyword arguments (``shard``, ``source``, ``sessions``): one per source,
    its sessions read when the task starts; a source with more than ``sessions_per_shard``
    sessions is split into as few shards as keep each at most that size, of consecutive sessions
    in the topology's order (a sink's clients side by side), sizes within one of each other.
    Each source read costs a read of its log per shard: split only a source too busy for one
    worker. An unknown source, a topology without sessions or a size below 1 is refused."""
    if sessions_per_shard is not None and sessions_per_shard < 1:
        raise ConfigurationError(f"sessions per shard must be at least 1, not {sessions_per_shard}")
    keys = topo.select(source=source or None)
    shards: list[dict] = []
    for site in sorted({k.source for k in keys}):
        mine = [k for k in keys if k.source == site]
        if not sessions_per_shard or len(mine) <= sessions_per_shard:
            shards.append({"shard": site, "source": site, "sessions": None})
            continue
        count = -(-len(mine) // sessions_per_shard)
        size, larger = divmod(len(mine), count)
        start = 0
        for index in range(count):
            end = start + size + (index < larger)
            part = [str(k) for k in mine[start:end]]
            shards.append({"shard": f"{site} {index + 1}/{count}", "source": site, "sessions": part})
            start = end
    return shards


def shard_sessions(
    topo: Topology, source: str | None = None, sessions: Sequence[str] | None = None
) -> list[SessionKey]:
    """The sessions a stream task streams: the listed ones (each a session of the topology, and of
    ``source`` when both are given), else ``source``'s, else every session. A shard that names no
    session, or names one the topology lacks, is refused naming the sessions there are."""
    if sessions is None:
        return topo.select(source=source or None)
    if isinstance(sessions, str) or not sessions:
        raise ConfigurationError(f"a shard is a non-empty list of sessions (source->sink/client), not {sessions!r}")
    known = set(topo.sessions(source=source or None))
    keys: set[SessionKey] = set()
    for name in sessions:
        try:
            key = SessionKey.parse(name)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if key not in known:
            raise ConfigurationError(
                f"session {key} is not a session {f'of source {source!r} ' if source else ''}in topology "
                f"{topo.path or topo.topology_config_id}; its sessions are {[str(k) for k in topo.sessions()]}"
            )
        keys.add(key)
    return sorted(keys)


class LRStreamOperator(BaseOperator):
    """Stream one shard's sessions (default: every session of the topology) for ``run_for``, then return.

    :param run_for: how long this task streams before it ends and its DAG starts the next run
        (seconds or a timedelta; templated). A retry streams only what is left of its DAG run's
        ``run_for`` (see ``seconds_to_stream``)
    :param source: only this source's sessions (default: all; templated)
    :param sessions: only these sessions, named ``source->sink/client`` (templated)
    :param shard: the shard's name in the task log and the UI's list of mapped instances
        (default: the source, or the sessions)
    :param interval: seconds between cycles of the sessions not streaming (snapshot syncs, errors)
    :param topology_path: the topology file (default: ``$LR_TOPOLOGY`` or the shipped one)
    :param report_every: seconds between the progress lines in the task log (entries/s, lag of the
        session most behind); 0 for none (templated)
    Returns a small summary: the shard and its sessions, the seconds it really streamed (a kill
    ends it early), deliveries per session and the streams' hand-backs. Fails when every session
    ended the run in error (one bad session does not stop the others), without a retry: the run's
    time is over, and the next run streams the shard again.
    """

    template_fields: Sequence[str] = ("run_for", "source", "sessions", "topology_path", "report_every")
    ui_color = "#d9f2e6"

    def __init__(
        self,
        *,
        run_for: float | timedelta = timedelta(minutes=10),
        source: str | None = None,
        sessions: Sequence[str] | None = None,
        shard: str | None = None,
        interval: float = 1.0,
        topology_path: str | None = None,
        report_every: float | str = DEFAULT_REPORT_EVERY,
        **kwargs: Any,
    ) -> None:
        final_refusals(kwargs)  # a stale file, a shard's settings: no retry
        super().__init__(**kwargs)
        self.run_for, self.source, self.sessions, self.shard = run_for, source, sessions, shard
        self.interval, self.topology_path = interval, topology_path
        self.report_every = report_every
        self._stop = threading.Event()  # a new one per run (an operator object may run again)
        self._stopped_by = ""  # what set it: "run_for" or "on_kill"

    @property
    def shard_name(self) -> str:
        """What the task streams, in a word: its log's lines and the UI's label of a mapped instance."""
        if self.shard:
            return str(self.shard)
        if self.sessions:
            return (
                ", ".join(self.sessions)
                if len(self.sessions) <= 2
                else f"{self.sessions[0]} and {len(self.sessions) - 1} more"
            )
        return self.source or "every session"

    def seconds_to_stream(self, context: Any) -> float:
        """``run_for`` for a first try. A retry (a crash, a lost worker) streams only what is left
        of its DAG run's ``run_for``, counted from the run's start: the shards of a run then end
        together and the next run starts for all, instead of the healthy shards' sessions waiting
        idle for a retry's full ``run_for``. Nothing left: fail (the next run streams the shard)."""
        planned = self.run_for.total_seconds() if isinstance(self.run_for, timedelta) else float(self.run_for)
        if not 0 < planned <= MAX_RUN_FOR:  # nan too
            raise refuse(
                self.log,
                f"shard {self.shard_name}",
                f"run_for must be between 1 and {MAX_RUN_FOR} seconds, not {self.run_for!r}",
            )
        ti, run = context.get("ti"), context.get("dag_run")
        if ti is None or run is None or run.start_date is None or (ti.try_number or 1) <= 1:
            return planned
        left = (run.start_date + timedelta(seconds=planned) - datetime.now(timezone.utc)).total_seconds()
        if left <= 0:
            raise refuse(
                self.log,
                f"shard {self.shard_name}",
                f"try {ti.try_number} started after its run's {planned:.0f} s (from the run's start); the next "
                "run streams it",
            )
        return left

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow_provider_lr.engine.session.stream import Streamer
        from airflow_provider_lr.engine.site.replicator import Replicator
        from airflow_provider_lr.engine.site.stale_topology import StaleWatch

        self._stop, self._stopped_by = threading.Event(), ""
        topo = load_topology(self.topology_path)
        try:
            sessions = shard_sessions(topo, self.source, self.sessions)
        except ConfigurationError as exc:
            raise refuse(self.log, f"shard {self.shard_name}", one_line(exc)) from None
        # a stale file (one that predates a failover) fails now, named, not after run_for of failing sessions
        check_topology(
            topo, self.log, f"shard {self.shard_name}", {site for k in sessions for site in (k.source, k.sink)}
        )
        seconds = self.seconds_to_stream(context)
        repl = Replicator(
            topo,
            _connector(topo),
            sessions=sessions,
            stop=self._stop,  # the run's end or a kill pauses a full sync's transfer at its chunk too
        )
        streamer = Streamer(repl)
        # a failover while it streams makes its file stale: every session refused until ``run_for``
        # ended (600 s by default, 5 s apart); now the shard stops, as ``lr sync`` does, and fails
        stale = StaleWatch(repl, self._stop, None, _connector, self.log.warning)
        delivered: Counter[str] = Counter()
        full_syncs: Counter[str] = Counter()  # applied at the sink by this shard (first contact, a forced one)
        last: dict[str, Any] = {}
        worked: set[str] = set()  # the sessions a cycle of this shard took up (not left to another replicator)

        def on_cycle(reports: list) -> None:
            stale.seen(reports)
            for r in reports:
                delivered[r.session] += r.delivered
                full_syncs[r.session] += r.full_syncs
                last[r.session] = r
                if not r.skipped:
                    worked.add(r.session)
                if r.error:
                    telemetry.session_error(r.session)
            # a login without lr's grants at every session's site: no retry mends it, so the shard
            # stops now, as the other operators do, not after ``run_for`` of failing cycles
            if len(last) == len(sessions) and all(r.refused == PRIVILEGE for r in last.values()):
                self._halt(_ALL_REFUSED)

        timer = threading.Timer(seconds, self._halt, args=("run_for",))
        timer.start()
        self.log.info(
            "shard %s: streaming %d sessions for up to %.0f s: %s",
            self.shard_name,
            len(sessions),
            seconds,
            ", ".join(map(str, sessions)),
        )
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
        if stale.error is not None:
            self._stopped_by = self._stopped_by or "its topology file going stale"
        for end in streamer.ends:
            delivered[end.session] += end.delivered
        for session, n in delivered.items():
            telemetry.session_step(session, delivered=n)
        failing = sorted(s for s, r in last.items() if r.error)
        # an ``lr sync`` (or another shard, an ``lr_replication`` run) beside it held these all along:
        # it delivered them, this shard did not (before, its summary listed them as streamed, 0 delivered)
        held = {s: r.skipped for s, r in sorted(last.items()) if r.skipped and s not in worked}
        summary = {
            "shard": self.shard_name,
            "sessions": [str(k) for k in sessions],
            "seconds": round(streamed, 1),
            "planned_seconds": round(seconds, 1),
            "delivered": dict(delivered),
            "full_syncs": {s: n for s, n in sorted(full_syncs.items()) if n},
            "failing": failing,
            "hand_backs": [f"{e.session}: {e.reason}" for e in streamer.ends if e.handed_back],
            "held_elsewhere": held,
        }
        if held:
            self.log.warning(
                "shard %s: %d of %d sessions were held by another replicator all along, not streamed by this "
                "shard: %s (one replicator per session is enough: stop `lr sync` or pause lr_streaming)",
                self.shard_name,
                len(held),
                len(sessions),
                "; ".join(f"{s}: {why}" for s, why in held.items()),
            )
        self.log.info(
            "streamed for %.0f s%s: %s",
            streamed,
            "" if self._stopped_by == "run_for" else f" of {seconds:.0f} s planned (stopped by {self._stopped_by})",
            summary,
        )
        if stale.error is not None:  # no retry mends it: the next run reads the file the sites run, or refuses
            raise refuse(self.log, f"shard {self.shard_name}", f"stopped: {one_line(stale.error)}")
        if self._stopped_by == _ALL_REFUSED:
            raise refuse(
                self.log,
                f"shard {self.shard_name}",
                "; ".join(f"session {s}: {without_statement(last[s].error)}" for s in failing),
            )
        if len(failing) == len(sessions):
            raise AirflowFailException(
                f"shard {self.shard_name}: every session failed: {', '.join(f'{s}: {last[s].error}' for s in failing)}"
            )
        return summary

    def _halt(self, by: str) -> None:
        self._stopped_by = self._stopped_by or by
        self._stop.set()

    def on_kill(self) -> None:
        """Stop streaming (the sessions hand their leases back on the way out)."""
        self._halt("on_kill")


def _connector(topo: Topology) -> Any:
    """Connects to a site of ``topo`` by id through its Airflow connection (what the engine's calls take)."""
    return lambda site: LRSiteHook(lr_conn_id=topo.conn_id(site), timeouts=topo.timeouts).get_conninfo().connect()
