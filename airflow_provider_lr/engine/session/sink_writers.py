"""The sink side of a source's stream: one connection per sink site, and the sinks written at once.

A stream writes each session's share of a read in its own fenced sink transaction; the sessions of
one sink site go together on that site's connection (``Apply``: in one round trip where it can),
different sites in parallel on a pool of writer threads (one per site written to, made as needed).
A connection is used by one thread at a time: the stream's own between its writes (handshakes,
checks), that site's writer during one.

A round waits for the sites it writes at most ``patience``: a site still writing then stays *in
flight* (``busy``) while the stream goes on with the others, and what its write did is collected
when it ends (``collect``), so one slow or silent sink does not hold the source's other sinks
(native logical replication has a sender per subscriber). A use of a busy site's connection by
the stream waits for its write first; the stream's own questions to a site (``ask``: the acks' WAL
positions, the tables check) are asked by its writer with the same patience. A call to a site that
does not answer is cut at ``deadline_s`` (``StreamSettings.sink_deadline``): that site's sessions fail. Such a site (a call
cut, a connect that timed out) is not waited for again for ``deadline_s``: the stream's next use of
it (another of its sessions, the acks' flush positions, a join) fails at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Generic, TypeVar, cast

import psycopg2.extensions

from airflow_provider_lr.engine.db import reach
from airflow_provider_lr.engine.db.explained import raised_on
from airflow_provider_lr.engine.db.timeouts import cap
from airflow_provider_lr.engine.errors import SiteUnreachableError, one_line

Connect = Callable[[str], psycopg2.extensions.connection]
MAX_WRITERS = 64  # sink sites written to at once (threads made only as sites need them)
SILENT_FOR = 10.0  # a silent site is not waited for again this long, without a ``deadline_s``
IDLE_FOR = 5.0  # a site no session of the stream writes keeps its connection this long (``retire``)

Job = TypeVar("Job")  # one session's batch, whatever the stream makes of it
Answer = TypeVar("Answer")
# a site's jobs on its connection: what each returned (the sink's position) or raised, in order
Apply = Callable[[psycopg2.extensions.connection, Sequence[Job]], Sequence[int | Exception]]
Outcomes = list[tuple[Job, int | BaseException]]  # what each job's write returned or raised


class SinkBusy(Exception):
    """A site still writing, or not answering within the stream's patience: asked again later."""


