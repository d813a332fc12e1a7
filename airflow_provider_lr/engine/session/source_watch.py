"""The newest commit position drawn on a source, watched for the streams of its sessions
(``session/stream.py``): one cheap probe per source, run only while some stream waits."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import LRError, SiteUnreachableError, one_line
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL

log = logging.getLogger(__name__)


class SourceWatch:
    """The newest commit position drawn on one source, for the streams of its sessions.

    One probe (``SELECT last_value`` of the commit-position sequence: no lock, no table) serves every
    session of the source, and it runs only while some stream waits: a busy stream reads again at
    once and needs no wake-up. A position drawn may still be committing; the stream's read tells.
    A source that is down is probed again every 0.5 s; what cannot heal (a refused connection, a
    bug) stops the watch with ``error``, which ``wait_beyond`` raises to every stream waiting on it."""

    def __init__(
        self, connect: Callable[[], psycopg2.extensions.connection], settings: StreamSettings, source: str = ""
    ) -> None:
        self._connect, self.settings, self.source = connect, settings, source
        self.error: BaseException | None = None
        self.failed_at = 0.0  # monotonic time of ``error``
        self.latest = 0
        self._cond = threading.Condition()
        self._waiting = 0
        self._stop = threading.Event()
        self._conn: psycopg2.extensions.connection | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="lr-source-watch")
        self._thread.start()

    def wait_beyond(self, position: int, timeout: float) -> bool:
        """Block until a position above ``position`` is drawn (True) or ``timeout`` passes."""
        with self._cond:
            if self.latest > position:
                return True
            self._waiting += 1
            self._cond.notify_all()  # wakes the probe loop if it sleeps for want of waiters
            try:
                moved = self._cond.wait_for(lambda: self.latest > position or self._stop.is_set(), timeout)
            finally:
                self._waiting -= 1
        if self.error is not None:
            raise LRError(f"the commit-position watch of source {self.source!r} stopped: {one_line(self.error)}")
        return moved

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _probe(self) -> int:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
            self._conn.autocommit = True
        with self._conn.cursor() as cur:
            cur.execute(LAST_DRAWN_POSITION_SQL)
            return cur.fetchone()[0]

    def _run(self) -> None:
        pause = self.settings.poll_min
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._waiting > 0 or self._stop.is_set())
            try:
                value = self._probe()
            except (psycopg2.OperationalError, psycopg2.InterfaceError, SiteUnreachableError) as exc:
                log.debug("commit-position probe of %s failed: %s", self.source, one_line(exc))  # retried slowly:
                self._close()  # the streams find out for themselves
                self._stop.wait(0.5)
                continue
            except Exception as exc:  # cannot heal: the streams waiting on this watch hand back with it
                log.error("commit-position watch of %s stopped: %s", self.source, one_line(exc))
                self.error, self.failed_at = exc, time.monotonic()
                self._stop.set()
                with self._cond:
                    self._cond.notify_all()
                self._close()
                return
            if value != self.latest:
                with self._cond:
                    self.latest = value
                    self._cond.notify_all()
                pause = self.settings.poll_min
            else:
                pause = min(pause * 2, self.settings.poll_max)
            self._stop.wait(pause)

    def _close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._close()
