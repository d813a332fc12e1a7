"""Streaming: ``lr sync``'s default mode (sessions in log-entry sync woken by commits, milliseconds
from commit to the sinks), over a ``Replicator``'s cycles.

The ``Streamer`` runs cycles for the sessions that need them (negotiation, snapshot sync, catch-up,
errors) and hands each session a cycle left in log-entry sync to its source's ``SourceStream``
(``source_stream.py``: one reader per source, whatever the number of its sessions). A session the
stream hands back is cycled at once; cycles of the others run every ``interval``. The sessions it
works are the replicator's ``sessions``, read anew every turn: a session that leaves them (another
replicator works it now) leaves its stream and gives its lease up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.counters import DeliveryCounters, Pulse
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.runner import CycleReport
from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.session.source_stream import SourceStream
from airflow_provider_lr.engine.session.stream_member import REASSIGNED, STOPPED, StreamEnd
from airflow_provider_lr.engine.vocabulary import SessionKey, SessionState

log = logging.getLogger(__name__)
# a turn of cycles this short made nobody wait: its failures were refused at once (``_note``)
QUICK_FAILURE_S = 1.0
# a stream's error of these types lost a connection to a site (cut, closed, unreachable)
LINK_LOST = ("OperationalError", "InterfaceError", "SiteUnreachableError")

Connect = Callable[[str], psycopg2.extensions.connection]

__all__ = ["REASSIGNED", "STOPPED", "Cycles", "StreamEnd", "Streamer", "streamable"]


class Cycles(Protocol):
    """What the streaming mode needs of a ``Replicator``: its sessions, connections, settings, and
    cycles for the sessions that are not streaming (negotiation, snapshot sync, catch-up, errors)."""

    connect: Connect
    settings: SessionSettings

    @property
    def sessions(self) -> list[SessionKey]:
        """The sessions this replicator works now (its share, when it is a member: may change)."""

    def run_cycle(self, keys: list[SessionKey] | None = None) -> list[CycleReport]: ...

    def lease_of(self, key: SessionKey) -> leases.Lease | None: ...

    def rest(self) -> None:
        """Close the connections the cycles have not used for a while (the streams have their own)."""

    def forget(self, site: str) -> None:
        """Close the cycles' connection to ``site`` (a stream found it failing): the next cycle connects."""


def streamable(report: CycleReport) -> bool:
    """A cycle left the session in log-entry sync, under our lease, with nothing wrong."""
    return (
        report.state == SessionState.IN_LOG_ENTRY_SYNC
        and not report.error
        and not report.skipped
        and not report.waiting
    )


