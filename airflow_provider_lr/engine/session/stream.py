"""Streaming: sessions in log-entry sync stay in a loop woken by commits (issue 19).

A replication *cycle* (``runner``) pays for a lease, a fence, a negotiation and a commit barrier
before it reads anything, and ``lr sync`` sleeps between idle cycles: fine for a batch, tens of
milliseconds of lag per entry for a stream. Here a session that a cycle left in log-entry sync is
handed to a ``SessionStream``, which renews the cycle's lease with one handshake (``handshake.py``),
keeps the ``Position`` it returns in memory and only:

1. waits until the source's commit position moves past its sink (``SourceWatch``: one cheap probe
   of the commit-position sequence per source, polled only while a stream waits, faster while
   commits keep coming);
2. reads the *final prefix* after the sink (``LogReader.read_final_batch``, or
   ``read_stream(final=True)`` when it is large: the positions after it that are all committed,
   in one snapshot with the trim mark; no ``pg_locks`` barrier, which costs the writers' lock
   manager on every read) and writes it in ONE fenced sink transaction
   (``writes.apply_log_stream``, exactly as a cycle does: epoch checked, position advanced with
   the entries, subscribers woken);
3. acknowledges on the source lazily (every ``ack_interval``, asynchronously committed: the sink's
   own position is the truth, so a lost ack only delays trim);
4. under load, lingers before the next read so batches grow (``busy_rate``, ``linger``): the fixed
   cost of a read and a sink transaction would otherwise be CPU taken from the writers.

Negotiation runs again only when something changed: the lease was taken over or could not be
renewed, the topology changed, a full sync was requested, the log was trimmed past the sink, or a
site failed (a sink restart drops its connection). The stream then hands the session back to the
cycles (``Streamer``), which renegotiate and, once the session is in log-entry sync
again, stream it anew. A batch is whatever committed since the last read, up to
``max_entries``/``max_bytes``: one entry at a low rate, thousands under load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import psycopg2
import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine.counters import DeliveryCounters, Pulse
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.errors import FencedError, LRError, StaleBatchError, TrimmedError, error_line, one_line
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import Position, handshake
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.session.runner import CycleReport, record_error
from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.session.source_watch import SourceWatch
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.backlog import session_backlogs
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogReader, LogStream
from airflow_provider_lr.engine.store.topology import recorded_id
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, SessionKey, SessionState

log = logging.getLogger(__name__)

Connect = Callable[[str], psycopg2.extensions.connection]


STOPPED = "stopped"  # a StreamEnd's reason when its run stopped it (not a hand-back)


@dataclass
class StreamEnd:
    """Why a stream handed its session back to the cycles, and what it delivered."""

    session: str
    reason: str  # why it handed back, or STOPPED
    delivered: int = 0
    error: str = ""

    @property
    def handed_back(self) -> bool:
        """Ended by the session's state (a hand-back to the cycles), not by its run stopping."""
        return self.reason != STOPPED


