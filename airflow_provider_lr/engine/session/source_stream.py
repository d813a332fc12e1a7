"""One reader per source: the streaming sessions of a source share one read of its log.

A session a cycle (``runner``) left in log-entry sync joins its source's ``SourceStream``: one
handshake (``handshake.py``) renews the cycle's lease and gives the ``Position`` kept in memory;
then, for all the source's sessions at once, the stream probes the last drawn commit position,
reads the *final prefix* after the lowest session ONCE (``source/routed_read``: the source's server
says which sessions want each entry), writes each session's share in ONE fenced sink transaction
(``writes.apply_log_stream``), committed asynchronously, the sinks in parallel, a slow one left in
flight (``sink_writers``), acknowledges lazily what each sink's WAL flush has passed
(``durable_acks``: the sink's position is the truth), and under load waits a while after each round
(``StreamSettings``). Per source: two source connections, one per sink site, a thread, a writer
thread per sink site: O(sites), whatever the number of sessions.

A session leaves when something calls for negotiation (lease taken over, topology changed, full sync
requested, table federated, log trimmed past it, its sink failed): handed back (``StreamEnd``) to
the cycles (``Streamer``). The whole story: docs/streaming.md."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

import psycopg2
from psycopg2.extensions import AsIs, connection

from airflow_provider_lr.engine.counters import DeliveryCounters
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.autocommit import autocommit
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.errors import FencedError, LRError, StaleBatchError, TrimmedError, error_line, one_line
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session import stream_tables, stream_writes
from airflow_provider_lr.engine.session.durable_acks import DurableAcks
from airflow_provider_lr.engine.session.handshake import handshake
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.session.runner import record_error
from airflow_provider_lr.engine.session.settings import RateWindow, SessionSettings, StreamSettings
from airflow_provider_lr.engine.session.sink_writers import Answer, Outcomes, SinkWriters
from airflow_provider_lr.engine.session.stream_member import REASSIGNED, STOPPED, Member, Requests, StreamEnd
from airflow_provider_lr.engine.session.stream_read import StreamRead
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.source.backlog import session_backlogs
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogReader
from airflow_provider_lr.engine.source.routed_read import RoutedBatch
from airflow_provider_lr.engine.store.topology import recorded_id
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, SessionKey

log = logging.getLogger(__name__)

_DONE = object()  # what a step of the chores gives when they are done
Connect = Callable[[str], connection]


class _Handback(Exception):
    """Something changed that calls for negotiation: the session leaves the stream, keeps the lease."""


class SourceStream:
    """The streaming sessions of one source (see the module docstring), on a thread of its own.
    ``join``/``leave`` come from the ``Streamer``'s thread; every session that leaves is reported to
    ``ended``, once, and the thread ends (``finished``) when ``halt`` is set or the source fails."""

    def __init__(
        self,
        source: str,
        connect: Connect,
        settings: SessionSettings,
        stream_settings: StreamSettings,
        ended: Callable[[StreamEnd], None],
        counters: DeliveryCounters | None = None,
    ) -> None:
        self.source, self.connect = source, connect
        self.settings, self.opts, self.ended = settings, stream_settings, ended
        self.counters = counters if counters is not None else DeliveryCounters()
        self.members: dict[SessionKey, Member] = {}
        self._requests = Requests()
        self._leaving: set[SessionKey] = set()  # asked to leave by the Streamer (another replicator took them)
        self.sinks: SinkWriters[tuple[Member, LogBatch]] = SinkWriters(connect, source, self.opts.sink_deadline)
        self.durable = DurableAcks()
        self._committed = sys.maxsize  # the highest committed position, as the last routed read saw it
        self.src = connect(source)
        try:
            with self.src.cursor() as cur:  # acks and renewals: the sink's position is the truth
                cur.execute("SET synchronous_commit = off")
            self.src.commit()
            self.reads = StreamRead(connect, source, settings.max_bytes)  # last: it closes its own on failure
        except BaseException:
            self.sinks.close()
            self.src.close()
            raise
        self.thread: threading.Thread | None = None

    # --- the Streamer's side ------------------------------------------------------------------
    def start(self, halt: threading.Event) -> None:
        self.thread = threading.Thread(target=self.run, args=(halt,), daemon=True, name=f"lr-stream-{self.source}")
        self.thread.start()

    @property
    def finished(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def join(self, key: SessionKey, lease: leases.Lease) -> None:
        """Stream ``key`` under ``lease`` (its cycle's): the handshake runs on the stream's thread."""
        self._requests.put("join", key, lease)

    def leave(self, key: SessionKey) -> None:
        """Stop streaming ``key`` and give its lease up: it moved to another replicator."""
        self._leaving.add(key)  # a fence by its new holder before the request is seen is that move too
        self._requests.put("leave", key)

    # --- the stream's thread ------------------------------------------------------------------
    def run(self, halt: threading.Event) -> None:
        """Stream until ``halt`` or a failure of the source; every session leaves on the way out."""
        reason, error = STOPPED, ""
        try:
            self._loop(halt)
        except (psycopg2.Error, LRError) as exc:  # the source is lost: its sessions go back to the cycles
            reason, error = "failed", failure(exc)
        except Exception as exc:  # pragma: no cover - a bug: hand every session back all the same
            log.exception("stream of %s failed", self.source)
            reason, error = "failed", failure(exc)
        finally:
            self._admit(final=True)  # a join still queued (or held) is answered too
            self._outcomes(self.sinks.collect(None))  # the writes in flight end (cut at ``sink_deadline``)
            if reason == STOPPED:
                self.durable.flush(list(self.members.values()), self.sinks.conn, self.source)
            for member in list(self.members.values()):
                self._ack_quietly(member)
                if reason == STOPPED:  # the process stops: another replicator may take it at once
                    self._release_quietly(member)
                self._end(member, reason, error)
            self.close()

    def _loop(self, halt: threading.Event) -> None:
        opts = self.opts
        next_check = time.monotonic() + opts.check_interval
        last_ack = 0.0
        chores: Iterator[None] | None = None  # the check or the ack under way: a step per turn
        stalled_since: float | None = None  # a drawn position has not shown up since then
        pause = opts.poll_min
        rate = RateWindow()
        again = False  # the last round moved under a steady rate: read again without probing first
        while not halt.is_set():
            self._admit()
            if self.src.closed:  # a join's handshake found it cut while no session read: a new stream connects
                raise psycopg2.InterfaceError(f"the stream's connection to {self.source} was lost")
            self._outcomes(self.sinks.collect())  # writes left in flight by earlier rounds that ended
            if not self.members:
                self.sinks.retire(())
                self._requests.wake.wait(0.05)
                self._requests.wake.clear()
                continue
            now = time.monotonic()
            if chores is None and now >= next_check:
                chores, next_check = self._check(), now + opts.check_interval
            elif chores is None and now - last_ack >= opts.ack_interval:
                chores, last_ack = self._ack(), now
            if chores is not None and next(chores, _DONE) is _DONE:
                chores = None
            ready = self._ready()
            if not ready:  # every session's sink still writes (or the chores handed all back): wait
                self._outcomes(self.sinks.collect(opts.sleep_max))
                continue
            low = min(m.read_to for m in ready)
            probed = not again and stalled_since is None
            due = 0.0 if chores is not None else min(next_check, last_ack + opts.ack_interval) - now
            if probed and not self.reads.wait_for_commit(low, pause, max(0.0, min(due, opts.sleep_max))):
                if chores is None:  # a wait cut short for the chores' next step is no idle turn
                    pause = min(pause * 2, opts.poll_max)
                continue
            barrier = stalled_since is not None and now - stalled_since >= opts.gap_timeout
            started = time.monotonic()
            moved = self._round(barrier)
            again = False
            if moved:
                stalled_since, pause = None, opts.poll_min
                delivering = rate.add(moved)
                again = delivering >= opts.reread_rate
                load = delivering / opts.busy_rate
                if load >= 1:  # under load: a wait that grows with the round's time and the load's square
                    halt.wait(min(opts.linger, (time.monotonic() - started) * load * load))
                continue
            if stalled_since is None and self._committed <= low and (not probed or self.reads.drawn <= low):
                continue  # nothing committed since, nor drawn when it looked (woken by a stream): the next turn probes
            # drawn but not visible: a commit in flight (shows up in a moment), or one that rolled back
            # after drawing (never does): the barrier tells after ``gap_timeout``, and again after each
            stalled_since = now if stalled_since is None or barrier else stalled_since
            time.sleep(pause)
            pause = min(pause * 2, opts.poll_max)

    def _admit(self, final: bool = False) -> None:
        """Answer the Streamer's joins and leaves (a join to a sink still writing waits: ``Requests``);
        ``final``: all of them."""
        for what, key, lease in self._requests.take(lambda: self.sinks.busy, final):
            if what == "leave":
                self._leaving.discard(key)
                member = self.members.get(key)
                if member is not None:
                    if key.sink not in self.sinks.busy:  # a write in flight is not waited for (a silent
                        # sink: its deadline): the sink's position is the truth, fenced for the next holder
                        self.durable.flush([member], self.sinks.conn, self.source)
                    self._ack_quietly(member)
                    self._release_quietly(member)
                    self._end(member, REASSIGNED)
            elif lease is not None:
                self._join(key, lease)

    def _join(self, key: SessionKey, lease: leases.Lease) -> None:
        """The handshake, as the cycle's lease holder (the same owner: renewed, same epoch); the
        session streams from its ``Position`` unless it is not in log-entry sync."""
        try:
            sink = self.sinks.conn(key.sink)
            schema.require_current(sink, "streaming into it")  # its one-round-trip writes (V0021)
            hs = handshake(self.src, sink, key, lease.owner, self.settings.lease_seconds)
            why = hs.left_out(Decision.LOG_ENTRY_SYNC, "left to the cycles")
            if why is not None:
                raise _Handback(why)
            assert hs.lease is not None and hs.position is not None
            reader = LogReader(
                self.src, key.sink, STREAM_LOG_ENTRIES, self.settings.barrier_timeout, client_name=key.client
            )
            member = Member(key, hs.lease, hs.position, reader, table_snapshot.splits(sink, key), recorded_id(self.src))
        except Exception as exc:
            self._refused(key, exc)
            return
        member.read_to = member.after  # acked once the sink's flush passed its mark: whatever the sink's settings
        self.members[key] = member
        log.info("session %s streams from position %d", key, member.after)

    # --- reading and writing ------------------------------------------------------------------
    def _round(self, barrier: bool) -> int:
        """Read what is final after the lowest session and write each session's share; the entries
        delivered when the read moved (at least 1), else 0. ``barrier``: read behind the commit
        barrier instead (it waits for the commits in flight, so a position still missing after it
        was rolled back and is passed), per session."""
        members = self._ready()
        low = min(m.read_to for m in members)
        self._committed = sys.maxsize
        batch: RoutedBatch | None = None
        if not barrier:
            try:
                batch = self.reads.read(members)
            except TrimmedError as exc:  # the sessions behind the trim mark go to a snapshot sync
                for m in members:
                    if m.read_to < exc.trim_mark:
                        self._fail(m, exc)
                return 1
        if batch is None:
            return self._round_per_session(members, barrier)
        self._committed = batch.highest
        if batch.end <= low:
            return 0
        jobs: dict[str, list[tuple[Member, LogBatch]]] = {}
        for member, records in zip(members, batch.records):
            if records:
                jobs.setdefault(member.key.sink, []).append((member, LogBatch(member.after, batch.end, records)))
            else:
                member.read_to = max(member.read_to, batch.end)
        self._write(jobs)
        return max(batch.entries, 1)  # deliveries: a round's cost grows with the sink transactions it takes

    def _round_per_session(self, members: list[Member], barrier: bool) -> int:
        """Each session read on its own (``LogReader.read_stream``) and streamed into its sink: a
        transaction too large for the routed read, or a read behind the commit barrier."""
        moved = 0
        for member in members:
            settings, position = self.settings, member.position
            try:
                stream = member.reader.read_stream(
                    position.after,
                    settings.max_entries,
                    settings.max_bytes,
                    position.split,
                    final=not barrier,
                    tables=member.tables,
                )
                with stream:
                    if stream.end <= position.after:
                        continue
                    after = stream_writes.apply_one(self.sinks.conn(member.key.sink), self.source, member, stream)
                self._applied(member, stream.entries, stream.bytes, after)
                moved += max(stream.entries, 1)
            except Exception as exc:
                self._fail(member, exc)
                if self.src.closed:
                    raise
        return moved

    def _ready(self) -> list[Member]:  # the sessions a round reads for: no write in flight to their sink
        busy = self.sinks.busy
        return [m for m in self.members.values() if m.key.sink not in busy]

    def _write(self, jobs: dict[str, list[tuple[Member, LogBatch]]]) -> None:
        """Each sink's batches by its writer, the sinks at once (one slow past ``sink_patience`` left in flight)."""
        apply = functools.partial(stream_writes.apply_site, source=self.source)
        self._outcomes(self.sinks.write(jobs, apply, self._patience()))

    def _patience(self) -> float | None:
        """How long a round waits for a sink: with one sink site, for good (it holds no other)."""
        return None if len({m.key.sink for m in self.members.values()}) <= 1 else self.opts.sink_patience

    def _ask(self, site: str, question: Callable[[connection], Answer]) -> Answer:
        return self.sinks.ask(site, question, self._patience())  # the acks' and the check's questions

    def _outcomes(self, outcomes: Outcomes[tuple[Member, LogBatch]]) -> None:
        for (member, batch), outcome in outcomes:
            if isinstance(outcome, BaseException):
                self._fail(member, outcome)
            else:
                self._applied(member, batch.entries, batch.bytes, outcome)

    def _applied(self, member: Member, entries: int, nbytes: int, after: int) -> None:
        member.registered = member.registered or entries > 0
        member.delivered += entries
        self.counters.delivered(member.key, entries, nbytes)
        member.position = member.position.advanced(max(after, member.after))
        member.read_to = max(member.read_to, member.after)

    # --- looking around -----------------------------------------------------------------------
    def _check(self) -> Iterator[None]:
        """Move idle sessions' sinks on, count each session's backlog (one count for all: ``lr status``),
        renew every lease with it in one statement (a session taken over leaves), hand back each whose
        negotiation is due. A step (a round trip or three) per turn of ``_loop``, not the ~5 ms of all."""
        self._advance_idle()
        self.sinks.retire({m.key.sink for m in self.members.values()})
        yield
        members = list(self.members.values())
        with autocommit(self.src):  # one round trip each
            backlogs = {(b.sink, b.client): b for b in session_backlogs(self.src)}  # the longest step
        yield
        with autocommit(self.src):
            topology_id = recorded_id(self.src)
            requested = full_sync.sessions_requested(self.src)
            federated = registry.federated_tables_of(self.src, {m.key.client for m in members})
        yield
        members = [m for m in members if not m.ended]  # those that left meanwhile are not renewed
        renewals = []
        for member in members:
            values: dict[str, object] = {
                "lease_expires_at": leases.expiry(self.settings.lease_seconds),
                "last_success_at": AsIs("now()"),
            }
            backlog = backlogs.get((member.key.sink, member.key.client))
            if backlog is not None:
                values["remaining_entries"] = backlog.entries
                self.counters.lag(member.key, backlog.entries, backlog.lag_seconds)
            renewals.append((member.lease, values))
        lost = self._update_leases(renewals)
        yield
        busy = self.sinks.busy  # a sink still writing is asked at the next check
        ready = [m for m in members if not m.ended and m.key.sink not in busy]
        lacking = stream_tables.tables_lacking(ready, federated, self._ask, self.source)
        for member in members:
            key = member.key
            if member.ended:  # the renewal itself failed
                continue
            try:
                if member.lease in lost:
                    raise lost[member.lease]
                if topology_id != member.topology_id:
                    raise _Handback("the topology changed")
                if (key.sink, key.client) in requested:
                    raise _Handback("a full sync was requested")
                on_sink = lacking.get(key.sink, {})
                if isinstance(on_sink, Exception):
                    raise on_sink
                if key.client in on_sink:
                    raise _Handback(table_snapshot.why_needed(on_sink[key.client]))
            except Exception as exc:
                self._fail(member, exc)
                if self.src.closed:
                    raise

    def _advance_idle(self) -> None:
        """Move the sinks of the sessions the reads found nothing for to where they were read: their
        acknowledged positions follow, so trim is not held back by a session that gets nothing."""
        jobs: dict[str, list[tuple[Member, LogBatch]]] = {}
        for member in self._ready():
            if member.read_to > member.after:
                jobs.setdefault(member.key.sink, []).append((member, LogBatch(member.after, member.read_to)))
        if jobs:
            self._write(jobs)

    def _ack(self) -> Iterator[None]:
        """Record on the source, in one statement, each sink's position its WAL flush has passed
        (``durable_acks``; the record itself is asynchronously committed: the sink's position is the
        truth, a lost ack only delays trim). Two steps: the sinks asked, then the source told."""
        for key, exc in self.durable.observe_members(self._ready(), self._ask).items():
            if key in self.members:
                self._fail(self.members[key], exc)
        yield
        due = [m for m in self.members.values() if m.acked < m.durable]
        lost = self._update_leases([(m.lease, self._ack_values(m)) for m in due])
        for member in due:
            if member.lease in lost:
                self._fail(member, lost[member.lease])
            elif member.key in self.members:
                member.acked = member.durable

    def _update_leases(self, updates: list[tuple[leases.Lease, dict[str, object]]]) -> dict[leases.Lease, Exception]:
        """Set each session's values on the source while its lease holds (one statement); the
        sessions that could not be set, with why: taken over, or all of them when the statement
        failed (the source lost: raised, after they left)."""
        try:
            with autocommit(self.src):  # one round trip
                return dict(leases.update_sessions(self.src, updates))
        except (psycopg2.Error, LRError) as exc:
            for lease, _ in updates:
                member = self.members.get(SessionKey(self.source, lease.sink, lease.client))
                if member is not None:
                    self._fail(member, exc)
            if self.src.closed:
                raise
            return {}

    @staticmethod
    def _ack_values(member: Member) -> dict[str, object]:
        return {"acked_position": member.durable, "last_error": None, "last_success_at": AsIs("now()")}

    def _ack_quietly(self, member: Member) -> None:
        if member.acked >= member.durable or self.src.closed:
            return
        try:
            self.src.rollback()  # a statement that failed on the source left its transaction aborted
            lost = leases.update_sessions(self.src, [(member.lease, self._ack_values(member))])
            if not lost:  # else taken over as it left (moved to another member): its new holder acks
                member.acked = member.durable
        except (psycopg2.Error, LRError) as exc:  # the next holder records its own; trim waits meanwhile
            log.info("stream %s: last ack not recorded: %s", member.key, one_line(exc))

    def _release_quietly(self, member: Member) -> None:
        if not self.src.closed:
            leases.release_quietly(self.src, member.lease)

    # --- sessions leaving ---------------------------------------------------------------------
    def _fail(self, member: Member, exc: BaseException) -> None:
        """The session leaves the stream, handed back to the cycles, saying why."""
        if member.ended:
            return
        if isinstance(exc, FencedError) and member.key in self._leaving:  # taken by the member it moved to
            self._end(member, REASSIGNED)
            return
        self._left(member)
        self._refused(member.key, exc, member.delivered)

    def _refused(self, key: SessionKey, exc: BaseException, delivered: int = 0) -> None:
        """Report ``key`` handed back because of ``exc`` (its last error recorded when it is one)."""
        if isinstance(exc, _Handback):
            reason, error = one_line(exc), ""
        elif isinstance(exc, (FencedError, StaleBatchError, TrimmedError)):
            reason, error = error_line(exc), ""
        elif isinstance(exc, (psycopg2.Error, LRError)):  # a bound that fired, a lost site: retried by the cycles
            if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
                self.sinks.drop(key.sink, exc)
            reason, error = "failed", failure(exc)
        else:  # pragma: no cover - a bug: hand the session back all the same
            log.error("stream %s failed", key, exc_info=exc)
            reason, error = "failed", failure(exc)
        if error:
            self._record_quietly(key, error)
        self.ended(StreamEnd(str(key), reason, delivered, error, isinstance(exc, FencedError)))

    def _end(self, member: Member, reason: str, error: str = "") -> None:
        """The session leaves the stream with the stream (STOPPED, or failed with its source) or to
        another replicator (REASSIGNED)."""
        if member.ended:
            return
        self._left(member)
        if error:
            self._record_quietly(member.key, error)
        self.ended(StreamEnd(str(member.key), reason, member.delivered, error))

    def _left(self, member: Member) -> None:
        """``member`` is out of the stream."""
        member.ended = True
        self.members.pop(member.key, None)
        self.durable.forget(member.key.sink)

    def _record_quietly(self, key: SessionKey, error: str) -> None:
        """The failure in the session's ``last_error`` (``lr status``), when the source is reachable;
        the cycle that takes the session back records its own otherwise."""
        try:
            if not self.src.closed:
                self.src.rollback()
                record_error(self.src, key, f"stream: {error}")
        except (psycopg2.Error, LRError) as exc:
            log.info("stream %s: error not recorded: %s", key, one_line(exc))

    def close(self) -> None:
        self.sinks.close()
        self.reads.close()
        if not self.src.closed:
            self.src.close()