class Streamer:
    """``lr sync``'s streaming mode over a ``Replicator`` (see the module docstring): cycles for the
    sessions that need them, one ``SourceStream`` per source for the sessions in log-entry sync."""

    def __init__(
        self, cycles: Cycles, options: StreamSettings | None = None, counters: DeliveryCounters | None = None
    ) -> None:
        self.cycles, self.options = cycles, options or StreamSettings()
        # of cycles and streams: the replicator's process passes its own (``site/metrics``) to export them
        self.counters = counters if counters is not None else DeliveryCounters()
        self.ends: list[StreamEnd] = []  # every stream that ended (handed back, or STOPPED with the run)
        self.streaming: set[SessionKey] = set()  # the sessions streaming now
        self.backoff: dict[SessionKey, tuple[int, float]] = {}  # failing sessions: (failures in a row, retry at)
        # sessions whose stream failed before it delivered anything (it cannot start: a site's schema
        # too old, a login refused to the stream): streamed again only then, the cycles carry them
        self.stream_backoff: dict[SessionKey, tuple[int, float]] = {}
        self.sources: dict[str, SourceStream] = {}  # the stream of each source with sessions streaming

    def run(
        self,
        stop: threading.Event,
        interval: float = 1.0,
        on_cycle: Callable[[list[CycleReport]], None] | None = None,
        on_end: Callable[[StreamEnd], None] | None = None,
        on_pulse: Callable[[str], None] | None = None,
        pulse_every: float = 30.0,
    ) -> None:
        """Until ``stop`` is set. ``on_pulse`` gets a line every ``pulse_every`` seconds: entries
        per second since the last one and the lag of the session most behind (``counters.Pulse``)."""
        pulse = Pulse(self.counters, pulse_every if on_pulse else 0.0, on_pulse or (lambda line: None))
        halt = threading.Event()
        ended: queue.SimpleQueue[StreamEnd] = queue.SimpleQueue()
        streams: dict[SessionKey, SourceStream] = {}
        leaving: set[SessionKey] = set()
        due = 0.0  # when the next cycle of the sessions not streaming runs
        try:
            while not stop.is_set():
                while not ended.empty():
                    self._ended(ended.get(), streams, leaving, on_end)
                    due = 0.0  # negotiate it now
                sessions = list(self.cycles.sessions)  # this replicator's share, anew every turn
                wanted = set(sessions)
                for key in [k for k in streams if k not in wanted and k not in leaving]:
                    streams[key].leave(key)  # another replicator works it now
                    leaving.add(key)
                idle = [k for k in sessions if k not in streams]
                now = time.monotonic()
                ready = [k for k in idle if self.backoff.get(k, (0, 0.0))[1] <= now]
                # the sessions not failing first: one handed back healthy (a full sync asked) does not
                # wait behind the retries of those whose site stopped answering
                ready.sort(key=lambda k: k in self.backoff)
                if ready and now >= due:
                    reports = self.cycles.run_cycle(ready)
                    quick = time.monotonic() - now < QUICK_FAILURE_S  # no failure of it made it wait
                    self.counters.cycle(reports)
                    if on_cycle:
                        on_cycle(reports)
                    for key, report in zip(ready, reports):
                        self._note(key, report, quick)
                        if streamable(report) and self.stream_backoff.get(key, (0, 0.0))[1] <= time.monotonic():
                            self._start(key, streams, halt, ended)
                    busy = any(not r.idle for r in reports)
                    due = time.monotonic() + (0.0 if busy else interval)
                else:
                    self.cycles.rest()
                pulse.tick(len(streams), len(sessions))
                stop.wait(0.05 if streams or idle else interval)
        finally:
            halt.set()
            behind = self._join_streams()
            while not ended.empty():  # the streams stopped with the run (STOPPED)
                self._ended(ended.get(), streams, leaving, on_end)
            for key in [k for k in streams if k.source in behind]:  # their threads may never say it
                error = (
                    f"its source {key.source} did not answer within {self.options.stop_within:g} s of the stop: "
                    "left behind (nothing lost: the next replicator starts from the sink's position)"
                )
                self._ended(StreamEnd(str(key), STOPPED, error=error), streams, leaving, on_end)

    def _join_streams(self) -> set[str]:
        """Wait for the source streams to end, at most ``stop_within`` in all; the sources whose
        stream is still in a call to a server that stopped answering (a frozen server, whose calls
        only the call deadlines end) are returned and left behind: daemon threads, their calls
        bounded, gone with the process. Before, a stop waited for each of them unbounded."""
        until = time.monotonic() + self.options.stop_within
        behind: set[str] = set()
        for source, source_stream in self.sources.items():
            if source_stream.thread is not None:
                source_stream.thread.join(max(0.0, until - time.monotonic()))
                if source_stream.thread.is_alive():
                    behind.add(source)
                    log.warning(
                        "stream of %s: still in a call to it %g s after the stop: left behind",
                        source,
                        self.options.stop_within,
                    )
        self.sources.clear()
        return behind

    def _note(self, key: SessionKey, report: CycleReport, quick: bool = False) -> None:
        """Back a failing session off (``retry_min`` doubling to ``retry_max``): a site that is
        down or a lock held elsewhere is not hammered, the other sessions go on. A failure in a
        cycle that made nobody wait (``quick``: a server refusing connections while it restarts)
        backs off to ``retry_max_quick`` at most: the site is found back within it, where a session
        backed off to ``retry_max`` (30 s) through an outage waited that long after it."""
        if not report.error:
            self.backoff.pop(key, None)
            return
        pause = self._back_off(self.backoff, key, self.options.retry_max_quick if quick else None)
        log.info("session %s failed %d time(s) in a row; retried in %.1fs", key, self.backoff[key][0], pause)

    def _back_off(
        self, failing: dict[SessionKey, tuple[int, float]], key: SessionKey, most: float | None = None
    ) -> float:
        """One more failure in a row of ``key``: its retry ``retry_min`` doubling to ``retry_max``
        (or ``most``, when lower) from now."""
        failures = failing.get(key, (0, 0.0))[0] + 1
        most = self.options.retry_max if most is None else min(most, self.options.retry_max)
        pause = min(most, self.options.retry_min * 2 ** (failures - 1))
        failing[key] = (failures, time.monotonic() + pause)
        return pause

    def _ended(
        self,
        end: StreamEnd,
        streams: dict[SessionKey, SourceStream],
        leaving: set[SessionKey],
        on_end: Callable[[StreamEnd], None] | None,
    ) -> None:
        key = SessionKey.parse(end.session)
        if key in leaving and end.fenced:
            # asked to leave, it met the fence of the member it moved to first: the move, not a
            # hand-back (at a join of 200 sessions, ~half of the moved ones were said as failures)
            end = StreamEnd(end.session, REASSIGNED, end.delivered)
        streams.pop(key, None)
        leaving.discard(key)
        self.streaming.discard(key)
        self.counters.left(key)
        self.ends.append(end)
        if end.reason != STOPPED and any(f"{lost}:" in end.error for lost in LINK_LOST):
            # the cycles' own connections to its sites may be as dead as the stream's: a cycle on one
            # kept open waited its call deadline (145 s) on a frozen sink, every other session's
            # cycle and hand-back behind it; connected anew, it waits the connect timeout at most.
            # (Not for another error: a login refused to the stream leaves the cycles' working ones.)
            self.cycles.forget(key.sink)
            self.cycles.forget(key.source)
        if end.error and not end.delivered:  # it could not start: the cycles carry it meanwhile
            self._back_off(self.stream_backoff, key)
        elif end.delivered:
            self.stream_backoff.pop(key, None)
        if end.handed_back:
            self.counters.hand_back(key)
        if end.error:
            self.counters.error(key)
        if on_end:  # the listener reports it (``lr sync`` prints it): logged as well, it was said twice
            on_end(end)
        else:
            (log.warning if end.error else log.info)(
                "stream %s handed back after %d entries: %s%s",
                end.session,
                end.delivered,
                end.reason,
                f" ({end.error})" if end.error else "",
            )

    def _start(
        self,
        key: SessionKey,
        streams: dict[SessionKey, SourceStream],
        halt: threading.Event,
        ended: queue.SimpleQueue,
    ) -> None:
        """Hand ``key`` to its source's stream (started when the source has none, or its last one
        ended with a failure of the source)."""
        lease = self.cycles.lease_of(key)
        if lease is None:
            return
        source_stream = self.sources.get(key.source)
        if source_stream is None or source_stream.finished:
            try:
                source_stream = SourceStream(
                    key.source, self.cycles.connect, self.cycles.settings, self.options, ended.put, self.counters
                )
            except Exception as exc:  # the source is down: the cycles report it
                ended.put(StreamEnd(str(key), "failed", error=failure(exc)))
                return
            self.sources[key.source] = source_stream
            unreached = getattr(self.cycles, "unreached", None)  # a sink it finds silent is said as a member
            source_stream.sinks.on_silent = unreached.failed if unreached is not None else None
            source_stream.start(halt)
        streams[key] = source_stream
        self.streaming.add(key)
        source_stream.join(key, lease)