class RateWindow:
    """Entries per second over the last whole window (``seconds``): a burst of commits inside a
    window does not make a stream at a modest rate linger, a sustained rate does."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds, self.rate = seconds, 0.0
        self._start, self._count = time.monotonic(), 0

    def add(self, entries: int) -> float:
        """Count ``entries`` read now; the rate of the last whole window."""
        self._count += entries
        now = time.monotonic()
        if now - self._start >= self.seconds:
            self.rate = self._count / (now - self._start)
            self._start, self._count = now, 0
        return self.rate


class _Handback(Exception):
    """Something changed that calls for negotiation: end the stream, keep the lease."""


class SessionStream:
    """One session in log-entry sync, streaming (see the module docstring). Own connections to its
    source and sink; holds the lease the cycle took (same owner and epoch) and renews it."""

    def __init__(
        self,
        key: SessionKey,
        lease: leases.Lease,
        connect: Connect,
        watch: SourceWatch,
        settings: SessionSettings,
        stream_settings: StreamSettings,
        counters: DeliveryCounters | None = None,
    ) -> None:
        self.key, self.lease, self.watch = key, lease, watch
        self.settings, self.opts = settings, stream_settings
        self.counters = counters if counters is not None else DeliveryCounters()
        self.delivered = 0
        self.src = connect(key.source)
        self.peek = self.sink = None
        try:
            self.peek = connect(key.source)  # autocommit: the one-statement reads of small batches
            self.peek.autocommit = True
            self.sink = connect(key.sink)
        except BaseException:
            self.close()
            raise
        # acks and renewals only: the sink's position is the truth, a lost ack delays trim only
        with self.src.cursor() as cur:
            cur.execute("SET synchronous_commit = off")
        self.src.commit()
        self.position: Position | None = None  # the handshake's, advanced by every write (``run``)
        self.acked = -1
        self.registered = False  # the receive queue, by this stream's first write of entries
        self.reader = LogReader(
            self.src, key.sink, STREAM_LOG_ENTRIES, settings.barrier_timeout, client_name=key.client
        )
        self.small = LogReader(self.peek, key.sink, STREAM_LOG_ENTRIES, client_name=key.client)
        self.tables = table_snapshot.splits(self.sink, key)  # the synced federated tables come along
        self.topology_id = recorded_id(self.src)

    @property
    def after(self) -> int:
        """The sink's position: where the next read starts."""
        return self.position.after if self.position is not None else -1

    def run(self, stop: threading.Event) -> StreamEnd:
        """Stream until ``stop`` or a hand-back; always leaves the connections closed."""
        end = StreamEnd(str(self.key), STOPPED)
        try:
            self._begin()
            self._loop(stop)
        except _Handback as exc:
            end.reason = one_line(exc)
        except (FencedError, StaleBatchError, TrimmedError) as exc:
            end.reason = error_line(exc)
        except (psycopg2.Error, LRError) as exc:  # a bound that fired, a lost site: retried by the cycles
            end.reason, end.error = "failed", failure(exc)
        finally:
            end.delivered = self.delivered
            self._ack_quietly()
            if end.error:
                self._record_quietly(end.error)
            self.close()
        return end

    def _begin(self) -> None:
        """The handshake, as the cycle's lease holder (the same owner: renewed, same epoch); the
        stream starts from its ``Position`` and hands back unless it is log-entry sync."""
        hs = handshake(self.src, self.sink, self.key, self.lease.owner, self.settings.lease_seconds)
        if hs.lease is not None:
            self.lease = hs.lease
        why = hs.left_out(Decision.LOG_ENTRY_SYNC, "left to the cycles")
        if why is not None:
            raise _Handback(why)
        self.position = hs.position
        log.info("session %s streams from position %d", self.key, self.after)

    def _record_quietly(self, error: str) -> None:
        """The failure in the session's ``last_error`` (``lr status``), when the source is reachable;
        the cycle that takes the session back records its own otherwise."""
        try:
            if not self.src.closed:
                self.src.rollback()
                record_error(self.src, self.key, f"stream: {error}")
        except (psycopg2.Error, LRError) as exc:
            log.info("stream %s: error not recorded: %s", self.key, one_line(exc))

    def _loop(self, stop: threading.Event) -> None:
        opts = self.opts
        next_check = time.monotonic() + opts.check_interval
        last_ack = 0.0
        stalled_since: float | None = None  # a drawn position has not shown up since then
        pause = opts.poll_min
        rate = RateWindow()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_check:
                self._check()
                next_check = now + opts.check_interval
            if self.acked < self.after and now - last_ack >= opts.ack_interval:
                self._ack()
                last_ack = now
            if stalled_since is None and self.watch.latest <= self.after:
                self.watch.wait_beyond(self.after, min(opts.check_interval, opts.ack_interval))
                continue
            barrier = stalled_since is not None and now - stalled_since >= opts.gap_timeout
            moved = self._step(barrier)
            if moved:
                stalled_since, pause = None, opts.poll_min
                if rate.add(moved) >= opts.busy_rate:
                    stop.wait(opts.linger)
                continue
            # drawn but not visible: a commit in flight (shows up in a moment), or one that rolled back
            # after drawing (never does): the barrier tells after ``gap_timeout``, and again after each
            stalled_since = now if stalled_since is None or barrier else stalled_since
            time.sleep(pause)
            pause = min(pause * 2, opts.poll_max)

    def _step(self, barrier: bool) -> int:
        """Read what is final after the sink and write it in one sink transaction; when the sink
        moved, the entries written (at least 1), else 0. ``barrier``: read behind the commit barrier
        instead (it waits for the commits in flight, so a position still missing after it was
        rolled back and is passed)."""
        settings, position = self.settings, self.position
        batch: LogBatch | LogStream | None = None
        assert position is not None, "run takes the handshake first"
        if not barrier:
            batch = self.small.read_final_batch(position.after, settings.max_bytes, position.split, self.tables)
        if batch is None:
            batch = self.reader.read_stream(
                position.after,
                settings.max_entries,
                settings.max_bytes,
                position.split,
                final=not barrier,
                tables=self.tables,
            )
        with batch:
            if batch.end <= position.after:
                return 0
            after = writes.apply_log_stream(
                self.sink,
                self.key.source,
                self.key.client,
                position.epoch,
                batch,
                position.base,
                register=not self.registered,
            )
        fault_point("stream_after_sink_apply")
        self.registered = self.registered or batch.entries > 0
        self.delivered += batch.entries
        self.counters.delivered(self.key, batch.entries, batch.bytes)
        moved, self.position = after > position.after, position.advanced(after)
        return max(batch.entries, 1) if moved else 0

    def _check(self) -> None:
        """Renew the lease (FencedError when taken over), note the success (a stream with nothing to
        do is healthy: ``lr status`` shows the age of the last success), and hand back when
        negotiation is due."""
        leases.renew(self.src, self.lease, self.settings.lease_seconds, last_success_at=AsIs("now()"))
        if recorded_id(self.src) != self.topology_id:
            raise _Handback("the topology changed")
        if full_sync.open_request(self.src, self.key.sink, self.key.client) is not None:
            raise _Handback("a full sync was requested")
        if table_snapshot.needed(self.src, self.sink, self.key, registry.federated_tables(self.src, self.key.client)):
            raise _Handback("a table was federated (its snapshot is taken by a cycle)")

    def _ack(self) -> None:
        """Record the sink's position on the source, then what is still to send behind it."""
        leases.update_session(
            self.src,
            self.lease,
            commit=False,
            acked_position=self.after,
            last_error=None,
            last_success_at=AsIs("now()"),
        )
        (backlog,) = session_backlogs(self.src, self.key.sink, self.key.client)  # commits both
        leases.update_session(self.src, self.lease, remaining_entries=backlog.entries)
        self.acked = self.after
        self.counters.lag(self.key, backlog.entries, backlog.lag_seconds)

    def _ack_quietly(self) -> None:
        if self.acked >= self.after or self.src.closed:
            return
        try:
            self.src.rollback()  # a statement that failed on the source left its transaction aborted
            self._ack()
        except (psycopg2.Error, LRError) as exc:  # the next holder records its own; trim waits meanwhile
            log.info("stream %s: last ack not recorded: %s", self.key, one_line(exc))

    def close(self) -> None:
        for conn in (self.src, self.peek, self.sink):
            if conn is not None and not conn.closed:
                conn.close()


