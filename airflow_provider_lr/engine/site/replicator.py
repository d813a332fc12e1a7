"""Replication cycles for every session of a topology, in one process (what `lr sync` runs), or,
as a member sharing them with other replicator processes (``session/membership``), for its share.

One connection per site is shared by the sessions touching it. A session that fails (a sink that is
down, a refused negotiation, a provider error) is reported and recorded in its ``last_error``;
the others go on, and the failed one is retried on the next cycle with fresh connections.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.db import reach
from airflow_provider_lr.engine.db.encoding import talking_utf8
from airflow_provider_lr.engine.db.explained import refused_kind
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    LRError,
    RepeatedErrors,
    SiteUnreachableError,
    one_line,
    still_failing,
    without_statement,
)
from airflow_provider_lr.engine.session import catchup, nearest_copy
from airflow_provider_lr.engine.session.lease import Lease, new_owner_id
from airflow_provider_lr.engine.session.membership import Membership
from airflow_provider_lr.engine.session.runner import CycleReport, SessionRunner, record_error, settled
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.session.unreached import Unreached
from airflow_provider_lr.engine.site.topology import runs_somewhere
from airflow_provider_lr.engine.source.backlog import log_entry_backlog, session_backlogs
from airflow_provider_lr.engine.source.full_sync import Provider, load_provider
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import Topology, reread
from airflow_provider_lr.engine.vocabulary import SessionKey

log = logging.getLogger(__name__)

Connect = Callable[[str], psycopg2.extensions.connection]


REST_AFTER = 5.0  # seconds a site's cycle connection may stay unused before ``rest`` closes it
# seconds one session's cycle may move a full sync's transfer (or log-entry batches) before the next
# session's turn: a full sync of millions no longer holds every other session's cycle (nor a stop)
CYCLE_SLICE = 5.0
FILE_RECHECK = 1.0  # seconds between looks at an edited topology file not applied yet (``_follow_file``)


def _stamp(path: str | None) -> int | None:
    """The file's modification time (None: no file, or it cannot be read now)."""
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None


