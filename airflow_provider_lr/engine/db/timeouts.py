"""What bounds a call on a connection lr opens: TCP keepalives, timeouts, and a deadline per call.

Without them a sink lock held by someone else, or a half-open link, stalls a replicator for good.
``conninfo`` is the one place that connects; it asks this module for the parameters of each
connection, by what the connection is for (``Purpose``):

* the network, on every connection: ``connect_timeout``; TCP keepalives (``keepalives_idle`` +
  ``keepalives_interval`` x ``keepalives_count``: an idle link that stopped answering fails in
  25 s by default) and ``tcp_user_timeout`` (data sent and never acknowledged fails in 30 s);
* the session, on lr's own connections: ``statement_timeout``, ``lock_timeout`` and
  ``idle_in_transaction_session_timeout`` (``-c`` options at connect: no round trip); bulk moves
  get their own, looser ones (``bulk_*``); a connection the application's statements run in (a
  subscriber's, whose listener writes in its transaction) gets none: those are the application's;
* a *deadline* per call on session connections (``Deadlines``): statement_timeout plus the time
  the keepalives need to call a link dead. A link that acknowledges every byte and answers none
  (a stalled proxy or load balancer, a stopped server process) fools TCP; past the deadline lr
  shuts the connection's socket itself, so the call fails like a lost connection. Work that runs
  long on a session connection (``lifting.lifted``) has no call deadline: a COPY in it is cut once no byte
  moved for the deadline it had (``Deadlines.stalled``), any call once a second connection finds
  the server unreachable or the call's backend idle (``Deadlines.heartbeat``, ``heartbeat.py``);
* the server's side: its TCP keepalives (as the client's) notice a client gone in a silent
  partition in seconds, not ~2 h; a backend whose call lr cut, alive behind a stalled link with
  its locks, is terminated on lr's next connection there (``orphans.py``).

Every setting is a topology setting (``settings:``, docs/topology.md); a DSN (or an Airflow
connection's extras) that sets a libpq parameter, or the same option in ``options``, wins over it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import copy_lost, orphans, reach
from airflow_provider_lr.engine.db.explained import explain, failure  # (imported from here by callers)
from airflow_provider_lr.engine.db.heartbeat import Beat, verdict

log = logging.getLogger(__name__)


class Purpose(str, Enum):
    """What a connection is for: which session settings it gets."""

    SESSION = "session"  # replication work (cycles, streams, the CLI, operators): every bound
    BULK = "bulk"  # long moves (Spark, the tee, snapshots, migrations): the bulk_* bounds, a heartbeat
    APPLICATION = (
        "application"  # statements of the application run in it (a subscriber's listener): network bounds only
    )


@dataclass(frozen=True)
class Timeouts:
    """Seconds (0: off). The topology setting of each field has the same name."""

    connect_timeout_s: float = 10  # a server that does not answer the connect
    keepalives_idle_s: int = 10  # an idle link is probed after this long ...
    keepalives_interval_s: int = 5  # ... every this long ...
    keepalives_count: int = 3  # ... and called dead after this many probes unanswered (10 + 5 x 3 = 25 s)
    tcp_user_timeout_s: float = 30  # data sent and not acknowledged this long: the link is dead
    statement_timeout_s: float = 120  # one statement of a session (reads and writes are batches: ms to s)
    lock_timeout_s: float = 5  # waiting for a lock another transaction holds (a sink row, a table)
    idle_in_transaction_timeout_s: float = 60  # a session's transaction left open (its client hung or cut off)
    bulk_statement_timeout_s: float = 0  # bulk COPY runs as long as the data takes
    bulk_lock_timeout_s: float = 60  # bulk writes wait longer for their locks

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Timeouts:
        """The topology's ``settings:`` (unknown keys ignored: they are other settings)."""
        names = {f.name: f.type for f in fields(cls)}
        given = {k: (int(v) if names[k] == "int" else float(v)) for k, v in settings.items() if k in names}
        return cls(**given)  # type: ignore[arg-type]  # each value converted to its field's type above

    @property
    def link_check_s(self) -> float:
        """How long the keepalives take to call an idle, silent link dead."""
        return self.keepalives_idle_s + self.keepalives_interval_s * self.keepalives_count

    def deadline_s(self, purpose: Purpose) -> float | None:
        """The longest a call on a connection of ``purpose`` may take before lr cuts it, or None."""
        if purpose is not Purpose.SESSION or not self.statement_timeout_s:
            return None
        return self.statement_timeout_s + self.link_check_s

    def session_options(self, purpose: Purpose) -> dict[str, float]:
        """The server settings (milliseconds) of a connection of ``purpose``."""
        if purpose is Purpose.APPLICATION:
            return {}
        bulk = purpose is Purpose.BULK
        return {
            "statement_timeout": self.bulk_statement_timeout_s if bulk else self.statement_timeout_s,
            "lock_timeout": self.bulk_lock_timeout_s if bulk else self.lock_timeout_s,
            # a bulk transaction may hold an exported snapshot open while other tasks copy
            "idle_in_transaction_session_timeout": 0 if bulk else self.idle_in_transaction_timeout_s,
        }

    def server_keepalives(self) -> dict[str, int]:
        """The server's TCP keepalives on lr's connections (seconds, a count), as the client's."""
        given = {
            "tcp_keepalives_idle": self.keepalives_idle_s,
            "tcp_keepalives_interval": self.keepalives_interval_s,
            "tcp_keepalives_count": self.keepalives_count,
        }
        return {name: value for name, value in given.items() if value}

    def libpq_params(self, purpose: Purpose, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` (a DSN's parameters) with these bounds added where it sets none."""
        params: dict[str, Any] = {
            "connect_timeout": max(2, round(self.connect_timeout_s)) if self.connect_timeout_s else 0,
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle_s,
            "keepalives_interval": self.keepalives_interval_s,
            "keepalives_count": self.keepalives_count,
        }
        if psycopg2.extensions.libpq_version() >= 120000:  # libpq 12 added it; an older one refuses the key
            params["tcp_user_timeout"] = round(self.tcp_user_timeout_s * 1000)
        params.update({k: v for k, v in given.items() if v is not None})
        if purpose is not Purpose.APPLICATION:  # every name and text lr reads, whatever the site's default
            # encoding or the DSN's (its client_encoding is the application's): on a LATIN1 connection a
            # column named ✓ could not be read, and psycopg2 composed é as Ã© (sql.Identifier), so every
            # change of a table with such a column was refused at that sink, for good
            params["client_encoding"] = "UTF8"
        ours = " ".join(f"-c {name}={round(seconds * 1000)}" for name, seconds in self.session_options(purpose).items())
        if purpose is not Purpose.APPLICATION:  # the server notices a vanished client as soon as lr would
            ours += "".join(f" -c {name}={value}" for name, value in self.server_keepalives().items())
            # names lr reads back from the catalog (a column's type, a definition) printed as every site
            # prints them: a site whose default quotes every identifier ("text") differs from the others
            ours += " -c quote_all_identifiers=off"
            # an xml value is parsed by the sink's xmloption (text and binary input alike): a site whose
            # default is DOCUMENT refused every content fragment ('text<b/>') a source took; CONTENT
            # takes both, as PostgreSQL's own default and pg_dump's restore do
            ours += " -c xmloption=content"
            # lr's SQL spells a backslash as itself ('\x00'::bytea): a site whose default is off (a legacy
            # application's) read it as an escape, and every sync of a source with federated tables
            # failed there, for good (invalid byte sequence 0x00); psycopg2 quotes by the connection's
            ours += " -c standard_conforming_strings=on"
        theirs = str(given.get("options") or "")
        options = f"{ours} {theirs}".strip()  # a later -c wins: the DSN's own options override ours
        if options:
            params["options"] = options
        return params


DEFAULT = Timeouts()

_STATEMENT_TIMEOUT_OPTION = re.compile(r"statement_timeout\s*=")


def deadline_for(timeouts: Timeouts, purpose: Purpose, given: Mapping[str, Any]) -> float | None:
    """The call deadline of a connection: none when its DSN sets its own statement timeout (lr
    cannot know how long the DSN's author lets a statement run)."""
    if _STATEMENT_TIMEOUT_OPTION.search(str(given.get("options") or "")):
        return None
    return timeouts.deadline_s(purpose)


class Clock:
    """When bytes last moved in a long COPY (``Deadlines.stalled``), None before the first: until
    then its source may work for long (a scan that finds its range late, a sort) with no byte to
    send, and only the heartbeat (is the backend at work?) watches the calls."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: float | None = None

    def moved(self) -> None:
        self.last = running()


TICK_S = 0.25  # the deadline thread looks this often; a tick PAUSED_S late: the process itself did
# not run (SIGSTOP, a suspended VM). Deadlines count only the time it ran (``running``): before, one
# continued cut every call in flight, blaming its servers for answers waiting in its sockets.
PAUSED_S, _paused = 1.0, 0.0  # (seconds the process did not run, as the deadline thread saw them)


def running() -> float:
    """The monotonic clock less the time this process did not run: what call deadlines count."""
    return time.monotonic() - _paused


class Deadlines:
    """One thread for the process: a call on a ``BoundedConnection`` that runs past its deadline
    gets its socket shut down, so libpq returns at once with the connection lost (a retryable
    ``OperationalError``) instead of waiting for an answer that a dead link will never bring."""

    def __init__(self) -> None:
        self._calls: dict[tuple[int, int], tuple[float, BoundedConnection]] = {}
        self._stalls: dict[tuple[int, int], tuple[Clock, float, BoundedConnection]] = {}
        self._beats: dict[tuple[int, int], Beat] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cut = 0  # connections cut, for tests and logs
        self.hurried: float | None = None  # the process is leaving: no call waits longer (``hurry``)

    def begin(self, conn: BoundedConnection) -> tuple[int, int] | None:
        seconds = conn.deadline_s
        if seconds is None:
            return None
        if self.hurried is not None:
            seconds = min(seconds, self.hurried)
        earlier = None if conn.was_cut else reach.known(conn.server)  # (a cut one fails as it is)
        if earlier is not None:  # its server made this command wait once already: the call fails at once
            self._cut(conn, 0, earlier)
            return None
        token = (id(conn), threading.get_ident())
        self._calls[token] = (running() + seconds, conn)
        if self._thread is None:
            self._start()
        return token

    def end(self, token: tuple[int, int] | None) -> None:
        if token is not None:
            self._calls.pop(token, None)

    def hurry(self, seconds: float | None) -> None:
        """The process is leaving (``lr sync`` stopped): every call watched by a deadline, in progress
        or later, ends within ``seconds`` (None: its own deadline again). A server that stopped
        answering then holds the stop that long per call left (a stream's wait, a lease released),
        not a call deadline (145 s) each; a healthy call takes ms. Lifted calls (a provider's
        supply) keep their heartbeat. A server that made it wait once is not waited for again
        (``reach.remember``): a stopped site holds the stop ``seconds`` once, not once per call."""
        self.hurried = seconds
        reach.remember(seconds is not None)
        if seconds is None:
            return
        until = running() + seconds
        for token, (due, conn) in list(self._calls.items()):
            if due > until:
                self._calls[token] = (until, conn)

    @contextmanager
    def stalled(self, conn: psycopg2.extensions.connection, clock: Clock) -> Iterator[None]:
        """A long call on a ``lifted`` or bulk connection (a table's COPY): no deadline while ``clock``
        moves, cut once it has not for the call deadline the connection had before it was lifted
        (before its first byte, the heartbeat alone watches it).
        A stopped sink or a stalled link would otherwise hold the COPY, and the cycle, for good."""
        seconds = getattr(conn, "stall_deadline_s", None)
        if seconds is None or not isinstance(conn, BoundedConnection):
            yield
            return
        token = (id(conn), threading.get_ident())
        self._stalls[token] = (clock, seconds, conn)
        if self._thread is None:
            self._start()
        try:
            yield
        finally:
            self._stalls.pop(token, None)

    def heartbeat(self, conn: BoundedConnection) -> tuple[int, int] | None:
        """Watch a call on a ``lifted`` connection (it may run for hours): each ``stall_deadline_s``,
        ``_probe`` asks its server on a second connection whether it still works on it."""
        seconds, reopen = conn.stall_deadline_s, conn.reopen
        if seconds is None or reopen is None:
            return None
        token = (id(conn), threading.get_ident())
        self._beats[token] = Beat(conn, conn.info.backend_pid, seconds, reopen, running() + seconds)
        if self._thread is None:
            self._start()
        return token

    def end_heartbeat(self, token: tuple[int, int] | None) -> None:
        if token is not None:
            self._beats.pop(token, None)

    def _probe(self, token: tuple[int, int], beat: Beat) -> None:
        """One heartbeat of a lifted call (``heartbeat.verdict``): cut it when the server is lost to it."""
        lost = verdict(beat, cap)
        if self._beats.get(token) is not beat:
            return  # the call ended meanwhile
        if not lost:
            beat.due, beat.probing = running() + (1.0 if beat.finished else beat.seconds), False
        elif self._beats.pop(token, None) is not None:
            self._cut(beat.conn, beat.seconds, lost)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="lr-call-deadlines")
                self._thread.start()

    def _run(self) -> None:
        global _paused
        while True:
            before = time.monotonic()
            time.sleep(TICK_S)
            lost = time.monotonic() - before - TICK_S
            if lost >= PAUSED_S:  # this process did not run meanwhile: its calls' time did not pass
                _paused += lost
                log.info("lr did not run for %.1f s (stopped?): its calls' deadlines are moved on by as much", lost)
            now = running()
            for token, (due, conn) in list(self._calls.items()):
                earlier = reach.known(conn.server)  # another call to its server was cut meanwhile
                if (now >= due or earlier is not None) and self._calls.get(token, (None,))[0] == due:
                    self._calls.pop(token, None)
                    bound, why = conn.deadline_s or 0, ""
                    if self.hurried is not None and self.hurried < bound:
                        bound, why = self.hurried, "lr stopping: no call waits longer"
                    self._cut(conn, bound, why) if earlier is None else self._cut(conn, 0, earlier)
            for token, (clock, seconds, conn) in list(self._stalls.items()):
                moved, earlier = clock.last, reach.known(conn.server)
                stalled = moved is not None and now - moved >= seconds
                if (stalled or earlier is not None) and self._stalls.pop(token, None) is not None:
                    self._cut(conn, seconds) if earlier is None else self._cut(conn, 0, earlier)
            for token, beat in list(self._beats.items()):
                earlier = reach.known(beat.conn.server)
                if earlier is not None and self._beats.pop(token, None) is not None:
                    self._cut(beat.conn, 0, earlier)
                elif now >= beat.due and not beat.probing:
                    beat.probing = True
                    threading.Thread(target=self._probe, args=(token, beat), daemon=True, name="lr-heartbeat").start()

    def _cut(self, conn: BoundedConnection, seconds: float, why: str = "") -> None:
        """Shut ``conn``'s socket: its call fails now. ``seconds`` 0: its server was found unreachable
        earlier in this command (``reach``; ``why`` says how), not waited for again. Nothing here
        takes the connection's lock before the shutdown (``conn.info``): its call holds it."""
        self.cut += 1
        if not conn.was_cut:  # the first cut says why (a later call on it only meets the closed link)
            conn.was_cut, conn.cut_after_s, conn.cut_earlier = True, seconds, why if not seconds else ""
        if not seconds:
            log.debug(
                "%s: not waited for: its server did not answer earlier in this command (%s)", conn.describe(), why
            )
        else:  # said before the cut: the caller's error follows it, never precedes it
            reach.lost(conn.server, f"a call gave no answer within {seconds:.0f} s")
            log.warning(
                "%s: a call ran past its deadline of %.0f s%s: the server or the link is taken as dead and the "
                "connection cut; the caller retries on a new one",
                conn.describe(),
                seconds,
                f" ({why})" if why else "",
            )
        orphans.record(conn)  # its backend, if it lives on behind a stalled link, is ended on the next connection
        conn.shut()


DEADLINES = Deadlines()


def _watched(conn: BoundedConnection, call: Any, *args: Any) -> Any:
    """``call(*args)``, a call to the server, under ``DEADLINES`` (a deadline, or on a lifted
    connection, a heartbeat)."""
    token = DEADLINES.begin(conn)
    beat = DEADLINES.heartbeat(conn) if token is None and conn.stall_deadline_s is not None else None
    try:
        return call(*args)
    except psycopg2.Error as exc:
        if conn.was_cut:  # ``explain`` says why, whatever call met the cut (a commit's error has no cursor)
            exc.lr_connection = conn
        raise
    finally:
        DEADLINES.end(token)
        DEADLINES.end_heartbeat(beat)


class BoundedCursor(psycopg2.extensions.cursor):
    """A cursor whose calls to the server are watched by ``DEADLINES``."""

    def execute(self, query: Any, vars: Any = None) -> Any:
        return _watched(self.connection, super().execute, query, vars)

    def executemany(self, query: Any, vars_list: Any) -> Any:
        return _watched(self.connection, super().executemany, query, vars_list)

    def copy_expert(self, sql: Any, file: Any, size: int = 8192) -> Any:
        return copy_lost.guarded(self.connection, _watched, self.connection, super().copy_expert, sql, file, size)

    def _fetch(self, method: Any, *args: Any) -> Any:
        if self.name is None:  # a client-side cursor: the rows are here already
            return method(*args)
        return _watched(self.connection, method, *args)  # a named cursor fetches from the server

    def fetchone(self) -> Any:
        return self._fetch(super().fetchone)

    def fetchmany(self, size: int | None = None) -> Any:
        return self._fetch(super().fetchmany) if size is None else self._fetch(super().fetchmany, size)

    def fetchall(self) -> Any:
        return self._fetch(super().fetchall)

    def __iter__(self) -> Any:
        """A named cursor's rows a round trip (``itersize``) at a time, each watched; a client-side
        cursor's as psycopg2 gives them (no per-row cost: ``__next__`` is not overridden)."""
        if self.name is None:
            return super().__iter__()
        return self._named_rows()

    def _named_rows(self) -> Iterator[Any]:
        while True:
            rows = self._fetch(super().fetchmany, self.itersize)
            if not rows:
                return
            yield from rows


class BoundedConnection(psycopg2.extensions.connection):
    """A connection of lr's whose calls have a deadline (``deadline_s``; None: unbounded)."""

    deadline_s: float | None = None
    stall_deadline_s: float | None = None  # while ``lifted``: its COPY cut once no byte moved this long
    reopen: Callable[[], psycopg2.extensions.connection] | None = None  # a second one, for heartbeats
    site: str | None = None
    site_path: str | None = None  # the site's search_path, its own being pg_catalog (``conninfo.catalog_first``)
    was_cut = False  # by ``DEADLINES``: its failure is a dead link, not the server's
    cut_after_s = 0.0  # the deadline that cut it
    cut_earlier = ""  # cut at once: how its server was found unreachable earlier in the command (``reach``)
    server: str | None = None  # ``reach.key`` of its parameters
    _where: str | None = None  # host:port, seen once open (``opened``)

    identity: tuple[str, str, str] | None = None  # (host, port, database) reached, seen once open
    backend_pid = 0  # its backend's pid, seen once open
    _socket = -1  # a duplicate of its socket's descriptor, lr's own until ``close`` (``shut``)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor_factory = BoundedCursor
        self._socket_lock = threading.Lock()

    def opened(self) -> None:
        """Note, on the thread that opened it, what other threads ask of this connection later (the
        deadline thread cutting a call, a heartbeat, messages once it is closed). They must not ask
        libpq: its connection may be freed under them by ``close`` on the owner's thread (a crash
        of the whole process), and libpq closes its socket when the link fails, so the descriptor's
        number may by then be another connection's. The duplicate stays this socket's until
        ``close``."""
        info = self.info
        self.identity, self.backend_pid = (str(info.host), str(info.port), str(info.dbname)), info.backend_pid
        self._where = f"{info.host}:{info.port}"
        self._socket = os.dup(self.fileno())

    def shut(self) -> None:
        """Shut this connection's socket down (from any thread): a call in progress fails at once
        with the connection lost. Nothing once ``close`` ran."""
        with self._socket_lock:
            if self._socket < 0:
                return
            try:
                with socket.socket(fileno=os.dup(self._socket)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # no longer connected
                pass

    def close(self) -> None:
        try:  # (a close waits for a call in progress on another thread: ``shut`` may still end it)
            super().close()
        finally:
            self._forget_socket()

    def __del__(self) -> None:  # a connection dropped unclosed: its duplicate goes with it
        self._forget_socket()

    def _forget_socket(self) -> None:
        if self._socket < 0:  # never opened (a failed connect has no lock either)
            return
        with self._socket_lock:
            if self._socket >= 0:
                os.close(self._socket)
                self._socket = -1

    def describe(self) -> str:
        where = self._where or "?"
        return f"connection to site {self.site!r} ({where})" if self.site else f"connection to {where}"

    def commit(self) -> None:
        _watched(self, super().commit)

    def rollback(self) -> None:
        """A connection lr cut has no transaction left to roll back (its server ends it with the
        backend, ``orphans``): nothing is sent, so the ``except: rollback(); raise`` of a caller
        raises the call's error, not "connection already closed" in its place."""
        if self.was_cut:
            return
        _watched(self, super().rollback)


def cap(conn: psycopg2.extensions.connection, seconds: float | None) -> psycopg2.extensions.connection:
    """``conn`` with its calls cut at ``seconds`` at the latest, whatever its own deadline (none when
    its DSN sets a statement timeout): for a caller that has somewhere else to go when a server
    does not answer. A connection lr did not bound (not a ``BoundedConnection``) is left as it is."""
    if seconds is not None and isinstance(conn, BoundedConnection):
        conn.deadline_s = seconds if conn.deadline_s is None else min(conn.deadline_s, seconds)
    return conn


__all__ = ["DEADLINES", "BoundedConnection", "Purpose", "Timeouts", "explain", "failure"]
