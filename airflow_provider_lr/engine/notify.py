"""Waiting for PostgreSQL notifications on one channel, interruptibly.

A writer's transaction sends ``pg_notify(channel, payload)``; a process that waits for it holds a
LISTEN connection and sleeps in ``select`` on it. Two things make that usable from a loop that must
also stop, change its mind, or survive a lost server, and they live here once: an *interrupt*
(a pipe in the same ``select``, written from any thread) and *wanting* (the connection is open only
while someone wants it). Notifications sent while nothing listened are not seen, so after every
(re)open ``wait`` says so (``None``) and the caller makes a full pass instead of trusting them.

The sink's receive-queue tap (``sink/wakeup.Tap``) is one; the channel is the caller's.
"""

from __future__ import annotations

import logging
import os
import re
import select
import threading
from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import SiteUnreachableError, one_line

log = logging.getLogger(__name__)

# A channel is named bare in ``LISTEN <channel>`` (what pg_stat_activity shows operators), so only a
# name PostgreSQL takes unquoted and unchanged is accepted.
_CHANNEL = re.compile(r"[a-z_][a-z0-9_]*")


class NotifyChannel:
    """A LISTEN connection on ``channel``, used by one thread, interruptible from any other.

    ``wait`` returns the payloads notified, deduplicated (a burst of commits is one wake-up). It
    opens the connection while ``wanted`` and closes it when not; after every (re)open, and when the
    connection is lost, it returns ``None``: notifications sent meanwhile were not seen."""

    def __init__(self, connect: Callable[[], psycopg2.extensions.connection], channel: str) -> None:
        if not _CHANNEL.fullmatch(channel):
            raise ValueError(f"NOTIFY channel {channel!r}: use lower-case letters, digits and '_'")
        self._connect = connect
        self.channel = channel
        self._conn: psycopg2.extensions.connection | None = None
        self.wanted = True
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._pipe_lock = threading.Lock()  # an fd closed by close() must never be written (reuse)
        self._closed = False

    @property
    def listening(self) -> bool:
        return self._conn is not None

    def interrupt(self) -> None:
        """Wake a ``wait`` in progress (thread-safe, never blocks)."""
        with self._pipe_lock:
            if self._closed:
                return
            try:
                os.write(self._pipe_w, b"x")
            except OSError:
                pass  # a wake-up is already pending

    def wait(self, timeout: float) -> list[str] | None:
        """Payloads notified within ``timeout`` seconds; [] on timeout or interrupt; ``None`` when
        the connection was just (re)opened or lost."""
        if self.wanted and self._conn is None:
            try:
                conn = self._connect()
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f"LISTEN {self.channel}")
                self._conn = conn
            except (psycopg2.Error, SiteUnreachableError) as exc:  # a server that is down: retried
                log.warning("LISTEN %s connection failed (%s); polling until it is back", self.channel, one_line(exc))
                self._select([], min(timeout, 0.5))
            return None
        if not self.wanted and self._conn is not None:
            self._drop()
        ready = self._select([self._conn] if self._conn is not None else [], timeout)
        if ready is None:
            self._drop()
            return None
        if self._conn is None or self._conn not in ready:
            return []
        try:
            self._conn.poll()
        except psycopg2.Error:
            self._drop()
            return None
        seen = dict.fromkeys(note.payload for note in self._conn.notifies)
        self._conn.notifies.clear()
        return list(seen)

    def _select(self, conns: list[Any], timeout: float) -> list[Any] | None:
        """Wait for the connections or an interrupt; drains the interrupt. None if select failed."""
        try:
            ready, _, _ = select.select([self._pipe_r, *conns], [], [], max(timeout, 0.0))
        except (OSError, ValueError, psycopg2.Error):
            return None
        if self._pipe_r in ready:
            try:
                while os.read(self._pipe_r, 4096):
                    pass
            except OSError:
                pass
        return ready

    def _drop(self) -> None:
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.close()
            except psycopg2.Error:
                pass
        self._conn = None

    def close(self) -> None:
        """Close the connection and the interrupt pipe (call from the thread that waits, or after it)."""
        with self._pipe_lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._pipe_r, self._pipe_w):
                os.close(fd)
        self._drop()
