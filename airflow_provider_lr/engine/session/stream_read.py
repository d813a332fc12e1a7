"""What a source's stream reads: the wait for a commit, and the routed read.

Every read goes through one autocommit connection to the source (``peek``), each one round trip.

* **The wait** (``wait_for_commit``): with nothing to read, the stream takes the source's wake-up
  key and reads the last drawn commit position after it (``lr.stream_may_sleep``, V0022); nothing
  new, it sleeps on the connection until a writer's commit NOTIFYs ``lr_commit`` (a writer does
  when it cannot take the key shared: only while a stream sleeps, so writers pay nothing while
  streams are busy). It cannot miss a commit: one that drew its position before the key was taken
  either still holds the key shared (the stream could not take it: it pauses and looks again) or
  shows in the position read after it; one drawn later notifies. The key is given back with the
  next statement.
* **The routed read** (``source/routed_read``, prepared once on the connection: planning it costs
  more than running it).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.session.stream_member import Member
from airflow_provider_lr.engine.source import routed_read
from airflow_provider_lr.engine.source.routed_read import ROUTED, RoutedBatch
from airflow_provider_lr.engine.vocabulary import COMMIT_CHANNEL, STREAM_WAKE_KEY


class StreamRead:
    """The reads of one source's stream (on the stream's thread only)."""

    def __init__(self, connect: Callable[[str], psycopg2.extensions.connection], source: str, max_bytes: int) -> None:
        self.source, self.max_bytes = source, max_bytes
        self._asleep = False  # the wake-up key is held: given back with the next statement
        self.peek = connect(source)
        try:
            self.peek.autocommit = True
            schema.require_current(self.peek, "streaming from it")
            ROUTED.prepare(self.peek)
            with self.peek.cursor() as cur:
                cur.execute(f"LISTEN {COMMIT_CHANNEL}")
        except BaseException:
            self.peek.close()
            raise

    def wait_for_commit(self, low: int, pause: float, longest: float) -> bool:
        """True when a commit position after ``low`` was drawn, or a commit woke the stream within
        ``longest`` seconds (read now); False after ``longest`` without one, or after ``pause``
        when the stream could not sleep (a writer is committing: its position shows in a moment)."""
        with self.peek.cursor() as cur:
            cur.execute(self._awake() + "SELECT asleep, latest FROM lr.stream_may_sleep()")
            self._asleep, latest = cur.fetchone()
        if latest > low:
            return True
        if not self._asleep:
            time.sleep(pause)
            return False
        self.peek.notifies.clear()
        woken = bool(select.select([self.peek], [], [], longest)[0])
        if woken:
            self.peek.poll()
            self.peek.notifies.clear()
        return woken

    def read(self, members: Sequence[Member]) -> RoutedBatch | None:
        """The routed read after where each of ``members`` was read to (``read_routed``: None for a
        transaction too large, ``TrimmedError``)."""
        readers = [m.routed() for m in members]
        return routed_read.read_routed(
            self.peek, readers, self.max_bytes, self.source, prepared=True, before=self._awake()
        )

    def _awake(self) -> str:
        """The statement that gives the wake-up key back, when it is held (for the next statement
        to send first, in the same round trip)."""
        if not self._asleep:
            return ""
        self._asleep = False
        return f"SELECT pg_catalog.pg_advisory_unlock({STREAM_WAKE_KEY}); "

    def close(self) -> None:
        if not self.peek.closed:
            self.peek.close()
