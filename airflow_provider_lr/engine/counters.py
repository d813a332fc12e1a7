"""What a replicator process delivered, counted as it happens, and the periodic line that says so.

Core (no I/O, no Prometheus): the stream (``session/stream.py``) and the cycles count into a
``DeliveryCounters``; ``site/metrics.ReplicationCounters`` extends it with Prometheus counters for
``lr sync --metrics-listen``, and the replicator passes that one in. So the stream reports to
whoever passes the counters, without importing the layer above it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from airflow_provider_lr.engine.vocabulary import SessionKey


class Delivery(Protocol):
    """What a cycle reports that the counters count (``runner.CycleReport``)."""

    session: str
    delivered: int
    delivered_bytes: int
    full_syncs: int
    error: str
    skipped: str


class DeliveryCounters:
    """Totals the periodic progress line reads (``Pulse``): entries delivered by every session and
    each session's lag at its last acknowledgement. Thread-safe: the stream threads and the cycles
    count into one. The per-session events (full syncs, errors, hand-backs) are hooks a subclass
    exports (``site/metrics.ReplicationCounters``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries = 0  # every session's, for the progress line
        self.lags: dict[str, tuple[int, float]] = {}  # session → (entries, seconds) at its last acknowledgement
        self.waiting: dict[str, str] = {}  # session → why its last cycle did nothing (a lease held elsewhere)

    def delivered(self, session: str | SessionKey, entries: int, nbytes: int = 0) -> None:
        if entries <= 0:
            return
        with self._lock:
            self.entries += entries

    def lag(self, session: str | SessionKey, entries: int, seconds: float) -> None:
        with self._lock:
            self.lags[str(session)] = (entries, seconds)

    def left(self, session: str | SessionKey) -> None:
        """The session left this process's streams (handed back, or to another replicator): its
        last lag is no longer this process's to report (kept, the progress line named a session
        another member works, with the figure of its last check here, for as long as it ran)."""
        with self._lock:
            self.lags.pop(str(session), None)

    def full_sync(self, session: str | SessionKey) -> None:
        """A full sync applied (counted by subclasses)."""

    def error(self, session: str | SessionKey) -> None:
        """A failed step (counted by subclasses)."""

    def hand_back(self, session: str | SessionKey) -> None:
        """A stream handed back to the cycles (counted by subclasses)."""

    def cycle(self, reports: Iterable[Delivery]) -> None:
        """Count what cycles did (their delivered entries, full syncs applied, failures)."""
        for r in reports:
            with self._lock:
                if r.skipped:
                    self.waiting[str(r.session)] = r.skipped
                else:
                    self.waiting.pop(str(r.session), None)
            self.delivered(r.session, r.delivered, r.delivered_bytes)
            for _ in range(r.full_syncs):
                self.full_sync(r.session)
            if r.error:
                self.error(r.session)

    def most_behind(self) -> tuple[str, int, float] | None:
        """The session whose last acknowledgement left the oldest entry behind: (session, entries, s)."""
        with self._lock:
            if not self.lags:
                return None
            session, (entries, seconds) = max(self.lags.items(), key=lambda item: (item[1][1], item[1][0]))
        return session, entries, seconds

    def waiting_for(self) -> list[tuple[str, str]]:
        """The sessions whose last cycle here did nothing, and why: (session, reason), sorted."""
        with self._lock:
            return sorted(self.waiting.items())


IDLE_EVERY = 600.0  # seconds between the progress lines of a stream with nothing to do


class Pulse:
    """A periodic line from a running stream, every ``every`` seconds (0: never): entries per
    second since the last line, as counted, and the lag of the session most behind. An idle stream
    (nothing delivered, no lag, the same sessions streaming) says so once, then only every
    ``idle_every`` seconds: a line of zeros every 30 s filled the logs of a quiet replicator (an
    ``lr_streaming`` task wrote 20 of them per run) and buried the lines that mattered. Sessions it
    should stream but cannot (their lease held by a replicator that was killed, until it expires)
    are named with why, every period: they read "0 of 2 sessions ... lag 0; idle" while the
    backlog grew."""

    def __init__(
        self,
        counters: DeliveryCounters,
        every: float,
        emit: Callable[[str], None],
        idle_every: float = IDLE_EVERY,
    ) -> None:
        self.counters, self.every, self.emit = counters, every, emit
        self.idle_every = max(every, idle_every)
        self._since, self._entries = time.monotonic(), counters.entries
        self._quiet: tuple[int, int] | None = None  # the streaming/sessions of the last idle line

    def tick(self, streaming: int, sessions: int) -> None:
        """Emit the line when it is due (the caller's loop calls this often)."""
        now = time.monotonic()
        if self.every <= 0 or now - self._since < self.every:
            return
        total = self.counters.entries
        done, seconds = total - self._entries, now - self._since
        behind = self.counters.most_behind()
        lagging = bool(behind and (behind[1] or behind[2]))
        waiting = self.counters.waiting_for() if streaming < sessions else []
        idle = not done and not lagging and not waiting
        if idle and self._quiet == (streaming, sessions) and seconds < self.idle_every:
            return  # still idle, already said: the window runs on until something changes
        self._since, self._entries = now, total
        lag = f"lag {behind[1]} entries / {behind[2]:.1f}s ({behind[0]})" if behind and lagging else "lag 0"
        line = (
            f"streaming {streaming} of {sessions} sessions: {done} entries in {seconds:.0f}s "
            f"({done / seconds:.1f} entries/s, {total} in all), {lag}"
        )
        if waiting:
            first, why = waiting[0]
            more = f" (and {len(waiting) - 1} more)" if len(waiting) > 1 else ""
            line += f"; not streaming {first}{more}: {why}"
        if idle and self._quiet is None:
            line += f"; idle: the next line when entries flow, or in {self.idle_every:.0f}s"
        self._quiet = (streaming, sessions) if idle else None
        self.emit(line)