class SinkWriters(Generic[Job]):
    """Connections to the sink sites of one source's stream and the threads that write them."""

    def __init__(self, connect: Connect, name: str, deadline_s: float | None = None) -> None:
        self.connect = connect
        self.deadline_s = deadline_s  # a call on a connection made here is cut past it (``timeouts.cap``)
        self._conns: dict[str, psycopg2.extensions.connection] = {}
        self._silent: dict[str, tuple[float, str]] = {}  # site -> since when it is taken as silent, why
        self.on_silent: Callable[[str, str], None] | None = None  # told of a site taken as silent, and why
        self._pool = ThreadPoolExecutor(MAX_WRITERS, thread_name_prefix=f"lr-sink-writer-{name}")
        self._flight: dict[str, Future[Outcomes[Job]]] = {}  # site -> its write the stream left running
        self._landed: Outcomes[Job] = []  # what writes waited for by ``conn`` did, for ``collect``
        self.idle_for = IDLE_FOR
        self._unused: dict[str, float] = {}  # site -> since when no session of the stream writes it

    @property
    def busy(self) -> set[str]:
        """The sites whose write is in flight (not yet collected)."""
        return set(self._flight)

    def conn(self, site: str) -> psycopg2.extensions.connection:
        """The connection to ``site`` (its write in flight waited for first: what it did is kept for
        ``collect``), made again when it was lost; ``SiteUnreachableError`` at once while ``site``
        is taken as silent."""
        self._landed += self.settle(site)
        return self._conn(site)

    def _conn(self, site: str) -> psycopg2.extensions.connection:
        silent = self._silent.get(site)
        if silent is not None:
            since, why = silent
            if time.monotonic() - since < (self.deadline_s or SILENT_FOR):
                raise SiteUnreachableError(
                    f"site {site!r} did not answer the stream {time.monotonic() - since:.0f} s ago ({why}); "
                    f"not waited for again within {self.deadline_s or SILENT_FOR:g} s"
                )
            del self._silent[site]
        conn = self._conns.get(site)
        if conn is None or conn.closed:
            try:
                conn = self._conns[site] = cap(self.connect(site), self.deadline_s)
            except SiteUnreachableError as exc:
                if reach.silent(one_line(exc), 0.0, None):  # waited out its connect timeout: silent
                    self._taken_silent(site, "a connect timed out")
                raise
        return conn

    def _taken_silent(self, site: str, why: str) -> None:
        self._silent[site] = (time.monotonic(), why)
        if self.on_silent is not None:  # the replicator's members give its sessions to one that reaches it
            self.on_silent(site, why)

    def drop(self, site: str, cause: BaseException | None = None) -> None:
        """Close ``site``'s connection (a lost server): the next use makes a new one. One whose call
        was cut at its deadline leaves ``site`` taken as silent (``conn``). ``cause``: the error
        that lost it; one raised on another connection (the source's: a lease renewal's lock
        timeout) leaves it as it is, its write in flight too."""
        on = raised_on(cause)
        if on is not None and on is not self._conns.get(site):
            return
        self._landed += self.settle(site)
        self._close(site)

    def retire(self, keep: Collection[str]) -> None:
        """Close the connection of each site not in ``keep`` (the sites the stream's sessions write)
        for ``idle_for`` (its sessions removed from the topology, moved, failed for good); one whose
        write is in flight at the first call after it lands (not waited for: a silent sink's is cut
        at its deadline), so a sink the stream no longer writes holds no backend. A session handed back (a full sync, a
        lease renewal refused) that joins again within it finds its connection."""
        now = time.monotonic()
        self._unused = {site: self._unused.get(site, now) for site in self._conns.keys() - set(keep)}
        for site, since in list(self._unused.items()):
            if now - since >= self.idle_for and site not in self._flight:
                self._close(site)

    def _close(self, site: str) -> None:
        self._unused.pop(site, None)
        conn = self._conns.pop(site, None)
        if conn is None:
            return
        if getattr(conn, "was_cut", False) and site not in self._silent:
            self._taken_silent(site, f"a call gave no answer within {conn.cut_after_s:g} s")
        if not conn.closed:
            conn.close()

    def write(
        self, jobs: Mapping[str, Sequence[Job]], apply: Apply[Job], patience: float | None = None
    ) -> Outcomes[Job]:
        """Run ``apply`` on each site's jobs on that site's connection, the sites at once; what each
        site's jobs returned or raised, site by site in the order given. ``patience`` None: every
        write waited for (the first site's on the calling thread: no hand-off on the way to a
        commit); else the writes not done within it stay in flight (``busy``, ``collect``). A site
        already in flight must not be given."""
        if not jobs:
            return []
        assert not self._flight.keys() & jobs.keys(), "a site written while its last write is in flight"
        if patience is None:
            (first, batch), *others = jobs.items()
            futures = [self._pool.submit(self._write_site, site, more, apply) for site, more in others]
            try:
                done = self._write_site(first, batch, apply)
            finally:  # every write is waited for, whatever happened here
                rest = [each for future in futures for each in future.result()]
            return done + rest
        flights = {site: self._pool.submit(self._write_site, site, more, apply) for site, more in jobs.items()}
        wait(flights.values(), patience)
        self._flight.update(flights)
        return self.collect()

    def collect(self, patience: float | None = 0.0) -> Outcomes[Job]:
        """What the writes in flight that ended did (and those ``conn`` waited for), their sites no
        longer busy; with none ended, waits for the first up to ``patience`` (None: for them all)."""
        if patience is None:
            wait(self._flight.values())
        elif patience > 0 and self._flight and not self._landed:
            wait(self._flight.values(), patience, return_when=FIRST_COMPLETED)
        out, self._landed = self._landed, []
        for site in [site for site, future in self._flight.items() if future.done()]:
            out += self._flight.pop(site).result()
        return out

    def settle(self, site: str) -> Outcomes[Job]:
        """Wait for ``site``'s write in flight, if any (bounded: its calls are cut at ``deadline_s``):
        what it did."""
        future = self._flight.pop(site, None)
        return [] if future is None else future.result()

    def ask(
        self, site: str, question: Callable[[psycopg2.extensions.connection], Answer], patience: float | None
    ) -> Answer:
        """``question(conn)`` on ``site``'s connection, its answer or what it raised. ``patience``
        None: asked on the calling thread; else by the site's writer, and ``SinkBusy`` when it is in
        flight or has not answered within ``patience`` (the site then stays busy until it does; the
        answer is dropped)."""
        if patience is None:
            return question(self.conn(site))
        if site in self._flight:
            raise SinkBusy(site)
        answer: list[tuple[bool, Any]] = []

        def asked() -> Outcomes[Job]:
            try:
                answer.append((True, question(self._conn(site))))
            except Exception as exc:
                answer.append((False, exc))
            return []

        future = self._pool.submit(asked)
        if not wait([future], patience).done:
            self._flight[site] = future
            raise SinkBusy(site)
        answered, value = answer[0]
        if not answered:
            raise value
        return cast(Answer, value)

    def _write_site(self, site: str, jobs: Sequence[Job], apply: Apply[Job]) -> Outcomes[Job]:
        try:
            done: Sequence[int | BaseException] = apply(self._conn(site), jobs)
        except Exception as exc:  # the site could not be reached: each of its sessions says so
            done = [exc] * len(jobs)
        return list(zip(jobs, done))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for site in list(self._conns):
            self.drop(site)