WATCH_RETRY = 10.0  # seconds before a source whose commit watch failed gets a new one (and streams again)


class Cycles(Protocol):
    """What the streaming mode needs of a ``Replicator``: its sessions, connections, settings, and
    cycles for the sessions that are not streaming (negotiation, snapshot sync, catch-up, errors)."""

    sessions: list[SessionKey]
    connect: Connect
    settings: SessionSettings

    def run_cycle(self, keys: list[SessionKey] | None = None) -> list[CycleReport]: ...

    def lease_of(self, key: SessionKey) -> leases.Lease | None: ...


def streamable(report: CycleReport) -> bool:
    """A cycle left the session in log-entry sync, under our lease, with nothing wrong."""
    return (
        report.state == SessionState.IN_LOG_ENTRY_SYNC
        and not report.error
        and not report.skipped
        and not report.waiting
    )


class Streamer:
    """``lr sync``'s streaming mode over a ``Replicator``: cycles for the sessions that need them,
    a ``SessionStream`` thread for each session in log-entry sync (one ``SourceWatch`` per source).
    A stream that hands back is cycled at once; cycles of the others run every ``interval``."""

    def __init__(
        self, cycles: Cycles, options: StreamSettings | None = None, counters: DeliveryCounters | None = None
    ) -> None:
        self.cycles, self.options = cycles, options or StreamSettings()
        # of cycles and streams: the replicator's process passes its own (``site/metrics``) to export them
        self.counters = counters if counters is not None else DeliveryCounters()
        self.ends: list[StreamEnd] = []  # every stream that ended (handed back, or STOPPED with the run)
        self.streaming: set[SessionKey] = set()  # the sessions streaming now
        self.backoff: dict[SessionKey, tuple[int, float]] = {}  # failing sessions: (failures in a row, retry at)

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
        streams: dict[SessionKey, threading.Thread] = {}
        watches: dict[str, SourceWatch] = {}
        due = 0.0  # when the next cycle of the sessions not streaming runs
        try:
            while not stop.is_set():
                while not ended.empty():
                    self._ended(ended.get(), streams, on_end)
                    due = 0.0  # negotiate it now
                idle = [k for k in self.cycles.sessions if k not in streams]
                now = time.monotonic()
                ready = [k for k in idle if self.backoff.get(k, (0, 0.0))[1] <= now]
                if ready and now >= due:
                    reports = self.cycles.run_cycle(ready)
                    self.counters.cycle(reports)
                    if on_cycle:
                        on_cycle(reports)
                    for key, report in zip(ready, reports):
                        self._note(key, report)
                        if streamable(report):
                            self._start(key, streams, watches, halt, ended)
                    busy = any(not r.idle for r in reports)
                    due = time.monotonic() + (0.0 if busy else interval)
                pulse.tick(len(streams), len(self.cycles.sessions))
                stop.wait(0.05 if streams or idle else interval)
        finally:
            halt.set()
            for thread in list(streams.values()):
                thread.join()
            while not ended.empty():  # the streams stopped with the run (STOPPED)
                self._ended(ended.get(), streams, on_end)
            for watch in watches.values():
                watch.close()

    def _note(self, key: SessionKey, report: CycleReport) -> None:
        """Back a failing session off (``retry_min`` doubling to ``retry_max``): a site that is
        down or a lock held elsewhere is not hammered, the other sessions go on."""
        if not report.error:
            self.backoff.pop(key, None)
            return
        failures = self.backoff.get(key, (0, 0.0))[0] + 1
        pause = min(self.options.retry_max, self.options.retry_min * 2 ** (failures - 1))
        self.backoff[key] = (failures, time.monotonic() + pause)
        log.info("session %s failed %d time(s) in a row; retried in %.1fs", key, failures, pause)

    def _ended(
        self, end: StreamEnd, streams: dict[SessionKey, threading.Thread], on_end: Callable[[StreamEnd], None] | None
    ) -> None:
        key = SessionKey.parse(end.session)
        streams.pop(key).join()
        self.streaming.discard(key)
        self.ends.append(end)
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
        streams: dict[SessionKey, threading.Thread],
        watches: dict[str, SourceWatch],
        halt: threading.Event,
        ended: queue.SimpleQueue,
    ) -> None:
        lease = self.cycles.lease_of(key)
        if lease is None:
            return
        watch = watches.get(key.source)
        if watch is not None and watch.failed:  # replaced after a while; the cycles carry the session meanwhile
            if time.monotonic() - watch.failed_at < WATCH_RETRY:
                return
            watch.close()
            del watches[key.source]
        if key.source not in watches:
            watches[key.source] = SourceWatch(lambda: self.cycles.connect(key.source), self.options, key.source)

        def run() -> None:
            try:
                stream = SessionStream(
                    key,
                    lease,
                    self.cycles.connect,
                    watches[key.source],
                    self.cycles.settings,
                    self.options,
                    self.counters,
                )
            except Exception as exc:  # a site down: the cycles report it
                ended.put(StreamEnd(str(key), "failed", error=failure(exc)))
                return
            try:
                ended.put(stream.run(halt))
            except Exception as exc:  # pragma: no cover - a bug: hand the session back all the same
                log.exception("stream %s failed", key)
                ended.put(StreamEnd(str(key), "failed", stream.delivered, failure(exc)))

        thread = streams[key] = threading.Thread(target=run, daemon=True, name=f"lr-stream-{key}")
        self.streaming.add(key)
        thread.start()
