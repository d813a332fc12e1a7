"""The sink side of a source's stream: one connection per sink site, and the sinks written at once.

A stream writes each session's share of a read in its own fenced sink transaction; the sessions of
one sink site go together on that site's connection (``Apply``: in one round trip where it can),
different sites in parallel on a pool of writer threads (one per site written to, made as needed).
A connection is used by one thread at a time: the stream's own between rounds (handshakes,
checks), that site's writer during one. A round waits for every site it writes, so a call to a site
that does not answer is cut at ``deadline_s`` (``StreamSettings.sink_deadline``): that site's
sessions fail, the other sites go on with the next round. Such a site (a call cut, a connect that
timed out) is not waited for again for ``deadline_s``: the stream's next use of it (another of its
sessions in the round, the acks' flush positions, a join) fails at once instead of waiting once more
each, while the other sites' sessions wait for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import psycopg2.extensions

from airflow_provider_lr.engine.db import reach
from airflow_provider_lr.engine.db.timeouts import cap
from airflow_provider_lr.engine.errors import SiteUnreachableError, one_line

Connect = Callable[[str], psycopg2.extensions.connection]
MAX_WRITERS = 64  # sink sites written to at once (threads made only as sites need them)
SILENT_FOR = 10.0  # a silent site is not waited for again this long, without a ``deadline_s``

Job = TypeVar("Job")  # one session's batch, whatever the stream makes of it
# a site's jobs on its connection: what each returned (the sink's position) or raised, in order
Apply = Callable[[psycopg2.extensions.connection, Sequence[Job]], Sequence[int | Exception]]


class SinkWriters(Generic[Job]):
    """Connections to the sink sites of one source's stream and the threads that write them."""

    def __init__(self, connect: Connect, name: str, deadline_s: float | None = None) -> None:
        self.connect = connect
        self.deadline_s = deadline_s  # a call on a connection made here is cut past it (``timeouts.cap``)
        self._conns: dict[str, psycopg2.extensions.connection] = {}
        self._silent: dict[str, tuple[float, str]] = {}  # site -> since when it is taken as silent, why
        self._pool = ThreadPoolExecutor(MAX_WRITERS, thread_name_prefix=f"lr-sink-writer-{name}")

    def conn(self, site: str) -> psycopg2.extensions.connection:
        """The connection to ``site``, made again when it was lost; ``SiteUnreachableError`` at once
        while ``site`` is taken as silent."""
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
                    self._silent[site] = (time.monotonic(), "a connect timed out")
                raise
        return conn

    def drop(self, site: str) -> None:
        """Close ``site``'s connection (a lost server): the next use makes a new one. One whose call
        was cut at its deadline leaves ``site`` taken as silent (``conn``)."""
        conn = self._conns.pop(site, None)
        if conn is None:
            return
        if getattr(conn, "was_cut", False):
            self._silent.setdefault(site, (time.monotonic(), f"a call gave no answer within {conn.cut_after_s:g} s"))
        if not conn.closed:
            conn.close()

    def write(self, jobs: Mapping[str, Sequence[Job]], apply: Apply[Job]) -> list[tuple[Job, int | BaseException]]:
        """Run ``apply`` on each site's jobs on that site's connection, the sites at once (the first
        site on the calling thread: no hand-off on the way to a commit); what each site's jobs
        returned or raised, site by site in the order given."""
        if not jobs:
            return []
        (first, batch), *others = jobs.items()
        futures = [self._pool.submit(self._write_site, site, more, apply) for site, more in others]
        try:
            done = self._write_site(first, batch, apply)
        finally:  # every write is waited for, whatever happened here
            rest = [each for future in futures for each in future.result()]
        return done + rest

    def _write_site(self, site: str, jobs: Sequence[Job], apply: Apply[Job]) -> list[tuple[Job, int | BaseException]]:
        try:
            done: Sequence[int | BaseException] = apply(self.conn(site), jobs)
        except Exception as exc:  # the site could not be reached: each of its sessions says so
            done = [exc] * len(jobs)
        return list(zip(jobs, done))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for site in list(self._conns):
            self.drop(site)