class Replicator:
    def __init__(
        self,
        topology: Topology,
        connect: Connect,
        owner: str | None = None,
        settings: SessionSettings | None = None,
        providers: Mapping[str, Provider] | None = None,
        sessions: list[SessionKey] | None = None,
        log_failures: bool = True,
        membership: bool = False,
        follow_file: bool = False,
        stop: threading.Event | None = None,
        cycle_slice: float = CYCLE_SLICE,
    ) -> None:
        """``log_failures``: log each failed session (repeats suppressed); off when the caller
        reports every cycle itself (``lr sync`` prints them), or each failure is said twice.
        ``stop``: once set, a cycle of several sessions ends after the session in progress (each
        may supply a full sync: a stop waited for all of them), and a transfer in progress pauses
        after its chunk (the next run resumes it from the sink's metadata).
        ``cycle_slice``: seconds one session's cycle may transfer before it pauses for the others'.
        ``membership``: share the sessions with the other replicator processes that do
        (``session/membership``): this one works its share of them, ``sessions`` says which now.
        ``follow_file``: work the sessions of the topology file as it is now (``follow``), unless
        ``sessions`` were given."""
        self.topology = topology
        self.stop = stop or threading.Event()
        self.cycle_slice = cycle_slice
        self._turn_ends = 0.0  # when the session cycling now has had its slice (monotonic)
        self.failures = RepeatedErrors() if log_failures else None
        self.connect = connect = talking_utf8(connect)
        self.owner = owner or new_owner_id()
        self.settings = settings or SessionSettings.from_topology(topology)
        self.providers: dict[str, Provider] = dict(providers or {})
        for client, target in topology.providers.items():
            self.providers.setdefault(client, load_provider(target))
        self._given = sessions if sessions is not None else topology.sessions()
        self._follow = follow_file and sessions is None and bool(topology.path)
        self._file_stamp = _stamp(topology.path)
        self._file_recheck = 0.0  # an edit no site runs yet: read again then (monotonic)
        self._working = list(self._given)  # what ``sessions`` said last
        self._conns: dict[str, psycopg2.extensions.connection] = {}
        self._silent: dict[str, str] = {}  # sites that made this turn wait for nothing (``_conn``), and why
        self._used: dict[str, float] = {}  # site -> when a cycle last used its connection (monotonic)
        self._made: dict[str, float] = {}  # site -> when its connection was made (monotonic)
        self._runners: dict[SessionKey, SessionRunner] = {}
        self._forgotten: set[str] = set()  # sources of runners dropped holding a lease (``_drop``)
        self.teed: dict[str, int] = {}  # str(SessionKey) -> entries the tee delivered, all cycles
        self.stalled_for = 0.0  # seconds the last run had made no progress when it ended (measured)
        self._no_tee: set[str] = set()  # sources whose sites' DSNs do not resolve (no tee for them)
        self._tee_notes = RepeatedErrors()  # why the tee of a source is not used, said once
        self.membership: Membership | None = None
        self.unreached = Unreached(connect, shared=membership)  # the sites it is cut off from, said as a member
        if membership:
            self.membership = Membership(connect, self._given, self.owner, self.settings, self.unreached)
            self.membership.start()
            self._working = self.membership.assigned()

    @property
    def sessions(self) -> list[SessionKey]:
        """The sessions this process works now: every one it was given, or, as a member, its share
        (recomputed by the membership's heartbeats). A session that left the share has its lease
        released here, so that the member it went to takes it at once."""
        self._follow_file()
        if self.membership is None:
            return self._given
        share = self.membership.assigned()
        if share != self._working:
            for key in self._working:
                if key not in share:
                    self._hand_over(key)
            self._working = share
        return share

    def _follow_file(self) -> None:
        """A long-running replicator (``lr sync``) follows its topology file: an edit that adds or
        removes sessions (applied to the sites with ``lr topology apply``) is taken up at the next
        turn, without a restart (it was not: a new client's sessions waited for one, a removed
        one's failed again and again). One ``stat`` a turn: the file is read only when it changed,
        and followed once some site runs it (until the apply, the sites' topology goes on)."""
        if not self._follow:
            return
        stamp = _stamp(self.topology.path)
        if stamp == self._file_stamp or time.monotonic() < self._file_recheck:
            return
        found = reread(self.topology)  # the topology itself while the file cannot be read
        if found.topology_config_id != self.topology.topology_config_id:
            if not runs_somewhere(found, self.connect):  # edited, not applied yet: the sites run ours
                self._file_recheck = time.monotonic() + FILE_RECHECK
                return
            self.follow(found)
        self._file_stamp = stamp

    def follow(self, topology: Topology) -> None:
        """Work ``topology``'s sessions from now on: new ones are taken up by the next cycle, the
        leases of removed ones released (their streams leave: ``sessions`` no longer has them)."""
        before = set(self._given)
        self.topology = topology
        for client, target in topology.providers.items():
            if client not in self.providers:
                try:
                    self.providers[client] = load_provider(target)
                except Exception as exc:  # said; the client's sessions wait for its data, as without one
                    log.warning("client %s: provider %s cannot be loaded: %s", client, target, one_line(exc))
        self._given = topology.sessions()
        removed = before - set(self._given)
        for key in removed:
            self._let_go(key)
        if self.membership is not None:
            self.membership.follow(self._given)
        log.info(
            "topology %s changed (id %s): %d sessions, %d new, %d removed",
            topology.path,
            topology.topology_config_id,
            len(self._given),
            len(set(self._given) - before),
            len(removed),
        )

    def _hand_over(self, key: SessionKey) -> None:
        self._let_go(key)
        if key in self._given:
            log.info("session %s: another replicator member works it now", key)

    def _let_go(self, key: SessionKey) -> None:
        """Release this process's lease of ``key``, which it works no more: its runner's, or, with
        no runner (forgotten with its connection by ``rest`` or a lost site, the lease still held),
        at the source by owner. Before, such a lease stayed held until it expired, and the member
        the session went to waited ``lease_seconds`` for it."""
        runner = self._runners.pop(key, None)
        if runner is not None:
            runner.release()
            return
        if key.source in self._forgotten:  # else never leased here since its connection went
            self._release_owned(key.source, key)

    def _conn(self, site: str) -> psycopg2.extensions.connection:
        """The cycles' connection to ``site``. A site that made this turn wait for nothing (a connect
        timed out, a call cut at its deadline: a stopped server, a stalled link) fails at once for
        the rest of the turn: before, each of its sessions waited again (its connect timeout, or a
        call deadline of 145 s), one after the other, and every session cycling after them
        (a healthy one handed back by its stream for a full sync) waited for all of it."""
        self._used[site] = time.monotonic()
        cut = self.unreached.why(site)  # (as a member: its sessions go to one that reaches it)
        if cut is not None:
            self._drop(site)
            raise SiteUnreachableError(f"site {site!r} cannot be reached from here ({cut}); probed again every 5 s")
        if site in self._silent:
            raise SiteUnreachableError(
                f"site {site!r} did not answer earlier in this cycle ({self._silent[site]}); "
                "not waited for again before the next"
            )
        conn = self._conns.get(site)
        if conn is None or conn.closed:
            try:
                conn = self._conns[site] = self.connect(site)
            except SiteUnreachableError as exc:
                if reach.silent(str(exc), 0.0, None):  # waited on a silent server, not one refused at once
                    self._silent[site] = one_line(exc)
                    self.unreached.failed(site, self._silent[site])
                raise
            self._made[site] = time.monotonic()
        return conn

    def _runner(self, key: SessionKey) -> SessionRunner:
        runner = self._runners.get(key)
        if runner is None or runner.source.closed or runner.sink.closed:
            runner = self._runners[key] = SessionRunner(
                key,
                self._conn(key.source),
                self._conn(key.sink),
                self.owner,
                self.settings,
                self.providers.get(key.client),
                peers=nearest_copy.peers_in_region(self.topology, key, self.connect),
                topology=self.topology,
                pause=self._turn_over,
            )
        return runner

    def _turn_over(self) -> bool:
        """The session cycling now pauses its transfer: stopping, or its slice is spent."""
        return self.stop.is_set() or time.monotonic() >= self._turn_ends

    def run_cycle(self, keys: list[SessionKey] | None = None) -> list[CycleReport]:
        """One cycle of every session (or of ``keys``, the ones not streaming); never raises for one
        session's failure. A source whose log-entry backlog reaches ``settings.tee_min_backlog`` is
        first caught up by the tee. Once ``stop`` is set, the sessions not cycled yet are left out
        (the reports cover the sessions cycled, in order)."""
        keys = self.sessions if keys is None else keys
        self._silent.clear()  # a site that was silent last turn is tried again
        teed: dict[str, int] = {}
        for source in sorted({key.source for key in keys}):
            if self.stop.is_set():
                break
            self._turn_ends = time.monotonic() + self.cycle_slice  # a catch-up's turn, as a session's
            teed.update(self._catch_up(source, keys))
        for session, n in teed.items():
            self.teed[session] = self.teed.get(session, 0) + n
        reports = []
        for key in keys:
            if self.stop.is_set():
                break
            self._used[key.source] = self._used[key.sink] = time.monotonic()
            self._turn_ends = time.monotonic() + self.cycle_slice
            raised: Exception | None = None
            try:
                report = self._cycle(key)
            except Exception as exc:  # one session's failure must not stop the others
                report, raised = CycleReport(str(key), error=failure(exc), refused=refused_kind(exc) or ""), exc
            # a refusal is said as a raised failure is: a session refused run after run (a failover
            # while lr_streaming streamed, its file now stale) logged only "failed N time(s) in a row"
            times = self.failures.due(str(key), report.error) if self.failures and report.error else None
            if times:
                log.warning(
                    "session %s failed: %s", key, report.error if times == 1 else still_failing(times, report.error)
                )
            if raised is not None:
                self._recover(key, report.error, raised)
            if not report.error and self.failures:
                self.failures.cleared(str(key))
            report.delivered += teed.get(str(key), 0)
            reports.append(report)
        return reports

    def _cycle(self, key: SessionKey) -> CycleReport:
        """One cycle of ``key``. One that fails for the loss of a connection made before it (its
        server restarted since: a connection kept between cycles is found dead only when used) runs
        again at once on new ones; before, the session failed with the server back up, and was
        backed off once more for it. A server still down fails the second one at its connect."""
        began = time.monotonic()
        try:
            return self._runner(key).run_cycle()
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:  # (a lock timeout is one too)
            kept = [site for site in (key.source, key.sink) if self._made.get(site, began) < began and self._lost(site)]
            if not kept:
                raise
            log.info(
                "session %s: a connection kept from before was lost (%s); the cycle runs again", key, one_line(exc)
            )
            for site in kept:
                self._drop(site)
        return self._runner(key).run_cycle()

    def _lost(self, site: str) -> bool:
        """Whether the cycles' connection to ``site`` was lost (closed under it: not an error of a statement)."""
        conn = self._conns.get(site)
        return conn is None or bool(conn.closed)

    def lease_of(self, key: SessionKey) -> Lease | None:
        """The lease this replicator's last cycle of ``key`` holds, if any (a stream carries it on)."""
        runner = self._runners.get(key)
        return runner.lease if runner is not None else None

    def _catch_up(self, source: str, keys: list[SessionKey]) -> dict[str, int]:
        """Move a log-entry backlog of ``source`` that ``session/catchup`` sends to the tee (this process
        runs no Spark) with the read-once tee here (one source read for all its sinks, packed rows,
        exactly once: ``engine/bulk/fanout.py``); the session cycles then go on from where it left
        each sink. Returns deliveries per session (``str(SessionKey)``). Any failure leaves the work
        to the session cycles, which report their own errors. The tee pauses between its chunks at a
        stop or once its turn (``cycle_slice``) is spent: the sessions cycle, the next cycle tees on."""
        if source in self._no_tee or not catchup.backlog_matters(self.settings):
            return {}
        try:
            cap = catchup.backlog_cap(self.settings)  # no need to count a backlog of millions
            backlogs = session_backlogs(self._conn(source), at_most=cap)
            self._tee_notes.cleared(source)  # read: its next failure is said in full
            mine = [b for b in backlogs if SessionKey(source, b.sink, b.client) in keys]  # not the others'
            choice = catchup.choose(log_entry_backlog(mine), self.settings, counted_to=cap)
            if choice.path is not catchup.CatchupPath.TEE:
                return {}
            driver = fanout.FanoutDriver(
                self.topology, source, owner=self.owner, settings=self.settings, connect=self.connect, sessions=keys
            )
        except SiteUnreachableError as exc:  # a site that is down: the session cycles report it; retried
            self._tee_not_used(source, f"not used now: {one_line(exc)}")
            self._drop(source)
            return {}
        except ConfigurationError as exc:  # the sites' DSNs do not resolve here (the tee needs them)
            self._tee_not_used(source, f"not used: {one_line(exc)}")
            self._no_tee.add(source)
            return {}
        except psycopg2.Error as exc:  # a site that is down, or has no lr schema: the session cycles report it
            self._tee_not_used(source, f"not used: {without_statement(failure(exc))}")
            self._drop(source)
            return {}
        try:
            log.info("catching up %s by the in-process fan-out: %s", source, choice.why)
            result = fanout.run_fanout(driver, fanout.local_map, pause=self._turn_over)
        except Exception as exc:  # nothing half-done is visible; the session cycles carry on
            log.warning("in-process fan-out of %s failed (%s); session cycles carry on", source, one_line(exc))
            return {}
        finally:
            driver.close()
        for session, error in result.errors.items():
            log.warning("in-process fan-out of %s: %s stopped: %s", source, session, error)
        return result.deliveries

    def _tee_not_used(self, source: str, why: str) -> None:
        """Say why the tee is not used for ``source`` once, not every cycle it is tried again."""
        times = self._tee_notes.due(source, why)
        if times:
            log.info("in-process fan-out of %s %s", source, why if times == 1 else still_failing(times, why))

    def _recover(self, key: SessionKey, error: str, exc: Exception) -> None:
        for site in (key.source, key.sink):
            conn = self._conns.get(site)
            if conn is None:
                continue
            if getattr(conn, "was_cut", False):  # a call it never answered: not waited for again this turn
                self._silent.setdefault(site, one_line(error))
                self.unreached.failed(site, self._silent[site])
            if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)) or conn.closed:
                self._drop(site)
            else:
                try:
                    conn.rollback()
                except psycopg2.Error:
                    self._drop(site)
        try:
            record_error(self._conn(key.source), key, error, exc)
        except (psycopg2.Error, SiteUnreachableError):  # the source is down: nowhere to record it now
            self._drop(key.source)

    def forget(self, site: str) -> None:
        """Close the cycles' connection to ``site`` (a stream found the site failing): a call on it
        would wait its deadline if the site stopped answering; the next cycle connects anew."""
        self._drop(site)

    def _drop(self, site: str) -> None:
        conn = self._conns.pop(site, None)
        self._made.pop(site, None)
        if conn is not None and not conn.closed:
            conn.close()
        for key in [k for k in self._runners if site in (k.source, k.sink)]:
            if self._runners.pop(key).lease is not None:  # still held: released at ``close``
                self._forgotten.add(key.source)

    def _release_owned(self, source: str, key: SessionKey | None = None) -> None:
        """Release every lease this replicator still holds at ``source`` (or only ``key``'s): a runner
        forgotten with its connection (``rest``, a lost site) left its lease, and a session a stream
        handed back keeps its lease for a cycle that may not come before the stop. Left, they stayed
        leased to a process gone, for ``lease_seconds``. A source that cannot be reached keeps them
        till then."""
        try:
            conn = self._conn(source)
            with conn.cursor() as cur:
                source_sessions.release_owned(cur, self.owner, None if key is None else (key.sink, key.client))
            conn.commit()
        except (psycopg2.Error, LRError) as exc:
            self._drop(source)
            what = f"lease of {key}" if key is not None else f"leases of {self.owner} at {source}"
            log.info("%s not released (%s): expiring on its own", what, one_line(exc))

    def run(
        self,
        max_cycles: int | None = None,
        until_idle: bool = False,
        interval: float = 1.0,
        stop: threading.Event | None = None,
        on_cycle: Callable[[list[CycleReport]], None] | None = None,
        give_up_after: float | None = None,
    ) -> list[CycleReport]:
        """Cycles until ``max_cycles``, until a cycle moves nothing and nothing is pending
        (``until_idle``), or until ``stop`` is set; returns the last cycle's reports. With
        ``until_idle``, ``give_up_after`` seconds without any progress while some session is
        still unsettled (failing, waiting for client data, leased elsewhere) also end the run:
        ``unsettled(reports)`` says why, and ``stalled_for`` how long it had made no progress
        (measured: the run may also have ended by ``max_cycles`` or ``stop``)."""
        stop = stop or self.stop
        cycles, reports = 0, []
        last_progress = time.monotonic()
        self.stalled_for = 0.0
        while not stop.is_set() and (max_cycles is None or cycles < max_cycles):
            reports = self.run_cycle()
            cycles += 1
            if on_cycle:
                on_cycle(reports)
            busy = any(not r.idle for r in reports)
            if busy:
                last_progress = time.monotonic()
            if until_idle and not busy and all(settled(r) for r in reports):
                break
            self.stalled_for = time.monotonic() - last_progress
            if until_idle and give_up_after is not None and self.stalled_for > give_up_after:
                break
            if not busy:
                stop.wait(interval)
        return reports

    def rest(self, idle_for: float = REST_AFTER) -> None:
        """Close the connections no cycle used for ``idle_for`` seconds: while every session of a
        site streams, the streams' own connections serve it (a replicator holds O(sites)); the next
        cycle that needs the site connects again. Leases are not touched (the streams hold them)."""
        now = time.monotonic()
        for site in [s for s in self._conns if now - self._used.get(s, now) > idle_for]:
            self._drop(site)

    def close(self) -> None:
        """Release the leases, close the connections and, as a member, leave (the others take over
        at their next heartbeat)."""
        self.unreached.close()
        if self.membership is not None:
            self.membership.quiet()  # no heartbeat begun while the leases go
        for runner in self._runners.values():
            runner.release()
        for source in sorted(self._forgotten):
            self._release_owned(source)
        for site in list(self._conns):
            self._drop(site)
        if self.membership is not None:
            self.membership.leave()


def run_until_idle(replicator: Replicator, max_cycles: int = 50, interval: float = 0.05) -> list[CycleReport]:
    return replicator.run(max_cycles=max_cycles, until_idle=True, interval=interval)
